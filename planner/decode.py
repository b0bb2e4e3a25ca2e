"""Decode plan: split-KV work items assigned to cells (Algorithm 1, or contiguous page ranges),
reduction map, one packed buffer.

Every array has a shape fixed by the capacities (max_batch_size,
max_num_pages, num_cells), so the jitted run() compiles once; what changes
from step to step (lengths, chunk size, work lists, page ids) is data.
"""
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from planner import scheduler, validate
from planner.packing import PackedLayout, new_buffer
from planner.work_items import DECODE

# What one more work item costs a decode cell, in KV tokens: an H100 timeline of the kernel
# put it at ~2 µs at batch 16, 50-80 tokens' worth of streaming.
# Contiguous cells charge it per item when they balance their costs.
ITEM_OVERHEAD_TOKENS = 80
PARTITIONS = ("auto", "greedy", "contiguous")


@dataclass(frozen=True)
class DecodeLayout(PackedLayout):
    """Static sizes of the packed plan buffer; hashable, part of the jit cache key."""
    ITEMS = DECODE
    batch: int       # B: rows of q and o
    index_cap: int   # entries of kv_indices
    num_cells: int   # persistent grid cells (grid = (num_cells, Hkv))
    item_cap: int    # work items
    part_cap: int    # partial states of split requests
    merge_cap: int   # split requests

    @classmethod
    def for_capacities(cls, batch, index_cap, num_cells, fixed_split_pages=None):
        """Bounds from Algorithm 1: with chunk L >= sum(pages) / n, a request has at most
        1 + pages / L items; split requests (pages > L) number under n and have
        at most 2 * pages / L chunks. Without a fixed split, n = num_cells. The contiguous
        partition fits them too: it cuts the requests at most n - 1 times."""
        n = num_cells if fixed_split_pages is None else -(-index_cap // fixed_split_pages)
        return cls(batch, index_cap, num_cells, batch + n, 2 * n, max(1, min(batch, n)))

    def sections(self):
        """(name, size) of each int32 section, in buffer order."""
        return (("kv_indices", self.index_cap), ("kv_lens", self.batch),
                ("items", self.item_cap * DECODE.width), ("cell_indptr", self.num_cells + 1),
                ("merge_indptr", self.merge_cap + 1), ("merge_dest", self.merge_cap))



@lru_cache(maxsize=256)
def decode_layout(batch, index_cap, num_cells, fixed_split_pages=None):
    """DecodeLayout.for_capacities, one instance per capacities (its offsets computed once)."""
    return DecodeLayout.for_capacities(batch, index_cap, num_cells, fixed_split_pages)


def plan_decode(kv_indptr, kv_indices, kv_last_page_len, *, page_size, num_cells,
                num_pages=None, max_batch_size=None, max_num_pages=None,
                fixed_split_pages=None, min_split_tokens=256, item_cost=32.0, partition="auto"):
    """Builds the decode work list. Returns (layout, buffer int32[layout.size], info dict).

    fixed_split_pages: chunk size in pages independent of the batch, which makes
    each request's output independent of the other requests (batch invariance).
    item_cost: the per-item cost alpha in tokens (Algorithm 1: alpha*l_q + beta*l_kv, beta = 1).
    partition (plans that split a request, without fixed_split_pages): "greedy" is Algorithm 1
    (chunks of L pages, longest first to the least-loaded cell); "contiguous" gives each cell a
    consecutive range of the requests' pages, ranges of equal cost (pages plus
    ITEM_OVERHEAD_TOKENS per item); "auto" takes "contiguous" where Algorithm 1's chunks
    outnumber the cells (some cells would run several items, the last ones its remainders),
    else "greedy". info["partition"] names the one used.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    table = validate.check_page_table(kv_indptr, kv_indices, kv_last_page_len, page_size)
    return plan_decode_checked(table, page_size=page_size, num_cells=num_cells, num_pages=num_pages,
                               max_batch_size=max_batch_size, max_num_pages=max_num_pages,
                               fixed_split_pages=fixed_split_pages, min_split_tokens=min_split_tokens,
                               item_cost=item_cost, partition=partition)


def plan_decode_checked(table, *, page_size, num_cells, num_pages, max_batch_size=None, max_num_pages=None,
                        fixed_split_pages=None, min_split_tokens=256, item_cost=32.0, partition="auto"):
    """plan_decode over a page table that validate.check_page_table already returned (`table`):
    callers that look at the table first (cascade="auto") validate it once. num_pages: the plan's
    own copy of the page ids is checked against it (validate.check_page_ids: one pass over memory
    just written, none over the caller's); None when check_page_table checked them."""
    if fixed_split_pages is not None and fixed_split_pages < 1:
        raise ValueError(f"fixed_split_pages must be >= 1, got {fixed_split_pages}")
    if not item_cost >= 1:  # every item, empty ones too, then has a positive cost
        raise ValueError(f"item_cost must be >= 1, got {item_cost}")
    if partition not in PARTITIONS:
        raise ValueError(f"partition must be one of {PARTITIONS}, got {partition!r}")
    if partition == "contiguous" and fixed_split_pages is not None:
        raise ValueError("partition='contiguous' cuts requests where the cells' costs balance; "
                         "fixed_split_pages (batch invariance) needs 'greedy' or 'auto'")
    kv_indptr, kv_indices, _, kv_lens, pages = table
    batch = pages.shape[0]
    num_listed = int(kv_indptr[-1])
    bcap = batch if max_batch_size is None else int(max_batch_size)
    icap = max(num_listed, 1) if max_num_pages is None else int(max_num_pages)
    if batch > bcap:
        raise ValueError(f"kv_indptr describes {batch} requests, over max_batch_size={bcap}")
    if num_listed > icap:
        raise ValueError(f"kv_indices lists {num_listed} pages, over max_num_pages={icap}")
    layout = decode_layout(bcap, icap, int(num_cells), fixed_split_pages)
    if fixed_split_pages is not None:
        chunk = int(fixed_split_pages)
    else:  # Algorithm 1, line 3 (scheduler.chunk_for_total)
        chunk = max(-(-min_split_tokens // page_size), -(-num_listed // max(num_cells, 1)), 1)

    # Every entry of buf is written once: sections, their padding, the gaps between them.
    buf = new_buffer(layout.size)
    i0, l0, t0, c0, m0, d0 = layout.starts
    c1 = c0 + layout.num_cells + 1
    buf[i0:i0 + num_listed] = kv_indices[:num_listed]
    if num_pages is not None:
        validate.check_page_ids(buf[i0:i0 + num_listed], num_pages)
    buf[i0 + num_listed:l0] = 0
    buf[l0:l0 + batch] = kv_lens
    buf[l0 + batch:t0] = 0
    lens = buf[l0:l0 + bcap]  # int32[bcap]: kv_lens, 0 for padding rows
    items = buf[t0:t0 + layout.item_cap * DECODE.width].reshape(-1, DECODE.width)
    used = "greedy"

    if not batch or int(validate.largest(pages)) <= chunk:  # no request is split: one item per row, all writethrough
        order, _ = scheduler.assign_positive(_costs(lens, item_cost), layout.num_cells, out=buf[c0:c1])
        base = kv_indptr[:-1]
        if bcap > batch:
            base = np.concatenate([base, np.zeros(bcap - batch, np.int32)])
        n_items = bcap
        items[:n_items, DECODE.request] = order
        items[:n_items, DECODE.page_base] = base.take(order)
        items[:n_items, DECODE.tok_start] = 0
        items[:n_items, DECODE.part_slot] = -1  # writethrough (two fills: a broadcast row is slower)
        items[:n_items, DECODE.tok_end] = lens.take(order)
        buf[c1:d0] = 0  # cell_indptr's gap, merge_indptr (no split request), its gap
        buf[d0:d0 + layout.merge_cap] = -1
        num_split = num_parts = 0
    else:
        order = None  # contiguous items are listed in cell order already
        if partition == "contiguous" or partition == "auto" and fixed_split_pages is None and (
                int(np.add.reduce(-(-pages // chunk))) > layout.num_cells):
            alpha = max(1, -(-ITEM_OVERHEAD_TOKENS // page_size))  # pages
            work, part_end, split, buf[c0:c1] = _contiguous_items(
                pages, kv_indptr, lens, page_size, layout.num_cells, alpha, -(-min_split_tokens // page_size), bcap)
            used = "contiguous"
        else:
            work, part_end, split = _split_items(pages, kv_indptr, lens, chunk, chunk * page_size, batch, bcap)
            tokens = np.subtract(work[:, DECODE.tok_end], work[:, DECODE.tok_start], dtype=np.int64)
            order, _ = scheduler.assign_positive(_costs(tokens, item_cost), layout.num_cells, out=buf[c0:c1])
        n_items = work.shape[0]
        split_reqs = np.flatnonzero(split)
        num_split = split_reqs.shape[0]
        assert n_items <= layout.item_cap and num_split <= layout.merge_cap
        if order is None:  # contiguous: the items are in cell order
            items[:n_items] = work
        else:
            work.take(order, axis=0, out=items[:n_items], mode="clip")  # (clip: in range; no buffered copy)
        buf[c1:m0 + 1] = 0  # cell_indptr's gap, merge_indptr[0]
        merge_indptr = buf[m0 + 1:m0 + 1 + layout.merge_cap]  # [1:]
        part_end.take(split_reqs, out=merge_indptr[:num_split])
        num_parts = int(part_end[-1])
        merge_indptr[num_split:] = num_parts
        buf[m0 + 1 + layout.merge_cap:d0] = 0
        merge_dest = buf[d0:d0 + layout.merge_cap]
        merge_dest[:num_split] = split_reqs
        merge_dest[num_split:] = -1
    buf[t0 + n_items * DECODE.width:c0] = 0  # unused items, the gap after them
    info = dict(chunk_pages=chunk, num_items=n_items, num_split=int(num_split), num_parts=num_parts,
                partition=used)
    return layout, buf, info


def _costs(tokens, item_cost):
    """Algorithm 1's cost of each work item: its tokens plus item_cost (int64[n])."""
    ic = _integer_cost(item_cost)
    if ic is not None:
        return np.add(tokens, ic, dtype=np.int64)
    return (item_cost + tokens).astype(np.int64)


def _contiguous_items(pages, kv_indptr, lens, page_size, num_cells, alpha, min_pages, bcap):
    """The contiguous partition: request r's stream of alpha + pages[r] pages (its first item's
    cost, then its pages), requests in order, is cut into num_cells ranges of equal width (at
    least min_pages + alpha); a cut inside a request's pages splits it there, a cut in its
    alpha zone moves to its start. Empty requests and padding rows (batch..bcap) take no part of
    the stream: their items go to the cells in turn. Returns (items int32[n, DECODE.width] in
    cell order, part_end int64[bcap], split bool[batch], cell_indptr int32[num_cells + 1])."""
    batch = pages.shape[0]
    p = np.zeros(bcap, np.int64)
    p[:batch] = pages
    end = np.add.accumulate(p + alpha * (p > 0))  # [bcap] stream position where each request ends
    start = end - p  # [bcap] stream position of each request's first page
    width = max(-(-int(end[-1]) // num_cells), min_pages + alpha)
    cuts = width * scheduler.arange(-(-int(end[-1]) // width))[1:]  # [k] inside the stream
    req = np.searchsorted(end, cuts, side="right")  # request whose stream holds each cut
    off = cuts - start.take(req)  # the cut's page offset in it (<= 0: in its alpha zone)
    inner = off > 0
    # Items: each request from its start, and from each cut inside its pages; both in stream order.
    item_req = np.concatenate([scheduler.arange(bcap), req[inner]])
    item_first = np.concatenate([np.zeros(bcap, np.int64), off[inner]])
    by_stream = np.argsort(np.concatenate([start, cuts[inner]]), kind="stable")
    item_req, item_first = item_req.take(by_stream), item_first.take(by_stream)
    n = item_req.shape[0]
    last_of_req = np.append(item_req[1:] != item_req[:-1], True)
    item_end = np.where(last_of_req, p.take(item_req), np.append(item_first[1:], 0))
    cell = np.searchsorted(cuts, start.take(item_req) + item_first, side="right")  # [n]
    empty = p.take(item_req) == 0
    cell[empty] = scheduler.arange(int(np.count_nonzero(empty))) % num_cells
    by_cell = cell.argsort(kind="stable")
    cell_indptr = np.searchsorted(cell.take(by_cell), scheduler.arange(num_cells + 1)).astype(np.int32)
    nparts = np.bincount(item_req, minlength=bcap)
    split = nparts > 1
    part_end = np.add.accumulate(nparts * split)
    first_item = np.add.accumulate(nparts) - nparts  # each request's first item
    work = np.empty((n, DECODE.width), np.int32)
    work[:, DECODE.request] = item_req
    base = np.zeros(bcap, np.int64)
    base[:batch] = kv_indptr[:-1]
    work[:, DECODE.page_base] = base.take(item_req)
    work[:, DECODE.tok_start] = item_first * page_size
    work[:, DECODE.tok_end] = np.minimum(lens.take(item_req), item_end * page_size)
    piece = scheduler.arange(n) - first_item.take(item_req)
    work[:, DECODE.part_slot] = np.where(split.take(item_req),
                                         part_end.take(item_req) - nparts.take(item_req) + piece, -1)
    return work.take(by_cell, axis=0), part_end, split[:batch], cell_indptr


def _integer_cost(item_cost):
    """item_cost as an int when it is integral (costs stay integer arithmetic), else None."""
    if type(item_cost) is int:
        return item_cost
    return int(item_cost) if float(item_cost).is_integer() else None


def _split_items(pages, kv_indptr, lens, chunk_pages, chunk_tokens, batch, bcap):
    """The work items of a plan with split requests, in request order: request b's chunks in
    order (consecutive partial slots if it has more than one, else writethrough), then one empty
    item per padding row (batch..bcap). Returns (items int32[n, DECODE.width], part_end
    int64[bcap]: each request's partial slots end (cumulative), split bool[batch])."""
    nchunks = np.ones(bcap, np.int64)
    np.floor_divide(pages + (chunk_pages - 1), chunk_pages, out=nchunks[:batch])
    np.maximum(nchunks, 1, out=nchunks)
    split = nchunks > 1
    part_end = np.add.accumulate(nchunks * split)
    item_end = np.add.accumulate(nchunks)
    # Per request, the item columns' values at its first chunk; tok_start holds -first item
    # (chunk index = item index + it) and part_slot the first partial slot (-1: writethrough).
    per_req = np.zeros((bcap, DECODE.width), np.int32)
    per_req[:, DECODE.request] = scheduler.arange32(bcap)
    per_req[:batch, DECODE.page_base] = kv_indptr[:-1]
    np.subtract(nchunks, item_end, out=per_req[:, DECODE.tok_start], casting="unsafe")
    per_req[:, DECODE.tok_end] = lens
    per_req[:, DECODE.part_slot] = np.where(split, part_end - nchunks, -1)
    req = scheduler.arange(bcap).repeat(nchunks)
    items = per_req.take(req, axis=0)  # [n, DECODE.width]
    chunk_idx = items[:, DECODE.tok_start]
    chunk_idx += scheduler.arange32(items.shape[0])
    items[:, DECODE.part_slot] += chunk_idx
    np.multiply(chunk_idx, chunk_tokens, out=chunk_idx)  # now tok_start
    np.minimum(items[:, DECODE.tok_end], chunk_idx + chunk_tokens, out=items[:, DECODE.tok_end])
    return items, part_end, split[:batch]
