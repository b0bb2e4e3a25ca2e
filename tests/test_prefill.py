"""Batch prefill (paged, ragged), block-sparse attention and custom masks, in interpret mode,
against jaxinfer.reference and float64 NumPy."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from helpers import TOL, assert_lse_close, np64_attention, page_table, randn, random_cache, rel_err
from jaxinfer import reference as ref
from planner import work_items

KV_LENS, QO_LENS = (1, 54, 97, 512), (1, 17, 37, 127)


def _lens(batch, i):
    kv = np.array([KV_LENS[(i + j) % 4] for j in range(batch)])
    qo = np.array([QO_LENS[(i + 2 * j) % 4] for j in range(batch)])
    return qo, kv


def _indptr(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _check_paged(rng, qo, kv, page, hq, hkv, d, causal, dtype=jnp.float32, layout="NHD", **kw):
    indptr, indices, last, num_pages = page_table(rng, kv, page)
    cache = random_cache(rng, num_pages, page, hkv, d, dtype, layout)
    qo_indptr = _indptr(qo)
    q = randn(rng, (qo_indptr[-1], hq, d), dtype)
    pre = ji.BatchPrefillWithPagedKVCache(hq, hkv, d, page, causal=causal, layout=layout,
                                          num_ctas=kw.pop("num_ctas", 8), **kw)
    plan = pre.plan(qo_indptr, indptr, indices, last, num_pages=num_pages)
    o, lse = pre.run(q, cache, plan, return_lse=True)
    want = ref.paged_attention(q, cache, qo_indptr, indptr, indices, last, causal=causal)
    assert rel_err(o, want.o) < TOL[dtype]
    assert_lse_close(lse, want.lse, 1e-4 if dtype == jnp.float32 else 1e-2)
    return plan


SAMPLE = [  # (batch, page, (Hq, Hkv), head_dim, causal)
    (5, 16, (32, 4), 64, True), (5, 5, (4, 4), 128, False), (1, 1, (4, 4), 64, True), (17, 16, (4, 4), 64, False)]


@pytest.mark.parametrize("i, case", [  # cases 1 and 3 (head_dim 128, non-causal, odd pages) take the
    # branches of the default tests (test_boundary's rows, test_short_path): under slow
    (i, c) if i in (0, 2) else pytest.param(i, c, marks=pytest.mark.slow) for i, c in enumerate(SAMPLE)])
def test_paged_prefill_sample(rng, i, case):
    batch, page, (hq, hkv), d, causal = case
    qo, kv = _lens(batch, i)
    _check_paged(rng, qo, kv, page, hq, hkv, d, causal)


FULL = list(itertools.product((1, 5, 17), (1, 5, 16), ((4, 4), (32, 4)), (64, 128), (True, False)))


@pytest.mark.slow
@pytest.mark.parametrize("i, case", list(enumerate(FULL)))
def test_paged_prefill_full_grid(rng, i, case):
    batch, page, (hq, hkv), d, causal = case
    qo, kv = _lens(batch, i)
    _check_paged(rng, qo, kv, page, hq, hkv, d, causal)


@pytest.mark.slow  # bf16 HND split tiles: the branches of test_boundary's HND rows and test_prefill_head_dims
def test_paged_prefill_bf16_hnd_split_kv(rng):
    plan = _check_paged(rng, np.array([40, 3, 64]), np.array([300, 0, 64]), 16, 8, 2, 64, True,
                        jnp.bfloat16, "HND", fixed_split_tokens=64)
    assert plan.info["num_split_tiles"] > 0


def test_split_kv_with_an_empty_chunk_and_fully_masked_rows(rng):
    # causal with qo_len > kv_len: the first rows see no key; a split leaves some chunks empty.
    _check_paged(rng, np.array([50, 9]), np.array([20, 200]), 4, 4, 1, 64, True, fixed_split_tokens=16)


# Non-causal under slow: test_boundary.test_ragged_kv_prefill_boundaries (its group-8 row) runs the
# ragged wrapper non-causal by default, at every tile edge.
@pytest.mark.slow  # by default: test_boundary.test_ragged_kv_prefill_boundaries (every tile edge), test_safety
@pytest.mark.parametrize("causal", [True, False])
def test_ragged_prefill(rng, causal):
    qo, kv = np.array([17, 1, 37, 127]), np.array([54, 97, 1, 512])
    qo_indptr, kv_indptr = _indptr(qo), _indptr(kv)
    q = randn(rng, (qo_indptr[-1], 8, 64), jnp.float32)
    k, v = randn(rng, (kv_indptr[-1], 2, 64), jnp.float32), randn(rng, (kv_indptr[-1], 2, 64), jnp.float32)
    pre = ji.BatchPrefillWithRaggedKVCache(8, 2, 64, causal=causal, num_ctas=8)
    o, lse = pre.run(q, k, v, pre.plan(qo_indptr, kv_indptr), return_lse=True)
    want = ref.ragged_attention(q, k, v, qo_indptr, kv_indptr, causal=causal)
    assert rel_err(o, want.o) < 2e-5
    assert_lse_close(lse, want.lse)
    for b in (0, 3):
        o64, _ = np64_attention(q[qo_indptr[b]:qo_indptr[b + 1]], k[kv_indptr[b]:kv_indptr[b + 1]],
                                v[kv_indptr[b]:kv_indptr[b + 1]], causal=causal)
        assert rel_err(o[qo_indptr[b]:qo_indptr[b + 1]], o64) < 2e-5


def test_custom_mask_tril_is_causal_and_packed_form(rng):
    qo, kv = np.array([5, 12, 3]), np.array([9, 12, 40])
    qo_indptr, kv_indptr = _indptr(qo), _indptr(kv)
    q = randn(rng, (qo_indptr[-1], 4, 64), jnp.float32)
    k, v = randn(rng, (kv_indptr[-1], 2, 64), jnp.float32), randn(rng, (kv_indptr[-1], 2, 64), jnp.float32)
    tril = np.concatenate([np.tril(np.ones((a, b), bool), k=b - a).reshape(-1) for a, b in zip(qo, kv)])
    causal = ji.BatchPrefillWithRaggedKVCache(4, 2, 64, causal=True, num_ctas=4)
    masked = ji.BatchPrefillWithRaggedKVCache(4, 2, 64, causal=False, num_ctas=4)
    want = causal.run(q, k, v, causal.plan(qo_indptr, kv_indptr))
    # The three masked plans have one structure (a mask is data): one program runs them all.
    run = jax.jit(lambda q, k, v, plan: masked.run(q, k, v, plan, return_lse=True))
    got = run(q, k, v, masked.plan(qo_indptr, kv_indptr, custom_mask=tril)).o
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    rand = rng.random(tril.size) < 0.3
    plain = run(q, k, v, masked.plan(qo_indptr, kv_indptr, custom_mask=rand))
    packed = run(q, k, v, masked.plan(qo_indptr, kv_indptr, packed_custom_mask=np.packbits(rand, bitorder="little")))
    np.testing.assert_array_equal(packed.o, plain.o)
    r = ref.ragged_attention(q, k, v, qo_indptr, kv_indptr, custom_mask=rand)
    assert rel_err(plain.o, r.o) < 2e-5
    assert run._cache_size() == 1
    assert_lse_close(plain.lse, r.lse)  # rows whose mask is all False: o = 0, lse = -inf


# Default: R 1 and 16, C 4 and 1, masked and not (one row and one column per block, several of
# each); (4, 16, masked) and (4, 4, unmasked) under slow.
@pytest.mark.parametrize("r, c, masked", [(1, 4, False), pytest.param(4, 16, True, marks=pytest.mark.slow), (16, 1, True),
                                          pytest.param(4, 4, False, marks=pytest.mark.slow)])
def test_block_sparse_any_block_size(rng, r, c, masked):
    m, n, hq, hkv, d = 64, 128, 4, 2, 64
    rows, cols = m // r, n // c
    dense_blocks = rng.random((rows, cols)) < 0.25
    indptr = _indptr(dense_blocks.sum(1))
    indices = np.nonzero(dense_blocks)[1].astype(np.int32)
    block_mask = rng.random((indices.size, r, c)) < 0.7 if masked else None
    bsr = ji.BlockSparseMatrix(indptr, indices, (r, c), (m, n), block_mask)
    q, k, v = randn(rng, (m, hq, d), jnp.float32), randn(rng, (n, hkv, d), jnp.float32), randn(rng, (n, hkv, d), jnp.float32)
    bsa = ji.BlockSparseAttention(hq, hkv, d, num_ctas=8)
    o, lse = bsa.run(q, k, v, bsa.plan(bsr), return_lse=True)
    o64, lse64 = np64_attention(q, k, v, mask=bsr.to_dense_mask())
    assert rel_err(o, o64) < 2e-5
    assert_lse_close(lse, lse64)


def test_speculative_verification_tokens(rng):
    """2-8 query tokens per request in a decode step go through the prefill path."""
    _check_paged(rng, np.array([2, 5, 8, 3]), np.array([70, 33, 120, 9]), 16, 32, 8, 128, True, jnp.bfloat16)


def test_capacity_plans_compile_once(rng):
    page, hq, hkv, d = 4, 8, 2, 64
    num_pages = 120
    cache = random_cache(rng, num_pages, page, hkv, d, jnp.float32)
    pre = ji.BatchPrefillWithPagedKVCache(hq, hkv, d, page, max_batch_size=4, max_num_tokens=64,
                                          max_num_pages=100, num_ctas=4, tile_rows=32)
    run = jax.jit(pre.run)
    for step in range(12):
        batch = int(rng.integers(1, 5))
        qo = rng.integers(1, 16, batch)
        kv = qo + rng.integers(0, 60, batch)
        npages = -(-kv // page)
        indptr = _indptr(npages)
        indices = rng.permutation(num_pages)[: indptr[-1]].astype(np.int32)
        last = (kv - (npages - 1) * page).astype(np.int32)
        qo_indptr = _indptr(qo)
        plan = pre.plan(qo_indptr, indptr, indices, last, num_pages=num_pages)
        q = randn(rng, (64, hq, d), jnp.float32)
        o = run(q, cache, plan)
        if step % 4 == 0:
            want = ref.paged_attention(q[:qo_indptr[-1]], cache, qo_indptr, indptr, indices, last, causal=True)
            assert rel_err(o[:qo_indptr[-1]], want.o) < 2e-5
            assert np.all(np.asarray(o[qo_indptr[-1]:]) == 0)
    assert run._cache_size() == 1


def test_prefill_rejects_bad_input(rng):
    indptr, indices, last, num_pages = page_table(rng, np.array([9, 3]), 4)
    pre = ji.BatchPrefillWithPagedKVCache(8, 2, 64, 4, num_ctas=4)
    with pytest.raises(ValueError, match="qo_indptr must start at 0"):
        pre.plan(np.array([1, 2, 3], np.int32), indptr, indices, last, num_pages=num_pages)
    with pytest.raises(ValueError, match="qo_indptr describes 1 requests"):
        pre.plan(np.array([0, 2], np.int32), indptr, indices, last, num_pages=num_pages)
    with pytest.raises(ValueError, match="page ids outside"):
        pre.plan(np.array([0, 2, 3], np.int32), indptr, indices + 100, last, num_pages=num_pages)
    with pytest.raises(ValueError, match="custom_mask"):
        pre.plan(np.array([0, 2, 3], np.int32), indptr, indices, last, num_pages=num_pages, custom_mask=np.ones(5, bool))
    plan = pre.plan(np.array([0, 2, 3], np.int32), indptr, indices, last, num_pages=num_pages)
    with pytest.raises(ValueError, match="q must have shape"):
        pre.run(randn(rng, (4, 8, 64), jnp.float32), random_cache(rng, num_pages, 4, 2, 64, jnp.float32), plan)
    with pytest.raises(ValueError, match="tile_rows"):
        ji.BatchPrefillWithRaggedKVCache(8, 2, 64, tile_rows=48)
    with pytest.raises(ValueError, match="bsr"):
        ji.BlockSparseAttention(8, 2, 64).plan(indptr)
    with pytest.raises(ValueError, match="plan"):
        x = randn(rng, (8, 8, 64), jnp.float32)
        ji.BlockSparseAttention(8, 8, 64).run(x, x, x, plan)


MOSAIC_CASES = [  # (qo_lens, kv_lens, page, hq, hkv, causal): unaligned request starts, a partial
    ([5, 70], [20, 90], 8, 2, 1, True),  # first tile, qo > kv rows with no visible key
    ([3, 130], [1, 200], 16, 2, 2, False),
    ([129, 64, 1], [40, 64, 300], 32, 4, 2, True),
    ([200], [333], 16, 1, 1, False),  # one request, several KV blocks (pipeline tests)
]


# The Mosaic kernel's schedules (MosaicPrefillConfig): FA3's intra-warpgroup overlap, three
# free-running compute warpgroups, halving row maxima; 64-key blocks put several unmasked and
# masked blocks in each tile. All under slow (suite time): by default the auto-impl test runs the
# kernel paged (head_dim 64's three-warpgroup default) and the variant test ragged.
MOSAIC_PIPELINES = [dict(pipeline="overlap", block_kv=64), dict(pipeline="overlap", block_kv=64, max_concurrent_steps=3),
                    dict(pipeline="free", compute_wgs=3, tree_max=True), dict(pipeline="pingpong", tree_max=True, block_kv=64)]


@pytest.mark.parametrize("config, case, kind", [
    pytest.param(None, i, kind, marks=pytest.mark.slow) for i in (0, 1, 2) for kind in ("paged", "ragged")] + [
    pytest.param(MOSAIC_PIPELINES[c], i, kind, marks=pytest.mark.slow)
    for c, i, kind in ((0, 0, "ragged"), (0, 3, "ragged"), (1, 2, "paged"), (2, 1, "paged"), (3, 0, "ragged"))])
def test_mosaic_prefill_matches_reference(rng, config, case, kind):
    """impl="mosaic" (the Mosaic GPU kernel, in its interpreter) with the default or a given
    MosaicPrefillConfig, bf16, against the reference."""
    qo, kv, page, hq, hkv, causal = MOSAIC_CASES[case]
    qo, kv, d = np.array(qo), np.array(kv), 64
    indptr, indices, last, num_pages = page_table(rng, kv, page)
    cache = random_cache(rng, num_pages, page, hkv, d, jnp.bfloat16, "NHD")
    qo_indptr = _indptr(qo)
    q = randn(rng, (qo_indptr[-1], hq, d), jnp.bfloat16)
    want = ref.paged_attention(q, cache, qo_indptr, indptr, indices, last, causal=causal)
    cfg = None if config is None else ji.MosaicPrefillConfig(**config)
    if kind == "paged":
        pre = ji.BatchPrefillWithPagedKVCache(hq, hkv, d, page, causal=causal, impl="mosaic", config=cfg)
        o, lse = pre.run(q, cache, pre.plan(qo_indptr, indptr, indices, last, num_pages=num_pages), return_lse=True)
    else:  # unaligned key rows: the kv_first prefix is loaded and masked
        k, v, kv_indptr = ref.gather_pages(cache, indptr, indices, last)
        pre = ji.BatchPrefillWithRaggedKVCache(hq, hkv, d, causal=causal, impl="mosaic", config=cfg)
        o, lse = pre.run(q, k, v, pre.plan(qo_indptr, kv_indptr), return_lse=True)
    assert rel_err(o, want.o) < TOL[jnp.bfloat16]
    assert_lse_close(lse, want.lse, 1e-2)


def test_mosaic_kernel_one_item_per_cell(rng):
    """The Mosaic kernel's host-plan form (persistent=False: a cell runs its one item, if any, in
    straight-line code; the wrappers' interpreter runs merge cells and take the loop): one whole
    causal tile in cell 0, cell 1 empty, against the reference."""
    from pallas_kernels import prefill_mosaic
    qo, kv, h, d = 128, 200, 1, 64
    q = randn(rng, (qo, h, d), jnp.bfloat16)
    k, v = randn(rng, (kv, h, d), jnp.bfloat16), randn(rng, (kv, h, d), jnp.bfloat16)
    pre = ji.BatchPrefillWithRaggedKVCache(h, h, d, causal=True, impl="mosaic", config=ji.MosaicPrefillConfig())
    plan = pre.plan(_indptr([qo]), _indptr([kv]))
    items = np.asarray(plan.sections()["items"])[:1]  # [1, PREFILL.width]
    o, lse_items, _ = prefill_mosaic.prefill_mosaic(
        q, k.reshape(-1, d), v.reshape(-1, d), None, jnp.asarray(items, jnp.int32),
        jnp.array([0, 1, 1], jnp.int32), 8, page_size=1, num_kv_heads=h, layout="NHD",
        sm_scale=pre.sm_scale, causal=True, interpret=True, persistent=False,
        columns=work_items.PREFILL)
    want = ref.ragged_attention(q, k, v, _indptr([qo]), _indptr([kv]), causal=True)
    assert rel_err(o, want.o) < TOL[jnp.bfloat16]
    assert_lse_close(lse_items[:, :qo].T, want.lse, 1e-2)


MOSAIC_VARIANTS = {  # name: (variant, parameter overrides)
    "cap_alibi_window": (lambda V: V.compose(V.soft_cap(), V.alibi(), V.sliding_window()),
                         dict(logits_soft_cap=30.0, window_left=33)),
    "window": (lambda V: V.sliding_window(), dict(window_left=13)),
    "sigmoid": (lambda V: V.sigmoid(), dict(sigmoid_bias=-2.0)),
    "cap_sinks": (lambda V: V.compose(V.soft_cap(), V.sinks()), dict(logits_soft_cap=1.0, sinks=[0.5, -1.0])),
}


@pytest.mark.parametrize("name, kind", [("cap_alibi_window", "ragged")] + [
    pytest.param(n, k, marks=pytest.mark.slow) for n in MOSAIC_VARIANTS for k in ("paged", "ragged")
    if (n, k) != ("cap_alibi_window", "ragged")])
def test_mosaic_prefill_variants_match_reference(rng, name, kind):
    """impl="mosaic" with variants traced in (its interpreter), bf16, against the reference
    applying the same functions; a window of 33 on 300 keys skips whole KV blocks."""
    from jaxinfer import variants as V
    make, overrides = MOSAIC_VARIANTS[name]
    var = make(V)
    qo, kv, page, hq, hkv, d = np.array([70, 5]), np.array([300, 40]), 16, 2, 1, 64
    params = V.default_params(var, hq, **{k: jnp.asarray(v) for k, v in overrides.items()})
    indptr, indices, last, num_pages = page_table(rng, kv, page)
    cache = random_cache(rng, num_pages, page, hkv, d, jnp.bfloat16, "NHD")
    qo_indptr = _indptr(qo)
    q = randn(rng, (qo_indptr[-1], hq, d), jnp.bfloat16)
    want = ref.paged_attention(q, cache, qo_indptr, indptr, indices, last, causal=True,
                               variant=var, params=params)
    if kind == "paged":
        pre = ji.BatchPrefillWithPagedKVCache(hq, hkv, d, page, impl="mosaic", variant=var)
        o = pre.run(q, cache, pre.plan(qo_indptr, indptr, indices, last, num_pages=num_pages), variant_params=params)
    else:
        k, v, kv_indptr = ref.gather_pages(cache, indptr, indices, last)
        pre = ji.BatchPrefillWithRaggedKVCache(hq, hkv, d, impl="mosaic", variant=var)
        o = pre.run(q, k, v, pre.plan(qo_indptr, kv_indptr), variant_params=params)
    assert not np.isnan(np.asarray(o, np.float32)).any()
    assert rel_err(o, want.o) < TOL[jnp.bfloat16]


def test_mosaic_prefill_rejects_what_it_does_not_support(rng):
    qo_indptr, kv_indptr = _indptr([4]), _indptr([8])
    q, k = randn(rng, (4, 2, 64), jnp.float32), randn(rng, (8, 2, 64), jnp.float32)
    pre = ji.BatchPrefillWithRaggedKVCache(2, 2, 64, impl="mosaic")
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        pre.run(q, k, k, pre.plan(qo_indptr, kv_indptr))
    qb, kb = q.astype(jnp.bfloat16), k.astype(jnp.bfloat16)
    with pytest.raises(ValueError, match="custom mask"):
        pre.run(qb, kb, kb, pre.plan(qo_indptr, kv_indptr, custom_mask=np.ones(32, bool)))
    from jaxinfer import variants as V
    with pytest.raises(ValueError, match="query / key transforms"):
        ji.BatchPrefillWithRaggedKVCache(2, 2, 64, impl="mosaic", variant=V.rope())
    with pytest.raises(ValueError, match="head_dim"):
        ji.BatchPrefillWithRaggedKVCache(2, 2, 32, impl="mosaic")


def test_auto_impl_plans_for_mosaic_and_falls_back_to_triton(rng, monkeypatch):
    """impl="auto" where the Mosaic GPU kernel can run (faked here): bf16 plans for it (the
    Mosaic kernel's own tests run it), fp8 K/V runs the Triton plan kept beside it (as would
    float32), and a plan with a custom mask is a Triton plan."""
    from jaxinfer import _backend, dispatch
    monkeypatch.setattr(_backend, "mosaic_available", lambda interpret: True)
    # Shapes this small cost the same on either kernel: make the cost model prefer Mosaic.
    monkeypatch.setattr(dispatch, "TRITON_FLOPS_PER_US", 1.0)
    qo, kv, page, hq, hkv, d = np.array([5, 70]), np.array([20, 90]), 8, 1, 1, 64
    indptr, indices, last, num_pages = page_table(rng, kv, page)
    cache = random_cache(rng, num_pages, page, hkv, d, jnp.bfloat16, "NHD")
    qo_indptr = _indptr(qo)
    q = randn(rng, (qo_indptr[-1], hq, d), jnp.bfloat16)
    pre = ji.BatchPrefillWithPagedKVCache(hq, hkv, d, page, num_ctas=8, config=ji.PrefillConfig(num_warps=4))
    plan = pre.plan(qo_indptr, indptr, indices, last, num_pages=num_pages)
    assert plan.impl == "prefill_mosaic" and plan.layout.tail_cap > 0
    assert plan.alt is not None and plan.alt.impl == "prefill_triton" and plan.alt.layout.tail_cap == 0
    fp8 = ji.PagedKVCache(cache.k_pages.astype(jnp.float8_e4m3fn), cache.v_pages.astype(jnp.float8_e4m3fn))
    want8 = ref.paged_attention(q, fp8, qo_indptr, indptr, indices, last, causal=True, k_scale=0.5, v_scale=2.0)
    assert rel_err(pre.run(q, fp8, plan, k_scale=0.5, v_scale=2.0), want8.o) < TOL[jnp.bfloat16]
    masked = pre.plan(qo_indptr, indptr, indices, last, num_pages=num_pages, custom_mask=np.ones(int((qo * kv).sum()), bool))
    assert masked.layout.tail_cap == 0 and masked.alt is None
    # Built-in logits transforms and masks plan for Mosaic; RoPE and user hooks for Triton.
    from jaxinfer import variants as V
    for var, mosaic in ((V.compose(V.soft_cap(), V.sliding_window()), True), (V.rope(), False),
                        (V.AttentionVariant(logits_transform=lambda p, s, *_: s * 0.5), False)):
        vplan = ji.BatchPrefillWithPagedKVCache(hq, hkv, d, page, variant=var).plan(qo_indptr, indptr, indices, last, num_pages=num_pages)
        assert (vplan.layout.tail_cap > 0) == mosaic and (vplan.alt is not None) == mosaic
    # Not on a Hopper GPU, or with impl="triton": Triton plans only.
    assert ji.BatchPrefillWithPagedKVCache(hq, hkv, d, page, impl="triton").plan(
        qo_indptr, indptr, indices, last, num_pages=num_pages).alt is None
    monkeypatch.setattr(_backend, "mosaic_available", lambda interpret: False)
    assert ji.BatchPrefillWithPagedKVCache(hq, hkv, d, page).plan(qo_indptr, indptr, indices, last, num_pages=num_pages).alt is None
