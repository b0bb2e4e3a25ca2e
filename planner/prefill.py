"""Prefill plan: query tiles x KV chunks, Algorithm 1 cell assignment, per-token reduction map.

The tile height (rows = tokens_per_tile x GQA group) follows the paper's rule
(§3.2.2: the smallest tile at least the average qo_len x group) from a fixed
set, so at most len(TILE_ROWS) programs ever compile; everything else that
changes per step is data in one packed int32 buffer.
"""
from dataclasses import dataclass

import numpy as np

from planner import scheduler, validate
from planner.packing import PackedLayout

ITEM_FIELDS = 16  # see pallas_kernels/prefill.py
ROW_ALIGN = 8  # tails plans: TMA copies rows in groups of 8
TILE_ROWS = (16, 32, 64, 128)


def choose_tile_rows(qo_lens, group):
    """Smallest tile (in rows) holding the average query length times the group."""
    live = qo_lens[qo_lens > 0]
    want = (float(live.mean()) if live.size else 1.0) * group
    floor = 1 << max(0, (group - 1).bit_length())  # a tile holds at least one token's group
    for rows in TILE_ROWS:
        if rows >= want and rows >= floor:
            return rows
    return max(TILE_ROWS[-1], floor)


@dataclass(frozen=True)
class PrefillLayout(PackedLayout):
    """Static sizes of the packed plan buffer; hashable, part of the jit cache key."""
    ITEM_FIELDS = ITEM_FIELDS
    num_tokens: int  # rows of q and o
    index_cap: int   # entries of kv_indices
    num_cells: int
    rows: int        # tile height
    group: int
    item_cap: int
    part_cap: int    # partial-state rows (tokens)
    merge_cap: int   # tokens whose tile was split
    tail_cap: int = 0  # rows of the tail map (kernels that store whole tiles; else 0)

    @classmethod
    def for_capacities(cls, num_tokens, batch, index_cap, num_cells, rows, group, num_splits, tails=False):
        """num_splits bounds sum(keys) / L over the tiles: num_cells when L is Algorithm 1's."""
        tokens_per_tile = max(1, rows // group)
        # + one padding request; tails plans start each request's tiles at an aligned row: + 1 each
        tiles = -(-num_tokens // tokens_per_tile) + (2 if tails else 1) * (batch + 1)
        # Split tiles see more than L keys: fewer than num_splits of them, each with
        # <= 2 * keys / L chunks of <= tokens_per_tile tokens.
        return cls(num_tokens, index_cap, num_cells, rows, group, tiles + num_splits,
                   max(1, 2 * num_splits * tokens_per_tile), max(1, num_splits * tokens_per_tile),
                   2 * (batch + 1) * tokens_per_tile if tails else 0)

    @property
    def tokens_per_tile(self):
        return max(1, self.rows // self.group)

    def sections(self):
        return (("kv_indices", self.index_cap), ("q_pos", self.num_tokens),
                ("items", self.item_cap * ITEM_FIELDS),
                ("cell_indptr", self.num_cells + 1), ("merge_indptr", self.merge_cap + 1),
                ("merge_dest", self.merge_cap), ("tail_dest", self.tail_cap),
                ("lse_src", self.num_tokens if self.tail_cap else 0))



def plan_prefill(qo_indptr, kv_lens, page_base, kv_indices, *, group, causal, num_cells,
                 max_num_tokens=None, max_batch_size=None, max_num_pages=None, rows=None,
                 mask_offsets=None, fixed_split_tokens=None, min_split_tokens=512, item_cost=64,
                 kv_pos_offset=None, q_positions=None, window_left=None, tails=False,
                 contiguous_kv=False):
    """Builds the prefill work list. Returns (layout, buffer int32[layout.size], info).

    kv_lens int32[B]: keys per request; page_base int32[B]: each request's offset in
    kv_indices (or its first row, for contiguous K/V); kv_indices: the listed pages
    (may be empty for contiguous K/V); mask_offsets int64[B] (optional): each
    request's offset in the flattened custom mask. Positions (for attention variants):
    request b's keys sit at kv_pos_offset[b] + j (default 0) and its queries at
    q_positions (int32[nnz]; default bottom-right: kv_pos_offset + kv_len - qo_len + i).
    window_left (optional): a sliding window known at plan time; each tile's keys then start at
    its first query's position minus the window, so only the window's keys are balanced.
    tails: for kernels that copy whole tiles by TMA, which reads and writes rows in groups of
    ROW_ALIGN: a request's tiles start at the aligned row below its first row (the first
    tile_tok may be negative: rows before the request are computed and dropped); a tile that
    is not wholly the request's (first or last) goes to tail slot `tail` of a side buffer,
    which tail_dest maps to rows of o (num_tokens: none); lse is stored per work item, in rows
    [slot * tokens_per_tile, ...), and lse_src maps each token to its row there. With
    contiguous_kv (page_base is a row of K), each request's keys likewise start at an aligned
    row: kv_first (item field 13) keys before its own are loaded and masked. Item fields 14, 15:
    the smallest and largest query position of the tile's rows (for variants' mask bounds).
    """
    if fixed_split_tokens is not None and fixed_split_tokens < 1:
        raise ValueError(f"fixed_split_tokens must be >= 1, got {fixed_split_tokens}")
    qo_indptr = validate.check_indptr("qo_indptr", qo_indptr)
    batch = qo_indptr.shape[0] - 1
    if kv_lens.shape[0] != batch:
        raise ValueError(f"qo_indptr describes {batch} requests but the KV side has {kv_lens.shape[0]}")
    nnz = int(qo_indptr[-1])
    qo_lens = (qo_indptr[1:] - qo_indptr[:-1]).astype(np.int64)
    num_tokens = nnz if max_num_tokens is None else int(max_num_tokens)
    bcap = batch if max_batch_size is None else int(max_batch_size)
    icap = max(kv_indices.shape[0], 1) if max_num_pages is None else int(max_num_pages)
    if nnz > num_tokens:
        raise ValueError(f"qo_indptr covers {nnz} tokens, over max_num_tokens={num_tokens}")
    if batch > bcap:
        raise ValueError(f"qo_indptr describes {batch} requests, over max_batch_size={bcap}")
    if kv_indices.shape[0] > icap:
        raise ValueError(f"kv_indices lists {kv_indices.shape[0]} pages, over max_num_pages={icap}")
    rows = choose_tile_rows(qo_lens, group) if rows is None else int(rows)
    tpt = max(1, rows // group)

    # Query tiles of every request, then of one padding request over rows [nnz, num_tokens).
    pad = num_tokens - nnz
    all_qo = np.append(qo_lens, pad)
    all_kv = np.append(kv_lens.astype(np.int64), 0)
    qo_start = np.append(qo_indptr[:-1], nnz)
    q_off = qo_start % ROW_ALIGN if tails else np.zeros_like(qo_start)  # rows below the start
    ntiles = np.where(all_qo > 0, -(-(all_qo + q_off) // tpt), 0)
    req = np.repeat(np.arange(batch + 1), ntiles)
    tile_tok = (np.arange(req.shape[0]) - (np.cumsum(ntiles) - ntiles)[req]) * tpt - q_off[req]
    qo_r, kv_r = all_qo[req], all_kv[req]
    kv_hi = kv_r
    if causal:  # keys visible to the tile's last token
        kv_hi = np.clip(np.minimum(tile_tok + tpt, qo_r) - 1 + kv_r - qo_r + 1, 0, kv_r)

    kv_lo = np.zeros_like(kv_hi)
    if window_left is not None and window_left >= 0:  # keys left of the first row's window
        kv_lo = np.clip(tile_tok + kv_r - qo_r - int(window_left), 0, kv_hi)
    span = kv_hi - kv_lo

    num_splits = int(num_cells)
    if tails:  # whole-tile kernels: one unsplit item per cell, longest first
        num_splits, num_cells = 0, -(-num_tokens // tpt) + 2 * (bcap + 1)
        chunk = max(int(span.max(initial=0)), 1)
    elif fixed_split_tokens is not None:
        chunk = int(fixed_split_tokens)
        if max_num_tokens is None:  # shapes follow the inputs anyway: size for this split
            num_splits = max(num_splits, -(-int(span.sum()) // chunk))
    else:
        chunk = scheduler.kv_chunk_size(span, num_cells, min_split_tokens)
    layout = PrefillLayout.for_capacities(num_tokens, bcap, icap, int(num_cells), rows, group, num_splits,
                                          tails=tails)
    nchunks = np.maximum(-(-span // chunk), 1)
    split = nchunks > 1
    tile_of = np.repeat(np.arange(req.shape[0]), nchunks)
    chunk_idx = np.arange(tile_of.shape[0]) - (np.cumsum(nchunks) - nchunks)[tile_of]
    kv_start = kv_lo[tile_of] + chunk_idx * chunk
    kv_end = np.minimum(kv_start + chunk, kv_hi[tile_of])
    tile_tokens = np.minimum(tpt, qo_r - tile_tok)  # real tokens in each tile
    part_size = np.where(split, tile_tokens * nchunks, 0)
    part_base = np.cumsum(part_size) - part_size
    if int(part_size.sum()) > layout.part_cap or tile_of.shape[0] > layout.item_cap:
        raise ValueError("the split needs more partial states or work items than the plan holds; "
                         "use a larger fixed_split_tokens (or no capacities)")

    items = np.zeros((tile_of.shape[0], ITEM_FIELDS), np.int64)
    r_of = req[tile_of]
    items[:, 0] = qo_start[r_of]
    items[:, 1] = tile_tok[tile_of]
    items[:, 2] = all_qo[r_of]
    kv_off = np.zeros(batch + 1, np.int64)  # keys loaded before the request's first (masked)
    if tails and contiguous_kv:
        kv_off[:batch] = np.asarray(page_base, np.int64) % ROW_ALIGN
    items[:, 3] = np.append(page_base, 0)[r_of] - kv_off[r_of]
    items[:, 4] = all_kv[r_of] + kv_off[r_of]
    items[:, 5] = np.where(kv_start > 0, kv_start + kv_off[r_of], 0)  # tails, no window: aligned
    items[:, 6] = kv_end + kv_off[r_of]
    items[:, 7] = np.where(split[tile_of], part_base[tile_of], -1)
    items[:, 8] = nchunks[tile_of]
    items[:, 9] = chunk_idx
    items[:, 10] = -1 if mask_offsets is None else np.append(mask_offsets, 0)[r_of]
    pos_off = np.zeros(batch, np.int64) if kv_pos_offset is None else np.asarray(kv_pos_offset, np.int64)
    items[:, 11] = np.append(pos_off, 0)[r_of] - kv_off[r_of]  # key t's position: field 11 + t
    # Tiles not wholly the request's rows (partial, or starting before it): a tail slot each.
    is_tail = (tile_tok < 0) | (tile_tok + tpt > qo_r)
    tail_slot = np.where(is_tail, np.cumsum(is_tail) - 1, -1)
    items[:, 12] = tail_slot[tile_of]
    items[:, 13] = kv_off[r_of]
    if q_positions is None:
        tok_req = np.repeat(np.arange(batch), qo_lens)
        q_positions = (pos_off + kv_lens - qo_lens)[tok_req] + np.arange(nnz) - qo_indptr[:-1][tok_req]
    # Each tile's query-position range: tiles cover rows [0, num_tokens) in order, each from its
    # first real row.
    all_pos = np.zeros(num_tokens, np.int64)
    all_pos[:nnz] = q_positions
    if req.shape[0]:
        first_row = qo_start[req] + np.maximum(tile_tok, 0)
        items[:, 14] = np.minimum.reduceat(all_pos, first_row)[tile_of]
        items[:, 15] = np.maximum.reduceat(all_pos, first_row)[tile_of]

    order, cell_indptr = scheduler.assign_cells(item_cost * tpt + (kv_end - kv_start), layout.num_cells)

    # Reduction map: one group per token of a split tile, its partials contiguous.
    split_tiles = np.flatnonzero(split)
    n_merge = int(tile_tokens[split_tiles].sum())
    if n_merge > layout.merge_cap:
        raise ValueError("the split needs more merge groups than the plan holds")
    t_in = np.arange(n_merge) - np.repeat(np.cumsum(tile_tokens[split_tiles]) - tile_tokens[split_tiles],
                                          tile_tokens[split_tiles])
    tile_m = np.repeat(split_tiles, tile_tokens[split_tiles])

    buf = np.zeros(layout.size, np.int32)
    sec = layout.unpack(buf)
    sec["kv_indices"][:kv_indices.shape[0]] = kv_indices
    sec["q_pos"][:nnz] = q_positions
    sec["items"][:items.shape[0]] = items[order]
    sec["cell_indptr"][:] = cell_indptr
    sec["merge_indptr"][1:n_merge + 1] = part_base[tile_m] + (t_in + 1) * nchunks[tile_m]
    sec["merge_indptr"][n_merge + 1:] = sec["merge_indptr"][n_merge]
    sec["merge_dest"][:] = -1
    sec["merge_dest"][:n_merge] = qo_start[req[tile_m]] + tile_tok[tile_m] + t_in
    if tails:  # tail slot s holds tile t's rows: tail row s * tpt + j -> token tile_tok[t] + j
        t = np.flatnonzero(is_tail)
        tok = tile_tok[t][:, None] + np.arange(tpt)[None, :]  # [slots, tpt]
        live = (tok >= 0) & (tok < qo_r[t][:, None])
        dest = np.where(live, qo_start[req[t]][:, None] + tok, num_tokens).reshape(-1)
        sec["tail_dest"][:dest.size] = dest
        sec["tail_dest"][dest.size:] = num_tokens
        # lse is stored per item (tile) slot, aligned: token i of request r -> its tile's slot.
        slot_of_tile = np.empty_like(order)
        slot_of_tile[order] = np.arange(order.shape[0])
        tok_r = np.repeat(np.arange(batch + 1), all_qo)
        tok_i = np.arange(num_tokens) - np.repeat(np.cumsum(all_qo) - all_qo, all_qo) + q_off[tok_r]
        tile = (np.cumsum(ntiles) - ntiles)[tok_r] + tok_i // tpt
        sec["lse_src"][:] = slot_of_tile[tile] * tpt + tok_i % tpt
    info = dict(rows=rows, chunk_tokens=chunk, num_items=int(items.shape[0]),
                num_split_tiles=int(split_tiles.size), num_parts=int(part_size.sum()))
    return layout, buf, info
