"""BatchAttention: one call for a serving step's mixed requests (decode, speculative verify,
chunked prefill, whole prompts) over one PagedKVCache."""
import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxinfer import _backend, dispatch, transfer, variants
from jaxinfer.runners import run_mixed_sections, run_short_sections
from jaxinfer.formats import AttentionState, check_layout, check_paged_cache, check_q, kv_scales
from jaxinfer.plans import BatchPlan, WrapperFacts
from jaxinfer.prefill import BatchPrefillWithPagedKVCache
from planner import batch as batch_planner
from planner import scheduler, validate



class BatchAttention:
    """Attention for any mix of per-request query lengths (0, 1, 2-16, chunks, prompts) in one call,
    with BatchPrefillWithPagedKVCache's semantics (causal: bottom-right).

        attn = BatchAttention(32, 8, 128, 16)
        plan = attn.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, num_pages=cache.num_pages)
        o = attn.run(q, kv_cache, plan)                 # q, o: [nnz, Hq, D]

    plan() classifies requests by qo_len x GQA group: requests whose tokens times the group fit a
    64-row tile run on the decode kernel (heads and tokens packed into one tensor-core tile,
    split-KV for long KV, Algorithm 1 balance); the others get prefill tiles (jaxinfer.dispatch
    picks Triton or Mosaic GPU from their lengths). At most two launches plus the merges;
    deterministic. With max_batch_size, max_num_tokens and max_num_pages all given, every plan has
    one pytree structure and the same shapes, whatever the step (run() compiles once): short
    requests are those of up to 16 rows (tokens x group; dispatch.FIXED_SHORT_ROWS), the decode kernel and
    the Triton prefill kernel (64-row tiles) both launch every step, empty or not (impl="mosaic"
    pins the Mosaic one; impl="mixed" makes every step one mixed launch). That costs time for one compilation: on an H200, decode B64 kv4096 258.5
    -> 288.3 µs, q4 B64 263.2 -> 291.4, the mixed step 4 x 512 + 60 decode 326.0 -> 457.3 (its
    chunks on Triton tiles). fixed_shapes=False keeps each step's own kernels under capacities
    (faster steps; one compilation per short-token class and long kernel, up to about 10).
    plan.impl names the kernels.
    causal=False attends every key. variant, sm_scale, layout, num_ctas, config: as the decode
    and prefill wrappers.

    impl="mixed" runs steps with both classes in one persistent Mosaic GPU launch instead
    (dispatch row "batch_mosaic": Hopper, 16-bit q and K/V, NHD, no variant; plan() told the
    dtypes): a short request is one packed tile per KV head (its tokens x head group in 64
    rows), a long one query tiles of one query head. "auto" weighs both paths by dispatch's cost
    model when plan() gets q_data_type: on the steps measured so far (chunks with decode or
    verify rows) it picks the mixed launch, and the two classes where a short request's context
    is long (the mixed launch never splits KV).
    """

    def __init__(self, num_qo_heads, num_kv_heads, head_dim, page_size, *, causal=True, layout="NHD",
                 variant=None, sm_scale=None, max_batch_size=None, max_num_tokens=None, max_num_pages=None,
                 num_ctas=None, backend=None, impl="auto", config=None, fixed_shapes=None):
        impls = dispatch.batch_impls(impl)
        self.prefill = BatchPrefillWithPagedKVCache(
            num_qo_heads, num_kv_heads, head_dim, page_size, causal=causal, layout=layout,
            max_batch_size=max_batch_size, max_num_tokens=max_num_tokens, max_num_pages=max_num_pages,
            sm_scale=sm_scale, backend=backend, variant=variant, impl=impls.long,
            config=config, num_ctas=num_ctas, fixed_shapes=fixed_shapes)
        self.prefill.often_empty = True  # (plans of fixed shapes launch it on every step)
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.page_size, self.layout, self.causal = page_size, check_layout(layout), causal
        self.group = num_qo_heads // num_kv_heads
        self.max_batch_size, self.max_num_tokens, self.max_num_pages = max_batch_size, max_num_tokens, max_num_pages
        self.variant, self.sm_scale, self.interpret = variant, self.prefill.sm_scale, self.prefill.interpret
        self.configs = self.prefill.configs
        self.num_cells = max(1, (num_ctas or 2 * _backend.num_sms()) // num_kv_heads)
        self.problem = dispatch.Problem("decode", num_qo_heads, num_kv_heads, head_dim, "paged", page_size,
                                        layout, variant, interpret=self.interpret)
        dispatch.check(self.problem)
        # Steps with both short and long requests: two classes, or one mixed launch (impl "mixed"
        # forces it; "auto" lets the cost model choose when plan() is told the dtypes).
        self.mixed_problem = dataclasses.replace(self.problem, family="batch")
        self.mixed_impl = impls.both
        dispatch.check(self.mixed_problem, self.mixed_impl)
        # The mixed launch's static facts: a persistent grid of one cell per SM, its query tile height.
        self.mixed_cells = _backend.num_sms()
        self.mixed_tile_tokens = dispatch.config_for(dispatch.IMPLEMENTATIONS_BY_NAME["batch_mosaic"],
                                                     self.mixed_problem, self.configs).tile_tokens
        self.facts = WrapperFacts(type(self).__name__, num_qo_heads, num_kv_heads, head_dim, page_size,
                                  layout, (max_batch_size, max_num_tokens, max_num_pages))

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, *, num_pages=None, q_data_type=None,
             kv_data_type=None):
        """Plans one step from host int32 arrays (qo_indptr [B+1] and a CSR page table); num_pages:
        the cache's page count (required). q_data_type / kv_data_type (as FlashInfer's; kv defaults
        to q): the dtypes run() will get, so the long requests' plan is made for the one kernel that
        runs them (without them a Mosaic plan carries a Triton plan beside it); run() rejects others."""
        dtypes = dispatch.plan_dtypes(q_data_type, kv_data_type)
        num_pages = validate.check_num_pages(num_pages)
        qo_indptr, qo_lens, _ = validate.indptr_lengths("qo_indptr", qo_indptr)
        kv_indptr, kv_indices, _, kv_lens, pages = validate.check_page_table(
            kv_indptr, kv_indices, kv_last_page_len, self.page_size, num_pages)
        batch, nnz = kv_lens.shape[0], int(qo_indptr[-1])
        if qo_indptr.shape[0] != batch + 1:
            raise ValueError(f"qo_indptr describes {qo_indptr.shape[0] - 1} requests, kv_indptr {batch}")
        num_tokens = nnz if self.max_num_tokens is None else int(self.max_num_tokens)
        bcap = batch if self.max_batch_size is None else int(self.max_batch_size)
        num_listed = int(kv_indptr[-1])
        icap = max(num_listed, 1) if self.max_num_pages is None else int(self.max_num_pages)
        for what, n, cap, name in (("tokens", nnz, num_tokens, "max_num_tokens"),
                                   ("requests", batch, bcap, "max_batch_size"),
                                   ("pages", num_listed, icap, "max_num_pages")):
            if n > cap:
                raise ValueError(f"the step has {n} {what}, over {name}={cap}")
        fixed = self.prefill.fixed_shapes  # every plan of one structure and shapes
        live = qo_lens > 0
        tokens, is_short = dispatch.batch_classes(qo_lens, self.group, fixed_shapes=fixed)
        page_base = kv_indptr[:-1]
        if dispatch.batch_tries_mixed(self.mixed_impl, dtypes, is_short, live, fixed_shapes=fixed):
            rows = self.__dict__.setdefault("_mixed_rows", {})  # candidates by dtypes: made once
            if dtypes not in rows:
                rows[dtypes] = dispatch.candidates(self.mixed_problem, self.mixed_impl, dtypes)
            choice = dispatch.choose(self.mixed_problem, qo_lens, kv_lens, self.causal, rows=rows[dtypes],
                                     fixed_shapes=fixed)
            if choice.name == "batch_mosaic":
                layout, buf, info = batch_planner.plan_mixed(
                    qo_indptr, kv_lens, page_base, kv_indices[:num_listed], is_short, page_size=self.page_size,
                    num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads, num_cells=self.mixed_cells,
                    tile_tokens=self.mixed_tile_tokens, tokens_per_item=tokens, num_tokens=num_tokens,
                    batch_cap=bcap, index_cap=icap, causal=self.causal)
                return BatchPlan(transfer.plan_sections(buf, layout), layout,
                                 self._spec(num_pages, choice.name, dtypes), None, True, self.causal, info=info)
        layout, buf, info = batch_planner.plan_short(
            qo_indptr, kv_lens, page_base, kv_indices[:num_listed], is_short,
            page_size=self.page_size, num_cells=self.num_cells, tokens_per_item=tokens,
            num_tokens=num_tokens, batch_cap=bcap, index_cap=icap)
        long_plan, impls = None, ["decode_triton"] if info["num_short"] or fixed else []
        if info["num_long_tokens"] or fixed:
            # The long requests' sub-batch: their rows and their pages (already checked above).
            long_reqs = (~is_short).nonzero()[0]
            sub_pages = pages.take(long_reqs)
            sub_indptr = np.zeros(long_reqs.shape[0] + 1, np.int32)
            np.add.accumulate(sub_pages, out=sub_indptr[1:])  # (int32 sums: no casting loop)
            sub_qo = np.zeros(long_reqs.shape[0] + 1, np.int32)
            np.add.accumulate(qo_lens.take(long_reqs), out=sub_qo[1:])
            first, last = (int(long_reqs[0]), int(long_reqs[-1])) if long_reqs.shape[0] else (0, -1)
            if last - first + 1 == long_reqs.shape[0]:  # consecutive requests: their pages are one slice
                sub_indices = kv_indices[kv_indptr[first]:kv_indptr[last + 1]]
            else:  # entry j of the sub-table: kv_indices[j + (request's first entry - its sub first)]
                shift = np.repeat(page_base.take(long_reqs) - sub_indptr[:-1], sub_pages)
                sub_indices = kv_indices.take(shift + scheduler.arange(int(sub_indptr[-1])))
            long_plan = self.prefill.plan_step(sub_qo, kv_lens.take(long_reqs), sub_indptr[:-1], sub_indices,
                                           None, None, num_pages, dtypes=dtypes)
            impls.append(long_plan.impl)
        impl = "+".join(impls) or "none (no query rows)"
        return BatchPlan(transfer.plan_sections(buf, layout), layout, self._spec(num_pages, impl, dtypes),
                         long_plan, bool(info["num_short"]) or fixed, self.causal, info=info)

    def _spec(self, num_pages, impl, dtypes):
        """The PlanSpec of a plan (made once per num_pages, impl and dtypes)."""
        specs = self.__dict__.setdefault("_specs", {})
        if len(specs) > 16:
            specs.clear()
        spec = specs.get((num_pages, impl, dtypes))
        if spec is None:
            spec = specs[num_pages, impl, dtypes] = self.facts.spec(num_pages, impl, dtypes)
        return spec

    def run(self, q, kv_cache, plan, *, return_lse=False, variant_params=None, k_scale=None, v_scale=None):
        """q [nnz, Hq, D] -> o [nnz, Hq, D], or AttentionState(o, lse [nnz, Hq]) (natural log)."""
        if not isinstance(plan, BatchPlan):
            raise ValueError("plan must be a BatchPlan from BatchAttention.plan()")
        plan.spec.check(self.facts)
        variants.check_variant(self.variant, return_lse)
        params = None if self.variant is None else self.variant.check_params(variant_params)
        check_q(q)
        lay = plan.layout
        if tuple(q.shape) != (lay.num_tokens, self.num_qo_heads, self.head_dim):
            raise ValueError(f"q must have shape {(lay.num_tokens, self.num_qo_heads, self.head_dim)}, got {q.shape}")
        check_paged_cache(kv_cache, q, self.page_size, self.num_kv_heads, self.head_dim, self.layout)
        plan.spec.check_rows(kv_cache.num_pages, "kv_cache")
        plan.spec.check_dtypes(q.dtype, kv_cache.dtype)
        scales = kv_scales(k_scale, v_scale, kv_cache.dtype, self.num_kv_heads)
        sec = plan.sections()
        n, hq, d = q.shape
        if isinstance(lay, batch_planner.MixedLayout):  # one persistent launch
            if scales is not None:
                raise ValueError("k_scale / v_scale: the mixed kernel reads 16-bit K/V only")
            k_rows, v_rows = kv_cache.rows()
            o, lse = run_mixed_sections(
                q, k_rows, v_rows, sec, plan.page_ids(sec, kv_cache.num_pages), lay, page_size=self.page_size,
                num_kv_heads=self.num_kv_heads, cache_layout=self.layout, sm_scale=self.sm_scale, causal=self.causal,
                interpret=self.interpret, config=dispatch.config_for(
                    dispatch.IMPLEMENTATIONS_BY_NAME["batch_mosaic"], self.mixed_problem, self.configs),
                padded=self.max_num_tokens is not None, need_lse=return_lse)
            return AttentionState(o, lse) if return_lse else o  # (no variant: finish is the identity)
        if plan.long is None:
            o, lse = jnp.zeros((n, hq, d), q.dtype), jnp.full((n, hq), -jnp.inf, jnp.float32)
        elif not plan.has_short:  # every row is long: no gather
            o, lse = self.prefill.run_raw(q, kv_cache, plan.long, params, scales)
        else:  # the long requests' rows, gathered, attended, then gathered back into place
            num_long = plan.long.layout.num_tokens
            rows = sec["prefill_rows"][:num_long]  # [L]: q rows, n past the long ones
            o_l, lse_l = self.prefill.run_raw(q[jnp.minimum(rows, n - 1)], kv_cache, plan.long, params, scales)
            # Each row's place among the long rows (L: a short row). A gather writes o whole, where
            # a scatter of o_l's rows into zeros costs ~6x as much on the GPU.
            pos = jnp.full((n + 1,), num_long, jnp.int32).at[rows].set(
                jnp.arange(num_long, dtype=jnp.int32), mode="drop")[:n]  # [n]
            is_long, pos = pos < num_long, jnp.minimum(pos, num_long - 1)
            o = jnp.where(is_long[:, None, None], o_l[pos], jnp.zeros((), q.dtype))
            lse = jnp.where(is_long[:, None], lse_l[pos], -jnp.inf)
        if plan.has_short:  # the decode kernel writes the short rows into o, lse in place
            k_rows, v_rows = kv_cache.rows()
            impl = dispatch.IMPLEMENTATIONS_BY_NAME["decode_triton"]
            o, lse = run_short_sections(
                q, k_rows, v_rows, sec, plan.page_ids(sec, kv_cache.num_pages), lay,
                page_size=self.page_size, num_kv_heads=self.num_kv_heads, cache_layout=self.layout,
                sm_scale=self.sm_scale, interpret=self.interpret, causal=self.causal,
                config=dispatch.config_for(impl, self.problem, self.configs), scales=scales,
                variant=self.variant, params=params, out=(o, lse))
        out = variants.finish(self.variant, params, o, lse, return_lse)
        return AttentionState(*out) if return_lse else out
