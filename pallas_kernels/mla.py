"""Multi-head latent attention (MLA, DeepSeek-V3) over a paged latent cache: decode and multi-token rows.

The cache holds one latent row per token, shared by every head: ckv [*, Dc] (also the values) and
kpe [*, Dr]. Grid (num_cells,): cell c runs items[cell_indptr[c]:cell_indptr[c+1]] one after another
(planner/mla.py balanced them; COLUMNS there name an item's fields). An item is a tile of block_rows
query rows of one request, (token, head) pairs token-major, against the keys [kv_start, kv_end):
each block of block_kv keys is gathered once through the page table for all the tile's heads,
s = q_nope ckv^T + q_pe kpe^T, online softmax (base 2), o += p ckv. Causal bottom-right: token t
sees keys <= first_pos + t. Keys past the chunk are masked loads (never read), their scores -inf
and their ckv rows zeroed before P V. An item with part_base < 0 writes the final (o, lse) rows,
else float32 partial states for merge.merge_varlen.

fp8 caches (float8_e4m3fn / e5m2) are widened to float16 on load (exact) and q is cast to float16
for the dots. Their dequantization scales (ckv_scale, kpe_scale: data, not compiled in) fold into
the softmax: s = q_nope ckv^T + (kpe_scale / ckv_scale) q_pe kpe^T is exponentiated with
sm_scale x ckv_scale, and o is multiplied by ckv_scale (ckv's role as the values).
"""
import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _attention, _common


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLAConfig:
    """Tuning of the MLA kernel. block_rows (None: the planner's choice, 16-64 query rows per
    tile); block_kv None: 64 keys per block for tiles of up to 16 rows, else 32 (a stage of ckv
    and kpe is 72 KB of shared memory at 64 keys: beside a [32+, 512] q tile, 64-key blocks
    overflow Hopper's 227 KB, measured); num_warps None: 4 for tiles of up to 16 rows, else 8
    (a [64, 512] float32 accumulator takes 128 registers a thread at 8 warps); num_stages None: 3
    (H200, 128 heads B16 kv8192: 251 µs, 2 stages at 64-key blocks 284); num_cells None: two cells per SM
    for tiles of up to 16 rows (memory-bound decode), else one (the Mosaic kernel, mla_mosaic: one per SM); min_chunk: the planner splits a
    tile's keys into chunks of at least this many. benchmarks/bench_mla.py --sweep times the
    alternatives."""
    block_kv: Optional[int] = None
    block_rows: Optional[int] = None
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None
    num_cells: Optional[int] = None
    min_chunk: int = 256

    def warps(self, block_rows):
        return self.num_warps or (4 if block_rows <= 16 else 8)

    def kv_block(self, block_rows):
        return self.block_kv or (64 if block_rows <= 16 else 32)

    def stages(self, block_rows):
        return self.num_stages or 3

    def cells(self, block_rows, num_sms):
        return self.num_cells or num_sms * (2 if block_rows <= 16 else 1)


def _mla_kernel(items_ref, cell_indptr_ref, kv_indices_ref, q_nope_ref, q_pe_ref, ckv_ref, kpe_ref, *refs,
                columns, num_heads, block_rows, block_kv, page_size, sm_scale, causal, has_scales):
    # items_ref int32[W, len(columns)]; cell_indptr_ref int32[cells + 1]; kv_indices_ref int32[I]
    # q_nope_ref [N, Dc], q_pe_ref [N, Dr]: q as rows token * H + head (N = T * H)
    # ckv_ref [num_pages * page_size, Dc], kpe_ref [num_pages * page_size, Dr]: the cache's token rows
    # (q's dtype, or fp8); scales_ref f32[2] (ckv_scale, kpe_scale), with has_scales
    # o_ref [N, Dc] (q's dtype), lse_ref f32[N]; o_part_ref f32[parts, Dc], lse_part_ref f32[parts]
    scales_ref, (o_ref, lse_ref, o_part_ref, lse_part_ref) = (refs[0], refs[1:]) if has_scales else (None, refs)
    r = jnp.arange(block_rows)  # [M] tile rows
    widen = ckv_ref.dtype.itemsize == 1  # fp8 cache: float16 dots
    dot_dtype = jnp.float16 if widen else q_nope_ref.dtype
    prec = _common.dot_precision(dot_dtype)
    fill = not widen  # Triton cannot fill 8-bit masked loads: those rows are zeroed / masked after
    scale = sm_scale * _common.LOG2E  # folded into exp2's multiply-add
    pe_ratio, v_scale = None, None
    if has_scales:  # dequantization: ckv_scale joins sm_scale, kpe's relative scale multiplies q_pe . kpe
        ckv_scale, kpe_scale = scales_ref[0], scales_ref[1]
        scale, pe_ratio, v_scale = scale * ckv_scale, kpe_scale / ckv_scale, ckv_scale

    def load_q(ref, rows, ok):  # [M, D] in the dots' dtype (fp8 caches: float16, clamped)
        q = _common.load_rows(ref, rows, ok)
        if not widen or q.dtype == jnp.float16:
            return q
        f16_max = float(jnp.finfo(jnp.float16).max)
        return jnp.clip(q.astype(jnp.float32), -f16_max, f16_max).astype(jnp.float16)

    def item(w, carry):
        f = {name: _common.uniform(items_ref[w, i]) for i, name in enumerate(columns)}
        row_ok = r < f["rows"]  # [M]
        q_rows = f["q_row"] + r  # [M]
        q_nope = load_q(q_nope_ref, q_rows, row_ok)  # [M, Dc]
        q_pe = load_q(q_pe_ref, q_rows, row_ok)  # [M, Dr]
        kv_start, n_tok = f["kv_start"], f["kv_end"] - f["kv_start"]
        limit = f["first_pos"] + (f["row_start"] + r) // num_heads  # [M] last key a row sees (causal)
        n_plain = n_tok // block_kv  # leading blocks every row sees whole
        if causal:  # row 0 has the tile's nearest diagonal
            n_plain = jnp.clip((f["first_pos"] + f["row_start"] // num_heads + 1 - kv_start) // block_kv,
                               0, n_plain)

        def block(j, carry, masked):
            acc, m, l = carry  # [M, Dc] f32, [M], [M]
            offs = j * block_kv + jnp.arange(block_kv)  # [BK]
            tok = kv_start + offs  # [BK] key positions
            valid = offs < n_tok  # [BK]
            page_pos = f["page_base"] + tok // page_size  # [BK] entries of kv_indices
            if masked:
                page_ids = _common.load_rows(kv_indices_ref, page_pos, valid)  # [BK]
            else:
                page_ids = kv_indices_ref[page_pos]
            rows = page_ids * page_size + tok % page_size  # [BK] cache rows
            if masked:
                ckv = _common.load_rows(ckv_ref, rows, valid, fill).astype(dot_dtype)  # [BK, Dc]
                kpe = _common.load_rows(kpe_ref, rows, valid, fill).astype(dot_dtype)  # [BK, Dr]
                ckv = jnp.where(valid[:, None], ckv, jnp.zeros_like(ckv))  # NaN * 0 = NaN: zeroed
            else:
                ckv, kpe = ckv_ref[rows].astype(dot_dtype), kpe_ref[rows].astype(dot_dtype)  # [BK, Dc], [BK, Dr]
            s_pe = lax.dot_general(q_pe, kpe, (((1,), (1,)), ((), ())), precision=prec,
                                   preferred_element_type=jnp.float32)  # [M, BK]
            if has_scales:
                s_pe = s_pe * pe_ratio
            s = lax.dot_general(q_nope, ckv, (((1,), (1,)), ((), ())), precision=prec,
                                preferred_element_type=jnp.float32) + s_pe  # [M, BK] logits / sm_scale (/ ckv_scale)
            if masked:
                visible = valid[None, :]  # [1, BK]
                if causal:
                    visible = visible & (tok[None, :] <= limit[:, None])  # [M, BK]
                s = jnp.where(visible, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=1) * scale)  # [M] scaled, base 2
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = _common.exp2(m - m_safe)  # [M]
            p = _common.exp2_scaled(s, scale, m_safe)  # [M, BK]
            pv = jnp.dot(p.astype(ckv.dtype), ckv, precision=prec, preferred_element_type=jnp.float32)
            return acc * alpha[:, None] + pv, m_new, l * alpha + jnp.sum(p, axis=1)

        state = (jnp.zeros((block_rows, o_ref.shape[1]), jnp.float32),
                 jnp.full((block_rows,), -jnp.inf, jnp.float32), jnp.zeros((block_rows,), jnp.float32))
        state = lax.fori_loop(0, n_plain, functools.partial(block, masked=False), state)
        acc, m, l = lax.fori_loop(n_plain, pl.cdiv(n_tok, block_kv), functools.partial(block, masked=True), state)
        o, lse = _attention.finalize(acc, m, l, v_scale=v_scale)  # [M, Dc] f32, [M] natural log; no key: 0, -inf

        @pl.when(f["part_base"] < 0)
        def _():
            _common.store_rows(o_ref, q_rows, o.astype(o_ref.dtype), row_ok)
            _common.store_rows(lse_ref, q_rows, lse, row_ok)

        @pl.when(f["part_base"] >= 0)
        def _():
            part_rows = f["part_base"] + r * f["part_stride"]  # [M]
            _common.store_rows(o_part_ref, part_rows, o, row_ok)
            _common.store_rows(lse_part_ref, part_rows, lse, row_ok)

        return carry

    cell = pl.program_id(0)
    first, end = (_common.uniform(cell_indptr_ref[cell + i]) for i in (0, 1))
    lax.fori_loop(first, end, item, 0)


@_common.compiled_once
def mla_paged(q_nope, q_pe, ckv_rows, kpe_rows, kv_indices, items, cell_indptr, *, columns, num_parts,
              num_heads, page_size, sm_scale, causal, block_rows, interpret, config=MLAConfig(), scales=None):
    """Runs the MLA work list.

    q_nope [N, Dc], q_pe [N, Dr]: q as rows token * num_heads + head; ckv_rows [num_pages *
    page_size, Dc], kpe_rows [.., Dr] in q's dtype, or both fp8 (q then float16 or bfloat16);
    kv_indices int32[I]; items int32[W, len(columns)] (planner/mla.py's COLUMNS); cell_indptr
    int32[num_cells + 1]; sm_scale > 0; scales: f32[2] (ckv_scale, kpe_scale > 0) or None.
    Returns (o [N, Dc] q's dtype, lse f32[N], o_part f32[max(num_parts, 1), Dc], lse_part
    f32[max(num_parts, 1)]); rows of o written by no writethrough item are the merge's.
    """
    n, dc = q_nope.shape
    num_parts = max(int(num_parts), 1)
    kernel = functools.partial(
        _mla_kernel, columns=tuple(columns), num_heads=num_heads, block_rows=block_rows,
        block_kv=config.kv_block(block_rows), page_size=page_size, sm_scale=float(sm_scale), causal=causal,
        has_scales=scales is not None)
    call = pl.pallas_call(
        kernel,
        grid=(cell_indptr.shape[0] - 1,),
        out_shape=(jax.ShapeDtypeStruct((n, dc), q_nope.dtype),  # o (writethrough)
                   jax.ShapeDtypeStruct((n,), jnp.float32),  # lse
                   jax.ShapeDtypeStruct((num_parts, dc), jnp.float32),  # partial o
                   jax.ShapeDtypeStruct((num_parts,), jnp.float32)),  # partial lse
        compiler_params=_common.compiler_params(config.warps(block_rows), config.stages(block_rows)),
        interpret=interpret,
        name="jaxinfer_mla_paged",
    )
    with _common.kernel_math(fast=not interpret):
        return call(items, cell_indptr, kv_indices, q_nope, q_pe, ckv_rows, kpe_rows,
                    *(() if scales is None else (scales,)))
