"""The inner loop shared by the attention kernels: online softmax over gathered K/V rows."""
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _common


def attend(q, k_ref, v_ref, kv_indices_ref, page_base, tok_start, n_tok, head, *, page_size,
           num_kv_heads, layout, block_kv, scale_log2, visible_fn=None, n_plain=0):
    """Online softmax of q [M, D] over the n_tok KV tokens starting at tok_start.

    Token t of the request lives in page kv_indices[page_base + t // page_size]
    at slot t % page_size; with kv_indices_ref None, K/V are contiguous rows
    [tokens, Hkv, D] and token t is row page_base + t. The first n_plain blocks of block_kv tokens must be
    wholly inside the range and visible to every row: they run without masks.
    The rest are masked: loads of tokens past n_tok are masked off (they touch
    no memory, so only the request's own pages are read), and visible_fn(tok
    [BK]) -> bool [M, BK] (optional) hides keys from rows (causal, custom masks).
    Returns (acc [M, D], m [M], l [M]) in base 2; see finalize.
    """
    rows_q, d = q.shape
    prec = _common.dot_precision(q.dtype)

    def block(j, carry, masked):
        acc, m, l = carry
        offs = j * block_kv + jnp.arange(block_kv)  # [BK]
        tok = tok_start + offs
        valid = offs < n_tok
        if kv_indices_ref is None:
            rows = (page_base + tok) * num_kv_heads + head
        else:
            page_pos = page_base + tok // page_size
            page_ids = (_common.load_rows(kv_indices_ref, page_pos, valid) if masked
                        else kv_indices_ref[page_pos])
            rows = _common.kv_rows(tok, page_ids, page_size, num_kv_heads, head, layout)
        if masked:
            k = _common.load_rows(k_ref, rows, valid)  # [BK, D]; rows past the range read as 0
            v = _common.load_rows(v_ref, rows, valid)
        else:
            k, v = k_ref[rows], v_ref[rows]
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec,
                            preferred_element_type=jnp.float32) * scale_log2  # [M, BK]
        if masked:
            visible = valid[None, :]
            if visible_fn is not None:
                visible = visible & visible_fn(tok)
            s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_safe)
        p = jnp.exp2(s - m_safe[:, None])
        pv = jnp.dot(p.astype(v.dtype), v, precision=prec, preferred_element_type=jnp.float32)
        return acc * alpha[:, None] + pv, m_new, l * alpha + jnp.sum(p, axis=1)

    init = (jnp.zeros((rows_q, d), jnp.float32), jnp.full((rows_q,), -jnp.inf, jnp.float32),
            jnp.zeros((rows_q,), jnp.float32))
    carry = lax.fori_loop(0, n_plain, functools.partial(block, masked=False), init)
    return lax.fori_loop(n_plain, pl.cdiv(n_tok, block_kv), functools.partial(block, masked=True), carry)


def finalize(acc, m, l):
    """Base-2 running state -> (o [M, D] f32, natural-log lse [M]); rows that saw no key give 0 / -inf."""
    nonempty = l > 0
    o = acc / jnp.where(nonempty, l, 1.0)[:, None]
    lse = jnp.where(nonempty, (m + jnp.log2(jnp.where(nonempty, l, 1.0))) * _common.LN2, -jnp.inf)
    return o, lse
