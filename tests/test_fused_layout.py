"""The NHD_FUSED cache layout (K and V of a page, slot and head side by side in one array
[num_pages, page_size, Hkv, 2, D]: RPA v3's fused cache reshaped), in interpret mode: every wrapper
and the KV append on it give what they give on the same K/V as an NHD cache (bit for bit: the
kernels read the same values), and match jaxinfer.reference; unlisted pages and the slots past each
request's length hold NaN. ragged_paged_attention's fused tests are in test_ragged_paged_attention.py,
the RPA v3 entry point's in test_compat_tpu_inference.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from helpers import TOL, assert_lse_close, fused, page_table, poison_pages, randn, random_cache, rel_err
from jaxinfer import reference as ref
from jaxinfer import sharding
from pallas_kernels import _common

HQ, HKV, D = 4, 2, 32


def _case(rng, kv, page, *, hkv=HKV, d=D, dtype=jnp.float32):
    """A page table over kv lengths and its poisoned NHD cache with the fused cache of the same K/V."""
    indptr, indices, last, num_pages = page_table(rng, kv, page, extra_pages=4)
    cache = poison_pages(random_cache(rng, num_pages, page, hkv, d, dtype), indptr, indices, last)
    return (indptr, indices, last), cache, fused(cache), num_pages


def _indptr(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def test_fused_cache_views_and_rows(rng):
    """PagedKVCache.fused: shape facts, K/V views, one pytree leaf, rows() twice (K at row 2r,
    V at 2r + 1 of the NHD row r: _common.kv_rows), with_rows back; the constructor refuses the
    layout (one array, not two)."""
    nhd = random_cache(rng, 5, 4, HKV, D, jnp.float32)
    cache = fused(nhd)
    assert (cache.num_pages, cache.page_size, cache.num_kv_heads, cache.head_dim, cache.layout) == \
        (5, 4, HKV, D, "NHD_FUSED")
    np.testing.assert_array_equal(cache.k_pages, nhd.k_pages)
    np.testing.assert_array_equal(cache.v_pages, nhd.v_pages)
    assert len(jax.tree_util.tree_leaves(cache)) == 1
    k_rows, v_rows = cache.rows()
    assert k_rows is v_rows and k_rows.shape == (5 * 4 * HKV * 2, D)
    page, tok, head = np.array([3, 0]), np.array([6, 1]), np.array([1, 0])
    k_at, v_at = _common.kv_rows(tok, page, 4, HKV, head, "NHD_FUSED")
    nhd_k, nhd_v = nhd.rows()
    nhd_at, _ = _common.kv_rows(tok, page, 4, HKV, head, "NHD")
    np.testing.assert_array_equal(k_rows[k_at], nhd_k[nhd_at])
    np.testing.assert_array_equal(v_rows[v_at], nhd_v[nhd_at])
    again = cache.with_rows(cache.stored_rows())
    assert again.layout == "NHD_FUSED"
    np.testing.assert_array_equal(again.kv_pages, cache.kv_pages)
    with pytest.raises(ValueError, match="PagedKVCache.fused"):
        ji.PagedKVCache(nhd.k_pages, nhd.v_pages, "NHD_FUSED")
    with pytest.raises(ValueError, match="kv_pages must be"):
        ji.PagedKVCache.fused(nhd.k_pages)
    with pytest.raises(ValueError, match="kv_pages: a NHD cache"):
        nhd.kv_pages  # noqa: B018


def test_append_writes_in_place_as_nhd(rng):
    """append_paged_kv_cache into the fused cache under jit with donation: the same K/V as the NHD
    write, the buffer donated (no second cache alive)."""
    table, nhd, cache, _ = _case(rng, [10, 3], 4)
    indptr, indices, _ = table
    bi, pos = ji.get_batch_indices_positions(np.array([0, 2, 3], np.int32), np.array([10, 3], np.int32), 4)
    k_new, v_new = randn(rng, (4, HKV, D), jnp.float32), randn(rng, (4, HKV, D), jnp.float32)
    want = ji.append_paged_kv_cache(nhd, k_new, v_new, bi, pos, indices, indptr)
    kv_pages = cache.kv_pages
    got = jax.jit(ji.append_paged_kv_cache, donate_argnums=0)(cache, k_new, v_new, bi, pos, indices, indptr)
    assert got.layout == "NHD_FUSED" and kv_pages.is_deleted()
    for g, w in ((got.k_pages, want.k_pages), (got.v_pages, want.v_pages)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))  # (NaN == NaN)


@pytest.mark.slow  # NHD_FUSED pages run by default through ragged_paged_attention (test_compat_tpu_inference) and Mosaic prefill
def test_decode_matches_nhd_and_reference(rng):
    """The decode wrapper (split KV: 8 CTAs), then its fused append (append_kv) on the fused cache."""
    kv = np.array([1, 37, 150, 9])
    table, nhd, cache, num_pages = _case(rng, kv, 8)
    q = randn(rng, (len(kv), HQ, D), jnp.float32)
    outs = []
    for c, layout in ((nhd, "NHD"), (cache, "NHD_FUSED")):
        dec = ji.BatchDecodeWithPagedKVCache(HQ, HKV, D, 8, layout=layout, num_ctas=8)
        outs.append(dec.run(q, c, dec.plan(*table, num_pages=num_pages), return_lse=True))
    np.testing.assert_array_equal(outs[1].o, outs[0].o)
    want = ref.decode(q, nhd, *table)
    assert rel_err(outs[1].o, want.o) < TOL[jnp.float32]
    assert_lse_close(outs[1].lse, want.lse)

    # append_kv: each request's new token written at its last position (length - 1) and attended
    k_new, v_new = randn(rng, (len(kv), HKV, D), jnp.float32), randn(rng, (len(kv), HKV, D), jnp.float32)
    got = []
    for c, layout in ((nhd, "NHD"), (cache, "NHD_FUSED")):
        dec = ji.BatchDecodeWithPagedKVCache(HQ, HKV, D, 8, layout=layout, num_ctas=8)
        got.append(dec.run(q, c, dec.plan(*table, num_pages=num_pages), append_kv=(k_new, v_new)))
    np.testing.assert_array_equal(got[1][0], got[0][0])
    assert got[1][1].layout == "NHD_FUSED"
    for g, w in ((got[1][1].k_pages, got[0][1].k_pages), (got[1][1].v_pages, got[0][1].v_pages)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


# Non-causal under slow: causal or not, the kernel reads the fused pages alike (non-causal paged
# prefill runs by default in test_safety.test_paged_prefill_never_reads_unlisted_memory[False]).
@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False])
def test_paged_prefill_matches_nhd_and_reference(rng, causal):
    qo, kv = np.array([5, 0, 17, 1]), np.array([40, 9, 70, 3])
    table, nhd, cache, num_pages = _case(rng, kv, 8)
    qo_indptr = _indptr(qo)
    q = randn(rng, (qo_indptr[-1], HQ, D), jnp.float32)
    outs = []
    for c, layout in ((nhd, "NHD"), (cache, "NHD_FUSED")):
        pre = ji.BatchPrefillWithPagedKVCache(HQ, HKV, D, 8, causal=causal, layout=layout, num_ctas=8)
        outs.append(pre.run(q, c, pre.plan(qo_indptr, *table, num_pages=num_pages), return_lse=True))
    np.testing.assert_array_equal(outs[1].o, outs[0].o)
    want = ref.paged_attention(q, nhd, qo_indptr, *table, causal=causal)
    assert rel_err(outs[1].o, want.o) < TOL[jnp.float32]
    assert_lse_close(outs[1].lse, want.lse)


def test_mosaic_prefill_matches_reference(rng):
    """impl="mosaic" (the Mosaic GPU kernel in its interpreter, seconds a run: no NHD run beside it):
    its TMA copies take K or V of the fused pages by a last index; bf16, one query head, one tile of
    70 tokens over 16-slot pages, poisoned tails."""
    qo, kv, page, hq, hkv, d = np.array([70]), np.array([90]), 16, 1, 1, 64
    table, nhd, cache, num_pages = _case(rng, kv, page, hkv=hkv, d=d, dtype=jnp.bfloat16)
    qo_indptr = _indptr(qo)
    q = randn(rng, (qo_indptr[-1], hq, d), jnp.bfloat16)
    pre = ji.BatchPrefillWithPagedKVCache(hq, hkv, d, page, causal=True, layout="NHD_FUSED", impl="mosaic")
    plan = pre.plan(qo_indptr, *table, num_pages=num_pages)
    assert plan.impl == "prefill_mosaic"
    o = pre.run(q, cache, plan)
    want = ref.paged_attention(q, nhd, qo_indptr, *table, causal=True)
    assert rel_err(o, want.o) < TOL[jnp.bfloat16]


@pytest.mark.slow
def test_batch_attention_matches_nhd_and_reference(rng):
    """BatchAttention's two classes (decode kernel for the short rows, prefill tiles for the rest)."""
    qo, kv = np.array([1, 0, 4, 37, 2]), np.array([300, 9, 64, 90, 17])
    table, nhd, cache, num_pages = _case(rng, kv, 8)
    qo_indptr = _indptr(qo)
    q = randn(rng, (qo_indptr[-1], HQ, D), jnp.float32)
    outs = []
    for c, layout in ((nhd, "NHD"), (cache, "NHD_FUSED")):
        attn = ji.BatchAttention(HQ, HKV, D, 8, layout=layout, num_ctas=8)
        plan = attn.plan(qo_indptr, *table, num_pages=num_pages)
        assert plan.impl.startswith("decode_triton+prefill_")
        outs.append(attn.run(q, c, plan, return_lse=True))
    np.testing.assert_array_equal(outs[1].o, outs[0].o)
    want = ref.paged_attention(q, nhd, qo_indptr, *table, causal=True)
    assert rel_err(outs[1].o, want.o) < TOL[jnp.float32]
    assert_lse_close(outs[1].lse, want.lse)


@pytest.mark.slow
def test_batch_attention_mixed_launch_matches_nhd_and_reference(rng):
    """impl="mixed": packed tiles (q_len 1 and 3) and query tiles (37) in one Mosaic launch, whose
    sanitized last-page V copy (LastPages) comes from the fused pages; bf16, poisoned tails."""
    qo, kv, page, hq, hkv, d = np.array([1, 37, 3]), np.array([70, 90, 40]), 16, 4, 1, 64
    table, nhd, cache, num_pages = _case(rng, kv, page, hkv=hkv, d=d, dtype=jnp.bfloat16)
    qo_indptr = _indptr(qo)
    q = randn(rng, (qo_indptr[-1], hq, d), jnp.bfloat16)
    outs = []
    for c, layout in ((nhd, "NHD"), (cache, "NHD_FUSED")):
        attn = ji.BatchAttention(hq, hkv, d, page, layout=layout, impl="mixed")
        plan = attn.plan(qo_indptr, *table, num_pages=num_pages, q_data_type="bfloat16")
        assert plan.impl == "batch_mosaic"
        outs.append(attn.run(q, c, plan))
    np.testing.assert_array_equal(np.asarray(outs[1], np.float32), np.asarray(outs[0], np.float32))
    want = ref.paged_attention(q, nhd, qo_indptr, *table, causal=True)
    assert rel_err(outs[1], want.o) < TOL[jnp.bfloat16]


def test_sharding_specs_and_replicated_heads(rng):
    """Head sharding: the fused cache's KV heads are axis 2, as NHD's; replicate_kv_heads keeps the
    layout."""
    assert sharding.cache_spec("NHD_FUSED", tp_axis="tp", cp_axis="cp") == \
        jax.sharding.PartitionSpec("cp", None, "tp", None, None)
    cache = fused(random_cache(rng, 3, 4, HKV, D, jnp.float32))
    rep = sharding.replicate_kv_heads(cache, 2)
    assert rep.layout == "NHD_FUSED" and rep.num_kv_heads == 2 * HKV
    np.testing.assert_array_equal(rep.k_pages, jnp.repeat(cache.k_pages, 2, axis=2))
    np.testing.assert_array_equal(rep.v_pages, jnp.repeat(cache.v_pages, 2, axis=2))
