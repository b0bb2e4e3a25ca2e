"""The inner loop shared by the attention kernels: online softmax over gathered K/V rows.

A variant (optional, static) is any object with jaxinfer.variants.AttentionVariant's
kernel-facing hooks (query_transform, key_transform, logits_transform, logits_mask,
kv_bounds, use_softmax, has_*); its parameters arrive as `params`.
"""
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _common


def attend(q, k_ref, v_ref, kv_indices_ref, page_base, tok_start, n_tok, head, *, page_size,
           num_kv_heads, layout, block_kv, sm_scale, visible_fn=None, n_head=0, n_plain=0,
           variant=None, params=None, qo_pos=None, qo_head=None, kv_pos_offset=0,
           global_kv_pos=False, k_scale=None, kv_pairs=None):
    """Online softmax of q [M, D] over the n_tok KV tokens starting at tok_start; V and the output
    may be of another width Dv (v_ref's). q may also be a tuple of column blocks of q whose widths
    are powers of two (_common.pow2_columns: a D that is not one, for Triton's tiles); K is then
    read in the same blocks and q.K summed over them (no query / key transforms or kv_pairs).
    Otherwise a D (or Dv) that Triton cannot tile comes in tiles of _common.tile_width columns,
    the extra ones 0: q [M, tile_width(D)], acc [M, tile_width(Dv)].

    Token t of the request lives in page kv_indices[page_base + t // page_size]
    at slot t % page_size (its K and V rows: _common.kv_rows of the cache layout); with
    kv_indices_ref None, K/V are contiguous rows [tokens, Hkv, D] and token t is row page_base + t.
    Blocks of block_kv tokens run in three phases: n_head masked, n_plain unmasked (wholly inside
    the range and visible to every row), then masked to the end. Masked loads of tokens past
    n_tok touch no memory (only the request's own pages are read); visible_fn(tok
    [BK]) -> bool [M, BK] (optional) hides keys from rows (causal, custom masks),
    and so does the variant's logits_mask.

    Variant positions: qo_pos [M], qo_head [M]; a key's position is kv_pos_offset + t,
    or its global row page_id * page_size + slot with global_kv_pos (block-sparse).
    K/V may be stored narrower than q (fp8): they are widened to float16 on load (exact),
    q is cast to float16 for the dots, and k_scale (a scalar) multiplies the logits. With
    kv_pairs (an fp8 dtype), k_ref and v_ref hold fp8 K/V as uint16 column pairs
    (_common.fp8_pairs): the even and odd columns are widened and multiplied separately (q's
    halves against K's, two [M, D / 2] accumulators for V's).
    Exponentials go through _common.exp2 (one MUFU.EX2 each when compiled); where the scale is
    a static positive float it is folded into the exponent (2 ** (s * c - m): one multiply-add)
    rather than applied to the logits first.
    Returns (acc [M, Dv], m [M], l [M]) in base 2; see finalize.
    """
    blocks = isinstance(q, tuple)
    if blocks and (kv_pairs is not None or variant is not None and (
            variant.has_query_transform or variant.has_key_transform)):
        raise ValueError("q in column blocks takes no kv_pairs and no query / key transforms")
    q_blocks = q if blocks else (q,)
    starts = [sum(x.shape[1] for x in q_blocks[:i]) for i in range(len(q_blocks))]
    columns = tuple((c, x.shape[1]) for c, x in zip(starts, q_blocks)) if blocks else (None,)  # K's blocks
    rows_q = q_blocks[0].shape[0]
    prec = _common.dot_precision(q_blocks[0].dtype)
    softmax = variant is None or variant.use_softmax
    natural = variant is not None and variant.has_logits_transform
    if variant is not None and variant.has_query_transform:
        q = variant.query_transform(params, q.astype(jnp.float32), qo_pos, qo_head).astype(q.dtype)
        q_blocks = (q,)
    scale = sm_scale if k_scale is None else sm_scale * k_scale
    # Raw logits are kept and the scale applied inside exp2's multiply-add (max(s) * c is the max
    # of the scaled logits for c > 0).
    fused_scale = softmax and not natural and k_scale is None and sm_scale > 0
    widen = k_ref.dtype != q_blocks[0].dtype
    if widen:  # fp8 K/V widen exactly to float16 (cheaper than bfloat16); q follows, clamped
        f16_max = float(jnp.finfo(jnp.float16).max)
        q_blocks = tuple(jnp.clip(x.astype(jnp.float32), -f16_max, f16_max).astype(jnp.float16)
                         for x in q_blocks)
    pairs = kv_pairs is not None
    d = q_blocks[0].shape[1]
    q_parts = jnp.unstack(q_blocks[0].reshape(rows_q, d // 2, 2), axis=-1) if pairs else q_blocks  # even, odd
    dv = _common.tile_width(v_ref.shape[1]) * (2 if pairs else 1)  # V's tile width (pairs: uint16 column pairs)
    zero_k_padding = widen and not pairs and not blocks  # fp8 K: a padded tile's extra columns are undefined
    acc_parts = 2 if pairs else 1

    def load(ref, rows, valid, masked, cols=None):  # [BK, C]; masked rows past the range read as 0
        if not masked:                               # (fp8: undefined, Triton cannot fill 8-bit loads)
            return (_common.whole_rows(ref, rows, fill=ref.dtype.itemsize > 1) if cols is None
                    else _common.load_rows(ref, rows, None, columns=cols))
        return _common.load_rows(ref, rows, valid, fill=ref.dtype.itemsize > 1, columns=cols)

    def widened(x, valid, masked):  # fp8 -> float16; masked rows zeroed
        x = x.astype(jnp.float16)
        return jnp.where(valid[:, None], x, jnp.zeros_like(x)) if masked else x

    def block(j, carry, masked):
        acc, m, l = carry
        offs = j * block_kv + jnp.arange(block_kv)  # [BK]
        tok = tok_start + offs
        valid = offs < n_tok
        if kv_indices_ref is None:
            page_ids = None
            k_rows = v_rows = (page_base + tok) * num_kv_heads + head
        else:
            page_pos = page_base + tok // page_size
            page_ids = (_common.load_rows(kv_indices_ref, page_pos, valid) if masked
                        else kv_indices_ref[page_pos])
            k_rows, v_rows = _common.kv_rows(tok, page_ids, page_size, num_kv_heads, head, layout)
        k = tuple(load(k_ref, k_rows, valid, masked, cols) for cols in columns)  # [BK, D] (or its column blocks)
        v = load(v_ref, v_rows, valid, masked)  # [BK, Dv]
        if pairs:  # [BK, D / 2] pairs (zero-filled) -> even, odd columns
            ks, vs = _common.widen_fp8_pairs(k[0], kv_pairs), _common.widen_fp8_pairs(v, kv_pairs)
        elif widen:
            ks, vs = tuple(widened(x, valid, masked) for x in k), (widened(v, valid, masked),)
            if zero_k_padding:
                ks = tuple(_common.zero_padding(x, k_ref.shape[1]) for x in ks)
        else:
            ks, vs = k, (v,)
        kv_pos = None
        if variant is not None:
            kv_pos = (page_ids * page_size + tok % page_size) if global_kv_pos else kv_pos_offset + tok
            if variant.has_key_transform:  # (callers pass no pairs with a key transform)
                ks = (variant.key_transform(params, ks[0].astype(jnp.float32), kv_pos, head).astype(q_blocks[0].dtype),)
        s = sum(lax.dot_general(qp, kp, (((1,), (1,)), ((), ())), precision=prec,
                                preferred_element_type=jnp.float32) for qp, kp in zip(q_parts, ks))  # [M, BK]
        if natural:
            s = variant.logits_transform(params, s * scale, qo_pos[:, None], kv_pos[None, :],
                                         qo_head[:, None])
            if softmax:
                s = s * _common.LOG2E
        elif not fused_scale:
            s = s * (scale * _common.LOG2E)
        visible = None
        if masked:
            visible = valid[None, :]
            if visible_fn is not None:
                visible = visible & visible_fn(tok)
            if variant is not None and variant.has_mask:
                visible = visible & variant.logits_mask(params, qo_pos[:, None], kv_pos[None, :],
                                                        qo_head[:, None])
        if not softmax:  # o = sum_j f(s_ij) v_j
            p = s if visible is None else jnp.where(visible, s, 0.0)
            return tuple(a + pv for a, pv in zip(acc, pv_dots(p, vs))), m, l
        if visible is not None:
            s = jnp.where(visible, s, -jnp.inf)
        m_blk = jnp.max(s, axis=1)
        if fused_scale:
            m_blk = m_blk * (scale * _common.LOG2E)
        m_new = jnp.maximum(m, m_blk)
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = _common.exp2(m - m_safe)
        p = (_common.exp2_scaled(s, scale * _common.LOG2E, m_safe) if fused_scale
             else _common.exp2(s - m_safe[:, None]))
        acc = tuple(a * alpha[:, None] + pv for a, pv in zip(acc, pv_dots(p, vs)))
        return acc, m_new, l * alpha + jnp.sum(p, axis=1)

    def pv_dots(p, vs):  # p [M, BK] times each V tile [BK, C]
        return [jnp.dot(p.astype(v.dtype), v, precision=prec, preferred_element_type=jnp.float32)
                for v in vs]

    carry = (tuple(jnp.zeros((rows_q, dv // acc_parts), jnp.float32) for _ in range(acc_parts)),
             jnp.full((rows_q,), -jnp.inf, jnp.float32), jnp.zeros((rows_q,), jnp.float32))
    masked_block = functools.partial(block, masked=True)
    if not (isinstance(n_head, int) and n_head == 0):
        carry = lax.fori_loop(0, n_head, masked_block, carry)
    carry = lax.fori_loop(n_head, n_head + n_plain, functools.partial(block, masked=False), carry)
    acc, m, l = lax.fori_loop(n_head + n_plain, pl.cdiv(n_tok, block_kv), masked_block, carry)
    acc = acc[0] if acc_parts == 1 else jnp.stack(acc, axis=-1).reshape(rows_q, dv)  # interleave columns
    return acc, m, l


def skip_to_bounds(variant, params, pos_min, pos_max, kv_pos_offset, tok_start, n_tok, block_kv):
    """Skips the keys left of the variant's mask bounds for rows with positions in
    [pos_min, pos_max]. Returns (tok_start, n_tok, n_head): the new range and how
    many of its leading blocks still need the mask (blocks after them see every
    key, up to the range's end or the causal diagonal)."""
    lo, full_lo = variant.kv_bounds(params, pos_min, pos_max)
    end = tok_start + n_tok
    start = jnp.clip(lo - kv_pos_offset, tok_start, end)
    n_tok = end - start
    n_head = jnp.clip(pl.cdiv(full_lo - kv_pos_offset - start, block_kv), 0, pl.cdiv(n_tok, block_kv))
    return start, n_tok, n_head


def finalize(acc, m, l, *, use_softmax=True, v_scale=None):
    """Base-2 running state -> (o [M, D] f32, natural-log lse [M]); rows that saw no key give
    0 / -inf. Without softmax, o is the plain sum and lse 0 (so ⊕ of such states, times
    exp(lse), is their sum). v_scale (a scalar, fp8) multiplies o."""
    if use_softmax:
        nonempty = l > 0
        o = acc / jnp.where(nonempty, l, 1.0)[:, None]
        lse = jnp.where(nonempty, (m + jnp.log2(jnp.where(nonempty, l, 1.0))) * _common.LN2, -jnp.inf)
    else:
        o, lse = acc, jnp.zeros_like(l)
    if v_scale is not None:
        o = o * v_scale
    return o, lse
