"""Compiled (non-interpret) kernels against jaxinfer.reference on small random shapes.

    PYTHONPATH=. python3 benchmarks/check_gpu.py [bfloat16|float16|float32 ...]
    PYTHONPATH=. python3 benchmarks/check_gpu.py stale|fused  (the stale-slot check alone: NHD and
                                                            NHD_FUSED caches, or the latter only)
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer as ji
from benchmarks.common import random_paged_cache, rel_err
from jaxinfer import reference as ref

rng = np.random.default_rng(0)
print("jax", jax.__version__, jax.devices(), flush=True)
fails = 0


def report(name, err, tol):
    global fails
    ok = err is not None and err < tol
    fails += not ok
    print(f"{'ok  ' if ok else 'FAIL'} {name}: rel_err {err:.2e} (tol {tol})", flush=True)


def check_prefill(dtype, tol):
    """Batch prefill (paged, ragged, custom mask, split KV) and block-sparse attention, compiled."""
    qo, kv = np.array([37, 1, 130, 8]), np.array([97, 54, 600, 8])
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    cache, indptr, indices, last = random_paged_cache(rng, kv, 16, 2, 128, dtype, "HND", 3)
    q = jax.random.normal(jax.random.key(8), (qo_indptr[-1], 8, 128), dtype)
    for split in (None, 64):
        pre = ji.BatchPrefillWithPagedKVCache(8, 2, 128, 16, layout="HND", fixed_split_tokens=split)
        o = jax.jit(pre.run)(q, cache, pre.plan(qo_indptr, indptr, indices, last, num_pages=cache.num_pages))
        want = ref.paged_attention(q, cache, qo_indptr, indptr, indices, last, causal=True).o
        report(f"paged prefill {dtype.__name__} split={split}", rel_err(o, want), tol)
    k, v, kv_indptr = ref.gather_pages(cache, indptr, indices, last)
    mask = rng.random(int((qo * kv).sum())) < 0.5
    rag = ji.BatchPrefillWithRaggedKVCache(8, 2, 128, causal=False)
    o = jax.jit(rag.run)(q, k, v, rag.plan(qo_indptr, kv_indptr, custom_mask=mask))
    report(f"ragged prefill custom mask {dtype.__name__}",
           rel_err(o, ref.ragged_attention(q, k, v, qo_indptr, kv_indptr, custom_mask=mask).o), tol)
    for r, c in ((1, 16), (16, 4)):
        blocks = rng.random((128 // r, 256 // c)) < 0.25
        bsr = ji.BlockSparseMatrix(np.concatenate([[0], np.cumsum(blocks.sum(1))]).astype(np.int32),
                                   np.nonzero(blocks)[1].astype(np.int32), (r, c), (128, 256),
                                   rng.random((int(blocks.sum()), r, c)) < 0.8)
        qb = jax.random.normal(jax.random.key(9), (128, 8, 128), dtype)
        kb = jax.random.normal(jax.random.key(10), (256, 2, 128), dtype)
        bsa = ji.BlockSparseAttention(8, 2, 128)
        o = jax.jit(bsa.run)(qb, kb, kb, bsa.plan(bsr))
        report(f"block sparse R={r} C={c} {dtype.__name__}", rel_err(o, ref.block_sparse_attention(qb, kb, kb, bsr).o), tol)


def check_stale_slots(dtype, tol, layout="NHD"):
    """NaN in every V slot past kv_len (Inf in K's) and in unlisted pages: each path's output
    against the reference on the clean cache (bf16, Hq 32 / Hkv 8, page 16); layout NHD_FUSED: the
    same K/V as one array (also through the RPA v3 entry point, in place, and the decode wrapper)."""
    from benchmarks.common import rpa_inputs
    hq, hkv, d, page = 32, 8, 128, 16
    kv = np.array([1000, 37, 515, 700])
    cache, indptr, indices, last = random_paged_cache(rng, kv, page, hkv, d, dtype, "NHD", 3)
    kp, vp = np.array(cache.k_pages), np.array(cache.v_pages)
    for b in range(len(kv)):
        kp[indices[indptr[b + 1] - 1], last[b]:] = np.inf
        vp[indices[indptr[b + 1] - 1], last[b]:] = np.nan
    unlisted = np.setdiff1d(np.arange(cache.num_pages), indices[:indptr[-1]])
    kp[unlisted], vp[unlisted] = np.nan, np.nan
    bad = ji.PagedKVCache(jnp.asarray(kp), jnp.asarray(vp))
    if layout == "NHD_FUSED":
        bad = ji.PagedKVCache.fused(jnp.stack([bad.k_pages, bad.v_pages], axis=3))
        dec = ji.BatchDecodeWithPagedKVCache(hq, hkv, d, page, layout=layout)
        q = jax.random.normal(jax.random.key(9), (len(kv), hq, d), dtype)
        o = jax.jit(dec.run)(q, bad, dec.plan(indptr, indices, last, num_pages=cache.num_pages))
        report(f"stale slots {layout} decode", rel_err(o, ref.decode(q, cache, indptr, indices, last).o), tol)
    for name, qo in (("prompts", kv), ("mixed", np.array([1, 1, 37, 300]))):
        qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
        q = jax.random.normal(jax.random.key(8), (int(qo.sum()), hq, d), dtype)
        want = ref.paged_attention(q, cache, qo_indptr, indptr, indices, last, causal=True).o
        runs = []
        for impl in ("auto", "mosaic", "triton"):
            pre = ji.BatchPrefillWithPagedKVCache(hq, hkv, d, page, impl=impl, layout=layout)
            runs.append((f"prefill {impl}", pre, pre.plan(qo_indptr, indptr, indices, last,
                                                            num_pages=cache.num_pages)))
        for impl in ("auto", "mixed"):
            attn = ji.BatchAttention(hq, hkv, d, page, impl=impl, layout=layout)
            runs.append((f"BatchAttention {impl}", attn, attn.plan(
                qo_indptr, indptr, indices, last, num_pages=cache.num_pages, q_data_type=jnp.dtype(dtype).name)))
        for label, w, plan in runs:
            o = jax.jit(w.run)(q, bad, plan)
            nan_rows = int(np.isnan(np.asarray(o, np.float32)).any(axis=(1, 2)).sum())
            report(f"stale slots {layout} {name} {label} ({plan.impl}; {nan_rows} NaN rows)", rel_err(o, want), tol)
        if name == "mixed":
            keys, values, meta = rpa_inputs(cache, qo, kv, indptr, indices, page)
            for impl in ("auto", "mixed", "mosaic", "triton"):
                o, _ = jax.jit(lambda q, k, v, c, m: ji.ragged_paged_attention(q, k, v, c, *m, impl=impl))(
                    q, keys, values, bad, meta)
                nan_rows = int(np.isnan(np.asarray(o, np.float32)).any(axis=(1, 2)).sum())
                report(f"stale slots {layout} rpa {impl} ({nan_rows} NaN rows)", rel_err(o, want), tol)
            if layout == "NHD_FUSED":  # RPA v3's cache of the same K/V (no padding: in place)
                from jaxinfer.compat import tpu_inference
                rpa = jax.jit(lambda *a: tpu_inference.ragged_paged_attention(*a, sm_scale=d ** -0.5))
                o, _ = rpa(q, keys, values, bad.kv_pages.reshape(tpu_inference.kv_cache_shape(
                    bad.num_pages, page, hkv, d, dtype)), *meta)
                report(f"stale slots {layout} compat.tpu_inference", rel_err(o, want), tol)


DTYPES = ((jnp.bfloat16, 2e-2), (jnp.float16, 5e-3), (jnp.float32, 1e-5))
only = sys.argv[1:]  # optional dtype names, e.g. `check_gpu.py float32`; `stale`, `fused`: see the docstring
if only in (["stale"], ["fused"]):
    for layout in ("NHD", "NHD_FUSED")[only == ["fused"]:]:
        check_stale_slots(jnp.bfloat16, 2e-2, layout)
    only = ["none"]
for dtype, tol in DTYPES:
    if only and jnp.dtype(dtype).name not in only:
        continue
    check_prefill(dtype, tol)
    if dtype == jnp.bfloat16:
        check_stale_slots(dtype, tol)
        check_stale_slots(dtype, tol, "NHD_FUSED")
    for (hq, hkv, d, page, layout) in ((32, 8, 128, 16, "NHD"), (8, 1, 256, 5, "NHD")):
        lens = rng.integers(0, 700, 9)
        cache, indptr, indices, last = random_paged_cache(rng, lens, page, hkv, d, dtype, layout, 3)
        q = jax.random.normal(jax.random.key(2), (9, hq, d), dtype)
        for split in ((None, 2) if dtype == jnp.bfloat16 else (2,)):
            dec = ji.BatchDecodeWithPagedKVCache(hq, hkv, d, page, layout=layout, fixed_split_pages=split)
            plan = dec.plan(indptr, indices, last, num_pages=cache.num_pages)
            o, lse = jax.jit(lambda q, c, p: dec.run(q, c, p, return_lse=True))(q, cache, plan)
            r = ref.decode(q, cache, indptr, indices, last)
            report(f"decode {dtype.__name__} {hq}/{hkv} d{d} p{page} {layout} split={split}", rel_err(o, r.o), tol)
            fin = np.isfinite(np.asarray(r.lse))
            report("  lse", rel_err(np.asarray(lse)[fin], np.asarray(r.lse)[fin]), 1e-3 if dtype != jnp.float32 else 1e-5)
    q = jax.random.normal(jax.random.key(3), (37, 8, 128), dtype)
    k = jax.random.normal(jax.random.key(4), (97, 2, 128), dtype)
    v = jax.random.normal(jax.random.key(5), (97, 2, 128), dtype)
    for causal in (False, True):
        o = ji.single_prefill_with_kv_cache(q, k, v, causal=causal)
        report(f"single_prefill {dtype.__name__} causal={causal}", rel_err(o, ref.attention(q, k, v, causal=causal).o), tol)
    o = ji.single_decode_with_kv_cache(q[0], k, v)
    report(f"single_decode {dtype.__name__}", rel_err(o, ref.attention(q[:1], k, v).o[0]), tol)
    a = ji.AttentionState(q[:5].astype(jnp.float32), jax.random.normal(jax.random.key(6), (5, 8)))
    b = ji.AttentionState(q[5:10].astype(jnp.float32), jax.random.normal(jax.random.key(7), (5, 8)))
    report("merge_state", rel_err(ji.merge_state(a, b).o, ref.merge_state(a, b).o), 1e-5)
print("GPU CHECK", "FAILED" if fails else "PASSED", fails)
