"""Attention over several devices: by heads (tensor parallel, TP), by context (CP), or both.

TP: q, o and the paged cache are split on heads along a mesh axis; every device runs the wrapper
built for its heads (split_heads) with one replicated plan. CP: split_page_table gives each device
a contiguous range of every request's pages; context_plan makes one plan per device (stacked on
the mesh axis); each device computes its partial AttentionState and the states are merged exactly
by a psum-based log-sum-exp merge (pmax of lse, psum of the weighted o). Both together on a 2-D
mesh ("tp", "cp"). The runners are shard_map'd functions: they work under jax.jit, lax.scan and
jax.distributed alike. Usage and the choice of merge: docs/sharding.md.
"""
import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxinfer.batch import BatchAttention
from jaxinfer.cascade import MultiLevelCascadeAttention
from jaxinfer.decode import BatchDecodeWithPagedKVCache
from jaxinfer.formats import AttentionState, PagedKVCache
from jaxinfer.prefill import BatchPrefillWithPagedKVCache
from jaxinfer.ragged import ragged_paged_attention
from planner import validate

if hasattr(jax, "shard_map"):  # jax >= 0.7 (check_vma)
    def shard_map(f, mesh, in_specs, out_specs):
        """jax.shard_map without the replication check, which pallas_call has no rule for."""
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
else:  # older jax (check_rep)
    from jax.experimental.shard_map import shard_map as _legacy_shard_map

    def shard_map(f, mesh, in_specs, out_specs):
        """jax.experimental.shard_map without the replication check (see above)."""
        return _legacy_shard_map(f, mesh, in_specs, out_specs, check_rep=False)


_WRAPPERS = (BatchDecodeWithPagedKVCache, BatchPrefillWithPagedKVCache, BatchAttention)  # context_parallel's
_TP_WRAPPERS = _WRAPPERS + (MultiLevelCascadeAttention,)  # head_parallel's


# ---------------------------------------------------------------------------------------------
# Placement helpers


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadSplit:
    """Per-device head counts of tensor parallelism (build the per-device wrapper with them)."""
    num_qo_heads: int   # query heads per device
    num_kv_heads: int   # KV heads per device
    kv_replicas: int    # devices sharing one KV head (> 1: replicate_kv_heads the cache first)


def split_heads(num_qo_heads, num_kv_heads, devices):
    """How `devices` devices split Hq query / Hkv KV heads with whole GQA groups on one device.

    Hkv a multiple of devices: Hkv / devices KV heads each with their groups. Fewer KV heads,
    devices a multiple of Hkv and of the group's split: each KV head replicated on devices / Hkv
    devices, each holding a slice of its query heads. Otherwise ValueError naming the argument."""
    if not isinstance(devices, (int, np.integer)) or devices < 1:
        raise ValueError(f"devices must be an int >= 1, got {devices!r}")
    if num_kv_heads < 1 or num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if num_kv_heads % devices == 0:
        return HeadSplit(num_qo_heads=num_qo_heads // devices, num_kv_heads=num_kv_heads // devices,
                         kv_replicas=1)
    if devices % num_kv_heads:
        raise ValueError(f"num_kv_heads ({num_kv_heads}) must be a multiple of the {devices} devices or divide it")
    if num_qo_heads % devices:
        raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of the {devices} devices when "
                         f"KV heads are replicated (num_kv_heads {num_kv_heads})")
    return HeadSplit(num_qo_heads=num_qo_heads // devices, num_kv_heads=1, kv_replicas=devices // num_kv_heads)


def replicate_kv_heads(x, replicas):
    """KV head h repeated as heads h * replicas .. h * replicas + replicas - 1: the head layout
    of a cache (PagedKVCache) or new K/V rows ([T, Hkv, D]) under TP with fewer KV heads than devices."""
    if isinstance(x, PagedKVCache):
        axis = 2 if x.layout == "NHD" else 1
        return PagedKVCache(jnp.repeat(x.k_pages, replicas, axis), jnp.repeat(x.v_pages, replicas, axis), x.layout)
    return jnp.repeat(x, replicas, axis=1)


def head_spec(tp_axis):
    """PartitionSpec of q / o [T, H, D] (and lse [T, H] by its first two entries)."""
    return P(None, tp_axis, None)


def cache_spec(layout, *, tp_axis=None, cp_axis=None):
    """PartitionSpec of the cache's page arrays: KV heads on tp_axis, pages on cp_axis (None:
    replicated). NHD [P, page, Hkv, D]; HND [P, Hkv, page, D]."""
    return P(cp_axis, None, tp_axis, None) if layout == "NHD" else P(cp_axis, tp_axis, None, None)


def put(tree, sharding):
    """Places host or device arrays (a pytree) as global arrays of `sharding`; every process
    passes the same values (multi-host safe, unlike device_put of process-local arrays)."""
    def one(x):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    return jax.tree.map(one, tree)


def _check_wrapper(wrapper, allowed=_WRAPPERS):
    if not isinstance(wrapper, allowed):
        names = [w.__name__ for w in allowed]
        raise ValueError(f"wrapper must be a {', '.join(names[:-1])} or {names[-1]}, got {type(wrapper).__name__}")


def _check_axis(mesh, name, axis):
    if axis is not None and axis not in mesh.axis_names:
        raise ValueError(f"{name} {axis!r} is not an axis of the mesh {mesh.axis_names}")


# ---------------------------------------------------------------------------------------------
# Tensor parallel


def head_parallel(wrapper, mesh, *, tp_axis="tp", return_lse=False):
    """wrapper.run over heads split on mesh axis tp_axis: run(q, kv_cache, plan, kv_lens=None).

    wrapper: the per-device wrapper (split_heads' head counts): decode, prefill, BatchAttention or
    MultiLevelCascadeAttention; plan: its plan, replicated. q, o [T, Hq, D] split on heads
    (head_spec), the cache on KV heads (cache_spec). kv_lens (decode only, may be traced): as the
    decode wrapper's run(). Returns o or AttentionState(o, lse [T, Hq])."""
    _check_wrapper(wrapper, _TP_WRAPPERS)
    _check_axis(mesh, "tp_axis", tp_axis)
    decode = isinstance(wrapper, BatchDecodeWithPagedKVCache)
    layout = wrapper.prefill.layout if isinstance(wrapper, MultiLevelCascadeAttention) else wrapper.layout
    spec_q, spec_c = head_spec(tp_axis), cache_spec(layout, tp_axis=tp_axis)
    out = AttentionState(spec_q, P(None, tp_axis)) if return_lse else spec_q

    def body(q, kv_cache, plan, kv_lens):  # q [T, Hq / tp, D]
        if decode:
            return wrapper.run(q, kv_cache, plan, kv_lens=kv_lens, return_lse=return_lse)
        return wrapper.run(q, kv_cache, plan, return_lse=return_lse)

    sharded = shard_map(body, mesh, (spec_q, spec_c, P(), P()), out)

    def run(q, kv_cache, plan, kv_lens=None):
        if kv_lens is not None and not decode:
            raise ValueError("kv_lens is a decode wrapper's argument")
        return sharded(q, kv_cache, plan, kv_lens)
    return run


def head_parallel_ragged(mesh, *, tp_axis="tp", causal=True, sm_scale=None, num_ctas=None, backend=None,
                         impl="auto"):
    """ragged_paged_attention over heads split on tp_axis: run(queries, keys, values, kv_cache,
    kv_lens, page_indices, cu_q_lens, distribution, sliding_window=None, soft_cap=None) ->
    (out, kv_cache). queries [T, Hq, D], keys / values [T, Hkv, D] and the cache split on heads
    (Hkv: after replicate_kv_heads when fewer KV heads than devices); metadata replicated.
    causal, sm_scale, num_ctas, backend, impl: as ragged_paged_attention's, on every device."""
    _check_axis(mesh, "tp_axis", tp_axis)
    spec_q = head_spec(tp_axis)

    def body(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, window, cap):
        return ragged_paged_attention(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens,
                                      distribution, causal=causal, sm_scale=sm_scale, sliding_window=window,
                                      soft_cap=cap, num_ctas=num_ctas, backend=backend, impl=impl)

    def run(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
            sliding_window=None, soft_cap=None):
        spec_c = cache_spec(kv_cache.layout, tp_axis=tp_axis)
        sharded = shard_map(body, mesh, (spec_q, spec_q, spec_q, spec_c) + (P(),) * 6, (spec_q, spec_c))
        return sharded(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
                       sliding_window, soft_cap)
    return run


# ---------------------------------------------------------------------------------------------
# Context parallel


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class ContextSplit:
    """One global page table split into per-device tables (host NumPy; split_page_table)."""
    tables: tuple               # per device: (kv_indptr int32[B+1], kv_indices, kv_last_page_len int32[B])
    key_offsets: np.ndarray     # int32[n, B]: each request's keys before the device's share
    share_lens: np.ndarray      # int32[n, B]: keys in the device's share
    kv_lens: np.ndarray         # int32[B]: the global lengths
    qo_indptr: Optional[np.ndarray]  # int32[B+1] (prefill, BatchAttention) or None (decode)
    pages_per_shard: Optional[int]   # pages of each device's block of a page-sharded cache; None: replicated

    @property
    def num_shards(self):
        return len(self.tables)


def _causal_page_costs(kv_len, qo_len, num_pages, page_size):
    """float64[num_pages]: each page's keys weighted by 1 + the queries that see them (causal)."""
    j = np.arange(num_pages * page_size)
    seen = np.clip(kv_len - np.maximum(j, kv_len - qo_len), 0, None) * (j < kv_len)
    return ((1 + seen) * (j < kv_len)).reshape(num_pages, page_size).sum(1).astype(np.float64)


def split_page_table(kv_indptr, kv_indices, kv_last_page_len, page_size, num_shards, *, qo_indptr=None,
                     causal=False, pages_per_shard=None):
    """Splits a global CSR page table into num_shards tables, each a contiguous range of every
    request's pages (a share may be empty: a request shorter than a share lands on fewer devices).

    pages_per_shard=None (cache replicated over the CP axis): shares are balanced by keys, or with
    qo_indptr and causal=True by causal work (each key weighted by the queries that see it, so the
    early shares are shorter). pages_per_shard=N (cache sharded on pages, N per device): device k
    owns the pages with ids in [k N, (k + 1) N); each request must list its pages device by device
    in that order; ids become device-local. Returns a ContextSplit."""
    if not isinstance(num_shards, (int, np.integer)) or num_shards < 1:
        raise ValueError(f"num_shards must be an int >= 1, got {num_shards!r}")
    indptr, indices, last, kv_lens, pages = validate.check_page_table(kv_indptr, kv_indices, kv_last_page_len,
                                                                      page_size)
    batch = pages.shape[0]
    qo_lens = None
    if qo_indptr is not None:
        qo_indptr, qo_lens, _ = validate.indptr_lengths("qo_indptr", qo_indptr)
        if qo_indptr.shape[0] != batch + 1:
            raise ValueError(f"qo_indptr describes {qo_indptr.shape[0] - 1} requests, kv_indptr {batch}")
    bounds = np.zeros((num_shards + 1, batch), np.int64)  # [n + 1, B]: page boundaries of the shares
    if pages_per_shard is None:
        for r in range(batch):
            n_r = int(pages[r])
            if n_r == 0:
                continue
            if causal and qo_lens is not None:
                cost = _causal_page_costs(int(kv_lens[r]), int(qo_lens[r]), n_r, page_size)
            else:
                cost = np.full(n_r, float(page_size))
                cost[-1] = last[r]
            cum = np.concatenate([[0.0], np.cumsum(cost)])
            bounds[:, r] = np.rint(np.interp(cum[-1] * np.arange(num_shards + 1) / num_shards, cum,
                                             np.arange(n_r + 1)))
    else:
        if pages_per_shard < 1:
            raise ValueError(f"pages_per_shard must be >= 1, got {pages_per_shard}")
        owner = indices[: indptr[-1]].astype(np.int64) // pages_per_shard
        if owner.size and owner.max() >= num_shards:
            raise ValueError(f"kv_indices holds page ids past num_shards x pages_per_shard "
                             f"({num_shards * pages_per_shard})")
        for r in range(batch):
            own = owner[indptr[r]:indptr[r + 1]]
            if np.any(np.diff(own) < 0):
                raise ValueError(f"kv_indices: request {r} must list its pages device by device (page ids in "
                                 f"ascending blocks of pages_per_shard = {pages_per_shard})")
            bounds[:, r] = np.searchsorted(own, np.arange(num_shards + 1), side="left")
        bounds[-1] = pages
    tables, offsets, shares = [], [], []
    for k in range(num_shards):
        lo, hi = bounds[k], bounds[k + 1]
        count = (hi - lo).astype(np.int32)
        sub_indptr = np.zeros(batch + 1, np.int32)
        np.cumsum(count, out=sub_indptr[1:])
        take = np.repeat(indptr[:-1] + lo - sub_indptr[:-1], count) + np.arange(sub_indptr[-1])
        sub_indices = indices[take].astype(np.int32)
        if pages_per_shard is not None:
            sub_indices -= np.int32(k * pages_per_shard)
        has_last = (hi == pages) & (count > 0)
        sub_last = np.where(has_last, last, page_size).astype(np.int32)
        tables.append((sub_indptr, sub_indices, sub_last))
        offsets.append(lo * page_size)
        shares.append(np.where(count > 0, (count - 1) * page_size + sub_last, 0))
    return ContextSplit(tables=tuple(tables), key_offsets=np.asarray(offsets, np.int32),
                        share_lens=np.asarray(shares, np.int32), kv_lens=kv_lens.astype(np.int32),
                        qo_indptr=qo_indptr, pages_per_shard=pages_per_shard)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class ContextPlan:
    """Per-device plans stacked on a leading device axis (context_plan); place it with
    put(plan, NamedSharding(mesh, P(cp_axis))). Rows of q are gathered into each device's
    sub-batches: `diag` (causal) holds the queries that lie inside the device's share, `full`
    (no mask) those after it (all rows without causal); queries before the share see none of it."""
    full: object                       # stacked wrapper plans
    diag: object = None                # stacked causal plans, or None
    full_rows: Optional[jax.Array] = None   # int32[n, Tcap]: q rows of the full sub-batch
    diag_rows: Optional[jax.Array] = None   # int32[n, Tcap]
    src: Optional[jax.Array] = None    # int32[n, T]: each q row's row of (diag, full, empty) outputs
    key_offsets: jax.Array = None      # int32[n, B]
    share_lens: jax.Array = None       # int32[n, B]
    pages_per_shard: Optional[int] = None

    def tree_flatten(self):
        return ((self.full, self.diag, self.full_rows, self.diag_rows, self.src, self.key_offsets,
                 self.share_lens), self.pages_per_shard)

    @classmethod
    def tree_unflatten(cls, pages_per_shard, children):
        full, diag, full_rows, diag_rows, src, key_offsets, share_lens = children
        return cls(full=full, diag=diag, full_rows=full_rows, diag_rows=diag_rows, src=src,
                   key_offsets=key_offsets, share_lens=share_lens, pages_per_shard=pages_per_shard)


def _stack(plans):
    """One pytree with a leading device axis; ValueError when the devices' plans differ in shape."""
    structures = {jax.tree.structure(p) for p in plans}
    shapes = {tuple(np.shape(x) for x in jax.tree.leaves(p)) for p in plans}
    if len(structures) > 1 or len(shapes) > 1:
        raise ValueError("the devices' plans differ in structure or shape: build the wrapper with "
                         "max_batch_size, max_num_tokens and max_num_pages (max_batch_size and "
                         "max_num_pages for decode) so that every plan has one shape")
    return jax.tree.map(lambda *xs: jnp.stack(xs), *plans)


def _ranges(starts, lens, cap, pad):
    """int32[cap]: the concatenated row ranges [starts[i], starts[i] + lens[i]), then pad."""
    rows = np.repeat(starts - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()))
    return np.concatenate([rows, np.full(cap - rows.shape[0], pad)]).astype(np.int32)


def _sub_batches(split, k, causal, num_rows):
    """Device k's (diag qo_indptr, diag rows, full qo_indptr, full rows, src) for num_rows q rows."""
    qo = split.qo_indptr
    qo_lens, kv_lens = np.diff(qo), split.kv_lens
    lo = split.key_offsets[k].astype(np.int64)
    hi = lo + split.share_lens[k]
    first = kv_lens - qo_lens.astype(np.int64)  # global position of each request's first query
    has = hi > lo
    if causal:  # queries at [lo, hi) see keys up to themselves; those at >= hi see the whole share
        d0 = np.maximum(lo, first)
        d_len = np.where(has, np.clip(hi - d0, 0, None), 0)
        f0 = np.maximum(hi, first)
        f_len = np.where(has, kv_lens - f0, 0)
    else:
        d0, d_len, f0, f_len = first, np.zeros_like(first), first, np.where(has, qo_lens, 0)
    d_start, f_start = qo[:-1] + (d0 - first), qo[:-1] + (f0 - first)
    src = np.full(num_rows, 2 * num_rows, np.int64)
    d_rows = _ranges(d_start, d_len, num_rows, 0)
    f_rows = _ranges(f_start, f_len, num_rows, 0)
    nd, nf = int(d_len.sum()), int(f_len.sum())
    src[d_rows[:nd]] = np.arange(nd)
    src[f_rows[:nf]] = num_rows + np.arange(nf)
    indptr = lambda lens: np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return indptr(d_len), d_rows, indptr(f_len), f_rows, src.astype(np.int32)


def context_plan(wrapper, split, *, num_pages, horizon=1, q_data_type=None, kv_data_type=None):
    """The ContextPlan of `wrapper` (the per-device one) over split's per-device tables.

    num_pages: the global cache's page count (with pages_per_shard: num_shards x pages_per_shard).
    horizon: decode plans only (run with kv_lens). q_data_type / kv_data_type: prefill and
    BatchAttention plans (as their plan()). The wrapper needs fixed-shape capacities (one plan
    shape for every device); its q has max_batch_size (decode) or max_num_tokens rows."""
    _check_wrapper(wrapper)
    if not isinstance(split, ContextSplit):
        raise ValueError("split must be a ContextSplit from split_page_table")
    if wrapper.variant is not None:
        raise ValueError("context parallelism runs without a variant (a device would see its keys at "
                         "share-local positions)")
    n = split.num_shards
    if split.pages_per_shard is None:
        local_pages = num_pages
    elif num_pages != n * split.pages_per_shard:
        raise ValueError(f"num_pages ({num_pages}) must be num_shards x pages_per_shard "
                         f"({n} x {split.pages_per_shard})")
    else:
        local_pages = split.pages_per_shard
    key_offsets, share_lens = jnp.asarray(split.key_offsets), jnp.asarray(split.share_lens)
    if isinstance(wrapper, BatchDecodeWithPagedKVCache):
        if split.qo_indptr is not None:
            raise ValueError("split has a qo_indptr: a decode split takes none")
        plans = [wrapper.plan(*t, num_pages=local_pages, horizon=horizon) for t in split.tables]
        return ContextPlan(full=_stack(plans), key_offsets=key_offsets, share_lens=share_lens,
                           pages_per_shard=split.pages_per_shard)
    if split.qo_indptr is None:
        raise ValueError("a prefill or BatchAttention split needs qo_indptr (split_page_table(qo_indptr=))")
    if horizon != 1:
        raise ValueError("horizon is a decode plan's argument")
    if wrapper.max_num_tokens is None:
        raise ValueError("context parallel prefill needs the wrapper's max_num_tokens (and max_batch_size, "
                         "max_num_pages)")
    num_rows = int(wrapper.max_num_tokens)

    def full_plan(qo_indptr, table):  # no mask: BatchAttention's own prefill wrapper when it is causal
        if isinstance(wrapper, BatchAttention) and not wrapper.causal:
            return wrapper.plan(qo_indptr, *table, num_pages=local_pages, q_data_type=q_data_type,
                                kv_data_type=kv_data_type)
        runner = wrapper.prefill if isinstance(wrapper, BatchAttention) else wrapper
        return runner.plan(qo_indptr, *table, num_pages=local_pages, causal=False, q_data_type=q_data_type,
                           kv_data_type=kv_data_type)

    diag_plans, full_plans, d_rows, f_rows, srcs = [], [], [], [], []
    for k, table in enumerate(split.tables):
        d_qo, d_r, f_qo, f_r, src = _sub_batches(split, k, wrapper.causal, num_rows)
        if wrapper.causal:
            diag_plans.append(wrapper.plan(d_qo, *table, num_pages=local_pages, q_data_type=q_data_type,
                                           kv_data_type=kv_data_type))
        full_plans.append(full_plan(f_qo, table))
        d_rows.append(d_r), f_rows.append(f_r), srcs.append(src)
    causal = wrapper.causal
    return ContextPlan(full=_stack(full_plans), diag=_stack(diag_plans) if causal else None,
                       full_rows=jnp.asarray(np.stack(f_rows)),
                       diag_rows=jnp.asarray(np.stack(d_rows)) if causal else None,
                       src=jnp.asarray(np.stack(srcs)), key_offsets=key_offsets, share_lens=share_lens,
                       pages_per_shard=split.pages_per_shard)


def merge_over(state, axis):
    """The exact ⊕ of the states (o [..., H, D], lse [..., H]) of every device along mesh axis
    `axis` (inside shard_map): pmax of lse, psum of exp(lse - max), psum of the weighted o in
    float32. Empty states (lse = -inf) weigh 0; all empty gives o = 0, lse = -inf."""
    o, lse = state
    top = lax.pmax(lse, axis)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp(lse - top)  # [..., H]: 0 for an empty state
    total = lax.psum(w, axis)
    scale = w / jnp.where(total > 0, total, 1.0)
    merged = lax.psum(o.astype(jnp.float32) * scale[..., None], axis)
    return AttentionState(merged.astype(o.dtype), jnp.where(total > 0, top + jnp.log(total), -jnp.inf))


def _local_state(wrapper, q, kv_cache, plan, kv_lens):
    """One device's partial AttentionState of the global query rows q [T, Hq, D]."""
    if isinstance(wrapper, BatchDecodeWithPagedKVCache):
        lens = None if kv_lens is None else jnp.clip(kv_lens - plan.key_offsets, 0, plan.share_lens)
        return wrapper.run(q, kv_cache, plan.full, kv_lens=lens, return_lse=True)
    full_wrapper = wrapper.prefill if isinstance(wrapper, BatchAttention) and wrapper.causal else wrapper
    states = [full_wrapper.run(q[plan.full_rows], kv_cache, plan.full, return_lse=True)]
    if plan.diag is not None:
        states.insert(0, wrapper.run(q[plan.diag_rows], kv_cache, plan.diag, return_lse=True))
    else:  # keep the (diag, full, empty) row numbering of src
        states.insert(0, AttentionState(jnp.zeros_like(states[0].o), jnp.full_like(states[0].lse, -jnp.inf)))
    h, d = q.shape[1:]
    o = jnp.concatenate([s.o for s in states] + [jnp.zeros((1, h, d), q.dtype)])[plan.src]
    lse = jnp.concatenate([s.lse for s in states] + [jnp.full((1, h), -jnp.inf, jnp.float32)])[plan.src]
    return AttentionState(o, lse)


def context_parallel(wrapper, mesh, *, cp_axis="cp", tp_axis=None, shard_pages=True, return_lse=False):
    """wrapper.run with the context split on mesh axis cp_axis (and heads on tp_axis, if given):
    run(q, kv_cache, plan, kv_lens=None) with a ContextPlan.

    q, o [T, Hq, D]: replicated over cp_axis (heads on tp_axis). The cache: pages sharded on
    cp_axis (shard_pages=True; split_page_table(pages_per_shard=)) or replicated. kv_lens
    (decode only, global int32[B], may be traced, e.g. plan horizons in lax.scan): each
    device reads clip(kv_lens - its key offset, 0, its share). Returns o or AttentionState."""
    _check_wrapper(wrapper)
    _check_axis(mesh, "cp_axis", cp_axis)
    _check_axis(mesh, "tp_axis", tp_axis)
    decode = isinstance(wrapper, BatchDecodeWithPagedKVCache)
    spec_q = head_spec(tp_axis)
    spec_c = cache_spec(wrapper.layout, tp_axis=tp_axis, cp_axis=cp_axis if shard_pages else None)
    out = AttentionState(spec_q, P(None, tp_axis)) if return_lse else spec_q

    def body(q, kv_cache, plan, kv_lens):
        plan = jax.tree.map(lambda x: x[0], plan)  # this device's plan
        state = merge_over(_local_state(wrapper, q, kv_cache, plan, kv_lens), cp_axis)
        return state if return_lse else state.o

    sharded = shard_map(body, mesh, (spec_q, spec_c, P(cp_axis), P()), out)

    def run(q, kv_cache, plan, kv_lens=None):
        if not isinstance(plan, ContextPlan):
            raise ValueError("plan must be a ContextPlan from context_plan")
        if (plan.pages_per_shard is not None) != shard_pages:
            raise ValueError(f"plan was split for a {'page-sharded' if plan.pages_per_shard else 'replicated'} "
                             f"cache but shard_pages={shard_pages}")
        if kv_lens is not None and not decode:
            raise ValueError("kv_lens is a decode wrapper's argument")
        return sharded(q, kv_cache, plan, kv_lens)
    return run
