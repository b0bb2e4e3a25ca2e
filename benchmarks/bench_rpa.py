"""ragged_paged_attention (device plan, fused KV write) against ji.BatchAttention (host plan) on
the GPU, on serving rows (bf16, Hq 32 / Hkv 8, head_dim 128, page 16), speculative verify of
8 tokens (ragged_paged_attention's class of 32-row decode tiles) and prefill only (B4 S8192).

    PYTHONPATH=. python3 benchmarks/bench_rpa.py [--rows q4,mixed,...] [--triton] [--cp1] [--mosaic-ctas 1,2]

--triton also times ragged_paged_attention with impl="triton" (its long sequences on the Triton
prefill kernel); --cp1 also times sharding.context_parallel_ragged on a one-device mesh (its
share is the whole cache: the cost of its row gather, placement and merge); --mosaic-ctas times
the Mosaic class with that many CTAs per SM (default: the module's MOSAIC_CTAS_PER_SM). Each row first checks both outputs against jaxinfer.reference
(rows over 16384 tokens: the last 256 rows of the first and last sequences). The new K/V given to
ragged_paged_attention are the values already in the cache at those positions, so its write
leaves the keys' rows as the reference and BatchAttention see them (and zeroes V past
each kv_len: common.rpa_written_cache). Times are per call, CALLS calls in
one program; ragged_paged_attention's calls thread the cache, donated, so the KV write is in place.
Results: printed as JSON lines and saved to $OUT/jaxinfer_rpa.json.
"""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import jaxinfer as ji
from benchmarks.common import bench, random_paged_cache, record, rel_err, rpa_inputs, rpa_written_cache, save
from jaxinfer import ragged, sharding
from jaxinfer import reference as ref

HQ, HKV, D, PAGE = 32, 8, 128, 16
CALLS = 10
CHECK_ALL = 16384  # rows of larger steps are checked in part
CHECK_ROWS = 256  # rows checked per sequence on rows over CHECK_ALL tokens


def rows(rng):
    """(name, q_lens, kv_lens): decode sequences (q_len 1) first, as RPA's distribution wants."""
    mixed_kv = rng.integers(512, 4097, 60)
    return [
        ("q4 B64 kv4096", np.full(64, 4), np.full(64, 4096)),
        ("mixed 4x512/2048 + 60 decode", np.r_[np.ones(60, int), np.full(4, 512)], np.r_[mixed_kv, np.full(4, 2048)]),
        ("decode B64 kv4096", np.ones(64, int), np.full(64, 4096)),
        ("q8 B64 kv4096", np.full(64, 8), np.full(64, 4096)),  # ragged's 32-row decode class
        ("prefill B4 S8192", np.full(4, 8192), np.full(4, 8192)),
    ]


def time_rpa(qs, ks, vs, cache, meta, iters=20, reps=7, attention=ji.ragged_paged_attention, **kw):
    """Median seconds per call of CALLS attention calls (ragged_paged_attention's arguments) in one
    program, the cache donated."""
    def many(qs, ks, vs, cache, *meta):
        outs = []
        for i in range(CALLS):
            o, cache = attention(qs[i], ks[i], vs[i], cache, *meta, **kw)
            outs.append(o)
        return outs, cache

    fn = jax.jit(many, donate_argnums=(3,))
    for _ in range(2):
        outs, cache = fn(qs, ks, vs, cache, *meta)
    jax.block_until_ready(outs)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(iters):
            outs, cache = fn(qs, ks, vs, cache, *meta)
        jax.block_until_ready((outs, cache))
        ts.append((time.perf_counter() - t) / iters)
    return float(np.median(ts)) / CALLS, cache


def reference_rows(q, cache, qo_indptr, indptr, indices, last):
    """(rows checked, reference o of those rows): all rows, or on large steps the last CHECK_ROWS
    of the first and last sequences (each as a request of CHECK_ROWS queries on the same keys:
    bottom-right causal keeps their masks)."""
    nnz = int(qo_indptr[-1])
    if nnz <= CHECK_ALL:
        return np.arange(nnz), jax.jit(lambda q, c: ref.paged_attention(
            q, c, qo_indptr, indptr, indices, last, causal=True).o)(q, cache)
    rows, wants = [], []
    for b in sorted({0, len(qo_indptr) - 2}):
        r = np.arange(qo_indptr[b + 1] - CHECK_ROWS, qo_indptr[b + 1])
        sub = (np.array([0, CHECK_ROWS], np.int32), indptr[b:b + 2] - indptr[b], indices[indptr[b]:indptr[b + 1]],
               last[b:b + 1])
        wants.append(ref.paged_attention(q[r], cache, *sub, causal=True).o)
        rows.append(r)
    return np.concatenate(rows), jnp.concatenate(wants)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="", help="comma-separated name prefixes (default: every row)")
    parser.add_argument("--triton", action="store_true", help='also time impl="triton"')
    parser.add_argument("--cp1", action="store_true", help="also time context_parallel_ragged on one device")
    parser.add_argument("--mosaic-ctas", default="", help="Mosaic CTAs per SM to time, e.g. 1,2")
    args = parser.parse_args()
    print("jax", jax.__version__, jax.devices(), flush=True)
    rng = np.random.default_rng(0)
    wanted = [x for x in args.rows.split(",") if x]
    cp1 = sharding.context_parallel_ragged(Mesh(np.array(jax.devices()[:1]), ("cp",)), cp_axis="cp") if args.cp1 else None
    for name, q_lens, kv_lens in rows(rng):
        if wanted and not any(name.startswith(w) for w in wanted):
            continue
        cache, indptr, indices, last = random_paged_cache(rng, kv_lens, PAGE, HKV, D, jnp.bfloat16)
        qo_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        nnz = int(qo_indptr[-1])
        q = jax.random.normal(jax.random.key(1), (nnz, HQ, D), jnp.bfloat16)
        keys, values, meta = rpa_inputs(cache, q_lens, kv_lens, indptr, indices, PAGE)

        check_rows, want = reference_rows(q, cache, qo_indptr, indptr, indices, last)
        attn = ji.BatchAttention(HQ, HKV, D, PAGE)
        plan = attn.plan(qo_indptr, indptr, indices, last, num_pages=cache.num_pages)
        err_ba = rel_err(jax.jit(attn.run)(q, cache, plan)[check_rows], want)
        rpa = ji.ragged_paged_attention
        variants = [("rpa", rpa, {})] + ([("rpa_triton", rpa, {"impl": "triton"})] if args.triton else []) \
            + ([("cp1", cp1, {})] if args.cp1 else [])
        res = {}
        for label, attention, kw in variants:
            o, new_cache = jax.jit(lambda *a, f=attention, kw=kw: f(*a, **kw))(q, keys, values, cache, *meta)
            res["rel_err_" + label] = rel_err(o[check_rows], want)
            finite = bool(jnp.all(jnp.isfinite(o)))
            written = rpa_written_cache(cache, q_lens, kv_lens, indptr, indices, PAGE)
            cache_same = bool(jnp.array_equal(new_cache.k_pages, written.k_pages)
                              & jnp.array_equal(new_cache.v_pages, written.v_pages))
            del written
            del new_cache, o
            if res["rel_err_" + label] > 2e-2 or err_ba > 2e-2 or not cache_same or not finite:
                raise SystemExit(f"{name}: wrong output (rel err BatchAttention {err_ba:.3g}, {label} "
                                 f"{res['rel_err_' + label]:.3g}, cache as written {cache_same}, finite {finite})")

        iters = 20 if nnz <= CHECK_ALL else 3
        qs = jax.random.normal(jax.random.key(2), (CALLS,) + q.shape, q.dtype)
        ks, vs = jnp.broadcast_to(keys, (CALLS,) + keys.shape), jnp.broadcast_to(values, (CALLS,) + values.shape)
        t_ba = bench(jax.jit(lambda qs, c, p: [attn.run(qs[i], c, p) for i in range(CALLS)]), qs, cache, plan,
                     iters=iters) / CALLS
        times = {}
        for label, attention, kw in variants:
            t, cache = time_rpa(qs, ks, vs, cache, meta, iters=iters, attention=attention, **kw)
            times[label + "_us"] = t * 1e6
        default_ctas = ragged.MOSAIC_CTAS_PER_SM
        for n in [int(x) for x in args.mosaic_ctas.split(",") if x]:
            ragged.MOSAIC_CTAS_PER_SM = n
            t, cache = time_rpa(qs, ks, vs, cache, meta, iters=iters)
            times[f"rpa_mosaic_ctas{n}_us"] = t * 1e6
        ragged.MOSAIC_CTAS_PER_SM = default_ctas
        record("rpa", config=name, **times, batch_attention_us=t_ba * 1e6, ratio=times["rpa_us"] / (t_ba * 1e6),
               rel_err_batch_attention=err_ba, batch_attention_impl=plan.impl, **res)
    save("rpa")


if __name__ == "__main__":
    main()
