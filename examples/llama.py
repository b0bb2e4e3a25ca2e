"""A Llama-architecture decoder in Flax NNX whose attention runs on jaxinfer.

RMSNorm, RoPE (Llama convention: rotate halves, rope_theta), grouped-query attention, SwiGLU
MLP; random weights (nothing is downloaded). cfg.layer_loop picks how the layers run:

  "unroll" (default)  one weight array and one KV cache per layer, the layers unrolled in Python
                      under one jit: every matmul reads its weights in place. The layer is one
                      inner jit, so it is traced and lowered once, not once per layer.
  "scan"              weights stacked [L, ...] and one lax.scan over them, one stacked cache:
                      compiles one layer, but XLA materializes each layer's weight slice
                      (dynamic-slice) before its matmuls, about doubling the weight traffic
                      (15.7 ms against 6.5 ms unrolled, Llama-3-8B, batch 1, H100).

Both loops build identical weights from the same seed, so they give the same tokens.

Attention goes through an attention object passed to the model with the step's inputs:

  PagedAttention  jaxinfer over paged caches (per layer, or one stacked cache whose layer l's
                  page p is cache page l * pages_per_layer + p): new K/V written with
                  append_paged_kv_cache, then BatchPrefillWithPagedKVCache (prompts),
                  BatchDecodeWithPagedKVCache (one token per request) or
                  MultiLevelCascadeAttention (shared prefixes) with one plan per step. Decode
                  steps without a page table (batch_indices None) write the new K/V inside
                  the decode kernel instead (run(..., append_kv="from_q"), q, k, v in one
                  array): one launch per layer.
  DenseAttention  the baseline: a dense padded cache [L, B, S, Hkv, D] and plain jnp attention
                  (impl="jnp") or jax.nn.dot_product_attention(implementation="cudnn").
"""
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import jaxinfer as ji


LAYER_LOOPS = ("unroll", "scan")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    dtype: str = "bfloat16"
    layer_loop: str = "unroll"  # "unroll" or "scan" (see the module docstring)

    def __post_init__(self):
        if self.layer_loop not in LAYER_LOOPS:
            raise ValueError(f"layer_loop must be one of {LAYER_LOOPS}, got {self.layer_loop!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates halves), got {self.head_dim}")


CONFIGS = {
    # CPU: Pallas interpret mode is slow, so the test/demo model is tiny (float32).
    "tiny": LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10000.0, dtype="float32"),
    # Llama-3-8B shapes (random bfloat16 weights).
    "llama3-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                             num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128),
}


def get_config(name, num_layers=None, layer_loop=None):
    """A named config, optionally with fewer layers (quick GPU runs) or another layer loop."""
    if name not in CONFIGS:
        raise ValueError(f"config must be one of {sorted(CONFIGS)}, got {name!r}")
    cfg = CONFIGS[name]
    if num_layers is not None:
        cfg = dataclasses.replace(cfg, num_layers=num_layers)
    if layer_loop is not None:
        cfg = dataclasses.replace(cfg, layer_loop=layer_loop)
    return cfg


def rms_norm(x, weight, eps):
    """x [..., H] * rsqrt(mean(x^2) + eps) * weight, computed in float32."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * weight.astype(jnp.float32)).astype(x.dtype)


def rope_tables(positions, head_dim, theta):
    """cos, sin [N, D/2] of positions [N] for frequencies theta^(-2i/D)."""
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
    """Llama (rotate-half) RoPE: x [N, H, D] with cos, sin [N, D/2]."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


LAYER_PARAMS = ("attn_norm", "wqkv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


def layer_param_shapes(cfg):
    """{name: (shape of one layer's array, fan_in)}; fan_in None: a norm weight (ones)."""
    H, F = cfg.hidden_size, cfg.intermediate_size
    hq, hkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return dict(attn_norm=((H,), None), wqkv=((H, hq + 2 * hkv), H), wo=((hq, H), hq),
                mlp_norm=((H,), None), w_gate=((H, F), H), w_up=((H, F), H), w_down=((F, H), F))


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "fan_in"))
def _normal(key, shape, dtype, fan_in):
    return (jax.random.normal(key, shape, dtype) * fan_in ** -0.5).astype(dtype)


class LayerWeights(nnx.Module):
    """One layer's weights (unroll), or all layers' stacked [L, ...] (scan): attn_norm [H],
    wqkv [H, (Hq + 2 Hkv) * D] (the q, k and v projections as one matmul), wo [Hq*D, H],
    mlp_norm [H], w_gate, w_up [H, F], w_down [F, H]."""

    def __init__(self, arrays):
        for name in LAYER_PARAMS:
            setattr(self, name, nnx.Param(arrays[name]))

    def arrays(self):
        return {name: getattr(self, name)[...] for name in LAYER_PARAMS}


@functools.partial(jax.jit, static_argnames=("cfg",))
def _layer(cfg, x, w, cos, sin, attention, layer, kv_cache):
    """One decoder layer: x [N, H] -> (x [N, H], kv_cache). w: the layer's arrays (LayerWeights);
    layer: None (kv_cache is this layer's own) or the index into a stacked cache. A jit of its
    own, so the unrolled model traces and lowers it once (XLA inlines the calls)."""
    n = x.shape[0]
    with jax.named_scope("qkv_proj"):
        h = rms_norm(x, w["attn_norm"], cfg.rms_norm_eps)
        # One matmul for q, k and v: at batch 1 three (one of [H, Hq*D], two of [H, Hkv*D]) took
        # 1 ms more per step than one (Llama-3-8B shapes, H100).
        qkv = h @ w["wqkv"]                                            # [N, (Hq + 2 Hkv) * D]
        if n == 1:  # materialized: XLA turns a one-row dot into a multiply + reduce and fuses that
            # into its consumer (the decode step's q/k/v concatenate: 200 µs a layer on an H100)
            qkv = jax.lax.optimization_barrier(qkv)
        qkv = qkv.reshape(n, cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim)
        q, k, v = jnp.split(qkv, [cfg.num_heads, cfg.num_heads + cfg.num_kv_heads], axis=1)  # [N, Hq | Hkv | Hkv, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    with jax.named_scope("attention"):
        o, kv_cache = attention(layer, q, k, v, kv_cache)              # [N, Hq, D]
    with jax.named_scope("o_proj"):
        x = x + o.reshape(n, -1) @ w["wo"]
    with jax.named_scope("mlp"):
        h = rms_norm(x, w["mlp_norm"], cfg.rms_norm_eps)
        x = x + (jax.nn.silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"]
    return x, kv_cache


class Llama(nnx.Module):
    """Llama decoder; cfg.layer_loop "unroll" (per-layer weights and caches) or "scan" (stacked).

        model = Llama(get_config("tiny"), rngs=nnx.Rngs(0))
        kv_cache = paged_kv_cache(model.cfg, pages_per_layer, page_size)   # matches the loop
        logits, kv_cache = model(tokens, positions, kv_cache, attention, logits_index=last)
    """

    def __init__(self, cfg, *, rngs):
        self.cfg = cfg
        dtype = jnp.dtype(cfg.dtype)
        self.embed = nnx.Param(_normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dtype, 1))  # [V, H]
        # Layer l's array of each name comes from fold_in(that name's key, l): both loops get the same weights.
        per_layer = []
        for name, (shape, fan_in) in layer_param_shapes(cfg).items():
            key = rngs.params()
            per_layer.append([jnp.ones(shape, dtype) if fan_in is None
                              else _normal(jax.random.fold_in(key, l), shape, dtype, fan_in)
                              for l in range(cfg.num_layers)])
        if cfg.layer_loop == "scan":
            self.layers = LayerWeights({name: jnp.stack(arrays) for name, arrays in zip(LAYER_PARAMS, per_layer)})
        else:
            self.layers = nnx.List([LayerWeights(dict(zip(LAYER_PARAMS, arrays))) for arrays in zip(*per_layer)])
        del per_layer
        self.norm = nnx.Param(jnp.ones((cfg.hidden_size,), dtype))
        self.lm_head = nnx.Param(_normal(rngs.params(), (cfg.hidden_size, cfg.vocab_size), dtype,
                                         cfg.hidden_size))                                 # [H, V]

    def __call__(self, tokens, positions, kv_cache, attention, *, logits_index=None):
        """tokens, positions int32[N] -> (logits [N or M, V] float32, updated kv_cache).

        kv_cache: a tuple of one cache per layer (unroll) or one stacked cache (scan), as
        paged_kv_cache / dense_kv_cache build them for this cfg. attention(layer, q, k, v,
        kv_cache) -> (o, kv_cache) writes the new K/V and attends (PagedAttention or
        DenseAttention). logits_index int32[M] (optional) picks the rows that need logits
        (each request's last prompt token), before the LM head.
        """
        cfg = self.cfg
        with jax.named_scope("embed"):
            x = jnp.take(self.embed[...], tokens, axis=0)                # [N, H]
            cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta)
        per_layer = isinstance(kv_cache, (tuple, list))
        if per_layer != (cfg.layer_loop == "unroll"):
            raise ValueError(f"kv_cache must be {'a tuple of per-layer caches' if cfg.layer_loop == 'unroll' else 'one stacked cache'} "
                             f"for layer_loop={cfg.layer_loop!r} (build it with paged_kv_cache / dense_kv_cache)")
        if cfg.layer_loop == "scan":
            def body(carry, xs):
                x, kv_cache = carry
                w, layer = xs
                return _layer(cfg, x, w, cos, sin, attention, layer, kv_cache), None

            layers = jnp.arange(cfg.num_layers, dtype=jnp.int32)
            (x, kv_cache), _ = jax.lax.scan(body, (x, kv_cache), (self.layers.arrays(), layers))
        else:
            if len(kv_cache) != cfg.num_layers:
                raise ValueError(f"kv_cache must hold {cfg.num_layers} layer caches, got {len(kv_cache)}")
            caches = list(kv_cache)
            for l, weights in enumerate(self.layers):
                x, caches[l] = _layer(cfg, x, weights.arrays(), cos, sin, attention, None, caches[l])
            kv_cache = tuple(caches)
        with jax.named_scope("lm_head"):
            if logits_index is not None:
                x = x[logits_index]                                         # [M, H]
            x = rms_norm(x, self.norm[...], cfg.rms_norm_eps)
            logits = jnp.dot(x, self.lm_head[...], preferred_element_type=jnp.float32)  # [M, V]
        return logits, kv_cache


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["plan", "batch_indices", "positions", "kv_indptr", "kv_indices", "kv_lens"],
                   meta_fields=["wrapper", "pages_per_layer"])
@dataclasses.dataclass(frozen=True)
class PagedAttention:
    """One step of jaxinfer attention for all layers (a pytree: pass it to jitted steps).

    wrapper: a BatchDecodeWithPagedKVCache, BatchPrefillWithPagedKVCache or
    MultiLevelCascadeAttention, and plan its plan for this step (page ids of one layer).
    batch_indices, positions int32[N]: where each token's K/V goes (-1: padding row).
    kv_indptr int32[Bcap+1], kv_indices int32[cap]: the page table (padded) for the append.
    These four None (a decode wrapper and DecodePlan only): token row b is request b's token
    at its last position (length - 1), and the decode kernel writes its K/V (append_kv).
    kv_lens int32[B] (optional): live lengths at this step of a horizon plan.
    pages_per_layer: pages of one layer; a stacked cache (scan) holds layer l's page p at
    l * pages_per_layer + p, and the plan is shifted there (plan.with_page_offset).
    """
    wrapper: Any
    pages_per_layer: int
    plan: Any
    batch_indices: Any = None
    positions: Any = None
    kv_indptr: Any = None
    kv_indices: Any = None
    kv_lens: Any = None

    def __call__(self, layer, q, k, v, kv_cache):
        """layer None: kv_cache is this layer's own PagedKVCache; else its index in a stacked one."""
        plan, kv_indices = self.plan, self.kv_indices
        if layer is not None:
            offset = layer * self.pages_per_layer
            plan = plan.with_page_offset(offset)
            kv_indices = None if kv_indices is None else kv_indices + offset
        if self.batch_indices is None:  # decode: the kernel appends (one launch per layer), reading the
            # new K/V heads after q's in one array: XLA writes q, k, v (RoPE applied) in one fusion
            qkv = jnp.concatenate([q, k, v], axis=1)  # [B, Hq + 2 Hkv, D]
            return self.wrapper.run(qkv, kv_cache, plan, kv_lens=self.kv_lens, append_kv="from_q")
        kv_cache = ji.append_paged_kv_cache(kv_cache, k, v, self.batch_indices, self.positions,
                                            kv_indices, self.kv_indptr)
        if self.kv_lens is None:
            return self.wrapper.run(q, kv_cache, plan), kv_cache
        return self.wrapper.run(q, kv_cache, plan, kv_lens=self.kv_lens), kv_cache


def paged_kv_cache(cfg, pages_per_layer, page_size):
    """Zeroed NHD page storage for cfg.num_layers layers, pages_per_layer pages each: a tuple
    of one PagedKVCache per layer (layer_loop "unroll") or one stacked cache of L x P pages (scan)."""
    shape = (pages_per_layer, page_size, cfg.num_kv_heads, cfg.head_dim)
    if cfg.layer_loop == "unroll":
        return tuple(ji.PagedKVCache(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype))
                     for _ in range(cfg.num_layers))
    shape = (cfg.num_layers * pages_per_layer, *shape[1:])
    return ji.PagedKVCache(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class DenseKVCache:
    """Dense padded cache: k, v [B, S, Hkv, D] (one layer) or [L, B, S, Hkv, D] (stacked)."""
    k: jax.Array
    v: jax.Array


def dense_kv_cache(cfg, batch, max_len):
    """Zeroed dense caches: a tuple of one [B, S, Hkv, D] pair per layer (unroll) or one
    stacked [L, B, S, Hkv, D] pair (scan)."""
    shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    if cfg.layer_loop == "unroll":
        return tuple(DenseKVCache(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype))
                     for _ in range(cfg.num_layers))
    shape = (cfg.num_layers, *shape)
    return DenseKVCache(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype))


DENSE_IMPLS = ("jnp", "cudnn")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["rows", "positions"],
                   meta_fields=["impl", "prefill"])
@dataclasses.dataclass(frozen=True)
class DenseAttention:
    """Baseline attention over a DenseKVCache; tokens come as a [Bc, T] block (N = Bc * T).

    rows int32[Bc]: cache rows of the block's requests (None: all rows, in order).
    positions int32[Bc, T]: each token's position (-1: padding). prefill: the block holds
    each request's whole prompt from position 0 (attend causally to the block's own K/V);
    otherwise T = 1 and each token attends to its request's cached positions <= its own.
    impl: "jnp" (plain einsum softmax) or "cudnn" (jax.nn.dot_product_attention).
    """
    rows: Any
    positions: jax.Array
    impl: str = "jnp"
    prefill: bool = False

    def __post_init__(self):
        if self.impl not in DENSE_IMPLS:
            raise ValueError(f"impl must be one of {DENSE_IMPLS}, got {self.impl!r}")

    def __call__(self, layer, q, k, v, kv_cache):
        """layer None: kv_cache is this layer's own [B, S, ...] cache; else its index in a stacked one."""
        bc, t = self.positions.shape
        q, k, v = (x.reshape(bc, t, *x.shape[1:]) for x in (q, k, v))   # [Bc, T, H, D]
        at = () if layer is None else (layer,)
        max_len = kv_cache.k.shape[-3]
        pos = jnp.where(self.positions < 0, max_len, self.positions)     # padding: dropped
        rows = jnp.arange(bc)[:, None] if self.rows is None else self.rows[:, None]
        kv_cache = DenseKVCache(kv_cache.k.at[(*at, rows, pos)].set(k, mode="drop"),
                                kv_cache.v.at[(*at, rows, pos)].set(v, mode="drop"))
        if self.prefill:
            keys, values = k, v                                          # [Bc, T, Hkv, D]
            key_pos = jnp.arange(t)
            lens = jnp.sum(self.positions >= 0, axis=1).astype(jnp.int32)  # [Bc]
        else:
            keys, values = kv_cache.k[at], kv_cache.v[at]                # [B, S, Hkv, D]
            if self.rows is not None:
                keys, values = keys[self.rows], values[self.rows]
            key_pos = jnp.arange(max_len)
            lens = self.positions[:, 0] + 1
        if self.impl == "cudnn":
            lens = jnp.maximum(lens, 1)  # padding rows: one (ignored) key instead of none
            o = jax.nn.dot_product_attention(
                q, keys, values, is_causal=self.prefill, query_seq_lengths=lens if self.prefill else None,
                key_value_seq_lengths=lens, implementation="cudnn")
        else:
            visible = key_pos[None, None, :] <= self.positions[:, :, None]  # [Bc, T, S]
            o = dense_attention(q, keys, values, visible)
        return o.reshape(bc * t, *o.shape[2:]), kv_cache


def dense_attention(q, k, v, visible):
    """Plain jnp attention: q [B, T, Hq, D], k/v [B, S, Hkv, D], visible bool [B, T, S] -> o [B, T, Hq, D].
    Rows that see no key give 0."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * d ** -0.5
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = (p / jnp.where(denom > 0, denom, 1.0)).astype(v.dtype)
    o = jnp.einsum("bkgts,bskd->btkgd", p, v, preferred_element_type=jnp.float32)
    return o.reshape(b, t, hq, d).astype(q.dtype)


def sample(logits, temperature, seeds, positions, *, greedy=False):
    """Next tokens int32[M] from logits [M, V]: greedy where temperature == 0, otherwise a
    sample (Gumbel-max) whose randomness depends only on (seeds[m], positions[m]), so a
    request samples the same tokens alone or in any batch. greedy=True (static): one argmax
    over the vocabulary and nothing else (temperature and seeds unused)."""
    logits = logits.astype(jnp.float32)
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if greedy:
        return greedy_tokens
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.fold_in(jax.random.key(0), s), p))(seeds, positions)
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, logits.shape[-1:]))(keys)
    t = jnp.maximum(temperature, 1e-6)[:, None]
    sampled = jnp.argmax(logits / t + gumbel, axis=-1)
    return jnp.where(temperature > 0, sampled, greedy_tokens).astype(jnp.int32)


def make_forward(graphdef):
    """jit((params, tokens, positions, kv_cache, attention, logits_index) -> (logits, kv_cache)),
    the cache donated (updated in place)."""
    def forward(params, tokens, positions, kv_cache, attention, logits_index=None):
        model = nnx.merge(graphdef, params)
        return model(tokens, positions, kv_cache, attention, logits_index=logits_index)
    return jax.jit(forward, donate_argnames="kv_cache")


def make_step(graphdef, greedy=False):
    """jit((params, tokens, positions, kv_cache, attention, logits_index, temperature, seeds)
    -> (next tokens int32[M], kv_cache)): one forward pass, the LM head only at the rows that
    sample, and sampling, all in one program; the cache donated (updated in place). Nothing
    in it waits on the host: feed the returned tokens (a device array) to the next step.
    logits_index None: one token per row (decode); temperature, seeds [M] as in sample();
    greedy=True: argmax only (temperature and seeds unused)."""
    def step(params, tokens, positions, kv_cache, attention, logits_index, temperature, seeds):
        model = nnx.merge(graphdef, params)
        logits, kv_cache = model(tokens, positions, kv_cache, attention, logits_index=logits_index)
        last = positions if logits_index is None else positions[logits_index]
        with jax.named_scope("sampling"):
            return sample(logits, temperature, seeds, last, greedy=greedy), kv_cache
    return jax.jit(step, donate_argnames="kv_cache")


def make_decode_scan(graphdef, wrapper, pages_per_layer, steps, greedy=False):
    """jit((params, tokens int32[B], kv_cache, plan, temperature, seeds) -> (tokens int32[steps, B],
    kv_cache)): `steps` decode steps in one lax.scan over a horizon plan (wrapper.plan(...,
    horizon=steps), the page table sized for the last step). Step s runs with kv_lens =
    plan.kv_lens_at(s), the decode kernel appending each token's K/V; rows with no KV are
    padding. greedy as in make_step."""
    def scan(params, tokens, kv_cache, plan, temperature, seeds):
        model = nnx.merge(graphdef, params)

        def body(carry, s):
            tokens, kv_cache = carry
            lens = plan.kv_lens_at(s)                                   # [B] after this step's append
            positions = jnp.where(lens > 0, lens - 1, -1)
            attention = PagedAttention(wrapper, pages_per_layer, plan, kv_lens=lens)  # the kernel appends
            logits, kv_cache = model(tokens, positions, kv_cache, attention)
            with jax.named_scope("sampling"):
                tokens = sample(logits, temperature, seeds, positions, greedy=greedy)
            return (tokens, kv_cache), tokens

        (_, kv_cache), out = jax.lax.scan(body, (tokens, kv_cache), jnp.arange(steps))
        return out, kv_cache
    return jax.jit(scan, donate_argnames="kv_cache")
