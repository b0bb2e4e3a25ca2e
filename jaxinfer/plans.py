"""Plans: what plan() hands to run(). Pytrees of the sections of one packed int32 buffer (one
host-to-device copy per step, split on the device: jaxinfer.transfer) plus static facts: the
buffer's layout and the PlanSpec that binds the plan to the wrapper and cache it was made for.
Every plan names its kernel(s) in plan.impl.
"""
import dataclasses
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import transfer


@dataclasses.dataclass(frozen=True)
class PlanSpec:
    """The static facts a plan was made for (part of the jit cache key; none change per step).

    run() compares them with its wrapper (WrapperFacts) and its cache: a plan from another
    wrapper kind, head count, head_dim, page size, layout or capacities is rejected, and so is a
    cache with fewer pages than num_pages (the plan's page ids all lie in [0, num_pages))."""
    wrapper: str                 # wrapper class name
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int               # 1 for contiguous K/V rows
    layout: str
    num_pages: int               # page ids (or K/V rows) read lie in [0, num_pages)
    impl: str                    # the kernel(s) run() will launch, "+"-joined
    capacities: Tuple[Optional[int], ...] = ()  # the wrapper's fixed-shape capacities
    dtypes: Optional[Tuple[str, str]] = None  # (q, K/V) dtype names plan() was told; None: any
    head_dim_vo: Optional[int] = None  # V and o's head_dim where it differs from head_dim (q, K)

    def check_dtypes(self, q_dtype, kv_dtype, kv_name="kv_cache"):
        """ValueError unless q / K/V have the dtypes the plan was made for (when it names them)."""
        got = (np.dtype(q_dtype).name, np.dtype(kv_dtype).name)
        if self.dtypes is not None and got != self.dtypes:
            raise ValueError(f"plan was made for q_data_type={self.dtypes[0]}, kv_data_type={self.dtypes[1]}; "
                             f"got q {got[0]}, {kv_name} {got[1]}")

    def check(self, facts, what="plan"):
        """ValueError naming each field where this spec differs from `facts` (a PlanSpec-like
        object from the running wrapper; num_pages and impl are the plan's own)."""
        bad = [f"{name}: plan has {getattr(self, name)!r}, wrapper has {getattr(facts, name)!r}"
               for name in ("wrapper", "num_qo_heads", "num_kv_heads", "head_dim", "head_dim_vo", "page_size",
                            "layout", "capacities") if getattr(self, name) != getattr(facts, name)]
        if bad:
            raise ValueError(f"{what} was made for another wrapper ({'; '.join(bad)})")

    def check_rows(self, available, name):
        """ValueError unless `available` pages (or rows) cover the plan's [0, num_pages)."""
        if available < self.num_pages:
            raise ValueError(f"{name} has {available} pages but the plan reads page ids up to "
                             f"{self.num_pages - 1} (plan(..., num_pages={self.num_pages}))")


@dataclasses.dataclass(frozen=True)
class WrapperFacts:
    """What a wrapper instance is: compared field by field with a plan's PlanSpec."""
    wrapper: str
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    layout: str
    capacities: Tuple[Optional[int], ...] = ()
    head_dim_vo: Optional[int] = None  # V and o's head_dim where it differs from head_dim

    def spec(self, num_pages, impl, dtypes=None):
        """The PlanSpec of a plan for num_pages pages running impl; dtypes: plan_dtypes' pair or None."""
        names = None if dtypes is None else tuple(np.dtype(x).name for x in dtypes)
        return PlanSpec(self.wrapper, self.num_qo_heads, self.num_kv_heads, self.head_dim,
                        self.page_size, self.layout, int(num_pages), impl, self.capacities, names,
                        self.head_dim_vo)


class _PagedPlan:
    """Shared by plans whose buffer lists page ids: the page offset of stacked caches."""

    @property
    def impl(self):
        return self.spec.impl

    def page_ids(self, sec, num_cache_pages):
        """The kv_indices section with the plan's page offset applied: clipped so that every id
        stays in [0, num_cache_pages) (ids were checked against spec.num_pages at plan time)."""
        if self.page_offset is None:
            return sec["kv_indices"]
        offset = jnp.clip(self.page_offset, 0, num_cache_pages - self.spec.num_pages)
        return sec["kv_indices"] + offset

    def with_page_offset(self, offset):
        """This plan reading page offset + p for each listed page p (offset may be traced): one
        plan serves every layer of a stacked cache of L x P pages (layer l: offset l * P). run()
        clips the offset to [0, cache pages - num_pages], so reads stay inside the cache."""
        return self._replace(page_offset=jnp.asarray(offset, jnp.int32))


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False)
class DecodePlan(_PagedPlan):
    """A decode plan (see BatchDecodeWithPagedKVCache.plan). kv_lens_at(step) gives the live
    lengths of step `step` of a horizon plan."""
    parts: Tuple[jax.Array, ...]  # transfer.plan_sections
    layout: object            # planner.decode.DecodeLayout (static)
    spec: PlanSpec
    horizon: int = 1
    page_offset: Optional[jax.Array] = None
    info: dict = dataclasses.field(default_factory=dict, compare=False)

    def sections(self):
        return transfer.sections(self.parts, self.layout)

    @property
    def kv_lens(self):
        """int32[B]: the lengths the plan was made for (the horizon's last step)."""
        return self.sections()["kv_lens"]

    def kv_lens_at(self, step):
        """int32[B]: live lengths at step `step` (0-based, may be traced) of the horizon."""
        return jnp.maximum(self.kv_lens - (self.horizon - 1 - step), 0)

    def _replace(self, **kw):
        return dataclasses.replace(self, **kw)

    def tree_flatten(self):
        return (self.parts, self.page_offset), (self.layout, self.spec, self.horizon)

    @classmethod
    def tree_unflatten(cls, aux, children):
        layout, spec, horizon = aux
        return cls(tuple(children[0]), layout, spec, horizon, children[1])


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False)
class PrefillPlan(_PagedPlan):
    """A prefill plan: the sections of one packed int32 buffer (and an int8 custom mask, if any)
    plus its static layout and causal flag. alt: with impl "prefill_mosaic", the Triton kernel's
    plan beside it, which run() uses where the Mosaic kernel cannot run the call's dtypes (fp8,
    float32)."""
    parts: Tuple[jax.Array, ...]  # transfer.plan_sections
    mask: Optional[jax.Array]
    layout: object            # planner.prefill.PrefillLayout (static)
    causal: bool
    spec: PlanSpec
    alt: Optional["PrefillPlan"] = None
    page_offset: Optional[jax.Array] = None
    info: dict = dataclasses.field(default_factory=dict, compare=False)

    def sections(self):
        return transfer.sections(self.parts, self.layout)

    def _replace(self, **kw):
        if self.alt is not None and "page_offset" in kw:
            kw["alt"] = self.alt._replace(page_offset=kw["page_offset"])
        return dataclasses.replace(self, **kw)

    def tree_flatten(self):
        return (self.parts, self.mask, self.alt, self.page_offset), (self.layout, self.causal, self.spec)

    @classmethod
    def tree_unflatten(cls, aux, children):
        parts, mask, alt, page_offset = children
        layout, causal, spec = aux
        return cls(tuple(parts), mask, layout, causal, spec, alt, page_offset)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False)
class CascadePlan:
    """Per-level prefill plans of a MultiLevelCascadeAttention (or a decode / prefill plan with
    cascade="auto"), whose level states run() merges with ⊕ in level order."""
    levels: Tuple[PrefillPlan, ...]
    info: dict = dataclasses.field(default_factory=dict, compare=False)

    @property
    def impl(self):
        return "cascade(" + ", ".join(level.impl for level in self.levels) + ")"

    @property
    def spec(self):
        return self.levels[0].spec

    def with_page_offset(self, offset):
        """Every level reading page offset + p (see DecodePlan)."""
        return CascadePlan(tuple(level.with_page_offset(offset) for level in self.levels), self.info)

    def tree_flatten(self):
        return self.levels, None

    @classmethod
    def tree_unflatten(cls, _, levels):
        return cls(tuple(levels))


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False)
class BatchPlan(_PagedPlan):
    """A BatchAttention plan: the short requests' decode-kernel work list (one packed buffer's
    sections) and, when the step has longer requests, the prefill plan of their rows. Also a prefill
    wrapper's plan when every request is short (impl "prefill_short": long is None)."""
    parts: Tuple[jax.Array, ...]  # transfer.plan_sections
    layout: object            # planner.batch.ShortLayout (static)
    spec: PlanSpec
    long: Optional[PrefillPlan] = None
    has_short: bool = True
    causal: bool = True
    page_offset: Optional[jax.Array] = None
    info: dict = dataclasses.field(default_factory=dict, compare=False)

    def sections(self):
        return transfer.sections(self.parts, self.layout)

    def _replace(self, **kw):
        if self.long is not None and "page_offset" in kw:
            kw["long"] = self.long._replace(page_offset=kw["page_offset"])
        return dataclasses.replace(self, **kw)

    def tree_flatten(self):
        return (self.parts, self.long, self.page_offset), (self.layout, self.spec, self.has_short, self.causal)

    @classmethod
    def tree_unflatten(cls, aux, children):
        parts, long, page_offset = children
        layout, spec, has_short, causal = aux
        return cls(tuple(parts), layout, spec, long, has_short, causal, page_offset)
