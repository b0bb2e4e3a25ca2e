"""Batch generation with a Llama-style Flax model on jaxinfer's paged KV cache.

    python examples/generate.py                      # CPU: tiny random model (Pallas interpret mode)
    python examples/generate.py --scan 4             # 4 decode steps per jitted lax.scan (horizon plan)
    python examples/generate.py --config llama3-8b --batch 16 --prompt-len 512 2048 --new-tokens 128

One prefill for all prompts (BatchPrefillWithPagedKVCache), then one decode step per token
(BatchDecodeWithPagedKVCache). Each step makes one plan on the host, shared by all layers;
plans have fixed capacities (max_batch_size, max_num_pages, max_num_tokens), so the prefill
and the decode step each compile once. Weights are random: the tokens are meaningless, the
timings are not. Prints compile times, TTFT, ITL and tokens/s.
"""
import argparse
import sys
import time

import jax
import numpy as np
from flax import nnx

import jaxinfer as ji
import llama
from planner.allocator import PageAllocator, page_table, pad


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny", choices=sorted(llama.CONFIGS))
    ap.add_argument("--layers", type=int, default=None, help="override the config's layer count")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"),
                    help="prompt lengths are uniform on [MIN, MAX]")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens generated per request")
    ap.add_argument("--scan", type=int, default=0, metavar="K",
                    help="run K decode steps per jitted lax.scan with a horizon plan (0: one step per call)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    for name in ("batch", "new_tokens", "page_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 1 <= args.prompt_len[0] <= args.prompt_len[1]:
        raise ValueError(f"--prompt-len must satisfy 1 <= MIN <= MAX, got {args.prompt_len}")
    if args.scan < 0:
        raise ValueError(f"--scan must be >= 0, got {args.scan}")
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


def main(argv=None):
    """Runs generation; returns a dict with tokens [B, new_tokens] and the timings."""
    args = parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    cfg = llama.get_config(args.config, args.layers)
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
    model = llama.Llama(cfg, rngs=nnx.Rngs(args.seed))
    graphdef, params = nnx.split(model)
    kv_cache = llama.paged_kv_cache(cfg, num_pages, ps)
    jax.block_until_ready((params, kv_cache))
    print(f"{args.config}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, heads {cfg.num_heads}/"
          f"{cfg.num_kv_heads}, {cfg.dtype}, {jax.default_backend()}; batch {batch}, prompts "
          f"{int(prompt_lens.min())}-{int(prompt_lens.max())} tokens, {new} new tokens, page {ps} "
          f"(weights + cache {time.perf_counter() - t:.1f} s)", flush=True)
    step = llama.make_step(graphdef)
    temperature = np.full(batch, args.temperature, np.float32)
    seeds = np.arange(batch, dtype=np.int32)
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    # Prefill: every prompt in one call.
    nnz = int(prompt_lens.sum())
    prefill = ji.BatchPrefillWithPagedKVCache(hq, hkv, d, ps, causal=True, max_batch_size=batch,
                                              max_num_tokens=nnz, max_num_pages=num_pages, **kernel_opts)
    qo_indptr = np.concatenate([[0], np.cumsum(prompt_lens)]).astype(np.int32)

    def prefill_inputs():
        kv_indptr, kv_indices, last = page_table(page_lists, prompt_lens, ps)
        plan = prefill.plan(qo_indptr, kv_indptr, kv_indices, last, num_pages=num_pages)
        positions = np.concatenate([np.arange(n) for n in prompt_lens]).astype(np.int32)
        attention = llama.PagedAttention(prefill, num_pages, plan,
                                         np.repeat(np.arange(batch), prompt_lens).astype(np.int32),
                                         positions, kv_indptr, pad(kv_indices, num_pages))
        return (params, np.concatenate(prompts), positions, kv_cache, attention, qo_indptr[1:] - 1,
                temperature, seeds)

    prefill_fn, prefill_compile_s = compile_timed(step, *prefill_inputs())
    t = time.perf_counter()
    first, kv_cache = prefill_fn(*prefill_inputs())
    tokens = np.asarray(first)
    ttft = time.perf_counter() - t
    out = [tokens]
    progress = Progress(batch * new, enabled=not args.quiet)
    progress.update(batch, f"TTFT {ttft * 1e3:.1f} ms")

    # Decode.
    decode = ji.BatchDecodeWithPagedKVCache(hq, hkv, d, ps, max_batch_size=batch,
                                            max_num_pages=num_pages, **kernel_opts)
    rows = np.arange(batch, dtype=np.int32)

    def page_inputs(lens, horizon=1):
        kv_indptr, kv_indices, last = page_table(page_lists, lens, ps)
        plan = decode.plan(kv_indptr, kv_indices, last, num_pages=num_pages, horizon=horizon)
        return plan, kv_indptr, pad(kv_indices, num_pages)

    def decode_inputs(tokens, done):
        lens = prompt_lens + done + 1  # after this step's token is appended
        positions = (lens - 1).astype(np.int32)
        if args.scan:
            plan, kv_indptr, kv_indices = page_inputs(prompt_lens + done + k, horizon=k)
            return params, tokens, kv_cache, plan, kv_indptr, kv_indices, temperature, seeds
        plan, kv_indptr, kv_indices = page_inputs(lens)
        attention = llama.PagedAttention(decode, num_pages, plan, rows, positions, kv_indptr, kv_indices)
        return params, tokens, positions, kv_cache, attention, None, temperature, seeds

    decode_compile_s, itl = 0.0, []
    if decode_steps:
        fn = (llama.make_decode_scan(graphdef, decode, num_pages, k) if args.scan else step)
        decode_fn, decode_compile_s = compile_timed(fn, *decode_inputs(tokens, 0))
    done = 0
    while done < decode_steps:
        t = time.perf_counter()
        generated, kv_cache = decode_fn(*decode_inputs(tokens, done))
        generated = np.asarray(generated).reshape(-1, batch)  # [k, B]
        dt = (time.perf_counter() - t) / k
        itl += [dt] * k
        tokens = generated[-1]
        out.extend(generated)
        shown = min(k, new - 1 - done)
        done += k
        if shown > 0:
            progress.update(batch * shown, f"ITL {dt * 1e3:.1f} ms")

    tokens_out = np.stack(out[:new], axis=1)  # [B, new]
    decode_time = float(np.sum(itl[:new - 1]))
    result = dict(tokens=tokens_out, prompt_lens=prompt_lens, ttft_s=ttft,
                  itl_s=float(np.mean(itl[:new - 1])) if new > 1 else float("nan"),
                  decode_tokens_per_s=batch * (new - 1) / decode_time if new > 1 else float("nan"),
                  tokens_per_s=batch * new / (ttft + decode_time),
                  prefill_compile_s=prefill_compile_s, decode_compile_s=decode_compile_s)
    print(f"compile: prefill {prefill_compile_s:.1f} s, decode {decode_compile_s:.1f} s"
          + (f" ({k} steps per lax.scan)" if args.scan else ""))
    print(f"TTFT {ttft * 1e3:.1f} ms ({nnz} prompt tokens) | ITL {result['itl_s'] * 1e3:.2f} ms | "
          f"decode {result['decode_tokens_per_s']:.1f} tokens/s | overall {result['tokens_per_s']:.1f} tokens/s")
    print(f"request 0 ({prompt_lens[0]} prompt tokens) -> {tokens_out[0].tolist()}")
    return result


if __name__ == "__main__":
    main()
