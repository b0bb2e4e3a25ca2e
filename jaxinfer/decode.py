"""Batch decode over a paged KV cache: plan() on the host, run() compiled once.

The decode path in three files: this wrapper, its planner (planner/decode.py: split-KV work items
balanced by Algorithm 1, or contiguous page ranges per cell) and its kernel (pallas_kernels/decode.py).
"""
import jax.numpy as jnp
import numpy as np

from jaxinfer import _backend, dispatch, transfer, variants
from jaxinfer.cascade import MultiLevelCascadeAttention
from jaxinfer.formats import (AttentionState, check_int32, check_layout, check_paged_cache, check_q,
                              default_sm_scale, is_concrete, kv_scales)
from jaxinfer.plans import CascadePlan, DecodePlan, WrapperFacts
from jaxinfer.prefill import auto_cascade_levels
from jaxinfer.runners import run_decode_sections
from pallas_kernels import decode as decode_kernels
from planner import decode as decode_planner
from planner import validate


class BatchDecodeWithPagedKVCache:
    """Batch decode (one query token per request) over a PagedKVCache.

        dec = BatchDecodeWithPagedKVCache(32, 8, 128, 16)
        plan = dec.plan(kv_indptr, kv_indices, kv_last_page_len, num_pages=cache.num_pages)
        o = dec.run(q, kv_cache, plan)                             # pure; jit it; every layer

    max_batch_size / max_num_pages fix the plan's shapes (q then has
    max_batch_size rows; rows past the batch give o = 0), so one compiled run()
    serves every step. num_ctas (default 2 x SM count) sets the grid: cells =
    num_ctas // num_kv_heads (all resident at once). fixed_split_pages: batch-invariant outputs.
    variant: a jaxinfer.AttentionVariant (static; the query sits at position kv_len - 1);
    run(..., variant_params=) takes its parameters as data. fp8 pages (float8_e4m3fn /
    e5m2) take run(..., k_scale=, v_scale=): scalars or [Hkv] arrays.
    config: a jaxinfer.DecodeConfig tuning the kernel (and, for cascade="auto" plans, a
    PrefillConfig / MosaicPrefillConfig for the cascade's levels: a tuple for several).
    """

    def __init__(self, num_qo_heads, num_kv_heads, head_dim, page_size, *, layout="NHD",
                 max_batch_size=None, max_num_pages=None, sm_scale=None, num_ctas=None,
                 fixed_split_pages=None, backend=None, variant=None, config=None):
        variants.check_variant(variant)
        if num_kv_heads < 1 or num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if head_dim < 1:
            raise ValueError(f"head_dim must be >= 1, got {head_dim}")
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.page_size, self.layout = page_size, check_layout(layout)
        self.max_batch_size, self.max_num_pages = max_batch_size, max_num_pages
        self.sm_scale = default_sm_scale(head_dim, sm_scale)
        ctas = num_ctas or 2 * _backend.num_sms()
        self.num_cells = max(1, ctas // num_kv_heads)  # all cells resident at once: no tail wave
        self.fixed_split_pages = fixed_split_pages
        self.interpret = _backend.use_interpret(backend)
        self.variant, self.configs = variant, dispatch.check_configs(config)
        self.problem = dispatch.Problem("decode", num_qo_heads, num_kv_heads, head_dim, "paged", page_size,
                                        layout, variant, interpret=self.interpret)
        dispatch.check(self.problem)
        self.facts = WrapperFacts(type(self).__name__, num_qo_heads, num_kv_heads, head_dim, page_size,
                                  layout, (max_batch_size, max_num_pages))
        self._cascade = None

    def plan(self, kv_indptr, kv_indices, kv_last_page_len, *, num_pages=None, horizon=1, cascade=None):
        """Plans one decode step from a host CSR page table (int32 NumPy arrays).

        num_pages: the cache's page count (required): page ids outside [0, num_pages) are
        rejected, and run() rejects a cache with fewer pages.
        horizon=K: the page table describes the lengths at the last of K steps
        (pages allocated ahead); run() at step s takes kv_lens=plan.kv_lens_at(s),
        so a lax.scan over K steps needs this one plan.
        cascade="auto": when consecutive requests begin with the same pages and the cost model
        says it pays, returns a two-level CascadePlan (shared prefixes read once for all their
        queries); run() takes either kind of plan.
        """
        if not isinstance(horizon, (int, np.integer)) or horizon < 1:
            raise ValueError(f"horizon must be an int >= 1, got {horizon!r}")
        if cascade not in (None, "auto"):
            raise ValueError(f"cascade must be None or 'auto', got {cascade!r}")
        num_pages = validate.check_num_pages(num_pages)
        if cascade == "auto" and horizon != 1:
            raise ValueError("cascade='auto' plans a single step (horizon=1)")
        # The only check of this page table; its page ids are checked on the plan's copy, unless
        # cascade="auto" reads them first.
        table = validate.check_page_table(kv_indptr, kv_indices, kv_last_page_len, self.page_size,
                                          num_pages if cascade == "auto" else None)
        if cascade == "auto":
            kv_indptr, kv_indices, kv_last_page_len = table[:3]
            levels = auto_cascade_levels(None, kv_indptr, kv_indices, kv_last_page_len, self.page_size,
                                         causal=False, problem=self.problem)
            if levels is not None:
                return self._cascade_wrapper().plan(levels, num_pages=num_pages)
        layout, buf, info = decode_planner.plan_decode_checked(
            table, page_size=self.page_size, num_cells=self.num_cells,
            num_pages=None if cascade == "auto" else num_pages, max_batch_size=self.max_batch_size,
            max_num_pages=self.max_num_pages, fixed_split_pages=self.fixed_split_pages)
        info["kv_lens"] = table[3]  # run(kv_lens=) checks against it
        # The spec depends on num_pages alone (one decode kernel, chosen without lengths): cached.
        spec = getattr(self, "_spec", None)
        if spec is None or spec.num_pages != num_pages:
            spec = self._spec = self.facts.spec(num_pages, dispatch.choose(self.problem, None, None, False).name)
        return DecodePlan(transfer.plan_sections(buf, layout), layout, spec, int(horizon), info=info)

    def run(self, q, kv_cache, plan, *, kv_lens=None, return_lse=False, variant_params=None,
            k_scale=None, v_scale=None, append_kv=None):
        """q [B, Hq, D] -> o [B, Hq, D], or AttentionState(o, lse [B, Hq]) with return_lse.

        kv_lens (int32[B], optional, may be traced): live lengths, each at most the planned
        length (checked when concrete); defaults to the plan's lengths (DecodePlan only).
        append_kv (k, v) [B, Hkv, D] (optional; a DecodePlan, no variant, K/V pages in q's
        dtype): this step's new K/V of each request, written at its last position (length - 1)
        by the decode kernel itself, which attends to it in the same launch (one launch where
        append_paged_kv_cache + run() take three); returns (o or AttentionState, the updated
        PagedKVCache), in place when the cache is donated. Rows whose length is 0 write nothing.
        append_kv="from_q": q is [B, Hq + 2 Hkv, D], each request's query heads, then its new key
        heads, then its new value heads (a fused QKV projection's output, RoPE applied), read in
        place: no slices of it are materialized; o is still [B, Hq, D].
        """
        if isinstance(plan, CascadePlan):
            if kv_lens is not None:
                raise ValueError("kv_lens needs a DecodePlan; a cascade plan serves one step")
            if append_kv is not None:
                raise ValueError("append_kv needs a DecodePlan; with a cascade plan use append_paged_kv_cache")
            return self._cascade_wrapper().run(q, kv_cache, plan, return_lse=return_lse,
                                               variant_params=variant_params, k_scale=k_scale,
                                               v_scale=v_scale)
        variants.check_variant(self.variant, return_lse)
        params = None if self.variant is None else self.variant.check_params(variant_params)
        self._check(q, kv_cache, plan, fused=isinstance(append_kv, str) and append_kv == "from_q")
        if append_kv is not None:
            append_kv = self._check_append(q, kv_cache, append_kv, k_scale, v_scale)
        sec = plan.sections()
        lens = sec["kv_lens"] if kv_lens is None else self._check_kv_lens(kv_lens, plan)
        if q.shape[0] == 0:  # batch 0 without capacities: empty outputs, no kernel
            shape = (0, self.num_qo_heads, self.head_dim)
            empty = AttentionState(jnp.zeros(shape, q.dtype), jnp.zeros(shape[:2], jnp.float32))
            empty = empty if return_lse else empty.o
            return empty if append_kv is None else (empty, kv_cache)
        k_rows, v_rows = kv_cache.rows()
        o, lse, *rows = run_decode_sections(
            q, k_rows, v_rows, sec, plan.page_ids(sec, kv_cache.num_pages), lens, plan.layout,
            page_size=self.page_size, num_kv_heads=self.num_kv_heads, cache_layout=self.layout,
            sm_scale=self.sm_scale, interpret=self.interpret,
            config=dispatch.config_for(dispatch.IMPLEMENTATIONS_BY_NAME[plan.impl], self.problem, self.configs),
            scales=kv_scales(k_scale, v_scale, kv_cache.dtype, self.num_kv_heads),
            variant=self.variant, params=params, append=append_kv)
        out = variants.finish(self.variant, params, o, lse, return_lse)
        out = AttentionState(*out) if return_lse else out
        if append_kv is None:
            return out
        return out, kv_cache.with_rows(rows)

    def _check_append(self, q, kv_cache, append_kv, k_scale, v_scale):
        """append_kv as a (k, v) pair of [B, Hkv, D] arrays in the cache's dtype, or "from_q";
        ValueError otherwise."""
        fused = isinstance(append_kv, str)
        if fused and append_kv != "from_q" or not fused and (
                not isinstance(append_kv, (tuple, list)) or len(append_kv) != 2):
            raise ValueError(f"append_kv must be a (k, v) pair or 'from_q', got {type(append_kv).__name__}"
                             f"{' ' + repr(append_kv) if fused else ''}")
        if self.variant is not None:
            raise ValueError("append_kv runs without a variant; use append_paged_kv_cache")
        if k_scale is not None or v_scale is not None or jnp.dtype(kv_cache.dtype) != jnp.dtype(q.dtype):
            raise ValueError(f"append_kv needs K/V pages in q's dtype ({jnp.dtype(q.dtype).name}) without "
                             f"scales, got {jnp.dtype(kv_cache.dtype).name}; use append_paged_kv_cache")
        if fused:
            return append_kv
        expect = (q.shape[0], self.num_kv_heads, self.head_dim)
        for name, x in zip("kv", append_kv):
            if not hasattr(x, "shape") or tuple(x.shape) != expect:
                raise ValueError(f"append_kv's {name} must have shape {expect}, got {getattr(x, 'shape', x)}")
        return tuple(jnp.asarray(x).astype(kv_cache.dtype) for x in append_kv)

    def _check_kv_lens(self, kv_lens, plan):
        check_int32("kv_lens", kv_lens)  # before jnp.asarray, which would make int64 int32 silently
        lens = jnp.asarray(kv_lens)
        if lens.dtype != jnp.int32 or lens.shape != (plan.layout.batch,):
            raise ValueError(f"kv_lens must be int32[{plan.layout.batch}], got {lens.dtype}{list(lens.shape)}")
        planned = plan.info.get("kv_lens")  # host copy, when this is the plan() object itself
        if planned is not None and is_concrete(kv_lens):
            if np.any(np.asarray(kv_lens)[: planned.shape[0]] > planned) or np.any(np.asarray(kv_lens) < 0):
                raise ValueError("kv_lens must lie in [0, the planned lengths] (plan a longer horizon)")
        return lens

    def _cascade_wrapper(self):
        """The two-level cascade used by plan(cascade="auto"): this wrapper's shapes, capacities
        and options."""
        if self._cascade is None:
            self._cascade = MultiLevelCascadeAttention(
                2, self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size, causal=False,
                layout=self.layout, sm_scale=self.sm_scale, max_batch_size=self.max_batch_size,
                max_num_tokens=self.max_batch_size, max_num_pages=self.max_num_pages,
                num_ctas=self.num_cells * self.num_kv_heads, variant=self.variant,
                backend="interpret" if self.interpret else "gpu",
                config=tuple(c for c in self.configs if not isinstance(c, decode_kernels.DecodeConfig)))
        return self._cascade

    def _check(self, q, kv_cache, plan, fused=False):
        """fused: q holds the new K/V heads after its query heads (append_kv="from_q")."""
        if not isinstance(plan, DecodePlan):
            raise ValueError("plan must be a DecodePlan from BatchDecodeWithPagedKVCache.plan()")
        plan.spec.check(self.facts)
        check_q(q)
        heads = self.num_qo_heads + (2 * self.num_kv_heads if fused else 0)
        expect_q = (plan.layout.batch, heads, self.head_dim)
        if tuple(q.shape) != expect_q:
            raise ValueError(f"q must have shape {expect_q}{' (Hq + 2 Hkv heads: append_kv=from_q)' if fused else ''}, "
                             f"got {q.shape}")
        check_paged_cache(kv_cache, q, self.page_size, self.num_kv_heads, self.head_dim, self.layout)
        plan.spec.check_rows(kv_cache.num_pages, "kv_cache")
