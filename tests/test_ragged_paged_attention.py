"""ragged_paged_attention (device-planned, fused KV write) in interpret mode, against
jaxinfer.reference over a cache written by a NumPy scatter, and float64 NumPy for one case."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from helpers import TOL, fused, np64_attention, poison_pages, randn, rel_err, zero_written_tails
from jaxinfer import ragged, ragged_plan
from planner import batch as batch_planner
from planner.work_items import MIXED
from jaxinfer import reference as ref
from jaxinfer import variants

HQ, HKV, D = 4, 2, 32
NUM_CTAS = 8  # 4 cells: small interpret-mode grids, and long blocks split
GARBAGE = 1 << 20  # page_indices entries no valid sequence uses: never read


def _step(rng, q_lens, cached, *, page, dist, seq_cap, tok_cap, pages_per_seq, num_pages=None, layout="NHD",
          poison=True, heads=(HQ, HKV, D), dtype=jnp.float32):
    """A random step: valid sequences q_lens / cached (kv_len = cached + q_len), padded to
    seq_cap sequences and tok_cap tokens, over num_pages pages (default: 4 more than needed);
    heads (Hq, Hkv, D); layout NHD, HND or NHD_FUSED (want_cache then NHD). Returns (args,
    want_cache, csr table)."""
    hq, hkv, d = heads
    q_lens, kv = np.asarray(q_lens), np.asarray(cached) + np.asarray(q_lens)
    n = len(q_lens)
    npages = -(-kv // page)
    num_pages = num_pages or int(npages.sum()) + 4
    perm = rng.permutation(num_pages).astype(np.int32)
    page_indices = np.full(seq_cap * pages_per_seq, GARBAGE, np.int32)
    first = np.concatenate([[0], np.cumsum(npages)])
    for i in range(n):
        page_indices[i * pages_per_seq: i * pages_per_seq + npages[i]] = perm[first[i]:first[i + 1]]
    nhd = layout != "HND"
    shape = (num_pages, page, hkv, d) if nhd else (num_pages, hkv, page, d)
    k_pages, v_pages = (np.array(randn(rng, shape, dtype)) for _ in "kv")  # host arrays: no device op compiles
    if poison:  # pages no valid sequence lists hold NaN: any read of them shows
        unlisted = perm[first[-1]:]
        k_pages[unlisted], v_pages[unlisted] = np.nan, np.nan
    cu = np.full(seq_cap + 1, np.sum(q_lens), np.int32)
    cu[: n + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    kv_lens = np.zeros(seq_cap, np.int32)
    kv_lens[:n] = kv
    q, k, v = (np.array(randn(rng, (tok_cap, h, d), dtype)) for h in (hq, hkv, hkv))

    want_k, want_v = np.array(k_pages), np.array(v_pages)  # the NumPy scatter of the new rows (dtype kept)
    for i in range(n):
        for j in range(q_lens[i]):
            pos = kv[i] - q_lens[i] + j
            pg, slot = page_indices[i * pages_per_seq + pos // page], pos % page
            idx = (pg, slot) if nhd else (pg, slice(None), slot)
            want_k[idx], want_v[idx] = k[cu[i] + j], v[cu[i] + j]
    base_layout = "NHD" if nhd else "HND"
    kv_indptr = first.astype(np.int32)
    table = (cu[: n + 1], kv_indptr, perm[: first[-1]], (kv - (npages - 1) * page).astype(np.int32))
    want = ji.PagedKVCache(jnp.asarray(want_k), jnp.asarray(zero_written_tails(want_v, base_layout, *table)),
                           base_layout)
    cache = ji.PagedKVCache(jnp.asarray(k_pages), jnp.asarray(v_pages), base_layout)
    args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), fused(cache) if layout == "NHD_FUSED" else cache,
            jnp.asarray(kv_lens), jnp.asarray(page_indices), jnp.asarray(cu), jnp.asarray(dist, jnp.int32))
    return args, want, table


def _reference(q, cache, table, **kw):
    """ref.paged_attention, jitted around the host table (one XLA compile, not one per op)."""
    fn = jax.jit(lambda q, c: ref.paged_attention(q, c, *table, **kw).o)
    return fn(q, cache)


def _check(args, want_cache, table, out, new_cache, causal=True, tol=TOL[jnp.float32], **variant_kw):
    q, nnz, out = np.asarray(args[0]), int(table[0][-1]), np.asarray(out)  # (host slices: no device op compiles)
    for got, want in ((new_cache.k_pages, want_cache.k_pages), (new_cache.v_pages, want_cache.v_pages)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))  # NaN == NaN
    want = _reference(jnp.asarray(q[:nnz]), want_cache, table, causal=causal, **variant_kw)
    assert rel_err(out[:nnz], want) < tol
    np.testing.assert_array_equal(out[nnz:], 0.0)  # padding rows: finite (zero)


@functools.partial(jax.jit, static_argnames=("pages_per_seq", "classes", "causal", "num_rows"))
def _plan_each(kv_lens, cu, dist, *, pages_per_seq, classes, causal, num_rows):
    """ragged_plan.plan_classes of each class alone (its sections), in one program."""
    return [ragged_plan.plan_classes(kv_lens, cu, dist, pages_per_seq=pages_per_seq, classes=(cls,), causal=causal,
                                     window_left=None, num_rows=num_rows)[0] for cls in classes]


def _plan_stats(args, causal=True):
    """Per class of the device plan of this step: (q_len range, kernel, live blocks, whether some
    block's KV splits into several chunks)."""
    q, _, _, cache, kv_lens, page_indices, cu, dist = args
    stats = []
    classes = ragged_plan.classes(q.shape[0], kv_lens.shape[0], NUM_CTAS // HKV, HQ // HKV)
    secs = _plan_each(kv_lens, cu, dist, pages_per_seq=page_indices.shape[0] // kv_lens.shape[0],
                      classes=tuple(classes), causal=causal, num_rows=q.shape[0])
    for cls, sec in zip(classes, secs):
        items = np.asarray(sec["items"])[: int(sec["cell_indptr"][-1])]
        # a block's first query row, its number of KV chunks
        first, n_chunks = (items[:, 0] + items[:, 1], items[:, 8]) if cls.prefill else (items[:, 6], items[:, 5])
        stats.append(((cls.min_q, cls.max_q), "prefill" if cls.prefill else "decode", len(set(first)),
                      bool(np.any(n_chunks > 1))))
    return sorted(stats)


# Decode rows first (q_len 1), then 0, 4, 37, 12 and others; one long decode splits its KV.
# Group 2: q_len <= 8 on 16-row decode tiles, 9..16 on 32-row decode tiles, longer on prefill tiles.
QO = [1, 1, 0, 4, 37, 12, 3]
CACHED = [700, 8, 5, 60, 20, 0, 129]


# Default: page 8, causal. Page 16 non-causal (the same classes and splits) under slow: a non-causal
# step with every class runs in test_boundary.test_ragged_paged_attention_boundaries (its group-6 row,
# page 8, NHD), page 16 in the SMALL steps below.
# Under slow: every class, the cache write and padding rows run in test_boundary's ragged_paged_attention rows
# (groups 1 and 6, every boundary length alone and in a mixed step), the decode-only and prefill-only
# steps below.
@pytest.mark.slow
@pytest.mark.parametrize("page, causal", [(8, True), (16, False)])
def test_mixed_step_matches_reference(rng, page, causal):
    args, want_cache, table = _step(rng, QO, CACHED, page=page, dist=(2, 2, 7), seq_cap=9, tok_cap=64,
                                    pages_per_seq=-(-760 // page))
    # 16-row tiles: 1, 1, 4, 3 (the 700-key decode splits); 32-row tiles: 12; prefill: 37 in one 64-token tile
    assert _plan_stats(args, causal) == [((1, 8), "decode", 4, True), ((9, 16), "decode", 1, False),
                                         ((17, 64), "prefill", 1, False)]
    out, new_cache = ji.ragged_paged_attention(*args, causal=causal, num_ctas=NUM_CTAS)
    _check(args, want_cache, table, out, new_cache, causal=causal)


def _poisoned_tails(args, want_cache, table):
    """The step with NaN also in each sequence's last-page slots past its kv_len (in the input, and
    in the expected cache's K and, of sequences with no query rows, V)."""
    kv_indptr, indices, last = table[1:]
    want = poison_pages(want_cache, kv_indptr, indices, last)
    want = ji.PagedKVCache(want.k_pages, jnp.asarray(zero_written_tails(np.array(want.v_pages), want.layout, *table)),
                           want.layout)
    return args[:3] + (poison_pages(args[3], kv_indptr, indices, last),) + args[4:], want, table


@pytest.mark.slow  # the default suite runs the fused cache through the RPA v3 entry point in place (test_compat_tpu_inference)
def test_fused_layout_matches_nhd_and_reference(rng):
    """The NHD_FUSED cache (K and V in one array, read and written in place, donated) against the
    same step on NHD pages, bit for bit, and the reference; NaN in unlisted pages and past each kv_len."""
    step = jax.jit(functools.partial(ji.ragged_paged_attention, num_ctas=NUM_CTAS), donate_argnums=(3,))
    outs = []
    for layout in ("NHD", "NHD_FUSED"):
        args, want_cache, table = _poisoned_tails(*_step(
            np.random.default_rng(7), QO, CACHED, page=8, dist=(2, 2, 7), seq_cap=9, tok_cap=64, pages_per_seq=95,
            layout=layout))
        out, new_cache = step(*args)
        assert new_cache.layout == layout
        _check(args, want_cache, table, out, new_cache)
        outs.append(out)
    np.testing.assert_array_equal(outs[1], outs[0])


def _np64_window_cap(q, k, v, *, window, cap, sm_scale):
    """float64 NumPy causal attention of one sequence (q [qo, Hq, D], k/v [kv, Hkv, D]) with RPA's
    window (the query at position p sees keys p - W < k <= p) and soft cap c * tanh(s / c)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    qo, kv, g = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    s = np.einsum("qhd,khd->hqk", q, np.repeat(k, g, axis=1)) * sm_scale
    s = cap * np.tanh(s / cap)
    pos, key = kv - qo + np.arange(qo)[:, None], np.arange(kv)[None, :]
    s = np.where((key <= pos) & (key > pos - window), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), np.repeat(v, g, axis=1))


def test_sliding_window_and_soft_cap_hnd(rng):
    """The mixed step with both options, page size 1, HND pages: against the reference, and
    float64 NumPy for RPA's window convention (the 700-key decode row skips the chunks left of
    its window)."""
    window, cap, sm_scale = 5, 2.5, 0.3
    args, want_cache, table = _step(rng, QO, CACHED, page=1, dist=(2, 2, 7), seq_cap=8, tok_cap=60,
                                    pages_per_seq=760, layout="HND")
    out, new_cache = ji.ragged_paged_attention(*args, sliding_window=window, soft_cap=cap, sm_scale=sm_scale,
                                               num_ctas=NUM_CTAS)
    variant = variants.compose(variants.sliding_window(), variants.soft_cap())
    params = {"window_left": jnp.int32(window - 1), "logits_soft_cap": jnp.float32(cap)}
    _check(args, want_cache, table, out, new_cache, variant=variant, params=params, sm_scale=sm_scale)
    k, v, tok = ref.gather_pages(want_cache, *table[1:])
    cu = table[0]
    for i in range(len(QO)):
        if QO[i]:
            o = _np64_window_cap(args[0][cu[i]:cu[i + 1]], k[tok[i]:tok[i + 1]], v[tok[i]:tok[i + 1]],
                                 window=window, cap=cap, sm_scale=sm_scale)
            assert rel_err(out[cu[i]:cu[i + 1]], o) < TOL[jnp.float32]


# Decode-only, prefill-only and other steps of one shape (one compilation).
SMALL = dict(page=16, seq_cap=7, tok_cap=64, pages_per_seq=16, num_pages=48)


@pytest.mark.slow  # the same program as the boundary rows and test_decode_only_and_prefill_only
def test_float64_numpy(rng):
    args, want_cache, table = _step(rng, [1, 5, 19], [40, 3, 30], dist=(1, 1, 3), **SMALL)
    out, _ = ji.ragged_paged_attention(*args, num_ctas=NUM_CTAS)
    k, v, tok = ref.gather_pages(want_cache, *table[1:])
    cu = table[0]
    for i in range(3):
        o, _ = np64_attention(args[0][cu[i]:cu[i + 1]], k[tok[i]:tok[i + 1]], v[tok[i]:tok[i + 1]], causal=True)
        assert rel_err(out[cu[i]:cu[i + 1]], o) < TOL[jnp.float32]


def test_decode_only_and_prefill_only(rng):
    """Steps with empty classes, through one program: decode only (the base prefill class and the
    32-row class empty), then chunks and prompts only (the 16-row class empty)."""
    for q_lens, cached, dist, blocks in (([1] * 6, [33, 1, 0, 17, 90, 8], (6, 6, 6), [6, 0, 0]),
                                         ([20, 12, 30], [0, 15, 40], (0, 3, 3), [0, 1, 2])):
        args, want_cache, table = _step(rng, q_lens, cached, dist=dist, **SMALL)
        assert [n for _, _, n, _ in _plan_stats(args)] == blocks
        out, new_cache = ji.ragged_paged_attention(*args, num_ctas=NUM_CTAS)
        _check(args, want_cache, table, out, new_cache)


# Decode-only, prefill-only and mixed compositions of SMALL's shapes.
COMPOSITIONS = (([1] * 5, [33, 0, 17, 90, 8], (5, 5, 5)), ([20, 12, 30], [0, 15, 40], (0, 3, 3)),
                ([1, 1, 4, 0, 19, 12], [60, 3, 9, 5, 30, 0], (2, 2, 6)))


# Default: sinks with a window, causal (one program, three compositions). The non-causal step runs in
# test_boundary's group-6 ragged_paged_attention row; sinks non-causal and without a window here under slow.
# Under slow: sinks with a window run by default through the RPA v3 hd64 entry point
# (test_compat_tpu_inference.test_rpa_v3_hd64_grid, sliding_window_sink) and on the Mosaic class
# (test_mosaic_class_holds_the_sinks).
@pytest.mark.slow
@pytest.mark.parametrize("causal, window", [(True, 6), (False, None), (True, None)])
def test_sinks_match_reference(rng, causal, window):
    """Attention sinks, traced: decode-only, prefill-only and mixed steps through one compilation,
    against the reference's sinks variant (sinks about the rows' lse, so that they matter)."""
    fn = jax.jit(lambda *a: ji.ragged_paged_attention(*a[:8], sinks=a[8], causal=causal, sliding_window=window,
                                                      num_ctas=NUM_CTAS))
    variant = variants.compose(*([variants.sliding_window()] if window else []), variants.sinks())
    for q_lens, cached, dist in COMPOSITIONS:
        args, want_cache, table = _step(rng, q_lens, cached, dist=dist, **SMALL)
        sinks = jnp.asarray(rng.normal(2.0, 2.0, HQ).astype(np.float32))
        out, new_cache = fn(*args, sinks)
        params = {"sinks": sinks} | ({"window_left": jnp.int32(window - 1)} if window else {})
        _check(args, want_cache, table, out, new_cache, causal=causal, variant=variant, params=params)
    assert fn._cache_size() == 1


@pytest.mark.parametrize("n", [1, 7, ragged_plan.DENSE_PREFIX_MAX, ragged_plan.DENSE_PREFIX_MAX + 3])
def test_device_plan_prefix_sums(rng, n):
    """The device plan's prefix sums (one masked row sum up to DENSE_PREFIX_MAX, XLA's scan past
    it) equal NumPy's, on int32 counts and float32 costs."""
    counts = rng.integers(0, 1000, n).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(ragged_plan.cumsum(jnp.asarray(counts))), np.cumsum(counts))
    np.testing.assert_array_equal(np.asarray(ragged_plan.excl_cumsum(jnp.asarray(counts))), np.cumsum(counts) - counts)
    costs = counts.astype(np.float32)  # integers well under 2^24: exact in float32 either way
    np.testing.assert_array_equal(np.asarray(ragged_plan.cumsum(jnp.asarray(costs))), np.cumsum(costs))


@pytest.mark.parametrize("group", [1, 2, 4, 8, 16, 64])
def test_classes_cover_every_q_len(group):
    """The static classes partition q_len 1..T: decode tiles of 16 rows, then 32 and 64, then the
    prefill kernel's (tiles of 128 rows or one token's group: the base), the last zeroes padding."""
    t = 300
    classes = ragged_plan.classes(t, 40, 4, group)
    assert classes[0].base and classes[-1].pad and sum(c.base for c in classes) == sum(c.pad for c in classes) == 1
    spans = sorted((c.min_q, c.max_q) for c in classes)
    assert spans[0][0] == 1 and spans[-1][1] == t and all(a[1] + 1 == b[0] for a, b in zip(spans, spans[1:]))
    decode = sorted((c for c in classes if not c.prefill), key=lambda c: c.min_q)
    rows = [max(16, c.tokens_per_item * group) for c in decode]  # q_len <= 16 // group on 16-row tiles
    assert rows[0] == max(16, group) and max(rows) <= max(64, group) and rows == sorted(set(rows))
    assert decode[0].tokens_per_item == max(1, 16 // group)
    # one class per tile height that holds more tokens than the one before (a tile's dots cost its rows)
    assert rows == {1: [16], 2: [16, 32], 4: [16, 32, 64], 8: [16, 32, 64], 16: [16, 32, 64], 64: [64]}[group]
    prefill = classes[0]
    assert prefill.prefill and prefill.rows == max(128, group) and prefill.tokens_per_item == prefill.rows // group
    assert [c.min_q for c in ragged_plan.classes(8, 40, 4, group)] == [c.min_q for c in classes if c.min_q <= 8]


def test_jit_donated_one_compilation(rng):
    """Two compositions of the same shapes: one trace, the cache updated in place. 16 tokens: no
    prefill class, so the 32-row decode class is the base (writes its rows, zeroes the padding).
    Then a third step through the same program: under jit the metadata are not checked, and a
    kv_len past its sequence's pages is clipped to them, so the step reads and writes only that
    sequence's row of page_indices (and the cache): every other sequence's output and pages are as
    in the valid step. (Interpret mode clamps out-of-bounds loads by itself, so on the CPU this
    checks the isolation, not the bound.)"""
    traces = []

    def step(q, k, v, cache, kv_lens, page_indices, cu, dist):
        traces.append(1)
        return ji.ragged_paged_attention(q, k, v, cache, kv_lens, page_indices, cu, dist, num_ctas=NUM_CTAS)

    fn = jax.jit(step, donate_argnums=(3,))
    shapes = dict(SMALL, tok_cap=16)
    assert [c.prefill for c in ragged_plan.classes(16, 7, NUM_CTAS // HKV, HQ // HKV)] == [False, False]
    for q_lens, cached, dist in (([1, 1, 6], [30, 4, 9], (2, 2, 3)), ([12, 1], [3, 50], (0, 2, 2))):
        args, want_cache, table = _step(rng, q_lens, cached, dist=dist, **shapes)
        k_before = args[3].k_pages
        out, new_cache = fn(*args)
        assert k_before.is_deleted()  # donated
        _check(args, want_cache, table, out, new_cache)

    # sequence 1's kv_len past its pages (pages_per_seq x page keys)
    args, want_cache, table = _step(rng, [1, 3, 5], [40, 9, 20], dist=(1, 1, 3), **shapes)
    q, k, v, cache, kv_lens, pi, cu, dist = args
    pps, num_pages = shapes["pages_per_seq"], cache.num_pages
    past = np.array(kv_lens)
    past[1] = pps * shapes["page"] + 50
    out, new_cache = fn(q, k, v, cache, jnp.asarray(past), pi, cu, dist)
    out, want = np.asarray(out), _reference(jnp.asarray(np.asarray(q)[:9]), want_cache, table, causal=True)
    for rows in (slice(0, 1), slice(4, 9)):  # sequences 0 and 2
        assert rel_err(out[rows], want[rows]) < TOL[jnp.float32]
    np.testing.assert_array_equal(out[9:], 0.0)
    others = np.concatenate([np.asarray(pi[:pps]), np.asarray(pi[2 * pps:])])
    others = others[others < num_pages]
    for got, w in ((new_cache.k_pages, want_cache.k_pages), (new_cache.v_pages, want_cache.v_pages)):
        np.testing.assert_array_equal(np.asarray(got)[others], np.asarray(w)[others])
    assert len(traces) == 1


def test_bad_inputs_raise(rng):
    args, _, _ = _step(rng, [1, 3], [5, 2], page=8, dist=(1, 1, 2), seq_cap=2, tok_cap=4, pages_per_seq=2)
    q, k, v, cache, kv_lens, pi, cu, dist = args
    with pytest.raises(ValueError, match="keys"):
        ji.ragged_paged_attention(q, k[:3], v, cache, kv_lens, pi, cu, dist)
    for bad in ([2, 1, 2], [0, 0, 3], [-1, 0, 2], [0, 3, 2]):  # d[0] > d[1], d[2] > S = 2, negative, d[1] > d[2]
        with pytest.raises(ValueError, match="distribution"):
            ji.ragged_paged_attention(q, k, v, cache, kv_lens, pi, cu, jnp.asarray(bad, jnp.int32))
    with pytest.raises(ValueError, match="kv_lens"):  # shorter than its q_len 3
        ji.ragged_paged_attention(q, k, v, cache, kv_lens.at[1].set(2), pi, cu, dist)
    with pytest.raises(ValueError, match="kv_lens"):
        ji.ragged_paged_attention(q, k, v, cache, kv_lens.astype(jnp.int64 if jax.config.x64_enabled else jnp.int16),
                                  pi, cu, dist)
    with pytest.raises(ValueError, match="page_indices"):
        ji.ragged_paged_attention(q, k, v, cache, kv_lens, pi.at[0].set(cache.num_pages), cu, dist)
    with pytest.raises(ValueError, match="sliding_window"):
        ji.ragged_paged_attention(q, k, v, cache, kv_lens, pi, cu, dist, causal=False, sliding_window=4)
    for cap in (0.0, -50.0):
        with pytest.raises(ValueError, match="soft_cap"):
            ji.ragged_paged_attention(q, k, v, cache, kv_lens, pi, cu, dist, soft_cap=cap)
    for sinks in (jnp.zeros((HQ + 1,), jnp.float32), jnp.zeros((HQ,), jnp.int32)):
        with pytest.raises(ValueError, match="sinks"):
            ji.ragged_paged_attention(q, k, v, cache, kv_lens, pi, cu, dist, sinks=sinks)
    for read in (kv_lens[:1], kv_lens + 1, kv_lens - 10, kv_lens.astype(jnp.float32)):  # shape, range, dtype
        with pytest.raises(ValueError, match="read_kv_lens"):
            ji.ragged_paged_attention(q, k, v, cache, kv_lens, pi, cu, dist, read_kv_lens=read)
    with pytest.raises(ValueError, match="keys and values"):
        ji.ragged_paged_attention(q, k, None, cache, kv_lens, pi, cu, dist)


# The Mosaic class (long sequences on the Mosaic GPU kernel, forced with impl="mosaic": its
# interpreter here, slow, so the shapes are tiny). Group 2: q_len <= 8 on 16-row decode tiles,
# 9..16 on 32-row decode tiles, longer on 128-token Mosaic tiles. The 70- and 140-token
# sequences start at unaligned rows; 140 crosses a tile boundary, its second tile holds 12 rows.
MOSAIC_QO = [1, 1, 0, 4, 12, 70, 140]
MOSAIC_CACHED = [300, 8, 5, 60, 20, 100, 10]


def _mosaic_step(rng, q_lens, cached, dist, heads=(2, 1, 64), **kw):
    kw = dict(dict(page=8, seq_cap=8, tok_cap=256, pages_per_seq=40, num_pages=100), **kw)
    return _step(rng, q_lens, cached, dist=dist, heads=heads, dtype=jnp.bfloat16, **kw)


@pytest.mark.slow  # the Mosaic class's program runs by default in test_mosaic_class_holds_the_sinks
def test_mosaic_class_matches_reference(rng):
    """A step with the Mosaic class as the base (group 1: q_len > 16), one query head (the
    interpreter runs each tile for seconds): two sequences at unaligned rows, their tiles in
    one cell (the kernel's item loop), each tile's 20-21 rows stored 8 at a time; unlisted pages
    NaN, the written cache exact, padding rows zero. (Tiles crossing 128 tokens: the slow test.)"""
    args, want_cache, table = _mosaic_step(rng, [1, 0, 4, 20, 21], [300, 5, 60, 30, 50], (1, 1, 5), heads=(1, 1, 64),
                                           tok_cap=56, seq_cap=6, num_pages=None)
    classes = ragged_plan.classes(56, 6, 1, 1, mosaic_cells=1)
    assert [(c.min_q, c.mosaic, c.pad) for c in classes] == [(17, True, True), (1, False, False)]
    out, new_cache = ji.ragged_paged_attention(*args, num_ctas=1, impl="mosaic")
    _check(args, want_cache, table, out, new_cache, tol=TOL[jnp.bfloat16])


def test_mosaic_class_holds_the_sinks(rng):
    """Sinks with a window on the Mosaic class (the sinks in its softmax state, one per head: two
    heads) beside a decode row on the Triton class (sinks applied by its lse): both against the
    reference (test_long_impl_dispatch: which impl takes sinks)."""
    args, want_cache, table = _mosaic_step(rng, [1, 20, 21], [40, 30, 5], (1, 1, 3), heads=(2, 2, 64),
                                           tok_cap=48, seq_cap=4, num_pages=None)
    sinks = jnp.asarray([1.5, 4.0], jnp.float32)  # about the rows' lse: they matter
    out, new_cache = ji.ragged_paged_attention(*args, num_ctas=1, impl="mosaic", sinks=sinks, sliding_window=24)
    _check(args, want_cache, table, out, new_cache, tol=TOL[jnp.bfloat16],
           variant=variants.compose(variants.sliding_window(), variants.sinks()),
           params={"sinks": sinks, "window_left": jnp.int32(23)})


@pytest.mark.slow
@pytest.mark.parametrize("page, causal, window", [(16, True, 40), (8, False, None), (8, True, None)])
def test_mosaic_class_compositions_one_compilation(rng, page, causal, window):
    """Group 2, two cells. Two compositions through one jitted, donated step: prefill only
    (aligned and unaligned starts), then the mixed step (q_len 0, 1, 4, 12, 70, 140); causal or
    not, with a sliding window and soft cap."""
    traces = []

    def step(*a):
        traces.append(1)
        kw = {} if window is None else dict(sliding_window=window, soft_cap=3.0)
        return ji.ragged_paged_attention(*a, causal=causal, num_ctas=4, impl="mosaic", **kw)

    fn = jax.jit(step, donate_argnums=(3,))
    for q_lens, cached, dist in (([130, 40, 0, 60], [0, 30, 4, 200], (0, 4, 4)),
                                 (MOSAIC_QO, MOSAIC_CACHED, (2, 2, 7))):
        args, want_cache, table = _mosaic_step(rng, q_lens, cached, dist, page=page)
        out, new_cache = fn(*args)
        kw = {}
        if window is not None:
            kw = dict(variant=variants.compose(variants.sliding_window(), variants.soft_cap()),
                      params={"window_left": jnp.int32(window - 1), "logits_soft_cap": jnp.float32(3.0)})
        _check(args, want_cache, table, out, new_cache, causal=causal, tol=TOL[jnp.bfloat16], **kw)
    assert len(traces) == 1


MIXED_STEP = (MOSAIC_QO, MOSAIC_CACHED, (2, 2, 7))
DECODE_STEP = ([1, 1, 1], [40, 200, 9], (3, 3, 3))


def _mixed_launch_steps(rng, steps):
    """Steps through one jitted, donated ragged_paged_attention with impl="mixed" (the mixed
    launch, its interpreter; group 2, two cells), each checked; returns the number of traces."""
    traces = []

    def step(*a):
        traces.append(1)
        return ji.ragged_paged_attention(*a, num_ctas=4, impl="mixed")

    fn = jax.jit(step, donate_argnums=(3,))
    for q_lens, cached, dist in steps:
        args, want_cache, table = _mosaic_step(rng, q_lens, cached, dist)
        out, new_cache = fn(*args)
        _check(args, want_cache, table, out, new_cache, tol=TOL[jnp.bfloat16])
    return len(traces)


@pytest.mark.slow
def test_mixed_launch_matches_reference(rng):
    """The 70- and 140-token sequences are query tiles (140 crosses a tile), q_len 1, 1 and 4
    packed tiles, 12 on the 32-row decode class after the launch, the padding rows tiles of no
    key; unlisted pages NaN, the written cache exact, padding rows zero."""
    _mixed_launch_steps(rng, [MIXED_STEP])


@pytest.mark.slow
def test_mixed_launch_decode_only_one_compilation(rng):
    """A decode-only step after the mixed one, through the same program: no query tile, so nothing
    is packed and the decode class runs every sequence (the launch only zeroes the padding)."""
    assert _mixed_launch_steps(rng, [MIXED_STEP, DECODE_STEP]) == 1


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["mosaic", "mixed"])
def test_fused_layout_long_kernels(rng, impl):
    """The Mosaic class and the mixed launch (their interpreters) on the NHD_FUSED cache: the
    mixed step against the reference, NaN in unlisted pages and past each kv_len (the mixed
    launch's sanitized last-page V copy is gathered from the fused pages)."""
    args, want_cache, table = _poisoned_tails(*_mosaic_step(rng, *MIXED_STEP, layout="NHD_FUSED"))
    out, new_cache = ji.ragged_paged_attention(*args, num_ctas=4, impl=impl)
    _check(args, want_cache, table, out, new_cache, tol=TOL[jnp.bfloat16])


def test_mosaic_plan_matches_numpy(rng):
    """The Mosaic class's device prologue against a NumPy derivation, for random compositions
    of one shape under one compilation: 8-aligned sub-buffer starts, 128-token tiles, cells
    covering the tiles in order, and the row maps both ways. (No kernel runs: cheap.)"""
    s, t, pps, cells = 12, 600, 8, 3
    traces = []
    mosaic_plan = jax.jit(lambda *a, **kw: (traces.append(1), ragged_plan.plan_mosaic(*a, **kw))[1],
                          static_argnames=("pages_per_seq", "cls", "causal", "window_left"))
    cls = ragged_plan.classes(t, s, 4, 2, mosaic_cells=cells)[0]
    assert cls.mosaic and cls.items == (t + s * 127) // 128 and cls.sub_rows == t + s * 7 + (-(t + s * 7)) % 8
    for trial in range(4):
        n = int(rng.integers(1, s + 1))
        q_lens = rng.choice([0, 1, 4, 33, 40, 128, 129, 200], n) if trial else np.full(n, 1)
        q_lens[np.cumsum(q_lens) > t] = 0
        cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        kv = q_lens + rng.integers(0, 50, n)
        pad_cu = np.full(s + 1, cu[-1], np.int32)
        pad_cu[: n + 1] = cu
        kv_lens, dist = np.zeros(s, np.int32), jnp.asarray([0, 0, n], jnp.int32)
        kv_lens[:n] = kv
        row_seq, row_live = ragged_plan.row_seqs(jnp.asarray(pad_cu), dist, t)
        items, cell_indptr, src, pos, lse_src = mosaic_plan(
            jnp.asarray(kv_lens), jnp.asarray(pad_cu), dist, row_seq, row_live, pages_per_seq=pps, cls=cls,
            causal=True, window_left=None)
        mine = q_lens >= cls.min_q
        span = np.where(mine, -(-q_lens // 8) * 8, 0)
        sub = np.cumsum(span) - span
        first = kv - q_lens  # each sequence's first query position
        want = [(sub[i], j, q_lens[i], i * pps, kv[i], first[i] + j, first[i] + min(j + 128, q_lens[i]) - 1)
                for i in np.flatnonzero(mine) for j in range(0, q_lens[i], 128)]
        live = int(cell_indptr[-1])
        got = np.asarray(items)[:live][:, [0, 1, 2, 3, 4, 14, 15]]
        np.testing.assert_array_equal(got, np.array(want, np.int64).reshape(-1, 7))
        assert np.all(np.asarray(items)[:live, 6] == np.asarray(items)[:live, 4])  # kv_end: every key
        assert int(cell_indptr[0]) == 0 and np.all(np.diff(np.asarray(cell_indptr)) >= 0)
        pos, src = np.asarray(pos), np.asarray(src)
        for i in range(n):
            rows = np.arange(cu[i], cu[i + 1])
            np.testing.assert_array_equal(pos[rows], sub[i] + rows - cu[i] if mine[i] else -1)
            if mine[i]:
                np.testing.assert_array_equal(src[pos[rows]], rows)
                first_item = int(np.sum(np.where(mine, -(-q_lens // 128), 0)[:i]))
                tok = rows - cu[i]
                np.testing.assert_array_equal(np.asarray(lse_src)[rows], (first_item + tok // 128) * 128 + tok % 128)
        assert np.all(pos[cu[-1]:] == -1)
    assert len(traces) == 1


def _np64_read(args, want_cache, table, read, causal):
    """float64 (o, lse) of each valid row when sequence i reads only its first read[i] keys (its
    rows keep their positions), from the written cache."""
    q, nnz = np.asarray(args[0], np.float64), int(table[0][-1])
    cu, kv_indptr, indices = table[0], table[1], table[2]
    kv_lens, page = np.asarray(args[4]), want_cache.page_size
    k_all, v_all = (np.asarray(x, np.float64) for x in (want_cache.k_pages, want_cache.v_pages))
    o, lse = np.zeros((nnz,) + q.shape[1:]), np.zeros((nnz, q.shape[1]))
    for i in range(len(cu) - 1):
        pages = indices[kv_indptr[i]:kv_indptr[i + 1]]
        kv = int(kv_lens[i])
        k, v = (x[pages].reshape(-1, *x.shape[2:])[:kv] for x in (k_all, v_all))  # NHD: [kv, Hkv, D]
        qo = int(cu[i + 1] - cu[i])
        mask = np.broadcast_to(np.arange(kv)[None, :] < read[i], (qo, kv))
        o[cu[i]:cu[i + 1]], lse[cu[i]:cu[i + 1]] = np64_attention(q[cu[i]:cu[i + 1]], k, v, causal=causal, mask=mask)
    return o, lse


@pytest.mark.parametrize("impl, causals", [("triton", (True,)), pytest.param("triton", (False,), marks=pytest.mark.slow),
                                           pytest.param("mosaic", (True, False), marks=pytest.mark.slow),
                                           pytest.param("mixed", (True, False), marks=pytest.mark.slow)])
def test_return_lse_read_kv_lens_and_no_write(rng, impl, causals):
    """return_lse, read_kv_lens (sequences reading part of their keys, rows keeping their
    positions: context parallel's shares) and keys = values = None, on every class (the
    Mosaic class and the mixed launch in their interpreter), against float64 NumPy: o and lse, padding rows o = 0 and
    lse = -inf, the cache untouched by the call without keys."""
    if impl == "mosaic":
        args, want_cache, table = _mosaic_step(rng, [1, 1, 0, 4, 12, 20, 140], [300, 8, 5, 60, 20, 30, 10],
                                               (2, 2, 7), heads=(1, 1, 64), tok_cap=216, seq_cap=8, num_pages=None)
        kw, tol = dict(num_ctas=1, impl="mosaic"), 2e-2
    elif impl == "mixed":  # query tiles (70, 140: two tiles), packed tiles (1, 1, 4), the 32-row class (12)
        args, want_cache, table = _mosaic_step(rng, [1, 1, 0, 4, 12, 70, 140], [300, 8, 5, 60, 20, 100, 10],
                                               (2, 2, 7))
        kw, tol = dict(num_ctas=4, impl="mixed"), 2e-2
    else:
        args, want_cache, table = _step(rng, QO, CACHED, page=8, dist=(2, 2, 7), seq_cap=9, tok_cap=64,
                                        pages_per_seq=-(-760 // 8))
        kw, tol = dict(num_ctas=NUM_CTAS), TOL[jnp.float32]
    nnz, kv_lens = int(table[0][-1]), np.asarray(args[4])
    n = len(table[0]) - 1
    # reads: all, none, fewer than the first query's position, one key, into the rows' range
    read = np.array([kv_lens[0], 0, kv_lens[2] // 3, 1, kv_lens[4] - 2, kv_lens[5] // 2, kv_lens[6] - 1][:n]
                    + [0] * (len(kv_lens) - n), np.int32)
    for causal in causals:
        state, cache = ji.ragged_paged_attention(*args, causal=causal, return_lse=True,
                                                 read_kv_lens=jnp.asarray(read), **kw)
        np.testing.assert_array_equal(np.asarray(cache.k_pages, np.float32), np.asarray(want_cache.k_pages, np.float32))
        want_o, want_lse = _np64_read(args, want_cache, table, read, causal)
        got_lse = np.asarray(state.lse)
        assert rel_err(np.asarray(state.o)[:nnz], want_o) < tol
        np.testing.assert_array_equal(np.isneginf(got_lse[:nnz]), np.isneginf(want_lse))
        fin = np.isfinite(want_lse)
        np.testing.assert_allclose(got_lse[:nnz][fin], want_lse[fin], atol=1e-2 if impl == "mosaic" else 1e-4)
        np.testing.assert_array_equal(np.asarray(state.o)[nnz:], 0.0)
        assert np.all(np.isneginf(got_lse[nnz:]))
    out, same = ji.ragged_paged_attention(args[0], None, None, want_cache, *args[4:], **kw)
    want_o, _ = _np64_read(args, want_cache, table, kv_lens, True)
    assert rel_err(np.asarray(out)[:nnz], want_o) < tol
    np.testing.assert_array_equal(np.asarray(same.v_pages, np.float32), np.asarray(want_cache.v_pages, np.float32))


def test_long_impl_dispatch(monkeypatch):
    """dispatch.ragged_long_impl: the mixed launch where it can run (compiled on a Hopper GPU: faked
    here), else the Mosaic prefill kernel without a variant (a head group past the packed tiles'),
    else Triton (variants: a sliding window with "auto"; sinks and other output transforms, which
    need each row's lse; the Mosaic prefill kernel runs a window and holds sinks in its softmax
    state with impl="mosaic"); impl="mixed" / "mosaic" name what they lack."""
    from jaxinfer import _backend, dispatch

    def pick(impl="auto", dtype=jnp.bfloat16, kv=jnp.bfloat16, scaled=False, d=64, page=16, layout="NHD",
             variant=None, heads=(4, 2)):
        p = dispatch.Problem("prefill", *heads, d, "paged", page, layout, variant, interpret=True)
        return dispatch.ragged_long_impl(p, impl, dtype, kv, scaled, 0.125).name

    assert pick() == "prefill_triton"  # not on a Hopper GPU
    assert pick("mosaic") == "prefill_mosaic" and pick("mixed") == "batch_mosaic"
    monkeypatch.setattr(_backend, "mosaic_available", lambda interpret: True)
    assert pick() == "batch_mosaic" and pick(page=8) == "batch_mosaic" and pick("triton") == "prefill_triton"
    window = ragged._variant(True, False, False)
    assert pick(variant=window) == "prefill_triton" and pick("mosaic", variant=window) == "prefill_mosaic"
    assert pick(variant=ragged._variant(False, True, False)) == "prefill_triton"  # soft cap
    assert pick(heads=(128, 1), variant=window) == "prefill_triton"
    for sinks in (ragged._variant(False, False, True), ragged._variant(True, True, True)):
        assert pick(variant=sinks) == "prefill_triton" and pick("triton", variant=sinks) == "prefill_triton"
        assert pick("mosaic", variant=sinks) == "prefill_mosaic"
    mine = variants.AttentionVariant(output_transform=lambda params, o, lse: (o, lse), name="mine")
    assert pick(variant=mine) == "prefill_triton"
    with pytest.raises(ValueError, match="impl='mosaic': variant 'mine' transforms the output"):
        pick("mosaic", variant=mine)
    with pytest.raises(ValueError, match="impl='mixed': variants"):
        pick("mixed", variant=window)
    assert pick(heads=(128, 2)) == "batch_mosaic" and pick(heads=(128, 1)) == "prefill_mosaic"  # group <= 64
    with pytest.raises(ValueError, match="impl='mixed': a packed tile holds 64 rows"):
        pick("mixed", heads=(128, 1))
    for kw in (dict(dtype=jnp.float32, kv=jnp.float32), dict(kv=jnp.float8_e4m3fn, scaled=True),
               dict(layout="HND"), dict(d=32), dict(page=4)):
        assert pick(**kw) == "prefill_triton"
        for impl in ("mosaic", "mixed"):
            with pytest.raises(ValueError, match=f"impl='{impl}'"):
                pick(impl, **kw)
    with pytest.raises(ValueError, match="impl"):
        pick("short")


def test_mixed_plan_matches_numpy(rng):
    """The mixed launch's device prologue (ragged_plan.plan_mixed) against a NumPy derivation for random
    compositions of one shape under one compilation (per causal): each long sequence's rows x
    query heads in exactly one query tile, the padding rows too (tiles of no key), each packed
    sequence x KV head in one packed tile (only beside query tiles), unique lse slots and each
    row's lse index, cells
    partitioning the items with their preferred kind first (each kind in slot order), and every
    cell's load within one item of the mean. (No kernel runs: cheap.)"""
    s, t, pps, hq, hkv, cells = 10, 700, 8, 4, 2, 5
    mix = ragged_plan.mixed_sizes(t, s, hq // hkv, 128, cells)
    assert (mix.long_min, mix.packed_tokens) == (17, 8)
    traces = []
    plan = jax.jit(lambda *a, **kw: (traces.append(1), ragged_plan.plan_mixed(*a, **kw))[1],
                   static_argnames=("pages_per_seq", "page_size", "causal", "num_qo_heads", "num_kv_heads", "mix",
                                    "num_rows"))
    cost = lambda kv_hi: kv_hi + batch_planner.MIXED_ITEM_COST
    for trial in range(6):
        n = int(rng.integers(1, s + 1))
        q_lens = rng.choice([0, 1, 3, 8, 9, 17, 128, 129, 300], n) if trial else np.full(n, 1)
        q_lens[np.cumsum(q_lens) > t] = 0
        kv = q_lens + rng.integers(0, 3000 if trial % 2 else 200, n)
        nnz = int(q_lens.sum())
        cu = np.full(s + 1, nnz, np.int32)
        cu[: n + 1] = np.concatenate([[0], np.cumsum(q_lens)])
        kv_lens = np.zeros(s, np.int32)
        kv_lens[:n] = kv
        causal = trial % 3 != 2
        items, cell_indptr, taken, lse_src = (np.asarray(x) for x in plan(
            jnp.asarray(kv_lens), jnp.asarray(cu), jnp.asarray([0, 0, n], jnp.int32), pages_per_seq=pps,
            page_size=16, causal=causal, num_qo_heads=hq, num_kv_heads=hkv, mix=mix, num_rows=t))
        long_ = q_lens >= mix.long_min
        short = (q_lens > 0) & (q_lens <= mix.packed_tokens)

        def kv_hi(i, j):  # keys tile j of sequence i sees
            return min(kv[i] - q_lens[i] + min(j + 128, q_lens[i]), kv[i]) if causal else kv[i]

        want_tiles = [(cu[i], j, q_lens[i], i * pps, kv[i], kv_hi(i, j)) for i in np.flatnonzero(long_)
                      for j in range(0, q_lens[i], 128)]
        want_tiles += [(nnz, j, t - nnz, (s - 1) * pps, 0, 0) for j in range(0, t - nnz, 128)]  # padding
        mean = (sum(cost(x[-1]) for x in want_tiles) * hq + sum(cost(kv[i]) for i in np.flatnonzero(short)) * hkv
                ) / cells
        packed = short & long_.any() & (cost(kv) <= mean)
        np.testing.assert_array_equal(taken[:n], long_ | packed)
        # each row's lse index (query head 0): query tile g's token j at g Hq 128 + j, a packed
        # sequence's token j at (its slot) 128 + j x the group; -1 for rows the launch does not run
        want_src = np.full(t, -1)
        first_tile = np.cumsum(np.where(long_, -(-q_lens // 128), 0)) - np.where(long_, -(-q_lens // 128), 0)
        for i in range(n):
            tok = np.arange(q_lens[i])
            if long_[i]:
                want_src[cu[i] + tok] = (first_tile[i] + tok // 128) * hq * 128 + tok % 128
            elif packed[i]:
                want_src[cu[i] + tok] = (mix.tiles * hq + i * hkv) * 128 + tok * (hq // hkv)
        np.testing.assert_array_equal(lse_src, want_src)
        live = int(cell_indptr[-1])
        got = items[:live]
        tiles = got[got[:, 9] == 0]
        assert sorted(map(tuple, tiles[:, [0, 1, 2, 3, 4, 6, 7]].tolist())) == sorted(
            x + (h,) for x in want_tiles for h in range(hq))
        want_packed = sorted((cu[i], q_lens[i], i * pps, kv[i], kv[i], h) for i in np.flatnonzero(packed)
                             for h in range(hkv))
        assert sorted(map(tuple, got[got[:, 9] == 1][:, [0, 2, 3, 4, 6, 7]].tolist())) == want_packed
        assert len(set(got[:, 8].tolist())) == live and np.all(got[:, 12] == -1)
        # a partly filled last page (page 16): the sanitized copy's row, its sequence
        np.testing.assert_array_equal(got[:, MIXED.last_row],
                                      np.where(got[:, MIXED.kv_len] % 16 != 0, got[:, MIXED.page_base] // pps, -1))
        ind = cell_indptr
        assert ind[0] == 0 and np.all(np.diff(ind) >= 0)
        for c in range(cells):
            kinds = got[ind[c]:ind[c + 1], 9]
            later = (kinds != c % 2).astype(int)
            assert np.all(np.diff(later) >= 0)  # the preferred kind first, each kind in lse-slot order
            assert np.all(np.diff(got[ind[c]:ind[c + 1], 8])[np.diff(later) == 0] > 0)
            assert cost(got[ind[c]:ind[c + 1], 6]).sum() <= mean + cost(got[:, 6]).max()
    assert len(traces) == 2  # one per value of causal
