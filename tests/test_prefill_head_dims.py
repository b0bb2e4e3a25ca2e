"""Prefill with head_dim_qk != head_dim_vo (q, K of 192, V, o of 128: DeepSeek's non-absorbed
prefill) on the real Triton kernel in interpret mode, against jaxinfer.reference and float64."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from helpers import TOL, assert_lse_close, np64_attention, page_table, randn, rel_err
from jaxinfer import dispatch
from jaxinfer import reference as ref

QK, VO = 192, 128


def _indptr(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


@pytest.mark.parametrize("hq, hkv, causal", [(8, 2, True), pytest.param(4, 4, False, marks=pytest.mark.slow)])
def test_ragged_192_128_matches_reference(rng, hq, hkv, causal):
    # qo 50 > kv 20 (causal rows that see no key), kv 1, a split request (fixed_split_tokens)
    qo, kv = np.array([17, 1, 50, 33]), np.array([54, 1, 20, 300])
    qo_indptr, kv_indptr = _indptr(qo), _indptr(kv)
    q = randn(rng, (qo_indptr[-1], hq, QK), jnp.float32)
    k, v = randn(rng, (kv_indptr[-1], hkv, QK), jnp.float32), randn(rng, (kv_indptr[-1], hkv, VO), jnp.float32)
    pre = ji.BatchPrefillWithRaggedKVCache(hq, hkv, QK, head_dim_vo=VO, causal=causal, num_ctas=8,
                                           fixed_split_tokens=128)
    plan = pre.plan(qo_indptr, kv_indptr)
    assert plan.impl == "prefill_triton" and plan.info["num_split_tiles"] > 0
    o, lse = pre.run(q, k, v, plan, return_lse=True)
    assert o.shape == (qo_indptr[-1], hq, VO)
    want = ref.ragged_attention(q, k, v, qo_indptr, kv_indptr, causal=causal)
    assert rel_err(o, want.o) < 2e-5
    assert_lse_close(lse, want.lse)
    q, k, v, o, lse = (np.asarray(x) for x in (q, k, v, o, lse))  # host slices below: no device op compiles
    for b in (0, 2, 3):  # float64, default sm_scale 1 / sqrt(192)
        q_b, k_b, v_b = q[qo_indptr[b]:qo_indptr[b + 1]], k[kv_indptr[b]:kv_indptr[b + 1]], v[kv_indptr[b]:kv_indptr[b + 1]]
        o64, lse64 = np64_attention(q_b, k_b, v_b, causal=causal)
        assert rel_err(o[qo_indptr[b]:qo_indptr[b + 1]], o64) < 2e-5
        assert_lse_close(lse[qo_indptr[b]:qo_indptr[b + 1]], lse64)


# Under slow: 192 / 128 runs by default on ragged K/V (Triton) and on the Mosaic kernel below.
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_paged_192_128_bf16_fixed_shapes_matches_reference(rng, layout):
    """Capacities: one structure for every plan; short steps (decode rows) stay on prefill tiles
    (the decode kernel's short path takes equal head dims only)."""
    hq, hkv, page = 8, 2, 16
    pre = ji.BatchPrefillWithPagedKVCache(hq, hkv, QK, page, head_dim_vo=VO, causal=True, layout=layout,
                                          max_batch_size=4, max_num_tokens=96, max_num_pages=40, num_ctas=8)
    run = jax.jit(lambda q, cache, plan: pre.run(q, cache, plan, return_lse=True))
    for qo, kv in ((np.array([40, 3, 1]), np.array([200, 3, 64])), (np.array([1, 1]), np.array([17, 90]))):
        indptr, indices, last, num_pages = page_table(rng, kv, page, extra_pages=40 - int(np.sum(-(-kv // page))))
        shape = (num_pages, page, hkv) if layout == "NHD" else (num_pages, hkv, page)
        cache = ji.PagedKVCache(randn(rng, shape + (QK,), jnp.bfloat16), randn(rng, shape + (VO,), jnp.bfloat16),
                                layout)
        qo_indptr = _indptr(qo)
        q = randn(rng, (96, hq, QK), jnp.bfloat16)
        plan = pre.plan(qo_indptr, indptr, indices, last, num_pages=num_pages)
        assert plan.impl == "prefill_triton"
        o, lse = run(q, cache, plan)
        n = qo_indptr[-1]
        want = ref.paged_attention(q[:n], cache, qo_indptr, indptr, indices, last, causal=True)
        assert o.shape == (96, hq, VO) and o.dtype == jnp.bfloat16
        assert rel_err(o[:n], want.o) < TOL[jnp.bfloat16]
        assert_lse_close(lse[:n], want.lse, 1e-2)
        np.testing.assert_array_equal(np.asarray(o[n:], np.float32), 0.0)
    assert run._cache_size() == 1  # both steps: one program


MOSAIC_QO, MOSAIC_KV = np.array([70, 1, 50]), np.array([130, 1, 20])


# The Mosaic GPU interpreter takes seconds a call: the default suite runs the kernel at 192 / 128 on
# ragged K/V, the paged form under slow (its page-table reads at 192 / 128 are those of equal head
# dims: paged Mosaic prefill runs by default in test_poison.test_paged_prefill[prefill_mosaic] and
# test_fused_layout.test_mosaic_prefill_matches_reference).
def test_mosaic_192_128_matches_reference(rng):
    """The Mosaic GPU kernel (its interpreter) with V / o of 128 beside q / K of 192, ragged K/V:
    causal rows that see no key, a request of one token; bf16."""
    hq, hkv = 2, 1
    qo, kv = MOSAIC_QO, MOSAIC_KV
    qo_indptr, kv_indptr = _indptr(qo), _indptr(kv)
    q = randn(rng, (qo_indptr[-1], hq, QK), jnp.bfloat16)
    k, v = randn(rng, (kv_indptr[-1], hkv, QK), jnp.bfloat16), randn(rng, (kv_indptr[-1], hkv, VO), jnp.bfloat16)
    pre = ji.BatchPrefillWithRaggedKVCache(hq, hkv, QK, head_dim_vo=VO, causal=True, impl="mosaic")
    plan = pre.plan(qo_indptr, kv_indptr)
    assert plan.impl == "prefill_mosaic"
    o, lse = pre.run(q, k, v, plan, return_lse=True)
    want = ref.ragged_attention(q, k, v, qo_indptr, kv_indptr, causal=True)
    assert o.shape == (qo_indptr[-1], hq, VO) and rel_err(o, want.o) < TOL[jnp.bfloat16]
    assert_lse_close(lse, want.lse, 1e-2)


@pytest.mark.slow
def test_mosaic_192_128_paged_matches_reference(rng):
    """The same on pages of 64 (the kernel's paged K and V of 192 and 128)."""
    hq, hkv, page = 2, 1, 64
    qo, kv = MOSAIC_QO, MOSAIC_KV
    qo_indptr = _indptr(qo)
    q = randn(rng, (qo_indptr[-1], hq, QK), jnp.bfloat16)
    indptr, indices, last, num_pages = page_table(rng, kv, page, extra_pages=2)
    cache = ji.PagedKVCache(randn(rng, (num_pages, page, hkv, QK), jnp.bfloat16),
                            randn(rng, (num_pages, page, hkv, VO), jnp.bfloat16))
    paged = ji.BatchPrefillWithPagedKVCache(hq, hkv, QK, page, head_dim_vo=VO, causal=True, impl="mosaic")
    plan = paged.plan(qo_indptr, indptr, indices, last, num_pages=num_pages)
    o = paged.run(q, cache, plan)
    want = ref.paged_attention(q, cache, qo_indptr, indptr, indices, last, causal=True)
    assert plan.impl == "prefill_mosaic" and rel_err(o, want.o) < TOL[jnp.bfloat16]


def test_dispatch_routes_distinct_head_dims():
    problem = dispatch.Problem("prefill", 16, 16, QK, "paged", 16, head_dim_vo=VO, interpret=False)
    reasons = {row.name: row.unsupported(problem, True) for row, _ in dispatch.implementations(problem)}
    assert "prefill kernels" in reasons["prefill_short"]
    assert reasons["prefill_triton"] is None and reasons["prefill_mosaic"] is None
    odd_vo = dispatch.Problem("prefill", 16, 16, QK, "ragged", head_dim_vo=96, interpret=False)
    assert "head_dim_vo" in dispatch._mosaic_unsupported(odd_vo, True)
    odd = dispatch.Problem("prefill", 16, 16, QK, "ragged", head_dim_vo=96, interpret=False)
    assert dispatch._triton_unsupported(odd, False) is None  # V and o of 96 in tiles of 128
    rope = dispatch.Problem("prefill", 16, 16, QK, "ragged", variant=ji.variants.rope(), head_dim_vo=VO,
                            interpret=False)  # q / K of 192 run in column blocks: no whole rows to rotate
    assert "rope" in dispatch._triton_unsupported(rope, False)
    with pytest.raises(ValueError, match="head_dim_vo"):  # explicit Mosaic, even in interpret mode
        ji.BatchPrefillWithRaggedKVCache(4, 4, QK, head_dim_vo=96, impl="mosaic")
    assert ji.BatchPrefillWithRaggedKVCache(4, 4, QK, head_dim_vo=96, backend="gpu").head_dim_vo == 96


def test_bad_shapes_and_plans_across_head_dims(rng):
    qo_indptr, kv_indptr = _indptr([3]), _indptr([5])
    pre = ji.BatchPrefillWithRaggedKVCache(4, 4, QK, head_dim_vo=VO)
    q, k = randn(rng, (3, 4, QK), jnp.float32), randn(rng, (5, 4, QK), jnp.float32)
    plan = pre.plan(qo_indptr, kv_indptr)
    with pytest.raises(ValueError, match="v must be"):
        pre.run(q, k, randn(rng, (5, 4, QK), jnp.float32), plan)
    with pytest.raises(ValueError, match="head_dim_vo"):
        ji.BatchPrefillWithRaggedKVCache(4, 4, QK, head_dim_vo=0)
    same = ji.BatchPrefillWithRaggedKVCache(4, 4, QK)
    with pytest.raises(ValueError, match="head_dim_vo"):  # a plan is bound to its wrapper's head dims
        same.run(q, k, randn(rng, (5, 4, QK), jnp.float32), plan)
    with pytest.raises(ValueError, match="v_pages"):
        ji.PagedKVCache(jnp.zeros((2, 4, 1, QK)), jnp.zeros((2, 8, 1, VO)))
    cache = ji.PagedKVCache(jnp.ones((2, 4, 4, QK)), jnp.ones((2, 4, 4, VO)))
    assert cache.head_dim == QK and cache.head_dim_vo == VO and "head_dim_vo=128" in repr(cache)
    paged = ji.BatchPrefillWithPagedKVCache(4, 4, QK, 4)  # equal head dims: rejects the cache
    table = (_indptr([1]), np.array([0], np.int32), np.array([3], np.int32))
    with pytest.raises(ValueError, match="head_dim_vo"):
        paged.run(q, cache, paged.plan(qo_indptr, *table, num_pages=2))
    dec = ji.BatchDecodeWithPagedKVCache(4, 4, QK, 4)
    with pytest.raises(ValueError, match="head_dim_vo"):
        dec.run(q[:1], cache, dec.plan(*table, num_pages=2))


def test_gpu_kernel_lowers_for_cuda():
    """q / K of 192 read as 128 + 64 column blocks, V / o of 128: the compiled kernels lower for CUDA."""
    from test_backend import TRITON_CALL, lower_for_cuda
    qo_indptr, kv_indptr = _indptr([100, 7]), _indptr([100, 300])
    pre = ji.BatchPrefillWithRaggedKVCache(16, 16, QK, head_dim_vo=VO, backend="gpu")
    plan = pre.plan(qo_indptr, kv_indptr)
    args = (jnp.ones((107, 16, QK), jnp.bfloat16), jnp.ones((400, 16, QK), jnp.bfloat16),
            jnp.ones((400, 16, VO), jnp.bfloat16), plan)
    assert TRITON_CALL in lower_for_cuda(pre.run, *args)
    from test_backend import MOSAIC_CALL  # ... and on the Mosaic GPU kernel, V / o staged apart from q
    for config in (None, ji.MosaicPrefillConfig(block_kv=64, pipeline="overlap")):
        pre = ji.BatchPrefillWithRaggedKVCache(16, 16, QK, head_dim_vo=VO, backend="gpu", impl="mosaic", config=config)
        assert MOSAIC_CALL in lower_for_cuda(pre.run, *args[:3], pre.plan(qo_indptr, kv_indptr))
