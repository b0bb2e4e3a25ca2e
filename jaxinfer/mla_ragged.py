"""mla_ragged_paged_attention: a whole MLA serving step (DeepSeek-V3/R1, Kimi K2: decode,
speculative verify, chunked prefill, prompts) in one jittable call, with the metadata of
jaxinfer.ragged_paged_attention / tpu-inference's ragged paged attention v3 and the argument
names of tpu-inference's `mla_ragged_paged_attention` (ql_nope, q_pe, new_kv_c, new_k_pe),
over the two latent caches of jaxinfer.BatchMLAPagedAttention (ckv, kpe: FlashInfer's).

The new tokens' latent rows are written into the caches (pallas_kernels.kv_write.write_rows, both
caches in one launch), then every (token, head) query row attends over its sequence's latent rows
with the MLA kernel (pallas_kernels.mla; jaxinfer.dispatch's mla row). The work list is planned on
the device (plan below: fixed capacities from the static shapes T, S, pages_per_seq), so there is
no host round trip and one compilation serves every composition of the same shapes. Split tiles'
partial states are merged by merge.merge_varlen over a fixed-capacity group list (num_live).
"""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import _backend, dispatch, ragged_plan
from jaxinfer.ragged import check_metadata
from jaxinfer.formats import check_kv_dtype, check_power_of_two, check_q, check_scale
from jaxinfer.ragged_plan import excl_cumsum, owner
from pallas_kernels import merge as merge_kernels
from pallas_kernels import mla as mla_kernels
from pallas_kernels.kv_write import write_rows
from planner import mla as mla_planner
from planner.work_items import MLA

ITEM_COST = 64  # an item's fixed cost in keys (cell balance; the host planner's item_cost)
WAVE_GRID = 64  # candidates per grid of wave_chunk's search
WAVE_SLACK = 1.125  # a wave's longest item may cost this many cells' shares (it needs fewer merges)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLASizes:
    """The static sizes of a step's device plan (a function of T, H, S and the config alone)."""
    block_rows: int  # (token, head) query rows per tile
    block_kv: int    # the kernel's keys per block: chunks are multiples of it
    min_chunk: int   # no tile's keys are split into chunks shorter than this (a multiple of block_kv)
    cells: int       # the kernel's grid
    tiles: int       # tile capacity: ceil(T H / block_rows) + S + 1 (padding rows' tiles included)
    items: int       # item capacity: tiles + cells (pieces of cut tiles)
    parts: int       # partial-state rows: 2 x cells x block_rows
    groups: int      # merge groups: one per row of a split tile (cells x block_rows),
                     # or per split tile with tile_merge (cells)
    tile_merge: bool = False  # split tiles' partial rows chunk by chunk, merged whole (the Mosaic kernel)


def tile_rows(num_tokens, num_heads, num_seqs, config):
    """The tiles' rows for T / S tokens per sequence (planner.mla.block_rows_for, as the host
    wrapper's under capacities) unless config.block_rows."""
    return config.block_rows or mla_planner.block_rows_for(num_heads, max(1, num_tokens // num_seqs))


def sizes(num_tokens, num_heads, num_seqs, config, num_cells, implementation=None):
    """MLASizes for implementation (an mla row; default the Triton kernel's), by
    dispatch.mla_tiling of tile_rows; cells: num_cells, else the row's.

    Bounds: a sequence's rows make ceil(rows / M) <= rows / M + 1 tiles, the padding rows one more
    run, so at most ceil(T H / M) + S + 1 tiles. One wave holds at most `cells` items. The
    balanced cut adds a piece for each of the cells - 1 share boundaries that falls inside a tile:
    at most tiles + cells items; a split tile of k boundaries has k + 1 <= 2k pieces, so at most
    2 x cells chunks of M partial rows and fewer than `cells` split tiles."""
    implementation = implementation or dispatch.IMPLEMENTATIONS_BY_NAME["mla_triton"]
    tiling = dispatch.mla_tiling(implementation, config, _backend.num_sms(),
                                 tile_rows(num_tokens, num_heads, num_seqs, config))
    block_rows, block_kv, cells = tiling.block_rows, tiling.block_kv, int(num_cells or tiling.num_cells)
    tiles = -(-num_tokens * num_heads // block_rows) + num_seqs + 1
    min_chunk = max(-(-int(config.min_chunk) // block_kv), 1) * block_kv
    return MLASizes(block_rows=block_rows, block_kv=block_kv, min_chunk=min_chunk, cells=cells, tiles=tiles,
                    items=tiles + cells, parts=2 * cells * block_rows,
                    groups=cells * (1 if tiling.tile_merge else block_rows), tile_merge=tiling.tile_merge)


def wave_chunk(kv_hi, live, sz):
    """One wave (planner.mla.chunk_keys'): the least chunk L (a multiple of block_kv, at least
    min_chunk) whose even chunks of the live tiles (a prefix; kv_hi keys each) fit the cells,
    searched on two grids of WAVE_GRID steps between keys / cells and the longest tile (exact up
    to range / WAVE_GRID^2 keys). Meaningful when the live tiles fit the cells."""
    bk, cells = sz.block_kv, sz.cells

    def up(x):
        return jnp.maximum(-(-x // bk) * bk, sz.min_chunk)

    head, head_live = kv_hi[:cells], live[:cells]  # (one wave: the live tiles are among these)

    def fits(cand):  # [G + 1] -> whether the live tiles cut in chunks of at most cand keys fit the cells
        chunks = jnp.where(head_live[None, :], jnp.maximum(-(-head[None, :] // cand[:, None]), 1), 0)
        return jnp.sum(chunks, axis=1) <= cells

    lo, hi = up(-(-jnp.sum(kv_hi) // cells)), up(jnp.max(kv_hi))  # no L under lo fits; hi fits when the tiles do
    j = jnp.arange(WAVE_GRID + 1, dtype=kv_hi.dtype)
    coarse = lo + (hi - lo) // bk * j // WAVE_GRID * bk  # [G + 1] from lo to hi
    first = jnp.argmax(fits(coarse))
    a, b = coarse[jnp.maximum(first - 1, 0)], coarse[first]  # the least fitting L is in (a, b]
    fine = a + (b - a) // bk * j // WAVE_GRID * bk
    return jnp.min(jnp.where(fits(fine), fine, b))


class _Quota:
    """N equal shares of W cost units: share c is [start(c), start(c + 1)), the first W % N one
    unit more (int32 throughout: no product of W and N)."""

    def __init__(self, total, shares):
        self.q, self.r = total // shares, total % shares

    def start(self, c):
        return c * self.q + jnp.minimum(c, self.r)

    def cell(self, x):
        """The share holding unit x (0 <= x < W): its cell."""
        big = self.r * (self.q + 1)
        return jnp.where(x < big, x // (self.q + 1), self.r + (x - big) // jnp.maximum(self.q, 1))


def plan(kv_lens, cu_q_lens, distribution, *, num_tokens, num_heads, pages_per_seq, causal, sz):
    """The device plan (all int32 jnp, fixed shapes): tiles of sz.block_rows (token, head) rows of
    each valid sequence (q / o viewed as [T * H, D], token-major), then of the padding rows
    (cu_q_lens[distribution[2]] * H to T * H: no key, o = 0), each against the keys it can see
    (causal: up to its last token's diagonal). Two ways to cut the keys, items in tile order:
    - one wave, where the tiles fit the cells: even chunks of at most wave_chunk's L keys, each item
      a cell of its own (as the host planner's);
    - balanced: the tiles' KV blocks, each tile ITEM_COST keys more, laid end to end and cut into
      equal shares (_Quota), one a cell (fewer where a share would be under min_chunk); a share
      boundary inside a tile's blocks cuts it there, so each cell's items cost its share give or
      take a block and an item, whatever the lengths.
    The wave is taken where its longest item costs at most WAVE_SLACK shares: it needs fewer
    partial states and merges. Kernel columns: planner.work_items.MLA.

    Returns dict(items [sz.items, 9], cell_indptr [cells + 1], merge_indptr [groups + 1],
    merge_dest [groups], num_groups (0-d: groups past it are not merged))."""
    s = kv_lens.shape[0]
    h, m, bk = num_heads, sz.block_rows, sz.block_kv
    valid = jnp.arange(s) < distribution[2]
    q_len = jnp.where(valid, jnp.maximum(cu_q_lens[1:] - cu_q_lens[:-1], 0), 0)  # [S]
    kv = jnp.where(valid, kv_lens, 0)

    # Tiles: sequence i's ceil(q_len H / M), then the padding rows' (sequence S: no key, no page).
    pad_start = cu_q_lens[distribution[2]]
    rows_x = jnp.concatenate([q_len, jnp.maximum(num_tokens - pad_start, 0)[None]]) * h  # [S + 1]
    start_x = jnp.concatenate([cu_q_lens[:s], pad_start[None]]) * h
    qlen_x = jnp.concatenate([q_len, jnp.zeros((1,), jnp.int32)])
    kv_x = jnp.concatenate([kv, jnp.zeros((1,), jnp.int32)])
    tseq, j, t_ok = owner(-(-rows_x // m), sz.tiles)  # [tiles]
    row_start = j * m
    rows = jnp.where(t_ok, jnp.minimum(m, rows_x[tseq] - row_start), 0)
    first_pos = kv_x[tseq] - qlen_x[tseq]
    kv_hi = kv_x[tseq]
    if causal:  # the tile's last token's keys
        kv_hi = jnp.clip(first_pos + (row_start + jnp.maximum(rows, 1) - 1) // h + 1, 0, kv_hi)
    kv_hi = jnp.where(t_ok, kv_hi, 0)

    # One wave: tiles cut evenly in chunks of at most L keys (multiples of block_kv), an item a cell.
    chunk = wave_chunk(kv_hi, t_ok, sz)
    wave_n = jnp.where(t_ok, jnp.maximum(-(-kv_hi // chunk), 1), 0)
    size = -(-(-(-kv_hi // jnp.maximum(wave_n, 1))) // bk) * bk
    # Balanced: the tiles' blocks (each tile ITEM_COST more) laid end to end and cut into the cells'
    # equal shares; a share's boundary inside a tile's blocks cuts the tile there.
    c0 = max(ITEM_COST // bk, 1)
    nb = -(-kv_hi // bk)  # [tiles] blocks
    cost = jnp.where(t_ok, nb + c0, 0)
    first_unit = excl_cumsum(cost)  # [tiles]
    shares = jnp.clip(jnp.sum(cost) // (sz.min_chunk // bk), 1, sz.cells)  # (no share under min_chunk)
    quota = _Quota(jnp.sum(cost), shares)
    blocks_at = first_unit + c0  # the tile's first block's unit
    cut0 = quota.cell(blocks_at)  # boundaries c > cut0 lie past the tile's first block
    last = jnp.minimum(quota.cell(first_unit + cost - 1), shares - 1)
    bal_n = jnp.where(t_ok, 1 + jnp.where(nb > 1, jnp.maximum(last - cut0, 0), 0), 0)
    # The wave where its longest item costs at most WAVE_SLACK x a share (no merges; even chunks).
    share = -(-jnp.sum(cost) // shares) * bk + ITEM_COST
    wave = (jnp.sum(t_ok) <= sz.cells) & (chunk + ITEM_COST <= WAVE_SLACK * share)
    n_chunks = jnp.where(wave, wave_n, bal_n)
    split = n_chunks > 1
    part_rows = jnp.where(split, n_chunks * m, 0)
    part_base = excl_cumsum(part_rows)  # split tile g: rows [base_g, base_g + M k_g)

    tile, piece, i_ok = owner(n_chunks, sz.items)  # [items]
    lo_cut = jnp.where(piece == 0, 0, quota.start(cut0[tile] + piece) - blocks_at[tile])
    hi_cut = jnp.where(piece == n_chunks[tile] - 1, nb[tile], quota.start(cut0[tile] + piece + 1) - blocks_at[tile])
    kv_start = jnp.where(wave, piece * size[tile], lo_cut * bk)
    kv_end = jnp.where(wave, kv_start + size[tile], hi_cut * bk)
    kv_start, kv_end = jnp.minimum(kv_start, kv_hi[tile]), jnp.minimum(kv_end, kv_hi[tile])
    bal_cell = jnp.minimum(cut0[tile] + piece, shares - 1)  # piece 0: the share of the tile's first block
    cell_of = jnp.where(i_ok, jnp.where(wave, jnp.arange(sz.items), bal_cell), sz.cells)
    zero = jnp.zeros_like(tile)
    cols = MLA.ordered(
        page_base=jnp.minimum(tseq[tile], s - 1) * pages_per_seq, q_row=start_x[tseq[tile]] + row_start[tile],
        rows=jnp.where(i_ok, rows[tile], 0), row_start=row_start[tile], first_pos=first_pos[tile],
        kv_start=jnp.where(i_ok, kv_start, 0), kv_end=jnp.where(i_ok, kv_end, 0),
        # row r of chunk i: base_g + i M + r (tile_merge), else base_g + r k_g + i (row r's k_g consecutive)
        part_base=jnp.where(i_ok & split[tile], part_base[tile] + (piece * m if sz.tile_merge else piece), -1),
        part_stride=(zero + 1) if sz.tile_merge else n_chunks[tile] + zero)
    items = jnp.stack(cols, axis=1).astype(jnp.int32)

    cell_indptr = jnp.searchsorted(cell_of, jnp.arange(sz.cells + 1, dtype=cell_of.dtype), side="left",
                                   method="compare_all").astype(jnp.int32)

    if sz.tile_merge:  # merge groups: split tile g whole, parts [base_g / M, base_g / M + k_g) of whole tiles
        gt, _, g_ok = owner(split.astype(jnp.int32), sz.groups)
        merge_end = jnp.where(g_ok, (part_base[gt] + part_rows[gt]) // m, jnp.sum(part_rows) // m)
        merge_dest = jnp.where(g_ok, (start_x[tseq[gt]] + row_start[gt]) // m, -1)
        num_groups = jnp.sum(split.astype(jnp.int32))
    else:  # row r of split tile g merges parts [base_g + r k_g, base_g + (r + 1) k_g)
        gt, r, g_ok = owner(jnp.where(split, m, 0), sz.groups)
        merge_end = jnp.where(g_ok, part_base[gt] + (r + 1) * n_chunks[gt], jnp.sum(part_rows))
        merge_dest = jnp.where(g_ok & (r < rows[gt]), start_x[tseq[gt]] + row_start[gt] + r, -1)
        num_groups = jnp.sum(jnp.where(split, m, 0))
    merge_indptr = jnp.concatenate([jnp.zeros((1,), jnp.int32), merge_end.astype(jnp.int32)])
    return dict(items=items, cell_indptr=cell_indptr, merge_indptr=merge_indptr,
                merge_dest=merge_dest.astype(jnp.int32),
                num_groups=jnp.minimum(num_groups, sz.groups).astype(jnp.int32))


def _check(ql_nope, q_pe, new_kv_c, new_k_pe, ckv_cache, kpe_cache, kv_lens, page_indices, cu_q_lens,
           distribution, implementation):
    args = dict(ql_nope=ql_nope, q_pe=q_pe, new_kv_c=new_kv_c, new_k_pe=new_k_pe, ckv_cache=ckv_cache,
                kpe_cache=kpe_cache)
    for name, x in args.items():
        if not hasattr(x, "dtype") or not hasattr(x, "shape"):
            raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    check_q(ql_nope, "ql_nope")
    if ql_nope.ndim != 3:
        raise ValueError(f"ql_nope must be [T, H, Dc], got shape {tuple(ql_nope.shape)}")
    t, h, dc = ql_nope.shape
    if q_pe.dtype != ql_nope.dtype:
        raise ValueError(f"q_pe dtype {q_pe.dtype} must match ql_nope's {ql_nope.dtype}")
    if q_pe.ndim != 3 or tuple(q_pe.shape[:2]) != (t, h):
        raise ValueError(f"q_pe must have shape [T={t}, H={h}, Dr], got {tuple(q_pe.shape)}")
    dr = q_pe.shape[2]
    check_power_of_two("ql_nope's width (Dc)", dc)
    check_power_of_two("q_pe's width (Dr)", dr)
    for name, x, d in (("ckv_cache", ckv_cache, dc), ("kpe_cache", kpe_cache, dr)):
        if x.ndim != 3 or x.shape[2] != d:
            raise ValueError(f"{name} must have shape [num_pages, page_size, {d}], got {tuple(x.shape)}")
    if tuple(kpe_cache.shape[:2]) != tuple(ckv_cache.shape[:2]):
        raise ValueError(f"kpe_cache [num_pages, page_size] = {tuple(kpe_cache.shape[:2])} must match "
                         f"ckv_cache's {tuple(ckv_cache.shape[:2])}")
    if ckv_cache.shape[0] < 1 or ckv_cache.shape[1] < 1:
        raise ValueError(f"ckv_cache must have pages and slots, got shape {tuple(ckv_cache.shape)}")
    check_kv_dtype(ql_nope.dtype, ckv_cache.dtype, "ckv_cache")
    if kpe_cache.dtype != ckv_cache.dtype:
        raise ValueError(f"kpe_cache dtype {kpe_cache.dtype} must match ckv_cache's {ckv_cache.dtype}")
    why = implementation.dtypes_unsupported(ql_nope.dtype, ckv_cache.dtype)
    if why is not None:
        raise ValueError(f"ckv_cache: {why}")
    for name, x, d in (("new_kv_c", new_kv_c, dc), ("new_k_pe", new_k_pe, dr)):
        if tuple(x.shape) != (t, d):
            raise ValueError(f"{name} must have shape {(t, d)}, got {tuple(x.shape)}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be a float array, got {x.dtype}")
    check_metadata(kv_lens, page_indices, cu_q_lens, distribution, num_tokens=t, num_pages=ckv_cache.shape[0],
                   page_size=ckv_cache.shape[1])


def mla_ragged_paged_attention(ql_nope, q_pe, new_kv_c, new_k_pe, ckv_cache, kpe_cache, kv_lens, page_indices,
                               cu_q_lens, distribution, *, sm_scale, causal=True, ckv_scale=None, kpe_scale=None,
                               num_cells=None, backend=None, config=None, impl="auto"):
    """One MLA serving step: writes the new latent rows, then MLA over the paged latent caches.

        ql_nope       [T, H, Dc]  q's no-rope part absorbed into the latent space (W_UK folded in)
        q_pe          [T, H, Dr]  q's rope part
        new_kv_c      [T, Dc]     the step's new latent rows (compressed kv), row-aligned with q
        new_k_pe      [T, Dr]     the step's new rope keys
        ckv_cache     [P, page_size, Dc]  latent cache (also the values)
        kpe_cache     [P, page_size, Dr]  rope-key cache, same pages and slots
        kv_lens       i32[S]      tokens of each sequence after this step (new ones included)
        page_indices  i32[S * pages_per_seq]  sequence s's pages from s * pages_per_seq
        cu_q_lens     i32[S + 1]  sequence s's q rows cu_q_lens[s]:cu_q_lens[s + 1]
        distribution  i32[3]      (decode_end, prefill_end, num_seqs): sequences < distribution[2]
                                  are valid, those < distribution[0] have q_len 1

    Sequence s < distribution[2] writes new_kv_c / new_k_pe[cu_q_lens[s] + i] at token position
    kv_lens[s] - q_len + i (cast to the cache dtype, not rescaled: an fp8 cache's rows are given
    already divided by their scale), then its q rows attend over its kv_lens[s] tokens:
    logits = sm_scale (ql_nope ckv + q_pe kpe), o = softmax(logits) ckv, causal bottom-right if
    causal. Rows from cu_q_lens[distribution[2]] on are padding: they write nothing and give o = 0.
    Dc and Dr: powers of two >= 16 (DeepSeek-V3: 512 and 64).

    sm_scale: a static positive float (required: MLA's is 1 / sqrt(qk_nope + qk_rope head dims)
    times any YaRN mscale^2). ckv_scale, kpe_scale: fp8 caches' dequantization scales (positive
    scalars or 0-d arrays, data; default 1), as BatchMLAPagedAttention.run's. num_cells: the
    kernel's grid (default: two per SM for tiles of up to 16 rows, else one; MLAConfig.cells);
    config: an MLAConfig (block_rows, block_kv, min_chunk, ...); backend: as the wrappers'. impl:
    "auto" (jaxinfer.dispatch's mla row for these shapes and dtypes: on Hopper the Mosaic kernel
    where page_size is a multiple of 32, the caches 16-bit and H a multiple of 64, or 16 or 32
    with T = S: tiles of one token, else Triton), "mosaic" or "triton".

    Returns (o [T, H, Dc] in ql_nope's dtype, ckv_cache, kpe_cache (updated)). Metadata are checked
    when concrete; under jax.jit (one compilation for every composition of the same shapes; donate
    the caches for an in-place write) inputs that break the contract give undefined results, but
    every read and write stays inside the arrays.
    """
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float, np.floating)) or not (
            math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale must be a positive finite float, got {sm_scale!r}")
    config = mla_kernels.MLAConfig() if config is None else config
    if not isinstance(config, mla_kernels.MLAConfig):
        raise ValueError(f"config must be an MLAConfig, got {type(config).__name__}")
    if config.block_kv is not None:
        check_power_of_two("config.block_kv", config.block_kv)
    if config.block_rows is not None:
        check_power_of_two("config.block_rows", config.block_rows)
    if num_cells is not None and (isinstance(num_cells, bool) or not isinstance(num_cells, (int, np.integer))
                                  or num_cells < 1):
        raise ValueError(f"num_cells must be a positive int or None, got {num_cells!r}")
    interpret = _backend.use_interpret(backend)
    head_dims = (getattr(ql_nope, "shape", (0,))[-1] or 0) + (getattr(q_pe, "shape", (0,))[-1] or 0)
    page_size = ckv_cache.shape[1] if getattr(ckv_cache, "ndim", 0) == 3 else 1
    num_heads = ql_nope.shape[1] if getattr(ql_nope, "ndim", 0) == 3 else 1
    dc = getattr(ql_nope, "shape", (0,))[-1] or 0
    problem = dispatch.Problem("mla", num_heads, 1, head_dims, "paged", page_size, interpret=interpret,
                               head_dim_vo=dc)
    dtypes = (getattr(ql_nope, "dtype", None), getattr(ckv_cache, "dtype", None))
    rows = dispatch.candidates(problem, impl)
    taking = tuple(i for i in rows if None in dtypes or i.dtypes_unsupported(*dtypes) is None)
    # (no row takes the dtypes: the last one's check below names them)
    num_tokens = ql_nope.shape[0] if getattr(ql_nope, "ndim", 0) == 3 else 1  # (_check below names bad shapes)
    num_seqs = max(kv_lens.shape[0], 1) if getattr(kv_lens, "ndim", 0) == 1 else 1
    implementation = dispatch.choose(problem, None, None, causal, rows=taking or rows[-1:], fixed_shapes=True,
                                     tile_rows=tile_rows(num_tokens, num_heads, num_seqs, config))
    _check(ql_nope, q_pe, new_kv_c, new_k_pe, ckv_cache, kpe_cache, kv_lens, page_indices, cu_q_lens,
           distribution, implementation)
    ckv_scale, kpe_scale = check_scale("ckv_scale", ckv_scale), check_scale("kpe_scale", kpe_scale)
    scales = None
    if ckv_scale is not None or kpe_scale is not None:  # f32[2]; a missing one is 1
        scales = jnp.stack([jnp.float32(1.0) if x is None else x for x in (ckv_scale, kpe_scale)])
    t, h, _ = ql_nope.shape
    sz = sizes(t, h, kv_lens.shape[0], config, num_cells, implementation)
    return _run(ql_nope, q_pe, new_kv_c, new_k_pe, ckv_cache, kpe_cache, kv_lens, page_indices, cu_q_lens,
                distribution, scales, sm_scale=float(sm_scale), causal=causal, sz=sz, interpret=interpret,
                config=config, kernel=implementation.kernel)


@functools.partial(jax.jit, static_argnames=("sm_scale", "causal", "sz", "interpret", "config", "kernel"))
def _run(ql_nope, q_pe, new_kv_c, new_k_pe, ckv_cache, kpe_cache, kv_lens, page_indices, cu_q_lens, distribution,
         scales, *, sm_scale, causal, sz, interpret, config, kernel):
    """mla_ragged_paged_attention after its checks (scales: f32[2] or None)."""
    t, h, dc = ql_nope.shape
    dr = q_pe.shape[2]
    num_pages, page_size = ckv_cache.shape[:2]
    s = kv_lens.shape[0]
    pages_per_seq = page_indices.shape[0] // s
    # Traced metadata are not checked; clipped, every read and write stays inside the arrays.
    kv_lens = jnp.clip(kv_lens, 0, pages_per_seq * page_size)
    cu_q_lens = jnp.clip(cu_q_lens, 0, t)
    distribution = jnp.clip(distribution, 0, s)

    # The write: row i to cache row page * page_size + slot; padding rows past the cache (dropped).
    row_seq, row_live = ragged_plan.row_seqs(cu_q_lens, distribution, t)
    page, slot, _ = ragged_plan.token_slots(kv_lens, cu_q_lens, page_indices, row_seq, row_live,
                                            pages_per_seq=pages_per_seq, page_size=page_size, num_pages=num_pages)
    page = jnp.where((page >= 0) & (page < num_pages), page, num_pages)  # (a bad page id: dropped)
    ckv_rows, kpe_rows = write_rows(ckv_cache.reshape(-1, dc), kpe_cache.reshape(-1, dr),
                                    page * page_size + slot, new_kv_c, new_k_pe, interpret=interpret)

    sec = plan(kv_lens, cu_q_lens, distribution, num_tokens=t, num_heads=h, pages_per_seq=pages_per_seq,
               causal=causal, sz=sz)
    kv_indices = jnp.clip(page_indices, 0, num_pages - 1)
    o, lse, o_part, lse_part = kernel(
        ql_nope.reshape(t * h, dc), q_pe.reshape(t * h, dr), ckv_rows, kpe_rows, kv_indices, sec["items"],
        sec["cell_indptr"], columns=mla_planner.COLUMNS, num_parts=sz.parts, num_heads=h, page_size=page_size,
        sm_scale=sm_scale, causal=causal, block_rows=sz.block_rows, interpret=interpret,
        config=config, scales=scales)
    m = sz.block_rows if sz.tile_merge else 1  # rows merged together (whole tiles: M)
    o, _ = merge_kernels.merge_varlen(
        o_part.reshape(-1, m, dc), lse_part.reshape(-1, m), sec["merge_indptr"], sec["merge_dest"],
        out=(o.reshape(-1, m, dc), lse.reshape(-1, m)), interpret=interpret,
        num_programs=min(sz.groups, 4 * sz.cells), num_live=sec["num_groups"])
    new_ckv, new_kpe = ckv_rows.reshape(ckv_cache.shape), kpe_rows.reshape(kpe_cache.shape)
    # The returned caches are tied to the output: every read of the written caches runs before a
    # later in-place write to them (as ragged_paged_attention's).
    return jax.lax.optimization_barrier((o.reshape(t, h, dc), new_ckv, new_kpe))

