"""Test helpers: random inputs (never zeros), float64 NumPy oracles, page tables."""
import jax.numpy as jnp
import numpy as np

import jaxinfer as ji

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 4e-3}


def randn(rng, shape, dtype, scale=1.0):
    """Standard normal values in dtype, cast on the host (a device cast compiles per shape)."""
    return jnp.asarray((rng.standard_normal(shape) * scale).astype(dtype))


def np64_attention(q, k, v, *, causal=False, sm_scale=None, mask=None):
    """float64 NumPy attention for one request: q [qo, Hq, D], k/v [kv, Hkv, D] -> (o, lse)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    qo, hq, d = q.shape
    kv, hkv, _ = k.shape
    g = hq // hkv
    scale = 1 / np.sqrt(d) if sm_scale is None else sm_scale
    kk, vv = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)  # [kv, Hq, D]
    s = np.einsum("qhd,khd->hqk", q, kk) * scale
    vis = np.ones((qo, kv), bool)
    if causal:
        vis &= np.arange(kv)[None, :] <= np.arange(qo)[:, None] + kv - qo
    if mask is not None:
        vis &= mask
    s = np.where(vis[None], s, -np.inf)
    m = s.max(-1, keepdims=True) if kv else np.full((hq, qo, 1), -np.inf)
    m = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m)
    den = p.sum(-1)
    o = np.einsum("hqk,khd->qhd", p, vv) / np.where(den > 0, den, 1).T[..., None]
    lse = np.where(den > 0, np.log(np.where(den > 0, den, 1)) + m[..., 0], -np.inf).T
    return o, lse


def rel_err(out, ref):
    """||out - ref|| / ||ref||; fails on NaN, which is what interpret mode leaves in any
    output element a kernel did not write (see test_backend.test_interpret_mode_poisons_outputs)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert not np.any(np.isnan(out)), "output has NaN"
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def assert_lse_close(lse, ref, tol=1e-4):
    lse, ref = np.asarray(lse, np.float64), np.asarray(ref, np.float64)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(lse[fin], ref[fin], rtol=tol, atol=tol)


def page_table(rng, kv_lens, page_size, extra_pages=3):
    """Random non-contiguous pages for each request. Returns (indptr, indices, last, num_pages)."""
    kv_lens = np.asarray(kv_lens)
    npages = -(-kv_lens // page_size)
    num_pages = int(npages.sum()) + extra_pages
    indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
    indices = rng.permutation(num_pages)[: indptr[-1]].astype(np.int32)
    last = np.where(npages > 0, kv_lens - (npages - 1) * page_size, 1).astype(np.int32)
    return indptr, indices, last, num_pages


def random_cache(rng, num_pages, page_size, hkv, d, dtype, layout="NHD"):
    shape = (num_pages, page_size, hkv, d) if layout == "NHD" else (num_pages, hkv, page_size, d)
    return ji.PagedKVCache(randn(rng, shape, dtype), randn(rng, shape, dtype), layout)


def fused(cache):
    """An NHD cache's K and V as one NHD_FUSED cache [num_pages, page_size, Hkv, 2, D]."""
    return ji.PagedKVCache.fused(jnp.stack([cache.k_pages, cache.v_pages], axis=3))


def _tail(layout, page, start):
    """The index of a page's slots from start on, in a [P, S, ...] (NHD) or [P, Hkv, S, D] (HND) array."""
    return (page, slice(None), slice(start, None)) if layout == "HND" else (page, slice(start, None))


def zero_written_tails(v, layout, qo_indptr, kv_indptr, kv_indices, kv_last_page_len):
    """ragged_paged_attention's write past the new rows, in NumPy: V (an NHD or HND array, changed
    in place and returned) set to 0 past kv_last_page_len in the last page of each request that
    has query rows (a partly filled page the step writes into)."""
    page_size = v.shape[2 if layout == "HND" else 1]
    for b in range(len(kv_indptr) - 1):
        if qo_indptr[b + 1] > qo_indptr[b] and kv_indptr[b + 1] > kv_indptr[b] and kv_last_page_len[b] < page_size:
            v[_tail(layout, kv_indices[kv_indptr[b + 1] - 1], kv_last_page_len[b])] = 0
    return v


def poison_pages(cache, kv_indptr, kv_indices, kv_last_page_len):
    """The cache (any layout) with NaN in every page the table does not list and in every slot past
    kv_last_page_len in a request's last page (memory no kernel may read)."""
    k, v = np.array(cache.k_pages), np.array(cache.v_pages)
    listed = kv_indices[: kv_indptr[-1]]
    unlisted = np.setdiff1d(np.arange(cache.num_pages), listed)
    k[unlisted], v[unlisted] = np.nan, np.nan
    for b in range(len(kv_indptr) - 1):
        if kv_indptr[b + 1] > kv_indptr[b]:
            tail = _tail(cache.layout, kv_indices[kv_indptr[b + 1] - 1], kv_last_page_len[b])
            k[tail], v[tail] = np.nan, np.nan
    if cache.layout == "NHD_FUSED":
        return ji.PagedKVCache.fused(jnp.asarray(np.stack([k, v], axis=3)))
    return ji.PagedKVCache(jnp.asarray(k), jnp.asarray(v), cache.layout)
