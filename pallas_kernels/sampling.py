"""Sorting-free sampling kernels: one program per output row, usually one pass over its vocabulary
(filtered_sample, its pass 1 split among several programs per row when the batch is small; an
unfiltered draw: race_sample, several programs per row).

Values y: probabilities, or logits times 1 / temperature. A filter keeps the tokens with y >= t
for a per-row threshold t, every token tied at the boundary included (top-k, top-p, min-p).
Pass 1 keeps, per lane, its `track` largest values with their columns and the largest value it
dropped (s: every value above s is tracked), draws a candidate from the whole row (an
exponential race) and sums the mass. A threshold above s is exact from the tracked values; when
the kept set lies above s the token is drawn from them in registers. Otherwise rejection with
pivots: a candidate is kept when it lies in the kept set; a check pass measures count and mass
above it, per lane, and a rejected one is followed by the next candidate drawn from those lane
masses by inverse CDF (no other pass). Rows that need more than max_rounds passes (or top-k
first with a large k) find their thresholds with an exact multi-pivot search. docs/sampling.md
has the details and the pass counts.
"""
import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _common

NUM_PIVOTS = 8     # the exact search evaluates its count or mass at 8 values per pass
MAX_PASSES = 12    # 8 ** 11 > 2 ** 32: the search reaches one distinct value within 11 passes
SPLIT_LANES = 128  # the fewest lanes a program of a lane-split pass 1 takes
WARP_LANES = 128   # a split pass 1 gives each warp this many lanes (4 a thread)
BAND_ROWS = 64     # the exact thresholds' all-pairs counts: this many values x the band at a time
LOG2E = _common.LOG2E


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """Tuning of the sampling kernels (one program per row after pass 1): lanes per block, warps, pipeline
    stages of the block loads (H100, min-p from probs at B1 x 128256: 71.7 µs with 1 stage,
    41.6 with 3; block_v 8192 spills), values tracked per lane in pass 1, and rejection passes
    before the exact search. splits: programs per row, for an unfiltered draw's race (its columns
    split) and a filtered draw's pass 1 (its lanes split, rounded down to a power of two, at
    least SPLIT_LANES lanes each; 1: pass 1 in the row's program). None: jaxinfer.sampling gives
    every SM two programs. The draw is the same however a row is split. split_stages: pipeline
    stages of a lane-split pass 1 (its programs load a few hundred lanes at a time). band (a
    power of two): the most tracked values compacted for the exact top-k / top-p thresholds."""
    block_v: int = 4096
    num_warps: int = 16
    num_stages: int = 3
    splits: Optional[int] = None
    split_stages: int = 6
    track: int = 3
    max_rounds: int = 16
    band: int = 64

    def __post_init__(self):
        for name in ("block_v", "num_warps", "band"):  # (Triton's block shapes)
            n = getattr(self, name)
            if not isinstance(n, int) or n < 1 or n & (n - 1):
                raise ValueError(f"SamplingConfig: {name} must be a power of two, got {n!r}")
        for name, least in (("num_stages", 1), ("split_stages", 1), ("track", 1), ("max_rounds", 0)):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < least:
                raise ValueError(f"SamplingConfig: {name} must be an int >= {least}, got {getattr(self, name)!r}")
        if self.splits is not None and (not isinstance(self.splits, int) or self.splits < 1):
            raise ValueError(f"SamplingConfig: splits must be None or an int >= 1, got {self.splits!r}")


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


INT_MIN = _i32(0x80000000)


def _mix(x):
    """lowbias32 (C. Wellons): a 32-bit integer hash with low bias, in wrapping int32 arithmetic."""
    x = x ^ lax.shift_right_logical(x, 16)
    x = x * _i32(0x7FEB352D)
    x = x ^ lax.shift_right_logical(x, 15)
    x = x * _i32(0x846CA68B)
    return x ^ lax.shift_right_logical(x, 16)


def _stream(s0, s1, rnd):
    """The int32 stream offset of a row (seeds s0, s1) in race round rnd."""
    return _mix(_mix(s0 ^ (rnd * _i32(0x85EBCA6B))) + s1)


def _asm(x, op, fast, asm):
    """op(x) for a f32 vector; fast (compiled for the GPU): the one PTX instruction asm."""
    if not fast:
        return op(x)
    return plgpu.elementwise_inline_asm(
        asm, args=[x], constraints="=f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])[0]


def _log2(x, fast):
    return _asm(x, jnp.log2, fast, "lg2.approx.ftz.f32 $0, $1;")


def _rcp(x, fast):
    return _asm(x, lambda v: 1.0 / v, fast, "rcp.approx.ftz.f32 $0, $1;")


def _exp(x, fast):
    """exp(x); fast: ex2.approx.ftz of x log2(e) (results below 2^-126 flush to 0)."""
    if not fast:
        return jnp.exp(x)
    return _asm(x * LOG2E, jnp.exp2, fast, "ex2.approx.ftz.f32 $0, $1;")


def race_keys(y, cols, stream, *, logits, fast):
    """Exponential-race keys [N] f32 of values y [N] at columns cols [N] int32: the largest key
    is an exact draw in proportion to y (probabilities) or exp(y) (logits). E = -log2(u), u in
    (0, 1) from a counter-based hash of (stream, column); key y / E, or y log2(e) - log2(E)."""
    h = _mix(cols * _i32(0x9E3779B9) + stream)
    u = (lax.shift_right_logical(h, 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))
    e = -_log2(u, fast)
    return y * LOG2E - _log2(e, fast) if logits else y * _rcp(e, fast)


def _to_key(f):
    """float32 -> its order-preserving key, an int32 read as unsigned (-inf < ... < +inf)."""
    b = lax.bitcast_convert_type(f, jnp.int32)
    return b ^ (lax.shift_right_arithmetic(b, 31) | INT_MIN)


def _from_key(k):
    b = k ^ (~lax.shift_right_arithmetic(k, 31) | INT_MIN)
    return lax.bitcast_convert_type(b, jnp.float32)


def _pivots(lo, hi):
    """NUM_PIVOTS scalars from lo (first) toward hi, evenly spaced in key space (unsigned, with
    wrapping int32 arithmetic): key(lo) + ceil(j * width / NUM_PIVOTS), j = 0 .. NUM_PIVOTS - 1."""
    klo = _to_key(lo)
    w = _to_key(hi) - klo  # the unsigned width, as int32 bits
    shift = NUM_PIVOTS.bit_length() - 1
    q, r = lax.shift_right_logical(w, shift), w & (NUM_PIVOTS - 1)
    return [_from_key(klo + q * j + lax.shift_right_logical(r * j + (NUM_PIVOTS - 1), shift))
            for j in range(NUM_PIVOTS)]


def _mass_at(keys, weights, v):
    """sum(weights where keys >= v) over the tracked values (lists of [N] int32 / f32 arrays)."""
    return jnp.sum(functools.reduce(jnp.add, [jnp.where(k >= v, w, 0.0) for k, w in zip(keys, weights)]))


def _count_at(keys, v):
    """How many tracked keys are >= v (int32)."""
    return jnp.sum(functools.reduce(jnp.add, [(k >= v).astype(jnp.int32) for k in keys]))


def _band(keys, weights, target, lo, hi, cap, counts=False):
    """Bisection of the signed keys [lo, hi), where G(>= hi) < target (G: the count of tracked
    keys at or above, where counts (a bool, may be traced), else their weights summed): a key
    L >= lo with G(>= L) >= target and at most cap tracked keys at or above it, or, when ties
    leave more than cap, the threshold's own key (G(>= L + 1) < target). cap < 0: always the
    threshold's key. One block reduction a step (two for a mass while the count exceeds cap), up
    to 32 steps. Returns (L, count(>= L) (0 when cap < 0), reach: G(>= lo) >= target; else L is
    meaningless)."""
    def pick(if_count, if_mass):  # (a traced choice: one branch runs)
        if isinstance(counts, bool):
            return if_count() if counts else if_mass()
        return lax.cond(counts, if_count, if_mass)

    def goal_at(v):
        return pick(lambda: _count_at(keys, v).astype(jnp.float32), lambda: _mass_at(keys, weights, v))

    def count_at(v, g):
        return v ^ v if cap < 0 else pick(lambda: g.astype(jnp.int32), lambda: _count_at(keys, v))

    g_lo = goal_at(lo)
    reach = g_lo >= target
    c_lo = lax.cond(reach, lambda: count_at(lo, g_lo), lambda: lo ^ lo)

    def cond(st):
        it, lo, hi, c = st
        return reach & (c > cap) & (lax.shift_right_logical(hi - lo, 1) != 0) & (it < 32)

    def body(st):
        it, lo, hi, c = st
        mid = lo + lax.shift_right_logical(hi - lo, 1)  # hi - lo wraps to the unsigned width
        g = goal_at(mid)
        up = g >= target
        c_mid = lax.cond(up, lambda: count_at(mid, g), lambda: c)
        return it + 1, jnp.where(up, mid, lo), jnp.where(up, hi, mid), c_mid

    _, lo, _, c_lo = lax.while_loop(cond, body, (jnp.int32(0), lo, hi, c_lo))
    return lo, c_lo, reach


def _band_thresholds(vals_ref, b, a, keys, real, weight, low, use_k, target1, p_target, *, band, fast):
    """Exact thresholds from the n <= band tracked values at or above the signed key low: they are
    compacted into vals_ref[b] (a prefix sum of the per-lane counts, then a masked scatter), and
    every value's count and mass at or above it come from all pairs, BAND_ROWS x band at a time. t1: the
    largest value with count >= target1 (use_k) or mass >= target1. With p_target (a function of
    the mass at or above t1, or None), t_p: the largest value with mass >= p_target, found when
    the compacted mass reaches it. Returns (t1, t_p, t_p found)."""
    sel = [(ki >= low) & r for ki, r in zip(keys, real)]  # [N] each; per lane, sel[i + 1] implies sel[i]
    per_lane = functools.reduce(jnp.add, [x.astype(jnp.int32) for x in sel])
    start = jnp.cumsum(per_lane) - per_lane
    n = jnp.sum(per_lane)
    for i, (x, ai) in enumerate(zip(sel, a)):  # (masked lanes aim at the spare slot `band`: the
        # interpreter's masked scatter writes them back, and must not over the compacted values)
        plgpu.store(vals_ref.at[b, jnp.where(x, start + i, band)], ai, mask=x)
    if fast:
        plgpu.debug_barrier()  # the scattered values visible to every thread of the program
    j = jnp.arange(band, dtype=jnp.int32)
    v_all = plgpu.load(vals_ref.at[b, j], mask=j < n, other=-jnp.inf)  # [band]
    w_all = jnp.where(j < n, weight(v_all), 0.0)
    chunk = min(band, BAND_ROWS)
    t1, rows = -jnp.inf, []
    for r in range(0, band, chunk):
        i = r + jnp.arange(chunk, dtype=jnp.int32)
        v = plgpu.load(vals_ref.at[b, i], mask=i < n, other=-jnp.inf)  # [chunk]
        ge = v_all[None, :] >= v[:, None]  # [chunk, band]
        mass = jnp.sum(jnp.where(ge, w_all[None, :], 0.0), axis=1)  # [chunk]
        goal = jnp.where(use_k, jnp.sum(ge.astype(jnp.int32), axis=1).astype(jnp.float32), mass)
        t1 = jnp.maximum(t1, jnp.max(jnp.where((i < n) & (goal >= target1), v, -jnp.inf)))
        rows.append((v, i, mass))
    if p_target is None:
        return t1, t1, n < 0
    target = p_target(jnp.sum(jnp.where(v_all >= t1, w_all, 0.0)))
    t_p = functools.reduce(jnp.maximum, [jnp.max(jnp.where((i < n) & (m >= target), v, -jnp.inf))
                                         for v, i, m in rows])
    return t1, t_p, jnp.sum(w_all) >= target


def _load_block(x_ref, row, lanes, j, *, block_v, vocab, scale, logits):
    """Block j of row `row` at lanes [N] (columns j * block_v + lanes): (y [N] f32, x times scale
    for logits, pads -inf; columns [N] int32; in range [N] bool)."""
    cols = j * block_v + lanes
    valid = cols < vocab
    x = plgpu.load(x_ref.at[row, cols], mask=valid, other=-jnp.inf).astype(jnp.float32)
    return (x * scale if logits else x), cols, valid


def _race(carry, r, cols):
    """One block of a race with keys r [N]: (best key, its column) [N]."""
    upd = r > carry[0]  # ties keep the earlier block: the lowest column wins
    return jnp.where(upd, r, carry[0]), jnp.where(upd, cols, carry[1])


def _winner(best, idx, vocab):
    """The race's token from its lanes' (best key, column) [N]: the lowest column among the
    largest keys (vocab: none)."""
    top = jnp.max(best)
    return jnp.min(jnp.where(best == top, idx, vocab))


def _store_winner(key_ref, col_ref, b, split, best, idx, vocab):
    """A split's race result at [b, split]: its largest key and that key's lowest column."""
    top = jnp.max(best)
    key_ref[b, split] = top
    col_ref[b, split] = jnp.min(jnp.where(best == top, idx, vocab))


def _pass1(load, num_blocks, num_lanes, *, filters, vocab, track, greedy, stream0, fast):
    """Pass 1 over blocks 0 .. num_blocks - 1 (load(j): y [num_lanes], columns), per lane: its
    `track` largest values (a: descending) with their columns (c), the largest value it dropped,
    its mass (probabilities summed; logits: relative to the lane maximum a[0], only for top-p)
    and a race over its columns in stream0 (best key, its column). Returns (a, c, dropped, mass,
    best, idx), each [num_lanes] (a, c: tuples of track)."""
    logits = filters.from_logits

    def step(j, carry):
        a, c, dropped, mass, best, idx = carry
        y, cols, _ = load(j)
        if filters.top_p:
            if logits:
                d = _exp(-jnp.abs(y - a[0]), fast)
                mass = jnp.where(y > -jnp.inf, jnp.where(y > a[0], mass * d + 1.0, mass + d), mass)
            else:
                mass = mass + jnp.maximum(y, 0.0)
        up = [y > ai for ai in a]  # up[i] implies up[i + 1]
        dropped = jnp.maximum(dropped, jnp.where(up[-1], a[-1], y))
        a = tuple(jnp.where(up[i - 1], a[i - 1], jnp.where(up[i], y, a[i])) if i else
                  jnp.where(up[0], y, a[0]) for i in range(track))
        c = tuple(jnp.where(up[i - 1], c[i - 1], jnp.where(up[i], cols, c[i])) if i else
                  jnp.where(up[0], cols, c[0]) for i in range(track))
        if filters.sample:
            r = race_keys(y, cols, stream0, logits=logits, fast=fast)
            best, idx = _race((best, idx), jnp.where(greedy, y, r), cols)
        return a, c, dropped, mass, best, idx

    ninf_v = jnp.full((num_lanes,), -jnp.inf, jnp.float32)
    none_v = jnp.full((num_lanes,), vocab, jnp.int32)
    init = ((ninf_v,) * track, (none_v,) * track, ninf_v, jnp.zeros((num_lanes,), jnp.float32),
            ninf_v, none_v)
    return lax.fori_loop(0, num_blocks, step, init)


def _row_scale(invt_ref, b):
    """(greedy, scale) of output row b: temperature 0 races on the values themselves."""
    inv_t = invt_ref[b]
    greedy = inv_t == 0
    return greedy, jnp.where(greedy, 1.0, inv_t)


def _pass1_kernel(rows_ref, x_ref, invt_ref, seed_ref, ta_ref, tc_ref, mass_ref, drop_ref, key_ref,
                  col_ref, *, filters, vocab, block_v, lanes, track, fast):
    # Program (b, s): pass 1 of output row b on lanes s * lanes .. (s + 1) * lanes - 1.
    # rows_ref [B] int32; x_ref [R, V] probs or logits; invt_ref [B] f32; seed_ref [B, 2] int32;
    # ta_ref [B, track, block_v] f32 / tc_ref [B, track, block_v] int32: the tracked values and
    # their columns; mass_ref [B, block_v] f32: the lane masses; drop_ref [B, S] f32: the largest
    # value dropped in the split; key_ref [B, S] f32 / col_ref [B, S] int32: its race's winner
    b, split = pl.program_id(0), pl.program_id(1)
    greedy, scale = _row_scale(invt_ref, b)
    first = split * lanes
    load = functools.partial(_load_block, x_ref, rows_ref[b], first + jnp.arange(lanes, dtype=jnp.int32),
                             block_v=block_v, vocab=vocab, scale=scale, logits=filters.from_logits)
    a, c, dropped, mass, best, idx = _pass1(
        load, pl.cdiv(vocab, block_v), lanes, filters=filters, vocab=vocab, track=track, greedy=greedy,
        stream0=_stream(seed_ref[b, 0], seed_ref[b, 1], 0), fast=fast)
    for i in range(track):
        ta_ref[b, i, pl.ds(first, lanes)] = a[i]
        tc_ref[b, i, pl.ds(first, lanes)] = c[i]
    mass_ref[b, pl.ds(first, lanes)] = mass
    drop_ref[b, split] = jnp.max(dropped)
    _store_winner(key_ref, col_ref, b, split, best, idx, vocab)


def _kernel(rows_ref, x_ref, k_ref, p_ref, minp_ref, invt_ref, seed_ref, *refs, filters, vocab,
            block_v, track, max_rounds, band, fast, split):
    # rows_ref [B] int32: the input row of each output row; x_ref [R, V] probs or logits;
    # k_ref [B] int32; p_ref, minp_ref, invt_ref [B] f32; seed_ref [B, 2] int32;
    # refs: when split, pass 1's outputs (_pass1_kernel: ta, tc, mass, drop, key, col), then
    # tok_ref [B] int32 (the draw); thr_ref [B] f32 (tokens with y >= it are kept; a lower
    # bound when sampling); vals_ref [B, band + 1] f32: scratch (the compacted tracked values, a spare slot)
    *state_refs, tok_ref, thr_ref, vals_ref = refs
    b = pl.program_id(0)
    row = rows_ref[b]
    num_blocks = pl.cdiv(vocab, block_v)
    lanes = jnp.arange(block_v, dtype=jnp.int32)
    logits, sample = filters.from_logits, filters.sample
    greedy, scale = _row_scale(invt_ref, b)
    s0, s1 = seed_ref[b, 0], seed_ref[b, 1]
    false = b < 0  # traced: constant booleans do not lower
    stream0 = _stream(s0, s1, 0)
    inf, ninf = jnp.float32(jnp.inf), jnp.float32(-jnp.inf)
    floor = ninf if logits else jnp.float32(0.0)  # below every value (probs are >= 0)
    keys = functools.partial(race_keys, logits=logits, fast=fast)
    load = functools.partial(_load_block, x_ref, row, lanes, block_v=block_v, vocab=vocab, scale=scale,
                             logits=logits)

    def value(tok):
        x = x_ref[row, jnp.minimum(tok, vocab - 1)].astype(jnp.float32)
        return x * scale if logits else x

    ninf_v = jnp.full((block_v,), -jnp.inf, jnp.float32)
    none_v = jnp.full((block_v,), vocab, jnp.int32)

    # Pass 1 (here, or split among programs by _pass1_kernel): the tracked values (a:
    # descending, c: their columns), s (every value above it is tracked), the lane masses and
    # the race's first candidate c1.
    if split:
        ta_ref, tc_ref, mass_ref, drop_ref, key_ref, col_ref = state_refs
        a = tuple(ta_ref[b, i, :] for i in range(track))
        c = tuple(tc_ref[b, i, :] for i in range(track))
        lane_mass = mass_ref[b, :]
        s = jnp.max(drop_ref[b, :])
        c1 = _winner(key_ref[b, :], col_ref[b, :], vocab)
    else:
        a, c, dropped, lane_mass, best, idx = _pass1(
            load, num_blocks, block_v, filters=filters, vocab=vocab, track=track, greedy=greedy,
            stream0=stream0, fast=fast)
        s = jnp.max(dropped)
        c1 = _winner(best, idx, vocab)
    ymax = jnp.max(a[0])

    def weight(y):
        """Each token's mass: its probability, or exp(y - max y) for logits (pads: 0)."""
        return _exp(y - ymax, fast) if logits else jnp.maximum(y, 0.0)

    real = [ci < vocab for ci in c]
    tkeys = [_to_key(jnp.where(ai == 0, 0.0, ai)) ^ INT_MIN for ai in a]  # signed, -0 as +0
    tmass = [jnp.where(r, weight(ai), 0.0) for r, ai in zip(real, a)]
    if logits:
        total = jnp.sum(lane_mass * _exp(a[0] - ymax, fast))
    else:
        total = jnp.sum(lane_mass)

    # Thresholds from the tracked values: exact when above s; an uncertified one is <= s.
    t_hi = ninf  # the largest exact threshold
    k_unknown = p_unknown = false
    k = k_ref[b]
    k_on = (k > 0) & (k < vocab)
    p = p_ref[b]
    p_on = p < 1.0
    t_k = ninf
    if filters.top_k or filters.top_p:
        # The first goal (top-k; top-p on rows without top-k) by bisection of the keys above s.
        # With top-k: down to at most `band` values, then exactly from those values compacted
        # (more than `band` values at the threshold: the bisection runs to it); top-p alone:
        # the bisection runs to its threshold.
        low = (_to_key(jnp.where(s == 0, 0.0, s)) ^ INT_MIN) + 1  # the tracked keys above s
        high = (_to_key(jnp.where(ymax == 0, 0.0, ymax)) ^ INT_MIN) + 1  # above every value
        use_k = k_on if filters.top_k else false
        two = filters.top_k and filters.top_p
        target1 = jnp.where(use_k, k.astype(jnp.float32), jnp.where(p_on, p * total, inf) if filters.top_p else inf)
    if filters.top_k:
        key1, n1, reach = _band(tkeys, tmass, target1, low, high, band, counts=use_k if filters.top_p else True)
        p_target = (lambda top_k_mass: p * top_k_mass) if filters.top_k_first else (lambda top_k_mass: p * total)
        compacted = functools.partial(
            _band_thresholds, vals_ref, b, a, tkeys, real, weight, key1, use_k, target1,
            p_target if two else None, band=band, fast=fast)
        # (the other branch derives its constants from operands: Triton yields values, not constants)
        t1, t_p2, p2_found = lax.cond(reach & (n1 <= band), compacted,
                                      lambda: (jnp.where(reach, _from_key(key1 ^ INT_MIN), ninf), ninf + 0 * p,
                                               ~reach & reach))
        k_cert = k_on & reach  # (t1 > s)
        k_unknown = k_on & ~k_cert
        t_k = t_hi = jnp.where(k_cert, t1, ninf)
    elif filters.top_p:
        key1, _, reach = _band(tkeys, tmass, target1, low, high, -1)
        t1 = jnp.where(reach, _from_key(key1 ^ INT_MIN), ninf)
    if filters.top_p:
        t_p, p_ok = t1, reach  # rows without top-k: top-p was the first goal
        if two:  # rows with top-k: top-p from the compacted values, else by bisection
            def bisect():
                base = jnp.where(k_cert, _mass_at(tkeys, tmass, _to_key(t_k) ^ INT_MIN), total) \
                    if filters.top_k_first else total
                return _band(tkeys, tmass, p * base, low, high, -1)[::2]

            pv, p_reach = lax.cond(use_k & p_on & ~p2_found, bisect, lambda: (low ^ low | INT_MIN, ~reach & reach))
            t_p = jnp.where(use_k, jnp.where(p2_found, t_p2, _from_key(pv ^ INT_MIN)), t1)
            p_ok = jnp.where(use_k, p2_found | p_reach, reach)
        p_cert = p_on & p_ok  # (t_p > s)
        if filters.top_k_first:
            p_cert &= ~k_unknown
        p_unknown = p_on & ~p_cert
        t_hi = jnp.maximum(t_hi, jnp.where(p_cert, t_p, ninf))
    if filters.min_p:
        mp = minp_ref[b]
        t_hi = jnp.maximum(t_hi, ymax + jnp.log(mp) if logits else mp * ymax)
    # top-k first with an uncertified top-k: top-p's base is unknown, and its threshold may be
    # above s: the exact search. Otherwise an unknown threshold is <= s, moot when t_hi > s.
    search_only = (k_unknown & p_on) if (filters.top_k_first and filters.top_p) else false
    unknown = (k_unknown | p_unknown) & (t_hi <= s)

    def search(lo0, hi0, active, count, goal):
        """The largest value t in [lo0, hi0) with G(t) >= target (G: count or mass at or above;
        target = goal(G(lo0))), -inf when G(lo0) < target or not active (no filter)."""
        def cond(state):
            return jnp.logical_not(state[3]) & (state[0] < MAX_PASSES)

        def body(state):
            it, lo, hi, _, ans, target = state
            piv = _pivots(lo, hi)

            def block(j, carry):
                acc, dmin, dmax = carry  # NUM_PIVOTS x [block_v], [block_v], [block_v]
                y, _, valid = load(j)
                g = valid.astype(jnp.float32) if count else weight(y)
                acc = tuple(ai + jnp.where(y >= pj, g, 0.0) for ai, pj in zip(acc, piv))
                inside = valid & (y >= lo) & (y < hi)
                return (acc, jnp.minimum(dmin, jnp.where(inside, y, jnp.inf)),
                        jnp.maximum(dmax, jnp.where(inside, y, -jnp.inf)))

            zeros = jnp.zeros((block_v,), jnp.float32)
            acc, dmin, dmax = lax.fori_loop(0, num_blocks, block, ((zeros,) * NUM_PIVOTS, -ninf_v, ninf_v))
            big = [jnp.sum(ai) for ai in acc]  # G at each pivot, non-increasing
            dmin, dmax = jnp.min(dmin), jnp.max(dmax)
            target = jnp.where(it == 0, goal(big[0]), target)
            none = big[0] < target  # only in the first pass: G(lo0) < target
            new_lo, new_hi = dmin, jnp.minimum(hi, lax.nextafter(dmax, inf))
            for gj, pj in zip(big, piv):
                new_lo = jnp.maximum(new_lo, jnp.where(gj >= target, pj, -jnp.inf))
                new_hi = jnp.minimum(new_hi, jnp.where(gj >= target, jnp.inf, pj))
            ans = jnp.where(none, -jnp.inf, jnp.where(dmin == dmax, dmin, lo))
            return it + 1, new_lo, new_hi, none | (dmin >= dmax), ans, target

        state = (jnp.int32(0), lo0, hi0, jnp.logical_not(active), ninf, jnp.float32(0.0))
        _, lo, _, done, ans, _ = lax.while_loop(cond, body, state)
        return jnp.where(done, ans, lo)  # the pass bound reached: lo keeps a superset

    def exact_threshold(active):
        """t_hi combined with the searched thresholds of the unknown filters (rows where active)."""
        t = t_hi
        tk = t_k
        if filters.top_k:
            tk = jnp.where(k_unknown, search(floor, inf, active & k_unknown, True,
                                             lambda g0: k.astype(jnp.float32)), t_k)
            t = jnp.maximum(t, tk)
        if filters.top_p:
            lo0 = jnp.maximum(tk, floor) if filters.top_k_first else floor
            tp = search(lo0, lax.nextafter(ymax, inf) if logits else inf, active & p_unknown, False,
                        lambda g0: p * g0)
            t = jnp.maximum(t, jnp.where(p_unknown, tp, ninf))
        return t

    if not sample:
        thr_ref[b] = exact_threshold(k_unknown | p_unknown)
        tok_ref[b] = jnp.int32(0)
        return

    # Rows whose kept set is tracked draw from the tracked values (race round 1).
    in_regs = t_hi > s
    stream1 = _stream(s0, s1, 1)
    rk = [jnp.where(r & (ai >= t_hi), keys(ai, ci, stream1), -jnp.inf) for r, ai, ci in zip(real, a, c)]
    top = functools.reduce(jnp.maximum, [jnp.max(r) for r in rk])
    tok_regs = functools.reduce(jnp.minimum, [jnp.min(jnp.where(r == top, ci, vocab)) for r, ci in zip(rk, c)])

    y1 = value(c1)
    accept1 = (y1 >= t_hi) & (~unknown | (y1 >= s))  # an unknown threshold is <= s
    done = greedy | in_regs | (accept1 & ~search_only)
    tok = jnp.where(in_regs & ~greedy, tok_regs, c1)

    # Rejection passes. state: (pass, done, token, pending candidate, its value, lo, rejected):
    # the pending candidate is unchecked (a check pass measures the kept set above it) or, only
    # before the first pass and in the exact loop, rejected (a draw pass draws the next one).
    # Draws after pass 1 take the inverse CDF of per-lane weights, then of one lane's columns:
    # a pass sums weights without hashes or logarithms (memory-bound), and a check pass's own
    # sums above the candidate give the next candidate on a rejection, without another pass.
    spread = jnp.arange(_common.next_pow2(num_blocks), dtype=jnp.int32)  # a lane's blocks

    def uniform(rnd):
        """The row's uniform in (0, 1) for round rnd (24 bits)."""
        h = _mix(_stream(s0, s1, rnd) ^ _i32(0x68E31DA4))
        return (lax.shift_right_logical(h, 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))

    def cdf_draw(lane_w, lo, rnd):
        """A token with y >= lo drawn in proportion to its weight, given lane_w [block_v]: each
        lane's weight of its columns with y >= lo (some > 0). The lane by the inverse CDF of
        lane_w, then the column by that of the lane's columns, read again (num_blocks values);
        rounding past the end takes the last lane or column of positive weight."""
        cum = jnp.cumsum(lane_w)
        target = uniform(rnd) * jnp.max(cum)
        lane = jnp.minimum(jnp.sum((cum <= target).astype(jnp.int32)),
                           jnp.max(jnp.where(lane_w > 0, lanes, 0)))
        rest = target - jnp.sum(jnp.where(lanes == lane, cum - lane_w, 0.0))
        cols = lane + spread * block_v
        x = plgpu.load(x_ref.at[row, cols], mask=cols < vocab, other=-jnp.inf).astype(jnp.float32)
        y = x * scale if logits else x
        w = jnp.where(y >= lo, weight(y), 0.0)
        step = jnp.minimum(jnp.sum((jnp.cumsum(w) <= rest).astype(jnp.int32)),
                           jnp.max(jnp.where(w > 0, spread, 0)))
        return lane + step * block_v

    def check_pass(state):
        """Count and mass above the pending candidate: kept, or rejected and the next candidate
        drawn from above it (kept at once when no threshold is unknown or it lies at or above s:
        an unknown threshold is <= s; unchecked otherwise)."""
        rnd, done, tok, cand, y_c, lo, _ = state

        def block(j, carry):
            cnt, mass = carry
            y, _, _ = load(j)
            if filters.top_k:
                cnt = cnt + jnp.where(y > y_c, 1.0, 0.0)
            return cnt, mass + jnp.where(y > y_c, weight(y), 0.0)

        zeros = jnp.zeros((block_v,), jnp.float32)
        cnt, mass = lax.fori_loop(0, num_blocks, block, (zeros, zeros))  # mass: the next support's
        ok = y_c >= t_hi
        ok &= ~k_unknown | (jnp.sum(cnt) < k.astype(jnp.float32))
        ok &= ~p_unknown | (jnp.sum(mass) < p * total)
        lo = jnp.maximum(lo, lax.nextafter(y_c, inf))  # y > y_c (the candidate lies at or above lo)
        nxt = lax.cond(ok, lambda: cand, lambda: cdf_draw(mass, lo, rnd))
        y_n = value(nxt)
        kept = ok | ~unknown | (y_n >= s)
        return rnd + 1, kept, jnp.where(kept, nxt, tok), nxt, y_n, lo, false

    def draw_pass(state, certain):
        """The weights of y >= max(lo, just above the rejected candidate), then a draw among
        them: the next candidate, kept at once when certain, when no threshold is unknown or
        when it lies at or above s; unchecked otherwise."""
        rnd, done, tok, cand, y_c, lo, _ = state
        lo = jnp.maximum(lo, lax.nextafter(y_c, inf))

        def block(j, lane_w):
            y, _, _ = load(j)
            return lane_w + jnp.where(y >= lo, weight(y), 0.0)

        spec = cdf_draw(lax.fori_loop(0, num_blocks, block, jnp.zeros((block_v,), jnp.float32)), lo, rnd)
        y_s = value(spec)
        ok = ~false if certain else ~unknown | (y_s >= s)
        return rnd + 1, ok, jnp.where(ok, spec, tok), spec, y_s, lo, false

    state = (jnp.int32(2), done, tok, c1, y1, t_hi, y1 < t_hi)
    state = lax.while_loop(
        lambda st: ~st[1] & ~search_only & (st[0] < max_rounds + 2),
        (lambda st: lax.cond(st[6], lambda: draw_pass(st, False), lambda: check_pass(st)))
        if filters.top_k or filters.top_p else (lambda st: draw_pass(st, False)), state)  # min-p: exact
    # Rows still undecided: exact thresholds; an unchecked candidate is kept when it lies in the
    # kept set (an exact rejection test), else one draw among the kept tokens.
    rnd, done, tok, cand, y_c, _, rejected = state
    t = exact_threshold(~done)
    keep = ~done & ~rejected & (y_c >= t)
    state = (rnd, done | keep, jnp.where(keep, cand, tok), cand, ninf, t, false)
    state = lax.while_loop(lambda st: ~st[1], lambda st: draw_pass(st, True), state)
    tok = state[2]
    thr_ref[b] = jnp.where(greedy, -jnp.inf, t_hi)
    tok_ref[b] = jnp.where(tok < vocab, tok, 0)  # no token drawable (invalid row): 0


def _race_kernel(rows_ref, x_ref, invt_ref, seed_ref, key_ref, col_ref, *, from_logits, vocab, block_v,
                 blocks_per_split, fast):
    # rows_ref [B] int32: the input row of each output row; x_ref [R, V] probs or logits;
    # invt_ref [B] f32; seed_ref [B, 2] int32; key_ref [B, S] f32 / col_ref [B, S] int32: the
    # largest race key among split s's columns and its lowest column (V: none)
    b, split = pl.program_id(0), pl.program_id(1)
    row = rows_ref[b]
    inv_t = invt_ref[b]
    greedy = inv_t == 0
    scale = jnp.where(greedy, 1.0, inv_t)
    stream0 = _stream(seed_ref[b, 0], seed_ref[b, 1], 0)
    lanes = jnp.arange(block_v, dtype=jnp.int32)

    def block(j, carry):
        best, idx = carry  # [block_v] f32, [block_v] int32
        cols = j * block_v + lanes
        x = plgpu.load(x_ref.at[row, cols], mask=cols < vocab, other=-jnp.inf).astype(jnp.float32)
        y = x * scale if from_logits else x
        r = jnp.where(greedy, y, race_keys(y, cols, stream0, logits=from_logits, fast=fast))
        upd = r > best  # ties keep the earlier block: the lowest column wins
        return jnp.where(upd, r, best), jnp.where(upd, cols, idx)

    first = split * blocks_per_split
    end = jnp.minimum(first + blocks_per_split, pl.cdiv(vocab, block_v))
    best, idx = lax.fori_loop(first, end, block, (jnp.full((block_v,), -jnp.inf, jnp.float32),
                                                  jnp.full((block_v,), vocab, jnp.int32)))
    _store_winner(key_ref, col_ref, b, split, best, idx, vocab)


@_common.compiled_once
def race_sample(x, rows, top_k, top_p, min_p, inv_temp, seeds, *, filters, interpret, config=SamplingConfig()):
    """filtered_sample for filters that filter nothing (top_k, top_p, min_p unread): one draw per
    output row from row rows[b] of x [R, V], in proportion to probabilities or to exp(logits x
    inv_temp) (inv_temp 0: the argmax, lowest index among ties). Each row's columns are split
    among config.splits programs: every column has its own race key (a hash of the row's seeds
    and the column), so the draw does not depend on the split. A row with nothing drawable gives
    0. Returns (tokens [B] int32, thresholds [B] f32: -inf, nothing filtered)."""
    del top_k, top_p, min_p
    from_logits = filters.from_logits
    batch, vocab = rows.shape[0], x.shape[1]
    block_v = min(config.block_v, _common.next_pow2(vocab))
    num_blocks = pl.cdiv(vocab, block_v)
    splits = max(1, min(config.splits or 1, num_blocks))
    blocks_per_split = pl.cdiv(num_blocks, splits)
    splits = pl.cdiv(num_blocks, blocks_per_split)
    kernel = functools.partial(_race_kernel, from_logits=from_logits, vocab=vocab, block_v=block_v,
                               blocks_per_split=blocks_per_split, fast=not interpret)
    keys, cols = pl.pallas_call(
        kernel,
        grid=(batch, splits),
        out_shape=(jax.ShapeDtypeStruct((batch, splits), jnp.float32),
                   jax.ShapeDtypeStruct((batch, splits), jnp.int32)),
        compiler_params=_common.compiler_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="jaxinfer_sampling_race",
    )(rows, x, inv_temp, seeds)
    top = jnp.max(keys, axis=1, keepdims=True)
    tok = jnp.min(jnp.where(keys == top, cols, vocab), axis=1)  # the lowest column among ties
    return jnp.where(tok < vocab, tok, 0), jnp.full((batch,), -jnp.inf, jnp.float32)


def lane_splits(config, vocab):
    """Programs per row of a filtered draw's pass 1: config.splits rounded down to a power of two,
    each program at least SPLIT_LANES of the block_v lanes (1: pass 1 in the row's program)."""
    block_v = min(config.block_v, _common.next_pow2(vocab))
    most = max(1, block_v // SPLIT_LANES)
    return min(1 << (max(1, config.splits or 1).bit_length() - 1), most)


@_common.compiled_once
def filtered_sample(x, rows, top_k, top_p, min_p, inv_temp, seeds, *, filters, interpret,
                    config=SamplingConfig()):
    """Per output row b, one draw from row rows[b] of x (filters.sample) or its threshold.

    x [R, V] f32/bf16 (probabilities, or logits when filters.from_logits); rows [B] int32;
    top_k [B] int32; top_p, min_p, inv_temp [B] f32 (inv_temp 0: greedy); seeds [B, 2] int32.
    Returns (tokens [B] int32, thresholds [B] f32: the row keeps tokens with y >= threshold,
    y = x * inv_temp for logits; -inf when nothing is filtered; when sampling, a lower bound).
    With lane_splits(config, V) > 1, pass 1 runs first, split among that many programs per row
    (the same values, so the same draws)."""
    batch = rows.shape[0]
    vocab = x.shape[1]
    block_v = min(config.block_v, _common.next_pow2(vocab))
    splits = lane_splits(config, vocab)
    state = ()
    if splits > 1:
        lanes = block_v // splits
        track = config.track
        state = pl.pallas_call(
            functools.partial(_pass1_kernel, filters=filters, vocab=vocab, block_v=block_v, lanes=lanes,
                              track=track, fast=not interpret),
            grid=(batch, splits),
            out_shape=(jax.ShapeDtypeStruct((batch, track, block_v), jnp.float32),
                       jax.ShapeDtypeStruct((batch, track, block_v), jnp.int32),
                       jax.ShapeDtypeStruct((batch, block_v), jnp.float32),
                       jax.ShapeDtypeStruct((batch, splits), jnp.float32),
                       jax.ShapeDtypeStruct((batch, splits), jnp.float32),
                       jax.ShapeDtypeStruct((batch, splits), jnp.int32)),
            compiler_params=_common.compiler_params(max(1, min(config.num_warps, lanes // WARP_LANES)),
                                                    config.split_stages),
            interpret=interpret,
            name="jaxinfer_sampling_pass1",
        )(rows, x, inv_temp, seeds)
    kernel = functools.partial(_kernel, filters=filters, vocab=vocab, block_v=block_v, track=config.track,
                               max_rounds=config.max_rounds, band=config.band, fast=not interpret,
                               split=splits > 1)
    tokens, thresholds, _ = pl.pallas_call(
        kernel,
        grid=(batch,),
        out_shape=(jax.ShapeDtypeStruct((batch,), jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.float32),
                   jax.ShapeDtypeStruct((batch, config.band + 1), jnp.float32)),
        compiler_params=_common.compiler_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="jaxinfer_sampling",
    )(rows, x, top_k, top_p, min_p, inv_temp, seeds, *state)
    return tokens, thresholds
