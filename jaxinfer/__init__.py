"""jaxinfer: a JAX/Pallas attention engine for LLM inference serving.

Formats (pytrees), plan/run wrappers backed by Pallas kernels, the exact
attention-state merge, KV append, and a pure-jnp reference (jaxinfer.reference).
"""
from jaxinfer import reference, variants
from jaxinfer.cascade import CascadeLevel, MultiLevelCascadeAttention, two_level_cascade
from jaxinfer.decode import BatchDecodeWithPagedKVCache, DecodePlan
from jaxinfer.formats import AttentionState, BlockSparseMatrix, PagedKVCache
from jaxinfer.prefill import (BatchPrefillWithPagedKVCache, BatchPrefillWithRaggedKVCache,
                              BlockSparseAttention, CascadePlan, PrefillPlan)
from jaxinfer.page import append_paged_kv_cache, get_batch_indices_positions
from jaxinfer.single import single_decode_with_kv_cache, single_prefill_with_kv_cache
from jaxinfer.state import merge_state, merge_state_varlen, merge_states
from jaxinfer.variants import AttentionVariant

__all__ = [
    "AttentionState", "AttentionVariant", "CascadeLevel", "CascadePlan", "MultiLevelCascadeAttention", "two_level_cascade", "BatchDecodeWithPagedKVCache", "BatchPrefillWithPagedKVCache",
    "BatchPrefillWithRaggedKVCache", "BlockSparseAttention", "BlockSparseMatrix", "DecodePlan", "PrefillPlan",
    "PagedKVCache", "append_paged_kv_cache", "get_batch_indices_positions", "merge_state",
    "merge_state_varlen", "merge_states", "reference", "single_decode_with_kv_cache",
    "single_prefill_with_kv_cache", "variants",
]
