"""Where a mixed serving step's device time goes (GPU): ragged_paged_attention (device plan, KV
write) against BatchAttention told the dtypes (host plan), each kernel's device µs per call from a
profiler trace, on issue 21's mixed step (60 decode requests of kv U[512, 4096], then 4 chunks of
512 onto 2048; bf16, Hq 32 / Hkv 8, head_dim 128, page 16).

    PYTHONPATH=. python3 benchmarks/trace_rpa.py [--decode N] [--chunks N]
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer as ji
from benchmarks.common import kernel_times, random_paged_cache, rel_err, rpa_inputs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decode", type=int, default=60, help="decode requests (kv U[512, 4096])")
    ap.add_argument("--chunks", type=int, default=4, help="chunks of 512 new tokens onto 2048")
    args = ap.parse_args()
    hq, hkv, d, page = 32, 8, 128, 16
    rng = np.random.default_rng(0)
    qo = np.concatenate([np.ones(args.decode, np.int64), np.full(args.chunks, 512)])
    kv = np.concatenate([rng.integers(512, 4097, args.decode), np.full(args.chunks, 2048)])
    cache, indptr, indices, last = random_paged_cache(rng, kv, page, hkv, d, jnp.bfloat16)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((int(qo_indptr[-1]), hq, d)), jnp.bfloat16)
    attn = ji.BatchAttention(hq, hkv, d, page)
    plan = attn.plan(qo_indptr, indptr, indices, last, num_pages=cache.num_pages, q_data_type="bfloat16")
    keys, values, meta = rpa_inputs(cache, qo, kv, indptr, indices, page)
    ba = jax.jit(attn.run)
    o_ba = ba(q, cache, plan)
    rpa = jax.jit(ji.ragged_paged_attention, donate_argnums=3)  # the cache written in place
    state = {"cache": ji.PagedKVCache(cache.k_pages + 0, cache.v_pages + 0)}

    def rpa_step(q, keys, values, *meta):  # each call threads the donated cache
        o, state["cache"] = rpa(q, keys, values, state["cache"], *meta)
        return o

    o_rpa = rpa_step(q, keys, values, *meta)
    print(f"rel_err ragged_paged_attention against BatchAttention ({plan.impl}): {rel_err(o_rpa, o_ba):.1e}")
    for name, fn, fn_args in (("BatchAttention told bf16", ba, (q, cache, plan)),
                              ("ragged_paged_attention", rpa_step, (q, keys, values, *meta))):
        kernels, busy = kernel_times(fn, *fn_args)
        print(f"--- {name}: device busy {busy:.1f} us per call (traced)")
        for kernel, us in kernels:
            print(f"  {us:8.1f}  {kernel}")


if __name__ == "__main__":
    main()
