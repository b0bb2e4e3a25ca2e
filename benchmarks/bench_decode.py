"""Batch decode on the GPU: µs and GB/s (KV bytes read / time) against the issue's anchors.

    PYTHONPATH=. python3 benchmarks/bench_decode.py [--variants]
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer as ji
from benchmarks.common import bench, random_paged_cache, record, rel_err, save
from jaxinfer import reference as ref

HQ, HKV, D, PAGE = 32, 8, 128, 16


def configs(rng):
    """(name, kv_lens) for the issue's rows."""
    zipf = np.minimum(rng.zipf(1.5, 16) * 200, 16384)
    zipf = np.maximum((zipf * 1024 / zipf.mean()).astype(int), 1)
    return [
        ("B64 kv4096", np.full(64, 4096)),
        ("B128 kv2048", np.full(128, 2048)),
        ("B16 kv1024", np.full(16, 1024)),
        ("B1 kv32768", np.full(1, 32768)),
        ("B16 U[512,1024]", rng.integers(512, 1025, 16)),
        ("B16 zipf mean1024", zipf),
        ("B64 U[512,4096]", rng.integers(512, 4097, 64)),
    ]


def run_config(rng, name, kv_lens, variants, check=True):
    cache, indptr, indices, last = random_paged_cache(rng, kv_lens, PAGE, HKV, D, jnp.bfloat16)
    q = jax.random.normal(jax.random.key(1), (len(kv_lens), HQ, D), jnp.bfloat16)
    kv_bytes = 2 * int(np.sum(kv_lens)) * HKV * D * 2
    for opts in variants:
        dec = ji.BatchDecodeWithPagedKVCache(HQ, HKV, D, PAGE, **opts)
        plan = dec.plan(indptr, indices, last, num_pages=cache.num_pages)
        run = jax.jit(dec.run)
        err = None
        if check:
            o = run(q, cache, plan)
            want = ref.decode(q, cache, indptr, indices, last).o
            err = rel_err(o, want)
        t = bench(run, q, cache, plan)
        record("jaxinfer_decode", config=name, opts=opts, us=t * 1e6, GBps=kv_bytes / t / 1e9,
               rel_err=err, chunk_pages=plan.info["chunk_pages"], items=plan.info["num_items"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", action="store_true", help="sweep kernel options on the fixed rows")
    args = ap.parse_args()
    print("jax", jax.__version__, jax.devices(), flush=True)
    rng = np.random.default_rng(0)
    default = [{}]
    sweep = [dict(block_kv=bk, num_warps=w, num_stages=s, num_ctas=c)
             for bk in (64, 128) for w in (4, 8) for s in (2, 3) for c in (132, 264, 528)]
    for i, (name, lens) in enumerate(configs(rng)):
        run_config(rng, name, lens, sweep if (args.variants and i < 4) else default)
    save("decode")


if __name__ == "__main__":
    main()
