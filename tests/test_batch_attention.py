"""BatchAttention: mixed query lengths in one call (decode kernel for short rows, prefill tiles for
the rest), in interpret mode against float64 NumPy attention per request (helpers.np64_attention,
the oracle jaxinfer.reference is checked against: no reference program to compile per shape)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from helpers import TOL, assert_lse_close, np64_attention, page_table, randn, random_cache, rel_err
from jaxinfer import reference as ref
from planner import batch as batch_planner

# qo lengths 0, 1, 4, 37 and others; kv past split and page boundaries.
QO = np.array([1, 0, 4, 37, 2, 1, 3])
KV = np.array([300, 9, 64, 90, 17, 1, 130])


def _want(q, cache, qo_indptr, indptr, indices, last, causal=False):
    """Float64 NumPy attention of each request over its listed pages: (o [nnz, Hq, D], lse [nnz, Hq])."""
    k, v, tok = ref.gather_pages(cache, indptr, indices, last)  # on the host
    q, k, v = (np.asarray(x, np.float32) for x in (q, k, v))
    outs = [np64_attention(q[a:b], k[c:e], v[c:e], causal=causal)
            for a, b, c, e in zip(qo_indptr[:-1], qo_indptr[1:], tok[:-1], tok[1:])]
    return ji.AttentionState(np.concatenate([o for o, _ in outs]), np.concatenate([lse for _, lse in outs]))


def _pad_pages(cache, num_pages):
    """The cache padded to num_pages pages, on the host (no program per shape)."""
    pad = ((0, num_pages - cache.num_pages),) + ((0, 0),) * 3
    return ji.PagedKVCache(*(jnp.asarray(np.pad(np.asarray(p), pad)) for p in (cache.k_pages, cache.v_pages)),
                           cache.layout)


def _pad_rows(q, n):
    return jnp.asarray(np.pad(np.asarray(q), ((0, n - q.shape[0]), (0, 0), (0, 0))))


def _case(rng, qo, kv, page, hq, hkv, d, layout="NHD", poison=True):
    indptr, indices, last, num_pages = page_table(rng, kv, page, extra_pages=3)
    cache = random_cache(rng, num_pages, page, hkv, d, jnp.float32, layout)
    if poison:  # unlisted pages hold NaN: any read outside a request's list shows
        unlisted = np.setdiff1d(np.arange(num_pages), indices[: indptr[-1]])
        cache = ji.PagedKVCache(cache.k_pages.at[unlisted].set(jnp.nan), cache.v_pages.at[unlisted].set(jnp.nan),
                                layout)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    q = randn(rng, (qo_indptr[-1], hq, d), jnp.float32)
    return q, cache, (qo_indptr, indptr, indices, last), num_pages


# Page 1 HND causal under slow: BatchAttention's page-1 HND steps run by default in
# test_short_path.test_mha_batch_with_a_20_token_request (causal and not; both classes) and in
# test_boundary's group-8 row (non-causal, every boundary length).
@pytest.mark.parametrize("page, layout, causal", [(8, "NHD", True), pytest.param(1, "HND", True, marks=pytest.mark.slow),
                                                  pytest.param(16, "NHD", False, marks=pytest.mark.slow)])
def test_mixed_step_matches_reference(rng, page, layout, causal):
    hq, hkv, d = 4, 2, 32
    q, cache, table, num_pages = _case(rng, QO, KV, page, hq, hkv, d, layout)
    attn = ji.BatchAttention(hq, hkv, d, page, causal=causal, layout=layout, num_ctas=8)
    plan = attn.plan(*table, num_pages=num_pages)
    assert plan.impl.startswith("decode_triton+prefill_")
    o, lse = attn.run(q, cache, plan, return_lse=True)
    want = _want(q, cache, *table, causal=causal)
    assert rel_err(o, want.o) < TOL[jnp.float32]
    assert_lse_close(lse, want.lse)


@pytest.mark.slow  # test_capacities_give_one_program_for_every_composition checks this on six compositions
def test_one_compilation_across_compositions(rng):
    """Fixed capacities: steps of different mixes (same short-token class) share one program."""
    hq, hkv, d, page = 4, 2, 32, 8
    attn = ji.BatchAttention(hq, hkv, d, page, num_ctas=8, max_batch_size=8, max_num_tokens=64,
                             max_num_pages=64)
    traces = []
    step = jax.jit(lambda q, c, p: (traces.append(1), attn.run(q, c, p))[1])
    for qo, kv in ((np.array([1, 3, 20]), np.array([40, 70, 33])),
                   (np.array([2, 1, 1, 30, 4]), np.array([9, 100, 17, 45, 4]))):
        q, cache, table, num_pages = _case(rng, qo, kv, page, hq, hkv, d, poison=False)
        cache = ji.PagedKVCache(jnp.pad(cache.k_pages, ((0, 64 - num_pages),) + ((0, 0),) * 3),
                                jnp.pad(cache.v_pages, ((0, 64 - num_pages),) + ((0, 0),) * 3))
        plan = attn.plan(*table, num_pages=64)
        qp = jnp.pad(q, ((0, 64 - q.shape[0]), (0, 0), (0, 0)))
        o = step(qp, cache, plan)
        want = ref.paged_attention(q, cache, *table, causal=True)
        assert rel_err(o[: q.shape[0]], want.o) < TOL[jnp.float32]
        assert not np.any(np.asarray(o[q.shape[0]:]))  # padding rows give 0
    assert len(traces) == 1


def test_decode_only_and_short_class(rng):
    hq, hkv, d, page = 8, 2, 32, 4
    qo, kv = np.array([1, 1, 1]), np.array([5, 200, 33])
    q, cache, table, num_pages = _case(rng, qo, kv, page, hq, hkv, d)
    attn = ji.BatchAttention(hq, hkv, d, page, num_ctas=4)
    plan = attn.plan(*table, num_pages=num_pages)
    assert plan.impl == "decode_triton" and plan.long is None and plan.layout.tokens_per_item == 1
    assert rel_err(attn.run(q, cache, plan), _want(q, cache, *table).o) < TOL[jnp.float32]
    # Group 4 x 16 tokens fill a 64-row tile: 16 tokens are short, 17 are long.
    tokens, short = batch_planner.short_tokens(np.array([16, 17, 1]), 4)
    assert tokens == 16 and short.tolist() == [True, False, True]


def test_plan_is_bound_to_wrapper_and_cache(rng):
    hq, hkv, d, page = 4, 2, 32, 8
    q, cache, table, num_pages = _case(rng, QO, KV, page, hq, hkv, d, poison=False)
    plan = ji.BatchAttention(hq, hkv, d, page, num_ctas=8).plan(*table, num_pages=num_pages)
    with pytest.raises(ValueError, match="page_size"):
        ji.BatchAttention(hq, hkv, d, 4, num_ctas=8).run(q, cache, plan)
    small = ji.PagedKVCache(cache.k_pages[: num_pages - 1], cache.v_pages[: num_pages - 1])
    with pytest.raises(ValueError, match="kv_cache has"):
        ji.BatchAttention(hq, hkv, d, page, num_ctas=8).run(q, small, plan)
    with pytest.raises(ValueError, match="num_pages"):
        ji.BatchAttention(hq, hkv, d, page).plan(*table)


def test_work_item_schema():
    """One schema: layouts name theirs; the mixed launch's items are prefill items, renamed."""
    from planner import work_items
    assert batch_planner.ShortLayout.ITEMS is work_items.DECODE_MULTI
    assert batch_planner.MixedLayout.ITEMS is work_items.MIXED
    assert work_items.MIXED.width == work_items.PREFILL.width
    assert work_items.MIXED.head == work_items.PREFILL.part_base and work_items.DECODE_MULTI.qo_len == 7
    assert work_items.PREFILL.ordered(**{n: i * 10 for i, n in enumerate(work_items.PREFILL.names)})[3] == 30
    with pytest.raises(ValueError, match="exactly the columns"):
        work_items.DECODE.ordered(request=0)
    with pytest.raises(AttributeError, match="no column 'kv_end'"):
        work_items.DECODE.kv_end
    from planner import mla as mla_planner  # its named row view has the schema's columns, in order
    assert tuple(f.name for f in dataclasses.fields(mla_planner.WorkItem)) == work_items.MLA.names


@pytest.mark.parametrize("causal", [True, False])
def test_prefill_wrapper_runs_short_steps_on_the_decode_kernel(rng, causal):
    """A prefill step whose requests all fit one decode tile (speculative verify) plans
    impl "prefill_short"; causal and not, against the reference, padding rows zero."""
    hq, hkv, d, page = 4, 2, 32, 8
    qo, kv = np.array([4, 1, 0, 3]), np.array([70, 9, 5, 200])
    q, cache, table, num_pages = _case(rng, qo, kv, page, hq, hkv, d)
    pre = ji.BatchPrefillWithPagedKVCache(hq, hkv, d, page, causal=causal, num_ctas=8, max_num_tokens=10)
    plan = pre.plan(*table, num_pages=num_pages)
    assert plan.impl == "prefill_short"
    o, lse = (np.asarray(x) for x in pre.run(_pad_rows(q, 10), cache, plan, return_lse=True))
    want = _want(q, cache, *table, causal=causal)
    assert rel_err(o[:8], want.o) < TOL[jnp.float32]
    assert_lse_close(lse[:8], want.lse)
    assert not np.any(o[8:]) and np.all(np.isneginf(lse[8:]))



def _bf16(q, cache):
    bf16 = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
    return bf16(q), ji.PagedKVCache(bf16(cache.k_pages), bf16(cache.v_pages))


def _f32(cache):
    return ji.PagedKVCache(cache.k_pages.astype(jnp.float32), cache.v_pages.astype(jnp.float32))


@pytest.mark.parametrize("causal, d", [(True, 128), pytest.param(False, 128, marks=pytest.mark.slow),
                                       pytest.param(True, 64, marks=pytest.mark.slow)])
def test_mixed_kernel_matches_reference(rng, causal, d):
    """impl="mixed": short requests (qo 1, 3; 0 too) as packed tiles and long ones (37, 140:
    several query tiles, unaligned first rows) in one persistent Mosaic launch (its interpreter),
    bf16, unlisted pages NaN, against float64; lse too. head_dim 128 runs two compute
    warpgroups, 64 three. Group 2 over two KV heads (the interpreter's time grows with the items:
    a query tile per query head, a packed tile per KV head)."""
    hq, hkv, page = 4, 2, 16
    qo, kv = np.array([1, 37, 0, 3, 140, 1]), np.array([40, 50, 9, 100, 150, 16])
    q, cache, table, num_pages = _case(rng, qo, kv, page, hq, hkv, d)
    q, cache = _bf16(q, cache)
    attn = ji.BatchAttention(hq, hkv, d, page, causal=causal, impl="mixed")
    plan = attn.plan(*table, num_pages=num_pages, q_data_type="bfloat16")
    assert plan.impl == "batch_mosaic" and plan.info["num_short"] == 3
    o, lse = attn.run(q, cache, plan, return_lse=True)
    want = _want(q, cache, *table, causal=causal)  # of the bf16 values
    assert rel_err(np.asarray(o, np.float32), want.o) < TOL[jnp.bfloat16]
    assert_lse_close(lse, want.lse, tol=2e-2)


def test_mixed_plans_share_one_program_under_capacities(rng):
    """Fixed capacities: mixed plans of different compositions have one pytree structure (static
    data included) and the same leaf shapes, so a jitted run() traces once (run below, slow)."""
    attn = ji.BatchAttention(4, 1, 64, 8, impl="mixed", max_batch_size=4, max_num_tokens=96, max_num_pages=48)
    shapes = []
    for qo, kv in ((np.array([2, 70]), np.array([30, 100])), (np.array([40, 1, 2, 20]), np.array([41, 9, 64, 20]))):
        _, _, table, _ = _case(rng, qo, kv, 8, 4, 1, 64, poison=False)
        plan = attn.plan(*table, num_pages=48, q_data_type="bfloat16")
        assert plan.impl == "batch_mosaic"
        leaves, treedef = jax.tree_util.tree_flatten(plan)
        shapes.append((treedef, [(x.shape, x.dtype) for x in leaves]))
    assert shapes[0] == shapes[1]


@pytest.mark.slow
def test_mixed_kernel_compiles_once_under_capacities(rng):
    """Fixed capacities: two mixed compositions share one program; rows past the step give 0."""
    hq, hkv, d, page = 4, 1, 64, 8
    attn = ji.BatchAttention(hq, hkv, d, page, impl="mixed", max_batch_size=4, max_num_tokens=96,
                             max_num_pages=48)
    traces = []
    step = jax.jit(lambda q, c, p: (traces.append(1), attn.run(q, c, p))[1])
    for qo, kv in ((np.array([2, 70]), np.array([30, 100])), (np.array([40, 1, 2, 20]), np.array([41, 9, 64, 20]))):
        q, cache, table, num_pages = _case(rng, qo, kv, page, hq, hkv, d, poison=False)
        q, cache = _bf16(q, cache)
        cache = ji.PagedKVCache(jnp.pad(cache.k_pages, ((0, 48 - num_pages),) + ((0, 0),) * 3),
                                jnp.pad(cache.v_pages, ((0, 48 - num_pages),) + ((0, 0),) * 3))
        plan = attn.plan(*table, num_pages=48, q_data_type="bfloat16")
        assert plan.impl == "batch_mosaic"
        o = step(jnp.pad(q, ((0, 96 - q.shape[0]), (0, 0), (0, 0))), cache, plan)
        want = ref.paged_attention(q.astype(jnp.float32), _f32(cache), *table, causal=True)
        assert rel_err(o[: q.shape[0]].astype(jnp.float32), want.o) < TOL[jnp.bfloat16]
        assert not np.any(np.asarray(o[q.shape[0]:], np.float32))  # padding rows give 0
    assert len(traces) == 1


def test_auto_told_the_dtypes_picks_the_mixed_launch_where_the_model_says(rng, monkeypatch):
    """On Hopper (patched in), plan(q_data_type=...) lets "auto" weigh the batch family's rows:
    chunks with decode rows take the mixed launch, a decode row of long context keeps the two
    classes, and a plan without dtypes always keeps them (the mixed kernel takes 16-bit only)."""
    from jaxinfer import _backend
    monkeypatch.setattr(_backend, "mosaic_available", lambda interpret: True)
    monkeypatch.setattr(_backend, "num_sms", lambda default=132: 132)
    attn = ji.BatchAttention(32, 8, 128, 16)
    for qo, kv, told, impl in (([512] * 4 + [1] * 60, [2048] * 4 + [3000] * 60, True, "batch_mosaic"),
                               ([512, 1], [2048, 131072], True, "decode_triton+prefill_mosaic"),
                               ([512] * 4 + [1] * 60, [2048] * 4 + [3000] * 60, False,
                                "decode_triton+prefill_mosaic")):
        indptr, indices, last, num_pages = page_table(rng, np.array(kv), 16)
        qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
        plan = attn.plan(qo_indptr, indptr, indices, last, num_pages=num_pages,
                         q_data_type="bfloat16" if told else None)
        assert plan.impl == impl, (qo[:2], kv[:2], told)


@pytest.mark.parametrize("hq, hkv, qo", [(8, 2, [3, 300, 0, 1, 130, 16, 9]), (9, 1, [3, 5, 300, 1, 6])])
def test_mixed_plan_covers_every_row_once(rng, hq, hkv, qo):
    """planner.batch.plan_mixed (NumPy only): each long row x query head lies in exactly one
    query tile starting at its request's first row (rows 3 and 309 are not 8-aligned), each
    short request x KV head is one packed tile over all its keys, a cell runs its items by kind
    (even cells query tiles first, odd cells packed tiles first), and lse_src points each row
    and head at its tile's lse slot."""
    page, T = 16, 128
    group = hq // hkv
    qo = np.array(qo)
    kv = qo + rng.integers(0, 200, qo.shape[0])
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    pages = -(-kv // page)
    page_base = np.concatenate([[0], np.cumsum(pages)[:-1]]).astype(np.int32)
    tokens, is_short = batch_planner.short_tokens(qo, group)
    nnz = int(qo.sum())
    layout, buf, info = batch_planner.plan_mixed(
        qo_indptr, kv.astype(np.int32), page_base, np.arange(pages.sum(), dtype=np.int32), is_short,
        page_size=page, num_qo_heads=hq, num_kv_heads=hkv, num_cells=5, tile_tokens=T, tokens_per_item=tokens,
        num_tokens=nnz + 5, batch_cap=8, index_cap=int(pages.sum()), causal=True)
    sec = layout.unpack(buf)
    items = sec["items"].reshape(-1, layout.ITEMS.width)[:info["num_items"]]
    assert sec["cell_indptr"][0] == 0 and sec["cell_indptr"][-1] == info["num_items"]
    for c in range(5):  # even cells run their query tiles first, odd cells their packed tiles
        kinds = items[sec["cell_indptr"][c]:sec["cell_indptr"][c + 1], 9]
        assert np.all(np.diff(kinds) >= 0) if c % 2 == 0 else np.all(np.diff(kinds) <= 0), (c, kinds)
    covered = np.zeros((layout.num_tokens, hq), int)
    slot_of = {}
    for start, tile_tok, n, _, kv_len, _, kv_end, head, slot, packed, *_ in items:
        if packed:
            assert n * group <= 64 and kv_end == kv_len
            for t in range(n):
                for g in range(group):
                    covered[start + t, head * group + g] += 1
                    slot_of[start + t, head * group + g] = slot * T + t * group + g
        else:
            assert tile_tok % T == 0 and 0 <= tile_tok < n
            for r in range(max(0, -tile_tok), min(T, n - tile_tok)):
                covered[start + tile_tok + r, head] += 1
                slot_of[start + tile_tok + r, head] = slot * T + r
    assert np.all(covered[:nnz] == 1) and not covered[nnz:].any()
    src = sec["lse_src"]
    assert np.all(src[nnz:] == -1)
    for (row, h), want in slot_of.items():
        packed = src[row] >= layout.packed_slot0 * T
        assert src[row] + ((h // group) * T + h % group if packed else h * T) == want, (row, h)


def test_mixed_impl_rejects_what_it_cannot_run(rng):
    with pytest.raises(ValueError, match="variant"):
        ji.BatchAttention(8, 2, 64, 16, impl="mixed", variant=ji.variants.soft_cap())
    with pytest.raises(ValueError, match="head_dim"):
        ji.BatchAttention(8, 2, 32, 16, impl="mixed")
    attn = ji.BatchAttention(8, 2, 64, 16, impl="mixed")
    q, cache, table, num_pages = _case(rng, np.array([1, 40]), np.array([20, 50]), 16, 8, 2, 64)
    with pytest.raises(ValueError, match="float32"):
        attn.plan(*table, num_pages=num_pages, q_data_type="float32")


# Decode-only, verify-only, mixed, prefill-only and empty steps under one set of capacities.
COMPOSITIONS = [([1, 1, 1, 1], [40, 9, 1, 70]), ([4, 4, 4], [30, 64, 17]), ([1, 12, 3], [33, 12, 50]),
                ([20, 1, 1, 2, 5, 1], [20, 9, 100, 2, 45, 4]), ([40, 17], [60, 17]), ([0, 0], [5, 9])]


@pytest.mark.parametrize("wrapper, hq, hkv", [(ji.BatchAttention, 8, 2),
                                             pytest.param(ji.BatchAttention, 4, 4, marks=pytest.mark.slow),
                                             (ji.BatchPrefillWithPagedKVCache, 8, 2)])
def test_capacities_give_one_program_for_every_composition(rng, wrapper, hq, hkv):
    """With max_batch_size, max_num_tokens and max_num_pages, every plan has one pytree structure
    and the same shapes: a jitted step compiles once across every kind of step."""
    d, page, cap_b, cap_t, cap_p = 32, 8, 8, 64, 96
    w = wrapper(hq, hkv, d, page, num_ctas=8, max_batch_size=cap_b, max_num_tokens=cap_t, max_num_pages=cap_p)
    traces, shapes = [], set()
    step = jax.jit(lambda q, c, p: (traces.append(1), w.run(q, c, p))[1])
    for qo, kv in COMPOSITIONS:
        qo, kv = np.array(qo), np.array(kv)
        q, cache, table, num_pages = _case(rng, qo, kv, page, hq, hkv, d, poison=False)
        cache = _pad_pages(cache, cap_p)
        plan = w.plan(*table, num_pages=cap_p)
        leaves, tree = jax.tree_util.tree_flatten(plan)
        shapes.add((tree, tuple((x.shape, x.dtype) for x in leaves)))
        o = np.asarray(step(_pad_rows(q, cap_t), cache, plan))
        if q.shape[0]:
            assert rel_err(o[: q.shape[0]], _want(q, cache, *table, causal=True).o) < TOL[jnp.float32], (qo, plan.impl)
        assert not np.any(o[q.shape[0]:])  # padding rows give 0
    assert len(shapes) == 1 and len(traces) == 1


# BatchAttention's long class is the prefill wrapper's plan and runner (BatchPrefillWithPagedKVCache
# under capacities runs by default in test_capacities_give_one_program_for_every_composition);
# the prefill wrapper's own case under slow.
@pytest.mark.parametrize("wrapper", [ji.BatchAttention, pytest.param(ji.BatchPrefillWithPagedKVCache,
                                                                    marks=pytest.mark.slow)])
def test_capacity_plans_merge_their_split_tiles(rng, wrapper):
    """Under capacities the split tiles' merge loops over its live groups (the rest of its
    capacity is never visited); long requests split by Algorithm 1 over 8 CTAs merge exactly."""
    hq, hkv, d, page, cap_t, cap_p = 8, 2, 32, 8, 64, 200
    qo, kv = np.array([20, 1, 9]), np.array([700, 33, 500])
    w = wrapper(hq, hkv, d, page, num_ctas=8, max_batch_size=4, max_num_tokens=cap_t, max_num_pages=cap_p)
    q, cache, table, num_pages = _case(rng, qo, kv, page, hq, hkv, d, poison=False)
    cache = _pad_pages(cache, cap_p)
    plan = w.plan(*table, num_pages=cap_p)
    long = plan.long if isinstance(plan, ji.plans.BatchPlan) else plan
    dest = np.asarray(long.sections()["merge_dest"])
    assert 0 < np.count_nonzero(dest >= 0) < dest.shape[0]  # live groups first, then capacity
    o = np.asarray(jax.jit(w.run)(_pad_rows(q, cap_t), cache, plan))
    assert rel_err(o[: q.shape[0]], _want(q, cache, *table, causal=True).o) < TOL[jnp.float32]
    assert not np.any(o[q.shape[0]:])


# The fixed plan's run under slow: test_capacities_give_one_program_for_every_composition runs
# BatchAttention's fixed plans (both classes launched) on a decode-only step by default.
@pytest.mark.parametrize("run_fixed", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_fixed_shapes_opt_out_and_check(rng, run_fixed):
    """fixed_shapes=False keeps each step's own kernels under capacities (run against float64); the
    default plans both classes (run under slow); True needs every capacity."""
    hq, hkv, d, page = 8, 2, 32, 8
    q, cache, table, num_pages = _case(rng, np.array([1, 1]), np.array([30, 9]), page, hq, hkv, d)
    caps = dict(max_batch_size=4, max_num_tokens=16, max_num_pages=num_pages)
    for fixed, impl in ((None, "decode_triton+prefill_triton"), (False, "decode_triton")):
        attn = ji.BatchAttention(hq, hkv, d, page, num_ctas=4, fixed_shapes=fixed, **caps)
        plan = attn.plan(*table, num_pages=num_pages)
        assert plan.impl == impl
        if fixed is None and not run_fixed:
            continue
        o = np.asarray(attn.run(_pad_rows(q, 16), cache, plan))
        assert rel_err(o[:2], _want(q, cache, *table, causal=True).o) < TOL[jnp.float32]
    with pytest.raises(ValueError, match="fixed_shapes=True needs"):
        ji.BatchAttention(hq, hkv, d, page, fixed_shapes=True, max_batch_size=4)
