"""Attention over several GPUs (jaxinfer.sharding): context parallel (CP) and head parallel (TP)
against one GPU, on Llama-3-70B heads (64 query / 8 KV, head_dim 128, bf16, pages of 16).

    PYTHONPATH=. python3 benchmarks/bench_sharding.py --out $OUT/bench_sharding.json   # 1, 2, 4 GPUs
    PYTHONPATH=. python3 benchmarks/bench_sharding.py --smoke --out /tmp/s.json   # tiny, 4 forced CPU devices

Rows: CP decode B8 kv131072, CP prefill B1 S65536 (causal; keys split, and `CP rows`: query rows
split, sharding.split_queries), TP decode B64 kv4096, TP prefill B4 S8192 (causal), the
context_parallel_ragged rows (`CP ragged`) and MLA decode with the latent cache split over the
devices (`CP MLA decode B8 kv131072`: BatchMLAPagedAttention, DeepSeek-V3's 128 heads, ckv 512 +
kpe 64, page 64), each on 1, 2 and 4 devices (as many as there are). Every row first checks its
output: the one-device output against float32 dense attention on a few query rows (the first and
last request), each sharded output against the one-device output on the same random K/V (o
relative error); then it times them: the median over repeated loops of a jitted program of
`calls` attention calls, each with its own q (10 for decode rows, so that host dispatch hides
behind the device; CP calls chained one after another, so that XLA does not combine their merges'
collectives). The one-device row is the plain wrapper; CP caches are page-sharded (each device
holds its own pages only).

CP rows on several devices also time the device-local part alone (local_ms: every device's
partial state, context_partial_states, the same calls unchained: the chain's scalar would have to
cross devices, and there are no collectives to keep apart) and name the merge
that ran (merge: --merge, or what "auto" chose for the device count and bf16 o,
sharding.merge_choice); merge_ms = ms - local_ms is the merge's share of the call (its
collectives and arithmetic, with whatever of them overlaps the local part hidden).

Each config runs in a process of its own (the same script with --only), bounded by --row-timeout-s
and the whole run by --budget-s: a crash, hang or out-of-memory costs that config only, and the
rows it finished are kept. JSON (every row, errors included) goes to --out; the speedup /
efficiency table prints last, then the CP rows' local / merge breakdown.
"""
import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys
import time

if "--smoke" in sys.argv and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
                               " --xla_backend_optimization_level=0").strip()  # before jax starts
if "--smoke" in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxinfer as ji  # noqa: E402
from benchmarks.common import bench  # noqa: E402
from jaxinfer import sharding  # noqa: E402

HQ, HKV, D, PAGE = 64, 8, 128, 16
DTYPE = jnp.bfloat16
MLA_SCALE = 0.1352  # DeepSeek-V3's softmax scale (1 / sqrt(192), YaRN-scaled)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """One benchmark row; prefill rows have qo_len = kv_len (whole prompts, causal)."""
    name: str
    mode: str      # "cp", "cp_rows" (query rows split: split_queries), "tp", "cp_ragged"
                   # (ragged_paged_attention, its KV write included) or "cp_mla" (MLA decode)
    kind: str      # "decode" or "prefill"
    batch: int
    kv_len: int
    calls: int     # attention calls per jitted program, each with its own q (hides host dispatch;
                   # CP calls chained, so that XLA cannot combine their merges' collectives)
    iters: int     # programs per timed loop
    reps: int      # timed loops (the median is reported)


def configs(smoke):
    if smoke:
        return [Config(name="CP decode B2 kv256", mode="cp", kind="decode", batch=2, kv_len=256, calls=2, iters=1,
                       reps=1),
                Config(name="CP prefill B1 S64", mode="cp", kind="prefill", batch=1, kv_len=64, calls=1, iters=1, reps=1),
                Config(name="CP rows prefill B1 S64", mode="cp_rows", kind="prefill", batch=1, kv_len=64, calls=1,
                       iters=1, reps=1),
                Config(name="TP decode B4 kv64", mode="tp", kind="decode", batch=4, kv_len=64, calls=2, iters=1, reps=1),
                Config(name="TP prefill B2 S32", mode="tp", kind="prefill", batch=2, kv_len=32, calls=1, iters=1,
                       reps=1),
                Config(name="CP ragged decode B2 kv256", mode="cp_ragged", kind="decode", batch=2, kv_len=256,
                       calls=2, iters=1, reps=1),
                Config(name="CP ragged prefill B1 S64", mode="cp_ragged", kind="prefill", batch=1, kv_len=64, calls=1,
                       iters=1, reps=1),
                Config(name="CP MLA decode B2 kv256", mode="cp_mla", kind="decode", batch=2, kv_len=256, calls=2,
                       iters=1, reps=1)]
    return [Config(name="CP decode B8 kv131072", mode="cp", kind="decode", batch=8, kv_len=131072, calls=10,
                   iters=3, reps=7),
            Config(name="CP prefill B1 S65536", mode="cp", kind="prefill", batch=1, kv_len=65536, calls=1, iters=2,
                   reps=5),
            Config(name="CP rows prefill B1 S65536", mode="cp_rows", kind="prefill", batch=1, kv_len=65536, calls=1,
                   iters=2, reps=5),
            Config(name="TP decode B64 kv4096", mode="tp", kind="decode", batch=64, kv_len=4096, calls=10, iters=5,
                   reps=7),
            Config(name="TP prefill B4 S8192", mode="tp", kind="prefill", batch=4, kv_len=8192, calls=1, iters=5,
                   reps=7),
            Config(name="CP ragged decode B8 kv131072", mode="cp_ragged", kind="decode", batch=8, kv_len=131072,
                   calls=10, iters=3, reps=7),
            Config(name="CP ragged prefill B1 S65536", mode="cp_ragged", kind="prefill", batch=1, kv_len=65536,
                   calls=1, iters=2, reps=5),
            Config(name="CP MLA decode B8 kv131072", mode="cp_mla", kind="decode", batch=8, kv_len=131072, calls=10,
                   iters=3, reps=7)]


def _wrapper(cfg, hq, hkv, pages, capacities, smoke, impl):
    """The decode or causal prefill wrapper (capacities: the fixed shapes CP's stacked plans need;
    impl: the prefill kernel, as the wrapper's impl=)."""
    ctas = 8 if smoke else None
    rows = cfg.batch if cfg.kind == "decode" else cfg.batch * cfg.kv_len
    caps = dict(max_batch_size=cfg.batch, max_num_pages=pages) if capacities else {}
    if cfg.kind == "decode":
        return ji.BatchDecodeWithPagedKVCache(hq, hkv, D, PAGE, num_ctas=ctas, **caps)
    if capacities:
        caps["max_num_tokens"] = rows
    return ji.BatchPrefillWithPagedKVCache(hq, hkv, D, PAGE, causal=True, num_ctas=ctas, impl=impl, **caps)


def _qo_indptr(cfg):
    """int32[B+1] (prefill: whole prompts) or None (decode)."""
    return None if cfg.kind == "decode" else (np.arange(cfg.batch + 1) * cfg.kv_len).astype(np.int32)


def _plan(w, cfg, table, num_pages):
    if cfg.kind == "decode":
        return w.plan(*table, num_pages=num_pages)
    return w.plan(_qo_indptr(cfg), *table, num_pages=num_pages, q_data_type="bfloat16")


def _cp_table(batch, kv_len, n, qo_indptr, causal, page=PAGE):
    """A page table allocated device by device along split_page_table's balanced shares (by keys,
    or by causal work): request pages [b_k, b_k+1) get ids from device k's block of N pages.
    Returns ((kv_indptr, kv_indices, kv_last_page_len), N)."""
    npages = -(-kv_len // page)
    indptr = (np.arange(batch + 1) * npages).astype(np.int32)
    last = np.full(batch, kv_len - (npages - 1) * page, np.int32)
    plain = sharding.split_page_table(indptr, np.arange(batch * npages, dtype=np.int32), last, page, n,
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


def _table(cfg, n, rng):
    """(page table, num_pages, pages per device or None): CP tables device by device (_cp_table),
    TP and one-device tables a random permutation of the pages."""
    if cfg.mode != "tp":
        table, per = _cp_table(cfg.batch, cfg.kv_len, n, _qo_indptr(cfg), cfg.kind == "prefill")
        return table, n * per, per
    npages = -(-cfg.kv_len // PAGE)
    table = ((np.arange(cfg.batch + 1) * npages).astype(np.int32), rng.permutation(cfg.batch * npages).astype(np.int32),
             np.full(cfg.batch, cfg.kv_len - (npages - 1) * PAGE, np.int32))
    return table, cfg.batch * npages, None


@functools.partial(jax.jit, static_argnames="num_pages")
def _physical(k_logical, v_logical, indices, num_pages):
    """The cache whose page indices[j] holds logical page j (request-major order): every table of
    a config sees the same K/V, so the one-device output is every row's reference."""
    shape = (num_pages,) + k_logical.shape[1:]
    return ji.PagedKVCache(jnp.zeros(shape, DTYPE).at[indices].set(k_logical),
                           jnp.zeros(shape, DTYPE).at[indices].set(v_logical))


@jax.jit
def _rel_err(got, want):
    diff = (got.astype(jnp.float32) - want.astype(jnp.float32)).ravel()
    return jnp.linalg.norm(diff) / jnp.linalg.norm(want.astype(jnp.float32).ravel())


@jax.jit
def _dense(q, k, v, seen):
    """float32 attention of query rows q [R, Hq, D] over k, v [L, Hkv, D]; row r sees keys < seen[r]."""
    qg = q.astype(jnp.float32).reshape(q.shape[0], HKV, HQ // HKV, D)
    s = jnp.einsum("rhgd,lhd->rhgl", qg, k.astype(jnp.float32), precision="highest") * D ** -0.5
    s = jnp.where(jnp.arange(k.shape[0]) < seen[:, None, None, None], s, -jnp.inf)
    o = jnp.einsum("rhgl,lhd->rhgd", jax.nn.softmax(s, axis=-1), v.astype(jnp.float32), precision="highest")
    return o.reshape(q.shape)


def _spot_check(cfg, q, out, k_logical, v_logical):
    """Largest o relative error of the first and last request's checked rows against _dense:
    decode its one row; prefill its first 4 and last 12 queries (query i sees keys <= i)."""
    npages = -(-cfg.kv_len // PAGE)
    worst = 0.0
    for r in sorted({0, cfg.batch - 1}):
        keys = k_logical[r * npages:(r + 1) * npages].reshape(-1, HKV, D)[:cfg.kv_len]
        values = v_logical[r * npages:(r + 1) * npages].reshape(-1, HKV, D)[:cfg.kv_len]
        if cfg.kind == "decode":
            rows, seen = np.array([r]), np.array([cfg.kv_len])
        else:
            pos = np.concatenate([np.arange(4), np.arange(cfg.kv_len - 12, cfg.kv_len)])
            rows, seen = r * cfg.kv_len + pos, pos + 1
        want = _dense(q[rows], keys, values, jnp.asarray(seen, jnp.int32))
        worst = max(worst, float(_rel_err(out[rows], want)))
    return worst


def _runner(cfg, n, table, num_pages, per, cache, qs, smoke, impl, merge="auto"):
    """(attention fn of (q, cache, plan), its args (qs [calls, T, Hq, D], cache, plan) placed for
    the first n devices, kernel names, the device-local fn of the same args for CP on several
    devices (o [n, T, Hq, D] unmerged) or None)."""
    devices = np.asarray(jax.devices()[:n])
    if n == 1:  # the plain wrapper on one device
        w = _wrapper(cfg, HQ, HKV, num_pages, False, smoke, impl)
        plan = _plan(w, cfg, table, num_pages)
        return w.run, (qs, cache, plan), plan.impl, None
    if cfg.mode == "tp":
        mesh = jax.sharding.Mesh(devices, ("tp",))
        hs = sharding.split_heads(HQ, HKV, n)
        w = _wrapper(cfg, hs.num_qo_heads, hs.num_kv_heads, num_pages, False, smoke, impl)
        plan = _plan(w, cfg, table, num_pages)
        c = sharding.replicate_kv_heads(cache, hs.kv_replicas) if hs.kv_replicas > 1 else cache
        args = (jax.device_put(qs, NamedSharding(mesh, P(None, *sharding.head_spec("tp")))),
                jax.device_put(c, NamedSharding(mesh, sharding.cache_spec("NHD", tp_axis="tp"))),
                jax.device_put(plan, NamedSharding(mesh, P())))
        return sharding.head_parallel(w, mesh), args, plan.impl, None
    mesh = jax.sharding.Mesh(devices, ("cp",))
    if cfg.mode == "cp_rows":  # each device's rows whole: no partial states to time apart
        split = sharding.split_queries(_qo_indptr(cfg), *table, PAGE, n, pages_per_shard=per)
        w = ji.BatchPrefillWithPagedKVCache(HQ, HKV, D, PAGE, causal=True, num_ctas=8 if smoke else None, impl=impl,
                                            max_batch_size=split.max_requests, max_num_tokens=split.max_tokens,
                                            max_num_pages=split.max_pages)
        plan = sharding.context_plan(w, split, num_pages=num_pages, q_data_type="bfloat16")
        args = (jax.device_put(qs, NamedSharding(mesh, P())),
                jax.device_put(cache, NamedSharding(mesh, sharding.cache_spec("NHD", cp_axis="cp"))),
                jax.device_put(plan, NamedSharding(mesh, P("cp"))))
        return sharding.context_parallel(w, mesh), args, plan.plan.impl, None
    split = sharding.split_page_table(*table, PAGE, n, qo_indptr=_qo_indptr(cfg), pages_per_shard=per)
    w = _wrapper(cfg, HQ, HKV, max(int(t[0][-1]) for t in split.tables), True, smoke, impl)
    dtype = {} if cfg.kind == "decode" else {"q_data_type": "bfloat16"}
    plan = sharding.context_plan(w, split, num_pages=num_pages, **dtype)
    args = (jax.device_put(qs, NamedSharding(mesh, P())),
            jax.device_put(cache, NamedSharding(mesh, sharding.cache_spec("NHD", cp_axis="cp"))),
            jax.device_put(plan, NamedSharding(mesh, P("cp"))))
    kernels = " + ".join(p.impl for p in (plan.full, plan.diag) if p is not None)
    partial = sharding.context_partial_states(w, mesh)
    return (sharding.context_parallel(w, mesh, merge=merge), args, kernels,
            lambda q, c, p: partial(q, c, p).o)


def _program(run, calls, chained):
    """jit of (qs, cache, plan) -> [run(qs[i], cache, plan) for i < calls]. chained: call i's q
    waits for call i - 1's output (adds 0 x one of its elements; XLA keeps x * 0 for floats), so
    that the calls' collectives stay apart, as they are in a real step."""
    def program(qs, cache, plan):
        outs = []
        for i in range(calls):
            q = qs[i] + 0 * outs[-1][0, 0, 0] if chained and outs else qs[i]
            outs.append(run(q, cache, plan))
        return outs
    return jax.jit(program)


def _ragged_row(cfg, n, table, num_pages, cache, qs, k_logical, v_logical, smoke, merge):
    """ragged_paged_attention (n = 1) or context_parallel_ragged over n devices: (program of
    (qs, keys, values, cache, *meta) making cfg.calls chained calls, the cache threaded and
    donated, its args placed). The step's keys / values are the cache's own rows at the new
    positions (decode: each request's last token; prefill: every token), so the write leaves the
    K/V as they were and every device count attends the same values."""
    npages = -(-cfg.kv_len // PAGE)
    q_lens = np.ones(cfg.batch, np.int32) if cfg.kind == "decode" else np.full(cfg.batch, cfg.kv_len, np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    decode = cfg.batch if cfg.kind == "decode" else 0
    meta = (np.full(cfg.batch, cfg.kv_len, np.int32), table[1], cu, np.array([decode, cfg.batch, cfg.batch], np.int32))
    rows = k_logical.reshape(cfg.batch, npages * PAGE, HKV, D)[:, cfg.kv_len - q_lens[0]:cfg.kv_len]
    keys = rows.reshape(-1, HKV, D)
    values = v_logical.reshape(cfg.batch, npages * PAGE, HKV, D)[:, cfg.kv_len - q_lens[0]:cfg.kv_len].reshape(-1, HKV, D)
    ctas = 8 if smoke else None
    if n == 1:
        run = functools.partial(ji.ragged_paged_attention, num_ctas=ctas)
        args = (qs, keys, values, cache) + tuple(jnp.asarray(x) for x in meta)
    else:
        mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:n]), ("cp",))
        run = sharding.context_parallel_ragged(mesh, num_ctas=ctas, merge=merge)
        rep = NamedSharding(mesh, P())
        args = (jax.device_put(qs, rep), jax.device_put(keys, rep), jax.device_put(values, rep),
                jax.device_put(cache, NamedSharding(mesh, sharding.cache_spec("NHD", cp_axis="cp")))) + tuple(
            jax.device_put(jnp.asarray(x), rep) for x in meta)

    def many(qs, keys, values, cache, *meta):
        outs = []
        for i in range(cfg.calls):
            q = qs[i] + 0 * outs[-1][0, 0, 0] if outs else qs[i]
            o, cache = run(q, keys, values, cache, *meta)
            outs.append(o)
        return outs, cache
    return jax.jit(many, donate_argnums=(3,)), args


def _mla_shapes(smoke):
    """(heads, ckv width, kpe width, page size): DeepSeek-V3's 128 heads, 512 + 64, page 64."""
    return (8, 64, 16, 4) if smoke else (128, 512, 64, 64)


def _mla_data(cfg, smoke):
    """Random bf16 q_nope [calls, B, H, Dc], q_pe [calls, B, H, Dr] and the logical latent pages
    [B x pages, page, Dc] and [.., Dr] (request-major)."""
    h, dc, dr, page = _mla_shapes(smoke)
    npages = -(-cfg.kv_len // page)
    keys = jax.random.split(jax.random.key(1), 4)
    return (jax.random.normal(keys[0], (cfg.calls, cfg.batch, h, dc), DTYPE),
            jax.random.normal(keys[1], (cfg.calls, cfg.batch, h, dr), DTYPE),
            jax.random.normal(keys[2], (cfg.batch * npages, page, dc), DTYPE),
            jax.random.normal(keys[3], (cfg.batch * npages, page, dr), DTYPE))


@functools.partial(jax.jit, static_argnames="scale")
def _dense_mla(q_nope, q_pe, ckv, kpe, scale):
    """float32 MLA of one request's rows q_nope [H, Dc], q_pe [H, Dr] over all of ckv [L, Dc], kpe [L, Dr]."""
    f = lambda x: x.astype(jnp.float32)  # noqa: E731
    s = (jnp.einsum("hc,lc->hl", f(q_nope), f(ckv), precision="highest")
         + jnp.einsum("hr,lr->hl", f(q_pe), f(kpe), precision="highest")) * scale
    return jnp.einsum("hl,lc->hc", jax.nn.softmax(s, axis=-1), f(ckv), precision="highest")


def _mla_row(cfg, n, want, data, smoke, merge):
    """BatchMLAPagedAttention decode on one device, or under context_parallel over n devices (the
    latent caches page-sharded): (program of (q_nope, q_pe, ckv, kpe, plan) making cfg.calls
    chained calls, its args placed, kernels)."""
    h, dc, dr, page = _mla_shapes(smoke)
    q_nope, q_pe, ckv_logical, kpe_logical = data
    table, per = _cp_table(cfg.batch, cfg.kv_len, n, None, False, page)
    num_pages = n * per
    place = jax.jit(lambda x, idx: jnp.zeros((num_pages,) + x.shape[1:], DTYPE).at[idx].set(x))
    ckv, kpe = place(ckv_logical, jnp.asarray(table[1])), place(kpe_logical, jnp.asarray(table[1]))
    kv = np.full(cfg.batch, cfg.kv_len, np.int32)
    rows = np.arange(cfg.batch + 1, dtype=np.int32)
    opts = dict(sm_scale=MLA_SCALE, config=ji.MLAConfig(num_cells=8) if smoke else None)
    if n == 1:
        w = ji.BatchMLAPagedAttention(h, dc, dr, page, **opts)
        plan = w.plan(rows, table[0], table[1], kv, num_pages=num_pages)
        run, args = w.run, (q_nope, q_pe, ckv, kpe, plan)
    else:
        mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:n]), ("cp",))
        split = sharding.split_page_table(*table, page, n, pages_per_shard=per)
        w = ji.BatchMLAPagedAttention(h, dc, dr, page, max_batch_size=cfg.batch, max_num_tokens=cfg.batch,
                                      max_num_pages=max(int(t[0][-1]) for t in split.tables), **opts)
        plan = sharding.context_plan(w, split, num_pages=num_pages)
        run = sharding.context_parallel(w, mesh, merge=merge)
        pages = NamedSharding(mesh, P("cp", None, None))
        args = (jax.device_put(q_nope, NamedSharding(mesh, P())), jax.device_put(q_pe, NamedSharding(mesh, P())),
                jax.device_put(ckv, pages), jax.device_put(kpe, pages), jax.device_put(plan, NamedSharding(mesh, P("cp"))))
        plan = plan.full

    def program(q_nope, q_pe, ckv, kpe, plan):
        outs = []
        for i in range(cfg.calls):
            chain = 0 * outs[-1][0, 0, 0] if outs else 0
            outs.append(run(q_nope[i] + chain, q_pe[i], ckv, kpe, plan))
        return outs
    return jax.jit(program), args, plan.impl


def _mla_check(cfg, data, got, smoke):
    """Largest o relative error of the first and last request against _dense_mla."""
    h, dc, dr, page = _mla_shapes(smoke)
    q_nope, q_pe, ckv_logical, kpe_logical = data
    npages = -(-cfg.kv_len // page)
    worst = 0.0
    for r in sorted({0, cfg.batch - 1}):
        ckv = ckv_logical[r * npages:(r + 1) * npages].reshape(-1, dc)[:cfg.kv_len]
        kpe = kpe_logical[r * npages:(r + 1) * npages].reshape(-1, dr)[:cfg.kv_len]
        worst = max(worst, float(_rel_err(got[r], _dense_mla(q_nope[0, r], q_pe[0, r], ckv, kpe, MLA_SCALE))))
    return worst


def _time_threaded(fn, args, iters, reps):
    """Median seconds per program of fn(*args) -> (outs, cache), the cache (args[3]) fed back."""
    args = list(args)
    for _ in range(2):
        outs, args[3] = fn(*args)
    jax.block_until_ready(outs)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(iters):
            outs, args[3] = fn(*args)
        jax.block_until_ready((outs, args[3]))
        ts.append((time.perf_counter() - t) / iters)
    return float(np.median(ts))


def _row(cfg, n, want, qs, k_logical, v_logical, rng, smoke, impl, merge="auto"):
    """One device count's row (checked, then timed: cfg.calls attention calls in one jitted
    program, one per q of qs) and the output of qs[0]. CP on several devices: also the
    device-local part alone (local_ms) and the merge (merge, merge_ms)."""
    row = dict(config=cfg.name, devices=n, device=jax.devices()[0].device_kind, calls=cfg.calls)
    if cfg.mode == "cp_mla":  # (qs: the MLA data, _mla_data)
        f, args, row["kernels"] = _mla_row(cfg, n, want, qs, smoke, merge)
        t = time.perf_counter()
        got = jax.block_until_ready(f(*args))[0]
        row["first_call_s"] = time.perf_counter() - t
        if want is None:
            row["check"], row["rel_err"] = "vs float32 dense MLA, first and last request", _mla_check(cfg, qs, got, smoke)
        else:
            row["check"], row["rel_err"] = "vs one device", float(_rel_err(jax.device_put(got, want.sharding), want))
        if not row["rel_err"] <= 2e-2:
            raise RuntimeError(f"o relative error {row['rel_err']:.2e} > 2e-2 ({row['check']})")
        row["ms"] = bench(f, *args, iters=cfg.iters, reps=cfg.reps) / cfg.calls * 1e3
        return row, got
    table, num_pages, per = _table(cfg, n, rng)
    cache = _physical(k_logical, v_logical, jnp.asarray(table[1]), num_pages)
    local = None
    if cfg.mode == "cp_ragged":
        f, args = _ragged_row(cfg, n, table, num_pages, cache, qs, k_logical, v_logical, smoke, merge)
        row["kernels"] = "ragged_paged_attention" if n == 1 else "context_parallel_ragged"
        t = time.perf_counter()
        outs, cache = f(*args)
        args = args[:3] + (cache,) + args[4:]
        got = jax.block_until_ready(outs)[0]
    else:
        run, args, row["kernels"], local = _runner(cfg, n, table, num_pages, per, cache, qs, smoke, impl, merge)
        f = _program(run, cfg.calls, chained=cfg.mode != "tp")
        t = time.perf_counter()
        got = jax.block_until_ready(f(*args))[0]
    row["first_call_s"] = time.perf_counter() - t  # compile included
    if want is None:
        row["check"] = "vs float32 dense, first and last request"
        row["rel_err"] = _spot_check(cfg, qs[0], got, k_logical, v_logical)
    else:
        row["check"] = "vs one device"
        row["rel_err"] = float(_rel_err(jax.device_put(got, want.sharding), want))
    if not row["rel_err"] <= 2e-2:
        raise RuntimeError(f"o relative error {row['rel_err']:.2e} > 2e-2 ({row['check']})")
    if cfg.mode == "cp_ragged":
        row["ms"] = _time_threaded(f, args, cfg.iters, cfg.reps) / cfg.calls * 1e3
    else:
        row["ms"] = bench(f, *args, iters=cfg.iters, reps=cfg.reps) / cfg.calls * 1e3
    if local is not None:
        row["merge"] = (sharding.merge_choice(n, DTYPE, got.size * got.dtype.itemsize) if merge == "auto"
                        else merge)
        row["merge_option"] = merge
        f_local = _program(local, cfg.calls, chained=False)  # (no collectives to keep apart)
        row["local_ms"] = bench(f_local, *args, iters=cfg.iters, reps=cfg.reps) / cfg.calls * 1e3
        row["merge_ms"] = row["ms"] - row["local_ms"]
    return row, got


def run_config(cfg, smoke, impl, emit, merge="auto"):
    """Every device count of cfg, one device first (the reference); emit(row) after each, errors
    included (a failed one-device row ends the config: nothing to check the others against)."""
    npages = -(-cfg.kv_len // PAGE)
    rows = cfg.batch if cfg.kind == "decode" else cfg.batch * cfg.kv_len
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    if cfg.mode == "cp_mla":
        qs, k_logical, v_logical = _mla_data(cfg, smoke), None, None
    else:
        qs = jax.random.normal(kq, (cfg.calls, rows, HQ, D), DTYPE)               # [calls, T, Hq, D]
        k_logical = jax.random.normal(kk, (cfg.batch * npages, PAGE, HKV, D), DTYPE)  # [B * pages, page, Hkv, D]
        v_logical = jax.random.normal(kv, (cfg.batch * npages, PAGE, HKV, D), DTYPE)
    rng = np.random.default_rng(0)
    want, base = None, None
    for n in [n for n in (1, 2, 4) if n <= len(jax.devices())]:
        try:
            row, got = _row(cfg, n, want, qs, k_logical, v_logical, rng, smoke, impl, merge)
            if want is None:
                want, base = got, row["ms"]
            row.update(speedup=base / row["ms"], efficiency=base / row["ms"] / n)
        except Exception as err:  # noqa: BLE001  (recorded; the next device count still runs)
            row = dict(config=cfg.name, devices=n, error=f"{type(err).__name__}: {err}"[:2000])
        emit(row)
        if want is None:
            return


def _write(path, rows):
    with open(path, "w") as fh:
        json.dump(dict(jax=jax.__version__, rows=rows), fh, indent=1)


def _isolated(cfgs, args):
    """Runs each config in a child process of this script; returns every row (failures too)."""
    rows, start = [], time.perf_counter()
    for cfg in cfgs:
        left = args.budget_s - (time.perf_counter() - start)
        if left < 10:
            rows.append(dict(config=cfg.name, error=f"skipped: --budget-s {args.budget_s:.0f} s spent"))
            continue
        part = f"{args.out}.part"
        if os.path.exists(part):
            os.remove(part)
        cmd = [sys.executable, os.path.abspath(__file__), "--only", cfg.name, "--out", part,
               "--prefill-impl", args.prefill_impl, "--merge", args.merge] + (["--smoke"] if args.smoke else [])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        timeout = min(args.row_timeout_s, left)
        try:
            rc = subprocess.run(cmd, env=env, timeout=timeout).returncode
            failure = None if rc == 0 else f"process exited with {rc}"
        except subprocess.TimeoutExpired:
            failure = f"timed out after {timeout:.0f} s"
        if os.path.exists(part):  # the rows the child finished
            with open(part) as fh:
                rows += json.load(fh)["rows"]
            os.remove(part)
        if failure:
            rows.append(dict(config=cfg.name, error=failure))
        _write(args.out, rows)
    return rows


def _table_text(rows):
    """The speedup / efficiency table, then one line per failure."""
    counts = sorted({r["devices"] for r in rows if "ms" in r})
    kinds = sorted({r["device"] for r in rows if "device" in r})
    lines = [f"{', '.join(kinds) or 'no device'}: time per call, speedup and efficiency against one device",
             f"{'config':<24}" + "".join(f"{f'{n} dev ms':>12}{'speedup':>9}{'eff':>7}" for n in counts)]
    for name in dict.fromkeys(r["config"] for r in rows):
        timed = {r["devices"]: r for r in rows if r["config"] == name and "ms" in r}
        cells = [(f"{timed[n]['ms']:>12.3f}{timed[n]['speedup']:>9.2f}{timed[n]['efficiency']:>7.2f}"
                  if n in timed else f"{'-':>12}{'-':>9}{'-':>7}") for n in counts]
        lines.append(f"{name:<24}" + "".join(cells))
    split = [r for r in rows if "local_ms" in r]
    if split:
        lines.append("CP breakdown: the call = device-local part (every device's partial state) + merge")
        lines += [f"{r['config']:<24}{r['devices']:>2} dev {r['ms']:>10.3f} ms = local {r['local_ms']:>10.3f}"
                  f" + merge {r['merge_ms']:>8.3f} ({r['merge']}" + (", auto" if r.get("merge_option") == "auto"
                                                                   else "") + ")" for r in split]
    lines += [f"FAILED {r['config']}" + (f" on {r['devices']}" if "devices" in r else "") + f": {r['error']}"
              for r in rows if "error" in r]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on 4 forced CPU devices")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_sharding.json"),
                    help="JSON of every row (default $OUT/bench_sharding.json)")
    ap.add_argument("--prefill-impl", default="auto", choices=("auto", "triton", "mosaic"),
                    help="the prefill rows' kernel on every device count (CP plans have fixed shapes, "
                         "which may pick another kernel than 'auto' does for one device)")
    ap.add_argument("--merge", default="auto", choices=sharding.MERGES,
                    help="the CP rows' merge (context_parallel(merge=)); auto: sharding.merge_choice")
    ap.add_argument("--only", default=None, help="comma-separated config name prefixes (e.g. 'CP decode')")
    ap.add_argument("--budget-s", type=float, default=330.0, help="start no config after this many seconds")
    ap.add_argument("--row-timeout-s", type=float, default=150.0, help="each config's process is killed after this")
    args = ap.parse_args(argv)
    cfgs = [c for c in configs(args.smoke)
            if not args.only or any(c.name.startswith(p.strip()) for p in args.only.split(","))]
    if len(cfgs) == 1:  # in this process
        rows = []

        def emit(row):
            rows.append(row)
            print(json.dumps(row), flush=True)
            _write(args.out, rows)
        run_config(cfgs[0], args.smoke, args.prefill_impl, emit, args.merge)
    else:
        rows = _isolated(cfgs, args)
    _write(args.out, rows)
    print("\n" + _table_text(rows), flush=True)
    return rows


if __name__ == "__main__":
    main()
