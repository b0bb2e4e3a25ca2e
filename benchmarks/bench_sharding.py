"""Attention over several GPUs (jaxinfer.sharding): context parallel (CP) and head parallel (TP)
against one GPU, on Llama-3-70B heads (64 query / 8 KV, head_dim 128, bf16, pages of 16).

    PYTHONPATH=. python3 benchmarks/bench_sharding.py            # 1, 2, 4 GPUs (as many as present)
    PYTHONPATH=. python3 benchmarks/bench_sharding.py --smoke    # tiny shapes, 4 forced CPU devices

Rows: CP decode B8 kv131072, TP decode B64 kv4096, CP prefill B1 S65536 (causal), TP prefill B4
S8192 (causal). Each config first checks its sharded output against the one-GPU output (o relative
error), then times the jitted call (median); the speedup / efficiency table prints last. The CP
caches are page-sharded (each GPU holds its pages only); the one-GPU row is the plain wrapper.
"""
import argparse
import os
import sys

if "--smoke" in sys.argv:  # before jax starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
                               " --xla_backend_optimization_level=0").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxinfer as ji  # noqa: E402
from benchmarks.common import bench, record, save  # noqa: E402
from jaxinfer import sharding  # noqa: E402

HQ, HKV, D, PAGE = 64, 8, 128, 16
DTYPE = jnp.bfloat16


def _configs(smoke):
    """(name, mode, kind, batch, kv_len): prefill rows have qo_len = kv_len."""
    if smoke:
        return [("CP decode B2 kv256", "cp", "decode", 2, 256), ("TP decode B4 kv64", "tp", "decode", 4, 64),
                ("CP prefill B1 S64", "cp", "prefill", 1, 64), ("TP prefill B2 S32", "tp", "prefill", 2, 32)]
    return [("CP decode B8 kv131072", "cp", "decode", 8, 131072), ("TP decode B64 kv4096", "tp", "decode", 64, 4096),
            ("CP prefill B1 S65536", "cp", "prefill", 1, 65536), ("TP prefill B4 S8192", "tp", "prefill", 4, 8192)]


def _wrapper(kind, hq, hkv, batch, tokens, pages, capacities, smoke, impl="auto"):
    """The decode or causal prefill wrapper (capacities: the fixed shapes CP's stacked plans need;
    impl: the prefill kernel, as the wrapper's impl=)."""
    ctas = 8 if smoke else None
    if kind == "decode":
        return ji.BatchDecodeWithPagedKVCache(hq, hkv, D, PAGE, num_ctas=ctas,
                                              max_batch_size=batch if capacities else None,
                                              max_num_pages=pages if capacities else None)
    return ji.BatchPrefillWithPagedKVCache(hq, hkv, D, PAGE, causal=True, num_ctas=ctas, impl=impl,
                                           max_batch_size=batch if capacities else None,
                                           max_num_tokens=tokens if capacities else None,
                                           max_num_pages=pages if capacities else None)


def _plan(w, kind, qo_indptr, table, num_pages):
    if kind == "decode":
        return w.plan(*table, num_pages=num_pages)
    return w.plan(qo_indptr, *table, num_pages=num_pages, q_data_type="bfloat16")


def _cp_table(batch, kv_len, n, qo_indptr, causal):
    """A page table allocated device by device along split_page_table's balanced shares (by keys,
    or by causal work): request pages [b_k, b_k+1) get ids from device k's block of N pages."""
    npages = -(-kv_len // PAGE)
    indptr = (np.arange(batch + 1) * npages).astype(np.int32)
    last = np.full(batch, kv_len - (npages - 1) * PAGE, np.int32)
    plain = sharding.split_page_table(indptr, np.arange(batch * npages, dtype=np.int32), last, PAGE, n,
                                      qo_indptr=qo_indptr, causal=causal)
    counts = np.stack([np.diff(t[0]) for t in plain.tables])  # [n, B]
    per = int(counts.sum(1).max())
    indices = []
    used = np.zeros(n, np.int64)
    for r in range(batch):
        for k in range(n):
            indices.append(k * per + used[k] + np.arange(counts[k, r]))
            used[k] += counts[k, r]
    return (indptr, np.concatenate(indices).astype(np.int32), last), per


def _run_config(name, mode, kind, batch, kv_len, counts, smoke, rng, impl):
    qo_indptr = None if kind == "decode" else (np.arange(batch + 1) * kv_len).astype(np.int32)
    rows = batch if kind == "decode" else batch * kv_len
    q = jnp.asarray(rng.standard_normal((rows, HQ, D), np.float32), DTYPE)
    times, base = {}, None
    for n in counts:
        mesh_devices = np.asarray(jax.devices()[:n])
        if mode == "cp":
            table, per = _cp_table(batch, kv_len, n, qo_indptr, kind == "prefill")
            num_pages = n * per
        else:
            npages = -(-kv_len // PAGE)
            table = ((np.arange(batch + 1) * npages).astype(np.int32),
                     rng.permutation(batch * npages).astype(np.int32),
                     np.full(batch, kv_len - (npages - 1) * PAGE, np.int32))
            num_pages = batch * npages
        key = jax.random.key(n)
        shape = (num_pages, PAGE, HKV, D)
        cache = ji.PagedKVCache(jax.random.normal(key, shape, DTYPE), jax.random.normal(jax.random.fold_in(key, 1),
                                                                                       shape, DTYPE))
        if n == 1:  # the plain wrapper on one GPU
            w = _wrapper(kind, HQ, HKV, batch, rows, num_pages, False, smoke, impl)
            plan = _plan(w, kind, qo_indptr, table, num_pages)
            f = jax.jit(lambda q, c, p, w=w: w.run(q, c, p))
            args = (q, cache, plan)
            ref_args = None
        elif mode == "tp":
            mesh = jax.sharding.Mesh(mesh_devices, ("tp",))
            hs = sharding.split_heads(HQ, HKV, n)
            w = _wrapper(kind, hs.num_qo_heads, hs.num_kv_heads, batch, rows, num_pages, False, smoke, impl)
            plan = _plan(w, kind, qo_indptr, table, num_pages)
            c = sharding.replicate_kv_heads(cache, hs.kv_replicas) if hs.kv_replicas > 1 else cache
            c = jax.device_put(c, NamedSharding(mesh, sharding.cache_spec("NHD", tp_axis="tp")))
            args = (jax.device_put(q, NamedSharding(mesh, sharding.head_spec("tp"))), c, plan)
            f = jax.jit(sharding.head_parallel(w, mesh))
            ref_args = (cache, table, num_pages)
        else:
            mesh = jax.sharding.Mesh(mesh_devices, ("cp",))
            split = sharding.split_page_table(*table, PAGE, n, qo_indptr=qo_indptr, pages_per_shard=per)
            pages_cap = max(int(t[0][-1]) for t in split.tables)
            w = _wrapper(kind, HQ, HKV, batch, rows, pages_cap, True, smoke, impl)
            if kind == "decode":
                plan = sharding.context_plan(w, split, num_pages=num_pages)
            else:
                plan = sharding.context_plan(w, split, num_pages=num_pages, q_data_type="bfloat16")
            plan = jax.device_put(plan, NamedSharding(mesh, P("cp")))
            c = jax.device_put(cache, NamedSharding(mesh, sharding.cache_spec("NHD", cp_axis="cp")))
            args = (jax.device_put(q, NamedSharding(mesh, sharding.head_spec(None))), c, plan)
            f = jax.jit(sharding.context_parallel(w, mesh))
            ref_args = (cache, table, num_pages)
        if ref_args is not None:  # correctness first: the same cache and table on one GPU
            w1 = _wrapper(kind, HQ, HKV, batch, rows, ref_args[2], False, smoke, impl)
            want = jax.jit(lambda q, c, p: w1.run(q, c, p))(q, ref_args[0],
                                                             _plan(w1, kind, qo_indptr, ref_args[1], ref_args[2]))
            got = f(*args)
            err = float(jnp.linalg.norm((got - want).astype(jnp.float32)) /
                        jnp.linalg.norm(want.astype(jnp.float32)))
            print(f"{name} on {n}: o relative error vs one GPU {err:.2e}", flush=True)
            if not err <= 2e-2:
                raise SystemExit(f"{name} on {n} devices: relative error {err:.2e} > 2e-2")
        kernels = (plan.full.impl + (" + " + plan.diag.impl if plan.diag is not None else "")
                   if isinstance(plan, sharding.ContextPlan) else plan.impl)
        print(f"{name} on {n}: kernels {kernels}", flush=True)
        t = bench(f, *args, iters=1 if smoke else 10, reps=1 if smoke else 7)
        times[n] = t
        base = base or t
        record("sharding", config=name, devices=n, ms=t * 1e3, speedup=base / t, efficiency=base / t / n,
               kernels=kernels, device=jax.devices()[0].device_kind)
        del args, cache, f
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on 4 forced CPU devices")
    ap.add_argument("--prefill-impl", default="auto", choices=("auto", "triton", "mosaic"),
                    help="the prefill rows' kernel on every device count (CP plans have fixed shapes, "
                         "which may pick another kernel than 'auto' does for one GPU)")
    ap.add_argument("--only", default=None, help="comma-separated config name prefixes (e.g. 'CP decode')")
    args = ap.parse_args()
    counts = [n for n in (1, 2, 4) if n <= len(jax.devices())]
    rng = np.random.default_rng(0)
    table = []
    for name, mode, kind, batch, kv_len in _configs(args.smoke):
        if args.only and not any(name.startswith(p.strip()) for p in args.only.split(",")):
            continue
        times = _run_config(name, mode, kind, batch, kv_len, counts, args.smoke, rng, args.prefill_impl)
        table.append((name, times))
    save("sharding")
    print(f"\n{jax.devices()[0].device_kind}: time per call, speedup and efficiency against one device")
    print(f"{'config':<24}" + "".join(f"{f'{n} dev ms':>12}{'speedup':>9}{'eff':>7}" for n in counts))
    for name, times in table:
        row = f"{name:<24}"
        for n in counts:
            row += f"{times[n] * 1e3:>12.3f}{times[1] / times[n]:>9.2f}{times[1] / times[n] / n:>7.2f}"
        print(row)


if __name__ == "__main__":
    main()
