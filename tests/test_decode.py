"""BatchDecodeWithPagedKVCache (Pallas kernel in interpret mode) against the reference."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from helpers import TOL, assert_lse_close, np64_attention, page_table, randn, random_cache, rel_err
from jaxinfer import reference as ref

KV_LENS = (1, 17, 97, 512, 2048)


def _lens(batch, i):
    """Lengths for a batch: cycles through the issue's kv_len values, plus an empty request."""
    lens = np.array([KV_LENS[(i + j) % len(KV_LENS)] for j in range(batch)])
    if batch > 2:
        lens[1] = 0
    return lens


def _check_decode(rng, lens, page, hq, hkv, d, dtype, layout, **kw):
    indptr, indices, last, num_pages = page_table(rng, lens, page)
    cache = random_cache(rng, num_pages, page, hkv, d, dtype, layout)
    q = randn(rng, (len(lens), hq, d), dtype)
    dec = ji.BatchDecodeWithPagedKVCache(hq, hkv, d, page, layout=layout, num_ctas=kw.pop("num_ctas", 8), **kw)
    plan = dec.plan(indptr, indices, last, num_pages=num_pages)
    o, lse = dec.run(q, cache, plan, return_lse=True)
    want = ref.decode(q, cache, indptr, indices, last)
    assert o.shape == q.shape and o.dtype == dtype
    assert rel_err(o, want.o) < TOL[dtype]
    assert_lse_close(lse, want.lse, 1e-4 if dtype == jnp.float32 else 1e-2)
    k, v, tok = ref.gather_pages(cache, indptr, indices, last)
    q, o, k, v = (np.asarray(x) for x in (q, o, k, v))  # host slices below: no device op compiles
    for b in range(len(lens)):  # float64 oracle, request by request
        o64, _ = np64_attention(q[b:b + 1], k[tok[b]:tok[b + 1]], v[tok[b]:tok[b + 1]])
        assert rel_err(o[b], o64[0]) < TOL[dtype] if lens[b] else np.all(o[b] == 0)
    return plan


SAMPLE = [  # (batch, page, (Hq, Hkv), head_dim, dtype, layout): every value of the grid at least once
    (7, 16, (32, 4), 128, jnp.bfloat16, "NHD"),
    (7, 1, (4, 4), 64, jnp.float32, "HND"),
    (1, 8, (8, 1), 256, jnp.float16, "NHD"),
    (33, 8, (32, 4), 64, jnp.float32, "NHD"),
    (7, 8, (8, 1), 128, jnp.bfloat16, "HND"),
    (1, 16, (4, 4), 256, jnp.float32, "HND"),
]
# The first four hold every value once (batch 1 / 7 / 33, pages 1 / 8 / 16, each head pair, head
# dim and dtype, both layouts; the batches of 7 and 33 every kv_len of KV_LENS, split requests
# and an empty one); the first two run by default (bf16 and float32, head dims 128 and 64, pages
# 16 and 1, both layouts, GQA 8 and none), the rest under slow (the third's float16, head_dim 256
# and one request take the first two's kernel branches; the fourth's batch of 33 those of the
# batches of 7), as does the full grid.
SAMPLE_DEFAULT = 2


@pytest.mark.parametrize("i, case", [(i, c) if i < SAMPLE_DEFAULT else pytest.param(i, c, marks=pytest.mark.slow)
                                     for i, c in enumerate(SAMPLE)])
def test_decode_sample(rng, i, case):
    batch, page, (hq, hkv), d, dtype, layout = case
    _check_decode(rng, _lens(batch, i), page, hq, hkv, d, dtype, layout)


FULL = list(itertools.product((1, 7, 33), (1, 8, 16), ((4, 4), (32, 4), (8, 1)), (64, 128, 256),
                              (jnp.float16, jnp.bfloat16, jnp.float32), ("NHD", "HND")))


@pytest.mark.slow
@pytest.mark.parametrize("i, case", list(enumerate(FULL)))
def test_decode_full_grid(rng, i, case):
    batch, page, (hq, hkv), d, dtype, layout = case
    _check_decode(rng, _lens(batch, i), page, hq, hkv, d, dtype, layout)


# All under slow: chunks of one page of 5 slots run by default in
# test_unlisted_pages_and_stale_slots_never_leak[False], chunks of several pages in every auto-split
# plan (e.g. test_decode_sample's 512- and 2048-key requests).
@pytest.mark.slow
@pytest.mark.parametrize("split", [1, 3])
def test_split_kv_and_odd_page_size(rng, split):
    plan = _check_decode(rng, np.array([97, 0, 40, 5, 200]), 5, 8, 2, 64, jnp.float32, "NHD",
                         fixed_split_pages=split)
    assert plan.info["num_split"] >= 3


# Under slow: contiguous cells (a request cut, partial states merged) run by default in
# test_unlisted_pages_and_stale_slots_never_leak[True].
@pytest.mark.slow
def test_contiguous_cells(rng):
    """A plan whose cells hold consecutive page ranges (planner partition "contiguous", chosen by
    "auto" here): requests cut where the cells' costs balance, partial states merged."""
    plan = _check_decode(rng, np.array([326, 553, 1650, 2249, 2853, 278]), 16, 8, 2, 64, jnp.float32, "NHD")
    assert plan.info["partition"] == "contiguous" and plan.info["num_split"] >= 2


@pytest.mark.slow  # full last pages and one-token requests run by default in test_decode_sample[0] (512, 2048 and 1 keys)
def test_last_page_full_and_single_token(rng):
    _check_decode(rng, np.array([16, 32, 1, 15]), 16, 8, 2, 64, jnp.float32, "NHD")


@pytest.mark.parametrize("contiguous", [False, True])
def test_unlisted_pages_and_stale_slots_never_leak(rng, contiguous):
    """NaN / inf in unlisted pages and in slots past each last page's length never reach o: with
    Algorithm 1's one-page chunks, and with contiguous cells (a request cut mid-page-list); pages
    of an odd size (5 slots)."""
    page, hkv, d = 5, 2, 64
    lens = np.array([15, 0, 65, 359]) if contiguous else np.array([13, 6, 0, 9])
    indptr, indices, last, num_pages = page_table(rng, lens, page, extra_pages=5)
    clean = random_cache(rng, num_pages, page, hkv, d, jnp.float32)
    k, v = np.array(clean.k_pages), np.array(clean.v_pages)
    unlisted = np.setdiff1d(np.arange(num_pages), indices)
    k[unlisted], v[unlisted] = np.nan, np.nan
    for b in range(len(lens)):  # slots past kv_last_page_len in each request's last page
        if indptr[b + 1] > indptr[b]:
            pg = indices[indptr[b + 1] - 1]
            k[pg, last[b]:], v[pg, last[b]:] = np.nan, np.inf
    poisoned = ji.PagedKVCache(jnp.asarray(k), jnp.asarray(v))
    q = randn(rng, (4, 8, d), jnp.float32)
    dec = ji.BatchDecodeWithPagedKVCache(8, hkv, d, page, num_ctas=4, fixed_split_pages=None if contiguous else 1)
    plan = dec.plan(indptr, indices, last, num_pages=num_pages)
    assert (plan.info["partition"] == "contiguous") == contiguous and plan.info["num_split"] > 0
    o, lse = dec.run(q, poisoned, plan, return_lse=True)
    want = ref.decode(q, clean, indptr, indices, last)
    assert np.all(np.isfinite(np.asarray(o)))
    assert rel_err(o, want.o) < 2e-5
    assert_lse_close(lse, want.lse)


def test_capacity_plans_compile_once(rng):
    page, hq, hkv, d, bmax, pmax = 4, 8, 2, 64, 6, 80
    num_pages = 90
    cache = random_cache(rng, num_pages, page, hkv, d, jnp.float32)
    dec = ji.BatchDecodeWithPagedKVCache(hq, hkv, d, page, max_batch_size=bmax, max_num_pages=pmax, num_ctas=8)
    run = jax.jit(dec.run)
    for step in range(12):
        batch = int(rng.integers(1, bmax + 1))
        lens = rng.integers(0, 60, batch)
        npages = -(-lens // page)
        indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
        indices = rng.permutation(num_pages)[: indptr[-1]].astype(np.int32)
        last = np.where(npages > 0, lens - (npages - 1) * page, 1).astype(np.int32)
        plan = dec.plan(indptr, indices, last, num_pages=num_pages)
        q = randn(rng, (bmax, hq, d), jnp.float32)
        o = run(q, cache, plan)
        if step % 4 == 0:
            want = ref.decode(q[:batch], cache, indptr, indices, last)
            assert rel_err(o[:batch], want.o) < 2e-5
            assert np.all(np.asarray(o[batch:]) == 0)  # padding rows
    assert run._cache_size() == 1


def test_horizon_plan_in_lax_scan_equals_separate_steps(rng):
    page, hq, hkv, d, steps = 4, 8, 2, 64, 4
    final = np.array([9, 14, 4])  # lengths at the last step; pages allocated for them
    indptr, indices, last, num_pages = page_table(rng, final, page)
    cache = random_cache(rng, num_pages, page, hkv, d, jnp.float32)
    qs = randn(rng, (steps, 3, hq, d), jnp.float32)
    dec = ji.BatchDecodeWithPagedKVCache(hq, hkv, d, page, num_ctas=4)
    plan = dec.plan(indptr, indices, last, num_pages=num_pages, horizon=steps)

    @jax.jit
    def loop(qs, cache, plan):
        def body(carry, xs):
            step, q = xs
            return carry, dec.run(q, cache, plan, kv_lens=plan.kv_lens_at(step))
        return jax.lax.scan(body, 0, (jnp.arange(steps), qs))[1]

    outs = loop(qs, cache, plan)
    # The separate steps: each planned alone, under capacities (one program for the four plans).
    one = ji.BatchDecodeWithPagedKVCache(hq, hkv, d, page, num_ctas=4, max_batch_size=3, max_num_pages=num_pages)
    separate = jax.jit(one.run)
    for s in range(steps):
        lens = final - (steps - 1 - s)
        npages = -(-lens // page)
        ip = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
        idx = np.concatenate([indices[indptr[b]:indptr[b] + npages[b]] for b in range(3)]).astype(np.int32)
        lp = (lens - (npages - 1) * page).astype(np.int32)
        step_plan = one.plan(ip, idx, lp, num_pages=num_pages)
        np.testing.assert_allclose(outs[s], separate(qs[s], cache, step_plan), rtol=1e-5, atol=1e-6)
        assert rel_err(outs[s], ref.decode(qs[s], cache, ip, idx, lp).o) < 2e-5
    assert separate._cache_size() == 1


def test_deterministic_and_batch_invariant(rng):
    page, hq, hkv, d = 4, 8, 2, 64
    lens = np.array([150, 30, 77])
    indptr, indices, last, num_pages = page_table(rng, lens, page)
    cache = random_cache(rng, num_pages, page, hkv, d, jnp.bfloat16)
    q = randn(rng, (3, hq, d), jnp.bfloat16)
    # (capacities: the batch of 3 and the request alone, its q padded to 3 rows, run one program)
    dec = ji.BatchDecodeWithPagedKVCache(hq, hkv, d, page, num_ctas=4, fixed_split_pages=8, max_batch_size=3,
                                         max_num_pages=num_pages)
    plan = dec.plan(indptr, indices, last, num_pages=num_pages)
    run = jax.jit(dec.run)  # one program, run twice
    a, b = run(q, cache, plan), run(q, cache, plan)
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    q_alone = jnp.asarray(np.concatenate([np.asarray(q[:1]), np.zeros((2, hq, d), np.asarray(q).dtype)]))
    alone = run(q_alone, cache, dec.plan(indptr[:2], indices[: indptr[1]], last[:1], num_pages=num_pages))
    np.testing.assert_array_equal(np.asarray(alone[0], np.float32), np.asarray(a[0], np.float32))
    assert run._cache_size() == 1


def test_decode_rejects_bad_input(rng):
    page, hq, hkv, d = 4, 8, 2, 64
    indptr, indices, last, num_pages = page_table(rng, np.array([9, 3]), page)
    cache = random_cache(rng, num_pages, page, hkv, d, jnp.float32)
    dec = ji.BatchDecodeWithPagedKVCache(hq, hkv, d, page, num_ctas=4, max_batch_size=2)
    with pytest.raises(ValueError, match="page ids outside"):
        dec.plan(indptr, np.full_like(indices, num_pages), last, num_pages=num_pages)
    with pytest.raises(ValueError, match="max_batch_size"):
        dec.plan(np.array([0, 1, 2, 3], np.int32), indices[:3], np.ones(3, np.int32), num_pages=num_pages)
    with pytest.raises(ValueError, match="kv_indptr must be non-decreasing"):
        dec.plan(np.array([0, 3, 2], np.int32), indices, last, num_pages=num_pages)
    plan = dec.plan(indptr, indices, last, num_pages=num_pages)
    with pytest.raises(ValueError, match="q must have shape"):
        dec.run(randn(rng, (3, hq, d), jnp.float32), cache, plan)
    with pytest.raises(ValueError, match="dtype"):
        dec.run(randn(rng, (2, hq, d), jnp.bfloat16), cache, plan)
    with pytest.raises(ValueError, match="kv_cache"):
        dec.run(randn(rng, (2, hq, d), jnp.float32), random_cache(rng, 4, 8, hkv, d, jnp.float32), plan)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ji.BatchDecodeWithPagedKVCache(6, 4, d, page)


def test_run_inside_shard_map(rng):
    """run() is a pure function: it traces inside shard_map. Pallas outputs carry no varying-axes
    annotation, so shard_map needs check_vma=False (as for any pallas_call)."""
    from jax.sharding import Mesh, PartitionSpec as P
    page, hq, hkv, d = 4, 8, 2, 64
    indptr, indices, last, num_pages = page_table(rng, np.array([9, 30]), page)
    cache = random_cache(rng, num_pages, page, hkv, d, jnp.float32)
    q = randn(rng, (2, hq, d), jnp.float32)
    dec = ji.BatchDecodeWithPagedKVCache(hq, hkv, d, page, num_ctas=4)
    plan = dec.plan(indptr, indices, last, num_pages=num_pages)
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    fn = jax.shard_map(lambda q, c, p: dec.run(q, c, p), mesh=mesh, in_specs=(P(), P(), P()), out_specs=P(),
                       check_vma=False)
    o = jax.jit(fn)(q, cache, plan)
    assert rel_err(o, ref.decode(q, cache, indptr, indices, last).o) < 2e-5


def test_with_page_offset_reads_a_stacked_cache(rng):
    """One plan, shifted by l * P, attends layer l of a cache stacking L layers of P pages. (float32
    at head_dim 128: K / V blocks halved to fit shared memory, _common.fit_block_kv.)"""
    lens = np.array([40, 7])
    indptr, indices, last, num_pages = page_table(rng, lens, 8)
    layers = [random_cache(rng, num_pages, 8, 2, 128, jnp.float32) for _ in range(3)]
    stacked = ji.PagedKVCache(jnp.concatenate([c.k_pages for c in layers]),
                              jnp.concatenate([c.v_pages for c in layers]))
    q = randn(rng, (2, 4, 128), jnp.float32)
    dec = ji.BatchDecodeWithPagedKVCache(4, 2, 128, 8, num_ctas=4)
    plan = dec.plan(indptr, indices, last, num_pages=num_pages)
    run = jax.jit(lambda q, c, p, l: dec.run(q, c, p.with_page_offset(l * num_pages)))
    for l in (0, 2):
        want = ref.decode(q, layers[l], indptr, indices, last)
        assert rel_err(run(q, stacked, plan, l), want.o) < TOL[jnp.float32]


@pytest.mark.parametrize("layout, split, horizon", [  # HND and contiguous cells: the same branches (slow)
    ("NHD", True, 2), pytest.param("HND", False, 1, marks=pytest.mark.slow),
    pytest.param("NHD", "contiguous", 1, marks=pytest.mark.slow)])
def test_append_kv_fused_equals_append_then_run(rng, layout, split, horizon):
    """run(..., append_kv=(k, v)) writes each request's new row at its last position in the same
    launch and attends to it: the cache equals append_paged_kv_cache's, o equals run() over that
    cache and the float64 oracle. Covered: split requests (the new token in a later chunk), a
    padding row (max_batch_size), a horizon plan run at its first step (kv_lens), both layouts,
    contiguous cells (the last request cut in two); under jit with the cache donated."""
    page, hq, hkv, d = 4, 8, 2, 64
    contiguous = split == "contiguous"
    lens = {True: [45, 9, 1], False: [12, 5, 8], "contiguous": [15, 65, 359]}[split]  # this step's
    lens = np.array(lens)
    indptr, indices, last, num_pages = page_table(rng, lens + horizon - 1, page)
    cache = random_cache(rng, num_pages, page, hkv, d, jnp.float32, layout)
    q = randn(rng, (4, hq, d), jnp.float32)
    k, v = randn(rng, (2, 4, hkv, d), jnp.float32)
    dec = ji.BatchDecodeWithPagedKVCache(hq, hkv, d, page, layout=layout, num_ctas=4, max_batch_size=4,
                                         max_num_pages=num_pages, fixed_split_pages=4 if split is True else None)
    plan = dec.plan(indptr, indices, last, num_pages=num_pages, horizon=horizon)
    assert (plan.info["num_split"] > 0) == bool(split)
    assert (plan.info["partition"] == "contiguous") == contiguous
    kv_lens = None if horizon == 1 else plan.kv_lens_at(0)
    pos = np.append(lens - 1, -1).astype(np.int32)  # row 3: padding
    want_cache = ji.append_paged_kv_cache(cache, k, v, np.array([0, 1, 2, -1], np.int32), pos, indices, indptr)
    want = dec.run(q, want_cache, plan, kv_lens=kv_lens)
    # append_kv="from_q": the new K/V heads after the query heads of one array, read in place.
    from_q = jax.jit(lambda qkv, c, p, n: dec.run(qkv, c, p, kv_lens=n, append_kv="from_q"), donate_argnums=1)
    o_q, new_q = from_q(jnp.concatenate([q, k, v], axis=1), jax.tree.map(jnp.copy, cache), plan, kv_lens)
    fused = jax.jit(lambda q, c, p, k, v, n: dec.run(q, c, p, kv_lens=n, append_kv=(k, v)), donate_argnums=1)
    o, new = fused(q, cache, plan, k, v, kv_lens)
    np.testing.assert_array_equal(o_q, o)
    np.testing.assert_array_equal(new_q.k_pages, new.k_pages)
    np.testing.assert_array_equal(new_q.v_pages, new.v_pages)
    np.testing.assert_array_equal(new.k_pages, want_cache.k_pages)
    np.testing.assert_array_equal(new.v_pages, want_cache.v_pages)
    np.testing.assert_allclose(o, want, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(o[3]) == 0)
    kk, vv, tok = ref.gather_pages(new, indptr, indices, last)
    q, o, kk, vv = (np.asarray(x) for x in (q, o, kk, vv))  # host slices: no device op compiles
    for b in range(3):
        o64, _ = np64_attention(q[b:b + 1], kk[tok[b]:tok[b] + lens[b]], vv[tok[b]:tok[b] + lens[b]])
        assert rel_err(o[b], o64[0]) < TOL[jnp.float32]


def test_append_kv_rejects_what_it_cannot_fuse(rng):
    page, hq, hkv, d = 4, 8, 2, 64
    indptr, indices, last, num_pages = page_table(rng, np.array([9, 3]), page)
    cache = random_cache(rng, num_pages, page, hkv, d, jnp.float32)
    q = randn(rng, (2, hq, d), jnp.float32)
    k = randn(rng, (2, hkv, d), jnp.float32)
    dec = ji.BatchDecodeWithPagedKVCache(hq, hkv, d, page, num_ctas=4)
    plan = dec.plan(indptr, indices, last, num_pages=num_pages)
    with pytest.raises(ValueError, match="append_kv's v must have shape"):
        dec.run(q, cache, plan, append_kv=(k, k[:1]))
    with pytest.raises(ValueError, match="pair"):
        dec.run(q, cache, plan, append_kv=k)
    with pytest.raises(ValueError, match="'from_q'"):
        dec.run(q, cache, plan, append_kv="fused")
    with pytest.raises(ValueError, match=r"q must have shape \(2, 12, 64\) \(Hq \+ 2 Hkv heads"):
        dec.run(q, cache, plan, append_kv="from_q")
    with pytest.raises(ValueError, match="q's dtype"):
        dec.run(q.astype(jnp.bfloat16), random_cache(rng, num_pages, page, hkv, d, jnp.float16), plan,
                append_kv=(k, k))
    soft = ji.BatchDecodeWithPagedKVCache(hq, hkv, d, page, num_ctas=4, variant=ji.variants.soft_cap())
    with pytest.raises(ValueError, match="variant"):
        soft.run(q, cache, soft.plan(indptr, indices, last, num_pages=num_pages), append_kv=(k, k),
                 variant_params={"logits_soft_cap": 30.0})
