"""The paper's Algorithm 1: deterministic longest-first greedy assignment of work items to cells."""
import heapq

import numpy as np


def kv_chunk_size(kv_lens_pages, num_cells, min_chunk_pages=1):
    """Algorithm 1, line 3: L_kv = ceil(sum of KV pages / #cells), at least min_chunk_pages."""
    total = int(np.sum(kv_lens_pages))
    return max(int(min_chunk_pages), -(-total // max(num_cells, 1)), 1)


def assign_cells(costs, num_cells):
    """Assigns items (by cost) to cells, longest first, each to the least-loaded cell.

    Ties break by item index, then by cell index, so the same costs always give
    the same assignment. Returns (order, cell_indptr): items listed cell by cell
    (in the order each cell runs them) and int32[num_cells + 1] offsets.
    """
    costs = np.asarray(costs, dtype=np.float64)
    n = costs.shape[0]
    by_cost = np.argsort(-costs, kind="stable")
    cell_of = np.empty(n, np.int64)
    first = min(n, num_cells)
    cell_of[by_cost[:first]] = np.arange(first)  # all loads are 0: cells taken in index order
    if n > num_cells:
        heap = [(float(costs[by_cost[c]]), c) for c in range(num_cells)]
        heapq.heapify(heap)
        for i in by_cost[num_cells:].tolist():
            load, c = heap[0]
            cell_of[i] = c
            heapq.heapreplace(heap, (load + costs[i], c))
    # Cells run their items in assignment order (longest first).
    rank = np.empty(n, np.int64)
    rank[by_cost] = np.arange(n)
    order = np.lexsort((rank, cell_of))
    cell_indptr = np.zeros(num_cells + 1, np.int32)
    np.cumsum(np.bincount(cell_of, minlength=num_cells), out=cell_indptr[1:])
    return order, cell_indptr
