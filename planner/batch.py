"""BatchAttention plan: one step's requests of any query length, split into two classes.

Short requests (qo_len <= tokens_per_item, the query tokens times the head group fitting one
decode tile) run on the decode kernel: items of up to tokens_per_item tokens x the group, split-KV
balanced by Algorithm 1 (MULTI_ITEM_COLUMNS). Longer requests (chunks, prompts) run on the
prefill kernel over their own rows, gathered from q through prefill_rows. Shapes are fixed by the
capacities, so one compiled run() serves every composition with the same tokens_per_item.
"""
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from planner import scheduler
from planner.packing import PackedLayout, new_buffer

ITEM_COLUMNS = ("request", "page_base", "tok_start", "tok_end", "part_slot", "part_stride", "q_start",
                "qo_len")  # = pallas_kernels.decode.MULTI_ITEM_COLUMNS (tests check)
SHORT_TOKENS = (1, 2, 4, 8, 16)  # tokens_per_item choices (static: one program each)


def short_tokens(qo_lens, group, max_rows=64):
    """tokens_per_item for this step: the smallest choice holding every request the decode kernel
    takes (qo_len * group <= max_rows); returns (tokens_per_item, is_short bool[B])."""
    cap = max(t for t in SHORT_TOKENS if t * group <= max_rows or t == 1)
    is_short = qo_lens <= cap
    longest = int(qo_lens[is_short].max(initial=1))
    return next(t for t in SHORT_TOKENS if t >= longest), is_short


@dataclass(frozen=True)
class ShortLayout(PackedLayout):
    """Static sizes of the short-request (decode-kernel) plan buffer."""
    ITEM_FIELDS = len(ITEM_COLUMNS)
    num_tokens: int  # rows of q and o
    batch: int       # requests (kv_lens entries)
    index_cap: int
    num_cells: int
    tokens_per_item: int
    item_cap: int
    part_cap: int
    merge_cap: int

    @classmethod
    def for_capacities(cls, num_tokens, batch, index_cap, num_cells, tokens_per_item):
        """As DecodeLayout.for_capacities, each partial and merge group per token of an item."""
        n, t = num_cells, tokens_per_item
        return cls(num_tokens, batch, index_cap, num_cells, t, batch + n, 2 * n * t, max(1, min(batch, n)) * t)

    def sections(self):
        return (("kv_indices", self.index_cap), ("kv_lens", self.batch),
                ("items", self.item_cap * self.ITEM_FIELDS), ("cell_indptr", self.num_cells + 1),
                ("merge_indptr", self.merge_cap + 1), ("merge_dest", self.merge_cap),
                ("prefill_rows", self.num_tokens))


@lru_cache(maxsize=256)
def short_layout(num_tokens, batch, index_cap, num_cells, tokens_per_item):
    """ShortLayout.for_capacities, one instance per capacities (its offsets computed once)."""
    return ShortLayout.for_capacities(num_tokens, batch, index_cap, num_cells, tokens_per_item)


def plan_short(qo_indptr, kv_lens, kv_indptr, kv_indices, is_short, *, page_size, num_cells, tokens_per_item,
               num_tokens, batch_cap, index_cap, min_split_tokens=256, item_cost=32.0):
    """Work list of the short requests (is_short) on the decode kernel, and the rows of the others
    (prefill_rows: their q rows in order, padded with num_tokens). Returns (layout, buffer, info).

    kv_indptr: each request's first entry in kv_indices (int32[B])."""
    batch = kv_lens.shape[0]
    nnz = int(qo_indptr[-1])
    layout = short_layout(num_tokens, batch_cap, index_cap, num_cells, tokens_per_item)
    qo_lens = (qo_indptr[1:] - qo_indptr[:-1]).astype(np.int64)  # int64[B]
    reqs = np.flatnonzero(is_short & (qo_lens > 0))
    lens_r = kv_lens.take(reqs).astype(np.int64)
    pages = -(-lens_r // page_size)
    chunk = scheduler.kv_chunk_size(pages, num_cells, -(-min_split_tokens // page_size))
    nchunks = -(-pages // chunk)
    np.maximum(nchunks, 1, out=nchunks)
    num_short = reqs.shape[0]
    work = np.empty((int(nchunks.sum()), len(ITEM_COLUMNS)), np.int64)  # items in request order
    if not num_short or int(nchunks.max()) == 1:  # nothing split: one writethrough item per request
        n_items, n_parts, n_merge = num_short, 0, 0
        work[:, 0] = reqs
        work[:, 1] = kv_indptr.take(reqs)
        work[:, 2] = 0
        work[:, 3] = lens_r
        work[:, 4:6] = (-1, 1)
        work[:, 6] = qo_indptr.take(reqs)
        work[:, 7] = qo_lens.take(reqs)
        spans = lens_r
    else:
        split = nchunks > 1
        n_items = work.shape[0]
        local = np.repeat(scheduler.arange(num_short), nchunks)
        chunk_idx = scheduler.arange(n_items) - (np.cumsum(nchunks) - nchunks).take(local)
        parts = np.where(split, nchunks * qo_lens.take(reqs), 0)  # partial rows of each request
        part_first = np.cumsum(parts)
        n_parts = int(part_first[-1])
        part_first -= parts
        req = reqs.take(local)
        tok_start = chunk_idx * (chunk * page_size)
        work[:, 0] = req
        work[:, 1] = kv_indptr.take(req)
        work[:, 2] = tok_start
        work[:, 3] = np.minimum(tok_start + chunk * page_size, lens_r.take(local))
        work[:, 4] = np.where(split.take(local), part_first.take(local) + chunk_idx, -1)
        work[:, 5] = nchunks.take(local)
        work[:, 6] = qo_indptr.take(req)
        work[:, 7] = qo_lens.take(req)
        spans = work[:, 3] - tok_start
        # Merge groups: one per token of a split request, its nchunks partials contiguous.
        sreq = np.flatnonzero(split)
        tokens = qo_lens.take(reqs.take(sreq))
        n_merge = int(tokens.sum())
    if n_items > layout.item_cap or n_parts > layout.part_cap:
        raise ValueError("the split needs more work items or partial states than the plan holds")
    ic = int(item_cost) if float(item_cost).is_integer() and item_cost >= 1 else None
    if ic is not None:  # integer costs, all positive
        order, cell_indptr = scheduler.assign_positive(spans + ic * tokens_per_item, layout.num_cells)
    else:
        order, cell_indptr = scheduler.assign_cells(
            (item_cost * tokens_per_item + spans).astype(np.int64), layout.num_cells)
    if n_merge > layout.merge_cap:
        raise ValueError("the split needs more merge groups than the plan holds")

    buf = new_buffer(layout.size)
    buf[:] = 0
    (i0, _), (l0, _), (t0, _), (c0, c1), (m0, _), (d0, d1), (p0, p1) = (
        layout.offsets[name] for name in ("kv_indices", "kv_lens", "items", "cell_indptr", "merge_indptr",
                                          "merge_dest", "prefill_rows"))
    buf[i0:i0 + kv_indices.shape[0]] = kv_indices
    buf[l0:l0 + batch] = kv_lens
    buf[t0:t0 + n_items * len(ITEM_COLUMNS)].reshape(n_items, len(ITEM_COLUMNS))[:] = work.take(order, axis=0)
    buf[c0:c1] = cell_indptr
    merge_dest = buf[d0:d1]
    merge_dest[:] = -1
    if n_merge:
        g_req = np.repeat(sreq, tokens)
        t_in = scheduler.arange(n_merge) - np.repeat(np.cumsum(tokens) - tokens, tokens)
        merge_indptr = buf[m0 + 1:m0 + 1 + layout.merge_cap]  # [1:]
        merge_indptr[:n_merge] = part_first.take(g_req) + (t_in + 1) * nchunks.take(g_req)
        merge_indptr[n_merge:] = merge_indptr[n_merge - 1]
        merge_dest[:n_merge] = qo_indptr.take(reqs.take(g_req)) + t_in
    prefill_rows = buf[p0:p1]
    if bool(is_short.all()):  # every row is short
        prefill_rows[:] = num_tokens
        num_long = 0
    else:
        long_rows = np.flatnonzero(np.repeat(~is_short, qo_lens))
        num_long = long_rows.shape[0]
        prefill_rows[:num_long] = long_rows
        prefill_rows[num_long:] = num_tokens
    info = dict(chunk_pages=chunk, num_items=n_items, num_short=num_short, num_long_tokens=num_long, nnz=nnz)
    return layout, buf, info
