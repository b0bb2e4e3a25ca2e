"""Reference semantics in pure jnp (float32 math). Every kernel is tested against this.

Conventions:
- GQA: query head h reads kv head h // (Hq // Hkv).
- sm_scale defaults to 1 / sqrt(head_dim).
- causal is bottom-right aligned: query i of a request with (qo_len, kv_len)
  sees keys j <= i + kv_len - qo_len.
- A query row with no visible key gives o = 0 and lse = -inf (natural log).
- Variants (jaxinfer.variants) apply the same hooks as the kernels; query i of a
  request sits at position kv_len - qo_len + i, key j at j (unless given).
- fp8 K/V are dequantized as k * k_scale[head] (a scalar or an [Hkv] array).
- V (and o) may have another head_dim than q and K (Dv).
Index arrays (indptr, indices) are host arrays: the reference loops over
requests in Python and is meant for tests, not speed. Concrete inputs are sliced
on the host and each request runs one jitted program on power-of-two padded
lengths (a few compilations per test); inside a caller's jit it traces as jnp.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import variants
from jaxinfer.formats import AttentionState, default_sm_scale


def attention(q, k, v, *, causal=False, sm_scale=None, mask=None, variant=None, params=None,
              qo_pos=None, kv_pos=None, k_scale=None, v_scale=None):
    """One request. q [qo_len, Hq, D], k [kv_len, Hkv, D], v [kv_len, Hkv, Dv], mask [qo_len, kv_len] bool.

    variant / params: an AttentionVariant and its parameters; qo_pos [qo_len], kv_pos [kv_len]:
    positions (defaults above). Returns AttentionState(o [qo_len, Hq, Dv] in q.dtype,
    lse [qo_len, Hq] float32); a variant without softmax gives lse = 0.

    Runs as one jitted program on lengths padded to powers of two (padded query rows and keys
    are hidden), so a test compiles a few programs rather than every op for every length.
    """
    qo_len, hq, d = q.shape
    kv_len = k.shape[0]
    scale = default_sm_scale(d, sm_scale)
    if kv_len == 0:
        lse = jnp.full((qo_len, hq), -jnp.inf if variant is None or variant.use_softmax else 0.0, jnp.float32)
        return _finish(variant, params, jnp.zeros((qo_len, hq, v.shape[-1]), jnp.float32), lse, q.dtype)
    # Concrete inputs are padded on the host; traced ones (reference() inside a caller's jit) are not.
    concrete = not any(map(_traced, jax.tree_util.tree_leaves((q, k, v, mask, qo_pos, kv_pos))))
    xp = np if concrete else jnp
    visible = xp.ones((qo_len, kv_len), bool)
    if causal:
        visible &= xp.arange(kv_len)[None, :] <= xp.arange(qo_len)[:, None] + kv_len - qo_len
    if mask is not None:
        visible &= xp.asarray(mask, bool)
    qo_pos = kv_len - qo_len + xp.arange(qo_len) if qo_pos is None else xp.asarray(qo_pos)
    kv_pos = xp.arange(kv_len) if kv_pos is None else xp.asarray(kv_pos)
    qo_pos, kv_pos = qo_pos.astype(np.int32), kv_pos.astype(np.int32)
    if concrete:
        qp, kp = _bucket(qo_len), _bucket(kv_len)
        q, k, v, qo_pos, kv_pos = _pad(q, qp), _pad(k, kp), _pad(v, kp), _pad(qo_pos, qp), _pad(kv_pos, kp)
        visible = _pad(_pad(visible, qp).T, kp).T
    o, lse = _padded_attention(q, k, v, visible, qo_pos, kv_pos, params, k_scale, v_scale,
                               scale=scale, variant=variant)
    return _finish(variant, params, o[:qo_len], lse[:qo_len], q.dtype)


def _traced(x):
    return isinstance(x, jax.core.Tracer)


def _host(x):
    """x as a NumPy array where it is concrete (sliced and gathered on the host: no program per
    slice), else x itself (the reference traced inside a caller's jit)."""
    return x if _traced(x) else np.asarray(x)


def _concat(xs):
    return jnp.asarray(jnp.concatenate(xs) if any(map(_traced, xs)) else np.concatenate(xs))


def _bucket(n):
    """The padded length: the power of two >= n (at least 8)."""
    return max(8, 1 << (n - 1).bit_length())


def _pad(x, n):
    """x [m, ...] (host copy) zero-padded to [n, ...]."""
    x = np.asarray(x)
    return np.concatenate([x, np.zeros((n - x.shape[0],) + x.shape[1:], x.dtype)])


@functools.partial(jax.jit, static_argnames=("scale", "variant"))
def _padded_attention(q, k, v, visible, qo_pos, kv_pos, params, k_scale, v_scale, *, scale, variant):
    """attention() on padded rows: q [QP, Hq, D], k [KP, Hkv, D], v [KP, Hkv, Dv], visible [QP, KP]
    bool, qo_pos [QP], kv_pos [KP]. Returns (o [QP, Hq, Dv] float32, lse [QP, Hq])."""
    qo_len, hq, d = q.shape
    kv_len, hkv, _ = k.shape
    group = hq // hkv
    kf = k.astype(jnp.float32) * _per_head(k_scale, hkv)
    vf = v.astype(jnp.float32) * _per_head(v_scale, hkv)
    row_pos = jnp.repeat(qo_pos, hq)  # rows are (token, head), token-major
    row_head = jnp.tile(jnp.arange(hq), qo_len)
    qf = q.astype(jnp.float32).reshape(qo_len * hq, d)
    if variant is not None and variant.has_query_transform:
        qf = variant.query_transform(params, qf, row_pos, row_head)
    if variant is not None and variant.has_key_transform:
        kf = jnp.stack([variant.key_transform(params, kf[:, h], kv_pos, h) for h in range(hkv)], 1)
    logits = jnp.einsum("qhgd,khd->qhgk", qf.reshape(qo_len, hkv, group, d), kf,
                        precision="highest").reshape(qo_len * hq, kv_len) * scale
    if variant is not None and variant.has_logits_transform:
        logits = variant.logits_transform(params, logits, row_pos[:, None], kv_pos[None, :], row_head[:, None])
    visible = jnp.repeat(visible, hq, axis=0)
    if variant is not None and variant.has_mask:
        visible &= variant.logits_mask(params, row_pos[:, None], kv_pos[None, :], row_head[:, None])
    v_rows = jnp.repeat(vf, group, axis=1)  # [kv, Hq, D]
    if not (variant is None or variant.use_softmax):
        p = jnp.where(visible, logits, 0.0).reshape(qo_len, hq, kv_len)
        o = jnp.einsum("qhk,khd->qhd", p, v_rows, precision="highest")
        return o, jnp.zeros((qo_len, hq), jnp.float32)
    logits = jnp.where(visible, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m_safe)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = (p / jnp.where(denom > 0, denom, 1.0)).reshape(qo_len, hq, kv_len)
    o = jnp.einsum("qhk,khd->qhd", p, v_rows, precision="highest")
    lse = jnp.where(denom[:, 0] > 0, jnp.log(denom[:, 0]) + m_safe[:, 0], -jnp.inf)
    return o, lse.reshape(qo_len, hq)


def _per_head(scale, hkv):
    """A k/v scale as a [Hkv, 1] multiplier (1 when None)."""
    if scale is None:
        return 1.0
    return jnp.broadcast_to(jnp.asarray(scale, jnp.float32), (hkv,))[:, None]


def _finish(variant, params, o, lse, dtype):
    o, lse = variants.finish(variant, params, o, lse, True)
    return AttentionState(o.astype(dtype), lse)


def _concat_states(states, hq, d, dtype):
    if not states:
        return AttentionState(jnp.zeros((0, hq, d), dtype), jnp.zeros((0, hq), jnp.float32))
    return AttentionState(_concat([_host(s.o) for s in states]), _concat([_host(s.lse) for s in states]))


def ragged_attention(q, k, v, qo_indptr, kv_indptr, *, causal=False, sm_scale=None, custom_mask=None,
                     **variant_kw):
    """Ragged queries and ragged KV. q [nnz_q, Hq, D], k [nnz_kv, Hkv, D], v [nnz_kv, Hkv, Dv].

    custom_mask: each request's qo_len x kv_len boolean mask flattened row-major
    and concatenated (FlashInfer's layout), combined with causal if both given.
    variant_kw: variant, params, k_scale, v_scale (see attention).
    """
    qo_indptr, kv_indptr = np.asarray(qo_indptr), np.asarray(kv_indptr)
    q, k, v = _host(q), _host(k), _host(v)
    states, mask_off = [], 0
    for b in range(len(qo_indptr) - 1):
        qs, qe, ks, ke = qo_indptr[b], qo_indptr[b + 1], kv_indptr[b], kv_indptr[b + 1]
        mask = None
        if custom_mask is not None:
            n = (qe - qs) * (ke - ks)
            mask = _host(custom_mask[mask_off:mask_off + n]).reshape(qe - qs, ke - ks)
            mask_off += n
        states.append(attention(q[qs:qe], k[ks:ke], v[ks:ke], causal=causal, sm_scale=sm_scale, mask=mask,
                                **variant_kw))
    return _concat_states(states, q.shape[1], v.shape[2], q.dtype)


def gather_pages(kv_cache, kv_indptr, kv_indices, kv_last_page_len):
    """Paged cache -> ragged K [nnz_kv, Hkv, D], V [nnz_kv, Hkv, Dv] and kv_indptr over tokens (host arrays)."""
    kv_indptr, kv_indices = np.asarray(kv_indptr), np.asarray(kv_indices)
    kv_last_page_len = np.asarray(kv_last_page_len)
    p = kv_cache.page_size
    k_pages, v_pages = _host(kv_cache.k_pages), _host(kv_cache.v_pages)
    ks, vs, lens = [], [], []
    for b in range(len(kv_indptr) - 1):
        pages = kv_indices[kv_indptr[b]:kv_indptr[b + 1]]
        n = 0 if len(pages) == 0 else (len(pages) - 1) * p + int(kv_last_page_len[b])
        kp, vp = k_pages[pages], v_pages[pages]
        if kv_cache.layout == "HND":  # [n, H, P, D] -> [n, P, H, D]
            kp, vp = kp.transpose(0, 2, 1, 3), vp.transpose(0, 2, 1, 3)
        ks.append(kp.reshape(-1, kv_cache.num_kv_heads, kv_cache.head_dim)[:n])
        vs.append(vp.reshape(-1, kv_cache.num_kv_heads, kv_cache.head_dim_vo)[:n])
        lens.append(n)
    tok_indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return _concat(ks), _concat(vs), tok_indptr


def paged_attention(q, kv_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, *,
                    causal=False, sm_scale=None, custom_mask=None, **variant_kw):
    """Ragged queries q [nnz_q, Hq, D] over a PagedKVCache with a CSR page table."""
    k, v, tok_indptr = gather_pages(kv_cache, kv_indptr, kv_indices, kv_last_page_len)
    return ragged_attention(q, k, v, qo_indptr, tok_indptr, causal=causal, sm_scale=sm_scale,
                            custom_mask=custom_mask, **variant_kw)


def decode(q, kv_cache, kv_indptr, kv_indices, kv_last_page_len, *, sm_scale=None, kv_lens=None,
           **variant_kw):
    """Batch decode: q [B, Hq, D], one query per request. kv_lens (optional) truncates each request."""
    k, v, tok_indptr = gather_pages(kv_cache, kv_indptr, kv_indices, kv_last_page_len)
    if kv_lens is not None:
        keep = np.concatenate([np.arange(tok_indptr[b], tok_indptr[b] + int(kv_lens[b]))
                               for b in range(len(tok_indptr) - 1)] + [np.zeros(0, np.int64)])
        k, v = _host(k)[keep], _host(v)[keep]
        tok_indptr = np.concatenate([[0], np.cumsum(np.asarray(kv_lens))]).astype(np.int32)
    qo_indptr = np.arange(q.shape[0] + 1, dtype=np.int32)
    return ragged_attention(q, k, v, qo_indptr, tok_indptr, sm_scale=sm_scale, **variant_kw)


def block_sparse_attention(q, k, v, bsr, *, sm_scale=None, **variant_kw):
    """q [M, Hq, D], k/v [N, Hkv, D]; query row i sees key j where the BSR (with its block_mask) is
    set. Variants see row i at position i and key j at j."""
    mask = bsr.to_dense_mask()
    return attention(q, k, v, sm_scale=sm_scale, mask=mask, qo_pos=jnp.arange(q.shape[0]),
                     kv_pos=jnp.arange(k.shape[0]), **variant_kw)


def merge_state(a, b):
    """The exact merge operator on AttentionStates (paper eq. for ⊕), in float32."""
    return merge_states(AttentionState(jnp.stack([a.o, b.o], -3), jnp.stack([a.lse, b.lse], -2)))


def merge_states(states):
    """Merges n states along axis -3 of o [..., n, H, D] (lse [..., n, H])."""
    lse = states.lse.astype(jnp.float32)
    m = jnp.max(lse, axis=-2, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m_safe)  # [..., n, H]
    total = jnp.sum(w, axis=-2)
    o = jnp.sum(jnp.where(w[..., None] > 0, w[..., None] * states.o.astype(jnp.float32), 0.0), axis=-3)
    o = o / jnp.where(total > 0, total, 1.0)[..., None]
    lse_out = jnp.where(total > 0, jnp.log(total) + m_safe[..., 0, :], -jnp.inf)
    return AttentionState(o.astype(states.o.dtype), lse_out)


def mla_reference(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, kv_len, *,
                  causal=False, sm_scale, ckv_scale=None, kpe_scale=None):
    """Multi-head latent attention over a paged latent cache (float32 math), request by request.

    q_nope [T, H, Dc], q_pe [T, H, Dr]; ckv_cache [num_pages, page_size, Dc], kpe_cache [..., Dr];
    request b: q rows qo_indptr[b]:qo_indptr[b+1], kv_len[b] tokens in pages
    kv_indices[kv_indptr[b]:kv_indptr[b+1]] (host arrays). The cache rows are dequantized as
    ckv x ckv_scale and kpe x kpe_scale (scalars; default 1); logits = sm_scale (q_nope ckv +
    q_pe kpe), v = ckv. Returns AttentionState(o [T, H, Dc] in q's dtype, lse [T, H]); rows past
    qo_indptr[-1] and rows that see no key give o = 0, lse = -inf.
    """
    qo_indptr, kv_indptr = np.asarray(qo_indptr), np.asarray(kv_indptr)
    kv_indices, kv_len = np.asarray(kv_indices), np.asarray(kv_len)
    t, h, dc = q_nope.shape
    o = jnp.zeros((t, h, dc), jnp.float32)
    lse = jnp.full((t, h), -jnp.inf, jnp.float32)
    page_size = ckv_cache.shape[1]
    for b in range(len(kv_len)):
        qs, qe, n = int(qo_indptr[b]), int(qo_indptr[b + 1]), int(kv_len[b])
        if qe == qs or n == 0:
            continue
        pages = kv_indices[kv_indptr[b]:kv_indptr[b + 1]]
        rows = pages[np.arange(n) // page_size] * page_size + np.arange(n) % page_size  # [n]
        ckv = ckv_cache.reshape(-1, dc)[rows].astype(jnp.float32) * _per_head(ckv_scale, 1)  # [n, Dc]
        kpe = kpe_cache.reshape(-1, kpe_cache.shape[-1])[rows].astype(jnp.float32) * _per_head(kpe_scale, 1)  # [n, Dr]
        s = (jnp.einsum("qhd,kd->qhk", q_nope[qs:qe].astype(jnp.float32), ckv, precision="highest")
             + jnp.einsum("qhd,kd->qhk", q_pe[qs:qe].astype(jnp.float32), kpe, precision="highest")) * sm_scale
        if causal:  # query i sees keys j <= i + kv_len - qo_len
            visible = np.arange(n)[None, :] <= np.arange(qe - qs)[:, None] + n - (qe - qs)
            s = jnp.where(visible[:, None, :], s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.exp(s - m_safe)
        den = jnp.sum(p, axis=-1)  # [q, H]
        o_b = jnp.einsum("qhk,kd->qhd", p, ckv, precision="highest") / jnp.where(den > 0, den, 1.0)[..., None]
        o = o.at[qs:qe].set(o_b)
        lse = lse.at[qs:qe].set(jnp.where(den > 0, jnp.log(jnp.where(den > 0, den, 1.0)) + m_safe[..., 0], -jnp.inf))
    return AttentionState(o.astype(q_nope.dtype), lse)
