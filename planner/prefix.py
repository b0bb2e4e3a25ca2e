"""Shared-prefix structure of page tables (host side, NumPy only).

RadixTree: a prefix index over page-id sequences that a serving loop keeps
across steps (longest-prefix match, insertion with edge splitting, LRU
eviction of unlocked leaves). shared_prefix_groups: the two-level split of a
batch's page table into a shared prefix per group of consecutive requests and
each request's unique suffix, the input of cascade attention.
"""
import itertools

import numpy as np

from planner import validate

_any = np.logical_or.reduce


class _Node:
    __slots__ = ("edge", "children", "parent", "last_used", "locks")

    def __init__(self, edge, parent):
        self.edge = edge          # tuple of page ids on the edge into this node
        self.children = {}        # first page id of the child's edge -> child
        self.parent = parent
        self.last_used = 0
        self.locks = 0            # requests currently using this node's pages


class RadixTree:
    """A radix tree over page-id sequences.

        tree = RadixTree()
        tree.insert([3, 9, 4])          # a request's pages
        n = tree.match([3, 9, 7])       # 2: pages [3, 9] are cached
        freed = tree.evict(2)           # page ids of least-recently-used, unlocked leaves

    Pages are identified by id: the tree stores which page sequences exist so a
    new request can reuse the pages of its longest cached prefix.
    """

    def __init__(self):
        self.root = _Node((), None)
        self._clock = itertools.count(1)
        self.num_pages = 0

    def _walk(self, pages, touch):
        """Follows pages from the root; returns (node, depth into its edge, pages matched)."""
        node, matched, now = self.root, 0, next(self._clock)
        while matched < len(pages):
            child = node.children.get(pages[matched])
            if child is None:
                return node, len(node.edge), matched
            k = 0
            while k < len(child.edge) and matched + k < len(pages) and child.edge[k] == pages[matched + k]:
                k += 1
            if touch:
                child.last_used = now
            matched += k
            if k < len(child.edge):
                return child, k, matched
            node = child
        return node, len(node.edge), matched

    def match(self, pages):
        """Length (in pages) of the longest cached prefix of `pages`; marks it recently used."""
        return self._walk(tuple(int(p) for p in pages), touch=True)[2]

    def insert(self, pages):
        """Adds a page sequence, splitting an edge where it diverges. Returns the pages already cached."""
        pages = tuple(int(p) for p in pages)
        node, depth, matched = self._walk(pages, touch=True)
        node = self._split(node, depth)
        if matched < len(pages):
            leaf = _Node(pages[matched:], node)
            leaf.last_used = next(self._clock)
            node.children[leaf.edge[0]] = leaf
            self.num_pages += len(leaf.edge)
        return matched

    def _split(self, node, depth):
        """Splits node's edge after `depth` pages (if inside it); returns the node ending there."""
        if depth >= len(node.edge):
            return node
        head = _Node(node.edge[:depth], node.parent)
        head.last_used, head.locks = node.last_used, node.locks
        node.parent.children[head.edge[0]] = head
        node.edge = node.edge[depth:]
        node.parent = head
        head.children[node.edge[0]] = node
        return head

    def lock(self, pages, delta=1):
        """Adds delta to the lock count of every node on the path of `pages` (a cached prefix,
        e.g. what match() found): locked nodes are never evicted. Use delta=-1 to unlock."""
        pages = tuple(int(p) for p in pages)
        node, depth, matched = self._walk(pages, touch=False)
        if matched != len(pages):
            raise ValueError("pages must be a cached prefix (insert it first)")
        node = self._split(node, depth)
        while node is not self.root:
            node.locks += delta
            if node.locks < 0:
                raise ValueError("unlock without a matching lock")
            node = node.parent

    def evict(self, num_pages):
        """Removes least-recently-used unlocked leaves until at least num_pages pages are freed
        (or nothing evictable is left). Returns the freed page ids."""
        freed = []
        while len(freed) < num_pages:
            leaves = [n for n in self._nodes() if not n.children and n.locks == 0 and n is not self.root]
            if not leaves:
                break
            leaf = min(leaves, key=lambda n: n.last_used)
            del leaf.parent.children[leaf.edge[0]]
            freed.extend(leaf.edge)
            self.num_pages -= len(leaf.edge)
            parent = leaf.parent
            if parent is not self.root and len(parent.children) == 1 and parent.locks == 0:
                (only,) = parent.children.values()  # merge a chain left with one child
                only.edge = parent.edge + only.edge
                only.parent = parent.parent
                parent.parent.children[only.edge[0]] = only
        return freed

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def may_share(kv_indptr, kv_indices):
    """O(B) test to run before shared_prefix_groups: False when no two consecutive requests
    begin with the same page id, so that no group can share a prefix. True may be a false
    positive (e.g. around empty requests); input that is not a page table also gives True,
    leaving the checks to the full path."""
    indptr, indices = np.asarray(kv_indptr), np.asarray(kv_indices)
    if indptr.ndim != 1 or indices.ndim != 1 or indptr.dtype.kind not in "iu":
        return True
    if indptr.shape[0] < 3 or not indices.shape[0]:
        return False
    first = indices.take(indptr[:-1], mode="clip")  # each request's first page id
    return bool(_any(first[1:] == first[:-1]))


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
    kv_indptr, kv_indices, kv_last_page_len, _, pages = validate.check_page_table(
        kv_indptr, kv_indices, kv_last_page_len, page_size)
    batch = pages.shape[0]
    full = np.maximum(pages - (kv_last_page_len < page_size), 0)  # leading pages that are full
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


def attention_cost_us(group_rows, group_pages, *, page_size, num_qo_heads, num_kv_heads, head_dim,
                      itemsize, bandwidth=3.0e12, tensor_flops=3.0e14, pages_read=None):
    """Roofline estimate (µs) of attention where group g's group_rows[g] query rows read
    group_pages[g] pages: max(K/V bytes / bandwidth, FLOPs / tensor-core rate). pages_read
    (default: all listed pages) counts the pages that reach HBM. The default rates are what
    one H100 reached here (BENCHMARKS.md)."""
    rows = np.asarray(group_rows, np.float64)
    pages = np.asarray(group_pages, np.float64)
    read = pages.sum() if pages_read is None else pages_read
    kv_bytes = 2.0 * read * page_size * num_kv_heads * head_dim * itemsize
    flops = 4.0 * float(np.dot(rows, pages)) * page_size * num_qo_heads * head_dim
    return max(kv_bytes / bandwidth, flops / tensor_flops) * 1e6


# Calibrated on one H100 (BENCHMARKS.md, cascade section): single-format decode re-reads a page
# that n requests share about n / 2.6 times (the rest hit L2); a two-level cascade costs about
# 33 µs of fixed overhead (two prefill launches and a merge) against 10 µs, and its shared
# level runs at about 200 TFLOP/s. The cascade must win by 20% (margin) to be chosen.
L2_REUSE, SINGLE_OVERHEAD_US, CASCADE_OVERHEAD_US, CASCADE_FLOPS, MARGIN = 2.6, 10.0, 33.0, 2.0e14, 0.8


def cascade_pays(qo_lens, pages, levels_groups, **shape):
    """Whether a two-level cascade beats one level: levels_groups is
    ((rows per shared group, shared pages per group), (rows per request, suffix pages))."""
    (_, shared_pages), (_, suffix_pages) = levels_groups
    shared_listed = float(np.sum(pages) - np.sum(suffix_pages))  # shared pages, once per request
    reads = float(np.sum(suffix_pages)) + max(shared_listed / L2_REUSE, float(np.sum(shared_pages)))
    single = SINGLE_OVERHEAD_US + attention_cost_us(qo_lens, pages, pages_read=reads, **shape)
    cascade = CASCADE_OVERHEAD_US + sum(attention_cost_us(rows, pg, tensor_flops=CASCADE_FLOPS, **shape)
                                        for rows, pg in levels_groups)
    return cascade < MARGIN * single


def level_positions(qo_indptrs, kv_lens):
    """Positions for cascade levels over the same query tokens (attention variants).

    qo_indptrs[l] int32[G_l + 1] groups the tokens at level l; kv_lens[l] int[G_l] are the
    groups' key counts. A token's keys at level l follow those of its groups at levels < l.
    Returns (offsets, q_pos): offsets[l] int64[G_l], each group's first key position;
    q_pos int64[nnz], each token's position, bottom-right in its whole sequence (by the
    last level's grouping).
    """
    nnz = int(qo_indptrs[0][-1])
    before = np.zeros(nnz, np.int64)  # keys of earlier levels, per token
    offsets = []
    for qo_indptr, lens in zip(qo_indptrs, kv_lens):
        first = np.minimum(qo_indptr[:-1], max(nnz - 1, 0))
        offsets.append(before[first] if nnz else np.zeros(len(lens), np.int64))
        before += np.repeat(np.asarray(lens, np.int64), np.diff(qo_indptr))
    last = qo_indptrs[-1]
    qo_lens = np.diff(last)
    group = np.repeat(np.arange(qo_lens.shape[0]), qo_lens)
    q_pos = before - qo_lens[group] + np.arange(nnz) - last[:-1][group]
    return offsets, q_pos


def two_level_cascade(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size, *,
                      causal=True, min_shared_pages=1):
    """Shared prefixes detected from a plain page table (no index surgery by the user).

    Consecutive requests that begin with the same full pages form a group; level 0
    gives each group its shared pages, level 1 each request the rest of its pages.
    With causal, a page is shared only if it lies before all of the request's queries.
    Returns (levels, saved_pages): each level (qo_indptr, kv_indptr, kv_indices,
    kv_last_page_len); saved_pages = pages no longer read per step.
    """
    qo_indptr = validate.check_indptr("qo_indptr", qo_indptr)
    kv_indptr, kv_indices, kv_last_page_len, kv_lens, pages = validate.check_page_table(
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
