"""Multi-head latent attention (MLA: DeepSeek-V3/R1, Kimi K2) over a paged latent cache.

One latent row per token, shared by every head: ckv (width 512, also the values) and kpe (the
rotary part, width 64). logits = sm_scale (q_nope ckv + q_pe kpe); o = softmax(logits) ckv.
An fp8 cache holds ckv / ckv_scale and kpe / kpe_scale: the logits and o use the dequantized rows.
plan() on the host (planner/mla.py), run() compiled once: the kernel (pallas_kernels/mla.py)
then merge.merge_varlen for split tiles.
"""
import dataclasses
import math
from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import _backend, dispatch, transfer
from jaxinfer.formats import AttentionState, check_kv_dtype, check_power_of_two, check_q, check_scale
from jaxinfer.plans import PlanSpec, WrapperFacts
from pallas_kernels import merge as merge_kernels
from pallas_kernels import mla as mla_kernels
from planner import mla as mla_planner
from planner import validate

@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class MLAPlan:
    """A BatchMLAPagedAttention plan: the sections of one packed int32 buffer (device arrays,
    the pytree's leaves) and its static facts (layout, spec, causal)."""
    parts: Tuple[jax.Array, ...]  # transfer.plan_sections
    layout: mla_planner.MLALayout
    spec: PlanSpec
    causal: bool
    info: dict = dataclasses.field(default_factory=dict, compare=False)

    @property
    def impl(self):
        return self.spec.impl

    def sections(self):
        return transfer.sections(self.parts, self.layout)

    def tree_flatten(self):
        return (self.parts,), (self.layout, self.spec, self.causal)

    @classmethod
    def tree_unflatten(cls, aux, children):
        layout, spec, causal = aux
        return cls(parts=tuple(children[0]), layout=layout, spec=spec, causal=causal)


def _capacity(name, x):
    if x is not None and (isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1):
        raise ValueError(f"{name} must be a positive int or None, got {x!r}")
    return None if x is None else int(x)


class BatchMLAPagedAttention:
    """Batch MLA over a paged latent cache, any mix of query lengths (decode, verify, prefill).

        mla = BatchMLAPagedAttention(16, 512, 64, 64, causal=True, sm_scale=0.1352)
        plan = mla.plan(qo_indptr, kv_indptr, kv_indices, kv_len, num_pages=ckv_cache.shape[0])
        o = mla.run(q_nope, q_pe, ckv_cache, kpe_cache, plan)            # pure; jit it

    Request b has q rows qo_indptr[b]:qo_indptr[b+1] and kv_len[b] tokens in pages
    kv_indices[kv_indptr[b]:kv_indptr[b+1]]. Causal is bottom-right; a row that sees no key
    gives o = 0, lse = -inf. With max_batch_size, max_num_tokens and max_num_pages every plan has
    the same shapes (q then has max_num_tokens rows; rows past the step give o = 0), so a jitted
    run() compiles once. config: an MLAConfig tuning the Triton kernel. impl: "auto" (the
    dispatch's choice per plan: on Hopper, "mosaic" for 16-bit caches where page_size is a
    multiple of 32 and num_heads a multiple of 64, or a divisor of 64 on steps of whole tiles
    (decode at 16 and 32 heads; under capacities, where max_num_tokens = max_batch_size), else
    "triton"), "mosaic" or "triton".
    """

    def __init__(self, num_heads, head_dim_ckv, head_dim_kpe, page_size, *, causal=False, sm_scale,
                 max_batch_size=None, max_num_tokens=None, max_num_pages=None, backend=None, config=None,
                 impl="auto"):
        if isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer)) or num_heads < 1:
            raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
        self.head_dim_ckv = check_power_of_two("head_dim_ckv", head_dim_ckv)
        self.head_dim_kpe = check_power_of_two("head_dim_kpe", head_dim_kpe)
        if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        if sm_scale is None or not isinstance(sm_scale, (int, float, np.floating)) or not (
                math.isfinite(sm_scale) and sm_scale > 0):
            raise ValueError(f"sm_scale must be a positive finite float, got {sm_scale!r}")
        if not isinstance(causal, bool):
            raise ValueError(f"causal must be a bool, got {causal!r}")
        self.config = mla_kernels.MLAConfig() if config is None else config
        if not isinstance(self.config, mla_kernels.MLAConfig):
            raise ValueError(f"config must be an MLAConfig, got {type(config).__name__}")
        if self.config.block_kv is not None:
            check_power_of_two("config.block_kv", self.config.block_kv)
        if self.config.block_rows is not None:
            check_power_of_two("config.block_rows", self.config.block_rows)
        self.num_heads, self.page_size, self.causal = int(num_heads), int(page_size), causal
        self.sm_scale = float(sm_scale)
        self.max_batch_size = _capacity("max_batch_size", max_batch_size)
        self.max_num_tokens = _capacity("max_num_tokens", max_num_tokens)
        self.max_num_pages = _capacity("max_num_pages", max_num_pages)
        self.interpret = _backend.use_interpret(backend)
        self.num_sms = _backend.num_sms()
        self.problem = dispatch.Problem("mla", self.num_heads, 1, self.head_dim_ckv + self.head_dim_kpe, "paged",
                                        self.page_size, interpret=self.interpret, head_dim_vo=self.head_dim_ckv)
        self.rows = dispatch.candidates(self.problem, impl)
        self.facts = WrapperFacts(type(self).__name__, self.num_heads, 1, self.head_dim_ckv, self.page_size,
                                  "NHD", (self.max_batch_size, self.max_num_tokens, self.max_num_pages))

    def _block_rows(self, qo_lens):
        """The tiles' rows (dispatch.mla_tiling caps the Mosaic kernel's at 64): the config's, else
        (planner.mla.block_rows_for) for the longest request, or under max_num_tokens for
        max_num_tokens / max_batch_size tokens (one tile size for every plan)."""
        if self.config.block_rows is not None:
            return self.config.block_rows
        if self.max_num_tokens is not None:
            longest = self.max_num_tokens // (self.max_batch_size or 1)
        else:
            longest = int(qo_lens.max()) if qo_lens.shape[0] else 1
        return mla_planner.block_rows_for(self.num_heads, longest)

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len, *, num_pages=None, q_dtype=jnp.bfloat16,
             kv_dtype=None):
        """Plans one step from host int32 arrays: qo_indptr, kv_indptr [B + 1], kv_indices,
        kv_len [B]. num_pages: the cache's page count (required; page ids outside [0, num_pages)
        are rejected, and run() rejects a smaller cache). q_dtype, kv_dtype (default q_dtype):
        the dtypes run() will get (FlashInfer's q_data_type / kv_data_type): the kernel is chosen
        for them."""
        num_pages = validate.check_num_pages(num_pages)
        qo_indptr, qo_lens, _ = validate.indptr_lengths("qo_indptr", qo_indptr)
        dtypes = []
        for name, x in (("q_dtype", q_dtype), ("kv_dtype", q_dtype if kv_dtype is None else kv_dtype)):
            try:
                dtypes.append(np.dtype(x))
            except TypeError:
                raise ValueError(f"{name} must be a dtype, got {x!r}") from None
        rows = tuple(i for i in self.rows if i.dtypes_unsupported(*dtypes) is None)
        if not rows:
            raise ValueError(f"kv_dtype: no MLA kernel takes q / latent cache of dtypes {dtypes[0]} / {dtypes[1]} ("
                             + "; ".join(f"{i.name}: {i.dtypes_unsupported(*dtypes)}" for i in self.rows) + ")")
        fixed = None not in (self.max_batch_size, self.max_num_tokens, self.max_num_pages)
        block_rows = self._block_rows(qo_lens)
        implementation = dispatch.choose(self.problem, qo_lens, validate.as_int32("kv_len", kv_len), self.causal,
                                         rows=rows, fixed_shapes=fixed, tile_rows=block_rows)
        tiling = dispatch.mla_tiling(implementation, self.config, self.num_sms, block_rows)
        layout, buf, info = mla_planner.plan(
            qo_indptr, kv_indptr, kv_indices, kv_len, page_size=self.page_size, num_heads=self.num_heads,
            num_cells=tiling.num_cells, block_rows=tiling.block_rows, causal=self.causal, num_pages=num_pages,
            max_batch_size=self.max_batch_size, max_num_tokens=self.max_num_tokens, max_num_pages=self.max_num_pages,
            block_kv=tiling.block_kv, min_chunk=self.config.min_chunk, tile_merge=tiling.tile_merge)
        spec = self.facts.spec(num_pages, implementation.name)
        return MLAPlan(parts=transfer.plan_sections(buf, layout), layout=layout, spec=spec, causal=self.causal,
                       info=info)

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, plan, *, return_lse=False, ckv_scale=None,
            kpe_scale=None):
        """q_nope [T, H, ckv], q_pe [T, H, kpe]; ckv_cache [num_pages, page_size, ckv], kpe_cache
        [num_pages, page_size, kpe], all of one dtype (float32, float16 or bfloat16), or both caches
        fp8 (float8_e4m3fn / e5m2) under a float16 or bfloat16 q. ckv_scale, kpe_scale (positive
        scalars, data: no recompiles; default 1): the caches' dequantization scales, as FlashInfer's
        (the rows are ckv_cache x ckv_scale, kpe_cache x kpe_scale). Returns o [T, H, ckv] in q's
        dtype, or AttentionState(o, lse [T, H] natural log) with return_lse."""
        self._check(q_nope, q_pe, ckv_cache, kpe_cache, plan)
        ckv_scale, kpe_scale = check_scale("ckv_scale", ckv_scale), check_scale("kpe_scale", kpe_scale)
        scales = None
        if ckv_scale is not None or kpe_scale is not None:  # f32[2]; a missing one is 1
            scales = jnp.stack([jnp.float32(1.0) if x is None else x for x in (ckv_scale, kpe_scale)])
        layout, h, dc, dr = plan.layout, self.num_heads, self.head_dim_ckv, self.head_dim_kpe
        t = q_nope.shape[0]
        if t == 0:  # an empty step without capacities: no kernel
            o = jnp.zeros((0, h, dc), q_nope.dtype)
            return AttentionState(o, jnp.zeros((0, h), jnp.float32)) if return_lse else o
        sec = plan.sections()
        implementation = dispatch.IMPLEMENTATIONS_BY_NAME[plan.impl]
        o, lse, o_part, lse_part = implementation.kernel(
            q_nope.reshape(t * h, dc), q_pe.reshape(t * h, dr), ckv_cache.reshape(-1, dc),
            kpe_cache.reshape(-1, dr), sec["kv_indices"], sec["items"], sec["cell_indptr"],
            columns=mla_planner.COLUMNS, num_parts=layout.part_cap, num_heads=h, page_size=self.page_size,
            sm_scale=self.sm_scale, causal=plan.causal, block_rows=layout.block_rows,
            interpret=self.interpret, config=self.config, scales=scales)
        if layout.group_cap:  # split tiles: their rows' partial states merged into o / lse in place
            m = layout.block_rows if layout.tile_merge else 1  # rows merged together (whole tiles: M)
            o, lse = merge_kernels.merge_varlen(
                o_part.reshape(-1, m, dc), lse_part.reshape(-1, m), sec["merge_indptr"], sec["merge_dest"],
                out=(o.reshape(-1, m, dc), lse.reshape(-1, m)), interpret=self.interpret,
                num_programs=min(layout.group_cap, 4 * layout.num_cells), num_live=sec["num_groups"][0])
        o, lse = o.reshape(t, h, dc), lse.reshape(t, h)
        return AttentionState(o, lse) if return_lse else o

    def _check(self, q_nope, q_pe, ckv_cache, kpe_cache, plan):
        if not isinstance(plan, MLAPlan):
            raise ValueError("plan must be an MLAPlan from BatchMLAPagedAttention.plan()")
        plan.spec.check(self.facts)
        if plan.causal != self.causal:
            raise ValueError(f"plan was made with causal={plan.causal}, the wrapper has causal={self.causal}")
        h, dc, dr, p = self.num_heads, self.head_dim_ckv, self.head_dim_kpe, self.page_size
        args = dict(q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv_cache, kpe_cache=kpe_cache)
        for name, x in args.items():
            if not hasattr(x, "dtype") or not hasattr(x, "shape"):
                raise ValueError(f"{name} must be an array, got {type(x).__name__}")
        check_q(q_nope, "q_nope")
        if q_pe.dtype != q_nope.dtype:
            raise ValueError(f"q_pe dtype {q_pe.dtype} must match q_nope's {q_nope.dtype}")
        check_kv_dtype(q_nope.dtype, ckv_cache.dtype, "ckv_cache")
        if kpe_cache.dtype != ckv_cache.dtype:
            raise ValueError(f"kpe_cache dtype {kpe_cache.dtype} must match ckv_cache's {ckv_cache.dtype}")
        why = dispatch.IMPLEMENTATIONS_BY_NAME[plan.impl].dtypes_unsupported(q_nope.dtype, ckv_cache.dtype)
        if why is not None:
            raise ValueError(f"ckv_cache: {why} (the plan's kernel {plan.impl}; plan() takes q_dtype / kv_dtype)")
        t = plan.layout.num_tokens
        for name, x, want in (("q_nope", q_nope, (t, h, dc)), ("q_pe", q_pe, (t, h, dr))):
            if tuple(x.shape) != want:
                raise ValueError(f"{name} must have shape [T={t}, num_heads={h}, {want[2]}], got {tuple(x.shape)}")
        for name, x, d in (("ckv_cache", ckv_cache, dc), ("kpe_cache", kpe_cache, dr)):
            if x.ndim != 3 or tuple(x.shape[1:]) != (p, d):
                raise ValueError(f"{name} must have shape [num_pages, page_size={p}, {d}], got {tuple(x.shape)}")
        if ckv_cache.shape[0] != kpe_cache.shape[0]:
            raise ValueError(f"ckv_cache has {ckv_cache.shape[0]} pages, kpe_cache {kpe_cache.shape[0]}")
        plan.spec.check_rows(ckv_cache.shape[0], "ckv_cache")
