"""Decode plan: split-KV work items, Algorithm 1 cell assignment, reduction map, one packed buffer.

Every array has a shape fixed by the capacities (max_batch_size,
max_num_pages, num_cells), so the jitted run() compiles once; what changes
from step to step (lengths, chunk size, work lists, page ids) is data.
"""
from dataclasses import dataclass

import numpy as np

from planner import scheduler, validate
from planner.packing import PackedLayout

ITEM_FIELDS = 5  # (request, page_base, tok_start, tok_end, part_slot); see pallas_kernels/decode.py


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



def plan_decode(kv_indptr, kv_indices, kv_last_page_len, *, page_size, num_cells,
                num_pages=None, max_batch_size=None, max_num_pages=None,
                fixed_split_pages=None, min_split_tokens=256, item_cost=32.0):
    """Builds the decode work list. Returns (layout, buffer int32[layout.size], info dict).

    fixed_split_pages: chunk size in pages independent of the batch, which makes
    each request's output independent of the other requests (batch invariance).
    item_cost: the per-item cost alpha in tokens (Algorithm 1: alpha*l_q + beta*l_kv, beta = 1).
    """
    if fixed_split_pages is not None and fixed_split_pages < 1:
        raise ValueError(f"fixed_split_pages must be >= 1, got {fixed_split_pages}")
    kv_indptr, kv_indices, kv_last_page_len, kv_lens, pages = validate.check_page_table(
        kv_indptr, kv_indices, kv_last_page_len, page_size, num_pages)
    batch = kv_indptr.shape[0] - 1
    num_listed = int(kv_indptr[-1])
    bcap = batch if max_batch_size is None else int(max_batch_size)
    icap = max(num_listed, 1) if max_num_pages is None else int(max_num_pages)
    if batch > bcap:
        raise ValueError(f"kv_indptr describes {batch} requests, over max_batch_size={bcap}")
    if num_listed > icap:
        raise ValueError(f"kv_indices lists {num_listed} pages, over max_num_pages={icap}")
    layout = DecodeLayout.for_capacities(bcap, icap, int(num_cells), fixed_split_pages)

    if fixed_split_pages is not None:
        chunk = int(fixed_split_pages)
    else:
        chunk = scheduler.kv_chunk_size(pages, num_cells, -(-min_split_tokens // page_size))
    nchunks = np.maximum(-(-pages // chunk), 1)  # an empty request gets one (empty) item
    items = np.zeros((int(nchunks.sum()) + bcap - batch, ITEM_FIELDS), np.int64)
    if int(nchunks.max(initial=1)) == 1:  # no request is split: one item per row, all writethrough
        split_reqs = np.zeros(0, np.int64)
        items[:, 0] = np.arange(bcap)
        items[:batch, 1] = kv_indptr[:-1]
        items[:batch, 3] = kv_lens
        items[:, 4] = -1
    else:
        split_reqs = np.flatnonzero(nchunks > 1)
        _split_items(items, nchunks, kv_indptr, kv_lens, chunk * page_size, batch, bcap)
    assert items.shape[0] <= layout.item_cap and split_reqs.size <= layout.merge_cap

    order, cell_indptr = scheduler.assign_cells(item_cost + items[:, 3] - items[:, 2], layout.num_cells)

    buf = np.zeros(layout.size, np.int32)
    sec = layout.unpack(buf)
    sec["kv_indices"][:num_listed] = kv_indices[:num_listed]
    sec["kv_lens"][:batch] = kv_lens
    sec["items"][:items.shape[0]] = items[order]
    sec["cell_indptr"][:] = cell_indptr
    sec["merge_indptr"][1:split_reqs.size + 1] = np.cumsum(nchunks[split_reqs])
    sec["merge_indptr"][split_reqs.size + 1:] = sec["merge_indptr"][split_reqs.size]
    sec["merge_dest"][:] = -1
    sec["merge_dest"][:split_reqs.size] = split_reqs
    info = dict(chunk_pages=chunk, num_items=int(items.shape[0]), num_split=int(split_reqs.size),
                num_parts=int(sec["merge_indptr"][-1]))
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
