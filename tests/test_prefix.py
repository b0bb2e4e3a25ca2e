"""Shared-prefix detection and the radix prefix index, on random tree-shaped page tables."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from planner.prefix import RadixTree, shared_prefix_groups


def _common(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=8), min_size=1, max_size=12),
       st.lists(st.lists(st.integers(0, 5), max_size=8), min_size=1, max_size=6))
def test_radix_match_is_longest_common_prefix(inserted, queries):
    tree = RadixTree()
    for seq in inserted:
        tree.insert(seq)
    for q in queries + inserted:
        assert tree.match(q) == max(_common(q, s) for s in inserted)
    distinct = {tuple(s[:k]) for s in inserted for k in range(1, len(s) + 1)}
    assert tree.num_pages == len(distinct)  # one node edge entry per distinct prefix


def test_insert_splits_edges_and_reports_cached_pages():
    tree = RadixTree()
    assert tree.insert([1, 2, 3, 4]) == 0
    assert tree.insert([1, 2, 9]) == 2  # splits the edge after [1, 2]
    assert tree.match([1, 2, 3, 4, 5]) == 4 and tree.match([1, 2, 9]) == 3 and tree.match([7]) == 0
    assert tree.num_pages == 5


def test_lru_eviction_respects_locks_and_merges_chains():
    tree = RadixTree()
    tree.insert([1, 2, 3])
    tree.insert([1, 2, 4])
    tree.insert([5, 6])
    tree.lock([1, 2, 3])
    tree.match([5, 6])  # [1, 2, 4] is now the least recently used unlocked leaf
    assert tree.evict(1) == [4]
    assert tree.match([1, 2, 4]) == 2 and tree.match([1, 2, 3]) == 3
    assert tree.evict(10) == [5, 6]  # the locked path stays
    tree.lock([1, 2, 3], -1)
    assert sorted(tree.evict(10)) == [1, 2, 3] and tree.num_pages == 0
    with pytest.raises(ValueError, match="cached"):
        tree.lock([8])


def _table(lists, page_size=4, last=None):
    indptr = np.concatenate([[0], np.cumsum([len(x) for x in lists])]).astype(np.int32)
    indices = np.concatenate([np.asarray(x, np.int32) for x in lists] + [np.zeros(0, np.int32)])
    last = np.full(len(lists), page_size, np.int32) if last is None else np.asarray(last, np.int32)
    return indptr, indices, last


def test_groups_split_shared_prefix_and_suffix():
    system = list(range(100, 110))
    lists = [system + [1, 2], system + [3], system + [4, 5, 6], [7, 8], [9] + [10], [9, 11]]
    g = shared_prefix_groups(*_table(lists, last=[4, 2, 4, 4, 4, 1]), 4)
    np.testing.assert_array_equal(g["group_indptr"], [0, 3, 4, 6])
    np.testing.assert_array_equal(g["prefix_pages"], [10, 0, 1])


def test_partial_last_page_is_never_shared():
    g = shared_prefix_groups(*_table([[1, 2], [1, 2]], last=[3, 3]), 4)
    np.testing.assert_array_equal(g["prefix_pages"], [1])  # page 2 is partly filled


def test_joining_must_read_fewer_pages():
    # 3 requests share 40 pages; a 4th shares only 1: joining would read more pages in all.
    base = list(range(40))
    g = shared_prefix_groups(*_table([base + [50], base + [51], base + [52], [0, 60]]), 4)
    np.testing.assert_array_equal(g["group_indptr"], [0, 3, 4])
    np.testing.assert_array_equal(g["prefix_pages"], [40, 0])


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_groups_on_random_tree_shaped_tables(data):
    rng = np.random.default_rng(data.draw(st.integers(0, 10**6)))
    trunk = list(rng.permutation(1000)[:rng.integers(0, 12)] + 2000)
    lists = []
    for _ in range(data.draw(st.integers(1, 10))):
        branch = trunk[:rng.integers(0, len(trunk) + 1)]
        lists.append(branch + list(rng.permutation(1000)[:rng.integers(0, 4)]))
    lists = [x for x in lists if x] or [[1]]
    last = rng.integers(1, 5, len(lists))
    indptr, indices, last = _table(lists, last=last)
    g = shared_prefix_groups(indptr, indices, last, 4)
    gi, pp = g["group_indptr"], g["prefix_pages"]
    assert gi[0] == 0 and gi[-1] == len(lists) and np.all(np.diff(gi) > 0)
    for grp in range(len(pp)):
        members = range(gi[grp], gi[grp + 1])
        s = int(pp[grp])
        if len(members) == 1:
            assert s == 0
        for m in members:  # the prefix is common, and made of full pages only
            assert lists[m][:s] == lists[gi[grp]][:s]
            assert s <= len(lists[m]) - (last[m] < 4)


def test_lock_a_prefix_that_ends_inside_an_edge():
    """match() may end mid-edge; locking that prefix splits the edge and protects only it."""
    tree = RadixTree()
    tree.insert([1, 2, 3, 4])
    assert tree.match([1, 2, 9]) == 2
    tree.lock([1, 2])
    assert sorted(tree.evict(10)) == [3, 4]  # the unlocked tail goes, the locked prefix stays
    assert tree.match([1, 2]) == 2
    tree.lock([1, 2], -1)
    assert sorted(tree.evict(10)) == [1, 2]


def test_groups_with_an_empty_request():
    """An empty request (0 pages, last page length 1 < page_size) shares nothing and does
    not break the grouping of the others (it once sliced kv_indices with a negative limit)."""
    indptr = np.array([0, 0, 2, 4], np.int32)
    indices = np.array([5, 6, 5, 6], np.int32)
    last = np.array([1, 8, 8], np.int32)
    groups = shared_prefix_groups(indptr, indices, last, 8)
    np.testing.assert_array_equal(groups["group_indptr"], [0, 1, 3])
    np.testing.assert_array_equal(groups["prefix_pages"], [0, 2])
