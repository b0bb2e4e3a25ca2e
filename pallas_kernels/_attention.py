"""The inner loop shared by the attention kernels: online softmax over gathered K/V rows."""
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _common


def attend(q, k_ref, v_ref, kv_indices_ref, page_base, tok_start, n_tok, head, *, page_size,
           num_kv_heads, layout, block_kv, scale_log2, q_pos=None, causal_offset=0):
    """Online softmax of q [M, D] over the n_tok KV tokens starting at tok_start.

    Token t of the request lives in page kv_indices[page_base + t // page_size]
    at slot t % page_size. Loads of tokens past n_tok are masked off (they touch
    no memory, so only the request's own pages are read) and read as zeros;
    their logits are -inf.
    With q_pos [M] (each row's query position), key t is visible to a row when
    t <= q_pos + causal_offset (bottom-right causal). Returns (acc [M, D],
    m [M], l [M]) in base 2; see finalize.
    """
    rows_q, d = q.shape
    prec = _common.dot_precision(q.dtype)

    def body(j, carry):
        acc, m, l = carry
        offs = j * block_kv + jnp.arange(block_kv)  # [BK]
        valid = offs < n_tok
        tok = tok_start + offs
        page_ids = _common.load_rows(kv_indices_ref, page_base + tok // page_size, valid)
        rows = _common.kv_rows(tok, page_ids, page_size, num_kv_heads, head, layout)
        k = _common.load_rows(k_ref, rows, valid)  # [BK, D]; rows past the chunk read as 0
        v = _common.load_rows(v_ref, rows, valid)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec,
                            preferred_element_type=jnp.float32) * scale_log2  # [M, BK]
        visible = valid[None, :]
        if q_pos is not None:
            visible = visible & (tok[None, :] <= q_pos[:, None] + causal_offset)
        s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_safe)
        p = jnp.exp2(s - m_safe[:, None])
        pv = jnp.dot(p.astype(v.dtype), v, precision=prec, preferred_element_type=jnp.float32)
        return acc * alpha[:, None] + pv, m_new, l * alpha + jnp.sum(p, axis=1)

    init = (jnp.zeros((rows_q, d), jnp.float32), jnp.full((rows_q,), -jnp.inf, jnp.float32),
            jnp.zeros((rows_q,), jnp.float32))
    return lax.fori_loop(0, pl.cdiv(n_tok, block_kv), body, init)


def finalize(acc, m, l):
    """Base-2 running state -> (o [M, D] f32, natural-log lse [M]); rows that saw no key give 0 / -inf."""
    nonempty = l > 0
    o = acc / jnp.where(nonempty, l, 1.0)[:, None]
    lse = jnp.where(nonempty, (m + jnp.log2(jnp.where(nonempty, l, 1.0))) * _common.LN2, -jnp.inf)
    return o, lse
