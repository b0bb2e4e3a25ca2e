"""Formats: pytrees, properties, BSR conversion, and ValueErrors naming the argument."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from helpers import page_table, random_cache
from planner import validate


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_paged_cache_properties_and_pytree(rng, layout):
    cache = random_cache(rng, 7, 4, 2, 16, jnp.float32, layout)
    assert (cache.num_pages, cache.page_size, cache.num_kv_heads, cache.head_dim) == (7, 4, 2, 16)
    assert cache.layout == layout
    doubled = jax.jit(lambda c: ji.PagedKVCache(c.k_pages * 2, c.v_pages, c.layout))(cache)
    assert doubled.layout == layout
    np.testing.assert_array_equal(doubled.k_pages, cache.k_pages * 2)


def test_paged_cache_rejects_bad_input():
    k = jnp.ones((3, 4, 2, 8))
    with pytest.raises(ValueError, match="layout"):
        ji.PagedKVCache(k, k, "NDH")
    with pytest.raises(ValueError, match="v_pages"):
        ji.PagedKVCache(k, k[:2])


def test_attention_state_unpacks():
    o, lse = ji.AttentionState(jnp.ones((2, 3, 4)), jnp.zeros((2, 3)))
    assert o.shape == (2, 3, 4) and lse.shape == (2, 3)


def test_bsr_from_page_table(rng):
    lens = np.array([5, 0, 12, 4])
    indptr, indices, last, num_pages = page_table(rng, lens, 4)
    bsr = ji.BlockSparseMatrix.from_page_table(indptr, indices, last, 4, num_pages)
    assert bsr.block_shape == (1, 4) and bsr.shape == (4, num_pages * 4)
    dense = bsr.to_dense_mask()
    np.testing.assert_array_equal(dense.sum(1), lens)
    for b in range(4):  # visible columns are exactly the request's tokens, in its pages
        pages = indices[indptr[b]:indptr[b + 1]]
        cols = np.concatenate([p * 4 + np.arange(4) for p in pages] + [np.zeros(0, int)])[:lens[b]]
        np.testing.assert_array_equal(np.flatnonzero(dense[b]), np.sort(cols))
    leaves = jax.tree_util.tree_leaves(bsr)
    assert len(leaves) == 3


def test_bsr_rejects_bad_input():
    ip = np.array([0, 1, 2], np.int32)
    with pytest.raises(ValueError, match="multiple of block_shape"):
        ji.BlockSparseMatrix(ip, np.array([0, 1], np.int32), (3, 4), (8, 8))
    with pytest.raises(ValueError, match="indices"):
        ji.BlockSparseMatrix(ip, np.array([0, 5], np.int32), (4, 4), (8, 8))
    with pytest.raises(ValueError, match="indices must be int32"):
        ji.BlockSparseMatrix(ip, np.array([0, 1], np.int64), (4, 4), (8, 8))
    with pytest.raises(ValueError, match="block_mask"):
        ji.BlockSparseMatrix(ip, np.array([0, 1], np.int32), (4, 4), (8, 8), np.ones((2, 4, 3), bool))


@pytest.mark.parametrize("bad, match", [
    (dict(kv_indptr=np.array([1, 2], np.int32)), "kv_indptr must start at 0"),
    (dict(kv_indptr=np.array([0, 2, 1], np.int32)), "kv_indptr must be non-decreasing"),
    (dict(kv_indptr=np.array([0, 2], np.int64)), "kv_indptr must be int32"),
    (dict(kv_indices=np.array([0, 1], np.int64)), "kv_indices must be int32"),
    (dict(kv_indices=np.array([0], np.int32)), "kv_indices has 1 entries"),
    (dict(kv_indices=np.array([0, 9], np.int32)), "page ids outside"),
    (dict(kv_indices=np.array([0, -1], np.int32)), "page ids outside"),
    (dict(kv_last_page_len=np.array([0], np.int32)), "kv_last_page_len must lie"),
    (dict(kv_last_page_len=np.array([5], np.int32)), "kv_last_page_len must lie"),
    (dict(kv_last_page_len=np.array([1, 1], np.int32)), "kv_last_page_len must have shape"),
])
def test_page_table_validation(bad, match):
    args = dict(kv_indptr=np.array([0, 2], np.int32), kv_indices=np.array([0, 1], np.int32),
                kv_last_page_len=np.array([3], np.int32))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        validate.check_page_table(args["kv_indptr"], args["kv_indices"], args["kv_last_page_len"], 4, 4)


def test_kv_lens_from_page_table():
    _, _, _, lens, _ = validate.check_page_table(
        np.array([0, 2, 2, 3], np.int32), np.array([4, 1, 0], np.int32), np.array([3, 1, 4], np.int32), 4, 5)
    np.testing.assert_array_equal(lens, [7, 0, 4])
