"""Attention variants and fp8 KV, in interpret mode: against the reference applying the same
hooks, and the built-ins against independent float64 NumPy formulas."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from helpers import np64_attention, page_table, randn, random_cache, rel_err
from jaxinfer import reference as ref
from jaxinfer import variants as V

HQ, HKV, D, PAGE = 8, 2, 64, 16
TOL32 = 2e-5


def _builtin(name, hq=HQ, rng=None):
    rng = rng or np.random.default_rng(0)
    table = {
        "soft_cap": (V.soft_cap(), {"logits_soft_cap": jnp.float32(1.0)}),
        "window": (V.sliding_window(), {"window_left": jnp.int32(13)}),
        "alibi": (V.alibi(), {"alibi_slopes": jnp.asarray(V.alibi_slopes(hq))}),
        "rope": (V.rope(), {"rope_theta": jnp.float32(1e4), "rope_scale": jnp.float32(2.0)}),
        "sigmoid": (V.sigmoid(), {"sigmoid_scale": jnp.float32(1.5), "sigmoid_bias": jnp.float32(-2.0)}),
        "sinks": (V.sinks(), {"sinks": jnp.asarray(rng.standard_normal(hq), jnp.float32)}),
        "rope+soft_cap+window": (V.compose(V.rope(), V.soft_cap(), V.sliding_window()),
                                 {"rope_theta": jnp.float32(1e4), "rope_scale": jnp.float32(1.0),
                                  "logits_soft_cap": jnp.float32(30.0), "window_left": jnp.int32(33)}),
        "rope+soft_cap+window+sinks": (V.compose(V.rope(), V.soft_cap(), V.sliding_window(), V.sinks()),
                                       {"rope_theta": jnp.float32(1e4), "rope_scale": jnp.float32(1.0),
                                        "logits_soft_cap": jnp.float32(30.0), "window_left": jnp.int32(33),
                                        "sinks": jnp.asarray(rng.standard_normal(hq), jnp.float32)}),
        "alibi+sigmoid": (V.compose(V.alibi(), V.sigmoid()),
                          {"alibi_slopes": jnp.asarray(V.alibi_slopes(hq)), "sigmoid_scale": jnp.float32(1.5),
                           "sigmoid_bias": jnp.float32(-2.0)}),
    }
    return table[name]


# Every built-in's kernel hooks run by default inside composed variants (RoPE's query and key
# transforms, soft cap, the window's mask and bounds, the sinks' output transform; ALiBi's per-head
# logits and sigmoid's sums); each built-in alone under slow.
COMPOSED = ("rope+soft_cap+window+sinks", "alibi+sigmoid")
NAMES = ("soft_cap", "window", "alibi", "rope", "sigmoid", "sinks", "rope+soft_cap+window") + COMPOSED


def _decode_case(rng, lens, hq=HQ, hkv=HKV, dtype=jnp.float32):
    indptr, indices, last, num_pages = page_table(rng, lens, PAGE)
    cache = random_cache(rng, num_pages, PAGE, hkv, D, dtype)
    q = randn(rng, (len(lens), hq, D), dtype)
    return q, cache, (indptr, indices, last), num_pages


@pytest.mark.parametrize("name", [n if n in COMPOSED else pytest.param(n, marks=pytest.mark.slow) for n in NAMES])
def test_decode_variant(rng, name):
    """KV split across cells (kv 300), an empty request (with sinks: o = 0, lse = the sink, no
    NaN). By default the two composed variants; each built-in alone under slow."""
    var, params = _builtin(name, rng=rng)
    q, cache, table, num_pages = _decode_case(rng, np.array([37, 0, 300, 5]))
    dec = ji.BatchDecodeWithPagedKVCache(HQ, HKV, D, PAGE, num_ctas=8, variant=var, config=ji.DecodeConfig(block_kv=32))
    plan = dec.plan(*table, num_pages=num_pages)
    # One run: o and lse for softmax variants (sigmoid has no lse, and its run returns o alone).
    out = dec.run(q, cache, plan, variant_params=params, return_lse=var.use_softmax)
    want = ref.decode(q, cache, *table, variant=var, params=params)
    assert rel_err(out.o if var.use_softmax else out, want.o) < TOL32
    if var.use_softmax:
        np.testing.assert_allclose(np.asarray(out.lse), np.asarray(want.lse), rtol=1e-4, atol=1e-4)
    if "sinks" in params:  # request 1 has no keys
        assert np.all(np.asarray(out.o[1]) == 0)
        np.testing.assert_allclose(np.asarray(out.lse[1]), np.asarray(params["sinks"]), rtol=1e-6)


# The prefill kernel's hooks for ALiBi, sigmoid and sinks run by default in the ragged wrapper's
# formula tests below (test_alibi_matches_formula, test_sigmoid_and_sinks_match_formula), sinks
# also through test_cascade_variant_positions's paged levels.
@pytest.mark.parametrize("name", [n if n == "rope+soft_cap+window" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in NAMES])
def test_prefill_variant(rng, name):
    """Paged, causal, with one request split across cells (kv 700). By default RoPE, soft cap and
    window composed; the rest under slow."""
    var, params = _builtin(name, rng=rng)
    lens, qo = np.array([54, 700, 1, 97]), np.array([17, 37, 1, 5])
    q_unused, cache, table, num_pages = _decode_case(rng, lens)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    q = randn(rng, (qo_indptr[-1], HQ, D), jnp.float32)
    pre = ji.BatchPrefillWithPagedKVCache(HQ, HKV, D, PAGE, num_ctas=8, variant=var, config=ji.PrefillConfig(block_kv=32))
    plan = pre.plan(qo_indptr, *table, num_pages=num_pages)
    assert plan.info["num_split_tiles"] > 0
    o = pre.run(q, cache, plan, variant_params=params)
    want = ref.paged_attention(q, cache, qo_indptr, *table, causal=True, variant=var, params=params)
    assert rel_err(o, want.o) < TOL32


@pytest.mark.parametrize("name", (  # ALiBi's positions also run in the Mosaic and paged variant tests
    pytest.param("alibi", marks=pytest.mark.slow), "window", pytest.param("rope", marks=pytest.mark.slow)))
def test_ragged_and_block_sparse_variant(rng, name):
    var, params = _builtin(name, rng=rng)
    qo_indptr = np.array([0, 20, 51], np.int32)
    kv_indptr = np.array([0, 40, 140], np.int32)
    q, k, v = (randn(rng, (n, h, D), jnp.float32) for n, h in ((51, HQ), (140, HKV), (140, HKV)))
    rag = ji.BatchPrefillWithRaggedKVCache(HQ, HKV, D, num_ctas=8, variant=var, config=ji.PrefillConfig(block_kv=32))
    o = rag.run(q, k, v, rag.plan(qo_indptr, kv_indptr), variant_params=params)
    want = ref.ragged_attention(q, k, v, qo_indptr, kv_indptr, causal=True, variant=var, params=params)
    assert rel_err(o, want.o) < TOL32
    # BSR: M = N = 64, blocks (4, 16), density ~0.5; positions are global rows / columns.
    m, (r, c) = 64, (4, 16)
    dense = rng.random((m // r, m // c)) < 0.5
    dense[:, 0] = True
    indptr = np.concatenate([[0], np.cumsum(dense.sum(1))]).astype(np.int32)
    bsr = ji.BlockSparseMatrix(indptr, np.nonzero(dense)[1].astype(np.int32), (r, c), (m, m))
    q, k, v = (randn(rng, (m, h, D), jnp.float32) for h in (HQ, HKV, HKV))
    bsa = ji.BlockSparseAttention(HQ, HKV, D, num_ctas=8, variant=var)
    o = bsa.run(q, k, v, bsa.plan(bsr), variant_params=params)
    want = ref.block_sparse_attention(q, k, v, bsr, variant=var, params=params)
    assert rel_err(o, want.o) < TOL32


def _cascade_case(rng):
    """Five requests sharing a 64-key prefix (four pages), unique suffixes of 17, 37, 5, 20, 1 keys."""
    shared, unique = 64, np.array([17, 37, 5, 20, 1])
    pre_pages = rng.permutation(200)[: shared // PAGE + unique.size * 3].astype(np.int32)
    lists = [np.concatenate([pre_pages[: shared // PAGE], pre_pages[shared // PAGE + 3 * b: shared // PAGE + 3 * b
                                                                      + -(-u // PAGE)]])
             for b, u in enumerate(unique)]
    indptr = np.concatenate([[0], np.cumsum([len(x) for x in lists])]).astype(np.int32)
    indices = np.concatenate(lists)
    last = ((unique - 1) % PAGE + 1).astype(np.int32)
    return random_cache(rng, 200, PAGE, HKV, D, jnp.float32), indptr, indices, last


def test_cascade_variant_positions(rng):
    """RoPE + window (+ soft cap, sinks) through a two-level cascade equal single format: the
    suffix level sees its keys at their positions after the shared prefix; sinks apply once,
    after the levels merge. The shared level runs the prefill kernel non-causal, the suffix
    level causal; decode through a non-causal cascade (the same kernel) under slow."""
    var, params = _builtin("rope+soft_cap+window+sinks", rng=rng)
    cache, indptr, indices, last = _cascade_case(rng)
    qo = np.array([1, 3, 1, 2, 1])
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    q = randn(rng, (qo_indptr[-1], HQ, D), jnp.float32)
    levels, saved = ji.two_level_cascade(qo_indptr, indptr, indices, last, PAGE)
    assert saved > 0
    cas = ji.MultiLevelCascadeAttention(2, HQ, HKV, D, PAGE, num_ctas=8, variant=var)
    o = cas.run(q, cache, cas.plan(levels, num_pages=200), variant_params=params)
    want = ref.paged_attention(q, cache, qo_indptr, indptr, indices, last, causal=True, variant=var,
                               params=params)
    assert rel_err(o, want.o) < TOL32


@pytest.mark.slow  # the non-causal prefill kernel with these hooks runs in the default test's shared level
def test_cascade_variant_positions_decode(rng):
    """Decode (one query per request, at position kv_len - 1) through a non-causal two-level
    cascade equals single format under RoPE + soft cap + window."""
    var, params = _builtin("rope+soft_cap+window", rng=rng)
    cache, indptr, indices, last = _cascade_case(rng)
    batch = indptr.shape[0] - 1
    qd = randn(rng, (batch, HQ, D), jnp.float32)
    levels, saved = ji.two_level_cascade(np.arange(batch + 1, dtype=np.int32), indptr, indices, last, PAGE,
                                         causal=False)
    assert saved > 0
    cas = ji.MultiLevelCascadeAttention(2, HQ, HKV, D, PAGE, causal=False, num_ctas=8, variant=var)
    want = ref.decode(qd, cache, indptr, indices, last, variant=var, params=params)
    got = cas.run(qd, cache, cas.plan(levels, num_pages=200), variant_params=params)
    assert rel_err(got, want.o) < TOL32


# Built-ins against independent float64 formulas (not the shared hooks).

def _np_logits(q, k, scale):
    return np.einsum("qhd,khd->hqk", np.asarray(q, np.float64), np.repeat(np.asarray(k, np.float64),
                                                                          q.shape[1] // k.shape[1], 1)) * scale


def _np_softmax_out(s, v, hq):
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, np.repeat(np.asarray(v, np.float64), hq // v.shape[1], 1))


# The cap is data (one path); 30 and 50 under slow.
@pytest.mark.parametrize("cap", (1.0, *(pytest.param(c, marks=pytest.mark.slow) for c in (30.0, 50.0))))
def test_soft_cap_matches_formula(rng, cap):
    q, k, v = randn(rng, (9, HQ, D), jnp.float32, 3.0), randn(rng, (40, HKV, D), jnp.float32), randn(rng, (40, HKV, D), jnp.float32)
    s = _np_logits(q, k, D ** -0.5)
    s = cap * np.tanh(s / cap)
    s = np.where(np.arange(40)[None, None, :] <= np.arange(9)[None, :, None] + 31, s, -np.inf)
    rag = ji.BatchPrefillWithRaggedKVCache(HQ, HKV, D, num_ctas=4, variant=V.soft_cap())
    o = rag.run(q, k, v, rag.plan(np.array([0, 9], np.int32), np.array([0, 40], np.int32)),
                variant_params={"logits_soft_cap": cap})
    assert rel_err(o, _np_softmax_out(s, v, HQ)) < 1e-5


@pytest.mark.parametrize("window", (pytest.param(3, marks=pytest.mark.slow), pytest.param(13, marks=pytest.mark.slow), 33))
def test_window_matches_custom_mask(rng, window):
    """Sliding window == the equivalent custom mask (kv up to 1177, tiles skipped). By default 33
    with the planner's window hint (tiles left of the window not planned; the kernel skipping
    them itself runs in test_prefill_variant's window of 33 over 700 keys); under slow 13 without
    the hint and 3 (hinted, a window inside one 16-key page)."""
    kv, qo = np.array([1177, 50]), np.array([40, 50])
    indptr, indices, last, num_pages = page_table(rng, kv, PAGE)
    cache = random_cache(rng, num_pages, PAGE, HKV, D, jnp.float32)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    q = randn(rng, (qo_indptr[-1], HQ, D), jnp.float32)
    pre = ji.BatchPrefillWithPagedKVCache(HQ, HKV, D, PAGE, num_ctas=8, variant=V.sliding_window())
    plan = pre.plan(qo_indptr, indptr, indices, last, num_pages=num_pages,
                    window_left=window if window != 13 else None)  # the planner's hint, or none
    o = pre.run(q, cache, plan, variant_params={"window_left": window})
    masks = []
    for a, b in zip(qo, kv):
        pos = b - a + np.arange(a)
        j = np.arange(b)
        masks.append(((j[None] <= pos[:, None]) & (j[None] >= pos[:, None] - window)).reshape(-1))
    plain = ji.BatchPrefillWithPagedKVCache(HQ, HKV, D, PAGE, num_ctas=8)
    want = plain.run(q, cache, plain.plan(qo_indptr, indptr, indices, last, num_pages=num_pages,
                                          custom_mask=np.concatenate(masks)))
    assert rel_err(o, want) < TOL32


# 7 heads (not a power of two, one KV head); 32 under slow (the slopes are data: both of
# alibi_slopes's branches are checked in test_alibi_slopes_standard).
@pytest.mark.parametrize("hq", (7, pytest.param(32, marks=pytest.mark.slow)))
def test_alibi_matches_formula(rng, hq):
    slopes = V.alibi_slopes(hq)
    assert slopes.shape == (hq,) and np.all(np.diff(slopes[: 1 << (hq.bit_length() - 1)]) < 0)
    q, k, v = randn(rng, (6, hq, D), jnp.float32), randn(rng, (30, 1, D), jnp.float32), randn(rng, (30, 1, D), jnp.float32)
    s = _np_logits(q, k, D ** -0.5)
    pos = 24 + np.arange(6)
    s = s + slopes[:, None, None] * (np.arange(30)[None, None, :] - pos[None, :, None])
    s = np.where(np.arange(30)[None, None, :] <= pos[None, :, None], s, -np.inf)
    rag = ji.BatchPrefillWithRaggedKVCache(hq, 1, D, num_ctas=4, variant=V.alibi())
    o = rag.run(q, k, v, rag.plan(np.array([0, 6], np.int32), np.array([0, 30], np.int32)),
                variant_params={"alibi_slopes": slopes})
    assert rel_err(o, _np_softmax_out(s, v, hq)) < 1e-5


def test_alibi_slopes_standard():
    np.testing.assert_allclose(V.alibi_slopes(8), 2.0 ** (-np.arange(1, 9)), rtol=1e-6)
    six = V.alibi_slopes(6)  # 4 from the power of two below, then every other one of 8
    np.testing.assert_allclose(six, np.concatenate([2.0 ** (-2.0 * np.arange(1, 5)),
                                                    2.0 ** (-np.array([1.0, 3.0]))]), rtol=1e-6)


def test_fused_rope_equals_rotate_first(rng):
    """Decode with fused RoPE == rotating q and k first (apply_rope), then float64 attention."""
    theta, scale = 5e5, 1.0
    lens = np.array([61, 130])
    q, cache, (indptr, indices, last), num_pages = _decode_case(rng, lens)
    k, v, tok = ref.gather_pages(cache, indptr, indices, last)
    dec = ji.BatchDecodeWithPagedKVCache(HQ, HKV, D, PAGE, num_ctas=8, variant=V.rope())
    o = dec.run(q, cache, dec.plan(indptr, indices, last, num_pages=num_pages),
                variant_params={"rope_theta": theta, "rope_scale": scale})
    rotate = jax.jit(lambda x, pos: V.apply_rope(x, pos, theta, scale))  # one program per shape, not per op
    k = rotate(k, np.concatenate([np.arange(n) for n in lens]))
    q = rotate(q, lens - 1)
    for b in range(2):
        o64, _ = np64_attention(q[b:b + 1], k[tok[b]:tok[b + 1]], v[tok[b]:tok[b + 1]])
        assert rel_err(o[b], o64[0]) < 1e-5


def test_rope_matches_numpy():
    x = np.random.default_rng(1).standard_normal((5, 2, 8)).astype(np.float32)
    pos = np.array([0, 1, 7, 100, 3000])
    got = np.asarray(V.apply_rope(jnp.asarray(x), pos, 1e4, 2.0), np.float64)
    inv = 1e4 ** (-np.arange(4) * 2 / 8.0)
    ang = (pos / 2.0)[:, None] * inv[None]  # [5, 4]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x[..., :4].astype(np.float64), x[..., 4:].astype(np.float64)
    want = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)  # float32 angles up to 1500 rad


def test_sigmoid_and_sinks_match_formula(rng):
    q, k, v = randn(rng, (4, HQ, D), jnp.float32), randn(rng, (25, HKV, D), jnp.float32), randn(rng, (25, HKV, D), jnp.float32)
    s = _np_logits(q, k, D ** -0.5)
    vis = np.arange(25)[None, None, :] <= 21 + np.arange(4)[None, :, None]
    vv = np.repeat(np.asarray(v, np.float64), HQ // HKV, 1)
    sig = np.where(vis, 1 / (1 + np.exp(-(s * 1.5 - 2.0))), 0.0)
    want_sig = np.einsum("hqk,khd->qhd", sig, vv)
    sinks = rng.standard_normal(HQ)
    e = np.where(vis, np.exp(s), 0.0)
    want_sink = np.einsum("hqk,khd->qhd", e, vv) / (e.sum(-1) + np.exp(sinks)[:, None]).T[..., None]
    qi, ki = np.array([0, 4], np.int32), np.array([0, 25], np.int32)
    for var, params, want in ((V.sigmoid(), {"sigmoid_scale": 1.5, "sigmoid_bias": -2.0}, want_sig),
                              (V.sinks(), {"sinks": sinks}, want_sink)):
        rag = ji.BatchPrefillWithRaggedKVCache(HQ, HKV, D, num_ctas=4, variant=var)
        assert rel_err(rag.run(q, k, v, rag.plan(qi, ki), variant_params=params), want) < 1e-5


@pytest.mark.slow  # test_decode_variant checks the same on its empty request (the composed variant with sinks)
def test_empty_rows_with_sinks(rng):
    """A request with no keys: o = 0, lse = sink (no NaN)."""
    var, params = _builtin("sinks", rng=rng)
    q, cache, table, num_pages = _decode_case(rng, np.array([0, 20]))
    dec = ji.BatchDecodeWithPagedKVCache(HQ, HKV, D, PAGE, num_ctas=4, variant=var)
    o, lse = dec.run(q, cache, dec.plan(*table, num_pages=num_pages), variant_params=params,
                     return_lse=True)
    assert np.all(np.asarray(o[0]) == 0)
    np.testing.assert_allclose(np.asarray(lse[0]), np.asarray(params["sinks"]), rtol=1e-6)


def test_params_are_data_no_recompile(rng):
    var, params = _builtin("rope+soft_cap+window", rng=rng)
    q, cache, table, num_pages = _decode_case(rng, np.array([40, 9]))
    dec = ji.BatchDecodeWithPagedKVCache(HQ, HKV, D, PAGE, num_ctas=4, variant=var)
    plan = dec.plan(*table, num_pages=num_pages)
    traces = []

    @jax.jit
    def step(q, cache, plan, params):
        traces.append(1)
        return dec.run(q, cache, plan, variant_params=params)

    outs = [step(q, cache, plan, dict(params, window_left=jnp.int32(w), logits_soft_cap=jnp.float32(c)))
            for w, c in ((3, 5.0), (33, 50.0))]
    assert len(traces) == 1
    assert rel_err(outs[0], outs[1]) > 1e-3  # the parameters did change the result


# Every dtype and scale kind once by default: e4m3fn per head on decode and prefill, e5m2 scalar on
# decode (fp8_pairs's widening per dtype is shared by both kernels, and checked on every byte value
# in test_fp8_pairs_split_columns_exactly); e5m2 prefill and the other pairings under slow.
@pytest.mark.parametrize("fp8, per_head, prefill", [
    (jnp.float8_e4m3fn, True, True), (jnp.float8_e5m2, False, False),
    pytest.param(jnp.float8_e5m2, False, True, marks=pytest.mark.slow),
    pytest.param(jnp.float8_e4m3fn, False, True, marks=pytest.mark.slow),
    pytest.param(jnp.float8_e5m2, True, True, marks=pytest.mark.slow)])
def test_fp8_kv(rng, fp8, per_head, prefill):
    """fp8 pages against float16 on the same dequantized values (atol 1e-2, rtol 2e-2: the
    reference over a float16 cache, so that each case compiles the fp8 kernels only), and
    prefill (where `prefill`) also against the reference's own dequantization."""
    lens, qo = np.array([37, 0, 300, 5]), np.array([3, 1, 40, 5])
    indptr, indices, last, num_pages = page_table(rng, lens, PAGE)
    c16 = random_cache(rng, num_pages, PAGE, HKV, D, jnp.float16)
    cache = ji.PagedKVCache(c16.k_pages.astype(fp8), c16.v_pages.astype(fp8))
    ks, vs = (jnp.asarray([0.5, 0.25]), jnp.asarray([2.0, 1.5])) if per_head else (0.5, 2.0)
    deq = [(p.astype(jnp.float32) * jnp.broadcast_to(jnp.asarray(s, jnp.float32), (HKV,))[:, None]).astype(jnp.float16)
           for p, s in ((cache.k_pages, ks), (cache.v_pages, vs))]
    c_deq = ji.PagedKVCache(*deq)
    q = randn(rng, (len(lens), HQ, D), jnp.float16)
    dec = ji.BatchDecodeWithPagedKVCache(HQ, HKV, D, PAGE, num_ctas=8, config=ji.DecodeConfig(block_kv=32))
    plan = dec.plan(indptr, indices, last, num_pages=num_pages)
    np.testing.assert_allclose(np.asarray(dec.run(q, cache, plan, k_scale=ks, v_scale=vs), np.float32),
                               np.asarray(ref.decode(q, c_deq, indptr, indices, last).o, np.float32),
                               atol=1e-2, rtol=2e-2)
    if not prefill:
        return
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    qp = randn(rng, (qo_indptr[-1], HQ, D), jnp.float16)
    pre = ji.BatchPrefillWithPagedKVCache(HQ, HKV, D, PAGE, num_ctas=8, config=ji.PrefillConfig(block_kv=32))
    pplan = pre.plan(qo_indptr, indptr, indices, last, num_pages=num_pages)
    got = pre.run(qp, cache, pplan, k_scale=ks, v_scale=vs)
    np.testing.assert_allclose(
        np.asarray(got, np.float32),
        np.asarray(ref.paged_attention(qp, c_deq, qo_indptr, indptr, indices, last, causal=True).o, np.float32),
        atol=1e-2, rtol=2e-2)
    want = ref.paged_attention(qp, cache, qo_indptr, indptr, indices, last, causal=True, k_scale=ks, v_scale=vs)
    assert rel_err(got, want.o) < 4e-3


@pytest.mark.parametrize("fp8", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_fp8_pairs_split_columns_exactly(fp8):
    """fp8 rows read as uint16 column pairs widen to exactly the even and odd columns, for all
    256 byte values (NaN included)."""
    from pallas_kernels import _common
    rows = jax.lax.bitcast_convert_type(jnp.arange(512, dtype=jnp.int32).astype(jnp.uint8), fp8).reshape(4, 128)
    even, odd = _common.widen_fp8_pairs(_common.fp8_pairs(rows), fp8)
    wide = np.asarray(rows.astype(jnp.float16))
    np.testing.assert_array_equal(np.asarray(even), wide[:, 0::2])
    np.testing.assert_array_equal(np.asarray(odd), wide[:, 1::2])


@pytest.mark.slow  # fp8 pair and plain reads take the branches of test_fp8_kv and test_fp8_pairs_split_columns_exactly
def test_fp8_pairs_and_plain_fp8_reads_agree(rng):
    """Decode and prefill read fp8 K/V either as column pairs or as bytes (fp8_pairs): the same
    attention up to summation order."""
    lens, qo = np.array([37, 300]), np.array([3, 40])
    indptr, indices, last, num_pages = page_table(rng, lens, PAGE)
    c16 = random_cache(rng, num_pages, PAGE, HKV, D, jnp.float16)
    cache = ji.PagedKVCache(c16.k_pages.astype(jnp.float8_e4m3fn), c16.v_pages.astype(jnp.float8_e4m3fn))
    q = randn(rng, (len(lens), HQ, D), jnp.float16)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    qp = randn(rng, (qo_indptr[-1], HQ, D), jnp.float16)
    outs = []
    for pairs in (True, False):
        dec = ji.BatchDecodeWithPagedKVCache(HQ, HKV, D, PAGE, num_ctas=8, config=ji.DecodeConfig(block_kv=32, fp8_pairs=pairs))
        pre = ji.BatchPrefillWithPagedKVCache(HQ, HKV, D, PAGE, num_ctas=8, config=ji.PrefillConfig(block_kv=32, fp8_pairs=pairs))
        outs.append((dec.run(q, cache, dec.plan(indptr, indices, last, num_pages=num_pages), k_scale=0.5, v_scale=2.0),
                     pre.run(qp, cache, pre.plan(qo_indptr, indptr, indices, last, num_pages=num_pages), k_scale=0.5, v_scale=2.0)))
    for a, b in zip(*outs):
        assert rel_err(a, b) < 1e-3


def test_bad_variant_inputs(rng):
    q, cache, table, num_pages = _decode_case(rng, np.array([10]))
    dec = ji.BatchDecodeWithPagedKVCache(HQ, HKV, D, PAGE, num_ctas=4, variant=V.alibi())
    plan = dec.plan(*table, num_pages=num_pages)
    with pytest.raises(ValueError, match="alibi_slopes"):
        dec.run(q, cache, plan, variant_params={})
    sig = ji.BatchDecodeWithPagedKVCache(HQ, HKV, D, PAGE, num_ctas=4, variant=V.sigmoid())
    with pytest.raises(ValueError, match="return_lse"):
        sig.run(q, cache, plan, variant_params=V.default_params(V.sigmoid(), HQ), return_lse=True)
    with pytest.raises(ValueError, match="variant"):
        ji.BatchDecodeWithPagedKVCache(HQ, HKV, D, PAGE, variant=lambda s: s)
    plain = ji.BatchDecodeWithPagedKVCache(HQ, HKV, D, PAGE, num_ctas=4)
    c8 = ji.PagedKVCache(cache.k_pages.astype(jnp.float8_e4m3fn), cache.v_pages.astype(jnp.float8_e4m3fn))
    with pytest.raises(ValueError, match="k_scale"):
        plain.run(q.astype(jnp.bfloat16), c8, plan, k_scale=jnp.ones(3))
    with pytest.raises(ValueError, match="kv_cache dtype"):
        plain.run(q, c8, plan)  # fp8 needs a float16 / bfloat16 q


def test_variant_is_static_and_hashable():
    a = V.compose(V.rope(), V.soft_cap())
    b = V.compose(V.rope(), V.soft_cap())
    assert a == b and hash(a) == hash(b)
    assert V.soft_cap() != V.alibi()
