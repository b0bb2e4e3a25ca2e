"""Tiled prefill attention (many query tokens per request) on tensor-core dots.

Grid (num_cells, Hkv). Cell c runs the query tiles items[cell_indptr[c]:
cell_indptr[c+1]]:

    items[w] = (q_row_start, tile_tok, qo_len, page_base, kv_len)

q_row_start is the request's first row in q [nnz, Hq, D]; the tile covers the
request's query tokens [tile_tok, tile_tok + tokens_per_tile). GQA folds the
head group into the tile rows: row r is query token tile_tok + r // G of query
head kv_head * G + r % G, so every K/V row loaded serves the whole group.
With causal, the KV loop stops at the tile's last visible key (bottom-right
alignment: query i sees keys j <= i + kv_len - qo_len), so fully masked
blocks are never loaded.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _attention, _common

ITEM_FIELDS = 5  # (q_row_start, tile_tok, qo_len, page_base, kv_len)


def tile_rows(group, block_q):
    """Rows of a query tile (a power of two >= 16 holding at least one token's head group)."""
    return max(16, _common.next_pow2(group), _common.next_pow2(block_q))


def _prefill_kernel(items_ref, cell_indptr_ref, kv_indices_ref, q_ref, k_ref, v_ref, o_ref, lse_ref,
                    *, num_qo_heads, num_kv_heads, group, rows, causal, **attend_kw):
    cell, head = pl.program_id(0), pl.program_id(1)
    r = jnp.arange(rows)
    tokens_per_tile = rows // group
    t_local = r // group
    q_head = head * group + r % group

    def item(w, carry):
        q_row_start, tile_tok, qo_len = items_ref[w, 0], items_ref[w, 1], items_ref[w, 2]
        page_base, kv_len = items_ref[w, 3], items_ref[w, 4]
        q_tok = tile_tok + t_local  # [rows] query positions in the request
        row_ok = (t_local < tokens_per_tile) & (q_tok < qo_len)
        q_tok_c = jnp.minimum(q_tok, qo_len - 1)
        q_rows = (q_row_start + q_tok_c) * num_qo_heads + q_head
        q = q_ref[q_rows]  # [rows, D]
        n_kv = kv_len
        if causal:
            last_tok = jnp.minimum(tile_tok + tokens_per_tile, qo_len) - 1
            n_kv = jnp.clip(last_tok + kv_len - qo_len + 1, 0, kv_len)
        acc, m, l = _attention.attend(
            q, k_ref, v_ref, kv_indices_ref, page_base, 0, n_kv, head, num_kv_heads=num_kv_heads,
            q_pos=q_tok_c if causal else None, causal_offset=kv_len - qo_len, **attend_kw)
        o, lse = _attention.finalize(acc, m, l)
        _common.store_rows(o_ref, q_rows, o.astype(o_ref.dtype), row_ok)
        _common.store_rows(lse_ref, q_rows, lse, row_ok)
        return carry

    lax.fori_loop(cell_indptr_ref[cell], cell_indptr_ref[cell + 1], item, 0)


def _prefill_triton(q, k_rows, v_rows, kv_indices, items, cell_indptr, *, page_size, num_kv_heads,
                    layout, sm_scale, causal, rows, block_kv, interpret, num_warps=4, num_stages=2):
    nnz, num_qo_heads, d = q.shape
    group = num_qo_heads // num_kv_heads
    kernel = functools.partial(
        _prefill_kernel, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, group=group,
        rows=rows, causal=causal, page_size=page_size, layout=layout, block_kv=block_kv,
        scale_log2=sm_scale * _common.LOG2E)
    o, lse = pl.pallas_call(
        kernel,
        grid=(cell_indptr.shape[0] - 1, num_kv_heads),
        out_shape=(jax.ShapeDtypeStruct((nnz * num_qo_heads, d), q.dtype),
                   jax.ShapeDtypeStruct((nnz * num_qo_heads,), jnp.float32)),
        compiler_params=_common.compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="jaxinfer_prefill",
    )(items, cell_indptr, kv_indices, q.reshape(nnz * num_qo_heads, d), k_rows, v_rows)
    return o.reshape(nnz, num_qo_heads, d), lse.reshape(nnz, num_qo_heads)


def prefill(q, k_rows, v_rows, kv_indices, items, cell_indptr, *, page_size, num_kv_heads, layout,
            sm_scale, causal, rows, block_kv=64, interpret, impl="triton", **tuning):
    """Runs the prefill tiles. q [nnz, Hq, D]; k_rows/v_rows the cache as [rows, D];
    items int32[W, 5]; cell_indptr int32[cells + 1]; rows: the tile height
    (see tile_rows). Returns (o [nnz, Hq, D], lse [nnz, Hq] float32)."""
    fn = _common.dispatch({"triton": _prefill_triton}, impl, "prefill")
    return fn(q, k_rows, v_rows, kv_indices, items, cell_indptr, page_size=page_size,
              num_kv_heads=num_kv_heads, layout=layout, sm_scale=sm_scale, causal=causal, rows=rows,
              block_kv=block_kv, interpret=interpret, **tuning)
