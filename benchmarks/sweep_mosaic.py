"""Mosaic GPU prefill tuning sweep (GPU): MosaicPrefillConfigs on causal ragged prefill at one
head_dim, each checked against the float32 reference first.

    PYTHONPATH=. python3 benchmarks/sweep_mosaic.py --head-dim 64 --heads 32 8
    PYTHONPATH=. python3 benchmarks/sweep_mosaic.py --config pipeline=free,compute_wgs=3,tree_max=1 --config ''
"""
import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer as ji
from benchmarks.common import bench, rel_err


def parse_config(text):
    """'block_kv=64,pipeline=overlap' -> MosaicPrefillConfig (typed by the dataclass's fields)."""
    types = {f.name: f.type for f in dataclasses.fields(ji.MosaicPrefillConfig)}
    kw = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=")
        kind = types[key]
        kw[key] = value if kind in (str, "str") else bool(int(value)) if kind in (bool, "bool") else int(value)
    return ji.MosaicPrefillConfig(**kw)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dim", type=int, default=64, help="head_dim of q, K and V")
    ap.add_argument("--heads", type=int, nargs=2, default=(32, 8), metavar=("HQ", "HKV"), help="head counts")
    ap.add_argument("--batch", type=int, default=4, help="requests")
    ap.add_argument("--seq", type=int, default=8192, help="tokens per request (query = key length)")
    ap.add_argument("--config", action="append",
                    help="a MosaicPrefillConfig as field=value,... ('' for the defaults); repeatable. "
                         "Without it: the --block-kv x --steps grid")
    ap.add_argument("--block-kv", type=int, nargs="+", default=(64, 128, 256), help="K/V block sizes to try")
    ap.add_argument("--steps", type=int, nargs="+", default=(2, 3, 4), help="max_concurrent_steps values to try")
    args = ap.parse_args()
    (hq, hkv), d, b, s = args.heads, args.head_dim, args.batch, args.seq
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((b * s, hq, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((b * s, hkv, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((b * s, hkv, d)), jnp.bfloat16)
    indptr = (np.arange(b + 1) * s).astype(np.int32)
    want = ji.reference.attention(q[:512].astype(jnp.float32), k[:512].astype(jnp.float32),
                                  v[:512].astype(jnp.float32), causal=True).o
    flops = 4.0 * b * hq * d * s * (s + 1) / 2  # causal pairs, as regress.py counts them
    configs = ([parse_config(c) for c in args.config] if args.config else
               [ji.MosaicPrefillConfig(block_kv=bk, max_concurrent_steps=st) for bk in args.block_kv
                for st in args.steps])
    print(f"{'us':>9} {'TFLOP/s':>8} {'rel_err':>8}  config", flush=True)
    for cfg in configs:
        try:
            pre = ji.BatchPrefillWithRaggedKVCache(hq, hkv, d, impl="mosaic", config=cfg)
            plan = pre.plan(indptr, indptr)
            fn = jax.jit(pre.run)
            o = fn(q, k, v, plan)
            # request 0's first 512 queries see only its first 512 keys
            err = rel_err(np.asarray(o[:512], np.float32), np.asarray(want))
            t = bench(fn, q, k, v, plan, iters=10, reps=9)
            print(f"{t * 1e6:>9.1f} {flops / t / 1e12:>8.1f} {err:>8.1e}  {cfg}", flush=True)
        except Exception as e:  # a config that does not fit shared memory
            print(f"failed: {str(e).splitlines()[0][:90]}  {cfg}", flush=True)


if __name__ == "__main__":
    main()
