"""Split-KV choices for the decode kernel at end-to-end-like lengths: µs per call of run()
(decode kernel + merge) for the default plan, no split, 132 CTAs and a fixed 64-page chunk.

    PYTHONPATH=. python3 benchmarks/bench_split.py

Each variant is checked against a dense reference first, then timed as 9 independent calls in
one jitted program (each its own q, three caches rotated). In a CUDA graph independent calls
can overlap, so rows that do not fill the GPU read as throughput rather than latency.
"""
import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer as ji
from benchmarks.common import bench, dense_decode_reference, random_paged_cache, rel_err

HQ, HKV, D, PAGE = 32, 8, 128, 16
CALLS = 9
VARIANTS = {"default": {}, "no split": {"fixed_split_pages": 100000}, "132 CTAs": {"num_ctas": 132},
            "chunk 64 pages": {"fixed_split_pages": 64}}


def main():
    rng = np.random.default_rng(0)
    cases = {
        "B16 U[512, 2048] + 64 (e2e)": rng.integers(512, 2049, 16) + 64,
        "B16 kv1024": np.full(16, 1024),
        "B1 kv1819": np.array([1819]),
        "B4 U[512, 2048] + 64": rng.integers(512, 2049, 4) + 64,
        "B64 U[512, 2048] + 64": rng.integers(512, 2049, 64) + 64,
    }
    for name, lens in cases.items():
        cache, indptr, indices, last = random_paged_cache(rng, lens, PAGE, HKV, D, jnp.bfloat16)
        caches = [cache] + [ji.PagedKVCache(cache.k_pages[::-1] * s, cache.v_pages[::-1] * s) for s in (1, -1)]
        qs = [jax.random.normal(jax.random.key(10 + i), (len(lens), HQ, D), jnp.bfloat16) for i in range(CALLS)]
        want = dense_decode_reference(qs[0], cache, indptr, indices, lens, D ** -0.5)
        cols = []
        for vname, opts in VARIANTS.items():
            dec = ji.BatchDecodeWithPagedKVCache(HQ, HKV, D, PAGE, **opts)
            plan = dec.plan(indptr, indices, last, num_pages=cache.num_pages)
            err = rel_err(jax.jit(dec.run)(qs[0], cache, plan), want)
            calls = jax.jit(lambda qs, cs, p: [dec.run(qs[i], cs[i % 3], p) for i in range(CALLS)])
            us = np.median([bench(calls, qs, caches, plan) / CALLS * 1e6 for _ in range(3)])
            cols.append(f"{vname} {us:.1f} (rel_err {err:.1e}, {plan.info['num_split']} split)")
        print(f"{name}: " + "; ".join(cols), flush=True)


if __name__ == "__main__":
    main()
