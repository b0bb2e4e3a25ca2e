"""Paged decode attention: one query token per request, head-group fusion, split-KV.

Grid (num_cells, Hkv), or (Hkv, num_cells) with heads_fastest (the launch order). Cell c
processes the work items items[cell_indptr[c]:cell_indptr[c+1]] one after another (the
planner balanced them with the paper's Algorithm 1). A work item is one KV chunk of one request:

    items[w] = (request, page_base, tok_start, tok_end, part_slot)

page_base is the offset of the request's page list in kv_indices; the item
covers the request's tokens [tok_start, min(tok_end, kv_lens[request])). All
Hq / Hkv query heads of a KV head are processed together (paper App. A), so
each K/V row is read once per head group. An item with part_slot < 0 is the
whole request and writes the final (o, lse) (App. D.2 writethrough); otherwise
it writes a float32 partial state to row part_slot of the partial buffers,
which merge.merge_varlen combines afterwards.

Loads of tokens past the chunk's end are masked off, so the kernel only ever
reads rows of pages in the request's own list; stale or NaN slots of a last
page are never loaded.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _attention, _common

ITEM_FIELDS = 5  # (request, page_base, tok_start, tok_end, part_slot)


def _decode_kernel(items_ref, cell_indptr_ref, kv_lens_ref, kv_indices_ref, q_ref, k_ref, v_ref,
                   *refs, num_qo_heads, num_kv_heads, group, group_pad, has_scales, variant,
                   param_tree, heads_fastest, **attend_kw):
    scale_refs, refs = (refs[:2], refs[2:]) if has_scales else ((None, None), refs)
    param_refs, (o_ref, lse_ref, o_part_ref, lse_part_ref) = refs[:-4], refs[-4:]
    cell, head = pl.program_id(0), pl.program_id(1)
    if heads_fastest:
        cell, head = head, cell
    g = jnp.arange(group_pad)
    row_ok = g < group
    heads = head * group + jnp.minimum(g, group - 1)  # [Gp] query heads of this KV head (clamped)
    k_scale, v_scale = (None, None) if not has_scales else (scale_refs[0][head], scale_refs[1][head])
    params = None if variant is None else _common.unflatten_params(param_refs, *param_tree)
    block_kv = attend_kw["block_kv"]

    def item(w, carry):
        req, page_base, tok_start, tok_end, part_slot = (
            _common.uniform(items_ref[w, i]) for i in range(ITEM_FIELDS))
        kv_len = _common.uniform(kv_lens_ref[req])
        n_tok = jnp.maximum(jnp.minimum(tok_end, kv_len) - tok_start, 0)
        q = q_ref[req * num_qo_heads + heads]  # [Gp, D]
        n_head, n_plain, var_kw = 0, n_tok // block_kv, {}
        if variant is not None:
            pos = kv_len - 1  # the query's position
            var_kw = dict(variant=variant, params=params, qo_pos=jnp.full((group_pad,), pos),
                          qo_head=heads)
            if variant.has_bounds:
                tok_start, n_tok, n_head = _attention.skip_to_bounds(
                    variant, params, pos, pos, 0, tok_start, n_tok, block_kv)
                n_plain = jnp.maximum(n_tok // block_kv - n_head, 0)
            elif variant.has_mask:
                n_plain = 0
        acc, m, l = _attention.attend(q, k_ref, v_ref, kv_indices_ref, page_base, tok_start, n_tok, head,
                                      num_kv_heads=num_kv_heads, n_head=n_head, n_plain=n_plain,
                                      k_scale=k_scale, **var_kw, **attend_kw)
        o, lse = _attention.finalize(acc, m, l, use_softmax=variant is None or variant.use_softmax,
                                     v_scale=v_scale)

        @pl.when(part_slot < 0)
        def _():
            rows = req * num_qo_heads + heads
            _common.store_rows(o_ref, rows, o.astype(o_ref.dtype), row_ok)
            _common.store_rows(lse_ref, rows, lse, row_ok)

        @pl.when(part_slot >= 0)
        def _():
            rows = part_slot * num_qo_heads + heads
            _common.store_rows(o_part_ref, rows, o, row_ok)
            _common.store_rows(lse_part_ref, rows, lse, row_ok)

        return carry

    first, end = (_common.uniform(cell_indptr_ref[cell + i]) for i in (0, 1))
    lax.fori_loop(first, end, item, 0)


def _paged_decode_triton(q, k_rows, v_rows, kv_indices, kv_lens, items, cell_indptr, *, num_parts,
                         page_size, num_kv_heads, layout, sm_scale, block_kv, interpret, scales=None,
                         variant=None, params=None, num_warps=4, num_stages=None, fp8_pairs=True,
                         heads_fastest=None):
    batch, num_qo_heads, d = q.shape
    if num_stages is None:  # measured on H100: 3 (fp8 as pairs: 205.6 vs 208.4 µs with 2)
        num_stages = 3
    if heads_fastest is None:  # fp8: a cell's KV heads launch together and read a token's
        heads_fastest = k_rows.dtype.itemsize == 1  # adjacent 128 B rows at once (H100: 203.9
        # vs 206.5 µs; bf16 gained nothing)
    group = num_qo_heads // num_kv_heads
    group_pad = max(16, _common.next_pow2(group))
    num_cells = cell_indptr.shape[0] - 1
    block_kv = _common.fit_block_kv(block_kv, d, k_rows.dtype.itemsize, num_stages)
    kv_pairs, k_rows, v_rows = _common.maybe_fp8_pairs(k_rows, v_rows, variant, fp8_pairs)
    leaves, treedef, scalar = _common.flatten_params(params)
    kernel = functools.partial(
        _decode_kernel, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, group=group,
        group_pad=group_pad, has_scales=scales is not None, variant=variant,
        param_tree=(treedef, scalar), page_size=page_size, layout=layout, block_kv=block_kv,
        sm_scale=sm_scale, kv_pairs=kv_pairs, heads_fastest=heads_fastest)
    call = pl.pallas_call(
        kernel,
        grid=(num_kv_heads, num_cells) if heads_fastest else (num_cells, num_kv_heads),
        out_shape=(
            jax.ShapeDtypeStruct((batch * num_qo_heads, d), q.dtype),  # o (writethrough)
            jax.ShapeDtypeStruct((batch * num_qo_heads,), jnp.float32),  # lse
            jax.ShapeDtypeStruct((num_parts * num_qo_heads, d), jnp.float32),  # partial o
            jax.ShapeDtypeStruct((num_parts * num_qo_heads,), jnp.float32),  # partial lse
        ),
        compiler_params=_common.compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="jaxinfer_paged_decode",
    )
    with _common.kernel_math(fast=not interpret):
        return call(items, cell_indptr, kv_lens, kv_indices, q.reshape(batch * num_qo_heads, d), k_rows,
                    v_rows, *(scales or ()), *leaves)


def paged_decode(q, k_rows, v_rows, kv_indices, kv_lens, items, cell_indptr, *, num_parts,
                 page_size, num_kv_heads, layout, sm_scale, block_kv=128, interpret, impl="triton",
                 scales=None, variant=None, params=None, **tuning):
    """Runs the decode work list.

    q [B, Hq, D]; k_rows/v_rows: the cache viewed as [num_pages*page_size*Hkv, D] (q's dtype,
    or fp8); kv_indices int32[*]; kv_lens int32[B] (live lengths); items int32[W, 5];
    cell_indptr int32[num_cells + 1]; scales: (k_scale, v_scale) f32[Hkv] or None;
    variant / params: an attention variant and its parameter pytree (see _attention).
    Returns flat (o [B*Hq, D], lse [B*Hq], o_part [num_parts*Hq, D] f32,
    lse_part [num_parts*Hq]); rows of o that no writethrough item covers are left for
    the caller's merge.
    """
    fn = _common.dispatch({"triton": _paged_decode_triton}, impl, "paged_decode")
    return fn(q, k_rows, v_rows, kv_indices, kv_lens, items, cell_indptr, num_parts=num_parts,
              page_size=page_size, num_kv_heads=num_kv_heads, layout=layout, sm_scale=sm_scale,
              block_kv=block_kv, interpret=interpret, scales=scales, variant=variant, params=params,
              **tuning)
