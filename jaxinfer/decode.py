"""Batch decode over a paged KV cache: plan() on the host, run() compiled once."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import _backend, variants
from jaxinfer.cascade import MultiLevelCascadeAttention, auto_cascade_levels
from jaxinfer.formats import AttentionState, check_layout, check_paged_cache, default_sm_scale, kv_scales
from jaxinfer.prefill import CascadePlan
from pallas_kernels import decode as decode_kernels
from pallas_kernels import merge as merge_kernels
from planner import decode as decode_planner
from planner import validate


@jax.tree_util.register_pytree_node_class
class DecodePlan:
    """A decode plan: one packed int32 buffer on the device plus its static layout.

    Pass it to run() inside or outside jit; plans with the same capacities share
    one compiled program. kv_lens_at(step) gives the live lengths of step
    `step` of a horizon plan (see BatchDecodeWithPagedKVCache.plan).
    """

    def __init__(self, buffer, layout, horizon=1, info=None):
        self.buffer, self.layout, self.horizon, self.info = buffer, layout, horizon, info or {}

    def sections(self):
        return self.layout.unpack(self.buffer)

    @property
    def kv_lens(self):
        """int32[B]: the lengths the plan was made for (the horizon's last step)."""
        return self.sections()["kv_lens"]

    def kv_lens_at(self, step):
        """int32[B]: live lengths at step `step` (0-based, may be traced) of the horizon."""
        return jnp.maximum(self.kv_lens - (self.horizon - 1 - step), 0)

    def with_page_offset(self, offset):
        """This plan reading page offset + p for each listed page p (offset may be traced): one
        plan serves every layer of a stacked cache of L x P pages (layer l: offset l * P).
        The caller keeps offset + p inside the cache."""
        start, stop = self.layout.section_range("kv_indices")
        return DecodePlan(self.buffer.at[start:stop].add(offset), self.layout, self.horizon, self.info)

    def tree_flatten(self):
        return (self.buffer,), (self.layout, self.horizon)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)


def run_decode_sections(q, k_rows, v_rows, sec, kv_lens, layout, *, page_size, num_kv_heads,
                        cache_layout, sm_scale, interpret, **kernel_options):
    """Decode kernel + split-KV merge over unpacked plan sections. Returns (o [B,Hq,D], lse [B,Hq]),
    before any variant output transform. kernel_options include scales / variant / params."""
    batch, hq, d = q.shape
    o, lse, o_part, lse_part = decode_kernels.paged_decode(
        q, k_rows, v_rows, sec["kv_indices"], kv_lens, sec["items"], sec["cell_indptr"],
        num_parts=layout.part_cap, page_size=page_size, num_kv_heads=num_kv_heads,
        layout=cache_layout, sm_scale=sm_scale, interpret=interpret, **kernel_options)
    return merge_kernels.merge_varlen(
        o_part.reshape(layout.part_cap, hq, d), lse_part.reshape(layout.part_cap, hq),
        sec["merge_indptr"], sec["merge_dest"], out=(o.reshape(batch, hq, d), lse.reshape(batch, hq)),
        interpret=interpret)


class BatchDecodeWithPagedKVCache:
    """Batch decode (one query token per request) over a PagedKVCache.

        dec = BatchDecodeWithPagedKVCache(32, 8, 128, 16)
        plan = dec.plan(kv_indptr, kv_indices, kv_last_page_len)   # host NumPy, once per step
        o = dec.run(q, kv_cache, plan)                             # pure; jit it; every layer

    max_batch_size / max_num_pages fix the plan's shapes (q then has
    max_batch_size rows; rows past the batch give o = 0), so one compiled run()
    serves every step. num_ctas (default 2 x SM count) sets the grid: cells =
    num_ctas // num_kv_heads (all resident at once). fixed_split_pages: batch-invariant outputs.
    variant: a jaxinfer.AttentionVariant (static; the query sits at position kv_len - 1);
    run(..., variant_params=) takes its parameters as data. fp8 pages (float8_e4m3fn /
    e5m2) take run(..., k_scale=, v_scale=): scalars or [Hkv] arrays.
    kernel_options (block_kv, num_warps, num_stages, fp8_pairs, heads_fastest) tune the kernel.
    """

    def __init__(self, num_qo_heads, num_kv_heads, head_dim, page_size, *, layout="NHD",
                 max_batch_size=None, max_num_pages=None, sm_scale=None, num_ctas=None,
                 fixed_split_pages=None, backend=None, variant=None, **kernel_options):
        variants.check_variant(variant)
        if num_kv_heads < 1 or num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.page_size, self.layout = page_size, check_layout(layout)
        self.max_batch_size, self.max_num_pages = max_batch_size, max_num_pages
        self.sm_scale = default_sm_scale(head_dim, sm_scale)
        ctas = num_ctas or 2 * _backend.num_sms()
        self.num_cells = max(1, ctas // num_kv_heads)  # all cells resident at once: no tail wave
        self.fixed_split_pages = fixed_split_pages
        self.interpret = _backend.use_interpret(backend)
        self.variant, self.kernel_options = variant, kernel_options
        self._cascade = None

    def plan(self, kv_indptr, kv_indices, kv_last_page_len, *, num_pages=None, horizon=1, cascade=None):
        """Plans one decode step from a host CSR page table (int32 NumPy arrays).

        num_pages: the cache's page count; page ids outside [0, num_pages) are rejected.
        horizon=K: the page table describes the lengths at the last of K steps
        (pages allocated ahead); run() at step s takes kv_lens=plan.kv_lens_at(s),
        so a lax.scan over K steps needs this one plan.
        cascade="auto": when consecutive requests begin with the same pages and the
        planner's cost estimate says it pays, returns a two-level CascadePlan (shared
        prefixes read once for all their queries); run() takes either kind of plan.
        """
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon}")
        if cascade not in (None, "auto"):
            raise ValueError(f"cascade must be None or 'auto', got {cascade!r}")
        if cascade == "auto" and horizon != 1:
            raise ValueError("cascade='auto' plans a single step (horizon=1)")
        table = validate.check_page_table(kv_indptr, kv_indices, kv_last_page_len, self.page_size,
                                          num_pages)  # the only check of this page table
        if cascade == "auto":
            kv_indptr, kv_indices, kv_last_page_len = table[:3]
            levels = auto_cascade_levels(
                np.arange(kv_indptr.shape[0], dtype=np.int32), kv_indptr, kv_indices, kv_last_page_len,
                self.page_size, causal=False, num_qo_heads=self.num_qo_heads,
                num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, itemsize=2)
            if levels is not None:
                return self._cascade_wrapper().plan(levels, num_pages=num_pages)
        layout, buf, info = decode_planner.plan_decode_checked(
            table, page_size=self.page_size, num_cells=self.num_cells,
            max_batch_size=self.max_batch_size, max_num_pages=self.max_num_pages,
            fixed_split_pages=self.fixed_split_pages)
        # buf is fresh and never written again, so the runtime may alias it instead of copying.
        return DecodePlan(jax.device_put(buf, may_alias=True), layout, int(horizon), info)

    def run(self, q, kv_cache, plan, *, kv_lens=None, return_lse=False, variant_params=None,
            k_scale=None, v_scale=None):
        """q [B, Hq, D] -> o [B, Hq, D], or AttentionState(o, lse [B, Hq]) with return_lse.

        kv_lens (int32[B], optional, may be traced): live lengths, each at most
        the planned length; defaults to the plan's lengths (DecodePlan only).
        """
        if isinstance(plan, CascadePlan):
            if kv_lens is not None:
                raise ValueError("kv_lens needs a DecodePlan; a cascade plan serves one step")
            return self._cascade_wrapper().run(q, kv_cache, plan, return_lse=return_lse,
                                               variant_params=variant_params, k_scale=k_scale,
                                               v_scale=v_scale)
        variants.check_variant(self.variant, return_lse)
        params = None if self.variant is None else self.variant.check_params(variant_params)
        self._check(q, kv_cache, plan)
        sec = plan.sections()
        lens = sec["kv_lens"] if kv_lens is None else jnp.asarray(kv_lens, jnp.int32)
        if lens.shape != (plan.layout.batch,):
            raise ValueError(f"kv_lens must have shape [{plan.layout.batch}], got {lens.shape}")
        k_rows, v_rows = kv_cache.rows()
        o, lse = run_decode_sections(
            q, k_rows, v_rows, sec, lens, plan.layout, page_size=self.page_size,
            num_kv_heads=self.num_kv_heads, cache_layout=self.layout, sm_scale=self.sm_scale,
            interpret=self.interpret, scales=kv_scales(k_scale, v_scale, kv_cache.dtype, self.num_kv_heads),
            variant=self.variant, params=params, **self.kernel_options)
        out = variants.finish(self.variant, params, o, lse, return_lse)
        return AttentionState(*out) if return_lse else out

    def _cascade_wrapper(self):
        """The two-level cascade used by plan(cascade="auto"): same shapes and capacities."""
        if self._cascade is None:
            self._cascade = MultiLevelCascadeAttention(
                2, self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size, causal=False,
                layout=self.layout, sm_scale=self.sm_scale, max_batch_size=self.max_batch_size,
                max_num_tokens=self.max_batch_size, max_num_pages=self.max_num_pages,
                num_ctas=self.num_cells * self.num_kv_heads, variant=self.variant,
                backend="interpret" if self.interpret else "gpu")
        return self._cascade

    def _check(self, q, kv_cache, plan):
        if not isinstance(plan, DecodePlan):
            raise ValueError("plan must be a DecodePlan from plan()")
        expect_q = (plan.layout.batch, self.num_qo_heads, self.head_dim)
        if tuple(q.shape) != expect_q:
            raise ValueError(f"q must have shape {expect_q}, got {q.shape}")
        check_paged_cache(kv_cache, q, self.page_size, self.num_kv_heads, self.head_dim, self.layout)

