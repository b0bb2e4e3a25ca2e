"""Token sampling without sorting: FlashInfer's sampling API on Pallas kernels.

Every function takes a jax.random key as the keyword `key` (in place of FlashInfer's torch
generator) and is deterministic given it. Per-request parameters are scalars or arrays [B]. All
functions are pure (jit, vmap; one compilation serves every parameter value). Filters keep the
tokens at or above a per-row threshold, ties at the boundary all kept: top_k <= 0 or >= V, top_p
= 1 and min_p = 0 filter nothing. Eager calls reject NaN, +inf and rows with nothing to draw
(ValueError); under jit such a row gives an unspecified token. docs/sampling.md has the details.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxinfer import _backend, dispatch
from jaxinfer.formats import is_concrete
from pallas_kernels.sampling import Filters, SamplingConfig

FILTER_ORDERS = ("top_k_first", "joint")
_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)

__all__ = [
    "SamplingConfig", "sampling_from_logits", "sampling_from_probs", "top_k_sampling_from_probs",
    "top_p_sampling_from_probs", "min_p_sampling_from_probs", "top_k_top_p_sampling_from_logits",
    "top_k_top_p_sampling_from_probs", "top_k_renorm_probs", "top_p_renorm_probs",
    "top_k_mask_logits", "chain_speculative_sampling"]


# --- argument checks ------------------------------------------------------------------------

def _check_matrix(name, x, from_logits):
    """x must be a float [R, V] array; concrete rows are checked (see the module docstring)."""
    if jnp.ndim(x) != 2 or not any(jnp.dtype(x.dtype) == jnp.dtype(d) for d in _FLOATS):
        raise ValueError(f"{name} must be a float32/bfloat16/float16 array [batch, vocab], got "
                         f"{getattr(x, 'dtype', type(x))} of shape {jnp.shape(x)}")
    if x.shape[1] == 0:
        raise ValueError(f"{name} has an empty vocabulary (shape {x.shape})")
    if not is_concrete(x) or x.shape[0] == 0:
        return
    xf = jnp.asarray(x, jnp.float32)
    if from_logits:
        bad = {"NaN": jnp.isnan(xf).any(), "+inf": jnp.isposinf(xf).any(),
               "a row with no finite logit": jnp.any(jnp.all(jnp.isneginf(xf), axis=1))}
    else:
        bad = {"NaN or inf": jnp.any(~jnp.isfinite(xf)), "a negative entry": jnp.any(xf < 0),
               "a row summing to 0": jnp.any(jnp.sum(xf, axis=1) <= 0)}
    found = [what for what, flag in zip(bad, np.asarray(jnp.stack(list(bad.values())))) if flag]
    if found:
        raise ValueError(f"{name} has {', '.join(found)}")


def _row_param(name, value, batch, dtype, low=None, high=None, low_open=False):
    """A scalar or [batch] parameter as a [batch] array; concrete values are range-checked."""
    arr = jnp.asarray(value)
    if arr.ndim > 1 or (arr.ndim == 1 and arr.shape[0] != batch):
        raise ValueError(f"{name} must be a scalar or an array [{batch}], got shape {arr.shape}")
    if jnp.issubdtype(dtype, jnp.integer) and not jnp.issubdtype(arr.dtype, jnp.integer):
        raise ValueError(f"{name} must be integer, got {arr.dtype}")
    if is_concrete(arr) and (low is not None or high is not None):
        a = np.asarray(arr, np.float64)
        below = a <= low if low_open else a < low
        if np.any(np.isnan(a)) or (low is not None and np.any(below)) or (high is not None and np.any(a > high)):
            span = f"{'(' if low_open else '['}{low}, {high}]"
            raise ValueError(f"{name} must lie in {span}, got {np.asarray(arr)}")
    return jnp.broadcast_to(arr.astype(dtype), (batch,))


def _seeds(key, batch):
    """Two int32 seeds per output row, from a jax.random key (typed or raw uint32[2])."""
    if not isinstance(key, jax.Array) or not (
            jnp.issubdtype(key.dtype, jax.dtypes.prng_key) or (key.shape == (2,) and key.dtype == jnp.uint32)):
        raise ValueError(f"key must be a jax.random key, got {key!r}")
    return lax.bitcast_convert_type(jax.random.bits(key, (batch, 2), jnp.uint32), jnp.int32)


def _rows(indices, num_rows):
    """The input row of each output row: indices [B] int32 (FlashInfer's `indices`) or all rows."""
    if indices is None:
        return jnp.arange(num_rows, dtype=jnp.int32)
    idx = jnp.asarray(indices)
    if idx.ndim != 1 or not jnp.issubdtype(idx.dtype, jnp.integer):
        raise ValueError(f"indices must be an integer array [B], got {idx.dtype} of shape {idx.shape}")
    if is_concrete(idx) and idx.size and (np.min(np.asarray(idx)) < 0 or np.max(np.asarray(idx)) >= num_rows):
        raise ValueError(f"indices must lie in [0, {num_rows}), got {np.asarray(idx)}")
    return idx.astype(jnp.int32)


def _order(filter_apply_order):
    if filter_apply_order not in FILTER_ORDERS:
        raise ValueError(f"filter_apply_order must be one of {FILTER_ORDERS}, got {filter_apply_order!r}")
    return filter_apply_order == "top_k_first"


def _run(name, x, *, filters, key=None, indices=None, top_k=None, top_p=None, min_p=None,
         temperature=None, backend=None, config=None):
    """Checks the arguments and runs the kernel: (tokens [B] int32, thresholds [B] f32, exact
    when not filters.sample)."""
    _check_matrix(name, x, filters.from_logits)
    rows = _rows(indices, x.shape[0])
    batch = rows.shape[0]
    k = _row_param("top_k", 0 if top_k is None else top_k, batch, jnp.int32)
    p = _row_param("top_p", 1.0 if top_p is None else top_p, batch, jnp.float32, 0.0, 1.0, low_open=True)
    mp = _row_param("min_p", 0.0 if min_p is None else min_p, batch, jnp.float32, 0.0, 1.0)
    temp = _row_param("temperature", 1.0 if temperature is None else temperature, batch, jnp.float32,
                      0.0, np.inf)
    inv_t = jnp.where(temp > 0, 1.0 / jnp.where(temp > 0, temp, 1.0), 0.0)
    seeds = _seeds(key, batch) if filters.sample else jnp.zeros((batch, 2), jnp.int32)
    if batch == 0:
        return jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.float32)
    config = dispatch.sampling_config(filters, config or SamplingConfig(), batch, _backend.num_sms())
    return dispatch.sampling_row(filters).kernel(x, rows, k, p, mp, inv_t, seeds, filters=filters,
                                          interpret=_backend.use_interpret(backend), config=config)


# --- sampling ----------------------------------------------------------------------------------

def sampling_from_logits(logits, indices=None, *, key, temperature=None, backend=None, config=None):
    """A token per row from softmax(logits / temperature). logits [R, V] -> int32 [B].

    indices [B] (optional): output row b draws from row indices[b] (B = R without it).
    temperature: a scalar or [B] (default 1); 0 gives the argmax (lowest index among ties)."""
    filters = Filters(from_logits=True)
    return _run("logits", logits, filters=filters, key=key, indices=indices, temperature=temperature,
                backend=backend, config=config)[0]


def sampling_from_probs(probs, indices=None, *, key, backend=None, config=None):
    """A token per row from probs [R, V] (need not sum to 1: drawn in proportion). -> int32 [B]."""
    return _run("probs", probs, filters=Filters(from_logits=False), key=key, indices=indices,
                backend=backend, config=config)[0]


def top_k_sampling_from_probs(probs, top_k, indices=None, *, key, backend=None, config=None):
    """A token per row from its top-k tokens renormalised (ties with the k-th value kept;
    top_k <= 0 or >= V: no filter). probs [R, V], top_k int scalar or [B] -> int32 [B]."""
    return _run("probs", probs, filters=Filters(from_logits=False, top_k=True), key=key,
                indices=indices, top_k=top_k, backend=backend, config=config)[0]


def top_p_sampling_from_probs(probs, top_p, indices=None, *, key, backend=None, config=None):
    """A token per row from its nucleus renormalised: the fewest top values whose mass reaches
    top_p of the row, with ties kept (top_p in (0, 1]; 1: no filter). -> int32 [B]."""
    return _run("probs", probs, filters=Filters(from_logits=False, top_p=True), key=key,
                indices=indices, top_p=top_p, backend=backend, config=config)[0]


def min_p_sampling_from_probs(probs, min_p, indices=None, *, key, backend=None, config=None):
    """A token per row from the tokens with p >= min_p * max p, renormalised (min_p in [0, 1]).
    -> int32 [B]."""
    return _run("probs", probs, filters=Filters(from_logits=False, min_p=True), key=key,
                indices=indices, min_p=min_p, backend=backend, config=config)[0]


def top_k_top_p_sampling_from_logits(logits, top_k, top_p, indices=None, filter_apply_order="top_k_first",
                                     *, key, temperature=None, backend=None, config=None):
    """A token per row from softmax(logits / temperature) filtered by top-k and top-p.

    filter_apply_order "top_k_first": top-p is taken of the top-k tokens renormalised (FlashInfer's
    default: top_k_mask_logits, softmax, top-p); "joint": a token must pass both filters, each
    measured on the whole row. temperature: scalar or [B] (default 1; 0: argmax). -> int32 [B]."""
    top_k_first = _order(filter_apply_order)
    filters = Filters(from_logits=True, top_k=True, top_p=True, top_k_first=top_k_first)
    return _run("logits", logits, filters=filters, key=key, indices=indices, top_k=top_k, top_p=top_p,
                temperature=temperature, backend=backend, config=config)[0]


def top_k_top_p_sampling_from_probs(probs, top_k, top_p, indices=None, filter_apply_order="top_k_first",
                                    *, key, backend=None, config=None):
    """As top_k_top_p_sampling_from_logits, from probabilities [R, V]. -> int32 [B]."""
    top_k_first = _order(filter_apply_order)
    filters = Filters(from_logits=False, top_k=True, top_p=True, top_k_first=top_k_first)
    return _run("probs", probs, filters=filters, key=key, indices=indices, top_k=top_k, top_p=top_p,
                backend=backend, config=config)[0]


# --- renormalisation and masking --------------------------------------------------------------

def _renorm(probs, thr):
    kept = jnp.where(probs >= thr[:, None].astype(probs.dtype), probs, 0).astype(jnp.float32)
    return (kept / jnp.sum(kept, axis=1, keepdims=True)).astype(probs.dtype)


def top_k_renorm_probs(probs, top_k, *, backend=None, config=None):
    """probs [B, V] with all but the top-k tokens zeroed and the rest renormalised (ties with the
    k-th value kept; top_k <= 0 or >= V: only renormalised)."""
    _, thr = _run("probs", probs, filters=Filters(from_logits=False, top_k=True, sample=False),
                  top_k=top_k, backend=backend, config=config)
    return _renorm(probs, thr)


def top_p_renorm_probs(probs, top_p, *, backend=None, config=None):
    """probs [B, V] restricted to each row's nucleus (as top_p_sampling_from_probs keeps) and
    renormalised."""
    _, thr = _run("probs", probs, filters=Filters(from_logits=False, top_p=True, sample=False),
                  top_p=top_p, backend=backend, config=config)
    return _renorm(probs, thr)


def top_k_mask_logits(logits, top_k, *, backend=None, config=None):
    """logits [B, V] with every token below the k-th largest value set to -inf (ties with the
    k-th value kept; top_k <= 0 or >= V: unchanged)."""
    _, thr = _run("logits", logits, filters=Filters(from_logits=True, top_k=True, sample=False),
                  top_k=top_k, backend=backend, config=config)
    return jnp.where(logits >= thr[:, None].astype(logits.dtype), logits, -jnp.inf).astype(logits.dtype)


# --- speculative decoding -----------------------------------------------------------------------

def chain_speculative_sampling(draft_probs, draft_token_ids, target_probs, *, key, backend=None, config=None):
    """Verifies a chain of n draft tokens per request (Leviathan et al.; Chen et al.): exact in
    distribution, every emitted token follows the target model.

    draft_probs [B, n, V], draft_token_ids [B, n] int, target_probs [B, n + 1, V]. Draft token i
    (q: target, p: draft probabilities at it) is accepted when u_i * p < q (u_i uniform in
    [0, 1)); at the first rejection a token is drawn from max(q - p, 0) renormalised (from q when
    that is all zero), and when all n are accepted a bonus token from target_probs[:, n].
    Returns (output_token_ids [B, n + 1] int32: the accepted drafts, then the drawn token, then
    -1; accepted_num [B]: drafts that pass the test, each considered on its own (FlashInfer's
    metric, not stopped at the first rejection); emitted_num [B]: drafts emitted, the accepted
    prefix)."""
    if jnp.ndim(draft_probs) != 3 or jnp.ndim(target_probs) != 3:
        raise ValueError(f"draft_probs must be [B, n, V] and target_probs [B, n + 1, V], got "
                         f"{jnp.shape(draft_probs)} and {jnp.shape(target_probs)}")
    batch, n, vocab = draft_probs.shape
    if target_probs.shape != (batch, n + 1, vocab):
        raise ValueError(f"target_probs must be [{batch}, {n + 1}, {vocab}], got {target_probs.shape}")
    ids = jnp.asarray(draft_token_ids)
    if ids.shape != (batch, n) or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"draft_token_ids must be an integer array [{batch}, {n}], got {ids.dtype} {ids.shape}")
    if is_concrete(ids) and ids.size and (np.min(np.asarray(ids)) < 0 or np.max(np.asarray(ids)) >= vocab):
        raise ValueError(f"draft_token_ids must lie in [0, {vocab})")
    if n:
        _check_matrix("draft_probs", draft_probs.reshape(batch * n, vocab), False)
    _check_matrix("target_probs", target_probs.reshape(batch * (n + 1), vocab), False)
    ids = ids.astype(jnp.int32)
    k_accept, k_draw = jax.random.split(key)
    q = jnp.take_along_axis(target_probs[:, :n], ids[..., None], axis=2)[..., 0].astype(jnp.float32)  # [B, n]
    p = jnp.take_along_axis(draft_probs, ids[..., None], axis=2)[..., 0].astype(jnp.float32)  # [B, n]
    u = jax.random.uniform(k_accept, (batch, n), jnp.float32)
    accept = u * p < q  # [B, n]
    emitted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)  # [B]
    first = jnp.minimum(emitted, n)  # the row drawn from: the rejection, or the bonus at n
    q_row = jnp.take_along_axis(target_probs, first[:, None, None], axis=1)[:, 0].astype(jnp.float32)  # [B, V]
    p_row = jnp.take_along_axis(jnp.pad(draft_probs, ((0, 0), (0, 1), (0, 0))), first[:, None, None],
                                axis=1)[:, 0].astype(jnp.float32)  # [B, V]; zeros at the bonus row
    residual = jnp.maximum(q_row - p_row, 0.0)
    residual = jnp.where(jnp.sum(residual, axis=1, keepdims=True) > 0, residual, q_row)
    drawn = _run("target_probs", residual, filters=Filters(from_logits=False), key=k_draw,
                 backend=backend, config=config)[0]  # concrete rows were checked above
    pos = jnp.arange(n + 1)[None, :]
    padded_ids = jnp.pad(ids, ((0, 0), (0, 1)))
    out = jnp.where(pos < emitted[:, None], padded_ids, jnp.where(pos == emitted[:, None], drawn[:, None], -1))
    return out.astype(jnp.int32), jnp.sum(accept, axis=1).astype(jnp.int32), emitted.astype(jnp.int32)


# --- references (pure jnp, sorting allowed): what the kernels must equal in distribution ------

def _reference_threshold(y, w, target, count, lo):
    """The largest value t >= lo of one row y [V] with G(t) >= target (G(t): count (count=True)
    or mass w [V] of the values >= t), or -inf when G(lo) < target. Sort-based."""
    order = jnp.argsort(y)
    a, wa = y[order], (jnp.ones_like(w) if count else w)[order]
    suffix = jnp.cumsum(wa[::-1])[::-1]  # suffix[i] = G(a[i]) up to ties
    g = suffix[jnp.searchsorted(a, y, side="left")]  # [V] G at each value
    g_lo = jnp.sum(jnp.where(y >= lo, jnp.ones_like(w) if count else w, 0.0))
    best = jnp.max(jnp.where((g >= target) & (y >= lo), y, -jnp.inf))
    return jnp.where(g_lo >= target, best, -jnp.inf)


def _reference_kept(x, *, from_logits, top_k=None, top_p=None, min_p=None, temperature=None,
                    filter_apply_order="joint"):
    """(y [B, V] f32, weights [B, V], keep [B, V] bool) of the filters as documented above."""
    x = jnp.asarray(x, jnp.float32)
    batch, vocab = x.shape
    t_arr = jnp.broadcast_to(jnp.asarray(1.0 if temperature is None else temperature, jnp.float32), (batch,))
    y = x / jnp.where(t_arr > 0, t_arr, 1.0)[:, None] if from_logits else x
    ymax = jnp.max(y, axis=1, keepdims=True)
    w = jnp.exp(y - ymax) if from_logits else y
    keep = jnp.ones_like(y, bool)
    floor = -jnp.inf if from_logits else 0.0
    t_k = jnp.full((batch,), -jnp.inf)
    if top_k is not None:
        k = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (batch,))
        t_k = jax.vmap(lambda yr, wr, kr: _reference_threshold(yr, wr, kr.astype(jnp.float32), True, floor))(y, w, k)
        t_k = jnp.where((k > 0) & (k < vocab), t_k, -jnp.inf)
        keep &= y >= t_k[:, None]
    if top_p is not None:
        p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (batch,))
        lo = jnp.maximum(t_k, floor) if filter_apply_order == "top_k_first" else jnp.full((batch,), floor)
        base = jnp.sum(jnp.where(y >= lo[:, None], w, 0.0), axis=1)
        t_p = jax.vmap(lambda yr, wr, tr, lr: _reference_threshold(yr, wr, tr, False, lr))(y, w, p * base, lo)
        keep &= y >= jnp.where(p < 1, t_p, -jnp.inf)[:, None]
    if min_p is not None:
        mp = jnp.broadcast_to(jnp.asarray(min_p, jnp.float32), (batch,))[:, None]
        keep &= (y >= ymax + jnp.log(mp)) if from_logits else (y >= mp * ymax)
    greedy = (t_arr == 0)[:, None]
    keep = jnp.where(greedy, y == ymax, keep)
    return y, w, keep


def _reference_probs(x, *, from_logits, top_k=None, top_p=None, min_p=None, temperature=None,
                     filter_apply_order="joint"):
    """The exact distribution [B, V] f32 each sampling function draws from (greedy rows: all
    mass on the first maximum)."""
    y, w, keep = _reference_kept(x, from_logits=from_logits, top_k=top_k, top_p=top_p, min_p=min_p,
                                 temperature=temperature, filter_apply_order=filter_apply_order)
    t_arr = jnp.broadcast_to(jnp.asarray(1.0 if temperature is None else temperature, jnp.float32), (y.shape[0],))
    kept = jnp.where(keep, w, 0.0)
    probs = kept / jnp.sum(kept, axis=1, keepdims=True)
    first_max = jax.nn.one_hot(jnp.argmax(y, axis=1), y.shape[1], dtype=jnp.float32)
    return jnp.where((t_arr == 0)[:, None], first_max, probs)


def _reference_top_k_renorm_probs(probs, top_k):
    _, w, keep = _reference_kept(probs, from_logits=False, top_k=top_k)
    kept = jnp.where(keep, w, 0.0)
    return kept / jnp.sum(kept, axis=1, keepdims=True)


def _reference_top_p_renorm_probs(probs, top_p):
    _, w, keep = _reference_kept(probs, from_logits=False, top_p=top_p)
    kept = jnp.where(keep, w, 0.0)
    return kept / jnp.sum(kept, axis=1, keepdims=True)


def _reference_top_k_mask_logits(logits, top_k):
    _, _, keep = _reference_kept(logits, from_logits=True, top_k=top_k)
    return jnp.where(keep, jnp.asarray(logits, jnp.float32), -jnp.inf)


def _reference_chain_speculative_sampling(draft_probs, draft_token_ids, target_probs, *, key):
    """chain_speculative_sampling in jnp with jax.random.categorical draws (same outputs)."""
    batch, n, _ = draft_probs.shape
    k_accept, k_draw = jax.random.split(key)
    ids = draft_token_ids.astype(jnp.int32)
    q = jnp.take_along_axis(target_probs[:, :n], ids[..., None], axis=2)[..., 0]
    p = jnp.take_along_axis(draft_probs, ids[..., None], axis=2)[..., 0]
    accept = jax.random.uniform(k_accept, (batch, n)) * p < q
    emitted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)
    q_row = target_probs[jnp.arange(batch), emitted]
    p_row = jnp.pad(draft_probs, ((0, 0), (0, 1), (0, 0)))[jnp.arange(batch), emitted]
    residual = jnp.maximum(q_row - p_row, 0.0)
    residual = jnp.where(jnp.sum(residual, axis=1, keepdims=True) > 0, residual, q_row)
    drawn = jax.random.categorical(k_draw, jnp.log(residual), axis=1)
    pos = jnp.arange(n + 1)[None, :]
    out = jnp.where(pos < emitted[:, None], jnp.pad(ids, ((0, 0), (0, 1))),
                    jnp.where(pos == emitted[:, None], drawn[:, None], -1))
    return out, jnp.sum(accept, axis=1), emitted
