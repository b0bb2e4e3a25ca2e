"""The device-planned MLA call (jaxinfer.mla_ragged_paged_attention: the step's latent rows written,
the work list planned in XLA) against the host-planned wrapper (BatchMLAPagedAttention) on the
caches after the write, DeepSeek shapes (bf16, ckv 512 + kpe 64, sm_scale 0.1352).

    PYTHONPATH=. python3 benchmarks/bench_mla_device.py           # uniform kv lengths
    PYTHONPATH=. python3 benchmarks/bench_mla_device.py --skew    # kv lengths U[64, kv] (seeded)
    PYTHONPATH=. python3 benchmarks/bench_mla_device.py --smoke   # tiny shapes, CPU interpret mode

µs per call: 10 calls per jitted program, chained through the donated caches (device-planned) or
over the same caches (host-planned). Each row first checks the outputs against each other.
"""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer as ji
from benchmarks.common import bench

CKV, KPE, SCALE = 512, 64, 0.1352
# (heads, batch, kv, query tokens per request, page)
ROWS = ((16, 64, 4096, 1, 64), (128, 64, 4096, 1, 64), (16, 8, 2048, 4, 64), (16, 64, 4096, 1, 1))
SKEW_ROWS = ((16, 64, 8192, 1, 64), (128, 64, 8192, 1, 64), (16, 16, 16384, 1, 64))
SMOKE_ROWS = ((16, 2, 40, 1, 16), (16, 2, 40, 3, 16))


def time_row(heads, batch, kv, q, page, *, skew, calls):
    """(device-planned µs, host-planned µs, relative error between them, NaN count)."""
    kv_lens = (np.random.default_rng(batch).integers(64, kv + 1, batch) if skew else np.full(batch, kv)).astype(np.int32)
    q_lens = np.full(batch, q, np.int32)
    pages_per_seq = -(-kv // page)
    num_pages = batch * pages_per_seq + 8
    tokens = int(q_lens.sum())
    ks = jax.random.split(jax.random.key(0), 6)
    q_nope = jax.random.normal(ks[0], (tokens, heads, CKV), jnp.bfloat16)
    q_pe = jax.random.normal(ks[1], (tokens, heads, KPE), jnp.bfloat16)
    ckv = jax.random.normal(ks[2], (num_pages, page, CKV), jnp.bfloat16)
    kpe = jax.random.normal(ks[3], (num_pages, page, KPE), jnp.bfloat16)
    new_ckv = jax.random.normal(ks[4], (tokens, CKV), jnp.bfloat16)
    new_kpe = jax.random.normal(ks[5], (tokens, KPE), jnp.bfloat16)
    page_indices = np.arange(batch * pages_per_seq, dtype=np.int32)
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    distribution = np.array([0, 0, batch] if q > 1 else [batch] * 3, np.int32)
    meta = tuple(jnp.asarray(x) for x in (kv_lens, page_indices, cu_q_lens, distribution))

    o_dev, ckv, kpe = jax.jit(lambda *a: ji.mla_ragged_paged_attention(*a, sm_scale=SCALE))(
        q_nope, q_pe, new_ckv, new_kpe, ckv, kpe, *meta)
    mla = ji.BatchMLAPagedAttention(heads, CKV, KPE, page, causal=True, sm_scale=SCALE)
    kv_indptr = (np.arange(batch + 1) * pages_per_seq).astype(np.int32)
    plan = mla.plan(cu_q_lens, kv_indptr, page_indices, kv_lens, num_pages=num_pages)
    o_host = jax.jit(mla.run)(q_nope, q_pe, ckv, kpe, plan)
    diff = (o_dev - o_host).astype(jnp.float32)
    err = float(jnp.linalg.norm(diff) / jnp.linalg.norm(o_host.astype(jnp.float32)))
    nan = int(jnp.isnan(o_dev).sum())

    qs = jnp.stack([q_nope] * calls)  # [calls, T, H, CKV]

    def chain(qs, c, k, q_pe, new_ckv, new_kpe, *meta):  # calls chained through the caches (in place)
        outs = []
        for i in range(calls):
            o, c, k = ji.mla_ragged_paged_attention(qs[i], q_pe, new_ckv, new_kpe, c, k, *meta, sm_scale=SCALE)
            outs.append(o)
        return outs, c, k

    step = jax.jit(chain, donate_argnums=(1, 2))
    rest = (q_pe, new_ckv, new_kpe) + meta
    c, k = ckv + 0, kpe + 0
    for _ in range(2):
        outs, c, k = step(qs, c, k, *rest)
    jax.block_until_ready(outs)
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(10):
            outs, c, k = step(qs, c, k, *rest)
        jax.block_until_ready((outs, c, k))
        ts.append((time.perf_counter() - t0) / 10)
    t_dev = float(np.median(ts)) / calls * 1e6
    many_host = jax.jit(lambda qs, q_pe, c, k, p: [mla.run(qs[i], q_pe, c, k, p) for i in range(calls)])
    t_host = bench(many_host, qs, q_pe, ckv, kpe, plan, iters=10, reps=5) / calls * 1e6
    return t_dev, t_host, err, nan


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--skew", action="store_true", help="kv lengths U[64, kv] per request (seeded)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpret mode")
    args = ap.parse_args()
    rows, calls = (SMOKE_ROWS, 2) if args.smoke else (SKEW_ROWS if args.skew else ROWS, 10)
    print("jax", jax.__version__, jax.devices()[0].device_kind, flush=True)
    for heads, batch, kv, q, page in rows:
        t_dev, t_host, err, nan = time_row(heads, batch, kv, q, page, skew=args.skew, calls=calls)
        lens = f"U[64,{kv}]" if args.skew else str(kv)
        print(f"H{heads} B{batch} kv{lens} q{q} page{page}: device-planned {t_dev:.1f} us, host-planned "
              f"{t_host:.1f} us, ratio {t_dev / t_host:.3f}, rel_err {err:.2e}, NaN {nan}", flush=True)


if __name__ == "__main__":
    main()
