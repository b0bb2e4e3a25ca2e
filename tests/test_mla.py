"""BatchMLAPagedAttention (interpret mode, the real kernel) against a float64 NumPy oracle.

Runners are cached per (heads, page size, causal, dtype) with fixed capacities, so each compiles
once and serves every step of every test that uses it (also the compile-once test's claim).
"""
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer.reference as ref
from jaxinfer import dispatch, mla_ragged
from jaxinfer.mla import BatchMLAPagedAttention, MLAPlan
from pallas_kernels.mla import MLAConfig
from planner import mla as mla_planner

CKV, KPE, SCALE = 512, 64, 0.1352
CAPS = dict(max_batch_size=6, max_num_tokens=16)
# Steps (qo_lens, kv_lens): decode with kv 1 and 300 (split), a request with no keys, a mixed step
# with causal rows that see no key (qo 4 > kv 2) and a request without query rows.
DECODE = ([1, 1, 1, 1, 1], [1, 300, 64, 0, 129])
MIXED = ([3, 1, 0, 5, 2, 4], [3, 257, 40, 1, 70, 2])
SMALL = ([1, 2, 1], [1, 70, 0])  # for 128 heads


def _num_pages(page_size):
    return 700 // page_size + 8  # every step's pages plus unlisted ones


def runner(num_heads, page_size, causal, scaled=False):
    """(wrapper, jitted run): run(q_nope, q_pe, ckv, kpe, plan) or, scaled, (..., plan, ckv_scale=, kpe_scale=)."""
    return _runner(num_heads, page_size, causal, scaled)


@functools.lru_cache(maxsize=None)
def _runner(num_heads, page_size, causal, scaled):
    mla = BatchMLAPagedAttention(num_heads, CKV, KPE, page_size, causal=causal, sm_scale=SCALE,
                                 max_num_pages=_num_pages(page_size), config=MLAConfig(num_cells=3, min_chunk=64),
                                 **CAPS)
    if scaled:
        return mla, jax.jit(lambda *args, ckv_scale, kpe_scale: mla.run(
            *args, return_lse=True, ckv_scale=ckv_scale, kpe_scale=kpe_scale))
    return mla, jax.jit(lambda *args: mla.run(*args, return_lse=True))


def step(rng, qo_lens, kv_lens, page_size, num_pages=None):
    """Host page table of a step: (qo_indptr, kv_indptr, kv_indices, kv_len), random page order."""
    qo_lens, kv_lens = np.asarray(qo_lens, np.int32), np.asarray(kv_lens, np.int32)
    pages = -(-kv_lens // page_size)
    kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    kv_indices = rng.permutation(num_pages or _num_pages(page_size))[:kv_indptr[-1]].astype(np.int32)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    return qo_indptr, kv_indptr, kv_indices, kv_lens


def inputs(rng, num_tokens, num_heads, page_size, dtype, cache_dtype=None):
    """q_nope, q_pe in dtype; ckv, kpe in cache_dtype (default dtype; fp8: 3 x normal, stored values
    up to ~15, for scales about 1 / 3)."""
    n = _num_pages(page_size)
    shapes = ((num_tokens, num_heads, CKV), (num_tokens, num_heads, KPE), (n, page_size, CKV), (n, page_size, KPE))
    out = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    wide = 3.0 if jnp.dtype(cache_dtype).itemsize == 1 else 1.0
    return [out[0].astype(dtype), out[1].astype(dtype), (wide * out[2]).astype(cache_dtype),
            (wide * out[3]).astype(cache_dtype)]


def oracle(q_nope, q_pe, ckv, kpe, qo_indptr, kv_indptr, kv_indices, kv_len, causal):
    """float64 MLA: (o [T, H, CKV], lse [T, H]); rows past the step and rows with no key: 0, -inf."""
    q_nope, q_pe, ckv, kpe = (np.asarray(x, np.float64) for x in (q_nope, q_pe, ckv, kpe))
    t, h, _ = q_nope.shape
    o, lse = np.zeros((t, h, CKV)), np.full((t, h), -np.inf)
    for b in range(len(kv_len)):
        qs, qe, n = qo_indptr[b], qo_indptr[b + 1], int(kv_len[b])
        pages = kv_indices[kv_indptr[b]:kv_indptr[b + 1]]
        c, r = ckv[pages].reshape(-1, CKV)[:n], kpe[pages].reshape(-1, KPE)[:n]
        s = (np.einsum("qhd,kd->qhk", q_nope[qs:qe], c) + np.einsum("qhd,kd->qhk", q_pe[qs:qe], r)) * SCALE
        if causal:
            s = np.where(np.arange(n)[None, None, :] <= np.arange(qe - qs)[:, None, None] + n - (qe - qs), s, -np.inf)
        seen = np.isfinite(s).any(-1)  # [q, H]
        m = np.where(seen, s.max(-1, initial=-np.inf), 0.0)
        w = np.exp(s - m[..., None])
        den = w.sum(-1)
        o[qs:qe] = np.einsum("qhk,kd->qhd", w, c) / np.where(seen, den, 1.0)[..., None]
        lse[qs:qe] = np.where(seen, np.log(np.where(seen, den, 1.0)) + m, -np.inf)
    return o, lse


def check(out, want, tol):
    o, lse = (np.asarray(x, np.float64) for x in out)
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want[1]))
    np.testing.assert_array_equal(o[np.isneginf(want[1])], 0.0)
    assert np.linalg.norm(o - want[0]) <= tol * np.linalg.norm(want[0])
    fin = np.isfinite(want[1])
    np.testing.assert_allclose(lse[fin], want[1][fin], rtol=tol, atol=tol)


def _poison(q_nope, q_pe, ckv, kpe, table, kv_lens, page_size):
    """NaN (in place) in unlisted pages, each last page's slots past kv_len and q's rows past the step."""
    listed = np.zeros(ckv.shape[:2], bool)
    for b in range(len(kv_lens)):
        pages = table[2][table[1][b]:table[1][b + 1]]
        listed.reshape(-1)[(pages[:, None] * page_size + np.arange(page_size)).reshape(-1)[:kv_lens[b]]] = True
    ckv[~listed], kpe[~listed] = np.nan, np.nan
    q_nope[table[0][-1]:], q_pe[table[0][-1]:] = np.nan, np.nan


def run_step(rng, num_heads, page_size, causal, qo_lens, kv_lens, dtype="float32", poison=False,
             cache_dtype=None, scales=None):
    """Runs one step on the cached runner; returns (output, float64 oracle on the clean cache,
    dequantized with scales = (ckv_scale, kpe_scale) when given)."""
    mla, run = runner(num_heads, page_size, causal, scales is not None)
    table = step(rng, qo_lens, kv_lens, page_size)
    q_nope, q_pe, ckv, kpe = inputs(rng, CAPS["max_num_tokens"], num_heads, page_size, jnp.dtype(dtype),
                                    cache_dtype and jnp.dtype(cache_dtype))
    c_scale, k_scale = (1.0, 1.0) if scales is None else scales
    want = oracle(q_nope, q_pe, np.asarray(ckv, np.float64) * c_scale, np.asarray(kpe, np.float64) * k_scale,
                  *table, causal)
    if poison:
        _poison(q_nope, q_pe, ckv, kpe, table, kv_lens, page_size)
    plan = mla.plan(*table, num_pages=ckv.shape[0])
    kw = {} if scales is None else dict(ckv_scale=jnp.float32(c_scale), kpe_scale=jnp.float32(k_scale))
    return run(*map(jnp.asarray, (q_nope, q_pe, ckv, kpe)), plan, **kw), want


# Default: 8 heads, page 1, causal; under slow the rest (16 heads run by default in the fp8 and
# Mosaic tests, page 64 and non-causal steps in test_one_compilation_across_steps, 128 heads in
# test_128_heads_small_kv).
@pytest.mark.parametrize("num_heads,page_size,causal", [
    (8, 1, True), pytest.param(16, 64, True, marks=pytest.mark.slow), pytest.param(16, 16, False, marks=pytest.mark.slow),
    pytest.param(8, 64, False, marks=pytest.mark.slow)])
def test_matches_float64_reference(rng, num_heads, page_size, causal):
    for qo_lens, kv_lens in (DECODE, MIXED):
        out, want = run_step(rng, num_heads, page_size, causal, qo_lens, kv_lens)
        check(out, want, 2e-5)


def test_128_heads_small_kv(rng):
    out, want = run_step(rng, 128, 64, True, *SMALL)
    check(out, want, 2e-5)


@pytest.mark.slow  # bfloat16 latent caches run by default in the Mosaic kernel tests and test_fp8_latent_cache_with_scales
def test_bfloat16(rng):
    out, want = run_step(rng, 16, 64, True, *MIXED, dtype="bfloat16")
    check(out, want, 2e-2)


@pytest.mark.parametrize("dtype,tol", [("bfloat16", 8e-3), pytest.param("float16", 1e-3, marks=pytest.mark.slow)])
def test_fp8_latent_cache_with_scales(rng, dtype, tol):
    """e4m3 ckv / kpe with their own scales (data: one compilation for both pairs), NaN in unlisted
    pages, against float64 on the dequantized cache; o in q's dtype."""
    _, run = runner(16, 16, True, True)
    sizes = []
    for (qo_lens, kv_lens), scales in ((DECODE, (0.31, 0.47)), (MIXED, (0.6, 0.2))):
        out, want = run_step(rng, 16, 16, True, qo_lens, kv_lens, dtype, poison=True,
                             cache_dtype="float8_e4m3fn", scales=scales)
        assert out.o.dtype == jnp.dtype(dtype)
        check(out, want, tol)
        sizes.append(run._cache_size())
    assert sizes[0] == sizes[1]


# Under slow: fp8 caches run by default with their scales (above); a cache read unscaled in every other test.
@pytest.mark.slow
def test_fp8_latent_cache_without_scales(rng):
    """An fp8 cache without scales reads its values as they are (scale 1)."""
    out, want = run_step(rng, 16, 64, True, *MIXED, "bfloat16", cache_dtype="float8_e4m3fn")
    check(out, want, 8e-3)


# Under slow: NaN in unlisted pages, stale slots and padding rows run by default in
# test_one_compilation_across_steps (non-causal steps) and test_fp8_latent_cache_with_scales (pages of 16).
@pytest.mark.slow
def test_nan_in_unlisted_pages_stale_slots_and_padding_rows(rng):
    for qo_lens, kv_lens in (DECODE, MIXED):
        out, want = run_step(rng, 16, 16, False, qo_lens, kv_lens, poison=True)
        check(out, want, 2e-5)


def test_empty_requests_and_masked_rows_give_zero_and_neg_inf(rng):
    # kv 0; causal rows before the first key (qo 3 > kv 1); an empty step (all rows padding)
    for qo_lens, kv_lens in (([2, 3, 1], [0, 1, 5]), ([], [])):
        (o, lse), want = run_step(rng, 8, 1, True, qo_lens, kv_lens)
        check((o, lse), want, 2e-5)
        dead = np.isneginf(want[1])
        assert dead.sum() >= 3 * 8 and np.all(np.asarray(o)[dead] == 0)


def test_one_compilation_across_steps(rng):
    """Four steps (decode with a split request, the mixed step, an empty step, one full request)
    through one program (page 64, non-causal); NaN in unlisted pages, stale slots and q's padding
    rows never reach o."""
    mla, run = runner(8, 64, False)
    assert mla.plan(*step(rng, *DECODE, 64), num_pages=_num_pages(64)).info["num_split"] > 0  # merges run
    for qo_lens, kv_lens in (DECODE, MIXED, ([], []), ([16], [16])):
        out, want = run_step(rng, 8, 64, False, qo_lens, kv_lens, poison=True)
        check(out, want, 2e-5)
    assert run._cache_size() == 1


def test_without_capacities_and_empty_step(rng):
    mla = BatchMLAPagedAttention(16, CKV, KPE, 16, causal=True, sm_scale=SCALE, config=MLAConfig(num_cells=2))
    table = step(rng, *MIXED, 16)
    q_nope, q_pe, ckv, kpe = inputs(rng, int(table[0][-1]), 16, 16, np.float32)
    out = mla.run(*map(jnp.asarray, (q_nope, q_pe, ckv, kpe)), mla.plan(*table, num_pages=ckv.shape[0]),
                  return_lse=True)
    check(out, oracle(q_nope, q_pe, ckv, kpe, *table, True), 2e-5)
    empty = step(rng, [0, 0], [3, 0], 16)
    o = mla.run(jnp.zeros((0, 16, CKV)), jnp.zeros((0, 16, KPE)), ckv, kpe, mla.plan(*empty, num_pages=ckv.shape[0]))
    assert o.shape == (0, 16, CKV)


def test_reference_matches_oracle(rng):
    table = step(rng, [2, 3, 1], [0, 40, 2], 16)
    q_nope, q_pe, ckv, kpe = inputs(rng, int(table[0][-1]), 4, 16, np.float32)
    reference = jax.jit(lambda *x: ref.mla_reference(*x, *table, causal=True, sm_scale=SCALE))  # one program
    got = reference(*map(jnp.asarray, (q_nope, q_pe, ckv, kpe)))
    check(got, oracle(q_nope, q_pe, ckv, kpe, *table, True), 1e-5)
    ckv8, kpe8 = (jnp.asarray(x * 3, jnp.float8_e4m3fn) for x in (ckv, kpe))
    got = jax.jit(lambda *x: ref.mla_reference(*x, *table, causal=True, sm_scale=SCALE, ckv_scale=0.3, kpe_scale=0.5))(
        *map(jnp.asarray, (q_nope, q_pe)), ckv8, kpe8)
    want = oracle(q_nope, q_pe, np.asarray(ckv8, np.float64) * 0.3, np.asarray(kpe8, np.float64) * 0.5, *table, True)
    check(got, want, 1e-5)


def test_plan_is_a_pytree_bound_to_its_wrapper(rng):
    mla, _ = runner(16, 64, True)
    table = step(rng, *DECODE, 64)
    plan = mla.plan(*table, num_pages=_num_pages(64))
    leaves, tree = jax.tree_util.tree_flatten(plan)
    again = jax.tree_util.tree_unflatten(tree, leaves)
    assert isinstance(again, MLAPlan) and again.spec == plan.spec and plan.impl == "mla_triton"
    q_nope, q_pe, ckv, kpe = (jnp.asarray(x) for x in inputs(rng, 16, 16, 64, np.float32))
    other = BatchMLAPagedAttention(8, CKV, KPE, 64, causal=True, sm_scale=SCALE, **CAPS,
                                   max_num_pages=_num_pages(64))
    with pytest.raises(ValueError, match="num_qo_heads"):
        other.run(q_nope[:, :8], q_pe[:, :8], ckv, kpe, plan)
    with pytest.raises(ValueError, match="ckv_cache"):
        mla.run(q_nope, q_pe, ckv[:3], kpe[:3], plan)


def test_planner_covers_every_visible_key_once(rng):
    """Each query row meets each key it may see in exactly one item (split or not), and is written
    once (by its item, or by the merge of its tile's chunks), padding rows too; under capacities."""
    for _ in range(20):
        batch = int(rng.integers(0, 6))
        qo, kv = rng.integers(0, 6, batch).astype(np.int32), rng.integers(0, 400, batch).astype(np.int32)
        h, page, causal = int(rng.choice([8, 16, 20, 64])), int(rng.choice([1, 16, 64])), bool(rng.integers(2))
        check_plan_covers(rng, qo, kv, h, page, causal)


def test_planner_cuts_skewed_lengths_into_equal_shares(rng):
    """One long request beside short ones, fewer tiles than cells: one wave would run the long tile
    whole on one cell, so the plan cuts the tiles' blocks into the cells' equal shares (each cell's
    items within an item's cost of its share), every key still met once."""
    for h, causal in ((64, True), (16, False)):
        qo, kv = np.array([1, 1, 1, 1], np.int32), np.array([390, 10, 20, 5], np.int32)
        sec, info, cells = check_plan_covers(rng, qo, kv, h, 16, causal, capacities=False)
        assert info["chunk"] is None and info["num_split"] == 1
        ip, items = sec["cell_indptr"], sec["items"]
        keys = items[:ip[-1], mla_planner.COLUMNS.index("kv_end")] - items[:ip[-1], mla_planner.COLUMNS.index("kv_start")]
        cost = np.add.reduceat(-(-keys // 64) + 1, ip[:-1][np.diff(ip) > 0])  # blocks + an item's cost a piece
        assert np.diff(ip).min() >= 1 and cost.max() <= -(-(7 + 3 + 4) // cells) + 1


@pytest.mark.parametrize("impl", ["triton", "mosaic"])
def test_kernels_on_equal_shares(rng, impl):
    """A plan cut into equal shares (one long request beside short ones on three cells: pieces
    that start and end mid-page, several tiles' pieces on one cell) against the float64 oracle,
    NaN in unlisted pages and stale slots; the Triton kernel in interpret mode, the Mosaic one in
    its interpreter (64 heads, bf16)."""
    heads, dtype, tol = (16, np.float32, 2e-5) if impl == "triton" else (64, jnp.bfloat16, 1e-2)
    mla = BatchMLAPagedAttention(heads, CKV, KPE, 64, causal=True, sm_scale=SCALE, impl=impl,
                                 config=MLAConfig(num_cells=3, min_chunk=64))
    qo_lens, kv_lens = [1, 1, 1], [600, 5, 70]
    table = step(rng, qo_lens, kv_lens, 64)
    plan = mla.plan(*table, num_pages=_num_pages(64))
    assert plan.info["chunk"] is None and plan.info["num_split"] == 1  # (equal shares, not one wave)
    q_nope, q_pe, ckv, kpe = (np.array(jnp.asarray(x, dtype), np.float32)  # (writable: poisoned below)
                              for x in inputs(rng, sum(qo_lens), heads, 64, np.float32))
    want = oracle(q_nope, q_pe, ckv, kpe, *table, True)
    _poison(q_nope, q_pe, ckv, kpe, table, kv_lens, 64)
    check(mla.run(*(jnp.asarray(x, dtype) for x in (q_nope, q_pe, ckv, kpe)), plan, return_lse=True), want, tol)


def check_plan_covers(rng, qo, kv, h, page, causal, capacities=True, cells=5):
    """Plans the step on `cells` cells (under capacities: 6 requests, 30 tokens) and checks the
    coverage above. Returns (the plan's sections, its info, cells)."""
    tile_merge = h == 64  # the Mosaic kernel's plans: 64-row tiles, split tiles merged whole
    table = step(rng, qo, kv, page, num_pages=2000)
    caps = dict(max_batch_size=6, max_num_tokens=30, max_num_pages=2000) if capacities else {}
    layout, buf, info = mla_planner.plan(*table, page_size=page, num_heads=h, num_cells=cells,
                                         block_rows=mla_planner.block_rows_for(h, 4), causal=causal,
                                         min_chunk=64, tile_merge=tile_merge, **caps)
    t_cap = 30 if capacities else int(np.sum(qo))
    sec = layout.named([buf[a:b] for a, b in layout.offsets.values()])
    assert sec["cell_indptr"][-1] == info["num_items"] <= layout.item_cap
    seen, written = np.zeros((t_cap * h, 400), np.int64), np.zeros(t_cap * h, np.int64)
    parts = np.zeros(layout.part_cap, np.int64)  # partial rows: each written once
    for it in mla_planner.work_items(sec["items"][:info["num_items"]]):
        for r in range(it.rows):
            last = it.first_pos + (it.row_start + r) // h if causal else 400
            seen[it.q_row + r, it.kv_start:max(min(it.kv_end, last + 1), it.kv_start)] += 1
            if it.part_base >= 0:
                parts[it.part_base + r * it.part_stride] += 1
        if it.part_base < 0:
            written[it.q_row:it.q_row + it.rows] += 1
    assert parts.max(initial=0) <= 1
    dest = sec["merge_dest"][:info["num_groups"]]
    if tile_merge:  # group g: whole tile dest[g] (rows 64 dest .. 64 dest + 63), parts in tile units
        m = layout.block_rows
        for g in np.flatnonzero(dest >= 0):
            written[dest[g] * m:(dest[g] + 1) * m] += 1
            lo, hi = sec["merge_indptr"][g:g + 2]
            np.testing.assert_array_equal(parts[lo * m:hi * m], 1)
    else:
        np.add.at(written, dest[dest >= 0], 1)
    np.testing.assert_array_equal(written, 1)
    want = np.zeros_like(seen)
    for b in range(qo.shape[0]):
        for t in range(qo[b]):
            row = (table[0][b] + t) * h
            want[row:row + h, :max(min(kv[b], kv[b] - qo[b] + t + 1) if causal else kv[b], 0)] = 1
    np.testing.assert_array_equal(seen, want)
    return sec, info, cells


@pytest.mark.parametrize("bad,match", [
    (dict(num_heads=0), "num_heads"), (dict(head_dim_ckv=500), "head_dim_ckv"), (dict(head_dim_kpe=8), "head_dim_kpe"),
    (dict(page_size=0), "page_size"), (dict(sm_scale=None), "sm_scale"), (dict(sm_scale=-1.0), "sm_scale"),
    (dict(max_num_tokens=0), "max_num_tokens")])
def test_bad_wrapper_arguments(bad, match):
    args = dict(num_heads=16, head_dim_ckv=CKV, head_dim_kpe=KPE, page_size=16, sm_scale=SCALE) | bad
    with pytest.raises(ValueError, match=match):
        BatchMLAPagedAttention(args.pop("num_heads"), args.pop("head_dim_ckv"), args.pop("head_dim_kpe"),
                               args.pop("page_size"), **args)


def test_bad_plan_and_run_inputs(rng):
    mla, _ = runner(16, 64, True)
    qo_indptr, kv_indptr, kv_indices, kv_len = step(rng, *DECODE, 64)
    n = _num_pages(64)
    bad_plans = [
        (dict(qo_indptr=qo_indptr.astype(np.int64)), "qo_indptr"), (dict(qo_indptr=qo_indptr[:-1]), "qo_indptr"),
        (dict(kv_indptr=kv_indptr[::-1].copy()), "kv_indptr"), (dict(kv_indices=list(kv_indices)), "kv_indices"),
        (dict(kv_indices=np.full_like(kv_indices, n)), "kv_indices"), (dict(kv_len=kv_len + 64), "kv_len"),
        (dict(kv_len=kv_len[:-1]), "kv_len"), (dict(qo_indptr=(np.arange(6) * 4).astype(np.int32)), "max_num_tokens")]
    for bad, match in bad_plans:
        args = dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len=kv_len) | bad
        with pytest.raises(ValueError, match=match):
            mla.plan(*args.values(), num_pages=n)
    with pytest.raises(ValueError, match="num_pages"):
        mla.plan(qo_indptr, kv_indptr, kv_indices, kv_len)
    plan = mla.plan(qo_indptr, kv_indptr, kv_indices, kv_len, num_pages=n)
    good = [jnp.asarray(x) for x in inputs(rng, 16, 16, 64, np.float32)]
    names = ("q_nope", "q_pe", "ckv_cache", "kpe_cache")
    for i, name in enumerate(names):
        for bad in (good[i].astype(jnp.float16), good[i][..., :16], good[i].astype(jnp.float8_e4m3fn)):
            args = list(good)
            args[i] = bad
            with pytest.raises(ValueError, match=name):
                mla.run(*args, plan)
    with pytest.raises(ValueError, match="float64"):
        mla.run(np.asarray(good[0], np.float64), *good[1:], plan)
    fp8 = [x.astype(jnp.float8_e4m3fn) for x in good[2:]]
    with pytest.raises(ValueError, match="ckv_cache"):  # fp8 under a float32 q
        mla.run(*good[:2], *fp8, plan)
    with pytest.raises(ValueError, match="kpe_cache"):  # caches of two dtypes
        mla.run(*(x.astype(jnp.bfloat16) for x in good[:2]), fp8[0], good[3].astype(jnp.bfloat16), plan)
    for bad in (-1.0, 0.0, float("nan"), np.ones(2), jnp.ones(2), "1", jnp.int32(2)):
        for name in ("ckv_scale", "kpe_scale"):
            with pytest.raises(ValueError, match=name):
                mla.run(*good, plan, **{name: bad})
    with pytest.raises(ValueError, match="causal"):
        runner(16, 64, False)[0].run(*good, plan)


@functools.lru_cache(maxsize=None)
def _mosaic_runner():
    """The Mosaic GPU kernel (64 heads, page 64, causal, bf16) in the Mosaic GPU interpreter."""
    mla = BatchMLAPagedAttention(64, CKV, KPE, 64, causal=True, sm_scale=SCALE, impl="mosaic",
                                 max_num_pages=_num_pages(64), config=MLAConfig(num_cells=3, min_chunk=64), **CAPS)
    return mla, jax.jit(lambda *args: mla.run(*args, return_lse=True))


def _same_program(*plans):
    """Plans of one pytree structure (static data included) and leaf shapes: one jitted program."""
    keys = {(jax.tree_util.tree_structure(p), tuple((x.shape, x.dtype) for x in jax.tree_util.tree_leaves(p)))
            for p in plans}
    return len(keys) == 1


# The Mosaic GPU interpreter compiles its warpgroups' programs again at every call (seconds each),
# jitted or not: by default the tests below run one step and check that the other step's plan is
# the same program (pytree structure and shapes, what jit's cache keys on); under slow they run both.
# Under slow: the mixed causal step's rows (no visible key, split decode rows, NaN, padding) and one
# program for two steps run by default in test_mosaic_kernel_one_token_tiles_under_capacities and
# test_mosaic_kernel_several_tokens_per_tile.
@pytest.mark.slow
@pytest.mark.parametrize("run_both", [False, True])
def test_mosaic_kernel_matches_float64_reference_once_compiled(rng, run_both):
    """The Hopper row in the interpreter: decode with a split request and one without keys (run
    under slow; by default its plan only, the mixed step's program), then a mixed causal step
    (rows that see no key, a request without rows, a split decode row), NaN in unlisted pages,
    stale slots and padding rows; one compilation serves both steps."""
    mla, run = _mosaic_runner()
    tables = [step(rng, qo_lens, kv_lens, 64) for qo_lens, kv_lens in (DECODE, MIXED)]
    plans = [mla.plan(*table, num_pages=_num_pages(64)) for table in tables]
    assert _same_program(*plans)
    for (qo_lens, kv_lens), table, plan in list(zip((DECODE, MIXED), tables, plans))[0 if run_both else 1:]:
        assert plan.impl == "mla_mosaic" and plan.layout.tile_merge
        assert plan.info["num_split"] > 0  # merged whole tiles
        q_nope, q_pe, ckv, kpe = (np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
                                  for x in inputs(rng, CAPS["max_num_tokens"], 64, 64, np.float32))
        want = oracle(q_nope, q_pe, ckv, kpe, *table, True)
        _poison(q_nope, q_pe, ckv, kpe, table, kv_lens, 64)
        out = run(*(jnp.asarray(x, jnp.bfloat16) for x in (q_nope, q_pe, ckv, kpe)), plan)
        check(out, want, 1e-2)
    assert run._cache_size() == 1


def test_mosaic_kernel_several_tokens_per_tile(rng):
    """16 heads: each 64-row tile holds 4 tokens, masked row by row on their diagonals (causal),
    rows before the first key (qo 12 > kv 6) give 0 and -inf; the interpreter, bf16, split tiles,
    NaN in unlisted pages and stale slots."""
    mla = BatchMLAPagedAttention(16, CKV, KPE, 64, causal=True, sm_scale=SCALE, impl="mosaic",
                                 config=MLAConfig(num_cells=3, min_chunk=64))
    qo_lens, kv_lens = [4, 8, 12], [4, 300, 6]
    table = step(rng, qo_lens, kv_lens, 64)
    plan = mla.plan(*table, num_pages=_num_pages(64))
    assert plan.impl == "mla_mosaic" and plan.info["num_split"] > 0
    q_nope, q_pe, ckv, kpe = (np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
                              for x in inputs(rng, sum(qo_lens), 16, 64, np.float32))
    want = oracle(q_nope, q_pe, ckv, kpe, *table, True)
    _poison(q_nope, q_pe, ckv, kpe, table, kv_lens, 64)
    out = mla.run(*(jnp.asarray(x, jnp.bfloat16) for x in (q_nope, q_pe, ckv, kpe)), plan, return_lse=True)
    check(out, want, 1e-2)
    assert np.isneginf(want[1]).sum() == 6 * 16


@pytest.mark.slow  # one-token tiles run by default in test_mosaic_kernel_one_token_tiles_under_capacities
def test_mosaic_kernel_one_token_tiles(rng, num_heads=32, page_size=32):
    """Decode of 32 heads: tiles of one token (H rows; the wgmma's other rows stale, never stored),
    split tiles merged, a request without keys, pages of one block; the interpreter, bf16, NaN in
    unlisted pages, stale slots and padding rows (16 heads: the capacities test below)."""
    mla = BatchMLAPagedAttention(num_heads, CKV, KPE, page_size, sm_scale=SCALE, impl="mosaic",
                                 config=MLAConfig(num_cells=3, min_chunk=64))
    qo_lens, kv_lens = [1, 1, 1, 1], [300, 0, 65, 130]
    table = step(rng, qo_lens, kv_lens, page_size)
    plan = mla.plan(*table, num_pages=_num_pages(page_size))
    assert plan.impl == "mla_mosaic" and plan.layout.block_rows == num_heads and plan.info["num_split"] > 0
    q_nope, q_pe, ckv, kpe = (np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
                              for x in inputs(rng, sum(qo_lens), num_heads, page_size, np.float32))
    want = oracle(q_nope, q_pe, ckv, kpe, *table, False)
    _poison(q_nope, q_pe, ckv, kpe, table, kv_lens, page_size)
    out = mla.run(*(jnp.asarray(x, jnp.bfloat16) for x in (q_nope, q_pe, ckv, kpe)), plan, return_lse=True)
    check(out, want, 1e-2)
    assert np.isneginf(want[1]).sum() == num_heads


@pytest.mark.parametrize("run_both", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_mosaic_kernel_one_token_tiles_under_capacities(rng, run_both):
    """16 heads with max_num_tokens = max_batch_size: one program of one-token tiles for a decode
    step (run under slow; by default its plan only, the other step's program: split one-token
    tiles run in test_mosaic_kernel_one_token_tiles) and a step with a 3-token causal request
    (rows masked on their own tokens' diagonals by tile), NaN in unlisted pages, stale slots and
    padding rows; the interpreter, bf16."""
    caps = dict(max_batch_size=4, max_num_tokens=4, max_num_pages=_num_pages(64))
    mla = BatchMLAPagedAttention(16, CKV, KPE, 64, causal=True, sm_scale=SCALE, impl="mosaic",
                                 config=MLAConfig(num_cells=3, min_chunk=64), **caps)
    run = jax.jit(lambda *args: mla.run(*args, return_lse=True))
    steps = (([1, 1, 1], [300, 1, 65]), ([3, 1], [130, 0]))
    tables = [step(rng, qo_lens, kv_lens, 64) for qo_lens, kv_lens in steps]
    plans = [mla.plan(*table, num_pages=_num_pages(64)) for table in tables]
    assert _same_program(*plans)
    for (qo_lens, kv_lens), table, plan in list(zip(steps, tables, plans))[0 if run_both else 1:]:
        assert plan.impl == "mla_mosaic" and plan.layout.block_rows == 16
        q_nope, q_pe, ckv, kpe = (np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
                                  for x in inputs(rng, 4, 16, 64, np.float32))
        want = oracle(q_nope, q_pe, ckv, kpe, *table, True)
        _poison(q_nope, q_pe, ckv, kpe, table, kv_lens, 64)
        check(run(*(jnp.asarray(x, jnp.bfloat16) for x in (q_nope, q_pe, ckv, kpe)), plan), want, 1e-2)
    assert run._cache_size() == 1


def test_mosaic_row_is_chosen_where_it_runs(monkeypatch):
    """On Hopper, "auto" plans the Mosaic kernel for 16-bit caches at 64-multiple pages and 64-
    multiple heads or decode of fewer (one-token tiles), the Triton kernel otherwise (fp8 or
    float32 caches, page 16); run() refuses dtypes its plan's kernel does not take."""
    from jaxinfer import _backend
    monkeypatch.setattr(_backend, "mosaic_available", lambda interpret: True)
    table = step(np.random.default_rng(0), [1, 1], [70, 130], 64, 20)
    for heads, page, kw, want in ((128, 64, {}, "mla_mosaic"), (64, 128, dict(q_dtype=jnp.float16), "mla_mosaic"),
                                  (128, 64, dict(kv_dtype=jnp.float8_e4m3fn), "mla_triton"),
                                  (128, 64, dict(q_dtype=jnp.float32), "mla_triton"),
                                  (16, 64, {}, "mla_mosaic"), (128, 32, {}, "mla_mosaic"), (128, 16, {}, "mla_triton")):
        mla = BatchMLAPagedAttention(heads, CKV, KPE, page, sm_scale=SCALE, backend="gpu")
        t = table if page == 64 else step(np.random.default_rng(0), [1, 1], [70, 130], page, 20)
        assert mla.plan(*t, num_pages=20, **kw).impl == want, (heads, page, kw)
    # 16 heads: Mosaic for steps of whole tiles (4 tokens a request: verify rows, prefill chunks)
    # without capacities; under capacities every step's plan is Triton's (one program)
    whole = step(np.random.default_rng(0), [4, 8], [70, 130], 64, 20)
    # (one token per request, max_num_tokens = max_batch_size: tiles of one token, whole in every step)
    for caps, want in (({}, "mla_mosaic"), (dict(max_batch_size=4, max_num_tokens=16, max_num_pages=20), "mla_triton"),
                       (dict(max_batch_size=16, max_num_tokens=16, max_num_pages=20), "mla_mosaic")):
        mla = BatchMLAPagedAttention(16, CKV, KPE, 64, causal=True, sm_scale=SCALE, backend="gpu", **caps)
        assert mla.plan(*whole, num_pages=20).impl == want, caps
    # The device-planned call's choice at its shapes: T == S tokens, one-token tiles; T = 4 S, Triton
    problem = dispatch.Problem("mla", 16, 1, CKV + KPE, "paged", 64, interpret=False, head_dim_vo=CKV)
    for t, want in ((8, "mla_mosaic"), (32, "mla_triton")):
        rows = mla_ragged.tile_rows(t, 16, 8, MLAConfig())
        assert dispatch.choose(problem, None, None, True, fixed_shapes=True, tile_rows=rows).name == want, t
    mla = BatchMLAPagedAttention(128, CKV, KPE, 64, sm_scale=SCALE, backend="gpu")
    plan = mla.plan(*table, num_pages=20)
    with pytest.raises(ValueError, match="ckv_cache.*mla_mosaic"):
        mla.run(jnp.ones((2, 128, CKV), jnp.bfloat16), jnp.ones((2, 128, KPE), jnp.bfloat16),
                jnp.ones((20, 64, CKV), jnp.float8_e4m3fn), jnp.ones((20, 64, KPE), jnp.float8_e4m3fn), plan)
    with pytest.raises(ValueError, match="num_heads must divide 64"):
        BatchMLAPagedAttention(24, CKV, KPE, 64, sm_scale=SCALE, impl="mosaic")
    with pytest.raises(ValueError, match="lengths"):  # 16 heads of one token in a tile of 4 tokens' rows
        BatchMLAPagedAttention(16, CKV, KPE, 64, sm_scale=SCALE, impl="mosaic").plan(
            *step(np.random.default_rng(0), [1, 4], [70, 130], 64, 20), num_pages=20)
    with pytest.raises(ValueError, match="fixed shapes"):
        BatchMLAPagedAttention(16, CKV, KPE, 64, sm_scale=SCALE, impl="mosaic", max_batch_size=4, max_num_tokens=16,
                               max_num_pages=20).plan(*table, num_pages=20)
    with pytest.raises(ValueError, match="kv_dtype"):
        BatchMLAPagedAttention(128, CKV, KPE, 64, sm_scale=SCALE, impl="mosaic").plan(
            *table, num_pages=20, kv_dtype=jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="q_dtype"):
        BatchMLAPagedAttention(128, CKV, KPE, 64, sm_scale=SCALE).plan(*table, num_pages=20, q_dtype="bf17")


@pytest.mark.parametrize("heads, qo, causal", [  # (64, 3) and (16, 1): the branches of the other two (slow)
    (128, 1, False), pytest.param(64, 3, True, marks=pytest.mark.slow), (16, 4, True),
    pytest.param(16, 1, False, marks=pytest.mark.slow)])
def test_mosaic_kernel_lowers_for_cuda(heads, qo, causal):
    """The Mosaic GPU kernel lowers for an H100 on any host (TMA, wgmma layouts, register stores):
    decode of 128 heads with split tiles, causal verify rows of 64 heads, 16 heads x 4 tokens a tile."""
    from test_backend import MOSAIC_CALL, lower_for_cuda
    b, kv, page = 4, 300, 64
    table = step(np.random.default_rng(0), [qo] * b, [kv] * b, page, 30)
    mla = BatchMLAPagedAttention(heads, CKV, KPE, page, causal=causal, sm_scale=SCALE, backend="gpu",
                                 impl="mosaic")
    plan = mla.plan(*table, num_pages=30)
    args = (jnp.ones((b * qo, heads, CKV), jnp.bfloat16), jnp.ones((b * qo, heads, KPE), jnp.bfloat16),
            jnp.ones((30, page, CKV), jnp.bfloat16), jnp.ones((30, page, KPE), jnp.bfloat16), plan)
    assert MOSAIC_CALL in lower_for_cuda(mla.run, *args)


def test_gpu_kernel_lowers_for_cuda():
    """The compiled kernels (MLA and the merge) lower to Triton IR for an H100 on any host."""
    from test_backend import TRITON_CALL, lower_for_cuda
    for heads, qo, cache in ((16, 1, jnp.bfloat16), (128, 1, jnp.bfloat16), (16, 4, jnp.bfloat16),
                             (16, 1, jnp.float8_e4m3fn), (128, 1, jnp.float8_e4m3fn)):
        b, kv, page = 4, 300, 64
        qo_indptr, kv_indptr, kv_indices, kv_len = step(np.random.default_rng(0), [qo] * b, [kv] * b, page, 20)
        mla = BatchMLAPagedAttention(heads, CKV, KPE, page, causal=qo > 1, sm_scale=SCALE, backend="gpu")
        plan = mla.plan(qo_indptr, kv_indptr, kv_indices, kv_len, num_pages=20)
        args = (jnp.ones((b * qo, heads, CKV), jnp.bfloat16), jnp.ones((b * qo, heads, KPE), jnp.bfloat16),
                jnp.ones((20, page, CKV), cache), jnp.ones((20, page, KPE), cache), plan)
        fn = mla.run if cache == jnp.bfloat16 else functools.partial(mla.run, ckv_scale=0.5, kpe_scale=0.25)
        assert lower_for_cuda(fn, *args).count(TRITON_CALL) == 1 + (plan.layout.group_cap > 0)


@pytest.mark.slow
@pytest.mark.parametrize("num_heads, page_size, causal", [(3, 3, True), (24, 64, False), (96, 4, True), (1, 1, False)])
def test_other_head_counts_and_requests_over_several_tiles(rng, num_heads, page_size, causal):
    """Head counts outside the grid below (tiles that cut a token's heads at 3 and 24, two tiles a
    token at 96) and requests of 15-33 tokens over several tiles, causal rows masked on their own
    diagonals; no capacities; NaN in unlisted pages and stale slots."""
    qo_lens, kv_lens = [17, 31, 0, 5, 1], [40, 31, 9, 200, 1]
    mla = BatchMLAPagedAttention(num_heads, CKV, KPE, page_size, causal=causal, sm_scale=SCALE,
                                 config=MLAConfig(num_cells=3, min_chunk=64))
    table = step(rng, qo_lens, kv_lens, page_size)
    q_nope, q_pe, ckv, kpe = inputs(rng, sum(qo_lens), num_heads, page_size, jnp.float32)
    want = oracle(q_nope, q_pe, ckv, kpe, *table, causal)
    _poison(q_nope, q_pe, ckv, kpe, table, kv_lens, page_size)
    plan = mla.plan(*table, num_pages=ckv.shape[0])
    assert plan.impl == "mla_triton"
    check(mla.run(*map(jnp.asarray, (q_nope, q_pe, ckv, kpe)), plan, return_lse=True), want, 2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("num_heads", [8, 16, 128])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grid_matches_float64_reference(rng, num_heads, page_size, causal, dtype):
    for qo_lens, kv_lens in (DECODE, MIXED) if num_heads < 128 else (SMALL, DECODE):
        out, want = run_step(rng, num_heads, page_size, causal, qo_lens, kv_lens, dtype, poison=True)
        check(out, want, 2e-5 if dtype == "float32" else 2e-2)


@pytest.mark.slow
@pytest.mark.parametrize("num_heads", [8, 16, 128])
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("cache_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_grid_matches_float64_reference(rng, num_heads, page_size, cache_dtype):
    for qo_lens, kv_lens in (DECODE, MIXED) if num_heads < 128 else (SMALL, DECODE):
        out, want = run_step(rng, num_heads, page_size, True, qo_lens, kv_lens, "bfloat16", poison=True,
                             cache_dtype=cache_dtype, scales=(0.4, 0.7))
        check(out, want, 8e-3)


# ---------------------------------------------------------------- boundaries
def qo_edges(num_heads, longest=70):
    """Query lengths at the MLA planner's edges for num_heads: a tile of M rows (M = 16, 32, 64:
    planner.mla.block_rows_for) holds M / H tokens, so 1 and n - 1, n, n + 1 at n = M / H, and
    2 M / H -1 / +1 (a second tile); ceil(M / H) and one more (the tile height moves past M)."""
    out = {1}
    for m in (16, 32, 64):
        per_tile = max(1, m // num_heads)
        out |= {per_tile - 1, per_tile, per_tile + 1, 2 * per_tile - 1, 2 * per_tile + 1}
        out |= {-(-m // num_heads), -(-m // num_heads) + 1}
    return sorted(n for n in out if 1 <= n <= longest)


def kv_edges(qo, page_size):
    """Key lengths >= qo at the edges: the causal diagonal (qo), qo + 1, the first two page ends,
    the kernel's 32- and 64-key blocks and the 256-key chunks (MLAConfig.min_chunk), -1 / 0 / +1."""
    edges = {qo, qo + 1}
    for n in (page_size, 2 * page_size, 32, 64, 256):
        edges |= {n - 1, n, n + 1}
    return sorted(n for n in edges if n >= max(qo, 1))


def boundary_steps(num_heads, page_size):
    """Each of qo_edges alone (its key lengths cycling through kv_edges), then all of them in one
    step with a request of no query rows and one of no keys."""
    lengths = qo_edges(num_heads)
    steps = []
    for i, q in enumerate(lengths):
        kvs = kv_edges(q, page_size)
        steps.append(([q], [kvs[i % len(kvs)]]))
    kvs = [kv_edges(q, page_size)[-1 - i % 3] for i, q in enumerate(lengths)]
    return steps + [(lengths + [0, 1], kvs + [5, 0])]


def run_boundaries(rng, num_heads, page_size, causal, capacities, dtype=jnp.float32, tol=2e-5):
    """Every boundary step through one wrapper (capacities: all three and small grids, so one
    compilation and split tiles; else the default config, a plan layout per step), against the
    float64 oracle (on the inputs as dtype holds them), with NaN in unlisted pages, stale slots
    and q rows past the step."""
    steps = boundary_steps(num_heads, page_size)
    t_cap, b_cap = max(sum(q) for q, _ in steps) + 3, max(len(q) for q, _ in steps)
    num_pages = max(int(np.sum(-(-np.asarray(k) // page_size))) for _, k in steps) + 6
    kw = dict(max_batch_size=b_cap, max_num_tokens=t_cap, max_num_pages=num_pages,
              config=MLAConfig(num_cells=3, min_chunk=64)) if capacities else {}
    mla = BatchMLAPagedAttention(num_heads, CKV, KPE, page_size, causal=causal, sm_scale=SCALE, **kw)
    traces = []
    run = jax.jit(lambda *a: (traces.append(1), mla.run(*a, return_lse=True))[1])
    for qo_lens, kv_lens in steps:
        table = step(rng, qo_lens, kv_lens, page_size, num_pages)
        n = t_cap if capacities else sum(qo_lens)
        q_nope, q_pe, ckv, kpe = (rng.standard_normal(shape).astype(dtype).astype(np.float32) for shape in (
            (n, num_heads, CKV), (n, num_heads, KPE), (num_pages, page_size, CKV), (num_pages, page_size, KPE)))
        want = oracle(q_nope, q_pe, ckv, kpe, *table, causal)
        _poison(q_nope, q_pe, ckv, kpe, table, kv_lens, page_size)
        plan = mla.plan(*table, num_pages=num_pages, q_dtype=dtype)
        out = run(*(jnp.asarray(x, dtype) for x in (q_nope, q_pe, ckv, kpe)), plan)
        try:
            check(out, want, tol)
        except AssertionError as e:
            raise AssertionError(f"qo {qo_lens} kv {kv_lens} {plan.impl} block_rows {plan.layout.block_rows}: "
                                 f"{e}") from None
    assert len(traces) == 1 or not capacities


# (num_heads, page_size, causal, capacities) by default; the rest of the product under slow (without
# capacities each step compiles its own plan layout: ~20 s a row).
BOUNDARY_ROWS = [(3, 1, True, True), (16, 64, False, True), (128, 16, True, True), (16, 64, False, False)]


@pytest.mark.parametrize("num_heads, page_size, causal, capacities", BOUNDARY_ROWS + [
    pytest.param(*row, marks=pytest.mark.slow) for row in itertools.product(
        (1, 3, 8, 16, 32, 64, 128), (1, 16, 64), (True, False), (True, False)) if row not in BOUNDARY_ROWS])
def test_boundaries(rng, num_heads, page_size, causal, capacities):
    """Query lengths at every tile edge of num_heads, alone and together, at page, block and chunk
    edges of the keys: tests/test_boundary.py's grid for MLA."""
    run_boundaries(rng, num_heads, page_size, causal, capacities)


GPU_BOUNDARY_ROWS = [(h, p, c, True) for h in (16, 32, 64, 128) for p in (1, 64) for c in (True, False)] + [
    (16, 64, True, False), (128, 64, False, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads, page_size, causal, capacities", GPU_BOUNDARY_ROWS)
def test_boundaries_on_a_gpu(rng, num_heads, page_size, causal, capacities):
    """The grid above in bfloat16 on a GPU (-m gpu), where dispatch picks the Mosaic kernel for
    the tiles it takes (pages of 64 rows; 64 or 128 heads, decode at 16 and 32)."""
    assert jax.default_backend() == "gpu", "-m gpu runs the grid on a GPU"
    run_boundaries(rng, num_heads, page_size, causal, capacities, jnp.bfloat16, 2e-2)
