"""Attention variants and fp8 KV on the GPU.

    PYTHONPATH=. python3 benchmarks/bench_variants.py [check] [prefill] [fp8]

check:   every built-in variant (and fp8 pages) through decode, paged prefill, ragged, BSR
         and the cascade, compiled, against jaxinfer.reference with the same variant.
prefill: ragged causal prefill, B 16, H 16, head_dim 128, S 1024 / 4096 / 16384, plain causal,
         soft-cap 30, ALiBi and sliding window 1024 (TFLOP/s; the window row counts only the
         window's FLOPs).
fp8:     decode (64, 4096), Hq 32, Hkv 8, page 16: bfloat16 pages against float8 e4m3 / e5m2.
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer as ji
from benchmarks.common import bench, random_paged_cache, record, rel_err, save
from jaxinfer import reference as ref
from jaxinfer import variants as V

D = 128


def builtins(hq):
    return {
        "soft_cap": (V.soft_cap(), {"logits_soft_cap": jnp.float32(30.0)}),
        "window": (V.sliding_window(), {"window_left": jnp.int32(100)}),
        "alibi": (V.alibi(), {"alibi_slopes": jnp.asarray(V.alibi_slopes(hq))}),
        "rope": (V.rope(), {"rope_theta": jnp.float32(5e5), "rope_scale": jnp.float32(1.0)}),
        "sigmoid": (V.sigmoid(), {"sigmoid_scale": jnp.float32(1.0), "sigmoid_bias": jnp.float32(-3.0)}),
        "sinks": (V.sinks(), {"sinks": jnp.linspace(-1.0, 2.0, hq, dtype=jnp.float32)}),
        "rope+soft_cap+window": (V.compose(V.rope(), V.soft_cap(), V.sliding_window()),
                                 {"rope_theta": jnp.float32(1e4), "rope_scale": jnp.float32(1.0),
                                  "logits_soft_cap": jnp.float32(30.0), "window_left": jnp.int32(300)}),
    }


def check():
    rng = np.random.default_rng(0)
    hq, hkv, page = 32, 8, 16
    lens = np.array([700, 1, 1500, 333, 64])
    qo = np.array([1, 1, 200, 77, 64])
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    cache, indptr, indices, last = random_paged_cache(rng, lens, page, hkv, D, jnp.bfloat16, extra_pages=4)
    q = jax.random.normal(jax.random.key(3), (len(lens), hq, D), jnp.bfloat16)
    qp = jax.random.normal(jax.random.key(4), (qo_indptr[-1], hq, D), jnp.bfloat16)
    for name, (var, params) in builtins(hq).items():
        dec = ji.BatchDecodeWithPagedKVCache(hq, hkv, D, page, variant=var)
        o = jax.jit(dec.run)(q, cache, dec.plan(indptr, indices, last), variant_params=params)
        want = ref.decode(q, cache, indptr, indices, last, variant=var, params=params)
        pre = ji.BatchPrefillWithPagedKVCache(hq, hkv, D, page, variant=var)
        op = jax.jit(pre.run)(qp, cache, pre.plan(qo_indptr, indptr, indices, last), variant_params=params)
        wp = ref.paged_attention(qp, cache, qo_indptr, indptr, indices, last, causal=True, variant=var,
                                 params=params)
        record("variant_check", variant=name, decode_rel_err=rel_err(o, want.o),
               prefill_rel_err=rel_err(op, wp.o))
    for fp8 in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        c8 = ji.PagedKVCache(cache.k_pages.astype(fp8), cache.v_pages.astype(fp8))
        ks, vs = jnp.linspace(0.5, 1.5, hkv), jnp.float32(0.75)
        dec = ji.BatchDecodeWithPagedKVCache(hq, hkv, D, page)
        o = jax.jit(dec.run)(q, c8, dec.plan(indptr, indices, last), k_scale=ks, v_scale=vs)
        want = ref.decode(q, c8, indptr, indices, last, k_scale=ks, v_scale=vs)
        pre = ji.BatchPrefillWithPagedKVCache(hq, hkv, D, page)
        op = jax.jit(pre.run)(qp, c8, pre.plan(qo_indptr, indptr, indices, last), k_scale=ks, v_scale=vs)
        wp = ref.paged_attention(qp, c8, qo_indptr, indptr, indices, last, causal=True, k_scale=ks, v_scale=vs)
        record("fp8_check", dtype=jnp.dtype(fp8).name, decode_rel_err=rel_err(o, want.o),
               prefill_rel_err=rel_err(op, wp.o))


def window_pairs(S, w):
    """Visible (query, key) pairs of causal attention with window_left w, per head."""
    i = np.arange(S)
    return int(np.minimum(i + 1, w + 1).sum())


def _soft_cap_exp(params, s, qo_pos, kv_pos, qo_head):
    """cap * tanh(s / cap) as cap - 2 cap / (exp(2 s / cap) + 1): one exp2 instead of tanh."""
    cap = params["logits_soft_cap"]
    return cap - 2.0 * cap / (jnp.exp2(s * (2.0 * 1.4426950408889634 / cap)) + 1.0)


PREFILL_ROWS = {
    "causal": (None, None, {}),
    "soft_cap": (V.soft_cap(), {"logits_soft_cap": jnp.float32(30.0)}, {}),
    "alibi": (V.alibi(), {"alibi_slopes": jnp.asarray(V.alibi_slopes(16))}, {}),
    "window": (V.sliding_window(), {"window_left": jnp.int32(1024)}, {"window_left": 1024}),
}
TUNE_ROWS = {
    "soft_cap_exp": (V.AttentionVariant(logits_transform=_soft_cap_exp, param_names=("logits_soft_cap",)),
                     {"logits_soft_cap": jnp.float32(30.0)}, {}),
    "window_unplanned": (V.sliding_window(), {"window_left": jnp.int32(1024)}, {}),
}


def prefill(seqs=(1024, 4096, 16384), rows=PREFILL_ROWS):
    B, H = 16, 16
    for S in seqs:
        indptr = (np.arange(B + 1) * S).astype(np.int32)
        q = jax.random.normal(jax.random.key(0), (B * S, H, D), jnp.bfloat16)
        k = jax.random.normal(jax.random.key(1), (B * S, H, D), jnp.bfloat16)
        v = jax.random.normal(jax.random.key(2), (B * S, H, D), jnp.bfloat16)
        for name, (var, params, plan_kw) in rows.items():
            pre = ji.BatchPrefillWithRaggedKVCache(H, H, D, causal=True, variant=var)
            plan = pre.plan(indptr, indptr, **plan_kw)
            run = jax.jit(lambda q, k, v, p, vp: pre.run(q, k, v, p, variant_params=vp))
            n = 256  # check the last 256 queries of request 0 against the reference
            got = run(q, k, v, plan, params)[S - n:S]
            want = ref.attention(q[S - n:S], k[:S], v[:S], causal=True, variant=var, params=params).o
            t = bench(run, q, k, v, plan, params, iters=3, reps=5)
            pairs = window_pairs(S, 1024) if name.startswith("window") else S * (S + 1) // 2
            record("variant_prefill", variant=name, B=B, S=S, H=H, us=t * 1e6,
                   TFLOPs=4 * B * H * D * pairs / t / 1e12, rel_err=rel_err(got, want))


def fp8(options=({}, {"block_kv": 256}, {"num_stages": 4}, {"block_kv": 256, "num_stages": 4})):
    B, S, hq, hkv, page = 64, 4096, 32, 8, 16
    rng = np.random.default_rng(0)
    cache, indptr, indices, last = random_paged_cache(rng, np.full(B, S), page, hkv, D, jnp.bfloat16)
    qs = jax.random.normal(jax.random.key(5), (10, B, hq, D), jnp.bfloat16)  # 10 distinct calls
    q = qs[0]
    base = None
    for dtype in (jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2):
        c = cache if dtype == jnp.bfloat16 else ji.PagedKVCache(cache.k_pages.astype(dtype),
                                                                cache.v_pages.astype(dtype))
        want = ref.decode(q[:4], c, indptr[:5], indices, last[:4], k_scale=0.9, v_scale=1.1).o
        for opts in options if dtype != jnp.bfloat16 else ({},):
            dec = ji.BatchDecodeWithPagedKVCache(hq, hkv, D, page, **opts)
            plan = dec.plan(indptr, indices, last)
            run = jax.jit(lambda qs, c, p: [dec.run(qs[i], c, p, k_scale=0.9, v_scale=1.1) for i in range(10)])
            err = rel_err(run(qs, c, plan)[0][:4], want)
            t = bench(run, qs, c, plan) / 10
            base = t if base is None else base
            nbytes = c.k_pages.size * c.k_pages.dtype.itemsize * 2
            record("fp8_decode", dtype=jnp.dtype(dtype).name, opts=opts, B=B, S=S, us=t * 1e6,
                   GBps=nbytes / t / 1e9, speedup_vs_bf16=base / t, rel_err=err)


def softcap():
    """The built-in soft-cap against the causal baseline."""
    prefill(seqs=(4096, 16384), rows={k: PREFILL_ROWS[k] for k in ("causal", "soft_cap")})


def tune():
    """Candidates: tanh as exp2, window without the plan hint, fp8 kernel options."""
    prefill(seqs=(4096,), rows={k: PREFILL_ROWS[k] for k in ("soft_cap", "window")} | TUNE_ROWS)
    fp8(options=({}, {"num_warps": 8}, {"num_warps": 8, "block_kv": 256}, {"block_kv": 64}))


def main():
    stages = sys.argv[1:] or ["check", "prefill", "fp8"]
    print("jax", jax.__version__, jax.devices(), flush=True)
    for stage in stages:
        {"check": check, "prefill": prefill, "fp8": fp8, "tune": tune, "softcap": softcap}[stage]()
        save("variants_" + stage)


if __name__ == "__main__":
    main()
