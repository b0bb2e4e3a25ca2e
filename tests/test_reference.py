"""The reference itself against float64 NumPy, and its paged/ragged/BSR forms against each other."""
import chex
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jaxinfer as ji
from helpers import np64_attention, page_table, randn, random_cache
from jaxinfer import reference as ref


@pytest.mark.parametrize("qo, kv, hq, hkv, causal", [
    (5, 9, 4, 2, False), (5, 9, 4, 2, True), (9, 5, 4, 1, True), (1, 17, 8, 8, False), (3, 0, 2, 1, True)])
def test_attention_matches_float64(rng, qo, kv, hq, hkv, causal):
    q, k, v = randn(rng, (qo, hq, 16), jnp.float32), randn(rng, (kv, hkv, 16), jnp.float32), randn(rng, (kv, hkv, 16), jnp.float32)
    o, lse = ref.attention(q, k, v, causal=causal)
    o64, lse64 = np64_attention(q, k, v, causal=causal)
    np.testing.assert_allclose(o, o64, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, lse64, rtol=1e-5, atol=1e-5)
    if causal and qo > kv:  # rows that see no key: o = 0, lse = -inf
        assert np.all(np.asarray(o[: qo - kv]) == 0) and np.all(np.isneginf(lse[: qo - kv]))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_paged_equals_ragged(rng, layout):
    lens, qo = np.array([7, 0, 13]), np.array([2, 1, 3])
    indptr, indices, last, num_pages = page_table(rng, lens, 4)
    cache = random_cache(rng, num_pages, 4, 2, 16, jnp.float32, layout)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    q = randn(rng, (qo_indptr[-1], 4, 16), jnp.float32)
    paged = ref.paged_attention(q, cache, qo_indptr, indptr, indices, last, causal=True)
    k, v, tok_indptr = ref.gather_pages(cache, indptr, indices, last)
    np.testing.assert_array_equal(tok_indptr, np.concatenate([[0], np.cumsum(lens)]))
    ragged = ref.ragged_attention(q, k, v, qo_indptr, tok_indptr, causal=True)
    np.testing.assert_array_equal(paged.o, ragged.o)
    for b in range(3):
        o64, _ = np64_attention(q[qo_indptr[b]:qo_indptr[b + 1]], k[tok_indptr[b]:tok_indptr[b + 1]],
                                v[tok_indptr[b]:tok_indptr[b + 1]], causal=True)
        np.testing.assert_allclose(paged.o[qo_indptr[b]:qo_indptr[b + 1]], o64, rtol=1e-5, atol=1e-5)


def test_block_sparse_reference_is_masked_dense(rng):
    indptr = np.array([0, 2, 3], np.int32)
    bsr = ji.BlockSparseMatrix(indptr, np.array([0, 3, 1], np.int32), (4, 2), (8, 8))
    q, k, v = randn(rng, (8, 2, 16), jnp.float32), randn(rng, (8, 2, 16), jnp.float32), randn(rng, (8, 2, 16), jnp.float32)
    o, _ = ref.block_sparse_attention(q, k, v, bsr)
    o64, _ = np64_attention(q, k, v, mask=bsr.to_dense_mask())
    np.testing.assert_allclose(o, o64, rtol=1e-5, atol=1e-5)


def test_custom_mask_equal_to_causal(rng):
    q, k, v = randn(rng, (3, 2, 8), jnp.float32), randn(rng, (5, 2, 8), jnp.float32), randn(rng, (5, 2, 8), jnp.float32)
    mask = np.tril(np.ones((3, 5), bool), k=2).reshape(-1)
    a = ref.ragged_attention(q, k, v, np.array([0, 3]), np.array([0, 5]), custom_mask=mask)
    b = ref.ragged_attention(q, k, v, np.array([0, 3]), np.array([0, 5]), causal=True)
    np.testing.assert_allclose(a.o, b.o, rtol=1e-6)


@settings(max_examples=8, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 20)), min_size=1, max_size=4), st.booleans())
def test_property_ragged_reference_matches_float64(shapes, causal):
    rng = np.random.default_rng(len(shapes) * 31 + sum(a * 7 + b for a, b in shapes))
    qo = np.array([a for a, _ in shapes]); kv = np.array([b for _, b in shapes])
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv)]).astype(np.int32)
    q = randn(rng, (qo_indptr[-1], 4, 8), jnp.float32)
    k, v = randn(rng, (kv_indptr[-1], 2, 8), jnp.float32), randn(rng, (kv_indptr[-1], 2, 8), jnp.float32)
    out = ref.ragged_attention(q, k, v, qo_indptr, kv_indptr, causal=causal)
    for b in range(len(shapes)):
        qs, ks = slice(qo_indptr[b], qo_indptr[b + 1]), slice(kv_indptr[b], kv_indptr[b + 1])
        o64, lse64 = np64_attention(q[qs], k[ks], v[ks], causal=causal)
        chex.assert_trees_all_close(np.asarray(out.o[qs]), o64.astype(np.float32), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out.lse[qs], lse64, rtol=1e-5, atol=1e-5)
