"""The loop-based planner the vectorized one replaced (loops, three validations): the oracle of
test_planner_equivalence.py, which checks that the vectorized planner makes bitwise identical plans.
Copied verbatim (function bodies) from planner/ and jaxinfer/cascade.py at commit 0d7f301;
plan_short from planner/batch.py at commit 0db9aa7; plan_mixed from planner/batch.py at commit 7ef3410
(its Algorithm 1 through assign_cells above, the same assignment)."""
import heapq

import numpy as np

from planner.batch import MixedLayout, ShortLayout
from planner.decode import DecodeLayout
from planner.packing import new_buffer
from planner.prefill import ROW_ALIGN, PrefillLayout, choose_tile_rows
from planner.work_items import DECODE, DECODE_MULTI, MIXED, PREFILL


def kv_chunk_size(kv_pages, num_cells, min_chunk_pages=1):
    """Algorithm 1, line 3: L_kv = ceil(sum of KV pages / #cells), at least min_chunk_pages."""
    total = int(np.sum(kv_pages))
    return max(int(min_chunk_pages), -(-total // max(num_cells, 1)), 1)


def assign_cells(costs, num_cells):
    """Assigns items (positive integer costs: alpha * l_q + beta * l_kv with alpha > 0) to
    cells, longest first, each to the least-loaded cell (a min-heap of cell loads).

    Ties break by item index, then by cell index, so the same costs always give
    the same assignment. Returns (order, cell_indptr): item ids listed cell by
    cell, and int32[num_cells + 1] offsets. A cell runs its items in item-id
    order (the work list's request order), not longest first: every request's
    items are spread over the cells, so cells running side by side work on the
    same requests and share their K/V in L2 (measured: prefill on H100).
    """
    costs = np.asarray(costs, np.int64)
    if costs.size and costs.min() <= 0:
        raise ValueError("costs must be positive")
    by_cost = np.argsort(-costs, kind="stable")
    sorted_costs = costs[by_cost].tolist()
    cell_of = list(range(min(len(sorted_costs), num_cells)))  # first items: empty cells, in index order
    if len(sorted_costs) > num_cells:
        # A heap entry packs (load, cell) into one int, load << bits | cell: ints compare
        # faster than tuples and order the same way, ties going to the lower cell.
        bits = max(num_cells - 1, 1).bit_length()
        heap = [(c << bits) | i for i, c in enumerate(sorted_costs[:num_cells])]
        heapq.heapify(heap)
        mask, replace, assign = (1 << bits) - 1, heapq.heapreplace, cell_of.append
        for c in sorted_costs[num_cells:]:
            top = heap[0]
            replace(heap, top + (c << bits))
            assign(top & mask)
    cell_of_item = np.empty(len(cell_of), np.int64)
    cell_of_item[by_cost] = cell_of
    order = np.argsort(cell_of_item, kind="stable")  # by cell, then by item id
    cell_indptr = np.zeros(num_cells + 1, np.int32)
    np.cumsum(np.bincount(cell_of_item, minlength=num_cells), out=cell_indptr[1:])
    return order, cell_indptr


def as_int32(name, x, ndim=1):
    """Returns x as a host int32 array; rejects other integer widths and floats."""
    arr = np.asarray(x)
    if arr.dtype != np.int32:
        raise ValueError(f"{name} must be int32, got {arr.dtype}")
    if arr.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {arr.shape}")
    return arr


def check_indptr(name, indptr, total=None):
    """indptr: int32[B+1], starts at 0, non-decreasing, ends at `total` if given."""
    indptr = as_int32(name, indptr)
    if indptr.shape[0] < 1:
        raise ValueError(f"{name} must have at least one entry (B+1), got shape {indptr.shape}")
    if indptr[0] != 0:
        raise ValueError(f"{name} must start at 0, got {int(indptr[0])}")
    if (indptr[1:] < indptr[:-1]).any():
        raise ValueError(f"{name} must be non-decreasing")
    if total is not None and int(indptr[-1]) != total:
        raise ValueError(f"{name}[-1] = {int(indptr[-1])} must equal {total}")
    return indptr


def check_page_table(kv_indptr, kv_indices, kv_last_page_len, page_size, num_pages=None):
    """Validates a CSR page table; returns (kv_indptr, kv_indices, kv_last_page_len, kv_lens, pages),
    pages being each request's page count."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    kv_indptr = check_indptr("kv_indptr", kv_indptr)
    kv_indices = as_int32("kv_indices", kv_indices)
    kv_last_page_len = as_int32("kv_last_page_len", kv_last_page_len)
    batch = kv_indptr.shape[0] - 1
    if kv_indices.shape[0] < kv_indptr[-1]:
        raise ValueError(
            f"kv_indices has {kv_indices.shape[0]} entries but kv_indptr[-1] = {int(kv_indptr[-1])}")
    if kv_last_page_len.shape[0] != batch:
        raise ValueError(f"kv_last_page_len must have shape [{batch}], got {kv_last_page_len.shape}")
    used = kv_indices[: kv_indptr[-1]]
    # One pass: as uint32, negative ids wrap past any page count.
    if num_pages is not None and used.size and used.view(np.uint32).max() >= num_pages:
        raise ValueError(f"kv_indices holds page ids outside [0, {num_pages})")
    pages = kv_indptr[1:] - kv_indptr[:-1]
    has_pages = pages > 0
    if ((kv_last_page_len < 1) | (kv_last_page_len > page_size))[has_pages].any():
        raise ValueError(f"kv_last_page_len must lie in [1, page_size={page_size}] for requests with pages")
    kv_lens = np.where(has_pages, (pages - 1) * page_size + kv_last_page_len, 0).astype(np.int32)
    return kv_indptr, kv_indices, kv_last_page_len, kv_lens, pages


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
    kv_indptr, kv_indices, kv_last_page_len, kv_lens, pages = check_page_table(
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
        chunk = kv_chunk_size(pages, num_cells, -(-min_split_tokens // page_size))
    nchunks = np.maximum(-(-pages // chunk), 1)  # an empty request gets one (empty) item
    items = np.zeros((int(nchunks.sum()) + bcap - batch, DECODE.width), np.int64)
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

    order, cell_indptr = assign_cells(item_cost + items[:, 3] - items[:, 2], layout.num_cells)

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
    qo_indptr = check_indptr("qo_indptr", qo_indptr)
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
        chunk = kv_chunk_size(span, num_cells, min_split_tokens)
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

    items = np.zeros((tile_of.shape[0], PREFILL.width), np.int64)
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

    order, cell_indptr = assign_cells(item_cost * tpt + (kv_end - kv_start), layout.num_cells)

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


def shared_prefix_groups(kv_indptr, kv_indices, kv_last_page_len, page_size, min_shared_pages=1,
                         max_shared_pages=None):
    """Splits consecutive requests that begin with the same pages into (shared prefix, suffix).

    A group is a run of consecutive requests whose page lists share at least
    min_shared_pages leading pages that are full in every request (a partially
    filled last page is never shared). Request e joins a group of n requests
    sharing s pages when the common prefix s' it leaves satisfies
    n * s' > (n - 1) * s, i.e. when joining reads fewer pages in all than
    staying apart (a group of n with prefix s reads sum(pages) - (n - 1) * s).
    Returns a dict of host arrays:
      group_indptr int32[G+1]   requests of group g: group_indptr[g]:group_indptr[g+1]
      prefix_pages int32[G]     shared full pages of group g (0: no sharing)
    Each request's unique suffix is its page list past its group's prefix.
    """
    kv_indptr, kv_indices, kv_last_page_len, _, pages = check_page_table(
        kv_indptr, kv_indices, kv_last_page_len, page_size)
    batch = pages.shape[0]
    full = pages - (kv_last_page_len < page_size)  # leading pages that are full
    if max_shared_pages is not None:
        full = np.minimum(full, max_shared_pages)
    starts, prefix = [0], []
    b = 0
    while b < batch:
        shared = int(full[b])
        e = b + 1
        while e < batch and shared >= min_shared_pages:
            common = _common_prefix(kv_indices, kv_indptr, b, e, min(shared, int(full[e])))
            n = e - b
            if common < min_shared_pages or (n > 1 and n * common <= (n - 1) * shared):
                break
            shared, e = common, e + 1
        if e - b == 1:
            shared = 0
        prefix.append(shared)
        starts.append(e)
        b = e
    return dict(group_indptr=np.asarray(starts, np.int32), prefix_pages=np.asarray(prefix, np.int32))


def _common_prefix(kv_indices, kv_indptr, a, b, limit):
    """Number of equal leading page ids of requests a and b, at most limit."""
    x = kv_indices[kv_indptr[a]:kv_indptr[a] + limit]
    y = kv_indices[kv_indptr[b]:kv_indptr[b] + limit]
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else limit


def two_level_cascade(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size, *,
                      causal=True, min_shared_pages=1):
    """Shared prefixes detected from a plain page table (no index surgery by the user).

    Consecutive requests that begin with the same full pages form a group; level 0
    gives each group its shared pages, level 1 each request the rest of its pages.
    With causal, a page is shared only if it lies before all of the request's queries.
    Returns (levels, saved_pages): saved_pages = pages no longer read per step.
    """
    qo_indptr = check_indptr("qo_indptr", qo_indptr)
    kv_indptr, kv_indices, kv_last_page_len, kv_lens, pages = check_page_table(
        kv_indptr, kv_indices, kv_last_page_len, page_size)
    qo_lens = qo_indptr[1:] - qo_indptr[:-1]
    cap = (kv_lens - qo_lens) // page_size if causal else pages
    groups = shared_prefix_groups(kv_indptr, kv_indices, kv_last_page_len, page_size,
                                                 min_shared_pages, max_shared_pages=np.maximum(cap, 0))
    gi, shared = groups["group_indptr"], groups["prefix_pages"].astype(np.int64)
    first = kv_indptr[gi[:-1]]
    level0 = (
        qo_indptr[gi].astype(np.int32), np.concatenate([[0], np.cumsum(shared)]).astype(np.int32),
        np.concatenate([kv_indices[f:f + s] for f, s in zip(first, shared)] + [np.zeros(0, np.int32)]),
        np.full(len(shared), page_size, np.int32))
    skip = np.repeat(shared, np.diff(gi))  # each request's pages already in level 0
    suffix = pages - skip
    level1 = (
        qo_indptr, np.concatenate([[0], np.cumsum(suffix)]).astype(np.int32),
        np.concatenate([kv_indices[kv_indptr[b] + skip[b]:kv_indptr[b + 1]] for b in range(len(pages))]
                       + [np.zeros(0, np.int32)]),
        kv_last_page_len)
    saved = int(np.sum((np.diff(gi) - 1) * shared))
    return (level0, level1), saved


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
    chunk = kv_chunk_size(pages, num_cells, -(-min_split_tokens // page_size))
    nchunks = np.maximum(-(-pages // chunk), 1)
    split = nchunks > 1
    n_items = int(nchunks.sum())
    req = np.repeat(reqs, nchunks)
    local = np.repeat(np.arange(reqs.shape[0]), nchunks)
    chunk_idx = np.arange(n_items) - (np.cumsum(nchunks) - nchunks)[local]
    parts = np.where(split, nchunks * qo_lens[reqs], 0)  # partial rows of each request
    part_first = np.cumsum(parts) - parts
    items = np.zeros((n_items, DECODE_MULTI.width), np.int64)
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
    order, cell_indptr = assign_cells(
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
    info = dict(chunk_pages=chunk, num_items=n_items, num_short=int(reqs.shape[0]),
                num_long_tokens=int(long_rows.shape[0]), nnz=nnz)
    return layout, buf, info


def plan_mixed(qo_indptr, kv_lens, page_base, kv_indices, is_short, *, page_size, num_qo_heads, num_kv_heads,
               num_cells, tile_tokens, tokens_per_item, num_tokens, batch_cap, index_cap, causal,
               item_cost=256):
    """One persistent work list for a mixed step (pallas_kernels.prefill_mosaic, packed_tokens):
    each short request (is_short) is one packed tile per KV head over all its keys; each other
    request is query tiles of tile_tokens tokens per query head from its first row (the kernel
    reads and stores q / o rows at any start). KV is never split. Items go to cells longest
    first (Algorithm 1), costed in keys: a packed tile's keys or a query tile's visible keys,
    plus item_cost each. (Equal weights measured best on an H100: 320 µs traced on the mixed row
    against 332 with a query tile's key at twice a packed tile's.)

    Returns (layout, buffer, info). lse_src[n] (row n of q): a query-tile row's lse index for
    query head 0 (head h: + h * T); a packed row's for head 0 of its tile (head h: + (h // G) * T +
    h % G; these are the indices >= packed_slot0 * T); -1 for rows past the step."""
    group = num_qo_heads // num_kv_heads
    nnz = int(qo_indptr[-1])
    T = tile_tokens
    layout = MixedLayout.for_capacities(num_tokens, batch_cap, index_cap, num_cells, num_qo_heads, num_kv_heads, T,
                          tokens_per_item)
    qo_lens = (qo_indptr[1:] - qo_indptr[:-1]).astype(np.int64)  # [B]
    kv64 = kv_lens.astype(np.int64)
    short = np.flatnonzero(is_short & (qo_lens > 0))  # [S]
    long_ = np.flatnonzero(~is_short & (qo_lens > 0))  # [L]
    start_l, qo_l, kv_l = qo_indptr.take(long_).astype(np.int64), qo_lens.take(long_), kv64.take(long_)
    p_start, p_qo, p_kv = qo_indptr.take(short).astype(np.int64), qo_lens.take(short), kv64.take(short)

    # Query tiles of the long requests, tile_tok from each one's first row.
    ntiles = -(-qo_l // T)  # [L]
    num_tiles = int(ntiles.sum())
    if num_tiles > layout.tile_cap:
        raise ValueError("the step needs more query tiles than the plan holds")
    tile_req = np.repeat(np.arange(long_.shape[0]), ntiles)  # [tiles]: index into long_
    tile_first = np.cumsum(ntiles) - ntiles
    tile_tok = (np.arange(num_tiles) - tile_first.take(tile_req)) * T
    qo_t, kv_t = qo_l.take(tile_req), kv_l.take(tile_req)
    # Keys visible to the tile's last token (causal), else all of them.
    kv_hi = np.minimum(kv_t - qo_t + np.minimum(tile_tok + T, qo_t), kv_t) if causal else kv_t

    # Items: query tiles x query heads (slot tile * Hq + head), then packed tiles (slot
    # packed_slot0 + short index * Hkv + KV head).
    n_q, n_p = num_tiles * num_qo_heads, short.shape[0] * num_kv_heads
    items = np.zeros((n_q + n_p, MIXED.width), np.int32)
    q_items = items[:n_q].reshape(num_tiles, num_qo_heads, MIXED.width)
    q_items[:, :, 0] = start_l.take(tile_req)[:, None]
    q_items[:, :, 1] = tile_tok[:, None]
    q_items[:, :, 2] = qo_t[:, None]
    q_items[:, :, 3] = page_base.take(long_.take(tile_req))[:, None]
    q_items[:, :, 4] = kv_t[:, None]
    q_items[:, :, 6] = kv_hi[:, None]
    q_items[:, :, 7] = np.arange(num_qo_heads)
    q_items[:, :, 8] = np.arange(n_q).reshape(num_tiles, num_qo_heads)
    q_items[:, :, 12] = -1
    p_items = items[n_q:].reshape(short.shape[0], num_kv_heads, MIXED.width)
    p_items[:, :, 0] = p_start[:, None]
    p_items[:, :, 2] = p_qo[:, None]
    p_items[:, :, 3] = page_base.take(short)[:, None]
    p_items[:, :, 4] = p_kv[:, None]
    p_items[:, :, 6] = p_kv[:, None]
    p_items[:, :, 7] = np.arange(num_kv_heads)
    p_items[:, :, 8] = layout.packed_slot0 + np.arange(n_p).reshape(-1, num_kv_heads)
    p_items[:, :, 9] = 1
    p_items[:, :, 12] = -1
    costs = np.concatenate([np.repeat(kv_hi, num_qo_heads), np.repeat(p_kv, num_kv_heads)]) + item_cost
    order, cell_indptr = assign_cells(costs, layout.num_cells)
    # A cell runs its items by kind: even cells their query tiles first, odd cells their packed
    # tiles first, so about half the SMs stream K/V while the others compute (H100, the mixed
    # row in a chain of 10 calls: 328.6 -> 319.8 µs a launch; every cell tiles first, packed
    # first or longest first: 328.6, 339.3, 339.2).
    cell = np.repeat(np.arange(layout.num_cells), np.diff(cell_indptr))  # [items]: by position
    key = cell * 2 + ((order >= n_q) ^ (cell & 1))
    order = order.take(key.astype(np.int16 if layout.num_cells < 1 << 14 else np.int64).argsort(kind="stable"))

    buf = new_buffer(layout.size)
    buf[:] = 0
    (i0, _), (t0, _), (c0, c1), (s0, s1) = (layout.offsets[name] for name in (
        "kv_indices", "items", "cell_indptr", "lse_src"))
    buf[i0:i0 + kv_indices.shape[0]] = kv_indices
    items.take(order, axis=0, out=buf[t0:t0 + items.size].reshape(items.shape), mode="clip")  # (in range)
    buf[c0:c1] = cell_indptr
    # lse_src: per row of q.
    lse_src = buf[s0:s1]
    lse_src[:] = -1
    if num_tiles:  # row r, token i of its request's tiles: tile i // T, row i % T
        req = np.repeat(np.arange(long_.shape[0]), qo_l)  # [long rows]
        tok_in = np.arange(req.shape[0]) - (np.cumsum(qo_l) - qo_l).take(req)
        lse_src[start_l.take(req) + tok_in] = (tile_first * (num_qo_heads * T)).take(req) + tok_in + (
            tok_in // T) * ((num_qo_heads - 1) * T)
    if short.shape[0]:
        t_in = np.arange(int(p_qo.sum())) - np.repeat(np.cumsum(p_qo) - p_qo, p_qo)
        slot = layout.packed_slot0 + np.repeat(np.arange(short.shape[0]) * num_kv_heads, p_qo)
        lse_src[p_start.repeat(p_qo) + t_in] = slot * T + t_in * group
    info = dict(num_items=n_q + n_p, num_tiles=num_tiles, num_short=short.shape[0], nnz=nnz)
    return layout, buf, info
