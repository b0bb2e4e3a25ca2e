"""Cascade attention over composable formats: a batch's KV split into levels (shared prefixes,
unique suffixes), each level attended with all of its queries as one row block, merged with ⊕.

Level l groups the query rows by qo_indptr_l and gives each group a page list. A shared
prefix is one group holding the queries of every request that shares it, so each prefix
page is loaded once for all of them (a GEMM-shaped tile on tensor cores) instead of once
per request. States of the levels merge exactly (paper §3.1.2).
"""
from typing import NamedTuple

import numpy as np

from jaxinfer.prefill import BatchPrefillWithPagedKVCache, CascadePlan
from planner import prefix as prefix_planner
from planner import validate


class CascadeLevel(NamedTuple):
    """One level: query groups (qo_indptr int32[G+1]) and each group's CSR page list."""
    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    kv_last_page_len: np.ndarray


class MultiLevelCascadeAttention:
    """Attention over num_levels levels of one PagedKVCache, as FlashInfer's
    MultiLevelCascadeAttentionWrapper.

        cas = MultiLevelCascadeAttention(2, 32, 8, 128, 16)
        plan = cas.plan([CascadeLevel(...shared prefix...), CascadeLevel(...per request...)])
        o = cas.run(q, kv_cache, plan)

    Queries of earlier levels see their whole page list (a shared prefix lies
    before every query that shares it); causal, if set, applies to the last level,
    bottom-right aligned to each request's full length. Other options are those of
    BatchPrefillWithPagedKVCache (capacities apply to every level).
    """

    def __init__(self, num_levels, num_qo_heads, num_kv_heads, head_dim, page_size, *, causal=True,
                 **prefill_options):
        if num_levels < 1:
            raise ValueError(f"num_levels must be >= 1, got {num_levels}")
        self.num_levels, self.causal = num_levels, causal
        self.prefill = BatchPrefillWithPagedKVCache(num_qo_heads, num_kv_heads, head_dim, page_size,
                                                    causal=causal, **prefill_options)

    def plan(self, levels, *, num_pages=None):
        """levels: num_levels CascadeLevels (or 4-tuples) of host int32 arrays."""
        if len(levels) != self.num_levels:
            raise ValueError(f"levels must hold {self.num_levels} levels, got {len(levels)}")
        return self.prefill.plan_levels(levels, num_pages=num_pages, causal=self.causal)

    def run(self, q, kv_cache, plan, *, return_lse=False, **run_options):
        """q [nnz, Hq, D] -> o [nnz, Hq, D] (or AttentionState): ⊕ over the levels.
        run_options: variant_params, k_scale, v_scale (as BatchPrefillWithPagedKVCache.run)."""
        if not isinstance(plan, CascadePlan) or len(plan.levels) != self.num_levels:
            raise ValueError(f"plan must be a CascadePlan of {self.num_levels} levels from plan()")
        return self.prefill.run(q, kv_cache, plan, return_lse=return_lse, **run_options)


def two_level_cascade(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size, *,
                      causal=True, min_shared_pages=1):
    """Shared prefixes detected from a plain page table (no index surgery by the user).

    Consecutive requests that begin with the same full pages form a group; level 0
    gives each group its shared pages, level 1 each request the rest of its pages.
    With causal, a page is shared only if it lies before all of the request's queries.
    Returns (levels, saved_pages): saved_pages = pages no longer read per step.
    """
    qo_indptr = validate.check_indptr("qo_indptr", qo_indptr)
    kv_indptr, kv_indices, kv_last_page_len, kv_lens, pages = validate.check_page_table(
        kv_indptr, kv_indices, kv_last_page_len, page_size)
    qo_lens = qo_indptr[1:] - qo_indptr[:-1]
    cap = (kv_lens - qo_lens) // page_size if causal else pages
    groups = prefix_planner.shared_prefix_groups(kv_indptr, kv_indices, kv_last_page_len, page_size,
                                                 min_shared_pages, max_shared_pages=np.maximum(cap, 0))
    gi, shared = groups["group_indptr"], groups["prefix_pages"].astype(np.int64)
    first = kv_indptr[gi[:-1]]
    level0 = CascadeLevel(
        qo_indptr[gi].astype(np.int32), np.concatenate([[0], np.cumsum(shared)]).astype(np.int32),
        np.concatenate([kv_indices[f:f + s] for f, s in zip(first, shared)] + [np.zeros(0, np.int32)]),
        np.full(len(shared), page_size, np.int32))
    skip = np.repeat(shared, np.diff(gi))  # each request's pages already in level 0
    suffix = pages - skip
    level1 = CascadeLevel(
        qo_indptr, np.concatenate([[0], np.cumsum(suffix)]).astype(np.int32),
        np.concatenate([kv_indices[kv_indptr[b] + skip[b]:kv_indptr[b + 1]] for b in range(len(pages))]
                       + [np.zeros(0, np.int32)]),
        kv_last_page_len)
    saved = int(np.sum((np.diff(gi) - 1) * shared))
    return (level0, level1), saved


def auto_cascade_levels(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size, *, causal,
                        **shape):
    """two_level_cascade's levels when the planner's cost estimate says sharing pays, else None.
    shape: num_qo_heads, num_kv_heads, head_dim, itemsize (see planner.prefix.attention_cost_us)."""
    if not prefix_planner.may_share(kv_indptr, kv_indices):  # O(B): no request shares a first page
        return None
    levels, saved = two_level_cascade(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size,
                                      causal=causal)
    if saved == 0:
        return None
    (q0, kv0, _, _), (q1, kv1, _, _) = levels
    pays = prefix_planner.cascade_pays(
        np.diff(q1), np.diff(np.asarray(kv_indptr)), ((np.diff(q0), np.diff(kv0)), (np.diff(q1), np.diff(kv1))),
        page_size=page_size, **shape)
    return levels if pays else None

