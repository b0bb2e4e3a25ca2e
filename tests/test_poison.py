"""No stale slot reaches an output, on every dispatch row (jaxinfer/dispatch.py IMPLEMENTATIONS and
ragged_long_impl) and both lowerings (Pallas Triton and Mosaic GPU, each in its interpreter).

Each test fills K and V, in a copy of a random cache, with poison:
  (a) the slots past kv_len in each request's last page,
  (b) the pages no request lists (ragged_paged_attention: page_indices' entries past each
      sequence's pages, and those of the sequences past distribution[2], point at them),
  (c) the padding rows of q, where the API has them (rows past the step's tokens under
      max_num_tokens / max_batch_size; ragged_paged_attention: queries, keys and values from
      cu_q_lens[distribution[2]] on),
then runs the kernel on the poisoned cache and checks, request by request, that every output row
is finite and equals jaxinfer.reference computed on the CLEAN cache (the poisoned slots holding
their random values), lse too where the API returns it. Rows that see no key (kv_len 0, causal
rows before a request's first key) must give o = 0, lse = -inf, and so must padding rows.

Poisons: "nan_inf" (the default run) cycles NaN, +Inf and -Inf over the elements of every
poisoned slot and row, so one kernel call covers all three; "nan" and "inf" (+Inf / -Inf) alone
run under -m slow, to tell them apart when the default case fails.

tests/test_safety.py already has float32 NaN tests (unlisted pages and last-page tails, no
capacities) of decode_triton, prefill_triton (paged, ragged, block-sparse) and the Triton cascade;
tests/test_batch_attention.py and tests/test_ragged_paged_attention.py poison unlisted pages (not
tails) of BatchAttention and ragged_paged_attention. This file adds, per dispatch row: Inf,
last-page tails, padding rows, the fused decode append, decode's cascade="auto", prefill_short,
and the Mosaic rows (bfloat16, one query head and one cell: the Mosaic interpreter takes 15-30 s
of CPU per call even so). Every row runs by default; variants of a row that runs by default
(prefill_triton not causal, the (k, v) pair append, MultiLevelCascadeAttention under capacities,
BatchAttention on the Triton kernels, ragged_paged_attention on the Mosaic kernels) run under
-m slow.
"""
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from helpers import TOL, page_table, randn, random_cache, zero_written_tails
from jaxinfer import _backend, dispatch, ragged_plan
from pallas_kernels import prefill as prefill_kernels
from jaxinfer import reference as ref

HQ, HKV, D = 4, 2, 32               # Triton rows: float32, GQA group 2
# Mosaic rows: bfloat16, NHD, page_size 8, one query head (the interpreter costs seconds per grid
# point and warpgroup); head_dim 128 takes the kernels' two-warpgroup default (64 takes three)
MQ, MKV, MD, MPAGE = 1, 1, 128, 8
PATTERNS = {"nan_inf": (np.nan, np.inf, -np.inf), "nan": (np.nan,), "inf": (np.inf, -np.inf)}
poisons = pytest.mark.parametrize("poison", ["nan_inf"] + [
    pytest.param(p, marks=pytest.mark.slow) for p in ("nan", "inf")])


def _indptr(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _fill(x, idx, values):
    """x[idx] = values cycled over its elements (in place; x a host array)."""
    n = x[idx].size
    x[idx] = np.resize(np.asarray(values, np.float32), n).reshape(x[idx].shape).astype(x.dtype)


def _poison(cache, indptr, indices, last, values, *, also=()):
    """A copy of cache with poison in K and V of (a) every slot past kv_last_page_len in each
    request's last page and (b) every page the table does not list; `also`: more (page, slot)
    pairs (stale slots an append overwrites). The clean cache is left as it is."""
    k, v = np.array(cache.k_pages), np.array(cache.v_pages)
    nhd = cache.layout == "NHD"
    unlisted = np.setdiff1d(np.arange(cache.num_pages), indices[: indptr[-1]])
    idx = [(unlisted,)]
    for b in range(len(indptr) - 1):
        if indptr[b + 1] > indptr[b]:
            page = indices[indptr[b + 1] - 1]
            idx.append((page, slice(last[b], None)) if nhd else (page, slice(None), slice(last[b], None)))
    idx += [(page, slot) if nhd else (page, slice(None), slot) for page, slot in also]
    for i in idx:
        _fill(k, i, values)
        _fill(v, i, values)
    return ji.PagedKVCache(jnp.asarray(k), jnp.asarray(v), cache.layout)


def _padded_q(rng, nnz, rows, heads, d, dtype, values):
    """q of `rows` rows: nnz random ones, then padding rows holding poison."""
    q = np.array(randn(rng, (rows, heads, d), dtype))
    _fill(q, slice(nnz, None), values)
    return jnp.asarray(q)


def _check(o, lse, want, qo_indptr, tol, what):
    """o (and lse, if given) against the reference state `want` of the step's nnz rows, request by
    request; rows past nnz are padding (o = 0, lse = -inf)."""
    o = np.asarray(o, np.float32)
    wo, wl = np.asarray(want.o, np.float32), np.asarray(want.lse, np.float32)
    nnz, batch = int(qo_indptr[-1]), len(qo_indptr) - 1
    finite = np.isfinite(o).all(axis=(1, 2))
    bad = [b for b in range(batch) if not finite[qo_indptr[b]:qo_indptr[b + 1]].all()]
    assert not bad, (f"{what}: non-finite o in requests {bad}: rows "
                     f"{np.flatnonzero(~finite[:nnz]).tolist()} of {nnz}")
    pad_bad = np.flatnonzero(np.any(o[nnz:] != 0, axis=(1, 2))) + nnz
    assert not pad_bad.size, f"{what}: padding rows {pad_bad.tolist()} are not 0"
    if lse is not None:
        lse = np.asarray(lse, np.float32)
        assert not (np.isnan(lse).any() or np.isposinf(lse).any()), (
            f"{what}: lse NaN / +inf at rows {np.flatnonzero((np.isnan(lse) | np.isposinf(lse)).any(1)).tolist()}")
        assert np.all(np.isneginf(lse[nnz:])), f"{what}: padding rows' lse is not -inf"
    for b in range(batch):
        rows = slice(qo_indptr[b], qo_indptr[b + 1])
        if qo_indptr[b + 1] == qo_indptr[b]:
            continue
        seen = np.isfinite(wl[rows])  # [qo, Hq]: (row, head) pairs that see some key
        got, want_o = o[rows], wo[rows]
        assert np.all(got[~seen] == 0), f"{what}: request {b}: rows that see no key are not 0"
        if lse is not None:
            assert np.all(np.isneginf(lse[rows][~seen])), f"{what}: request {b}: rows that see no key: lse"
            np.testing.assert_allclose(lse[rows][seen], wl[rows][seen], rtol=tol, atol=tol,
                                       err_msg=f"{what}: request {b}: lse")
        if seen.any():
            err = np.linalg.norm(got[seen] - want_o[seen]) / max(np.linalg.norm(want_o[seen]), 1e-30)
            assert err < tol, f"{what}: request {b}: relative error {err:.3g}"


def _case(rng, kv, page, hkv, d, dtype, layout="NHD"):
    """(page table (indptr, indices, last), num_pages, clean cache): random pages, 4 unlisted."""
    indptr, indices, last, num_pages = page_table(rng, np.asarray(kv), page, extra_pages=4)
    return (indptr, indices, last), num_pages, random_cache(rng, num_pages, page, hkv, d, dtype, layout)


# ---------------------------------------------------------------- decode_triton
@poisons
@pytest.mark.parametrize("row", ["decode_triton"])
def test_decode(rng, row, poison):
    """decode_triton: BatchDecodeWithPagedKVCache, HND, split KV, max_batch_size 8 over 6 requests
    (one of kv_len 0: no key)."""
    values, page, cap = PATTERNS[poison], 8, 8
    kv = np.array([1, 37, 300, 0, 64, 9])
    table, num_pages, clean = _case(rng, kv, page, HKV, D, jnp.float32, "HND")
    bad = _poison(clean, *table, values)
    dec = ji.BatchDecodeWithPagedKVCache(HQ, HKV, D, page, layout="HND", num_ctas=8, max_batch_size=cap,
                                         max_num_pages=64)
    plan = dec.plan(*table, num_pages=num_pages)
    assert plan.impl == row and plan.info["num_split"] > 0  # the 300-key request's KV is split
    q = _padded_q(rng, len(kv), cap, HQ, D, jnp.float32, values)
    o, lse = dec.run(q, bad, plan, return_lse=True)
    want = ref.decode(q[: len(kv)], clean, *table)
    _check(o, lse, want, np.arange(len(kv) + 1), TOL[jnp.float32], "decode_triton")


@poisons
@pytest.mark.parametrize("row, append", [pytest.param("decode_triton", "pair", marks=pytest.mark.slow),
                                         ("decode_triton", "from_q")])
def test_decode_fused_append(rng, row, append, poison):
    """decode_triton with run(..., append_kv=): the slot each request appends to (position kv_len
    - 1) holds poison before the call (a stale slot), as do the tails and unlisted pages; padding
    rows (kv_len 0 under max_batch_size) hold it in q and in the new K/V, and write nothing.
    append_kv="from_q" (the new K/V read in place from q's extra heads) by default; the (k, v)
    pair, the same kernel and slots, under -m slow."""
    values, page, b, cap = PATTERNS[poison], 8, 5, 8
    kv = np.array([1, 37, 300, 8, 17])
    (indptr, indices, last), num_pages, clean = _case(rng, kv, page, HKV, D, jnp.float32)
    slots = [(indices[indptr[i] + (kv[i] - 1) // page], (kv[i] - 1) % page) for i in range(b)]
    bad = _poison(clean, indptr, indices, last, values, also=slots)
    new_k, new_v = (np.array(randn(rng, (cap, HKV, D), jnp.float32)) for _ in "kv")
    _fill(new_k, slice(b, None), values)
    _fill(new_v, slice(b, None), values)
    want_k, want_v = np.array(clean.k_pages), np.array(clean.v_pages)  # clean, with the new rows
    out_k, out_v = np.array(bad.k_pages), np.array(bad.v_pages)        # poisoned, with the new rows
    for i, (pg, slot) in enumerate(slots):
        want_k[pg, slot], want_v[pg, slot] = new_k[i], new_v[i]
        out_k[pg, slot], out_v[pg, slot] = new_k[i], new_v[i]
    dec = ji.BatchDecodeWithPagedKVCache(HQ, HKV, D, page, num_ctas=8, max_batch_size=cap, max_num_pages=64)
    plan = dec.plan(indptr, indices, last, num_pages=num_pages)
    assert plan.impl == row
    q = _padded_q(rng, b, cap, HQ, D, jnp.float32, values)
    if append == "pair":
        arg, q_in = (jnp.asarray(new_k), jnp.asarray(new_v)), q
    else:  # [B, Hq + 2 Hkv, D]: query heads, then the new key heads, then the new value heads
        arg, q_in = "from_q", jnp.concatenate([q, jnp.asarray(new_k), jnp.asarray(new_v)], axis=1)
    (o, lse), new_cache = dec.run(q_in, bad, plan, append_kv=arg, return_lse=True)
    np.testing.assert_array_equal(np.asarray(new_cache.k_pages), out_k)  # (NaN == NaN here)
    np.testing.assert_array_equal(np.asarray(new_cache.v_pages), out_v)
    want = ref.decode(q[:b], ji.PagedKVCache(jnp.asarray(want_k), jnp.asarray(want_v)), indptr, indices, last)
    _check(o, lse, want, np.arange(b + 1), TOL[jnp.float32], f"decode_triton append_kv={append}")


@poisons
@pytest.mark.parametrize("row", ["prefill_triton"])
def test_decode_cascade_auto(rng, row, poison, monkeypatch):
    """BatchDecodeWithPagedKVCache.plan(cascade="auto") (the cost model made to take it): a
    CascadePlan on prefill_triton, the shared prefix pages read once; max_batch_size padding."""
    from planner import prefix as prefix_planner
    monkeypatch.setattr(prefix_planner, "CASCADE_OVERHEAD_US", 0.0)
    monkeypatch.setattr(prefix_planner, "MARGIN", 1e9)
    values, page, b, cap = PATTERNS[poison], 4, 4, 6
    kv = np.array([30, 21, 17, 13])
    (indptr, indices, last), num_pages, clean = _case(rng, kv, page, HKV, D, jnp.float32)
    for i in range(1, b):  # every request starts with the same 3 pages
        indices[indptr[i]:indptr[i] + 3] = indices[:3]
    bad = _poison(clean, indptr, indices, last, values)
    dec = ji.BatchDecodeWithPagedKVCache(HQ, HKV, D, page, num_ctas=8, max_batch_size=cap, max_num_pages=64)
    plan = dec.plan(indptr, indices, last, num_pages=num_pages, cascade="auto")
    assert isinstance(plan, ji.CascadePlan) and {p.impl for p in plan.levels} == {row}, plan
    q = _padded_q(rng, b, cap, HQ, D, jnp.float32, values)
    o, lse = dec.run(q, bad, plan, return_lse=True)
    want = ref.decode(q[:b], clean, indptr, indices, last)
    _check(o, lse, want, np.arange(b + 1), TOL[jnp.float32],
           f"decode cascade='auto' ({'+'.join(p.impl for p in plan.levels)})")


# ---------------------------------------------------------------- prefill rows
PREFILL = {  # (qo_lens, kv_lens): qo 6 on kv 3 / 12 on 10: causal rows before the first key; kv 0: no key
    "prefill_triton": ([5, 0, 17, 6, 1, 2], [40, 9, 70, 3, 33, 0]),
    "prefill_short": ([4, 1, 0, 3, 6, 2], [70, 9, 5, 200, 3, 0]),
    "prefill_mosaic": ([12, 2, 0, 5], [10, 0, 9, 21]),
}


@poisons
@pytest.mark.parametrize("row, causal", [
    pytest.param("prefill_triton", True, id="prefill_triton-causal"),
    pytest.param("prefill_triton", False, id="prefill_triton-noncausal", marks=pytest.mark.slow),
    pytest.param("prefill_short", True, id="prefill_short-causal"),
    pytest.param("prefill_mosaic", True, id="prefill_mosaic-causal")])
def test_paged_prefill(rng, row, causal, poison):
    """BatchPrefillWithPagedKVCache under capacities (max_num_tokens: 4 padding rows): impl
    "triton", a short-only step (impl "auto": prefill_short, the decode kernel's multi-token
    items; max_num_tokens alone) and impl "mosaic" (its interpreter)."""
    values, mosaic = PATTERNS[poison], row == "prefill_mosaic"
    qo, kv = (np.array(x) for x in PREFILL[row])
    (hq, hkv, d), page, dtype = ((MQ, MKV, MD), MPAGE, jnp.bfloat16) if mosaic else ((HQ, HKV, D), 8, jnp.float32)
    table, num_pages, clean = _case(rng, kv, page, hkv, d, dtype)
    bad = _poison(clean, *table, values)
    qo_indptr = _indptr(qo)
    nnz, cap = int(qo.sum()), int(qo.sum()) + 4
    impl = {"prefill_triton": "triton", "prefill_short": "auto", "prefill_mosaic": "mosaic"}[row]
    # All three capacities pin one program (never the short path): prefill_short gets max_num_tokens only.
    caps = dict(max_num_tokens=cap) if row == "prefill_short" else dict(max_batch_size=8, max_num_tokens=cap,
                                                                         max_num_pages=64)
    pre = ji.BatchPrefillWithPagedKVCache(hq, hkv, d, page, causal=causal, impl=impl, num_ctas=1 if mosaic else 8,
                                          **caps)
    plan = pre.plan(qo_indptr, *table, num_pages=num_pages)
    assert plan.impl == row
    q = _padded_q(rng, nnz, cap, hq, d, dtype, values)
    o, lse = pre.run(q, bad, plan, return_lse=True)
    want = ref.paged_attention(q[:nnz], clean, qo_indptr, *table, causal=causal)
    _check(o, lse, want, qo_indptr, TOL[dtype], f"{row} causal={causal}")


@pytest.mark.slow  # by default: test_decode_cascade_auto (a CascadePlan on prefill_triton, padding rows,
@poisons           # NaN and Inf) and test_safety's MultiLevelCascadeAttention NaN test (tails, unlisted pages)
@pytest.mark.parametrize("row", ["prefill_triton"])
def test_cascade(rng, row, poison):
    """MultiLevelCascadeAttention (prefill_triton per level): a shared 3-page prefix level, then
    each request's own pages (causal), under capacities with 3 padding rows."""
    values, page = PATTERNS[poison], 4
    qo, kv = np.array([2, 3, 1, 4]), np.array([30, 21, 17, 14])
    (indptr, indices, last), num_pages, clean = _case(rng, kv, page, HKV, D, jnp.float32)
    for i in range(1, len(kv)):
        indices[indptr[i]:indptr[i] + 3] = indices[:3]
    bad = _poison(clean, indptr, indices, last, values)
    qo_indptr = _indptr(qo)
    levels, saved = ji.two_level_cascade(qo_indptr, indptr, indices, last, page)
    assert saved > 0
    nnz, cap = int(qo.sum()), int(qo.sum()) + 3
    cas = ji.MultiLevelCascadeAttention(2, HQ, HKV, D, page, num_ctas=8, max_batch_size=8, max_num_tokens=cap,
                                        max_num_pages=64)
    plan = cas.plan(levels, num_pages=num_pages)
    assert {p.impl for p in plan.levels} == {row}
    q = _padded_q(rng, nnz, cap, HQ, D, jnp.float32, values)
    o, lse = cas.run(q, bad, plan, return_lse=True)
    want = ref.paged_attention(q[:nnz], clean, qo_indptr, indptr, indices, last, causal=True)
    _check(o, lse, want, qo_indptr, TOL[jnp.float32], f"cascade ({'+'.join(p.impl for p in plan.levels)})")


# ---------------------------------------------------------------- BatchAttention
BATCH = {  # group 2 (Triton): up to 32 tokens are short; group 1 (Mosaic): up to 16
    "batch_classes": ([1, 0, 4, 40, 2, 6, 1], [300, 9, 64, 90, 0, 3, 17]),
    "batch_mosaic": ([1, 20, 0, 3, 6, 1], [30, 21, 9, 50, 3, 0]),
}


@poisons
@pytest.mark.parametrize("row", [pytest.param("batch_classes", marks=pytest.mark.slow), "batch_mosaic"])
def test_batch_attention(rng, row, poison, monkeypatch):
    """BatchAttention under capacities (5 padding rows): impl "auto" (batch_classes:
    decode_triton for the short requests, prefill_triton for the long one) and impl "mixed"
    (batch_mosaic: one persistent Mosaic launch, plan(q_data_type="bfloat16"); one cell).
    batch_classes under -m slow: its two rows run poisoned by default in test_decode and
    test_paged_prefill, and BatchAttention's padding rows in batch_mosaic."""
    values, mosaic = PATTERNS[poison], row == "batch_mosaic"
    if mosaic:  # the mixed launch's grid is one cell per SM: one grid point for the interpreter
        monkeypatch.setattr(_backend, "num_sms", lambda default=132: 1)
    qo, kv = (np.array(x) for x in BATCH[row])
    (hq, hkv, d), page, dtype = ((MQ, MKV, MD), MPAGE, jnp.bfloat16) if mosaic else ((HQ, HKV, D), 8, jnp.float32)
    table, num_pages, clean = _case(rng, kv, page, hkv, d, dtype)
    bad = _poison(clean, *table, values)
    qo_indptr = _indptr(qo)
    nnz, cap = int(qo.sum()), int(qo.sum()) + 5
    # the mixed launch in 16-key blocks: items of up to 4 blocks through its 2 slots (the memory
    # warpgroup's loop, and a sanitized last page in its final block)
    config = prefill_kernels.MosaicPrefillConfig(block_kv=16) if mosaic else None
    attn = ji.BatchAttention(hq, hkv, d, page, impl="mixed" if mosaic else "auto", num_ctas=8, max_batch_size=8,
                             max_num_tokens=cap, max_num_pages=64, config=config)
    plan = attn.plan(qo_indptr, *table, num_pages=num_pages, q_data_type="bfloat16" if mosaic else None)
    assert plan.impl == ("batch_mosaic" if mosaic else "decode_triton+prefill_triton")
    assert plan.info["num_short"] >= 3  # short requests beside the long one (packed tiles when mixed)
    q = _padded_q(rng, nnz, cap, hq, d, dtype, values)
    o, lse = attn.run(q, bad, plan, return_lse=True)
    want = ref.paged_attention(q[:nnz], clean, qo_indptr, *table, causal=True)
    _check(o, lse, want, qo_indptr, TOL[dtype], f"{row} ({plan.impl})")


# ---------------------------------------------------------------- ragged_paged_attention
def _rpa_step(rng, q_lens, cached, dist, *, page, heads, dtype, tok_cap, values):
    """A ragged_paged_attention step over a poisoned cache. Sequence i < dist[2] has q_len
    q_lens[i] and kv_len cached[i] + q_lens[i]; one sequence slot more is padding. Returns (args,
    the cache the step must leave: the poisoned one with the new rows and V zeroed past each
    written sequence's kv_len, the clean cache so, the CSR table of the valid sequences)."""
    hq, hkv, d = heads
    q_lens, kv = np.asarray(q_lens), np.asarray(cached) + np.asarray(q_lens)
    n, seqs = len(q_lens), len(q_lens) + 1
    npages = -(-kv // page)
    pages_per_seq = int(npages.max()) + 1
    num_pages = int(npages.sum()) + 4
    perm = rng.permutation(num_pages).astype(np.int32)
    first = _indptr(npages)
    page_indices = np.resize(perm[first[-1]:], seqs * pages_per_seq).astype(np.int32)  # unlisted pages
    for i in range(n):
        page_indices[i * pages_per_seq: i * pages_per_seq + npages[i]] = perm[first[i]:first[i + 1]]
    clean = random_cache(rng, num_pages, page, hkv, d, dtype)
    last = (kv - (npages - 1) * page).astype(np.int32)
    bad = _poison(clean, first, perm, last, values)
    cu = np.full(seqs + 1, q_lens.sum(), np.int32)
    cu[: n + 1] = _indptr(q_lens)
    kv_lens = np.zeros(seqs, np.int32)
    kv_lens[:n] = kv
    q, k, v = (np.array(randn(rng, (tok_cap, h, d), dtype)) for h in (hq, hkv, hkv))
    for x in (q, k, v):
        _fill(x, slice(int(cu[n]), None), values)
    caches = []
    for base in (bad, clean):  # the new rows land at positions kv - q_len .. kv - 1
        ck, cv = np.array(base.k_pages), np.array(base.v_pages)
        for i in range(n):
            for j in range(q_lens[i]):
                p = kv[i] - q_lens[i] + j
                pg = page_indices[i * pages_per_seq + p // page]
                ck[pg, p % page], cv[pg, p % page] = k[cu[i] + j], v[cu[i] + j]
        zero_written_tails(cv, "NHD", _indptr(q_lens), first, perm, last)
        caches.append(ji.PagedKVCache(jnp.asarray(ck), jnp.asarray(cv)))
    args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), bad, jnp.asarray(kv_lens), jnp.asarray(page_indices),
            jnp.asarray(cu), jnp.asarray(dist, jnp.int32))
    return args, caches[0], caches[1], (cu[: n + 1], first, perm[: first[-1]], last)


RPA = {  # impl: (q_lens, cached, distribution, tok_cap): decode rows first; 6-8 padding rows
    # group 2: q_len <= 8 on 16-row decode tiles, 9..16 on 32-row ones, longer on prefill_triton
    "triton": ([1, 1, 0, 4, 37, 12, 3], [700, 8, 5, 60, 20, 0, 129], (2, 2, 7), 64),
    # group 1: q_len <= 16 on the decode kernel, longer on the Mosaic kernel (the class's base)
    "mosaic": ([1, 0, 4, 20], [30, 5, 10, 5], (1, 1, 4), 32),
    # the mixed launch: 20 a query tile, 1 / 4 / 1 packed tiles (or the decode class), padding tiles
    "mixed": ([1, 0, 4, 20, 1], [30, 5, 10, 5, 0], (1, 1, 5), 32),
}


@poisons
@pytest.mark.parametrize("impl, row", [
    ("triton", "prefill_triton"),
    pytest.param("mosaic", "prefill_mosaic", marks=pytest.mark.slow),  # (test_paged_prefill covers the kernel)
    pytest.param("mixed", "batch_mosaic", marks=pytest.mark.slow)])
def test_ragged_paged_attention(rng, impl, row, poison):
    """ragged_paged_attention, impl "triton" (prefill_triton), "mosaic" (prefill_mosaic) and "mixed"
    (batch_mosaic), one cell for the Mosaic ones: outputs against the reference on the clean cache,
    the cache written exactly (the poison elsewhere unchanged), padding rows 0 and written nowhere."""
    values, mosaic = PATTERNS[poison], impl != "triton"
    q_lens, cached, dist, tok_cap = RPA[impl]
    heads, page, dtype = ((MQ, MKV, MD), MPAGE, jnp.bfloat16) if mosaic else ((HQ, HKV, D), 8, jnp.float32)
    args, want_cache, clean, table = _rpa_step(rng, q_lens, cached, dist, page=page, heads=heads, dtype=dtype,
                                               tok_cap=tok_cap, values=values)
    num_ctas = 1 if mosaic else 8
    hq, hkv, d = heads
    problem = dispatch.Problem("prefill", hq, hkv, d, "paged", page)
    assert dispatch.ragged_long_impl(problem, impl, dtype, dtype, False, 0.1).name == row
    if impl == "mosaic":  # the long sequence (20 tokens) is on the Mosaic class
        base = ragged_plan.classes(tok_cap, len(q_lens) + 1, 1, hq // hkv, mosaic_cells=1)[0]
        assert base.mosaic and base.min_q <= 20
    if impl == "mixed":  # ... and a query tile of the mixed launch
        assert ragged_plan.mixed_sizes(tok_cap, len(q_lens) + 1, hq // hkv, 128, 1).long_min <= 20
    out, new_cache = ji.ragged_paged_attention(*args, num_ctas=num_ctas, impl=impl)
    for got, want in ((new_cache.k_pages, want_cache.k_pages), (new_cache.v_pages, want_cache.v_pages)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    nnz = int(table[0][-1])
    want = ref.paged_attention(args[0][:nnz], clean, *table, causal=True)
    _check(out, None, want, table[0], TOL[dtype], f"ragged_paged_attention impl={impl}")
