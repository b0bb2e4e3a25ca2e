"""Attention over several devices: by heads (tensor parallel, TP), by context (CP), or both.

TP: q, o and the paged cache are split on heads along a mesh axis; every device runs the wrapper
built for its heads (split_heads) with one replicated plan. CP: split_page_table gives each device
a contiguous range of every request's pages; context_plan makes one plan per device (stacked on
the mesh axis); each device computes its partial AttentionState and the states are merged exactly
in float32: by a psum-based log-sum-exp merge (pmax of lse, psum of the weighted o), by an
all-gather of the states and the same merge on every device, or by an all-to-all (each device
merges a slice of the rows) and an all-gather of the merged slices, whichever moves fewer bytes
(merge_choice). For long prompts split_queries splits the query rows instead: each device
computes its rows whole over the keys they see (the pages it needs gathered from the devices
that hold them) and the devices exchange their rows. MLA splits its latent cache's pages
the same way (context_parallel of a BatchMLAPagedAttention), and a cascade each of its levels'
(split_cascade_levels). ragged_paged_attention has both too (head_parallel_ragged, and
context_parallel_ragged, which plans each device's share on the device). Both together on a 2-D
mesh ("tp", "cp"). The runners are shard_map'd functions:
they work under jax.jit, lax.scan and jax.distributed alike. Usage and the choice of merge:
docs/sharding.md.
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
from jaxinfer.formats import FUSED, AttentionState, CascadeLevel, PagedKVCache, check_sinks, is_concrete
from jaxinfer.mla import BatchMLAPagedAttention
from jaxinfer.mla_ragged import mla_ragged_paged_attention
from jaxinfer.prefill import BatchPrefillWithPagedKVCache
from jaxinfer import _backend, ragged_plan, variants
from jaxinfer.page import write_slots
from jaxinfer.ragged import check_metadata as ragged_check_metadata
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
_TP_WRAPPERS = _WRAPPERS + (MultiLevelCascadeAttention,)  # head_parallel's (and context_parallel's, by levels)


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
        axis = 1 if x.layout == "HND" else 2
        return x.tree_unflatten(x.layout, tuple(jnp.repeat(a, replicas, axis) for a in x.arrays))
    return jnp.repeat(x, replicas, axis=1)


def head_spec(tp_axis):
    """PartitionSpec of q / o [T, H, D] (and lse [T, H] by its first two entries)."""
    return P(None, tp_axis, None)


def cache_spec(layout, *, tp_axis=None, cp_axis=None):
    """PartitionSpec of the cache's page arrays: KV heads on tp_axis, pages on cp_axis (None:
    replicated). NHD [P, page, Hkv, D]; HND [P, Hkv, page, D]; NHD_FUSED [P, page, Hkv, 2, D]."""
    if layout == "HND":
        return P(cp_axis, tp_axis, None, None)
    return P(cp_axis, None, tp_axis, None, None) if layout == FUSED else P(cp_axis, None, tp_axis, None)


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
    """wrapper.run over heads split on mesh axis tp_axis: run(q, kv_cache, plan, kv_lens=None,
    append_kv=None).

    wrapper: the per-device wrapper (split_heads' head counts): decode, prefill, BatchAttention or
    MultiLevelCascadeAttention; plan: its plan, replicated. q, o [T, Hq, D] split on heads
    (head_spec), the cache on KV heads (cache_spec). kv_lens (decode only, may be traced): as the
    decode wrapper's run(). append_kv (decode only): (k, v) [B, Hkv, D] split on heads as q, each
    request's new K/V written at its last position by the decode kernel on every device (as the
    decode wrapper's run(append_kv=(k, v)): no separate append launch); run then returns (o or
    AttentionState, the updated cache, split as it came). Returns o or AttentionState(o, lse [T, Hq]).

    A BatchMLAPagedAttention of num_heads / devices heads: run(q_nope, q_pe, ckv_cache, kpe_cache,
    plan, ckv_scale=None, kpe_scale=None), q_nope [T, H, Dc] and q_pe [T, H, Dr] split on heads,
    the latent caches and the scales replicated (every head reads every latent row)."""
    if isinstance(wrapper, BatchMLAPagedAttention):
        return _mla_head_parallel(wrapper, mesh, tp_axis, return_lse)
    _check_wrapper(wrapper, _TP_WRAPPERS)
    _check_axis(mesh, "tp_axis", tp_axis)
    decode = isinstance(wrapper, BatchDecodeWithPagedKVCache)
    layout = wrapper.prefill.layout if isinstance(wrapper, MultiLevelCascadeAttention) else wrapper.layout
    spec_q, spec_c = head_spec(tp_axis), cache_spec(layout, tp_axis=tp_axis)
    out = AttentionState(spec_q, P(None, tp_axis)) if return_lse else spec_q

    def body(q, kv_cache, plan, kv_lens, append):  # q [T, Hq / tp, D]; append: (k, v) [B, Hkv / tp, D] or None
        if decode:
            return wrapper.run(q, kv_cache, plan, kv_lens=kv_lens, return_lse=return_lse, append_kv=append)
        return wrapper.run(q, kv_cache, plan, return_lse=return_lse)

    sharded = shard_map(body, mesh, (spec_q, spec_c, P(), P(), P()), out)
    appending = shard_map(body, mesh, (spec_q, spec_c, P(), P(), (spec_q, spec_q)), (out, spec_c))

    def run(q, kv_cache, plan, kv_lens=None, append_kv=None):
        if kv_lens is not None and not decode:
            raise ValueError("kv_lens is a decode wrapper's argument")
        if append_kv is None:
            return sharded(q, kv_cache, plan, kv_lens, None)
        if not decode:
            raise ValueError("append_kv is a decode wrapper's argument")
        if isinstance(append_kv, str) or not isinstance(append_kv, (tuple, list)) or len(append_kv) != 2:
            raise ValueError("append_kv must be (k, v) [B, Hkv, D] under head_parallel (a fused q's heads would "
                             "split across devices)")
        return appending(q, kv_cache, plan, kv_lens, tuple(append_kv))
    return run


def _mla_head_parallel(wrapper, mesh, tp_axis, return_lse):
    _check_axis(mesh, "tp_axis", tp_axis)
    spec_q = head_spec(tp_axis)
    out = AttentionState(spec_q, P(None, tp_axis)) if return_lse else spec_q

    def body(q_nope, q_pe, ckv_cache, kpe_cache, plan, ckv_scale, kpe_scale):  # q [T, H / tp, D]
        return wrapper.run(q_nope, q_pe, ckv_cache, kpe_cache, plan, return_lse=return_lse, ckv_scale=ckv_scale,
                           kpe_scale=kpe_scale)

    sharded = shard_map(body, mesh, (spec_q, spec_q) + (P(),) * 5, out)

    def run(q_nope, q_pe, ckv_cache, kpe_cache, plan, ckv_scale=None, kpe_scale=None):
        return sharded(q_nope, q_pe, ckv_cache, kpe_cache, plan, ckv_scale, kpe_scale)
    return run


def head_parallel_mla_ragged(mesh, *, tp_axis="tp", sm_scale, causal=True, num_cells=None, backend=None,
                             config=None, impl="auto"):
    """mla_ragged_paged_attention over heads split on tp_axis: run(ql_nope, q_pe, new_kv_c, new_k_pe,
    ckv_cache, kpe_cache, kv_lens, page_indices, cu_q_lens, distribution, ckv_scale=None,
    kpe_scale=None) -> (o, ckv_cache, kpe_cache). ql_nope [T, H, Dc], q_pe [T, H, Dr] and o split
    on heads; the new latent rows, the latent caches (each device writes the same rows into its
    replica), the metadata and the scales replicated. sm_scale, causal, num_cells, backend,
    config, impl: as mla_ragged_paged_attention's, on every device (H / devices heads each)."""
    _check_axis(mesh, "tp_axis", tp_axis)
    spec_q = head_spec(tp_axis)

    def body(ql_nope, q_pe, *rest):
        *args, ckv_scale, kpe_scale = rest
        return mla_ragged_paged_attention(ql_nope, q_pe, *args, sm_scale=sm_scale, causal=causal, ckv_scale=ckv_scale,
                                          kpe_scale=kpe_scale, num_cells=num_cells, backend=backend, config=config,
                                          impl=impl)

    sharded = shard_map(body, mesh, (spec_q, spec_q) + (P(),) * 10, (spec_q, P(), P()))

    def run(ql_nope, q_pe, new_kv_c, new_k_pe, ckv_cache, kpe_cache, kv_lens, page_indices, cu_q_lens, distribution,
            ckv_scale=None, kpe_scale=None):
        return sharded(ql_nope, q_pe, new_kv_c, new_k_pe, ckv_cache, kpe_cache, kv_lens, page_indices, cu_q_lens,
                       distribution, ckv_scale, kpe_scale)
    return run


def head_parallel_ragged(mesh, *, tp_axis="tp", causal=True, sm_scale=None, num_ctas=None, backend=None,
                         impl="auto"):
    """ragged_paged_attention over heads split on tp_axis: run(queries, keys, values, kv_cache,
    kv_lens, page_indices, cu_q_lens, distribution, sliding_window=None, soft_cap=None,
    sinks=None) -> (out, kv_cache). queries [T, Hq, D], keys / values [T, Hkv, D], the cache and
    sinks f32[Hq] split on heads (Hkv: after replicate_kv_heads when fewer KV heads than devices);
    metadata replicated. causal, sm_scale, num_ctas, backend, impl: as ragged_paged_attention's,
    on every device."""
    _check_axis(mesh, "tp_axis", tp_axis)
    spec_q = head_spec(tp_axis)

    def body(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, window, cap, sink):
        return ragged_paged_attention(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens,
                                      distribution, causal=causal, sm_scale=sm_scale, sliding_window=window,
                                      soft_cap=cap, sinks=sink, num_ctas=num_ctas, backend=backend, impl=impl)

    def run(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
            sliding_window=None, soft_cap=None, sinks=None):
        check_sinks(sinks, queries.shape[1])
        spec_c = cache_spec(kv_cache.layout, tp_axis=tp_axis)
        sharded = shard_map(body, mesh, (spec_q, spec_q, spec_q, spec_c) + (P(),) * 6 + (P(tp_axis),),
                            (spec_q, spec_c))
        return sharded(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
                       sliding_window, soft_cap, None if sinks is None else jnp.asarray(sinks, jnp.float32))
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
    put(plan, NamedSharding(mesh, P(cp_axis))). Each device splits q's rows into two sub-batches
    over its share: `diag` (causal) holds each request's queries up to the share's end (those
    before the share see none of it: o = 0, lse = -inf), `full` (no mask) those after it (all
    rows without causal). `base` (static) names the sub-batch whose rows are q's first rows, in
    order, on every device (one prompt, for one): it runs on q itself and the other's rows are
    scattered into its output. Otherwise (None) both sub-batches gather their rows from q and
    one gather by `src` places their states. context_plan builds every leaf on the host (NumPy,
    one transfer when put on the mesh)."""
    full: object                       # stacked wrapper plans
    diag: object = None                # stacked causal plans, or None
    full_rows: Optional[np.ndarray] = None   # int32[n, Tcap]: q rows of the full sub-batch, then Tcap + j
    diag_rows: Optional[np.ndarray] = None   # int32[n, Tcap] (the same)
    src: Optional[np.ndarray] = None    # int32[n, T]: each q row's row of the (diag, full, empty) outputs
    key_offsets: np.ndarray = None     # int32[n, B]
    share_lens: np.ndarray = None      # int32[n, B]
    pages_per_shard: Optional[int] = None
    base: Optional[str] = None         # "diag", "full" or None (see above)
    has_full: bool = True              # a full launch runs (some device has full rows, or base "full")

    def tree_flatten(self):
        return ((self.full, self.diag, self.full_rows, self.diag_rows, self.src, self.key_offsets,
                 self.share_lens), (self.pages_per_shard, self.base, self.has_full))

    @classmethod
    def tree_unflatten(cls, aux, children):
        full, diag, full_rows, diag_rows, src, key_offsets, share_lens = children
        pages_per_shard, base, has_full = aux
        return cls(full=full, diag=diag, full_rows=full_rows, diag_rows=diag_rows, src=src,
                   key_offsets=key_offsets, share_lens=share_lens, pages_per_shard=pages_per_shard,
                   base=base, has_full=has_full)


def _device_pages(num_shards, pages_per_shard, num_pages):
    """The pages of the cache a device's plans address: the global num_pages (replicated cache,
    pages_per_shard None) or its block, pages_per_shard (ValueError unless num_pages is
    num_shards x pages_per_shard)."""
    if pages_per_shard is None:
        return num_pages
    if num_pages != num_shards * pages_per_shard:
        raise ValueError(f"num_pages ({num_pages}) must be num_shards x pages_per_shard "
                         f"({num_shards} x {pages_per_shard})")
    return pages_per_shard


def _stack(plans):
    """One pytree with a leading device axis; ValueError when the devices' plans differ in shape.
    Host leaves (the planners' NumPy arrays) stay on the host: one transfer places the stacked
    plan on every device, where device arrays stacked here would each cost a dispatch, then a
    copy to every other device."""
    structures = {jax.tree.structure(p) for p in plans}
    shapes = {tuple(np.shape(x) for x in jax.tree.leaves(p)) for p in plans}
    if len(structures) > 1 or len(shapes) > 1:
        raise ValueError("the devices' plans differ in structure or shape: build the wrapper with "
                         "max_batch_size, max_num_tokens and max_num_pages (max_batch_size and "
                         "max_num_pages for decode) so that every plan has one shape")
    stack = lambda *xs: np.stack(xs) if all(isinstance(x, np.ndarray) for x in xs) else jnp.stack(xs)
    return jax.tree.map(stack, *plans)


def _ranges(starts, lens):
    """int64[sum(lens)]: the concatenated row ranges [starts[i], starts[i] + lens[i])."""
    lens = np.asarray(lens, np.int64)
    return np.repeat(np.asarray(starts, np.int64) - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()))


def _padded(rows, cap):
    """int32[cap]: rows, then cap + j for the j-th padding entry (out of bounds and distinct, so
    that a scatter by them drops the padding and every index stays unique and sorted)."""
    return np.concatenate([rows, cap + np.arange(cap - rows.shape[0])]).astype(np.int32)


def _sub_batches(split, k, causal):
    """Device k's sub-batches as q rows: (diag rows, diag lengths [B], full rows, full lengths [B]).

    Causal: request r's diag rows are its queries at positions < the share's end hi (its first
    rows), its full rows those at >= hi (the rest). The queries before the share's start lo see
    none of it, and in the diag sub-request (the whole share, bottom-right causal) they see no
    key either, so they need no rows of their own. Without causal every row of a request with
    keys on the device is full."""
    qo = split.qo_indptr
    qo_lens, kv_lens = np.diff(qo).astype(np.int64), split.kv_lens.astype(np.int64)
    lo = split.key_offsets[k].astype(np.int64)
    hi = lo + split.share_lens[k]
    has = hi > lo
    if causal:
        first = kv_lens - qo_lens  # global position of each request's first query
        d_len = np.where(has, np.clip(hi - first, 0, qo_lens), 0)
        f_len = np.where(has, qo_lens - d_len, 0)
    else:
        d_len, f_len = np.zeros_like(qo_lens), np.where(has, qo_lens, 0)
    starts = qo[:-1].astype(np.int64)
    return _ranges(starts, d_len), d_len, _ranges(starts + d_len, f_len), f_len


def context_plan(wrapper, split, *, num_pages, horizon=1, q_data_type=None, kv_data_type=None,
                 fixed_shapes=False):
    """The ContextPlan of `wrapper` (the per-device one) over split's per-device tables.

    num_pages: the global cache's page count (with pages_per_shard: num_shards x pages_per_shard).
    horizon: decode plans only (run with kv_lens). q_data_type / kv_data_type: prefill and
    BatchAttention plans (as their plan()). The wrapper needs fixed-shape capacities (one plan
    shape for every device); its q has max_batch_size (decode) or max_num_tokens rows.
    fixed_shapes=True: one pytree structure and one set of shapes for every split under the
    wrapper's capacities, so that a jitted serving step compiles once: key_offsets and share_lens
    padded to max_batch_size requests (decode kv_lens then has max_batch_size entries), and a
    prefill plan always takes the general form (base None, both sub-batches launched), where
    False picks the cheapest form for this split (one prompt: no gathers, no second launch).

    A QuerySplit (split_queries) gives a QueryPlan: each device's sub-requests planned by the
    wrapper (prefill or BatchAttention), whose shapes are the wrapper's capacities, the split's
    num_rows and its gather width (gather_capacity), whatever fixed_shapes says."""
    _check_wrapper(wrapper, _TP_WRAPPERS + (BatchMLAPagedAttention,))
    if isinstance(wrapper, MultiLevelCascadeAttention) or isinstance(split, CascadeSplit):
        return _cascade_context_plan(wrapper, split, num_pages, horizon)
    if not isinstance(split, (ContextSplit, QuerySplit)):
        raise ValueError("split must be a ContextSplit from split_page_table or a QuerySplit from split_queries")
    if not isinstance(wrapper, BatchMLAPagedAttention) and wrapper.variant is not None:
        raise ValueError("context parallelism runs without a variant (a device would see its keys at "
                         "share-local positions)")
    if isinstance(split, QuerySplit):
        if horizon != 1:
            raise ValueError("horizon is a decode plan's argument")
        if isinstance(wrapper, BatchMLAPagedAttention):
            raise ValueError("BatchMLAPagedAttention splits its keys under CP (split_page_table)")
        return _query_plan(wrapper, split, num_pages, q_data_type, kv_data_type)
    n = split.num_shards
    local_pages = _device_pages(n, split.pages_per_shard, num_pages)
    key_offsets, share_lens = split.key_offsets, split.share_lens
    if fixed_shapes:
        if wrapper.max_batch_size is None:
            raise ValueError("fixed_shapes needs the wrapper's max_batch_size")
        if key_offsets.shape[1] > wrapper.max_batch_size:
            raise ValueError(f"split has {key_offsets.shape[1]} requests, past the wrapper's max_batch_size "
                             f"({wrapper.max_batch_size})")
        pad = ((0, 0), (0, wrapper.max_batch_size - key_offsets.shape[1]))
        key_offsets, share_lens = np.pad(key_offsets, pad), np.pad(share_lens, pad)
    key_offsets, share_lens = key_offsets.astype(np.int32), share_lens.astype(np.int32)
    if isinstance(wrapper, BatchMLAPagedAttention):
        if horizon != 1:
            raise ValueError("horizon is a decode wrapper's argument")
        return _mla_context_plan(wrapper, split, local_pages, key_offsets, share_lens, q_data_type, kv_data_type)
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
    causal = wrapper.causal

    def full_plan(qo_indptr, table):  # no mask: BatchAttention's own prefill wrapper when it is causal
        if isinstance(wrapper, BatchAttention) and not wrapper.causal:
            return wrapper.plan(qo_indptr, *table, num_pages=local_pages, q_data_type=q_data_type,
                                kv_data_type=kv_data_type)
        runner = wrapper.prefill if isinstance(wrapper, BatchAttention) else wrapper
        return runner.plan(qo_indptr, *table, num_pages=local_pages, causal=False, q_data_type=q_data_type,
                           kv_data_type=kv_data_type)

    indptr = lambda lens: np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    subs = [_sub_batches(split, k, causal) for k in range(n)]
    has_full = any(f_r.shape[0] for _, _, f_r, _ in subs)
    in_order = lambda rows: bool(np.array_equal(rows, np.arange(rows.shape[0])))
    base = None
    if fixed_shapes:
        has_full = True
    elif causal and all(in_order(d_r) for d_r, _, _, _ in subs):
        base = "diag"
    elif not causal and all(in_order(f_r) for _, _, f_r, _ in subs):
        base = "full"
    diag_plans, full_plans, srcs = [], [], []
    for table, (d_r, d_len, f_r, f_len) in zip(split.tables, subs):
        if causal:
            diag_plans.append(wrapper.plan(indptr(d_len), *table, num_pages=local_pages,
                                           q_data_type=q_data_type, kv_data_type=kv_data_type))
        if has_full or base == "full":
            full_plans.append(full_plan(indptr(f_len), table))
        if base is None:  # rows of the (diag, full) outputs as concatenated, then the empty row
            full_at = num_rows if causal else 0
            src = np.full(num_rows, full_at + (num_rows if has_full else 0), np.int64)
            src[d_r] = np.arange(d_r.shape[0])
            src[f_r] = full_at + np.arange(f_r.shape[0])
            srcs.append(src.astype(np.int32))
    rows = lambda i: np.stack([_padded(sub[i], num_rows) for sub in subs])
    return ContextPlan(full=_stack(full_plans) if full_plans else None,
                       diag=_stack(diag_plans) if causal else None,
                       full_rows=rows(2) if full_plans and base != "full" else None,
                       diag_rows=rows(0) if causal and base is None else None,
                       src=np.stack(srcs) if base is None else None,
                       key_offsets=key_offsets, share_lens=share_lens,
                       pages_per_shard=split.pages_per_shard, base=base, has_full=bool(full_plans))


# ---------------------------------------------------------------------------------------------
# Context parallel over cascade levels


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class CascadeSplit:
    """A MultiLevelCascadeAttention step's levels split over devices (split_cascade_levels): per
    level its query groups and the ContextSplit of its page lists."""
    qo_indptrs: tuple   # per level: int32[G+1]
    splits: tuple       # per level: ContextSplit

    @property
    def num_shards(self):
        return self.splits[0].num_shards


def split_cascade_levels(levels, page_size, num_shards, *, pages_per_shard=None):
    """Splits each cascade level's page lists over num_shards devices as split_page_table splits
    a page table (pages_per_shard=N: device k holds pages [k N, (k + 1) N), each group listing
    its pages device by device; None: a replicated cache, balanced by keys). Every query of a
    level sees each of its groups' pages but the last level's causal diagonal, so each device
    runs the levels over its pages and the states merge as context_parallel's. Returns a
    CascadeSplit for context_plan."""
    qo_indptrs, splits = [], []
    for i, level in enumerate(levels):
        qo_indptr, kv_indptr, kv_indices, kv_last_page_len = level
        qo_indptrs.append(validate.check_indptr(f"levels[{i}].qo_indptr", qo_indptr))
        splits.append(split_page_table(kv_indptr, kv_indices, kv_last_page_len, page_size, num_shards,
                                       pages_per_shard=pages_per_shard))
    if not splits:
        raise ValueError("levels must hold at least one level")
    return CascadeSplit(qo_indptrs=tuple(qo_indptrs), splits=tuple(splits))


def _cascade_context_plan(wrapper, split, num_pages, horizon):
    """context_plan of a MultiLevelCascadeAttention over a CascadeSplit: each device's levels over
    its pages of them (a ContextPlan whose full plans are CascadePlans)."""
    if not isinstance(wrapper, MultiLevelCascadeAttention) or not isinstance(split, CascadeSplit):
        raise ValueError("a MultiLevelCascadeAttention takes a CascadeSplit (split_cascade_levels), and a "
                         "CascadeSplit a MultiLevelCascadeAttention")
    if horizon != 1:
        raise ValueError("horizon is a decode plan's argument")
    if len(split.splits) != wrapper.num_levels:
        raise ValueError(f"split has {len(split.splits)} levels, the wrapper {wrapper.num_levels}")
    if wrapper.causal and np.any(np.diff(split.qo_indptrs[-1]) > 1):
        raise ValueError("a causal cascade under CP takes one query row per last-level group (decode): a "
                         "row's causal diagonal would cut a device's pages")
    n, pages_per_shard = split.num_shards, split.splits[0].pages_per_shard
    local_pages = _device_pages(n, pages_per_shard, num_pages)
    plans = [wrapper.plan([CascadeLevel(qo, *s.tables[k]) for qo, s in zip(split.qo_indptrs, split.splits)],
                          num_pages=local_pages) for k in range(n)]
    return ContextPlan(full=_stack(plans), pages_per_shard=pages_per_shard)  # (no offsets: one shape a capacity)


# ---------------------------------------------------------------------------------------------
# Context parallel by query rows


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class QuerySplit:
    """One step's query rows split over devices (split_queries; host NumPy): each row is computed
    whole on one device, over every key it sees. Per device, sub-requests: each a run of one
    request's rows with the keys they see, its pages numbered in the gathered cache. max_*: the
    least capacities of the per-device wrapper (at least 1)."""
    tables: tuple              # per device: (qo_indptr int32[S+1], kv_indptr int32[S+1], kv_indices, kv_last_page_len int32[S])
    rows: tuple                # per device: int64[R_k], q rows of its sub-requests in order
    gather: Optional[np.ndarray]  # int32[n, G]: device-local ids of the pages each device lends; None: replicated cache
    num_rows: int              # rows of the global q (those of no request give o = 0, lse = -inf)
    pages_per_shard: Optional[int]

    @property
    def num_shards(self):
        return len(self.tables)

    @property
    def max_requests(self):
        """The per-device wrapper's max_batch_size must be at least this (sub-requests of one device)."""
        return max(1, max(int(t[0].shape[0]) - 1 for t in self.tables))

    @property
    def max_tokens(self):
        """The per-device wrapper's max_num_tokens must be at least this (rows of one device)."""
        return max(1, max(int(r.shape[0]) for r in self.rows))

    @property
    def max_pages(self):
        """The per-device wrapper's max_num_pages must be at least this (pages one device lists)."""
        return max(1, max(int(t[1][-1]) for t in self.tables))


def split_queries(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size, num_shards, *, causal=True,
                  pages_per_shard=None, num_rows=None, gather_capacity=None):
    """Splits a prefill step's query rows over num_shards devices (context parallel by rows, for
    long prompts): request r's rows are cut into 2 n equal runs and device (k + r) mod n takes
    runs k and 2 n - 1 - k, which balances causal work (a run's cost grows linearly with its
    position), and spreads requests of fewer rows than runs over the devices.
    Each run is a sub-request over the keys it sees (causal: up to its last row; else all of
    them). No partial states: each device computes its rows whole, and the devices exchange
    their rows' outputs (T rows of o, against key splitting's merge of T rows from every device),
    plus, with a page-sharded cache, the pages the step reads (Hkv / Hq of o's bytes a token).

    pages_per_shard=None: the cache is replicated over the CP axis. pages_per_shard=N: device k
    holds pages [k N, (k + 1) N) and lends those of them that the runs read (gathered to every
    device, G a device: the most any device lends, or gather_capacity for one shape across
    steps).
    num_rows: q's rows (default qo_indptr[-1]). Returns a QuerySplit for context_plan."""
    if not isinstance(num_shards, (int, np.integer)) or num_shards < 1:
        raise ValueError(f"num_shards must be an int >= 1, got {num_shards!r}")
    indptr, indices, last, kv_lens, pages = validate.check_page_table(kv_indptr, kv_indices, kv_last_page_len,
                                                                      page_size)
    qo_indptr, qo_lens, _ = validate.indptr_lengths("qo_indptr", qo_indptr)
    batch, n = pages.shape[0], int(num_shards)
    if qo_indptr.shape[0] != batch + 1:
        raise ValueError(f"qo_indptr describes {qo_indptr.shape[0] - 1} requests, kv_indptr {batch}")
    if np.any(qo_lens > kv_lens):
        raise ValueError("qo_indptr: a request has more queries than keys (kv_indptr, kv_last_page_len)")
    num_rows = int(qo_indptr[-1]) if num_rows is None else int(num_rows)
    if num_rows < qo_indptr[-1]:
        raise ValueError(f"num_rows ({num_rows}) must cover qo_indptr's {int(qo_indptr[-1])} rows")
    if pages_per_shard is not None and pages_per_shard < 1:
        raise ValueError(f"pages_per_shard must be >= 1, got {pages_per_shard}")
    subs = [[] for _ in range(n)]  # per device: (first row, rows, kv_len, global page ids)
    for r in range(batch):
        cuts = np.rint(np.linspace(0, int(qo_lens[r]), 2 * n + 1)).astype(np.int64)
        first = int(kv_lens[r] - qo_lens[r])  # position of the request's first query
        for c in range(2 * n):
            a, b = cuts[c], cuts[c + 1]
            seen = first + b if causal else int(kv_lens[r])
            if b > a and seen > 0:  # (the pairs rotate with r: one-row requests spread over the devices)
                subs[((c if c < n else 2 * n - 1 - c) + r) % n].append(
                    (qo_indptr[r] + a, b - a, seen, indices[indptr[r]: indptr[r] + -(-seen // page_size)]))
    gather = None
    if pages_per_shard is not None:  # each device lends the pages of its block that some run reads
        read = np.unique(np.concatenate([x[3] for sub in subs for x in sub] + [np.zeros(0, np.int32)]))
        owner, local = read // pages_per_shard, read % pages_per_shard
        if owner.size and owner.max() >= n:
            raise ValueError(f"kv_indices holds page ids past num_shards x pages_per_shard "
                             f"({n * pages_per_shard})")
        lent = [local[owner == k] for k in range(n)]  # (sorted, as read is)
        width = max(1, max(x.shape[0] for x in lent))
        if gather_capacity is not None:
            if gather_capacity < width:
                raise ValueError(f"gather_capacity ({gather_capacity}) is below the {width} pages a device lends")
            width = int(gather_capacity)
        gather = np.zeros((n, width), np.int32)  # (padding lends local page 0, which no table lists)
        at = np.empty(read.shape[0], np.int64)  # each read page's id in the gathered cache
        for k in range(n):
            gather[k, : lent[k].shape[0]] = lent[k]
            at[owner == k] = k * width + np.arange(lent[k].shape[0])
        subs = [[(*x[:3], at[np.searchsorted(read, x[3])]) for x in sub] for sub in subs]
    tables, rows = [], []
    for sub in subs:
        lens = np.asarray([s[1] for s in sub], np.int64)
        npg = np.asarray([s[3].shape[0] for s in sub], np.int64)
        seen = np.asarray([s[2] for s in sub], np.int64)
        tables.append((np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
                       np.concatenate([[0], np.cumsum(npg)]).astype(np.int32),
                       np.concatenate([s[3] for s in sub] + [np.zeros(0, np.int64)]).astype(np.int32),
                       (seen - (npg - 1) * page_size).astype(np.int32)))
        rows.append(_ranges([s[0] for s in sub], lens))
    return QuerySplit(tables=tuple(tables), rows=tuple(rows), gather=gather, num_rows=num_rows,
                      pages_per_shard=pages_per_shard)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class QueryPlan:
    """Per-device plans of a QuerySplit stacked on a leading device axis (context_plan); place it
    with put(plan, NamedSharding(mesh, P(cp_axis))). Device k gathers its rows of q (rows), runs
    the wrapper over them (plan) on the cache whose pages every device lent (gather), and every
    device takes each q row's output from the devices' outputs gathered in device order (src)."""
    plan: object                     # stacked wrapper plans
    rows: np.ndarray                 # int32[n, R]: device k's q rows, padded (R: the wrapper's max_num_tokens)
    src: np.ndarray                  # int32[n, T]: q row t's row k R + i of the gathered outputs, or -1 (none)
    gather: Optional[np.ndarray] = None  # int32[n, G], or None (replicated cache)
    pages_per_shard: Optional[int] = None

    def tree_flatten(self):
        return (self.plan, self.rows, self.src, self.gather), (self.pages_per_shard,)

    @classmethod
    def tree_unflatten(cls, aux, children):
        plan, rows, src, gather = children
        return cls(plan=plan, rows=rows, src=src, gather=gather, pages_per_shard=aux[0])


def _query_plan(wrapper, split, num_pages, q_data_type, kv_data_type):
    """context_plan of a QuerySplit."""
    if isinstance(wrapper, BatchDecodeWithPagedKVCache):
        raise ValueError("split_queries splits prefill rows: a decode step has one row per request "
                         "(split its keys: split_page_table)")
    if wrapper.max_num_tokens is None:
        raise ValueError("context parallel by rows needs the wrapper's max_num_tokens (and max_batch_size, "
                         "max_num_pages)")
    n = split.num_shards
    local_pages = _device_pages(n, split.pages_per_shard, num_pages)
    if split.gather is not None:
        local_pages = split.gather.size  # the lent pages of every device, gathered
    cap = int(wrapper.max_num_tokens)
    if split.max_tokens > cap:
        raise ValueError(f"a device gets {split.max_tokens} rows, past the wrapper's max_num_tokens ({cap})")
    plans = [wrapper.plan(*table, num_pages=local_pages, q_data_type=q_data_type, kv_data_type=kv_data_type)
             for table in split.tables]
    src = np.full(split.num_rows, -1, np.int64)
    for k, rows in enumerate(split.rows):
        src[rows] = k * cap + np.arange(rows.shape[0])
    padded = np.stack([np.concatenate([r, np.zeros(cap - r.shape[0], np.int64)]) for r in split.rows])
    return QueryPlan(plan=_stack(plans), rows=padded.astype(np.int32),
                     src=np.broadcast_to(src.astype(np.int32), (n, split.num_rows)).copy(),
                     gather=split.gather, pages_per_shard=split.pages_per_shard)


def _rows_state(wrapper, q, kv_cache, plan, axis):
    """Every q row's AttentionState under a QueryPlan (this device's slice of it): the lent pages
    gathered, this device's rows computed whole, every device's rows exchanged."""
    if plan.gather is not None:  # [n G, ...]: every device's lent pages, in device order
        kv_cache = jax.tree.map(lambda a: lax.all_gather(jnp.take(a, plan.gather, axis=0), axis, tiled=True),
                                kv_cache)
    mine = wrapper.run(jnp.take(q, plan.rows, axis=0), kv_cache, plan.plan, return_lse=True)  # [R, H, D]
    cap = plan.rows.shape[0]
    has = plan.src >= 0
    src = jnp.where(has, plan.src, 0)
    if _axis_size(axis) == 2:  # one swap; each device's rows from its own output or the other's
        other = jax.tree.map(lambda x: lax.ppermute(x, axis, [(0, 1), (1, 0)]), mine)
        here = (src // cap) == lax.axis_index(axis)
        pick = lambda x, y: jnp.where(here.reshape(-1, *[1] * (x.ndim - 1)), jnp.take(x, src % cap, axis=0),
                                      jnp.take(y, src % cap, axis=0))
        o, lse = pick(mine.o, other.o), pick(mine.lse, other.lse)
    else:
        o, lse = (jnp.take(lax.all_gather(x, axis, tiled=True), src, axis=0) for x in mine)
    o = jnp.where(has[:, None, None], o, jnp.zeros((), o.dtype))
    return AttentionState(o, jnp.where(has[:, None], lse, -jnp.inf))


# ---------------------------------------------------------------------------------------------
# Merging the devices' states

MERGES = ("auto", "psum", "all_gather", "all_to_all")


SMALL_STATE_BYTES = 4 << 20  # o of at most this many bytes a device: the merge is latency-bound


def merge_choice(num_devices, dtype, state_bytes=None):
    """The merge that merge="auto" runs over num_devices devices for o of `dtype` (state_bytes:
    o's bytes on one device, if known): "all_gather" where the state is small (<= 4 MiB: one
    collective instead of the psum's three; CP decode B8 kv131072 on 4 H100: 0.018 ms against
    0.048) or on 2 devices (one swap), else "all_to_all". Per element of o and device, with s its
    itemsize: the all-gather receives (n - 1) s bytes, the psum (float32) 8 (n - 1) / n, the
    all-to-all 2 (n - 1) / n s: the fewest from 3 devices on, and the psum's for float32 o."""
    if (state_bytes is not None and state_bytes <= SMALL_STATE_BYTES) or num_devices <= 2:
        return "all_gather"
    return "all_to_all"


def _check_merge(merge):
    if merge not in MERGES:
        raise ValueError(f"merge must be one of {', '.join(map(repr, MERGES))}, got {merge!r}")


def _axis_size(axis):
    if hasattr(lax, "axis_size"):
        return lax.axis_size(axis)
    return lax.psum(1, axis)  # (older jax: a constant under shard_map)


def _lse_merge(o, lse, reduce_max, reduce_sum):
    """The exact ⊕ of states o [..., H, D], lse [..., H] in float32, reduce_max / reduce_sum
    reducing over the states (collectives over a mesh axis, or a stacked axis kept as 1). An
    empty state (lse = -inf) weighs 0; all empty gives o = 0, lse = -inf."""
    top = reduce_max(lse)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp(lse - top)  # [..., H]: 0 for an empty state
    total = reduce_sum(w)
    scale = w / jnp.where(total > 0, total, 1.0)
    merged = reduce_sum(o.astype(jnp.float32) * scale[..., None])
    return merged.astype(o.dtype), jnp.where(total > 0, top + jnp.log(total), -jnp.inf)


def merge_over(state, axis, *, merge="auto"):
    """The exact ⊕ of the states (o [..., H, D], lse [..., H]) of every device along mesh axis
    `axis` (inside shard_map), in float32; every device gets the result. merge="psum": pmax of
    lse, psum of exp(lse - max), psum of the weighted o (float32); "all_gather": o (in its
    dtype) and lse gathered from every device (on 2 devices one swap, lax.ppermute: the same
    bytes without the gather's local copy), then the same arithmetic on each; "all_to_all": each
    device merges a slice of the rows, then gathers the merged slices; "auto": merge_choice's.
    Empty states (lse = -inf) weigh 0; all empty gives o = 0, lse = -inf."""
    _check_merge(merge)
    o, lse = state
    if merge == "auto":
        merge = merge_choice(_axis_size(axis), o.dtype, o.size * o.dtype.itemsize)
    if merge == "psum":
        out = _lse_merge(o, lse, lambda x: lax.pmax(x, axis), lambda x: lax.psum(x, axis))
        return AttentionState(*out)
    if merge == "all_to_all":
        return _all_to_all_merge(o, lse, axis)
    if _axis_size(axis) == 2:  # one swap moves what the all-gather moves, without its local copy
        swap = lambda x: lax.ppermute(x, axis, [(0, 1), (1, 0)])
        # Both devices stack the states in device order: fused multiply-adds are not symmetric,
        # and the replicas must hold the same bits.
        first = lax.axis_index(axis) == 0
        in_order = lambda x, y: jnp.stack([jnp.where(first, x, y), jnp.where(first, y, x)])
        o_all, lse_all = in_order(o, swap(o)), in_order(lse, swap(lse))  # [2, ...]
    else:
        o_all, lse_all = lax.all_gather(o, axis), lax.all_gather(lse, axis)  # [n, ...]
    return _merge_stacked(o_all, lse_all)


def _merge_stacked(o_all, lse_all):
    """The ⊕ of states stacked on axis 0 (o [n, ...], lse [n, ...]), in stack order."""
    o_m, lse_m = _lse_merge(o_all, lse_all, lambda x: jnp.max(x, 0, keepdims=True),
                            lambda x: jnp.sum(x, 0, keepdims=True))
    return AttentionState(o_m[0], lse_m[0])


def _all_to_all_merge(o, lse, axis):
    """merge="all_to_all": the rows cut into n slices (padded to a multiple of n), device k
    receives every device's state of slice k (one all-to-all, in o's dtype), merges them in
    device order, and an all-gather of the merged slices gives every device all rows. Each row
    is merged once, so the replicas hold the same bits."""
    n, t = _axis_size(axis), o.shape[0]
    pad = -t % n
    if pad:
        o = jnp.pad(o, [(0, pad)] + [(0, 0)] * (o.ndim - 1))
        lse = jnp.pad(lse, [(0, pad)] + [(0, 0)] * (lse.ndim - 1), constant_values=-jnp.inf)
    rows = (t + pad) // n
    gather_slice = lambda x: lax.all_to_all(x, axis, 0, 0, tiled=True).reshape(n, rows, *x.shape[1:])
    merged = _merge_stacked(gather_slice(o), gather_slice(lse))  # [rows, ...]: this device's slice
    return jax.tree.map(lambda x: lax.all_gather(x, axis, tiled=True)[:t], merged)


def _local_state(wrapper, q, kv_cache, plan, kv_lens):
    """One device's partial AttentionState of the global query rows q [T, Hq, D]."""
    if isinstance(wrapper, MultiLevelCascadeAttention):  # every level over the device's pages of it
        return wrapper.run(q, kv_cache, plan.full, return_lse=True)
    if isinstance(wrapper, BatchDecodeWithPagedKVCache):
        lens = None if kv_lens is None else jnp.clip(kv_lens - plan.key_offsets, 0, plan.share_lens)
        return wrapper.run(q, kv_cache, plan.full, kv_lens=lens, return_lse=True)
    full_wrapper = wrapper.prefill if isinstance(wrapper, BatchAttention) and wrapper.causal else wrapper
    take = lambda rows: jnp.take(q, rows, axis=0, mode="clip")  # (padding entries read row T - 1)
    if plan.base == "full":  # no diag sub-batch
        return full_wrapper.run(q, kv_cache, plan.full, return_lse=True)
    if plan.base == "diag":  # the diag outputs in place, the full rows scattered in (padding dropped)
        o, lse = wrapper.run(q, kv_cache, plan.diag, return_lse=True)
        if plan.has_full:
            full = full_wrapper.run(take(plan.full_rows), kv_cache, plan.full, return_lse=True)
            put_rows = lambda x, y: x.at[plan.full_rows].set(y, mode="drop", indices_are_sorted=True,
                                                             unique_indices=True)
            o, lse = put_rows(o, full.o), put_rows(lse, full.lse)
        return AttentionState(o, lse)
    states = []
    if plan.diag is not None:
        states.append(wrapper.run(take(plan.diag_rows), kv_cache, plan.diag, return_lse=True))
    if plan.has_full:
        states.append(full_wrapper.run(take(plan.full_rows), kv_cache, plan.full, return_lse=True))
    h = q.shape[1]
    if states:
        dv, dtype = states[0].o.shape[-1], states[0].o.dtype
    else:
        dv, dtype = getattr(full_wrapper, "head_dim_vo", q.shape[2]), q.dtype
    o = jnp.concatenate([s.o for s in states] + [jnp.zeros((1, h, dv), dtype)])
    lse = jnp.concatenate([s.lse for s in states] + [jnp.full((1, h), -jnp.inf, jnp.float32)])
    return AttentionState(jnp.take(o, plan.src, axis=0, mode="clip"), jnp.take(lse, plan.src, axis=0, mode="clip"))


def _context_sharded(wrapper, mesh, cp_axis, tp_axis, shard_pages, finish, out, whole=None):
    """run(q, kv_cache, plan, kv_lens=None): shard_map of finish(each device's local state) for a
    ContextPlan, of whole(every row's state) for a QueryPlan (whole None: QueryPlans refused)."""
    _check_wrapper(wrapper, _TP_WRAPPERS)
    _check_axis(mesh, "cp_axis", cp_axis)
    _check_axis(mesh, "tp_axis", tp_axis)
    decode = isinstance(wrapper, BatchDecodeWithPagedKVCache)
    layout = wrapper.prefill.layout if isinstance(wrapper, MultiLevelCascadeAttention) else wrapper.layout
    spec_q = head_spec(tp_axis)
    spec_c = cache_spec(layout, tp_axis=tp_axis, cp_axis=cp_axis if shard_pages else None)
    n = mesh.shape[cp_axis]

    def body(q, kv_cache, plan, kv_lens):
        plan = jax.tree.map(lambda x: x[0], plan)  # this device's plan
        if isinstance(plan, QueryPlan):
            return whole(_rows_state(wrapper, q, kv_cache, plan, cp_axis))
        return finish(_local_state(wrapper, q, kv_cache, plan, kv_lens))

    sharded = shard_map(body, mesh, (spec_q, spec_c, P(cp_axis), P()), out)

    def run(q, kv_cache, plan, kv_lens=None):
        plans = (ContextPlan, QueryPlan) if whole is not None else ContextPlan
        if not isinstance(plan, plans):
            raise ValueError("plan must be a ContextPlan from context_plan"
                             + (" (or a QueryPlan)" if whole is not None else " over a split_page_table split"))
        if (plan.pages_per_shard is not None) != shard_pages:
            raise ValueError(f"plan was split for a {'page-sharded' if plan.pages_per_shard else 'replicated'} "
                             f"cache but shard_pages={shard_pages}")
        if isinstance(plan, QueryPlan) and shard_pages and kv_cache.num_pages != n * plan.pages_per_shard:
            raise ValueError(f"kv_cache has {kv_cache.num_pages} pages; the plan was split for {n} devices of "
                             f"{plan.pages_per_shard}")
        if isinstance(plan, QueryPlan) and q.shape[0] != plan.src.shape[1]:
            raise ValueError(f"q has {q.shape[0]} rows; the plan was split for {plan.src.shape[1]} (num_rows)")
        if kv_lens is not None and not decode:
            raise ValueError("kv_lens is a decode wrapper's argument")
        return sharded(q, kv_cache, plan, kv_lens)
    return run


def context_parallel(wrapper, mesh, *, cp_axis="cp", tp_axis=None, shard_pages=True, return_lse=False,
                     merge="auto"):
    """wrapper.run with the context split on mesh axis cp_axis (and heads on tp_axis, if given):
    run(q, kv_cache, plan, kv_lens=None) with a ContextPlan (keys split, states merged) or a
    QueryPlan (query rows split, each computed whole on one device and exchanged; merge unused).

    q, o [T, Hq, D]: replicated over cp_axis (heads on tp_axis). The cache: pages sharded on
    cp_axis (shard_pages=True; split_page_table(pages_per_shard=)) or replicated. kv_lens
    (decode only, global int32[B], may be traced, e.g. plan horizons in lax.scan): each
    device reads clip(kv_lens - its key offset, 0, its share). merge: how the devices' states
    are merged (merge_over): "psum", "all_gather", "all_to_all" or "auto" (merge_choice for the
    cp axis's size, o's dtype and its size). Returns o or AttentionState.

    A BatchMLAPagedAttention (its ContextPlan from a split_page_table split, the per-device
    wrapper's heads H / tp): run(q_nope, q_pe, ckv_cache, kpe_cache, plan, ckv_scale=None,
    kpe_scale=None), the latent caches [P, page, D] on pages over cp_axis and replicated over
    tp_axis, q_nope / q_pe / o split on heads over tp_axis: DeepSeek's latent cache split over the
    devices instead of held whole on each (vLLM's decode context parallel); decode rows, and
    causal multi-token rows (MTP verify) as _mla_sub_requests splits them.

    A MultiLevelCascadeAttention with its ContextPlan from a split_cascade_levels split: every
    device runs the levels over its pages of them; the states merge as above."""
    _check_merge(merge)
    _check_axis(mesh, "cp_axis", cp_axis)
    if isinstance(wrapper, BatchMLAPagedAttention):
        return _mla_context_parallel(wrapper, mesh, cp_axis, tp_axis, shard_pages, return_lse, merge)
    spec_q = head_spec(tp_axis)
    out = AttentionState(spec_q, P(None, tp_axis)) if return_lse else spec_q
    n = mesh.shape[cp_axis]

    def whole(state):
        return state if return_lse else state.o

    def finish(state):
        how = merge_choice(n, state.o.dtype, state.o.size * state.o.dtype.itemsize) if merge == "auto" else merge
        return whole(merge_over(state, cp_axis, merge=how))

    return _context_sharded(wrapper, mesh, cp_axis, tp_axis, shard_pages, finish, out, whole)


def _mla_sub_requests(split, k, causal):
    """Device k's MLA sub-requests as (first q row, rows, request): each request's rows over its
    share of keys. Causal: the rows before the share's end (its first rows) are one sub-request,
    bottom-right over the share (the rows before the share's start see none of it); each later
    row sees the whole share and is a one-row sub-request of its own. One-row requests (decode)
    and non-causal requests are one sub-request each, even over an empty share (o = 0, lse =
    -inf), so that a decode step keeps its rows in order."""
    qo = split.qo_indptr if split.qo_indptr is not None else np.arange(split.kv_lens.shape[0] + 1)
    q_lens, kv = np.diff(qo).astype(np.int64), split.kv_lens.astype(np.int64)
    hi = split.key_offsets[k].astype(np.int64) + split.share_lens[k]
    subs = []
    for r in range(q_lens.shape[0]):
        if q_lens[r] == 1 or not causal:
            if q_lens[r]:
                subs.append((int(qo[r]), int(q_lens[r]), r))
            continue
        if split.share_lens[k][r] == 0:
            continue
        diag = int(np.clip(hi[r] - (kv[r] - q_lens[r]), 0, q_lens[r]))  # rows at positions < the share's end
        if diag:
            subs.append((int(qo[r]), diag, r))
        subs += [(int(qo[r]) + j, 1, r) for j in range(diag, int(q_lens[r]))]
    return subs


def _mla_context_plan(wrapper, split, local_pages, key_offsets, share_lens, q_data_type, kv_data_type):
    """context_plan of a BatchMLAPagedAttention over a split_page_table split: each device's
    sub-requests (_mla_sub_requests) planned over its share's pages. Where they are the step's
    requests in order (decode, or no causal mask) the devices run q itself (full_rows None);
    otherwise full_rows [n, T] gathers each device's rows and src [n, T] places their states
    (row T: the empty state)."""
    num_rows = int(wrapper.max_num_tokens) if wrapper.max_num_tokens is not None else None
    plans, row_lists = [], []
    for k, (indptr, indices, _) in enumerate(split.tables):
        subs = _mla_sub_requests(split, k, wrapper.causal)
        req = np.asarray([x[2] for x in subs], np.int64)
        lens = np.asarray([x[1] for x in subs], np.int64)
        npg = (indptr[1:] - indptr[:-1])[req]
        take = _ranges(indptr[:-1][req], npg)
        to32 = lambda x: np.concatenate([[0], np.cumsum(x)]).astype(np.int32)  # noqa: E731
        plans.append(wrapper.plan(to32(lens), to32(npg), indices[take].astype(np.int32),
                                  split.share_lens[k][req].astype(np.int32), num_pages=local_pages,
                                  q_dtype=q_data_type or jnp.bfloat16, kv_dtype=kv_data_type))
        row_lists.append(_ranges([x[0] for x in subs], lens))
    in_order = all(np.array_equal(rows, np.arange(rows.shape[0])) for rows in row_lists)
    full_rows = src = None
    if not in_order:
        if num_rows is None:
            raise ValueError("BatchMLAPagedAttention under CP with causal multi-token rows needs the wrapper's "
                             "max_num_tokens (and max_batch_size, max_num_pages)")
        src = np.full((split.num_shards, num_rows), num_rows, np.int64)
        for k, rows in enumerate(row_lists):
            src[k, rows] = np.arange(rows.shape[0])
        full_rows = np.stack([_padded(rows, num_rows) for rows in row_lists])
    return ContextPlan(full=_stack(plans), full_rows=full_rows, src=None if src is None else src.astype(np.int32),
                       key_offsets=key_offsets, share_lens=share_lens, pages_per_shard=split.pages_per_shard)


def _mla_context_parallel(wrapper, mesh, cp_axis, tp_axis, shard_pages, return_lse, merge):
    """context_parallel of a BatchMLAPagedAttention: run(q_nope, q_pe, ckv_cache, kpe_cache, plan,
    ckv_scale=None, kpe_scale=None). q_nope [T, H, Dc] and q_pe [T, H, Dr] replicated over
    cp_axis (heads on tp_axis); the latent caches [P, page, D] sharded on pages over cp_axis
    (shard_pages; else replicated) and replicated over tp_axis; each device attends its share of
    every request's latent rows, and the states merge exactly (merge_over)."""
    _check_axis(mesh, "tp_axis", tp_axis)
    spec_q = head_spec(tp_axis)
    spec_c = P(cp_axis if shard_pages else None, None, None)
    out = AttentionState(spec_q, P(None, tp_axis)) if return_lse else spec_q

    def body(q_nope, q_pe, ckv_cache, kpe_cache, plan, ckv_scale, kpe_scale):  # q [T, H / tp, D]
        plan = jax.tree.map(lambda x: x[0], plan)  # this device's plan
        if plan.full_rows is None:  # its sub-requests are the step's requests, in order
            state = wrapper.run(q_nope, q_pe, ckv_cache, kpe_cache, plan.full, return_lse=True,
                                ckv_scale=ckv_scale, kpe_scale=kpe_scale)
        else:  # its rows gathered (padding rows read row T - 1), their states placed (row T: empty)
            take = lambda x: jnp.take(x, plan.full_rows, axis=0, mode="clip")  # noqa: E731
            o, lse = wrapper.run(take(q_nope), take(q_pe), ckv_cache, kpe_cache, plan.full, return_lse=True,
                                 ckv_scale=ckv_scale, kpe_scale=kpe_scale)
            o = jnp.concatenate([o, jnp.zeros((1,) + o.shape[1:], o.dtype)])
            lse = jnp.concatenate([lse, jnp.full((1,) + lse.shape[1:], -jnp.inf, lse.dtype)])
            state = AttentionState(jnp.take(o, plan.src, axis=0), jnp.take(lse, plan.src, axis=0))
        state = merge_over(state, cp_axis, merge=merge)
        return state if return_lse else state.o

    sharded = shard_map(body, mesh, (spec_q, spec_q, spec_c, spec_c, P(cp_axis), P(), P()), out)

    def run(q_nope, q_pe, ckv_cache, kpe_cache, plan, ckv_scale=None, kpe_scale=None):
        if not isinstance(plan, ContextPlan) or plan.diag is not None:
            raise ValueError("plan must be a ContextPlan of this BatchMLAPagedAttention (context_plan)")
        if plan.src is not None and q_nope.shape[0] != plan.src.shape[1]:
            raise ValueError(f"q_nope has {q_nope.shape[0]} rows; the plan places {plan.src.shape[1]} "
                             "(the wrapper's max_num_tokens)")
        if (plan.pages_per_shard is not None) != shard_pages:
            raise ValueError(f"plan was split for a {'page-sharded' if plan.pages_per_shard else 'replicated'} "
                             f"cache but shard_pages={shard_pages}")
        return sharded(q_nope, q_pe, ckv_cache, kpe_cache, plan, ckv_scale, kpe_scale)
    return run


def context_partial_states(wrapper, mesh, *, cp_axis="cp", tp_axis=None, shard_pages=True):
    """context_parallel's device-local part alone: run(q, kv_cache, plan, kv_lens=None) ->
    AttentionState(o [n, T, Hq, D], lse [n, T, Hq]), device k's partial state at [k] (sharded on
    cp_axis; heads on tp_axis), unmerged. merge_states over axis 0 gives context_parallel's
    result; the benchmark times it to split a CP call into local compute and merge."""
    spec_o = P(cp_axis, None, tp_axis, None)
    out = AttentionState(spec_o, P(cp_axis, None, tp_axis))
    return _context_sharded(wrapper, mesh, cp_axis, tp_axis, shard_pages,
                            lambda state: jax.tree.map(lambda x: x[None], state), out)


def context_parallel_ragged(mesh, *, cp_axis="cp", tp_axis=None, causal=True, sm_scale=None, num_ctas=None,
                            backend=None, impl="auto", merge="auto", return_lse=False):
    """ragged_paged_attention with the context split on mesh axis cp_axis (heads on tp_axis, if
    given): run(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
    sliding_window=None, soft_cap=None, sinks=None) -> (out, kv_cache), or (AttentionState,
    kv_cache) with return_lse.

    The cache is sharded on pages over cp_axis: device k holds global pages [k N, (k + 1) N),
    and each sequence lists its pages device by device (its first pages on the first device it
    uses; it may skip devices). Metadata are global and replicated (RPA v3's, page ids global);
    queries, keys, values are replicated over cp_axis (heads on tp_axis). Each device writes the
    step's rows whose pages it holds, attends every row over its share of the sequence's keys
    (ragged_plan.context_share: one ragged_paged_attention call reading the share, global
    positions kept through read_kv_lens), and the partial states merge exactly (merge_over;
    merge: as context_parallel's). A sliding window (a distance between positions) and a soft cap
    (per logit) hold on every share and merge exactly; both may be traced. Attention sinks (f32[Hq],
    may be traced; split on tp_axis with the heads) enter each row's softmax once: they are applied
    to the merged state, as ragged_paged_attention applies them (every row's lse then includes its
    sink). causal, sm_scale, num_ctas, backend, impl: as ragged_paged_attention's, on every device."""
    _check_merge(merge)
    _check_axis(mesh, "cp_axis", cp_axis)
    _check_axis(mesh, "tp_axis", tp_axis)
    spec_q = head_spec(tp_axis)
    n = mesh.shape[cp_axis]

    def body(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, window, cap, sink):
        # queries [T, Hq, D], keys / values [T, Hkv, D] (heads: this device's); kv_cache: its pages
        t, pages = queries.shape[0], kv_cache.num_pages
        shard = lax.axis_index(cp_axis)
        share = ragged_plan.context_share(kv_lens, page_indices, cu_q_lens, distribution, shard=shard,
                                          pages_per_shard=pages, page_size=kv_cache.page_size, causal=causal)
        # The step's rows whose pages this device holds (global page ids -> local; others dropped).
        row_seq, row_live = ragged_plan.row_seqs(cu_q_lens, distribution, t)
        page, slot, _ = ragged_plan.token_slots(
            kv_lens, cu_q_lens, page_indices, row_seq, row_live, pages_per_seq=page_indices.shape[0] // kv_lens.shape[0],
            page_size=kv_cache.page_size, num_pages=n * pages)
        local = page - shard * pages
        stale_pages, stale_from = ragged_plan.written_tails(
            kv_lens, page_indices, cu_q_lens, distribution, pages_per_seq=page_indices.shape[0] // kv_lens.shape[0],
            page_size=kv_cache.page_size)  # (as ragged_paged_attention's write: on the device holding the page)
        stale_local = stale_pages - shard * pages
        kv_cache = write_slots(kv_cache, jnp.where((local >= 0) & (local < pages), local, pages), slot, keys, values,
                               interpret=_backend.use_interpret(backend),
                               stale_pages=jnp.where((stale_local >= 0) & (stale_local < pages), stale_local, pages),
                               stale_from=stale_from)
        # One sub-step over the device's share: its rows gathered, attended, placed back. The cache
        # returned is the call's, tied to its output: every kernel reading it runs before the next
        # step's in-place write (as in ragged_paged_attention; without the tie XLA may copy it).
        cu, src, pos = ragged_plan.sub_step_rows(cu_q_lens, distribution, share.row_start, share.q_lens, t)
        state, kv_cache = ragged_paged_attention(
            queries[src], None, None, kv_cache, share.kv_lens, share.page_indices, cu,
            jnp.stack([0, 0, distribution[2]]).astype(jnp.int32), causal=causal, sm_scale=sm_scale,
            sliding_window=window, soft_cap=cap,
            num_ctas=num_ctas, backend=backend, impl=impl, return_lse=True, read_kv_lens=share.read_lens)
        mine = pos >= 0  # [T]: rows of the sub-step; the others see none of this device's keys
        o = jnp.where(mine[:, None, None], state.o[jnp.maximum(pos, 0)], jnp.zeros((), queries.dtype))  # [T, Hq, D]
        lse = jnp.where(mine[:, None], state.lse[jnp.maximum(pos, 0)], -jnp.inf)  # [T, Hq]
        state = merge_over(AttentionState(o, lse), cp_axis, merge=merge)
        if sink is not None:  # sink: f32[Hq of this device], once per row, on the merged state
            state = AttentionState(*variants.finish(variants.sinks(), {"sinks": sink}, state.o, state.lse, True))
        return (state if return_lse else state.o), kv_cache

    def run(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, sliding_window=None,
            soft_cap=None, sinks=None):
        if not isinstance(kv_cache, PagedKVCache):
            raise ValueError("kv_cache must be a PagedKVCache")
        check_sinks(sinks, queries.shape[1])
        if kv_cache.num_pages % n:
            raise ValueError(f"kv_cache: its {kv_cache.num_pages} pages do not split over {n} devices of {cp_axis!r}")
        ragged_check_metadata(kv_lens, page_indices, cu_q_lens, distribution, num_tokens=queries.shape[0],
                              num_pages=kv_cache.num_pages, page_size=kv_cache.page_size)
        _check_device_order(kv_lens, page_indices, distribution, kv_cache.page_size, kv_cache.num_pages // n)
        spec_c = cache_spec(kv_cache.layout, tp_axis=tp_axis, cp_axis=cp_axis)
        out = AttentionState(spec_q, P(None, tp_axis)) if return_lse else spec_q
        sharded = shard_map(body, mesh, (spec_q, spec_q, spec_q, spec_c) + (P(),) * 6 + (P(tp_axis),), (out, spec_c))
        return sharded(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
                       None if sliding_window is None else jnp.asarray(sliding_window, jnp.int32),
                       None if soft_cap is None else jnp.asarray(soft_cap, jnp.float32),
                       None if sinks is None else jnp.asarray(sinks, jnp.float32))
    return run


def _check_device_order(kv_lens, page_indices, distribution, page_size, pages_per_shard):
    """When concrete: every valid sequence lists its pages device by device (context_parallel_ragged)."""
    if not is_concrete(kv_lens, page_indices, distribution):
        return
    kv, table = np.asarray(kv_lens), np.asarray(page_indices).reshape(kv_lens.shape[0], -1)
    for i in range(int(np.asarray(distribution)[2])):
        device = table[i, : -(-int(kv[i]) // page_size)] // pages_per_shard
        if np.any(np.diff(device) < 0):
            raise ValueError(f"page_indices: sequence {i} lists its pages out of device order (on devices "
                             f"{device.tolist()}; device k holds pages [{pages_per_shard} k, {pages_per_shard} (k + 1)))")
