"""Causal batch prefill on the GPU: TFLOP/s (causal FLOPs = 2 B Hq S^2 D) for paged and ragged KV.

    PYTHONPATH=. python3 benchmarks/bench_prefill.py [--sweep] [--impl triton,mosaic]
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer as ji
from benchmarks.common import bench, random_paged_cache, record, rel_err, save

D, PAGE = 128, 16
ROWS = [(16, 4096, 16, 16), (4, 8192, 32, 8), (1, 16384, 32, 8)]  # (B, S, Hq, Hkv)


def causal_check(q, k, v, S, sm_scale, n_rows=256):
    """float32 causal attention of request 0's last n_rows queries (a slice keeps it small)."""
    hq, hkv = q.shape[1], k.shape[1]
    qs = q[S - n_rows:S].astype(jnp.float32).reshape(n_rows, hkv, hq // hkv, D)
    s = jnp.einsum("qhgd,khd->hgqk", qs, k[:S].astype(jnp.float32), precision="highest") * sm_scale
    s = jnp.where(jnp.arange(S)[None, :] <= jnp.arange(S - n_rows, S)[:, None], s, -jnp.inf)
    o = jnp.einsum("hgqk,khd->qhgd", jax.nn.softmax(s, -1), v[:S].astype(jnp.float32), precision="highest")
    return o.reshape(n_rows, hq, D)


def run_row(B, S, hq, hkv, variants, kinds=("paged", "ragged"), check=True):
    flops = 2 * B * hq * S * S * D
    lens = np.full(B, S)
    qo_indptr = (np.arange(B + 1) * S).astype(np.int32)
    q = jax.random.normal(jax.random.key(0), (B * S, hq, D), jnp.bfloat16)
    for kind in kinds:
        if kind == "paged":
            cache, indptr, indices, last = random_paged_cache(np.random.default_rng(0), lens, PAGE, hkv, D,
                                                              jnp.bfloat16)
            k0, v0, _ = ji.reference.gather_pages(cache, indptr[:2], indices, last[:1])
        else:
            k = jax.random.normal(jax.random.key(1), (B * S, hkv, D), jnp.bfloat16)
            v = jax.random.normal(jax.random.key(2), (B * S, hkv, D), jnp.bfloat16)
            k0, v0 = k[:S], v[:S]
        for opts in variants:
            if kind == "paged":
                pre = ji.BatchPrefillWithPagedKVCache(hq, hkv, D, PAGE, causal=True, **opts)
                plan = pre.plan(qo_indptr, indptr, indices, last, num_pages=cache.num_pages)
                args = (q, cache, plan)
            else:
                pre = ji.BatchPrefillWithRaggedKVCache(hq, hkv, D, causal=True, **opts)
                plan = pre.plan(qo_indptr, qo_indptr)
                args = (q, k, v, plan)
            run = jax.jit(pre.run)
            err = None
            if check:
                err = rel_err(run(*args)[S - 256:S], causal_check(q, k0, v0, S, pre.sm_scale))
            t = bench(run, *args, iters=3, reps=5)
            record("jaxinfer_prefill", kind=kind, B=B, S=S, Hq=hq, Hkv=hkv, opts=opts, us=t * 1e6,
                   TFLOPs=flops / t / 1e12, rel_err=err, rows=plan.layout.rows, items=plan.info["num_items"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="vary kernel options on the first row (paged)")
    ap.add_argument("--impl", default="triton", help="kernel implementations to run, comma-separated")
    args = ap.parse_args()
    print("jax", jax.__version__, jax.devices(), flush=True)
    if args.sweep:
        sweep = [{}, dict(num_stages=2), dict(num_stages=3), dict(num_warps=8)]
        run_row(*ROWS[0], sweep, check=False)
        save("prefill_sweep")
        return
    impls = [{} if impl == "triton" else {"impl": impl} for impl in args.impl.split(",")]
    for row in ROWS:
        run_row(*row, impls)
    save("prefill")


if __name__ == "__main__":
    main()
