"""Plan sections -> kernels -> merged (o, lse): the launches every wrapper shares.

Each runner takes a plan's unpacked sections and page ids and returns (o [N, Hq, D], lse [N, Hq])
before any variant output transform; wrappers check their inputs first.
"""
import jax.numpy as jnp

from pallas_kernels import decode as decode_kernels
from pallas_kernels import merge as merge_kernels
from planner.work_items import DECODE, DECODE_MULTI, MIXED, PREFILL


def run_decode_sections(q, k_rows, v_rows, sec, kv_indices, kv_lens, layout, *, page_size, num_kv_heads,
                        cache_layout, sm_scale, interpret, config, scales=None, variant=None, params=None,
                        columns=DECODE, tokens_per_item=1, causal=True, out=None,
                        append=None):
    """Decode kernel + split-KV merge over unpacked plan sections. Returns (o [N,Hq,D], lse [N,Hq]),
    before any variant output transform. out (optional): (o [N, Hq, D], lse [N, Hq]) whose rows the
    plan does not write are kept (updated in place). append (optional): (k, v) [N, Hkv, D], each
    request's new row, written at position kv_lens - 1 by the decode kernel itself
    (decode_kernels.paged_decode); then returns (o, lse, *rows), rows the cache's updated stored
    rows (PagedKVCache.stored_rows);
    append="from_q": q [N, Hq + 2 Hkv, D] holds them after its query heads."""
    n, hq, d = q.shape
    if isinstance(append, str):
        hq -= 2 * num_kv_heads
    flat_out = None if out is None else (out[0].reshape(n * hq, d), out[1].reshape(n * hq))
    o, lse, o_part, lse_part, *rows = decode_kernels.paged_decode(
        q, k_rows, v_rows, kv_indices, kv_lens, sec["items"], sec["cell_indptr"],
        num_parts=layout.part_cap, page_size=page_size, num_kv_heads=num_kv_heads, layout=cache_layout,
        sm_scale=sm_scale, interpret=interpret, columns=columns, tokens_per_item=tokens_per_item,
        causal=causal, scales=scales, variant=variant, params=params, config=config, out=flat_out,
        append=append)
    o, lse = merge_kernels.merge_varlen(
        o_part.reshape(layout.part_cap, hq, d), lse_part.reshape(layout.part_cap, hq),
        sec["merge_indptr"], sec["merge_dest"], out=(o.reshape(n, hq, d), lse.reshape(n, hq)),
        interpret=interpret)
    return (o, lse, *rows)


def run_prefill_sections(q, k_rows, v_rows, plan, kv_indices, *, kernel, page_size, num_kv_heads, cache_layout,
                         sm_scale, interpret, config=None, scales=None, variant=None, params=None,
                         global_kv_pos=False, merge_programs=None):
    """Prefill kernel (dispatch's row's: pallas_kernels.prefill.run_triton or run_mosaic) + per-token
    merge of split tiles. kv_indices: the plan's page ids (None for contiguous K/V); merge_programs:
    merge_varlen's num_programs (plans of fixed capacity, whose merge is mostly empty). Returns
    (o [nnz, Hq, Dv], lse [nnz, Hq]) (Dv: v_rows' width), before any variant output transform."""
    nnz, hq, _ = q.shape
    d = v_rows.shape[1]
    lay, sec = plan.layout, plan.sections()
    o, lse, o_part, lse_part = kernel(
        q, k_rows, v_rows, kv_indices, sec["items"], sec["cell_indptr"], mask=plan.mask,
        num_parts=lay.part_cap, page_size=page_size, num_kv_heads=num_kv_heads, layout=cache_layout,
        sm_scale=sm_scale, causal=plan.causal, rows=lay.rows, interpret=interpret, config=config,
        columns=PREFILL, scales=scales, variant=variant, params=params, q_pos=sec["q_pos"],
        global_kv_pos=global_kv_pos,
        **({"tail_dest": sec["tail_dest"], "lse_src": sec["lse_src"]} if lay.tail_cap else {}))
    return merge_kernels.merge_varlen(
        o_part.reshape(lay.part_cap, hq, d), lse_part.reshape(lay.part_cap, hq), sec["merge_indptr"],
        sec["merge_dest"], out=(o.reshape(nnz, hq, d), lse.reshape(nnz, hq)), interpret=interpret,
        num_programs=merge_programs)


def run_short_sections(q, k_rows, v_rows, sec, kv_indices, layout, *, page_size, num_kv_heads,
                       cache_layout, sm_scale, interpret, causal, config, scales=None, variant=None,
                       params=None, out=None):
    """A short-query plan (planner.batch: items of up to tokens_per_item tokens of one request on
    the decode kernel) over q [N, Hq, D]. Rows the plan does not cover keep out's values
    (o [N, Hq, D], lse [N, Hq]; default o = 0, lse = -inf)."""
    n, hq, _ = q.shape
    if out is None:
        out = (jnp.zeros(q.shape, q.dtype), jnp.full((n, hq), -jnp.inf, jnp.float32))
    return run_decode_sections(
        q, k_rows, v_rows, sec, kv_indices, sec["kv_lens"], layout, page_size=page_size,
        num_kv_heads=num_kv_heads, cache_layout=cache_layout, sm_scale=sm_scale, interpret=interpret,
        config=config, scales=scales, variant=variant, params=params,
        columns=DECODE_MULTI, tokens_per_item=layout.tokens_per_item, causal=causal,
        out=out)


def run_mixed_sections(q, k_rows, v_rows, sec, kv_indices, layout, *, page_size, num_kv_heads, cache_layout,
                       sm_scale, causal, interpret, config, padded, need_lse):
    """A mixed plan (planner.batch.plan_mixed: query tiles and packed tiles) in one Mosaic GPU
    launch. padded: q may have rows past the step (capacities), set to o = 0. Returns (o [N, Hq, D],
    lse [N, Hq] gathered from the kernel's slots, or None without need_lse)."""
    from pallas_kernels import prefill_mosaic
    n, hq, d = q.shape
    group, T = hq // num_kv_heads, layout.tile_tokens
    o, lse_items, _ = prefill_mosaic.prefill_mosaic(  # (no tail slots: its o_tail is 8 unused rows)
        q, k_rows, v_rows, kv_indices, sec["items"].reshape(-1, layout.ITEMS.width), sec["cell_indptr"], 8,
        page_size=page_size, num_kv_heads=num_kv_heads, layout=cache_layout, sm_scale=sm_scale, causal=causal,
        block_kv=config.block_kv, max_concurrent_steps=config.max_concurrent_steps, pipeline=config.pipeline,
        tree_max=config.tree_max, compute_wgs=config.compute_wgs, interpret=interpret,
        packed_tokens=layout.tokens_per_item, num_lse_slots=layout.num_lse_slots, columns=MIXED,
        last_pages=prefill_mosaic.LastPages(page=sec["last_page"], length=sec["last_len"]))
    src = sec["lse_src"]  # [N]
    live = (src >= 0)[:, None]
    lse = None
    if need_lse:  # [N, Hq] from the slots (planner.batch.plan_mixed's lse_src)
        heads = jnp.arange(hq, dtype=jnp.int32)
        packed = (src >= layout.packed_slot0 * T)[:, None]
        idx = src[:, None] + jnp.where(packed, heads // group * T + heads % group, heads * T)  # [N, Hq]
        lse = jnp.where(live, lse_items[0, jnp.maximum(idx, 0)], -jnp.inf)
    if padded:  # rows past the step are nobody's: never written
        o = jnp.where(live[:, :, None], o, jnp.zeros((), o.dtype))
    return o, lse
