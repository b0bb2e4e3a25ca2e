"""Where a mixed serving step's time goes (GPU): the step through BatchAttention, then its two
parts alone (the decode requests through BatchDecodeWithPagedKVCache, the chunks through
BatchPrefillWithPagedKVCache with each prefill kernel).

    PYTHONPATH=. python3 benchmarks/bench_mixed_parts.py [--trace]

--trace also prints each part's kernels (device µs per call, from a profiler trace).
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer as ji
from benchmarks.common import bench, kernel_times, random_paged_cache


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, nargs=3, default=(4, 512, 2048), metavar=("N", "NEW", "KV"),
                    help="N chunks of NEW tokens onto KV total keys")
    ap.add_argument("--decode", type=int, nargs=3, default=(60, 512, 4096), metavar=("N", "LO", "HI"),
                    help="N decode requests of kv U[LO, HI]")
    ap.add_argument("--trace", action="store_true", help="print each part's kernels from a profiler trace")
    args = ap.parse_args()
    hq, hkv, d, page = 32, 8, 128, 16
    rng = np.random.default_rng(0)
    (nc, new, kvc), (nd, lo, hi) = args.chunks, args.decode
    kv = np.concatenate([np.full(nc, kvc), rng.integers(lo, hi + 1, nd)])
    qo = np.concatenate([np.full(nc, new), np.ones(nd, np.int64)])
    cache, indptr, indices, last = random_paged_cache(rng, kv, page, hkv, d, jnp.bfloat16)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((int(qo_indptr[-1]), hq, d)), jnp.bfloat16)
    n = cache.num_pages
    rows, traced = [], []
    attn = ji.BatchAttention(hq, hkv, d, page)
    plan = attn.plan(qo_indptr, indptr, indices, last, num_pages=n)
    rows.append(("BatchAttention, whole step", plan.impl, bench(jax.jit(attn.run), q, cache, plan, iters=10)))
    traced.append(("BatchAttention, whole step", jax.jit(attn.run), (q, cache, plan)))
    # The decode requests alone.
    dec = ji.BatchDecodeWithPagedKVCache(hq, hkv, d, page)
    d_indptr = (indptr[nc:] - indptr[nc]).astype(np.int32)
    d_indices = indices[indptr[nc]:indptr[-1]]
    dplan = dec.plan(d_indptr, d_indices, last[nc:], num_pages=n)
    rows.append(("decode requests alone", dplan.impl, bench(jax.jit(dec.run), q[-nd:], cache, dplan, iters=10)))
    traced.append(("decode requests alone", jax.jit(dec.run), (q[-nd:], cache, dplan)))
    # The chunks alone, each prefill kernel.
    c_qo = qo_indptr[: nc + 1]
    for impl in ("auto", "triton", "mosaic"):
        pre = ji.BatchPrefillWithPagedKVCache(hq, hkv, d, page, impl=impl)
        pplan = pre.plan(c_qo, indptr[: nc + 1], indices[: indptr[nc]], last[:nc], num_pages=n)
        rows.append((f"chunks alone, impl={impl}", pplan.impl,
                     bench(jax.jit(pre.run), q[: c_qo[-1]], cache, pplan, iters=10)))
        if impl == "mosaic":
            traced.append((f"chunks alone, impl={impl}", jax.jit(pre.run), (q[: c_qo[-1]], cache, pplan)))
    for name, fn, fn_args in traced if args.trace else ():
        kernels, busy = kernel_times(fn, *fn_args)
        print(f"--- {name}: device busy {busy:.1f} us per call (traced)")
        for kernel, us in kernels:
            print(f"  {us:8.1f}  {kernel}")
    print(f"{'part':<32} {'kernels':<36} {'us':>8}")
    for name, impl, t in rows:
        print(f"{name:<32} {impl:<36} {t * 1e6:>8.1f}")


if __name__ == "__main__":
    main()
