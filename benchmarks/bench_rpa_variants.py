"""ragged_paged_attention with a sliding window or a soft cap: the long sequences' kernel that
impl "auto" picks (dispatch.ragged_long_impl) against impl="triton" and impl="mosaic" (the Mosaic
prefill class), on prefill-only and mixed steps (bf16, page 16).

    PYTHONPATH=. python3 benchmarks/bench_rpa_variants.py [--smoke]

Each step's outputs are compared with impl="triton"'s first (relative error, printed); times are
µs per call, 10 calls per jitted program, each with its own q, the cache donated and threaded
through the calls (the new K/V are the cache's own rows, so every call sees the same cache).
The table prints last.
"""
import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer as ji
from benchmarks.common import per_call_us, random_paged_cache, rel_err, rpa_inputs

IMPLS = ("auto", "triton", "mosaic")
CALLS = 10


def steps(smoke):
    """(name, q_lens, kv_lens, Hq, Hkv, D, sliding_window, soft_cap); decode sequences first."""
    if smoke:
        return [("B1 S64 4/2 d64 window 16", [64], [64], 4, 2, 64, 16, None)]
    rng = np.random.default_rng(0)
    mixed_q, mixed_kv = [1] * 60 + [512] * 4, list(rng.integers(512, 4097, 60)) + [2048] * 4
    out = []
    for b, s, hq, hkv, d in ((4, 2048, 32, 8, 128), (4, 2048, 64, 8, 64), (1, 8192, 32, 8, 128)):
        for window, cap in ((None, None), (128, None), (1024, None), (None, 30.0)):
            out.append((f"B{b} S{s} {hq}/{hkv} d{d} window {window} cap {cap}", [s] * b, [s] * b, hq, hkv, d,
                        window, cap))
    out.append(("B4 S2048 32/8 d128 window 128 cap 30.0", [2048] * 4, [2048] * 4, 32, 8, 128, 128, 30.0))
    for hq, hkv, d, window, cap in ((32, 8, 128, 128, None), (32, 8, 128, 1024, None), (32, 8, 128, None, 30.0),
                                    (64, 8, 64, 128, None)):
        out.append((f"60 decode + 4x512/2048 {hq}/{hkv} d{d} window {window} cap {cap}", mixed_q, mixed_kv, hq,
                    hkv, d, window, cap))
    return out


def time_step(q_lens, kv_lens, hq, hkv, d, window, cap, *, calls=CALLS, reps=7, iters=10):
    """{impl: µs per call}, {impl: o relative error against impl="triton"}."""
    q_lens, kv_lens = np.asarray(q_lens), np.asarray(kv_lens)
    cache, indptr, indices, _ = random_paged_cache(np.random.default_rng(0), kv_lens, 16, hkv, d, jnp.bfloat16)
    keys, values, meta = rpa_inputs(cache, q_lens, kv_lens, indptr, indices, 16)
    qs = [jax.random.normal(jax.random.key(i), (int(q_lens.sum()), hq, d), jnp.bfloat16) for i in range(calls)]
    times, outs = {}, {}
    for impl in IMPLS:
        def many(qs, cache, impl=impl):
            out = []
            for q in qs:
                o, cache = ji.ragged_paged_attention(q, keys, values, cache, *meta, sliding_window=window,
                                                     soft_cap=cap, impl=impl)
                out.append(o)
            return out, cache
        fn = jax.jit(many, donate_argnums=1)
        state = {"cache": jax.tree.map(jnp.copy, cache)}

        def step(fn=fn, state=state):
            out, state["cache"] = fn(qs, state["cache"])
            return out
        outs[impl] = np.asarray(step()[0], np.float32)
        times[impl] = per_call_us(step, calls, reps=reps, iters=iters)
    return times, {impl: rel_err(outs[impl], outs["triton"]) for impl in IMPLS}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="one tiny step, one call timed once (CPU, interpret mode)")
    args = ap.parse_args()
    rows = []
    for name, *step in steps(args.smoke):
        times, errs = time_step(*step, **(dict(calls=1, reps=1, iters=1) if args.smoke else {}))
        rows.append((name, times))
        print(json.dumps(dict(step=name, us=times, rel_err_vs_triton=errs)), flush=True)
    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}: µs per call")
    print(f"{'step':<48}" + "".join(f"{i:>12}" for i in IMPLS))
    for name, times in rows:
        print(f"{name:<48}" + "".join(f"{times[i]:>12.1f}" for i in IMPLS))


if __name__ == "__main__":
    main()
