"""End-to-end generation latency, Llama-3-8B shapes: TTFT and ITL of jaxinfer against dense caches.

    PYTHONPATH=. python3 benchmarks/bench_e2e.py            # one H100: under 8 minutes, compiles included
    PYTHONPATH=. python3 benchmarks/bench_e2e.py --smoke    # tiny model, a CPU smoke run
    PYTHONPATH=. python3 benchmarks/plot_e2e.py             # ITL against batch as a PNG

Random bfloat16 weights (examples/llama.py, 32 layers unrolled under one jit; --layer-loop scan:
stacked weights in one lax.scan), batch 1 / 16 / 64, prompt lengths uniform on [512, 2048], 128
output tokens, greedy (the step ends in one argmax over the vocabulary; the jaxinfer row also times
the step's sampling call alone, see below). Methods:

  jaxinfer        paged cache (page 16): one BatchPrefillWithPagedKVCache call for all prompts,
                  then BatchDecodeWithPagedKVCache steps (a host plan per step, shared by all
                  layers; the decode kernel appends each step's K/V: run(..., append_kv=))
  jaxinfer-mixed  the same cache served as a continuous-batching engine with chunked prefill
                  (examples/serve.py --chunk): every step is one forward pass, one
                  ji.ragged_paged_attention call per layer (which also writes the step's K/V),
                  holding a decode row for each request that has its first token, then up to
                  --chunk prompt tokens of the requests still prefilling (admission order; a
                  prompt may be split across steps, and the chunk that ends it samples its first
                  token). Inputs padded to B sequences and B + chunk tokens, or B tokens on
                  steps without a chunk: two compilations, as an engine's padding buckets
  dense           dense padded cache [L, B, max prompt + 127, Hkv, D], plain jnp attention
  cudnn           the same dense cache, jax.nn.dot_product_attention(implementation="cudnn")

TTFT: all prompts arrive together; wall time from the start of the prefill (host planning
included) until every request's first token is on the host. The dense methods prefill
--dense-prefill-chunk requests per call, each padded to the longest prompt of the batch (the
[B, H, T, T] scores of the jnp baseline bound the chunk). ITL: every decode step's tokens reach
the host, as a streaming server needs; ITL is the interval between successive steps' arrivals,
median and mean over the 127 decode steps (--itl-repeats N: the same 127 steps N times, ITL p50
the median of the loops' medians, each printed). Step t + 1 is planned on the host, copied over and
launched (fed step t's tokens on the device) before the host waits for step t's tokens, as in
examples/generate.py (--sync: wait, then plan and launch the next step). Compile times
(prefill, decode step) are measured apart (ahead-of-time) and printed. A row that fails records its
error and the run goes on; rows that would start past --budget-s are skipped. Results go to
$OUT/bench_e2e.json (OUT defaults to ./out); the table prints last.

jaxinfer-mixed: all B requests arrive at t = 0 and every step's sampled tokens reach the host
(overlapped as above: step t + 1 is prepared and launched, its decode rows fed step t's tokens on
the device, before the host waits for step t). The schedule (which rows each step holds) depends
only on the prompt lengths and is computed up front; each step's arrays are built in its turn. A
request's TTFT runs from the start of the first step (its host preparation included) to the
arrival of the step that samples its first token: ttft_ms is the mean over requests (ttft_ms_p50,
ttft_ms_max too; the other rows' requests all get theirs at once, so there mean = max). ITL: the
intervals between a request's successive tokens' arrivals, pooled over requests (steps that also
carry prompt chunks included: the prefill's cost to decoding requests); p50, mean, p90 of the
pool. The whole schedule runs once as a warm-up, then --itl-repeats times (ITL p50: the median of
the runs' medians). Its first tokens are compared with the jaxinfer row's (first_token_mismatches,
first_tokens_match; bf16 rounding on a GPU may flip a few). Its compile column adds the two step shapes'
compiles.

Sampling share (jaxinfer rows): the step's sampling call (llama.sample) timed alone at the row's
batch and the vocabulary, float32 logits, --sampling-reps calls queued back to back:
sampling_ms for top-k 50 + top-p 0.9 at temperature 1 (jaxinfer.sampling's sorting-free
top_k_top_p_sampling_from_logits), argmax_ms for the greedy argmax, and sampling_share =
sampling_ms / (ITL p50 - argmax_ms + sampling_ms): its share of the ITL of a sampled decode step.
"""
import argparse
import functools
import json
import os
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxinfer as ji
from planner.allocator import PageAllocator, page_table, pad

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import generate  # noqa: E402
import llama  # noqa: E402
import serve  # noqa: E402

METHODS = ("jaxinfer", "jaxinfer-mixed", "dense", "cudnn")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model, short prompts (CPU)")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,16,64; smoke 1,3)")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help=f"comma-separated methods, drawn from {','.join(METHODS)} (default all)")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the config's")
    ap.add_argument("--layer-loop", default="unroll", choices=llama.LAYER_LOOPS,
                    help="unroll: layers unrolled under one jit, per-layer weights (default); "
                         "scan: stacked weights in one lax.scan")
    ap.add_argument("--sync", action="store_true",
                    help="each decode step waits for its tokens on the host before the next is planned "
                         "and launched (no host/device overlap)")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                    help="prompt lengths uniform on [MIN, MAX] (default 512 2048; smoke 8 40)")
    ap.add_argument("--out-tokens", type=int, default=None,
                    help="tokens generated per request, >= 2 (default 128; smoke 6)")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per page of jaxinfer's paged cache")
    ap.add_argument("--dense-prefill-chunk", type=int, default=4, help="requests per dense prefill call")
    ap.add_argument("--chunk", type=int, default=None,
                    help="jaxinfer-mixed: prompt tokens per engine step (default 512; smoke 16)")
    ap.add_argument("--budget-s", type=float, default=400.0, help="start no row after this many seconds")
    ap.add_argument("--itl-repeats", type=int, default=1,
                    help="decode loops per row (the same steps again; ITL p50 = median of the loops' p50)")
    ap.add_argument("--sampling-reps", type=int, default=None,
                    help="calls of the timed sampling call per jaxinfer row (default 100; smoke 3)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights, prompt lengths and tokens")
    args = ap.parse_args(argv)
    args.config = "tiny" if args.smoke else "llama3-8b"
    args.batches = [int(b) for b in (args.batches or ("1,3" if args.smoke else "1,16,64")).split(",")]
    args.methods = args.methods.split(",")
    args.prompt_len = args.prompt_len or ((8, 40) if args.smoke else (512, 2048))
    args.out_tokens = args.out_tokens or (6 if args.smoke else 128)
    args.chunk = (16 if args.smoke else 512) if args.chunk is None else args.chunk
    args.sampling_reps = args.sampling_reps or (3 if args.smoke else 100)
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        raise ValueError(f"--methods must be drawn from {METHODS}, got {bad}")
    if (min(args.batches) < 1 or args.out_tokens < 2 or args.dense_prefill_chunk < 1 or args.itl_repeats < 1
            or args.chunk < 1 or args.sampling_reps < 1):
        raise ValueError("--batches, --dense-prefill-chunk, --itl-repeats, --chunk, --sampling-reps must be >= 1 "
                         "and --out-tokens >= 2")
    if not 1 <= args.prompt_len[0] <= args.prompt_len[1]:
        raise ValueError(f"--prompt-len must satisfy 1 <= MIN <= MAX, got {args.prompt_len}")
    return args


def aot(fn, *args):
    """(compiled, seconds): ahead-of-time compile, so compile time stays out of TTFT and ITL."""
    t = time.perf_counter()
    compiled = fn.lower(*args).compile()
    return compiled, time.perf_counter() - t


def latency_stats(ttft, loops):
    """TTFT and ITL figures (ms); loops: per decode loop, its steps' seconds."""
    p50s = [float(np.median(itl)) * 1e3 for itl in loops]
    itl = np.concatenate([np.asarray(x) for x in loops])
    return dict(ttft_ms=ttft * 1e3, itl_ms_p50=float(np.median(p50s)), itl_ms_p50_loops=p50s,
                itl_ms_mean=float(itl.mean()) * 1e3, itl_ms_mean_loops=[float(np.mean(x)) * 1e3 for x in loops],
                itl_ms_p90=float(np.percentile(itl, 90)) * 1e3)


class MixedStep(NamedTuple):
    """One engine step of jaxinfer-mixed (request ids index the batch's prompts)."""
    decode: list   # (request, position of the token it feeds) per decode row
    chunks: list   # (request, start, stop) per prompt chunk
    sampled: list  # requests that sample a token: the decode rows', then those whose chunk ends the prompt


def mixed_schedule(lens, out, chunk):
    """The steps of serve.Engine._mixed_step's policy for requests all admitted at t = 0: decode
    rows first, then prompt chunks of at most `chunk` tokens in all, in admission order (a chunk
    that leaves its prompt unfinished ends the step's prefill), until every request has `out`
    tokens. [MixedStep]."""
    written = np.zeros(len(lens), int)    # [B] prompt tokens whose K/V are written
    generated = np.zeros(len(lens), int)  # [B] tokens sampled
    steps = []
    while generated.min() < out:
        decode = [(i, lens[i] + generated[i] - 1) for i in range(len(lens)) if 0 < generated[i] < out]
        chunks, budget = [], chunk
        for i in np.flatnonzero(written < lens).tolist():
            n = min(lens[i] - written[i], budget)
            if n == 0:
                break
            chunks.append((i, written[i], written[i] + n))
            budget -= n
            if written[i] + n < lens[i]:
                break
        ends = [i for i, _, b in chunks if b == lens[i]]
        for i, _, b in chunks:
            written[i] = b
        steps.append(MixedStep(decode, chunks, [i for i, _ in decode] + ends))
        generated[steps[-1].sampled] += 1
    return steps


def fed_step(step):
    """jit of llama.make_step's step whose decode rows take their tokens on the device from the
    previous step's output: (params, prev int32[M'], src int32[N], tokens int32[N], ...) runs
    step(params, where(src >= 0, prev[src], tokens), ...), so the host need not wait for them."""
    def fed(params, prev, src, tokens, positions, kv_cache, attention, logits_index, sampling, key):
        tokens = jnp.where(src >= 0, prev[src], tokens)
        return step(params, tokens, positions, kv_cache, attention, logits_index, sampling, key)
    return jax.jit(fed, donate_argnames="kv_cache")


class Bench:
    """Model, weights and the shared jitted step; run_*() measure one (method, batch) row."""

    def __init__(self, args):
        self.args = args
        self.cfg = llama.get_config(args.config, args.layers, args.layer_loop)
        t = time.perf_counter()
        graphdef, self.params = nnx.split(llama.Llama(self.cfg, rngs=nnx.Rngs(args.seed)))
        jax.block_until_ready(self.params)
        self.init_s = time.perf_counter() - t
        self.step = llama.make_step(graphdef)  # greedy
        self.mixed_step = fed_step(self.step)
        self.kernel_opts = {} if jax.default_backend() == "gpu" else {"num_ctas": 8}

    def sampling(self, n):
        """(SamplingParams [n], key) on the device: greedy; the key passes through the step unused."""
        return jax.device_put((llama.SamplingParams.full(n), jax.random.key(self.args.seed)))

    def sampling_cost(self, batch, itl_ms):
        """The decode step's sampling call alone (llama.sample) at its batch and vocabulary, float32
        logits: ms per call of top-k 50 + top-p 0.9 at temperature 1 (jaxinfer.sampling's
        top_k_top_p_sampling_from_logits) and of the greedy step's argmax, over --sampling-reps
        calls queued back to back; sampling_share: the sampling call's share of an ITL whose argmax
        it replaces."""
        logits = jax.random.normal(jax.random.key(1), (batch, self.cfg.vocab_size), jnp.float32)
        params = jax.device_put(llama.SamplingParams.full(batch, 1.0, 50, 0.9))
        key, out = jax.random.key(2), {}
        for name, sampler in (("sampling", llama.Sampler(False, top_k=True, top_p=True)), ("argmax", llama.Sampler())):
            fn = jax.jit(functools.partial(llama.sample, sampler=sampler))
            jax.block_until_ready(fn(logits, params, key))
            t = time.perf_counter()
            jax.block_until_ready([fn(logits, params, key) for _ in range(self.args.sampling_reps)])
            out[f"{name}_ms"] = (time.perf_counter() - t) / self.args.sampling_reps * 1e3
        out["sampling_share"] = out["sampling_ms"] / (itl_ms - out["argmax_ms"] + out["sampling_ms"])
        return out

    def run_jaxinfer(self, prompts):
        cfg, ps, out = self.cfg, self.args.page_size, self.args.out_tokens
        batch, lens = len(prompts), np.array([len(p) for p in prompts])
        pages = -(-(lens + out - 1) // ps)
        num_pages = int(pages.sum())
        allocator = PageAllocator(num_pages)
        page_lists = [allocator.alloc(int(n)) for n in pages]
        kv_cache = llama.paged_kv_cache(cfg, num_pages, ps)
        heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, ps)
        nnz = int(lens.sum())
        prefill = ji.BatchPrefillWithPagedKVCache(*heads, causal=True, max_batch_size=batch, max_num_tokens=nnz,
                                                  max_num_pages=num_pages, **self.kernel_opts)
        decode = ji.BatchDecodeWithPagedKVCache(*heads, max_batch_size=batch, max_num_pages=num_pages,
                                                **self.kernel_opts)
        qo_indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        tokens = np.concatenate(prompts)
        positions = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
        rows = np.repeat(np.arange(batch), lens).astype(np.int32)
        sampling = self.sampling(batch)

        def prefill_args():
            kv_indptr, kv_indices, last = page_table(page_lists, lens, ps)
            plan = prefill.plan(qo_indptr, kv_indptr, kv_indices, last, num_pages=num_pages,
                                q_data_type=cfg.dtype)
            attention = llama.PagedAttention(prefill, num_pages, plan, rows, positions, kv_indptr,
                                             pad(kv_indices, num_pages))
            return (self.params, tokens, positions, kv_cache, attention, qo_indptr[1:] - 1, *sampling)

        def decode_inputs(step):
            """Step `step`'s host plan, sent to the device: (positions, attention); the decode
            kernel appends each request's K/V at its last position."""
            kv_lens = lens + step + 1
            kv_indptr, kv_indices, last = page_table(page_lists, kv_lens, ps)
            plan = decode.plan(kv_indptr, kv_indices, last, num_pages=num_pages)
            pos = (kv_lens - 1).astype(np.int32)
            return jax.device_put((pos, llama.PagedAttention(decode, num_pages, plan)))

        prefill_fn, prefill_compile = aot(self.step, *prefill_args())
        _, kv_cache, _ = prefill_fn(*prefill_args())  # warm-up (writes the same K/V again below)
        jax.block_until_ready(kv_cache)
        t = time.perf_counter()
        first, kv_cache, _ = prefill_fn(*prefill_args())
        host_first = np.asarray(first)
        ttft = time.perf_counter() - t
        decode_compile, loops = self.decode_loop(decode_inputs, first, kv_cache, sampling, out)
        stats = latency_stats(ttft, loops)
        return dict(first_tokens=host_first, compile_prefill_s=prefill_compile, compile_decode_s=decode_compile,
                    **stats, **self.sampling_cost(batch, stats["itl_ms_p50"]))

    def decode_loop(self, decode_inputs, first, kv_cache, sampling, out):
        """Compiles the decode step, then runs out - 1 steps (generate.decode_loop: overlapped
        unless --sync), --itl-repeats times over the same steps; returns (compile s, per loop
        its steps' s). decode_inputs(step) -> (positions, attention) on the device; first: the
        prefill's tokens."""
        state = {"kv_cache": kv_cache}

        def call_args(tokens, inputs):
            pos, attention = inputs
            return self.params, tokens, pos, state["kv_cache"], attention, None, *sampling

        def dispatch(tokens, inputs):
            tok, state["kv_cache"], _ = decode_fn(*call_args(tokens, inputs))
            return tok, tok

        decode_fn, compile_s = aot(self.step, *call_args(first, decode_inputs(0)))
        loops = [generate.decode_loop(dispatch, decode_inputs, first, out - 1, overlap=not self.args.sync)[1]
                 for _ in range(self.args.itl_repeats)]
        return compile_s, loops

    def run_jaxinfer_mixed(self, prompts):
        """The chunked-prefill engine (mixed_schedule), one fed_step call per step, through
        generate.decode_loop (overlapped unless --sync): a warm-up run, then --itl-repeats runs."""
        cfg, ps, out, chunk = self.cfg, self.args.page_size, self.args.out_tokens, self.args.chunk
        batch, lens = len(prompts), np.array([len(p) for p in prompts])
        pages = -(-(lens + out - 1) // ps)
        num_pages, per_seq = int(pages.sum()), int(pages.max())
        allocator = PageAllocator(num_pages)
        table = np.stack([pad(allocator.alloc(int(n)), per_seq) for n in pages])  # [B, per_seq] page ids
        kv_cache = llama.paged_kv_cache(cfg, num_pages, ps)
        steps = mixed_schedule(lens, out, chunk)
        bcap = batch
        sampling = self.sampling(batch)

        def step_inputs(c):
            """Step c's arrays, sent to the device: (src, tokens, positions, attention, logits_index).
            src: each decode row's row in step c - 1's output (-1: a prompt token or padding)."""
            step = steps[c]
            tcap = bcap + (chunk if step.chunks else 0)  # two shapes: decode-only steps, and with chunks
            prev = {i: j for j, i in enumerate(steps[c - 1].sampled)} if c else {}
            nd = len(step.decode)
            seqs = [i for i, _ in step.decode] + [i for i, _, _ in step.chunks]
            cu = np.cumsum([0] + [1] * nd + [b - a for _, a, b in step.chunks]).astype(np.int32)
            src = np.array([prev[i] for i, _ in step.decode], np.int32)
            tokens = np.concatenate([np.zeros(nd, np.int32)] + [prompts[i][a:b] for i, a, b in step.chunks])
            positions = np.array([p for _, p in step.decode] + [p for _, a, b in step.chunks for p in range(a, b)],
                                 np.int32)
            kv_lens = np.array([p + 1 for _, p in step.decode] + [b for _, _, b in step.chunks], np.int32)
            rows = list(range(nd)) + [nd + k for k, (i, _, b) in enumerate(step.chunks) if b == lens[i]]
            attention = serve.RaggedAttention(
                pad(kv_lens, bcap), pad(table[seqs].reshape(-1), bcap * per_seq), pad(cu, bcap + 1, cu[-1]),
                np.array([nd, nd, len(seqs)], np.int32), num_pages, self.kernel_opts.get("num_ctas"))
            return jax.device_put((pad(src, tcap, -1), pad(tokens, tcap), pad(positions, tcap, -1), attention,
                                   pad(cu[1:][rows] - 1, bcap)))

        state = {"kv_cache": kv_cache}

        def call_args(prev, inputs):
            src, tokens, positions, attention, logits_index = inputs
            return (self.params, prev, src, tokens, positions, state["kv_cache"], attention, logits_index,
                    *sampling)

        def dispatch(prev, inputs):
            tok, state["kv_cache"], _ = step_fns[inputs[1].shape[0]](*call_args(prev, inputs))
            return tok, tok

        no_tokens = jax.device_put(np.zeros(bcap, np.int32))  # step 0 has no decode rows
        step_fns, compile_s = {}, 0.0  # by padded token count
        for c in sorted({bool(s.chunks): c for c, s in enumerate(steps)}.values()):
            inputs = step_inputs(c)
            step_fns[inputs[1].shape[0]], seconds = aot(self.mixed_step, *call_args(no_tokens, inputs))
            compile_s += seconds
        runs = [generate.decode_loop(dispatch, step_inputs, no_tokens, len(steps), overlap=not self.args.sync)
                for _ in range(1 + self.args.itl_repeats)][1:]  # the first run: warm-up
        first_step = [next(c for c, s in enumerate(steps) if i in s.sampled) for i in range(batch)]  # [B]
        tokens = runs[0][0]  # per step: int32[B], its sampled rows first
        first = np.array([tokens[c][steps[c].sampled.index(i)] for i, c in enumerate(first_step)])
        ttft = np.concatenate([np.cumsum(times)[first_step] for _, times in runs])  # [runs * B] s
        loops = [np.repeat(times, [len(s.decode) for s in steps]) for _, times in runs]  # per token interval
        return dict(first_tokens=first, compile_step_s=compile_s, step_shapes=len(step_fns), chunk=chunk,
                    steps=len(steps),
                    **latency_stats(float(ttft.mean()), loops),
                    ttft_ms_p50=float(np.median(ttft)) * 1e3, ttft_ms_max=float(ttft.max()) * 1e3)

    def run_dense(self, prompts, impl):
        cfg, out, chunk = self.cfg, self.args.out_tokens, self.args.dense_prefill_chunk
        batch, lens = len(prompts), np.array([len(p) for p in prompts])
        t_pad = int(lens.max())
        kv_cache = llama.dense_kv_cache(cfg, batch, t_pad + out - 1)
        chunk = min(chunk, batch)
        num_chunks = -(-batch // chunk)
        block = np.zeros((num_chunks * chunk, t_pad), np.int32)
        block_pos = np.full((num_chunks * chunk, t_pad), -1, np.int32)
        for b, p in enumerate(prompts):
            block[b, :len(p)], block_pos[b, :len(p)] = p, np.arange(len(p))
        sampling = self.sampling(chunk)

        def prefill_args(c):
            sl = slice(c * chunk, (c + 1) * chunk)
            rows = np.arange(sl.start, sl.stop, dtype=np.int32)
            live = rows < batch
            attention = llama.DenseAttention(np.where(live, rows, 0).astype(np.int32), block_pos[sl],
                                             impl=impl, prefill=True)
            last = np.arange(chunk) * t_pad + np.maximum(lens[np.minimum(rows, batch - 1)] - 1, 0)
            return (self.params, block[sl].reshape(-1), np.maximum(block_pos[sl], 0).reshape(-1), kv_cache,
                    attention, last.astype(np.int32), *sampling)

        def decode_inputs(step):
            pos = (lens + step).astype(np.int32)
            return jax.device_put((pos, llama.DenseAttention(None, pos[:, None], impl=impl)))

        prefill_fn, prefill_compile = aot(self.step, *prefill_args(0))
        _, kv_cache, _ = prefill_fn(*prefill_args(0))  # warm-up on the first chunk
        jax.block_until_ready(kv_cache)
        t = time.perf_counter()
        firsts = []
        for c in range(num_chunks):
            first, kv_cache, _ = prefill_fn(*prefill_args(c))
            firsts.append(first)
        first = np.concatenate([np.asarray(f) for f in firsts])[:batch]
        ttft = time.perf_counter() - t
        decode_compile, loops = self.decode_loop(decode_inputs, jax.device_put(first), kv_cache,
                                                 self.sampling(batch), out)
        return dict(first_tokens=first, compile_prefill_s=prefill_compile, compile_decode_s=decode_compile,
                    prefill_chunk=chunk, **latency_stats(ttft, loops))


def print_table(rows):
    """One line per row; jaxinfer-mixed's TTFT is the mean over requests, its compile its step shapes'."""
    print(f"{'method':<14} {'batch':>5} {'TTFT ms':>9} {'ITL p50 ms':>10} {'ITL mean':>9} "
          f"{'tok/s':>8} {'compile prefill+decode s':>24}  note")
    for r in rows:
        if "itl_ms_p50" in r:
            agree, mismatches = r.get("first_token_agreement"), r.get("first_token_mismatches")
            compile_s = (f"{r['compile_step_s']:.1f} ({r['step_shapes']} step shapes)" if "compile_step_s" in r
                         else f"{r['compile_prefill_s']:.1f} + {r['compile_decode_s']:.1f}")
            loops = r["itl_ms_p50_loops"]
            print(f"{r['method']:<14} {r['batch']:>5} {r['ttft_ms']:>9.1f} {r['itl_ms_p50']:>10.3f} "
                  f"{r['itl_ms_mean']:>9.3f} {r['batch'] * 1e3 / r['itl_ms_p50']:>8.0f} {compile_s:>24}  "
                  + ("" if "chunk" not in r else f"chunk {r['chunk']}, {r['steps']} steps, "
                     f"TTFT max {r['ttft_ms_max']:.1f}  ")
                  + ("" if "sampling_ms" not in r else f"sampling {r['sampling_ms']:.3f} ms "
                     f"({r['sampling_share']:.1%} of a sampled ITL)  ")
                  + ("" if mismatches is None else f"first tokens unlike jaxinfer's: {mismatches}  ")
                  + ("" if agree is None else f"first tokens = dense's: {agree:.2f}  ")
                  + ("" if len(loops) < 2 else "p50 per loop " + " ".join(f"{x:.3f}" for x in loops)))
        else:
            print(f"{r['method']:<14} {r['batch']:>5} {'-':>9} {'-':>10} {'-':>9} {'-':>8} {'-':>24}  "
                  f"{r.get('error') or r.get('skipped')}")


def main(argv=None):
    args = parse_args(argv)
    start = time.perf_counter()
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "bench_e2e.json")
    bench = Bench(args)
    cfg = bench.cfg
    meta = dict(config=args.config, num_layers=cfg.num_layers, layer_loop=cfg.layer_loop, sync=args.sync,
                dtype=cfg.dtype, jax=jax.__version__,
                device=str(jax.devices()[0].device_kind), backend=jax.default_backend(),
                prompt_len=list(args.prompt_len), out_tokens=args.out_tokens, page_size=args.page_size,
                weights_init_s=bench.init_s)
    print(json.dumps(meta), flush=True)
    rng = np.random.default_rng(args.seed)
    rows = []
    for batch in args.batches:
        lens = rng.integers(args.prompt_len[0], args.prompt_len[1] + 1, batch)
        prompts = [rng.integers(0, cfg.vocab_size, n).astype(np.int32) for n in lens]
        firsts = {}
        for method in args.methods:
            row = dict(method=method, batch=batch, prompt_tokens=int(lens.sum()))
            elapsed = time.perf_counter() - start
            if elapsed > args.budget_s:
                row["skipped"] = f"time budget ({elapsed:.0f} s > --budget-s {args.budget_s:.0f})"
            elif method == "cudnn" and jax.default_backend() != "gpu":
                row["skipped"] = "cudnn needs a GPU"
            else:
                try:
                    result = (bench.run_jaxinfer(prompts) if method == "jaxinfer"
                              else bench.run_jaxinfer_mixed(prompts) if method == "jaxinfer-mixed"
                              else bench.run_dense(prompts, "jnp" if method == "dense" else "cudnn"))
                    firsts[method] = result.pop("first_tokens")
                    row.update(result)
                except Exception as e:  # a failing baseline must not lose the other rows
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
        for row in rows[-len(args.methods):]:
            if "dense" in firsts and row["method"] in firsts and row["method"] != "dense":
                row["first_token_agreement"] = float(np.mean(firsts[row["method"]] == firsts["dense"]))
            if row["method"] == "jaxinfer-mixed" and {"jaxinfer", "jaxinfer-mixed"} <= firsts.keys():
                mismatches = int(np.sum(firsts["jaxinfer-mixed"] != firsts["jaxinfer"]))
                row.update(first_token_mismatches=mismatches, first_tokens_match=mismatches == 0)
        with open(path, "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)
    print(f"total {time.perf_counter() - start:.0f} s; results in {path}")
    print_table(rows)
    return rows


if __name__ == "__main__":
    main()
