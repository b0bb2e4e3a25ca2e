"""Paged decode attention: one query token per request, head-group fusion, split-KV.

Grid (num_cells, Hkv). Cell c processes the work items items[cell_indptr[c]:
cell_indptr[c+1]] one after another (the planner balanced them with the
paper's Algorithm 1). A work item is one KV chunk of one request:

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
                   o_ref, lse_ref, o_part_ref, lse_part_ref, *, num_qo_heads, num_kv_heads, group,
                   group_pad, **attend_kw):
    cell, head = pl.program_id(0), pl.program_id(1)
    g = jnp.arange(group_pad)
    row_ok = g < group
    heads = head * group + jnp.minimum(g, group - 1)  # [Gp] query heads of this KV head (clamped)

    def item(w, carry):
        req = items_ref[w, 0]
        page_base, tok_start = items_ref[w, 1], items_ref[w, 2]
        tok_end, part_slot = items_ref[w, 3], items_ref[w, 4]
        n_tok = jnp.maximum(jnp.minimum(tok_end, kv_lens_ref[req]) - tok_start, 0)
        q = q_ref[req * num_qo_heads + heads]  # [Gp, D]
        acc, m, l = _attention.attend(q, k_ref, v_ref, kv_indices_ref, page_base, tok_start, n_tok, head,
                                      num_kv_heads=num_kv_heads, n_plain=n_tok // attend_kw["block_kv"],
                                      **attend_kw)
        o, lse = _attention.finalize(acc, m, l)

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

    lax.fori_loop(cell_indptr_ref[cell], cell_indptr_ref[cell + 1], item, 0)


def _paged_decode_triton(q, k_rows, v_rows, kv_indices, kv_lens, items, cell_indptr, *, num_parts,
                         page_size, num_kv_heads, layout, sm_scale, block_kv, interpret,
                         num_warps=4, num_stages=3):
    batch, num_qo_heads, d = q.shape
    group = num_qo_heads // num_kv_heads
    group_pad = max(16, _common.next_pow2(group))
    num_cells = cell_indptr.shape[0] - 1
    block_kv = _common.fit_block_kv(block_kv, d, k_rows.dtype.itemsize, num_stages)
    kernel = functools.partial(
        _decode_kernel, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, group=group,
        group_pad=group_pad, page_size=page_size, layout=layout, block_kv=block_kv,
        scale_log2=sm_scale * _common.LOG2E)
    return pl.pallas_call(
        kernel,
        grid=(num_cells, num_kv_heads),
        out_shape=(
            jax.ShapeDtypeStruct((batch * num_qo_heads, d), q.dtype),  # o (writethrough)
            jax.ShapeDtypeStruct((batch * num_qo_heads,), jnp.float32),  # lse
            jax.ShapeDtypeStruct((num_parts * num_qo_heads, d), jnp.float32),  # partial o
            jax.ShapeDtypeStruct((num_parts * num_qo_heads,), jnp.float32),  # partial lse
        ),
        compiler_params=_common.compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="jaxinfer_paged_decode",
    )(items, cell_indptr, kv_lens, kv_indices, q.reshape(batch * num_qo_heads, d), k_rows, v_rows)


def paged_decode(q, k_rows, v_rows, kv_indices, kv_lens, items, cell_indptr, *, num_parts,
                 page_size, num_kv_heads, layout, sm_scale, block_kv=128, interpret, impl="triton",
                 **tuning):
    """Runs the decode work list.

    q [B, Hq, D]; k_rows/v_rows: the cache viewed as [num_pages*page_size*Hkv, D];
    kv_indices int32[*]; kv_lens int32[B] (live lengths); items int32[W, 5];
    cell_indptr int32[num_cells + 1]. Returns flat (o [B*Hq, D], lse [B*Hq],
    o_part [num_parts*Hq, D] f32, lse_part [num_parts*Hq]); rows of o that
    no writethrough item covers are left for the caller's merge.
    """
    fn = _common.dispatch({"triton": _paged_decode_triton}, impl, "paged_decode")
    return fn(q, k_rows, v_rows, kv_indices, kv_lens, items, cell_indptr, num_parts=num_parts,
              page_size=page_size, num_kv_heads=num_kv_heads, layout=layout, sm_scale=sm_scale,
              block_kv=block_kv, interpret=interpret, **tuning)
