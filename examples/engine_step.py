"""tpu-inference's attention metadata, built for a few steps of continuous batching, run by jaxinfer.

    python examples/engine_step.py               # CPU: tiny config, interpret mode, 9 steps
    python examples/engine_step.py --check       # and compare every row with float64 NumPy
    python examples/engine_step.py --dtype bfloat16 --num-pages 4096 --max-tokens 512   # a GPU

The host side builds, each step, what tpu-inference's runner builds (runner/tpu_runner.py and
runner/persistent_batch_manager.py at jaxinfer.compat.tpu_inference.TPU_INFERENCE_COMMIT): the
scheduled requests in a persistent batch, decode requests first; query_start_loc (cu_q_lens,
padded with its last value), seq_lens (kv_lens, new tokens included, 0-padded), block_tables
[max_num_seqs * pages_per_seq] (0-padded) and request_distribution (d, d, num_reqs); tokens
padded to a fixed budget. Every layer's cache is one RPA v3 fused array (kv_cache_shape,
zeros as create_kv_caches). One jitted forward (caches donated) calls the compat entry point once
per layer and compiles once. The "model" is attention only: each layer's q, k, v for a token are
random functions of (layer, request, position), so that --check knows every key a row must see.
On 2 CPU cores: one compilation (20-70 s), then about a second per step.
"""
import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.compat import tpu_inference


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """The model and engine sizes (tiny by default: CPU interpret mode)."""
    num_layers: int = 2
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 128
    page_size: int = 16
    num_pages: int = 24
    max_num_seqs: int = 4
    max_model_len: int = 128
    max_tokens: int = 32  # the step's token budget (tpu-inference pads to buckets; one here)
    dtype: str = "float32"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request:
    rid: int
    arrival: int  # the step it arrives at
    prompt_len: int
    max_new_tokens: int


REQUESTS = (Request(rid=0, arrival=0, prompt_len=20, max_new_tokens=4),
            Request(rid=1, arrival=0, prompt_len=7, max_new_tokens=6),
            Request(rid=2, arrival=1, prompt_len=45, max_new_tokens=3),
            Request(rid=3, arrival=3, prompt_len=5, max_new_tokens=5),
            Request(rid=4, arrival=4, prompt_len=18, max_new_tokens=2))


def token_qkv(cfg, layer, rid, pos):
    """A token's q [Hq, D], k and v [Hkv, D] at one layer (float32, from a seeded generator)."""
    rng = np.random.default_rng((layer, rid, pos))
    return (rng.standard_normal((cfg.num_q_heads, cfg.head_dim), np.float32),
            rng.standard_normal((2, cfg.num_kv_heads, cfg.head_dim), np.float32))


class Engine:
    """The host side: free pages, running requests (tokens in cache, pages), the scheduler."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.free = list(range(cfg.num_pages))
        self.running = {}  # rid -> [request, tokens in cache, page list]

    def schedule(self, step, waiting):
        """Admits arrivals, then gives each running request its tokens: 1 past its prompt
        (decode), else a prompt chunk within the budget. Returns [(rid, num_computed, n)] in
        the persistent batch's order, decode requests first (as tpu-inference reorders)."""
        cfg = self.cfg
        while waiting and waiting[0].arrival <= step and len(self.running) < cfg.max_num_seqs:
            r = waiting.pop(0)
            self.running[r.rid] = [r, 0, []]
        budget, sched = cfg.max_tokens, []
        for rid, (r, done, pages) in self.running.items():
            n = min(1 if done >= r.prompt_len else r.prompt_len - done, budget)
            need = -(-(done + n) // cfg.page_size) - len(pages)
            if n == 0 or need > len(self.free):
                continue
            pages.extend(self.free.pop(0) for _ in range(need))
            budget -= n
            sched.append((rid, done, n))
        return sorted(sched, key=lambda s: s[2] > 1)  # stable: decode first

    def metadata(self, sched):
        """RPA v3's metadata for a step (tpu-inference's names in comments), as int32 arrays."""
        cfg = self.cfg
        pages_per_seq = cfg.max_model_len // cfg.page_size
        n = np.array([s[2] for s in sched], np.int32)
        cu_q_lens = np.full(cfg.max_num_seqs + 1, n.sum(), np.int32)  # query_start_loc
        cu_q_lens[: len(sched) + 1] = np.concatenate([[0], np.cumsum(n)])
        kv_lens = np.zeros(cfg.max_num_seqs, np.int32)  # seq_lens
        kv_lens[: len(sched)] = [done + k for _, done, k in sched]
        table = np.zeros((cfg.max_num_seqs, pages_per_seq), np.int32)  # block_tables
        for i, (rid, _, _) in enumerate(sched):
            pages = self.running[rid][2]
            table[i, :len(pages)] = pages
        num_decode = int(np.sum(n == 1))
        distribution = np.array([num_decode, num_decode, len(sched)], np.int32)  # request_distribution
        return kv_lens, table.reshape(-1), cu_q_lens, distribution

    def advance(self, sched):
        """Records the step's tokens; frees the pages of finished requests."""
        for rid, done, n in sched:
            entry = self.running[rid]
            entry[1] = done + n
            if entry[1] >= entry[0].prompt_len + entry[0].max_new_tokens:
                self.free.extend(entry[2])
                del self.running[rid]


def step_inputs(cfg, sched):
    """The step's q [L, T, Hq, D], k and v [L, T, Hkv, D] (padding rows 0), token-major."""
    q = np.zeros((cfg.num_layers, cfg.max_tokens, cfg.num_q_heads, cfg.head_dim), np.float32)
    kv = np.zeros((cfg.num_layers, 2, cfg.max_tokens, cfg.num_kv_heads, cfg.head_dim), np.float32)
    row = 0
    for rid, done, n in sched:
        for pos in range(done, done + n):
            for layer in range(cfg.num_layers):
                q[layer, row], kv[layer, :, row] = token_qkv(cfg, layer, rid, pos)
            row += 1
    return q, kv[:, 0], kv[:, 1]


def expected_rows(cfg, sched):
    """float64 causal attention of each scheduled row over its request's keys so far: [L, rows, Hq, D]."""
    g, out = cfg.num_q_heads // cfg.num_kv_heads, []
    for layer in range(cfg.num_layers):
        for rid, done, n in sched:
            toks = [token_qkv(cfg, layer, rid, p) for p in range(done + n)]
            k = np.repeat(np.stack([t[1][0] for t in toks]).astype(np.float64), g, axis=1)  # [kv, Hq, D]
            v = np.repeat(np.stack([t[1][1] for t in toks]).astype(np.float64), g, axis=1)
            for p in range(done, done + n):
                s = np.einsum("hd,khd->hk", toks[p][0].astype(np.float64), k[: p + 1]) / np.sqrt(cfg.head_dim)
                w = np.exp(s - s.max(-1, keepdims=True))
                out.append(np.einsum("hk,khd->hd", w / w.sum(-1, keepdims=True), v[: p + 1]))
    return np.stack(out).reshape(cfg.num_layers, -1, cfg.num_q_heads, cfg.head_dim)


def make_forward(cfg):
    """The jitted attention stack: every layer's compat call; caches donated (written in place)."""

    @functools.partial(jax.jit, donate_argnums=0)
    def forward(caches, q, k, v, kv_lens, page_indices, cu_q_lens, distribution):
        outs, new = [], []
        for layer, cache in enumerate(caches):
            o, cache = tpu_inference.ragged_paged_attention(
                q[layer], k[layer], v[layer], cache, kv_lens, page_indices, cu_q_lens, distribution,
                sm_scale=cfg.head_dim ** -0.5)
            outs.append(o)
            new.append(cache)
        return tuple(new), jnp.stack(outs)

    return forward


def run(cfg, *, check=False, max_steps=20):
    """Serves REQUESTS to completion. Returns (steps, largest error against float64 or None)."""
    dtype = jnp.dtype(cfg.dtype)
    shape = tpu_inference.kv_cache_shape(cfg.num_pages, cfg.page_size, cfg.num_kv_heads, cfg.head_dim, dtype)
    caches = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))  # as create_kv_caches
    forward, engine, waiting = make_forward(cfg), Engine(cfg), sorted(REQUESTS, key=lambda r: r.arrival)
    worst = 0.0 if check else None
    for step in range(max_steps):
        if not waiting and not engine.running:
            break
        sched = engine.schedule(step, waiting)
        md = [jnp.asarray(x) for x in engine.metadata(sched)]
        q, k, v = (jnp.asarray(x, dtype) for x in step_inputs(cfg, sched))
        t0 = time.perf_counter()
        caches, out = forward(caches, q, k, v, *md)
        out.block_until_ready()
        ms = 1e3 * (time.perf_counter() - t0)
        rows = sum(s[2] for s in sched)
        line = (f"step {step}: {int(md[3][0])} decode + {len(sched) - int(md[3][0])} prefill chunk(s), "
                f"{rows}/{cfg.max_tokens} tokens, distribution {np.asarray(md[3]).tolist()}, {ms:.0f} ms")
        if check:
            err = float(np.max(np.abs(np.asarray(out[:, :rows], np.float64) - expected_rows(cfg, sched))))
            worst = max(worst, err)
            line += f", max |err| {err:.1e}"
        print(line)
        engine.advance(sched)
    print(f"forward compiled {forward._cache_size()} time(s)")
    return step, worst


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-pages", type=int, default=Config.num_pages)
    ap.add_argument("--max-tokens", type=int, default=Config.max_tokens)
    a = ap.parse_args()
    run(Config(dtype=a.dtype, num_pages=a.num_pages, max_tokens=a.max_tokens), check=a.check)


if __name__ == "__main__":
    main()
