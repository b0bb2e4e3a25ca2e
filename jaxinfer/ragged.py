"""ragged_paged_attention: a whole serving step (decode, speculative verify, chunked prefill,
prompts) in one jittable call, with the arguments of tpu-inference's ragged paged attention v3.

The new tokens' K/V are scattered into the paged cache, then every query row attends over its
sequence. Planning runs on the device: a small XLA prologue turns the metadata into
fixed-capacity work lists, one per q_len class, and their split-KV merges
(pallas_kernels/merge.merge_varlen). There is no host round trip, and one compilation serves
every composition with the same shapes.

On a Hopper GPU with 16-bit q and K/V and no variant (dispatch.ragged_long_impl: "batch_mosaic"),
the step's base is one persistent Mosaic launch (_mixed_plan: BatchAttention impl="mixed"'s work
list, planned on the device): the long sequences' query tiles, the short ones' packed tiles when
the step has long ones (those whose keys fit a cell's mean load), and the padding rows' tiles (o
= 0). The decode classes below then run the other short sequences (decode-only steps, long
contexts: split-KV) into its output.

Classes (static, by q_len, each its own launch with its own tile; _classes): q_len <= T_s on the
decode kernel's multi-token items of T_s tokens, T_s x the GQA group within a 16-row tile
(decode, speculative verify: BatchAttention's short rows); q_len <= T_l on 64-row decode tiles
(when T_l > T_s); longer sequences on prefill tiles, of the kernel jaxinfer.dispatch picks
(dispatch.ragged_long_impl). A class with no sequence costs a launch over an empty work list.
The long class is the base, launched first; every other class's kernel writes its unsplit
blocks into the base's output in place (the decode kernel's out=). The decode classes share one
device plan (_plan over the group: their items class by class, each class's cells a slice of
one cell_indptr), one buffer of partial states (the second launch writes into the first's:
paged_decode's parts=), and one merge into the base's output (merge_varlen's out=; its
programs loop over the groups below the plan's live count, so an empty merge is cheap). So the
classes' outputs combine without a pass over the whole output beyond the base's own.
- Mosaic (Hopper, 16-bit q and K/V; _mosaic_plan): the class's rows are gathered into a
  sub-buffer where each sequence starts at an 8-aligned row (TMA copies rows in groups of 8),
  cut into tiles of 128 tokens of one query head that never split KV. The grid is (Hq, cells),
  about MOSAIC_CTAS_PER_SM CTAs per SM in all; each cell runs a contiguous run of tiles of about
  equal cost (a persistent grid), and a partial tile's rows are stored 8 at a time, so no tile
  needs a tail slot. The output is one
  gather + select over the rows (BatchAttention's placement), which also zeroes every row that
  is not the class's: the padding rows too.
- Triton (pallas_kernels/prefill.py ITEM_COLUMNS built on the device, tiles of 128 rows, no
  tails): the kernel writes its rows of the output and its merge its split rows; the last
  class's merge writes o = 0 to the padding rows.

The work list of a decode or Triton class. Each of its sequences' q_len query tokens are cut
into blocks of up to T tokens (the class's item or tile). Block (i, t0) with qo tokens reaches keys
[lo, kv_len - q_len + t0 + qo) (causal; all kv_len keys if not; lo > 0 only under a sliding
window). With L = max(ceil(the class's keys / (2 x cells)), 256) rounded to 128-key units, a
block of more than L keys splits into n = ceil(its keys / L) items of equal 128-key multiples,
whose float32 partial states are merged afterwards. So fewer than 2 x cells blocks split, the
list holds fewer than blocks + 2 x cells items (that bounds the static capacities), and each
cell runs a contiguous run of items of about equal cost (keys plus a per-tile constant): at
most the mean plus one chunk.

How a decode block's own query positions reach the kernel: a multi-token item's first query
sits at kv_lens[item.request] - qo_len. Here `request` names the block, and the kv_lens the
kernel reads hold each block's causal end (kv_len - q_len + t0 + qo), so no new item column is
needed. Prefill items carry the sequence's kv_len and the tile's first token themselves.
"""
import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import _backend, dispatch, variants
from jaxinfer.formats import PagedKVCache, check_int32, check_kv_dtype, default_sm_scale, is_concrete, kv_scales
from jaxinfer.page import write_slots
from jaxinfer.prefill import _check_q
from pallas_kernels import decode as decode_kernels
from pallas_kernels import merge as merge_kernels
from pallas_kernels import prefill as prefill_kernels
from planner import batch as batch_planner

CHUNK_UNIT = 128       # keys: KV chunks are multiples of this (the kernel's default block_kv)
MIN_CHUNK_UNITS = 2    # no item splits below 256 keys (planner/batch.py's min_split_tokens)
CHUNKS_PER_CELL = 2    # KV chunks are at most 1 / (2 x cells) of a class's keys: a cell's run of
                       # items then costs at most 1.5 x the mean (runs are contiguous, not greedy)
DENSE_PREFIX_MAX = 1024  # _cumsum's one-kernel form up to this length (n^2 adds: 1M at the most)
TILE_COST = 32         # an item's fixed cost in keys per query token of its tile (cell balance)
PREFILL_ROWS = 128     # prefill tile rows (query tokens x the GQA group), as BatchAttention's chunks
# Query tokens per Mosaic tile (of one query head): the kernel's two compute warpgroups, ping-pong
# (MosaicPrefillConfig's defaults; of a config given here only block_kv and
# max_concurrent_steps apply to this class).
MOSAIC_TILE = 2 * 64
MOSAIC_CTAS_PER_SM = 1  # the Mosaic class's grid (Hq, cells): its shared memory holds one CTA per SM
ROW_ALIGN = 8          # the Mosaic kernel reads and writes q / o rows in groups of 8 (TMA)
MERGE_PROGRAMS = 128   # the merge's grid over groups (each program loops over groups: an empty merge is cheap)
MIXED_ITEM_COST = 256  # keys: a mixed-launch item's fixed cost (planner.batch.plan_mixed's item_cost)


class _Class(NamedTuple):
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


def _tokens(group, rows):
    """The most query tokens per decode item whose tile (tokens x group) fits `rows` (1 at least)."""
    return batch_planner.short_cap(group, rows)


def _classes(num_tokens, num_seqs, num_cells, group, mosaic_cells=0, mixed=False):
    """The q_len classes, base first: q_len <= T_s on 16-row decode tiles of T_s tokens (decode,
    speculative verify), q_len <= T_l on 64-row decode tiles of T_l tokens (when T_l > T_s), the
    rest on prefill tiles: the Triton kernel's of PREFILL_ROWS rows, or with mosaic_cells > 0 the
    Mosaic kernel's of MOSAIC_TILE tokens over that many cells per query head. Classes no
    sequence of num_tokens can reach are left out. The padding class is the last one, or the
    Mosaic class (its output placement zeroes every row not its own). mixed: the decode classes
    only, none the base (the mixed launch before them makes the output and runs the rest)."""
    t_short, t_long = _tokens(group, 16), _tokens(group, 64)
    rows = max(PREFILL_ROWS, 1 << (group - 1).bit_length())
    bounds = [(1, t_short, False, t_short)]
    if t_long > t_short:
        bounds.append((t_short + 1, t_long, False, t_long))
    if not mixed:
        bounds.append((bounds[-1][1] + 1, num_tokens, True, rows // group))
    bounds = [x for x in bounds if x[0] <= num_tokens][::-1]  # the longest class is the base: most rows
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
            out.append(_Class(lo, hi, True, MOSAIC_TILE, True, True, tiles, tiles, 0, 0, mosaic_cells,
                              MOSAIC_TILE * group, True, sub_rows))
            continue
        blocks = max(1, min(tokens, (tokens + seqs * (t - 1)) // t, seqs * -(-hi // t)))
        c = CHUNKS_PER_CELL * num_cells  # the class's keys / the longest chunk, at most
        # Fewer than c blocks split, into fewer than 2c chunks (module docstring).
        part_cap, merges = 2 * c * t, max(1, (c - 1) * t)
        if pad:  # padding rows, disjoint from this class's and fewer than num_tokens
            merges += num_tokens
        out.append(_Class(lo, hi, prefill, t, base, pad, blocks, blocks + c, part_cap, merges,
                          num_cells, rows))
    return tuple(out)


def _cumsum(x):
    """Inclusive prefix sum of a vector x [n] (sequences, blocks or items), kept out of its
    consumers' fusions (XLA would otherwise recompute it inside each consumer's threads). Up to
    DENSE_PREFIX_MAX entries it is one [n, n] masked row sum: one GPU kernel, where XLA lowers
    jnp.cumsum to a blocked scan of two or three."""
    n = x.shape[0]
    if n > DENSE_PREFIX_MAX:
        return jax.lax.optimization_barrier(jnp.cumsum(x))
    lower = jnp.arange(n)[:, None] >= jnp.arange(n)[None, :]  # [n, n]: j <= i
    return jax.lax.optimization_barrier(jnp.sum(jnp.where(lower, x[None, :], 0), axis=1, dtype=x.dtype))


def _excl_cumsum(x):
    return _cumsum(x) - x


def _owner(counts, n):
    """For slots 0..n-1 laid out as counts[0] slots of owner 0, then counts[1] of owner 1, ...:
    (owner of each slot clipped to a valid index, index within the owner, slot is used)."""
    ends = _cumsum(counts)
    slot = jnp.arange(n, dtype=jnp.int32)
    owner = jnp.minimum(jnp.searchsorted(ends, slot, side="right", method="compare_all"),
                        counts.shape[0] - 1).astype(jnp.int32)
    return owner, slot - (ends - counts)[owner], slot < ends[-1]


def _plan(kv_lens, cu_q_lens, distribution, *, pages_per_seq, classes, causal, window_left, num_rows, taken=None):
    """The device prologue of a group of classes that share one partial buffer and one merge (the
    decode classes, or the Triton prefill class alone): work items (the decode kernel's
    MULTI_ITEM_COLUMNS or the prefill kernel's ITEM_COLUMNS), class by class, one cell_indptr per
    class (into the shared item list), the merge groups, and the per-block kv_lens the decode
    kernel reads. All int32 jnp. taken (bool[S], optional): sequences the mixed launch runs.

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
    vseq, j, blk_ok = _owner(nblk, sum(c.blocks for c in classes))  # [NB]
    seq, k_blk = vseq % s, vseq // s
    t_item = t_of[k_blk]
    t0 = j * t_item
    q_b, kv_b = q_len[seq], kv_lens[seq]
    qo = jnp.where(blk_ok, jnp.minimum(q_b - t0, t_item), 0)
    first_pos = kv_b - q_b + t0
    end = first_pos + qo if causal else kv_b  # the block's keys end here (its kernel kv_len)
    lo = jnp.zeros_like(end)
    if window_left is not None:  # keys left of the first token's window are never seen
        lo = jnp.where(window_left < 0, 0, jnp.maximum(first_pos - window_left, 0)) // CHUNK_UNIT * CHUNK_UNIT
    units = jnp.where(blk_ok, -(-(end - lo) // CHUNK_UNIT), 0)
    one_hot = k_blk[:, None] == jnp.arange(len(classes))[None, :]  # [NB, K]
    class_units = jnp.sum(jnp.where(one_hot, units[:, None], 0), axis=0)  # [K]
    max_chunk = jnp.maximum(-(-class_units // (CHUNKS_PER_CELL * cells)), MIN_CHUNK_UNITS)[k_blk]  # units
    n_chunks = jnp.where(blk_ok, jnp.maximum(-(-units // max_chunk), 1), 0)
    chunk = -(-units // jnp.maximum(n_chunks, 1)) * CHUNK_UNIT  # [NB] keys per item: the block cut evenly
    split = n_chunks > 1  # blocks writing partials
    parts = jnp.where(split, n_chunks * qo, 0)
    part_first = _excl_cumsum(parts)

    # Items: block b's n_chunks KV chunks.
    blk, c, item_ok = _owner(n_chunks, sum(c.items for c in classes))  # [IC]
    tok_start = lo[blk] + c * chunk[blk]
    tok_end = jnp.minimum(tok_start + chunk[blk], end[blk])
    sb = seq[blk]
    if classes[0].prefill:  # pallas_kernels.prefill.ITEM_COLUMNS (no mask, no tails)
        zero = jnp.zeros_like(blk)
        cols = [cu_q_lens[sb], t0[blk], q_len[sb], sb * pages_per_seq, kv_lens[sb], tok_start, tok_end,
                jnp.where(split[blk], part_first[blk], -1), n_chunks[blk], c, zero - 1, zero, zero - 1, zero,
                first_pos[blk], first_pos[blk] + jnp.maximum(qo[blk], 1) - 1]
    else:  # pallas_kernels.decode.MULTI_ITEM_COLUMNS
        cols = [blk, sb * pages_per_seq, tok_start, tok_end, jnp.where(split[blk], part_first[blk] + c, -1),
                n_chunks[blk], cu_q_lens[sb] + t0[blk], qo[blk]]
    items = jnp.stack(cols, axis=1).astype(jnp.int32)

    # Cells of each class: contiguous runs of its items of about its total / cells cost each.
    k_item = k_blk[blk]
    cost = jnp.where(item_ok, TILE_COST * t_item[blk] + tok_end - tok_start, 0).astype(jnp.float32)
    class_cost = jnp.sum(jnp.where(k_item[:, None] == jnp.arange(len(classes))[None, :], cost[:, None], 0), axis=0)
    start = _excl_cumsum(cost) - (jnp.cumsum(class_cost) - class_cost)[k_item]  # within the class
    cell_of = jnp.floor(start / jnp.maximum(class_cost[k_item], 1.0) * cells) + k_item * cells
    cell_of = jnp.where(item_ok, cell_of, len(classes) * cells)
    cell_indptr = jnp.searchsorted(cell_of, jnp.arange(len(classes) * cells + 1, dtype=jnp.float32), side="left",
                                   method="compare_all").astype(jnp.int32)

    # Merge groups: one per query token of a partial-writing block, its n_chunks partials contiguous.
    tokens = jnp.where(split, qo, 0)
    mb, tin, m_ok = _owner(tokens, sum(c.merges for c in classes))
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


class _Mixed(NamedTuple):
    """The mixed launch's static sizes (pallas_kernels.prefill_mosaic, packed_tokens > 0)."""
    tiles: int          # query-tile capacity (each run for every query head), the padding's too
    long_min: int       # sequences of q_len >= this take query tiles (those past the decode classes)
    packed_tokens: int  # a packed tile's tokens: sequences of q_len <= this may be packed
    tile_tokens: int
    cells: int

    def slots(self, num_seqs, num_qo_heads, num_kv_heads):
        """Work-item (and lse-slot) capacity: tiles x Hq, then packed sequences x Hkv."""
        return self.tiles * num_qo_heads + num_seqs * num_kv_heads


def _mixed_sizes(num_tokens, num_seqs, group, tile_tokens, cells):
    """_Mixed for a step of num_tokens rows over num_seqs sequences: sequences past the decode
    classes' tokens take query tiles, those of a 16-row decode tile's may be packed."""
    long_min = _tokens(group, 64) + 1
    seqs = max(1, min(num_seqs, num_tokens // long_min)) + 1  # (+ the padding rows' tiles)
    tiles = max(1, (num_tokens + seqs * (tile_tokens - 1)) // tile_tokens)  # sum of ceil(q_len / tile)
    return _Mixed(tiles, long_min, _tokens(group, 16), tile_tokens, cells)


def _order_desc(cost):
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


def _mixed_plan(kv_lens, cu_q_lens, distribution, *, pages_per_seq, causal, num_qo_heads, num_kv_heads, mix,
                num_rows):
    """The device prologue of the mixed launch (planner.batch.plan_mixed's work list, planned in
    XLA): sequences of q_len >= mix.long_min are query tiles of tile_tokens tokens x each query
    head, from their first row; when the step has such a tile, a sequence of q_len <=
    mix.packed_tokens whose keys fit a cell's mean load is a packed tile per KV head (its tokens x
    the head group in 64 rows). The other sequences are left to the decode classes (split-KV).
    KV is never split. The padding rows (from cu_q_lens[distribution[2]] to num_rows) are query
    tiles of no key: the launch writes them o = 0.

    Cells: the work units (a tile, or a packed sequence: Hq, resp. Hkv, items of one cost: keys
    + MIXED_ITEM_COST, as plan_mixed's) sorted largest first, their items dealt to the cells in
    a snake order (0..C-1, then C-1..0, ...): about longest-first greedy's balance without its
    loop. Within a cell, even cells run their query tiles first, odd cells their packed tiles
    (plan_mixed's order), each kind in lse-slot order (tiles by sequence and position, packed
    tiles by sequence: on the H100's mixed step 10 µs faster than largest first).

    Returns (items int32[N, 16] (prefill_mosaic ITEM_FIELDS with MIXED_ITEM_COLUMNS), cell_indptr
    int32[cells + 1], taken bool[S] (the sequences this launch runs))."""
    s, hq, hkv, T, C = kv_lens.shape[0], num_qo_heads, num_kv_heads, mix.tile_tokens, mix.cells
    q_len = jnp.maximum(cu_q_lens[1:] - cu_q_lens[:-1], 0)  # [S]
    valid = (jnp.arange(s) < distribution[2]) & (q_len > 0)
    q_len, kv = jnp.where(valid, q_len, 0), jnp.where(valid, kv_lens, 0)
    long_ = q_len >= mix.long_min

    # Query tiles of the long sequences, then of the padding rows (sequence S: no key, no page).
    pad_start = cu_q_lens[distribution[2]]
    start_x = jnp.concatenate([cu_q_lens[:s], pad_start[None]])  # [S + 1]
    q_x = jnp.concatenate([q_len, jnp.maximum(num_rows - pad_start, 0)[None]])
    kv_x = jnp.concatenate([kv, jnp.zeros((1,), kv.dtype)])
    tseq, j, t_ok = _owner(jnp.where(jnp.concatenate([long_, jnp.ones((1,), bool)]), -(-q_x // T), 0), mix.tiles)
    tile_tok = j * T
    qo_t, kv_t = q_x[tseq], kv_x[tseq]
    kv_hi = jnp.clip(kv_t - qo_t + jnp.minimum(tile_tok + T, qo_t), 0, kv_t) if causal else kv_t
    tile_cost = jnp.where(t_ok, kv_hi + MIXED_ITEM_COST, 0)
    # Packed short sequences: only beside query tiles, and only those no longer than a cell's mean.
    short = valid & (q_len <= mix.packed_tokens)
    short_cost = jnp.where(short, kv + MIXED_ITEM_COST, 0)
    mean = (jnp.sum(tile_cost.astype(jnp.float32)) * hq + jnp.sum(short_cost.astype(jnp.float32)) * hkv) / C
    packed = short & jnp.any(long_) & (short_cost <= mean)

    # Units (tiles, then sequences), largest first; slot p of the sorted items goes to cell
    # p % C in even rounds (p // C), C - 1 - p % C in odd ones.
    cost = jnp.concatenate([tile_cost, jnp.where(packed, short_cost, 0)])  # [U]
    mult = jnp.concatenate([jnp.where(t_ok, hq, 0), jnp.where(packed, hkv, 0)]).astype(jnp.int32)
    order = _order_desc(cost)
    ends = _cumsum(mult[order])  # [U]
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
    ok = slot < n
    pos = k * C + jnp.where(k % 2 == 0, c, C - 1 - c)  # the slot's place in the sorted items
    sorted_unit = jnp.minimum(jnp.searchsorted(ends, pos, side="right", method="compare_all"), ends.shape[0] - 1)
    unit = order[sorted_unit]
    within = pos - (ends - mult[order])[sorted_unit]  # query head, or KV head
    is_packed = unit >= mix.tiles

    # Fields of each item (prefill_mosaic.ITEM_FIELDS; MIXED_ITEM_COLUMNS = 7, 8, 9).
    tile = jnp.minimum(unit, mix.tiles - 1)
    seq = jnp.where(is_packed, unit - mix.tiles, tseq[tile])  # (S: the padding)
    zero = jnp.zeros_like(slot)
    lse_slot = jnp.where(is_packed, mix.tiles * hq + (unit - mix.tiles) * hkv, unit * hq) + within
    cols = [start_x[seq], jnp.where(is_packed, 0, tile_tok[tile]), q_x[seq], jnp.minimum(seq, s - 1) * pages_per_seq,
            kv_x[seq], zero, jnp.where(is_packed, kv_x[seq], kv_hi[tile]), within, lse_slot,
            is_packed.astype(jnp.int32), zero, zero, zero - 1, zero, zero, zero]
    items = jnp.stack(cols, axis=1).astype(jnp.int32)  # [N, 16]

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
    return items, cell_indptr, long_ | packed


def _row_seqs(cu_q_lens, distribution, num_tokens):
    """Each of the num_tokens rows' sequence (clipped to a valid index) and whether it is a valid
    sequence's row (not padding). Returns (seq int32[T], live bool[T])."""
    s = cu_q_lens.shape[0] - 1
    n_valid = distribution[2]
    cu = jnp.where(jnp.arange(s + 1) <= n_valid, cu_q_lens, jnp.iinfo(jnp.int32).max)  # monotone
    row = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu, row, side="right", method="compare_all") - 1, 0, s - 1)
    return seq.astype(jnp.int32), row < cu[n_valid]


def _mosaic_plan(kv_lens, cu_q_lens, distribution, row_seq, row_live, *, pages_per_seq, cls, causal,
                 window_left):
    """The device prologue of the Mosaic class. Its sequences' rows are gathered into a
    sub-buffer where each starts at an 8-aligned row (the kernel's TMA copies rows in groups of
    8), so every tile starts at its sequence's first row or 128 after, and no tile is a tail.
    Returns (items int32[W, 16] (pallas_kernels.prefill.ITEM_COLUMNS, one unsplit KV range each),
    cell_indptr int32[cells + 1] (contiguous runs of about equal cost), src int32[sub_rows] (the
    q row of each sub-buffer row; rows past a sequence repeat its last), pos int32[T] (each
    output row's sub-buffer row, -1 when it is not the class's))."""
    s = kv_lens.shape[0]
    q_len = jnp.maximum(cu_q_lens[1:] - cu_q_lens[:-1], 0)  # [S]
    mine = (jnp.arange(s) < distribution[2]) & (q_len >= cls.min_q) & (q_len <= cls.max_q)
    q_len = jnp.where(mine, q_len, 0)
    kv_len = jnp.where(mine, kv_lens, 0)
    span = -(-q_len // ROW_ALIGN) * ROW_ALIGN
    sub_start = _excl_cumsum(span)  # [S]

    # Tiles of MOSAIC_TILE tokens, KV never split.
    seq, j, ok = _owner(-(-q_len // MOSAIC_TILE), cls.items)  # [W]
    tile_tok = j * MOSAIC_TILE
    qo, kv = q_len[seq], kv_len[seq]
    first_pos = kv - qo
    tok_end = jnp.minimum(tile_tok + MOSAIC_TILE, qo)
    zero = jnp.zeros_like(seq)
    cols = [sub_start[seq], tile_tok, qo, seq * pages_per_seq, kv, zero, kv, zero - 1, zero + 1, zero, zero - 1,
            zero, zero - 1, zero, first_pos + tile_tok, first_pos + jnp.maximum(tok_end, 1) - 1]
    items = jnp.stack(cols, axis=1).astype(jnp.int32)

    keys = first_pos + tok_end if causal else kv  # keys the tile's last token sees
    if window_left is not None:
        keys = jnp.where(window_left < 0, keys, jnp.minimum(keys, window_left + 1 + MOSAIC_TILE))
    cost = jnp.where(ok, TILE_COST * MOSAIC_TILE + keys, 0).astype(jnp.float32)
    start = _excl_cumsum(cost)
    cell_of = jnp.where(ok, jnp.floor(start / jnp.maximum(jnp.sum(cost), 1.0) * cls.cells), cls.cells)
    cell_indptr = jnp.searchsorted(cell_of, jnp.arange(cls.cells + 1, dtype=jnp.float32), side="left",
                                   method="compare_all").astype(jnp.int32)

    sseq, t, _ = _owner(span, cls.sub_rows)  # [sub_rows]
    src = cu_q_lens[sseq] + jnp.maximum(jnp.minimum(t, q_len[sseq] - 1), 0)
    src = jnp.clip(src, 0, row_seq.shape[0] - 1).astype(jnp.int32)
    row = jnp.arange(row_seq.shape[0], dtype=jnp.int32)
    pos = jnp.where(row_live & mine[row_seq], sub_start[row_seq] + row - cu_q_lens[row_seq], -1)
    return items, cell_indptr, src, pos.astype(jnp.int32)


def _token_slots(kv_lens, cu_q_lens, page_indices, row_seq, row_live, *, pages_per_seq, page_size, num_pages):
    """Cache page and slot of each row; padding rows get page num_pages (dropped by the scatter).
    Returns (page int32[T], slot int32[T], token position int32[T])."""
    row, seq = jnp.arange(row_seq.shape[0], dtype=jnp.int32), row_seq
    pos = kv_lens[seq] - (cu_q_lens[seq + 1] - cu_q_lens[seq]) + (row - cu_q_lens[seq])
    pos = jnp.clip(pos, 0, pages_per_seq * page_size - 1)
    page = page_indices[seq * pages_per_seq + pos // page_size]
    return jnp.where(row_live, page, num_pages), pos % page_size, pos


def _check(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, sliding_window):
    _check_q(queries, "queries")
    if queries.ndim != 3:
        raise ValueError(f"queries must be [T, Hq, D], got shape {queries.shape}")
    if not isinstance(kv_cache, PagedKVCache):
        raise ValueError("kv_cache must be a PagedKVCache")
    t, hq, d = queries.shape
    hkv = kv_cache.num_kv_heads
    if kv_cache.head_dim != d or hq % hkv:
        raise ValueError(f"kv_cache (num_kv_heads {hkv}, head_dim {kv_cache.head_dim}) does not fit "
                         f"queries [T, {hq}, {d}] (Hq must be a multiple of num_kv_heads)")
    check_kv_dtype(queries.dtype, kv_cache.dtype, "kv_cache")
    for name, x in (("keys", keys), ("values", values)):
        if tuple(x.shape) != (t, hkv, d):
            raise ValueError(f"{name} must have shape {(t, hkv, d)}, got {tuple(x.shape)}")
    for name, x in (("kv_lens", kv_lens), ("page_indices", page_indices), ("cu_q_lens", cu_q_lens),
                    ("distribution", distribution)):
        check_int32(name, x)
        if jnp.ndim(x) != 1:
            raise ValueError(f"{name} must be 1-D, got shape {jnp.shape(x)}")
    s = kv_lens.shape[0]
    if s < 1 or page_indices.shape[0] % s or page_indices.shape[0] == 0:
        raise ValueError(f"page_indices must hold S * pages_per_seq entries (S = {s}), got {page_indices.shape[0]}")
    if cu_q_lens.shape[0] != s + 1:
        raise ValueError(f"cu_q_lens must have shape [{s + 1}], got {cu_q_lens.shape}")
    if distribution.shape[0] != 3:
        raise ValueError(f"distribution must have shape [3], got {distribution.shape}")
    if sliding_window is not None and is_concrete(sliding_window) and int(sliding_window) < 1:
        raise ValueError(f"sliding_window must be >= 1, got {int(sliding_window)}")
    if not is_concrete(kv_lens, page_indices, cu_q_lens, distribution):
        return
    kv, pi, cu, dist = (np.asarray(x) for x in (kv_lens, page_indices, cu_q_lens, distribution))
    n = int(dist[2])
    if not 0 <= dist[0] <= dist[1] <= n <= s:
        raise ValueError(f"distribution must satisfy 0 <= d[0] <= d[1] <= d[2] <= {s}, got {dist.tolist()}")
    q_len = np.diff(cu[: n + 1])
    if cu[0] != 0 or np.any(q_len < 0) or cu[n] > t:
        raise ValueError(f"cu_q_lens must start at 0 and rise to at most {t} over the valid sequences")
    if np.any(q_len[: dist[0]] != 1):
        raise ValueError("cu_q_lens: sequences [0, distribution[0]) must have q_len 1")
    pages_per_seq = pi.shape[0] // s
    if np.any(kv[:n] < q_len) or np.any(kv[:n] > pages_per_seq * kv_cache.page_size):
        raise ValueError(f"kv_lens must lie in [q_len, pages_per_seq * page_size = "
                         f"{pages_per_seq * kv_cache.page_size}] for the valid sequences")
    used = np.arange(pages_per_seq)[None, :] < -(-kv[:n, None] // kv_cache.page_size)
    ids = pi[: n * pages_per_seq].reshape(n, pages_per_seq)[used]
    if ids.size and (ids.min() < 0 or ids.max() >= kv_cache.num_pages):
        raise ValueError(f"page_indices lists page ids outside [0, {kv_cache.num_pages})")


def ragged_paged_attention(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, *,
                           causal=True, sm_scale=None, sliding_window=None, soft_cap=None, k_scale=None,
                           v_scale=None, num_ctas=None, backend=None, impl="auto", config=None):
    """One serving step: writes the new K/V, then ragged attention over the paged cache.

    queries [T, Hq, D]; keys, values [T, Hkv, D] (row-aligned with queries); kv_cache: a
    PagedKVCache (NHD as RPA v3; HND works too); kv_lens i32[S] (each INCLUDES its sequence's
    new tokens); page_indices i32[S * pages_per_seq]; cu_q_lens i32[S + 1]; distribution i32[3] =
    (decode_end, prefill_end, mixed_end). Sequence i < distribution[2] is valid (those before
    distribution[0] have q_len 1): its new rows keys/values[cu_q_lens[i] + j] land at token
    position kv_len - q_len + j (cast to the cache dtype, not rescaled), then its q rows attend
    over its kv_len keys, causal bottom-right if causal. Rows from cu_q_lens[distribution[2]] on
    are padding: they write nothing and give o = 0.

    sm_scale: a static float (default 1 / sqrt(D); RPA v3's own default is 1.0).
    sliding_window W (int, may be traced; needs causal): the query at position p sees keys
    p - W < k <= p. soft_cap c (float, may be traced): logits s -> c * tanh(s / c) after sm_scale.
    k_scale / v_scale: fp8 caches' dequantization scales (scalars or [Hkv]).
    impl: the kernel of the long sequences (past the decode tiles): "auto" (jaxinfer.dispatch
    decides: the mixed launch, else the Mosaic GPU prefill kernel where they can run, compiled on
    a Hopper GPU with 16-bit q and K/V, else the Triton kernel), "mixed" or "mosaic" (forced;
    interpret mode too) or "triton".
    num_ctas: grid size (default 2 x SMs for the decode and Triton launches, MOSAIC_CTAS_PER_SM
    x SMs for the Mosaic one); backend, config (a DecodeConfig, PrefillConfig and/or
    MosaicPrefillConfig, or a tuple of them): as the wrappers.

    Returns (out [T, Hq, D] in queries' dtype, the updated PagedKVCache). Metadata are checked
    when concrete; under jax.jit (one compilation for all compositions of the same shapes, cache
    donated for an in-place write) inputs that break the contract give undefined results. The
    mixed launch reads queries as they are: a slice of a larger array (q split from a fused qkv
    with no op after it) is first copied to a buffer of its own (H100, a 2108-row step: ~15 µs).
    """
    _check(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, sliding_window)
    if sliding_window is not None and not causal:
        raise ValueError("sliding_window needs causal=True")
    hq, d = queries.shape[1:]
    hkv = kv_cache.num_kv_heads
    window = None if sliding_window is None else jnp.asarray(sliding_window, jnp.int32)
    cap = None if soft_cap is None else jnp.asarray(soft_cap, jnp.float32)
    variant = _variant(window is not None, cap is not None)
    interpret = _backend.use_interpret(backend)
    problem = dispatch.Problem("decode", hq, hkv, d, "paged", kv_cache.page_size, kv_cache.layout, variant,
                               interpret=interpret)
    dispatch.check(problem)
    configs = dispatch.check_configs(config)
    scales = kv_scales(k_scale, v_scale, kv_cache.dtype, hkv)
    sm_scale = default_sm_scale(d, sm_scale)
    long_problem = dataclasses.replace(problem, family="prefill")
    long_impl = dispatch.ragged_long_impl(long_problem, impl, queries.dtype, kv_cache.dtype, scales is not None,
                                          sm_scale)
    ctas = num_ctas or 2 * _backend.num_sms()
    long_config = dispatch.config_for(long_impl, long_problem, configs)
    mosaic_cells, mixed = 0, None
    if long_impl.name == "prefill_mosaic":
        mosaic_cells = max(1, (num_ctas or MOSAIC_CTAS_PER_SM * _backend.num_sms()) // hq)
    elif long_impl.name == "batch_mosaic":
        mixed = _mixed_sizes(queries.shape[0], kv_lens.shape[0], hq // hkv, long_config.tile_tokens,
                             num_ctas or _backend.num_sms())
    return _run(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, window, cap,
                scales, causal=causal, sm_scale=sm_scale, num_cells=max(1, ctas // hkv), mosaic_cells=mosaic_cells,
                mixed=mixed, interpret=interpret,
                decode_config=dispatch.config_for(dispatch.IMPLEMENTATIONS_BY_NAME["decode_triton"], problem, configs),
                long_config=long_config)


def _variant(has_window, has_cap):
    """The static variant of the sliding window and soft-cap options (None without either)."""
    parts = ([variants.sliding_window()] if has_window else []) + ([variants.soft_cap()] if has_cap else [])
    return None if not parts else parts[0] if len(parts) == 1 else variants.compose(*parts)


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale", "num_cells", "mosaic_cells", "mixed",
                                             "interpret", "decode_config", "long_config"))
def _run(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, window, cap, scales, *,
         causal, sm_scale, num_cells, mosaic_cells, mixed, interpret, decode_config, long_config):
    """ragged_paged_attention after its checks (window, cap: 0-d arrays or None; mixed: the mixed
    launch's sizes, or None for the class launches alone)."""
    t, hq, d = queries.shape
    hkv, page_size = kv_cache.num_kv_heads, kv_cache.page_size
    s = kv_lens.shape[0]
    pages_per_seq = page_indices.shape[0] // s
    # Traced metadata are not checked; clipped, they still keep every read inside the arrays: no
    # page id past a sequence's row of page_indices (pages_per_seq x page_size keys at most), no q
    # row past T. (Concrete metadata were checked: for them the clips change nothing.)
    kv_lens = jnp.clip(kv_lens, 0, pages_per_seq * page_size)
    cu_q_lens = jnp.clip(cu_q_lens, 0, t)
    distribution = jnp.clip(distribution, 0, s)
    variant = _variant(window is not None, cap is not None)
    params = {}
    if window is not None:  # keys p - W < k <= p: window_left W - 1
        params["window_left"] = window - 1
    if cap is not None:
        params["logits_soft_cap"] = cap

    # The KV write: padding rows go to page num_pages, dropped.
    row_seq, row_live = _row_seqs(cu_q_lens, distribution, t)
    page, slot, q_pos = _token_slots(kv_lens, cu_q_lens, page_indices, row_seq, row_live,
                                     pages_per_seq=pages_per_seq, page_size=page_size,
                                     num_pages=kv_cache.num_pages)
    new_cache = write_slots(kv_cache, page, slot, keys, values, interpret=interpret)

    # Per class: the work list, its kernel, the merge (into the base class's output).
    kv_indices = jnp.clip(page_indices, 0, kv_cache.num_pages - 1)
    k_rows, v_rows = new_cache.rows()
    out, taken = None, None
    if mixed is not None:  # the base: the long sequences and the packed short ones in one launch
        from pallas_kernels import prefill_mosaic
        items, cell_indptr, taken = _mixed_plan(kv_lens, cu_q_lens, distribution, pages_per_seq=pages_per_seq,
                                                causal=causal, num_qo_heads=hq, num_kv_heads=hkv, mix=mixed,
                                                num_rows=t)
        o, _, _ = prefill_mosaic.prefill_mosaic(  # (no tail slots: its o_tail is 8 unused rows)
            queries, k_rows, v_rows, kv_indices, items, cell_indptr, ROW_ALIGN, page_size=page_size,
            num_kv_heads=hkv, layout=kv_cache.layout, sm_scale=sm_scale, causal=causal,
            block_kv=long_config.block_kv, max_concurrent_steps=long_config.max_concurrent_steps,
            pipeline=long_config.pipeline, tree_max=long_config.tree_max, compute_wgs=long_config.compute_wgs,
            interpret=interpret, packed_tokens=mixed.packed_tokens, num_lse_slots=items.shape[0])
        out = (o, jnp.zeros((t, hq), jnp.float32))  # (lse: written by the classes below, never read)
    classes = _classes(t, s, num_cells, hq // hkv, mosaic_cells, mixed is not None)
    kw = dict(page_size=page_size, num_kv_heads=hkv, layout=kv_cache.layout, sm_scale=sm_scale,
              interpret=interpret, variant=variant, params=params or None)
    if classes[0].mosaic:  # the base: its rows through a sub-buffer and back by a gather + select
        from pallas_kernels import prefill_mosaic
        items, cell_indptr, src, pos = _mosaic_plan(
            kv_lens, cu_q_lens, distribution, row_seq, row_live, pages_per_seq=pages_per_seq, cls=classes[0],
            causal=causal, window_left=params.get("window_left"))
        o_sub, _, _ = prefill_mosaic.prefill_mosaic(
            queries[src], k_rows, v_rows, kv_indices, items, cell_indptr, ROW_ALIGN, causal=causal,
            block_kv=long_config.block_kv, max_concurrent_steps=long_config.max_concurrent_steps,
            q_pos=q_pos[src] if variant is not None else None, row_stores=True, persistent=True, **kw)
        mine = pos >= 0
        o = jnp.where(mine[:, None, None], o_sub[jnp.maximum(pos, 0)], jnp.zeros((), queries.dtype))
        out = (o, jnp.zeros((t, hq), jnp.float32))  # (lse: written by the classes below, never read)
        classes = classes[1:]
    # The Triton prefill class (the base when present) alone, then the decode classes together:
    # one plan, their partial states in one buffer, one merge.
    groups = [(c,) for c in classes if c.prefill] + [tuple(c for c in classes if not c.prefill)]
    kw.update(scales=scales)
    for group in filter(None, groups):
        sec, block_kv_lens = _plan(kv_lens, cu_q_lens, distribution, pages_per_seq=pages_per_seq, classes=group,
                                   causal=causal, window_left=params.get("window_left"), num_rows=t, taken=taken)
        part_cap = sum(c.part_cap for c in group)
        parts = None
        for k, cls in enumerate(group):
            if cls.prefill:  # (alone in its group)
                o, lse, *parts = prefill_kernels.prefill(
                    queries, k_rows, v_rows, kv_indices, sec["items"], sec["cell_indptr"], causal=causal,
                    rows=cls.rows, impl="triton", config=long_config, num_parts=part_cap,
                    q_pos=q_pos if variant is not None else None, **kw)
            else:  # a class after the base writes its unsplit blocks into the base's output, its
                # split ones into the group's partial buffer
                flat_out = None if cls.base else (out[0].reshape(t * hq, d), out[1].reshape(t * hq))
                o, lse, *parts = decode_kernels.paged_decode(
                    queries, k_rows, v_rows, kv_indices, block_kv_lens, sec["items"], sec["cell_indptr"],
                    cells=(k * cls.cells, cls.cells), columns=decode_kernels.MULTI_ITEM_COLUMNS,
                    tokens_per_item=cls.tokens_per_item, causal=causal and cls.max_q > 1, config=decode_config,
                    out=flat_out, num_parts=part_cap, parts=parts, **kw)
            out = (o.reshape(t, hq, d), lse.reshape(t, hq))
        out = merge_kernels.merge_varlen(
            parts[0].reshape(part_cap, hq, d), parts[1].reshape(part_cap, hq), sec["merge_indptr"],
            sec["merge_dest"], out=out, interpret=interpret, num_programs=MERGE_PROGRAMS,
            num_live=sec["merge_live"])
    # window and soft cap leave (o, lse) final (variants.finish is the identity on them). The
    # returned cache is tied to the output, so every kernel reading the written cache runs before
    # any later in-place write to it: without the tie XLA copied the whole K cache before the next
    # call's write (H100, q4 B64 kv4096, 10 chained calls: 852 -> 416 us per call).
    return jax.lax.optimization_barrier((out[0], new_cache))
