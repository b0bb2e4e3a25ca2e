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
                  array; under TP head_parallel's append_kv=(k, v)): one launch per layer.
  DenseAttention  the baseline: a dense padded cache [L, B, S, Hkv, D] and plain jnp attention
                  (impl="jnp") or jax.nn.dot_product_attention(implementation="cudnn").

Tensor parallelism (cfg.tp devices on a mesh axis "tp"): build(cfg, seed, mesh) makes the weights
as global arrays, each device generating its own share of each layer (one jitted call per layer;
fused q/k/v, MLP gate/up and the LM head column-parallel, o_proj and MLP down row-parallel; XLA
adds the all-reduces), so no host holds the model; paged_kv_cache(..., mesh) makes the cache split
on KV heads, and
PagedAttention(..., mesh=mesh) attends through jaxinfer.sharding.head_parallel.

Context parallelism (a mesh with one axis "cp"): the weights replicated, each layer's cache split
on pages (device k holds pages [k N, (k + 1) N)), the K/V appended on the device that owns each
token's page (append_context_parallel) and the attention through
jaxinfer.sharding.context_parallel, the devices' partial states merged exactly.

Sampling (sample, Sampler): greedy argmax, or jaxinfer.sampling (temperature, top-k, top-p,
min-p) on the device inside the jitted step, a jax.random key threaded through the steps.
"""
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxinfer as ji
from jaxinfer import sharding


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
    tp: int = 1  # tensor-parallel devices the fused q/k/v weight is laid out for (qkv_columns)

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
        sharding.split_heads(self.num_heads, self.num_kv_heads, self.tp)  # ValueError: tp fits neither way

    @property
    def heads(self):
        """sharding.split_heads of the heads over tp devices (per-device counts, KV replicas)."""
        return sharding.split_heads(self.num_heads, self.num_kv_heads, self.tp)

    @property
    def cache_kv_heads(self):
        """KV heads of the cache: num_kv_heads, each repeated kv_replicas times under TP."""
        return self.num_kv_heads * self.heads.kv_replicas


CONFIGS = {
    # CPU: Pallas interpret mode is slow, so the test/demo model is tiny (float32).
    "tiny": LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10000.0, dtype="float32"),
    # Llama-3-8B shapes (random bfloat16 weights).
    "llama3-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                             num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128),
    # Llama-3-70B shapes (random bfloat16 weights, about 141 GB: several GPUs, --tp).
    "llama3-70b": LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                              num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128),
}


def get_config(name, num_layers=None, layer_loop=None, tp=None):
    """A named config, optionally with fewer layers (quick GPU runs), another layer loop or a
    tensor-parallel degree."""
    if name not in CONFIGS:
        raise ValueError(f"config must be one of {sorted(CONFIGS)}, got {name!r}")
    cfg = CONFIGS[name]
    if num_layers is not None:
        cfg = dataclasses.replace(cfg, num_layers=num_layers)
    if layer_loop is not None:
        cfg = dataclasses.replace(cfg, layer_loop=layer_loop)
    if tp is not None:
        cfg = dataclasses.replace(cfg, tp=tp)
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
    """{name: (shape of one layer's array, fan_in)}; fan_in None: a norm weight (ones). wqkv
    as at tp 1 (Llama.__init__ lays it out for cfg.tp with qkv_columns)."""
    H, F = cfg.hidden_size, cfg.intermediate_size
    hq, hkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return dict(attn_norm=((H,), None), wqkv=((H, hq + 2 * hkv), H), wo=((hq, H), hq),
                mlp_norm=((H,), None), w_gate=((H, F), H), w_up=((H, F), H), w_down=((F, H), F))


def qkv_columns(cfg):
    """int32[(Hq + 2 Hkv r) D]: column j of wqkv laid out for cfg.tp devices is column
    qkv_columns(cfg)[j] of the tp-1 wqkv. One block per device (its query heads, then its KV
    heads' k, then their v), so that splitting the columns tp ways (P(None, "tp")) gives each
    device its heads. r = kv_replicas: with fewer KV heads than devices, device i holds KV head
    i // r (sharding.replicate_kv_heads' layout)."""
    hs, hq, hkv = cfg.heads, cfg.num_heads, cfg.num_kv_heads
    heads = []
    for i in range(cfg.tp):
        kv = [i // hs.kv_replicas] if hs.kv_replicas > 1 else range(i * hs.num_kv_heads, (i + 1) * hs.num_kv_heads)
        heads += [*range(i * hs.num_qo_heads, (i + 1) * hs.num_qo_heads), *(hq + g for g in kv),
                  *(hq + hkv + g for g in kv)]
    return (np.asarray(heads)[:, None] * cfg.head_dim + np.arange(cfg.head_dim)).reshape(-1).astype(np.int32)


# LM head column-parallel too: each device reads its slice of the vocabulary (logits gathered to
# sample). The rest (embeddings: one row per token read; norms): replicated.
TP_SPECS = dict(wqkv=P(None, "tp"), wo=P("tp", None), w_gate=P(None, "tp"), w_up=P(None, "tp"),
                w_down=P("tp", None), lm_head=P(None, "tp"))


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "fan_in"))
def _normal(key, shape, dtype, fan_in):
    return (jax.random.normal(key, shape, dtype) * fan_in ** -0.5).astype(dtype)


def layer_arrays(cfg, keys, l):
    """Layer l's arrays {name: array} (LAYER_PARAMS): weights normal(fold_in(keys[name], l)) /
    sqrt(fan_in), norms ones; wqkv's columns in per-device blocks for cfg.tp (qkv_columns). l may be
    traced (lax.map over the layers, or one jitted call for every layer)."""
    dtype = jnp.dtype(cfg.dtype)
    arrays = {name: jnp.ones(shape, dtype) if fan_in is None
              else _normal(jax.random.fold_in(keys[name], l), shape, dtype, fan_in)
              for name, (shape, fan_in) in layer_param_shapes(cfg).items()}
    if cfg.tp > 1:  # the same weights, wqkv's columns in per-device blocks
        arrays["wqkv"] = jnp.take(arrays["wqkv"], qkv_columns(cfg), axis=1)
    return arrays


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
    n, hs = x.shape[0], cfg.heads
    with jax.named_scope("qkv_proj"):
        h = rms_norm(x, w["attn_norm"], cfg.rms_norm_eps)
        # One matmul for q, k and v: at batch 1 three (one of [H, Hq*D], two of [H, Hkv*D]) took
        # 1 ms more per step than one (Llama-3-8B shapes, H100).
        qkv = h @ w["wqkv"]                                            # [N, (Hq + 2 Hkv) * D]
        if n == 1:  # materialized: XLA turns a one-row dot into a multiply + reduce and fuses that
            # into its consumer (the decode step's q/k/v concatenate: 200 µs a layer on an H100)
            qkv = jax.lax.optimization_barrier(qkv)
        # cfg.tp blocks (qkv_columns), each [Hq / tp | Hkv' | Hkv', D] (Hkv' its KV heads)
        qkv = qkv.reshape(n, cfg.tp, hs.num_qo_heads + 2 * hs.num_kv_heads, cfg.head_dim)
        q, k, v = jnp.split(qkv, [hs.num_qo_heads, hs.num_qo_heads + hs.num_kv_heads], axis=2)
        q, k, v = (x.reshape(n, -1, cfg.head_dim) for x in (q, k, v))  # [N, Hq | Hkv r | Hkv r, D]
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

    def __init__(self, cfg, *, rngs, layer_fn=None):
        """layer_fn(keys, l) -> layer l's arrays: layer_arrays (default), or build()'s jitted and
        sharded version of it."""
        self.cfg = cfg
        dtype = jnp.dtype(cfg.dtype)
        self.embed = nnx.Param(_normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dtype, 1))  # [V, H]
        # One key per name (norms included), layer l's array from fold_in(key, l): both loops get the same weights.
        keys = {name: rngs.params() for name in LAYER_PARAMS}
        layer_fn = layer_fn or functools.partial(layer_arrays, cfg)
        if cfg.layer_loop == "scan":  # stacked [L, ...], made in place by one loop
            self.layers = LayerWeights(jax.lax.map(lambda l: layer_fn(keys, l), jnp.arange(cfg.num_layers)))
        else:
            self.layers = nnx.List([LayerWeights(layer_fn(keys, l)) for l in range(cfg.num_layers)])
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


def _tp_spec(path, x):
    """A parameter's PartitionSpec under TP: TP_SPECS by name (stacked [L, ...]: None first)."""
    name = next((k.key for k in reversed(path) if isinstance(getattr(k, "key", None), str)), None)
    if name not in TP_SPECS:
        return P()
    return P(*[None] * (x.ndim - len(TP_SPECS[name])), *TP_SPECS[name])


def build(cfg, seed, mesh=None):
    """(graphdef, params) of Llama(cfg, rngs=nnx.Rngs(seed)). mesh: tensor parallel over its
    "tp" axis of cfg.tp devices; params are global arrays placed as TP_SPECS says, each device
    making only its share of every layer (a model larger than one device fits; no host holds
    it): unroll, one jitted call per layer (compiled once); scan, one jit (its lax.map makes the
    stacked layers). Embeddings, norms and LM head are made on the first device, then placed."""
    if mesh is None:
        return nnx.split(Llama(cfg, rngs=nnx.Rngs(seed)))
    if is_context_parallel(mesh):  # every device holds the whole model
        graphdef, params = nnx.split(Llama(cfg, rngs=nnx.Rngs(seed)))
        return graphdef, jax.device_put(params, NamedSharding(mesh, P()))
    if mesh.shape.get("tp") != cfg.tp:
        raise ValueError(f"mesh must have an axis 'tp' of cfg.tp = {cfg.tp} devices, got {dict(mesh.shape)}")
    placed = functools.partial(jax.tree_util.tree_map_with_path,
                               lambda path, x: NamedSharding(mesh, _tp_spec(path, x)))
    if cfg.layer_loop == "scan":
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(seed))))
        return graphdef, jax.jit(lambda: nnx.split(Llama(cfg, rngs=nnx.Rngs(seed)))[1],
                                 out_shardings=placed(abstract))()
    layer_fn = jax.jit(functools.partial(layer_arrays, cfg),
                       out_shardings={name: NamedSharding(mesh, TP_SPECS.get(name, P())) for name in LAYER_PARAMS})
    graphdef, params = nnx.split(Llama(cfg, rngs=nnx.Rngs(seed), layer_fn=layer_fn))
    return graphdef, jax.device_put(params, placed(params))


def is_context_parallel(mesh):
    """Whether mesh is a context-parallel one (its one axis "cp"); else tensor parallel ("tp")."""
    return mesh is not None and tuple(mesh.axis_names) == ("cp",)


def _cache_spec(mesh, layout):
    """The cache's PartitionSpec on mesh: pages on "cp" (context parallel), else KV heads on "tp".
    Trailing Nones dropped, as the steps' outputs carry it: the first step's cache (made with this
    spec) then shares its compiled program with every later one."""
    spec = tuple(sharding.cache_spec(layout, cp_axis="cp") if is_context_parallel(mesh)
                 else sharding.cache_spec(layout, tp_axis="tp"))
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return P(*spec)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["plan", "batch_indices", "positions", "kv_indptr", "kv_indices", "kv_lens"],
                   meta_fields=["wrapper", "pages_per_layer", "mesh"])
@dataclasses.dataclass(frozen=True)
class PagedAttention:
    """One step of jaxinfer attention for all layers (a pytree: pass it to jitted steps).

    wrapper: a BatchDecodeWithPagedKVCache, BatchPrefillWithPagedKVCache or
    MultiLevelCascadeAttention, and plan its plan for this step (page ids of one layer).
    batch_indices, positions int32[N]: where each token's K/V goes (-1: padding row).
    kv_indptr int32[Bcap+1], kv_indices int32[cap]: the page table (padded) for the append.
    These four None (a decode wrapper and DecodePlan only): token row b is request b's token
    at its last position (length - 1), and the decode kernel writes its K/V (append_kv; under
    TP on every device, its KV heads: sharding.head_parallel's append_kv).
    kv_lens int32[B] (optional): live lengths at this step of a horizon plan.
    pages_per_layer: pages of one layer; a stacked cache (scan) holds layer l's page p at
    l * pages_per_layer + p, and the plan is shifted there (plan.with_page_offset).
    mesh (optional): tensor parallel over its "tp" axis: q, k, v and the cache split on heads,
    wrapper built for one device's heads (cfg.heads), the attention through
    sharding.head_parallel (the plan replicated), the K/V appended on each device's heads
    (append_head_parallel) where the page table is given, else by the decode kernel.
    A context-parallel mesh (axis "cp"): plan is a sharding.ContextPlan of the wrapper built for
    one device's pages (or a QueryPlan, whose wrapper is built for one device's query rows), and
    the append table is context_append_tables' (one per device, stacked).
    """
    wrapper: Any
    pages_per_layer: int
    plan: Any
    batch_indices: Any = None
    positions: Any = None
    kv_indptr: Any = None
    kv_indices: Any = None
    kv_lens: Any = None
    mesh: Any = None

    def __call__(self, layer, q, k, v, kv_cache):
        """layer None: kv_cache is this layer's own PagedKVCache; else its index in a stacked one."""
        plan, kv_indices = self.plan, self.kv_indices
        if layer is not None:
            offset = layer * self.pages_per_layer
            plan = plan.with_page_offset(offset)
            kv_indices = None if kv_indices is None else kv_indices + offset
        if self.batch_indices is None:  # decode: the kernel appends (one launch per layer)
            if self.mesh is None:  # reading the new K/V heads after q's in one array: XLA writes q, k,
                # v (RoPE applied) in one fusion
                qkv = jnp.concatenate([q, k, v], axis=1)  # [B, Hq + 2 Hkv, D]
                return self.wrapper.run(qkv, kv_cache, plan, kv_lens=self.kv_lens, append_kv="from_q")
            if is_context_parallel(self.mesh):
                raise ValueError("PagedAttention on a context-parallel mesh needs the append tables "
                                 "(context_append_tables): each device writes the rows of its pages")
            run = sharding.head_parallel(self.wrapper, self.mesh)  # each device's kernel appends its KV heads
            return run(q, kv_cache, plan, kv_lens=self.kv_lens, append_kv=(k, v))
        table = (self.batch_indices, self.positions, kv_indices, self.kv_indptr)
        if self.mesh is None:
            kv_cache = ji.append_paged_kv_cache(kv_cache, k, v, *table)
            run = self.wrapper.run
        elif is_context_parallel(self.mesh):
            if layer is not None:
                raise ValueError("context parallelism takes one cache per layer (layer_loop 'unroll')")
            kv_cache = append_context_parallel(self.mesh, kv_cache, k, v, *table)
            run = sharding.context_parallel(self.wrapper, self.mesh)
        else:
            kv_cache = append_head_parallel(self.mesh, kv_cache, k, v, *table)
            run = sharding.head_parallel(self.wrapper, self.mesh)
        if self.kv_lens is None:
            return run(q, kv_cache, plan), kv_cache
        return run(q, kv_cache, plan, kv_lens=self.kv_lens), kv_cache


def append_head_parallel(mesh, kv_cache, k, v, batch_indices, positions, kv_indices, kv_indptr):
    """ji.append_paged_kv_cache on each device's KV heads (mesh axis "tp"; k, v [N, Hkv', D] and
    the cache split on heads, the rest replicated): its write kernel has no partitioning rule,
    so it runs under shard_map."""
    spec_h, spec_c = sharding.head_spec("tp"), sharding.cache_spec(kv_cache.layout, tp_axis="tp")
    append = sharding.shard_map(ji.append_paged_kv_cache, mesh, (spec_c, spec_h, spec_h) + (P(),) * 4, spec_c)
    return append(kv_cache, k, v, batch_indices, positions, kv_indices, kv_indptr)


def append_context_parallel(mesh, kv_cache, k, v, batch_indices, positions, kv_indices, kv_indptr):
    """ji.append_paged_kv_cache on each device's pages (mesh axis "cp"; k, v [N, Hkv, D]
    replicated, the cache split on pages): the tables [n, ...] are context_append_tables', device
    k's row writing the tokens whose pages it holds (the others are padding rows, -1)."""
    spec_c = sharding.cache_spec(kv_cache.layout, cp_axis="cp")

    def append(cache, k, v, rows, pos, indices, indptr):  # this device's table: [1, ...]
        return ji.append_paged_kv_cache(cache, k, v, rows[0], pos[0], indices[0], indptr[0])

    run = sharding.shard_map(append, mesh, (spec_c, P(), P()) + (P("cp"),) * 4, spec_c)
    return run(kv_cache, k, v, batch_indices, positions, kv_indices, kv_indptr)


def context_append_tables(split, batch_indices, positions, max_pages):
    """Host tables of append_context_parallel for the tokens (request batch_indices[i] at global
    position positions[i], int32[N]) under split (sharding.split_page_table with pages_per_shard):
    per device k, the tokens in its share at share-local positions (others -1) and its local page
    table, kv_indices padded to max_pages. Returns (batch_indices, positions, kv_indptr,
    kv_indices), each stacked [n, ...]: PagedAttention's fields in order."""
    rows, pos, indices, indptrs = [], [], [], []
    for k, (indptr, local, _) in enumerate(split.tables):
        start = split.key_offsets[k][batch_indices]
        end = start + split.share_lens[k][batch_indices]
        mine = (batch_indices >= 0) & (positions >= start) & (positions < end)
        rows.append(np.where(mine, batch_indices, -1))
        pos.append(np.where(mine, positions - start, 0))
        indices.append(np.pad(local, (0, max_pages - local.shape[0])))
        indptrs.append(indptr)
    return tuple(np.stack(x).astype(np.int32) for x in (rows, pos, indptrs, indices))


def paged_kv_cache(cfg, pages_per_layer, page_size, mesh=None):
    """Zeroed NHD page storage for cfg.num_layers layers, pages_per_layer pages each: a tuple
    of one PagedKVCache per layer (layer_loop "unroll") or one stacked cache of L x P pages (scan).
    cfg.cache_kv_heads KV heads; mesh: made in place split on them ("tp") or on pages ("cp")."""
    unroll = cfg.layer_loop == "unroll"
    shape = (pages_per_layer * (1 if unroll else cfg.num_layers), page_size, cfg.cache_kv_heads, cfg.head_dim)

    placed = {} if mesh is None else {"out_shardings": NamedSharding(mesh, _cache_spec(mesh, "NHD"))}
    zeros = jax.jit(functools.partial(jnp.zeros, shape, cfg.dtype), **placed)  # compiled once for every array
    if unroll:
        return tuple(ji.PagedKVCache(zeros(), zeros()) for _ in range(cfg.num_layers))
    return ji.PagedKVCache(zeros(), zeros())


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


@dataclasses.dataclass(frozen=True)
class Sampler:
    """How the jitted step picks tokens (static: one compilation per Sampler). greedy: one argmax
    over the vocabulary. Otherwise jaxinfer.sampling draws from softmax(logits / temperature) with
    the filters switched on: top-k, then top-p of what is left, then min-p (SamplingParams holds
    the per-row values; rows with temperature 0 take the argmax)."""
    greedy: bool = True
    top_k: bool = False
    top_p: bool = False
    min_p: bool = False

    @classmethod
    def of(cls, temperature, top_k=0, top_p=1.0, min_p=0.0):
        """The sampler of these values (greedy where temperature is 0; a filter where it filters)."""
        return cls(greedy=temperature == 0, top_k=top_k > 0, top_p=top_p < 1, min_p=min_p > 0)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["temperature", "top_k", "top_p", "min_p", "indices"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per output row b: temperature f32[B] (0: argmax), top_k int32[B] (0: no filter), top_p
    f32[B] (1: none), min_p f32[B] (0: none); indices int32[B] (None: b): the logits row that
    row b draws from (n > 1 samples of one prompt share one row, as in jaxinfer.sampling)."""
    temperature: Any
    top_k: Any
    top_p: Any
    min_p: Any
    indices: Any = None

    @classmethod
    def full(cls, batch, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, indices=None):
        """The same values for all `batch` rows (host arrays)."""
        return cls(np.full(batch, temperature, np.float32), np.full(batch, top_k, np.int32),
                   np.full(batch, top_p, np.float32), np.full(batch, min_p, np.float32), indices)


def sample(logits, params, key, sampler):
    """Next tokens int32[B] from logits [M, V] float32: row b from logits row params.indices[b]
    (row b without indices), as sampler says, drawn with key. Filters with top-k and top-p
    only run jaxinfer.sampling.top_k_top_p_sampling_from_logits; with one filter or min-p the
    probabilities are renormalised by all filters but the last, which draws."""
    idx, t = params.indices, params.temperature
    if sampler.greedy:
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return tokens if idx is None else tokens[idx]
    if not (sampler.top_k or sampler.top_p or sampler.min_p):
        return ji.sampling.sampling_from_logits(logits, idx, key=key, temperature=t)
    if sampler.top_k and sampler.top_p and not sampler.min_p:
        return ji.sampling.top_k_top_p_sampling_from_logits(logits, params.top_k, params.top_p, idx,
                                                            key=key, temperature=t)
    x = logits if idx is None else logits[idx]
    probs = jax.nn.softmax(x / jnp.where(t > 0, t, 1.0)[:, None], axis=-1)
    if sampler.min_p:
        if sampler.top_k:
            probs = ji.sampling.top_k_renorm_probs(probs, params.top_k)
        if sampler.top_p:
            probs = ji.sampling.top_p_renorm_probs(probs, params.top_p)
        drawn = ji.sampling.min_p_sampling_from_probs(probs, params.min_p, key=key)
    elif sampler.top_k:
        drawn = ji.sampling.top_k_sampling_from_probs(probs, params.top_k, key=key)
    else:
        drawn = ji.sampling.top_p_sampling_from_probs(probs, params.top_p, key=key)
    return jnp.where(t > 0, drawn, jnp.argmax(x, axis=-1)).astype(jnp.int32)


def _draw(sampler, mesh):
    """(logits, params, key) -> tokens: sample(), or on a mesh one replicated draw on every device
    (the sampling kernel has no partitioning rule)."""
    draw = functools.partial(sample, sampler=sampler)
    if mesh is None or sampler.greedy:
        return draw
    return sharding.shard_map(draw, mesh, (P(), P(), P()), P())


def _placed(mesh, *outputs):
    """outputs with tokens and key replicated and caches split as paged_kv_cache places them
    (mesh), so that every step's outputs are placed as its inputs were."""
    if mesh is None:
        return outputs

    def one(x):
        spec = _cache_spec(mesh, x.layout) if isinstance(x, ji.PagedKVCache) else P()
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
    return jax.tree.map(one, outputs, is_leaf=lambda x: isinstance(x, ji.PagedKVCache))


def make_forward(graphdef):
    """jit((params, tokens, positions, kv_cache, attention, logits_index) -> (logits, kv_cache)),
    the cache donated (updated in place)."""
    def forward(params, tokens, positions, kv_cache, attention, logits_index=None):
        model = nnx.merge(graphdef, params)
        return model(tokens, positions, kv_cache, attention, logits_index=logits_index)
    return jax.jit(forward, donate_argnames="kv_cache")


def make_step(graphdef, sampler=Sampler(), mesh=None):
    """jit((params, tokens, positions, kv_cache, attention, logits_index, sampling, key) ->
    (next tokens int32[B], kv_cache, next key)): one forward pass, the LM head only at the rows
    that sample, and sample() (sampling: SamplingParams; a subkey of key), all in one program;
    the cache donated (updated in place). Nothing in it waits on the host: feed the returned
    tokens and key (device arrays) to the next step. logits_index None: one token per row
    (decode). mesh: tensor parallel over its "tp" axis (build, paged_kv_cache, PagedAttention)."""
    draw = _draw(sampler, mesh)

    def step(params, tokens, positions, kv_cache, attention, logits_index, sampling, key):
        model = nnx.merge(graphdef, params)
        logits, kv_cache = model(tokens, positions, kv_cache, attention, logits_index=logits_index)
        sub = key
        if not sampler.greedy:
            key, sub = jax.random.split(key)
        with jax.named_scope("sampling"):
            return _placed(mesh, draw(logits, sampling, sub), kv_cache, key)
    return jax.jit(step, donate_argnames="kv_cache")


def make_decode_scan(graphdef, wrapper, pages_per_layer, steps, sampler=Sampler(), mesh=None):
    """jit((params, tokens int32[B], kv_cache, plan, sampling, key, step_inputs) -> (tokens
    int32[steps, B], kv_cache, key)): `steps` decode steps in one lax.scan over a horizon plan
    (wrapper.plan(..., horizon=steps), the page table sized for the last step). Step s runs with
    kv_lens = plan.kv_lens_at(s), the decode kernel appending each token's K/V (under TP on
    every device, its KV heads); rows with no KV are padding. sampler, sampling, key as in
    make_step. mesh: TP (step_inputs None), or CP: plan a sharding.ContextPlan (horizon steps),
    step_inputs (kv_lens int32[B] of the last step, the append tables [steps, n, ...] of each
    step: context_append_tables'), step s's lengths kv_lens - (steps - 1 - s)."""
    draw = _draw(sampler, mesh)
    context = is_context_parallel(mesh)

    def scan(params, tokens, kv_cache, plan, sampling, key, step_inputs):
        model = nnx.merge(graphdef, params)

        def body(carry, s):
            tokens, kv_cache, key = carry
            if context:  # the K/V written through each step's tables, on the device of their page
                last_lens, tables = step_inputs
                lens = jnp.maximum(last_lens - (steps - 1 - s), 0)
                attention = PagedAttention(wrapper, pages_per_layer, plan, *(x[s] for x in tables), kv_lens=lens,
                                           mesh=mesh)
            else:  # the kernel appends
                lens = plan.kv_lens_at(s)                               # [B] after this step's append
                attention = PagedAttention(wrapper, pages_per_layer, plan, kv_lens=lens, mesh=mesh)
            positions = jnp.where(lens > 0, lens - 1, -1)
            logits, kv_cache = model(tokens, positions, kv_cache, attention)
            sub = key
            if not sampler.greedy:
                key, sub = jax.random.split(key)
            with jax.named_scope("sampling"):
                tokens = draw(logits, sampling, sub)
            return (tokens, kv_cache, key), tokens

        (_, kv_cache, key), out = jax.lax.scan(body, (tokens, kv_cache, key), jnp.arange(steps))
        return _placed(mesh, out, kv_cache, key)
    return jax.jit(scan, donate_argnames="kv_cache")
