"""BatchAttention plan: one step's requests of any query length, split into two classes.

Short requests (qo_len <= tokens_per_item, the query tokens times the head group fitting one
decode tile) run on the decode kernel: items (DECODE_MULTI) of up to tokens_per_item tokens x the
group, split-KV balanced by Algorithm 1. Longer requests (chunks, prompts) run on the
prefill kernel over their own rows, gathered from q through prefill_rows. Shapes are fixed by the
capacities, so one compiled run() serves every composition with the same tokens_per_item.
"""
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from planner import scheduler, validate
from planner.packing import PackedLayout, new_buffer
from planner.work_items import DECODE_MULTI, MIXED

SHORT_TOKENS = (1, 2, 4, 8, 16)  # tokens_per_item choices (static: one program each)
SHORT_MAX_ROWS = 64  # a short request's tokens x head group fill at most one decode tile
MIN_SPLIT_TOKENS = 256  # no short request's KV splits into chunks below this
MIXED_ITEM_COST = 256  # keys: a mixed-launch item's fixed cost (plan_mixed's cell balance)
_max = np.maximum.reduce


def short_tokens(qo_lens, group, max_rows=SHORT_MAX_ROWS):
    """tokens_per_item for this step: the smallest choice holding every request the decode kernel
    takes (qo_len <= short_cap(group)); returns (tokens_per_item, is_short bool[B])."""
    is_short = qo_lens <= short_cap(group, max_rows)
    longest = int(_max(qo_lens, where=is_short, initial=1))
    return next(t for t in SHORT_TOKENS if t >= longest), is_short


@lru_cache(maxsize=64)
def short_cap(group, max_rows=SHORT_MAX_ROWS):
    """The longest query a short request may have: the largest SHORT_TOKENS choice whose rows
    (tokens x group) fit max_rows (1 at least). The one definition of "short": dispatch's cost
    model and every planner of short items use it."""
    return max(t for t in SHORT_TOKENS if t * group <= max_rows or t == 1)


@dataclass(frozen=True)
class ShortLayout(PackedLayout):
    """Static sizes of the short-request (decode-kernel) plan buffer."""
    ITEMS = DECODE_MULTI
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
                ("items", self.item_cap * self.ITEMS.width), ("cell_indptr", self.num_cells + 1),
                ("merge_indptr", self.merge_cap + 1), ("merge_dest", self.merge_cap),
                ("prefill_rows", self.num_tokens))


@lru_cache(maxsize=256)
def short_layout(num_tokens, batch, index_cap, num_cells, tokens_per_item):
    """ShortLayout.for_capacities, one instance per capacities (its offsets computed once)."""
    return ShortLayout.for_capacities(num_tokens, batch, index_cap, num_cells, tokens_per_item)


def plan_short(qo_indptr, kv_lens, kv_indptr, kv_indices, is_short, *, page_size, num_cells, tokens_per_item,
               num_tokens, batch_cap, index_cap, min_split_tokens=MIN_SPLIT_TOKENS, item_cost=32.0):
    """Work list of the short requests (is_short) on the decode kernel, and the rows of the others
    (prefill_rows: their q rows in order, padded with num_tokens). Returns (layout, buffer, info).

    kv_indptr: each request's first entry in kv_indices (int32[B])."""
    batch = kv_lens.shape[0]
    nnz = int(qo_indptr[-1])
    layout = short_layout(num_tokens, batch_cap, index_cap, num_cells, tokens_per_item)
    qo_lens = qo_indptr[1:] - qo_indptr[:-1]  # int32[B]
    reqs = (is_short & (qo_lens > 0)).nonzero()[0]
    lens_r = kv_lens.take(reqs).astype(np.int64)
    pages = (lens_r + (page_size - 1)) // page_size
    chunk = scheduler.chunk_for_total(np.add.reduce(pages), num_cells, -(-min_split_tokens // page_size))
    nchunks = (pages + (chunk - 1)) // chunk
    np.maximum(nchunks, 1, out=nchunks)
    num_short = reqs.shape[0]
    # Items in request order, in int32 (the buffer's type: values wrap as its cast would).
    work = np.empty((int(np.add.reduce(nchunks)), DECODE_MULTI.width), np.int32)
    if not num_short or int(validate.largest(nchunks)) == 1:  # nothing split: one writethrough item per request
        n_items, n_parts, n_merge = num_short, 0, 0
        work[:, DECODE_MULTI.request] = reqs
        work[:, DECODE_MULTI.page_base] = kv_indptr.take(reqs)
        work[:, DECODE_MULTI.tok_start] = 0
        work[:, DECODE_MULTI.part_slot] = -1  # writethrough
        work[:, DECODE_MULTI.part_stride] = 1
        work[:, DECODE_MULTI.tok_end] = lens_r
        work[:, DECODE_MULTI.q_start] = qo_indptr.take(reqs)
        work[:, DECODE_MULTI.qo_len] = qo_lens.take(reqs)
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
        work[:, DECODE_MULTI.request] = req
        work[:, DECODE_MULTI.page_base] = kv_indptr.take(req)
        work[:, DECODE_MULTI.tok_start] = tok_start
        work[:, DECODE_MULTI.tok_end] = np.minimum(tok_start + chunk * page_size, lens_r.take(local))
        work[:, DECODE_MULTI.part_slot] = np.where(split.take(local), part_first.take(local) + chunk_idx, -1)
        work[:, DECODE_MULTI.part_stride] = nchunks.take(local)
        work[:, DECODE_MULTI.q_start] = qo_indptr.take(req)
        work[:, DECODE_MULTI.qo_len] = qo_lens.take(req)
        spans = work[:, DECODE_MULTI.tok_end] - tok_start
        # Merge groups: one per token of a split request, its nchunks partials contiguous.
        sreq = split.nonzero()[0]
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
    i0, l0, t0, c0, m0, d0, p0 = layout.starts
    buf[i0:i0 + kv_indices.shape[0]] = kv_indices
    buf[l0:l0 + batch] = kv_lens
    items = buf[t0:t0 + n_items * DECODE_MULTI.width].reshape(n_items, DECODE_MULTI.width)
    work.take(order, axis=0, out=items, mode="clip")  # (clip: in range; no buffered copy)
    buf[c0:c0 + layout.num_cells + 1] = cell_indptr
    merge_dest = buf[d0:d0 + layout.merge_cap]
    merge_dest[:] = -1
    if n_merge:
        g_req = np.repeat(sreq, tokens)
        t_in = scheduler.arange(n_merge) - np.repeat(np.cumsum(tokens) - tokens, tokens)
        merge_indptr = buf[m0 + 1:m0 + 1 + layout.merge_cap]  # [1:]
        merge_indptr[:n_merge] = part_first.take(g_req) + (t_in + 1) * nchunks.take(g_req)
        merge_indptr[n_merge:] = merge_indptr[n_merge - 1]
        merge_dest[:n_merge] = qo_indptr.take(reqs.take(g_req)) + t_in
    prefill_rows = buf[p0:p0 + num_tokens]
    long_reqs = (~is_short).nonzero()[0]
    if not long_reqs.shape[0]:  # every row is short
        num_long = 0
    elif int(long_reqs[-1]) - int(long_reqs[0]) + 1 == long_reqs.shape[0]:  # consecutive: one run of rows
        start = int(qo_indptr[long_reqs[0]])
        num_long = int(qo_indptr[long_reqs[-1] + 1]) - start
        np.add(scheduler.arange32(num_long), start, out=prefill_rows[:num_long])
    else:
        long_rows = np.repeat(~is_short, qo_lens).nonzero()[0]
        num_long = long_rows.shape[0]
        prefill_rows[:num_long] = long_rows
    prefill_rows[num_long:] = num_tokens
    info = dict(chunk_pages=chunk, num_items=n_items, num_short=num_short, num_long_tokens=num_long, nnz=nnz)
    return layout, buf, info




@dataclass(frozen=True)
class MixedLayout(PackedLayout):
    """Static sizes of a mixed plan: one persistent launch of query tiles (one query head each,
    tile_tokens tokens) and packed tiles (one short request x one KV head)."""
    ITEMS = MIXED
    num_tokens: int
    batch: int
    index_cap: int
    num_cells: int
    num_qo_heads: int
    num_kv_heads: int
    tile_tokens: int
    tokens_per_item: int  # a packed tile's tokens (its q copies)
    tile_cap: int         # query tiles (each run for every query head)

    @classmethod
    def for_capacities(cls, num_tokens, batch, index_cap, num_cells, num_qo_heads, num_kv_heads, tile_tokens,
                       tokens_per_item):
        tile_cap = -(-(num_tokens + batch * (tile_tokens - 1)) // tile_tokens)  # sum of ceil(qo / T)
        return cls(num_tokens, batch, index_cap, num_cells, num_qo_heads, num_kv_heads, tile_tokens,
                   tokens_per_item, tile_cap)

    @property
    def packed_slot0(self):
        """The first lse slot of packed tiles (query tiles' slots come first: tile * Hq + head)."""
        return self.tile_cap * self.num_qo_heads

    @property
    def num_lse_slots(self):
        return self.packed_slot0 + self.batch * self.num_kv_heads

    def sections(self):
        return (("kv_indices", self.index_cap), ("items", self.num_lse_slots * self.ITEMS.width),
                ("cell_indptr", self.num_cells + 1), ("lse_src", self.num_tokens),
                ("last_page", self.batch), ("last_len", self.batch))


@lru_cache(maxsize=256)
def mixed_layout(*args):
    """MixedLayout.for_capacities, one instance per capacities."""
    return MixedLayout.for_capacities(*args)


def plan_mixed(qo_indptr, kv_lens, page_base, kv_indices, is_short, *, page_size, num_qo_heads, num_kv_heads,
               num_cells, tile_tokens, tokens_per_item, num_tokens, batch_cap, index_cap, causal,
               item_cost=MIXED_ITEM_COST):
    """One persistent work list for a mixed step (pallas_kernels.prefill_mosaic, packed_tokens):
    each short request (is_short) is one packed tile per KV head over all its keys; each other
    request is query tiles of tile_tokens tokens per query head from its first row (the kernel
    reads and stores q / o rows at any start). KV is never split. Items go to cells longest
    first (Algorithm 1), costed in keys: a packed tile's keys or a query tile's visible keys,
    plus item_cost each. (Equal weights measured best on an H100: 320 µs traced on the mixed row
    against 332 with a query tile's key at twice a packed tile's.)

    Returns (layout, buffer, info). lse_src[n] (row n of q): a query-tile row's lse index for
    query head 0 (head h: + h * T); a packed row's for head 0 of its tile (head h: + (h // G) * T +
    h % G; these are the indices >= packed_slot0 * T); -1 for rows past the step. Request b's
    last page when partly filled (the kernel reads its V from a copy with the stale slots zeroed):
    last_page[b], last_len[b] its keys there (else 0), and its items' last_row b (else -1)."""
    group = num_qo_heads // num_kv_heads
    nnz = int(qo_indptr[-1])
    T = tile_tokens
    layout = mixed_layout(num_tokens, batch_cap, index_cap, num_cells, num_qo_heads, num_kv_heads, T,
                          tokens_per_item)
    qo_lens = (qo_indptr[1:] - qo_indptr[:-1]).astype(np.int64)  # [B]
    kv64 = kv_lens.astype(np.int64)
    live = qo_lens > 0
    short = np.flatnonzero(is_short & live)  # [S]
    long_ = np.flatnonzero(live > is_short)  # [L] (live and not short)
    start_l, qo_l, kv_l = qo_indptr.take(long_).astype(np.int64), qo_lens.take(long_), kv64.take(long_)
    p_start, p_qo, p_kv = qo_indptr.take(short).astype(np.int64), qo_lens.take(short), kv64.take(short)

    # Query tiles of the long requests, tile_tok from each one's first row.
    ntiles = -(-qo_l // T)  # [L]
    num_tiles = int(ntiles.sum())
    if num_tiles > layout.tile_cap:
        raise ValueError("the step needs more query tiles than the plan holds")
    tile_req = np.repeat(scheduler.arange(long_.shape[0]), ntiles)  # [tiles]: index into long_
    tile_first = ntiles.cumsum() - ntiles
    tile_tok = (scheduler.arange(num_tiles) - tile_first.take(tile_req)) * T
    qo_t, kv_t = qo_l.take(tile_req), kv_l.take(tile_req)
    # Keys visible to the tile's last token (causal), else all of them.
    kv_hi = np.minimum(kv_t - qo_t + np.minimum(tile_tok + T, qo_t), kv_t) if causal else kv_t

    # Items: query tiles x query heads (slot tile * Hq + head), then packed tiles (slot
    # packed_slot0 + short index * Hkv + KV head): each tile's fields, repeated per head.
    n_q, n_p = num_tiles * num_qo_heads, short.shape[0] * num_kv_heads
    tiles = np.zeros((num_tiles + short.shape[0], MIXED.width), np.int32)
    q_tiles, p_tiles = tiles[:num_tiles], tiles[num_tiles:]
    q_tiles[:, MIXED.q_row_start] = start_l.take(tile_req)
    q_tiles[:, MIXED.tile_tok] = tile_tok
    q_tiles[:, MIXED.qo_len] = qo_t
    q_tiles[:, MIXED.page_base] = page_base.take(long_.take(tile_req))
    q_tiles[:, MIXED.kv_len] = kv_t
    q_tiles[:, MIXED.kv_end] = kv_hi
    p_tiles[:, MIXED.q_row_start] = p_start
    p_tiles[:, MIXED.qo_len] = p_qo
    p_tiles[:, MIXED.page_base] = page_base.take(short)
    p_tiles[:, MIXED.kv_len] = p_kv
    p_tiles[:, MIXED.kv_end] = p_kv
    p_tiles[:, MIXED.packed] = 1
    tiles[:, MIXED.tail] = -1
    partial = np.flatnonzero((qo_lens > 0) & (kv64 % page_size != 0))  # [R]: a partly filled last page
    last_row = np.full(qo_lens.shape, -1, np.int32)
    last_row[partial] = partial
    q_tiles[:, MIXED.last_row] = last_row.take(long_.take(tile_req))
    p_tiles[:, MIXED.last_row] = last_row.take(short)
    items = tiles.repeat(np.repeat([num_qo_heads, num_kv_heads], [num_tiles, short.shape[0]]), axis=0)
    items[:n_q, MIXED.head].reshape(num_tiles, num_qo_heads)[:] = scheduler.arange(num_qo_heads)
    items[n_q:, MIXED.head].reshape(-1, num_kv_heads)[:] = scheduler.arange(num_kv_heads)
    items[:, MIXED.lse_slot] = scheduler.arange(n_q + n_p)
    items[n_q:, MIXED.lse_slot] += layout.packed_slot0 - n_q
    costs = np.add(items[:, MIXED.kv_end], item_cost, dtype=np.int64)  # keys + item_cost
    cell = scheduler.cells_of(costs, layout.num_cells)  # [items]
    # A cell runs its items by kind: even cells their query tiles first, odd cells their packed
    # tiles first, so about half the SMs stream K/V while the others compute (H100, the mixed
    # row in a chain of 10 calls: 328.6 -> 319.8 µs a launch; every cell tiles first, packed
    # first or longest first: 328.6, 339.3, 339.2). Items sorted by (cell, kind first, item id):
    key = np.left_shift(cell, 1, dtype=np.int16 if layout.num_cells < 1 << 14 else np.int64)
    key |= cell & 1  # query tiles second in odd cells
    key[n_q:] ^= 1  # packed tiles: the other way round
    order = key.argsort(kind="stable")

    buf = new_buffer(layout.size)
    buf[:] = 0
    (i0, _), (t0, _), (c0, c1), (s0, s1), (p0, _), (n0, _) = (layout.offsets[name] for name in (
        "kv_indices", "items", "cell_indptr", "lse_src", "last_page", "last_len"))
    buf[i0:i0 + kv_indices.shape[0]] = kv_indices
    items.take(order, axis=0, out=buf[t0:t0 + items.size].reshape(items.shape), mode="clip")  # (in range)
    buf[c0 + 1:c1] = np.add.accumulate(np.bincount(cell, minlength=layout.num_cells))  # (cell_indptr[0] = 0)
    # lse_src: per row of q, the lse index of head 0. Query tile g's row j: g * Hq * T + j;
    # a short request s's token t: (packed_slot0 + s * Hkv) * T + t * group.
    lse_src = buf[s0:s1]
    lse_src[:] = -1
    if num_tiles:
        j = scheduler.arange(T)
        lse = np.add.outer(scheduler.arange(num_tiles) * (num_qo_heads * T), j)  # [tiles, T]
        rows = np.minimum(qo_t - tile_tok, T)  # [tiles]
        if int(validate.smallest(rows)) < T:  # partial tiles: their live rows
            lse = lse[j < rows[:, None]]
        first, last = int(long_[0]), int(long_[-1])
        if int(qo_indptr[last + 1]) - int(qo_indptr[first]) == lse.size:  # one run of rows
            lse_src[int(qo_indptr[first]):int(qo_indptr[last + 1])] = lse.reshape(-1)
        else:
            lse_src[np.repeat(~is_short, qo_lens).nonzero()[0]] = lse.reshape(-1)
    if short.shape[0]:
        width = int(validate.largest(p_qo))  # [S, width] grids: token t of each short request
        t = scheduler.arange(width)
        base = scheduler.arange(short.shape[0]) * (num_kv_heads * T)
        base += layout.packed_slot0 * T
        rows, lse = p_start[:, None] + t, base[:, None] + t * group
        if int(validate.smallest(p_qo)) < width:
            live = t < p_qo[:, None]
            rows, lse = rows[live], lse[live]
        lse_src[rows.reshape(-1)] = lse.reshape(-1)
    buf[p0 + partial] = kv_indices.take(page_base.take(partial) + (kv64.take(partial) - 1) // page_size)
    buf[n0 + partial] = kv64.take(partial) % page_size
    info = dict(num_items=n_q + n_p, num_tiles=num_tiles, num_short=short.shape[0], nnz=nnz)
    return layout, buf, info
