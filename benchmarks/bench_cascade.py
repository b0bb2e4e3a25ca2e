"""Shared-prefix decode on the GPU: single format vs two-level cascade vs cascade="auto".

    PYTHONPATH=. python3 benchmarks/bench_cascade.py [--small]   # --small: a CPU smoke run

bfloat16, Hq 32, Hkv 8, head_dim 128, page 16, unique suffix 128 tokens per request.
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer as ji
from benchmarks.common import bench, dense_decode_reference, record, rel_err, save

HQ, HKV, D, PAGE, SUFFIX = 32, 8, 128, 16, 128


def shared_prefix_batch(rng, batch, prefix):
    """All requests share `prefix` tokens of pages, then own SUFFIX tokens; random page order."""
    pre, suf = prefix // PAGE, SUFFIX // PAGE
    num_pages = pre + batch * suf
    perm = rng.permutation(num_pages).astype(np.int32)
    lists = [np.concatenate([perm[:pre], perm[pre + b * suf: pre + (b + 1) * suf]]) for b in range(batch)]
    indptr = (np.arange(batch + 1) * (pre + suf)).astype(np.int32)
    last = np.full(batch, PAGE, np.int32)
    key = jax.random.key(int(rng.integers(1 << 30)))
    k1, k2 = jax.random.split(key)
    shape = (num_pages, PAGE, HKV, D)
    cache = ji.PagedKVCache(jax.random.normal(k1, shape, jnp.bfloat16), jax.random.normal(k2, shape, jnp.bfloat16))
    return cache, indptr, np.concatenate(lists), last


def run_row(rng, batch, prefix, calls, explicit=True):
    """calls: independent calls per jitted program, so host dispatch does not hide GPU time."""
    cache, indptr, indices, last = shared_prefix_batch(rng, batch, prefix)
    q = jax.random.normal(jax.random.key(1), (batch, HQ, D), jnp.bfloat16)
    qs = jax.random.normal(jax.random.key(2), (calls, batch, HQ, D), jnp.bfloat16)
    dec = ji.BatchDecodeWithPagedKVCache(HQ, HKV, D, PAGE)
    want = dense_decode_reference(q, cache, indptr, indices, np.full(batch, prefix + SUFFIX), dec.sm_scale)
    times = {}
    for name, cascade in (("single", None), ("auto", "auto")):
        plan = dec.plan(indptr, indices, last, num_pages=cache.num_pages, cascade=cascade)
        err = rel_err(jax.jit(dec.run)(q, cache, plan), want)
        f = jax.jit(lambda qs, c, p: [dec.run(qs[i], c, p) for i in range(calls)])
        times[name] = bench(f, qs, cache, plan) / calls
        record("jaxinfer_shared_prefix_decode", B=batch, prefix=prefix, mode=name,
               plan=type(plan).__name__, us=times[name] * 1e6, rel_err=err)
    if not explicit:
        return
    levels, _ = ji.two_level_cascade(np.arange(batch + 1, dtype=np.int32), indptr, indices, last, PAGE,
                                     causal=False)
    cas = ji.MultiLevelCascadeAttention(2, HQ, HKV, D, PAGE, causal=False)
    plan = cas.plan(levels, num_pages=cache.num_pages)
    err = rel_err(jax.jit(cas.run)(q, cache, plan), want)
    f = jax.jit(lambda qs, c, p: [cas.run(qs[i], c, p) for i in range(calls)])
    t = bench(f, qs, cache, plan) / calls
    record("jaxinfer_shared_prefix_decode", B=batch, prefix=prefix, mode="cascade", us=t * 1e6,
           speedup=times["single"] / t, rel_err=err)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="tiny sizes (a CPU smoke run)")
    ap.add_argument("--auto-rows", action="store_true",
                    help="short prefixes, where cascade='auto' should keep single format")
    args = ap.parse_args()
    print("jax", jax.__version__, jax.devices(), flush=True)
    rng = np.random.default_rng(0)
    if args.auto_rows:
        for batch, prefix in [(64, 16), (64, 128), (16, 512), (64, 1024), (8, 2048)]:
            run_row(rng, batch, prefix, calls=10, explicit=False)
        save("cascade_auto")
        return
    rows = [(4, 256)] if args.small else [(16, 8192), (64, 8192), (64, 32768)]
    for batch, prefix in rows:
        run_row(rng, batch, prefix, calls=1 if args.small else 10)
    save("cascade")


if __name__ == "__main__":
    main()
