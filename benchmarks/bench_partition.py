"""The decode planner's two partitions (planner/decode.py: Algorithm 1's "greedy" and
"contiguous" cells) at serving-like lengths: µs per call of run() (decode kernel + merge).

    PYTHONPATH=. python3 benchmarks/bench_partition.py

Calls are chained as a model's layers are (call i + 1's q is call i's o), 8 calls in one jitted
program, each over its own cache (8 caches: K/V come from HBM, not L2), so a call's time is its
latency. Each partition is checked against a dense float32 reference first. The two are timed
in turn, then again in reverse order (drift falls on both); "auto" is what the wrappers use.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer as ji
from benchmarks.common import dense_decode_reference, per_call_us, random_paged_cache, rel_err
from planner import decode as decode_planner

HQ, HKV, D, PAGE, LAYERS = 32, 8, 128, 16, 8
PARTITIONS = ("greedy", "auto")


def plan_with(partition, dec, *args, **kw):
    """dec.plan(*args, **kw) with the planner's partition set (the wrappers plan with "auto")."""
    checked = decode_planner.plan_decode_checked
    decode_planner.plan_decode_checked = functools.partial(checked, partition=partition)
    try:
        return dec.plan(*args, **kw)
    finally:
        decode_planner.plan_decode_checked = checked


def main():
    rng = np.random.default_rng(0)
    serving = lambda seed, b, extra=64: np.random.default_rng(seed).integers(512, 2049, b) + extra
    cases = {"B16 U[512,2048]+64 s0": serving(0, 16), "B16 U[512,2048]+64 s1": serving(1, 16),
             "B16 U[512,2048]+128": serving(5, 16, 128), "B16 kv1024": np.full(16, 1024),
             "B1 kv1819": np.array([1819]), "B4 U[512,2048]+64": serving(2, 4), "B8 U[512,2048]+64": serving(3, 8),
             "B32 U[512,2048]+64": serving(4, 32), "B64 U[512,2048]+64": serving(6, 64),
             "B64 kv4096": np.full(64, 4096), "B1 kv32768": np.array([32768])}
    for name, lens in cases.items():
        cache, indptr, indices, last = random_paged_cache(rng, lens, PAGE, HKV, D, jnp.bfloat16)
        caches = [ji.PagedKVCache(cache.k_pages * (1 - 2 * (i % 2)), cache.v_pages + 0) for i in range(LAYERS)]
        q = jax.random.normal(jax.random.key(1), (len(lens), HQ, D), jnp.bfloat16)
        want = dense_decode_reference(q, cache, indptr, indices, lens, D ** -0.5)
        steps, used = {}, {}
        for partition in PARTITIONS:
            dec = ji.BatchDecodeWithPagedKVCache(HQ, HKV, D, PAGE)
            plan = plan_with(partition, dec, indptr, indices, last, num_pages=cache.num_pages)
            used[partition] = f"{plan.info['partition']}, {plan.info['num_items']} items"
            err = rel_err(jax.jit(dec.run)(q, cache, plan), want)
            if not err < 2e-2:
                raise AssertionError(f"{name} {partition}: rel_err {err:.2e}")

            def chained(q, caches, plan, dec=dec):
                for c in caches:
                    q = dec.run(q, c, plan)
                return q
            fn = jax.jit(chained)
            steps[partition] = lambda fn=fn, plan=plan: fn(q, caches, plan)
        us = {p: [per_call_us(steps[p], LAYERS)] for p in PARTITIONS}
        for p in reversed(PARTITIONS):
            us[p].append(per_call_us(steps[p], LAYERS))
        print(f"{name:<24} " + "  ".join(f"{p} ({used[p]}): {a:.1f} / {b:.1f}" for p, (a, b) in us.items()),
              flush=True)


if __name__ == "__main__":
    main()
