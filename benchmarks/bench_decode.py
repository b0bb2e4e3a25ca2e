"""Batch decode on the GPU: µs and GB/s (KV bytes read / time) against the issue's anchors.

    PYTHONPATH=. python3 benchmarks/bench_decode.py [--variants]
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer as ji
from benchmarks.common import bench, dense_decode_reference, random_paged_cache, record, rel_err, save
from benchmarks.decode_configs import D, HKV, HQ, PAGE, decode_rows
from pallas_kernels import decode as decode_kernels
from planner import work_items

CALLS = 10


def _kernel_only(dec, q, cache, plan):
    """The decode kernel alone, without the split-KV merge."""
    sec = plan.sections()
    k_rows, v_rows = cache.rows()
    return decode_kernels.paged_decode(
        q, k_rows, v_rows, sec["kv_indices"], sec["kv_lens"], sec["items"], sec["cell_indptr"],
        num_parts=plan.layout.part_cap, page_size=PAGE, num_kv_heads=HKV, layout="NHD",
        sm_scale=dec.sm_scale, interpret=False, columns=work_items.DECODE)


def run_config(rng, name, kv_lens, variants, check=True):
    cache, indptr, indices, last = random_paged_cache(rng, kv_lens, PAGE, HKV, D, jnp.bfloat16)
    q = jax.random.normal(jax.random.key(1), (len(kv_lens), HQ, D), jnp.bfloat16)
    kv_bytes = 2 * int(np.sum(kv_lens)) * HKV * D * 2
    for opts in variants:
        dec = ji.BatchDecodeWithPagedKVCache(HQ, HKV, D, PAGE, **opts)
        plan = dec.plan(indptr, indices, last, num_pages=cache.num_pages)
        err = None
        if check:
            o = jax.jit(dec.run)(q, cache, plan)
            want = dense_decode_reference(q, cache, indptr, indices, kv_lens, dec.sm_scale)
            err = rel_err(o, want)
        # CALLS independent calls in one program, so host dispatch does not hide GPU time.
        qs = jax.random.normal(jax.random.key(2), (CALLS,) + q.shape, q.dtype)
        t = bench(jax.jit(lambda qs, c, p: [dec.run(qs[i], c, p) for i in range(CALLS)]),
                  qs, cache, plan) / CALLS
        t_kernel = bench(jax.jit(lambda qs, c, p: [_kernel_only(dec, qs[i], c, p) for i in range(CALLS)]),
                         qs, cache, plan) / CALLS
        record("jaxinfer_decode", config=name, opts=opts, us=t * 1e6, GBps=kv_bytes / t / 1e9,
               kernel_us=t_kernel * 1e6, rel_err=err, chunk_pages=plan.info["chunk_pages"], items=plan.info["num_items"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true",
                    help="vary one kernel option at a time on B64 kv4096, B16 kv1024, B1 kv32768")
    args = ap.parse_args()
    print("jax", jax.__version__, jax.devices(), flush=True)
    rng = np.random.default_rng(0)
    if args.sweep:
        sweep = [{}, dict(block_kv=64), dict(num_stages=2), dict(num_stages=4), dict(num_warps=2),
                 dict(num_ctas=132), dict(num_ctas=528)]
        for name, lens in decode_rows():
            if name in ("B64 kv4096", "B16 kv1024", "B1 kv32768"):
                run_config(rng, name, lens, sweep, check=False)
        save("decode_sweep")
        return
    for name, lens in decode_rows():
        run_config(rng, name, lens, [{}])
    save("decode")


if __name__ == "__main__":
    main()
