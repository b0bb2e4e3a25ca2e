"""Cascade attention over composable formats: a batch's KV split into levels (shared prefixes,
unique suffixes), each level attended with all of its queries as one row block, merged with ⊕.

Level l groups the query rows by qo_indptr_l and gives each group a page list
(jaxinfer.CascadeLevel; jaxinfer.two_level_cascade finds them in a plain page table). A shared
prefix is one group holding the queries of every request that shares it, so each prefix page is
loaded once for all of them (a GEMM-shaped tile on tensor cores) instead of once per request.
States of the levels merge exactly (paper §3.1.2). Each level's kernel is chosen by
jaxinfer.dispatch from that level's lengths (plan.impl lists them).
"""
from jaxinfer.plans import CascadePlan
from jaxinfer.prefill import BatchPrefillWithPagedKVCache


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
                 layout="NHD", max_batch_size=None, max_num_tokens=None, max_num_pages=None,
                 sm_scale=None, num_ctas=None, fixed_split_tokens=None, tile_rows=None, backend=None,
                 variant=None, impl="auto", config=None):
        if num_levels < 1:
            raise ValueError(f"num_levels must be >= 1, got {num_levels}")
        self.num_levels, self.causal = num_levels, causal
        self.prefill = BatchPrefillWithPagedKVCache(
            num_qo_heads, num_kv_heads, head_dim, page_size, causal=causal, layout=layout,
            max_batch_size=max_batch_size, max_num_tokens=max_num_tokens, max_num_pages=max_num_pages,
            sm_scale=sm_scale, num_ctas=num_ctas, fixed_split_tokens=fixed_split_tokens,
            tile_rows=tile_rows, backend=backend, variant=variant, impl=impl, config=config)

    def plan(self, levels, *, num_pages=None):
        """levels: num_levels CascadeLevels (or 4-tuples) of host int32 arrays; num_pages: the
        cache's page count."""
        if len(levels) != self.num_levels:
            raise ValueError(f"levels must hold {self.num_levels} levels, got {len(levels)}")
        return self.prefill.plan_levels(levels, num_pages=num_pages, causal=self.causal)

    def run(self, q, kv_cache, plan, *, return_lse=False, variant_params=None, k_scale=None,
            v_scale=None):
        """q [nnz, Hq, D] -> o [nnz, Hq, D] (or AttentionState): ⊕ over the levels."""
        if not isinstance(plan, CascadePlan) or len(plan.levels) != self.num_levels:
            raise ValueError(f"plan must be a CascadePlan of {self.num_levels} levels from plan()")
        return self.prefill.run(q, kv_cache, plan, return_lse=return_lse, variant_params=variant_params,
                                k_scale=k_scale, v_scale=v_scale)
