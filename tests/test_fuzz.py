"""Fuzz the bad-input contract (docs/safety.md): random VALID inputs for every entry point, then
one random corruption each. A case passes when it raises ValueError / TypeError, or, when the
corruption left the input valid (duplicated page ids, batch 0, qo_len 0, NaN / Inf in one
request's q, ...), when its outputs equal jaxinfer.reference (NaN rows: every other request's
rows). Every paged case also fills the pages it does not list with NaN, so a read outside a
request's page list shows up as NaN.

Shapes are tiny and fixed (wrapper capacities), so each entry point compiles its kernels once
and most cases stop at plan() or at trace time. The reference is jaxinfer.reference.attention
over the whole step with a block-diagonal mask, padded to one shape (one compilation).

Edges on purpose: with probability EDGE_SHARE a valid case of an entry point with ragged q draws its
query lengths at the boundaries of the planners and dispatch (b - 1, b, b + 1 of the short/long
cut, the SHORT_TOKENS choices, the tile heights, ragged_paged_attention's q_len classes and
dispatch's flips: test_boundary.edge_classes, derived from their constants), with key lengths at
page edges. BatchAttention's edge cases, and GROUP1_SHARE of the paged prefill wrapper's, run
group 1 (Hq == Hkv: HQ1 query heads over the same cache; one more program each).
Fuzzer.drawn counts the edge lengths that ran, by (group, boundary kind); Fuzzer.rpa_options the
ragged_paged_attention options that valid steps ran with (in turn: each of them in every run).
"""
import collections
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer import reference as ref
from planner import batch as batch_planner
from helpers import zero_written_tails
from test_boundary import edge_classes

HQ, HKV, D, P, NP = 4, 2, 16, 4, 16     # heads, head_dim, page size, cache pages
MAXB, MAXT, MAXPG = 4, 40, 16           # capacities: requests, query tokens, listed pages
TCAP, KCAP = MAXT, 96                   # reference padding: query rows, key rows
KTOT = 24                               # ragged prefill: K/V rows (fixed: plans specialize on it)
BSR_M, BSR_N, BSR_R, BSR_C, BSR_PER_ROW = 16, 32, 2, 4, 3
ATOL = 2e-5
VALID_SHARE = 0.3                       # cases whose input stays valid (they run kernels)
EDGE_SHARE = 0.6                        # valid cases with ragged q: lengths at the boundaries
RPA_OPTIONS = ("plain", "read", "no_write", "non_causal")  # how a valid ragged_paged_attention step runs
GROUP1_SHARE = 0.5                      # edge cases of the paged prefill wrapper: group 1
HQ1 = HKV                               # group 1: one query head per KV head (same cache)
EDGE_KINDS = ("short_cut", "short_tokens", "tile_rows", "ragged_class", "dispatch")
MH, DC, DR, MLA_SCALE = 4, 16, 16, 0.3   # MLA: heads, latent (ckv) and rope (kpe) widths, sm_scale
MLA_CELLS = 4                           # the MLA kernels' grid
ERRORS = (ValueError, TypeError)


class Silent(AssertionError):
    """A corrupted input that ran without an error (a silent wrong result)."""


def i32(x):
    return np.asarray(x, np.int32)


def randn(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


@jax.jit
def _ref_attention(q, k, v, mask):
    return ref.attention(q, k, v, mask=mask)


def ref_ragged(q, k, v, qo_indptr, kv_indptr, causal, mask=None):
    """jaxinfer.reference over a ragged step: one masked call (block-diagonal, causal bottom-right)
    padded to [TCAP] x [KCAP]. q [T, HQ, D], k/v [K, HKV, D] host arrays -> (o [T,HQ,D], lse [T,HQ])."""
    t, kk = q.shape[0], k.shape[0]
    full = np.zeros((TCAP, KCAP), bool)
    for b in range(len(qo_indptr) - 1):
        qs, qe, ks, ke = qo_indptr[b], qo_indptr[b + 1], kv_indptr[b], kv_indptr[b + 1]
        qo, kv = qe - qs, ke - ks
        vis = np.ones((qo, kv), bool)
        if causal:
            vis &= np.arange(kv)[None, :] <= np.arange(qo)[:, None] + kv - qo
        full[qs:qe, ks:ke] = vis
    if mask is not None:
        full[:t, :kk] = mask
    pad = lambda x, n: np.concatenate([x, np.zeros((n - x.shape[0],) + x.shape[1:], np.float32)])
    o, lse = _ref_attention(pad(q, TCAP), pad(k, KCAP), pad(v, KCAP), full)
    return np.asarray(o)[:t], np.asarray(lse)[:t]


def ref_rpa_rows(q, k_pages, v_pages, page_indices, kv, read, cu, n_valid, causal):
    """ragged_paged_attention's rows in float64 NumPy: row j of sequence i (position kv - q_len +
    j) sees keys below min(position + 1, read[i]) (causal) or read[i]. Returns (o [rows, HQ, D],
    lse [rows, HQ]: natural log, -inf where a row sees no key, with o 0)."""
    rows = int(cu[n_valid])
    o, lse = np.zeros((rows, HQ, D)), np.full((rows, HQ), -np.inf)
    group = HQ // HKV
    for i in range(n_valid):
        q_len = cu[i + 1] - cu[i]
        pages = page_indices[i, :-(-kv[i] // P)]
        keys = k_pages[pages].reshape(-1, HKV, D)[:kv[i]].astype(np.float64)
        values = v_pages[pages].reshape(-1, HKV, D)[:kv[i]].astype(np.float64)
        for j in range(q_len):
            end = min(kv[i] - q_len + j + 1, read[i]) if causal else read[i]
            if end <= 0:
                continue
            for h in range(HQ):
                logits = keys[:end, h // group] @ q[cu[i] + j, h].astype(np.float64) / np.sqrt(D)  # [end]
                top = logits.max()
                w = np.exp(logits - top)
                o[cu[i] + j, h] = w @ values[:end, h // group] / w.sum()
                lse[cu[i] + j, h] = top + np.log(w.sum())
    return o, lse


def ref_mla(q_nope, q_pe, ckv, kpe, seqs, causal):
    """MLA in float64 NumPy over flat latent caches ckv [NP * P, DC], kpe [NP * P, DR]: seqs lists
    (q_start, q_end, cache rows [n]) per request; logits = MLA_SCALE (q_nope ckv + q_pe kpe), v =
    ckv, causal bottom-right. Returns (o [T, MH, DC], lse [T, MH]): rows of no request and rows
    that see no key give 0 and -inf."""
    qn, qp = np.asarray(q_nope, np.float64), np.asarray(q_pe, np.float64)
    c_all, r_all = np.asarray(ckv, np.float64), np.asarray(kpe, np.float64)
    o, lse = np.zeros(qn.shape), np.full(qn.shape[:2], -np.inf)
    for qs, qe, rows in seqs:
        n = len(rows)
        for i in range(qe - qs):
            end = min(n, n - (qe - qs) + i + 1) if causal else n
            if end <= 0:
                continue
            logits = (qn[qs + i] @ c_all[rows[:end]].T + qp[qs + i] @ r_all[rows[:end]].T) * MLA_SCALE  # [MH, end]
            top = logits.max(-1, keepdims=True)
            w = np.exp(logits - top)
            o[qs + i] = w @ c_all[rows[:end]] / w.sum(-1, keepdims=True)
            lse[qs + i] = top[:, 0] + np.log(w.sum(-1))
    return o, lse


def gather(cache_np, kv_indptr, kv_indices, last):
    """Host K/V rows of each request's pages (in list order) and their token indptr."""
    ks, vs, lens = [], [], []
    for b in range(len(kv_indptr) - 1):
        pages = kv_indices[kv_indptr[b]:kv_indptr[b + 1]]
        n = 0 if len(pages) == 0 else (len(pages) - 1) * P + int(last[b])
        ks.append(cache_np[0][pages].reshape(-1, HKV, D)[:n])
        vs.append(cache_np[1][pages].reshape(-1, HKV, D)[:n])
        lens.append(n)
    empty = [np.zeros((0, HKV, D), np.float32)]
    return np.concatenate(ks + empty), np.concatenate(vs + empty), i32(np.concatenate([[0], np.cumsum(lens)]))


def close(got, want, rows=None, what="o"):
    """Outputs equal the reference (lse: same -inf pattern) on `rows` (default: all)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if rows is not None:
        got, want = got[rows], want[rows]
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=what)
    fin = np.isfinite(want)
    assert np.all(np.isfinite(got[fin])), f"{what}: non-finite where the reference is finite"
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-4, atol=ATOL, err_msg=what)


def rejected(thunk, names=()):
    """The call must raise ValueError / TypeError (naming each of `names` in the message)."""
    try:
        thunk()
    except ERRORS as e:
        for n in names:
            assert n in str(e), f"error does not name {n!r}: {e}"
        return "rejected"
    raise Silent("corrupted input ran without an error")


def table(rng, batch, max_pages=MAXPG, zero_len=True):
    """A random valid CSR page table over distinct pages of the NP-page cache: (indptr, indices,
    last, kv_lens). Some requests may have no pages (zero_len)."""
    npg = rng.integers(0 if zero_len else 1, 5, batch)
    while npg.sum() > max_pages:
        npg[np.argmax(npg)] -= 1
    indptr = i32(np.concatenate([[0], np.cumsum(npg)]))
    indices = i32(rng.permutation(NP)[: indptr[-1]])
    last = i32(np.where(npg > 0, rng.integers(1, P + 1, batch), rng.integers(0, P + 2, batch)))
    kv_lens = np.where(npg > 0, (npg - 1) * P + last, 0)
    return indptr, indices, last, kv_lens


def poisoned_cache(rng, listed):
    """A float32 NHD cache (host copy too) whose unlisted pages hold NaN."""
    k, v = randn(rng, (NP, P, HKV, D)), randn(rng, (NP, P, HKV, D))
    unlisted = np.setdiff1d(np.arange(NP), listed)
    k[unlisted], v[unlisted] = np.nan, np.nan
    return ji.PagedKVCache(jnp.asarray(k), jnp.asarray(v)), (k, v)


# ---------------------------------------------------------------- paged-table corruptions
TABLE_BAD = ("page_oob", "page_neg", "indptr_nonmono", "indptr_start", "last_zero", "last_big",
             "int64_indptr", "list_indptr", "float_indices", "indices_short", "last_shape",
             "num_pages_missing", "num_pages_small")


def corrupt_table(rng, corr, indptr, indices, last, num_pages):
    """Applies a TABLE_BAD corruption (or dup_pages, valid). Returns (indptr, indices, last,
    num_pages, names the error must mention) or None when the table has nothing to corrupt."""
    indptr, indices, last = indptr.copy(), indices.copy(), last.copy()
    listed, batch = int(indptr[-1]), len(last)
    has_pages = np.flatnonzero(np.diff(indptr) > 0)
    names = ()
    if corr in ("page_oob", "page_neg", "dup_pages", "indices_short", "num_pages_small") and listed == 0:
        return None
    if corr in ("last_zero", "last_big") and not len(has_pages):
        return None
    if corr == "indptr_nonmono" and batch < 1:
        return None
    if corr == "page_oob":
        indices[rng.integers(listed)] = num_pages + rng.integers(0, 3)
    elif corr == "page_neg":
        indices[rng.integers(listed)] = -rng.integers(1, 4)
    elif corr == "dup_pages":
        indices[rng.integers(listed)] = indices[rng.integers(listed)]
    elif corr == "indptr_nonmono":
        b = rng.integers(1, batch + 1)
        indptr[b] = indptr[b - 1] - rng.integers(1, 3)
        names = ("kv_indptr",)
    elif corr == "indptr_start":
        indptr = indptr + 1
        names = ("kv_indptr",)
    elif corr == "last_zero":
        last[rng.choice(has_pages)] = 0
        names = ("kv_last_page_len",)
    elif corr == "last_big":
        last[rng.choice(has_pages)] = P + rng.integers(1, 4)
        names = ("kv_last_page_len",)
    elif corr == "int64_indptr":
        indptr = indptr.astype(np.int64)
        names = ("kv_indptr", "int32")
    elif corr == "list_indptr":
        indptr = indptr.tolist()
        names = ("kv_indptr", "int32")
    elif corr == "float_indices":
        indices = indices.astype(np.float32)
        names = ("kv_indices",)
    elif corr == "indices_short":
        indices = indices[: listed - 1]
        names = ("kv_indices",)
    elif corr == "last_shape":
        last = np.concatenate([last, i32([1])])
        names = ("kv_last_page_len",)
    elif corr == "num_pages_missing":
        num_pages = None
        names = ("num_pages",)
    elif corr == "num_pages_small":
        num_pages = int(indices[:listed].max())
        if num_pages == 0:
            return None
    return indptr, indices, last, num_pages, names


# run()-time corruptions shared by the paged wrappers
RUN_BAD = ("q_f64", "q_f16", "q_rows", "q_heads", "q_list", "cache_heads", "cache_page_size",
           "cache_layout", "cache_small", "plan_bigger_cache", "plan_other_wrapper")


def corrupt_run(rng, corr, q, cache, plan, other_plan, bigger_plan):
    """Returns (q, cache, plan) with a RUN_BAD corruption applied."""
    if corr == "q_f64":
        q = np.asarray(q, np.float64)
    elif corr == "q_f16":
        q = q.astype(jnp.float16)
    elif corr == "q_rows":
        q = q[:-1]
    elif corr == "q_heads":
        q = q[:, :-1]
    elif corr == "q_list":
        q = np.asarray(q).tolist()
    elif corr == "cache_heads":
        cache = ji.PagedKVCache(cache.k_pages[:, :, :1], cache.v_pages[:, :, :1])
    elif corr == "cache_page_size":
        cache = ji.PagedKVCache(cache.k_pages[:, :2], cache.v_pages[:, :2])
    elif corr == "cache_layout":
        cache = ji.PagedKVCache(cache.k_pages.swapaxes(1, 2), cache.v_pages.swapaxes(1, 2), "HND")
    elif corr == "cache_small":
        cache = ji.PagedKVCache(cache.k_pages[: NP // 2], cache.v_pages[: NP // 2])
    elif corr == "plan_bigger_cache":
        plan = bigger_plan
    elif corr == "plan_other_wrapper":
        plan = other_plan
    return q, cache, plan


# ---------------------------------------------------------------- the fuzzer
class Fuzzer:
    """Wrappers and jitted runs built once (fixed capacities: one compilation per entry point)."""

    def __init__(self):
        caps = dict(max_batch_size=MAXB, max_num_pages=MAXPG)
        self.dec = ji.BatchDecodeWithPagedKVCache(HQ, HKV, D, P, num_ctas=4, **caps)
        self.dec_nocap = ji.BatchDecodeWithPagedKVCache(HQ, HKV, D, P, num_ctas=4)
        self.dec_other = ji.BatchDecodeWithPagedKVCache(HQ, HKV, D, 2 * P, num_ctas=4, **caps)
        pcaps = dict(caps, max_num_tokens=MAXT, tile_rows=16, num_ctas=4)
        # impl="triton": one program (impl="auto" may pick prefill_short, one program per token class)
        self.pre = ji.BatchPrefillWithPagedKVCache(HQ, HKV, D, P, impl="triton", **pcaps)
        self.pre_nocap = ji.BatchPrefillWithPagedKVCache(HQ, HKV, D, P, num_ctas=4)
        self.pre_other = ji.BatchPrefillWithPagedKVCache(2 * HQ, HKV, D, P, impl="triton", **pcaps)
        self.rag = ji.BatchPrefillWithRaggedKVCache(HQ, HKV, D, max_batch_size=MAXB, max_num_tokens=MAXT,
                                                    tile_rows=16, num_ctas=4)
        self.rag_nocap = ji.BatchPrefillWithRaggedKVCache(HQ, HKV, D, num_ctas=4)
        self.bsa = ji.BlockSparseAttention(HQ, HKV, D, num_ctas=4, tile_rows=16)
        self.cas = ji.MultiLevelCascadeAttention(2, HQ, HKV, D, P, max_num_tokens=MAXT, num_ctas=4, **caps)
        self.cas.prefill.tile_rows = 16  # one tile height for every level (one program), as pcaps
        self.ba = ji.BatchAttention(HQ, HKV, D, P, num_ctas=4, max_num_tokens=MAXT, **caps)
        self.ba_nocap = ji.BatchAttention(HQ, HKV, D, P, num_ctas=4)
        self.ba_other = ji.BatchAttention(HQ, HKV, D, P, num_ctas=4, max_num_tokens=MAXT + 1, **caps)
        self.pre1 = ji.BatchPrefillWithPagedKVCache(HQ1, HKV, D, P, impl="triton", **pcaps)  # group 1
        self.ba1 = ji.BatchAttention(HQ1, HKV, D, P, num_ctas=4, max_num_tokens=MAXT, **caps)
        lse = lambda w: jax.jit(lambda q, c, p: w.run(q, c, p, return_lse=True))
        self.run_pre, self.run_cas, self.run_ba = (lse(w) for w in (self.pre, self.cas, self.ba))
        self.run_pre1, self.run_ba1 = lse(self.pre1), lse(self.ba1)
        self.drawn = collections.Counter()  # (group, boundary kind) of the edge lengths that ran
        self.entry = None  # the entry point of the case running (fuzz() sets it)
        self.valid_turns = collections.Counter()  # valid cases drawn so far, by entry point
        mla_kw = dict(sm_scale=MLA_SCALE, config=ji.MLAConfig(num_cells=MLA_CELLS), max_num_tokens=MAXT, **caps)
        self.mla = ji.BatchMLAPagedAttention(MH, DC, DR, P, causal=True, **mla_kw)
        self.mla_other = ji.BatchMLAPagedAttention(MH, DC, DR, P, causal=False, **mla_kw)
        self.run_mla = jax.jit(lambda *args: self.mla.run(*args, return_lse=True))
        self.rpa_options = collections.Counter()  # RPA_OPTIONS that valid ragged_paged_attention steps ran
        # decode: one program, kv_lens always passed (the planned lengths unless a case shortens them)
        self.run_dec_lens = jax.jit(lambda q, c, p, n: self.dec.run(q, c, p, kv_lens=n, return_lse=True))
        self.run_dec = lambda q, c, p: self.run_dec_lens(q, c, p, p.kv_lens)
        self.run_rag = jax.jit(lambda q, k, v, p: self.rag.run(q, k, v, p, return_lse=True))
        self.run_bsa = jax.jit(lambda q, k, v, p: self.bsa.run(q, k, v, p, return_lse=True))
        self.single_decode = jax.jit(lambda q, k, v: ji.single_decode_with_kv_cache(q, k, v, return_lse=True))
        self.merge_state, self.ref_merge_state = jax.jit(ji.merge_state), jax.jit(ref.merge_state)
        self.merge_states, self.ref_merge_states = jax.jit(ji.merge_states), jax.jit(ref.merge_states)
        self.merge_state_varlen = jax.jit(ji.merge_state_varlen)
        self.append_jit = jax.jit(ji.append_paged_kv_cache)
        self.single_prefill = jax.jit(
            lambda q, k, v: ji.single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True))

    def edge_len(self, rng, group, hi, lo=1):
        """A query length in [lo, hi] at one of the group's boundaries (None if none fits)."""
        fits = [n for n in edge_classes(group) if lo <= n <= hi]
        return fits[rng.integers(len(fits))] if fits else None

    def count_edges(self, group, lengths):
        """Counts the lengths of an edge case that sit at a boundary, by kind (after the case ran)."""
        edges = edge_classes(group)
        for n in np.asarray(lengths).tolist():
            for kind in edges.get(n, ()):
                self.drawn[group, kind] += 1

    def edge_prefill(self, rng, group, batch):
        """qo_lens at the group's boundaries and a page table whose key lengths hold them (at page
        edges: qo, +1, + P - 1 or + P keys), within MAXT tokens and MAXPG pages."""
        qo, kv = np.zeros(batch, np.int64), np.zeros(batch, np.int64)
        tokens, pages = MAXT, MAXPG
        for b in range(batch):
            n = self.edge_len(rng, group, min(tokens, pages * P)) or 0
            k = min(n + (0, 1, P - 1, P)[rng.integers(4)], pages * P) if n else int(rng.integers(0, P + 2))
            k = min(k, pages * P)
            qo[b], kv[b] = n, k
            tokens, pages = tokens - n, pages - (-(-k // P))
        npg = -(-kv // P)
        indptr = i32(np.concatenate([[0], np.cumsum(npg)]))
        indices = i32(rng.permutation(NP)[: indptr[-1]])
        last = i32(np.where(npg > 0, kv - (npg - 1) * P, 1))
        return qo, (indptr, indices, last, kv)

    def pick(self, rng, corrs, valid=1):
        """A corruption (remembered for failure reports): with probability VALID_SHARE one of the
        first `valid` (those that leave the input valid and run kernels), in turn for the entry
        point (so that each of them runs: NaN in q, empty batches, ...), else a random other one."""
        if rng.random() < VALID_SHARE:
            turn = self.valid_turns[self.entry]
            self.valid_turns[self.entry] += 1
            self.corr = corrs[turn % valid]
        else:
            self.corr = corrs[valid + rng.integers(len(corrs) - valid)]
        return self.corr

    # -- paged wrappers: decode, prefill, BatchAttention ---------------------------------------
    PAGED_VALID = ("none", "dup_pages", "nan_q", "inf_q", "batch0", "batch0_nocap")

    def paged(self, rng, kind):
        """One case of BatchDecodeWithPagedKVCache ("decode"), BatchPrefillWithPagedKVCache
        ("prefill") or BatchAttention ("batch")."""
        extra = {"decode": ("kv_lens_over", "kv_lens_under", "kv_lens_int64"),
                 "prefill": ("qo_len0", "qo_gt_kv", "qo_indptr_batch", "qo_indptr_nonmono", "mask_size"),
                 "batch": ("qo_len0", "qo_indptr_batch", "qo_indptr_nonmono", "over_tokens")}[kind]
        valid = self.PAGED_VALID + tuple(e for e in extra if e in ("kv_lens_under", "qo_len0", "qo_gt_kv"))
        corr = self.pick(rng, valid + TABLE_BAD + RUN_BAD + tuple(e for e in extra if e not in valid), len(valid))
        batch = 0 if corr.startswith("batch0") else int(rng.integers(2 if kind == "batch" else 1, MAXB + 1))
        if kind == "batch" and corr == "qo_len0":
            batch = max(batch, 3)
        # Valid prefill / BatchAttention cases: query lengths at the boundaries (edge); BatchAttention's
        # in group 1 (one program more, as the prefill wrapper's group 1 cases: GROUP1_SHARE of its edges).
        edge = kind != "decode" and batch > 0 and corr in ("none", "dup_pages", "nan_q", "inf_q", "qo_len0") \
            and rng.random() < EDGE_SHARE
        group = 1 if edge and (kind == "batch" or rng.random() < GROUP1_SHARE) else HQ // HKV
        indptr, indices, last, kv_lens = table(rng, batch, zero_len=kind != "batch")
        if kind == "decode":
            qo_lens = np.ones(batch, np.int64)
        elif kind == "prefill" and edge:
            qo_lens, (indptr, indices, last, kv_lens) = self.edge_prefill(rng, group, batch)
        elif kind == "prefill":
            qo_lens = rng.integers(0, 8, batch)
            qo_lens = np.minimum(qo_lens, np.maximum(kv_lens, 1)) if corr != "qo_gt_kv" else kv_lens + rng.integers(1, 3, batch)
            while qo_lens.sum() > MAXT:
                qo_lens[np.argmax(qo_lens)] -= 1
        else:  # one short (1 token) and one long (> 16: prefill tiles) request, the rest 0 or 1
            qo_lens = rng.integers(0, 2, batch)
            if batch:
                qo_lens[:2] = 1, rng.integers(17, 32 - batch + 1)  # (<= 32 tokens: one tile height)
            if edge:  # the short one in the top short-token class (at or below the cut), the long one past it
                cap = batch_planner.short_cap(group)
                qo_lens[0] = self.edge_len(rng, group, cap, lo=cap // 2 + 1)
                qo_lens[1] = self.edge_len(rng, group, MAXT - qo_lens[0] - (batch - 2), lo=cap + 1)
            if corr == "qo_len0":
                qo_lens[2] = 0
            perm = rng.permutation(batch)
            qo_lens, (indptr, indices, last, kv_lens) = qo_lens[perm], _permute_table(indptr, indices, last, perm)
        if corr == "qo_len0" and kind == "prefill":
            qo_lens[rng.integers(batch)] = 0
        qo_indptr = i32(np.concatenate([[0], np.cumsum(qo_lens)]))
        wrapper = {"decode": self.dec, "prefill": self.pre, "batch": self.ba}[kind]
        if group == 1:
            wrapper = {"prefill": self.pre1, "batch": self.ba1}[kind]
        if corr == "batch0_nocap":
            wrapper = {"decode": self.dec_nocap, "prefill": self.pre_nocap, "batch": self.ba_nocap}[kind]

        if corr == "dup_pages":
            indptr, indices, last, _, _ = corrupt_table(rng, corr, indptr, indices, last, NP) or (
                indptr, indices, last, 0, 0)
        cache, cache_np = poisoned_cache(rng, indices)

        def plan(w, ip=indptr, idx=indices, ln=last, num_pages=NP, qi=qo_indptr, **kw):
            return w.plan(ip, idx, ln, num_pages=num_pages, **kw) if kind == "decode" else \
                w.plan(qi, ip, idx, ln, num_pages=num_pages, **kw)

        if corr in TABLE_BAD:
            bad = corrupt_table(rng, corr, indptr, indices, last, NP)
            if bad is None:
                return corr, "inapplicable"
            *t, num_pages, names = bad
            return corr, rejected(lambda: plan(wrapper, *t, num_pages=num_pages), names)
        if corr == "qo_indptr_batch":
            return corr, rejected(lambda: plan(wrapper, qi=qo_indptr[:-1]))
        if corr == "qo_indptr_nonmono":
            bad = qo_indptr.copy()
            bad[-1] = bad[-2] - 1
            return corr, rejected(lambda: plan(wrapper, qi=bad), ("qo_indptr",))
        if corr == "mask_size":
            n = int(np.sum(qo_lens * kv_lens)) + 1
            return corr, rejected(lambda: plan(wrapper, custom_mask=rng.random(n) < 0.5), ("custom_mask",))
        if corr == "over_tokens":
            return corr, rejected(lambda: plan(self.ba, qi=i32(list(qo_indptr[:-1]) + [MAXT + 1])))
        p = plan(wrapper)
        if corr == "batch0_nocap":
            rows = 0
        else:
            rows = MAXB if kind == "decode" else MAXT
        hq = HQ1 if group == 1 else HQ
        q = randn(rng, (rows, hq, D))
        if corr in RUN_BAD:
            other = {"decode": self.dec_other, "prefill": self.pre_other, "batch": self.ba_other}[kind]
            other_plan = _other_plan(rng, other, kind)
            bigger = plan(wrapper, num_pages=2 * NP)
            q, c, p = corrupt_run(rng, corr, jnp.asarray(q), cache, p, other_plan, bigger)
            run = {"decode": self.run_dec, "prefill": self.run_pre, "batch": self.run_ba}[kind]
            if corr == "q_f64":  # eager: jit casts float64 to float32 (x64 off)
                run = lambda q, c, p: wrapper.run(q, c, p)
            return corr, rejected(lambda: run(q, c, p), ("float64",) if corr == "q_f64" else ())
        if corr == "kv_lens_over":
            over = i32(np.concatenate([kv_lens, np.zeros(MAXB - batch)]))
            over[rng.integers(batch)] += rng.integers(1, 4)
            return corr, rejected(lambda: self.dec.run(jnp.asarray(q), cache, p, kv_lens=over), ("kv_lens",))
        if corr == "kv_lens_int64":
            return corr, rejected(lambda: self.dec.run(jnp.asarray(q), cache, p, kv_lens=np.zeros(MAXB, np.int64)),
                                  ("kv_lens",))
        # valid: run and compare
        k, v, tok_indptr = gather(cache_np, indptr, indices, last)
        causal = kind != "decode"
        if corr == "kv_lens_under":
            live = i32(np.concatenate([rng.integers(0, kv_lens + 1), np.zeros(MAXB - batch)]))
            keep = np.concatenate([np.arange(tok_indptr[b], tok_indptr[b] + live[b]) for b in range(batch)])
            k, v, tok_indptr = k[keep], v[keep], i32(np.concatenate([[0], np.cumsum(live[:batch])]))
            o, lse = self.run_dec_lens(jnp.asarray(q), cache, p, live)
        elif wrapper in (self.dec_nocap, self.pre_nocap, self.ba_nocap):
            o, lse = wrapper.run(jnp.asarray(q), cache, p, return_lse=True)
        else:
            bad_req = rng.integers(batch) if corr in ("nan_q", "inf_q") and batch else None
            q_in = q.copy()
            if bad_req is not None:
                q_in[qo_indptr[bad_req]:qo_indptr[bad_req + 1]] = np.nan if corr == "nan_q" else np.inf
            run = {"decode": self.run_dec, "prefill": self.run_pre, "batch": self.run_ba}[kind]
            if group == 1:
                run = {"prefill": self.run_pre1, "batch": self.run_ba1}[kind]
            o, lse = run(jnp.asarray(q_in), cache, p)
        t = int(qo_indptr[-1])
        assert o.shape == (rows, hq, D) and lse.shape == (rows, hq), (o.shape, lse.shape)
        want_o, want_lse = ref_ragged(q[:t], k, v, qo_indptr, tok_indptr, causal)
        keep = np.ones(t, bool)
        if corr in ("nan_q", "inf_q") and batch:
            keep[qo_indptr[bad_req]:qo_indptr[bad_req + 1]] = False
        close(o[:t], want_o, keep)
        close(lse[:t], want_lse, keep, "lse")
        if edge:
            self.count_edges(group, qo_lens)
        return corr, "matched" if corr not in ("nan_q", "inf_q") else "nan-isolated"

    # -- ragged prefill -------------------------------------------------------------------------
    def ragged(self, rng):
        corrs = ("none", "nan_q", "qo_len0", "kv_len0", "batch0_nocap", "kv_indptr_nonmono", "kv_indptr_start",
                 "int64_indptr", "list_indptr", "qo_indptr_batch", "k_short", "k_heads", "kv_dtype",
                 "q_f64", "q_rows", "k_v_mismatch", "plan_other_wrapper", "mask_size")
        corr = self.pick(rng, corrs, 5)
        batch = 0 if corr == "batch0_nocap" else int(rng.integers(1, MAXB + 1))
        kv_lens = rng.multinomial(KTOT, np.ones(batch) / batch) if batch else np.zeros(0, np.int64)
        if corr == "kv_len0" and batch > 1:  # one request without keys (the total stays KTOT)
            b = rng.integers(batch)
            kv_lens[(b + 1) % batch] += kv_lens[b]
            kv_lens[b] = 0
        qo_lens = np.minimum(rng.integers(0, 8, batch), np.maximum(kv_lens, 1))
        edge = batch > 0 and corr in ("none", "nan_q", "qo_len0") and rng.random() < EDGE_SHARE
        if edge:  # query lengths at the boundaries, each with at least as many of the KTOT keys
            for b in range(batch):
                qo_lens[b] = self.edge_len(rng, HQ // HKV, KTOT - int(qo_lens[:b].sum())) or 0
            kv_lens = qo_lens + rng.multinomial(KTOT - int(qo_lens.sum()), np.ones(batch) / batch)
        kv_indptr = i32(np.concatenate([[0], np.cumsum(kv_lens)]))
        if corr == "qo_len0" and batch:
            qo_lens[rng.integers(batch)] = 0
        qo_indptr = i32(np.concatenate([[0], np.cumsum(qo_lens)]))
        nk = KTOT if batch else 0
        k, v = randn(rng, (nk, HKV, D)), randn(rng, (nk, HKV, D))
        w = self.rag_nocap if batch == 0 else self.rag
        if corr == "kv_indptr_nonmono":
            bad = kv_indptr.copy()
            bad[-1] = bad[-2] - 1
            return corr, rejected(lambda: w.plan(qo_indptr, bad), ("kv_indptr",))
        if corr == "kv_indptr_start":
            return corr, rejected(lambda: w.plan(qo_indptr, kv_indptr + 1), ("kv_indptr",))
        if corr == "int64_indptr":
            return corr, rejected(lambda: w.plan(qo_indptr.astype(np.int64), kv_indptr), ("qo_indptr", "int32"))
        if corr == "list_indptr":
            return corr, rejected(lambda: w.plan(qo_indptr, kv_indptr.tolist()), ("kv_indptr", "int32"))
        if corr == "qo_indptr_batch":
            return corr, rejected(lambda: w.plan(qo_indptr[:-1], kv_indptr))
        if corr == "mask_size":
            n = int(np.sum(qo_lens * kv_lens)) + 1
            return corr, rejected(lambda: w.plan(qo_indptr, kv_indptr, custom_mask=np.ones(n, bool)), ("custom_mask",))
        p = w.plan(qo_indptr, kv_indptr)
        rows = MAXT if w is self.rag else int(qo_indptr[-1])
        q = randn(rng, (rows, HQ, D))
        qj, kj, vj = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
        bad_run = {"k_short": lambda: self.run_rag(qj, kj[:-1], vj[:-1], p),
                   "k_heads": lambda: self.run_rag(qj, kj[:, :1], vj[:, :1], p),
                   "kv_dtype": lambda: self.run_rag(qj, kj.astype(jnp.float16), vj.astype(jnp.float16), p),
                   "q_f64": lambda: self.rag.run(np.asarray(q, np.float64), kj, vj, p),
                   "q_rows": lambda: self.run_rag(qj[:-1], kj, vj, p),
                   "k_v_mismatch": lambda: self.run_rag(qj, kj, vj[:-1], p),
                   "plan_other_wrapper": lambda: self.run_rag(qj, kj, vj, self.pre.plan(
                       i32([0, 1]), i32([0, 1]), i32([0]), i32([1]), num_pages=NP))}
        if corr in bad_run:
            return corr, rejected(bad_run[corr])
        bad_req = rng.integers(batch) if corr == "nan_q" else None
        q_in = q.copy()
        if bad_req is not None:
            q_in[qo_indptr[bad_req]:qo_indptr[bad_req + 1]] = np.nan
        if w is self.rag:
            o, lse = self.run_rag(jnp.asarray(q_in), kj, vj, p)
        else:
            o, lse = w.run(jnp.asarray(q_in), kj, vj, p, return_lse=True)
        t = int(qo_indptr[-1])
        assert o.shape == (rows, HQ, D)
        keep = np.ones(t, bool)
        if bad_req is not None:
            keep[qo_indptr[bad_req]:qo_indptr[bad_req + 1]] = False
        want_o, want_lse = ref_ragged(q[:t], k, v, qo_indptr, kv_indptr, True)
        close(o[:t], want_o, keep)
        close(lse[:t], want_lse, keep, "lse")
        if edge:
            self.count_edges(HQ // HKV, qo_lens)
        return corr, "matched" if bad_req is None else "nan-isolated"

    # -- block-sparse ---------------------------------------------------------------------------
    def bsr(self, rng):
        corrs = ("none", "nan_q", "dup_block", "indices_oob", "indices_neg", "indptr_nonmono", "int64_indptr",
                 "list_indices", "mask_shape", "k_short", "k_heads", "q_rows", "q_f64", "not_bsr",
                 "plan_other_wrapper")
        corr = self.pick(rng, corrs, 2)
        nrb, ncb = BSR_M // BSR_R, BSR_N // BSR_C
        indptr = i32(np.arange(nrb + 1) * BSR_PER_ROW)
        indices = i32(np.concatenate([rng.permutation(ncb)[:BSR_PER_ROW] for _ in range(nrb)]))
        mask = rng.random((len(indices), BSR_R, BSR_C)) < 0.7
        q, k, v = randn(rng, (BSR_M, HQ, D)), randn(rng, (BSR_N, HKV, D)), randn(rng, (BSR_N, HKV, D))
        qj, kj, vj = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
        make = lambda ip=indptr, idx=indices, m=mask: ji.BlockSparseMatrix(ip, idx, (BSR_R, BSR_C), (BSR_M, BSR_N), m)
        bad_plan = {"indices_oob": lambda: self.bsa.plan(make(idx=np.where(np.arange(len(indices)) == 0, ncb, indices).astype(np.int32))),
                    "indices_neg": lambda: self.bsa.plan(make(idx=np.where(np.arange(len(indices)) == 0, -1, indices).astype(np.int32))),
                    "indptr_nonmono": lambda: self.bsa.plan(make(ip=i32(np.where(np.arange(nrb + 1) == 1, indptr[2] + 1, indptr)))),
                    "int64_indptr": lambda: self.bsa.plan(make(ip=indptr.astype(np.int64))),
                    "list_indices": lambda: self.bsa.plan(make(idx=indices.tolist())),
                    "mask_shape": lambda: self.bsa.plan(make(m=mask[:, :, :-1])),
                    "not_bsr": lambda: self.bsa.plan((indptr, indices))}
        if corr in bad_plan:
            return corr, rejected(bad_plan[corr])
        if corr == "dup_block":  # a row block listing one column block twice
            bad = indices.copy()
            bad[1] = bad[0]
            return corr, rejected(lambda: self.bsa.plan(make(idx=bad)), ("bsr.indices",))
        p = self.bsa.plan(make())
        bad_run = {"k_short": lambda: self.run_bsa(qj, kj[:-BSR_C], vj[:-BSR_C], p),
                   "k_heads": lambda: self.run_bsa(qj, kj[:, :1], vj[:, :1], p),
                   "q_rows": lambda: self.run_bsa(qj[:-1], kj, vj, p),
                   "q_f64": lambda: self.bsa.run(np.asarray(q, np.float64), kj, vj, p),
                   "plan_other_wrapper": lambda: self.run_bsa(qj, kj, vj, self.rag.plan(i32([0, 1]), i32([0, 1])))}
        if corr in bad_run:
            return corr, rejected(bad_run[corr])
        q_in = q.copy()
        bad_rows = None
        if corr == "nan_q":  # one row block's queries
            i = rng.integers(nrb)
            bad_rows = slice(i * BSR_R, (i + 1) * BSR_R)
            q_in[bad_rows] = np.nan
        o, lse = self.run_bsa(jnp.asarray(q_in), kj, vj, p)
        want_o, want_lse = ref_ragged(q, k, v, i32([0, BSR_M]), i32([0, BSR_N]), False, make().to_dense_mask())
        keep = np.ones(BSR_M, bool)
        if bad_rows is not None:
            keep[bad_rows] = False
        close(o, want_o, keep)
        close(lse, want_lse, keep, "lse")
        return corr, "matched" if bad_rows is None else "nan-isolated"

    # -- cascade --------------------------------------------------------------------------------
    def cascade(self, rng):
        corrs = ("none", "nan_q", "batch0_nocap", "levels_count", "level_rows", "level_page_oob", "level_last_zero",
                 "level_int64", "level_groups", "num_pages_missing", "plan_bigger_cache", "plan_not_cascade",
                 "q_f64", "q_rows", "cache_small")
        corr = self.pick(rng, corrs, 3)
        if corr == "batch0_nocap":
            empty = (i32([0]), i32([0]), i32([]), i32([]))
            w = ji.MultiLevelCascadeAttention(2, HQ, HKV, D, P, num_ctas=4)
            cache, _ = poisoned_cache(rng, np.arange(NP))
            o, lse = w.run(jnp.zeros((0, HQ, D)), cache, w.plan([empty, empty], num_pages=NP), return_lse=True)
            assert o.shape == (0, HQ, D) and lse.shape == (0, HQ)
            return corr, "matched"
        batch = int(rng.integers(2, MAXB + 1))
        shared = int(rng.integers(1, 4))  # pages every request starts with
        own = rng.integers(0, 3, batch)
        while batch * shared + own.sum() > MAXPG:  # the flat table fits the capacity (nothing may be shared)
            own[np.argmax(own)] -= 1
        pages = rng.permutation(NP)
        indices = np.concatenate([np.concatenate([pages[:shared], pages[shared + 3 * b: shared + 3 * b + own[b]]])
                                  for b in range(batch)])
        npg = shared + own
        indptr = i32(np.concatenate([[0], np.cumsum(npg)]))
        indices, last = i32(indices), i32(rng.integers(1, P + 1, batch))
        qo_lens = rng.integers(1, 5, batch)
        edge = corr in ("none", "nan_q") and rng.random() < EDGE_SHARE
        if edge:  # query lengths at the boundaries (past kv_len - shared pages: less is shared, or nothing)
            for b in range(batch):
                qo_lens[b] = self.edge_len(rng, HQ // HKV, MAXT - int(qo_lens[:b].sum()) - (batch - b - 1))
        qo_indptr = i32(np.concatenate([[0], np.cumsum(qo_lens)]))
        levels, _ = ji.two_level_cascade(qo_indptr, indptr, indices, last, P, causal=True)
        cache, cache_np = poisoned_cache(rng, indices)
        levels = [list(l) for l in levels]
        lv = rng.integers(2)
        if corr == "levels_count":
            return corr, rejected(lambda: self.cas.plan(levels[:1], num_pages=NP), ("levels",))
        if corr == "level_rows":
            bad = [list(l) for l in levels]
            bad[lv][0] = bad[lv][0].copy()
            bad[lv][0][-1] += 1
            return corr, rejected(lambda: self.cas.plan(bad, num_pages=NP))
        if corr in ("level_page_oob", "level_last_zero", "level_int64", "num_pages_missing"):
            bad = [list(l) for l in levels]
            if corr == "level_page_oob" and len(bad[lv][2]):
                bad[lv][2] = bad[lv][2].copy()
                bad[lv][2][rng.integers(len(bad[lv][2]))] = NP
            elif corr == "level_last_zero" and bad[lv][1][-1] > 0:
                bad[lv][3] = bad[lv][3] * 0
            elif corr == "level_int64":
                bad[lv][1] = bad[lv][1].astype(np.int64)
            elif corr != "num_pages_missing":
                return corr, "inapplicable"
            return corr, rejected(lambda: self.cas.plan(bad, num_pages=None if corr == "num_pages_missing" else NP))
        if corr == "level_groups":
            bad = [list(l) for l in levels]
            bad[lv][0] = np.concatenate([bad[lv][0], bad[lv][0][-1:]]).astype(np.int32)
            return corr, rejected(lambda: self.cas.plan(bad, num_pages=NP))
        p = self.cas.plan(levels, num_pages=NP)
        q = randn(rng, (MAXT, HQ, D))
        qj = jnp.asarray(q)
        bad_run = {"plan_bigger_cache": lambda: self.run_cas(qj, cache, self.cas.plan(levels, num_pages=2 * NP)),
                   "plan_not_cascade": lambda: self.run_cas(qj, cache, self.pre.plan(qo_indptr, indptr, indices, last, num_pages=NP)),
                   "q_f64": lambda: self.cas.run(np.asarray(q, np.float64), cache, p),
                   "q_rows": lambda: self.run_cas(qj[:-1], cache, p),
                   "cache_small": lambda: self.run_cas(qj, ji.PagedKVCache(cache.k_pages[:4], cache.v_pages[:4]), p)}
        if corr in bad_run:
            return corr, rejected(bad_run[corr])
        q_in, bad_req = q.copy(), None
        if corr == "nan_q":
            bad_req = rng.integers(batch)
            q_in[qo_indptr[bad_req]:qo_indptr[bad_req + 1]] = np.nan
        o, lse = self.run_cas(jnp.asarray(q_in), cache, p)
        k, v, tok_indptr = gather(cache_np, indptr, indices, last)
        t = int(qo_indptr[-1])
        want_o, want_lse = ref_ragged(q[:t], k, v, qo_indptr, tok_indptr, True)
        keep = np.ones(t, bool)
        if bad_req is not None:
            keep[qo_indptr[bad_req]:qo_indptr[bad_req + 1]] = False
        close(o[:t], want_o, keep)
        close(lse[:t], want_lse, keep, "lse")
        if edge:
            self.count_edges(HQ // HKV, qo_lens)
        return corr, "matched" if bad_req is None else "nan-isolated"

    # -- single-request -------------------------------------------------------------------------
    def single(self, rng, kind):
        corrs = ("none", "nan_row", "kv_len0", "qo_len0", "q_f64", "kv_f64", "kv_dtype", "k_v_shape",
                 "heads_ratio", "head_dim", "q_ndim", "q_list")
        corr = self.pick(rng, corrs, 4)
        if kind == "decode" and corr == "qo_len0":
            corr = "none"
        kv_len, qo_len = (0 if corr == "kv_len0" else 20), (0 if corr == "qo_len0" else 6)
        q = randn(rng, (HQ, D) if kind == "decode" else (qo_len, HQ, D))
        k, v = randn(rng, (kv_len, HKV, D)), randn(rng, (kv_len, HKV, D))
        fn = self.single_decode if kind == "decode" else self.single_prefill
        eager = ji.single_decode_with_kv_cache if kind == "decode" else ji.single_prefill_with_kv_cache
        qj, kj, vj = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
        bad = {"q_f64": lambda: eager(np.asarray(q, np.float64), kj, vj),  # eager: jit casts float64
               "kv_f64": lambda: eager(qj, np.asarray(k, np.float64), np.asarray(v, np.float64)),
               "kv_dtype": lambda: fn(qj, kj.astype(jnp.bfloat16), vj.astype(jnp.bfloat16)),
               "k_v_shape": lambda: fn(qj, kj, vj[:-1]),
               "heads_ratio": lambda: fn(qj[..., :3, :], kj, vj),
               "head_dim": lambda: fn(qj[..., :-1], kj, vj),
               "q_ndim": lambda: fn(qj[None], kj, vj),
               "q_list": lambda: fn(q.tolist(), kj, vj)}
        if corr in bad:
            return corr, rejected(bad[corr])
        q_in, bad_rows = q.copy(), None
        if corr == "nan_row":  # one query head (decode) or one query token (prefill)
            bad_rows = rng.integers(q.shape[0])
            q_in[bad_rows] = np.nan
        if kv_len == 0 or qo_len == 0:  # empty outputs, no kernel (not jitted: shapes differ)
            o, lse = eager(jnp.asarray(q_in), kj, vj, return_lse=True)
        else:
            o, lse = fn(jnp.asarray(q_in), kj, vj)
        q3 = q[None] if kind == "decode" else q
        o3, lse3 = (o[None], lse[None]) if kind == "decode" else (o, lse)
        assert o3.shape == q3.shape
        want_o, want_lse = ref_ragged(q3, k, v, i32([0, q3.shape[0]]), i32([0, kv_len]), kind == "prefill")
        keep = np.ones(q3.shape[:2], bool)
        if bad_rows is not None:
            keep[(0, bad_rows) if kind == "decode" else bad_rows] = False
        close(np.asarray(o3)[keep], want_o[keep])
        close(np.asarray(lse3)[keep], want_lse[keep], what="lse")
        return corr, "matched" if bad_rows is None else "nan-isolated"

    # -- merge ----------------------------------------------------------------------------------
    def merge(self, rng, kind):
        corrs = ("none", "rows0", "groups0", "o_shape", "lse_shape", "not_state", "mask_shape",
                 "indptr_nonmono", "indptr_end", "indptr_start", "int64_indptr", "list_indptr")
        corr = self.pick(rng, corrs, 3)
        rows = 0 if corr == "rows0" else 5

        def state(*lead):
            lse = randn(rng, lead + (HQ,)) * 3
            lse[rng.random(lse.shape) < 0.2] = -np.inf
            return ji.AttentionState(jnp.asarray(randn(rng, lead + (HQ, D))), jnp.asarray(lse))

        if kind == "merge_state":
            a, b = state(rows), state(rows)
            mask = jnp.asarray(rng.random(rows) < 0.7)
            bad = {"o_shape": lambda: ji.merge_state(a, ji.AttentionState(b.o[:, :-1], b.lse[:, :-1])),
                   "lse_shape": lambda: ji.merge_state(ji.AttentionState(a.o, a.lse[:, :-1]), b),
                   "not_state": lambda: ji.merge_state(a.o, b),
                   "mask_shape": lambda: ji.merge_state(a, b, jnp.ones(rows + 1, bool))}
            if corr in bad:
                return corr, rejected(bad[corr])
            use_mask = rng.random() < 0.5
            got = self.merge_state(a, b, mask if use_mask else None)
            want = self.ref_merge_state(a, b)
            if use_mask:
                want = ji.AttentionState(jnp.where(mask[:, None, None], want.o, a.o), jnp.where(mask[:, None], want.lse, a.lse))
        elif kind == "merge_states":
            n = 3
            s = state(rows, n)
            bad = {"o_shape": lambda: ji.merge_states(ji.AttentionState(s.o[..., :-1, :], s.lse)),
                   "lse_shape": lambda: ji.merge_states(ji.AttentionState(s.o, s.lse[..., :-1])),
                   "not_state": lambda: ji.merge_states(s.o)}
            if corr in bad:
                return corr, rejected(bad[corr])
            if corr == "groups0":  # merging no states: the empty state (o = 0, lse = -inf)
                got = ji.merge_states(ji.AttentionState(s.o[:, :0], s.lse[:, :0]))
                want = ji.AttentionState(np.zeros((rows, HQ, D)), np.full((rows, HQ), -np.inf))
            else:
                got, want = self.merge_states(s), self.ref_merge_states(s)
        else:
            np_rows = 0 if corr == "rows0" else 10
            s = state(np_rows)
            groups = 0 if corr == "groups0" else 4
            indptr = i32(np.concatenate([[0], np.sort(rng.integers(0, np_rows + 1, groups))]))
            bad = {"indptr_nonmono": i32(np.concatenate([indptr[:-1], [indptr[-2] - 1]])) if groups else None,
                   "indptr_end": i32(np.concatenate([indptr[:-1], [np_rows + 1]])),
                   "indptr_start": indptr + 1,
                   "int64_indptr": indptr.astype(np.int64),
                   "list_indptr": indptr.tolist()}
            if corr == "o_shape":
                return corr, rejected(lambda: ji.merge_state_varlen(ji.AttentionState(s.o[None], s.lse[None]), indptr))
            if corr == "lse_shape":
                return corr, rejected(lambda: ji.merge_state_varlen(ji.AttentionState(s.o, s.lse[:, :-1]), indptr))
            if corr == "not_state":
                return corr, rejected(lambda: ji.merge_state_varlen(s.o, indptr))
            if bad.get(corr) is not None:
                return corr, rejected(lambda: ji.merge_state_varlen(s, bad[corr]), ("indptr",))
            got = self.merge_state_varlen(s, indptr)
            # reference: each group padded to 10 states with lse = -inf
            po = np.zeros((groups, 10, HQ, D), np.float32)
            pl = np.full((groups, 10, HQ), -np.inf, np.float32)
            for g in range(groups):
                n = indptr[g + 1] - indptr[g]
                po[g, :n], pl[g, :n] = np.asarray(s.o)[indptr[g]:indptr[g + 1]], np.asarray(s.lse)[indptr[g]:indptr[g + 1]]
            want = self.ref_merge_states(ji.AttentionState(jnp.asarray(po), jnp.asarray(pl)))
        assert got.o.shape == want.o.shape and got.lse.shape == want.lse.shape
        close(got.o, want.o)
        close(got.lse, want.lse, what="lse")
        return corr, "matched"

    # -- append / batch indices -----------------------------------------------------------------
    NNZ = 8

    def append(self, rng):
        corrs = ("none", "jit_invalid_row", "batch_oob", "pos_neg", "pos_past_pages", "page_oob", "int64_batch",
                 "list_positions", "k_shape", "k_v_mismatch", "k_heads", "not_cache", "indptr_int64")
        corr = self.pick(rng, corrs, 2)
        batch = int(rng.integers(1, MAXB + 1))
        indptr, indices, last, kv_lens = table(rng, batch, zero_len=False)
        app = np.minimum(rng.integers(0, 4, batch), kv_lens)
        while app.sum() > self.NNZ:
            app[np.argmax(app)] -= 1
        app_indptr = i32(np.concatenate([[0], np.cumsum(app)]))
        nnz = self.NNZ
        bi, pos = ji.get_batch_indices_positions(app_indptr, i32(kv_lens), nnz)
        bi, pos = np.asarray(bi), np.asarray(pos)
        cache_k, cache_v = randn(rng, (NP, P, HKV, D)), randn(rng, (NP, P, HKV, D))
        cache = ji.PagedKVCache(jnp.asarray(cache_k), jnp.asarray(cache_v))
        ak, av = randn(rng, (nnz, HKV, D)), randn(rng, (nnz, HKV, D))
        live = np.flatnonzero(bi >= 0)
        call = lambda c=cache, k=ak, v=av, b=bi, p=pos, idx=indices, ip=indptr: ji.append_paged_kv_cache(
            c, jnp.asarray(k) if hasattr(k, "shape") else k, jnp.asarray(v) if hasattr(v, "shape") else v, b, p, idx, ip)
        if corr in ("batch_oob", "pos_neg", "pos_past_pages", "page_oob", "jit_invalid_row") and not len(live):
            return corr, "inapplicable"
        r = rng.choice(live) if len(live) else 0
        if corr == "batch_oob":
            b2 = bi.copy()
            b2[r] = batch + rng.integers(0, 3)
            return corr, rejected(lambda: call(b=b2), ("batch_indices",))
        if corr == "pos_neg":
            p2 = pos.copy()
            p2[r] = -1
            return corr, rejected(lambda: call(p=p2), ("positions",))
        if corr == "pos_past_pages":
            p2 = pos.copy()
            p2[r] = (indptr[bi[r] + 1] - indptr[bi[r]]) * P + rng.integers(0, 3)
            return corr, rejected(lambda: call(p=p2), ("positions",))
        if corr == "page_oob":
            idx2 = indices.copy()
            idx2[indptr[bi[r]] + pos[r] // P] = NP + rng.integers(0, 3)
            return corr, rejected(lambda: call(idx=idx2), ("kv_indices",))
        bad = {"int64_batch": lambda: call(b=bi.astype(np.int64)),
               "list_positions": lambda: call(p=pos.tolist()),
               "k_shape": lambda: call(k=ak[:-1], v=av[:-1]),
               "k_v_mismatch": lambda: call(v=av[:, :, :-1]),
               "k_heads": lambda: call(k=ak[:, :1], v=av[:, :1]),
               "not_cache": lambda: call(c=(cache.k_pages, cache.v_pages)),
               "indptr_int64": lambda: call(ip=indptr.astype(np.int64))}
        if corr in bad:
            return corr, rejected(bad[corr])
        if corr == "jit_invalid_row":  # under jit an invalid row is dropped; the others land
            how = rng.integers(5)
            bi, pos, indices = bi.copy(), pos.copy(), indices.copy()
            if how == 0:
                bi[r] = batch + rng.integers(0, 3)
            elif how == 1:
                pos[r] = -rng.integers(1, 5)
            elif how == 2:
                pos[r] = (indptr[bi[r] + 1] - indptr[bi[r]]) * P + rng.integers(0, 3)
            else:  # the row's page id outside the cache, or negative: every row on that page drops
                entry = indptr[bi[r]] + pos[r] // P
                indices[entry] = NP + rng.integers(0, 3) if how == 3 else -rng.integers(1, 4)
                live = live[indptr[bi[live]] + pos[live] // P != entry]
            live = live[live != r]
            got = self.append_jit(cache, jnp.asarray(ak), jnp.asarray(av), bi, pos, indices, indptr)
        else:
            got = call()
        want_k, want_v = cache_k.copy(), cache_v.copy()
        for i in live:
            page = indices[indptr[bi[i]] + pos[i] // P]
            want_k[page, pos[i] % P], want_v[page, pos[i] % P] = ak[i], av[i]
        np.testing.assert_array_equal(np.asarray(got.k_pages), want_k)
        np.testing.assert_array_equal(np.asarray(got.v_pages), want_v)
        return corr, "matched"

    def batch_indices(self, rng):
        corrs = ("none", "batch0", "int64", "list", "seq_shape", "indptr_nonmono", "seq_short", "nnz_short")
        corr = self.pick(rng, corrs, 2)
        batch = 0 if corr == "batch0" else int(rng.integers(1, MAXB + 1))
        app = rng.integers(0, 4, batch)
        app_indptr = i32(np.concatenate([[0], np.cumsum(app)]))
        seq = i32(app + rng.integers(0, 10, batch))
        nnz = self.NNZ + 4
        bad = {"int64": lambda: ji.get_batch_indices_positions(app_indptr.astype(np.int64), seq, nnz),
               "list": lambda: ji.get_batch_indices_positions(app_indptr.tolist(), seq, nnz),
               "seq_shape": lambda: ji.get_batch_indices_positions(app_indptr, seq[:-1], nnz)}
        if corr in bad:
            return corr, rejected(bad[corr], ("int32",) if corr in ("int64", "list") else ())
        if corr == "indptr_nonmono":
            if app_indptr[-1] == 0:
                return corr, "inapplicable"
            b2 = app_indptr.copy()
            b2[-1] = b2[-2] - 1
            return corr, rejected(lambda: ji.get_batch_indices_positions(b2, seq, nnz), ("append_indptr",))
        if corr == "seq_short":
            if not np.any(app):
                return corr, "inapplicable"
            s2 = seq.copy()
            b = np.flatnonzero(app)[0]
            s2[b] = app[b] - 1
            return corr, rejected(lambda: ji.get_batch_indices_positions(app_indptr, s2, nnz), ("seq_lens",))
        if corr == "nnz_short":
            if app_indptr[-1] == 0:
                return corr, "inapplicable"
            return corr, rejected(lambda: ji.get_batch_indices_positions(app_indptr, seq, int(app_indptr[-1]) - 1),
                                  ("nnz",))
        bi, pos = ji.get_batch_indices_positions(app_indptr, seq, nnz)
        want_b = np.full(nnz, -1)
        want_p = np.full(nnz, -1)
        for b in range(batch):
            for j, r in enumerate(range(app_indptr[b], app_indptr[b + 1])):
                want_b[r], want_p[r] = b, seq[b] - app[b] + j
        np.testing.assert_array_equal(np.asarray(bi), want_b)
        np.testing.assert_array_equal(np.asarray(pos), want_p)
        return corr, "matched"

    # -- ragged_paged_attention: a whole step (KV write + attention), metadata on the device --------
    RPA_SEQS, RPA_PAGES = MAXB, 5  # sequences, pages per sequence (the valid ones' pages: at most NP in all)

    def ragged_step(self, rng, all_padding, edge_group=None):
        """A ragged step's composition over RPA_SEQS sequences and MAXT rows: a decode prefix, then
        q_len 0..12 (with edge_group, the non-decode sequences' q_len at that group's boundaries,
        when the step has any), padding rows after the valid ones, each valid sequence on distinct
        pages (the other entries of page_indices: any page). Returns (n_valid, n_decode, q_len [S],
        kv [S], cu_q_lens, page_indices [S, pages_per_seq], pages used [S], the pages listed,
        whether the lengths are at the edges)."""
        s, pps = self.RPA_SEQS, self.RPA_PAGES
        n_valid = 0 if all_padding else int(rng.integers(1, s + 1))
        n_decode = int(rng.integers(0, n_valid + 1))
        q_len = np.concatenate([np.ones(n_decode, np.int64), rng.integers(0, 13, s - n_decode)])
        q_len[n_valid:] = rng.integers(0, 3, s - n_valid)  # (past distribution[2]: padding rows)
        edge = edge_group is not None and n_valid > n_decode
        if edge:  # the non-decode sequences' q_len at the boundaries (their pages within the cache's)
            for i in range(n_decode, n_valid):
                pages = NP - n_decode - int(np.sum(-(-q_len[n_decode:i] // P)))
                q_len[i] = self.edge_len(rng, edge_group, min(pps, pages) * P) or 0
        while q_len.sum() > MAXT:
            q_len[np.argmax(q_len)] -= 1
        kv = np.minimum(q_len + rng.integers(0, 14, s), pps * P)
        while np.sum(-(-kv[:n_valid] // P)) > NP and np.any(kv[:n_valid] > q_len[:n_valid]):
            i = int(np.argmax(kv[:n_valid] - q_len[:n_valid]))  # distinct pages for the valid sequences
            kv[i] = max(q_len[i], kv[i] - P)
        cu = i32(np.concatenate([[0], np.cumsum(q_len)]))
        cu[n_valid + 1:] = cu[n_valid]  # sequences past the valid ones hold no rows
        used = -(-kv // P)
        page_indices = i32(rng.integers(0, NP, (s, pps)))  # unused entries: any page, NaN or not
        ids = rng.permutation(NP)
        for i in range(n_valid):  # distinct pages for the valid sequences' tokens (they are written)
            page_indices[i, :used[i]], ids = ids[:used[i]], ids[used[i]:]
        listed = np.concatenate([page_indices[i, :used[i]] for i in range(n_valid)] + [np.zeros(0, np.int32)])
        return n_valid, n_decode, q_len, kv, cu, page_indices, used, listed, edge

    def rpa(self, rng):
        """One step of 4 sequences over MAXT rows: a decode prefix, then q_len 0..12 (or at the
        edges), padding rows after the valid ones. Valid steps run as they are or with one of
        RPA_OPTIONS (each with return_lse and read_kv_lens: every sequence reads its first 0..kv_len
        keys). Valid steps: the written cache slots exact, every other slot (NaN in pages no valid
        sequence uses) unchanged, o (and lse) equal to the reference, padding rows 0 (lse -inf)."""
        corrs = ("none", "all_padding", "kv_lens_int64", "page_oob", "page_neg", "cu_nonmono", "cu_start",
                 "cu_past_rows", "dist_order", "dist_shape", "decode_not_1", "kv_under_q", "kv_past_pages",
                 "keys_shape", "page_indices_len", "window0", "not_cache", "q_ndim", "read_past_kv", "read_shape",
                 "values_only")
        corr = self.pick(rng, corrs, 2)
        s, pps = self.RPA_SEQS, self.RPA_PAGES
        edge = corr == "none" and rng.random() < EDGE_SHARE
        n_valid, n_decode, q_len, kv, cu, page_indices, used, listed, edge = self.ragged_step(
            rng, corr == "all_padding", HQ // HKV if edge else None)
        cache, (ck, cv) = poisoned_cache(rng, listed)
        q, k, v = randn(rng, (MAXT, HQ, D)), randn(rng, (MAXT, HKV, D)), randn(rng, (MAXT, HKV, D))
        args = dict(queries=jnp.asarray(q), keys=jnp.asarray(k), values=jnp.asarray(v), kv_cache=cache,
                    kv_lens=jnp.asarray(i32(kv)), page_indices=jnp.asarray(page_indices.reshape(-1)),
                    cu_q_lens=jnp.asarray(cu), distribution=jnp.asarray(i32([n_decode, n_decode, n_valid])))
        call = lambda **kw: ji.ragged_paged_attention(**(args | kw), num_ctas=4)
        live = [i for i in range(n_valid) if q_len[i] > 0]
        bad = {"kv_lens_int64": (lambda: call(kv_lens=np.asarray(kv, np.int64)), "kv_lens"),
               "dist_order": (lambda: call(distribution=jnp.asarray(i32([1, 0, n_valid]))), "distribution"),
               "dist_shape": (lambda: call(distribution=jnp.asarray(i32([0, n_valid]))), "distribution"),
               "keys_shape": (lambda: call(keys=jnp.asarray(k[:-1])), "keys"),
               "page_indices_len": (lambda: call(page_indices=jnp.asarray(page_indices.reshape(-1)[:-1])),
                                    "page_indices"),
               "window0": (lambda: call(sliding_window=0), "sliding_window"),
               "not_cache": (lambda: call(kv_cache=(cache.k_pages, cache.v_pages)), "kv_cache"),
               "q_ndim": (lambda: call(queries=jnp.asarray(q[:, 0])), "queries"),
               "read_past_kv": (lambda: call(read_kv_lens=jnp.asarray(i32(kv + (np.arange(s) == rng.integers(s))))),
                                "read_kv_lens"),
               "read_shape": (lambda: call(read_kv_lens=jnp.asarray(i32(kv[:-1]))), "read_kv_lens"),
               "values_only": (lambda: call(keys=None), "keys")}
        if corr in bad:
            thunk, name = bad[corr]
            return corr, rejected(thunk, (name,))
        if corr in ("page_oob", "page_neg", "kv_under_q", "kv_past_pages", "cu_nonmono", "cu_past_rows",
                    "decode_not_1") and not live:
            return corr, "inapplicable"
        r = live[rng.integers(len(live))] if live else 0
        if corr in ("page_oob", "page_neg"):
            p2 = page_indices.copy()
            p2[r, rng.integers(used[r])] = NP + rng.integers(0, 3) if corr == "page_oob" else -rng.integers(1, 4)
            return corr, rejected(lambda: call(page_indices=jnp.asarray(p2.reshape(-1))), ("page_indices",))
        if corr in ("kv_under_q", "kv_past_pages"):
            kv2 = kv.copy()
            kv2[r] = q_len[r] - 1 if corr == "kv_under_q" else pps * P + rng.integers(1, 4)
            return corr, rejected(lambda: call(kv_lens=jnp.asarray(i32(kv2))), ("kv_lens",))
        if corr in ("cu_nonmono", "cu_start", "cu_past_rows"):
            cu2 = cu.copy()
            if corr == "cu_start":
                cu2[0] = 1
            elif corr == "cu_nonmono":
                cu2[r + 1] = cu2[r] - 1
            else:
                cu2[n_valid] = MAXT + 1
            return corr, rejected(lambda: call(cu_q_lens=jnp.asarray(cu2)), ("cu_q_lens",))
        if corr == "decode_not_1":  # distribution[0] claims a sequence whose q_len is not 1
            if q_len[r] == 1:
                return corr, "inapplicable"
            return corr, rejected(lambda: call(distribution=jnp.asarray(i32([r + 1, r + 1, n_valid]))),
                                  ("q_len 1",))
        option = RPA_OPTIONS[sum(self.rpa_options.values()) % len(RPA_OPTIONS)]
        self.rpa_options[option] += 1
        read = rng.integers(0, kv + 1) if option != "plain" else kv
        kw = {} if option == "plain" else dict(return_lse=True, read_kv_lens=jnp.asarray(i32(read)))
        if option == "no_write":  # the cache holds the rows: attend without writing
            kw.update(keys=None, values=None)
        causal = option != "non_causal"
        out, new_cache = call(**kw, causal=causal)
        lse = None
        if option != "plain":
            out, lse = out
        want_k, want_v = ck.copy(), cv.copy()
        for i in range(n_valid if option != "no_write" else 0):  # the new rows land at kv - q_len .. kv - 1
            for j in range(q_len[i]):
                pos = kv[i] - q_len[i] + j
                page = page_indices[i, pos // P]
                want_k[page, pos % P], want_v[page, pos % P] = k[cu[i] + j], v[cu[i] + j]
        if option != "no_write":  # V past kv_len in each written sequence's last page: 0
            last = [page_indices[i, used[i] - 1] if used[i] else 0 for i in range(n_valid)]
            zero_written_tails(want_v, "NHD", cu[:n_valid + 1], np.arange(n_valid + 1), last, kv - (used - 1) * P)
        np.testing.assert_array_equal(np.asarray(new_cache.k_pages), want_k)  # (NaN == NaN here)
        np.testing.assert_array_equal(np.asarray(new_cache.v_pages), want_v)
        rows = int(cu[n_valid])
        np.testing.assert_array_equal(np.asarray(out)[rows:], 0.0)  # padding rows
        if lse is not None:
            np.testing.assert_array_equal(np.asarray(lse)[rows:], -np.inf)
            want_o, want_lse = ref_rpa_rows(q, want_k, want_v, page_indices, kv, read, cu, n_valid, causal)
            close(np.asarray(out)[:rows], want_o)
            close(np.asarray(lse)[:rows], want_lse, what="lse")
        elif rows:
            pages = [page_indices[i, :used[i]] for i in range(n_valid)]
            keys = np.concatenate([want_k[p].reshape(-1, HKV, D)[:kv[i]] for i, p in enumerate(pages)])
            values = np.concatenate([want_v[p].reshape(-1, HKV, D)[:kv[i]] for i, p in enumerate(pages)])
            kv_indptr = i32(np.concatenate([[0], np.cumsum(kv[:n_valid])]))
            want_o, _ = ref_ragged(q[:rows], keys, values, cu[:n_valid + 1], kv_indptr, causal=True)
            close(np.asarray(out)[:rows], want_o)
        if edge:
            self.count_edges(HQ // HKV, q_len[n_decode:n_valid])
        return corr, "matched"

    # -- MLA: the host-planned wrapper and the device-planned step over a paged latent cache ------
    MLA_BAD = ("qo_int64", "qo_short", "qo_over_tokens", "kv_indptr_nonmono", "indices_list", "page_oob",
               "kv_len_over", "kv_len_short", "num_pages_missing", "q_nope_f16", "q_pe_width", "ckv_width",
               "kpe_f16", "q_f64", "scale_neg", "plan_causal")

    def mla_paged(self, rng):
        """One case of BatchMLAPagedAttention (causal, capacities): random q lengths 0..8 over a
        random page table, NaN in unlisted pages, stale slots and q rows past the step; valid: o
        and lse equal float64 NumPy."""
        corr = self.pick(rng, ("none",) + self.MLA_BAD)
        batch = int(rng.integers(1, MAXB + 1))
        kv_indptr, kv_indices, _, kv_len = table(rng, batch)
        kv_len = i32(kv_len)
        qo = rng.integers(0, 9, batch)
        while qo.sum() > MAXT:
            qo[np.argmax(qo)] -= 1
        qo_indptr = i32(np.concatenate([[0], np.cumsum(qo)]))
        q_nope, q_pe = randn(rng, (MAXT, MH, DC)), randn(rng, (MAXT, MH, DR))
        ckv, kpe = randn(rng, (NP * P, DC)), randn(rng, (NP * P, DR))  # flat: row = page * P + slot
        seqs = []
        for b in range(batch):
            pages = kv_indices[kv_indptr[b]:kv_indptr[b + 1]]
            seqs.append((qo_indptr[b], qo_indptr[b + 1], (pages[:, None] * P + np.arange(P)).reshape(-1)[:kv_len[b]]))
        keys = np.zeros(NP * P, bool)
        keys[np.concatenate([r for _, _, r in seqs])] = True
        ckv[~keys], kpe[~keys] = np.nan, np.nan
        q_nope[qo_indptr[-1]:], q_pe[qo_indptr[-1]:] = np.nan, np.nan
        args = dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len=kv_len)
        b = int(rng.integers(batch))
        over_tokens, nonmono, kv_over = qo_indptr.copy(), kv_indptr.copy(), kv_len.copy()
        over_tokens[-1] = MAXT + 1
        nonmono[b + 1] = nonmono[b] - 1
        kv_over[b] += P  # past its pages
        bad_plan = {
            "qo_int64": (dict(qo_indptr=qo_indptr.astype(np.int64)), "qo_indptr"),
            "qo_short": (dict(qo_indptr=qo_indptr[:-1]), "qo_indptr"),
            "qo_over_tokens": (dict(qo_indptr=over_tokens), "max_num_tokens"),
            "kv_indptr_nonmono": (dict(kv_indptr=nonmono), "kv_indptr"),
            "indices_list": (dict(kv_indices=kv_indices.tolist()), "kv_indices"),
            "kv_len_over": (dict(kv_len=kv_over), "kv_len"),
            "kv_len_short": (dict(kv_len=kv_len[:-1]), "kv_len")}
        if corr == "page_oob":
            if not len(kv_indices):
                return corr, "inapplicable"
            bad = kv_indices.copy()
            bad[rng.integers(len(bad))] = NP + rng.integers(0, 3)
            bad_plan[corr] = (dict(kv_indices=bad), "kv_indices")
        if corr in bad_plan:
            change, name = bad_plan[corr]
            return corr, rejected(lambda: self.mla.plan(**(args | change), num_pages=NP), (name,))
        if corr == "num_pages_missing":
            return corr, rejected(lambda: self.mla.plan(**args), ("num_pages",))
        plan = self.mla.plan(**args, num_pages=NP)
        good = [jnp.asarray(x) for x in (q_nope, q_pe, ckv.reshape(NP, P, DC), kpe.reshape(NP, P, DR))]
        bad_run = {"q_nope_f16": (0, good[0].astype(jnp.float16), "q_nope"),
                   "q_pe_width": (1, good[1][..., :8], "q_pe"),
                   "ckv_width": (2, good[2][..., :8], "ckv_cache"),
                   "kpe_f16": (3, good[3].astype(jnp.float16), "kpe_cache"),
                   "q_f64": (0, np.asarray(q_nope, np.float64), "float64")}
        if corr in bad_run:
            i, x, name = bad_run[corr]
            return corr, rejected(lambda: self.mla.run(*good[:i], x, *good[i + 1:], plan), (name,))
        if corr == "scale_neg":
            return corr, rejected(lambda: self.mla.run(*good, plan, ckv_scale=-1.0), ("ckv_scale",))
        if corr == "plan_causal":  # a causal plan given to a non-causal wrapper
            return corr, rejected(lambda: self.mla_other.run(*good, plan), ("causal",))
        o, lse = self.run_mla(*good, plan)
        want_o, want_lse = ref_mla(q_nope, q_pe, ckv, kpe, seqs, causal=True)
        close(o, want_o)
        close(lse, want_lse, what="lse")
        return corr, "matched"

    MLA_RAGGED_BAD = ("kv_lens_int64", "page_oob", "cu_nonmono", "dist_order", "decode_not_1", "kv_under_q",
                      "ql_nope_rank", "q_pe_f16", "new_kv_c_width", "kpe_pages", "sm_scale0", "causal_int")

    def mla_ragged(self, rng):
        """One step of mla_ragged_paged_attention: ragged_paged_attention's compositions (ragged_step)
        over a paged latent cache, NaN in unlisted pages and stale slots; valid: the caches written
        exactly (every other slot unchanged), o equal to float64 NumPy over them, padding rows 0."""
        corr = self.pick(rng, ("none", "all_padding") + self.MLA_RAGGED_BAD, 2)
        n_valid, n_decode, q_len, kv, cu, page_indices, used, _, _ = self.ragged_step(rng, corr == "all_padding")
        s, pps = self.RPA_SEQS, self.RPA_PAGES
        rows = [(page_indices[i, :used[i], None] * P + np.arange(P)).reshape(-1)[:kv[i]] for i in range(n_valid)]
        ckv, kpe = randn(rng, (NP * P, DC)), randn(rng, (NP * P, DR))
        keys = np.zeros(NP * P, bool)
        keys[np.concatenate(rows + [np.zeros(0, np.int64)])] = True
        ckv[~keys], kpe[~keys] = np.nan, np.nan
        ql_nope, q_pe = randn(rng, (MAXT, MH, DC)), randn(rng, (MAXT, MH, DR))
        new_c, new_pe = randn(rng, (MAXT, DC)), randn(rng, (MAXT, DR))
        args = dict(ql_nope=ql_nope, q_pe=q_pe, new_kv_c=new_c, new_k_pe=new_pe, ckv_cache=ckv.reshape(NP, P, DC),
                    kpe_cache=kpe.reshape(NP, P, DR), kv_lens=i32(kv), page_indices=page_indices.reshape(-1),
                    cu_q_lens=cu, distribution=i32([n_decode, n_decode, n_valid]))
        kw = dict(sm_scale=MLA_SCALE, num_cells=MLA_CELLS)
        call = lambda **change: ji.mla_ragged_paged_attention(**(args | kw | change))
        live = [i for i in range(n_valid) if q_len[i] > 0]
        r = live[rng.integers(len(live))] if live else 0
        bad = {"kv_lens_int64": (dict(kv_lens=kv.astype(np.int64)), "kv_lens"),
               "dist_order": (dict(distribution=i32([1, 0, n_valid])), "distribution"),
               "ql_nope_rank": (dict(ql_nope=ql_nope[0]), "ql_nope"),
               "q_pe_f16": (dict(q_pe=q_pe.astype(np.float16)), "q_pe"),
               "new_kv_c_width": (dict(new_kv_c=new_c[:, :8]), "new_kv_c"),
               "kpe_pages": (dict(kpe_cache=args["kpe_cache"][:-1]), "kpe_cache"),
               "sm_scale0": (dict(sm_scale=0.0), "sm_scale"),
               "causal_int": (dict(causal=1), "causal")}
        if live:
            p2, cu2, kv2 = page_indices.copy(), cu.copy(), i32(kv)
            p2[r, rng.integers(used[r])] = NP + rng.integers(0, 3)
            cu2[r + 1] = cu2[r] - 1
            kv2[r] = q_len[r] - 1
            bad |= {"page_oob": (dict(page_indices=p2.reshape(-1)), "page_indices"),
                    "cu_nonmono": (dict(cu_q_lens=cu2), "cu_q_lens"),
                    "kv_under_q": (dict(kv_lens=kv2), "kv_lens")}
            if q_len[r] != 1:  # distribution[0] claims a sequence whose q_len is not 1
                bad["decode_not_1"] = (dict(distribution=i32([r + 1, r + 1, n_valid])), "cu_q_lens")
        if corr in bad:
            change, name = bad[corr]
            return corr, rejected(lambda: call(**change), (name,))
        if corr not in ("none", "all_padding"):
            return corr, "inapplicable"
        o, ckv_out, kpe_out = call()
        want_c, want_pe = ckv.copy(), kpe.copy()
        for i in range(n_valid):  # the new rows land at positions kv - q_len .. kv - 1
            for j in range(q_len[i]):
                row = rows[i][kv[i] - q_len[i] + j]
                want_c[row], want_pe[row] = new_c[cu[i] + j], new_pe[cu[i] + j]
        np.testing.assert_array_equal(np.asarray(ckv_out).reshape(-1, DC), want_c)  # (NaN == NaN here)
        np.testing.assert_array_equal(np.asarray(kpe_out).reshape(-1, DR), want_pe)
        want_o, _ = ref_mla(ql_nope, q_pe, want_c, want_pe, [(cu[i], cu[i + 1], rows[i]) for i in range(n_valid)],
                            causal=True)
        close(o, want_o)
        return corr, "matched"


def _permute_table(indptr, indices, last, perm):
    """The page table with its requests reordered by perm (indptr, indices, last, kv_lens)."""
    npg = np.diff(indptr)
    new_idx = np.concatenate([indices[indptr[b]:indptr[b + 1]] for b in perm] + [np.zeros(0, np.int32)])
    new_ptr = i32(np.concatenate([[0], np.cumsum(npg[perm])]))
    new_last = last[perm]
    kv_lens = np.where(npg[perm] > 0, (npg[perm] - 1) * P + new_last, 0)
    return new_ptr, i32(new_idx), new_last, kv_lens


def _other_plan(rng, other, kind):
    """A valid plan from another wrapper (other page size, heads or capacities)."""
    if kind == "decode":
        return other.plan(i32([0, 1]), i32([0]), i32([1]), num_pages=NP)
    return other.plan(i32([0, 1]), i32([0, 1]), i32([0]), i32([1]), num_pages=NP)


ENTRY_POINTS = {
    "BatchDecodeWithPagedKVCache": lambda f, rng: f.paged(rng, "decode"),
    "BatchPrefillWithPagedKVCache": lambda f, rng: f.paged(rng, "prefill"),
    "BatchAttention": lambda f, rng: f.paged(rng, "batch"),
    "BatchPrefillWithRaggedKVCache": lambda f, rng: f.ragged(rng),
    "BlockSparseAttention": lambda f, rng: f.bsr(rng),
    "MultiLevelCascadeAttention": lambda f, rng: f.cascade(rng),
    "single_decode_with_kv_cache": lambda f, rng: f.single(rng, "decode"),
    "single_prefill_with_kv_cache": lambda f, rng: f.single(rng, "prefill"),
    "merge_state": lambda f, rng: f.merge(rng, "merge_state"),
    "merge_states": lambda f, rng: f.merge(rng, "merge_states"),
    "merge_state_varlen": lambda f, rng: f.merge(rng, "merge_state_varlen"),
    "append_paged_kv_cache": lambda f, rng: f.append(rng),
    "get_batch_indices_positions": lambda f, rng: f.batch_indices(rng),
    "ragged_paged_attention": lambda f, rng: f.rpa(rng),
    "BatchMLAPagedAttention": lambda f, rng: f.mla_paged(rng),
    "mla_ragged_paged_attention": lambda f, rng: f.mla_ragged(rng),
}


def fuzz(num_cases, seed):
    """Runs num_cases cases round-robin over ENTRY_POINTS. Returns (counts {entry: Counter of
    outcomes}, corruptions {entry: Counter}, failures [(entry, case seed, corruption, error type,
    message)], seconds {entry: time spent}, the Fuzzer: its drawn and rpa_options count what ran)."""
    fz = Fuzzer()
    counts = {name: collections.Counter() for name in ENTRY_POINTS}
    corrs = {name: collections.Counter() for name in ENTRY_POINTS}
    failures, seconds = [], collections.Counter()
    names = list(ENTRY_POINTS)
    for i in range(num_cases):
        name = names[i % len(names)]
        case_seed = (seed, i)
        rng = np.random.default_rng(case_seed)
        start = time.perf_counter()
        fz.entry = name
        try:
            corr, outcome = ENTRY_POINTS[name](fz, rng)
        except Exception as e:  # noqa: BLE001 - every failure is collected and reported
            failures.append((name, case_seed, fz.corr, type(e).__name__, str(e)[:300]))
            counts[name]["FAILED"] += 1
            continue
        finally:
            seconds[name] += time.perf_counter() - start
        counts[name][outcome] += 1
        corrs[name][corr] += 1
    return counts, corrs, failures, seconds, fz


def _report(counts, corrs, failures, seconds, edges):
    print(f"\nfuzz: {sum(sum(c.values()) for c in counts.values())} cases in {sum(seconds.values()):.1f} s")
    for name, c in counts.items():
        print(f"  {name:30s} {sum(c.values()):5d} cases {seconds[name]:5.1f} s  "
              + ", ".join(f"{k} {v}" for k, v in sorted(c.items())) + f"  ({len(corrs[name])} corruption kinds)")
    print("  edge lengths run, by (group, boundary kind): "
          + ", ".join(f"g{g} {kind} {n}" for (g, kind), n in sorted(edges.items())))
    for f in failures[:30]:
        print("  FAIL", *f)


def _check(num_cases, seed):
    counts, corrs, failures, seconds, fz = fuzz(num_cases, seed)
    edges = fz.drawn
    _report(counts, corrs, failures, seconds, edges)
    print("  ragged_paged_attention options run: " + ", ".join(f"{k} {v}" for k, v in sorted(fz.rpa_options.items())))
    assert not failures, f"{len(failures)} failing cases (first: {failures[0]})"
    per_entry = num_cases // len(ENTRY_POINTS)
    for name, c in counts.items():
        assert sum(c.values()) >= per_entry, name
        assert c["rejected"] > 0 and c["matched"] > 0, (name, c)
    for name in ("BatchDecodeWithPagedKVCache", "BatchPrefillWithPagedKVCache", "BatchAttention",
                 "BatchPrefillWithRaggedKVCache", "BlockSparseAttention", "MultiLevelCascadeAttention",
                 "single_decode_with_kv_cache", "single_prefill_with_kv_cache"):
        assert counts[name]["nan-isolated"] > 0, name
    assert sum(sum(c.values()) for c in counts.values()) == num_cases
    for group in (1, HQ // HKV):  # every kind of boundary drawn on purpose, group 1 (Hq == Hkv) too
        for kind in EDGE_KINDS:
            assert edges[group, kind] > 0, (group, kind, edges)
    assert all(fz.rpa_options[o] > 0 for o in RPA_OPTIONS), fz.rpa_options


def test_fuzz_448():
    _check(448, seed=20)


@pytest.mark.slow
def test_fuzz_1000():
    _check(1000, seed=20)


@pytest.mark.slow
def test_fuzz_10000():
    _check(10000, seed=2020)
