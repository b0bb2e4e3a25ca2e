"""GPU regression suite: a fixed table of rows, each checked against a float32 reference and
timed, compared with the checked-in baseline benchmarks/baselines/h100.json.

On the device machine (the repo root is the cwd; jax 0.11.2 with CUDA; one H100):

    PYTHONPATH=. python3 benchmarks/regress.py --json $OUT/regress.json
    PYTHONPATH=. python3 benchmarks/regress.py --update --commit <sha>     # rewrite the baseline
    PYTHONPATH=. python3 benchmarks/regress.py --rows 'cascade|q4'         # a subset (regex)

Two trees (a change and its base) on one machine, alternating: benchmarks/ab.py.

The device copy has no .git: give --commit (`git rev-parse HEAD` here) with --update, then
copy $OUT's baseline back (--update --baseline $OUT/h100.json writes it there). --update with
--rows rewrites only those rows, each with its own commit and date; the header keeps the run
the other rows came from.
With FlashInfer 0.5.3 beside (wheels installed into /tmp/site as ../shared/anchors/README.md
says; its first call of each kernel JIT-compiles, minutes in all on a fresh machine):

    PYTHONPATH=.:/tmp/site python3 benchmarks/regress.py --flashinfer --json $OUT/regress.json

CPU smoke run (every row, interpret mode, tiny shapes; checks the script end to end):

    PYTHONPATH=. python3 benchmarks/regress.py --smoke

Each row: correctness first (outputs poisoned, fresh random inputs, no NaN anywhere, rel_err of
sampled requests of the first and last call against jaxinfer.reference in float32 on the
device), then the median over rounds of µs per call. Rows that take microseconds run `calls`
independent calls in one jitted program (host dispatch hidden), each with its own q and, where
one cache is under ROTATE_BYTES, its own cache copy (a layer), so L2 does not hold the inputs.
The table printed last marks rows more than 5% slower than the baseline; the exit code is 1
when any row errors, gives NaN or exceeds its rel_err tolerance.

Rows are data (ROWS): Row(name, builder, params). A new kernel family adds a builder that
returns a Case and its rows; --smoke shrinks every row's shapes through Env.
"""
import argparse
import dataclasses
import datetime
import json
import math
import os
import re
import subprocess
import sys
import time
from typing import Any, Callable, Optional

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINE = os.path.join(ROOT, "benchmarks", "baselines", "h100.json")
SLOWER = 1.05            # ratio now / baseline above which a row is marked SLOWER
ROTATE_BYTES = 256 << 20  # a row whose cache is smaller gets several copies (H100 L2: 50 MB)
CALLS = 10               # calls per timed program for rows of microseconds
ROUNDS = 7               # timing rounds (median); jaxinfer and FlashInfer alternate within each
ROUND_S = 0.03           # seconds per timing round
CHECK_ROWS = 256         # queries per sampled request in the reference check
SMOKE_TOKENS = 32        # --smoke: query, cached and prefix token counts are capped at this

jax = jnp = ji = ref = V = None  # imported by _import_jax(), after argument parsing


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- rows as data


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of the suite: build(env, **params) -> Case; tol: the largest rel_err passing."""
    name: str
    build: Callable
    params: tuple = ()  # (key, value) pairs, at full (GPU) size
    tol: float = 2e-2


def row(name, build, tol=2e-2, **params):
    return Row(name, build, tuple(params.items()), tol)


@dataclasses.dataclass
class Case:
    """A built row. run() enqueues `calls` kernel calls and returns their outputs (one per call);
    check(i, o) is the rel_err of call i's output o against the float32 reference."""
    run: Callable[[], list]
    calls: int
    check: Optional[Callable[[int, Any], float]]
    flops: float = 0.0                      # per call; > 0: TFLOP/s is reported
    info: dict = dataclasses.field(default_factory=dict)
    flashinfer: Optional[Callable] = None   # (FlashInfer helper) -> run() with the same contract
    host: bool = False                      # run() is host work (plan()), timed call by call


class Env:
    """Run-wide settings: full GPU shapes, or --smoke's tiny ones (interpret mode on the CPU);
    also the compiled-function memo that lets rows with equal shapes share programs."""

    def __init__(self, smoke):
        self.smoke = smoke
        self.calls = 1 if smoke else CALLS
        self.rounds = 1 if smoke else ROUNDS
        self._memo = {}

    def memo(self, key, make):
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def heads(self, hq, hkv):
        """(Hq, Hkv); smoke: (4, 2) for every row, so rows share compiled programs."""
        return (4, 2) if self.smoke else (hq, hkv)

    def count(self, n):
        return 2 if self.smoke else n

    def tokens(self, n):
        return min(n, SMOKE_TOKENS) if self.smoke else n

    def lens(self, segs):
        """segs ((count, qo_len, kv_len or (lo, hi) uniform), ...) -> (qo_lens, kv_lens); each
        range drawn from its own default_rng(0). Smoke caps the new and the cached tokens."""
        qo, kv = [], []
        for count, q, k in segs:
            count = self.count(count)
            k = (np.random.default_rng(0).integers(k[0], k[1] + 1, count) if isinstance(k, tuple)
                 else np.full(count, k))
            q_small = self.tokens(q)
            qo.append(np.full(count, q_small))
            kv.append(q_small + np.array([self.tokens(int(c)) for c in k - q]))
        return np.concatenate(qo), np.concatenate(kv)

    def wrapper_kw(self):
        """A small grid in interpret mode (it runs the grid serially)."""
        return {"num_ctas": 8} if self.smoke else {}


def _indptr(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def causal_pairs(qo_lens, kv_lens):
    """Visible (query, key) pairs of bottom-right causal attention, bench_prefill's convention
    (qo * kv - qo^2 / 2 per request: S^2 / 2 for qo = kv = S)."""
    qo, kv = np.asarray(qo_lens, np.float64), np.asarray(kv_lens, np.float64)
    return float(np.sum(qo * kv - qo * qo / 2))


def window_pairs(S, w):
    """Visible pairs of causal self-attention of length S with window_left w (bench_variants)."""
    return float(np.minimum(np.arange(S) + 1, w + 1).sum())


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _reference(env, sm_scale, variant=None, k_scale=None, v_scale=None):
    """f(qs, call, start, k, v, sel, params, n=, kv_len=, paged=) -> float32 o [n, Hq, D] of
    queries qs[call, start:start + n] over kv_len keys: pages k[sel] of a paged cache (paged=True)
    or rows sel:sel + kv_len of ragged k/v; jaxinfer.reference.attention, causal, in float32 and
    jitted (slices and gathers inside, so each shape compiles once)."""
    def f(qs, call, start, k, v, sel, params, *, n, kv_len, paged):
        q = jax.lax.dynamic_slice_in_dim(qs[call], start, n).astype(jnp.float32)
        if paged:
            k, v = (x[sel].reshape(-1, *x.shape[2:])[:kv_len] for x in (k, v))
        else:
            k, v = (jax.lax.dynamic_slice_in_dim(x, sel, kv_len) for x in (k, v))
        return ref.attention(q, k, v, causal=True, sm_scale=sm_scale, variant=variant, params=params,
                             k_scale=k_scale, v_scale=v_scale).o
    return env.memo(("reference", sm_scale, variant, k_scale, v_scale),
                    lambda: jax.jit(f, static_argnames=("n", "kv_len", "paged")))


def _host(o):
    """An output as float32 NumPy."""
    return np.asarray(o).astype(np.float32)


def _random(env, seed, shape, dtype):
    """Standard normal values (never zeros) in dtype, drawn on the device (fp8 through bfloat16);
    smoke draws them with NumPy (a jax.random program per shape costs seconds to compile on the CPU)."""
    if env.smoke:
        return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32), dtype)
    x = jax.random.normal(jax.random.key(seed), shape, jnp.bfloat16 if jnp.dtype(dtype).itemsize == 1 else dtype)
    return x.astype(dtype)


# ----------------------------------------------------------------------------- paged rows


def build_paged(env, segs, wrapper, hq=32, hkv=8, head_dim=128, page=16, dtype="bfloat16",
                kv_scale=None, prefix=0, cascade=None, fi=None, told_dtypes=False, pad_rows=0, capacities=False,
                layout="NHD"):
    """Attention over a paged cache (layout NHD, or NHD_FUSED: RPA v3's K and V in one array),
    pages in random order.

    segs: request lengths (Env.lens; kv counts every token, prefix included); prefix: tokens
    (whole pages) every request shares before its own; wrapper: "decode"
    (BatchDecodeWithPagedKVCache), "prefill" (BatchPrefillWithPagedKVCache, causal) or
    "attention" (ji.BatchAttention where it exists, else the prefill wrapper); cascade: plan()'s
    cascade argument; kv_scale: (k_scale, v_scale) for fp8 pages; fi: FlashInfer's counterpart
    ("decode", "cascade", "prefill", "attention"); told_dtypes: plan() gets q_data_type (as
    FlashInfer's plan() does), which lets BatchAttention choose the mixed launch. pad_rows (rpa
    only): padding rows after the step's tokens, as an engine's token buckets leave (checked 0).
    capacities: the wrapper gets max_batch_size, max_num_tokens and max_num_pages (the step's own):
    plans of one structure for every step."""
    hq, hkv = env.heads(hq, hkv)
    prefix = env.tokens(prefix)
    qo_lens, kv_lens = env.lens(segs)
    kv_lens = kv_lens + prefix
    batch, tokens = len(qo_lens), int(qo_lens.sum())
    dtype = jnp.dtype(dtype)
    rng = np.random.default_rng(1)
    # Page table: `pre` shared pages, then each request's own, all in random order.
    pre = prefix // page
    own = -(-(kv_lens - prefix) // page)
    perm = rng.permutation(pre + int(own.sum())).astype(np.int32)
    starts = pre + np.concatenate([[0], np.cumsum(own)])
    indices = np.concatenate([np.concatenate([perm[:pre], perm[starts[b]:starts[b + 1]]])
                              for b in range(batch)]).astype(np.int32)
    indptr, qo_indptr = _indptr(pre + own), _indptr(qo_lens)
    last = (kv_lens - (pre + own - 1) * page).astype(np.int32)
    num_pages = len(perm)
    layer_bytes = 2 * num_pages * page * hkv * head_dim * dtype.itemsize
    calls = env.calls if tokens < 16384 else 1
    layers = min(calls, max(1, -(-ROTATE_BYTES // layer_bytes)))
    if env.smoke:
        layers = 1
    shape = (num_pages, page, hkv, head_dim)
    caches = [ji.PagedKVCache(_random(env, 10 + 2 * i, shape, dtype), _random(env, 11 + 2 * i, shape, dtype))
              for i in range(layers)]
    if layout == "NHD_FUSED":  # the same K and V, interleaved in one array [P, page, Hkv, 2, D]
        caches = [ji.PagedKVCache.fused(jnp.stack([c.k_pages, c.v_pages], axis=3)) for c in caches]
    qs = _random(env, 9, (calls, tokens + pad_rows, hq, head_dim), jnp.bfloat16)  # [calls, T, Hq, D]

    run_kw = {} if kv_scale is None else {"k_scale": kv_scale[0], "v_scale": kv_scale[1]}
    if wrapper == "rpa":
        run, cache_of = _rpa_run(env, qs, caches, qo_lens, kv_lens, indptr, indices, page, pad_rows)
        name, plan, sm_scale = "ragged_paged_attention", None, 1.0 / math.sqrt(head_dim)
    else:
        kw = env.wrapper_kw() | ({} if layout == "NHD" else {"layout": layout})
        if capacities:
            kw.update(max_batch_size=batch, max_num_tokens=tokens, max_num_pages=num_pages)
        name = wrapper
        if wrapper == "decode":
            cls = ji.BatchDecodeWithPagedKVCache
        else:
            cls = ji.BatchPrefillWithPagedKVCache
            kw["causal"] = True
            if wrapper == "attention" and hasattr(ji, "BatchAttention"):
                cls = ji.BatchAttention
            name = cls.__name__
        key = ("paged", cls.__name__, hq, hkv, head_dim, page, calls, layers, tuple(sorted(run_kw.items())),
               tuple(sorted(kw.items())))
        w = env.memo(key + ("wrapper",), lambda: cls(hq, hkv, head_dim, page, **kw))
        plan_kw = {"num_pages": num_pages} | ({"cascade": cascade} if cascade else {}) | (
            {"q_data_type": dtype.name} if told_dtypes else {})
        if wrapper == "decode":
            plan = w.plan(indptr, indices, last, **plan_kw)
        else:
            plan = w.plan(qo_indptr, indptr, indices, last, **plan_kw)

        def make():
            return jax.jit(lambda qs, caches, plan: [
                w.run(qs[i], caches[i % len(caches)], plan, **run_kw) for i in range(qs.shape[0])])
        fn = env.memo(key + ("run",), make)
        run, sm_scale = (lambda: fn(qs, caches, plan)), w.sm_scale

        def cache_of(i):
            return caches[i % layers]
    reference = _reference(env, sm_scale, k_scale=run_kw.get("k_scale"), v_scale=run_kw.get("v_scale"))
    sample = sorted({0, batch - 1})

    def check(i, o):
        o, got, want = _host(o), [], []
        if np.any(o[tokens:] != 0):  # padding rows give 0
            return math.inf
        for b in sample:
            n = min(int(qo_lens[b]), CHECK_ROWS)
            start = int(qo_indptr[b + 1]) - n
            cache = cache_of(i)
            want.append(np.asarray(reference(qs, i, start, cache.k_pages, cache.v_pages,
                                             indices[indptr[b]:indptr[b + 1]], None, n=n,
                                             kv_len=int(kv_lens[b]), paged=True)))
            got.append(o[start:start + n])
        return rel_err(np.concatenate(got), np.concatenate(want))

    flashinfer = None
    if fi is not None:
        def flashinfer(F):
            common = dict(qs=qs, caches=caches, hq=hq, hkv=hkv, head_dim=head_dim, page=page)
            if fi == "cascade":
                levels, _ = ji.two_level_cascade(np.arange(batch + 1, dtype=np.int32), indptr, indices,
                                                 last, page, causal=False)
                return F.cascade(levels=levels, **common)
            if fi == "decode":
                return F.decode(indptr=indptr, indices=indices, last=last, kv_scale=kv_scale, **common)
            if fi == "attention":
                return F.attention(qo_indptr=qo_indptr, indptr=indptr, indices=indices, kv_lens=kv_lens,
                                   **common)
            return F.paged_prefill(qo_indptr=qo_indptr, indptr=indptr, indices=indices, last=last,
                                   **common)

    info = {"wrapper": name, "plan": type(plan).__name__ if plan is not None else None,
            "plan_impl": getattr(plan, "impl", None),
            "batch": batch, "tokens": tokens, "kv_tokens": int(kv_lens.sum()), "layers": layers,
            "hq": hq, "hkv": hkv, "head_dim": head_dim, "dtype": dtype.name}
    flops = 4 * head_dim * hq * causal_pairs(qo_lens, kv_lens) if qo_lens.max() >= 64 else 0.0
    return Case(run=run, calls=calls, check=check, flops=flops, info=info, flashinfer=flashinfer)


def _rpa_run(env, qs, caches, qo_lens, kv_lens, indptr, indices, page, pad_rows=0):
    """(run, cache_of) of ji.ragged_paged_attention over the caches, call i on cache i % layers:
    each call writes its tokens' K/V as the cache already holds them (common.rpa_inputs), so
    every output is checked against the cache as built; one jitted program of all calls, the
    caches donated from run to run (cache_of(i): call i's cache as it is now)."""
    from benchmarks.common import rpa_inputs
    if np.any(np.diff((qo_lens > 1).astype(int)) < 0):
        raise ValueError("rpa rows list their decode segments (q_len 1) first")
    layers = len(caches)
    inputs = [rpa_inputs(c, qo_lens, kv_lens, indptr, indices, page) for c in caches]
    new_kv = [tuple(jnp.pad(x, ((0, pad_rows), (0, 0), (0, 0))) for x in inp[:2]) for inp in inputs]  # [T, Hkv, D]
    meta = inputs[0][2]
    kw = env.wrapper_kw()

    def calls(qs, new_kv, caches, meta):
        caches, outs = list(caches), []
        for i in range(len(qs)):
            k, v = new_kv[i % layers]
            o, caches[i % layers] = ji.ragged_paged_attention(qs[i], k, v, caches[i % layers], *meta, **kw)
            outs.append(o)
        return outs, caches

    fn = jax.jit(calls, donate_argnums=2)
    state = {"caches": caches}

    # Each call's q its own array, as a layer's projection gives it. A slice of qs inside the
    # program costs ragged_paged_attention a copy in front of its kernel, which BatchAttention's
    # own q fusion absorbs (H100, decode first: 366.2 against 350.0 µs).
    q_each = [qs[i] for i in range(qs.shape[0])]

    def run():
        outs, state["caches"] = fn(q_each, new_kv, state["caches"], meta)
        return outs
    return run, lambda i: state["caches"][i % layers]


def build_plan(env, segs, page=16, hq=32, hkv=8, head_dim=128):
    """Host latency of BatchDecodeWithPagedKVCache.plan() (with the copy to the device)."""
    hq, hkv = env.heads(hq, hkv)
    _, kv_lens = env.lens(segs)
    npages = -(-kv_lens // page)
    indptr = _indptr(npages)
    indices = np.random.default_rng(1).permutation(int(indptr[-1])).astype(np.int32)
    last = (kv_lens - (npages - 1) * page).astype(np.int32)
    dec = ji.BatchDecodeWithPagedKVCache(hq, hkv, head_dim, page, **env.wrapper_kw())

    def run():
        return [jax.block_until_ready(dec.plan(indptr, indices, last, num_pages=int(indptr[-1])))]
    return Case(run=run, calls=1, check=None, host=True, info={"batch": len(kv_lens)})


# ----------------------------------------------------------------------------- MLA rows

MLA_CKV, MLA_KPE, MLA_SCALE = 512, 64, 0.1352337747812271  # DeepSeek-V3's latent widths and scale


def build_mla(env, segs, heads, page=64, causal=False):
    """BatchMLAPagedAttention over a paged latent cache (ckv 512 + kpe 64, bf16, pages in random
    order); FlashInfer's BatchMLAPagedAttentionWrapper (fa3) beside it. Requests 0 and B - 1 are
    checked against jaxinfer.reference.mla_reference."""
    heads = 8 if env.smoke else heads
    qo_lens, kv_lens = (x.astype(np.int32) for x in env.lens(segs))
    batch, tokens = len(qo_lens), int(qo_lens.sum())
    pages = -(-kv_lens // page)
    indptr, qo_indptr = _indptr(pages), _indptr(qo_lens)
    num_pages = int(indptr[-1])
    indices = np.random.default_rng(1).permutation(num_pages).astype(np.int32)
    calls = env.calls if tokens < 16384 else 1
    ckv, kpe = (_random(env, seed, (num_pages, page, d), jnp.bfloat16)
                for seed, d in ((10, MLA_CKV), (11, MLA_KPE)))
    qn, qp = (_random(env, seed, (calls, tokens, heads, d), jnp.bfloat16)
              for seed, d in ((8, MLA_CKV), (9, MLA_KPE)))
    w = ji.BatchMLAPagedAttention(heads, MLA_CKV, MLA_KPE, page, causal=causal, sm_scale=MLA_SCALE)
    plan = w.plan(qo_indptr, indptr, indices, kv_lens, num_pages=num_pages)
    fn = jax.jit(lambda qn, qp, ckv, kpe, plan: [w.run(qn[i], qp[i], ckv, kpe, plan) for i in range(calls)])

    def check(i, o):
        got, want = [], []
        for b in sorted({0, batch - 1}):
            qs, qe = int(qo_indptr[b]), int(qo_indptr[b + 1])
            want.append(ref.mla_reference(qn[i, qs:qe], qp[i, qs:qe], ckv, kpe, [0, qe - qs],
                                          indptr[b:b + 2] - indptr[b], indices[indptr[b]:indptr[b + 1]],
                                          kv_lens[b:b + 1], causal=causal, sm_scale=MLA_SCALE).o)
            got.append(_host(o)[qs:qe])
        return rel_err(np.concatenate(got), np.concatenate([_host(x) for x in want]))

    def flashinfer(F):
        return F.mla(qn, qp, ckv, kpe, qo_indptr, indptr, indices, kv_lens, heads, page, causal, MLA_SCALE)

    vis = causal_pairs(qo_lens, kv_lens) if causal else float(np.dot(qo_lens, kv_lens))
    info = {"wrapper": "BatchMLAPagedAttention", "plan_impl": plan.impl, "batch": batch, "tokens": tokens,
            "kv_tokens": int(kv_lens.sum()), "heads": heads, "page": page, "split_tiles": plan.info["num_split"]}
    return Case(run=lambda: fn(qn, qp, ckv, kpe, plan), calls=calls, check=check,
                flops=2 * heads * (2 * MLA_CKV + MLA_KPE) * vis, info=info, flashinfer=flashinfer)


# ----------------------------------------------------------------------------- sampling rows


def build_sampling(env, op, batch, vocab):
    """One draw per row from float32 logits ~ 3 N(0, 1) (or their softmax), `calls` draws per
    program, each from its own input buffer (L2 cold). The check is the fraction of drawn tokens
    the reference's filters drop (0 passes)."""
    from benchmarks import bench_sampling
    from jaxinfer import sampling as S
    kind, call, filters, fi_call = bench_sampling.OPS[op]
    batch, vocab = (2, 1000) if env.smoke else (batch, vocab)
    logits = _random(env, 12, (batch, vocab), jnp.float32) * 3
    x = logits if kind == "logits" else jax.nn.softmax(logits, axis=-1)
    xs = [jnp.array(x, copy=True) for _ in range(env.calls)]
    keys = jax.random.split(jax.random.key(3), env.calls)
    fn = jax.jit(lambda xs, keys: [call(xi, k) for xi, k in zip(xs, keys)])
    kept = np.asarray(S._reference_probs(x, **filters)) > 0  # [B, V]

    def check(i, o):
        return float(np.mean(~kept[np.arange(batch), np.asarray(o)]))

    def flashinfer(F):
        return F.sampling(fi_call[0], xs, fi_call[1])

    return Case(run=lambda: fn(xs, keys), calls=env.calls, check=check, flashinfer=flashinfer,
                info={"op": op, "batch": batch, "vocab": vocab})


# ----------------------------------------------------------------------------- ragged rows


def _variant(name, window):
    if name is None:
        return None, None
    if name == "soft_cap":
        return V.soft_cap(), {"logits_soft_cap": jnp.float32(30.0)}
    if name == "window":
        return V.sliding_window(), {"window_left": jnp.int32(window)}
    raise ValueError(f"unknown variant {name!r}")


def build_ragged(env, batch, seq, hq, hkv, head_dim=128, variant=None, window=1024):
    """Causal self-attention over ragged (contiguous) K/V: batch requests of seq tokens;
    variant "soft_cap" (30) or "window" (window_left, planned with plan(window_left=))."""
    hq, hkv = env.heads(hq, hkv)
    batch, seq = env.count(batch), env.tokens(seq)
    window = min(window, seq // 4) if env.smoke else window
    var, params = _variant(variant, window)
    indptr = _indptr(np.full(batch, seq))
    qs = _random(env, 3, (1, batch * seq, hq, head_dim), jnp.bfloat16)  # [1, B S, Hq, D]
    k = _random(env, 4, (batch * seq, hkv, head_dim), jnp.bfloat16)     # [B S, Hkv, D]
    v = _random(env, 5, (batch * seq, hkv, head_dim), jnp.bfloat16)
    key = ("ragged", hq, hkv, head_dim, var)
    pre = env.memo(key + ("wrapper",), lambda: ji.BatchPrefillWithRaggedKVCache(
        hq, hkv, head_dim, causal=True, variant=var, **env.wrapper_kw()))
    plan = pre.plan(indptr, indptr, **({"window_left": window} if variant == "window" else {}))
    fn = env.memo(key + ("run",), lambda: jax.jit(
        lambda qs, k, v, plan, params: [pre.run(qs[0], k, v, plan, variant_params=params)]))
    reference = _reference(env, pre.sm_scale, variant=var)

    def check(i, o):
        o, got, want = _host(o), [], []
        n = min(seq, CHECK_ROWS)
        for b in sorted({0, batch - 1}):
            start = (b + 1) * seq - n
            want.append(np.asarray(reference(qs, 0, start, k, v, b * seq, params, n=n, kv_len=seq,
                                             paged=False)))
            got.append(o[start:start + n])
        return rel_err(np.concatenate(got), np.concatenate(want))

    pairs = batch * (window_pairs(seq, window) if variant == "window" else causal_pairs([seq], [seq]))

    def flashinfer(F):
        return F.ragged(q=qs[0], k=k, v=v, indptr=indptr, hq=hq, hkv=hkv, head_dim=head_dim,
                        soft_cap=30.0 if variant == "soft_cap" else None,
                        window_left=window if variant == "window" else -1)

    info = {"plan": type(plan).__name__, "plan_impl": getattr(plan, "impl", None), "batch": batch,
            "seq": seq, "hq": hq, "hkv": hkv, "head_dim": head_dim, "variant": variant}
    return Case(run=lambda: fn(qs, k, v, plan, params), calls=1, check=check,
                flops=4 * head_dim * hq * pairs, info=info, flashinfer=flashinfer)


# ----------------------------------------------------------------------------- the table

SUFFIX = 128  # cascade rows: each request's own tokens after the shared prefix


def _decode(batch, kv, **kw):
    return dict(segs=((batch, 1, kv),), wrapper="decode", fi="decode", **kw)


def _cascade(batch, prefix, mode):
    return dict(segs=((batch, 1, SUFFIX),), prefix=prefix, wrapper="decode",
                cascade="auto" if mode == "auto" else None, fi="cascade" if mode == "auto" else "decode")


ROWS = [
    row("decode B64 kv4096", build_paged, **_decode(64, 4096)),
    row("decode B128 kv2048", build_paged, **_decode(128, 2048)),
    row("decode B16 kv1024", build_paged, **_decode(16, 1024)),
    row("decode B1 kv32768", build_paged, **_decode(1, 32768)),
    row("decode B64 kv U[512,4096]", build_paged, **_decode(64, (512, 4096))),
    # The e2e benchmark's batch 16 (U[512, 2048] + 64): contiguous cells (planner "auto").
    row("decode B16 kv U[576,2112]", build_paged, **_decode(16, (576, 2112))),
    row("decode fp8e4m3 B64 kv4096", build_paged, tol=3e-2,
        **_decode(64, 4096, dtype="float8_e4m3fn", kv_scale=(0.9, 1.1))),
    row("decode d64 B64 kv4096", build_paged, **_decode(64, 4096, head_dim=64)),
    row("decode d256 B64 kv4096", build_paged, **_decode(64, 4096, head_dim=256)),
    row("ragged d64 B4 S8192 32/8", build_ragged, batch=4, seq=8192, hq=32, hkv=8, head_dim=64),
    row("ragged d256 B4 S8192 16/8", build_ragged, batch=4, seq=8192, hq=16, hkv=8, head_dim=256),
    *[row(f"{kind} B{b} S{s} {hq}/{hkv}", build_paged if kind == "paged" else build_ragged,
          **(dict(segs=((b, s, s),), hq=hq, hkv=hkv, wrapper="prefill", fi="prefill") if kind == "paged"
             else dict(batch=b, seq=s, hq=hq, hkv=hkv)))
      for kind in ("paged", "ragged") for b, s, hq, hkv in ((16, 4096, 16, 16), (4, 8192, 32, 8),
                                                             (1, 16384, 32, 8))],
    row("ragged softcap30 B16 S4096 16/16", build_ragged, batch=16, seq=4096, hq=16, hkv=16,
        variant="soft_cap"),
    row("ragged window1024 B16 S4096 16/16", build_ragged, batch=16, seq=4096, hq=16, hkv=16,
        variant="window"),
    *[row(f"cascade {mode} B{b} prefix{p}", build_paged, **_cascade(b, p, mode))
      for b, p in ((16, 8192), (64, 8192), (64, 32768)) for mode in ("single", "auto")],
    row("q4 B64 kv4096", build_paged, segs=((64, 4, 4096),), wrapper="prefill",
        fi="attention"),
    row("q4 B64 kv4096 BatchAttention", build_paged, segs=((64, 4, 4096),), wrapper="attention",
        fi="attention"),
    row("q4 B64 kv4096 ragged_paged_attention", build_paged, segs=((64, 4, 4096),), wrapper="rpa",
        fi="attention"),
    row("q8 B64 kv4096 BatchAttention", build_paged, segs=((64, 8, 4096),), wrapper="attention",
        fi="attention"),  # speculative verify of 8 tokens
    row("q8 B64 kv4096 ragged_paged_attention", build_paged, segs=((64, 8, 4096),), wrapper="rpa",
        fi="attention"),
    row("decode B64 kv4096 BatchAttention", build_paged, segs=((64, 1, 4096),), wrapper="attention",
        fi="attention"),
    row("decode B64 kv U[512,8192] BatchAttention", build_paged, segs=((64, 1, (512, 8192)),),
        wrapper="attention", fi="attention"),  # skewed lengths: the split-KV balance
    row("decode B64 kv U[512,8192] ragged_paged_attention", build_paged, segs=((64, 1, (512, 8192)),),
        wrapper="rpa", fi="attention"),
    row("decode B64 kv4096 ragged_paged_attention", build_paged, segs=((64, 1, 4096),), wrapper="rpa",
        fi="attention"),
    *[row(f"{name} BatchAttention capacities", build_paged, segs=segs, wrapper="attention", fi="attention",
          capacities=True)
      for name, segs in (("decode B64 kv4096", ((64, 1, 4096),)), ("q4 B64 kv4096", ((64, 4, 4096),)),
                         ("mixed 4x512/2048 + 60 decode", ((4, 512, 2048), (60, 1, (512, 4096)))))],
    row("paged B4 S8192 32/8 BatchAttention", build_paged, segs=((4, 8192, 8192),), wrapper="attention",
        fi="attention"),
    row("mixed 4x512/2048 + 60 decode", build_paged, segs=((4, 512, 2048), (60, 1, (512, 4096))),
        wrapper="attention", fi="attention"),
    row("mixed 4x512/2048 + 60 decode BatchAttention told bf16", build_paged,
        segs=((4, 512, 2048), (60, 1, (512, 4096))), wrapper="attention", fi="attention", told_dtypes=True),
    row("q4 x60 + 4x512/2048 BatchAttention told bf16", build_paged,
        segs=((60, 4, (512, 4096)), (4, 512, 2048)), wrapper="attention", fi="attention", told_dtypes=True),
    row("q4 x60 + 4x512/2048 ragged_paged_attention", build_paged,
        segs=((60, 4, (512, 4096)), (4, 512, 2048)), wrapper="rpa", fi="attention"),
    row("mixed 4x512/2048 + 60 decode ragged_paged_attention (decode first)", build_paged,
        segs=((60, 1, (512, 4096)), (4, 512, 2048)), wrapper="rpa", fi="attention"),
    row("mixed 4x512/2048 + 60 decode ragged_paged_attention (decode first, 2560 rows)", build_paged,
        segs=((60, 1, (512, 4096)), (4, 512, 2048)), wrapper="rpa", pad_rows=452),
    row("mixed 4x512/2048 + 60 decode BatchAttention told bf16 (decode first)", build_paged,
        segs=((60, 1, (512, 4096)), (4, 512, 2048)), wrapper="attention", fi="attention", told_dtypes=True),
    row("mixed 4x512/2048 + 60 decode prefill-wrapper", build_paged,
        segs=((4, 512, 2048), (60, 1, (512, 4096))), wrapper="prefill", fi="attention"),
    row("append 512 onto 3584 B8", build_paged, segs=((8, 512, 4096),), wrapper="prefill", fi="prefill"),
    row("plan decode B64 kv4096", build_plan, segs=((64, 1, 4096),)),
    # Multi-head latent attention (DeepSeek-V3 shapes).
    row("MLA decode H16 B64 kv4096", build_mla, segs=((64, 1, 4096),), heads=16),
    row("MLA decode H32 B64 kv4096", build_mla, segs=((64, 1, 4096),), heads=32),
    row("MLA decode H128 B64 kv4096", build_mla, segs=((64, 1, 4096),), heads=128),
    row("MLA decode H128 B16 kv8192", build_mla, segs=((16, 1, 8192),), heads=128),
    row("MLA prefill H16 B4 S4096 causal", build_mla, segs=((4, 4096, 4096),), heads=16, causal=True),
    # Sampling (jaxinfer.sampling against flashinfer.sampling): tol 1e-9, no token outside the kept set.
    *[row(f"{'' if op.startswith('sampling') else 'sampling '}{op} B{b} V{v}", build_sampling, tol=1e-9, op=op,
          batch=b, vocab=v)
      for op, b, v in (("top-p 0.9 from probs", 64, 128256), ("top-p 0.9 from probs", 1, 128256),
                       ("min-p 0.1 from probs", 64, 128256), ("top-k 50 + top-p 0.9 from logits", 64, 128256),
                       ("top-k 50 + top-p 0.9 from logits", 1, 128256), ("sampling from logits", 64, 128256))],
    # RPA v3's fused cache read in place (against the NHD rows of the same names).
    *[row(f"{name} NHD_FUSED", build_paged, segs=segs, wrapper=wrapper, layout="NHD_FUSED", **kw)
      for name, segs, wrapper, kw in (
          ("decode B64 kv4096 ragged_paged_attention", ((64, 1, 4096),), "rpa", {}),
          ("q4 B64 kv4096 ragged_paged_attention", ((64, 4, 4096),), "rpa", {}),
          ("mixed 4x512/2048 + 60 decode ragged_paged_attention (decode first)",
           ((60, 1, (512, 4096)), (4, 512, 2048)), "rpa", {}),
          ("mixed 4x512/2048 + 60 decode BatchAttention told bf16 (decode first)",
           ((60, 1, (512, 4096)), (4, 512, 2048)), "attention", {"told_dtypes": True}),
          ("paged B4 S8192 32/8", ((4, 8192, 8192),), "prefill", {}))],
]


# ----------------------------------------------------------------------------- measuring


def _poison(nbytes):
    """Fills and frees device memory with NaN, so outputs allocated next likely start as NaN."""
    x = jnp.full((max(nbytes, 2) // 2,), jnp.nan, jnp.bfloat16)
    x.block_until_ready()
    del x


def _correct(case, outs):
    """(rel_err over the first and last call, NaN seen)."""
    nan = any(bool(np.isnan(_host(o)).any()) for o in outs)
    err = max(case.check(i, outs[i]) for i in sorted({0, len(outs) - 1}))
    return err, nan


def _time_host(run, n):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        run()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def _time_loop(run, iters, sync):
    t = time.perf_counter()
    for _ in range(iters):
        out = run()
    sync(out)
    return (time.perf_counter() - t) / iters


def measure(spec, env, fi):
    """Builds, checks and times one row; returns its result record."""
    res = {"name": spec.name, "tol": spec.tol}
    t0 = time.perf_counter()
    case = spec.build(env, **dict(spec.params))
    res.update(info=case.info, calls=case.calls)
    if case.host:
        case.run()
        res["median_us"] = _time_host(case.run, 20 if env.smoke else 300) * 1e6
        res["rel_err"] = None
        return res
    if not env.smoke:
        _poison(2 * sum(o.nbytes for o in jax.block_until_ready(case.run())))
    outs = jax.block_until_ready(case.run())  # compiles on the first row of its shape
    res["compile_s"] = time.perf_counter() - t0
    res["rel_err"], res["nan"] = _correct(case, outs)
    del outs
    runners = {"jaxinfer": (case.run, jax.block_until_ready)}
    if fi is not None and case.flashinfer is not None:
        try:
            fi_run = case.flashinfer(fi)
            fi_outs = fi_run()
            res["fi_rel_err"], res["fi_nan"] = _correct(case, [fi.as_jax(o) for o in fi_outs])
            runners["flashinfer"] = (fi_run, fi.sync)
        except Exception as e:  # FlashInfer lacks the row or fails: its column stays blank
            res["fi_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    iters = {}
    for name, (run, sync) in runners.items():
        sync(run())
        est = _time_loop(run, 1, sync)
        iters[name] = 1 if env.smoke else max(1, min(100, round(ROUND_S / max(est, 1e-6))))
    ts = {name: [] for name in runners}
    for _ in range(env.rounds):  # interleaved: each round times every runner once
        for name, (run, sync) in runners.items():
            ts[name].append(_time_loop(run, iters[name], sync) / case.calls)
    res["median_us"] = float(np.median(ts["jaxinfer"])) * 1e6
    res["rounds_us"] = [t * 1e6 for t in ts["jaxinfer"]]
    if "flashinfer" in ts:
        res["fi_us"] = float(np.median(ts["flashinfer"])) * 1e6
    if case.flops:
        res["tflops"] = case.flops / (res["median_us"] * 1e-6) / 1e12
        if "fi_us" in res:
            res["fi_tflops"] = case.flops / (res["fi_us"] * 1e-6) / 1e12
    return res


# ----------------------------------------------------------------------------- baseline and table


def _commit(given):
    """--commit, else git's HEAD, marked "-dirty" when the tracked files differ from it (the
    device machine's copy can carry a .git older than its files)."""
    if given:
        return given
    try:
        git = dict(cwd=ROOT, capture_output=True, text=True, timeout=10)
        out = subprocess.run(["git", "rev-parse", "HEAD"], **git)
        if out.returncode:
            return "unknown"
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], **git).returncode != 0
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def status(res, base):
    """A row's mark: ERROR, BAD (NaN or rel_err over tolerance), SLOWER, faster, new or ''."""
    if "error" in res:
        return "ERROR"
    if res.get("nan") or (res.get("rel_err") is not None and not res["rel_err"] <= res["tol"]):
        return "BAD"
    b = (base or {}).get("median_us")
    if b is None:
        return "new"
    ratio = res["median_us"] / b
    return "SLOWER" if ratio > SLOWER else "faster" if ratio < 1 / SLOWER else ""


def _fmt(x, spec):
    return "" if x is None else format(x, spec)


def table(results, base_rows):
    head = ["row", "base us", "now us", "ratio", "TFLOP/s", "rel_err", "FI us", "FI TFLOP/s", "mark"]
    lines = []
    for r in results:
        b = (base_rows.get(r["name"]) or {}).get("median_us")
        now = r.get("median_us")
        ratio = now / b if b and now else None
        lines.append([r["name"], _fmt(b, ".1f"), _fmt(now, ".1f"), _fmt(ratio, ".3f"),
                      _fmt(r.get("tflops"), ".0f"), _fmt(r.get("rel_err"), ".1e"),
                      _fmt(r.get("fi_us"), ".1f"), _fmt(r.get("fi_tflops"), ".0f"),
                      r["mark"] + (" " + r["error"][:60] if "error" in r else "")])
    widths = [max(len(x[i]) for x in lines + [head]) for i in range(len(head))]
    out = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths)))]
    for x in lines:
        out.append("  ".join(c.ljust(w) if i in (0, len(head) - 1) else c.rjust(w)
                             for i, (c, w) in enumerate(zip(x, widths))))
    return "\n".join(out)


def _import_jax(args):
    global jax, jnp, ji, ref, V
    if args.smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["JAXINFER_BACKEND"] = "interpret"
    elif args.flashinfer:  # leave GPU memory to torch
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
    import jax as _jax
    import jax.numpy as _jnp
    import jaxinfer as _ji
    from jaxinfer import reference as _ref
    from jaxinfer import variants as _V
    jax, jnp, ji, ref, V = _jax, _jnp, _ji, _ref, _V


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Rows:\n" + "\n".join("  " + r.name for r in ROWS))
    ap.add_argument("--rows", help="only rows whose name matches this regular expression")
    ap.add_argument("--update", action="store_true",
                    help="rewrite the baseline from this run (with --rows: only those rows)")
    ap.add_argument("--baseline", default=BASELINE, help="baseline file (default: %(default)s)")
    ap.add_argument("--json", help="write every row's full result here")
    ap.add_argument("--commit", help="commit recorded by --update (default: git rev-parse HEAD)")
    ap.add_argument("--flashinfer", action="store_true",
                    help="also time FlashInfer (torch + flashinfer importable) on the rows it has")
    ap.add_argument("--smoke", action="store_true",
                    help="every row on the CPU in interpret mode, tiny shapes, no baseline")
    ap.add_argument("--list", action="store_true", help="print the row names and exit")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    rows = [r for r in ROWS if not args.rows or re.search(args.rows, r.name)]
    if args.list:
        print("\n".join(r.name for r in rows))
        return 0
    if not rows:
        log(f"no row matches {args.rows!r}")
        return 2
    if args.smoke and args.update:
        log("--update needs GPU numbers, not --smoke")
        return 2
    start = time.perf_counter()
    _import_jax(args)
    env = Env(args.smoke)
    device = jax.devices()[0].device_kind
    log(f"regress: {len(rows)} rows, jax {jax.__version__}, {device}, smoke={args.smoke}")
    fi = None
    if args.flashinfer:
        from benchmarks import regress_flashinfer
        fi = regress_flashinfer.load(log)
    baseline = {}
    if os.path.exists(args.baseline):
        with open(args.baseline) as f:
            baseline = json.load(f)
        if not args.smoke and baseline.get("device") != device:
            log(f"baseline from {baseline.get('device')}, this is {device}: ratios compare machines")
    base_rows = {} if args.smoke else baseline.get("rows", {})
    results = []
    for i, spec in enumerate(rows):
        t = time.perf_counter()
        try:
            res = measure(spec, env, fi)
        except Exception as e:  # the row fails, the suite goes on
            res = {"name": spec.name, "tol": spec.tol, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        res["mark"] = status(res, base_rows.get(spec.name))
        results.append(res)
        log(f"[{i + 1}/{len(rows)} {time.perf_counter() - start:6.1f}s] {spec.name}: "
            f"{_fmt(res.get('median_us'), '.1f')} us rel_err {_fmt(res.get('rel_err'), '.1e')} "
            f"FI {_fmt(res.get('fi_us'), '.1f')} {res['mark']} {res.get('error', '')} "
            f"({time.perf_counter() - t:.1f}s)")
    elapsed = time.perf_counter() - start
    header = {"device": device, "jax_version": jax.__version__, "commit": _commit(args.commit),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(header | {"smoke": args.smoke, "elapsed_s": elapsed, "results": results}, f, indent=1)
    if args.update:
        # With --rows the header stays the baseline's; the rows rewritten record their own run.
        partial = bool(args.rows and baseline.get("rows"))
        new_rows = dict(baseline.get("rows", {})) if partial else {}
        for r in results:
            if "error" in r:
                new_rows.pop(r["name"], None)
                continue
            new_rows[r["name"]] = {k: r[k] for k in ("median_us", "rel_err", "tflops", "fi_us")
                                   if r.get(k) is not None}
            if partial:
                new_rows[r["name"]] |= {"commit": header["commit"], "date": header["date"]}
        os.makedirs(os.path.dirname(os.path.abspath(args.baseline)), exist_ok=True)
        with open(args.baseline, "w") as f:
            kept = {k: baseline[k] for k in header} if partial else header
            json.dump(kept | {"rows": new_rows}, f, indent=1)
            f.write("\n")
        log(f"baseline written: {args.baseline}")
    print(table(results, base_rows))
    marks = [r["mark"] for r in results]
    print(f"{len(results)} rows in {elapsed:.0f} s: {marks.count('SLOWER')} SLOWER (> {SLOWER - 1:.0%} "
          f"over baseline), {marks.count('faster')} faster, {marks.count('new')} without baseline, "
          f"{marks.count('BAD')} BAD (NaN or rel_err over tolerance), {marks.count('ERROR')} ERROR")
    return 1 if {"BAD", "ERROR"} & set(marks) else 0


if __name__ == "__main__":
    sys.exit(main())
