"""MLA on the GPU: BatchMLAPagedAttention beside FlashInfer 0.5.3's BatchMLAPagedAttentionWrapper.

    PYTHONPATH=. python3 benchmarks/bench_mla.py [--sweep] [--smoke] [--fp8]

Rows (bf16, ckv 512 + kpe 64, page 64, sm_scale 0.1352): decode 16 heads B64 kv4096 (and page 1),
128 heads B64 kv4096 and B16 kv8192, causal prefill 16 heads B4 S4096 (absorbed); then DeepSeek's
unabsorbed prefill, ragged causal attention with q / k of 192 and v / o of 128, 128 heads B4 S8192
(BatchPrefillWithRaggedKVCache head_dim_vo=128 beside FlashInfer's ragged wrapper). Each row is
checked against jaxinfer.reference.mla_reference first, then timed (median; `CALLS` calls per
program so host dispatch hides no GPU time). FlashInfer (fa3, fa2) runs on the same inputs through
DLPack when torch and flashinfer import (../shared/anchors/README.md), else its columns stay
blank. --sweep times MLAConfig variants; --smoke runs tiny shapes in interpret mode (CPU); --fp8
stores the latent cache in float8_e4m3fn (q bf16; ckv_scale = kpe_scale = 1, passed as data so the
scaled path runs; FlashInfer is asked for the same dtypes).
"""
import argparse
import dataclasses
import functools
import re
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")  # room for torch beside jax

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import bench, record, rel_err, save  # noqa: E402
import jaxinfer as ji  # noqa: E402
from jaxinfer.mla import BatchMLAPagedAttention  # noqa: E402
from jaxinfer.reference import mla_reference  # noqa: E402
from pallas_kernels.mla import MLAConfig  # noqa: E402

CKV, KPE, SCALE, CALLS = 512, 64, 0.1352337747812271, 10


@dataclasses.dataclass(frozen=True, kw_only=True)
class Row:
    name: str
    heads: int
    qo_lens: tuple
    kv_lens: tuple
    page_size: int = 64
    causal: bool = False


ROWS = (
    Row(name="decode H16 B64 kv4096", heads=16, qo_lens=(1,) * 64, kv_lens=(4096,) * 64),
    Row(name="decode H16 B64 kv4096 p1", heads=16, qo_lens=(1,) * 64, kv_lens=(4096,) * 64, page_size=1),
    Row(name="decode H128 B64 kv4096", heads=128, qo_lens=(1,) * 64, kv_lens=(4096,) * 64),
    Row(name="decode H128 B16 kv8192", heads=128, qo_lens=(1,) * 16, kv_lens=(8192,) * 16),
    Row(name="prefill H16 B4 S4096 causal", heads=16, qo_lens=(4096,) * 4, kv_lens=(4096,) * 4, causal=True),
)
SMOKE_ROWS = (
    Row(name="smoke decode H16 B3", heads=16, qo_lens=(1, 1, 1), kv_lens=(1, 130, 77), page_size=16),
    Row(name="smoke prefill H8 B2 causal", heads=8, qo_lens=(9, 4), kv_lens=(9, 40), page_size=16, causal=True),
)
PREFILL_192 = (Row(name="ragged prefill 192/128 H128 B4 S8192 causal", heads=128, qo_lens=(8192,) * 4,
                   kv_lens=(8192,) * 4, causal=True),)
SMOKE_PREFILL_192 = (Row(name="smoke ragged prefill 192/128 H4 B2 causal", heads=4, qo_lens=(40, 300),
                         kv_lens=(40, 300), causal=True),)
QK, VO = 192, 128
SWEEP = (MLAConfig(), MLAConfig(num_stages=2), MLAConfig(num_stages=4, block_kv=32),
         MLAConfig(num_stages=3, block_kv=32), MLAConfig(num_warps=4), MLAConfig(num_warps=8),
         MLAConfig(num_cells=132), MLAConfig(num_cells=264), MLAConfig(block_rows=32), MLAConfig(block_rows=16))


def inputs(row, rng, cache_dtype=jnp.bfloat16):
    """(q_nope, q_pe, ckv, kpe) on the device (q bf16, the cache in cache_dtype) and the host page
    table (random page order)."""
    kv = np.asarray(row.kv_lens, np.int32)
    pages = -(-kv // row.page_size)
    n = int(pages.sum())
    kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    kv_indices = rng.permutation(n).astype(np.int32)
    qo_indptr = np.concatenate([[0], np.cumsum(row.qo_lens)]).astype(np.int32)
    t = int(qo_indptr[-1])
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 4)
    shapes = ((t, row.heads, CKV), (t, row.heads, KPE), (n, row.page_size, CKV), (n, row.page_size, KPE))
    arrays = [jax.random.normal(k, s, jnp.bfloat16) for k, s in zip(keys, shapes)]
    arrays[2:] = [x.astype(cache_dtype) for x in arrays[2:]]
    return arrays, (qo_indptr, kv_indptr, kv_indices, kv)


def work(row, itemsize=2):
    """(FLOPs, bytes of latent cache read once): 2 H (ckv + kpe + ckv) per visible key."""
    vis = sum(int(np.clip(np.arange(q) + (k - q) + 1, 0, k).sum()) if row.causal else q * k
              for q, k in zip(row.qo_lens, row.kv_lens))
    return 2 * row.heads * (CKV + KPE + CKV) * vis, int(np.sum(row.kv_lens)) * (CKV + KPE) * itemsize


def time_jaxinfer(row, arrays, table, config, want, backend, impl="auto"):
    mla = BatchMLAPagedAttention(row.heads, CKV, KPE, row.page_size, causal=row.causal, sm_scale=SCALE,
                                 config=config, backend=backend, impl=impl)
    if arrays[2].dtype.itemsize == 1:  # fp8: the scaled path, scales as data
        one = jnp.float32(1.0)
        run = functools.partial(mla.run, ckv_scale=one, kpe_scale=one)
    else:
        run = mla.run
    plan_for = functools.partial(mla.plan, *table, num_pages=arrays[2].shape[0], kv_dtype=arrays[2].dtype)
    plan = plan_for()
    start = time.perf_counter()
    for _ in range(10):
        plan = plan_for()
    plan_us = (time.perf_counter() - start) / 10 * 1e6
    o = jax.jit(run)(*arrays, plan)
    err = rel_err(o, want)
    qs = jnp.stack([arrays[0]] * CALLS)  # CALLS calls in one program
    many = jax.jit(lambda qs, q_pe, ckv, kpe, p: [run(qs[i], q_pe, ckv, kpe, p) for i in range(CALLS)])
    iters = 2 if backend == "interpret" else 20
    t = bench(many, qs, *arrays[1:], plan, iters=iters, reps=3 if backend == "interpret" else 7) / CALLS
    return t, err, dict(plan.info, plan_us=plan_us, impl=plan.impl)


class FlashInfer:
    """FlashInfer's MLA wrapper on jaxinfer's arrays (zero-copy through DLPack)."""

    def __init__(self):
        import flashinfer
        import torch
        self.torch, self.fi = torch, flashinfer
        self.ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def time(self, row, arrays, table, backend):
        torch = self.torch
        q_nope, q_pe, ckv, kpe = (torch.from_dlpack(x) for x in arrays)
        ints = [torch.as_tensor(a, device="cuda") for a in table]
        w = self.fi.mla.BatchMLAPagedAttentionWrapper(self.ws, backend=backend)
        kv_dtype = torch.float8_e4m3fn if arrays[2].dtype.itemsize == 1 else torch.bfloat16
        w.plan(ints[0], ints[1], ints[2], ints[3], row.heads, CKV, KPE, row.page_size, row.causal, SCALE,
               torch.bfloat16, kv_dtype)
        o = jnp.from_dlpack(w.run(q_nope, q_pe, ckv, kpe).contiguous())
        w.run(q_nope, q_pe, ckv, kpe)
        torch.cuda.synchronize()
        ts = []
        for _ in range(7):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                w.run(q_nope, q_pe, ckv, kpe)
            end.record()
            torch.cuda.synchronize()
            ts.append(start.elapsed_time(end) / 20 / 1e3)
        return float(np.median(ts)), o


def time_prefill_192(row, backend, fi):
    """The unabsorbed prefill row: (jaxinfer seconds, rel err of request 0's last 256 rows against
    jaxinfer.reference, {FlashInfer backend: seconds}, FLOPs, bytes of q, k, v and o)."""
    h, lens = row.heads, np.asarray(row.qo_lens)
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    t_all, s0 = int(indptr[-1]), int(lens[0])
    keys = jax.random.split(jax.random.key(1), 3)
    q, k, v = (jax.random.normal(key, (t_all, h, d), jnp.bfloat16) for key, d in zip(keys, (QK, QK, VO)))
    scale = 1.0 / np.sqrt(QK)
    pre = ji.BatchPrefillWithRaggedKVCache(h, h, QK, head_dim_vo=VO, causal=True, sm_scale=scale, backend=backend)
    plan = pre.plan(indptr, indptr)
    run = jax.jit(pre.run)
    n = min(256, s0)
    want = ji.reference.attention(q[s0 - n:s0], k[:s0], v[:s0], causal=True, sm_scale=scale).o
    err = rel_err(run(q, k, v, plan)[s0 - n:s0], want)
    reps = 3 if backend == "interpret" else 7
    t = bench(run, q, k, v, plan, iters=2 if backend == "interpret" else 10, reps=reps)
    pairs = float(np.sum(lens * (lens + 1) // 2))
    flops, nbytes = 2 * h * (QK + VO) * pairs, t_all * h * (2 * QK + 2 * VO) * 2
    fi_s = {}
    for fb in ("fa3", "fa2") if fi is not None else ():
        try:
            torch = fi.torch
            tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
            ti = torch.as_tensor(indptr, device="cuda")
            w = fi.fi.BatchPrefillWithRaggedKVCacheWrapper(fi.ws, "NHD", backend=fb)
            w.plan(ti, ti, h, h, QK, head_dim_vo=VO, causal=True, sm_scale=scale, q_data_type=torch.bfloat16)
            o = jnp.from_dlpack(w.run(tq, tk, tv).contiguous())
            ts = []
            for _ in range(reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(10):
                    w.run(tq, tk, tv)
                end.record()
                torch.cuda.synchronize()
                ts.append(start.elapsed_time(end) / 10 / 1e3)
            fi_s[fb] = float(np.median(ts))
            record("flashinfer_prefill_192", row=row.name, backend=fb, us=fi_s[fb] * 1e6,
                   TFLOPs=flops / fi_s[fb] / 1e12, rel_err=rel_err(o[s0 - n:s0], want))
        except Exception as e:
            record("flashinfer_prefill_192", row=row.name, backend=fb, error=f"{type(e).__name__}: {str(e)[:300]}")
    record("jaxinfer_prefill_192", row=row.name, impl=plan.impl, us=t * 1e6, TFLOPs=flops / t / 1e12, rel_err=err)
    return t, err, fi_s, flops, nbytes


def load_flashinfer():
    try:
        return FlashInfer()
    except Exception as e:  # no torch, no flashinfer, no GPU: the columns stay blank
        print(f"FlashInfer unavailable ({type(e).__name__}: {e}); its columns stay blank", flush=True)
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="time MLAConfig variants on every row")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
    ap.add_argument("--rows", default="", help="a regular expression: only the rows it matches")
    ap.add_argument("--no-flashinfer", action="store_true", help="jaxinfer alone")
    ap.add_argument("--fp8", action="store_true", help="the latent cache in float8_e4m3fn")
    ap.add_argument("--impls", default="auto", help="comma-separated impl= values to time (auto, mosaic, triton)")
    args = ap.parse_args()
    backend = "interpret" if args.smoke else None
    print("jax", jax.__version__, jax.devices(), flush=True)
    fi = None if args.smoke or args.no_flashinfer else load_flashinfer()
    rng = np.random.default_rng(0)
    table_rows = []
    for row in SMOKE_ROWS if args.smoke else ROWS:
        if not re.search(args.rows, row.name):
            continue
        arrays, table = inputs(row, rng, jnp.float8_e4m3fn if args.fp8 else jnp.bfloat16)
        flops, nbytes = work(row, 1 if args.fp8 else 2)
        want = jax.jit(lambda *a: mla_reference(*a, *table, causal=row.causal, sm_scale=SCALE).o)(*arrays)
        runs = []  # (seconds, rel err, impl and config) of each timed run
        for impl, config in [(i, c) for i in args.impls.split(",") for c in (SWEEP if args.sweep else (MLAConfig(),))]:
            try:
                t, err, info = time_jaxinfer(row, arrays, table, config, want, backend, impl)
            except Exception as e:  # a sweep config that does not compile (shared memory, registers)
                record("jaxinfer_mla", row=row.name, impl=impl, config=repr(config),
                       error=f"{type(e).__name__}: {str(e)[:300]}")
                continue
            record("jaxinfer_mla", row=row.name, impl=info["impl"], config=repr(config), us=t * 1e6, GBps=nbytes / t / 1e9,
                   TFLOPs=flops / t / 1e12, rel_err=err, items=info["num_items"], split_tiles=info["num_split"],
                   chunk=info["chunk"], plan_us=info["plan_us"])
            runs.append((t, err, f"{info['impl']} {config}"))
        fi_us = {}
        for fb in ("fa3", "fa2") if fi is not None else ():
            try:
                t, o = fi.time(row, arrays, table, fb)
                fi_us[fb] = t * 1e6
                record("flashinfer_mla", row=row.name, backend=fb, us=t * 1e6, GBps=nbytes / t / 1e9,
                       TFLOPs=flops / t / 1e12, rel_err=rel_err(o, want))
            except Exception as e:
                record("flashinfer_mla", row=row.name, backend=fb, error=f"{type(e).__name__}: {str(e)[:300]}")
        table_rows.append((row, runs, fi_us, flops, nbytes))
    for row in () if args.sweep or args.fp8 else SMOKE_PREFILL_192 if args.smoke else PREFILL_192:
        if re.search(args.rows, row.name):
            t, err, fi_s, flops, nbytes = time_prefill_192(row, backend, fi)
            table_rows.append((row, [(t, err, "ragged, Triton")], {b: x * 1e6 for b, x in fi_s.items()}, flops, nbytes))
    save(("mla_sweep" if args.sweep else "mla") + ("_fp8" if args.fp8 else ""))
    print("\n| row | jaxinfer µs | GB/s | TFLOP/s | rel err | FlashInfer fa3 µs | fa2 µs | config |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row, runs, fi_us, flops, nbytes in table_rows:
        fa = " | ".join(f"{fi_us[b]:.1f}" if b in fi_us else "" for b in ("fa3", "fa2"))
        for t, err, config in runs or [(float("nan"), float("nan"), None)]:
            print(f"| {row.name} | {t * 1e6:.1f} | {nbytes / t / 1e9:.0f} | {flops / t / 1e12:.1f} | {err:.1e} | "
                  f"{fa} | {config} |")


if __name__ == "__main__":
    main()
