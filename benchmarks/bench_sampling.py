"""Sampling on the GPU: jaxinfer.sampling against the JAX baselines and FlashInfer 0.5.3.

    PYTHONPATH=. python3 benchmarks/bench_sampling.py            # H100 rows (FlashInfer if importable)
    PYTHONPATH=. python3 benchmarks/bench_sampling.py --smoke    # tiny shapes, CPU interpret mode

float32 logits ~ 3 N(0, 1) and their softmax, rows B x V in {1, 64, 256} x 128256 and 64 x 32000.
Ops: top-k 50 + top-p 0.9 from logits (top_k_first and joint), top-p 0.9 / top-k 50 / min-p 0.1
from probs, plain sampling from logits. JAX baselines (as ../shared/anchors/anchors_sampling.py):
sort + top-k + top-p + categorical; lax.top_k(50) + top-p + categorical; 32-step bisection top-p.
FlashInfer runs through torch on the same data when `import flashinfer` works (see
../shared/anchors/README.md), and is skipped otherwise.

First a distribution check per op (many draws of one row through `indices`: every draw kept by
the reference, and the drawn mass of the reference's top tokens within 5 sigma of theirs), then
medians over repeats (benchmarks.common.bench) of programs of CALLS draws each (µs per draw), then
a markdown table. FlashInfer's calls are timed one by one with CUDA events (eager torch).
"""
import argparse
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import bench, record, save
from jaxinfer import sampling as S

SHAPES = [(1, 128256), (64, 128256), (256, 128256), (64, 32000)]
CONFIG = S.SamplingConfig()  # --block-v, --num-warps, --track, --band, ... replace its fields
SMOKE_SHAPES = [(3, 1000)]
K, P, MIN_P = 50, 0.9, 0.1

# name: (input, jaxinfer call, reference filters, FlashInfer call name and arguments)
OPS = {
    "top-k 50 + top-p 0.9 from logits": (
        "logits", lambda x, key, idx=None: S.top_k_top_p_sampling_from_logits(x, K, P, idx, key=key,
                                                                                config=CONFIG),
        dict(from_logits=True, top_k=K, top_p=P, filter_apply_order="top_k_first"),
        ("top_k_top_p_sampling_from_logits", (K, P))),
    "top-k 50 + top-p 0.9 from logits, joint": (
        "logits", lambda x, key, idx=None: S.top_k_top_p_sampling_from_logits(x, K, P, idx, "joint", key=key,
                                                                                config=CONFIG),
        dict(from_logits=True, top_k=K, top_p=P, filter_apply_order="joint"), None),
    "top-p 0.9 from probs": (
        "probs", lambda x, key, idx=None: S.top_p_sampling_from_probs(x, P, idx, key=key, config=CONFIG),
        dict(from_logits=False, top_p=P), ("top_p_sampling_from_probs", (P,))),
    "min-p 0.1 from probs": (
        "probs", lambda x, key, idx=None: S.min_p_sampling_from_probs(x, MIN_P, idx, key=key, config=CONFIG),
        dict(from_logits=False, min_p=MIN_P), ("min_p_sampling_from_probs", (MIN_P,))),
    "top-k 50 from probs": (
        "probs", lambda x, key, idx=None: S.top_k_sampling_from_probs(x, K, idx, key=key, config=CONFIG),
        dict(from_logits=False, top_k=K), ("top_k_sampling_from_probs", (K,))),
    "sampling from logits": (
        "logits", lambda x, key, idx=None: S.sampling_from_logits(x, idx, key=key, config=CONFIG),
        dict(from_logits=True), ("sampling_from_logits", ())),
}


def jax_sort_top_k_top_p(logits, key):
    """Sort-based (many JAX engines): sort, top-k mask, sort again, top-p mask, categorical."""
    srt = -jnp.sort(-logits, axis=-1)
    logits = jnp.where(logits < srt[:, K - 1:K], -jnp.inf, logits)
    srt = -jnp.sort(-logits, axis=-1)
    cum = jnp.cumsum(jax.nn.softmax(srt, axis=-1), -1)
    thr = jnp.take_along_axis(srt, jnp.sum(cum < P, -1, keepdims=True), -1)
    return jax.random.categorical(key, jnp.where(logits < thr, -jnp.inf, logits), -1)


def jax_top_k_then_p(logits, key):
    """lax.top_k(50), top-p within the 50, categorical."""
    v, i = jax.lax.top_k(logits, K)
    pr = jax.nn.softmax(v, -1)
    v = jnp.where(jnp.cumsum(pr, -1) - pr > P, -jnp.inf, v)
    return jnp.take_along_axis(i, jax.random.categorical(key, v, -1)[:, None], -1)[:, 0]


def jax_bisection_top_p(logits, key):
    """tpu-inference's way: 32-step bisection on the probability threshold, then categorical."""
    probs = jax.nn.softmax(logits, -1)
    lo, hi = jnp.zeros((logits.shape[0], 1)), jnp.ones((logits.shape[0], 1))

    def body(_, c):
        lo, hi = c
        mid = (lo + hi) / 2
        ok = jnp.sum(jnp.where(probs >= mid, probs, 0), -1, keepdims=True) >= P
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, 32, body, (lo, hi))
    return jax.random.categorical(key, jnp.where(probs >= lo, logits, -jnp.inf), -1)


BASELINES = {"JAX sort + top-k + top-p": jax_sort_top_k_top_p, "JAX lax.top_k(50) + top-p": jax_top_k_then_p,
             "JAX bisection top-p": jax_bisection_top_p}


CALLS = 10  # draws per jitted program: the GPU's time per draw, not the host's dispatch of one call


def chained(call):
    """CALLS draws in one program, draw i from copy i of the input (xs: CALLS distinct arrays
    [B, V], each its own buffer, so XLA cannot share a baseline's key-independent sort or search
    among the draws, and no draw pays a copy) with its own key."""
    return lambda xs, key: [call(x, k) for x, k in zip(xs, jax.random.split(key, CALLS))]


def check_distribution(name, x, draws):
    """Draws `draws` tokens from row 0 of x and checks them against the reference distribution."""
    kind, call, filters, _ = OPS[name]
    idx = jnp.zeros((draws,), jnp.int32)
    tokens = np.asarray(jax.jit(call)(x, jax.random.key(11), idx))
    ref = np.asarray(S._reference_probs(x[:1], **filters)[0], np.float64)
    outside = int(np.sum(ref[tokens] == 0))
    top = np.argsort(-ref)[:min(20, int(np.sum(ref > 0)))]
    mass = float(ref[top].sum())
    drawn = float(np.isin(tokens, top).mean())
    sigma = np.sqrt(max(mass * (1 - mass), 1e-12) / draws)
    z = (drawn - mass) / sigma if mass < 1 else 0.0
    ok = bool(outside == 0 and abs(z) < 5)
    record("sampling_check", op=name, V=x.shape[1], draws=draws, outside_kept=outside, top_mass=mass,
           drawn_top_mass=drawn, z=float(z), ok=ok)
    return ok


def flashinfer_timer():
    """(module, torch, timer) or None when FlashInfer is not importable here."""
    try:
        import flashinfer
        import torch
    except ImportError as e:
        print(f"FlashInfer skipped: {e}", flush=True)
        return None

    def timer(fn, iters=20, reps=7):
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(iters):
                fn()
            e.record()
            torch.cuda.synchronize()
            ts.append(s.elapsed_time(e) / iters / 1e3)
        return float(np.median(ts))

    print("flashinfer", flashinfer.__version__, flush=True)
    return flashinfer, torch, timer


def main():
    global CONFIG
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, few repeats (CPU interpret mode)")
    ap.add_argument("--block-v", type=int, default=CONFIG.block_v, help="lanes per block")
    ap.add_argument("--num-warps", type=int, default=CONFIG.num_warps)
    ap.add_argument("--num-stages", type=int, default=CONFIG.num_stages, help="pipeline stages of the block loads")
    ap.add_argument("--track", type=int, default=CONFIG.track, help="values tracked per lane in pass 1")
    ap.add_argument("--splits", type=int, default=CONFIG.splits,
                    help="programs per row (default: two per SM in all; 1: pass 1 in the row's program)")
    ap.add_argument("--split-stages", type=int, default=CONFIG.split_stages,
                    help="pipeline stages of a split pass 1")
    ap.add_argument("--band", type=int, default=CONFIG.band,
                    help="most tracked values compacted for the exact thresholds (a power of two)")
    ap.add_argument("--ops", help="regular expression: run only the ops it matches")
    ap.add_argument("--shapes", help="B x V pairs to run, e.g. 1x128256,64x128256 (default: all)")
    ap.add_argument("--jaxinfer-only", action="store_true",
                    help="time jaxinfer alone (no distribution checks, FlashInfer or JAX baselines): config sweeps")
    args = ap.parse_args()
    CONFIG = S.SamplingConfig(block_v=args.block_v, num_warps=args.num_warps, num_stages=args.num_stages,
                              track=args.track, splits=args.splits, split_stages=args.split_stages,
                              band=args.band)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.shapes:
        shapes = [tuple(int(n) for n in pair.split("x")) for pair in args.shapes.split(",")]
    iters, reps = (2, 1) if args.smoke else (20, 7)
    fi = None if args.smoke or args.jaxinfer_only else flashinfer_timer()
    print("jax", jax.__version__, jax.devices()[0].device_kind, CONFIG, flush=True)

    table = {}
    for batch, vocab in shapes:
        logits = jax.random.normal(jax.random.key(0), (batch, vocab), jnp.float32) * 3
        probs = jax.nn.softmax(logits, axis=-1)
        data = {"logits": logits, "probs": probs}
        copies = {name: [jnp.array(x, copy=True) for _ in range(CALLS)] for name, x in data.items()}
        key = jax.random.key(1)
        for name, (kind, call, _, fi_call) in OPS.items():
            if args.ops and not re.search(args.ops, name):
                continue
            t0 = time.perf_counter()
            ok = None if args.jaxinfer_only else check_distribution(name, data[kind], 256 if args.smoke else 8192)
            us = bench(jax.jit(chained(call)), copies[kind], key, iters=iters, reps=reps) / CALLS * 1e6
            record("jaxinfer_sampling", B=batch, V=vocab, op=name, us=us, check_ok=ok,
                   wall_s=time.perf_counter() - t0)
            row = table.setdefault((batch, vocab), {})
            row[f"jaxinfer {name}"] = us
            if fi is not None and fi_call is not None:
                flashinfer, torch, timer = fi
                xt = torch.from_numpy(np.asarray(data[kind])).cuda()
                fn_name, fn_args = fi_call
                fn = getattr(flashinfer.sampling, fn_name)
                try:
                    row[f"FlashInfer {name}"] = timer(lambda: fn(xt, *fn_args)) * 1e6
                    record("flashinfer_sampling", B=batch, V=vocab, op=name, us=row[f"FlashInfer {name}"])
                except Exception as e:  # an op missing from this FlashInfer: recorded, not fatal
                    record("flashinfer_sampling", B=batch, V=vocab, op=name, error=f"{type(e).__name__}: {e}"[:200])
        for name, f in ({} if args.jaxinfer_only else BASELINES).items():
            us = bench(jax.jit(chained(f)), copies["logits"], key, iters=iters, reps=reps) / CALLS * 1e6
            record("jax_baseline_sampling", B=batch, V=vocab, op=name, us=us)
            table[(batch, vocab)][name] = us
    save("sampling")

    cols = sorted({c for row in table.values() for c in row}, key=lambda c: (not c.startswith("jaxinfer"), c))
    print("\n| B x V | " + " | ".join(cols) + " |")
    print("| --- |" + " --- |" * len(cols))
    for (batch, vocab), row in table.items():
        print(f"| {batch} x {vocab} | " + " | ".join(f"{row[c]:.1f}" if c in row else "" for c in cols) + " |")
    sort_col = "JAX sort + top-k + top-p"
    if args.jaxinfer_only:
        return
    if "jaxinfer top-k 50 + top-p 0.9 from logits" not in next(iter(table.values()), {}):
        return
    print("\nspeedup of jaxinfer top-k + top-p from logits over the JAX sort baseline: " + ", ".join(
        f"{b}x{v}: {row[sort_col] / row['jaxinfer top-k 50 + top-p 0.9 from logits']:.1f}x"
        for (b, v), row in table.items()))


if __name__ == "__main__":
    main()
