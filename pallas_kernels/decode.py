"""Paged decode attention: one query token per request (or a few: multi-token items), the
head group fused into one tile, split-KV.

Grid (Hkv, num_cells) with heads_fastest, else (num_cells, Hkv). Cell c runs the work items
items[cell_indptr[c]:cell_indptr[c+1]] in order (planner.work_items.DECODE or DECODE_MULTI):
one KV chunk of one request each, all Hq / Hkv query heads of a KV head together, so each K/V
row is read once per head group. An item with part_slot < 0 writes the final (o, lse);
otherwise a float32 partial state that merge.merge_varlen combines. Loads past the chunk's
end are masked off: only rows of the request's own pages are read. Fused append writes the
step's new K/V row into the cache in the same launch. docs/design.md has the details.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _attention, _common

K_ROWS_ARG = 5  # the kernel's argument k_rows (v_rows next, unless fused): aliased to outputs when appending


def _decode_kernel(items_ref, cell_indptr_ref, kv_lens_ref, kv_indices_ref, q_ref, k_ref,
                   *refs, num_qo_heads, num_kv_heads, group, rows, columns, causal, has_scales, variant, cell_offset,
                   param_tree, heads_fastest, has_out, has_parts, has_append, append_in_q, q_stride, **attend_kw):
    fused = attend_kw["layout"] == "NHD_FUSED"  # K and V rows in the one array k_ref
    v_ref, refs = (k_ref, refs) if fused else (refs[0], refs[1:])
    scale_refs, refs = (refs[:2], refs[2:]) if has_scales else ((None, None), refs)
    # refs: [params..., (k_new, v_new), (o, lse aliased), (o_part, lse_part aliased)] inputs, then the outputs
    # o, lse, o_part, lse_part, (k_rows, v_rows aliased; fused: kv_rows).
    cache_outs = has_append * (1 if fused else 2)
    outs, refs = refs[len(refs) - 4 - cache_outs:], refs[:len(refs) - 4 - cache_outs]
    o_ref, lse_ref, o_part_ref, lse_part_ref, *cache_out_refs = outs
    k_out_ref, v_out_ref = (cache_out_refs * 2 if fused else cache_out_refs) if has_append else (None, None)
    refs = refs[:len(refs) - 2 * (has_out + has_parts)]
    if has_append and not append_in_q:
        (k_new_ref, v_new_ref), param_refs = refs[-2:], refs[:-2]
    else:  # (append_in_q: the new K/V rows are q_ref's rows past the query heads)
        (k_new_ref, v_new_ref), param_refs = (q_ref, q_ref) if has_append else (None, None), refs
    cell, head = pl.program_id(0), pl.program_id(1)
    if heads_fastest:
        cell, head = head, cell
    r = jnp.arange(rows)
    t_local = r // group  # [rows] query token of each row within the item
    heads = head * group + r % group  # [rows] query head of each row
    k_scale, v_scale = (None, None) if not has_scales else (scale_refs[0][head], scale_refs[1][head])
    params = None if variant is None else _common.unflatten_params(param_refs, *param_tree)
    block_kv = attend_kw["block_kv"]
    multi = "q_start" in columns.names  # items carry their query rows (several tokens per request)

    def item(w, carry):
        f = {name: _common.uniform(items_ref[w, i]) for i, name in enumerate(columns.names)}
        req, tok_start, tok_end, part_slot = f["request"], f["tok_start"], f["tok_end"], f["part_slot"]
        q_start, qo_len = (f["q_start"], f["qo_len"]) if multi else (req, 1)
        kv_len = _common.uniform(kv_lens_ref[req])
        cached = kv_len - 1 if has_append else kv_len  # the appended token is not read from the cache
        n_tok = jnp.maximum(jnp.minimum(tok_end, cached) - tok_start, 0)
        row_ok = t_local < qo_len
        q_tok = jnp.minimum(t_local, jnp.maximum(qo_len, 1) - 1)
        q_rows = (q_start + q_tok) * q_stride + heads
        o_rows = (q_start + q_tok) * num_qo_heads + heads
        q = _common.whole_rows(q_ref, q_rows)  # [rows, D] (D padded: _common.tile_width)
        first_pos = kv_len - qo_len  # position of the item's first query token
        n_head, var_kw, visible = 0, {}, None
        if variant is not None:
            var_kw = dict(variant=variant, params=params, qo_pos=first_pos + q_tok, qo_head=heads)
            if variant.has_bounds:
                tok_start, n_tok, n_head = _attention.skip_to_bounds(
                    variant, params, first_pos, kv_len - 1, 0, tok_start, n_tok, block_kv)
        n_plain = n_tok // block_kv  # blocks every row sees whole, counted from tok_start
        if multi and causal:  # bottom-right: token t sees keys <= first_pos + t
            n_plain = jnp.clip((first_pos + 1 - tok_start) // block_kv, 0, n_plain)
            visible = lambda tok: tok[None, :] <= first_pos + q_tok[:, None]  # [rows, BK]
        n_plain = jnp.maximum(n_plain - n_head, 0)
        if variant is not None and variant.has_mask and not variant.has_bounds:
            n_head, n_plain = 0, 0
        acc, m, l = _attention.attend(q, k_ref, v_ref, kv_indices_ref, f["page_base"], tok_start, n_tok,
                                      head, num_kv_heads=num_kv_heads, n_head=n_head, n_plain=n_plain,
                                      visible_fn=visible, k_scale=k_scale, **var_kw, **attend_kw)
        if has_append:  # request req's new K / V row of this head: q_ref's past its query heads, or own arrays
            k_new_row = req * q_stride + num_qo_heads + head if append_in_q else req * num_kv_heads + head
            v_new_row = k_new_row + num_kv_heads if append_in_q else k_new_row
            acc, m, l = _append_token(acc, m, l, q, k_new_ref, v_new_ref, k_new_row, v_new_row, k_out_ref,
                                      v_out_ref, kv_indices_ref, head, f["page_base"], tok_start, tok_end,
                                      kv_len, r,
                                      num_kv_heads=num_kv_heads, page_size=attend_kw["page_size"],
                                      layout=attend_kw["layout"], sm_scale=attend_kw["sm_scale"])
        o, lse = _attention.finalize(acc, m, l, use_softmax=variant is None or variant.use_softmax,
                                     v_scale=v_scale)

        @pl.when(part_slot < 0)
        def _():
            _common.store_rows(o_ref, o_rows, o.astype(o_ref.dtype), row_ok)
            _common.store_rows(lse_ref, o_rows, lse, row_ok)

        @pl.when(part_slot >= 0)
        def _():  # token t's partials are part_stride apart (contiguous per token for the merge)
            stride = f["part_stride"] if multi else 1
            part_rows = (part_slot + q_tok * stride) * num_qo_heads + heads
            _common.store_rows(o_part_ref, part_rows, o, row_ok)
            _common.store_rows(lse_part_ref, part_rows, lse, row_ok)

        return carry

    first, end = (_common.uniform(cell_indptr_ref[cell_offset + cell + i]) for i in (0, 1))
    lax.fori_loop(first, end, item, 0)


def _append_token(acc, m, l, q, k_new_ref, v_new_ref, k_new_row, v_new_row, k_out_ref, v_out_ref,
                  kv_indices_ref, head, page_base, tok_start, tok_end, kv_len, r, *, num_kv_heads, page_size,
                  layout, sm_scale):
    """The fused append: if this item's chunk [tok_start, tok_end) holds position kv_len - 1,
    writes the item's request's new K/V row of KV head `head` (k_new_ref[k_new_row],
    v_new_ref[v_new_row]) there (page from kv_indices) and adds that key to the base-2
    online-softmax state (acc [M, D], m [M], l [M]); otherwise the state is returned unchanged
    and nothing is written."""
    last = kv_len - 1
    owns = (kv_len > 0) & (tok_start <= last) & (last < tok_end)
    own_rows = jnp.full(r.shape, owns)
    # [M, D]: every row the same K (V) row, 0 where not owned
    k = _common.load_rows(k_new_ref, jnp.full(r.shape, k_new_row), own_rows)
    v = _common.load_rows(v_new_ref, jnp.full(r.shape, v_new_row), own_rows)
    s = jnp.sum(q.astype(jnp.float32) * k.astype(jnp.float32), axis=1) * (sm_scale * _common.LOG2E)  # [M]
    s = jnp.where(own_rows, s, -jnp.inf)
    m_new = jnp.maximum(m, s)
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha, p = _common.exp2(m - m_safe), _common.exp2(s - m_safe)
    acc = acc * alpha[:, None] + p[:, None] * v.astype(jnp.float32)
    page = kv_indices_ref[jnp.where(owns, page_base + last // page_size, 0)]
    k_row, v_row = _common.kv_rows(last, page, page_size, num_kv_heads, head, layout)
    write = own_rows & (r == 0)  # one tile row writes the K/V row
    _common.store_rows(k_out_ref, jnp.full(r.shape, k_row), k, write)
    _common.store_rows(v_out_ref, jnp.full(r.shape, v_row), v, write)
    return acc, m_new, l * alpha + p


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Tuning of the decode kernel (defaults measured on H100, BENCHMARKS.md).

    heads_fastest: the grid is (Hkv, cells), so a cell's KV heads launch together and read a
    token's adjacent head rows at once (fp8: 203.9 vs 206.5 µs at (64, 4096); bf16 gained
    nothing there), and when a step has fewer items than cells (small batches, short
    contexts) every busy CTA is in the first wave rather than spread over two (a CTA with
    three 64-KB K/V stages has an SM to itself).
    num_stages 3: fp8 as pairs 205.6 vs 208.4 µs with 2. The page-id gather takes a pipeline
    stage of its own, so at 3 stages K and V have one shared-memory buffer each (two from 5
    stages; slower at batch 16 and 64)."""
    block_kv: int = 128
    num_warps: int = 4
    num_stages: int = 3
    fp8_pairs: bool = True
    heads_fastest: bool = True


def tile_rows(group, tokens_per_item=1):
    """Rows of a decode tile: the items' query tokens times the head group, a power of two >= 16."""
    return max(16, _common.next_pow2(group * tokens_per_item))


@_common.compiled_once
def paged_decode(q, k_rows, v_rows, kv_indices, kv_lens, items, cell_indptr, *, num_parts,
                 page_size, num_kv_heads, layout, sm_scale, interpret, columns,
                 tokens_per_item=1, causal=True, scales=None, variant=None, params=None,
                 config=DecodeConfig(), out=None, parts=None, append=None, cells=None):
    """Runs the decode work list.

    q [N, Hq, D] (N = B for one token per request); k_rows/v_rows: the cache viewed as
    [num_pages*page_size*Hkv, D] (q's dtype, or fp8; layout NHD_FUSED: one array of K and V rows
    [num_pages*page_size*Hkv*2, D] as both, passed to the kernel once); kv_indices int32[*]; kv_lens int32[B]
    (live lengths); items int32[W, columns.width], columns naming its fields (work_items.DECODE,
    or DECODE_MULTI for items of up to tokens_per_item query tokens of one request, causal
    bottom-right unless causal=False); cell_indptr int32[num_cells + 1], or with cells=(offset,
    num_cells) (static) the launch's cells are cell_indptr[offset:offset + num_cells + 1] of a longer
    one (several launches over one work list, no slice copied); scales: (k_scale, v_scale) f32[Hkv] or None;
    variant / params: an attention variant and its parameter pytree (see _attention).
    out (optional): (o [N*Hq, D], lse [N*Hq]) updated in place (aliased): rows no item writes
    keep their values (BatchAttention: the prefill kernel's rows).
    parts (optional): (o_part [num_parts*Hq, D] f32, lse_part [num_parts*Hq]) updated in place
    (aliased): the partial states of another launch sharing one merge (ragged_paged_attention's
    decode classes); slots no item writes keep their values.
    append (optional): (k_new, v_new) [N, Hkv, D] in the cache's dtype (= q's), one token per
    request (DECODE items), no variant or scales: request b's row is written at position
    kv_lens[b] - 1 of the cache (k_rows / v_rows aliased in and out) and attended to (see the
    module docstring). append="from_q": q is [N, Hq + 2 Hkv, D], each request's query heads
    then its new key heads then its new value heads (a fused QKV projection's output), read in
    place.
    Returns flat (o [N*Hq, D], lse [N*Hq], o_part [num_parts*Hq, D] f32,
    lse_part [num_parts*Hq]), then with append the new (k_rows, v_rows) (NHD_FUSED: kv_rows); rows of o that no
    writethrough item covers are left for the caller's merge (or keep out's values).
    """
    n, q_stride, d = q.shape
    append_in_q = isinstance(append, str)
    if append_in_q and append != "from_q":
        raise ValueError(f"append must be a (k, v) pair or 'from_q', got {append!r}")
    num_qo_heads = q_stride - 2 * num_kv_heads if append_in_q else q_stride
    if append is not None and ("q_start" in columns.names or variant is not None or scales is not None
                               or k_rows.dtype != q.dtype):
        raise ValueError("append needs one-token items, no variant, no K/V scales and K/V in q's dtype")
    heads_fastest = config.heads_fastest
    group = num_qo_heads // num_kv_heads
    cell_offset, num_cells = (0, cell_indptr.shape[0] - 1) if cells is None else cells
    block_kv = _common.fit_block_kv(config.block_kv, d, k_rows.dtype.itemsize, config.num_stages)
    kv_pairs, k_rows, v_rows = _common.maybe_fp8_pairs(k_rows, v_rows, variant, config.fp8_pairs)
    cache = (k_rows,) if layout == "NHD_FUSED" else (k_rows, v_rows)  # (fused: k_rows holds V too)
    leaves, treedef, scalar = _common.flatten_params(params)
    kernel = functools.partial(
        _decode_kernel, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, group=group,
        rows=tile_rows(group, tokens_per_item), columns=columns, causal=causal, cell_offset=cell_offset,
        has_scales=scales is not None,
        variant=variant, param_tree=(treedef, scalar), page_size=page_size, layout=layout,
        block_kv=block_kv, sm_scale=sm_scale, kv_pairs=kv_pairs, heads_fastest=heads_fastest,
        has_out=out is not None, has_parts=parts is not None, has_append=append is not None,
        append_in_q=append_in_q, q_stride=q_stride)
    args = [items, cell_indptr, kv_lens, kv_indices, q.reshape(n * q_stride, d), *cache,  # (K_ROWS_ARG)
            *(scales or ()), *leaves]
    out_shape = [
        jax.ShapeDtypeStruct((n * num_qo_heads, d), q.dtype),  # o (writethrough)
        jax.ShapeDtypeStruct((n * num_qo_heads,), jnp.float32),  # lse
        jax.ShapeDtypeStruct((num_parts * num_qo_heads, d), jnp.float32),  # partial o
        jax.ShapeDtypeStruct((num_parts * num_qo_heads,), jnp.float32),  # partial lse
    ]
    aliases = {}
    if append is not None:  # the cache, written in place: its arrays (args 5, 6 or 5) are outputs 4, 5 (or 4)
        args += [] if append_in_q else [x.reshape(n * num_kv_heads, d) for x in append]
        out_shape += [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in cache]
        aliases = {K_ROWS_ARG + i: 4 + i for i in range(len(cache))}
    extra = [*(out or ()), *(parts or ())]  # aliased in place: o, lse, then o_part, lse_part
    for i, slot in enumerate((0, 1) * (out is not None) + (2, 3) * (parts is not None)):
        aliases[len(args) + i] = slot
    call = pl.pallas_call(
        kernel,
        grid=(num_kv_heads, num_cells) if heads_fastest else (num_cells, num_kv_heads),
        out_shape=tuple(out_shape),
        input_output_aliases=aliases,
        compiler_params=_common.compiler_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="jaxinfer_paged_decode",
    )
    with _common.kernel_math(fast=not interpret):
        return call(*args, *extra)
