"""Head dims Triton cannot tile as they are (not a power of two >= 16: Phi-3's 96, 80, 72, 8): the
Triton kernels read them in tiles padded with zero columns (pallas_kernels._common.tile_width;
q and K of a multiple of 16 in column blocks in the prefill kernel) and store only the real
columns. Interpret mode runs the same padded tiles, so these tests check them against float64
NumPy; the compiled kernels' lowering for CUDA is checked in test_backend. The boundary grid at
head dims 96 and 80 is test_boundary.test_boundaries_at_head_dims_triton_pads."""
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from helpers import np64_attention, page_table, randn, rel_err

HQ, HKV, PAGE = 4, 2, 8
FP8_TOL = 3e-2  # e4m3 K/V with unit scales under a bfloat16 q, float16 dots


def paged(rng, kv_lens, d, dtype=jnp.float32):
    indptr, indices, last, num_pages = page_table(rng, kv_lens, PAGE)
    k, v = (randn(rng, (num_pages, PAGE, HKV, d), jnp.float32) for _ in range(2))
    if np.dtype(dtype).itemsize == 1:  # fp8: the oracle reads the rounded values
        k, v = k.astype(dtype), v.astype(dtype)
    return ji.PagedKVCache(k, v), indptr, indices, last, num_pages


def request_kv(cache, indptr, indices, last, b):
    """Request b's K and V [kv, Hkv, D] in float64."""
    pages = np.asarray(indices[indptr[b]:indptr[b + 1]])
    n = (len(pages) - 1) * PAGE + int(last[b])
    k, v = (np.asarray(x.astype(jnp.float32), np.float64)[pages].reshape(-1, HKV, x.shape[-1])[:n]
            for x in (cache.k_pages, cache.v_pages))
    return k, v


@pytest.mark.parametrize("d, dtype", [(96, jnp.float32), (80, jnp.float32), (72, jnp.float32),
                                      (8, jnp.float32), (96, jnp.float8_e4m3fn)])
def test_decode_and_prefill_at_padded_head_dims(rng, d, dtype):
    """Decode (split-KV and merged), the paged prefill (causal) and BatchAttention's short and
    long rows, fp8 K/V too (their padded columns are undefined after the load and zeroed)."""
    kv_lens = [5, 300, 40]
    cache, indptr, indices, last, num_pages = paged(rng, kv_lens, d, dtype)
    fp8 = np.dtype(dtype).itemsize == 1
    q_dtype, tol = (jnp.bfloat16, FP8_TOL) if fp8 else (jnp.float32, 1e-5)
    q = randn(rng, (3, HQ, d), q_dtype)
    dec = ji.BatchDecodeWithPagedKVCache(HQ, HKV, d, PAGE, num_ctas=8)
    o = dec.run(q, cache, dec.plan(indptr, indices, last, num_pages=num_pages))
    for b in range(3):
        k, v = request_kv(cache, indptr, indices, last, b)
        assert rel_err(o[b], np64_attention(q[b:b + 1], k, v)[0][0]) < tol, (d, b)

    qo_lens = [5, 1, 33]  # a request of several tiles, one decode row, one within the tile
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q = randn(rng, (int(qo_indptr[-1]), HQ, d), q_dtype)
    pre = ji.BatchPrefillWithPagedKVCache(HQ, HKV, d, PAGE, causal=True, num_ctas=8)
    batch = ji.BatchAttention(HQ, HKV, d, PAGE, num_ctas=8)
    for w in (pre, batch):
        plan = w.plan(qo_indptr, indptr, indices, last, num_pages=num_pages)
        o = w.run(q, cache, plan)
        for b in range(3):
            k, v = request_kv(cache, indptr, indices, last, b)
            want = np64_attention(q[qo_indptr[b]:qo_indptr[b + 1]], k, v, causal=True)[0]
            assert rel_err(o[qo_indptr[b]:qo_indptr[b + 1]], want) < tol, (type(w).__name__, plan.impl, d, b)


@pytest.mark.parametrize("d", [96, 40])
def test_ragged_prefill_distinct_padded_dims(rng, d):
    """q and K of d against V and o of another padded width (48)."""
    dv, lens = 48, [70, 9]
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q, k = randn(rng, (79, HQ, d), jnp.float32), randn(rng, (79, HKV, d), jnp.float32)
    v = randn(rng, (79, HKV, dv), jnp.float32)
    w = ji.BatchPrefillWithRaggedKVCache(HQ, HKV, d, head_dim_vo=dv, causal=True, num_ctas=8)
    o = w.run(q, k, v, w.plan(indptr, indptr))
    assert o.shape == (79, HQ, dv)
    for b in range(2):
        s = slice(indptr[b], indptr[b + 1])
        assert rel_err(o[s], np64_attention(q[s], k[s], v[s], causal=True)[0]) < 1e-5, b


def test_decode_append_and_kv_write_at_head_dim_96(rng):
    """The decode kernel's fused append and the KV-write kernel store only the real columns."""
    d, kv_lens = 96, [17, 8]
    cache, indptr, indices, last, num_pages = paged(rng, kv_lens, d)
    q, k_new, v_new = (randn(rng, (2, h, d), jnp.float32) for h in (HQ, HKV, HKV))
    dec = ji.BatchDecodeWithPagedKVCache(HQ, HKV, d, PAGE, num_ctas=8)
    plan = dec.plan(indptr, indices, last, num_pages=num_pages)  # lengths after the append
    o, written = dec.run(q, cache, plan, append_kv=(k_new, v_new))
    positions = np.asarray(kv_lens) - 1
    appended = ji.append_paged_kv_cache(cache, k_new, v_new, np.arange(2, dtype=np.int32),
                                        positions.astype(np.int32), indices, indptr)
    for got in (written, appended):
        for b in range(2):
            page = indices[indptr[b] + positions[b] // PAGE]
            np.testing.assert_array_equal(got.k_pages[page, positions[b] % PAGE], k_new[b])
            np.testing.assert_array_equal(got.v_pages[page, positions[b] % PAGE], v_new[b])
        untouched = np.ones(got.k_pages.shape[:2], bool)
        for b in range(2):
            untouched[indices[indptr[b] + positions[b] // PAGE], positions[b] % PAGE] = False
        np.testing.assert_array_equal(np.asarray(got.k_pages)[untouched], np.asarray(cache.k_pages)[untouched])
    for b in range(2):
        k, v = request_kv(written, indptr, indices, last, b)
        assert rel_err(o[b], np64_attention(q[b:b + 1], k, v)[0][0]) < 1e-5, b


def test_merges_at_head_dim_96(rng):
    """merge_state and merge_states (the merge kernels) on o of width 96."""
    n, d = 5, 96
    o = randn(rng, (n, 2, HQ, d), jnp.float32)
    lse = randn(rng, (n, 2, HQ), jnp.float32).at[0, 0].set(-jnp.inf)
    states = ji.AttentionState(o, lse)
    want = ji.reference.merge_states(states)
    got = ji.merge_states(states)
    assert rel_err(got.o, want.o) < 1e-5 and rel_err(got.lse, want.lse) < 1e-5
    pair = ji.merge_state(ji.AttentionState(o[:, 0], lse[:, 0]), ji.AttentionState(o[:, 1], lse[:, 1]))
    assert rel_err(pair.o, want.o) < 1e-5 and rel_err(pair.lse, want.lse) < 1e-5


def test_query_key_transforms_need_a_tileable_head_dim():
    """RoPE rotates whole q / K rows, which a padded tile is not: a ValueError naming head_dim."""
    for make in (lambda: ji.BatchDecodeWithPagedKVCache(HQ, HKV, 96, PAGE, variant=ji.variants.rope()),
                 lambda: ji.BatchPrefillWithPagedKVCache(HQ, HKV, 80, PAGE, variant=ji.variants.rope()),
                 lambda: ji.BatchPrefillWithRaggedKVCache(HQ, HKV, 8, variant=ji.variants.rope())):
        with pytest.raises(ValueError, match="head_dim must be a power of two >= 16"):
            make()
    ji.BatchDecodeWithPagedKVCache(HQ, HKV, 96, PAGE, variant=ji.variants.soft_cap())  # logits only: fine
