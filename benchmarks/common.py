"""Shared helpers for the GPU benchmarks: timing, random paged caches, result records."""
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer as ji

RESULTS = []


def record(name, **kw):
    kw["name"] = name
    RESULTS.append(kw)
    print(json.dumps(kw), flush=True)


def save(stage):
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, f"jaxinfer_{stage}.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)


def bench(f, *args, iters=20, reps=7):
    """Median seconds per call over `reps` timed loops of `iters` calls (after warm-up)."""
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(iters):
            out = f(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t) / iters)
    return float(np.median(ts))


def per_call_us(step, calls, reps=7, iters=10):
    """Median µs per call over `reps` loops of `iters` steps (each step makes `calls` calls)."""
    jax.block_until_ready(step())
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(iters):
            out = step()
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t) / iters / calls)
    return float(np.median(ts)) * 1e6


def random_paged_cache(rng, kv_lens, page_size, num_kv_heads, head_dim, dtype, layout="NHD", extra_pages=0):
    """A cache with random values and random page order; returns (cache, indptr, indices, last)."""
    kv_lens = np.asarray(kv_lens)
    npages = -(-kv_lens // page_size)
    num_pages = int(npages.sum()) + extra_pages
    indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
    indices = rng.permutation(num_pages)[: indptr[-1]].astype(np.int32)
    last = np.where(npages > 0, kv_lens - (npages - 1) * page_size, 1).astype(np.int32)
    if layout == "NHD_FUSED":  # K and V in one array [num_pages, page_size, Hkv, 2, D]
        key = jax.random.key(int(rng.integers(1 << 30)))
        cache = ji.PagedKVCache.fused(jax.random.normal(key, (num_pages, page_size, num_kv_heads, 2, head_dim), dtype))
        return cache, indptr, indices, last
    shape = ((num_pages, page_size, num_kv_heads, head_dim) if layout == "NHD"
             else (num_pages, num_kv_heads, page_size, head_dim))
    key = jax.random.key(int(rng.integers(1 << 30)))
    k1, k2 = jax.random.split(key)
    cache = ji.PagedKVCache(jax.random.normal(k1, shape, dtype), jax.random.normal(k2, shape, dtype), layout)
    return cache, indptr, indices, last


def rpa_inputs(cache, q_lens, kv_lens, indptr, indices, page_size):
    """ragged_paged_attention's inputs for a step over a paged cache (CSR page table indptr /
    indices, decode sequences first): (keys, values [T, Hkv, D], the cache's own rows at the new
    tokens' positions, so a call leaves every key's row unchanged; meta: (kv_lens, page_indices,
    cu_q_lens, distribution) on the device)."""
    s = len(q_lens)
    npages = np.diff(indptr)
    pages_per_seq = int(npages.max())
    page_indices = np.zeros((s, pages_per_seq), np.int32)
    for i in range(s):
        page_indices[i, :npages[i]] = indices[indptr[i]:indptr[i + 1]]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    pos = np.concatenate([np.arange(kv - q, kv) for q, kv in zip(q_lens, kv_lens)])
    seq = np.repeat(np.arange(s), q_lens)
    pages, slots = page_indices[seq, pos // page_size], pos % page_size
    keys, values = cache.k_pages[pages, slots], cache.v_pages[pages, slots]  # [T, Hkv, D]
    n_decode = int(np.sum(np.cumprod(q_lens == 1)))
    meta = (jnp.asarray(kv_lens, jnp.int32), jnp.asarray(page_indices.reshape(-1)), jnp.asarray(cu),
            jnp.asarray([n_decode, n_decode, s], jnp.int32))
    return keys, values, meta


def rpa_written_cache(cache, q_lens, kv_lens, indptr, indices, page_size):
    """The cache a ragged_paged_attention call on rpa_inputs' step leaves (an NHD cache): the
    same rows, and V zeroed past kv_len in the last page of each sequence with query rows."""
    v = cache.v_pages
    for b, (q, kv) in enumerate(zip(q_lens, kv_lens)):
        if q > 0 and kv % page_size:
            v = v.at[indices[indptr[b + 1] - 1], kv % page_size:].set(0)
    return ji.PagedKVCache(cache.k_pages, v)


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def dense_decode_reference(q, cache, indptr, indices, kv_lens, sm_scale):
    """Decode attention in float32 over pages gathered into a padded dense batch (NHD caches;
    vectorized, so it checks large GPU batches quickly). Returns o [B, Hq, D] float32."""
    batch, hq, d = q.shape
    npages = np.diff(indptr)
    table = np.zeros((batch, max(int(npages.max()), 1)), np.int32)
    for b in range(batch):
        table[b, :npages[b]] = indices[indptr[b]:indptr[b + 1]]
    k = cache.k_pages[table].reshape(batch, -1, cache.num_kv_heads, d).astype(jnp.float32)
    v = cache.v_pages[table].reshape(batch, -1, cache.num_kv_heads, d).astype(jnp.float32)
    qg = q.astype(jnp.float32).reshape(batch, cache.num_kv_heads, -1, d)
    s = jnp.einsum("bhgd,bthd->bhgt", qg, k, precision="highest") * sm_scale
    s = jnp.where(jnp.arange(k.shape[1]) < jnp.asarray(kv_lens)[:, None, None, None], s, -jnp.inf)
    o = jnp.einsum("bhgt,bthd->bhgd", jax.nn.softmax(s, axis=-1), v, precision="highest")
    return o.reshape(batch, hq, d)


def kernel_times(f, *args, iters=10, trace_dir=None):
    """Device time per call of each kernel f launches (µs, costliest first) and the busy time (union
    of device intervals), from a perfetto trace of `iters` calls after warm-up. XLA turns CUDA
    graphs off while tracing, so launch gaps are wider than untraced."""
    import collections
    import glob
    import gzip
    import tempfile
    jax.block_until_ready(f(*args))
    trace_dir = trace_dir or tempfile.mkdtemp()
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(iters):
            out = f(*args)
        jax.block_until_ready(out)
    path = max(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True),
               key=os.path.getmtime)
    with gzip.open(path) as fh:
        trace = json.load(fh)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = [e for e in events if e.get("ph") == "X" and e.get("dur") is not None
              and "GPU" in procs.get(e["pid"], "")]
    per_kernel = collections.Counter()
    for e in device:
        per_kernel[e["name"][:70]] += e["dur"] / iters
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in device)
    busy, end = 0.0, -np.inf
    for s, e in spans:
        if e > end:
            busy += e - max(s, end)
            end = e
    return per_kernel.most_common(), busy / iters
