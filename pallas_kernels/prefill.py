"""Tiled prefill attention (many query tokens per request) on tensor-core dots.

run_triton: the Pallas-Triton kernel (every feature); run_mosaic: the Mosaic GPU kernel
(prefill_mosaic.py, Hopper) behind the same outputs; mosaic_limits: what the latter cannot run.
Grid (num_cells, Hkv). Cell c runs items[cell_indptr[c]:cell_indptr[c+1]] (planner.work_items
.PREFILL, passed as columns): one query tile of one request against one chunk of its keys, the head group folded
into the tile rows (row r: token tile_tok + r // G of query head kv_head * G + r % G). Causal is
bottom-right; a custom mask, a variant and cascade key offsets ride on the item's columns.
part_base < 0: the tile writes o, lse; else float32 partial rows part_base + t * num_chunks +
chunk for merge.merge_varlen. docs/design.md has the details.
"""
import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _attention, _common



def tile_rows(group, block_q):
    """Rows of a query tile (a power of two >= 16 holding at least one token's head group)."""
    return max(16, _common.next_pow2(group), _common.next_pow2(block_q))


def _prefill_kernel(items_ref, cell_indptr_ref, kv_indices_ref, mask_ref, q_ref, k_ref, v_ref,
                    *refs, num_qo_heads, num_kv_heads, group, rows, causal, has_mask, contiguous,
                    has_scales, variant, param_tree, global_kv_pos, columns, q_columns, **attend_kw):
    # q_ref [nnz * Hq, D]; k_ref [*, D], v_ref [*, Dv]: K/V rows; q_columns: D's column blocks (or None)
    scale_refs, refs = (refs[:2], refs[2:]) if has_scales else ((None, None), refs)
    q_pos_ref, refs = (refs[0], refs[1:]) if variant is not None else (None, refs)
    param_refs, (o_ref, lse_ref, o_part_ref, lse_part_ref) = refs[:-4], refs[-4:]
    cell, head = pl.program_id(0), pl.program_id(1)
    k_scale, v_scale = (None, None) if not has_scales else (scale_refs[0][head], scale_refs[1][head])
    params = None if variant is None else _common.unflatten_params(param_refs, *param_tree)
    block_kv = attend_kw["block_kv"]

    def field(w, name):
        return _common.uniform(items_ref[w, getattr(columns, name)])

    r = jnp.arange(rows)
    tokens_per_tile = rows // group
    t_local = r // group
    q_head = head * group + r % group

    def query_rows(w):
        """The tile's query positions (clamped), flat rows of q, and which rows are real. Called
        before and after the KV loop, so these [rows] vectors are not kept live across it."""
        q_row_start, tile_tok, qo_len = field(w, "q_row_start"), field(w, "tile_tok"), field(w, "qo_len")
        q_tok = tile_tok + t_local
        q_tok_c = jnp.minimum(q_tok, qo_len - 1)
        row_ok = (t_local < tokens_per_tile) & (q_tok < qo_len)
        return q_tok_c, (q_row_start + q_tok_c) * num_qo_heads + q_head, row_ok

    def item(w, carry):
        tile_tok, qo_len, page_base, kv_len = (field(w, c) for c in ("tile_tok", "qo_len", "page_base", "kv_len"))
        kv_start, kv_end, mask_base = field(w, "kv_start"), field(w, "kv_end"), field(w, "mask_base")
        q_flat = query_rows(w)[1]  # [rows]
        if q_columns is None:
            q = _common.whole_rows(q_ref, q_flat)  # [rows, D] (D padded: _common.tile_width)
        else:  # [rows, width] each
            q = tuple(_common.load_rows(q_ref, q_flat, None, columns=c) for c in q_columns)
        offset = kv_len - qo_len
        kv_hi = kv_end
        diag_end = kv_end  # keys before it are visible to every row (causal)
        if causal:
            last_tok = jnp.minimum(tile_tok + tokens_per_tile, qo_len) - 1
            kv_hi = jnp.clip(last_tok + offset + 1, kv_start, kv_end)
            diag_end = tile_tok + offset + 1
        tok_start, n_tok, n_head, var_kw = kv_start, kv_hi - kv_start, 0, {}
        if variant is not None:
            q_tok_c, _, row_ok = query_rows(w)
            qo_pos = _common.load_rows(q_pos_ref, field(w, "q_row_start") + q_tok_c, row_ok)  # [rows]
            pos_offset = field(w, "kv_pos_offset")
            var_kw = dict(variant=variant, params=params, qo_pos=qo_pos, qo_head=q_head,
                          kv_pos_offset=pos_offset, global_kv_pos=global_kv_pos)
            if variant.has_bounds and not global_kv_pos:
                big = jnp.iinfo(jnp.int32).max
                pos_min = jnp.min(jnp.where(row_ok, qo_pos, big))
                pos_max = jnp.max(jnp.where(row_ok, qo_pos, -big))
                tok_start, n_tok, n_head = _attention.skip_to_bounds(
                    variant, params, pos_min, pos_max, pos_offset, tok_start, n_tok, block_kv)
        n_plain = jnp.maximum(jnp.minimum(diag_end - tok_start, n_tok) // block_kv - n_head, 0)
        if has_mask or (variant is not None and variant.has_mask and
                        (global_kv_pos or not variant.has_bounds)):
            n_head, n_plain = 0, 0

        def visible(tok):  # [BK] -> [rows, BK]
            q_tok_c = jnp.minimum(tile_tok + t_local, qo_len - 1)
            vis = jnp.ones((rows, tok.shape[0]), jnp.bool_)
            if causal:
                vis = tok[None, :] <= q_tok_c[:, None] + offset
            if has_mask:
                idx = mask_base + q_tok_c[:, None] * kv_len + tok[None, :]
                in_range = jnp.broadcast_to(tok[None, :] < kv_end, idx.shape)
                vis = vis & (_common.load_rows(mask_ref, idx, in_range) != 0)
            return vis

        acc, m, l = _attention.attend(
            q, k_ref, v_ref, None if contiguous else kv_indices_ref, page_base, tok_start, n_tok, head,
            num_kv_heads=num_kv_heads, visible_fn=visible if (causal or has_mask) else None,
            n_head=n_head, n_plain=n_plain, k_scale=k_scale, **var_kw, **attend_kw)
        o, lse = _attention.finalize(acc, m, l, use_softmax=variant is None or variant.use_softmax,
                                     v_scale=v_scale)
        q_tok_c, q_rows, row_ok = query_rows(w)
        part_base = field(w, "part_base")

        @pl.when(part_base < 0)
        def _():
            _common.store_rows(o_ref, q_rows, o.astype(o_ref.dtype), row_ok)
            _common.store_rows(lse_ref, q_rows, lse, row_ok)

        @pl.when(part_base >= 0)
        def _():
            num_chunks, chunk = field(w, "num_chunks"), field(w, "chunk")
            t = q_tok_c - tile_tok  # token index within the tile
            part_rows = (part_base + t * num_chunks + chunk) * num_qo_heads + q_head
            _common.store_rows(o_part_ref, part_rows, o, row_ok)
            _common.store_rows(lse_part_ref, part_rows, lse, row_ok)

        return carry

    first, end = (_common.uniform(cell_indptr_ref[cell + i]) for i in (0, 1))
    lax.fori_loop(first, end, item, 0)


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """Tuning of the Triton prefill kernel. num_stages None: 3 for paged gathers, 2 for contiguous
    K/V (measured on H100); fp8_pairs off (H100 prefill was slower with pairs, 272-306 vs
    313-316 TFLOP/s)."""
    block_kv: int = 64
    num_warps: int = 4
    num_stages: Optional[int] = None
    fp8_pairs: bool = False


@dataclasses.dataclass(frozen=True)
class MosaicPrefillConfig:
    """Tuning of the Mosaic GPU prefill kernel (prefill_mosaic.py): K/V blocks of block_kv tokens
    through max_concurrent_steps shared-memory slots (head_dim 256 needs block_kv 64 to fit);
    compute_wgs (2 or 3) warpgroups of 64 query rows per tile; pipeline: how each runs its blocks,
    "pingpong" (the two warpgroups' matmuls alternate, FA3's inter-warpgroup schedule), "free"
    (no ordering between warpgroups) or "overlap" (FA3's intra-warpgroup overlap: block j's QK^T
    and block j-1's PV in flight during block j's softmax); tree_max: row maxima by halving the
    columns (short dependency chains)."""
    block_kv: int = 128
    max_concurrent_steps: int = 2
    pipeline: str = "pingpong"
    tree_max: bool = False
    compute_wgs: int = 2

    def __post_init__(self):
        if self.pipeline not in ("pingpong", "free", "overlap"):
            raise ValueError(f"MosaicPrefillConfig: pipeline must be 'pingpong', 'free' or 'overlap', "
                             f"got {self.pipeline!r}")
        if self.compute_wgs not in (2, 3):
            raise ValueError(f"MosaicPrefillConfig: compute_wgs must be 2 or 3, got {self.compute_wgs}")
        if self.pipeline == "pingpong" and self.compute_wgs != 2:
            raise ValueError("MosaicPrefillConfig: the ping-pong pipeline needs compute_wgs=2")

    @property
    def tile_tokens(self):
        """Query tokens per tile: 64 per compute warpgroup (prefill_mosaic.WG_ROWS)."""
        return 64 * self.compute_wgs


@_common.compiled_once
def run_triton(q, k_rows, v_rows, kv_indices, items, cell_indptr, *, mask=None, num_parts=1, page_size,
               num_kv_heads, layout, sm_scale, causal, rows, interpret, config=None, scales=None,
               variant=None, params=None, q_pos=None, global_kv_pos=False, tail_dest=None, lse_src=None,
               columns):
    """Runs the prefill work list on the Pallas-Triton kernel (every feature).

    q [nnz, Hq, D]; k_rows [num_pages*page_size*Hkv, D], v_rows [.., Dv]: the cache's rows (q's dtype
    or fp8; Dv may differ from D: o is then [.., Dv]; a D that is not a power of two is read in
    column blocks that are where it is a multiple of 16, else padded, as Dv is:
    _common.tile_width); kv_indices int32[*], or None for contiguous K/V ([tokens, Hkv, D]
    rows; page_base is then each request's first row); mask int8[*] (custom masks, or None); items
    int32[W, columns.width] (columns: planner.work_items.PREFILL); cell_indptr int32[cells + 1]; rows: the tile height (see
    tile_rows); config: a PrefillConfig; scales: (k_scale, v_scale) f32[Hkv] or None; variant /
    params / q_pos int32[nnz]: an attention variant, its parameters and each query token's
    position. tail_dest / lse_src: run_mosaic's (unused here).
    Returns flat (o [nnz*Hq, Dv], lse [nnz*Hq], o_part [num_parts*Hq, Dv] f32,
    lse_part [num_parts*Hq]); rows of o that split tiles cover are left for the merge.
    """
    config = _check_config(config, PrefillConfig)
    nnz, num_qo_heads, d = q.shape
    dv = v_rows.shape[1]
    group = num_qo_heads // num_kv_heads
    num_stages = config.num_stages or (2 if kv_indices is None else 3)
    block_kv = _common.fit_block_kv(config.block_kv, d, k_rows.dtype.itemsize, num_stages, head_dim_vo=dv)
    q_columns = _common.pow2_columns(d) if d % 16 == 0 else None  # else q and K padded (tile_width)
    kv_pairs, k_rows, v_rows = _common.maybe_fp8_pairs(k_rows, v_rows, variant,
                                                       config.fp8_pairs and d == dv and q_columns is None)
    leaves, treedef, scalar = _common.flatten_params(params)
    kernel = functools.partial(
        _prefill_kernel, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, group=group,
        rows=rows, causal=causal, has_mask=mask is not None, contiguous=kv_indices is None,
        has_scales=scales is not None, variant=variant, param_tree=(treedef, scalar),
        global_kv_pos=global_kv_pos, columns=columns, q_columns=q_columns, page_size=page_size, layout=layout,
        block_kv=block_kv, sm_scale=sm_scale, kv_pairs=kv_pairs)
    if mask is None:
        mask = jnp.zeros((1,), jnp.int8)
    if kv_indices is None:
        kv_indices = jnp.zeros((1,), jnp.int32)
    extra = [*(scales or ())] + ([q_pos] if variant is not None else []) + leaves
    call = pl.pallas_call(
        kernel,
        grid=(cell_indptr.shape[0] - 1, num_kv_heads),
        out_shape=(jax.ShapeDtypeStruct((nnz * num_qo_heads, dv), q.dtype),
                   jax.ShapeDtypeStruct((nnz * num_qo_heads,), jnp.float32),
                   jax.ShapeDtypeStruct((num_parts * num_qo_heads, dv), jnp.float32),
                   jax.ShapeDtypeStruct((num_parts * num_qo_heads,), jnp.float32)),
        compiler_params=_common.compiler_params(config.num_warps, num_stages),
        interpret=interpret,
        name="jaxinfer_prefill",
    )
    with _common.kernel_math(fast=not interpret):
        return call(items, cell_indptr, kv_indices, mask, q.reshape(nnz * num_qo_heads, d), k_rows, v_rows,
                    *extra)


def mosaic_limits(*, head_dim=64, page_size=None, block_kv=128, layout="NHD", q_dtype=None, kv_dtype=None,
                  sm_scale=None, head_dim_vo=None):
    """Why the Mosaic GPU kernel cannot run these (None when it can): its one list of limits,
    which jaxinfer.dispatch asks too. page_size None: contiguous K/V; dtypes, sm_scale None: not
    known yet; head_dim_vo (V and o's head_dim) None: head_dim."""
    if layout not in ("NHD", "NHD_FUSED"):
        return f"layout must be 'NHD' or 'NHD_FUSED', got {layout!r}"
    if head_dim % 64:
        return f"head_dim must be a multiple of 64, got {head_dim}"
    if head_dim_vo is not None and (head_dim_vo % 64 or head_dim_vo > 256):
        return f"head_dim_vo must be a multiple of 64 up to 256, got {head_dim_vo}"
    if head_dim_vo is not None and head_dim_vo != head_dim and layout == "NHD_FUSED":
        return "an NHD_FUSED cache holds K and V of one head_dim"
    if page_size is not None and (page_size % 8 or (block_kv % page_size and page_size % block_kv)):
        return f"page_size must be a multiple of 8 dividing {block_kv} (or a multiple of it), got {page_size}"
    if q_dtype is not None:
        q_dtype, kv_dtype = jnp.dtype(q_dtype), jnp.dtype(kv_dtype)
        if q_dtype not in (jnp.bfloat16, jnp.float16) or kv_dtype != q_dtype:
            return f"q and K/V must both be bfloat16 or float16, got {q_dtype} / {kv_dtype}"
    if sm_scale is not None and not sm_scale > 0:
        return f"sm_scale must be > 0, got {sm_scale}"
    return None


@_common.compiled_once
def run_mosaic(q, k_rows, v_rows, kv_indices, items, cell_indptr, *, mask=None, num_parts=1, page_size,
               num_kv_heads, layout, sm_scale, causal, rows, interpret, config=None, scales=None,
               variant=None, params=None, q_pos=None, global_kv_pos=False, tail_dest=None, lse_src=None,
               columns):
    """The Mosaic GPU kernel (prefill_mosaic.py) behind run_triton's outputs (config a
    MosaicPrefillConfig; a plan with tails, one unsplit item per cell, and tail_dest, lse_src):
    its partial tiles are scattered into o through tail_dest, its lse rows gathered through
    lse_src. Hopper: wgmma, TMA, warp-specialized; mosaic_limits, no custom mask, no fp8."""
    from pallas_kernels import prefill_mosaic
    config = _check_config(config, MosaicPrefillConfig)
    nnz, num_qo_heads, d = q.shape
    unsupported = {"custom mask": mask is not None,
                   "fp8 / k_scale, v_scale": scales is not None, "block-sparse": global_kv_pos,
                   "a plan without tails": tail_dest is None or lse_src is None}
    for what, present in unsupported.items():
        if present:
            raise ValueError(f"prefill impl='mosaic' does not support {what}")
    group = num_qo_heads // num_kv_heads
    if rows != config.tile_tokens * group:
        raise ValueError(f"prefill impl='mosaic': rows must be {config.tile_tokens * group}, got {rows}")
    block_kv = config.block_kv
    why = mosaic_limits(head_dim=d, page_size=None if kv_indices is None else page_size, block_kv=block_kv,
                        layout=layout if kv_indices is not None else "NHD", q_dtype=q.dtype,
                        kv_dtype=k_rows.dtype, sm_scale=sm_scale, head_dim_vo=v_rows.shape[1])
    if why is not None:
        raise ValueError(f"prefill impl='mosaic': {why}")
    o, lse_items, o_tail = prefill_mosaic.prefill_mosaic(
        q, k_rows, v_rows, kv_indices, items, cell_indptr, tail_dest.shape[0], page_size=page_size,
        num_kv_heads=num_kv_heads, layout=layout, sm_scale=sm_scale, causal=causal, block_kv=block_kv,
        variant=variant, params=params, q_pos=q_pos, interpret=interpret,
        max_concurrent_steps=config.max_concurrent_steps, pipeline=config.pipeline,
        tree_max=config.tree_max, compute_wgs=config.compute_wgs, columns=columns)
    o = o.at[tail_dest].set(o_tail, mode="drop")
    lse = lse_items[:, lse_src[:nnz]].T  # [nnz, Hq]
    dv = v_rows.shape[1]
    return (o.reshape(nnz * num_qo_heads, dv), lse.reshape(-1),
            jnp.zeros((num_parts * num_qo_heads, dv), jnp.float32),
            jnp.zeros((num_parts * num_qo_heads,), jnp.float32))


def _check_config(config, config_type):
    config = config_type() if config is None else config
    if not isinstance(config, config_type):
        raise ValueError(f"this prefill kernel takes a {config_type.__name__}, got {config!r}")
    return config
