"""mla_ragged_paged_attention (interpret mode, the real kernels) against a float64 NumPy oracle:
mixed compositions through one jitted call (one trace), the cache writes bit for bit, NaN-poisoned
unlisted pages and stale slots, fp8 caches with scales, the device plan's capacities, ValueErrors."""
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from jaxinfer import mla_ragged
from pallas_kernels.mla import MLAConfig
from planner import mla as mla_planner
import test_mla  # (its boundary lengths)

DC, DR, SCALE = 64, 16, 0.3
S, T = 6, 24
CELLS = 3
CONFIG = MLAConfig(min_chunk=32)
# Compositions (q_lens, kv_lens, distribution) over S = 6 slots and T = 24 rows: decode rows (kv 1,
# and kv 300: split over chunks), multi-token rows, a prompt, an empty sequence (q 0, kv 40),
# padding rows; then all decode-first with a 5-token verify; then no padding at all.
COMPOSITIONS = (
    ([1, 1, 3, 8, 0], [1, 300, 70, 8, 40], (2, 2, 5)),
    ([1, 1, 1, 5, 2, 4], [129, 64, 2, 200, 2, 130], (3, 3, 6)),
    ([20, 4], [20, 257], (0, 0, 2)),
)
MAX_KV = 320


def _pages_per_seq(page_size):
    return -(-MAX_KV // page_size)


def _num_pages(page_size, num_seqs=S):
    return num_seqs * _pages_per_seq(page_size) + 5  # every sequence's pages plus unlisted ones


def metadata(rng, q_lens, kv_lens, dist, page_size, num_seqs=S):
    """Device metadata of a composition: kv_lens [S], page_indices [S * pages_per_seq] (random
    distinct pages; entries past each sequence's pages are garbage ids), cu_q_lens [S + 1]."""
    n, pps = dist[2], _pages_per_seq(page_size)
    kv = np.zeros(num_seqs, np.int32)
    kv[:n] = kv_lens
    cu = np.zeros(num_seqs + 1, np.int32)
    cu[1:n + 1] = np.cumsum(q_lens)
    cu[n + 1:] = cu[n]
    pi = np.full(num_seqs * pps, 10 ** 6, np.int32)  # garbage past the pages in use (never read)
    perm = rng.permutation(_num_pages(page_size, num_seqs))
    used = 0
    for s in range(n):
        k = -(-kv[s] // page_size)
        pi[s * pps:s * pps + k] = perm[used:used + k]
        used += k
    return kv, pi, cu, np.asarray(dist, np.int32)


def caches(rng, page_size, dtype=np.float32, num_seqs=S):
    shape = (_num_pages(page_size, num_seqs), page_size)
    return (rng.standard_normal(shape + (DC,)).astype(dtype), rng.standard_normal(shape + (DR,)).astype(dtype))


def poison(ckv, kpe, kv, pi, cu, dist, page_size):
    """NaN in every page no valid sequence lists and in the slots past each sequence's kv_len."""
    ckv, kpe = ckv.copy(), kpe.copy()
    n, pps = dist[2], _pages_per_seq(page_size)
    listed = np.zeros(ckv.shape[0], bool)
    for s in range(n):
        k = -(-kv[s] // page_size)
        pages = pi[s * pps:s * pps + k]
        listed[pages] = True
        if kv[s] % page_size:
            ckv[pages[-1], kv[s] % page_size:] = np.nan
            kpe[pages[-1], kv[s] % page_size:] = np.nan
    ckv[~listed] = np.nan
    kpe[~listed] = np.nan
    return ckv, kpe


def expected_caches(ckv, kpe, new_c, new_pe, kv, pi, cu, dist, page_size):
    ckv, kpe = ckv.copy(), kpe.copy()
    pps = _pages_per_seq(page_size)
    for s in range(dist[2]):
        q = cu[s + 1] - cu[s]
        for i in range(q):
            pos = kv[s] - q + i
            page = pi[s * pps + pos // page_size]
            ckv[page, pos % page_size] = new_c[cu[s] + i].astype(ckv.dtype)
            kpe[page, pos % page_size] = new_pe[cu[s] + i].astype(kpe.dtype)
    return ckv, kpe


def oracle(ql_nope, q_pe, ckv, kpe, kv, pi, cu, dist, page_size, causal=True, ckv_scale=1.0, kpe_scale=1.0):
    """float64 MLA over the (written) caches: o [T, H, DC]; padding rows and rows with no key: 0."""
    qn, qp = np.asarray(ql_nope, np.float64), np.asarray(q_pe, np.float64)
    ckv, kpe = np.asarray(ckv, np.float64) * ckv_scale, np.asarray(kpe, np.float64) * kpe_scale
    t, h, _ = qn.shape
    o = np.zeros((t, h, DC))
    pps = _pages_per_seq(page_size)
    for s in range(dist[2]):
        qs, qe, n = cu[s], cu[s + 1], int(kv[s])
        if qe == qs or n == 0:
            continue
        pos = np.arange(n)
        rows = pi[s * pps + pos // page_size] * page_size + pos % page_size
        c, r = ckv.reshape(-1, DC)[rows], kpe.reshape(-1, DR)[rows]
        logits = (np.einsum("qhd,kd->qhk", qn[qs:qe], c) + np.einsum("qhd,kd->qhk", qp[qs:qe], r)) * SCALE
        if causal:
            logits = np.where(pos[None, None, :] <= np.arange(qe - qs)[:, None, None] + n - (qe - qs), logits, -np.inf)
        m = logits.max(-1, keepdims=True)
        p = np.exp(logits - np.where(np.isfinite(m), m, 0))  # (a row with no visible key: p = 0, o = 0)
        o[qs:qe] = np.einsum("qhk,kd->qhd", p, c) / np.maximum(p.sum(-1), 1e-300)[..., None]
    return o


def new_rows(rng, heads, dtype=np.float32, num_tokens=T):
    t = num_tokens
    return (rng.standard_normal((t, heads, DC)).astype(dtype), rng.standard_normal((t, heads, DR)).astype(dtype),
            rng.standard_normal((t, DC)).astype(dtype), rng.standard_normal((t, DR)).astype(dtype))


def _bits(x):
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


@functools.lru_cache(maxsize=None)
def _jitted(heads, page_size, causal):
    """(jitted call, trace counter): one compilation per (heads, page_size, causal)."""
    traces = [0]

    def fn(*args):
        traces[0] += 1
        return jaxinfer.mla_ragged_paged_attention(*args, sm_scale=SCALE, causal=causal, num_cells=CELLS,
                                                   config=CONFIG)

    return jax.jit(fn), traces


def _run_compositions(heads, page_size, causal=True, seed=0):
    call, traces = _jitted(heads, page_size, causal)
    rng = np.random.default_rng(seed)
    for q_lens, kv_lens, dist in COMPOSITIONS:
        kv, pi, cu, dist = metadata(rng, q_lens, kv_lens, dist, page_size)
        ckv, kpe = poison(*caches(rng, page_size), kv, pi, cu, dist, page_size)
        qn, qp, nc, npe = new_rows(rng, heads)
        o, ckv_out, kpe_out = call(qn, qp, nc, npe, ckv, kpe, kv, pi, cu, dist)
        want_ckv, want_kpe = expected_caches(ckv, kpe, nc, npe, kv, pi, cu, dist, page_size)
        # The writes: bit for bit at their slots, every other bit (NaNs included) unchanged.
        np.testing.assert_array_equal(_bits(ckv_out), _bits(want_ckv))
        np.testing.assert_array_equal(_bits(kpe_out), _bits(want_kpe))
        o = np.asarray(o)
        assert o.shape == (T, heads, DC) and o.dtype == np.float32
        assert np.all(np.isfinite(o)), "NaN-poisoned unlisted pages or stale slots leaked into o"
        want = oracle(qn, qp, want_ckv, want_kpe, kv, pi, cu, dist, page_size, causal)
        np.testing.assert_allclose(o, want, atol=2e-4, rtol=2e-4)
        assert np.all(o[cu[dist[2]]:] == 0), "padding rows must give o = 0"
    return traces[0]


# Pages of 64 by default; 16 under slow (test_not_causal runs three compositions on them), and 1
# (the kernel's one-slot pages run by default in test_mla.test_matches_float64_reference[8-1-True]).
@pytest.mark.parametrize("page_size", [pytest.param(1, marks=pytest.mark.slow), pytest.param(16, marks=pytest.mark.slow),
                                       64])
def test_compositions_one_compilation(page_size):
    assert _run_compositions(16, page_size) == 1  # three compositions, one trace


def test_not_causal():
    assert _run_compositions(16, 16, causal=False, seed=1) == 1


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 64])
def test_compositions_128_heads(page_size):
    assert _run_compositions(128, page_size, seed=2) == 1


# The Mosaic GPU interpreter compiles its warpgroups' programs again at every call (seconds each,
# jitted or not): by default one composition, the second (the same shapes: the same trace) under slow.
# Under slow: the Mosaic kernel runs by default in test_mla.py (its interpreter), one program for
# every composition in test_compositions_one_compilation (the Triton kernel, the same plans).
@pytest.mark.slow
@pytest.mark.parametrize("compositions", [1, 2])
def test_mosaic_kernel_compositions_one_compilation(monkeypatch, compositions):
    """impl="mosaic" (the Mosaic GPU interpreter): 64 heads, Dc 128 + Dr 64, page 64, bf16;
    compositions (decode with a split tile, multi-token rows, an empty sequence and padding rows;
    under slow then decode first with verify and prompt rows) through one trace, the writes bit
    for bit, NaN-poisoned pages and slots, split tiles merged whole, padding rows 0."""
    import sys
    monkeypatch.setattr(sys.modules[__name__], "DC", 128)
    monkeypatch.setattr(sys.modules[__name__], "DR", 64)
    heads, page_size, traces = 64, 64, [0]

    def fn(*args):
        traces[0] += 1
        return jaxinfer.mla_ragged_paged_attention(*args, sm_scale=SCALE, num_cells=CELLS, config=CONFIG,
                                                   impl="mosaic")

    call, rng, bf16 = jax.jit(fn), np.random.default_rng(6), jnp.bfloat16
    as_bf16 = lambda x: np.asarray(jnp.asarray(x, bf16))  # noqa: E731
    for q_lens, kv_lens, dist in COMPOSITIONS[:compositions]:  # (the third adds no path: the first two cover it)
        kv, pi, cu, dist = metadata(rng, q_lens, kv_lens, dist, page_size)
        ckv, kpe = (as_bf16(x) for x in poison(*caches(rng, page_size), kv, pi, cu, dist, page_size))
        qn, qp, nc, npe = (as_bf16(x) for x in new_rows(rng, heads))
        o, ckv_out, kpe_out = call(qn, qp, nc, npe, ckv, kpe, kv, pi, cu, dist)
        want_ckv, want_kpe = expected_caches(ckv, kpe, nc, npe, kv, pi, cu, dist, page_size)
        np.testing.assert_array_equal(_bits(ckv_out), _bits(want_ckv))
        o = np.asarray(o, np.float32)
        assert np.all(np.isfinite(o)) and np.all(o[cu[dist[2]]:] == 0)
        want = oracle(*(np.asarray(x, np.float32) for x in (qn, qp, want_ckv, want_kpe)), kv, pi, cu, dist, page_size)
        assert np.linalg.norm(o - want) <= 1e-2 * np.linalg.norm(want)
    assert traces[0] == 1


def test_fp8_caches_with_scales_eager():
    """bfloat16 q over float8_e4m3fn caches holding rows / scale; an eager call (concrete metadata:
    the checks run)."""
    page_size, heads = 16, 16
    rng = np.random.default_rng(4)
    q_lens, kv_lens, dist = COMPOSITIONS[0]
    kv, pi, cu, dist = metadata(rng, q_lens, kv_lens, dist, page_size)
    f8 = jnp.float8_e4m3fn
    ckv, kpe = (np.asarray(jnp.asarray(3 * x).astype(f8)) for x in caches(rng, page_size))
    qn, qp, nc, npe = new_rows(rng, heads)
    qn, qp = np.asarray(jnp.asarray(qn, jnp.bfloat16)), np.asarray(jnp.asarray(qp, jnp.bfloat16))
    nc, npe = np.asarray(jnp.asarray(3 * nc, jnp.bfloat16)), np.asarray(jnp.asarray(3 * npe, jnp.bfloat16))
    o, ckv_out, kpe_out = jaxinfer.mla_ragged_paged_attention(
        qn, qp, nc, npe, ckv, kpe, kv, pi, cu, dist, sm_scale=SCALE, num_cells=CELLS, config=CONFIG,
        ckv_scale=1 / 3, kpe_scale=jnp.float32(0.25))
    want_ckv, want_kpe = expected_caches(np.asarray(ckv), np.asarray(kpe), np.asarray(nc), np.asarray(npe), kv, pi,
                                         cu, dist, page_size)
    np.testing.assert_array_equal(_bits(ckv_out), _bits(want_ckv))
    np.testing.assert_array_equal(_bits(kpe_out), _bits(want_kpe))
    assert o.dtype == jnp.bfloat16
    want = oracle(qn.astype(np.float32), qp.astype(np.float32), want_ckv.astype(np.float32),
                  want_kpe.astype(np.float32), kv, pi, cu, dist, page_size, ckv_scale=1 / 3, kpe_scale=0.25)
    np.testing.assert_allclose(np.asarray(o, np.float32), want, atol=3e-2, rtol=3e-2)


def _plan_np(q_lens, kv_lens, n, heads, cells, causal=True):
    """The device plan of a composition (jitted) as NumPy arrays, with its sizes."""
    s = len(kv_lens)
    kv = np.asarray(kv_lens, np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    t = int(cu[-1]) + 3  # three padding rows
    sz = mla_ragged.sizes(t, heads, s, MLAConfig(min_chunk=32), cells)
    sec = jax.jit(functools.partial(mla_ragged.plan, num_tokens=t, num_heads=heads, pages_per_seq=8,
                                    causal=causal, sz=sz))(kv, cu, np.asarray([0, 0, n], np.int32))
    return {k: np.asarray(v) for k, v in sec.items()}, sz, cu, t


@pytest.mark.parametrize("seed,cells", [(0, 2), (0, 64), pytest.param(1, 2, marks=pytest.mark.slow),
                                        pytest.param(2, 2, marks=pytest.mark.slow)])
def test_plan_covers_every_row_within_capacity(seed, cells):  # (seeds 1 and 2: other random compositions, under slow)
    """Every (token, head) row is in exactly one tile, its tile's chunks cover the keys it sees
    exactly once, split tiles' rows have one merge group each, and the item, partial-row and group
    counts stay within the static capacities, for long sequences over few cells (many splits, the
    items in runs) and over more cells than tiles (one wave: an item a cell)."""
    rng = np.random.default_rng(seed)
    heads, s = 4, 7
    q_lens = rng.integers(0, 9, s)
    kv_lens = q_lens + rng.integers(0, 900, s)
    sec, sz, cu, t = _plan_np(q_lens, kv_lens, s, heads, cells)
    items, ip = sec["items"], sec["cell_indptr"]
    assert ip[0] == 0 and np.all(np.diff(ip) >= 0) and ip[-1] <= sz.items
    col = {name: i for i, name in enumerate(mla_ragged.MLA.names)}
    seen = np.zeros((t * heads, 1000), np.int32)  # [row, key]: chunks covering it
    parts_used = []
    for w in items[:ip[-1]]:
        f = {k: int(w[i]) for k, i in col.items()}
        for r in range(f["rows"]):
            row = f["q_row"] + r
            seen[row, f["kv_start"]:f["kv_end"]] += 1
            if f["part_base"] >= 0:
                parts_used.append(f["part_base"] + r * f["part_stride"])
    assert len(parts_used) == len(set(parts_used)) and (not parts_used or max(parts_used) < sz.parts)
    for b in range(s):
        for tok in range(q_lens[b]):
            last = kv_lens[b] - q_lens[b] + tok  # causal: keys <= last are visible
            for hd in range(heads):
                row = (cu[b] + tok) * heads + hd
                assert np.all(seen[row, :last + 1] == 1), (b, tok, hd)
    assert np.all(seen[cu[-1] * heads:] == 0)  # padding rows: items of no key
    ng = int(sec["num_groups"])
    assert ng <= sz.groups
    dest = sec["merge_dest"][:ng]
    assert np.all(sec["merge_dest"][ng:] == -1) or ng == sz.groups
    live = dest[dest >= 0]
    assert len(live) == len(set(live))
    assert sec["merge_indptr"][ng] <= sz.parts


def test_plan_tile_merge_for_the_mosaic_kernel():
    """Mosaic sizes (64-row tiles, whole-tile merges): each split tile's chunk i writes partial rows
    base + 64 i .. + 63, and its merge group names those whole tiles and its own tile of o."""
    rng = np.random.default_rng(3)
    heads, cells, s = 64, 2, 3
    q_lens, kv_lens = np.array([1, 2, 1]), rng.integers(2000, 4000, s)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    t = int(cu[-1]) + 2
    sz = mla_ragged.sizes(t, heads, s, MLAConfig(min_chunk=64), cells,
                          jaxinfer.dispatch.IMPLEMENTATIONS_BY_NAME["mla_mosaic"])
    assert sz.tile_merge and sz.block_rows == 64 and sz.groups == cells
    sec = jax.jit(functools.partial(mla_ragged.plan, num_tokens=t, num_heads=heads, pages_per_seq=16, causal=True,
                                    sz=sz))(kv_lens.astype(np.int32), cu, np.asarray([0, 0, s], np.int32))
    sec = {k: np.asarray(v) for k, v in sec.items()}
    col = {name: i for i, name in enumerate(mla_ragged.MLA.names)}
    chunks = {}  # q_row -> part bases of its chunks
    for w in sec["items"][:sec["cell_indptr"][-1]]:
        f = {k: int(w[i]) for k, i in col.items()}
        if f["part_base"] >= 0:
            assert f["part_stride"] == 1 and f["part_base"] % 64 == 0
            chunks.setdefault(f["q_row"], []).append(f["part_base"] // 64)
    ng = int(sec["num_groups"])
    assert ng == len(chunks) > 0
    for g in range(ng):
        lo, hi = sec["merge_indptr"][g:g + 2]
        assert sorted(chunks[int(sec["merge_dest"][g]) * 64]) == list(range(lo, hi))


def _cells_and_keys(sec, sz):
    """Each cell's item count and each item's keys."""
    ip, items = sec["cell_indptr"], sec["items"]
    col = {name: i for i, name in enumerate(mla_ragged.MLA.names)}
    keys = items[:ip[-1], col["kv_end"]] - items[:ip[-1], col["kv_start"]]
    return np.diff(ip), keys


def test_plan_one_wave_or_balanced_shares():
    """Uniform decode with fewer tiles than cells: the host planner's one wave (each tile cut into
    the most even chunks that still give every item a cell of its own). With one long request
    among short ones a wave would run the long one whole on one cell: the tiles' blocks are cut
    into the cells' equal shares instead, each cell's items within a block of its share."""
    sec, sz, _, _ = _plan_np([1] * 8, [4096] * 8, 8, 16, 36)
    per_cell, keys = _cells_and_keys(sec, sz)
    assert per_cell.max() == 1 and per_cell.sum() == 8 * 4 + 3  # 4 chunks of 1024 a request, 3 padding tiles
    assert keys.max() == 1024 and int(sec["num_groups"]) == 8 * 16  # (merged row by row)

    cells, bk = 8, sz.block_kv
    sec, sz, _, _ = _plan_np([1] * 5, [8192] + [64] * 4, 5, 16, cells)
    per_cell, keys = _cells_and_keys(sec, sz)
    c0 = max(mla_ragged.ITEM_COST // bk, 1)  # an item's cost in blocks
    assert per_cell.min() >= 1
    units = np.add.reduceat(-(-keys // bk) + c0, np.cumsum(per_cell) - per_cell)  # [cells]
    mean = (8192 // bk + 4 + 8 * c0) / cells  # 5 tiles and 3 padding tiles
    assert units.max() <= mean + c0 + 1  # (a cut piece's own item cost, rounding)


@pytest.mark.parametrize("heads", [16, 64])
@pytest.mark.parametrize("skewed,cells,min_chunk", [(False, 24, 64), (True, 8, 64), (True, 6, 1024)])
def test_plan_equals_the_host_plan_where_the_tiles_fit_the_cells(heads, skewed, cells, min_chunk):
    """Where a step's tiles fit the cells (one wave, or skewed lengths cut into equal shares; with
    min_chunk 1024 fewer shares than cells, none under min_chunk), the device plan's items are the
    host planner's (planner.mla.plan with the same tiles, cells, block and costs): the same rows,
    keys and cells; steps without padding rows."""
    rng = np.random.default_rng(heads + skewed)
    s = 6
    q_lens = np.ones(s, np.int64)  # (a tile a request: the wave fills the 24 cells with 4 chunks each)
    kv_lens = np.r_[4000, rng.integers(1, 60, s - 1)] if skewed else q_lens + rng.integers(3000, 3100, s)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    t = int(cu[-1])
    sz = mla_ragged.sizes(t, heads, s, MLAConfig(min_chunk=min_chunk), cells,
                          jaxinfer.dispatch.IMPLEMENTATIONS_BY_NAME["mla_mosaic" if heads == 64 else "mla_triton"])
    dev = jax.jit(functools.partial(mla_ragged.plan, num_tokens=t, num_heads=heads, pages_per_seq=256, causal=True,
                                    sz=sz))(kv_lens.astype(np.int32), cu, np.asarray([0, 0, s], np.int32))
    pages = -(-kv_lens // 16)
    kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    layout, buf, info = mla_planner.plan(cu, kv_indptr, np.arange(kv_indptr[-1], dtype=np.int32),
                                         kv_lens.astype(np.int32), page_size=16, num_heads=heads, num_cells=cells,
                                         block_rows=sz.block_rows, causal=True, block_kv=sz.block_kv,
                                         min_chunk=sz.min_chunk, item_cost=mla_ragged.ITEM_COST,
                                         tile_merge=sz.tile_merge)
    host = layout.named([buf[a:b] for a, b in layout.offsets.values()])
    assert info["num_tiles"] <= cells  # (the regime this test is about)
    col = [mla_ragged.MLA.names.index(n) for n in ("q_row", "rows", "kv_start", "kv_end")]

    def by_cell(sec):  # {cell: sorted (q_row, rows, kv_start, kv_end) of its items}
        ip = np.asarray(sec["cell_indptr"])
        return {c: sorted(map(tuple, np.asarray(sec["items"])[ip[c]:ip[c + 1]][:, col].tolist()))
                for c in range(cells) if ip[c + 1] > ip[c]}

    want, got = by_cell(host), by_cell(dev)
    assert (info["chunk"] is None) == skewed
    if skewed:  # equal shares: the same items on the same cells
        assert got == want
        if min_chunk > 64:  # fewer shares than cells, each of at least min_chunk keys' cost (in blocks)
            bk, c0 = sz.block_kv, max(mla_ragged.ITEM_COST // sz.block_kv, 1)
            assert len(got) < cells and min(sum(-(-(e - b) // bk) + c0 for _, _, b, e in items)
                                            for items in got.values()) * bk >= min_chunk
    else:  # one wave: the same items, each on a cell of its own (the host lists them longest first)
        assert sorted(sum(got.values(), [])) == sorted(sum(want.values(), []))
        assert max(map(len, got.values())) == 1


def test_plan_worst_case_capacity():
    """One token per sequence at the most keys each, T = S: the chunk rule's bound holds."""
    s, heads, cells = 16, 16, 2
    sec, sz, _, _ = _plan_np([1] * s, [5000] * s, s, heads, cells)
    assert sec["cell_indptr"][-1] <= sz.items
    assert int(sec["num_groups"]) <= sz.groups and sec["merge_indptr"][-1] <= sz.parts
    assert sec["cell_indptr"][-1] > s  # (it did split)


def _valid_args(page_size=16, heads=16):
    rng = np.random.default_rng(5)
    q_lens, kv_lens, dist = COMPOSITIONS[0]
    kv, pi, cu, dist = metadata(rng, q_lens, kv_lens, dist, page_size)
    ckv, kpe = caches(rng, page_size)
    qn, qp, nc, npe = new_rows(rng, heads)
    return dict(ql_nope=qn, q_pe=qp, new_kv_c=nc, new_k_pe=npe, ckv_cache=ckv, kpe_cache=kpe, kv_lens=kv,
                page_indices=pi, cu_q_lens=cu, distribution=dist)


def _call(**changes):
    args = _valid_args()
    kw = dict(sm_scale=SCALE, num_cells=CELLS, config=CONFIG)
    kw.update(changes.pop("kw", {}))
    args.update(changes)
    names = ("ql_nope", "q_pe", "new_kv_c", "new_k_pe", "ckv_cache", "kpe_cache", "kv_lens", "page_indices",
             "cu_q_lens", "distribution")
    return jaxinfer.mla_ragged_paged_attention(*(args[k] for k in names), **kw)


def _bad_cases():
    a = _valid_args()
    kv_short = a["kv_lens"].copy()
    kv_short[2] = 2  # q_len 3
    dist_bad = np.asarray([3, 2, 5], np.int32)
    pi_bad = a["page_indices"].copy()
    pi_bad[0] = a["ckv_cache"].shape[0]
    cu_bad = a["cu_q_lens"].copy()
    cu_bad[1] = 2  # a decode sequence with q_len 2
    return [
        (dict(ql_nope=a["ql_nope"][0]), "ql_nope"),
        (dict(q_pe=a["q_pe"][:, :4]), "q_pe"),
        (dict(q_pe=a["q_pe"].astype(np.float16)), "q_pe"),
        (dict(ql_nope=a["ql_nope"][..., :48], ckv_cache=a["ckv_cache"][..., :48], new_kv_c=a["new_kv_c"][:, :48]),
         "Dc"),
        (dict(ckv_cache=a["ckv_cache"][..., :32]), "ckv_cache"),
        (dict(kpe_cache=a["kpe_cache"][:-1]), "kpe_cache"),
        (dict(ckv_cache=a["ckv_cache"].astype(np.float16)), "ckv_cache"),
        (dict(new_kv_c=a["new_kv_c"][:, :32]), "new_kv_c"),
        (dict(new_k_pe=a["new_k_pe"][:-1]), "new_k_pe"),
        (dict(new_k_pe=a["new_k_pe"].astype(np.int32)), "new_k_pe"),
        (dict(kv_lens=a["kv_lens"].astype(np.int64)), "kv_lens"),
        (dict(page_indices=a["page_indices"][:-1]), "page_indices"),
        (dict(cu_q_lens=a["cu_q_lens"][:-1]), "cu_q_lens"),
        (dict(distribution=a["distribution"][:2]), "distribution"),
        (dict(kv_lens=kv_short), "kv_lens"),
        (dict(distribution=dist_bad), "distribution"),
        (dict(page_indices=pi_bad), "page_indices"),
        (dict(cu_q_lens=cu_bad), "cu_q_lens"),
        (dict(kw=dict(sm_scale=0.0)), "sm_scale"),
        (dict(kw=dict(causal=1)), "causal"),
        (dict(kw=dict(num_cells=0)), "num_cells"),
        (dict(kw=dict(config=object())), "config"),
        (dict(kw=dict(ckv_scale=-1.0)), "ckv_scale"),
    ]


@pytest.mark.parametrize("case", range(23))
def test_value_errors(case):
    changes, name = _bad_cases()[case]
    with pytest.raises(ValueError, match=name):
        _call(**changes)


def test_sm_scale_required():
    with pytest.raises(TypeError, match="sm_scale"):
        a = _valid_args()
        jaxinfer.mla_ragged_paged_attention(*a.values())


def test_rows_with_no_visible_key_give_zero():
    """Under jit (metadata unchecked) a sequence with kv_len 2 < q_len 4: its first two rows see no
    key (causal) and give o = 0; the others match the oracle over the returned caches. (Pages of
    64: test_compositions_one_compilation[64]'s program.)"""
    page_size, heads = 64, 16
    call, traces = _jitted(heads, page_size, True)
    rng = np.random.default_rng(6)
    kv, pi, cu, dist = metadata(rng, [1, 4, 2], [50, 2, 9], (1, 1, 3), page_size)
    ckv, kpe = caches(rng, page_size)
    qn, qp, nc, npe = new_rows(rng, heads)
    o, ckv_out, kpe_out = call(qn, qp, nc, npe, ckv, kpe, kv, pi, cu, dist)
    o = np.asarray(o)
    assert np.all(o[1:3] == 0) and np.all(np.isfinite(o))
    want = oracle(qn, qp, np.asarray(ckv_out), np.asarray(kpe_out), kv, pi, cu, dist, page_size)
    np.testing.assert_allclose(o, want, atol=2e-4, rtol=2e-4)
    assert np.all(o[cu[dist[2]]:] == 0)


def test_donated_caches_chain():
    """Two chained steps under a jit that donates the caches (an engine's decode loop): the second
    step reads the first's written rows."""
    page_size, heads = 16, 16
    fn = jax.jit(lambda *a: jaxinfer.mla_ragged_paged_attention(*a, sm_scale=SCALE, num_cells=CELLS, config=CONFIG),
                 donate_argnums=(4, 5))
    rng = np.random.default_rng(7)
    ckv, kpe = caches(rng, page_size)
    kv, pi, cu, dist = metadata(rng, [3, 1], [3, 40], (0, 0, 2), page_size)
    want_ckv, want_kpe = ckv, kpe
    c, p = jnp.asarray(ckv), jnp.asarray(kpe)
    for step in range(2):
        qn, qp, nc, npe = new_rows(rng, heads)
        want_ckv, want_kpe = expected_caches(want_ckv, want_kpe, nc, npe, kv, pi, cu, dist, page_size)
        o, c, p = fn(qn, qp, nc, npe, c, p, kv, pi, cu, dist)
        np.testing.assert_array_equal(_bits(c), _bits(want_ckv))
        np.testing.assert_array_equal(_bits(p), _bits(want_kpe))
        np.testing.assert_allclose(np.asarray(o), oracle(qn, qp, want_ckv, want_kpe, kv, pi, cu, dist, page_size),
                                   atol=2e-4, rtol=2e-4)
        kv = kv + np.asarray([1, 1, 0, 0, 0, 0], np.int32)  # next: a decode token each
        cu = np.asarray([0, 1, 2, 2, 2, 2, 2], np.int32)
        dist = np.asarray([2, 2, 2], np.int32)


def test_mosaic_kernel_lowers_for_cuda():
    """The device-planned step on the Mosaic GPU kernel lowers for an H100 on any host."""
    from test_backend import MOSAIC_CALL, lower_for_cuda
    t, s, h, page, pps = 8, 4, 128, 64, 4
    bf = jnp.bfloat16
    args = (jnp.ones((t, h, 512), bf), jnp.ones((t, h, 64), bf), jnp.ones((t, 512), bf), jnp.ones((t, 64), bf),
            jnp.ones((s * pps, page, 512), bf), jnp.ones((s * pps, page, 64), bf), jnp.full((s,), 100, jnp.int32),
            jnp.arange(s * pps, dtype=jnp.int32), jnp.array([0, 1, 2, 3, 8], jnp.int32), jnp.array([3, 3, 4], jnp.int32))
    fn = functools.partial(jaxinfer.mla_ragged_paged_attention, sm_scale=SCALE, backend="gpu", impl="mosaic")
    assert MOSAIC_CALL in lower_for_cuda(fn, *args)


# ---------------------------------------------------------------- boundaries
def boundary_compositions(heads, page_size, num_tokens, num_seqs):
    """test_mla's query lengths at the tile edges of `heads` that fit num_tokens rows, each alone
    (decode where q_len is 1), then decode rows first and as many of the others as fit (a padding
    sequence left over); key lengths at the page, block and chunk edges."""
    lengths = [q for q in test_mla.qo_edges(heads) if q <= num_tokens]
    comps = []
    for i, q in enumerate(lengths):
        kvs = [k for k in test_mla.kv_edges(q, page_size) if k <= MAX_KV]
        comps.append(([q], [kvs[i % len(kvs)]], (1, 1, 1) if q == 1 else (0, 0, 1)))
    decode = [1] * min(2, num_seqs - 1)
    rest, room = [], num_tokens - len(decode)
    for q in sorted((q for q in lengths if q > 1), reverse=True):
        if q <= room and len(decode) + len(rest) < num_seqs - 1:
            rest.append(q)
            room -= q
    q_lens = decode + rest
    kv_lens = [max(q, (300, 129, 65, 64, 17, 2)[i % 6]) for i, q in enumerate(q_lens)]
    return comps + [(q_lens, kv_lens, (len(decode), len(decode), len(q_lens)))]


# (heads, page_size, causal, (T, S)) by default: T / S sets the tile height (mla_ragged.tile_rows);
# the rest of the product under slow.
BOUNDARY_ROWS = [(3, 1, True, (24, 6)), (16, 64, False, (24, 24)), (128, 16, True, (80, 2))]


@pytest.mark.parametrize("heads, page_size, causal, shape", BOUNDARY_ROWS + [
    pytest.param(*row, marks=pytest.mark.slow) for row in itertools.product(
        (1, 3, 8, 16, 32, 64, 128), (1, 16, 64), (True, False), ((24, 6), (24, 24), (80, 2)))
    if row not in BOUNDARY_ROWS])
def test_boundaries(heads, page_size, causal, shape):
    """Every boundary composition through one jitted call: the caches written bit for bit, o
    against the float64 oracle with NaN in unlisted pages and stale slots, padding rows 0."""
    num_tokens, num_seqs = shape
    traces = []

    def fn(*args):
        traces.append(1)
        return jaxinfer.mla_ragged_paged_attention(*args, sm_scale=SCALE, causal=causal, num_cells=CELLS,
                                                   config=CONFIG)

    call = jax.jit(fn)
    rng = np.random.default_rng(heads * 7 + page_size)
    for q_lens, kv_lens, dist in boundary_compositions(heads, page_size, num_tokens, num_seqs):
        what = f"q {q_lens} kv {kv_lens}"
        kv, pi, cu, dist = metadata(rng, q_lens, kv_lens, dist, page_size, num_seqs)
        ckv, kpe = poison(*caches(rng, page_size, num_seqs=num_seqs), kv, pi, cu, dist, page_size)
        qn, qp, nc, npe = new_rows(rng, heads, num_tokens=num_tokens)
        o, ckv_out, kpe_out = call(qn, qp, nc, npe, ckv, kpe, kv, pi, cu, dist)
        want_ckv, want_kpe = expected_caches(ckv, kpe, nc, npe, kv, pi, cu, dist, page_size)
        np.testing.assert_array_equal(_bits(ckv_out), _bits(want_ckv), err_msg=what)
        np.testing.assert_array_equal(_bits(kpe_out), _bits(want_kpe), err_msg=what)
        o = np.asarray(o)
        assert np.all(np.isfinite(o)), what
        want = oracle(qn, qp, want_ckv, want_kpe, kv, pi, cu, dist, page_size, causal)
        np.testing.assert_allclose(o, want, atol=2e-4, rtol=2e-4, err_msg=what)
        assert np.all(o[cu[dist[2]]:] == 0), what
    assert len(traces) == 1
