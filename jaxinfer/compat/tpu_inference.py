"""tpu-inference's ragged paged attention v3 (RPA v3) on jaxinfer: a model changes one import.

Follows tpu_inference/kernels/ragged_paged_attention/v3/kernel.py at TPU_INFERENCE_COMMIT: its
signature, defaults (sm_scale 1.0), input checks and fused KV cache [num_pages, page_size,
align(2 Hkv, p) // p, p, align(D, 128)], K and V heads interleaved (K0, V0, K1, V1, ...), p the
values per 32-bit word (1 for 32-bit, 2 for 16-bit, 4 for 8-bit dtypes). Its head_dim-64 variant
(v3/kernel_hd64.py: ragged_paged_attention_hd64, with attention sinks) over its own cache
[num_pages, page_size, align(Hkv, p) // p, p, 128], each head's K and V side by side.

A cache without padding (2 Hkv a multiple of p and head_dim of 128: bfloat16 and float32 with
head_dim % 128 == 0, fp8 with an even Hkv too; the hd64 variant's with Hkv a multiple of p) is a
free reshape of jaxinfer's NHD_FUSED layout (fused_view): jaxinfer.ragged_paged_attention reads it
and writes the new tokens into it in place (donated), no page copied. Any other cache (padded heads
or head_dim) takes the copy path: the pages its sequences list are split out into a PagedKVCache
(a copy of min(num_pages, S * pages_per_seq) pages), attended, and the new tokens' K/V rows
scattered into the fused cache (donated, so in place). The TPU tuning arguments are accepted and
ignored. docs/engines.md lists every remaining difference from RPA v3.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import ragged
from jaxinfer.formats import PagedKVCache, check_int32, is_concrete

TPU_INFERENCE_COMMIT = "b8692ff01fa191343836996c27a39dc95f008b88"  # vllm-project/tpu-inference
LANE = 128  # RPA v3 pads head_dim to a multiple of the TPU lane width


def packing(dtype):
    """Values of `dtype` per 32-bit word: K/V heads packed along the fused cache's fourth axis."""
    return 32 // (8 * jnp.dtype(dtype).itemsize)


def _align(x, a):
    return -(-x // a) * a


def kv_cache_shape(num_pages, page_size, num_kv_heads, head_dim, dtype):
    """RPA v3's fused cache shape (tpu-inference's get_kv_cache_shape)."""
    p = packing(dtype)
    return (num_pages, page_size, _align(2 * num_kv_heads, p) // p, p, _align(head_dim, LANE))


get_kv_cache_shape = kv_cache_shape  # RPA v3's name


def merge_kv(k, v):
    """k, v [..., Hkv, D] -> fused rows [..., align(2 Hkv, p) // p, p, align(D, 128)] (heads K0,
    V0, K1, V1, ..., zero padding). Tokens [T, Hkv, D] give RPA v3's merge_kv; NHD pages
    [num_pages, page_size, Hkv, D] give a whole fused cache."""
    if k.shape != v.shape or k.dtype != v.dtype or k.ndim < 2:
        raise ValueError(f"k {k.shape} {k.dtype} and v {v.shape} {v.dtype} must have one shape [..., Hkv, D] "
                         "and one dtype")
    *lead, hkv, d = k.shape
    p = packing(k.dtype)
    heads, dp = _align(2 * hkv, p), _align(d, LANE)
    kv = jnp.stack([k, v], axis=-2).reshape(*lead, 2 * hkv, d)  # [..., 2 Hkv, D]
    kv = jnp.pad(kv, [(0, 0)] * len(lead) + [(0, heads - 2 * hkv), (0, dp - d)])
    return kv.reshape(*lead, heads // p, p, dp)


def split_kv(kv_cache, num_kv_heads, head_dim):
    """A fused cache -> PagedKVCache (NHD) [num_pages, page_size, Hkv, D] of its K and V heads,
    padding dropped. Strided slices: XLA copies them unless it fuses them into their reader."""
    if kv_cache.ndim != 5 or kv_cache.shape[2] * kv_cache.shape[3] < 2 * num_kv_heads \
            or kv_cache.shape[4] < head_dim:
        raise ValueError(f"kv_cache {kv_cache.shape} is not a fused cache of {num_kv_heads} KV heads of "
                         f"head_dim {head_dim}")
    n, page_size, words, p, dp = kv_cache.shape
    heads = kv_cache.reshape(n, page_size, words * p, dp)  # [num_pages, page_size, align(2 Hkv, p), Dp]
    return PagedKVCache(heads[:, :, 0:2 * num_kv_heads:2, :head_dim], heads[:, :, 1:2 * num_kv_heads:2, :head_dim])


def fused_view(kv_cache, num_kv_heads, head_dim):
    """Either variant's fused cache as a PagedKVCache of layout NHD_FUSED over the same buffer (a
    free reshape to [num_pages, page_size, Hkv, 2, head_dim], read and written in place) when it
    holds no padding; None otherwise. No padding: RPA v3's 2 Hkv a multiple of p and head_dim of
    128 (heads K0, V0, K1, V1, ... of head_dim each); the hd64 variant's Hkv a multiple of p (each
    head's row of 128 is [K | V])."""
    n, page_size, words, p, dp = kv_cache.shape
    if words * p * dp != 2 * num_kv_heads * head_dim:
        return None
    return PagedKVCache.fused(kv_cache.reshape(n, page_size, num_kv_heads, 2, head_dim))


HD64 = 64  # the hd64 variant's head_dim: [K_h, V_h] fill one 128-lane row


def kv_cache_shape_hd64(num_pages, page_size, num_kv_heads, head_dim, dtype):
    """The hd64 variant's fused cache shape (its get_kv_cache_shape): [num_pages, page_size,
    align(Hkv, p) // p, p, 128]."""
    if head_dim != HD64:
        raise ValueError(f"head_dim must be {HD64} for the hd64 cache, got {head_dim}")
    p = packing(dtype)
    return (num_pages, page_size, _align(num_kv_heads, p) // p, p, 2 * HD64)


get_kv_cache_shape_hd64 = kv_cache_shape_hd64  # tpu-inference's name (layers/common/attention_interface.py)


def merge_kv_hd64(k, v):
    """k, v [..., Hkv, 64] -> hd64 fused rows [..., align(Hkv, p) // p, p, 128] (each head's K then
    V, zero head padding). Tokens [T, Hkv, 64] give the hd64 variant's merge_kv; NHD pages
    [num_pages, page_size, Hkv, 64] a whole fused cache."""
    if k.shape != v.shape or k.dtype != v.dtype or k.ndim < 2 or k.shape[-1] != HD64:
        raise ValueError(f"k {k.shape} {k.dtype} and v {v.shape} {v.dtype} must have one shape [..., Hkv, {HD64}] "
                         "and one dtype")
    *lead, hkv, d = k.shape
    p = packing(k.dtype)
    kv = jnp.concatenate([k, v], axis=-1)  # [..., Hkv, 128]
    kv = jnp.pad(kv, [(0, 0)] * len(lead) + [(0, _align(hkv, p) - hkv), (0, 0)])
    return kv.reshape(*lead, _align(hkv, p) // p, p, 2 * d)


def split_kv_hd64(kv_cache, num_kv_heads):
    """An hd64 fused cache -> PagedKVCache (NHD) [num_pages, page_size, Hkv, 64] of its K and V
    halves, padding dropped (strided slices, as split_kv)."""
    if kv_cache.ndim != 5 or kv_cache.shape[2] * kv_cache.shape[3] < num_kv_heads or kv_cache.shape[4] != 2 * HD64:
        raise ValueError(f"kv_cache {kv_cache.shape} is not an hd64 fused cache of {num_kv_heads} KV heads")
    n, page_size, words, p, dp = kv_cache.shape
    heads = kv_cache.reshape(n, page_size, words * p, dp)[:, :, :num_kv_heads]  # [num_pages, page_size, Hkv, 128]
    return PagedKVCache(heads[..., :HD64], heads[..., HD64:])


def ragged_paged_attention(
        queries,  # [T, Hq, D]
        keys,  # [T, Hkv, D], in the cache's dtype
        values,  # [T, Hkv, D], in the cache's dtype
        kv_cache,  # [num_pages, page_size, align(2 Hkv, p) // p, p, align(D, 128)]
        kv_lens,  # i32[S], each including its sequence's new tokens
        page_indices,  # i32[S * pages_per_seq]
        cu_q_lens,  # i32[S + 1]
        distribution,  # i32[3]: (decode_end, prefill_end, num_seqs)
        *, use_causal_mask=True, update_kv_cache=True, skip_kv_mask=False, sm_scale=1.0, sliding_window=None,
        soft_cap=None, out_dtype=None, mask_value=None, q_scale=None, k_scale=None, v_scale=None,
        chunk_prefill_size=None, d_block_sizes=None, p_block_sizes=None, m_block_sizes=None,
        vmem_limit_bytes=None, debug_mode=False, disable_bounds_checks=True, disable_semaphore_checks=True,
        num_ctas=None, backend=None):
    """RPA v3: writes the new K/V into the fused cache, then ragged paged attention over it.

    Sequence i < distribution[2] has q rows [cu_q_lens[i], cu_q_lens[i + 1]), whose K/V land at
    positions kv_lens[i] - q_len + j (unless update_kv_cache=False: KV sharing, the rows are
    already in the cache and keys/values are not read); its queries attend over its kv_lens[i]
    keys, causal (bottom-right) if use_causal_mask, within sliding_window (needs causal). Logits
    are q.k * sm_scale * k_scale * q_scale, then soft_cap * tanh(s / soft_cap); q_scale first
    quantizes q to the cache dtype (q / q_scale, clipped); v_scale scales the output.

    out_dtype: the output's dtype (default queries'; jaxinfer accumulates in float32 always).
    Ignored: mask_value (masked keys are excluded exactly), skip_kv_mask (checked as RPA v3 does)
    and the TPU tuning (chunk_prefill_size, block sizes, vmem_limit_bytes, debug flags).
    num_ctas, backend: jaxinfer's (ragged_paged_attention).
    Metadata are checked (RPA v3's checks, ValueError) when concrete. Returns (out [T, Hq, D],
    the updated fused cache); padding rows of out are 0. The cache is donated, as RPA v3 does.
    """
    del mask_value, chunk_prefill_size, d_block_sizes, p_block_sizes, m_block_sizes, vmem_limit_bytes
    del debug_mode, disable_bounds_checks, disable_semaphore_checks
    _check_static(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
                  use_causal_mask=use_causal_mask, skip_kv_mask=skip_kv_mask, sliding_window=sliding_window,
                  soft_cap=soft_cap, hd64=False, attention_sink=None)
    return _call(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, None,
                 causal=use_causal_mask, update_kv_cache=update_kv_cache, sm_scale=sm_scale,
                 sliding_window=sliding_window, soft_cap=soft_cap, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
                 out_dtype=out_dtype, hd64=False, num_ctas=num_ctas, backend=backend)


def ragged_paged_attention_hd64(
        queries,  # [T, Hq, 64]
        keys,  # [T, Hkv, 64], in the cache's dtype
        values,  # [T, Hkv, 64], in the cache's dtype
        kv_cache,  # [num_pages, page_size, align(Hkv, p) // p, p, 128]
        kv_lens,  # i32[S], each including its sequence's new tokens
        page_indices,  # i32[S * pages_per_seq]
        cu_q_lens,  # i32[S + 1]
        distribution,  # i32[3]: (decode_end, prefill_end, num_seqs)
        attention_sink=None,  # f32[Hq]
        *, sm_scale=1.0, sliding_window=None, soft_cap=None, mask_value=None, q_scale=None, k_scale=None,
        v_scale=None, chunk_prefill_size=None, num_kv_pages_per_block=None, num_queries_per_block=None,
        vmem_limit_bytes=None, debug_mode=False, num_ctas=None, backend=None):
    """RPA v3's head_dim-64 variant (kernel_hd64.py at TPU_INFERENCE_COMMIT) over its cache
    (kv_cache_shape_hd64): ragged_paged_attention's semantics, always causal, plus attention_sink:
    one logit per query head in every row's softmax denominator (gpt-oss). Returns (out [T, Hq, 64]
    in queries' dtype, the updated cache); ignores mask_value and the TPU tuning as
    ragged_paged_attention does."""
    del mask_value, chunk_prefill_size, num_kv_pages_per_block, num_queries_per_block, vmem_limit_bytes, debug_mode
    _check_static(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
                  use_causal_mask=True, skip_kv_mask=False, sliding_window=sliding_window, soft_cap=soft_cap,
                  hd64=True, attention_sink=attention_sink)
    return _call(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, attention_sink,
                 causal=True, update_kv_cache=True, sm_scale=sm_scale, sliding_window=sliding_window,
                 soft_cap=soft_cap, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out_dtype=None, hd64=True,
                 num_ctas=num_ctas, backend=backend)


def _call(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, attention_sink, *,
          causal, update_kv_cache, sm_scale, sliding_window, soft_cap, q_scale, k_scale, v_scale, out_dtype, hd64,
          num_ctas, backend):
    """Either entry point after its static checks: the metadata's checks when concrete, then _run."""
    if is_concrete(kv_lens, page_indices, cu_q_lens, distribution):
        _check_metadata(queries.shape[0], kv_cache.shape[0], kv_cache.shape[1], kv_lens, page_indices, cu_q_lens,
                        distribution)
    scale = float(sm_scale)
    for s in (k_scale, q_scale):  # RPA v3 scales the logits by both
        scale *= 1.0 if s is None else float(s)
    return _run(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, attention_sink,
                causal=bool(causal), update_kv_cache=bool(update_kv_cache), sm_scale=scale,
                sliding_window=None if sliding_window is None else jnp.asarray(sliding_window, jnp.int32),
                soft_cap=None if soft_cap is None else jnp.asarray(soft_cap, jnp.float32),
                q_scale=None if q_scale is None else float(q_scale),
                v_scale=None if v_scale is None else float(v_scale),
                out_dtype=None if out_dtype is None else jnp.dtype(out_dtype), hd64=hd64, num_ctas=num_ctas,
                backend=backend)


def _check_static(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, *,
                  use_causal_mask, skip_kv_mask, sliding_window, soft_cap, hd64, attention_sink):
    """RPA v3's static_validate_inputs (its messages; hd64: the hd64 variant's, with its cache shape
    and attention_sink), and what jaxinfer cannot run."""
    if use_causal_mask and skip_kv_mask:
        raise ValueError("Can not skip kv mask when using causal mask.")
    if not queries.ndim == keys.ndim == values.ndim == 3:
        raise ValueError(f"Expected 3D array for {queries.shape=}, {keys.shape=}, {values.shape=}")
    if keys.shape != values.shape or queries.shape[0] != keys.shape[0] or queries.shape[2] != keys.shape[2]:
        raise ValueError(f"queries {queries.shape}, keys {keys.shape} and values {values.shape} must be "
                         "[T, Hq, D], [T, Hkv, D], [T, Hkv, D]")
    hq, hkv, d = queries.shape[1], keys.shape[1], queries.shape[2]
    if hq % hkv:
        raise ValueError(f"Expected actual_num_q_heads={hq} to be divisible by actual_num_kv_heads={hkv}.")
    if hd64 and d != HD64:
        raise ValueError(f"Expected actual_head_dim={d} to be {HD64}.")
    if attention_sink is not None:
        if jnp.ndim(attention_sink) != 1 or attention_sink.shape[0] != hq:
            raise ValueError(f"Expected attention_sink.shape={tuple(jnp.shape(attention_sink))} to be ({hq},) "
                             f"(num_q_heads).")
        if attention_sink.dtype != jnp.float32:
            raise ValueError(f"Expected attention_sink.dtype={attention_sink.dtype} to be equal to float32.")
    if kv_cache.ndim != 5:
        raise ValueError(f"kv_cache must be RPA v3's 5-D fused cache (kv_cache_shape), got shape {kv_cache.shape}")
    want = (kv_cache_shape_hd64 if hd64 else kv_cache_shape)(*kv_cache.shape[:2], hkv, d, kv_cache.dtype)
    if tuple(kv_cache.shape) != want:
        raise ValueError(f"Expected kv_cache.shape={tuple(kv_cache.shape)} to be equal to {want}")
    if not kv_cache.dtype == keys.dtype == values.dtype:
        raise ValueError(f"Expected kv_cache.dtype={kv_cache.dtype} to be equal to keys.dtype={keys.dtype} and "
                         f"values.dtype={values.dtype}.")
    if not jnp.issubdtype(kv_cache.dtype, jnp.floating):
        raise ValueError(f"Expected kv_cache.dtype={kv_cache.dtype} to be a floating point.")
    for name, x in (("kv_lens", kv_lens), ("page_indices", page_indices), ("cu_q_lens", cu_q_lens),
                    ("distribution", distribution)):
        check_int32(name, x)
        if jnp.ndim(x) != 1:
            raise ValueError(f"Expected 1D array for {name}, got shape {jnp.shape(x)}")
    s = kv_lens.shape[0]
    if s < 1 or page_indices.shape[0] % s or page_indices.shape[0] == 0:
        raise ValueError(f"Expected num_page_indices={page_indices.shape[0]} to be a positive multiple of "
                         f"max_num_seqs={s}.")
    if cu_q_lens.shape != (s + 1,) or distribution.shape != (3,):
        raise ValueError(f"Expected cu_q_lens.shape={cu_q_lens.shape} to be ({s + 1},) and "
                         f"distribution.shape={distribution.shape} to be (3,).")
    if kv_cache.shape[1] % packing(kv_cache.dtype):
        raise ValueError(f"page_size={kv_cache.shape[1]} must be divisible by kv_packing={packing(kv_cache.dtype)}.")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window={sliding_window} must be positive.")
    if sliding_window is not None and not use_causal_mask:
        raise ValueError("sliding_window needs use_causal_mask=True on jaxinfer")
    if soft_cap is not None and soft_cap == 0.0:
        raise ValueError(f"soft_cap={soft_cap} must not be 0.0.")
    if soft_cap is not None and soft_cap < 0:
        raise ValueError(f"soft_cap={soft_cap} must be positive (RPA v3 caps at |soft_cap|: tanh is odd)")


def _check_metadata(num_tokens, num_pages, page_size, kv_lens, page_indices, cu_q_lens, distribution):
    """RPA v3's dynamic_validate_inputs (its messages), plus the order of distribution's values,
    cu_q_lens[0] = 0 and q_len 1 for the decode sequences (jaxinfer's)."""
    kv, pi, cu, dist = (np.asarray(x) for x in (kv_lens, page_indices, cu_q_lens, distribution))
    s = kv.shape[0]
    pages_per_seq = pi.shape[0] // s
    i, j, k = (int(x) for x in dist)
    if not 0 <= i <= j <= k:
        raise ValueError(f"Invalid distribution: {dist.tolist()} (needs 0 <= d[0] <= d[1] <= d[2])")
    if k > s:
        raise ValueError(f"num_seqs={k} must be <= max_num_seqs={s}")
    if cu[0] != 0:
        raise ValueError(f"cu_q_lens[0] must be 0, got {cu[0]}")
    if cu[k] > num_tokens:
        raise ValueError(f"Total q tokens {cu[k]} must be <= max_num_tokens={num_tokens}.")
    q_len, kv = np.diff(cu[: k + 1]), kv[:k]
    bad = np.flatnonzero((q_len <= 0) | (q_len > kv))
    if bad.size:
        b = bad[0]
        raise ValueError(f"Require 0 < q_len={q_len[b]} <= kv_len={kv[b]} at sequence {b}.")
    bad = np.flatnonzero(q_len[:i] != 1)
    if bad.size:
        raise ValueError(f"Sequences [0, distribution[0]) are decode-only: require q_len=1, got "
                         f"q_len={q_len[bad[0]]} at sequence {bad[0]}.")
    page_cnt = -(-kv // page_size)
    bad = np.flatnonzero(page_cnt > pages_per_seq)
    if bad.size:
        b = bad[0]
        raise ValueError(f"Require page_cnt={page_cnt[b]} <= pages_per_seq={pages_per_seq} at sequence {b} where "
                         f"kv_len={kv[b]} and page_size={page_size}.")
    ids = pi[: k * pages_per_seq].reshape(k, pages_per_seq)
    bad = np.argwhere((np.arange(pages_per_seq)[None, :] < page_cnt[:, None]) & ((ids < 0) | (ids >= num_pages)))
    if bad.size:
        b, p = bad[0]
        raise ValueError(f"Require 0 <= page_idx={ids[b, p]} < total_num_pages={num_pages} at sequence {b} where "
                         f"kv_len={kv[b]} and page_size={page_size}.")


def _token_slots(kv_lens, cu_q_lens, distribution, num_rows, page_size, pages_per_seq):
    """Per query row [T]: its entry of page_indices, its slot in that page, and whether it is a
    valid sequence's row (entries and slots in range for any metadata)."""
    s = kv_lens.shape[0]
    n = jnp.clip(distribution[2], 0, s)
    ends = jnp.where(jnp.arange(s) < n, cu_q_lens[1:], jnp.iinfo(jnp.int32).max)  # [S]
    row = jnp.arange(num_rows, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, row, side="right"), s - 1).astype(jnp.int32)  # [T]
    pos = kv_lens[seq] - cu_q_lens[seq + 1] + row  # kv_len - q_len + (row - cu_q_lens[seq])
    live = (row >= cu_q_lens[0]) & (row < cu_q_lens[n]) & (pos >= 0) & (pos < pages_per_seq * page_size)
    pos = jnp.clip(pos, 0, pages_per_seq * page_size - 1)
    return seq * pages_per_seq + pos // page_size, pos % page_size, live


@functools.partial(jax.jit, static_argnames=("causal", "update_kv_cache", "sm_scale", "q_scale", "v_scale",
                                             "out_dtype", "hd64", "num_ctas", "backend"),
                   donate_argnames=("kv_cache",))
def _run(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, sinks, *, causal,
         update_kv_cache, sm_scale, sliding_window, soft_cap, q_scale, v_scale, out_dtype, hd64, num_ctas, backend):
    """Either entry point after its checks (sm_scale: RPA v3's times k_scale and q_scale;
    sliding_window, soft_cap: 0-d arrays or None, so that their values share one compilation;
    sinks f32[Hq] or None; hd64: the hd64 cache layout)."""
    t, _, d = queries.shape
    hkv = keys.shape[1]
    num_pages, page_size = kv_cache.shape[:2]
    s = kv_lens.shape[0]
    pages_per_seq = page_indices.shape[0] // s
    entry, slot, live = _token_slots(kv_lens, cu_q_lens, distribution, t, page_size, pages_per_seq)
    page = page_indices[entry]  # [T]
    q = queries
    if q_scale is not None:  # RPA v3 quantizes q to the cache dtype
        info = jnp.finfo(kv_cache.dtype)
        q = jnp.clip(q / q_scale, float(info.min), float(info.max)).astype(kv_cache.dtype).astype(queries.dtype)
    attend = functools.partial(
        ragged.ragged_paged_attention, q, kv_lens=kv_lens, cu_q_lens=cu_q_lens, distribution=distribution,
        causal=causal, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks,
        v_scale=v_scale, num_ctas=num_ctas, backend=backend)
    view = fused_view(kv_cache, hkv, d)
    # KV sharing (update_kv_cache=False): the rows are in the cache already, nothing is written
    k_new, v_new = (keys, values) if update_kv_cache else (None, None)
    if view is not None:  # in place: ragged_paged_attention writes the new rows into this very buffer
        out, cache = attend(k_new, v_new, view, page_indices=page_indices)
        return out.astype(queries.dtype if out_dtype is None else out_dtype), cache.kv_pages.reshape(kv_cache.shape)
    split = (lambda c: split_kv_hd64(c, hkv)) if hd64 else (lambda c: split_kv(c, hkv, d))
    if s * pages_per_seq < num_pages:  # split only the listed pages, renumbered in listing order
        cache = split(kv_cache[jnp.clip(page_indices, 0, num_pages - 1)])
        table = jnp.arange(s * pages_per_seq, dtype=jnp.int32)
    else:
        cache = split(kv_cache)
        table = page_indices
    out, _ = attend(k_new, v_new, cache, page_indices=table)
    out = out.astype(queries.dtype if out_dtype is None else out_dtype)
    if not update_kv_cache:
        return out, kv_cache
    # The scatter after the reads of the cache (tied to out), so that it can write in place.
    rows = merge_kv_hd64(keys, values) if hd64 else merge_kv(keys, values)  # [T, words, p, Dp]
    rows, out = jax.lax.optimization_barrier((rows, out))
    dest = jnp.where(live & (page >= 0) & (page < num_pages), page * page_size + slot, num_pages * page_size)
    flat = kv_cache.reshape(num_pages * page_size, *kv_cache.shape[2:])
    return out, flat.at[dest].set(rows, mode="drop").reshape(kv_cache.shape)
