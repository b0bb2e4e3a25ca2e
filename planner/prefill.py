"""Prefill plan: query tiles x KV chunks, Algorithm 1 cell assignment, per-token reduction map.

The tile height (rows = tokens_per_tile x GQA group) follows the paper's rule
(§3.2.2: the smallest tile at least the average qo_len x group) from a fixed
set, so at most len(TILE_ROWS) programs ever compile; everything else that
changes per step is data in one packed int32 buffer.
"""
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import numpy as np

from planner import scheduler, validate
from planner.packing import PackedLayout, new_buffer
from planner.work_items import PREFILL

ROW_ALIGN = 8  # tails plans: TMA copies rows in groups of 8
TILE_ROWS = (16, 32, 64, 128)


def choose_tile_rows(qo_lens, group, total=None):
    """Smallest tile (in rows) holding the average query length times the group
    (total: sum(qo_lens), if known)."""
    live = np.count_nonzero(qo_lens)
    total = int(np.add.reduce(qo_lens)) if total is None else total
    want = (total / live if live else 1.0) * group
    floor = 1 << max(0, (group - 1).bit_length())  # a tile holds at least one token's group
    for rows in TILE_ROWS:
        if rows >= want and rows >= floor:
            return rows
    return max(TILE_ROWS[-1], floor)


def fixed_tile_rows(group):
    """The tile height of plans whose shapes may not change from step to step (capacities given):
    64 rows, or one token's group where that is more."""
    return max(64, 1 << max(0, (group - 1).bit_length()))


@dataclass(frozen=True)
class PrefillLayout(PackedLayout):
    """Static sizes of the packed plan buffer; hashable, part of the jit cache key."""
    ITEMS = PREFILL
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
                ("items", self.item_cap * PREFILL.width),
                ("cell_indptr", self.num_cells + 1), ("merge_indptr", self.merge_cap + 1),
                ("merge_dest", self.merge_cap), ("tail_dest", self.tail_cap),
                ("lse_src", self.num_tokens if self.tail_cap else 0))



@lru_cache(maxsize=64)
def _request_fields(rows):
    """int32[rows, PREFILL.width], read-only: each request's item fields before its values, 0 but
    part_base (no partials), mask_base (no mask) and tail (no tail slot): -1."""
    fields = np.zeros((rows, PREFILL.width), np.int32)
    fields[:, [PREFILL.part_base, PREFILL.mask_base, PREFILL.tail]] = -1
    fields.flags.writeable = False
    return fields


def _request_rows(qo_indptr, qo_lens, kv_lens, page_base, *, bcap, num_tokens, mask_offsets, kv_pos_offset,
                  q_positions):
    """Per request (and one padding request over rows [nnz, num_tokens)): its item fields
    int32[B + 1, PREFILL.width], int32 as the buffer (values wrap as its cast would; items are
    gathered without a cast), to be gathered per tile. tile_tok is left for each request's first
    tile; q_pos_min holds pos_off + kv_len - the request's end row (= first row + qo_len): row r
    of request b sits at r plus it (bottom-right positions)."""
    batch, nnz = qo_lens.shape[0], int(qo_indptr[-1])
    per_req = _request_fields(bcap + 1)[:batch + 1].copy()
    per_req[:, PREFILL.q_row_start] = qo_indptr  # first row (nnz for the padding request)
    per_req[:batch, PREFILL.qo_len] = qo_lens
    per_req[batch, PREFILL.qo_len] = num_tokens - nnz
    per_req[:batch, PREFILL.page_base] = page_base
    per_req[:batch, PREFILL.kv_len] = kv_lens  # (the padding request: 0)
    if mask_offsets is not None:
        per_req[:batch, PREFILL.mask_base] = mask_offsets
        per_req[batch, PREFILL.mask_base] = 0
    pos_off = None if kv_pos_offset is None else np.asarray(kv_pos_offset, np.int64)
    if pos_off is not None:
        per_req[:batch, PREFILL.kv_pos_offset] = pos_off
    if q_positions is None:
        pos0 = np.subtract(per_req[:batch, PREFILL.kv_len], qo_indptr[1:],
                           out=per_req[:batch, PREFILL.q_pos_min])
        if pos_off is not None:
            pos0 += pos_off
    return per_req


@dataclass(frozen=True, kw_only=True)
class _Splits:
    """How a plan's tiles split into KV chunks; per tile: nchunks, split (None: no tile split),
    groups (merge groups: its tokens if split), item_first, group_first, part_base (its firsts)."""
    nchunks: np.ndarray
    split: Optional[np.ndarray]
    groups: Optional[np.ndarray]
    item_first: Optional[np.ndarray]
    group_first: Optional[np.ndarray]
    part_base: Optional[np.ndarray]
    num_items: int
    n_merge: int
    num_parts: int


def _splits(span, chunk, tile_tokens):
    """Per tile, after a row of zeros: work items (chunks), merge groups (a split tile's tokens),
    partial states (groups x chunks). One cumulative sum gives each tile's first of each, and the
    totals."""
    num_tiles = span.shape[0]
    counts = np.zeros((num_tiles + 1, 3), np.int64)
    nchunks = counts[1:, 0]
    np.floor_divide(span + (chunk - 1), chunk, out=nchunks)  # (span >= 0)
    np.maximum(nchunks, 1, out=nchunks)
    if not num_tiles or int(validate.largest(nchunks)) <= 1:  # no tile is split: one item per tile
        return _Splits(nchunks=nchunks, split=None, groups=None, item_first=None, group_first=None, part_base=None,
                       num_items=num_tiles, n_merge=0, num_parts=0)
    split = nchunks > 1
    groups = np.multiply(tile_tokens, split, out=counts[1:, 1])
    np.multiply(groups, nchunks, out=counts[1:, 2])
    firsts = np.add.accumulate(counts)  # (across the rows: quicker than along each column)
    num_items, n_merge, num_parts = firsts[-1].tolist()
    return _Splits(nchunks=nchunks, split=split, groups=groups, item_first=firsts[:-1, 0], group_first=firsts[:-1, 1],
                   part_base=firsts[:-1, 2], num_items=num_items, n_merge=n_merge, num_parts=num_parts)


def _tile_positions(per_tile, q_pos, first_row, tile_tokens, *, tails, bottom_right, padding_from):
    """Each tile's query-position range (q_pos_min, q_pos_max): the positions of its first real row
    and its last row. bottom_right: from q_pos_min (see _request_rows) plus the rows; the padding
    request's tiles (from padding_from) sit at 0. Else from q_pos int32[num_tokens]."""
    start_r, tile_tok = per_tile[:, PREFILL.q_row_start], per_tile[:, PREFILL.tile_tok]
    if not bottom_right:
        per_tile[:, PREFILL.q_pos_min] = np.minimum.reduceat(q_pos, first_row)
        per_tile[:, PREFILL.q_pos_max] = np.maximum.reduceat(q_pos, first_row)
        return
    np.add(per_tile[:, PREFILL.q_pos_min], tile_tokens - 1, out=per_tile[:, PREFILL.q_pos_max])
    per_tile[:, PREFILL.q_pos_max] += start_r + tile_tok if tails else first_row
    per_tile[:, PREFILL.q_pos_min] += first_row
    if padding_from is not None:
        per_tile[padding_from:, PREFILL.q_pos_min:PREFILL.q_pos_max + 1] = 0


def _align_keys(per_tile, page_base, ntiles, kv_start):
    """Contiguous K/V under tails: each request's keys start at the aligned row below its first
    (page_base is a row of K); the kv_first keys before its own are loaded and masked."""
    batch = page_base.shape[0]
    kv_off = np.zeros(batch + 1, np.int64)
    kv_off[:batch] = np.asarray(page_base, np.int64) % ROW_ALIGN
    off = kv_off.repeat(ntiles)
    per_tile[:, PREFILL.page_base] -= off
    per_tile[:, PREFILL.kv_len] += off
    per_tile[:, PREFILL.kv_pos_offset] -= off
    per_tile[:, PREFILL.kv_first] = off
    if kv_start is not None:
        per_tile[:, PREFILL.kv_start] = np.where(kv_start > 0, kv_start + off, 0)  # (aligned)
    per_tile[:, PREFILL.kv_end] += off


def _capacities(nnz, batch, kv_batch, num_listed, max_num_tokens, max_batch_size, max_num_pages):
    """(num_tokens, batch_cap, index_cap) of a plan: the capacities, or the step's own sizes."""
    if kv_batch != batch:
        raise ValueError(f"qo_indptr describes {batch} requests but the KV side has {kv_batch}")
    num_tokens = nnz if max_num_tokens is None else int(max_num_tokens)
    bcap = batch if max_batch_size is None else int(max_batch_size)
    icap = max(num_listed, 1) if max_num_pages is None else int(max_num_pages)
    if nnz > num_tokens:
        raise ValueError(f"qo_indptr covers {nnz} tokens, over max_num_tokens={num_tokens}")
    if batch > bcap:
        raise ValueError(f"qo_indptr describes {batch} requests, over max_batch_size={bcap}")
    if num_listed > icap:
        raise ValueError(f"kv_indices lists {num_listed} pages, over max_num_pages={icap}")
    return num_tokens, bcap, icap


def _key_ranges(kv_r, qo_r, rest, tile_tokens, tile_tok, causal, window_left):
    """Each tile's keys: (kv_lo int64[tiles] or None (0), kv_hi int64[tiles], span = kv_hi - kv_lo).
    Causal: the keys its last token sees; a window (known at plan time) drops those left of its
    first row's."""
    if causal:  # keys visible to the tile's last token: kv - (qo - its row - 1), at least 0
        kv_hi = np.subtract(kv_r, rest, dtype=np.int64)
        kv_hi += tile_tokens
        np.maximum(kv_hi, 0, out=kv_hi)
    else:
        kv_hi = kv_r.astype(np.int64)
    if window_left is not None and window_left >= 0:  # keys left of the first row's window
        kv_lo = np.clip(np.subtract(kv_r, qo_r, dtype=np.int64) + tile_tok - int(window_left), 0, kv_hi)
        return kv_lo, kv_hi, kv_hi - kv_lo
    return None, kv_hi, kv_hi


def _chunking(span, *, tails, fixed_split_tokens, max_num_tokens, num_tokens, tpt, bcap, num_cells,
              min_split_tokens):
    """(chunk: keys per work item, num_splits: the layout's split bound, num_cells)."""
    num_splits = int(num_cells)
    if tails:  # whole-tile kernels: one unsplit item per cell, longest first
        return max(int(span.max(initial=0)), 1), 0, -(-num_tokens // tpt) + 2 * (bcap + 1)
    if fixed_split_tokens is not None:
        chunk = int(fixed_split_tokens)
        if max_num_tokens is None:  # shapes follow the inputs anyway: size for this split
            num_splits = max(num_splits, -(-int(span.sum()) // chunk))
        return chunk, num_splits, num_cells
    return scheduler.chunk_for_total(np.add.reduce(span), num_cells, min_split_tokens), num_splits, num_cells


@lru_cache(maxsize=256)
def prefill_layout(num_tokens, batch, index_cap, num_cells, rows, group, num_splits, tails=False):
    """PrefillLayout.for_capacities, one instance per capacities (its offsets computed once)."""
    return PrefillLayout.for_capacities(num_tokens, batch, index_cap, num_cells, rows, group, num_splits, tails=tails)


def plan_prefill(qo_indptr, kv_lens, page_base, kv_indices, *, group, causal, num_cells,
                 max_num_tokens=None, max_batch_size=None, max_num_pages=None, rows=None,
                 mask_offsets=None, fixed_split_tokens=None, min_split_tokens=512, item_cost=64,
                 kv_pos_offset=None, q_positions=None, window_left=None, tails=False,
                 contiguous_kv=False, qo_lens=None):
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
    row: kv_first keys before its own are loaded and masked. q_pos_min, q_pos_max:
    the smallest and largest query position of the tile's rows (for variants' mask bounds).
    qo_lens: qo_indptr's lengths, from a caller that checked qo_indptr (validate.indptr_lengths)
    already; qo_indptr is then not checked again.
    """
    if fixed_split_tokens is not None and fixed_split_tokens < 1:
        raise ValueError(f"fixed_split_tokens must be >= 1, got {fixed_split_tokens}")
    if qo_lens is None:
        qo_indptr, qo_lens, _ = validate.indptr_lengths("qo_indptr", qo_indptr)
    batch, nnz = qo_lens.shape[0], int(qo_indptr[-1])
    num_tokens, bcap, icap = _capacities(nnz, batch, kv_lens.shape[0], kv_indices.shape[0], max_num_tokens,
                                         max_batch_size, max_num_pages)
    rows = choose_tile_rows(qo_lens, group, nnz) if rows is None else int(rows)
    tpt = max(1, rows // group)

    per_req = _request_rows(qo_indptr, qo_lens, kv_lens, page_base, bcap=bcap, num_tokens=num_tokens,
                            mask_offsets=mask_offsets, kv_pos_offset=kv_pos_offset, q_positions=q_positions)
    qo_start, tile_first = per_req[:, PREFILL.q_row_start], per_req[:, PREFILL.tile_tok]
    all_qo = per_req[:, PREFILL.qo_len]
    if tails:  # rows below each request's first row, back to an aligned row
        q_off = qo_start % ROW_ALIGN
        ntiles = np.where(all_qo > 0, -(-(all_qo + q_off) // tpt), 0)
    else:
        ntiles = (all_qo + (tpt - 1)) // tpt  # (0 for an empty request)
    np.add.accumulate(ntiles, out=tile_first)
    num_tiles = int(tile_first[-1])
    tile_first -= ntiles  # each request's first tile
    per_tile = per_req.repeat(ntiles, axis=0)  # [tiles, PREFILL.width]: its request's fields
    start_r, tile_tok = per_tile[:, PREFILL.q_row_start], per_tile[:, PREFILL.tile_tok]
    qo_r, kv_r = per_tile[:, PREFILL.qo_len], per_tile[:, PREFILL.kv_len]
    # Each tile's first token within its request.
    np.subtract(scheduler.arange32(num_tiles), tile_tok, out=tile_tok)
    tile_tok *= tpt
    if tails:
        tile_tok -= q_off.repeat(ntiles)
    rest = qo_r - tile_tok  # the request's rows from the tile's first on
    tile_tokens = np.minimum(rest, tpt)  # real tokens in each tile
    kv_lo, kv_hi, span = _key_ranges(kv_r, qo_r, rest, tile_tokens, tile_tok, causal, window_left)
    chunk, num_splits, num_cells = _chunking(
        span, tails=tails, fixed_split_tokens=fixed_split_tokens, max_num_tokens=max_num_tokens,
        num_tokens=num_tokens, tpt=tpt, bcap=bcap, num_cells=num_cells, min_split_tokens=min_split_tokens)
    layout = prefill_layout(num_tokens, bcap, icap, int(num_cells), rows, group, num_splits, tails=tails)

    sp = _splits(span, chunk, tile_tokens)
    nchunks, split, num_items, n_merge, num_parts = sp.nchunks, sp.split, sp.num_items, sp.n_merge, sp.num_parts
    if num_parts > layout.part_cap or num_items > layout.item_cap:
        raise ValueError("the split needs more partial states or work items than the plan holds; "
                         "use a larger fixed_split_tokens (or no capacities)")
    if n_merge > layout.merge_cap:
        raise ValueError("the split needs more merge groups than the plan holds")
    buf = new_buffer(layout.size)
    k0, q0, t0, c0, m0, d0, e0, s0 = layout.starts  # (sections() order)
    c1 = c0 + layout.num_cells + 1

    # The packed buffer: every entry written once (sections, their padding, the gaps).
    n_idx = kv_indices.shape[0]
    buf[k0:k0 + n_idx] = kv_indices
    buf[k0 + n_idx:q0] = 0
    q_pos = buf[q0:q0 + num_tokens]  # int32[num_tokens]: positions, 0 past nnz
    if q_positions is None:  # row r of request b: r + its q_pos_min (int32: no casting pass over nnz entries)
        np.add(scheduler.arange32(nnz), per_req[:batch, PREFILL.q_pos_min].repeat(qo_lens), out=q_pos[:nnz])
    else:
        q_pos[:nnz] = q_positions
    buf[q0 + nnz:t0] = 0

    # Items, in cell order: the tiles' fields, gathered per item.
    per_tile[:, PREFILL.num_chunks] = nchunks
    if split is not None:
        np.copyto(per_tile[:, PREFILL.part_base], sp.part_base, where=split)
    # Tiles not wholly the request's rows (partial, or starting before it): a tail slot each
    # (tail; -1 for whole tiles).
    is_tail = tile_tokens < tpt  # (tile_tok + tpt > qo_r)
    if tails:
        is_tail |= tile_tok < 0  # (tile_tok >= 0 in other plans)
    tail_tiles = is_tail.nonzero()[0]
    if tail_tiles.shape[0]:
        per_tile[tail_tiles, PREFILL.tail] = scheduler.arange32(tail_tiles.shape[0])
    first_row = start_r + (np.maximum(tile_tok, 0) if tails else tile_tok)  # each tile's first real row
    if num_tiles:
        _tile_positions(per_tile, q_pos, first_row, tile_tokens, tails=tails, bottom_right=q_positions is None,
                        padding_from=tile_first[batch] if num_tokens > nnz else None)
    # Each item's row: its tile's, with its keys [kv_start, kv_end) (kv_start 0 unless split or
    # windowed) and its chunk.
    if split is not None:
        tile_of = scheduler.arange(num_tiles).repeat(nchunks)
        chunk_idx = scheduler.arange(num_items) - sp.item_first.take(tile_of)
        kv_start = chunk_idx * chunk
        if kv_lo is not None:
            kv_start += kv_lo.take(tile_of)
        kv_end = np.minimum(kv_start + chunk, kv_hi.take(tile_of))
        per_item = per_tile.take(tile_of, axis=0)  # [items, PREFILL.width]
        per_item[:, PREFILL.chunk] = chunk_idx
    else:
        per_item, kv_start = per_tile, kv_lo
        kv_end = np.minimum(kv_hi, chunk) if kv_lo is None else np.minimum(kv_lo + chunk, kv_hi)
    if kv_start is not None:
        per_item[:, PREFILL.kv_start] = kv_start
    per_item[:, PREFILL.kv_end] = kv_end
    keys = kv_end if kv_start is None else kv_end - kv_start
    if type(item_cost) is int and item_cost >= 1:  # integer costs, all positive
        order, _ = scheduler.assign_positive(keys + item_cost * tpt, layout.num_cells, out=buf[c0:c1])
    else:
        order, _ = scheduler.assign_cells(item_cost * tpt + keys, layout.num_cells, out=buf[c0:c1])
    if tails and contiguous_kv:  # (no tile split: per_item is per_tile)
        _align_keys(per_tile, page_base, ntiles, kv_start)
    items = buf[t0:t0 + layout.item_cap * PREFILL.width].reshape(-1, PREFILL.width)
    per_item.take(order, axis=0, out=items[:num_items], mode="clip")  # (clip: in range; no buffered copy)
    buf[t0 + num_items * PREFILL.width:c0] = 0

    if n_merge:
        _write_merges(buf, layout, n_merge, num_parts, sp.part_base, sp.group_first, nchunks,
                      per_tile[:, PREFILL.num_chunks], sp.groups, first_row)
    else:  # merge_indptr all 0, like the gaps around it
        buf[c1:d0] = 0
        buf[d0:d0 + layout.merge_cap] = -1
    if tails:
        _write_tails(buf, layout, tail_tiles=tail_tiles, tile_tok=tile_tok, qo_r=qo_r, start_r=start_r, order=order,
                     all_qo=all_qo, q_off=q_off, tile_first=tile_first, tpt=tpt, num_tokens=num_tokens)
    else:
        buf[d0 + layout.merge_cap:] = 0  # the gap after merge_dest (the tail sections are empty)
    info = dict(rows=rows, chunk_tokens=chunk, num_items=num_items,
                num_split_tiles=int(np.count_nonzero(split)) if split is not None else 0, num_parts=num_parts)
    return layout, buf, info


def _write_merges(buf, layout, n_merge, num_parts, part_base, group_first, nchunks, nchunks32, groups, first_row):
    """The merge map of split tiles: one group per token of a split tile, its partials contiguous;
    merge_indptr (with the gap after cell_indptr before it) and merge_dest, every entry written."""
    _, _, _, c0, m0, d0, _, _ = layout.starts
    buf[c0 + layout.num_cells + 1:m0 + 1] = 0  # the gap after cell_indptr, merge_indptr[0]
    merge_indptr = buf[m0 + 1:m0 + 1 + layout.merge_cap]  # [1:]
    merge_dest = buf[d0:d0 + layout.merge_cap]
    # Group g, token j of tile k (g = k's first group + j), ends at part_base + (j + 1) * nchunks
    # = g * nchunks + part_base - (k's first group - 1) * nchunks (no cumulative sum over the
    # groups); its row is k's first row + j. Per tile, repeated by its groups (none if unsplit).
    # In int32: products wrap, and their sums come back to the ends (< part_cap).
    end_base = np.subtract(part_base, (group_first - 1) * nchunks, dtype=np.int32, casting="unsafe")
    row_base = np.subtract(first_row, group_first, dtype=np.int32, casting="unsafe")  # (tiles not tails)
    g = scheduler.arange32(n_merge)
    np.multiply(g, nchunks32.repeat(groups), out=merge_indptr[:n_merge])
    merge_indptr[:n_merge] += end_base.repeat(groups)
    merge_indptr[n_merge:] = num_parts  # (the last group's end)
    np.add(g, row_base.repeat(groups), out=merge_dest[:n_merge])
    merge_dest[n_merge:] = -1
    buf[m0 + 1 + layout.merge_cap:d0] = 0


def _write_tails(buf, layout, *, tail_tiles, tile_tok, qo_r, start_r, order, all_qo, q_off, tile_first, tpt,
                 num_tokens):
    """tail_dest (tail slot s holds tile t's rows: tail row s * tpt + j -> token tile_tok[t] + j)
    and lse_src (lse is stored per item slot: token i of request r -> its tile's slot)."""
    _, _, _, _, _, d0, e0, s0 = layout.starts
    tail_dest, lse_src = buf[e0:e0 + layout.tail_cap], buf[s0:s0 + num_tokens]
    t = tail_tiles
    tok = tile_tok[t][:, None] + np.arange(tpt)[None, :]  # [slots, tpt]
    live_tok = (tok >= 0) & (tok < qo_r[t][:, None])
    dest = np.where(live_tok, start_r[t][:, None] + tok, num_tokens).reshape(-1)
    tail_dest[:dest.size] = dest
    tail_dest[dest.size:] = num_tokens
    buf[d0 + layout.merge_cap:e0] = 0
    buf[e0 + layout.tail_cap:s0] = 0
    slot_of_tile = np.empty_like(order)
    slot_of_tile[order] = np.arange(order.shape[0])
    tok_r = np.repeat(np.arange(all_qo.shape[0]), all_qo)
    tok_i = np.arange(num_tokens) - np.repeat(np.cumsum(all_qo) - all_qo, all_qo) + q_off[tok_r]
    tile = tile_first[tok_r] + tok_i // tpt
    lse_src[:] = slot_of_tile[tile] * tpt + tok_i % tpt
