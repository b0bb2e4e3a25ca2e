"""BatchAttention plan: one step's requests of any query length, split into two classes.

Short requests (qo_len <= tokens_per_item, the query tokens times the head group fitting one
decode tile) run on the decode kernel: items of up to tokens_per_item tokens x the group, split-KV
balanced by Algorithm 1 (MULTI_ITEM_COLUMNS). Longer requests (chunks, prompts) run on the
prefill kernel over their own rows, gathered from q through prefill_rows. Shapes are fixed by the
capacities, so one compiled run() serves every composition with the same tokens_per_item.
"""
from dataclasses import dataclass

import numpy as np

from planner import scheduler
from planner.packing import PackedLayout

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
                ("prefill_rows", self.num_tokens), ("row_is_short", self.num_tokens))


def plan_short(qo_indptr, kv_lens, kv_indptr, kv_indices, is_short, *, page_size, num_cells, tokens_per_item,
               num_tokens, batch_cap, index_cap, min_split_tokens=256, item_cost=32.0):
    """Work list of the short requests (is_short) on the decode kernel, and the rows of the others
    (prefill_rows: their q rows in order, padded with num_tokens). Returns (layout, buffer, info)."""
    batch = kv_lens.shape[0]
    nnz = int(qo_indptr[-1])
    layout = ShortLayout.for_capacities(num_tokens, batch_cap, index_cap, num_cells, tokens_per_item)
    qo_lens = np.diff(qo_indptr).astype(np.int64)
    reqs = np.flatnonzero(is_short & (qo_lens > 0))
    pages = -(-kv_lens[reqs].astype(np.int64) // page_size)
    chunk = scheduler.kv_chunk_size(pages, num_cells, -(-min_split_tokens // page_size))
    nchunks = np.maximum(-(-pages // chunk), 1)
    split = nchunks > 1
    n_items = int(nchunks.sum())
    req = np.repeat(reqs, nchunks)
    local = np.repeat(np.arange(reqs.shape[0]), nchunks)
    chunk_idx = np.arange(n_items) - (np.cumsum(nchunks) - nchunks)[local]
    parts = np.where(split, nchunks * qo_lens[reqs], 0)  # partial rows of each request
    part_first = np.cumsum(parts) - parts
    items = np.zeros((n_items, len(ITEM_COLUMNS)), np.int64)
    tok_start = chunk_idx * chunk * page_size
    items[:, 0] = req
    items[:, 1] = kv_indptr[req]
    items[:, 2] = tok_start
    items[:, 3] = np.minimum(tok_start + chunk * page_size, kv_lens[req])
    items[:, 4] = np.where(split[local], part_first[local] + chunk_idx, -1)
    items[:, 5] = nchunks[local]
    items[:, 6] = qo_indptr[req]
    items[:, 7] = qo_lens[req]
    if n_items > layout.item_cap or int(parts.sum()) > layout.part_cap:
        raise ValueError("the split needs more work items or partial states than the plan holds")
    order, cell_indptr = scheduler.assign_cells(
        (item_cost * tokens_per_item + items[:, 3] - items[:, 2]).astype(np.int64), layout.num_cells)

    # Merge groups: one per token of a split request, its nchunks partials contiguous.
    sreq = np.flatnonzero(split)
    tokens = qo_lens[reqs[sreq]]
    n_merge = int(tokens.sum())
    if n_merge > layout.merge_cap:
        raise ValueError("the split needs more merge groups than the plan holds")
    g_req = np.repeat(sreq, tokens)
    t_in = np.arange(n_merge) - np.repeat(np.cumsum(tokens) - tokens, tokens)
    buf = np.zeros(layout.size, np.int32)
    sec = layout.unpack(buf)
    sec["kv_indices"][:kv_indices.shape[0]] = kv_indices
    sec["kv_lens"][:batch] = kv_lens
    sec["items"][:n_items] = items[order]
    sec["cell_indptr"][:] = cell_indptr
    sec["merge_indptr"][1:n_merge + 1] = part_first[g_req] + (t_in + 1) * nchunks[g_req]
    sec["merge_indptr"][n_merge + 1:] = sec["merge_indptr"][n_merge]
    sec["merge_dest"][:] = -1
    sec["merge_dest"][:n_merge] = qo_indptr[reqs[g_req]] + t_in
    long_rows = np.flatnonzero(np.repeat(~is_short, qo_lens))
    sec["prefill_rows"][:] = num_tokens
    sec["prefill_rows"][:long_rows.shape[0]] = long_rows
    sec["row_is_short"][:nnz] = np.repeat(is_short, qo_lens)
    info = dict(chunk_pages=chunk, num_items=n_items, num_short=int(reqs.shape[0]),
                num_long_tokens=int(long_rows.shape[0]), nnz=nnz)
    return layout, buf, info
