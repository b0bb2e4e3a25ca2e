"""Decode plan: split-KV work items, Algorithm 1 cell assignment, reduction map, one packed buffer.

Every array has a shape fixed by the capacities (max_batch_size,
max_num_pages, num_cells), so the jitted run() compiles once; what changes
from step to step (lengths, chunk size, work lists, page ids) is data.
"""
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from planner import scheduler, validate
from planner.packing import PackedLayout, new_buffer

_max = np.maximum.reduce

ITEM_FIELDS = 5  # (request, page_base, tok_start, tok_end, part_slot); see pallas_kernels/decode.py
_WRITETHROUGH = np.array([0, -1], np.int32)  # (tok_start, part_slot) of an unsplit request's item


@dataclass(frozen=True)
class DecodeLayout(PackedLayout):
    """Static sizes of the packed plan buffer; hashable, part of the jit cache key."""
    ITEM_FIELDS = ITEM_FIELDS
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
        at most 2 * pages / L chunks. Without a fixed split, n = num_cells."""
        n = num_cells if fixed_split_pages is None else -(-index_cap // fixed_split_pages)
        return cls(batch, index_cap, num_cells, batch + n, 2 * n, max(1, min(batch, n)))

    def sections(self):
        """(name, size) of each int32 section, in buffer order."""
        return (("kv_indices", self.index_cap), ("kv_lens", self.batch),
                ("items", self.item_cap * ITEM_FIELDS), ("cell_indptr", self.num_cells + 1),
                ("merge_indptr", self.merge_cap + 1), ("merge_dest", self.merge_cap))



@lru_cache(maxsize=256)
def decode_layout(batch, index_cap, num_cells, fixed_split_pages=None):
    """DecodeLayout.for_capacities, one instance per capacities (its offsets computed once)."""
    return DecodeLayout.for_capacities(batch, index_cap, num_cells, fixed_split_pages)


def plan_decode(kv_indptr, kv_indices, kv_last_page_len, *, page_size, num_cells,
                num_pages=None, max_batch_size=None, max_num_pages=None,
                fixed_split_pages=None, min_split_tokens=256, item_cost=32.0):
    """Builds the decode work list. Returns (layout, buffer int32[layout.size], info dict).

    fixed_split_pages: chunk size in pages independent of the batch, which makes
    each request's output independent of the other requests (batch invariance).
    item_cost: the per-item cost alpha in tokens (Algorithm 1: alpha*l_q + beta*l_kv, beta = 1).
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    table = validate.check_page_table(kv_indptr, kv_indices, kv_last_page_len, page_size, num_pages)
    return plan_decode_checked(table, page_size=page_size, num_cells=num_cells,
                               max_batch_size=max_batch_size, max_num_pages=max_num_pages,
                               fixed_split_pages=fixed_split_pages, min_split_tokens=min_split_tokens,
                               item_cost=item_cost)


def plan_decode_checked(table, *, page_size, num_cells, max_batch_size=None, max_num_pages=None,
                        fixed_split_pages=None, min_split_tokens=256, item_cost=32.0):
    """plan_decode over a page table that validate.check_page_table already returned (`table`):
    callers that look at the table first (cascade="auto") validate it once."""
    if fixed_split_pages is not None and fixed_split_pages < 1:
        raise ValueError(f"fixed_split_pages must be >= 1, got {fixed_split_pages}")
    if not item_cost >= 1:  # every item, empty ones too, then has a positive cost
        raise ValueError(f"item_cost must be >= 1, got {item_cost}")
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
    else:
        chunk = scheduler.chunk_for_total(num_listed, num_cells, -(-min_split_tokens // page_size))

    # Every entry of buf is written once: sections, their padding, the gaps between them.
    buf = new_buffer(layout.size)
    off = layout.offsets
    (i0, _), (l0, _), (t0, _), (c0, c1), (m0, _), (d0, d1) = (
        off[name] for name in ("kv_indices", "kv_lens", "items", "cell_indptr", "merge_indptr",
                               "merge_dest"))
    buf[i0:i0 + num_listed] = kv_indices[:num_listed]
    buf[i0 + num_listed:l0] = 0
    buf[l0:l0 + batch] = kv_lens
    buf[l0 + batch:t0] = 0
    lens = buf[l0:l0 + bcap]  # int32[bcap]: kv_lens, 0 for padding rows
    items = buf[t0:t0 + layout.item_cap * ITEM_FIELDS].reshape(-1, ITEM_FIELDS)
    merge_indptr, merge_dest = buf[m0:m0 + layout.merge_cap + 1], buf[d0:d1]
    ic = int(item_cost) if float(item_cost).is_integer() else None

    if not batch or int(_max(pages)) <= chunk:  # no request is split: one item per row, all writethrough
        costs = np.add(lens, ic, dtype=np.int64) if ic is not None else (item_cost + lens).astype(np.int64)
        order, _ = scheduler.assign_positive(costs, layout.num_cells, out=buf[c0:c1])
        base = kv_indptr[:-1]
        if bcap > batch:
            base = np.concatenate([base, np.zeros(bcap - batch, np.int32)])
        n_items = bcap
        items[:n_items, 0] = order
        items[:n_items, 1] = base.take(order)
        items[:n_items, 2::2] = _WRITETHROUGH
        items[:n_items, 3] = lens.take(order)
        buf[c1:d0] = 0  # cell_indptr's gap, merge_indptr (no split request), its gap
        merge_dest[:] = -1
        num_split = num_parts = 0
    else:
        nchunks = np.maximum(-(-pages // chunk), 1)
        split_reqs = np.flatnonzero(nchunks > 1)
        work = np.zeros((int(nchunks.sum()) + bcap - batch, ITEM_FIELDS), np.int64)
        _split_items(work, nchunks, kv_indptr, kv_lens, chunk * page_size, batch, bcap)
        n_items, num_split = work.shape[0], split_reqs.size
        assert n_items <= layout.item_cap and num_split <= layout.merge_cap
        costs = work[:, 3] - work[:, 2] + ic if ic is not None else (item_cost + work[:, 3] - work[:, 2])
        order, _ = scheduler.assign_positive(costs.astype(np.int64, copy=False), layout.num_cells,
                                             out=buf[c0:c1])
        items[:n_items] = work[order]
        buf[c1:m0 + 1] = 0  # cell_indptr's gap, merge_indptr[0]
        np.cumsum(nchunks[split_reqs], out=merge_indptr[1:num_split + 1])
        num_parts = int(merge_indptr[num_split])
        merge_indptr[num_split + 1:] = num_parts
        buf[m0 + layout.merge_cap + 1:d0] = 0
        merge_dest[:num_split] = split_reqs
        merge_dest[num_split:] = -1
    buf[t0 + n_items * ITEM_FIELDS:c0] = 0  # unused items, the gap after them
    info = dict(chunk_pages=chunk, num_items=n_items, num_split=int(num_split), num_parts=num_parts)
    return layout, buf, info


def _split_items(items, nchunks, kv_indptr, kv_lens, chunk_tokens, batch, bcap):
    """Fills items with request b's chunks in order; split requests get consecutive partial
    slots, the rest write through; padding rows (batch..bcap) get empty items."""
    n_items = items.shape[0] - (bcap - batch)
    split = nchunks > 1
    req = np.repeat(np.arange(batch), nchunks)
    chunk_idx = np.arange(n_items) - (np.cumsum(nchunks) - nchunks)[req]
    tok_start = chunk_idx * chunk_tokens
    part_first = np.cumsum(np.where(split, nchunks, 0)) - np.where(split, nchunks, 0)
    items[:n_items, 0] = req
    items[:n_items, 1] = kv_indptr[:-1][req]
    items[:n_items, 2] = tok_start
    items[:n_items, 3] = np.minimum(tok_start + chunk_tokens, kv_lens[req])
    items[:n_items, 4] = np.where(split[req], part_first[req] + chunk_idx, -1)
    items[n_items:, 0] = np.arange(batch, bcap)
    items[n_items:, 4] = -1
