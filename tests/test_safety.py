"""The safety contract (docs/safety.md), one unit test per item: NaN-poison tests per kernel family
(memory a request does not list holds NaN; outputs stay finite and equal jaxinfer.reference),
empty batches, dtype and index-array errors, and append_paged_kv_cache under jit.
BatchAttention's NaN-poison test is in tests/test_batch_attention.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from helpers import TOL, assert_lse_close, page_table, poison_pages, randn, random_cache, rel_err
from jaxinfer import reference as ref

HQ, HKV, D = 4, 2, 32


def _table(rng, kv_lens, page):
    indptr, indices, last, num_pages = page_table(rng, kv_lens, page, extra_pages=5)
    # distinct last pages only: a page listed twice may not hold NaN in its tail
    cache = random_cache(rng, num_pages, page, HKV, D, jnp.float32)
    return (indptr, indices, last), poison_pages(cache, indptr, indices, last), num_pages


# page 8 under -m slow (the same kernel; test_poison's decode tests poison 8-token pages by default)
@pytest.mark.parametrize("page", [1, pytest.param(8, marks=pytest.mark.slow)])
def test_decode_never_reads_unlisted_memory(rng, page):
    kv = np.array([1, 37, 300, 9, 64])
    table, cache, num_pages = _table(rng, kv, page)
    dec = ji.BatchDecodeWithPagedKVCache(HQ, HKV, D, page, num_ctas=8)
    q = randn(rng, (len(kv), HQ, D), jnp.float32)
    o, lse = dec.run(q, cache, dec.plan(*table, num_pages=num_pages), return_lse=True)
    want = ref.decode(q, cache, *table)
    assert rel_err(o, want.o) < TOL[jnp.float32]
    assert_lse_close(lse, want.lse)


# causal under -m slow (the same kernel; test_poison's prefill_triton test is causal by default)
@pytest.mark.parametrize("causal", [pytest.param(True, marks=pytest.mark.slow), False])
def test_paged_prefill_never_reads_unlisted_memory(rng, causal):
    page, qo, kv = 8, np.array([5, 0, 17, 1]), np.array([40, 9, 70, 3])
    table, cache, num_pages = _table(rng, kv, page)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    pre = ji.BatchPrefillWithPagedKVCache(HQ, HKV, D, page, causal=causal, num_ctas=8)
    q = randn(rng, (qo_indptr[-1], HQ, D), jnp.float32)
    o, lse = pre.run(q, cache, pre.plan(qo_indptr, *table, num_pages=num_pages), return_lse=True)
    want = ref.paged_attention(q, cache, qo_indptr, *table, causal=causal)
    assert rel_err(o, want.o) < TOL[jnp.float32]
    assert_lse_close(lse, want.lse)


def test_ragged_prefill_never_reads_past_its_rows(rng):
    """K/V rows past kv_indptr[-1] hold NaN (the plan only covers kv_indptr[-1] rows)."""
    qo, kv = np.array([3, 0, 20, 1]), np.array([10, 4, 33, 0])
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv)]).astype(np.int32)
    extra = 13
    k = randn(rng, (kv_indptr[-1] + extra, HKV, D), jnp.float32).at[kv_indptr[-1]:].set(jnp.nan)
    v = randn(rng, (kv_indptr[-1] + extra, HKV, D), jnp.float32).at[kv_indptr[-1]:].set(jnp.nan)
    rag = ji.BatchPrefillWithRaggedKVCache(HQ, HKV, D, num_ctas=8)
    q = randn(rng, (qo_indptr[-1], HQ, D), jnp.float32)
    o, lse = rag.run(q, k, v, rag.plan(qo_indptr, kv_indptr), return_lse=True)
    want = ref.ragged_attention(q, k, v, qo_indptr, kv_indptr, causal=True)
    assert rel_err(o, want.o) < TOL[jnp.float32]
    assert_lse_close(lse, want.lse)


def test_block_sparse_never_reads_unlisted_blocks(rng):
    """Column blocks no row block lists hold NaN."""
    (r, c), (m, n) = (2, 8), (12, 64)
    indptr = np.array([0, 2, 2, 5, 6, 6, 7], np.int32)
    indices = np.array([6, 1, 0, 3, 6, 1, 3], np.int32)  # blocks 2, 4, 5, 7 are never listed
    bsr = ji.BlockSparseMatrix(indptr, indices, (r, c), (m, n))
    unlisted = np.setdiff1d(np.arange(n // c), indices)
    rows = (unlisted[:, None] * c + np.arange(c)).ravel()
    k = randn(rng, (n, HKV, D), jnp.float32).at[rows].set(jnp.nan)
    v = randn(rng, (n, HKV, D), jnp.float32).at[rows].set(jnp.nan)
    q = randn(rng, (m, HQ, D), jnp.float32)
    bsa = ji.BlockSparseAttention(HQ, HKV, D, num_ctas=8)
    o, lse = bsa.run(q, k, v, bsa.plan(bsr), return_lse=True)
    want = ref.block_sparse_attention(q, jnp.nan_to_num(k), jnp.nan_to_num(v), bsr)
    assert rel_err(o, want.o) < TOL[jnp.float32]
    assert_lse_close(lse, want.lse)


def test_cascade_never_reads_unlisted_memory(rng):
    page, qo, kv = 4, np.array([2, 3, 1]), np.array([30, 21, 17])
    indptr, indices, last, num_pages = page_table(rng, kv, page, extra_pages=5)
    shared = 3  # every request starts with the same 3 pages
    starts = indptr[:-1]
    for b in range(1, len(kv)):
        indices[starts[b]:starts[b] + shared] = indices[:shared]
    cache = random_cache(rng, num_pages, page, HKV, D, jnp.float32)
    cache = poison_pages(cache, indptr, indices, last)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    levels, saved = ji.two_level_cascade(qo_indptr, indptr, indices, last, page)
    assert saved > 0
    cas = ji.MultiLevelCascadeAttention(2, HQ, HKV, D, page, num_ctas=8)
    q = randn(rng, (qo_indptr[-1], HQ, D), jnp.float32)
    o, lse = cas.run(q, cache, cas.plan(levels, num_pages=num_pages), return_lse=True)
    want = ref.paged_attention(q, cache, qo_indptr, indptr, indices, last, causal=True)
    assert rel_err(o, want.o) < TOL[jnp.float32]
    assert_lse_close(lse, want.lse)


# ---------------------------------------------------------------- batch 0, qo_len 0
def _empty_table():
    return np.zeros(1, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32)


def _assert_empty(out, rows):
    o, lse = out
    assert o.shape == (rows, HQ, D) and lse.shape == (rows, HQ)
    assert not np.any(np.asarray(o)) and np.all(np.isneginf(np.asarray(lse))) if rows else True


def test_batch_zero_gives_empty_outputs(rng):
    """A batch of 0 (and a step whose requests all have qo_len 0) through every batch wrapper,
    without capacities: empty outputs, no kernel."""
    cache = random_cache(rng, 4, 8, HKV, D, jnp.float32)
    q0 = jnp.zeros((0, HQ, D), jnp.float32)
    dec = ji.BatchDecodeWithPagedKVCache(HQ, HKV, D, 8)
    _assert_empty(dec.run(q0, cache, dec.plan(*_empty_table(), num_pages=4), return_lse=True), 0)
    pre = ji.BatchPrefillWithPagedKVCache(HQ, HKV, D, 8)
    _assert_empty(pre.run(q0, cache, pre.plan(np.zeros(1, np.int32), *_empty_table(), num_pages=4),
                          return_lse=True), 0)
    qo0 = np.zeros(3, np.int32)  # two requests, both qo_len 0, with keys
    table = (np.array([0, 1, 3], np.int32), np.array([2, 0, 1], np.int32), np.array([5, 8], np.int32))
    _assert_empty(pre.run(q0, cache, pre.plan(qo0, *table, num_pages=4), return_lse=True), 0)
    ba = ji.BatchAttention(HQ, HKV, D, 8)
    _assert_empty(ba.run(q0, cache, ba.plan(qo0, *table, num_pages=4), return_lse=True), 0)
    _assert_empty(ba.run(q0, cache, ba.plan(np.zeros(1, np.int32), *_empty_table(), num_pages=4),
                         return_lse=True), 0)
    rag = ji.BatchPrefillWithRaggedKVCache(HQ, HKV, D)
    k = randn(rng, (6, HKV, D), jnp.float32)
    _assert_empty(rag.run(q0, k, k, rag.plan(qo0, np.array([0, 2, 6], np.int32)), return_lse=True), 0)
    _assert_empty(rag.run(q0, k[:0], k[:0], rag.plan(np.zeros(1, np.int32), np.zeros(1, np.int32)),
                          return_lse=True), 0)
    bsa = ji.BlockSparseAttention(HQ, HKV, D)
    bsr = ji.BlockSparseMatrix(np.zeros(1, np.int32), np.zeros(0, np.int32), (2, 2), (0, 6))
    _assert_empty(bsa.run(q0, k, k, bsa.plan(bsr), return_lse=True), 0)
    cas = ji.MultiLevelCascadeAttention(2, HQ, HKV, D, 8)
    level = (np.zeros(1, np.int32),) + _empty_table()
    _assert_empty(cas.run(q0, cache, cas.plan([level, level], num_pages=4), return_lse=True), 0)


def test_qo_len_zero_requests_get_no_rows(rng):
    """Requests with qo_len 0 beside others: the others' rows equal the reference."""
    page, qo, kv = 8, np.array([0, 4, 0, 1]), np.array([9, 20, 0, 5])
    table, cache, num_pages = _table(rng, kv, page)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    q = randn(rng, (qo_indptr[-1], HQ, D), jnp.float32)
    want = ref.paged_attention(q, cache, qo_indptr, *table, causal=True)
    for w in (ji.BatchPrefillWithPagedKVCache(HQ, HKV, D, page, num_ctas=8),
              ji.BatchAttention(HQ, HKV, D, page, num_ctas=8)):
        o = w.run(q, cache, w.plan(qo_indptr, *table, num_pages=num_pages))
        assert rel_err(o, want.o) < TOL[jnp.float32], type(w).__name__


# ---------------------------------------------------------------- dtypes and index arrays
def test_python_list_index_arrays_name_the_argument_and_int32():
    dec = ji.BatchDecodeWithPagedKVCache(HQ, HKV, D, 8)
    with pytest.raises(ValueError, match="kv_indptr must be an int32 array, got a Python list") as e:
        dec.plan([0, 1], np.array([0], np.int32), np.array([3], np.int32), num_pages=4)
    assert "int64" not in str(e.value)
    rag = ji.BatchPrefillWithRaggedKVCache(HQ, HKV, D)
    with pytest.raises(ValueError, match="qo_indptr must be an int32 array"):
        rag.plan([0, 1], np.array([0, 1], np.int32))
    with pytest.raises(ValueError, match="append_indptr must be an int32 array"):
        ji.get_batch_indices_positions([0, 1], np.array([3], np.int32), 1)
    with pytest.raises(ValueError, match="int64"):  # an int64 array is named as such
        dec.plan(np.array([0, 1]), np.array([0], np.int32), np.array([3], np.int32), num_pages=4)


def test_float64_q_names_the_dtype(rng):
    cache = random_cache(rng, 4, 8, HKV, D, jnp.float32)
    table = (np.array([0, 1], np.int32), np.array([2], np.int32), np.array([5], np.int32))
    q64 = np.zeros((1, HQ, D), np.float64)
    dec = ji.BatchDecodeWithPagedKVCache(HQ, HKV, D, 8)
    pre = ji.BatchPrefillWithPagedKVCache(HQ, HKV, D, 8)
    ba = ji.BatchAttention(HQ, HKV, D, 8)
    cas = ji.MultiLevelCascadeAttention(1, HQ, HKV, D, 8)
    qo = np.array([0, 1], np.int32)
    for w, plan in ((dec, dec.plan(*table, num_pages=4)), (pre, pre.plan(qo, *table, num_pages=4)),
                    (ba, ba.plan(qo, *table, num_pages=4)), (cas, cas.plan([(qo,) + table], num_pages=4))):
        with pytest.raises(ValueError, match="float64"):
            w.run(q64, cache, plan)
    rag = ji.BatchPrefillWithRaggedKVCache(HQ, HKV, D)
    k = jnp.zeros((1, HKV, D), jnp.float32)
    with pytest.raises(ValueError, match="float64"):
        rag.run(q64, k, k, rag.plan(qo, np.array([0, 1], np.int32)))


def test_decode_kv_lens_must_be_int32(rng):
    cache = random_cache(rng, 4, 8, HKV, D, jnp.float32)
    dec = ji.BatchDecodeWithPagedKVCache(HQ, HKV, D, 8)
    plan = dec.plan(np.array([0, 1], np.int32), np.array([2], np.int32), np.array([5], np.int32), num_pages=4)
    with pytest.raises(ValueError, match="kv_lens must be int32"):
        dec.run(jnp.zeros((1, HQ, D)), cache, plan, kv_lens=np.array([3]))  # int64


def test_block_sparse_rejects_a_block_listed_twice():
    """The kernel would attend the block's keys twice (lse off by log 2); the BSR is a set."""
    bsr = ji.BlockSparseMatrix(np.array([0, 2], np.int32), np.array([1, 1], np.int32), (2, 4), (2, 8))
    with pytest.raises(ValueError, match="bsr.indices lists a column block twice"):
        ji.BlockSparseAttention(HQ, HKV, D).plan(bsr)


def test_merges_of_nothing_are_empty_states():
    o, lse = jnp.ones((0, HQ, D)), jnp.ones((0, HQ))
    out = ji.merge_state(ji.AttentionState(o, lse), ji.AttentionState(o, lse))
    assert out.o.shape == (0, HQ, D)
    out = ji.merge_states(ji.AttentionState(jnp.ones((3, 0, HQ, D)), jnp.ones((3, 0, HQ))))
    np.testing.assert_array_equal(out.o, 0)
    assert np.all(np.isneginf(out.lse)) and out.lse.shape == (3, HQ)
    out = ji.merge_state_varlen(ji.AttentionState(o, lse), np.zeros(3, np.int32))
    assert out.o.shape == (2, HQ, D) and np.all(np.isneginf(out.lse))
    out = ji.merge_state_varlen(ji.AttentionState(jnp.ones((2, HQ, D)), jnp.ones((2, HQ))), np.zeros(1, np.int32))
    assert out.o.shape == (0, HQ, D)


def test_get_batch_indices_positions_validates_concrete_arguments():
    ip, seq = np.array([0, 2, 3], np.int32), np.array([4, 1], np.int32)
    b, pos = ji.get_batch_indices_positions(ip, seq, 4)
    np.testing.assert_array_equal(b, [0, 0, 1, -1])
    np.testing.assert_array_equal(pos, [2, 3, 0, -1])
    with pytest.raises(ValueError, match="append_indptr must be non-decreasing"):
        ji.get_batch_indices_positions(np.array([0, 2, 1], np.int32), seq, 4)
    with pytest.raises(ValueError, match="seq_lens must be >="):
        ji.get_batch_indices_positions(ip, np.array([1, 1], np.int32), 4)
    with pytest.raises(ValueError, match="nnz = 2"):
        ji.get_batch_indices_positions(ip, seq, 2)
    b, pos = ji.get_batch_indices_positions(np.zeros(1, np.int32), np.zeros(0, np.int32), 3)  # batch 0
    np.testing.assert_array_equal(b, -1)


# ---------------------------------------------------------------- append_paged_kv_cache
def test_append_invalid_rows_raise_when_concrete_and_are_dropped_under_jit(rng):
    """Concrete arguments: ValueError naming the argument. Under jit: every invalid row writes
    nothing (in particular never another request's page) and the valid rows land."""
    page, num_pages = 4, 6
    cache = random_cache(rng, num_pages, page, HKV, D, jnp.float32)
    kv_indptr = np.array([0, 2, 3, 4], np.int32)
    kv_indices = np.array([3, 6, 5, -1], np.int32)  # request 0: pages 3, 6 (outside); 1: 5; 2: -1
    batch = np.array([0, 1, 0, 2, 3, 1, 0, -1], np.int32)
    pos = np.array([2, 3, 5, 0, 0, -1, 8, 0], np.int32)
    errors = {2: "kv_indices holds page ids outside",   # page 6
              3: "kv_indices holds page ids outside",   # page -1 (would wrap to page 5)
              4: "batch_indices holds requests outside",  # request 3 of 3
              5: "positions must be >= 0",
              6: "positions lie past the pages"}        # entry 2 is request 1's page 5
    k_new, v_new = randn(rng, (8, HKV, D), jnp.float32), randn(rng, (8, HKV, D), jnp.float32)
    for row, message in errors.items():
        with pytest.raises(ValueError, match=message):
            ji.append_paged_kv_cache(cache, k_new[row:row + 1], v_new[row:row + 1], batch[[row]], pos[[row]],
                                     kv_indices, kv_indptr)
    out = jax.jit(ji.append_paged_kv_cache)(cache, k_new, v_new, batch, pos, kv_indices, kv_indptr)
    want_k, want_v = np.array(cache.k_pages), np.array(cache.v_pages)
    want_k[3, 2], want_v[3, 2] = k_new[0], v_new[0]  # the two valid rows
    want_k[5, 3], want_v[5, 3] = k_new[1], v_new[1]
    np.testing.assert_array_equal(out.k_pages, want_k)
    np.testing.assert_array_equal(out.v_pages, want_v)
