"""The vectorized planner makes bitwise the plans of the planner it replaced: same
layout, same work items in the same order, same packed buffer, same info, on grids of random
batches. The oracle is the old code, kept verbatim in tests/_old_planner.py for this test only."""
import re

import numpy as np
import pytest

import _old_planner as old
from helpers import page_table
from planner import decode as decode_planner
from planner import prefill as prefill_planner
from planner import scheduler, validate
from planner.work_items import MIXED


def _same(new, ref):
    (layout, buf, info), (ref_layout, ref_buf, ref_info) = new, ref
    assert layout == ref_layout
    assert buf.dtype == ref_buf.dtype == np.int32
    np.testing.assert_array_equal(buf, ref_buf)
    assert info == ref_info


def _same_plan_or_error(new_fn, old_fn, *args, **kw):
    """new_fn(*args, **kw) gives the old function's plan bitwise, or the same ValueError."""
    try:
        ref = old_fn(*args, **kw)
    except ValueError as e:
        with pytest.raises(ValueError, match=re.escape(str(e)[:30])):
            new_fn(*args, **kw)
        return
    _same(new_fn(*args, **kw), ref)


def _same_parts(plan, ref_buf):
    """The plan's device sections (split on a GPU, one buffer on the CPU) are the packed buffer's."""
    got, want = plan.sections(), plan.layout.unpack(ref_buf)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(np.asarray(got[name]), want[name])


def _lens(rng, batch, hi):
    """Lengths with empty requests, one-token requests and long ones mixed in."""
    lens = rng.integers(1, hi, batch)
    lens[rng.random(batch) < 0.1] = 0
    lens[rng.random(batch) < 0.1] = 1
    return lens


@pytest.mark.parametrize("seed", range(40))
def test_decode_plans_match_the_old_planner(seed):
    rng = np.random.default_rng(seed)
    batch = int(rng.choice([1, 2, 5, 33, 64, 130]))
    page = int(rng.choice([1, 4, 16]))
    lens = _lens(rng, batch, int(rng.choice([40, 600, 5000])))
    if seed % 4 == 0:  # all requests of (nearly) one length: many equal costs, ties
        lens = 1000 - rng.integers(0, 3, batch)
    indptr, indices, last, num_pages = page_table(rng, lens, page)
    kw = dict(page_size=page, num_cells=int(rng.choice([1, 3, 8, 33, 264])), num_pages=num_pages)
    if seed % 3 == 0:
        kw.update(max_batch_size=batch + int(rng.integers(0, 9)), max_num_pages=int(indptr[-1]) + 50)
    if seed % 5 == 1:
        kw["fixed_split_pages"] = int(rng.integers(1, 40))
    if seed % 7 == 2:
        kw["item_cost"] = 1.5  # a fractional alpha: costs truncated as before
    if seed % 6 == 5:
        kw["min_split_tokens"] = 16
    new = decode_planner.plan_decode(indptr, indices, last, partition="greedy", **kw)  # Algorithm 1
    assert new[2].pop("partition") == "greedy"
    _same(new, old.plan_decode(indptr, indices, last, **kw))


@pytest.mark.parametrize("seed", range(16))
def test_decode_page_id_checks_match_the_old_planner(seed):
    """Page ids are checked on the plan's own copy (after the copy, not on the caller's array): the
    same ValueError as the old planner's check of the caller's table, through plan_decode and
    the wrapper (cascade off and "auto"), page sizes 1 and 16, empty requests, capacities or not."""
    import jaxinfer as ji
    rng = np.random.default_rng(2000 + seed)
    batch, page = int(rng.choice([1, 5, 64])), int(rng.choice([1, 16]))
    indptr, indices, last, num_pages = page_table(rng, _lens(rng, batch, 3000), page)
    caps = dict(max_batch_size=batch + 3, max_num_pages=int(indptr[-1]) + 20) if seed % 2 else {}
    if indices.size and seed % 4 != 3:  # (else a valid table: the plans must match)
        indices[rng.integers(0, indices.size)] = int(rng.choice([num_pages, num_pages + 7, -1, -(1 << 31)]))
    kw = dict(page_size=page, num_cells=8, num_pages=num_pages, **caps)
    dec = ji.BatchDecodeWithPagedKVCache(8, 2, 64, page, num_ctas=16, **caps)
    try:
        ref = old.plan_decode(indptr, indices, last, **kw)
    except ValueError as e:
        assert "kv_indices holds page ids outside" in str(e)
        with pytest.raises(ValueError, match=f"kv_indices holds page ids outside \\[0, {num_pages}\\)"):
            decode_planner.plan_decode(indptr, indices, last, **kw)
        for cascade in (None, "auto"):
            with pytest.raises(ValueError, match=f"kv_indices holds page ids outside \\[0, {num_pages}\\)"):
                dec.plan(indptr, indices, last, num_pages=num_pages, cascade=cascade)
        return
    greedy = decode_planner.plan_decode(indptr, indices, last, partition="greedy", **kw)
    assert greedy[2].pop("partition") == "greedy"
    _same(greedy, ref)
    auto = decode_planner.plan_decode(indptr, indices, last, **kw)[1]  # (the wrapper's partition)
    for cascade in (None, "auto"):
        _same_parts(dec.plan(indptr, indices, last, num_pages=num_pages, cascade=cascade), auto)


@pytest.mark.parametrize("seed", range(30))
def test_assign_cells_matches_the_old_heap(seed):
    rng = np.random.default_rng(seed)
    n, cells = int(rng.integers(0, 1200)), int(rng.choice([1, 2, 33, 264, 1000]))
    costs = rng.integers(1, int(rng.choice([3, 100, 10 ** 6])), n)
    order, indptr = scheduler.assign_cells(costs, cells)
    ref_order, ref_indptr = old.assign_cells(costs, cells)
    np.testing.assert_array_equal(order, ref_order)
    np.testing.assert_array_equal(indptr, ref_indptr)


@pytest.mark.parametrize("seed", range(30))
def test_assign_cells_matches_the_old_heap_on_close_costs(seed):
    """Costs within a factor of about 2 (decode rows of similar lengths): rounds in key order."""
    rng = np.random.default_rng(500 + seed)
    n, cells = int(rng.integers(0, 1200)), int(rng.choice([1, 2, 5, 33, 264]))
    lo = int(rng.choice([1, 40, 2000]))
    costs = rng.integers(lo, lo + int(rng.integers(1, lo + 2)), n)
    order, indptr = scheduler.assign_cells(costs, cells)
    ref_order, ref_indptr = old.assign_cells(costs, cells)
    np.testing.assert_array_equal(order, ref_order)
    np.testing.assert_array_equal(indptr, ref_indptr)


@pytest.mark.parametrize("seed", range(20))
def test_page_table_checks_match(seed):
    rng = np.random.default_rng(seed)
    lens = _lens(rng, int(rng.integers(0, 40)), 200)
    page = int(rng.choice([1, 8]))
    indptr, indices, last, num_pages = page_table(rng, lens, page)
    bad = int(rng.integers(0, 4))
    if bad == 1 and lens.size:
        last[rng.integers(0, lens.size)] = int(rng.choice([0, page + 1, -3]))
    if bad == 2 and indices.size:
        indices[rng.integers(0, indices.size)] = int(rng.choice([num_pages, -1]))
    if bad == 3 and lens.size > 1:
        indptr[1], indptr[-1] = indptr[-1], indptr[1]
    args = (indptr, indices, last, page, num_pages)
    try:
        ref = old.check_page_table(*args)
    except ValueError as e:
        with pytest.raises(ValueError, match=str(e).split(" ")[0]):
            validate.check_page_table(*args)
        return
    for a, b in zip(validate.check_page_table(*args), ref):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("seed", range(48))
def test_prefill_plans_match_the_old_planner(seed):
    rng = np.random.default_rng(1000 + seed)
    batch = int(rng.choice([1, 3, 8, 40]))
    qo = _lens(rng, batch, int(rng.choice([4, 300, 2100])))
    kv = qo + _lens(rng, batch, int(rng.choice([2, 500, 3000])))
    if seed % 5 == 0:  # decode rows mixed with prefill chunks
        qo[: batch // 2] = 1
    if seed % 8 == 2:  # equal lengths, whole tiles
        qo[:] = 256
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    page = int(rng.choice([1, 16]))
    indptr, indices, _, _ = page_table(rng, kv, page)
    tails, contiguous = seed % 4 == 3, seed % 8 == 7
    base = indptr[:-1]
    if contiguous:
        base, indices = (np.cumsum(kv) - kv + rng.integers(0, 8)).astype(np.int32), np.zeros(0, np.int32)
    kw = dict(group=int(rng.choice([1, 4, 8])), causal=bool(seed % 3), num_cells=int(rng.choice([1, 8, 33, 264])),
              tails=tails, contiguous_kv=contiguous)
    if tails:
        kw["rows"] = 128 * kw["group"]
    elif seed % 6 == 1:
        kw["rows"] = 64
    if seed % 3 == 0:
        kw.update(max_num_tokens=int(qo_indptr[-1]) + int(rng.integers(0, 40)), max_batch_size=batch + 2,
                  max_num_pages=indices.shape[0] + 7)
    if seed % 7 == 2 and not tails:
        kw["fixed_split_tokens"] = int(rng.integers(16, 600))
        kw.pop("max_num_tokens", None)
    if seed % 5 == 4:
        kw["window_left"] = int(rng.choice([0, 37, 400]))
    if seed % 9 == 5:
        kw["mask_offsets"] = np.cumsum(qo * kv) - qo * kv
    if seed % 4 == 1:  # cascade levels: positions given
        kw["kv_pos_offset"] = rng.integers(0, 100, batch)
        kw["q_positions"] = rng.integers(0, 5000, int(qo_indptr[-1]))
    if seed % 10 == 6:
        kw["item_cost"] = 2.5
    if seed % 3 == 2:  # short chunks: many split tiles
        kw["min_split_tokens"] = int(rng.choice([16, 64]))
        kw["num_cells"] = 264
    args = (qo_indptr, kv.astype(np.int32), base, indices)
    _same(prefill_planner.plan_prefill(*args, **kw), old.plan_prefill(*args, **kw))


@pytest.mark.parametrize("seed", range(30))
def test_first_page_check_never_hides_a_shared_prefix(seed):
    """prefix.may_share (O(B), run before the grouping) is False only where the old grouping
    found nothing to share: cascade="auto" then plans as before, without the deeper work."""
    from planner import prefix
    rng = np.random.default_rng(2000 + seed)
    batch = int(rng.integers(1, 30))
    lens = rng.integers(1, 300, batch)  # (the old grouping fails on empty requests: see test_prefix)
    page = int(rng.choice([1, 8]))
    indptr, indices, last, _ = page_table(rng, lens, page)
    if seed % 2:  # some consecutive requests start on the same full pages
        for b in rng.integers(0, max(batch - 1, 1), 3):
            n = min(int(indptr[b + 1] - indptr[b]), int(indptr[min(b + 2, batch)] - indptr[b + 1]) if b + 1 < batch else 0)
            k = int(rng.integers(0, n + 1))
            indices[indptr[b + 1]:indptr[b + 1] + k] = indices[indptr[b]:indptr[b] + k]
    qo_indptr = np.arange(batch + 1, dtype=np.int32)
    (_, _), saved = old.two_level_cascade(qo_indptr, indptr, indices, last, page, causal=False)
    if not prefix.may_share(indptr, indices):
        assert saved == 0
    if seed % 2 == 0:  # distinct pages everywhere: the check alone settles it
        assert not prefix.may_share(indptr, indices)


def test_wrapper_plans_own_their_buffers(rng):
    """Each plan() fills a fresh host buffer (on the CPU backend the plan keeps it, and jax
    aliases it when it is 64-byte aligned), so a later plan never changes an earlier one: with
    fixed capacities and without."""
    import jaxinfer as ji
    for caps in (dict(max_batch_size=8, max_num_pages=200), {}):
        dec = ji.BatchDecodeWithPagedKVCache(8, 2, 64, 16, **caps)
        tables = [page_table(rng, rng.integers(1, 400, 8), 16) for _ in range(3)]
        plans = [dec.plan(*t[:3], num_pages=t[3]) for t in tables]
        for (indptr, indices, last, num_pages), plan in zip(tables, plans):
            ref = decode_planner.plan_decode(indptr, indices, last, page_size=16, num_cells=dec.num_cells,
                                             num_pages=num_pages, **caps)[1]
            _same_parts(plan, ref)


def test_wrapper_plans_own_their_large_buffers(rng):
    """Page 1 with a plan buffer of over 1 MB (64-byte aligned, so jax aliases it on the CPU
    backend): each plan() must fill a fresh one; two plans keep their contents."""
    import jaxinfer as ji
    from planner import packing
    tables = [page_table(rng, rng.integers(70_000, 80_000, 4), 1) for _ in range(2)]
    cap = max(int(t[0][-1]) for t in tables)
    assert cap * 4 >= packing.ALIAS_BYTES
    dec = ji.BatchDecodeWithPagedKVCache(8, 2, 64, 1, max_batch_size=4, max_num_pages=cap)
    plans = [dec.plan(*t[:3], num_pages=t[3]) for t in tables]
    for (indptr, indices, last, num_pages), plan in zip(tables, plans):
        ref = decode_planner.plan_decode(indptr, indices, last, page_size=1, num_cells=dec.num_cells,
                                         num_pages=num_pages, max_batch_size=4, max_num_pages=cap)[1]
        _same_parts(plan, ref)


@pytest.mark.parametrize("page", [1, 16])
def test_decode_plans_ignore_later_writes_to_the_callers_table(rng, page):
    """The plan holds its own copy of the page table (its ids checked on that copy): writing the
    caller's arrays after plan(), bad page ids included, changes neither the plan nor its check."""
    import jaxinfer as ji
    indptr, indices, last, num_pages = page_table(rng, rng.integers(1, 3000, 16), page)
    ref = decode_planner.plan_decode(indptr, indices, last, page_size=page, num_cells=8,
                                     num_pages=num_pages)[1]
    dec = ji.BatchDecodeWithPagedKVCache(8, 2, 64, page, num_ctas=16)
    plans = [dec.plan(indptr, indices, last, num_pages=num_pages, cascade=c) for c in (None, "auto")]
    indices[:] = -1
    last[:] = page + 1
    indptr[1:] = 0
    for plan in plans:
        _same_parts(plan, ref)


@pytest.mark.parametrize("seed", range(40))
def test_batch_attention_short_plans_match_the_old_planner(seed):
    from planner import batch as batch_planner
    rng = np.random.default_rng(3000 + seed)
    batch = int(rng.choice([1, 4, 17, 64]))
    qo = rng.choice([0, 1, 1, 2, 4, 9, 40, 300], batch)
    if seed % 4 == 0:  # every request short, one length (speculative verify)
        qo[:] = int(rng.choice([1, 4]))
    kv = qo + _lens(rng, batch, int(rng.choice([30, 600, 4000])))
    page = int(rng.choice([1, 16]))
    indptr, indices, _, _ = page_table(rng, kv, page)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    tokens, is_short = batch_planner.short_tokens(qo, int(rng.choice([1, 4, 8])))
    nnz, extra = int(qo_indptr[-1]), int(rng.integers(0, 9)) * (seed % 3 == 0)
    kw = dict(page_size=page, num_cells=int(rng.choice([1, 8, 33, 132])), tokens_per_item=tokens,
              num_tokens=nnz + extra, batch_cap=batch + extra, index_cap=int(indptr[-1]) + extra + 1)
    if seed % 5 == 1:
        kw["min_split_tokens"] = 16
    if seed % 7 == 2:
        kw["item_cost"] = 2.5
    args = (qo_indptr, kv.astype(np.int32), indptr[:-1], indices[: indptr[-1]], is_short)
    _same_plan_or_error(batch_planner.plan_short, old.plan_short, *args, **kw)


@pytest.mark.parametrize("seed", range(30))
def test_assign_cells_matches_the_old_heap_on_costs_in_runs(seed):
    """Costs repeated in runs (a mixed plan's items: one per head of a tile or short request):
    rounds of the greedy that place every cell at once."""
    rng = np.random.default_rng(700 + seed)
    n, cells, run = int(rng.integers(0, 2000)), int(rng.choice([48, 132, 264])), int(rng.choice([1, 8, 32]))
    lo = int(rng.choice([1, 300, 2000]))
    costs = np.repeat(rng.integers(lo, lo + int(rng.choice([lo, 4 * lo, 3000])), n // run + 1), run)[:n]
    order, indptr = scheduler.assign_cells(costs, cells)
    ref_order, ref_indptr = old.assign_cells(costs, cells)
    np.testing.assert_array_equal(order, ref_order)
    np.testing.assert_array_equal(indptr, ref_indptr)
    cell_of_item = np.repeat(np.arange(cells), np.diff(ref_indptr))[np.argsort(ref_order)]
    np.testing.assert_array_equal(scheduler.cells_of(costs, cells), cell_of_item)


@pytest.mark.parametrize("seed", range(40))
def test_mixed_plans_match_the_old_planner(seed):
    from planner import batch as batch_planner
    rng = np.random.default_rng(4000 + seed)
    batch = int(rng.choice([2, 5, 17, 64]))
    qo = rng.choice([0, 1, 1, 2, 4, 9, 40, 300, 512, 1000], batch)
    if seed % 3 == 0:  # chunks first, then decode rows: the long rows one run
        qo[:] = 1
        qo[: max(1, batch // 8)] = int(rng.choice([128, 512, 700]))
    kv = qo + _lens(rng, batch, int(rng.choice([30, 600, 4000])))
    page = int(rng.choice([8, 16]))
    indptr, indices, _, _ = page_table(rng, kv, page)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    hq, hkv = int(rng.choice([8, 32])), int(rng.choice([1, 8]))
    tokens, is_short = batch_planner.short_tokens(qo, hq // hkv)
    nnz, extra = int(qo_indptr[-1]), int(rng.integers(0, 9)) * (seed % 2 == 0)
    kw = dict(page_size=page, num_qo_heads=hq, num_kv_heads=hkv, num_cells=int(rng.choice([1, 33, 132])),
              tile_tokens=int(rng.choice([64, 128, 192])), tokens_per_item=tokens, num_tokens=nnz + extra,
              batch_cap=batch + extra, index_cap=int(indptr[-1]) + extra + 1, causal=bool(seed % 4))
    args = (qo_indptr, kv.astype(np.int32), indptr[:-1], indices[: indptr[-1]], is_short)
    plan = batch_planner.plan_mixed(*args, **kw)
    # What the old planner lacks: request b's partly filled last page and its items' last_row
    sec = plan[0].unpack(plan[1])
    partial = (qo > 0) & (kv % page != 0)
    np.testing.assert_array_equal(sec["last_page"][:batch],
                                  np.where(partial, indices[np.maximum(indptr[:-1] + (kv - 1) // page, 0)], 0))
    np.testing.assert_array_equal(sec["last_len"][:batch], np.where(partial, kv % page, 0))
    items = sec["items"]
    live = items[:, MIXED.kv_len] > 0
    req = np.searchsorted(qo_indptr, items[:, MIXED.q_row_start], side="right") - 1  # (qo > 0: one request a row)
    np.testing.assert_array_equal(items[live, MIXED.last_row], np.where(partial, np.arange(batch), -1)[req[live]])
    sec["last_page"][:], sec["last_len"][:], items[:, MIXED.last_row] = 0, 0, 0
    ref = old.plan_mixed(*args, **kw)
    _same(plan, ref)


def _prefill_lens(rng, batch):
    """Query and key lengths: empty requests, single tokens (decode rows), whole and partial tiles."""
    qo = rng.choice([0, 1, 1, 7, 16, 33, 128, 300, 512, 2048], batch)
    kv = qo + rng.choice([0, 0, 1, 15, 64, 700, 3000], batch)
    return qo, kv


@pytest.mark.parametrize("split", ["auto", "short chunks", "fixed", "none"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("seed", range(8))
def test_prefill_plans_match_the_old_planner_on_a_grid(seed, page, causal, split):
    """The per-tile fields gathered from the requests' item rows, one cumulative sum
    for items, merge groups and partial states, and the reduction map repeated per tile give
    the old plans bitwise, over page sizes, masks, splits and lengths (with capacities or not)."""
    rng = np.random.default_rng([seed, page, causal, len(split)])
    batch = int(rng.choice([1, 2, 5, 17, 64]))
    qo, kv = _prefill_lens(rng, batch)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    indptr, indices, _, _ = page_table(rng, kv, page)
    kw = dict(group=int(rng.choice([1, 4, 8])), causal=causal, num_cells=int(rng.choice([8, 33, 264])))
    if split == "short chunks":
        kw["min_split_tokens"] = int(rng.choice([16, 64]))
    elif split == "fixed":
        kw["fixed_split_tokens"] = int(rng.integers(16, 1200))
    elif split == "none":
        kw["num_cells"] = 1
    if seed % 2:
        kw.update(max_num_tokens=int(qo_indptr[-1]) + int(rng.integers(0, 70)), max_batch_size=batch + 3,
                  max_num_pages=int(indptr[-1]) + 5)
        if split == "fixed":  # room for the split's partial states
            kw["max_num_tokens"] += 4096
    if seed % 4 == 3:
        kw["rows"] = int(rng.choice(prefill_planner.TILE_ROWS))
    args = (qo_indptr, kv.astype(np.int32), indptr[:-1], indices)
    # (a fixed split over the capacities: the same error)
    _same_plan_or_error(prefill_planner.plan_prefill, old.plan_prefill, *args, **kw)


@pytest.mark.parametrize("seed", range(48))
def test_prefill_variant_plans_match_the_old_planner(seed):
    """Tails plans (paged and contiguous K/V), sliding windows, given positions and mask offsets:
    bitwise the old plans."""
    rng = np.random.default_rng(5000 + seed)
    batch = int(rng.choice([1, 3, 17, 40]))
    qo, kv = _prefill_lens(rng, batch)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    page = int(rng.choice([1, 16]))
    indptr, indices, _, _ = page_table(rng, kv, page)
    base = indptr[:-1]
    group = int(rng.choice([1, 4]))
    kw = dict(group=group, causal=bool(rng.integers(0, 2)), num_cells=int(rng.choice([8, 264])))
    kind = seed % 4
    if kind in (0, 1):  # tails; 1: contiguous K/V
        kw.update(tails=True, rows=128 * group, contiguous_kv=kind == 1)
        if kind == 1:
            base, indices = (np.cumsum(kv) - kv + rng.integers(0, 8)).astype(np.int32), np.zeros(0, np.int32)
    if kind == 2 or seed % 5 == 0:
        kw["window_left"] = int(rng.choice([0, 37, 400]))
    if kind == 3:
        kw["kv_pos_offset"] = rng.integers(0, 100, batch)
        if seed % 8 == 3:
            kw["q_positions"] = rng.integers(0, 5000, int(qo_indptr[-1]))
    if seed % 3 == 0:
        kw["mask_offsets"] = np.cumsum(qo * kv) - qo * kv
    if seed % 2:
        kw.update(max_num_tokens=int(qo_indptr[-1]) + int(rng.integers(0, 40)), max_batch_size=batch + 2,
                  max_num_pages=indices.shape[0] + 7)
    args = (qo_indptr, kv.astype(np.int32), base, indices)
    _same(prefill_planner.plan_prefill(*args, **kw), old.plan_prefill(*args, **kw))


@pytest.mark.parametrize("seed", range(24))
def test_wrapper_prefill_plans_match_the_old_planner(seed):
    """BatchPrefillWithPagedKVCache.plan (its checks, then the planner) makes the old checks' and
    planner's buffer, with capacities and without."""
    import jaxinfer as ji
    rng = np.random.default_rng(6000 + seed)
    batch = int(rng.choice([1, 4, 17, 64]))
    qo, kv = _prefill_lens(rng, batch)
    qo[0] = 64  # (not every request short: a prefill kernel's plan)
    kv[0] = max(kv[0], 64)
    page, causal = int(rng.choice([1, 16])), bool(seed % 2)
    indptr, indices, last, num_pages = page_table(rng, kv, page)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    caps = dict(max_batch_size=batch + 2, max_num_tokens=int(qo_indptr[-1]) + 9,
                max_num_pages=int(indptr[-1]) + 3) if seed % 3 else {}
    pre = ji.BatchPrefillWithPagedKVCache(32, 8, 128, page, causal=causal, num_ctas=2112, impl="triton", **caps)
    plan = pre.plan(qo_indptr, indptr, indices, last, num_pages=num_pages)
    kv_indptr, kv_indices, _, kv_lens = old.check_page_table(indptr, indices, last, page, num_pages)[:4]
    # (with every capacity, the wrapper pins its tile height: one program for every step)
    ref = old.plan_prefill(qo_indptr, kv_lens, kv_indptr[:-1], kv_indices[: kv_indptr[-1]], group=4,
                           causal=causal, num_cells=pre.num_cells, rows=64 if caps else None, **caps)
    layout, buf, info = ref
    assert plan.layout == layout and plan.info == info
    _same_parts(plan, buf)
