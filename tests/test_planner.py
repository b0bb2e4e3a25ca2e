"""The NumPy planner: Algorithm 1, the decode work list, capacities and determinism."""
import heapq

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from helpers import page_table
from planner import decode as decode_planner
from planner import scheduler


def _algorithm1_spec(costs, num_cells):
    """Algorithm 1 as written in the paper: longest first, pop the least-loaded cell."""
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    heap = [(0, c) for c in range(num_cells)]
    cells = [[] for _ in range(num_cells)]
    for i in order:
        load, c = heapq.heappop(heap)
        cells[c].append(i)
        heapq.heappush(heap, (load + costs[i], c))
    return cells


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=0, max_size=300), st.integers(1, 70))
def test_assign_cells_is_algorithm1(costs, num_cells):
    order, cell_indptr = scheduler.assign_cells(np.array(costs, np.int64), num_cells)
    got = [order[cell_indptr[c]:cell_indptr[c + 1]].tolist() for c in range(num_cells)]
    assert got == [sorted(cell) for cell in _algorithm1_spec(costs, num_cells)]  # run in item order
    if costs:  # list scheduling bound: no cell exceeds the mean load by more than the largest item
        loads = [sum(costs[i] for i in cell) for cell in got]
        assert max(loads) <= sum(costs) / num_cells + max(costs)


def _plan(rng, lens, page, **kw):
    indptr, indices, last, num_pages = page_table(rng, lens, page)
    kw.setdefault("num_cells", 8)
    return decode_planner.plan_decode(indptr, indices, last, page_size=page, num_pages=num_pages, **kw), indptr


@pytest.mark.parametrize("split, partition", [(None, "greedy"), (None, "contiguous"), (None, "auto"),
                                              (1, "auto"), (3, "greedy")])
def test_decode_items_cover_each_request_once(rng, split, partition):
    lens = np.array([0, 1, 17, 97, 512, 2048, 33])
    (layout, buf, info), indptr = _plan(rng, lens, 8, fixed_split_pages=split, max_batch_size=9,
                                        partition=partition)
    assert info["partition"] in (("greedy", "contiguous") if partition == "auto" else (partition,))
    sec = layout.unpack(buf)
    items = sec["items"][: sec["cell_indptr"][-1]]
    covered = np.zeros(9, np.int64)
    parts = {}
    for req, base, t0, t1, slot in items:
        assert base == (indptr[req] if req < 7 else 0)
        covered[req] += t1 - t0
        if slot >= 0:
            parts.setdefault(req, []).append((t0, slot))
    np.testing.assert_array_equal(covered[:7], lens)
    assert np.all(covered[7:] == 0) and np.sum(items[:, 0] >= 7) == 2  # padding rows: one empty item each
    # Reduction map: split request r's partial slots, in chunk order, are merge group's rows.
    n_split = info["num_split"]
    for g in range(n_split):
        r = sec["merge_dest"][g]
        slots = [s for _, s in sorted(parts[r])]
        assert slots == list(range(sec["merge_indptr"][g], sec["merge_indptr"][g + 1]))
    assert set(parts) == set(sec["merge_dest"][:n_split].tolist())
    assert np.all(sec["merge_dest"][n_split:] == -1)


def _cell_costs(layout, buf, page, alpha):
    """Each cell's cost as the planner counts it: its items' pages plus alpha pages per item."""
    sec = layout.unpack(buf)
    items, ptr = sec["items"], sec["cell_indptr"]
    pages = -(-(items[:, 3] - items[:, 2]) // page) + alpha
    return np.array([pages[ptr[c]:ptr[c + 1]].sum() for c in range(len(ptr) - 1)])


@pytest.mark.parametrize("seed", range(24))
def test_contiguous_partition_gives_cells_consecutive_equal_ranges(seed):
    """Cells hold consecutive ranges of the requests' pages, in request order (a request's items
    in token order, adjacent), each cell's cost within two items' of its budget; "auto" takes
    them where Algorithm 1's chunks outnumber the cells."""
    rng = np.random.default_rng(seed)
    page, cells = int(rng.choice([1, 4, 16])), int(rng.choice([3, 8, 33]))
    lens = rng.integers(0, int(rng.choice([300, 3000])), int(rng.choice([1, 5, 16, 40])))
    plans = {p: _plan(rng, lens, page, num_cells=cells, partition=p, max_batch_size=len(lens) + 2)[0]
             for p in ("greedy", "contiguous", "auto")}
    layout, buf, info = plans["contiguous"]
    if not plans["greedy"][2]["num_split"]:  # no request longer than Algorithm 1's chunk: none is cut
        assert info["partition"] == plans["auto"][2]["partition"] == "greedy"
        return
    sec = layout.unpack(buf)
    items = sec["items"][: sec["cell_indptr"][-1]]
    items = items[np.append(lens, [0, 0])[items[:, 0]] > 0]  # (empty rows go to the cells in turn)
    stream = [(req, t0) for req, _, t0, _, _ in items]
    assert info["partition"] == "contiguous" and stream == sorted(stream)  # cell by cell, in order
    nxt = np.append(items[1:, 2], 0)
    same = np.append(items[1:, 0] == items[:-1, 0], False)
    np.testing.assert_array_equal(items[same, 3], nxt[same])  # a request's pieces meet
    alpha = max(1, -(-decode_planner.ITEM_OVERHEAD_TOKENS // page))
    pages = -(-lens // page)
    stream = int(pages.sum()) + alpha * int(np.count_nonzero(pages))  # empty rows take the cells in turn
    empties = len(lens) + 2 - int(np.count_nonzero(pages))
    width = max(-(-stream // cells), -(-256 // page) + alpha)
    assert _cell_costs(layout, buf, page, alpha).max() <= width + 2 * alpha + alpha * -(-empties // cells)
    chunks = int(np.sum(-(-pages // plans["greedy"][2]["chunk_pages"])))
    assert plans["auto"][2]["partition"] == ("contiguous" if chunks > cells else "greedy")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5000), min_size=1, max_size=70), st.integers(1, 70), st.sampled_from([1, 4, 16]),
       st.integers(0, 9), st.sampled_from([16, 256, 1024]))
def test_contiguous_partition_fits_the_capacities(lens, num_cells, page, pad, min_split):
    """Any batch, grid and padding: the contiguous cells fit the layout's capacities (items,
    split requests, partial slots; the planner asserts them) and cover every request's tokens
    exactly once, a request's pieces in consecutive partial slots."""
    rng = np.random.default_rng(len(lens))
    lens = np.array(lens)
    (layout, buf, info), _ = _plan(rng, lens, page, num_cells=num_cells, partition="contiguous",
                                   max_batch_size=len(lens) + pad, min_split_tokens=min_split)
    sec = layout.unpack(buf)
    items = sec["items"][: sec["cell_indptr"][-1]]
    assert items.shape[0] == info["num_items"] <= layout.item_cap
    covered = np.bincount(items[:, 0], weights=items[:, 3] - items[:, 2], minlength=len(lens) + pad)
    np.testing.assert_array_equal(covered[:len(lens)], lens)
    assert np.all(covered[len(lens):] == 0)
    slots = np.sort(items[items[:, 4] >= 0, 4])
    np.testing.assert_array_equal(slots, np.arange(info["num_parts"]))
    assert info["num_parts"] <= layout.part_cap and info["num_split"] <= layout.merge_cap


def test_auto_partition_on_serving_lengths(rng):
    """Batch 16 at the e2e benchmark's lengths: Algorithm 1 leaves its remainders to a few cells
    (three items each), so "auto" takes the contiguous cells; 16 requests of 1024 tokens split
    evenly into 32 cells, and "auto" keeps Algorithm 1's."""
    (_, _, info), _ = _plan(rng, np.random.default_rng(0).integers(512, 2049, 16) + 64, 16, num_cells=33)
    assert info["partition"] == "contiguous"
    (_, _, info), _ = _plan(rng, np.full(16, 1024), 16, num_cells=33)
    assert info["partition"] == "greedy" and info["num_items"] == 32


def test_auto_chunk_fills_the_cells(rng):
    (layout, _, info), _ = _plan(rng, np.array([32768]), 16, num_cells=33)
    assert info["num_items"] >= 30 and info["num_split"] == 1  # one long request split across cells
    (layout, _, info), _ = _plan(rng, np.full(64, 4096), 16, num_cells=33)
    assert info["num_split"] == 0  # enough requests: no split, all writethrough


def test_plan_shapes_depend_only_on_capacities(rng):
    shapes = set()
    for _ in range(10):
        lens = rng.integers(0, 300, rng.integers(1, 9))
        (layout, buf, _), _ = _plan(rng, lens, 4, max_batch_size=8, max_num_pages=600)
        shapes.add((layout, buf.shape))
    assert len(shapes) == 1


def test_plan_is_deterministic(rng):
    lens = rng.integers(0, 3000, 20)
    indptr, indices, last, num_pages = page_table(rng, lens, 16)
    a = decode_planner.plan_decode(indptr, indices, last, page_size=16, num_cells=16)[1]
    b = decode_planner.plan_decode(indptr.copy(), indices.copy(), last.copy(), page_size=16, num_cells=16)[1]
    np.testing.assert_array_equal(a, b)


def test_capacity_errors(rng):
    indptr, indices, last, _ = page_table(rng, np.array([5, 9, 3]), 4)
    with pytest.raises(ValueError, match="max_batch_size"):
        decode_planner.plan_decode(indptr, indices, last, page_size=4, num_cells=4, max_batch_size=2)
    with pytest.raises(ValueError, match="max_num_pages"):
        decode_planner.plan_decode(indptr, indices, last, page_size=4, num_cells=4, max_num_pages=3)
    with pytest.raises(ValueError, match="fixed_split_pages"):
        decode_planner.plan_decode(indptr, indices, last, page_size=4, num_cells=4, fixed_split_pages=0)
    with pytest.raises(ValueError, match="partition must be one of"):
        decode_planner.plan_decode(indptr, indices, last, page_size=4, num_cells=4, partition="lpt")
    with pytest.raises(ValueError, match="fixed_split_pages"):
        decode_planner.plan_decode(indptr, indices, last, page_size=4, num_cells=4, fixed_split_pages=2,
                                   partition="contiguous")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.integers(0, 400)), min_size=1, max_size=6),
       st.booleans(), st.booleans(), st.integers(0, 50), st.sampled_from([1, 4]),
       st.sampled_from([None, 0, 37, 200]))
def test_tails_plan_aligns_tiles_and_maps_every_token_once(lens, causal, contiguous, spare, group, window):
    """impl='mosaic' plans: every tile (and, for contiguous K/V, every request's keys) starts
    at a row divisible by ROW_ALIGN; each token of q is stored exactly once, by its tile in
    place or through tail_dest; lse_src points at the token's row of its tile's item slot.
    Positions: key t of an item sits at field 11 + t, fields 14 / 15 bound its rows' query
    positions, and a window plan starts no later than the first key the window shows."""
    from planner import prefill as prefill_planner
    qo_lens = np.array([q for q, _ in lens], np.int64)
    kv_lens = np.array([k for _, k in lens], np.int32)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    kv_base = (np.cumsum(kv_lens) - kv_lens).astype(np.int32)  # contiguous rows, unaligned
    num_tokens = int(qo_indptr[-1]) + spare
    layout, buf, _ = prefill_planner.plan_prefill(
        qo_indptr, kv_lens, kv_base, np.zeros(0, np.int32), group=group, causal=causal, num_cells=8,
        max_num_tokens=num_tokens, rows=128 * group, tails=True, contiguous_kv=contiguous,
        window_left=window)
    sec = layout.unpack(buf)
    tpt, align = 128, prefill_planner.ROW_ALIGN
    cells = np.diff(sec["cell_indptr"])
    assert cells.max() <= 1  # one item per cell
    items = sec["items"][:int(cells.sum())]
    written = np.zeros(num_tokens, np.int64)
    for w, (q0, t0, qo, base, kv, k0, k1, *_, pos_off, tail, kv_first, pos_min, pos_max) in enumerate(items):
        assert (q0 + t0) % align == 0 and -align < t0 < max(qo, 1)
        assert pos_off == -kv_first  # key t of the item is the request's key t - kv_first
        req_q = (np.arange(max(t0, 0), min(t0 + tpt, qo)) + kv - kv_first - qo)  # bottom-right
        if qo and q0 < qo_indptr[-1]:  # (not the padding request)
            assert (pos_min, pos_max) == (req_q.min(), req_q.max())
        if window is not None and k0 > 0:
            assert pos_off + k0 <= max(0, pos_min - window)
        if contiguous and kv:
            assert base % align == 0 and kv_first == kv_base[np.searchsorted(qo_indptr, q0, "right") - 1] % align
        else:
            assert kv_first == 0
        tok = np.arange(t0, t0 + tpt)
        mine = (tok >= 0) & (tok < qo)
        if tail < 0:
            assert mine.all()
            written[q0 + tok] += 1
        else:
            dest = sec["tail_dest"][tail * tpt:(tail + 1) * tpt]
            np.testing.assert_array_equal(dest, np.where(mine, q0 + tok, num_tokens))
        np.testing.assert_array_equal(sec["lse_src"][q0 + tok[mine]], w * tpt + np.flatnonzero(mine))
    live = sec["tail_dest"][sec["tail_dest"] < num_tokens]
    np.add.at(written, live, 1)
    np.testing.assert_array_equal(written, 1)


def test_plan_sections_start_256_byte_aligned(rng):
    """Every section of a packed plan starts at a multiple of 64 int32 entries (Mosaic GPU
    kernels take inputs only at 256-byte aligned addresses), and unpack returns exactly it."""
    from planner import packing
    from planner import prefill as prefill_planner
    indptr, indices, last, _ = page_table(rng, np.array([5, 70, 33]), 16)
    layout, buf, _ = decode_planner.plan_decode(indptr, indices, last, page_size=16, num_cells=8)
    qo_indptr = np.array([0, 3, 10, 11], np.int32)
    kv_lens = np.array([5, 70, 33], np.int32)
    p_layout, p_buf, _ = prefill_planner.plan_prefill(qo_indptr, kv_lens, indptr[:-1], indices,
                                                      group=2, causal=True, num_cells=8)
    for lay, b in ((layout, buf), (p_layout, p_buf)):
        assert b.shape == (lay.size,)
        sec = lay.unpack(b)
        for name, n in lay.sections():
            start, stop = lay.section_range(name)
            assert start % packing.SECTION_ALIGN == 0 and stop - start == n == sec[name].size
