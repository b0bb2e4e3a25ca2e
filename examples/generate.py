"""Batch generation with a Llama-style Flax model on jaxinfer's paged KV cache.

    python examples/generate.py                      # CPU: tiny random model (Pallas interpret mode)
    python examples/generate.py --scan 4             # 4 decode steps per jitted lax.scan (horizon plan)
    python examples/generate.py --config llama3-8b --batch 16 --prompt-len 512 2048 --new-tokens 128
    python examples/generate.py --temperature 0.8 --top-k 50 --top-p 0.9   # sampling (jaxinfer.sampling)
    python examples/generate.py --config llama3-70b --tp 4 --batch 1 64   # 4 GPUs, tensor parallel
    python examples/generate.py --config llama3-8b --cp 4 --batch 1 --prompt-len 60000 65000   # context parallel

One prefill for all prompts (BatchPrefillWithPagedKVCache), then one decode step per token
(BatchDecodeWithPagedKVCache). Each step makes one plan on the host, shared by all layers;
plans have fixed capacities (max_batch_size, max_num_pages, max_num_tokens), so the prefill
and the decode step each compile once. The step is one jitted program (layers unrolled by
default, see llama.py; LM head and sampling inside, the cache donated). The host never
stalls the device: step t + 1 is planned, copied over and queued, its tokens input the
device output of step t, before the host waits for step t's tokens (--sync: the old order).
Weights are random: the tokens are meaningless, the timings are not. Prints compile times,
TTFT, ITL (the interval between successive tokens' arrival on the host) and tokens/s. Several
--batch values run one after another on one model and one KV cache (sized for the largest); the
programs of all of them are compiled first, in parallel threads.

Tokens are greedy (one argmax) unless --temperature > 0: then jaxinfer.sampling draws them on the
device inside the step (--top-k, --top-p, --min-p filter), with a jax.random key threaded from
step to step (deterministic given --seed; --scan gives the same tokens). --tp N shards the model
over N devices (llama.py: weights column/row parallel and made on the devices, each device its
share, never on the host; the cache on KV heads, attention through jaxinfer.sharding.head_parallel,
plans replicated; each device's decode kernel appends its K/V heads: head_parallel's append_kv).
--cp N splits the context over N devices for long prompts (llama.py: every layer's cache split on
pages, each request's pages spread evenly over the devices, the attention through
jaxinfer.sharding.context_parallel with one plan per device: the prefill splits the prompts'
query rows (sharding.split_queries: each device computes its rows whole, the pages gathered),
the decode steps split the keys and merge the partial states exactly); the rest of the model
runs replicated on every device.
"""
import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxinfer as ji
import llama
from jaxinfer import sharding
from planner.allocator import PageAllocator, page_table, pad


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny", choices=sorted(llama.CONFIGS),
                    help="model shapes: tiny (CPU, float32), llama3-8b or llama3-70b (random bfloat16 "
                         "weights; 70b: GPUs only, about 141 GB, e.g. --tp 4 on H100s)")
    ap.add_argument("--layers", type=int, default=None, help="override the config's layer count")
    ap.add_argument("--layer-loop", default="unroll", choices=llama.LAYER_LOOPS,
                    help="unroll: per-layer weights, layers unrolled under one jit (fast); "
                         "scan: stacked weights in one lax.scan (copies each layer's weights)")
    ap.add_argument("--batch", type=int, nargs="+", default=[4],
                    help="requests generated together; several values run one after another on the same "
                         "weights and cache (e.g. --batch 1 64), their programs compiled in parallel")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"),
                    help="prompt lengths are uniform on [MIN, MAX]")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens generated per request")
    ap.add_argument("--scan", type=int, default=0, metavar="K",
                    help="run K decode steps per jitted lax.scan with a horizon plan (0: one step per call)")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per KV cache page")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature for every request; 0: greedy (the step then only takes an argmax)")
    ap.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="sample from the smallest set of top tokens holding this much probability (1: all)")
    ap.add_argument("--min-p", type=float, default=0.0,
                    help="sample among the tokens with p >= min_p * the top token's p (0: all)")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor parallel over the first N devices (heads, MLP columns and the cache split)")
    ap.add_argument("--cp", type=int, default=1,
                    help="context parallel over the first N devices (every layer's cache split on pages, the "
                         "attention's partial states merged; the weights replicated)")
    ap.add_argument("--sync", action="store_true",
                    help="wait for each step's tokens on the host before planning and launching the next "
                         "(no overlap of host work with the device; for comparison)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and prompts")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--warmup", type=int, default=0,
                    help="untimed generations of each batch before the timed one (first runs pay one-time "
                         "costs: the devices' first launches, collective setup)")
    args = ap.parse_args(argv)
    for name in ("new_tokens", "page_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.batch) < 1:
        raise ValueError(f"--batch values must be >= 1, got {args.batch}")
    if not 1 <= args.prompt_len[0] <= args.prompt_len[1]:
        raise ValueError(f"--prompt-len must satisfy 1 <= MIN <= MAX, got {args.prompt_len}")
    if args.scan < 0:
        raise ValueError(f"--scan must be >= 0, got {args.scan}")
    if args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1 or not 0 <= args.min_p <= 1:
        raise ValueError("need --temperature >= 0, --top-k >= 0, 0 < --top-p <= 1 and 0 <= --min-p <= 1")
    if args.temperature == 0 and (args.top_k or args.top_p < 1 or args.min_p):
        raise ValueError("--top-k, --top-p and --min-p filter samples: give a --temperature > 0 (0 is greedy)")
    if not 1 <= args.tp <= len(jax.devices()):
        raise ValueError(f"--tp must lie in [1, {len(jax.devices())}] (the devices there are), got {args.tp}")
    if not 1 <= args.cp <= len(jax.devices()):
        raise ValueError(f"--cp must lie in [1, {len(jax.devices())}] (the devices there are), got {args.cp}")
    if args.cp > 1 and (args.tp > 1 or args.layer_loop != "unroll"):
        raise ValueError("--cp runs with --tp 1 and --layer-loop unroll")
    if args.config == "llama3-70b" and jax.default_backend() != "gpu":
        raise ValueError("--config llama3-70b needs GPUs (about 141 GB of bfloat16 weights, e.g. --tp 4 "
                         f"on H100s); this backend is {jax.default_backend()}")
    return args


class Progress:
    """A one-line text progress bar on stderr (shown only on a terminal)."""

    def __init__(self, total, enabled=True, width=30):
        self.total, self.width, self.done = total, width, 0
        self.enabled = enabled and sys.stderr.isatty()

    def update(self, n, note=""):
        self.done += n
        if self.enabled:
            filled = self.width * self.done // self.total
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] "
                             f"{self.done}/{self.total} tokens {note}")
            if self.done >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def context_page_lists(pages_needed, num_devices, pages_per_device):
    """Each request's pages spread evenly over the devices of a page-split cache (the first devices
    take one more where they do not divide), listed device by device: device k's from its pages
    [k N, (k + 1) N), N = pages_per_device (sharding.split_page_table's order)."""
    allocator = PageAllocator(num_devices * pages_per_device, num_shards=num_devices)
    shares = context_shares(pages_needed, num_devices)
    return [np.concatenate([allocator.alloc(int(shares[k, r]), shard=k) for k in range(num_devices)])
            for r in range(len(pages_needed))]


def context_shares(pages_needed, num_devices):
    """int64[n, B]: request r's pages_needed[r] pages split evenly over n devices."""
    base, extra = np.divmod(np.asarray(pages_needed, np.int64), num_devices)
    return base[None, :] + (np.arange(num_devices)[:, None] < extra[None, :])


def compile_all(lowered):
    """Compiles jit(...).lower(...) results in parallel threads (XLA compiles without the GIL), so
    that the programs of several batch sizes cost about one compile of wall time. Returns
    [(compiled, seconds of its compile)] in order."""
    def one(low):
        t = time.perf_counter()
        return low.compile(), time.perf_counter() - t
    with ThreadPoolExecutor(max_workers=len(lowered)) as pool:
        return list(pool.map(one, lowered))


def decode_loop(dispatch, inputs, first, num_calls, overlap=True, on_tokens=None):
    """Runs num_calls decode calls; returns (host tokens of each call, seconds of each call).

    inputs(c) -> call c's inputs: the host plan, already sent on with jax.device_put.
    dispatch(tokens, inputs) -> (output tokens, next call's input tokens): launches one call
    (asynchronously; device arrays in and out). first: the prefill's tokens (on the device).
    overlap: call c + 1 is planned and launched, fed call c's device tokens, before the host
    waits for call c's tokens, so the device runs calls back to back while the host plans and
    streams tokens out; a call's time is the interval between its tokens' arrival on the host
    and the previous call's. overlap False: call c's tokens reach the host before call c + 1
    is planned (the host round trip and planning sit between calls). on_tokens(c, host
    tokens, seconds) is called as each call's tokens arrive.
    """
    out, times = [], []
    t = time.perf_counter()
    gen, nxt = dispatch(first, inputs(0))
    for c in range(num_calls):
        if overlap and c + 1 < num_calls:
            following = dispatch(nxt, inputs(c + 1))
        host = np.asarray(gen)
        now = time.perf_counter()
        out.append(host)
        times.append(now - t)
        t = now
        if on_tokens is not None:
            on_tokens(c, host, times[-1])
        if c + 1 < num_calls:
            gen, nxt = following if overlap else dispatch(host.reshape(-1, host.shape[-1])[-1], inputs(c + 1))
    return out, times


def device_memory():
    """'X GB in use (peak Y) of Z GB on device 0 (its kind)', or '' where the backend does not say."""
    stats = jax.devices()[0].memory_stats()
    if not stats or "bytes_in_use" not in stats:
        return ""
    return (f"{stats['bytes_in_use'] / 1e9:.1f} GB in use (peak {stats.get('peak_bytes_in_use', 0) / 1e9:.1f}) "
            f"of {stats.get('bytes_limit', 0) / 1e9:.1f} GB on device 0 ({jax.devices()[0].device_kind})")


class BatchRun:
    """One --batch value's generation: random prompts, pages for the whole generation (allocated up
    front), the prefill and decode wrappers, each call's host inputs (sent on with put) and the
    decode loop. Every batch value shares the model's weights and one KV cache."""

    def __init__(self, args, cfg, batch, rng):
        self.args, self.cfg, self.batch = args, cfg, batch
        self.k = max(args.scan, 1)
        self.prompt_lens = rng.integers(args.prompt_len[0], args.prompt_len[1] + 1, batch)
        self.prompts = [rng.integers(0, cfg.vocab_size, n).astype(np.int32) for n in self.prompt_lens]
        # The last scan may run past new_tokens; extra tokens are dropped.
        self.decode_steps = -(-(args.new_tokens - 1) // self.k) * self.k
        self.pages_needed = -(-(self.prompt_lens + self.decode_steps) // args.page_size)  # per request

    def lower(self, num_pages, graphdef, params, kv_cache, step, sampler, put, mesh):
        """Builds the wrappers over kv_cache (num_pages pages per layer); returns the prefill's and
        (with decode steps) the decode call's programs, lowered (traced, not compiled)."""
        args, cfg, batch, ps = self.args, self.cfg, self.batch, self.args.page_size
        self.num_pages, self.params, self.put, self.mesh = num_pages, params, put, mesh
        self.local_pages = num_pages // args.cp  # the pages of one device (all of them without CP)
        if args.cp > 1:
            self.page_lists = context_page_lists(self.pages_needed, args.cp, self.local_pages)
        else:
            allocator = PageAllocator(num_pages)
            self.page_lists = [allocator.alloc(int(n)) for n in self.pages_needed]
        hs, d = cfg.heads, cfg.head_dim  # per-device heads (all of them without TP)
        opts = {} if jax.default_backend() == "gpu" else {"num_ctas": 8}  # interpret mode runs the grid serially
        capacities = (batch, int(self.prompt_lens.sum()), self.local_pages)
        if args.cp > 1:  # the prefill's query rows split over the devices: its capacities are one device's
            self.prompt_split = sharding.split_queries(self.qo_indptr(), *self.prompt_table(), ps, args.cp,
                                                       pages_per_shard=self.local_pages)
            capacities = (self.prompt_split.max_requests, self.prompt_split.max_tokens, self.prompt_split.max_pages)
        self.prefill = ji.BatchPrefillWithPagedKVCache(
            hs.num_qo_heads, hs.num_kv_heads, d, ps, causal=True, max_batch_size=capacities[0],
            max_num_tokens=capacities[1], max_num_pages=capacities[2], **opts)
        self.decode = ji.BatchDecodeWithPagedKVCache(hs.num_qo_heads, hs.num_kv_heads, d, ps, max_batch_size=batch,
                                                     max_num_pages=self.local_pages, **opts)
        self.sampling, self.key = put((llama.SamplingParams.full(batch, args.temperature, args.top_k, args.top_p,
                                                                 args.min_p), jax.random.key(args.seed)))
        self.decode_fn = (llama.make_decode_scan(graphdef, self.decode, num_pages, self.k, sampler, mesh)
                          if args.scan else step)
        lowered = [step.lower(*self.prefill_inputs(kv_cache))]
        if self.decode_steps:
            tokens = put(np.zeros(batch, np.int32))  # placed as the prefill's tokens are
            lowered.append(self.decode_fn.lower(*self.call_args(tokens, self.decode_inputs(0), kv_cache, self.key)))
        return lowered

    def qo_indptr(self):
        return np.concatenate([[0], np.cumsum(self.prompt_lens)]).astype(np.int32)

    def prompt_table(self):
        """The prompts' page table (kv_indptr, kv_indices, kv_last_page_len)."""
        return page_table(self.page_lists, self.prompt_lens, self.args.page_size)

    def prefill_inputs(self, kv_cache):
        """The prefill call's arguments: every prompt in one call."""
        batch, lens = self.batch, self.prompt_lens
        qo_indptr = self.qo_indptr()
        kv_indptr, kv_indices, last = self.prompt_table()
        positions = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
        rows = np.repeat(np.arange(batch), lens).astype(np.int32)
        if self.args.cp > 1:  # attention by query rows; the K/V written where their pages live
            plan = sharding.context_plan(self.prefill, self.prompt_split, num_pages=self.num_pages,
                                         q_data_type=self.cfg.dtype)
            split = sharding.split_page_table(kv_indptr, kv_indices, last, self.args.page_size, self.args.cp,
                                              pages_per_shard=self.local_pages)
            table = llama.context_append_tables(split, rows, positions, self.local_pages)
        else:
            plan = self.prefill.plan(qo_indptr, kv_indptr, kv_indices, last, num_pages=self.num_pages,
                                     q_data_type=self.cfg.dtype)
            table = (rows, positions, kv_indptr, pad(kv_indices, self.num_pages))
        attention = llama.PagedAttention(self.prefill, self.num_pages, plan, *table, mesh=self.mesh)
        return (self.params, *self.put((np.concatenate(self.prompts), positions)), kv_cache,
                self.put(attention), self.put(qo_indptr[1:] - 1), self.sampling, self.key)

    def decode_inputs(self, call):
        """Host plan for decode call `call` (k steps from token `call * k`), sent to the device.
        Row b is request b at its last position, so the decode kernel appends the K/V itself (on
        every device under TP; under CP through per-device append tables, which are also sent)."""
        args, k, mesh = self.args, self.k, self.mesh
        lens = self.prompt_lens + call * k + (k if args.scan else 1)  # after the call's last token is appended
        kv_indptr, kv_indices, last = page_table(self.page_lists, lens, args.page_size)
        positions = (lens - 1).astype(np.int32)
        if args.cp > 1:  # the shares of the call's last step; each step's K/V rows to the device of their page
            split = sharding.split_page_table(kv_indptr, kv_indices, last, args.page_size, args.cp,
                                              pages_per_shard=self.local_pages)
            plan = sharding.context_plan(self.decode, split, num_pages=self.num_pages, horizon=k if args.scan else 1)
            rows = np.arange(self.batch, dtype=np.int32)
            if args.scan:  # step s's lengths: lens - (k - 1 - s)
                tables = [llama.context_append_tables(split, rows, positions - (k - 1 - s), self.local_pages)
                          for s in range(k)]
                return self.put((plan, (lens.astype(np.int32), tuple(np.stack(x) for x in zip(*tables)))))
            append = llama.context_append_tables(split, rows, positions, self.local_pages)
            return self.put((positions, llama.PagedAttention(self.decode, self.num_pages, plan, *append, mesh=mesh)))
        plan = self.decode.plan(kv_indptr, kv_indices, last, num_pages=self.num_pages,
                                horizon=k if args.scan else 1)
        if args.scan:
            return self.put((plan, None))
        return self.put((positions, llama.PagedAttention(self.decode, self.num_pages, plan, mesh=mesh)))

    def call_args(self, tokens, inputs, kv_cache, key):
        """The decode call's arguments."""
        if self.args.scan:
            plan, steps = inputs
            return (self.params, tokens, kv_cache, plan, self.sampling, key, steps)
        positions, attention = inputs
        return (self.params, tokens, positions, kv_cache, attention, None, self.sampling, key)

    def generate(self, prefill_fn, decode_fn, kv_cache):
        """Prefill, then the decode calls (compiled programs of lower(); decode_fn None without
        decode steps); returns (result dict, the KV cache after the last call)."""
        args, batch, new, k = self.args, self.batch, self.args.new_tokens, self.k
        t = time.perf_counter()
        first, kv_cache, key = prefill_fn(*self.prefill_inputs(kv_cache))
        tokens = np.asarray(first)
        ttft = time.perf_counter() - t
        out = [tokens]
        progress = Progress(batch * new, enabled=not args.quiet)
        progress.update(batch, f"TTFT {ttft * 1e3:.1f} ms")
        state = {"kv_cache": kv_cache, "key": key}

        def dispatch(tokens, inputs):
            generated, state["kv_cache"], state["key"] = decode_fn(*self.call_args(tokens, inputs, state["kv_cache"],
                                                                                  state["key"]))
            return generated, generated[-1] if args.scan else generated

        def on_tokens(call, host, seconds):
            shown = min(k, new - 1 - call * k)
            if shown > 0:
                progress.update(batch * shown, f"ITL {seconds / k * 1e3:.1f} ms")

        itl = []
        if self.decode_steps:
            generated, times = decode_loop(dispatch, self.decode_inputs, first, self.decode_steps // k,
                                           overlap=not args.sync, on_tokens=on_tokens)
            for g, dt in zip(generated, times):
                out.extend(g.reshape(-1, batch))
                itl += [dt / k] * k
        tokens_out = np.stack(out[:new], axis=1)  # [B, new]
        itl = itl[:new - 1]
        decode_time = float(np.sum(itl))
        nan = float("nan")
        return dict(batch=batch, tokens=tokens_out, prompt_lens=self.prompt_lens, ttft_s=ttft,
                    itl_s=float(np.mean(itl)) if itl else nan, itl_p50_s=float(np.median(itl)) if itl else nan,
                    decode_tokens_per_s=batch * len(itl) / decode_time if itl else nan,
                    tokens_per_s=batch * new / (ttft + decode_time)), state["kv_cache"]


def main(argv=None):
    """Runs generation once per --batch value, on one model and KV cache; returns one dict per
    value (tokens [B, new_tokens], TTFT, ITL, tokens/s, compile seconds)."""
    args = parse_args(argv)
    cfg = llama.get_config(args.config, args.layers, args.layer_loop, args.tp)
    mesh = None
    if args.tp > 1:
        mesh = Mesh(np.asarray(jax.devices()[:args.tp]), ("tp",))
    elif args.cp > 1:
        mesh = Mesh(np.asarray(jax.devices()[:args.cp]), ("cp",))
    # Host inputs (tokens, plans, ...): replicated on the mesh.
    put = jax.device_put if mesh is None else lambda x: jax.device_put(x, NamedSharding(mesh, P()))
    rng = np.random.default_rng(args.seed)
    runs = [BatchRun(args, cfg, batch, rng) for batch in args.batch]
    # Pages per layer: the largest batch value's (under CP, the most any device holds, on each).
    num_pages = args.cp * max(int(context_shares(r.pages_needed, args.cp).sum(axis=1).max()) for r in runs)

    t = time.perf_counter()
    graphdef, params = llama.build(cfg, args.seed, mesh)
    kv_cache = llama.paged_kv_cache(cfg, num_pages, args.page_size, mesh)
    jax.block_until_ready((params, kv_cache))
    print(f"{args.config}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, heads {cfg.num_heads}/"
          f"{cfg.num_kv_heads}, {cfg.dtype}, {jax.default_backend()}" + (f", TP {args.tp}" if args.tp > 1 else "")
          + (f", CP {args.cp}" if args.cp > 1 else "")
          + f"; {args.new_tokens} new tokens, page {args.page_size}, {num_pages} pages per layer "
          f"(weights + cache {time.perf_counter() - t:.1f} s)", flush=True)
    print(f"memory after weights and cache: {device_memory() or 'not reported by this backend'}", flush=True)
    sampler = llama.Sampler.of(args.temperature, args.top_k, args.top_p, args.min_p)
    step = llama.make_step(graphdef, sampler, mesh)
    t = time.perf_counter()
    lowered = [r.lower(num_pages, graphdef, params, kv_cache, step, sampler, put, mesh) for r in runs]
    trace_s = time.perf_counter() - t
    t = time.perf_counter()
    compiled = iter(compile_all([low for lows in lowered for low in lows]))
    print(f"compile: {sum(map(len, lowered))} programs in {time.perf_counter() - t:.1f} s in parallel (trace "
          f"{trace_s:.1f} s; layers: {cfg.layer_loop}" + (f"; {args.scan} steps per lax.scan)" if args.scan else ")"),
          flush=True)
    results = []
    for r in runs:
        prefill_fn, prefill_s = next(compiled)
        decode_fn, decode_s = next(compiled) if r.decode_steps else (None, 0.0)
        for _ in range(args.warmup):  # the same prompts and pages: the timed run rewrites them
            _, kv_cache = r.generate(prefill_fn, decode_fn, kv_cache)
        result, kv_cache = r.generate(prefill_fn, decode_fn, kv_cache)
        result.update(prefill_compile_s=prefill_s, decode_compile_s=decode_s)
        results.append(result)
        lens = r.prompt_lens
        print(f"batch {r.batch}: TTFT {result['ttft_s'] * 1e3:.1f} ms ({int(lens.sum())} prompt tokens, "
              f"{int(lens.min())}-{int(lens.max())} each) | ITL {result['itl_s'] * 1e3:.2f} ms (p50 "
              f"{result['itl_p50_s'] * 1e3:.2f}) | decode {result['decode_tokens_per_s']:.1f} tokens/s | overall "
              f"{result['tokens_per_s']:.1f} tokens/s | compile prefill {prefill_s:.1f} s, decode {decode_s:.1f} s",
              flush=True)
        print(f"  request 0 ({lens[0]} prompt tokens) -> {result['tokens'][0].tolist()}", flush=True)
    print(f"memory at the end: {device_memory() or 'not reported by this backend'}", flush=True)
    return results


if __name__ == "__main__":
    main()
