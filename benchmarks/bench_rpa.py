"""ragged_paged_attention (device plan, fused KV write) against ji.BatchAttention (host plan) on
the GPU, on issue 21's rows (bf16, Hq 32 / Hkv 8, head_dim 128, page 16), and speculative
verify of 8 tokens (ragged_paged_attention's class of 64-row decode tiles).

    PYTHONPATH=. python3 benchmarks/bench_rpa.py

Each row first checks both outputs against jaxinfer.reference. The new K/V given to
ragged_paged_attention are the values already in the cache at those positions, so its write
leaves the cache as the reference and BatchAttention see it. Times are per call, CALLS calls in
one program; ragged_paged_attention's calls thread the cache, donated, so the KV write is in place.
Results: printed as JSON lines and saved to $OUT/jaxinfer_rpa.json.
"""
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer as ji
from benchmarks.common import bench, random_paged_cache, record, rel_err, save
from jaxinfer import reference as ref

HQ, HKV, D, PAGE = 32, 8, 128, 16
CALLS = 10


def rows(rng):
    """(name, q_lens, kv_lens): decode sequences (q_len 1) first, as RPA's distribution wants."""
    mixed_kv = rng.integers(512, 4097, 60)
    return [
        ("q4 B64 kv4096", np.full(64, 4), np.full(64, 4096)),
        ("mixed 4x512/2048 + 60 decode", np.r_[np.ones(60, int), np.full(4, 512)], np.r_[mixed_kv, np.full(4, 2048)]),
        ("decode B64 kv4096", np.ones(64, int), np.full(64, 4096)),
        ("q8 B64 kv4096", np.full(64, 8), np.full(64, 4096)),  # ragged's 64-row decode class
    ]


def rpa_inputs(cache, q_lens, kv_lens, indptr, indices):
    """RPA metadata for the step, and K/V rows copied from the cache at the new tokens' positions."""
    s = len(q_lens)
    npages = np.diff(indptr)
    pages_per_seq = int(npages.max())
    page_indices = np.zeros((s, pages_per_seq), np.int32)
    for i in range(s):
        page_indices[i, :npages[i]] = indices[indptr[i]:indptr[i + 1]]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    pos = np.concatenate([np.arange(kv - q, kv) for q, kv in zip(q_lens, kv_lens)])
    seq = np.repeat(np.arange(s), q_lens)
    pages, slots = page_indices[seq, pos // PAGE], pos % PAGE
    keys, values = cache.k_pages[pages, slots], cache.v_pages[pages, slots]  # [T, Hkv, D]
    n_decode = int(np.sum(np.cumprod(q_lens == 1)))
    meta = (jnp.asarray(kv_lens, jnp.int32), jnp.asarray(page_indices.reshape(-1)), jnp.asarray(cu),
            jnp.asarray([n_decode, n_decode, s], jnp.int32))
    return keys, values, meta


def time_rpa(qs, ks, vs, cache, meta, iters=20, reps=7):
    """Median seconds per call of CALLS ragged_paged_attention calls in one program, the cache donated."""
    def many(qs, ks, vs, cache, *meta):
        outs = []
        for i in range(CALLS):
            o, cache = ji.ragged_paged_attention(qs[i], ks[i], vs[i], cache, *meta)
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


def main():
    print("jax", jax.__version__, jax.devices(), flush=True)
    rng = np.random.default_rng(0)
    for name, q_lens, kv_lens in rows(rng):
        cache, indptr, indices, last = random_paged_cache(rng, kv_lens, PAGE, HKV, D, jnp.bfloat16)
        qo_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        nnz = int(qo_indptr[-1])
        q = jax.random.normal(jax.random.key(1), (nnz, HQ, D), jnp.bfloat16)
        keys, values, meta = rpa_inputs(cache, q_lens, kv_lens, indptr, indices)

        want = jax.jit(lambda q, c: ref.paged_attention(q, c, qo_indptr, indptr, indices, last, causal=True).o)(
            q, cache)
        attn = ji.BatchAttention(HQ, HKV, D, PAGE)
        plan = attn.plan(qo_indptr, indptr, indices, last, num_pages=cache.num_pages)
        err_ba = rel_err(jax.jit(attn.run)(q, cache, plan), want)
        o, new_cache = jax.jit(ji.ragged_paged_attention)(q, keys, values, cache, *meta)
        err_rpa = rel_err(o, want)
        cache_same = bool(jnp.array_equal(new_cache.k_pages, cache.k_pages)
                          & jnp.array_equal(new_cache.v_pages, cache.v_pages))
        del new_cache
        if max(err_ba, err_rpa) > 2e-2 or not cache_same:
            raise SystemExit(f"{name}: wrong output (rel err BatchAttention {err_ba:.3g}, "
                             f"ragged_paged_attention {err_rpa:.3g}, cache unchanged {cache_same})")

        qs = jax.random.normal(jax.random.key(2), (CALLS,) + q.shape, q.dtype)
        ks, vs = jnp.broadcast_to(keys, (CALLS,) + keys.shape), jnp.broadcast_to(values, (CALLS,) + values.shape)
        t_ba = bench(jax.jit(lambda qs, c, p: [attn.run(qs[i], c, p) for i in range(CALLS)]), qs, cache, plan) / CALLS
        t_rpa, cache = time_rpa(qs, ks, vs, cache, meta)
        record("rpa", config=name, rpa_us=t_rpa * 1e6, batch_attention_us=t_ba * 1e6, ratio=t_rpa / t_ba,
               rel_err_rpa=err_rpa, rel_err_batch_attention=err_ba, batch_attention_impl=plan.impl)
    save("rpa")


if __name__ == "__main__":
    main()
