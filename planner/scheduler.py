"""The paper's Algorithm 1: deterministic longest-first greedy assignment of work items to cells."""
import heapq

import numpy as np


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
