"""Sorting-free sampling kernels: one program per output row, a few passes over its vocabulary.

Each row's values y are probabilities, or logits times 1 / temperature. A filter keeps the
tokens with y >= t for one threshold t per row, found without sorting:

- top-k: t is the largest value with count(y >= t) >= k, so every token tied with the k-th
  largest value is kept (possibly more than k tokens);
- top-p: t is the largest value with mass(y >= t) >= top_p * mass (mass: the probabilities,
  or exp(y - max y) for logits), so ties at the boundary are kept too;
- min-p: t = min_p * max p (logits: max y + log(min_p)).

Threshold search (exact, deterministic): the answer lies in an interval [lo, hi) of values with
G(lo) >= target > G(hi) (G: the count or mass at or above a value). Each pass over the row
evaluates G at NUM_PIVOTS pivots spread evenly over the interval's order-preserving 32-bit keys
(the float's bits, sign-folded, so the spread is linear within a binade and logarithmic
across them) and, in the same pass, the smallest and largest value inside the interval; the
interval then shrinks to the pivot bucket holding the answer, clipped to those values. A pass
narrows the key range 16-fold, so at most 9 passes reach one distinct value; on real logit or
probability rows 3-6 do.

The draw is an exponential race over the kept tokens (Gumbel-max for logits): token i's key is
p_i / E_i (y_i - log E_i) with E_i ~ Exp(1) from a counter-based hash of (row seed, i), and the
largest key wins; that is an exact draw from the kept tokens renormalised, in one pass, with no
prefix sum. Ties in the race key go to the lowest index. Greedy rows (inverse temperature 0)
race on the logits themselves.

Refs hold whole arrays; each program reads its row in blocks of block_v lanes with masked
loads (any V). Per-lane partial results ride in the loop carry and are reduced once per pass.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _common

NUM_PIVOTS = 16    # G is evaluated at 16 keys per search pass (the first is the interval's lo)
MAX_PASSES = 12    # a bound the search never reaches on finite data (it needs at most 9)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """Tuning of the sampling kernel: lanes per block and warps per program (one row each)."""
    block_v: int = 1024
    num_warps: int = 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class Filters:
    """Which filters a kernel instance applies (static). top_k_first: top-p is measured on the
    top-k tokens renormalised (FlashInfer's "top_k_first"); otherwise both filters see the whole
    row and a token must pass both ("joint")."""
    from_logits: bool
    top_k: bool = False
    top_p: bool = False
    min_p: bool = False
    top_k_first: bool = False
    sample: bool = True


def _i32(u):
    """A uint32 constant as the int32 with the same bits."""
    return int(np.uint32(u).view(np.int32))


def _mix(x):
    """lowbias32 (C. Wellons): a 32-bit integer hash with low bias, in wrapping int32 arithmetic."""
    x = x ^ lax.shift_right_logical(x, 16)
    x = x * _i32(0x7FEB352D)
    x = x ^ lax.shift_right_logical(x, 15)
    x = x * _i32(0x846CA68B)
    return x ^ lax.shift_right_logical(x, 16)


def exponential(seed0, seed1, cols):
    """Exp(1) variates [N] f32 for columns cols [N] int32 of a row with int32 seeds (seed0, seed1):
    a counter-based hash, so a draw depends only on the key, the row and the column."""
    h = _mix(_mix(cols * _i32(0x9E3779B9) + seed0) ^ seed1)
    u = (lax.shift_right_logical(h, 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))  # (0, 1)
    return -jnp.log(u)


def _to_key(f):
    """float32 -> its order-preserving key, an int32 read as unsigned (-inf < ... < +inf)."""
    b = lax.bitcast_convert_type(f, jnp.int32)
    return b ^ (lax.shift_right_arithmetic(b, 31) | _i32(0x80000000))


def _from_key(k):
    b = k ^ (~lax.shift_right_arithmetic(k, 31) | _i32(0x80000000))
    return lax.bitcast_convert_type(b, jnp.float32)


def _pivots(lo, hi):
    """NUM_PIVOTS values from lo (first) toward hi, evenly spaced in key space (unsigned, with
    wrapping int32 arithmetic): key(lo) + ceil(j * width / NUM_PIVOTS), j = 0 .. NUM_PIVOTS - 1."""
    klo = _to_key(lo)
    w = _to_key(hi) - klo  # the unsigned width, as int32 bits
    j = jnp.arange(NUM_PIVOTS, dtype=jnp.int32)
    shift = NUM_PIVOTS.bit_length() - 1
    off = lax.shift_right_logical(w, shift) * j + lax.shift_right_logical(
        (w & (NUM_PIVOTS - 1)) * j + (NUM_PIVOTS - 1), shift)
    return _from_key(klo + off)  # [P]


def _kernel(rows_ref, x_ref, k_ref, p_ref, minp_ref, invt_ref, seed_ref, tok_ref, thr_ref, *,
            filters, vocab, block_v):
    # rows_ref [B] int32: the input row of each output row; x_ref [R, V] probs or logits;
    # k_ref [B] int32; p_ref, minp_ref, invt_ref [B] f32; seed_ref [B, 2] int32;
    # tok_ref [B] int32 (the draw); thr_ref [B] f32 (the threshold t: tokens with y >= t are kept)
    b = pl.program_id(0)
    row = rows_ref[b]
    num_blocks = pl.cdiv(vocab, block_v)
    lanes = jnp.arange(block_v, dtype=jnp.int32)
    logits = filters.from_logits
    inv_t = invt_ref[b]
    greedy = inv_t == 0
    scale = jnp.where(greedy, 1.0, inv_t)

    def load(j, other):
        """Block j of the row: (y [block_v] f32, columns [block_v] int32, in range [block_v])."""
        cols = j * block_v + lanes
        valid = cols < vocab
        x = plgpu.load(x_ref.at[row, cols], mask=valid, other=other).astype(jnp.float32)
        return (x * scale if logits else x), cols, valid

    ninf = jnp.full((block_v,), -jnp.inf, jnp.float32)
    ymax = None
    if filters.min_p or (logits and filters.top_p):
        def max_body(j, m):
            y, _, valid = load(j, -jnp.inf)
            return jnp.maximum(m, jnp.where(valid, y, -jnp.inf))
        ymax = jnp.max(lax.fori_loop(0, num_blocks, max_body, ninf))

    def weight(y):
        """Each token's mass: its probability, or exp(y - max y) for logits (NaN pads give 0)."""
        w = jnp.exp(y - ymax) if logits else jnp.maximum(y, 0.0)
        return jnp.where(y == y, w, 0.0)

    def search(lo0, hi0, active, count, goal):
        """The largest value t in [lo0, hi0) with G(t) >= target (G: count or mass at or above;
        target = goal(G(lo0))), -inf when G(lo0) < target or not active (no filter)."""
        def cond(state):
            it, done = state[0], state[3]
            return jnp.logical_and(jnp.logical_not(done), it < MAX_PASSES)

        def body(state):
            it, lo, hi, _, ans, target = state
            piv = _pivots(lo, hi)  # [P]

            def block(j, carry):
                acc, dmin, dmax = carry  # [block_v, P], [block_v], [block_v]
                y, _, _ = load(j, jnp.nan)  # pads are NaN: never >= a pivot, never inside
                g = jnp.where(y == y, 1.0, 0.0) if count else weight(y)
                acc = acc + jnp.where(y[:, None] >= piv[None, :], g[:, None], 0.0)
                inside = (y >= lo) & (y < hi)
                return (acc, jnp.minimum(dmin, jnp.where(inside, y, jnp.inf)),
                        jnp.maximum(dmax, jnp.where(inside, y, -jnp.inf)))

            init = (jnp.zeros((block_v, NUM_PIVOTS), jnp.float32), -ninf, ninf)
            acc, dmin, dmax = lax.fori_loop(0, num_blocks, block, init)
            big = jnp.sum(acc, axis=0)  # [P] G at each pivot, non-increasing
            dmin, dmax = jnp.min(dmin), jnp.max(dmax)
            g_lo = jnp.max(big)  # G(lo): the first pivot is lo, and G is non-increasing
            target = jnp.where(it == 0, goal(g_lo), target)
            ok = big >= target
            none = g_lo < target  # only in the first pass: G(lo0) < target
            single = dmin >= dmax  # one distinct value left (or none: cannot happen on finite data)
            new_lo = jnp.maximum(jnp.max(jnp.where(ok, piv, -jnp.inf)), dmin)
            new_hi = jnp.minimum(jnp.min(jnp.where(ok, jnp.inf, piv)), hi)
            new_hi = jnp.minimum(new_hi, lax.nextafter(dmax, jnp.float32(jnp.inf)))
            ans = jnp.where(none, -jnp.inf, jnp.where(dmin == dmax, dmin, lo))
            return it + 1, new_lo, new_hi, none | single, ans, target

        state = (jnp.int32(0), lo0, hi0, jnp.logical_not(active), jnp.float32(-jnp.inf),
                 jnp.float32(0.0))
        it, lo, _, done, ans, _ = lax.while_loop(cond, body, state)
        return jnp.where(done, ans, lo)  # the pass bound reached: lo keeps a superset

    inf = jnp.float32(jnp.inf)
    floor = jnp.float32(-jnp.inf if logits else 0.0)  # below every value (probs are >= 0)
    t = jnp.float32(-jnp.inf)
    if filters.top_k:
        k = k_ref[b]
        t_k = search(floor, inf, (k > 0) & (k < vocab), True, lambda g0: k.astype(jnp.float32))
        t = jnp.maximum(t, t_k)
    if filters.top_p:
        p = p_ref[b]
        lo0 = jnp.maximum(t, floor) if filters.top_k_first else floor
        t_p = search(lo0, lax.nextafter(ymax, inf) if logits else inf, p < 1.0, False,
                     lambda g0: p * g0)
        t = jnp.maximum(t, t_p)
    if filters.min_p:
        mp = minp_ref[b]
        t = jnp.maximum(t, ymax + jnp.log(mp) if logits else mp * ymax)
    thr_ref[b] = jnp.where(greedy, -jnp.inf, t)
    if not filters.sample:
        tok_ref[b] = jnp.int32(0)
        return

    s0, s1 = seed_ref[b, 0], seed_ref[b, 1]

    def race(j, carry):
        best, idx = carry  # [block_v] f32, [block_v] int32
        y, cols, valid = load(j, -jnp.inf)
        e = exponential(s0, s1, cols)
        r = (y - jnp.log(e)) if logits else (y / e)
        r = jnp.where(greedy, y, r)
        r = jnp.where(valid & ((y >= t) | greedy), r, -jnp.inf)
        upd = r > best
        return jnp.where(upd, r, best), jnp.where(upd, cols, idx)

    best, idx = lax.fori_loop(0, num_blocks, race, (ninf, jnp.full((block_v,), vocab, jnp.int32)))
    top = jnp.max(best)
    tok = jnp.min(jnp.where(best == top, idx, vocab))
    tok_ref[b] = jnp.where(tok < vocab, tok, 0)  # no token kept (invalid row): 0


def filtered_sample(x, rows, top_k, top_p, min_p, inv_temp, seeds, *, filters, interpret,
                    config=SamplingConfig()):
    """Per output row b, the threshold and one draw from row rows[b] of x.

    x [R, V] f32/bf16 (probabilities, or logits when filters.from_logits); rows [B] int32;
    top_k [B] int32; top_p, min_p, inv_temp [B] f32 (inv_temp 0: greedy); seeds [B, 2] int32.
    Returns (tokens [B] int32, thresholds [B] f32: the row keeps tokens with y >= threshold,
    y = x * inv_temp for logits; -inf when nothing is filtered)."""
    batch = rows.shape[0]
    vocab = x.shape[1]
    block_v = min(config.block_v, _common.next_pow2(vocab))
    kernel = functools.partial(_kernel, filters=filters, vocab=vocab, block_v=block_v)
    return pl.pallas_call(
        kernel,
        grid=(batch,),
        out_shape=(jax.ShapeDtypeStruct((batch,), jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.float32)),
        compiler_params=_common.compiler_params(config.num_warps, 1),
        interpret=interpret,
        name="jaxinfer_sampling",
    )(rows, x, top_k, top_p, min_p, inv_temp, seeds)
