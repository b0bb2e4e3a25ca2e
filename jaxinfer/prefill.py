"""Batch prefill over paged, ragged and block-sparse KV: plan() on the host, run() compiled once."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import _backend, dispatch, transfer, variants
from jaxinfer.formats import (AttentionState, BlockSparseMatrix, check_int32, check_kv_dtype, check_q,
                              check_layout, check_paged_cache, check_qkv, default_sm_scale, kv_scales,
                              two_level_cascade)
from jaxinfer.plans import BatchPlan, CascadePlan, PrefillPlan, WrapperFacts
from jaxinfer.runners import run_prefill_sections, run_short_sections
from jaxinfer.state import merge_state
from pallas_kernels import merge as merge_kernels
from planner import batch as batch_planner
from planner import prefill as prefill_planner
from planner import prefix as prefix_planner
from planner import validate


def _flat_mask(custom_mask, packed_custom_mask, qo_lens, kv_lens, max_mask_len):
    """The custom mask (bool, or little-endian bit-packed) as int8 plus each request's offset."""
    sizes = qo_lens.astype(np.int64) * kv_lens.astype(np.int64)
    total = int(sizes.sum())
    if packed_custom_mask is not None:
        packed = np.asarray(packed_custom_mask)
        if packed.dtype != np.uint8 or packed.ndim != 1 or packed.size * 8 < total:
            raise ValueError(f"packed_custom_mask must be uint8[>= {-(-total // 8)}] (little-endian bits)")
        flat = np.unpackbits(packed, count=total, bitorder="little")
    else:
        flat = np.asarray(custom_mask)
        if flat.ndim != 1 or flat.size != total:
            raise ValueError(f"custom_mask must be flat with sum(qo_len * kv_len) = {total} entries, "
                             f"got shape {flat.shape}")
    cap = max(total, 1) if max_mask_len is None else int(max_mask_len)
    if total > cap:
        raise ValueError(f"custom_mask has {total} entries, over max_mask_len={cap}")
    mask = np.zeros(cap, np.int8)
    mask[:total] = flat.astype(bool)
    return mask, np.cumsum(sizes) - sizes


PREFILL_CTAS_PER_SM = 16


class _Prefill:
    """Shared plan/run machinery of the prefill wrappers."""

    def __init__(self, num_qo_heads, num_kv_heads, head_dim, *, kv_format, page_size=1, layout="NHD",
                 causal, max_batch_size=None, max_num_tokens=None, max_num_pages=None, sm_scale,
                 num_ctas, fixed_split_tokens=None, max_mask_len=None, backend, tile_rows, variant,
                 impl="auto", config=None, fixed_shapes=None, head_dim_vo=None):
        variants.check_variant(variant)
        if num_kv_heads < 1 or num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if head_dim < 1:
            raise ValueError(f"head_dim must be >= 1, got {head_dim}")
        if head_dim_vo is not None and (isinstance(head_dim_vo, bool) or not isinstance(
                head_dim_vo, (int, np.integer)) or head_dim_vo < 1):
            raise ValueError(f"head_dim_vo must be a positive int or None, got {head_dim_vo!r}")
        # V and o's head_dim; None in the problem and facts where it is head_dim
        self.head_dim_vo = head_dim if head_dim_vo is None else int(head_dim_vo)
        distinct_vo = None if self.head_dim_vo == head_dim else self.head_dim_vo
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if tile_rows is not None and tile_rows not in prefill_planner.TILE_ROWS:
            raise ValueError(f"tile_rows must be one of {prefill_planner.TILE_ROWS}, got {tile_rows}")
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.group = num_qo_heads // num_kv_heads
        self.page_size, self.layout = page_size, check_layout(layout)
        self.causal = causal
        self.max_batch_size, self.max_num_tokens, self.max_num_pages = max_batch_size, max_num_tokens, max_num_pages
        self.sm_scale = default_sm_scale(head_dim, sm_scale)
        self.interpret = _backend.use_interpret(backend)
        # Measured on H100 (BENCHMARKS.md): 16 CTAs per SM, several waves the hardware rebalances,
        # beat 2 (all resident, balanced by Algorithm 1 alone) by 4-29%. Interpret mode keeps a
        # small grid: it runs the grid serially on the CPU.
        ctas = num_ctas or (2 if self.interpret else PREFILL_CTAS_PER_SM) * _backend.num_sms()
        self.num_cells = max(1, ctas // num_kv_heads)
        # Short-query plans run the decode kernel: all of its cells resident at once (2 per SM).
        self.short_cells = max(1, (num_ctas or 2 * _backend.num_sms()) // num_kv_heads)
        self.fixed_split_tokens, self.max_mask_len, self.tile_rows = fixed_split_tokens, max_mask_len, tile_rows
        # Every capacity given: each plan has the same structure and shapes (one compiled run()).
        all_caps = kv_format == "paged" and None not in (max_batch_size, max_num_tokens, max_num_pages)
        if fixed_shapes and not all_caps:
            raise ValueError("fixed_shapes=True needs max_batch_size, max_num_tokens and max_num_pages")
        self.fixed_shapes = all_caps if fixed_shapes is None else bool(fixed_shapes)
        if self.fixed_shapes and tile_rows is None:
            self.tile_rows = prefill_planner.fixed_tile_rows(self.group)
        self.often_empty = False  # BatchAttention's long class: steps often have none (dispatch._fixed_choice)
        self.variant, self.impl = variant, impl
        self.configs = dispatch.check_configs(config)
        self.problem = dispatch.Problem("prefill", num_qo_heads, num_kv_heads, head_dim, kv_format,
                                        page_size, layout, variant, interpret=self.interpret,
                                        head_dim_vo=distinct_vo)
        dispatch.check(self.problem, impl)
        self._candidates = {}  # dispatch.candidates by custom_mask
        self.facts = WrapperFacts(type(self).__name__, num_qo_heads, num_kv_heads, head_dim, page_size,
                                  layout, (max_batch_size, max_num_tokens, max_num_pages, max_mask_len),
                                  head_dim_vo=distinct_vo)

    def plan_step(self, qo_indptr, kv_lens, page_base, kv_indices, custom_mask, packed_custom_mask, num_pages,
                  causal=None, window_left=None, contiguous_kv=False, dtypes=None, kv_pos_offset=None,
                  q_positions=None):
        """The plan of one step from checked metadata (a page table's or K/V rows'), for the wrappers
        built on this one. dtypes: dispatch.plan_dtypes' (q, K/V) pair, or None: a Mosaic plan then
        carries a Triton plan for dtypes Mosaic cannot take. kv_pos_offset, q_positions: the keys'
        and queries' positions (cascade levels, block-sparse rows; planner.prefill.plan_prefill)."""
        positions = kv_pos_offset is not None or q_positions is not None
        qo_indptr, qo_lens, _ = validate.indptr_lengths("qo_indptr", qo_indptr)  # the only check of it
        if qo_indptr.shape[0] != kv_lens.shape[0] + 1:  # before any planner (prefill_short too)
            raise ValueError(f"qo_indptr describes {qo_indptr.shape[0] - 1} requests but the KV side has "
                             f"{kv_lens.shape[0]}")
        if window_left is not None and not (self.variant is not None and self.variant.has_bounds):
            raise ValueError("window_left needs a variant with a sliding window (variants.sliding_window)")
        causal = self.causal if causal is None else causal
        problem, mask, offsets = self.problem, None, None
        if custom_mask is not None or packed_custom_mask is not None:
            mask, offsets = _flat_mask(custom_mask, packed_custom_mask, qo_lens, kv_lens, self.max_mask_len)
            causal = False  # the custom mask replaces the causal mask
            problem = dataclasses.replace(problem, custom_mask=True)
        rows = self._candidates.get((problem.custom_mask, dtypes))  # static per wrapper, mask, dtypes
        if rows is None:
            rows = self._candidates[problem.custom_mask, dtypes] = dispatch.candidates(problem, self.impl, dtypes)
        # Cascade levels need their positions, a pinned tile_rows one Triton program: no short path.
        choice = dispatch.choose(problem, qo_lens, kv_lens, causal, self.impl, rows=rows,
                                 fixed_shapes=self.fixed_shapes, often_empty=self.often_empty,
                                 without=("prefill_short",) if positions or self.tile_rows is not None else ())
        if choice.name == "prefill_short":
            return self._plan_short(qo_indptr, qo_lens, kv_lens, page_base, kv_indices, num_pages, causal, dtypes)
        tails = choice.whole_tiles
        specs = self.__dict__.setdefault("_specs", {})  # PlanSpec by (num_pages, impl, dtypes): made once
        if len(specs) > 16:
            specs.clear()

        def plan_for(tails, impl_name, alt=None):
            layout, buf, info = prefill_planner.plan_prefill(
                qo_indptr, kv_lens, page_base, kv_indices, group=self.group, causal=causal, qo_lens=qo_lens,
                num_cells=self.num_cells, max_num_tokens=self.max_num_tokens,
                max_batch_size=self.max_batch_size, max_num_pages=self.max_num_pages,
                rows=(dispatch.config_for(choice, problem, self.configs).tile_tokens * self.group if tails
                      else self.tile_rows),
                mask_offsets=offsets, fixed_split_tokens=self.fixed_split_tokens, window_left=window_left,
                tails=tails, contiguous_kv=contiguous_kv, kv_pos_offset=kv_pos_offset,
                q_positions=q_positions)
            dev_mask = None if mask is None else jax.device_put(mask, may_alias=True)
            spec = specs.get((num_pages, impl_name, dtypes))
            if spec is None:
                spec = specs[num_pages, impl_name, dtypes] = self.facts.spec(num_pages, impl_name, dtypes)
            return PrefillPlan(transfer.plan_sections(buf, layout), dev_mask, layout, causal, spec, alt,
                               info=info)

        fallback = dispatch.fallback(choice, self.impl, dtypes)  # (on a GPU host: twice plan()'s cost)
        alt = None if fallback is None else plan_for(False, fallback.name)
        return plan_for(tails, choice.name, alt)

    def _plan_short(self, qo_indptr, qo_lens, kv_lens, page_base, kv_indices, num_pages, causal, dtypes=None):
        """Every request short: the decode kernel's multi-token items (planner.batch)."""
        tokens, is_short = batch_planner.short_tokens(qo_lens, self.group)
        if not np.all(is_short | (qo_lens == 0)):  # dispatch's rule and the planner's must agree
            raise AssertionError("prefill_short chosen for a step with long requests")
        nnz = int(qo_indptr[-1])
        layout, buf, info = batch_planner.plan_short(
            qo_indptr, kv_lens, page_base, kv_indices, is_short, page_size=self.page_size,
            num_cells=self.short_cells, tokens_per_item=tokens,
            num_tokens=nnz if self.max_num_tokens is None else int(self.max_num_tokens),
            batch_cap=kv_lens.shape[0] if self.max_batch_size is None else int(self.max_batch_size),
            index_cap=max(kv_indices.shape[0], 1) if self.max_num_pages is None else int(self.max_num_pages))
        return BatchPlan(transfer.plan_sections(buf, layout), layout,
                         self.facts.spec(num_pages, "prefill_short", dtypes), causal=causal, info=info)

    def _run_raw(self, q, k_rows, v_rows, plan, variant_params, scales, num_rows, kv_name, facts=None,
                 **cache_kw):
        """(o, lse) of one PrefillPlan, before the variant's output transform. num_rows: pages (or
        K/V rows) the cache holds; kv_name names it in errors."""
        if not isinstance(plan, (PrefillPlan, BatchPlan)):
            raise ValueError(f"plan must be a PrefillPlan from {type(self).__name__}.plan()")
        plan.spec.check(facts or self.facts)
        plan.spec.check_rows(num_rows, kv_name)
        plan.spec.check_dtypes(q.dtype, k_rows.dtype, kv_name)
        check_q(q)
        expect = (plan.layout.num_tokens, self.num_qo_heads, self.head_dim)
        if tuple(q.shape) != expect:
            raise ValueError(f"q must have shape {expect}, got {q.shape}")
        if q.shape[0] == 0:  # no query rows (batch 0 or every qo_len 0, no capacities): no kernel
            return (jnp.zeros((0, self.num_qo_heads, self.head_dim_vo), q.dtype),
                    jnp.full(q.shape[:2], -jnp.inf, jnp.float32))
        if isinstance(plan, BatchPlan):  # impl "prefill_short"
            sec = plan.sections()
            return run_short_sections(
                q, k_rows, v_rows, sec, plan.page_ids(sec, num_rows), plan.layout,
                page_size=cache_kw["page_size"], num_kv_heads=self.num_kv_heads,
                cache_layout=cache_kw["cache_layout"], sm_scale=self.sm_scale, interpret=self.interpret,
                causal=plan.causal, scales=scales, variant=self.variant, params=variant_params,
                config=dispatch.config_for(dispatch.IMPLEMENTATIONS_BY_NAME["prefill_short"], self.problem,
                                           self.configs))
        if plan.alt is not None and dispatch.runs_on_fallback(plan.spec.impl, q.dtype, k_rows.dtype,
                                                              scales is not None):
            plan = plan.alt
        implementation = dispatch.IMPLEMENTATIONS_BY_NAME[plan.spec.impl]
        return run_prefill_sections(
            q, k_rows, v_rows, plan, None if cache_kw.get("contiguous") else plan.page_ids(plan.sections(), num_rows),
            page_size=cache_kw["page_size"], num_kv_heads=self.num_kv_heads,
            cache_layout=cache_kw["cache_layout"], sm_scale=self.sm_scale, interpret=self.interpret,
            kernel=implementation.kernel,
            config=dispatch.config_for(implementation, self.problem, self.configs), scales=scales,
            variant=self.variant, params=variant_params, global_kv_pos=cache_kw.get("global_kv_pos", False),
            merge_programs=None if self.max_num_tokens is None else merge_kernels.LOOP_PROGRAMS)

    def _params(self, variant_params, return_lse):
        variants.check_variant(self.variant, return_lse)
        return None if self.variant is None else self.variant.check_params(variant_params)

    def _finish(self, state, params, return_lse):
        out = variants.finish(self.variant, params, *state, return_lse)
        return AttentionState(*out) if return_lse else out

    def _check_kv(self, q, k, v, name="k"):
        check_q(q)
        if not hasattr(k, "shape") or not hasattr(v, "shape"):
            raise ValueError(f"{name} and v must be arrays [n, {self.num_kv_heads}, {self.head_dim}]")
        if k.shape[:-1] != v.shape[:-1] or k.dtype != v.dtype:
            raise ValueError(f"{name} {k.shape} {k.dtype} and v {v.shape} {v.dtype} must match")
        if k.ndim != 3 or k.shape[1:] != (self.num_kv_heads, self.head_dim):
            raise ValueError(f"{name} must be [n, {self.num_kv_heads}, {self.head_dim}], got {k.shape}")
        if v.shape[2] != self.head_dim_vo:
            raise ValueError(f"v must be [n, {self.num_kv_heads}, head_dim_vo={self.head_dim_vo}], got {v.shape}")
        check_kv_dtype(q.dtype, k.dtype, name)


_DOC_COMMON = """
    causal: bottom-right aligned; a custom mask, when given, replaces it. Rows that see no
    key give o = 0 and lse = -inf. max_batch_size / max_num_tokens (/ max_num_pages,
    max_mask_len) fix the plan's shapes, so run() compiles at most once per tile height
    (16, 32, 64 or 128 rows, chosen per step from the average query length), and once per
    short-token class when every request is short (impl "prefill_short", the decode kernel);
    tile_rows pins one Triton program. A paged wrapper given all three capacities makes every plan
    of one structure and shapes (one compilation): one kernel (Mosaic where it runs, else Triton),
    tile_rows (default 64) for every step; fixed_shapes=False keeps each step's own kernel. With max_num_tokens, q has that many rows and rows past the batch give 0.
    head_dim_vo (default head_dim): the head_dim of V and o, where it differs from q and K's
    (DeepSeek's prefill: 192 / 128); such wrappers run on the Mosaic kernel on Hopper (head dims
    that are multiples of 64), else on Triton.
    variant: a jaxinfer.AttentionVariant (static); run(..., variant_params=) takes its
    parameters as data. K/V may be fp8 (float8_e4m3fn / e5m2) with run(..., k_scale=,
    v_scale=): scalars (per tensor) or [Hkv] arrays (per head).
    plan(..., window_left=w): a sliding window known at plan time (w >= the window passed in
    variant_params): only keys inside it are planned and balanced across the grid.
    num_ctas (default 16 x SM count on the GPU) sets the grid: cells = num_ctas // num_kv_heads.
    config: kernel tuning, a jaxinfer.PrefillConfig (Triton) and/or MosaicPrefillConfig (a tuple
    for both). impl picks the kernel (jaxinfer.dispatch decides for "auto"; plan.impl names it): "mosaic",
    the Hopper kernel (Mosaic GPU: TMA, wgmma, warp-specialized; 16-bit q/K/V, NHD, head_dim a
    multiple of 64, page_size a multiple of 8 dividing 128 or a multiple of 128, no custom
    mask, fp8, or variant query / key transforms (RoPE); ValueError otherwise): 128-token tiles
    of one query head, one per CTA, KV never split, 1.2-1.5x the Triton kernel on H100
    (BENCHMARKS.md); "triton", the Pallas-Triton kernel, every feature;
    "auto" (default): of the kernels that can run the plan (Mosaic: compiled on a Hopper GPU,
    no variant or built-in ones only: soft-cap, window, ALiBi, sigmoid, sinks), the one the
    cost model expects faster for the step's lengths (Mosaic plans then hold a Triton plan too,
    which run() uses for other dtypes)."""



class BatchPrefillWithPagedKVCache(_Prefill):
    __doc__ = """Prefill / append (many query tokens per request) over a PagedKVCache.

        pre = BatchPrefillWithPagedKVCache(32, 8, 128, 16)
        plan = pre.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, num_pages=cache.num_pages)
        o = pre.run(q, kv_cache, plan)                      # q, o: [nnz, Hq, D]
""" + _DOC_COMMON

    def __init__(self, num_qo_heads, num_kv_heads, head_dim, page_size, *, causal=True, layout="NHD",
                 max_batch_size=None, max_num_tokens=None, max_num_pages=None, sm_scale=None,
                 num_ctas=None, fixed_split_tokens=None, max_mask_len=None, backend=None,
                 tile_rows=None, variant=None, impl="auto", config=None, fixed_shapes=None, head_dim_vo=None):
        super().__init__(num_qo_heads, num_kv_heads, head_dim, kv_format="paged", page_size=page_size,
                         layout=layout, causal=causal, max_batch_size=max_batch_size,
                         max_num_tokens=max_num_tokens, max_num_pages=max_num_pages, sm_scale=sm_scale,
                         num_ctas=num_ctas, fixed_split_tokens=fixed_split_tokens,
                         max_mask_len=max_mask_len, backend=backend, tile_rows=tile_rows,
                         variant=variant, impl=impl, config=config, fixed_shapes=fixed_shapes,
                         head_dim_vo=head_dim_vo)

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, *, num_pages=None, custom_mask=None,
             packed_custom_mask=None, causal=None, cascade=None, window_left=None, q_data_type=None,
             kv_data_type=None):
        """Plans one step from host arrays (int32 CSR page table, as for decode).

        num_pages: the cache's page count (required): page ids outside [0, num_pages) are
        rejected, and run() rejects a cache with fewer pages.
        custom_mask: each request's qo_len x kv_len boolean mask, row-major, concatenated;
        packed_custom_mask: the same bits packed with np.packbits(..., bitorder="little").
        causal (optional) overrides the wrapper's setting for this plan.
        cascade="auto": a two-level CascadePlan when requests share leading pages (before
        all of their queries) and the cost model (dispatch.cascade_pays) says it pays.
        q_data_type / kv_data_type (as FlashInfer's; kv defaults to q): the dtypes run() will get,
        so the plan is made for the one kernel that runs them; run() rejects others. Without them
        a Mosaic plan carries a Triton plan for dtypes Mosaic cannot take (two plans' cost).
        """
        dtypes = dispatch.plan_dtypes(q_data_type, kv_data_type)
        if cascade not in (None, "auto"):
            raise ValueError(f"cascade must be None or 'auto', got {cascade!r}")
        num_pages = validate.check_num_pages(num_pages)
        causal = self.causal if causal is None else causal
        if cascade == "auto" and custom_mask is None and packed_custom_mask is None:
            levels = auto_cascade_levels(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, self.page_size,
                                         causal=causal, problem=self.problem)
            if levels is not None:
                return self.plan_levels(levels, num_pages=num_pages, causal=causal, q_data_type=q_data_type,
                                        kv_data_type=kv_data_type)
        kv_indptr, kv_indices, _, kv_lens, _ = validate.check_page_table(
            kv_indptr, kv_indices, kv_last_page_len, self.page_size, num_pages)
        used = kv_indices[: kv_indptr[-1]]
        return self.plan_step(qo_indptr, kv_lens, kv_indptr[:-1], used, custom_mask, packed_custom_mask,
                          num_pages, causal, window_left, dtypes=dtypes)

    def plan_levels(self, levels, *, num_pages=None, causal=None, q_data_type=None, kv_data_type=None):
        """A CascadePlan over levels (qo_indptr, kv_indptr, kv_indices, kv_last_page_len) of
        the same queries; causal (default: the wrapper's) applies to the last level only.
        Variants see each key at its position in the request's whole sequence. q_data_type,
        kv_data_type: as plan()."""
        dtypes = dispatch.plan_dtypes(q_data_type, kv_data_type)
        num_pages = validate.check_num_pages(num_pages)
        causal = self.causal if causal is None else causal
        qo_indptrs, tables = [], []
        for i, (qo_indptr, kv_indptr, kv_indices, kv_last_page_len) in enumerate(levels):
            qo_indptrs.append(validate.check_indptr(f"levels[{i}].qo_indptr", qo_indptr))
            if int(qo_indptrs[i][-1]) != int(qo_indptrs[0][-1]):
                raise ValueError(f"levels[{i}].qo_indptr covers {int(qo_indptrs[i][-1])} rows, "
                                 f"level 0 covers {int(qo_indptrs[0][-1])}")
            tables.append(validate.check_page_table(kv_indptr, kv_indices, kv_last_page_len,
                                                    self.page_size, num_pages))
            if tables[i][0].shape[0] != qo_indptrs[i].shape[0]:
                raise ValueError(f"levels[{i}]: qo_indptr and kv_indptr describe different group counts")
        offsets, q_pos = prefix_planner.level_positions(qo_indptrs, [t[3] for t in tables])
        plans = []
        for i, ((kv_indptr, kv_indices, _, kv_lens, _), qo_indptr) in enumerate(zip(tables, qo_indptrs)):
            plans.append(self.plan_step(qo_indptr, kv_lens, kv_indptr[:-1], kv_indices[: kv_indptr[-1]],
                                    None, None, num_pages, causal and i == len(levels) - 1, dtypes=dtypes,
                                    kv_pos_offset=offsets[i], q_positions=q_pos))
        return CascadePlan(tuple(plans))

    def run(self, q, kv_cache, plan, *, return_lse=False, variant_params=None, k_scale=None,
            v_scale=None):
        """q [nnz, Hq, D] -> o [nnz, Hq, Dv], or AttentionState(o, lse [nnz, Hq]) (Dv: head_dim_vo)."""
        params = self._params(variant_params, return_lse)
        check_q(q)
        check_paged_cache(kv_cache, q, self.page_size, self.num_kv_heads, self.head_dim, self.layout,
                          self.head_dim_vo)
        scales = kv_scales(k_scale, v_scale, kv_cache.dtype, self.num_kv_heads)
        return self._finish(self.run_raw(q, kv_cache, plan, params, scales), params, return_lse)

    def run_raw(self, q, kv_cache, plan, params, scales):
        """(o, lse) merged over a CascadePlan's levels, before the variant's output transform."""
        if isinstance(plan, CascadePlan):
            state = None
            for level_plan in plan.levels:
                s = self.run_raw(q, kv_cache, level_plan, params, scales)
                state = s if state is None else merge_state(
                    AttentionState(*state), AttentionState(*s),
                    backend="interpret" if self.interpret else "gpu")
            return state
        k_rows, v_rows = kv_cache.rows()
        return self._run_raw(q, k_rows, v_rows, plan, params, scales, kv_cache.num_pages, "kv_cache",
                             page_size=self.page_size, cache_layout=self.layout)


class BatchPrefillWithRaggedKVCache(_Prefill):
    __doc__ = """Prefill over ragged (contiguous) K/V: request b's keys are rows
    kv_indptr[b]:kv_indptr[b+1] of k [nnz_kv, Hkv, D], v [nnz_kv, Hkv, Dv] (run() rejects k/v
    shorter than kv_indptr[-1]; plans are specialized on that total).

        pre = BatchPrefillWithRaggedKVCache(32, 8, 128)
        o = pre.run(q, k, v, pre.plan(qo_indptr, kv_indptr))
        mha = BatchPrefillWithRaggedKVCache(128, 128, 192, head_dim_vo=128)   # DeepSeek's prefill
""" + _DOC_COMMON

    def __init__(self, num_qo_heads, num_kv_heads, head_dim, *, causal=True, max_batch_size=None,
                 max_num_tokens=None, sm_scale=None, num_ctas=None, fixed_split_tokens=None,
                 max_mask_len=None, backend=None, tile_rows=None, variant=None, impl="auto", config=None,
                 head_dim_vo=None):
        super().__init__(num_qo_heads, num_kv_heads, head_dim, kv_format="ragged", causal=causal,
                         max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
                         sm_scale=sm_scale, num_ctas=num_ctas, fixed_split_tokens=fixed_split_tokens,
                         max_mask_len=max_mask_len, backend=backend, tile_rows=tile_rows,
                         variant=variant, impl=impl, config=config, head_dim_vo=head_dim_vo)

    def plan(self, qo_indptr, kv_indptr, *, custom_mask=None, packed_custom_mask=None, window_left=None,
             q_data_type=None, kv_data_type=None):
        """Plans one step (int32 host indptrs). q_data_type, kv_data_type: as
        BatchPrefillWithPagedKVCache.plan()."""
        dtypes = dispatch.plan_dtypes(q_data_type, kv_data_type)
        kv_indptr = validate.check_indptr("kv_indptr", kv_indptr)
        return self.plan_step(qo_indptr, kv_indptr[1:] - kv_indptr[:-1], kv_indptr[:-1],
                          np.zeros(0, np.int32), custom_mask, packed_custom_mask, int(kv_indptr[-1]),
                          window_left=window_left, contiguous_kv=True, dtypes=dtypes)

    def run(self, q, k, v, plan, *, return_lse=False, variant_params=None, k_scale=None,
            v_scale=None):
        """q [nnz, Hq, D], k [nnz_kv, Hkv, D], v [nnz_kv, Hkv, Dv] -> o [nnz, Hq, Dv] (or
        AttentionState); Dv: head_dim_vo."""
        params = self._params(variant_params, return_lse)
        self._check_kv(q, k, v)
        scales = kv_scales(k_scale, v_scale, k.dtype, self.num_kv_heads)
        state = self._run_raw(q, k.reshape(-1, self.head_dim), v.reshape(-1, self.head_dim_vo), plan,
                              params, scales, k.shape[0], "k", page_size=1, cache_layout="NHD",
                              contiguous=True)
        return self._finish(state, params, return_lse)


class BlockSparseAttention(_Prefill):
    """Attention with a block-sparse (BSR) visibility pattern, any block size (R, C).

        bsa = BlockSparseAttention(Hq, Hkv, D)
        plan = bsa.plan(bsr)                       # a jaxinfer.BlockSparseMatrix (M, N), blocks (R, C)
        o = bsa.run(q, k, v, plan)                 # q [M, Hq, D], k/v [N, Hkv, D]

    Query row i sees key j where block (i // R, j // C) is listed (and, with a
    block_mask [nnz, R, C], where that entry is set). Each row block's column
    blocks are gathered into contiguous tiles for dense tensor-core dots (§2.3).
    The plan holds everything a run needs (C, N): the wrapper keeps no per-plan state.
    """

    def __init__(self, num_qo_heads, num_kv_heads, head_dim, *, sm_scale=None, num_ctas=None,
                 backend=None, tile_rows=None, variant=None, impl="auto", config=None):
        super().__init__(num_qo_heads, num_kv_heads, head_dim, kv_format="bsr", causal=False,
                         sm_scale=sm_scale, num_ctas=num_ctas, backend=backend, tile_rows=tile_rows,
                         variant=variant, impl=impl, config=config)

    def plan(self, bsr):
        if not isinstance(bsr, BlockSparseMatrix):
            raise ValueError("bsr must be a jaxinfer.BlockSparseMatrix")
        (r, c), (m, n) = bsr.block_shape, bsr.shape
        indptr, indices = np.asarray(bsr.indptr), np.asarray(bsr.indices)
        check_int32("bsr.indptr", indptr)
        nblocks = indptr[1:] - indptr[:-1]
        used = indices[: indptr[-1]].astype(np.int64) + np.repeat(np.arange(m // r), nblocks) * (n // c)
        if np.unique(used).size != used.size:  # the kernel would count those keys twice
            raise ValueError("bsr.indices lists a column block twice in one row block")
        qo_indptr = (np.arange(m // r + 1) * r).astype(np.int32)
        custom_mask = None
        if bsr.block_mask is not None:  # [nnz, R, C] -> each row block's R x (blocks * C), row-major
            bm = np.asarray(bsr.block_mask, bool)
            custom_mask = np.concatenate(
                [bm[indptr[i]:indptr[i + 1]].transpose(1, 0, 2).reshape(-1) for i in range(m // r)]
                + [np.zeros(0, bool)])
        plan = self.plan_step(qo_indptr, (nblocks * c).astype(np.int32), indptr[:-1], indices[: indptr[-1]],
                          custom_mask, None, n // c, q_positions=np.arange(m))
        # The block width C is the kernel's page size: the plan's, not the wrapper's.
        return dataclasses.replace(plan, spec=dataclasses.replace(plan.spec, page_size=c))

    def run(self, q, k, v, plan, *, return_lse=False, variant_params=None, k_scale=None,
            v_scale=None):
        """q [M, Hq, D], k/v [N, Hkv, D] -> o [M, Hq, D] (or AttentionState). Variants see
        query row i at position i and key row j at position j."""
        params = self._params(variant_params, return_lse)
        self._check_kv(q, k, v)
        check_qkv(q, k)
        if not isinstance(plan, PrefillPlan):
            raise ValueError("plan must be a PrefillPlan from BlockSparseAttention.plan()")
        c = plan.spec.page_size
        scales = kv_scales(k_scale, v_scale, k.dtype, self.num_kv_heads)
        state = self._run_raw(q, k.reshape(-1, self.head_dim), v.reshape(-1, self.head_dim), plan,
                              params, scales, k.shape[0] // c, "k (in blocks of C rows)",
                              facts=dataclasses.replace(self.facts, page_size=c), page_size=c,
                              cache_layout="NHD", global_kv_pos=True)
        return self._finish(state, params, return_lse)


def auto_cascade_levels(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size, *, causal, problem):
    """two_level_cascade's levels when the cost model says sharing pays, else None. qo_indptr None:
    one query per request (decode; made only past the O(B) test)."""
    if not prefix_planner.may_share(kv_indptr, kv_indices):  # O(B): no request shares a first page
        return None
    if qo_indptr is None:
        qo_indptr = np.arange(np.asarray(kv_indptr).shape[0], dtype=np.int32)
    levels, saved = two_level_cascade(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size,
                                      causal=causal)
    if saved == 0:
        return None
    (q0, kv0, _, _), (q1, kv1, _, _) = levels
    pays = dispatch.cascade_pays(np.diff(q1), np.diff(np.asarray(kv_indptr)),
                                 ((np.diff(q0), np.diff(kv0)), (np.diff(q1), np.diff(kv1))),
                                 page_size=page_size, problem=problem)
    return levels if pays else None
