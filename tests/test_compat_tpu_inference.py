"""tpu-inference's RPA v3 test grids (tests/kernels/ragged_paged_attention_kernel_v3_test.py and
its hd64 variant's ragged_paged_attention_kernel_v3_hd64_test.py at TPU_INFERENCE_COMMIT: their
sequence lists, heads, head_dims, dtypes, scales, window, soft cap, attention sinks, KV sharing)
through jaxinfer.compat.tpu_inference in interpret mode. Each case checks RPA v3's own bars
against its reference (copied below): outputs within its tolerance, cache writes exact; and
jaxinfer's bar against a float64 NumPy oracle. Default: a subset; -m slow: all."""
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import TOL, rel_err
from jaxinfer.compat import tpu_inference

NUM_CTAS = 8  # small interpret-mode grids
NAN_INT = np.iinfo(np.int32).min  # RPA v3's tests pad int32 tables with NaN: this on x86


# ---- Copied from vllm-project/tpu-inference at TPU_INFERENCE_COMMIT (Apache License 2.0,
# Copyright 2025 Google LLC): ref_ragged_paged_attention and merge_kv
# (tpu_inference/kernels/ragged_paged_attention/v3/kernel.py), ref_ragged_paged_attention_hd64 and
# its merge_kv (as merge_kv_hd64) with DEFAULT_MASK_VALUE (v3/kernel_hd64.py), align_to, cdiv,
# get_dtype_packing (v3/util.py). Changes: no input validation call (the entry point's checks are
# tested below), jnp.clip's bounds positional, get_dtype_packing through the itemsize, formatting.
def cdiv(a, b):
    assert b != 0
    return (a + b - 1) // b


def align_to(x, a):
    return cdiv(x, a) * a


def get_dtype_packing(dtype):
    return 32 // (8 * jnp.dtype(dtype).itemsize)


def merge_kv(k, v):
    assert k.shape == v.shape
    assert k.dtype == v.dtype
    max_num_tokens, actual_num_kv_heads, actual_head_dim = k.shape
    kv_packing = get_dtype_packing(k.dtype)
    actual_num_kv_heads_x2 = actual_num_kv_heads * 2
    num_kv_heads_x2 = align_to(actual_num_kv_heads_x2, kv_packing)
    head_dim = align_to(actual_head_dim, 128)
    kv = jnp.pad(
        jnp.concat([k, v], axis=-1).reshape(max_num_tokens, actual_num_kv_heads_x2, actual_head_dim),
        ((0, 0), (0, num_kv_heads_x2 - actual_num_kv_heads_x2), (0, head_dim - actual_head_dim)),
        constant_values=0,
    ).reshape(max_num_tokens, num_kv_heads_x2 // kv_packing, kv_packing, head_dim)
    return kv


def ref_ragged_paged_attention(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, *,
                               use_causal_mask=True, skip_kv_mask=False, sm_scale=1.0, sliding_window=None,
                               soft_cap=None, out_dtype=None, mask_value=None, q_scale=None, k_scale=None,
                               v_scale=None):
    if out_dtype is None:
        out_dtype = jnp.float32 if queries.dtype == jnp.float32 else jnp.bfloat16
    if mask_value is None:
        # We do not set to -inf directly because (-inf) - (-inf) is nan.
        mask_value = jnp.finfo(out_dtype).min
    actual_head_dim = queries.shape[2]
    actual_num_q_heads = queries.shape[1]
    actual_num_kv_heads = keys.shape[1]
    merged_kv = merge_kv(keys, values)
    assert merged_kv.shape[-3:] == kv_cache.shape[-3:]
    _, page_size, num_kv_heads_x2_per_kv_packing, kv_packing, head_dim = kv_cache.shape
    num_kv_heads_x2 = num_kv_heads_x2_per_kv_packing * kv_packing
    assert num_kv_heads_x2 % 2 == 0
    assert actual_num_q_heads % actual_num_kv_heads == 0
    assert head_dim % 128 == 0
    assert get_dtype_packing(kv_cache.dtype) == kv_packing
    assert num_kv_heads_x2 == align_to(actual_num_kv_heads * 2, kv_packing)
    actual_num_q_heads_per_kv_head = actual_num_q_heads // actual_num_kv_heads
    max_num_seqs = kv_lens.shape[0]
    num_page_indices = page_indices.shape[0]
    assert num_page_indices % max_num_seqs == 0
    pages_per_seq = num_page_indices // max_num_seqs
    outputs = []

    for i in range(distribution[-1]):
        q_start = cu_q_lens[i]
        q_end = cu_q_lens[i + 1]
        q_len = q_end - q_start

        kv_len = kv_lens[i]
        indices_start = i * pages_per_seq
        indices_end = indices_start + cdiv(kv_len, page_size)
        indices = page_indices[indices_start:indices_end]
        q = queries[q_start:q_end, :, :actual_head_dim]

        # Update the kv cache.
        assert kv_len - q_len >= 0
        gathered_kv = kv_cache[indices]
        gathered_shape = gathered_kv.shape
        gathered_kv = gathered_kv.reshape(-1, *gathered_shape[-3:])
        gathered_kv = gathered_kv.at[kv_len - q_len:kv_len].set(merged_kv[q_start:q_end])
        kv_cache = kv_cache.at[indices].set(gathered_kv.reshape(gathered_shape))

        kv = gathered_kv.reshape(-1, num_kv_heads_x2, head_dim)[:, :actual_num_kv_heads * 2, :].reshape(
            -1, actual_num_kv_heads, head_dim * 2)
        k = kv[:kv_len, :, :head_dim][:, :, :actual_head_dim]
        v = kv[:kv_len, :, head_dim:][:, :, :actual_head_dim]
        k = jnp.repeat(k, actual_num_q_heads_per_kv_head, axis=1)
        v = jnp.repeat(v, actual_num_q_heads_per_kv_head, axis=1)

        if q_scale is not None:
            q = q / q_scale
            if jnp.issubdtype(k.dtype, jnp.floating):
                dtype_info = jnp.finfo(k.dtype)
                minval = float(dtype_info.min)
                maxval = float(dtype_info.max)
                q = jnp.clip(q, minval, maxval)
            q = q.astype(k.dtype)

        attn = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=jnp.float32).astype(out_dtype)
        attn *= sm_scale
        if k_scale is not None:
            attn *= k_scale
        if q_scale is not None:
            attn *= q_scale
        if soft_cap is not None:
            attn = soft_cap * jnp.tanh(attn / soft_cap)

        if use_causal_mask:
            q_span = (kv_len - q_len) + jax.lax.broadcasted_iota(jnp.int32, attn.shape, 1)
            kv_span = jax.lax.broadcasted_iota(jnp.int32, attn.shape, 2)
            mask = q_span >= kv_span
            if sliding_window is not None:
                mask = jnp.logical_and(mask, q_span < kv_span + sliding_window)
            attn = jnp.where(mask, attn, mask_value)
        attn = jax.nn.softmax(attn, axis=-1).astype(v.dtype)

        out = jnp.einsum("hqk,khd->qhd", attn, v).astype(out_dtype)
        if v_scale is not None:
            out *= v_scale

        outputs.append(out)

    result = jnp.concatenate(outputs, axis=0)
    return result, kv_cache


DEFAULT_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.dtype("float32")).max)


def merge_kv_hd64(k, v):
    assert k.shape == v.shape
    assert k.dtype == v.dtype
    max_num_tokens, actual_num_kv_heads, actual_head_dim = k.shape
    kv_packing = get_dtype_packing(k.dtype)
    num_kv_heads = align_to(actual_num_kv_heads, kv_packing)
    kv = jnp.pad(
        jnp.concat([k, v], axis=-1),
        ((0, 0), (0, num_kv_heads - actual_num_kv_heads), (0, 0)),
        constant_values=0,
    ).reshape(max_num_tokens, num_kv_heads // kv_packing, kv_packing, actual_head_dim * 2)
    return kv


def ref_ragged_paged_attention_hd64(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
                                    attention_sink=None, *, sm_scale=1.0, sliding_window=None, soft_cap=None,
                                    mask_value=DEFAULT_MASK_VALUE, q_scale=None, k_scale=None, v_scale=None):
    if mask_value is None:
        mask_value = DEFAULT_MASK_VALUE
    actual_head_dim = queries.shape[2]
    actual_num_q_heads = queries.shape[1]
    actual_num_kv_heads = keys.shape[1]
    assert actual_head_dim == 64
    _, page_size, _, kv_packing, actual_head_dim_x2 = kv_cache.shape
    assert actual_num_q_heads % actual_num_kv_heads == 0
    assert actual_head_dim_x2 == 128
    assert get_dtype_packing(kv_cache.dtype) == kv_packing
    actual_num_q_heads_per_kv_head = actual_num_q_heads // actual_num_kv_heads
    padded_actual_num_kv_heads = align_to(actual_num_kv_heads, kv_packing)
    max_num_seqs = kv_lens.shape[0]
    num_page_indices = page_indices.shape[0]
    assert num_page_indices % max_num_seqs == 0
    pages_per_seq = num_page_indices // max_num_seqs

    # prepare kv and queries
    merged_kv = merge_kv_hd64(keys, values)
    queries = jnp.pad(queries, ((0, 0), (0, 0), (0, 64)), constant_values=0.0)
    outputs = []

    for i in range(distribution[-1]):
        q_start = cu_q_lens[i]
        q_end = cu_q_lens[i + 1]
        q_len = q_end - q_start

        kv_len = kv_lens[i]
        indices_start = i * pages_per_seq
        indices_end = indices_start + cdiv(kv_len, page_size)
        indices = page_indices[indices_start:indices_end]
        q = queries[q_start:q_end, :, :]

        # Update the kv cache.
        assert kv_len - q_len >= 0
        gathered_kv = kv_cache[indices]
        gathered_shape = gathered_kv.shape
        gathered_kv = gathered_kv.reshape(-1, *gathered_shape[-3:])
        gathered_kv = gathered_kv.at[kv_len - q_len:kv_len].set(merged_kv[q_start:q_end])
        kv_cache = kv_cache.at[indices].set(gathered_kv.reshape(gathered_shape))

        kv = gathered_kv.reshape(-1, padded_actual_num_kv_heads, actual_head_dim_x2)[:, :actual_num_kv_heads, :]
        kv = kv[:kv_len, :, :]
        kv = jnp.repeat(kv, actual_num_q_heads_per_kv_head, axis=1)
        if q_scale is not None:
            q = q / q_scale
            if jnp.issubdtype(kv.dtype, jnp.floating):
                dtype_info = jnp.finfo(kv.dtype)
                minval = float(dtype_info.min)
                maxval = float(dtype_info.max)
                q = jnp.clip(q, minval, maxval)
            q = q.astype(kv.dtype)
        attn = jnp.einsum("qhd,khd->hqk", q, kv, preferred_element_type=jnp.float32)
        attn *= sm_scale
        if k_scale is not None:
            attn *= k_scale
        if q_scale is not None:
            attn *= q_scale

        q_span = (kv_len - q_len) + jax.lax.broadcasted_iota(jnp.int32, attn.shape, 1)
        kv_span = jax.lax.broadcasted_iota(jnp.int32, attn.shape, 2)
        mask = q_span < kv_span
        if sliding_window is not None:
            mask = jnp.logical_or(mask, q_span - sliding_window >= kv_span)
        if soft_cap is not None:
            attn = soft_cap * jnp.tanh(attn / soft_cap)
        attn = jnp.where(mask, mask_value, attn)

        if attention_sink is not None:
            reshaped_attention_sink = attention_sink.reshape(actual_num_q_heads, 1, 1)
            reshaped_attention_sink = jnp.repeat(reshaped_attention_sink, q_len, axis=1)
            attn = jnp.concat([reshaped_attention_sink, attn], axis=2)
            attn = jax.nn.softmax(attn, axis=-1).astype(kv.dtype)
            attn = attn[..., 1:]
        else:
            attn = jax.nn.softmax(attn, axis=-1).astype(kv.dtype)

        out = jnp.einsum("hqk,khd->qhd", attn, kv).astype(queries.dtype)
        if v_scale is not None:
            out *= v_scale

        outputs.append(out)

    result = jnp.concatenate(outputs, axis=0)
    result = result[:, :, actual_head_dim:]
    return result, kv_cache
# ---- End of the copy.


def _reference(args, **kwargs):
    """ref_ragged_paged_attention jitted around the concrete metadata: one XLA compilation, not
    one per eager op and sequence. Nine arguments (attention_sink last): the hd64 variant's."""
    meta = tuple(np.asarray(x) for x in args[4:8])
    if len(args) == 9:
        return jax.jit(lambda q, k, v, cache, sink: ref_ragged_paged_attention_hd64(
            q, k, v, cache, *meta, sink, **kwargs))(*args[:4], args[8])
    return jax.jit(lambda q, k, v, cache: ref_ragged_paged_attention(q, k, v, cache, *meta, **kwargs))(*args[:4])


def _inputs(seq_lens, num_heads, head_dim, page_size, q_dtype, kv_dtype, num_pages, *, max_num_batched_tokens=512,
            max_num_seq=8, distribution=None, hd64=False, sink_scale=None, token_align=128):
    """RPA v3's test inputs (its _test_ragged_paged_attention: seed, uniform values, NaN where no
    sequence's token lies; built in float32 NumPy, cast once). distribution: default RPA v3's
    (0, 0, n). hd64: its hd64 test's (the hd64 cache, and attention_sink uniform x sink_scale, or
    None, as a ninth argument). T: max_num_batched_tokens, at least the step's tokens aligned to
    token_align (RPA v3's 128; the small steps below take 8, so T 16: no prefill-class kernel to
    compile where no sequence is long)."""
    rng = np.random.default_rng(1234)

    def gen_random(shape):
        return rng.random(size=shape, dtype=np.float32)

    cu_q_lens, kv_lens = [0], []
    for q_len, kv_len in seq_lens:
        assert q_len <= kv_len
        cu_q_lens.append(cu_q_lens[-1] + q_len)
        kv_lens.append(kv_len)
    max_num_batched_tokens = max(align_to(cu_q_lens[-1], token_align), max_num_batched_tokens)
    max_num_seq = max(align_to(len(seq_lens), 8), max_num_seq)
    pages_per_seq = cdiv(max(kv_lens), page_size)
    num_q_heads, num_kv_heads = num_heads
    q = jnp.asarray(gen_random((max_num_batched_tokens, num_q_heads, head_dim))).astype(q_dtype)
    k, v = (jnp.asarray(gen_random((max_num_batched_tokens, num_kv_heads, head_dim))).astype(kv_dtype)
            for _ in "kv")
    sinks = None if sink_scale is None else jnp.asarray(gen_random((num_q_heads,)) * sink_scale)
    kv_packing = get_dtype_packing(kv_dtype)
    words = align_to(num_kv_heads * (1 if hd64 else 2), kv_packing) // kv_packing
    padded_head_dim = align_to(head_dim, 128)
    pages, page_indices, page_cnt = [], np.full((max_num_seq, pages_per_seq), NAN_INT, np.int32), 0
    for i, kv_len in enumerate(kv_lens):
        kv = gen_random((kv_len, words, kv_packing, padded_head_dim))
        kv = np.pad(kv, ((0, cdiv(kv_len, page_size) * page_size - kv_len), (0, 0), (0, 0), (0, 0)),
                    constant_values=np.nan).reshape(-1, page_size, words, kv_packing, padded_head_dim)
        page_indices[i, :kv.shape[0]] = page_cnt + np.arange(kv.shape[0])
        page_cnt += kv.shape[0]
        pages.append(kv)
    kv_cache = np.concatenate(pages, axis=0)
    kv_cache = np.pad(kv_cache, ((0, num_pages - kv_cache.shape[0]),) + ((0, 0),) * 4, constant_values=np.nan)
    kv_cache = jnp.asarray(kv_cache).astype(kv_dtype)
    cu = np.zeros(max_num_seq + 1, np.int32)
    cu[:len(cu_q_lens)] = cu_q_lens
    kv_lens = np.pad(np.asarray(kv_lens, np.int32), (0, max_num_seq - len(kv_lens)))
    dist = (0, 0, len(seq_lens)) if distribution is None else distribution
    args = (q, k, v, kv_cache, jnp.asarray(kv_lens), jnp.asarray(page_indices.reshape(-1)), jnp.asarray(cu),
            jnp.asarray(dist, jnp.int32))
    return args + (sinks,) if hd64 else args


def _oracle(queries, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, num_kv_heads, *, use_causal_mask=True,
            sm_scale=1.0, sliding_window=None, soft_cap=None, q_scale=None, k_scale=None, v_scale=None, hd64=False,
            attention_sink=None):
    """RPA v3's semantics in float64 NumPy over a fused cache (q quantized as RPA v3 does; hd64:
    the hd64 cache, attention_sink f32[Hq] an extra logit in each row's softmax denominator)."""
    if q_scale is not None:
        info = jnp.finfo(kv_cache.dtype)
        queries = jnp.clip(queries / q_scale, float(info.min), float(info.max)).astype(kv_cache.dtype)
    q = np.asarray(queries.astype(jnp.float32), np.float64)
    kv_lens, page_indices, cu_q_lens, distribution = (np.asarray(x) for x in (kv_lens, page_indices, cu_q_lens,
                                                                             distribution))
    t, hq, d = q.shape
    num_pages, page_size, words, p, dp = kv_cache.shape  # heads K0, V0, K1, V1, ...: [K_h, V_h] rows
    kv_cache, g = _f32(kv_cache).reshape(num_pages, page_size, words * p, dp), hq // num_kv_heads
    rows, v_at = (num_kv_heads, d) if hd64 else (2 * num_kv_heads, dp)  # hd64: [K_h | V_h] in one row
    pages_per_seq = page_indices.shape[0] // kv_lens.shape[0]
    scale = sm_scale * (k_scale or 1.0) * (q_scale or 1.0)
    out = np.zeros((t, hq, d))
    for i in range(int(distribution[2])):
        a, b, kv_len = int(cu_q_lens[i]), int(cu_q_lens[i + 1]), int(kv_lens[i])
        pages = page_indices[i * pages_per_seq: i * pages_per_seq + cdiv(kv_len, page_size)]
        kv = kv_cache[pages, :, :rows].astype(np.float64).reshape(-1, num_kv_heads, rows // num_kv_heads * dp)
        kv = kv[:kv_len]
        # [Hq, kv_len, D], contiguous (BLAS)
        k, v = (np.ascontiguousarray(np.repeat(x, g, axis=1).transpose(1, 0, 2))
                for x in (kv[..., :d], kv[..., v_at:v_at + d]))
        s = np.matmul(np.ascontiguousarray(q[a:b].transpose(1, 0, 2)), k.transpose(0, 2, 1)) * scale  # [Hq, q, kv]
        if soft_cap is not None:
            s = soft_cap * np.tanh(s / soft_cap)
        q_pos = kv_len - (b - a) + np.arange(b - a)[:, None]
        vis = np.ones((b - a, kv_len), bool)
        if use_causal_mask:
            vis &= np.arange(kv_len)[None, :] <= q_pos
        if sliding_window is not None:
            vis &= np.arange(kv_len)[None, :] > q_pos - sliding_window
        s = np.where(vis[None], s, -np.inf)
        m = s.max(-1, keepdims=True)
        den = 0.0
        if attention_sink is not None:
            sink = np.asarray(attention_sink, np.float64)[:, None, None]  # [Hq, 1, 1]
            m = np.maximum(m, sink)
            den = np.exp(sink - m)
        p = np.exp(s - m)
        out[a:b] = np.matmul(p / (p.sum(-1, keepdims=True) + den), v).transpose(1, 0, 2) * (v_scale or 1.0)
    return out


def _f32(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


def _run_case(seq_lens, num_heads, head_dim, page_size, q_dtype, kv_dtype, num_pages, *, distribution=None,
              block_sizes=(64, 256, 32, 128), hd64=False, use_attention_sink=False, **kwargs):
    """RPA v3's _test_ragged_paged_attention (hd64: its hd64 test's, the sequences sorted by q_len,
    decode ones first) through the compat entry point, and the oracle."""
    if hd64:
        seq_lens = sorted(seq_lens, key=lambda x: x[0])
        num_decode = sum(q_len == 1 for q_len, _ in seq_lens)
        distribution = (num_decode, num_decode, len(seq_lens))
    args = _inputs(seq_lens, num_heads, head_dim, page_size, q_dtype, kv_dtype, num_pages,
                   distribution=distribution, hd64=hd64, sink_scale=100.0 if use_attention_sink else None)
    expected, expected_cache = _reference(args, **kwargs)
    want = _oracle(args[0], expected_cache, *args[4:8], num_heads[1], hd64=hd64,
                   attention_sink=args[8] if hd64 else None, **kwargs)
    t0 = time.perf_counter()
    if hd64:
        output, updated_cache = tpu_inference.ragged_paged_attention_hd64(
            *args, **kwargs, num_kv_pages_per_block=8, num_queries_per_block=64,
            vmem_limit_bytes=100 * 1024 * 1024, num_ctas=NUM_CTAS)
    else:
        output, updated_cache = tpu_inference.ragged_paged_attention(
            *args, **kwargs, m_block_sizes=block_sizes, vmem_limit_bytes=100 * 1024 * 1024, num_ctas=NUM_CTAS)
    output.block_until_ready()
    print(f"compat call: {time.perf_counter() - t0:.1f} s")
    n = int(args[6][args[7][2]])
    assert output.shape == args[0].shape and output.dtype == args[0].dtype
    # RPA v3's bars: its tolerance by K/V bits, exact cache where its reference wrote no NaN.
    tol = {32: 0.15, 16: 0.2, 8: 0.2}[8 * jnp.dtype(kv_dtype).itemsize]
    np.testing.assert_allclose(_f32(output[:n]), _f32(expected), atol=tol, rtol=tol)
    mask = ~np.isnan(_f32(expected_cache))
    np.testing.assert_array_equal(_f32(updated_cache)[mask], _f32(expected_cache)[mask])
    # jaxinfer's bar: against float64 over the same cache.
    assert rel_err(output[:n], want[:n]) < TOL[q_dtype]
    np.testing.assert_array_equal(_f32(output[n:]), 0.0)  # padding rows


def _params(cases, default):
    """pytest params, those whose id is not in `default` marked slow."""
    return [pytest.param(*c[1:], id=c[0], marks=() if c[0] in default else pytest.mark.slow) for c in cases]


SEQ_BASIC = [(192, 328), (128, 180), (64, 255)]
SEQ_DECODE = [(1, 18), (1, 129), (1, 597), (1, 122), (1, 64), (1, 322), (1, 463), (1, 181), (1, 1107), (1, 123),
              (1, 31), (1, 18), (1, 1229), (1, 229), (1, 87), (1, 1328)]
SEQ_PREFILL = [(5, 18), (15, 129), (120, 597), (100, 122), (21, 64), (32, 322), (251, 463), (40, 181), (64, 1107),
               (99, 123), (10, 31), (5, 18), (3, 1229), (120, 229), (9, 87), (2, 1328)]
SEQ_MIXED = [(5, 18), (1, 129), (120, 597), (1, 122), (1, 64), (32, 322), (251, 463), (1, 181), (1, 1107),
             (99, 123), (1, 31), (5, 18), (3, 1229), (117, 229), (1, 87), (1, 1328)]
DT = {"f32": jnp.float32, "bf16": jnp.bfloat16, "e5m2": jnp.float8_e5m2, "e4m3": jnp.float8_e4m3fn}


def _distribution_forms(name, seq_lens, dtype):
    """RPA v3's case (distribution (0, 0, n): all "mixed"), and the forms engines send:
    tpu-inference's runner puts decode sequences first, (d, d, n); a prefill-only range (0, n, n)."""
    yield (f"{name}-{jnp.dtype(dtype).name}", seq_lens, (32, 8), 128, dtype, dtype, None, {})
    if name == "prefill_only":
        yield (f"{name}-{jnp.dtype(dtype).name}-range", seq_lens, (32, 8), 128, dtype, dtype,
               (0, len(seq_lens), len(seq_lens)), {})
        return
    dec = [s for s in seq_lens if s[0] == 1]
    yield (f"{name}-{jnp.dtype(dtype).name}-engine", dec + [s for s in seq_lens if s[0] != 1], (32, 8), 128, dtype,
           dtype, (len(dec), len(dec), len(seq_lens)), {})


def _random_seqs(num_seqs):
    """RPA v3's random (q_len, kv_len) lists (seed 1234)."""
    rng = np.random.default_rng(1234)
    q_lens = rng.integers(1, 100, num_seqs)
    kv_lens = q_lens + rng.integers(0, 50, num_seqs)
    return list(zip(q_lens.tolist(), kv_lens.tolist()))


# (id, seq_lens, (Hq, Hkv), head_dim, q dtype, kv dtype, distribution, kwargs)
CASES = (
    [(f"basic-{d}-b{b[1]}-causal{int(c)}", SEQ_BASIC, (32, 8), 128, DT[d], DT[d], None,
      dict(block_sizes=b, use_causal_mask=c))
     for d in ("f32", "bf16") for b in ((64, 256, 32, 128), (60, 48, 30, 48)) for c in (True, False)]
    + [(f"quantized_kv-{kv}-scales{s[0]}", SEQ_BASIC, (32, 8), 128, jnp.bfloat16, DT[kv], None,
        dict(k_scale=s[0], v_scale=s[1])) for kv in ("e5m2", "e4m3") for s in ((0.5, 0.5), (None, None))]
    + [(f"quantized_attention-{kv}-scales{s[0]}", SEQ_BASIC, (32, 8), 128, jnp.bfloat16, DT[kv], None,
        dict(q_scale=0.5, k_scale=s[0], v_scale=s[1])) for kv in ("e5m2", "e4m3") for s in ((0.5, 0.5), (None, None))]
    + [c for name, seqs in (("decode_only", SEQ_DECODE), ("prefill_only", SEQ_PREFILL), ("mixed", SEQ_MIXED))
       for d in ("f32", "bf16") for c in _distribution_forms(name, seqs, DT[d])]
    + [(f"complex-s{n}-h{h[0]}x{h[1]}-d{hd}-{d}", _random_seqs(n), h, hd, DT[d], DT[d], None, {})
       for n in (1, 17) for h in ((32, 8), (12, 2), (5, 1), (3, 3)) for hd in (80, 240) for d in ("f32", "bf16")]
    + [(f"sliding_window-{w}", _random_seqs(5), (4, 4), 128, jnp.float32, jnp.float32, None, dict(sliding_window=w))
       for w in (None, 5, 128)]
    + [(f"soft_cap-{c}", _random_seqs(2), (16, 2), 128, jnp.float32, jnp.float32, None, dict(soft_cap=c))
       for c in (None, 50.0)]
)
# All under slow (each row compiles its own program: 12-26 s on the 2-core machine). RPA v3's layout
# runs by default through the entry point in the tests below, at small shapes, with the grid's
# features: a sliding window and a soft cap on the padded cache (head_dim 64 in 128 lanes), the
# engines' decode-first form and out_dtype in test_jit_with_donation_compiles_once_and_matches; an fp8
# cache with k / v scales under bfloat16 queries at head_dim 128 (in place and copied) in
# test_unpadded_cache_runs_in_place; bfloat16 in test_kv_share_reads_the_cache_and_leaves_it. The hd64
# variant's layout runs its grid's row with a window and sinks by default (HD64_DEFAULT).
DEFAULT = set()


@pytest.mark.parametrize("seq_lens,num_heads,head_dim,q_dtype,kv_dtype,distribution,kwargs", _params(CASES, DEFAULT))
def test_rpa_v3_grid(seq_lens, num_heads, head_dim, q_dtype, kv_dtype, distribution, kwargs):
    _run_case(seq_lens, num_heads, head_dim, 16, q_dtype, kv_dtype, 1000, distribution=distribution, **kwargs)


# The hd64 variant's grid (head_dim 64, always causal): (id, seq_lens, (Hq, Hkv), q dtype, kv dtype, kwargs).
HD64_CASES = (
    [(f"basic-{d}", SEQ_BASIC, (32, 8), DT[d], DT[d], {}) for d in ("f32", "bf16")]
    + [(f"quantized_kv-{kv}-scales{s[0]}", SEQ_BASIC, (32, 8), jnp.bfloat16, DT[kv], dict(k_scale=s[0], v_scale=s[1]))
       for kv in ("e5m2", "e4m3") for s in ((0.5, 0.5), (None, None))]
    + [(f"quantized_attention-{kv}-scales{s[0]}", SEQ_BASIC, (32, 8), jnp.bfloat16, DT[kv],
        dict(q_scale=0.5, k_scale=s[0], v_scale=s[1])) for kv in ("e5m2", "e4m3") for s in ((0.5, 0.5), (None, None))]
    + [(f"{name}-{d}", seqs, (32, 8), DT[d], DT[d], {})
       for name, seqs in (("decode_only", SEQ_DECODE), ("prefill_only", SEQ_PREFILL), ("mixed", SEQ_MIXED))
       for d in ("f32", "bf16")]
    + [(f"complex-s{n}-h{h[0]}x{h[1]}-{d}", _random_seqs(n), h, DT[d], DT[d], {})
       for n in (1, 17) for h in ((32, 8), (12, 2), (5, 1), (3, 3)) for d in ("f32", "bf16")]
    + [(f"sliding_window-{w}", _random_seqs(5), (4, 4), jnp.float32, jnp.float32, dict(sliding_window=w))
       for w in (None, 5, 128)]
    + [(f"sliding_window_sink-{w}-h{h[0]}x{h[1]}", _random_seqs(5), h, jnp.float32, jnp.float32,
        dict(sliding_window=w, use_attention_sink=True)) for w in (5, 128) for h in ((4, 4), (8, 4), (64, 8))]
    + [(f"soft_cap-{c}", _random_seqs(2), (16, 2), jnp.float32, jnp.float32, dict(soft_cap=c)) for c in (None, 50.0)]
)
HD64_DEFAULT = {"sliding_window_sink-5-h8x4"}


@pytest.mark.parametrize("seq_lens,num_heads,q_dtype,kv_dtype,kwargs", _params(HD64_CASES, HD64_DEFAULT))
def test_rpa_v3_hd64_grid(seq_lens, num_heads, q_dtype, kv_dtype, kwargs):
    """The hd64 variant (ragged_paged_attention_hd64: its cache, attention sinks) on its test grid."""
    _run_case(seq_lens, num_heads, 64, 16, q_dtype, kv_dtype, 1000, hd64=True, **kwargs)


def _kv_share_inputs(*, q_len, kv_len, kv_input_seed, num_q_heads=8, num_kv_heads=1, head_dim=128, page_size=16,
                     num_pages=8, max_num_seqs=8, dtype=jnp.bfloat16):
    """RPA v3's _build_kv_share_inputs: one sequence over a cache filled beforehand."""
    rng_q, rng_cache, rng_input = (np.random.default_rng(s) for s in (123, 42, kv_input_seed))
    pages_per_seq = cdiv(kv_len, page_size)
    t = max(align_to(q_len, 128), 128)
    p = get_dtype_packing(dtype)
    words = align_to(num_kv_heads * 2, p) // p
    q = jnp.array(rng_q.random((t, num_q_heads, head_dim), dtype=np.float32)).astype(dtype)
    k = jnp.array(rng_input.random((t, num_kv_heads, head_dim), dtype=np.float32)).astype(dtype)
    v = jnp.array(rng_input.random((t, num_kv_heads, head_dim), dtype=np.float32)).astype(dtype)
    cache = jnp.array(rng_cache.random((pages_per_seq * page_size, words, p, align_to(head_dim, 128)),
                                       dtype=np.float32)).astype(dtype)
    cache = jnp.pad(cache.reshape(pages_per_seq, page_size, words, p, -1),
                    ((0, num_pages - pages_per_seq),) + ((0, 0),) * 4, constant_values=jnp.nan)
    page_indices = np.zeros(max_num_seqs * pages_per_seq, np.int32)
    page_indices[:pages_per_seq] = np.arange(pages_per_seq)
    kv_lens, cu = np.zeros(max_num_seqs, np.int32), np.zeros(max_num_seqs + 1, np.int32)
    kv_lens[0], cu[1:] = kv_len, q_len
    dist = (1, 1, 1) if q_len == 1 else (0, 1, 1)
    return (q, k, v, cache, jnp.asarray(kv_lens), jnp.asarray(page_indices), jnp.asarray(cu),
            jnp.asarray(dist, jnp.int32))


@pytest.mark.parametrize("q_len,kv_len", [pytest.param(16, 16, marks=pytest.mark.slow), (8, 24),
                                           pytest.param(1, 33, marks=pytest.mark.slow)])
def test_kv_share_reads_the_cache_and_leaves_it(q_len, kv_len):
    """update_kv_cache=False (RPA v3's KV-share tests): keys/values unread, the cache unchanged,
    the output attention over the cache's rows."""
    outs = []
    for seed in (11, 99):
        args = _kv_share_inputs(q_len=q_len, kv_len=kv_len, kv_input_seed=seed)
        before = _f32(args[3])
        want = _oracle(args[0], args[3], *args[4:], 1, sm_scale=128 ** -0.5)
        out, after = tpu_inference.ragged_paged_attention(*args, sm_scale=128 ** -0.5, update_kv_cache=False,
                                                          m_block_sizes=(64, 256, 32, 128), num_ctas=NUM_CTAS)
        np.testing.assert_array_equal(_f32(after), before)  # NaN == NaN
        assert rel_err(out[:q_len], want[:q_len]) < TOL[jnp.bfloat16]
        outs.append(_f32(out))
    np.testing.assert_array_equal(outs[0], outs[1])


def _small(**kw):
    """A small valid step (f32, heads (4, 2), head_dim 64; 8 sequence slots, 2 pages each, T
    16): RPA v3 arguments."""
    return _inputs([(3, 20), (1, 9), (6, 6)], (4, 2), 64, 16, jnp.float32, jnp.float32, 12,
                   max_num_batched_tokens=16, max_num_seq=4, token_align=8, **kw)


@pytest.mark.parametrize("kwargs,match", [
    (dict(sliding_window=0), "must be positive"), (dict(sliding_window=-1), "must be positive"),
    (dict(soft_cap=0.0), "must not be 0.0"), (dict(soft_cap=-50.0), "must be positive"),
    (dict(skip_kv_mask=True), "Can not skip kv mask"),
    (dict(use_causal_mask=False, sliding_window=8), "needs use_causal_mask"),
])
def test_rejects_options_as_rpa_v3(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tpu_inference.ragged_paged_attention(*_small(), **kwargs)


def _replace(args, i, value):
    """args with argument i's first entries replaced by `value` (the rest 0)."""
    x = np.zeros(args[i].shape, np.int32)
    x[:len(value)] = value
    return args[:i] + (jnp.asarray(x),) + args[i + 1:]


@pytest.mark.parametrize("index,value,match", [
    (7, (0, 0, 9), "num_seqs=9 must be <="), (7, (2, 1, 3), "Invalid distribution"),
    (7, (-1, 0, 3), "Invalid distribution"), (7, (2, 2, 3), "decode"),
    (4, (2, 9, 6), "Require 0 < q_len=3 <= kv_len=2 at sequence 0"),
    (6, (0, 3, 3, 10), "Require 0 < q_len=0"), (6, (0, 3, 4, 200), "Total q tokens 200"),
    (5, [NAN_INT] * 16, "page_idx"),
])
def test_rejects_bad_metadata_when_concrete(index, value, match):
    """Out-of-range distribution values, kv_lens below q_lens, empty sequences, pages outside
    the cache: ValueError (RPA v3's messages) when the metadata are concrete."""
    with pytest.raises(ValueError, match=match):
        tpu_inference.ragged_paged_attention(*_replace(_small(), index, value))


def _small_hd64():
    """_small's step for the hd64 variant: its cache, and attention sinks."""
    return _inputs([(3, 20), (1, 9), (6, 6)], (4, 2), 64, 16, jnp.float32, jnp.float32, 12, max_num_batched_tokens=16,
                   max_num_seq=4, hd64=True, sink_scale=10.0, token_align=8)


@pytest.mark.parametrize("kwargs,match", [
    (dict(attention_sink=jnp.zeros((5,), jnp.float32)), "attention_sink.shape=.5,. to be .4,."),
    (dict(attention_sink=jnp.zeros((4,), jnp.bfloat16)), "attention_sink.dtype=bfloat16"),
    (dict(soft_cap=0.0), "must not be 0.0"), (dict(soft_cap=-50.0), "must be positive"),
    (dict(sliding_window=0), "must be positive"),
    (dict(kv_lens=(2, 9, 6)), "Require 0 < q_len=3 <= kv_len=2 at sequence 0"),
    (dict(distribution=(0, 0, 9)), "num_seqs=9 must be <="), (dict(distribution=(0, 4, 3)), "Invalid distribution"),
])
def test_hd64_rejects_as_rpa_v3(kwargs, match):
    """The hd64 entry point's checks (its messages): attention_sink f32[Hq], soft cap, window, and
    the metadata when concrete."""
    args = list(_small_hd64())
    for i, name in ((4, "kv_lens"), (7, "distribution"), (8, "attention_sink")):
        if name in kwargs:
            value = kwargs.pop(name)
            args = list(_replace(tuple(args), i, value)) if i < 8 else args[:8] + [value]
    with pytest.raises(ValueError, match=match):
        tpu_inference.ragged_paged_attention_hd64(*args, **kwargs)


def test_hd64_rejects_other_head_dims_and_caches():
    args = _inputs([(3, 20)], (4, 2), 80, 16, jnp.float32, jnp.float32, 12, max_num_batched_tokens=16, max_num_seq=4,
                   token_align=8)
    with pytest.raises(ValueError, match="actual_head_dim=80 to be 64"):
        tpu_inference.ragged_paged_attention_hd64(*args)
    with pytest.raises(ValueError, match="Expected kv_cache.shape"):  # RPA v3's cache, not the hd64 one
        tpu_inference.ragged_paged_attention_hd64(*_small())


@pytest.mark.parametrize("dtype,num_kv_heads", [(jnp.float32, 3), (jnp.bfloat16, 1), (jnp.float8_e4m3fn, 3)])
def test_hd64_layout_helpers_match_rpa_v3(dtype, num_kv_heads):
    """get_kv_cache_shape_hd64 and merge_kv_hd64 as the hd64 variant's; split_kv_hd64 undoes merge_kv_hd64."""
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.random((6, 16, num_kv_heads, 64), np.float32)).astype(dtype) for _ in "kv")
    p = get_dtype_packing(dtype)
    assert tpu_inference.get_kv_cache_shape_hd64(6, 16, num_kv_heads, 64, dtype) == (
        6, 16, align_to(num_kv_heads, p) // p, p, 128)
    np.testing.assert_array_equal(_f32(tpu_inference.merge_kv_hd64(k[0], v[0])), _f32(merge_kv_hd64(k[0], v[0])))
    cache = tpu_inference.merge_kv_hd64(k, v)
    assert cache.shape == tpu_inference.get_kv_cache_shape_hd64(6, 16, num_kv_heads, 64, dtype)
    split = tpu_inference.split_kv_hd64(cache, num_kv_heads)
    np.testing.assert_array_equal(_f32(split.k_pages), _f32(k))
    np.testing.assert_array_equal(_f32(split.v_pages), _f32(v))
    with pytest.raises(ValueError, match="head_dim must be 64"):
        tpu_inference.get_kv_cache_shape_hd64(6, 16, num_kv_heads, 128, dtype)


@pytest.mark.parametrize("dtype,num_kv_heads,head_dim", [
    (jnp.float32, 3, 80), (jnp.bfloat16, 1, 64), (jnp.bfloat16, 8, 128), (jnp.float8_e4m3fn, 1, 240),
    (jnp.float8_e5m2, 3, 128)])
def test_layout_helpers_match_rpa_v3(dtype, num_kv_heads, head_dim):
    """kv_cache_shape and merge_kv as RPA v3's (on tokens and on whole pages); split_kv undoes merge_kv."""
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.random((6, 16, num_kv_heads, head_dim), np.float32)).astype(dtype) for _ in "kv")
    p = get_dtype_packing(dtype)
    assert tpu_inference.kv_cache_shape(6, 16, num_kv_heads, head_dim, dtype) == (
        6, 16, align_to(2 * num_kv_heads, p) // p, p, align_to(head_dim, 128))
    np.testing.assert_array_equal(_f32(tpu_inference.merge_kv(k[0], v[0])), _f32(merge_kv(k[0], v[0])))
    cache = tpu_inference.merge_kv(k, v)
    assert cache.shape == tpu_inference.kv_cache_shape(6, 16, num_kv_heads, head_dim, dtype)
    split = tpu_inference.split_kv(cache, num_kv_heads, head_dim)
    np.testing.assert_array_equal(_f32(split.k_pages), _f32(k))
    np.testing.assert_array_equal(_f32(split.v_pages), _f32(v))


def test_jit_with_donation_compiles_once_and_matches():
    """Under one jit (cache donated), two compositions of one shape compile once; the cache
    writes are RPA v3's reference's, the output (out_dtype bfloat16) float64's. With a sliding
    window and a soft cap, on the padded cache (head_dim 64 in 128 lanes: the copy path): the
    grid's window and soft cap on RPA v3's layout by default (its own rows under slow)."""
    opts = dict(sm_scale=0.125, sliding_window=8, soft_cap=1.5)  # (logits about 2: the cap bends them)
    step = jax.jit(lambda *a: tpu_inference.ragged_paged_attention(*a, **opts, out_dtype=jnp.bfloat16,
                                                                   num_ctas=NUM_CTAS), donate_argnums=3)
    for dist in ((0, 0, 3), (1, 1, 2)):
        args = _small(distribution=dist) if dist[0] == 0 else _small_decode_first(dist)
        _, want_cache = _reference(args, **opts)
        want = _oracle(args[0], want_cache, *args[4:], 2, **opts)
        out, cache = step(*args)
        n = int(args[6][dist[2]])
        assert out.dtype == jnp.bfloat16
        assert rel_err(out[:n], want[:n]) < TOL[jnp.bfloat16]
        mask = ~np.isnan(_f32(want_cache))
        np.testing.assert_array_equal(_f32(cache)[mask], _f32(want_cache)[mask])
    assert step._cache_size() == 1


@pytest.mark.parametrize("hd64", [False, pytest.param(True, marks=pytest.mark.slow)])  # hd64: 15 s
def test_unpadded_cache_runs_in_place(monkeypatch, hd64):
    """A cache without padding (head_dim 128, 2 Hkv a multiple of p; the hd64 variant's with Hkv a
    multiple of p) is jaxinfer's NHD_FUSED layout of the same buffer (fused_view): the whole cache
    reaches ragged_paged_attention, which writes into it (donated), and no page is split out (a copy);
    out and the cache equal the copy path's (fused_view off) bit for bit, and out float64's over the
    written cache. NaN past each kv_len and in unlisted pages (_inputs). RPA v3's layout: an fp8
    (e4m3) cache with k / v scales under bfloat16 queries (the grid's quantized_kv rows: under slow);
    hd64: float32."""
    from jaxinfer import ragged
    entry = tpu_inference.ragged_paged_attention_hd64 if hd64 else tpu_inference.ragged_paged_attention
    split_name = "split_kv_hd64" if hd64 else "split_kv"
    split, real = getattr(tpu_inference, split_name), ragged.ragged_paged_attention
    caches = []  # the cache each trace hands to ragged_paged_attention
    monkeypatch.setattr(ragged, "ragged_paged_attention", lambda *a, **kw: (caches.append(a[3]), real(*a, **kw))[1])
    q_dtype, kv_dtype, opts = (jnp.float32, jnp.float32, {}) if hd64 else (
        jnp.bfloat16, jnp.float8_e4m3fn, dict(k_scale=0.5, v_scale=0.5))

    def call():
        tpu_inference._run.clear_cache()  # (a new trace under each patch)
        args = _inputs([(3, 20), (1, 9), (6, 6)], (4, 2), 64 if hd64 else 128, 16, q_dtype, kv_dtype, 12,
                       max_num_batched_tokens=16, max_num_seq=4, hd64=hd64, token_align=8)
        out, cache = entry(*args, **opts, num_ctas=NUM_CTAS)
        return args, _f32(out), _f32(cache)

    def no_split(*a):
        raise AssertionError("the in-place path split the cache")

    monkeypatch.setattr(tpu_inference, split_name, no_split)
    args, out, cache = call()
    assert args[3].is_deleted()  # donated: the returned cache is the same buffer, updated
    assert caches[-1].layout == "NHD_FUSED" and caches[-1].num_pages == 12
    want = _oracle(args[0], cache, *args[4:8], 2, hd64=hd64, attention_sink=args[8] if hd64 else None, **opts)
    assert rel_err(out[:10], want[:10]) < TOL[q_dtype]
    monkeypatch.setattr(tpu_inference, split_name, split)
    monkeypatch.setattr(tpu_inference, "fused_view", lambda *a: None)
    _, want_out, want_cache = call()
    assert caches[-1].layout == "NHD"  # the copy path
    np.testing.assert_array_equal(out, want_out)
    # In place, V past kv_len in each written sequence's last page is 0 (the copy path leaves it)
    kv_lens, page_indices, cu, dist = (np.asarray(a) for a in args[4:8])
    pps, page = page_indices.shape[0] // kv_lens.shape[0], want_cache.shape[1]
    want_cache = np.array(want_cache)
    rows = want_cache.reshape(want_cache.shape[:2] + (-1, want_cache.shape[-1]))  # [P, S, rows, 128] (a view)
    # V: hd64, columns 64.. of each head's row (K and V side by side); RPA v3's, rows V0, V1 of K0, V0, K1, V1
    v_part = (slice(None), slice(64, None)) if hd64 else (slice(1, None, 2),)
    for i in range(dist[2]):
        if cu[i + 1] > cu[i] and kv_lens[i] % page:
            pg = page_indices[i * pps + (kv_lens[i] - 1) // page]
            rows[(pg, slice(kv_lens[i] % page, None)) + v_part] = 0
    np.testing.assert_array_equal(cache, want_cache)  # (NaN == NaN)


@pytest.mark.parametrize("dtype,num_kv_heads,head_dim,free", [
    (jnp.bfloat16, 2, 128, True), (jnp.float8_e4m3fn, 2, 256, True), (jnp.float8_e4m3fn, 3, 128, False),
    (jnp.bfloat16, 2, 64, False)])
def test_fused_view_only_without_padding(dtype, num_kv_heads, head_dim, free):
    """fused_view: the cache's K / V heads as an NHD_FUSED PagedKVCache of the same values where the
    layout has no padding (else None, the copy path)."""
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.random((3, 16, num_kv_heads, head_dim), np.float32)).astype(dtype) for _ in "kv")
    view = tpu_inference.fused_view(tpu_inference.merge_kv(k, v), num_kv_heads, head_dim)
    assert (view is not None) == free
    if free:
        assert view.layout == "NHD_FUSED"
        np.testing.assert_array_equal(_f32(view.k_pages), _f32(k))
        np.testing.assert_array_equal(_f32(view.v_pages), _f32(v))


def _small_decode_first(dist):
    """_small's shapes, another composition: a decode sequence, then a chunk."""
    return _inputs([(1, 30), (5, 12)], (4, 2), 64, 16, jnp.float32, jnp.float32, 12, max_num_batched_tokens=16,
                   max_num_seq=4, distribution=dist, token_align=8)


@pytest.mark.slow
def test_engine_step_example_matches_float64():
    """examples/engine_step.py: tpu-inference's metadata over 9 steps of continuous batching, one
    compilation, every row within 1e-4 of float64."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    import engine_step
    steps, worst = engine_step.run(engine_step.Config(), check=True)
    assert steps >= 8 and worst < 1e-4
