"""Independent against chained calls (GPU): BatchAttention told bf16 and ragged_paged_attention on
issue 21's mixed step (short requests of kv U[512, 4096] first, then chunks of 512 onto 2048;
bf16, Hq 32 / Hkv 8, head_dim 128, page 16), `--layers` calls in one jitted program, each over
its own cache: independent calls with q sliced from one [L, T, Hq, D] array inside the program,
independent calls each given its own q array, and chained calls (call i + 1's queries are call
i's output, as a model's layers are).

    PYTHONPATH=. python3 benchmarks/bench_chained.py [--short 60] [--short-q 1] [--chunks 4] [--layers 8]
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer as ji
from benchmarks.common import per_call_us, random_paged_cache, rel_err, rpa_inputs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--short", type=int, default=60, help="short requests (kv U[512, 4096])")
    ap.add_argument("--short-q", type=int, default=1, help="query tokens of each short request")
    ap.add_argument("--chunks", type=int, default=4, help="chunks of 512 new tokens onto 2048")
    ap.add_argument("--layers", type=int, default=8, help="calls per jitted program, a cache each")
    args = ap.parse_args()
    hq, hkv, d, page, layers = 32, 8, 128, 16, args.layers
    rng = np.random.default_rng(0)
    qo = np.concatenate([np.full(args.short, args.short_q), np.full(args.chunks, 512)])
    kv = np.concatenate([rng.integers(512, 4097, args.short), np.full(args.chunks, 2048)])
    cache, indptr, indices, last = random_paged_cache(rng, kv, page, hkv, d, jnp.bfloat16)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    tokens = int(qo_indptr[-1])
    qs = jax.random.normal(jax.random.key(1), (layers, tokens, hq, d), jnp.bfloat16)  # [L, T, Hq, D]
    keys, values, meta = rpa_inputs(cache, qo, kv, indptr, indices, page)
    # One cache per call (distinct buffers, same contents): each call reads its K/V from HBM.
    caches = [ji.PagedKVCache(cache.k_pages + 0, cache.v_pages + 0) for _ in range(layers)]
    del cache
    attn = ji.BatchAttention(hq, hkv, d, page)
    plan = attn.plan(qo_indptr, indptr, indices, last, num_pages=caches[0].num_pages, q_data_type="bfloat16")

    def ba_independent(qs, caches, plan):
        return [attn.run(qs[i], caches[i], plan) for i in range(layers)]

    def ba_chained(qs, caches, plan):
        q = qs[0]
        for c in caches:
            q = attn.run(q, c, plan)
        return q

    def rpa_independent(qs, caches, keys, values, meta):
        outs, new = [], []
        for i, c in enumerate(caches):
            o, c = ji.ragged_paged_attention(qs[i], keys, values, c, *meta)
            outs.append(o)
            new.append(c)
        return outs, new

    def rpa_chained(qs, caches, keys, values, meta):
        q, new = qs[0], []
        for c in caches:
            q, c = ji.ragged_paged_attention(q, keys, values, c, *meta)
            new.append(c)
        return q, new

    state = {"caches": caches}

    def rpa_step(fn, q):
        def step():  # the caches donated and threaded (each call rewrites the rows they hold)
            out, state["caches"] = fn(q, state["caches"], keys, values, meta)
            return out
        return step

    ba_i, ba_c = jax.jit(ba_independent), jax.jit(ba_chained)
    rpa_i, rpa_c = jax.jit(rpa_independent, donate_argnums=1), jax.jit(rpa_chained, donate_argnums=1)
    q_each = [qs[i] for i in range(layers)]  # separate arrays: no slice inside the program
    checks = {"independent": rel_err(rpa_step(rpa_i, qs)()[-1], ba_i(qs, state["caches"], plan)[-1]),
              "chained": rel_err(rpa_step(rpa_c, qs)(), ba_c(qs, state["caches"], plan))}
    print(f"step: {args.short} x q{args.short_q} + {args.chunks} x 512/2048, {tokens} rows, {layers} calls; "
          f"BatchAttention plan {plan.impl}; rel_err RPA vs BatchAttention {checks}")
    rows = []
    for mode, ba_fn, rpa_fn, q in (("independent, q sliced", ba_i, rpa_i, qs),
                                   ("independent, own q", ba_i, rpa_i, q_each), ("chained", ba_c, rpa_c, qs)):
        ba_us = per_call_us(lambda: ba_fn(q, state["caches"], plan), layers)
        rpa_us = per_call_us(rpa_step(rpa_fn, q), layers)
        rows.append((mode, ba_us, rpa_us))
    print(f"{'calls':<22} {'BatchAttention us':>18} {'RPA us':>8} {'RPA / BA':>9}")
    for mode, ba_us, rpa_us in rows:
        print(f"{mode:<22} {ba_us:>18.1f} {rpa_us:>8.1f} {rpa_us / ba_us:>9.3f}")


if __name__ == "__main__":
    main()
