"""Batch generation with a Llama-style Flax model on jaxinfer's paged KV cache.

    python examples/generate.py                      # CPU: tiny random model (Pallas interpret mode)
    python examples/generate.py --scan 4             # 4 decode steps per jitted lax.scan (horizon plan)
    python examples/generate.py --config llama3-8b --batch 16 --prompt-len 512 2048 --new-tokens 128
    python examples/generate.py --temperature 0.8 --top-k 50 --top-p 0.9   # sampling (jaxinfer.sampling)
    python examples/generate.py --config llama3-70b --tp 4                # 4 GPUs, tensor parallel

One prefill for all prompts (BatchPrefillWithPagedKVCache), then one decode step per token
(BatchDecodeWithPagedKVCache). Each step makes one plan on the host, shared by all layers;
plans have fixed capacities (max_batch_size, max_num_pages, max_num_tokens), so the prefill
and the decode step each compile once. The step is one jitted program (layers unrolled by
default, see llama.py; LM head and sampling inside, the cache donated). The host never
stalls the device: step t + 1 is planned, copied over and queued, its tokens input the
device output of step t, before the host waits for step t's tokens (--sync: the old order).
Weights are random: the tokens are meaningless, the timings are not. Prints compile times,
TTFT, ITL (the interval between successive tokens' arrival on the host) and tokens/s.

Tokens are greedy (one argmax) unless --temperature > 0: then jaxinfer.sampling draws them on the
device inside the step (--top-k, --top-p, --min-p filter), with a jax.random key threaded from
step to step (deterministic given --seed; --scan gives the same tokens). --tp N shards the model
over N devices (llama.py: weights column/row parallel, the cache on KV heads, attention through
jaxinfer.sharding.head_parallel, plans replicated); the decode step then appends the K/V through
the page table instead of inside the decode kernel.
"""
import argparse
import sys
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxinfer as ji
import llama
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
    ap.add_argument("--batch", type=int, default=4, help="requests generated together")
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
    ap.add_argument("--sync", action="store_true",
                    help="wait for each step's tokens on the host before planning and launching the next "
                         "(no overlap of host work with the device; for comparison)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and prompts")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    for name in ("batch", "new_tokens", "page_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
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


def compile_timed(fn, *args):
    """Ahead-of-time compile of a jitted fn for these arguments: (compiled, seconds)."""
    t = time.perf_counter()
    compiled = fn.lower(*args).compile()
    return compiled, time.perf_counter() - t


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


def main(argv=None):
    """Runs generation; returns a dict with tokens [B, new_tokens] and the timings."""
    args = parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    cfg = llama.get_config(args.config, args.layers, args.layer_loop, args.tp)
    mesh = Mesh(np.asarray(jax.devices()[:args.tp]), ("tp",)) if args.tp > 1 else None
    # Host inputs (tokens, plans, ...): replicated under TP.
    put = jax.device_put if mesh is None else lambda x: jax.device_put(x, NamedSharding(mesh, P()))
    ps = args.page_size
    kernel_opts = {} if on_gpu else {"num_ctas": 8}  # interpret mode runs the grid serially
    batch, new = args.batch, args.new_tokens
    rng = np.random.default_rng(args.seed)
    prompt_lens = rng.integers(args.prompt_len[0], args.prompt_len[1] + 1, batch)
    prompts = [rng.integers(0, cfg.vocab_size, n).astype(np.int32) for n in prompt_lens]
    k = max(args.scan, 1)
    decode_steps = -(-(new - 1) // k) * k  # the last scan may run past new_tokens; extra tokens are dropped

    # Pages for each request's whole generation, allocated up front.
    pages_needed = -(-(prompt_lens + decode_steps) // ps)
    num_pages = int(pages_needed.sum())
    allocator = PageAllocator(num_pages)
    page_lists = [allocator.alloc(int(n)) for n in pages_needed]

    t = time.perf_counter()
    graphdef, params = llama.build(cfg, args.seed, mesh)
    kv_cache = llama.paged_kv_cache(cfg, num_pages, ps, mesh)
    jax.block_until_ready((params, kv_cache))
    print(f"{args.config}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, heads {cfg.num_heads}/"
          f"{cfg.num_kv_heads}, {cfg.dtype}, {jax.default_backend()}" + (f", TP {args.tp}" if mesh else "")
          + f"; batch {batch}, prompts {int(prompt_lens.min())}-{int(prompt_lens.max())} tokens, {new} new "
          f"tokens, page {ps} (weights + cache {time.perf_counter() - t:.1f} s)", flush=True)
    sampler = llama.Sampler.of(args.temperature, args.top_k, args.top_p, args.min_p)
    step = llama.make_step(graphdef, sampler, mesh)
    sampling, key = put((llama.SamplingParams.full(batch, args.temperature, args.top_k, args.top_p, args.min_p),
                         jax.random.key(args.seed)))
    hs, d = cfg.heads, cfg.head_dim  # per-device heads (all of them without TP)
    hq, hkv = hs.num_qo_heads, hs.num_kv_heads

    # Prefill: every prompt in one call.
    nnz = int(prompt_lens.sum())
    prefill = ji.BatchPrefillWithPagedKVCache(hq, hkv, d, ps, causal=True, max_batch_size=batch,
                                              max_num_tokens=nnz, max_num_pages=num_pages, **kernel_opts)
    qo_indptr = np.concatenate([[0], np.cumsum(prompt_lens)]).astype(np.int32)

    def prefill_inputs():
        kv_indptr, kv_indices, last = page_table(page_lists, prompt_lens, ps)
        plan = prefill.plan(qo_indptr, kv_indptr, kv_indices, last, num_pages=num_pages,
                            q_data_type=cfg.dtype)
        positions = np.concatenate([np.arange(n) for n in prompt_lens]).astype(np.int32)
        attention = llama.PagedAttention(prefill, num_pages, plan,
                                         np.repeat(np.arange(batch), prompt_lens).astype(np.int32),
                                         positions, kv_indptr, pad(kv_indices, num_pages), mesh=mesh)
        return (params, *put((np.concatenate(prompts), positions)), kv_cache, put(attention),
                put(qo_indptr[1:] - 1), sampling, key)

    prefill_fn, prefill_compile_s = compile_timed(step, *prefill_inputs())
    t = time.perf_counter()
    first, kv_cache, key = prefill_fn(*prefill_inputs())
    tokens = np.asarray(first)
    ttft = time.perf_counter() - t
    out = [tokens]
    progress = Progress(batch * new, enabled=not args.quiet)
    progress.update(batch, f"TTFT {ttft * 1e3:.1f} ms")

    # Decode.
    decode = ji.BatchDecodeWithPagedKVCache(hq, hkv, d, ps, max_batch_size=batch,
                                            max_num_pages=num_pages, **kernel_opts)

    def decode_inputs(call):
        """Host plan for decode call `call` (k steps from token `call * k`), sent to the device.
        Row b is request b at its last position, so the decode kernel appends the K/V itself
        (under TP through the page table, which is also sent)."""
        lens = prompt_lens + call * k + (k if args.scan else 1)  # after the call's last token is appended
        kv_indptr, kv_indices, last = page_table(page_lists, lens, ps)
        plan = decode.plan(kv_indptr, kv_indices, last, num_pages=num_pages, horizon=k if args.scan else 1)
        table = (kv_indptr, pad(kv_indices, num_pages))
        if args.scan:
            return put((plan, table if mesh else None))
        positions = (lens - 1).astype(np.int32)
        append = (np.arange(batch, dtype=np.int32), positions, *table) if mesh else ()
        return put((positions, llama.PagedAttention(decode, num_pages, plan, *append, mesh=mesh)))

    state = {"kv_cache": kv_cache, "key": key}

    def call_args(tokens, inputs):
        if args.scan:
            plan, table = inputs
            return (params, tokens, state["kv_cache"], plan, sampling, state["key"], table)
        positions, attention = inputs
        return (params, tokens, positions, state["kv_cache"], attention, None, sampling, state["key"])

    def dispatch(tokens, inputs):
        generated, state["kv_cache"], state["key"] = decode_fn(*call_args(tokens, inputs))
        return generated, generated[-1] if args.scan else generated

    def on_tokens(call, host, seconds):
        shown = min(k, new - 1 - call * k)
        if shown > 0:
            progress.update(batch * shown, f"ITL {seconds / k * 1e3:.1f} ms")

    decode_compile_s, itl = 0.0, []
    if decode_steps:
        fn = (llama.make_decode_scan(graphdef, decode, num_pages, k, sampler, mesh) if args.scan else step)
        decode_fn, decode_compile_s = compile_timed(fn, *call_args(first, decode_inputs(0)))
        generated, times = decode_loop(dispatch, decode_inputs, first, decode_steps // k,
                                       overlap=not args.sync, on_tokens=on_tokens)
        for g, dt in zip(generated, times):
            out.extend(g.reshape(-1, batch))
            itl += [dt / k] * k

    tokens_out = np.stack(out[:new], axis=1)  # [B, new]
    decode_time = float(np.sum(itl[:new - 1]))
    result = dict(tokens=tokens_out, prompt_lens=prompt_lens, ttft_s=ttft,
                  itl_s=float(np.mean(itl[:new - 1])) if new > 1 else float("nan"),
                  decode_tokens_per_s=batch * (new - 1) / decode_time if new > 1 else float("nan"),
                  tokens_per_s=batch * new / (ttft + decode_time),
                  prefill_compile_s=prefill_compile_s, decode_compile_s=decode_compile_s)
    print(f"compile: prefill {prefill_compile_s:.1f} s, decode {decode_compile_s:.1f} s "
          f"(layers: {cfg.layer_loop}" + (f"; {k} steps per lax.scan)" if args.scan else ")"))
    print(f"TTFT {ttft * 1e3:.1f} ms ({nnz} prompt tokens) | ITL {result['itl_s'] * 1e3:.2f} ms | "
          f"decode {result['decode_tokens_per_s']:.1f} tokens/s | overall {result['tokens_per_s']:.1f} tokens/s")
    print(f"request 0 ({prompt_lens[0]} prompt tokens) -> {tokens_out[0].tolist()}")
    return result


if __name__ == "__main__":
    main()
