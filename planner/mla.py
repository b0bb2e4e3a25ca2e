"""MLA plan: tiles of (token, head) query rows x KV chunks, balanced over cells, one packed buffer.

Request b's query rows are its qo_len x num_heads (token, head) pairs, token-major; they are cut
into tiles of block_rows rows. Each tile meets the request's keys it can see (causal:
up to its last token's diagonal), cut into even chunks where that exceeds L (chunk_keys: one
wave over the cells, or Algorithm 1's L = ceil(all keys / cells)); where the tiles fit the cells
but one wave's longest item would cost over WAVE_SLACK cells' shares (skewed lengths), the tiles'
blocks are cut into the cells' equal shares instead (balanced_cut). The chunks of a tile
write partial states, merged row by row (merge_indptr / merge_dest). With max_batch_size,
max_num_tokens and max_num_pages every plan has one layout, so run() compiles once.
"""
import dataclasses
from functools import lru_cache

import numpy as np

from planner import scheduler, validate
from planner.packing import PackedLayout, new_buffer
from planner.work_items import MLA


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkItem:
    """One work item: a tile of a request's query rows against one chunk of its keys. The fields
    are the columns of the plan's int32 items array, in this order (planner.work_items.MLA)."""
    page_base: int    # the request's first entry in kv_indices
    q_row: int        # the tile's first row of q / o viewed as [T * H, D]
    rows: int         # rows of the tile (<= block_rows); the rest are padding
    row_start: int    # the tile's first row within its request (token = row // num_heads)
    first_pos: int    # position of the request's first query token (kv_len - qo_len; causal)
    kv_start: int     # keys [kv_start, kv_end) of the request
    kv_end: int
    part_base: int    # -1: the item writes o / lse; else row r's partial state is row
    part_stride: int  # part_base + r * part_stride of the partial buffers


COLUMNS = MLA.names  # WorkItem's fields, in order
_COL = {name: i for i, name in enumerate(COLUMNS)}


def work_items(items):
    """The rows of an items array (int32[n, len(COLUMNS)]) as WorkItems."""
    return tuple(WorkItem(**dict(zip(COLUMNS, map(int, row)))) for row in np.asarray(items))


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLALayout(PackedLayout):
    """Static sizes of the packed plan buffer; hashable, part of the jit cache key."""
    num_heads: int
    block_rows: int   # query rows per tile
    num_tokens: int   # rows of q (T); q / o viewed as [T * num_heads, D]
    index_cap: int    # entries of kv_indices
    num_cells: int    # grid
    item_cap: int     # work items
    part_cap: int     # partial-state rows
    group_cap: int    # merge groups (one per row of a split tile, or per split tile with tile_merge)
    tile_merge: bool = False  # split tiles' partial rows chunk by chunk, merged by whole tiles

    def sections(self):
        """(name, size) of each int32 section, in buffer order."""
        return (("kv_indices", self.index_cap), ("items", self.item_cap * len(COLUMNS)),
                ("cell_indptr", self.num_cells + 1), ("merge_indptr", self.group_cap + 1),
                ("merge_dest", self.group_cap), ("num_groups", 1))

    def named(self, parts):
        """{name: section} of the sections given in sections() order (items int32[item_cap, len(COLUMNS)])."""
        out = dict(zip(self.offsets, parts))
        out["items"] = out["items"].reshape(-1, len(COLUMNS))
        return out


@lru_cache(maxsize=64)
def fixed_layout(*, num_heads, block_rows, num_tokens, batch, index_cap, num_cells, tile_merge=False):
    """The layout of every plan under capacities. Bounds: tiles <= ceil(T H / M) + B + 1 (padding
    included); Algorithm 1's chunk L >= keys / cells adds at most `cells` items, splits fewer than
    `cells` tiles into at most 2 keys / L chunks each; balanced_cut adds a piece per share
    boundary inside a tile (fewer than `cells`), a split tile's k boundaries making k + 1 <= 2k."""
    tiles = -(-num_tokens * num_heads // block_rows) + batch + 1
    return MLALayout(num_heads=num_heads, block_rows=block_rows, num_tokens=num_tokens, index_cap=index_cap,
                     num_cells=num_cells, item_cap=tiles + num_cells, part_cap=2 * num_cells * block_rows,
                     group_cap=num_cells * (1 if tile_merge else block_rows), tile_merge=tile_merge)


def block_rows_for(num_heads, max_qo_len, cap=64):
    """Tile rows: the query rows of the longest request, a power of two in [16, cap]."""
    return min(cap, max(16, 1 << (max(int(num_heads) * int(max_qo_len), 1) - 1).bit_length()))


def chunk_keys(kv_hi, num_cells, min_chunk, block_kv):
    """The chunk L (a multiple of block_kv, at least min_chunk) of tiles with kv_hi keys each.
    When every tile fits one cell unsplit, the least L whose chunks still fit one wave of
    num_cells (each item a cell of its own: no cell runs two); otherwise Algorithm 1's
    L = ceil(keys / cells), its items balanced longest first."""
    def up(x):
        return max(-(-int(x) // block_kv) * block_kv, -(-int(min_chunk) // block_kv) * block_kv, block_kv)

    lo = up(scheduler.chunk_for_total(int(kv_hi.sum()), num_cells))
    hi = up(kv_hi.max()) if kv_hi.shape[0] else lo
    if kv_hi.shape[0] > num_cells or hi <= lo:
        return lo
    while lo < hi:  # the least L in [lo, hi] with sum(ceil(kv_hi / L)) <= num_cells
        mid = (lo + hi) // 2 // block_kv * block_kv
        if np.sum(np.maximum(-(-kv_hi // mid), 1)) <= num_cells:
            hi = mid
        else:
            lo = mid + block_kv
    return lo


WAVE_SLACK = 1.125  # a wave's longest item may cost this many cells' balanced shares (it needs fewer merges)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cut:
    """Tiles cut into pieces by balanced_cut: the items in tile order, and so in cell order."""
    pieces: np.ndarray     # int64[tiles]: each tile's pieces (1: not split)
    item_tile: np.ndarray  # int64[items]: the item's tile
    piece: np.ndarray      # int64[items]: its index among its tile's pieces
    kv_start: np.ndarray   # int64[items]: its keys [kv_start, kv_end) of the tile's
    kv_end: np.ndarray
    cell: np.ndarray       # int64[items]: its cell (non-decreasing)
    share: int             # a cell's cost in keys (its share of blocks, plus an item's cost)


def balanced_cut(kv_hi, num_cells, block_kv, item_cost, min_chunk):
    """The tiles' KV blocks (kv_hi keys each), each tile item_cost keys more (at least a block),
    laid end to end and cut into equal shares, one a cell (fewer where a share would be under
    min_chunk keys): a share boundary inside a tile's blocks cuts the tile there. Returns a Cut."""
    c0 = max(int(item_cost) // block_kv, 1)
    nb = -(-kv_hi.astype(np.int64) // block_kv)
    cost = nb + c0
    first = np.cumsum(cost) - cost
    shares = int(np.clip(int(cost.sum()) // max(int(min_chunk) // block_kv, 1), 1, num_cells))
    q, r = divmod(int(cost.sum()), shares)  # share c starts at c q + min(c, r)

    def start(c):
        return c * q + np.minimum(c, r)

    def cell(x):  # the share holding unit x
        return np.where(x < r * (q + 1), x // (q + 1), r + (x - r * (q + 1)) // max(q, 1))

    blocks_at = first + c0
    cut0 = cell(blocks_at)  # share boundaries past cut0 cut the tile
    last = np.minimum(cell(first + cost - 1), shares - 1)
    pieces = 1 + np.where(nb > 1, np.maximum(last - cut0, 0), 0)
    item_tile = np.repeat(scheduler.arange(kv_hi.shape[0]), pieces)
    piece = scheduler.arange(item_tile.shape[0]) - (np.cumsum(pieces) - pieces)[item_tile]
    t_at, c = blocks_at[item_tile], cut0[item_tile] + piece
    lo = np.where(piece == 0, 0, start(c) - t_at)
    hi = np.where(piece == pieces[item_tile] - 1, nb[item_tile], start(c + 1) - t_at)
    kv_start = np.minimum(lo * block_kv, kv_hi[item_tile])
    kv_end = np.minimum(hi * block_kv, kv_hi[item_tile])
    return Cut(pieces=pieces, item_tile=item_tile, piece=piece, kv_start=kv_start, kv_end=kv_end,
               cell=np.minimum(c, shares - 1), share=(q + (r > 0)) * block_kv + int(item_cost))


def plan(qo_indptr, kv_indptr, kv_indices, kv_len, *, page_size, num_heads, num_cells, block_rows, causal,
         num_pages=None, max_batch_size=None, max_num_tokens=None, max_num_pages=None, block_kv=64,
         min_chunk=256, item_cost=64, tile_merge=False):
    """Builds the work list. Returns (layout, buffer int32[layout.size], info dict).

    qo_indptr, kv_indptr int32[B + 1], kv_indices int32[*], kv_len int32[B] (each at most its
    pages x page_size); num_pages: page ids must lie in [0, num_pages). item_cost: Algorithm 1's
    per-item cost in keys. Rows of q past qo_indptr[-1] (up to max_num_tokens) get items that
    write o = 0, lse = -inf. tile_merge (every request's rows, and the capacity's, whole tiles:
    tiles start at multiples of block_rows): a split tile's chunk i writes its rows to partial rows base + i M .. base +
    i M + M - 1, and merge group g is a whole split tile (o viewed as [T H / M, M, D]): parts
    merge_indptr[g] .. merge_indptr[g + 1] of the partial rows viewed as [parts / M, M, D], into
    row merge_dest[g].
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")
    if num_cells < 1:
        raise ValueError(f"num_cells must be >= 1, got {num_cells}")
    if block_rows < 1 or block_rows & (block_rows - 1):
        raise ValueError(f"block_rows must be a power of two, got {block_rows}")
    if block_kv < 1 or block_kv & (block_kv - 1):
        raise ValueError(f"block_kv must be a power of two, got {block_kv}")
    qo_indptr, qo_lens, _ = validate.indptr_lengths("qo_indptr", qo_indptr)
    kv_indptr, pages, _ = validate.indptr_lengths("kv_indptr", kv_indptr)
    kv_indices = validate.as_int32("kv_indices", kv_indices)
    kv_len = validate.as_int32("kv_len", kv_len)
    batch = pages.shape[0]
    if qo_lens.shape[0] != batch:
        raise ValueError(f"qo_indptr describes {qo_lens.shape[0]} requests, kv_indptr {batch}")
    if kv_len.shape[0] != batch:
        raise ValueError(f"kv_len must have shape [{batch}], got {kv_len.shape}")
    num_listed = int(kv_indptr[-1])
    if kv_indices.shape[0] < num_listed:
        raise ValueError(f"kv_indices has {kv_indices.shape[0]} entries but kv_indptr[-1] = {num_listed}")
    if batch and (kv_len.min() < 0 or np.any(kv_len.astype(np.int64) > pages.astype(np.int64) * page_size)):
        raise ValueError(f"kv_len must lie in [0, pages x page_size={page_size}] for each request")
    num_tokens = int(qo_indptr[-1])
    tcap = num_tokens if max_num_tokens is None else int(max_num_tokens)
    bcap = batch if max_batch_size is None else int(max_batch_size)
    icap = max(num_listed, 1) if max_num_pages is None else int(max_num_pages)
    if num_tokens > tcap:
        raise ValueError(f"qo_indptr holds {num_tokens} tokens, over max_num_tokens={tcap}")
    if batch > bcap:
        raise ValueError(f"kv_indptr describes {batch} requests, over max_batch_size={bcap}")
    if num_listed > icap:
        raise ValueError(f"kv_indices lists {num_listed} pages, over max_num_pages={icap}")

    h, m = int(num_heads), int(block_rows)
    if tile_merge and (np.any(qo_lens.astype(np.int64) * h % m) or tcap * h % m):
        raise ValueError(f"tile_merge needs whole tiles: every request's qo_len x num_heads ({h}) and "
                         f"max_num_tokens x num_heads a multiple of block_rows ({m})")
    # Tiles of the requests' rows, then padding tiles over rows T H .. T_cap H.
    req_rows = qo_lens.astype(np.int64) * h
    ntiles = -(-req_rows // m)
    req = np.repeat(scheduler.arange(batch), ntiles)
    first_tile = np.cumsum(ntiles) - ntiles
    row_start = (scheduler.arange(req.shape[0]) - first_tile[req]) * m
    pad_start = np.arange(num_tokens * h, tcap * h, m, dtype=np.int64)
    n_tiles = req.shape[0] + pad_start.shape[0]
    t = {name: np.zeros(n_tiles, np.int64) for name in ("page_base", "q_row", "rows", "row_start", "first_pos")}
    n_real = req.shape[0]
    t["page_base"][:n_real] = kv_indptr[req]
    t["q_row"][:n_real] = qo_indptr[req].astype(np.int64) * h + row_start
    t["q_row"][n_real:] = pad_start
    t["rows"][:n_real] = np.minimum(m, req_rows[req] - row_start)
    t["rows"][n_real:] = np.minimum(m, tcap * h - pad_start)
    t["row_start"][:n_real] = row_start
    t["first_pos"][:n_real] = kv_len[req].astype(np.int64) - qo_lens[req]
    kv_hi = np.zeros(n_tiles, np.int64)  # keys each tile sees: [0, kv_hi)
    kv_hi[:n_real] = kv_len[req]
    if causal:
        last_token = (row_start + t["rows"][:n_real] - 1) // h
        kv_hi[:n_real] = np.clip(t["first_pos"][:n_real] + last_token + 1, 0, kv_hi[:n_real])

    chunk = chunk_keys(kv_hi, num_cells, min_chunk, block_kv)
    balanced = None
    if 0 < n_tiles <= num_cells:  # one wave, unless its longest item costs over WAVE_SLACK balanced shares
        balanced = balanced_cut(kv_hi, num_cells, block_kv, item_cost, min_chunk)
        if chunk + item_cost <= WAVE_SLACK * balanced.share:
            balanced = None
    if balanced is None:
        nchunks = np.maximum(-(-kv_hi // chunk), 1)
        # A split tile's chunks are even (multiples of block_kv, each non-empty): no short remainder.
        size = -(-(-(-kv_hi // nchunks)) // block_kv) * block_kv
        item_tile = np.repeat(scheduler.arange(n_tiles), nchunks)
        piece = scheduler.arange(item_tile.shape[0]) - (np.cumsum(nchunks) - nchunks)[item_tile]
        kv_start = piece * size[item_tile]
        kv_end = np.minimum(kv_hi[item_tile], kv_start + size[item_tile])
    else:
        nchunks, item_tile, piece = balanced.pieces, balanced.item_tile, balanced.piece
        kv_start, kv_end = balanced.kv_start, balanced.kv_end
    split = nchunks > 1
    # Split tile g owns partial rows [base_g, base_g + M k_g): row r's k_g chunks are consecutive.
    part_rows = np.where(split, nchunks * m, 0)
    part_base = np.cumsum(part_rows) - part_rows
    n_items = item_tile.shape[0]

    if max_num_tokens is not None and max_batch_size is not None and max_num_pages is not None:
        layout = fixed_layout(num_heads=h, block_rows=m, num_tokens=tcap, batch=bcap, index_cap=icap,
                              num_cells=int(num_cells), tile_merge=tile_merge)
    else:
        layout = MLALayout(num_heads=h, block_rows=m, num_tokens=tcap, index_cap=icap, num_cells=int(num_cells),
                           item_cap=max(n_items, 1), part_cap=int(part_rows.sum()),
                           group_cap=int(np.count_nonzero(split)) * (1 if tile_merge else m), tile_merge=tile_merge)
    assert n_items <= layout.item_cap and int(part_rows.sum()) <= layout.part_cap

    buf = new_buffer(layout.size)
    buf[:] = 0
    sec = layout.unpack(buf)
    sec["kv_indices"][:num_listed] = kv_indices[:num_listed]
    if num_pages is not None:
        validate.check_page_ids(sec["kv_indices"][:num_listed], num_pages)
    work = np.zeros((n_items, len(COLUMNS)), np.int64)
    for name in ("page_base", "q_row", "rows", "row_start", "first_pos"):
        work[:, _COL[name]] = t[name][item_tile]
    work[:, _COL["kv_start"]] = kv_start
    work[:, _COL["kv_end"]] = kv_end
    if tile_merge:  # chunk i's rows at base + i M + r
        work[:, _COL["part_base"]] = np.where(split[item_tile], part_base[item_tile] + piece * m, -1)
        work[:, _COL["part_stride"]] = 1
    else:  # row r's chunks at base + r k + i
        work[:, _COL["part_base"]] = np.where(split[item_tile], part_base[item_tile] + piece, -1)
        work[:, _COL["part_stride"]] = nchunks[item_tile]
    if balanced is None:  # Algorithm 1's items (or one wave), longest first to the least loaded cell
        order, _ = scheduler.assign_cells(kv_end - kv_start + int(item_cost), layout.num_cells,
                                          out=sec["cell_indptr"])
        work = work[order]
    else:  # each piece's cell is its share's
        sec["cell_indptr"][:] = np.searchsorted(balanced.cell, scheduler.arange(layout.num_cells + 1), side="left")
    sec["items"][:n_items] = work

    tiles = np.flatnonzero(split)
    if tile_merge:  # merge groups: each split tile g, parts [base_g / M, base_g / M + k_g) of whole tiles
        starts, dest, end = part_base[tiles] // m, t["q_row"][tiles] // m, part_rows.sum() // m
    else:  # rows r of each split tile g, parts [base_g + r k_g, base_g + (r + 1) k_g)
        rows = scheduler.arange(m)
        starts = (part_base[tiles][:, None] + rows[None, :] * nchunks[tiles][:, None]).reshape(-1)
        dest = np.where(rows[None, :] < t["rows"][tiles][:, None], t["q_row"][tiles][:, None] + rows[None, :], -1)
        end = part_rows.sum()
    n_groups = starts.shape[0]
    if layout.group_cap:
        sec["merge_indptr"][:n_groups] = starts
        sec["merge_indptr"][n_groups:] = end
        sec["merge_dest"][:n_groups] = dest.reshape(-1)
        sec["merge_dest"][n_groups:] = -1
    sec["num_groups"][0] = n_groups
    info = dict(chunk=chunk if balanced is None else None, num_items=n_items, num_tiles=n_tiles, num_split=int(tiles.shape[0]),
                num_groups=n_groups, kv_len=kv_len)
    return layout, buf, info
