"""jaxinfer: a JAX/Pallas attention engine for LLM inference serving.

Formats (pytrees), plan/run wrappers backed by Pallas kernels, the exact
attention-state merge, KV append, MLA, sorting-free sampling (jaxinfer.sampling),
attention over several devices (jaxinfer.sharding), and a pure-jnp reference
(jaxinfer.reference).
"""
from jaxinfer import dispatch, reference, sampling, sharding, variants
from jaxinfer.batch import BatchAttention
from jaxinfer.cascade import MultiLevelCascadeAttention
from jaxinfer.decode import BatchDecodeWithPagedKVCache
from jaxinfer.mla import BatchMLAPagedAttention, MLAPlan
from jaxinfer.mla_ragged import mla_ragged_paged_attention
from jaxinfer.formats import AttentionState, BlockSparseMatrix, CascadeLevel, PagedKVCache, two_level_cascade
from jaxinfer.plans import BatchPlan, CascadePlan, DecodePlan, PlanSpec, PrefillPlan
from jaxinfer.ragged import ragged_paged_attention
from jaxinfer.prefill import BatchPrefillWithPagedKVCache, BatchPrefillWithRaggedKVCache, BlockSparseAttention
from pallas_kernels.decode import DecodeConfig
from pallas_kernels.mla import MLAConfig
from pallas_kernels.sampling import SamplingConfig
from pallas_kernels.prefill import MosaicPrefillConfig, PrefillConfig
from jaxinfer.page import append_paged_kv_cache, get_batch_indices_positions
from jaxinfer.single import single_decode_with_kv_cache, single_prefill_with_kv_cache
from jaxinfer.state import merge_state, merge_state_varlen, merge_states
from jaxinfer.variants import AttentionVariant

__all__ = [
    "BatchAttention", "BatchMLAPagedAttention", "BatchPlan", "DecodeConfig", "MLAConfig", "MLAPlan",
    "SamplingConfig", "sampling", "sharding", "MosaicPrefillConfig", "PlanSpec", "PrefillConfig", "dispatch",
    "AttentionState", "AttentionVariant", "CascadeLevel", "CascadePlan", "MultiLevelCascadeAttention", "two_level_cascade", "BatchDecodeWithPagedKVCache", "BatchPrefillWithPagedKVCache",
    "BatchPrefillWithRaggedKVCache", "BlockSparseAttention", "BlockSparseMatrix", "DecodePlan", "PrefillPlan",
    "PagedKVCache", "append_paged_kv_cache", "get_batch_indices_positions", "merge_state",
    "merge_state_varlen", "merge_states", "mla_ragged_paged_attention", "ragged_paged_attention", "reference", "single_decode_with_kv_cache",
    "single_prefill_with_kv_cache", "variants",
]
