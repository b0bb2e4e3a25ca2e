"""ragged_paged_attention: a whole serving step (decode, speculative verify, chunked prefill,
prompts) in one jittable call, with the arguments of tpu-inference's ragged paged attention v3.

The new tokens' K/V are scattered into the paged cache, then every query row attends over its
sequence. Planning runs on the device (jaxinfer.ragged_plan: work lists of fixed capacities,
one per q_len class, planned before any launch), so there is no host round trip and one
compilation serves every composition of the same shapes. jaxinfer.dispatch picks the long
sequences' kernel (dispatch.ragged_long_impl: the mixed Mosaic launch, the Mosaic prefill
kernel, or Triton); the decode classes run on the decode kernel and write into the base
class's output in place, their split-KV partials merged once. docs/design.md has the details.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import _backend, dispatch, ragged_plan, variants
from jaxinfer.formats import (PagedKVCache, check_int32, check_kv_dtype, check_q, check_sinks, default_sm_scale,
                              is_concrete, kv_scales)
from jaxinfer.page import write_slots
from jaxinfer.state import AttentionState
from pallas_kernels import decode as decode_kernels
from pallas_kernels import merge as merge_kernels
from pallas_kernels import prefill as prefill_kernels
from planner.prefill import ROW_ALIGN
from planner.work_items import DECODE_MULTI, MIXED, PREFILL

MOSAIC_CTAS_PER_SM = 1  # the Mosaic class's grid (Hq, cells): its shared memory holds one CTA per SM


def check_metadata(kv_lens, page_indices, cu_q_lens, distribution, *, num_tokens, num_pages, page_size,
                   kv_covers_q=True):
    """RPA v3's metadata (kv_lens i32[S], page_indices i32[S * pages_per_seq], cu_q_lens i32[S + 1],
    distribution i32[3]) for num_tokens query rows over a cache of num_pages pages of page_size:
    shapes and dtypes always; when concrete, the values (a ValueError naming the argument).
    kv_covers_q: each kv_len counts its sequence's q rows (so kv_len >= q_len)."""
    t = num_tokens
    for name, x in (("kv_lens", kv_lens), ("page_indices", page_indices), ("cu_q_lens", cu_q_lens),
                    ("distribution", distribution)):
        check_int32(name, x)
        if jnp.ndim(x) != 1:
            raise ValueError(f"{name} must be 1-D, got shape {jnp.shape(x)}")
    s = kv_lens.shape[0]
    if s < 1 or page_indices.shape[0] % s or page_indices.shape[0] == 0:
        raise ValueError(f"page_indices must hold S * pages_per_seq entries (S = {s}), got {page_indices.shape[0]}")
    if cu_q_lens.shape[0] != s + 1:
        raise ValueError(f"cu_q_lens must have shape [{s + 1}], got {cu_q_lens.shape}")
    if distribution.shape[0] != 3:
        raise ValueError(f"distribution must have shape [3], got {distribution.shape}")
    if not is_concrete(kv_lens, page_indices, cu_q_lens, distribution):
        return
    kv, pi, cu, dist = (np.asarray(x) for x in (kv_lens, page_indices, cu_q_lens, distribution))
    n = int(dist[2])
    if not 0 <= dist[0] <= dist[1] <= n <= s:
        raise ValueError(f"distribution must satisfy 0 <= d[0] <= d[1] <= d[2] <= {s}, got {dist.tolist()}")
    q_len = np.diff(cu[: n + 1])
    if cu[0] != 0 or np.any(q_len < 0) or cu[n] > t:
        raise ValueError(f"cu_q_lens must start at 0 and rise to at most {t} over the valid sequences")
    if np.any(q_len[: dist[0]] != 1):
        raise ValueError("cu_q_lens: sequences [0, distribution[0]) must have q_len 1")
    pages_per_seq = pi.shape[0] // s
    low = q_len if kv_covers_q else 0
    if np.any(kv[:n] < low) or np.any(kv[:n] > pages_per_seq * page_size):
        raise ValueError(f"kv_lens must lie in [{'q_len' if kv_covers_q else 0}, pages_per_seq * page_size = "
                         f"{pages_per_seq * page_size}] for the valid sequences")
    used = np.arange(pages_per_seq)[None, :] < -(-kv[:n, None] // page_size)
    ids = pi[: n * pages_per_seq].reshape(n, pages_per_seq)[used]
    if ids.size and (ids.min() < 0 or ids.max() >= num_pages):
        raise ValueError(f"page_indices lists page ids outside [0, {num_pages})")


def _check(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, sliding_window,
           soft_cap, sinks, causal):
    check_q(queries, "queries")
    if queries.ndim != 3:
        raise ValueError(f"queries must be [T, Hq, D], got shape {queries.shape}")
    if not isinstance(kv_cache, PagedKVCache):
        raise ValueError("kv_cache must be a PagedKVCache")
    t, hq, d = queries.shape
    hkv = kv_cache.num_kv_heads
    if kv_cache.head_dim != d or kv_cache.head_dim_vo != d or hq % hkv:
        raise ValueError(f"kv_cache (num_kv_heads {hkv}, head_dim {kv_cache.head_dim}) does not fit "
                         f"queries [T, {hq}, {d}] (Hq must be a multiple of num_kv_heads)")
    check_kv_dtype(queries.dtype, kv_cache.dtype, "kv_cache")
    if (keys is None) != (values is None):
        raise ValueError("keys and values must both be arrays or both be None")
    for name, x in (("keys", keys), ("values", values)):
        if x is not None and tuple(x.shape) != (t, hkv, d):
            raise ValueError(f"{name} must have shape {(t, hkv, d)}, got {tuple(x.shape)}")
    if sliding_window is not None and is_concrete(sliding_window) and int(sliding_window) < 1:
        raise ValueError(f"sliding_window must be >= 1, got {int(sliding_window)}")
    if soft_cap is not None and is_concrete(soft_cap) and not float(soft_cap) > 0:
        raise ValueError(f"soft_cap must be > 0, got {float(soft_cap)}")
    check_sinks(sinks, hq)
    check_metadata(kv_lens, page_indices, cu_q_lens, distribution, num_tokens=t, num_pages=kv_cache.num_pages,
                   page_size=kv_cache.page_size, kv_covers_q=keys is not None or causal)


def ragged_paged_attention(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, *,
                           causal=True, sm_scale=None, sliding_window=None, soft_cap=None, sinks=None,
                           k_scale=None, v_scale=None, num_ctas=None, backend=None, impl="auto", config=None,
                           return_lse=False, read_kv_lens=None):
    """One serving step: writes the new K/V, then ragged attention over the paged cache.

    queries [T, Hq, D]; keys, values [T, Hkv, D] (row-aligned with queries); kv_cache: a
    PagedKVCache (NHD as RPA v3; HND works too); kv_lens i32[S] (each INCLUDES its sequence's
    new tokens); page_indices i32[S * pages_per_seq]; cu_q_lens i32[S + 1]; distribution i32[3] =
    (decode_end, prefill_end, mixed_end). Sequence i < distribution[2] is valid (those before
    distribution[0] have q_len 1): its new rows keys/values[cu_q_lens[i] + j] land at token
    position kv_len - q_len + j (cast to the cache dtype, not rescaled), V's slots past kv_len
    in the page of its last row are set to 0 (no key lives there yet), then its q rows attend
    over its kv_len keys, causal bottom-right if causal. Rows from cu_q_lens[distribution[2]] on
    are padding: they write nothing and give o = 0. keys = values = None: nothing is written (the
    cache holds the step's rows already: KV sharing, or context parallel, where each row is
    written on the device that holds its page); without causal, kv_lens may then be shorter than
    q_len. read_kv_lens i32[S] (may be traced): sequence i reads only its first read_kv_lens[i]
    keys (at most kv_lens[i]) while its rows keep their positions, so a causal row sees the keys
    below min(its position + 1, read_kv_lens[i]); context parallel passes each device's share so.

    sm_scale: a static float (default 1 / sqrt(D); RPA v3's own default is 1.0).
    sliding_window W (int, may be traced; needs causal): the query at position p sees keys
    p - W < k <= p. soft_cap c > 0 (float, may be traced; a traced c <= 0 turns it off): logits
    s -> c * tanh(s / c) after sm_scale. sinks f32[Hq] (may be traced): attention sinks (gpt-oss),
    one logit per query head added to every row's softmax denominator: o = sum_j e^(s_j) v_j /
    (e^sink + sum_j e^(s_j)). With sinks the long sequences run on the Triton kernel, or with
    impl="mosaic" on the Mosaic prefill kernel, the sinks in its softmax state (dispatch).
    k_scale / v_scale: fp8 caches' dequantization scales (scalars or [Hkv]).
    impl: the kernel of the long sequences (past the decode tiles): "auto" (jaxinfer.dispatch
    decides: the mixed launch where it can run, compiled on a Hopper GPU with 16-bit q and K/V
    and no window, soft cap or sinks; else the Mosaic GPU prefill kernel for steps without them;
    else the Triton kernel, faster with them), "mixed" or "mosaic" (forced; interpret mode too) or
    "triton". return_lse: also each row's log-sum-exp (natural log; -inf for padding rows and rows
    that see no key; with sinks every row's includes its sink's term, so those rows give the
    sink), for merging with other states.
    num_ctas: grid size (default 2 x SMs for the decode and Triton launches, MOSAIC_CTAS_PER_SM
    x SMs for the Mosaic one); backend, config (a DecodeConfig, PrefillConfig and/or
    MosaicPrefillConfig, or a tuple of them): as the wrappers.

    Returns (out [T, Hq, D] in queries' dtype, or AttentionState(out, lse [T, Hq]) with return_lse;
    the updated PagedKVCache). Metadata are checked
    when concrete; under jax.jit (one compilation for all compositions of the same shapes, cache
    donated for an in-place write) inputs that break the contract give undefined results. The
    mixed launch reads queries as they are: a slice of a larger array (q split from a fused qkv
    with no op after it) is first copied to a buffer of its own (H100, a 2108-row step: ~15 µs).
    """
    _check(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, sliding_window,
           soft_cap, sinks, causal)
    if read_kv_lens is not None:
        check_int32("read_kv_lens", read_kv_lens)
        if jnp.shape(read_kv_lens) != kv_lens.shape:
            raise ValueError(f"read_kv_lens must have shape {kv_lens.shape} (one per sequence), got "
                             f"{jnp.shape(read_kv_lens)}")
        if is_concrete(read_kv_lens, kv_lens) and np.any(
                (np.asarray(read_kv_lens) < 0) | (np.asarray(read_kv_lens) > np.asarray(kv_lens))):
            raise ValueError("read_kv_lens must lie in [0, kv_lens] for every sequence")
    if sliding_window is not None and not causal:
        raise ValueError("sliding_window needs causal=True")
    hq, d = queries.shape[1:]
    hkv = kv_cache.num_kv_heads
    window = None if sliding_window is None else jnp.asarray(sliding_window, jnp.int32)
    cap = None if soft_cap is None else jnp.asarray(soft_cap, jnp.float32)
    sink = None if sinks is None else jnp.asarray(sinks, jnp.float32)
    variant = _variant(window is not None, cap is not None, sink is not None)
    interpret = _backend.use_interpret(backend)
    problem = dispatch.Problem("decode", hq, hkv, d, "paged", kv_cache.page_size, kv_cache.layout, variant,
                               interpret=interpret)
    dispatch.check(problem)
    configs = dispatch.check_configs(config)
    scales = kv_scales(k_scale, v_scale, kv_cache.dtype, hkv)
    sm_scale = default_sm_scale(d, sm_scale)
    long_problem = dataclasses.replace(problem, family="prefill")
    long_impl = dispatch.ragged_long_impl(long_problem, impl, queries.dtype, kv_cache.dtype, scales is not None,
                                          sm_scale)
    ctas = num_ctas or 2 * _backend.num_sms()
    long_config = dispatch.config_for(long_impl, long_problem, configs)
    mosaic_cells, mixed = 0, None
    if long_impl.name == "prefill_mosaic":
        mosaic_cells = max(1, (num_ctas or MOSAIC_CTAS_PER_SM * _backend.num_sms()) // hq)
    elif long_impl.name == "batch_mosaic":
        mixed = ragged_plan.mixed_sizes(queries.shape[0], kv_lens.shape[0], hq // hkv, long_config.tile_tokens,
                             num_ctas or _backend.num_sms())
    return _run(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, read_kv_lens,
                window, cap, sink, scales, causal=causal, sm_scale=sm_scale, num_cells=max(1, ctas // hkv),
                mosaic_cells=mosaic_cells, mixed=mixed, interpret=interpret, return_lse=bool(return_lse),
                decode_config=dispatch.config_for(dispatch.IMPLEMENTATIONS_BY_NAME["decode_triton"], problem, configs),
                long_config=long_config)


def _variant(has_window, has_cap, has_sinks):
    """The static variant of the sliding window, soft-cap and sinks options (None without any)."""
    parts = ([variants.sliding_window()] if has_window else []) + ([variants.soft_cap()] if has_cap else []) \
        + ([variants.sinks()] if has_sinks else [])
    return None if not parts else parts[0] if len(parts) == 1 else variants.compose(*parts)


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale", "num_cells", "mosaic_cells", "mixed",
                                             "interpret", "return_lse", "decode_config", "long_config"))
def _run(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, read_lens, window, cap,
         sink, scales, *, causal, sm_scale, num_cells, mosaic_cells, mixed, interpret, return_lse, decode_config, long_config):
    """ragged_paged_attention after its checks (keys, values: arrays, or None to write nothing;
    read_lens: int32[S] or None; window, cap: 0-d arrays or None; sink: f32[Hq] or None; mixed: the mixed launch's sizes, or
    None for the class launches alone)."""
    t, hq, d = queries.shape
    hkv, page_size = kv_cache.num_kv_heads, kv_cache.page_size
    s = kv_lens.shape[0]
    pages_per_seq = page_indices.shape[0] // s
    # Traced metadata are not checked; clipped, they still keep every read inside the arrays: no
    # page id past a sequence's row of page_indices (pages_per_seq x page_size keys at most), no q
    # row past T. (Concrete metadata were checked: for them the clips change nothing.)
    kv_lens = jnp.clip(kv_lens, 0, pages_per_seq * page_size)
    cu_q_lens = jnp.clip(cu_q_lens, 0, t)
    distribution = jnp.clip(distribution, 0, s)
    if read_lens is not None:
        read_lens = jnp.clip(read_lens, 0, kv_lens)
    variant = _variant(window is not None, cap is not None, sink is not None)
    params = {}
    if window is not None:  # keys p - W < k <= p: window_left W - 1
        params["window_left"] = window - 1
    if cap is not None:
        params["logits_soft_cap"] = cap
    if sink is not None:  # (the kernels leave it to variants.finish below)
        params["sinks"] = sink

    # The KV write: padding rows go to page num_pages, dropped. It also zeroes V in the slots
    # past kv_len of each last page it writes into (only the sequence's own rows live there),
    # so the mixed launch, which loads whole key blocks, reads no stale value there (0 * NaN is
    # NaN in P V); with nothing written, that launch reads those pages' V from a sanitized copy.
    row_seq, row_live = ragged_plan.row_seqs(cu_q_lens, distribution, t)
    page, slot, q_pos = ragged_plan.token_slots(kv_lens, cu_q_lens, page_indices, row_seq, row_live,
                                     pages_per_seq=pages_per_seq, page_size=page_size,
                                     num_pages=kv_cache.num_pages)
    kv_indices = jnp.clip(page_indices, 0, kv_cache.num_pages - 1)
    if keys is None:
        new_cache = kv_cache
    else:
        stale_pages, stale_from = ragged_plan.written_tails(kv_lens, kv_indices, cu_q_lens, distribution,
                                                            pages_per_seq=pages_per_seq, page_size=page_size)
        new_cache = write_slots(kv_cache, page, slot, keys, values, interpret=interpret, stale_pages=stale_pages,
                                stale_from=stale_from)

    # Every class's work list first (device plans: no launch depends on another's plan) ...
    classes = ragged_plan.classes(t, s, num_cells, hq // hkv, mosaic_cells, mixed is not None)
    mixed_plan = mosaic_plan = taken = final_rows = None
    if mixed is not None:  # the base: the long sequences and the packed short ones in one launch
        mixed_plan = ragged_plan.plan_mixed(kv_lens, cu_q_lens, distribution, pages_per_seq=pages_per_seq,
                                            page_size=page_size, causal=causal, num_qo_heads=hq, num_kv_heads=hkv, mix=mixed, num_rows=t,
                                            read_lens=read_lens)
        taken = mixed_plan[2]
    if classes[0].mosaic:  # the base: its rows through a sub-buffer and back by a gather + select
        mosaic_plan = ragged_plan.plan_mosaic(
            kv_lens, cu_q_lens, distribution, row_seq, row_live, pages_per_seq=pages_per_seq, cls=classes[0],
            causal=causal, window_left=params.get("window_left"), read_lens=read_lens)
        classes = classes[1:]
    # The Triton prefill class (the base when present) alone, then the decode classes together:
    # one plan, their partial states in one buffer, one merge.
    groups = [g for g in [(c,) for c in classes if c.prefill] + [tuple(c for c in classes if not c.prefill)] if g]
    group_plans = [ragged_plan.plan_classes(kv_lens, cu_q_lens, distribution, pages_per_seq=pages_per_seq,
                                            classes=group, causal=causal, window_left=params.get("window_left"),
                                            num_rows=t, taken=taken, read_lens=read_lens) for group in groups]

    # ... then the launches, each writing into the base's output.
    k_rows, v_rows = new_cache.rows()
    kw = dict(page_size=page_size, num_kv_heads=hkv, layout=kv_cache.layout, sm_scale=sm_scale,
              interpret=interpret, variant=variant, params=params or None)
    out = None
    if mixed_plan is not None:
        from pallas_kernels import prefill_mosaic
        items, cell_indptr, _, lse_src = mixed_plan
        o, lse_items, _ = prefill_mosaic.prefill_mosaic(  # (no tail slots: its o_tail is ROW_ALIGN unused rows)
            queries, k_rows, v_rows, kv_indices, items, cell_indptr, ROW_ALIGN, page_size=page_size,
            num_kv_heads=hkv, layout=kv_cache.layout, sm_scale=sm_scale, causal=causal,
            block_kv=long_config.block_kv, max_concurrent_steps=long_config.max_concurrent_steps,
            pipeline=long_config.pipeline, tree_max=long_config.tree_max, compute_wgs=long_config.compute_wgs,
            interpret=interpret, packed_tokens=mixed.packed_tokens, num_lse_slots=items.shape[0], columns=MIXED,
            last_pages=None if keys is not None else ragged_plan.last_pages(
                kv_lens, kv_indices, distribution, pages_per_seq=pages_per_seq, page_size=page_size))
        lse = jnp.zeros((t, hq), jnp.float32)  # (without return_lse: written by the classes below, never read)
        if return_lse:  # [T, Hq] from the slots (plan_mixed's lse_src: head 0's; rows it runs)
            heads = jnp.arange(hq, dtype=jnp.int32)
            group = hq // hkv
            packed = (lse_src >= mixed.tiles * hq * mixed.tile_tokens)[:, None]
            idx = lse_src[:, None] + jnp.where(packed, heads // group * mixed.tile_tokens + heads % group,
                                               heads * mixed.tile_tokens)
            lse = jnp.where((lse_src >= 0)[:, None], lse_items[0, jnp.maximum(idx, 0)], -jnp.inf)
        out = (o, lse)
    if mosaic_plan is not None:
        from pallas_kernels import prefill_mosaic
        items, cell_indptr, src, pos, lse_src = mosaic_plan
        # (sinks in the kernel: its rows' (o, lse) come out final)
        in_kernel = _variant(window is not None, cap is not None, False)
        o_sub, lse_items, _ = prefill_mosaic.prefill_mosaic(
            queries[src], k_rows, v_rows, kv_indices, items, cell_indptr, ROW_ALIGN, causal=causal,
            block_kv=long_config.block_kv, max_concurrent_steps=long_config.max_concurrent_steps,
            q_pos=q_pos[src] if in_kernel is not None else None, row_stores=True, persistent=True, columns=PREFILL,
            sinks=sink, **dict(kw, variant=in_kernel, params={n: x for n, x in params.items() if n != "sinks"} or None))
        mine = pos >= 0
        final_rows = mine if sink is not None else None
        o = jnp.where(mine[:, None, None], o_sub[jnp.maximum(pos, 0)], jnp.zeros((), queries.dtype))
        lse = jnp.zeros((t, hq), jnp.float32)  # (without return_lse: written by the classes below, never read)
        if return_lse:  # lse_items [Hq, items * tile]: row r's at lse_src[r]
            lse = jnp.where(mine[:, None], lse_items[:, jnp.maximum(lse_src, 0)].T, -jnp.inf)
        out = (o, lse)
    kw.update(scales=scales)
    for group, (sec, block_kv_lens) in zip(groups, group_plans):
        part_cap = sum(c.part_cap for c in group)
        parts = None
        for k, cls in enumerate(group):
            if cls.prefill:  # (alone in its group)
                o, lse, *parts = prefill_kernels.run_triton(  # (the Triton class: dispatch's prefill_triton)
                    queries, k_rows, v_rows, kv_indices, sec["items"], sec["cell_indptr"], causal=causal,
                    rows=cls.rows, config=long_config, num_parts=part_cap, columns=PREFILL,
                    q_pos=q_pos if variant is not None else None, **kw)
            else:  # a class after the base writes its unsplit blocks into the base's output, its
                # split ones into the group's partial buffer
                flat_out = None if cls.base else (out[0].reshape(t * hq, d), out[1].reshape(t * hq))
                o, lse, *parts = decode_kernels.paged_decode(
                    queries, k_rows, v_rows, kv_indices, block_kv_lens, sec["items"], sec["cell_indptr"],
                    cells=(k * cls.cells, cls.cells), columns=DECODE_MULTI,
                    tokens_per_item=cls.tokens_per_item, causal=causal and cls.max_q > 1, config=decode_config,
                    out=flat_out, num_parts=part_cap, parts=parts, **kw)
            out = (o.reshape(t, hq, d), lse.reshape(t, hq))
        out = merge_kernels.merge_varlen(
            parts[0].reshape(part_cap, hq, d), parts[1].reshape(part_cap, hq), sec["merge_indptr"],
            sec["merge_dest"], out=out, interpret=interpret, num_programs=merge_kernels.LOOP_PROGRAMS,
            num_live=sec["merge_live"])
    # Sinks rescale each row by its lse (window and soft cap leave (o, lse) final; padding rows
    # have lse -inf and stay 0). The returned cache is tied to the output, so every kernel reading
    # the written cache runs before any later in-place write to it: without the tie XLA copied the
    # whole K cache before the next call's write (H100, q4 B64 kv4096, 10 chained calls: 852 ->
    # 416 us per call).
    o, lse = variants.finish(variant, params, out[0], out[1], True)
    if final_rows is not None:  # the Mosaic class applied the sinks itself
        o = jnp.where(final_rows[:, None, None], out[0], o)
        lse = jnp.where(final_rows[:, None], out[1], lse)
    return jax.lax.optimization_barrier((AttentionState(o, lse) if return_lse else o, new_cache))
