"""The paper's Algorithm 1: deterministic longest-first greedy assignment of work items to cells."""
import heapq

import numpy as np

_min, _max = np.minimum.reduce, np.maximum.reduce
_ARANGE = np.arange(1 << 16)  # sliced (a view) instead of a fresh arange per plan
_ARANGE.flags.writeable = False
_ARANGE32 = _ARANGE.astype(np.int32)
_ARANGE32.flags.writeable = False


def arange(n):
    """np.arange(n) (int64); for n <= 65536 a read-only view of one shared array."""
    return _ARANGE[:n] if n <= _ARANGE.shape[0] else np.arange(n)


def arange32(n):
    """np.arange(n, dtype=int32), as arange: for arithmetic written into int32 plan buffers
    without a casting pass."""
    return _ARANGE32[:n] if n <= _ARANGE32.shape[0] else np.arange(n, dtype=np.int32)


def chunk_for_total(total, num_cells, min_chunk=1):
    """Algorithm 1, line 3: L_kv = ceil(total KV / #cells), at least min_chunk (and 1)."""
    return max(int(min_chunk), -(-int(total) // max(num_cells, 1)), 1)


def kv_chunk_size(kv_pages, num_cells, min_chunk_pages=1):
    """Algorithm 1, line 3: L_kv = ceil(sum of KV pages / #cells), at least min_chunk_pages."""
    total = np.add.reduce(kv_pages) if type(kv_pages) is np.ndarray else np.sum(kv_pages)
    return chunk_for_total(total, num_cells, min_chunk_pages)


def assign_cells(costs, num_cells, out=None):
    """Assigns items (positive integer costs: alpha * l_q + beta * l_kv with alpha > 0) to
    cells, longest first, each to the least-loaded cell (a min-heap of cell loads).

    Ties break by item index, then by cell index, so the same costs always give
    the same assignment. Returns (order, cell_indptr): item ids listed cell by
    cell, and int32[num_cells + 1] offsets (written into `out` if given). A cell
    runs its items in item-id order (the work list's request order), not longest
    first: every request's items are spread over the cells, so cells running side
    by side work on the same requests and share their K/V in L2 (measured: prefill on H100).
    """
    costs = np.asarray(costs)
    if costs.dtype.kind not in "iu":
        costs = costs.astype(np.int64)
    if costs.shape[0] and costs.min() <= 0:
        raise ValueError("costs must be positive")
    return assign_positive(costs, num_cells, out)


def assign_positive(costs, num_cells, out=None):
    """assign_cells for integer costs known to be positive (no check)."""
    n = costs.shape[0]
    cell_indptr = np.empty(num_cells + 1, np.int32) if out is None else out
    if n <= num_cells:  # one item per cell, cells in cost order: listing by cell is by cost
        np.minimum(arange(num_cells + 1), n, out=cell_indptr)
        return longest_first(costs), cell_indptr
    cell_of_item = cells_of(costs, num_cells)
    order = cell_of_item.argsort(kind="stable")  # by cell, then by item id (radix sort: int16)
    cell_indptr[0] = 0
    cell_indptr[1:] = np.add.accumulate(np.bincount(cell_of_item, minlength=num_cells))  # (an int32 out= is slower)
    return order, cell_indptr


def cells_of(costs, num_cells):
    """Each item's cell as assign_positive assigns it (positive integer costs): int16[n] when
    num_cells <= 2**15, else int64[n]."""
    n = costs.shape[0]
    by_cost = longest_first(costs)
    cell_of_item = np.empty(n, np.int16 if num_cells <= 1 << 15 else np.int64)
    if n <= num_cells:  # one item per cell, in cost order
        cell_of_item[by_cost] = arange(n)
        return cell_of_item
    # The first num_cells items go to the empty cells in index order; the rest to the least-loaded.
    ordered = costs.take(by_cost)
    cell_of_sorted = np.empty_like(cell_of_item)
    if ordered[0] == ordered[n - 1]:  # equal costs: the cells take turns (ties go to the lower cell)
        np.remainder(arange(n), num_cells, out=cell_of_sorted, casting="unsafe")
    else:
        cell_of_sorted[:num_cells] = arange(num_cells)
        _greedy(ordered, num_cells, cell_of_sorted)
    cell_of_item[by_cost] = cell_of_sorted
    return cell_of_item


def longest_first(costs):
    """Item ids by cost, longest first, ties by item id (a stable sort; a radix sort on 16 bits
    when the costs span fewer than 2**16 values, which pays from about 512 items)."""
    if costs.shape[0] >= 512:
        hi = int(_max(costs))
        if hi - int(_min(costs)) < 1 << 16:
            return np.subtract(hi, costs, dtype=np.int64).astype(np.uint16).argsort(kind="stable")
    return np.negative(costs, dtype=np.int64).argsort(kind="stable")


ROUND_MIN_ITEMS = 48  # a vectorized round pays for its ~10 NumPy calls past this many items


def _greedy(ordered, num_cells, cell_of_sorted):
    """Items num_cells.. (ordered: the costs, longest first) each to the least-loaded cell,
    written into cell_of_sorted.

    A cell's key packs (load, cell) into one int, load << bits | cell: ints compare faster than
    tuples and order the same way, ties going to the lower cell; keys are distinct.

    Rounds first: with the cells sorted by key, item pos + k takes the k-th cell as long as
    every cell an earlier item of the round took now has a larger key (a cumulative minimum
    says how far that holds: that prefix is exactly what the heap does). Rounds stop paying
    when they place few items; a heap of packed keys does the rest."""
    n = ordered.shape[0]
    pos = num_cells
    # The loads' spread is at most hi - mid (ordered is sorted, longest first); the keys' at most
    # (hi - mid) << bits | (num_cells - 1), which the least cost shifted exceeds iff lo > hi - mid.
    hi, mid, lo = int(ordered[0]), int(ordered[num_cells - 1]), int(ordered[n - 1])
    in_rounds = lo > max(hi - mid, hi - lo)
    # Costs within a factor of ~2 (the smallest above both the spread of the cells' loads and that
    # of the costs): every round of num_cells items goes to the cells in key order. (While a round
    # runs, each new key exceeds every old one, and a round leaves the keys' spread within the
    # larger of those two spreads.)
    if in_rounds and n - pos <= num_cells:  # one round: the cells by load, ties to the lower cell
        # (a stable sort; timsort is quick on these loads, nearly descending)
        cell_of_sorted[pos:] = ordered[:num_cells].argsort(kind="stable")[:n - pos]
        return
    bits = max(num_cells - 1, 1).bit_length()
    shifted = np.left_shift(ordered, bits, dtype=np.int64)
    if in_rounds:
        # Row r of `rounds` holds the keys before round r, sorted in place (a key's low bits name
        # its cell): item num_cells * (r + 1) + k goes to the k-th, whose key plus that item's is
        # row r + 1's entry k. (Every round but the last places num_cells items.)
        num_rounds = -(-(n - pos) // num_cells)
        rounds = np.empty((num_rounds, num_cells), np.int64)
        np.bitwise_or(shifted[:num_cells], arange(num_cells), out=rounds[0])
        items = shifted[num_cells:num_cells * num_rounds].reshape(num_rounds - 1, num_cells)
        for keys, placed, after in zip(rounds, items, rounds[1:]):
            keys.sort()  # (the keys are distinct: any sort gives this order)
            np.add(keys, placed, out=after)
        rounds[-1].sort()
        cell_of_sorted[num_cells:] = rounds.reshape(-1)[:n - num_cells] & ((1 << bits) - 1)
        return
    keys = shifted[:num_cells] | arange(num_cells)  # each cell's key (its low bits name the cell)
    mask = (1 << bits) - 1
    if n - pos >= ROUND_MIN_ITEMS and num_cells >= ROUND_MIN_ITEMS:
        keys.sort()  # sorted between rounds: the k-th key is the k-th least-loaded cell
        while True:
            m = min(num_cells, n - pos)
            if int(shifted[pos + m - 1]) > int(keys[m - 1]) - int(keys[0]):
                took = m  # the round's least cost exceeds the keys' spread: every new key > every old
            else:  # item pos + k + 1 goes to the cell of old[k + 1] iff min(new[:k + 1]) > old[k + 1]
                old = keys[:m]
                later = np.minimum.accumulate(old[:-1] + shifted[pos:pos + m - 1]) < old[1:]
                first = int(later.argmax())
                took = first + 1 if later[first] else m
            np.bitwise_and(keys[:took], mask, out=cell_of_sorted[pos:pos + took], casting="unsafe")
            keys[:took] += shifted[pos:pos + took]
            pos += took
            if took < ROUND_MIN_ITEMS or n - pos < ROUND_MIN_ITEMS:
                break
            keys.sort()
    if pos < n:
        heap = keys.tolist()
        heapq.heapify(heap)
        replace = heapq.heapreplace  # pop the least-loaded cell, push its new load
        cells = [replace(heap, heap[0] + s) & mask for s in shifted[pos:].tolist()]
        # (small ints to an array: through bytes, a C loop, when they fit in one)
        cell_of_sorted[pos:] = np.frombuffer(bytes(cells), np.uint8) if num_cells <= 256 else cells
