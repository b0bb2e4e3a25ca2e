"""The GPU kernels of ragged_paged_attention and BatchAttention on bench_rpa.py's rows: one run of
a jitted program of CALLS calls (as regress.py times them; ragged_paged_attention's calls thread
the cache, donated), traced with torch.profiler, whose CUPTI trace sees XLA's kernels too.

    PYTHONPATH=. python3 benchmarks/kernel_trace.py [--rows decode,q4] [--impl auto] [--timeline]

For each row and call: the kernels grouped by name (XLA numbers its fusions: loop_select_fusion_3
counts as loop_select_fusion; a wrapper's two launches of one kernel keep their names, e.g.
jaxinfer_paged_decode and jaxinfer_paged_decode__1), their count and GPU time, and the program's span per call. XLA
computes what depends on the metadata alone once for all calls of a program (the device plan),
so the per-call kernels are the ones counted CALLS times. --timeline also prints every kernel
(start and duration in µs, name). Traces go to $OUT (or /tmp) as Chrome JSON.
"""
import argparse
import collections
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer as ji
from benchmarks.bench_rpa import CALLS, D, HKV, HQ, PAGE, rows
from benchmarks.common import random_paged_cache, rpa_inputs


def trace(fn, args, path):
    """Kernels (start µs from the first, duration µs, name) of one call of fn(*args) after two warm-ups."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        jax.block_until_ready(fn(*args))
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = sorted((e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    t0 = events[0]["ts"] if events else 0.0
    return [(e["ts"] - t0, e["dur"], e["name"]) for e in events]


def summary(label, kernels, timeline):
    span = kernels[-1][0] + kernels[-1][1] if kernels else 0.0
    print(f"== {label}: {len(kernels)} kernels, span {span:.1f} µs ({span / CALLS:.1f} per call)")
    if timeline:
        for start, dur, name in kernels:
            print(f"{start:9.1f} {dur:8.2f}  {name[:100]}")
    groups = collections.defaultdict(list)
    for _, dur, name in kernels:
        groups[(re.sub(r"_\d+$", "", name) if "fusion" in name else name)[:60]].append(dur)
    print(f"{'kernel':62s} {'count':>5s} {'µs':>9s}")
    for name, durs in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        print(f"{name:62s} {len(durs):5d} {sum(durs):9.1f}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="decode,q4", help="name prefixes of bench_rpa.py's rows")
    parser.add_argument("--impl", default="auto", help="ragged_paged_attention's impl")
    parser.add_argument("--timeline", action="store_true", help="print every kernel too")
    args = parser.parse_args()
    out = os.environ.get("OUT", "/tmp")
    wanted = args.rows.split(",")
    rng = np.random.default_rng(0)
    for name, q_lens, kv_lens in rows(rng):
        if not any(name.startswith(w) for w in wanted):
            continue
        cache, indptr, indices, last = random_paged_cache(rng, kv_lens, PAGE, HKV, D, jnp.bfloat16)
        qo_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        qs = jax.random.normal(jax.random.key(2), (CALLS, int(qo_indptr[-1]), HQ, D), jnp.bfloat16)
        keys, values, meta = rpa_inputs(cache, q_lens, kv_lens, indptr, indices, PAGE)
        attn = ji.BatchAttention(HQ, HKV, D, PAGE)
        plan = attn.plan(qo_indptr, indptr, indices, last, num_pages=cache.num_pages)
        tag = re.sub(r"\W+", "_", name)
        summary(f"{name}: BatchAttention ({plan.impl})",
                trace(jax.jit(lambda qs, c, p: [attn.run(qs[i], c, p) for i in range(CALLS)]), (qs, cache, plan),
                      f"{out}/trace_ba_{tag}.json"), args.timeline)

        def many(qs, cache, *meta):
            outs = []
            for i in range(CALLS):
                o, cache = ji.ragged_paged_attention(qs[i], keys, values, cache, *meta, impl=args.impl)
                outs.append(o)
            return outs, cache

        step = jax.jit(many, donate_argnums=(1,))
        state = {"cache": cache}

        def threaded(qs, *meta):  # each run donates the cache the last one returned
            outs, state["cache"] = step(qs, state["cache"], *meta)
            return outs

        summary(f"{name}: ragged_paged_attention (impl={args.impl})",
                trace(threaded, (qs,) + tuple(meta), f"{out}/trace_rpa_{tag}.json"), args.timeline)


if __name__ == "__main__":
    main()
