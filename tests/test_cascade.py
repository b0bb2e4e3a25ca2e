"""Cascade attention (shared prefix + unique suffix levels) against single-format attention."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from helpers import randn, random_cache, rel_err
from jaxinfer import reference as ref
from jaxinfer import dispatch
from jaxinfer.prefill import auto_cascade_levels
from planner import prefix as prefix_planner


def _shared_table(rng, batch, prefix_tokens, unique_tokens, page, sharing=None, extra=2):
    """Requests [0, sharing) share the first prefix_tokens (whole pages); the rest do not.
    Returns (indptr, indices, last, num_pages)."""
    sharing = batch if sharing is None else sharing
    pre_pages = prefix_tokens // page
    lens = [prefix_tokens + u for u in unique_tokens]
    npages = [-(-n // page) for n in lens]
    num_pages = pre_pages * (1 + batch - sharing) + sum(n - pre_pages for n in npages) + extra
    perm = iter(rng.permutation(num_pages).tolist())
    shared = [next(perm) for _ in range(pre_pages)]
    lists = []
    for b in range(batch):
        head = shared if b < sharing else [next(perm) for _ in range(pre_pages)]
        lists.append(head + [next(perm) for _ in range(npages[b] - pre_pages)])
    indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
    indices = np.concatenate([np.asarray(x, np.int32) for x in lists])
    last = np.array([n - (p - 1) * page for n, p in zip(lens, npages)], np.int32)
    return indptr, indices, last, num_pages


CASES = [  # (batch, unique kv, prefix, (Hq, Hkv), head_dim, page, qo_len)
    (12, 17, 128, (8, 8), 64, 16, 1),
    (17, 37, 512, (32, 8), 128, 16, 1),
    (12, 37, 128, (32, 8), 64, 1, 1),
    (12, 17, 128, (8, 8), 128, 16, 5),    # append: several causal queries per request
]


# All under slow: two-level cascades run by default through MultiLevelCascadeAttention in
# test_changing_prefix_structure_compiles_once (decode rows, levels from two_level_cascade), the
# decode wrapper's in test_decode_auto_cascade (bf16, 32 / 8 heads at d128) and the prefill
# wrapper's with several causal queries a request in
# test_prefill_auto_cascade_shares_only_keys_before_the_queries.
@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_two_level_cascade_equals_single_format(rng, case):
    batch, unique, prefix, (hq, hkv), d, page, qo = case
    uniq = rng.integers(1, unique + 1, batch)
    indptr, indices, last, num_pages = _shared_table(rng, batch, prefix, uniq, page)
    cache = random_cache(rng, num_pages, page, hkv, d, jnp.bfloat16)
    qo_indptr = (np.arange(batch + 1) * qo).astype(np.int32)
    q = randn(rng, (qo_indptr[-1], hq, d), jnp.bfloat16)
    levels, saved = ji.two_level_cascade(qo_indptr, indptr, indices, last, page)
    if qo == 1:
        assert saved == (batch - 1) * (prefix // page)
    else:  # causal: a page is shared only if it lies before all of the request's queries
        assert 0 < saved <= (batch - 1) * (prefix // page)
    cas = ji.MultiLevelCascadeAttention(2, hq, hkv, d, page, num_ctas=8)
    o, lse = cas.run(q, cache, cas.plan(levels, num_pages=num_pages), return_lse=True)
    want = ref.paged_attention(q, cache, qo_indptr, indptr, indices, last, causal=True)
    assert rel_err(o, want.o) < 2e-2
    np.testing.assert_allclose(lse, want.lse, rtol=2e-3, atol=2e-3)


@pytest.mark.slow  # every level runs the two-level path's kernels and merge (the default tests above and below)
def test_three_levels_and_partial_sharing(rng):
    """Level 0: a prefix shared by all; level 1: a second prefix shared by a sub-group; level 2: suffixes."""
    page, hq, hkv, d = 4, 8, 2, 64
    batch = 6
    cache = random_cache(rng, 60, page, hkv, d, jnp.float32)
    perm = rng.permutation(60).astype(np.int32)
    sys_pages, sub_pages = perm[:5], perm[5:8]
    own = [perm[8 + 3 * b: 11 + 3 * b] for b in range(batch)]
    lists = [np.concatenate([sys_pages, sub_pages if b < 3 else [], own[b]]) for b in range(batch)]
    last = rng.integers(1, page + 1, batch).astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum([len(x) for x in lists])]).astype(np.int32)
    indices = np.concatenate(lists).astype(np.int32)
    q = randn(rng, (batch, hq, d), jnp.float32)
    full = np.full
    levels = [
        ji.CascadeLevel(np.array([0, batch], np.int32), np.array([0, 5], np.int32), sys_pages, full(1, page, np.int32)),
        ji.CascadeLevel(np.array([0, 3, 6], np.int32), np.array([0, 3, 3], np.int32), sub_pages, full(2, page, np.int32)),
        ji.CascadeLevel(np.arange(batch + 1, dtype=np.int32), (np.arange(batch + 1) * 3).astype(np.int32),
                        np.concatenate(own).astype(np.int32), last),
    ]
    cas = ji.MultiLevelCascadeAttention(3, hq, hkv, d, page, num_ctas=4)
    o = cas.run(q, cache, cas.plan(levels, num_pages=cache.num_pages))
    want = ref.decode(q, cache, indptr, indices, last)
    assert rel_err(o, want.o) < 2e-5
    # Only requests 0-2 share more than the system prompt: detection finds the bigger group.
    levels2, saved = ji.two_level_cascade(np.arange(batch + 1, dtype=np.int32), indptr, indices, last, page)
    np.testing.assert_array_equal(levels2[0].qo_indptr, [0, 3, 6])
    assert saved == 2 * 8 + 2 * 5


@pytest.mark.parametrize("batch, prefix, pays", [
    (16, 8192, True), (64, 8192, True), (64, 32768, True),  # the rows: cascade measured faster
    (64, 128, False), (16, 512, False), (64, 1024, False), (8, 2048, False)])  # measured slower
def test_auto_cascade_cost_model_matches_h100_measurements(batch, prefix, pays):
    """plan(cascade="auto") picks what was faster on the H100 (BENCHMARKS.md, cascade)."""
    page, suffix = 16, 128
    npre, nsuf = prefix // page, suffix // page
    lists = [np.concatenate([np.arange(npre), npre + b * nsuf + np.arange(nsuf)]) for b in range(batch)]
    indptr = (np.arange(batch + 1) * (npre + nsuf)).astype(np.int32)
    levels = auto_cascade_levels(np.arange(batch + 1, dtype=np.int32), indptr,
                                 np.concatenate(lists).astype(np.int32), np.full(batch, page, np.int32),
                                 page, causal=False,
                                 problem=dispatch.Problem("decode", 32, 8, 128, "paged", page))
    assert (levels is not None) == pays


def test_decode_auto_cascade(rng, monkeypatch):
    # Small enough for interpret mode, where the H100 calibration would keep single format:
    # make the cascade free of fixed overhead so the auto path runs.
    monkeypatch.setattr(prefix_planner, "CASCADE_OVERHEAD_US", 0.0)
    monkeypatch.setattr(prefix_planner, "MARGIN", 1.0)
    page, hq, hkv, d, batch = 16, 32, 8, 128, 12
    indptr, indices, last, num_pages = _shared_table(rng, batch, 1024, rng.integers(1, 40, batch), page)
    cache = random_cache(rng, num_pages, page, hkv, d, jnp.bfloat16)
    q = randn(rng, (batch, hq, d), jnp.bfloat16)
    dec = ji.BatchDecodeWithPagedKVCache(hq, hkv, d, page, num_ctas=8)
    plan = dec.plan(indptr, indices, last, num_pages=num_pages, cascade="auto")
    assert isinstance(plan, ji.CascadePlan)
    o = jax.jit(dec.run)(q, cache, plan)
    assert rel_err(o, ref.decode(q, cache, indptr, indices, last).o) < 2e-2
    # No sharing: the planner keeps the single format.
    indptr2, indices2, last2, n2 = _shared_table(rng, batch, 1024, rng.integers(1, 40, batch), page, sharing=1)
    assert isinstance(dec.plan(indptr2, indices2, last2, num_pages=n2, cascade="auto"), ji.DecodePlan)
    with pytest.raises(ValueError, match="cascade"):
        dec.plan(indptr, indices, last, num_pages=num_pages, cascade="always")


def test_prefill_auto_cascade_shares_only_keys_before_the_queries(rng):
    page, hq, hkv, d, batch = 4, 8, 2, 64, 5
    indptr, indices, last, num_pages = _shared_table(rng, batch, 64, rng.integers(1, 9, batch), page)
    cache = random_cache(rng, num_pages, page, hkv, d, jnp.float32)
    qo = np.array([3, 1, 6, 2, 4])
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    q = randn(rng, (qo_indptr[-1], hq, d), jnp.float32)
    pre = ji.BatchPrefillWithPagedKVCache(hq, hkv, d, page, num_ctas=4)
    levels, saved = ji.two_level_cascade(qo_indptr, indptr, indices, last, page)
    assert 0 < saved <= (batch - 1) * (64 // page)  # causal: only pages before all of a request's queries
    plan = ji.CascadePlan((pre.plan(*levels[0], num_pages=num_pages, causal=False), pre.plan(*levels[1], num_pages=num_pages)))
    o = pre.run(q, cache, plan)
    assert rel_err(o, ref.paged_attention(q, cache, qo_indptr, indptr, indices, last, causal=True).o) < 2e-5


def test_changing_prefix_structure_compiles_once(rng):
    page, hq, hkv, d, bmax = 4, 8, 2, 64, 6
    cas = ji.MultiLevelCascadeAttention(2, hq, hkv, d, page, causal=False, num_ctas=4, tile_rows=16,
                                        max_batch_size=bmax, max_num_tokens=bmax, max_num_pages=80)
    run = jax.jit(cas.run)
    for step in range(6):
        batch = int(rng.integers(2, bmax + 1))
        sharing = int(rng.integers(1, batch + 1))
        indptr, indices, last, num_pages = _shared_table(rng, batch, 4 * int(rng.integers(1, 6)),
                                                         rng.integers(1, 9, batch), page, sharing, extra=0)
        assert num_pages <= 80
        cache = random_cache(rng, 80, page, hkv, d, jnp.float32)
        q_rows = np.arange(batch + 1, dtype=np.int32)
        levels, _ = ji.two_level_cascade(q_rows, indptr, indices, last, page, causal=False)
        q = randn(rng, (bmax, hq, d), jnp.float32)
        o = run(q, cache, cas.plan(levels, num_pages=80))
        want = ref.decode(q[:batch], cache, indptr, indices, last)
        assert rel_err(o[:batch], want.o) < 2e-5
    assert run._cache_size() == 1


def test_cascade_rejects_bad_levels(rng):
    cas = ji.MultiLevelCascadeAttention(2, 8, 2, 64, 4, num_ctas=4)
    lvl = ji.CascadeLevel(np.array([0, 2], np.int32), np.array([0, 1], np.int32), np.array([0], np.int32),
                          np.array([4], np.int32))
    with pytest.raises(ValueError, match="levels must hold 2"):
        cas.plan([lvl], num_pages=64)
    other = ji.CascadeLevel(np.array([0, 3], np.int32), *lvl[1:])
    with pytest.raises(ValueError, match="covers 3 rows"):
        cas.plan([lvl, other], num_pages=64)
