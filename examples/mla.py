"""One DeepSeek-V3 attention layer (multi-head latent attention) in Flax NNX on jaxinfer.

    python examples/mla.py [--config tiny | deepseek-v3] [--batch 3] [--prompt-len 5 24] [--new-tokens 4]

The layer, as the DeepSeek-V2 paper (section 2.1) describes it, with DeepSeek-V3's shapes: a
token's hidden state x gives a query through a low-rank path (c_q = RMSNorm(x W_DQ), q = c_q W_UQ:
per head q_nope and a rotary part q_pe), and one latent row shared by every head: c_kv =
RMSNorm(x W_DKV) (512) and k_pe = RoPE(x W_KR) (64). Per head, k_nope = c_kv W_UK and v = c_kv W_UV.

- Prefill (the prompts) leaves the weights unabsorbed, as SGLang and vLLM run it: q and k of
  nope + rope = 192 (k_pe shared by the heads), v and o of 128, ragged causal attention through
  BatchPrefillWithRaggedKVCache(H, H, 192, head_dim_vo=128). The prompts' latent rows go into
  a paged latent cache (ckv [pages, page, 512], kpe [pages, page, 64]).
- Decode absorbs the weights: q_nope . k_nope = (q_nope W_UK^T) . c_kv, so each head's query is
  q_nope W_UK^T (512 wide) against the latent rows themselves, through BatchMLAPagedAttention
  (one compilation for every step); W_UV then maps each head's 512-wide output to its 128.

Every step is checked against a dense reference: the same layer, unabsorbed, with plain jnp
attention over each request's tokens in float32. Weights and hidden states are random (nothing
is downloaded); sm_scale is 1 / sqrt(192) (V3's YaRN factor is left out). --config tiny (the
default, float32) runs on a CPU in seconds; --config deepseek-v3 has V3's dimensions (hidden
7168, 128 heads, q rank 1536, latent 512 + 64, bfloat16: ~187M weights) for a GPU.
"""
import argparse
import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxinfer as ji


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepSeekAttentionConfig:
    hidden_size: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int       # the latent c_kv's width (ckv)
    qk_nope_head_dim: int
    qk_rope_head_dim: int   # k_pe's width (kpe), shared by the heads
    v_head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    dtype: str = "bfloat16"

    @property
    def qk_head_dim(self):
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def sm_scale(self):
        return 1.0 / math.sqrt(self.qk_head_dim)


CONFIGS = {
    # CPU: Pallas interpret mode is slow, so the demo layer is tiny (float32; q / k of 48 = 32 + 16).
    "tiny": DeepSeekAttentionConfig(hidden_size=64, num_heads=4, q_lora_rank=48, kv_lora_rank=64,
                                    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, dtype="float32"),
    # DeepSeek-V3's attention shapes (random bfloat16 weights).
    "deepseek-v3": DeepSeekAttentionConfig(hidden_size=7168, num_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                                           qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
}


def rms_norm(x, weight, eps):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps) * weight).astype(x.dtype)


def rope(x, positions, theta):
    """Rotary embedding of x [T, ..., D] at positions [T] (rotate halves)."""
    half = x.shape[-1] // 2
    freq = theta ** (-np.arange(half, dtype=np.float32) / half)  # [D/2]
    angle = positions.astype(jnp.float32)[:, None] * freq  # [T, D/2]
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (half,)
    cos, sin = jnp.cos(angle).reshape(shape), jnp.sin(angle).reshape(shape)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


class MLALayer(nnx.Module):
    """DeepSeek's attention layer: weights as nnx.Params, each math step in `dtype` (the reference
    calls the same steps in float32)."""

    def __init__(self, cfg, *, rngs):
        self.cfg = cfg
        h, dc, dr = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        dtype = jnp.dtype(cfg.dtype)

        def weight(shape, fan_in):
            return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype))

        self.w_dq = weight((cfg.hidden_size, cfg.q_lora_rank), cfg.hidden_size)  # W_DQ
        self.q_norm = nnx.Param(jnp.ones((cfg.q_lora_rank,), dtype))
        self.w_uq = weight((cfg.q_lora_rank, h, cfg.qk_head_dim), cfg.q_lora_rank)  # W_UQ, W_QR
        self.w_dkv = weight((cfg.hidden_size, dc + dr), cfg.hidden_size)  # W_DKV, W_KR
        self.kv_norm = nnx.Param(jnp.ones((dc,), dtype))
        self.w_uk = weight((dc, h, cfg.qk_nope_head_dim), dc)  # W_UK
        self.w_uv = weight((dc, h, cfg.v_head_dim), dc)  # W_UV
        self.w_o = weight((h, cfg.v_head_dim, cfg.hidden_size), h * cfg.v_head_dim)  # W_O

    def project(self, x, positions, dtype):
        """x [T, hidden], positions [T] -> q_nope [T, H, dn], q_pe [T, H, dr] (rotated), c_kv
        [T, dc] (normalized), k_pe [T, dr] (rotated)."""
        cfg, x = self.cfg, x.astype(dtype)
        c_q = rms_norm(x @ self.w_dq[...].astype(dtype), self.q_norm[...].astype(jnp.float32), cfg.rms_norm_eps)
        q = jnp.einsum("tr,rhd->thd", c_q, self.w_uq[...].astype(dtype))  # [T, H, dn + dr]
        q_nope, q_pe = q[..., :cfg.qk_nope_head_dim], rope(q[..., cfg.qk_nope_head_dim:], positions, cfg.rope_theta)
        kv = x @ self.w_dkv[...].astype(dtype)  # [T, dc + dr]
        c_kv = rms_norm(kv[:, :cfg.kv_lora_rank], self.kv_norm[...].astype(jnp.float32), cfg.rms_norm_eps)
        k_pe = rope(kv[:, cfg.kv_lora_rank:], positions, cfg.rope_theta)
        return q_nope, q_pe, c_kv, k_pe

    def unabsorbed(self, q_nope, q_pe, c_kv, k_pe, dtype):
        """Per-head q, k [T, H, dn + dr] and v [T, H, dv] (k_pe shared by the heads)."""
        w_uk, w_uv = self.w_uk[...].astype(dtype), self.w_uv[...].astype(dtype)
        k_nope = jnp.einsum("tc,chd->thd", c_kv, w_uk)
        v = jnp.einsum("tc,chd->thd", c_kv, w_uv)
        k_pe = jnp.broadcast_to(k_pe[:, None], k_nope.shape[:2] + k_pe.shape[-1:])
        return jnp.concatenate([q_nope, q_pe], -1), jnp.concatenate([k_nope, k_pe], -1), v

    def out(self, o, dtype):
        """o [T, H, dv] -> [T, hidden]."""
        return jnp.einsum("thd,hdm->tm", o, self.w_o[...].astype(dtype))

    def prefill(self, x, positions, wrapper, plan):
        """Prompts (ragged, causal within each): the 192 / 128 form. Returns (out [T, hidden],
        c_kv [T, dc], k_pe [T, dr]) for the latent cache."""
        dtype = jnp.dtype(self.cfg.dtype)
        q_nope, q_pe, c_kv, k_pe = self.project(x, positions, dtype)
        q, k, v = self.unabsorbed(q_nope, q_pe, c_kv, k_pe, dtype)
        return self.out(wrapper.run(q, k, v, plan), dtype), c_kv, k_pe

    def decode(self, x, positions, ckv_cache, kpe_cache, rows, wrapper, plan):
        """One token per request, W_UK absorbed into q and W_UV applied after attention: its latent
        row written at cache rows `rows` [B], then attention over the latent cache. Returns
        (out [B, hidden], ckv_cache, kpe_cache)."""
        dtype = jnp.dtype(self.cfg.dtype)
        q_nope, q_pe, c_kv, k_pe = self.project(x, positions, dtype)
        ckv_cache, kpe_cache = write_latents(ckv_cache, kpe_cache, rows, c_kv, k_pe)
        q_latent = jnp.einsum("thd,chd->thc", q_nope, self.w_uk[...].astype(dtype))  # [B, H, dc]
        o_latent = wrapper.run(q_latent, q_pe, ckv_cache, kpe_cache, plan)  # [B, H, dc]
        o = jnp.einsum("thc,chd->thd", o_latent, self.w_uv[...].astype(dtype))  # [B, H, dv]
        return self.out(o, dtype), ckv_cache, kpe_cache

    def reference(self, x):
        """One request's tokens x [S, hidden] at positions 0..S-1, causal, dense jnp attention in
        float32 (unabsorbed): out [S, hidden]. Row i is token i's output at any later step too."""
        with jax.default_matmul_precision("highest"):
            q, k, v = self.unabsorbed(*self.project(x, jnp.arange(x.shape[0]), jnp.float32), jnp.float32)
            s = jnp.einsum("qhd,khd->hqk", q, k) * self.cfg.sm_scale
            n = x.shape[0]
            s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -jnp.inf)
            o = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, -1), v)
            return self.out(o, jnp.float32)


def write_latents(ckv_cache, kpe_cache, rows, c_kv, k_pe):
    """Latent rows c_kv [T, dc], k_pe [T, dr] written at cache rows (page * page_size + slot) [T]."""
    shape_c, shape_r = ckv_cache.shape, kpe_cache.shape
    ckv = ckv_cache.reshape(-1, shape_c[-1]).at[rows].set(c_kv.astype(ckv_cache.dtype))
    kpe = kpe_cache.reshape(-1, shape_r[-1]).at[rows].set(k_pe.astype(kpe_cache.dtype))
    return ckv.reshape(shape_c), kpe.reshape(shape_r)


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny", choices=sorted(CONFIGS), help="layer shapes and dtype")
    ap.add_argument("--batch", type=int, default=3, help="requests")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(5, 24), metavar=("MIN", "MAX"),
                    help="prompt lengths are drawn from [MIN, MAX]")
    ap.add_argument("--new-tokens", type=int, default=4, help="decode steps")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per latent cache page")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and hidden states")
    args = ap.parse_args(argv)
    cfg = CONFIGS[args.config]
    dtype = jnp.dtype(cfg.dtype)
    tol = 1e-4 if dtype == jnp.float32 else 2e-2
    rng = np.random.default_rng(args.seed)
    layer = MLALayer(cfg, rngs=nnx.Rngs(args.seed))
    graphdef, state = nnx.split(layer)
    h, dc, dr, ps, b = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, args.page_size, args.batch

    # Each request's hidden states (a previous layer's output: random here), prompt then new tokens.
    lens = rng.integers(args.prompt_len[0], args.prompt_len[1] + 1, b)
    total = lens + args.new_tokens
    xs = [rng.standard_normal((int(n), cfg.hidden_size)).astype(np.float32) for n in total]
    # Pages for every request's whole sequence, in random order; a token's cache row.
    pages = -(-total // ps)
    num_pages = int(pages.sum()) + 2
    kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    kv_indices = rng.permutation(num_pages)[:kv_indptr[-1]].astype(np.int32)

    def rows(req, positions):
        positions = np.asarray(positions)
        return kv_indices[kv_indptr[req] + positions // ps] * ps + positions % ps

    ckv_cache = jnp.zeros((num_pages, ps, dc), dtype)
    kpe_cache = jnp.zeros((num_pages, ps, dr), dtype)

    # Prefill: every prompt at once, ragged, in the 192 / 128 form.
    prefill_attn = ji.BatchPrefillWithRaggedKVCache(h, h, cfg.qk_head_dim, head_dim_vo=cfg.v_head_dim, causal=True,
                                                    sm_scale=cfg.sm_scale)
    qo_indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    prefill_plan = prefill_attn.plan(qo_indptr, qo_indptr)

    @jax.jit
    def prefill_step(state, x, positions, plan, ckv_cache, kpe_cache, rows):
        out, c_kv, k_pe = nnx.merge(graphdef, state).prefill(x, positions, prefill_attn, plan)
        return (out, *write_latents(ckv_cache, kpe_cache, rows, c_kv, k_pe))

    x = jnp.asarray(np.concatenate([xs[i][:lens[i]] for i in range(b)]), dtype)
    positions = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    prompt_rows = np.concatenate([rows(i, np.arange(lens[i])) for i in range(b)]).astype(np.int32)
    start = time.perf_counter()
    out, ckv_cache, kpe_cache = prefill_step(state, x, positions, prefill_plan, ckv_cache, kpe_cache, prompt_rows)
    out = np.asarray(out)
    print(f"{args.config}: {b} prompts of {lens.tolist()} tokens, {h} heads, q/k {cfg.qk_head_dim}, v/o "
          f"{cfg.v_head_dim}, latent {dc} + {dr}, {dtype.name}, page {ps}")
    # The reference over each request's whole sequence at once (causal: a row does not depend on
    # later ones), the sequences zero-padded to one length: one program.
    padded = np.zeros((b, int(total.max()), cfg.hidden_size), np.float32)
    for i in range(b):
        padded[i, :total[i]] = xs[i]
    want_all = np.asarray(jax.jit(jax.vmap(lambda state, x: nnx.merge(graphdef, state).reference(x),
                                           in_axes=(None, 0)))(state, padded))  # [B, S, hidden]
    want = np.concatenate([want_all[i, :lens[i]] for i in range(b)])
    prefill_err = rel_err(out, want)
    print(f"prefill ({prefill_plan.impl}, {time.perf_counter() - start:.1f} s with compile): "
          f"rel err {prefill_err:.1e} against the dense reference")

    # Decode: one token per request per step, absorbed, over the paged latent cache.
    decode_attn = ji.BatchMLAPagedAttention(h, dc, dr, ps, causal=True, sm_scale=cfg.sm_scale, max_batch_size=b,
                                            max_num_tokens=b, max_num_pages=int(kv_indptr[-1]))

    @jax.jit
    def decode_step(state, x, positions, ckv_cache, kpe_cache, rows, plan):
        return nnx.merge(graphdef, state).decode(x, positions, ckv_cache, kpe_cache, rows, decode_attn, plan)

    decode_errs = []
    for step in range(args.new_tokens):
        pos = lens + step  # [B] the new token's position
        plan = decode_attn.plan(np.arange(b + 1, dtype=np.int32), kv_indptr, kv_indices, (pos + 1).astype(np.int32),
                                num_pages=num_pages)
        x = jnp.asarray(np.stack([xs[i][pos[i]] for i in range(b)]), dtype)
        step_rows = np.array([rows(i, pos[i]) for i in range(b)], np.int32)
        start = time.perf_counter()
        out, ckv_cache, kpe_cache = decode_step(state, x, pos.astype(np.int32), ckv_cache, kpe_cache, step_rows, plan)
        out = np.asarray(out)
        elapsed = time.perf_counter() - start
        decode_errs.append(rel_err(out, want_all[np.arange(b), pos]))
        print(f"decode step {step} ({plan.impl}, {elapsed * 1e3:.0f} ms): rel err {decode_errs[-1]:.1e}")
    compiles = decode_step._cache_size()
    print(f"decode: {compiles} compilation for {args.new_tokens} steps")
    worst = max([prefill_err] + decode_errs)
    if worst > tol:
        raise SystemExit(f"error {worst:.1e} over the tolerance {tol:.0e}")
    print(f"ok: every step within {tol:.0e} of the dense reference")
    return dict(prefill_err=prefill_err, decode_errs=decode_errs, decode_compiles=compiles, tol=tol)


if __name__ == "__main__":
    main()
