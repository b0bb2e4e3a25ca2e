"""Attention variants: plain jnp functions traced into every kernel (and the reference).

An AttentionVariant is static (hashable; it is part of the jit cache key, so the jit cache is
the kernel cache). Its per-call parameters (slopes, window, caps, ...) are a dict of arrays
passed to run(..., variant_params=...): data, so changing them never recompiles. The hooks
(query / key transforms, logits transform and mask, kv_bounds, output transform, use_softmax)
and their tile shapes are in docs/variants.md. Inside a kernel a 0-d parameter arrives as a
scalar and an array parameter as a ref: index it with integer arrays; kernels cannot
concatenate along a tile's last axis, so avoid jnp.concatenate in hooks.
"""
import dataclasses
import math
from typing import Callable, Tuple

import jax.numpy as jnp
import numpy as np

from pallas_kernels import _common as _kernel_math

_FAR = 1 << 30  # a key position below every real one


def _as_tuple(fn):
    if fn is None:
        return ()
    return tuple(fn) if isinstance(fn, (tuple, list)) else (fn,)


@dataclasses.dataclass(frozen=True, init=False)
class AttentionVariant:
    """A static attention variant; compose several with compose() (hooks chain, masks AND)."""
    query_transforms: Tuple[Callable, ...]
    key_transforms: Tuple[Callable, ...]
    logits_transforms: Tuple[Callable, ...]
    logits_masks: Tuple[Tuple[Callable, Callable], ...]  # (mask, kv_bounds or None)
    output_transforms: Tuple[Callable, ...]
    use_softmax: bool
    param_names: Tuple[str, ...]
    name: str

    def __init__(self, *, query_transform=None, key_transform=None, logits_transform=None,
                 logits_mask=None, kv_bounds=None, output_transform=None, use_softmax=True,
                 param_names=(), name="custom"):
        if kv_bounds is not None and logits_mask is None:
            raise ValueError("kv_bounds describes a logits_mask; give the mask too")
        masks = () if logits_mask is None else ((logits_mask, kv_bounds),)
        for field, value in (("query_transforms", _as_tuple(query_transform)),
                             ("key_transforms", _as_tuple(key_transform)),
                             ("logits_transforms", _as_tuple(logits_transform)),
                             ("logits_masks", masks),
                             ("output_transforms", _as_tuple(output_transform)),
                             ("use_softmax", bool(use_softmax)),
                             ("param_names", tuple(param_names)), ("name", name)):
            object.__setattr__(self, field, value)

    # Hooks as the kernels call them (each chains its parts).
    @property
    def has_query_transform(self):
        return bool(self.query_transforms)

    @property
    def has_key_transform(self):
        return bool(self.key_transforms)

    @property
    def has_logits_transform(self):
        return bool(self.logits_transforms)

    @property
    def has_mask(self):
        return bool(self.logits_masks)

    @property
    def has_bounds(self):
        """True when every mask has kv_bounds (then kernels skip and unmask tiles)."""
        return self.has_mask and all(b is not None for _, b in self.logits_masks)

    def query_transform(self, params, q, qo_pos, qo_head):
        for f in self.query_transforms:
            q = f(params, q, qo_pos, qo_head)
        return q

    def key_transform(self, params, k, kv_pos, kv_head):
        for f in self.key_transforms:
            k = f(params, k, kv_pos, kv_head)
        return k

    def logits_transform(self, params, s, qo_pos, kv_pos, qo_head):
        for f in self.logits_transforms:
            s = f(params, s, qo_pos, kv_pos, qo_head)
        return s

    def logits_mask(self, params, qo_pos, kv_pos, qo_head):
        vis = None
        for f, _ in self.logits_masks:
            m = f(params, qo_pos, kv_pos, qo_head)
            vis = m if vis is None else vis & m
        return vis

    def kv_bounds(self, params, pos_min, pos_max):
        """(lo, full_lo) of the combined mask (see the module docstring); needs has_bounds."""
        lo, full_lo = -_FAR, -_FAR
        for _, b in self.logits_masks:
            blo, bfull = b(params, pos_min, pos_max)
            lo, full_lo = jnp.maximum(lo, blo), jnp.maximum(full_lo, bfull)
        return lo, full_lo

    def output_transform(self, params, o, lse):
        for f in self.output_transforms:
            o, lse = f(params, o, lse)
        return o, lse

    def check_params(self, params):
        """ValueError naming a missing parameter; returns params as a dict of jnp arrays."""
        params = {} if params is None else dict(params)
        missing = [n for n in self.param_names if n not in params]
        if missing:
            raise ValueError(f"variant_params is missing {missing} (variant {self.name!r} needs "
                             f"{list(self.param_names)})")
        return {k: jnp.asarray(v) for k, v in params.items()}


def compose(*variants):
    """One variant applying each in order: transforms chain, masks AND, parameters union.
    use_softmax is off if any part turns it off."""
    out = AttentionVariant()
    fields = {}
    for f in ("query_transforms", "key_transforms", "logits_transforms", "logits_masks",
              "output_transforms", "param_names"):
        fields[f] = sum((getattr(v, f) for v in variants), ())
    fields["use_softmax"] = all(v.use_softmax for v in variants)
    fields["name"] = "+".join(v.name for v in variants)
    for f, value in fields.items():
        object.__setattr__(out, f, value)
    return out


def rotate_half(x):
    """[..., N, D] -> concat(-x2, x1) of the two halves of the last axis, in ops that
    Pallas-Triton lowers (split, stack on the last axis, transpose, reshape)."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    pairs = jnp.stack([-x2, x1], axis=-1)  # [..., N, D/2, 2]
    return jnp.swapaxes(pairs, -1, -2).reshape(x.shape)


def tanh(x):
    """tanh for hooks: jnp.tanh in the reference and in interpret mode; inside compiled GPU
    kernels one hardware tanh.approx.f32 (max relative error about 2^-11; FlashInfer's
    soft-cap uses the same instruction)."""
    return _kernel_math.tanh(x)


# Built-ins. Module-level hooks, so equal variants hash equal and share compiled kernels.

def _soft_cap(params, s, qo_pos, kv_pos, qo_head):
    cap = params["logits_soft_cap"]
    safe = jnp.where(cap > 0, cap, 1.0)
    return jnp.where(cap > 0, safe * tanh(s * (1.0 / safe)), s)  # one reciprocal, then multiplies


def soft_cap():
    """Logits soft-cap: cap * tanh(s / cap) after sm_scale. Params: logits_soft_cap (0-d; <= 0 is off)."""
    return AttentionVariant(logits_transform=_soft_cap, param_names=("logits_soft_cap",),
                            name="soft_cap")


def _window_mask(params, qo_pos, kv_pos, qo_head):
    w = params["window_left"]
    return (w < 0) | (kv_pos >= qo_pos - w)


def _window_bounds(params, pos_min, pos_max):
    w = params["window_left"]
    return jnp.where(w < 0, -_FAR, pos_min - w), jnp.where(w < 0, -_FAR, pos_max - w)


def sliding_window():
    """Keys [pos - w, pos] stay visible (with causal; the window bounds only the left side).
    Params: window_left (0-d int32; -1 is off). KV tiles left of every row's window are skipped."""
    return AttentionVariant(logits_mask=_window_mask, kv_bounds=_window_bounds,
                            param_names=("window_left",), name="sliding_window")


def _alibi(params, s, qo_pos, kv_pos, qo_head):
    return s + params["alibi_slopes"][qo_head] * (kv_pos - qo_pos).astype(jnp.float32)


def alibi():
    """ALiBi: s + slope[head] * (kv_pos - qo_pos). Params: alibi_slopes f32[Hq] (see alibi_slopes)."""
    return AttentionVariant(logits_transform=_alibi, param_names=("alibi_slopes",), name="alibi")


def alibi_slopes(num_heads):
    """The standard ALiBi slopes (Press et al.), with the non-power-of-two extension: the
    slopes of the nearest lower power of two, then every other slope of twice that."""
    def pow2_slopes(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]
    n = 1 << (num_heads.bit_length() - 1)
    slopes = pow2_slopes(n)
    if n < num_heads:
        slopes += pow2_slopes(2 * n)[0::2][: num_heads - n]
    return np.asarray(slopes, np.float32)


def _rope(params, x, pos):
    d = x.shape[-1]
    half = jnp.arange(d) % (d // 2)
    inv_freq = jnp.exp(half.astype(jnp.float32) * (-2.0 / d) * jnp.log(params["rope_theta"]))  # [D]
    angle = (pos.astype(jnp.float32) / params["rope_scale"])[:, None] * inv_freq[None, :]  # [N, D]
    return x * jnp.cos(angle) + rotate_half(x) * jnp.sin(angle)


def _rope_query(params, q, qo_pos, qo_head):
    return _rope(params, q, qo_pos)


def _rope_key(params, k, kv_pos, kv_head):
    return _rope(params, k, kv_pos)


def rope():
    """RoPE fused into the query and key transforms (Llama rotate-half convention): the cache
    holds un-rotated keys, rotated on load. Params: rope_theta, rope_scale (0-d float32;
    positions are divided by rope_scale)."""
    return AttentionVariant(query_transform=_rope_query, key_transform=_rope_key,
                            param_names=("rope_theta", "rope_scale"), name="rope")


def apply_rope(x, positions, rope_theta=1e4, rope_scale=1.0):
    """x [N, H, D] rotated at positions [N] (the unfused form; tests and models)."""
    params = {"rope_theta": jnp.float32(rope_theta), "rope_scale": jnp.float32(rope_scale)}
    n, h, d = x.shape
    rows = jnp.swapaxes(x.astype(jnp.float32), 0, 1).reshape(h * n, d)
    out = _rope(params, rows, jnp.tile(jnp.asarray(positions), h))
    return jnp.swapaxes(out.reshape(h, n, d), 0, 1).astype(x.dtype)


def _sigmoid(params, s, qo_pos, kv_pos, qo_head):
    return 1.0 / (1.0 + jnp.exp(-(s * params["sigmoid_scale"] + params["sigmoid_bias"])))


def sigmoid():
    """Sigmoid attention (FlashSigmoid): o = sum_j sigmoid(s_ij * scale + bias) v_j, no softmax.
    Params: sigmoid_scale, sigmoid_bias (0-d float32)."""
    return AttentionVariant(logits_transform=_sigmoid, use_softmax=False,
                            param_names=("sigmoid_scale", "sigmoid_bias"), name="sigmoid")


def _sinks(params, o, lse):
    sink = params["sinks"].astype(jnp.float32)  # [Hq]
    keep = jnp.exp(jnp.minimum(lse - jnp.logaddexp(lse, sink), 0.0))  # sigmoid(lse - sink)
    return o * keep[..., None], jnp.logaddexp(lse, sink)


def sinks():
    """Attention sinks: a per-head logit (natural units) added to each softmax denominator.
    Params: sinks f32[Hq]. A row that sees no key then gives o = 0 and lse = sink."""
    return AttentionVariant(output_transform=_sinks, param_names=("sinks",), name="sinks")


# Hooks the Mosaic GPU prefill kernel is known to lower (checked on the GPU, BENCHMARKS.md):
# prefill impl="auto" picks it for variants made of these only. Output transforms run outside
# the kernels.
_MOSAIC_HOOKS = frozenset([_soft_cap, _window_mask, _window_bounds, _alibi, _sigmoid])


def sinks_only_output(variant):
    """Whether the variant's one output transform is the built-in sinks (which a kernel that never
    splits KV can hold in its softmax state instead)."""
    return variant.output_transforms == (_sinks,)


def mosaic_ready(variant):
    """Whether impl="auto" may run `variant` on the Mosaic GPU prefill kernel: no variant, or
    built-in logits transforms and masks (other hooks run there with impl="mosaic" only)."""
    if variant is None:
        return True
    hooks = (variant.query_transforms + variant.key_transforms + variant.logits_transforms
             + tuple(f for pair in variant.logits_masks for f in pair if f is not None))
    return all(f in _MOSAIC_HOOKS for f in hooks)


def default_params(variant, num_qo_heads, **overrides):
    """Typical parameters for the built-ins in `variant` (overridable by name)."""
    defaults = {"logits_soft_cap": jnp.float32(30.0), "window_left": jnp.int32(-1),
                "alibi_slopes": jnp.asarray(alibi_slopes(num_qo_heads)),
                "rope_theta": jnp.float32(1e4), "rope_scale": jnp.float32(1.0),
                "sigmoid_scale": jnp.float32(1.0), "sigmoid_bias": jnp.float32(-math.log(4096.0)),
                "sinks": jnp.zeros((num_qo_heads,), jnp.float32)}
    params = {n: defaults[n] for n in variant.param_names if n in defaults}
    params.update(overrides)
    return params


def finish(variant, params, o, lse, return_lse):
    """The merged (o, lse) -> run()'s result: sums for non-softmax variants, then the
    output transform (sinks, user hooks), once per call."""
    if variant is None:
        return (o, lse) if return_lse else o
    dtype = o.dtype
    if not variant.use_softmax:
        o = o.astype(jnp.float32) * jnp.exp(lse)[..., None]  # states of sums: o * exp(lse) = sum
    if variant.output_transforms:
        o, lse = variant.output_transform(params, o.astype(jnp.float32), lse)
    o = o.astype(dtype)
    return (o, lse) if return_lse else o


def check_variant(variant, return_lse=False):
    if variant is not None and not isinstance(variant, AttentionVariant):
        raise ValueError(f"variant must be a jaxinfer.AttentionVariant, got {type(variant).__name__}")
    if return_lse and variant is not None and not variant.use_softmax:
        raise ValueError(f"return_lse: variant {variant.name!r} has no softmax, hence no lse")
