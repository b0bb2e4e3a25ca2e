"""The device planner of ragged_paged_attention: its metadata (kv_lens, cu_q_lens, distribution,
page_indices: device arrays) turned into fixed-capacity work lists in a small XLA prologue, with
the host planner's schema (planner.work_items) and constants. One list per q_len class (classes:
decode items of T_s, T_m or T_l tokens, Triton prefill tiles, or the Mosaic class's 128-token tiles),
and the mixed launch's (plan_mixed: planner.batch.plan_mixed's list). docs/design.md tells how
a class's keys are cut into items and why the capacities bound them.
"""
import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer import dispatch
from planner import batch as batch_planner
from planner.prefill import ROW_ALIGN
from planner.work_items import DECODE_MULTI, MIXED, PREFILL

CHUNK_UNIT = 128       # keys: KV chunks are multiples of this (the kernel's default block_kv)
MIN_CHUNK_UNITS = batch_planner.MIN_SPLIT_TOKENS // CHUNK_UNIT  # no item splits below the host planner's
CHUNKS_PER_CELL = 2    # KV chunks are at most 1 / (2 x cells) of a class's keys: a cell's run of
                       # items then costs at most 1.5 x the mean (runs are contiguous, not greedy)
DENSE_PREFIX_MAX = 1024  # cumsum's one-kernel form up to this length (n^2 adds: 1M at the most)
TILE_COST = 32         # an item's fixed cost in keys per query token of its tile (cell balance)
# Query tokens per Mosaic tile (of one query head): the kernel's two compute warpgroups, ping-pong
# (MosaicPrefillConfig's defaults; of a config given here only block_kv and
# max_concurrent_steps apply to this class).
MOSAIC_TILE = 2 * 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class QueryClass:
    """A q_len class (static): its sequences, kernel, tile and work-list capacities. The base
    class (launched first) makes the output; every other class writes its rows into it in place.
    The last class's merge also zeroes the padding rows."""
    min_q: int           # sequences with min_q <= q_len <= max_q
    max_q: int
    prefill: bool        # the prefill kernel's tiles (else the decode kernel's multi-token items)
    tokens_per_item: int  # query tokens per block (decode item or prefill tile)
    base: bool
    pad: bool
    blocks: int          # query blocks (each up to tokens_per_item tokens of one sequence)
    items: int           # work items: blocks plus at most CHUNKS_PER_CELL x cells extra chunks
    part_cap: int        # partial-state rows
    merges: int          # merge groups
    cells: int
    rows: int            # prefill tile rows (tokens_per_item = rows // group)
    mosaic: bool = False  # the Mosaic kernel (prefill): its rows gathered into a sub-buffer (sub_rows)
    sub_rows: int = 0


def classes(num_tokens, num_seqs, num_cells, group, mosaic_cells=0, mixed=False):
    """The q_len classes, base first: q_len <= T_s on 16-row decode tiles of T_s tokens (decode,
    speculative verify), then up to T_m on 32-row and T_l on 64-row decode tiles
    (dispatch.ragged_class_bounds: each where it holds more tokens than the class before), the
    rest on prefill tiles: the Triton kernel's (dispatch.ragged_prefill_rows), or with mosaic_cells > 0 the
    Mosaic kernel's of MOSAIC_TILE tokens over that many cells per query head. Classes no
    sequence of num_tokens can reach are left out. The padding class is the last one, or the
    Mosaic class (its output placement zeroes every row not its own). mixed: the decode classes
    only, none the base (the mixed launch before them makes the output and runs the rest)."""
    rows = dispatch.ragged_prefill_rows(group)
    bounds = dispatch.ragged_class_bounds(group, num_tokens, mixed=mixed)[::-1]  # the longest first: the base
    mosaic = mosaic_cells > 0 and bounds[0][2]
    out = []
    for k, (lo, hi, prefill, t) in enumerate(bounds):
        base = k == 0 and not mixed
        pad = base if mosaic else k == len(bounds) - 1 and not mixed  # (the mixed launch zeroes padding)
        seqs = max(1, min(num_seqs, num_tokens // lo))
        tokens = max(1, min(num_tokens, seqs * hi))
        if base and mosaic:  # whole tiles per sequence, KV never split: no partials, no merges
            tiles = max(1, (tokens + seqs * (MOSAIC_TILE - 1)) // MOSAIC_TILE)  # sum of ceil(q_len / tile)
            sub_rows = -(-(tokens + seqs * (ROW_ALIGN - 1)) // ROW_ALIGN) * ROW_ALIGN  # 8-aligned starts
            out.append(QueryClass(min_q=lo, max_q=hi, prefill=True, tokens_per_item=MOSAIC_TILE, base=True, pad=True,
                                  blocks=tiles, items=tiles, part_cap=0, merges=0, cells=mosaic_cells,
                                  rows=MOSAIC_TILE * group, mosaic=True, sub_rows=sub_rows))
            continue
        blocks = max(1, min(tokens, (tokens + seqs * (t - 1)) // t, seqs * -(-hi // t)))
        c = CHUNKS_PER_CELL * num_cells  # the class's keys / the longest chunk, at most
        # Fewer than c blocks split, into fewer than 2c chunks (module docstring).
        part_cap, merges = 2 * c * t, max(1, (c - 1) * t)
        if pad:  # padding rows, disjoint from this class's and fewer than num_tokens
            merges += num_tokens
        out.append(QueryClass(min_q=lo, max_q=hi, prefill=prefill, tokens_per_item=t, base=base, pad=pad,
                              blocks=blocks, items=blocks + c, part_cap=part_cap, merges=merges, cells=num_cells,
                              rows=rows))
    return tuple(out)


def cumsum(x):
    """Inclusive prefix sum of a vector x [n] (sequences, blocks or items), kept out of its
    consumers' fusions (XLA would otherwise recompute it inside each consumer's threads). Up to
    DENSE_PREFIX_MAX entries it is one [n, n] masked row sum: one GPU kernel, where XLA lowers
    jnp.cumsum to a blocked scan of two or three."""
    n = x.shape[0]
    if n > DENSE_PREFIX_MAX:
        return jax.lax.optimization_barrier(jnp.cumsum(x))
    lower = jnp.arange(n)[:, None] >= jnp.arange(n)[None, :]  # [n, n]: j <= i
    return jax.lax.optimization_barrier(jnp.sum(jnp.where(lower, x[None, :], 0), axis=1, dtype=x.dtype))


def excl_cumsum(x):
    return cumsum(x) - x


def owner(counts, n):
    """For slots 0..n-1 laid out as counts[0] slots of owner 0, then counts[1] of owner 1, ...:
    (owner of each slot clipped to a valid index, index within the owner, slot is used)."""
    ends = cumsum(counts)
    slot = jnp.arange(n, dtype=jnp.int32)
    owner = jnp.minimum(jnp.searchsorted(ends, slot, side="right", method="compare_all"),
                        counts.shape[0] - 1).astype(jnp.int32)
    return owner, slot - (ends - counts)[owner], slot < ends[-1]


def plan_classes(kv_lens, cu_q_lens, distribution, *, pages_per_seq, classes, causal, window_left, num_rows, taken=None,
                 read_lens=None):
    """The device prologue of a group of classes that share one partial buffer and one merge (the
    decode classes, or the Triton prefill class alone): work items (the decode kernel's
    work_items.DECODE_MULTI or PREFILL), class by class, one cell_indptr per
    class (into the shared item list), the merge groups, and the per-block kv_lens the decode
    kernel reads. All int32 jnp. taken (bool[S], optional): sequences the mixed launch runs.
    read_lens (int32[S], optional): each sequence reads only its first read_lens keys, its mask
    still aligned to kv_lens (the block ends returned).

    Returns (dict(items [IC, cols], cell_indptr [K * cells + 1], merge_indptr
    [G + 1], merge_dest [G], merge_live (0-d: groups past it write nothing)), block ends [NB]).
    Class k's cells are cell_indptr[k * cells:(k + 1) * cells + 1]."""
    s = kv_lens.shape[0]
    cells = classes[0].cells
    q_len = jnp.maximum(cu_q_lens[1:] - cu_q_lens[:-1], 0)  # [S]
    live = jnp.arange(s) < distribution[2]
    if taken is not None:
        live &= ~taken

    # Query blocks of up to t tokens (the class's), class by class: block b of "virtual sequence"
    # k * S + i is sequence i's in class k.
    t_of = jnp.array([c.tokens_per_item for c in classes], jnp.int32)  # [K]
    nblk = jnp.concatenate([jnp.where(live & (q_len >= c.min_q) & (q_len <= c.max_q), -(-q_len // c.tokens_per_item), 0)
                            for c in classes])  # [K * S]
    vseq, j, blk_ok = owner(nblk, sum(c.blocks for c in classes))  # [NB]
    seq, k_blk = vseq % s, vseq // s
    t_item = t_of[k_blk]
    t0 = j * t_item
    q_b, kv_b = q_len[seq], kv_lens[seq]
    qo = jnp.where(blk_ok, jnp.minimum(q_b - t0, t_item), 0)
    first_pos = kv_b - q_b + t0
    end = first_pos + qo if causal else kv_b  # the block's keys end here (its kernel kv_len)
    read_end = end if read_lens is None else jnp.minimum(end, read_lens[seq])  # ... and its reads here
    lo = jnp.zeros_like(end)
    if window_left is not None:  # keys left of the first token's window are never seen
        lo = jnp.where(window_left < 0, 0, jnp.maximum(first_pos - window_left, 0)) // CHUNK_UNIT * CHUNK_UNIT
    units = jnp.where(blk_ok, -(-jnp.maximum(read_end - lo, 0) // CHUNK_UNIT), 0)
    # (sums over the minor axis: XLA runs a column sum of [NB, K] on a few threads, ~6 µs)
    one_hot = jnp.arange(len(classes))[:, None] == k_blk[None, :]  # [K, NB]
    class_units = jnp.sum(jnp.where(one_hot, units[None, :], 0), axis=1)  # [K]
    max_chunk = jnp.maximum(-(-class_units // (CHUNKS_PER_CELL * cells)), MIN_CHUNK_UNITS)[k_blk]  # units
    n_chunks = jnp.where(blk_ok, jnp.maximum(-(-units // max_chunk), 1), 0)
    chunk = -(-units // jnp.maximum(n_chunks, 1)) * CHUNK_UNIT  # [NB] keys per item: the block cut evenly
    split = n_chunks > 1  # blocks writing partials
    parts = jnp.where(split, n_chunks * qo, 0)
    part_first = excl_cumsum(parts)

    # Items: block b's n_chunks KV chunks.
    blk, c, item_ok = owner(n_chunks, sum(c.items for c in classes))  # [IC]
    tok_start = lo[blk] + c * chunk[blk]
    tok_end = jnp.minimum(tok_start + chunk[blk], read_end[blk])
    sb = seq[blk]
    if classes[0].prefill:  # (no mask, no tails)
        zero = jnp.zeros_like(blk)
        cols = PREFILL.ordered(
            q_row_start=cu_q_lens[sb], tile_tok=t0[blk], qo_len=q_len[sb], page_base=sb * pages_per_seq,
            kv_len=kv_lens[sb], kv_start=tok_start, kv_end=tok_end,
            part_base=jnp.where(split[blk], part_first[blk], -1), num_chunks=n_chunks[blk], chunk=c,
            mask_base=zero - 1, kv_pos_offset=zero, tail=zero - 1, kv_first=zero, q_pos_min=first_pos[blk],
            q_pos_max=first_pos[blk] + jnp.maximum(qo[blk], 1) - 1)
    else:
        cols = DECODE_MULTI.ordered(
            request=blk, page_base=sb * pages_per_seq, tok_start=tok_start, tok_end=tok_end,
            part_slot=jnp.where(split[blk], part_first[blk] + c, -1), part_stride=n_chunks[blk],
            q_start=cu_q_lens[sb] + t0[blk], qo_len=qo[blk])
    items = jnp.stack(cols, axis=1).astype(jnp.int32)

    # Cells of each class: contiguous runs of its items of about its total / cells cost each.
    k_item = k_blk[blk]
    cost = jnp.where(item_ok, TILE_COST * t_item[blk] + tok_end - tok_start, 0).astype(jnp.float32)
    class_cost = jnp.sum(jnp.where(jnp.arange(len(classes))[:, None] == k_item[None, :], cost[None, :], 0), axis=1)
    start = excl_cumsum(cost) - (jnp.cumsum(class_cost) - class_cost)[k_item]  # within the class
    cell_of = jnp.floor(start / jnp.maximum(class_cost[k_item], 1.0) * cells) + k_item * cells
    cell_of = jnp.where(item_ok, cell_of, len(classes) * cells)
    cell_indptr = jnp.searchsorted(cell_of, jnp.arange(len(classes) * cells + 1, dtype=jnp.float32), side="left",
                                   method="compare_all").astype(jnp.int32)

    # Merge groups: one per query token of a partial-writing block, its n_chunks partials contiguous.
    tokens = jnp.where(split, qo, 0)
    mb, tin, m_ok = owner(tokens, sum(c.merges for c in classes))
    merge_end = jnp.where(m_ok, part_first[mb] + (tin + 1) * n_chunks[mb], jnp.sum(parts))
    merge_indptr = jnp.concatenate([jnp.zeros((1,), jnp.int32), merge_end.astype(jnp.int32)])
    merge_dest = jnp.where(m_ok, cu_q_lens[seq[mb]] + t0[mb] + tin, -1)
    merge_live = jnp.sum(tokens)
    if any(c.pad for c in classes):  # the groups after those: no partials (o = 0), one per padding row
        pad_row = cu_q_lens[distribution[2]] + jnp.arange(merge_dest.shape[0]) - merge_live
        merge_dest = jnp.where(m_ok, merge_dest, jnp.where(pad_row < num_rows, pad_row, -1))
        merge_live += jnp.maximum(num_rows - cu_q_lens[distribution[2]], 0)
    sec = dict(items=items, cell_indptr=cell_indptr, merge_indptr=merge_indptr,
               merge_dest=merge_dest.astype(jnp.int32), merge_live=merge_live.astype(jnp.int32))
    return sec, end.astype(jnp.int32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixedSizes:
    """The mixed launch's static sizes (pallas_kernels.prefill_mosaic, packed_tokens > 0)."""
    tiles: int          # query-tile capacity (each run for every query head), the padding's too
    long_min: int       # sequences of q_len >= this take query tiles (those past the decode classes)
    packed_tokens: int  # a packed tile's tokens: sequences of q_len <= this may be packed
    tile_tokens: int
    cells: int

    def slots(self, num_seqs, num_qo_heads, num_kv_heads):
        """Work-item (and lse-slot) capacity: tiles x Hq, then packed sequences x Hkv."""
        return self.tiles * num_qo_heads + num_seqs * num_kv_heads


def mixed_sizes(num_tokens, num_seqs, group, tile_tokens, cells):
    """MixedSizes for a step of num_tokens rows over num_seqs sequences: sequences past the decode
    classes' tokens take query tiles, those of a 16-row decode tile's may be packed."""
    long_min = batch_planner.short_cap(group, dispatch.SHORT_MAX_ROWS) + 1  # past the decode classes
    seqs = max(1, min(num_seqs, num_tokens // long_min)) + 1  # (+ the padding rows' tiles)
    tiles = max(1, (num_tokens + seqs * (tile_tokens - 1)) // tile_tokens)  # sum of ceil(q_len / tile)
    return MixedSizes(tiles=tiles, long_min=long_min, packed_tokens=batch_planner.short_cap(group, dispatch.FIXED_SHORT_ROWS),
                      tile_tokens=tile_tokens, cells=cells)


def order_desc(cost):
    """The indices of cost [n] largest first (ties: lower index first). Up to DENSE_PREFIX_MAX
    entries by ranks from one [n, n] comparison and a scatter (XLA's sort kernel costs ~5 µs
    at any size, 23 µs at 3072 entries on an H100)."""
    n = cost.shape[0]
    if n > DENSE_PREFIX_MAX:
        return jnp.argsort(-cost, stable=True).astype(jnp.int32)
    i = jnp.arange(n, dtype=jnp.int32)
    before = (cost[None, :] > cost[:, None]) | ((cost[None, :] == cost[:, None]) & (i[None, :] < i[:, None]))
    rank = jnp.sum(before, axis=1, dtype=jnp.int32)  # [n]: entries placed before each
    return jnp.zeros_like(i).at[rank].set(i, unique_indices=True)


def plan_mixed(kv_lens, cu_q_lens, distribution, *, pages_per_seq, page_size, causal, num_qo_heads, num_kv_heads,
               mix, num_rows, read_lens=None):
    """The device prologue of the mixed launch (planner.batch.plan_mixed's work list, planned in
    XLA): sequences of q_len >= mix.long_min are query tiles of tile_tokens tokens x each query
    head, from their first row; when the step has such a tile, a sequence of q_len <=
    mix.packed_tokens whose keys fit a cell's mean load is a packed tile per KV head (its tokens x
    the head group in 64 rows). The other sequences are left to the decode classes (split-KV).
    KV is never split. The padding rows (from cu_q_lens[distribution[2]] to num_rows) are query
    tiles of no key: the launch writes them o = 0.

    Cells: the work units (a tile, or a packed sequence: Hq, resp. Hkv, items of one cost: keys
    + batch_planner.MIXED_ITEM_COST, as plan_mixed's) sorted largest first, their items dealt to the cells in
    a snake order (0..C-1, then C-1..0, ...): about longest-first greedy's balance without its
    loop. Within a cell, even cells run their query tiles first, odd cells their packed tiles
    (plan_mixed's order), each kind in lse-slot order (tiles by sequence and position, packed
    tiles by sequence: on the H100's mixed step 10 µs faster than largest first).
    read_lens (int32[S], optional): as plan_classes'; a sequence that does not read to its
    kv_len reads no partly filled last page, so it needs no sanitized copy.

    Returns (items int32[N, MIXED.width], cell_indptr
    int32[cells + 1], taken bool[S] (the sequences this launch runs), lse_src int32[num_rows]: each
    row's lse index of query head 0 in the kernel's lse_items [1, slots * tile_tokens], -1 for rows
    it does not run (query head h adds h * tile_tokens in a query tile; in a packed tile
    (h // group) * tile_tokens + h % group, its rows token-major))."""
    s, hq, hkv, T, C = kv_lens.shape[0], num_qo_heads, num_kv_heads, mix.tile_tokens, mix.cells
    q_len = jnp.maximum(cu_q_lens[1:] - cu_q_lens[:-1], 0)  # [S]
    valid = (jnp.arange(s) < distribution[2]) & (q_len > 0)
    q_len, kv = jnp.where(valid, q_len, 0), jnp.where(valid, kv_lens, 0)
    read = kv if read_lens is None else jnp.minimum(kv, read_lens)
    long_ = q_len >= mix.long_min

    # Query tiles of the long sequences, then of the padding rows (sequence S: no key, no page).
    pad_start = cu_q_lens[distribution[2]]
    start_x = jnp.concatenate([cu_q_lens[:s], pad_start[None]])  # [S + 1]
    q_x = jnp.concatenate([q_len, jnp.maximum(num_rows - pad_start, 0)[None]])
    kv_x = jnp.concatenate([kv, jnp.zeros((1,), kv.dtype)])
    read_x = jnp.concatenate([read, jnp.zeros((1,), kv.dtype)])
    tseq, j, t_ok = owner(jnp.where(jnp.concatenate([long_, jnp.ones((1,), bool)]), -(-q_x // T), 0), mix.tiles)
    tile_tok = j * T
    qo_t, kv_t = q_x[tseq], kv_x[tseq]
    kv_hi = jnp.clip(kv_t - qo_t + jnp.minimum(tile_tok + T, qo_t), 0, kv_t) if causal else kv_t
    kv_hi = jnp.minimum(kv_hi, read_x[tseq])
    tile_cost = jnp.where(t_ok, kv_hi + batch_planner.MIXED_ITEM_COST, 0)
    # Packed short sequences: only beside query tiles, and only those no longer than a cell's mean.
    short = valid & (q_len <= mix.packed_tokens)
    short_cost = jnp.where(short, read + batch_planner.MIXED_ITEM_COST, 0)
    mean = (jnp.sum(tile_cost.astype(jnp.float32)) * hq + jnp.sum(short_cost.astype(jnp.float32)) * hkv) / C
    packed = short & jnp.any(long_) & (short_cost <= mean)

    # Units (tiles, then sequences), largest first; slot p of the sorted items goes to cell
    # p % C in even rounds (p // C), C - 1 - p % C in odd ones.
    cost = jnp.concatenate([tile_cost, jnp.where(packed, short_cost, 0)])  # [U]
    mult = jnp.concatenate([jnp.where(t_ok, hq, 0), jnp.where(packed, hkv, 0)]).astype(jnp.int32)
    order = order_desc(cost)
    ends = cumsum(mult[order])  # [U]
    n = ends[-1]
    # Each cell gets `rounds` items, and one more: cells 0..rest-1 after an even number of rounds,
    # C-rest..C-1 after an odd one (closed forms: no prefix sum, no search).
    rounds, rest = n // C, n % C
    even = rounds % 2 == 0
    edge = jnp.arange(C + 1, dtype=jnp.int32)
    cell_indptr = edge * rounds + jnp.where(even, jnp.minimum(edge, rest), jnp.maximum(edge - (C - rest), 0))
    cap = mix.slots(s, hq, hkv)
    slot = jnp.arange(cap, dtype=jnp.int32)
    first_n, first_size = jnp.where(even, rest, C - rest), jnp.where(even, rounds + 1, rounds)  # the first cells
    split_slot = first_n * first_size
    c = jnp.where(slot < split_slot, slot // jnp.maximum(first_size, 1),
                  first_n + (slot - split_slot) // jnp.maximum(2 * rounds + 1 - first_size, 1))
    c = jnp.minimum(c, C - 1)
    k = slot - cell_indptr[c]
    pos = k * C + jnp.where(k % 2 == 0, c, C - 1 - c)  # the slot's place in the sorted items
    sorted_unit = jnp.minimum(jnp.searchsorted(ends, pos, side="right", method="compare_all"), ends.shape[0] - 1)
    unit = order[sorted_unit]
    within = pos - (ends - mult[order])[sorted_unit]  # query head, or KV head
    is_packed = unit >= mix.tiles

    # Fields of each item (work_items.MIXED).
    tile = jnp.minimum(unit, mix.tiles - 1)
    seq = jnp.where(is_packed, unit - mix.tiles, tseq[tile])  # (S: the padding)
    zero = jnp.zeros_like(slot)
    lse_slot = jnp.where(is_packed, mix.tiles * hq + (unit - mix.tiles) * hkv, unit * hq) + within
    cols = MIXED.ordered(
        q_row_start=start_x[seq], tile_tok=jnp.where(is_packed, 0, tile_tok[tile]), qo_len=q_x[seq],
        page_base=jnp.minimum(seq, s - 1) * pages_per_seq, kv_len=kv_x[seq], kv_start=zero,
        kv_end=jnp.where(is_packed, read_x[seq], kv_hi[tile]), head=within, lse_slot=lse_slot,
        packed=is_packed.astype(jnp.int32),
        last_row=jnp.where((seq < s) & (kv_x[seq] % page_size != 0) & (read_x[seq] == kv_x[seq]), seq, -1),
        kv_pos_offset=zero, tail=zero - 1, kv_first=zero, q_pos_min=zero, q_pos_max=zero)
    items = jnp.stack(cols, axis=1).astype(jnp.int32)  # [N, MIXED.width]

    # Within each cell (its items the row of a [C, R] table): the preferred kind first (query tiles
    # on even cells), each kind in lse-slot order, by ranks from a [C, R, R] comparison.
    r = -(-cap // C)  # a cell's most items: the snake deals each floor(n / C) or one more
    at = cell_indptr[:-1, None] + jnp.arange(r, dtype=jnp.int32)[None, :]  # [C, R]
    live = at < cell_indptr[1:, None]
    at = jnp.minimum(at, cap - 1)
    later = (is_packed != (c % 2 == 1)).astype(jnp.int32)
    key = jnp.where(live, later[at] * cap + lse_slot[at], 2 * cap)  # [C, R]
    rank = jnp.sum(key[:, None, :] < key[:, :, None], axis=2, dtype=jnp.int32)  # (keys are distinct)
    dest = jnp.where(live, cell_indptr[:-1, None] + rank, cap)
    items = jnp.zeros_like(items).at[dest.reshape(-1)].set(items[at.reshape(-1)], mode="drop", unique_indices=True)

    # Each row's lse index: sequence i's query tiles are tiles first_tile[i], ... (owner: in order).
    row_seq, row_live = row_seqs(cu_q_lens, distribution, num_rows)
    tok = jnp.arange(num_rows, dtype=jnp.int32) - cu_q_lens[row_seq]
    first_tile = excl_cumsum(jnp.where(long_, -(-q_len // T), 0))[row_seq]
    in_tile = ((first_tile + tok // T) * hq * T + tok % T).astype(jnp.int32)
    in_packed = ((mix.tiles * hq + row_seq * hkv) * T + tok * (hq // hkv)).astype(jnp.int32)
    lse_src = jnp.where(row_live & long_[row_seq], in_tile, jnp.where(row_live & packed[row_seq], in_packed, -1))
    return items, cell_indptr, long_ | packed, lse_src


def last_pages(kv_lens, kv_indices, distribution, *, pages_per_seq, page_size):
    """The valid sequences' partly filled last pages (pallas_kernels.prefill_mosaic.LastPages, row
    s: sequence s, plan_mixed's last_row), read by the mixed launch with their stale slots
    zeroed; kv_indices [S * pages_per_seq], sequence s's pages from s * pages_per_seq."""
    from pallas_kernels.prefill_mosaic import LastPages
    seq = jnp.arange(kv_lens.shape[0], dtype=jnp.int32)
    pos = seq * pages_per_seq + jnp.maximum(kv_lens - 1, 0) // page_size  # [S]
    length = jnp.where(seq < distribution[2], kv_lens % page_size, 0)  # [S] (0: full or no page)
    return LastPages(page=kv_indices[pos], length=length)


def written_tails(kv_lens, kv_indices, cu_q_lens, distribution, *, pages_per_seq, page_size):
    """The partly filled last page of each valid sequence the step writes rows into (its own
    page), and its first slot past kv_len (0 where there is none): the V slots the KV write
    zeroes (jaxinfer.page.write_slots' stale_pages, stale_from), int32[S] each."""
    last = last_pages(kv_lens, kv_indices, distribution, pages_per_seq=pages_per_seq, page_size=page_size)
    writes = cu_q_lens[1:] > cu_q_lens[:-1]
    return last.page, jnp.where(writes, last.length, 0)


def row_seqs(cu_q_lens, distribution, num_tokens):
    """Each of the num_tokens rows' sequence (clipped to a valid index) and whether it is a valid
    sequence's row (not padding). Returns (seq int32[T], live bool[T])."""
    s = cu_q_lens.shape[0] - 1
    n_valid = distribution[2]
    cu = jnp.where(jnp.arange(s + 1) <= n_valid, cu_q_lens, jnp.iinfo(jnp.int32).max)  # monotone
    row = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu, row, side="right", method="compare_all") - 1, 0, s - 1)
    return seq.astype(jnp.int32), row < cu[n_valid]


def plan_mosaic(kv_lens, cu_q_lens, distribution, row_seq, row_live, *, pages_per_seq, cls, causal,
                 window_left, read_lens=None):
    """The device prologue of the Mosaic class. Its sequences' rows are gathered into a
    sub-buffer where each starts at an 8-aligned row (the kernel's TMA copies rows in groups of
    8), so every tile starts at its sequence's first row or 128 after, and no tile is a tail.
    read_lens (int32[S], optional): as plan_classes'.
    Returns (items int32[W, PREFILL.width] (one unsplit KV range each),
    cell_indptr int32[cells + 1] (contiguous runs of about equal cost), src int32[sub_rows] (the
    q row of each sub-buffer row; rows past a sequence repeat its last), pos int32[T] (each
    output row's sub-buffer row, -1 when it is not the class's), lse_src int32[T] (each output row's
    column of the kernel's lse_items [Hq, W * MOSAIC_TILE], -1 when it is not the class's))."""
    s = kv_lens.shape[0]
    q_len = jnp.maximum(cu_q_lens[1:] - cu_q_lens[:-1], 0)  # [S]
    mine = (jnp.arange(s) < distribution[2]) & (q_len >= cls.min_q) & (q_len <= cls.max_q)
    q_len = jnp.where(mine, q_len, 0)
    kv_len = jnp.where(mine, kv_lens, 0)
    span = -(-q_len // ROW_ALIGN) * ROW_ALIGN
    sub_start = excl_cumsum(span)  # [S]

    # Tiles of MOSAIC_TILE tokens, KV never split.
    tiles = -(-q_len // MOSAIC_TILE)  # [S]
    seq, j, ok = owner(tiles, cls.items)  # [W]
    tile_tok = j * MOSAIC_TILE
    qo, kv = q_len[seq], kv_len[seq]
    first_pos = kv - qo
    read = kv if read_lens is None else jnp.minimum(kv, read_lens[seq])
    tok_end = jnp.minimum(tile_tok + MOSAIC_TILE, qo)
    zero = jnp.zeros_like(seq)
    cols = PREFILL.ordered(
        q_row_start=sub_start[seq], tile_tok=tile_tok, qo_len=qo, page_base=seq * pages_per_seq, kv_len=kv,
        kv_start=zero, kv_end=read, part_base=zero - 1, num_chunks=zero + 1, chunk=zero, mask_base=zero - 1,
        kv_pos_offset=zero, tail=zero - 1, kv_first=zero, q_pos_min=first_pos + tile_tok,
        q_pos_max=first_pos + jnp.maximum(tok_end, 1) - 1)
    items = jnp.stack(cols, axis=1).astype(jnp.int32)

    keys = jnp.minimum(first_pos + tok_end if causal else kv, read)  # keys the tile's last token sees
    if window_left is not None:
        keys = jnp.where(window_left < 0, keys, jnp.minimum(keys, window_left + 1 + MOSAIC_TILE))
    cost = jnp.where(ok, TILE_COST * MOSAIC_TILE + keys, 0).astype(jnp.float32)
    start = excl_cumsum(cost)
    cell_of = jnp.where(ok, jnp.floor(start / jnp.maximum(jnp.sum(cost), 1.0) * cls.cells), cls.cells)
    cell_indptr = jnp.searchsorted(cell_of, jnp.arange(cls.cells + 1, dtype=jnp.float32), side="left",
                                   method="compare_all").astype(jnp.int32)

    sseq, t, _ = owner(span, cls.sub_rows)  # [sub_rows]
    src = cu_q_lens[sseq] + jnp.maximum(jnp.minimum(t, q_len[sseq] - 1), 0)
    src = jnp.clip(src, 0, row_seq.shape[0] - 1).astype(jnp.int32)
    row = jnp.arange(row_seq.shape[0], dtype=jnp.int32)
    tok = row - cu_q_lens[row_seq]
    pos = jnp.where(row_live & mine[row_seq], sub_start[row_seq] + tok, -1)
    # item w holds tile j of its sequence (owner: a sequence's tiles in order); its tokens' lse at w * T + i
    lse_src = jnp.where(pos >= 0, (excl_cumsum(tiles)[row_seq] + tok // MOSAIC_TILE) * MOSAIC_TILE + tok % MOSAIC_TILE, -1)
    return items, cell_indptr, src, pos.astype(jnp.int32), lse_src.astype(jnp.int32)


def token_slots(kv_lens, cu_q_lens, page_indices, row_seq, row_live, *, pages_per_seq, page_size, num_pages):
    """Cache page and slot of each row; padding rows get page num_pages (dropped by the scatter).
    Returns (page int32[T], slot int32[T], token position int32[T])."""
    row, seq = jnp.arange(row_seq.shape[0], dtype=jnp.int32), row_seq
    pos = kv_lens[seq] - (cu_q_lens[seq + 1] - cu_q_lens[seq]) + (row - cu_q_lens[seq])
    pos = jnp.clip(pos, 0, pages_per_seq * page_size - 1)
    page = page_indices[seq * pages_per_seq + pos // page_size]
    return jnp.where(row_live, page, num_pages), pos % page_size, pos


@dataclasses.dataclass(frozen=True, kw_only=True)
class ContextShare:
    """One device's part of a ragged step whose cache is split on pages (context parallel), as a
    sub-step of the same sequences over the device's pages (device arrays). Sequence i's rows
    before row_start see none of the device's keys; the sub-step attends its rows from there."""
    page_indices: jax.Array  # int32[S * pages_per_seq]: the device's pages of each sequence, local ids, first
    read_lens: jax.Array     # int32[S]: the sequence's keys on this device (its share)
    kv_lens: jax.Array       # int32[S]: the share's keys as positions: row j at kv_lens - q_lens + j
    row_start: jax.Array     # int32[S]: the first row the sub-step takes
    q_lens: jax.Array        # int32[S]: its rows (0 where the share is empty)


def context_share(kv_lens, page_indices, cu_q_lens, distribution, *, shard, pages_per_shard, page_size, causal):
    """Device `shard`'s share of each sequence: it holds global pages [shard N, (shard + 1) N)
    (N = pages_per_shard), and each sequence lists its pages device by device, so its keys on
    the device are one contiguous range [offset, offset + share) (offset: the keys on pages of
    earlier devices). Row j of sequence i sits at position p = kv_len - q_len + j and sees keys
    <= p (causal): on the device those are its first p - offset + 1 keys, read up to the share.
    So the sub-step keeps the rows at p >= offset, reads the share, and places its rows with
    kv_lens = kv_len - offset: rows past the share see all of it, the others their causal part.
    Without causal every row sees the whole share. Returns a ContextShare."""
    s = kv_lens.shape[0]
    pages_per_seq = page_indices.shape[0] // s
    live = jnp.arange(s) < distribution[2]
    kv = jnp.where(live, jnp.clip(kv_lens, 0, pages_per_seq * page_size), 0)  # [S]
    q_len = jnp.where(live, jnp.clip(cu_q_lens[1:] - cu_q_lens[:-1], 0, kv if causal else None), 0)
    table = page_indices.reshape(s, pages_per_seq)
    col = jnp.arange(pages_per_seq, dtype=jnp.int32)[None, :]
    used = col < -(-kv[:, None] // page_size)  # [S, pages_per_seq]
    device = table // pages_per_shard
    before = jnp.sum(used & (device < shard), axis=1, dtype=jnp.int32)  # [S]
    count = jnp.sum(used & (device == shard), axis=1, dtype=jnp.int32)
    local = jnp.take_along_axis(table, jnp.minimum(before[:, None] + col, pages_per_seq - 1), axis=1)
    local = jnp.where(col < count[:, None], jnp.clip(local - shard * pages_per_shard, 0, pages_per_shard - 1), 0)
    offset = before * page_size
    share = jnp.clip(kv - offset, 0, count * page_size)
    if causal:
        row_start = jnp.clip(offset - (kv - q_len), 0, q_len)  # rows before the share's first key see none of it
        positions = kv - offset
    else:
        row_start, positions = jnp.zeros_like(q_len), share
    rows = jnp.where(share > 0, q_len - row_start, 0)
    as32 = lambda x: x.astype(jnp.int32)
    return ContextShare(page_indices=as32(local.reshape(-1)), read_lens=as32(share), kv_lens=as32(positions),
                        row_start=as32(row_start), q_lens=as32(rows))


def sub_step_rows(cu_q_lens, distribution, starts, lens, num_rows):
    """The rows of a sub-step that takes rows [starts[i], starts[i] + lens[i]) of each sequence i
    of a step (cu_q_lens, distribution; num_rows rows). Returns (cu int32[S + 1]: the sub-step's
    cu_q_lens, src int32[T]: each sub-step row's step row (padding rows: clipped), pos int32[T]:
    each step row's sub-step row, -1 when the sub-step does not take it)."""
    cu = jnp.concatenate([jnp.zeros(1, jnp.int32), cumsum(lens).astype(jnp.int32)])
    sub_seq, sub_live = row_seqs(cu, distribution, num_rows)
    row = jnp.arange(num_rows, dtype=jnp.int32)
    src = jnp.clip(cu_q_lens[sub_seq] + starts[sub_seq] + row - cu[sub_seq], 0, num_rows - 1)
    seq, live = row_seqs(cu_q_lens, distribution, num_rows)
    j = row - cu_q_lens[seq] - starts[seq]
    pos = jnp.where(live & (j >= 0) & (j < lens[seq]), cu[seq] + j, -1)
    return cu, jnp.where(sub_live, src, num_rows - 1).astype(jnp.int32), pos.astype(jnp.int32)
