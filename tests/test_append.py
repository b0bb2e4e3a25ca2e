"""KV append: exact equality with a NumPy scatter; other pages untouched; jit with donation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from helpers import fused, randn, random_cache


def test_batch_indices_positions():
    bi, pos = ji.get_batch_indices_positions(np.array([0, 2, 3, 3], np.int32), np.array([5, 9, 4], np.int32), 5)
    np.testing.assert_array_equal(bi, [0, 0, 1, -1, -1])
    np.testing.assert_array_equal(pos, [3, 4, 8, -1, -1])


@pytest.mark.parametrize("layout, dtype", [("NHD", "float32"), ("HND", "float32"), ("NHD", "float8_e4m3fn")])
def test_append_matches_numpy_scatter(rng, layout, dtype, monkeypatch):
    """12 rows x 2 heads: the write kernel's 16-row programs (as on the GPU), the last one partly
    past the rows."""
    from pallas_kernels import kv_write
    monkeypatch.setattr(kv_write, "INTERPRET_ROWS", kv_write.ROWS)
    page, hkv, d = 4, 2, 8
    cache = random_cache(rng, 12, page, hkv, d, jnp.float32, layout)
    cache = ji.PagedKVCache(cache.k_pages.astype(dtype), cache.v_pages.astype(dtype), layout)
    kv_indptr = np.array([0, 3, 5, 6], np.int32)
    kv_indices = np.array([9, 2, 7, 0, 11, 4], np.int32)  # non-contiguous pages
    seq_lens = np.array([10, 8, 4], np.int32)  # after appending
    append_indptr = np.array([0, 6, 8, 12], np.int32)
    bi, pos = ji.get_batch_indices_positions(append_indptr, seq_lens, 12)
    k_new, v_new = randn(rng, (12, hkv, d), jnp.float32), randn(rng, (12, hkv, d), jnp.float32)
    out = ji.append_paged_kv_cache(cache, k_new, v_new, bi, pos, kv_indices, kv_indptr)
    bits = lambda x: np.asarray(x).view(np.uint8) if dtype != "float32" else np.asarray(x)
    want_k, want_v = np.array(cache.k_pages), np.array(cache.v_pages)
    k_cast, v_cast = np.asarray(k_new.astype(dtype)), np.asarray(v_new.astype(dtype))
    for r, (b, p) in enumerate(zip(np.asarray(bi), np.asarray(pos))):
        pg, slot = kv_indices[kv_indptr[b] + p // page], p % page
        if layout == "NHD":
            want_k[pg, slot], want_v[pg, slot] = k_cast[r], v_cast[r]
        else:
            want_k[pg, :, slot], want_v[pg, :, slot] = k_cast[r], v_cast[r]
    np.testing.assert_array_equal(bits(out.k_pages), bits(want_k))
    np.testing.assert_array_equal(bits(out.v_pages), bits(want_v))
    untouched = np.setdiff1d(np.arange(12), kv_indices)
    np.testing.assert_array_equal(bits(out.k_pages[untouched]), bits(cache.k_pages[untouched]))


def test_append_under_jit_with_donation(rng):
    cache = random_cache(rng, 6, 4, 1, 8, jnp.float32)
    kv_indptr, kv_indices = np.array([0, 2], np.int32), np.array([5, 1], np.int32)
    bi, pos = np.array([0, 0], np.int32), np.array([4, 5], np.int32)
    k_new = randn(rng, (2, 1, 8), jnp.float32)
    expect = np.array(cache.k_pages)
    expect[1, 0:2] = k_new
    step = jax.jit(ji.append_paged_kv_cache, donate_argnums=0)
    out = step(cache, k_new, k_new, bi, pos, kv_indices, kv_indptr)
    np.testing.assert_array_equal(out.k_pages, expect)


def test_append_skips_padding_rows(rng):
    cache = random_cache(rng, 3, 2, 1, 4, jnp.float32)
    out = ji.append_paged_kv_cache(cache, randn(rng, (2, 1, 4), jnp.float32), randn(rng, (2, 1, 4), jnp.float32),
                                   np.array([-1, -1], np.int32), np.array([-1, -1], np.int32),
                                   np.array([0], np.int32), np.array([0, 1], np.int32))
    np.testing.assert_array_equal(out.k_pages, cache.k_pages)


@pytest.mark.parametrize("bad, match", [
    (dict(bi=np.array([0, 3], np.int32)), "batch_indices"),
    (dict(pos=np.array([0, 8], np.int32)), "positions lie past"),
    (dict(pos=np.array([0, 1], np.int64)), "positions must be int32"),
    (dict(kv_indices=np.array([0, 9], np.int32)), "page ids outside"),
    (dict(k=np.ones((2, 2, 8), np.float32)), "append_k"),
])
def test_append_rejects_bad_input(rng, bad, match):
    cache = random_cache(rng, 4, 4, 1, 8, jnp.float32)
    args = dict(k=np.ones((2, 1, 8), np.float32), bi=np.array([0, 0], np.int32), pos=np.array([0, 5], np.int32),
                kv_indices=np.array([0, 3], np.int32))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        ji.append_paged_kv_cache(cache, jnp.asarray(args["k"]), jnp.asarray(args["k"]), args["bi"], args["pos"],
                                 args["kv_indices"], np.array([0, 2], np.int32))


@pytest.mark.parametrize("layout, page, hkv, d, gpu_programs", [
    ("NHD", 16, 2, 32, True), ("HND", 8, 6, 80, False), ("NHD_FUSED", 1, 3, 96, True), ("HND", 64, 4, 16, True)])
def test_write_zeroes_stale_v_tails(rng, layout, page, hkv, d, gpu_programs, monkeypatch):
    """write_slots' stale_pages / stale_from (ragged_paged_attention's write): V of each listed
    page zeroed from its slot on (0: nothing; page_size - 1: the last slot), in the same launch
    as the new rows; K, the other slots and other pages bit for bit as before. gpu_programs: one
    tail program per page as on the GPU (pages of 64 x 4 heads: two 128-row chunks), else the
    interpreter's one for all."""
    from jaxinfer.page import write_slots
    from pallas_kernels import kv_write
    if gpu_programs:
        monkeypatch.setattr(kv_write, "INTERPRET_ROWS", kv_write.ROWS)
    num_pages, n = 10, 5
    base = random_cache(rng, num_pages, page, hkv, d, jnp.float32, "HND" if layout == "HND" else "NHD")
    cache = fused(base) if layout == "NHD_FUSED" else base
    page_ids = rng.permutation(num_pages)[:n].astype(np.int32)
    slots = rng.integers(0, page, n).astype(np.int32)
    k_new, v_new = randn(rng, (n, hkv, d), jnp.float32), randn(rng, (n, hkv, d), jnp.float32)
    stale_pages = np.array([page_ids[0], page_ids[1], page_ids[2], 7], np.int32)
    stale_from = np.array([page // 2, 0, page - 1, 1], np.int32) if page > 1 else np.array([0, 0, 0, 0], np.int32)
    out = write_slots(cache, jnp.asarray(page_ids), jnp.asarray(slots), k_new, v_new,
                      stale_pages=jnp.asarray(stale_pages), stale_from=jnp.asarray(stale_from))
    want_k, want_v = np.array(base.k_pages), np.array(base.v_pages)
    at = (lambda pg, sl: (pg, slice(None), sl)) if layout == "HND" else (lambda pg, sl: (pg, sl))
    for i in range(n):
        want_k[at(page_ids[i], slots[i])], want_v[at(page_ids[i], slots[i])] = k_new[i], v_new[i]
    for pg, start in zip(stale_pages, stale_from):
        if start > 0:
            want_v[at(pg, slice(start, None))] = 0
    np.testing.assert_array_equal(np.asarray(out.k_pages), want_k)
    np.testing.assert_array_equal(np.asarray(out.v_pages), want_v)
