"""BatchAttention: mixed query lengths in one call (decode kernel for short rows, prefill tiles for
the rest), in interpret mode against jaxinfer.reference (itself checked against float64 NumPy)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from helpers import TOL, assert_lse_close, page_table, randn, random_cache, rel_err
from jaxinfer import reference as ref
from pallas_kernels import decode as decode_kernels
from planner import batch as batch_planner

# qo lengths 0, 1, 4, 37 and others; kv past split and page boundaries.
QO = np.array([1, 0, 4, 37, 2, 1, 3])
KV = np.array([300, 9, 64, 90, 17, 1, 130])


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


@pytest.mark.parametrize("page, layout, causal", [(8, "NHD", True), (1, "HND", True), (16, "NHD", False)])
def test_mixed_step_matches_reference(rng, page, layout, causal):
    hq, hkv, d = 4, 2, 32
    q, cache, table, num_pages = _case(rng, QO, KV, page, hq, hkv, d, layout)
    attn = ji.BatchAttention(hq, hkv, d, page, causal=causal, layout=layout, num_ctas=8)
    plan = attn.plan(*table, num_pages=num_pages)
    assert plan.impl.startswith("decode_triton+prefill_")
    o, lse = attn.run(q, cache, plan, return_lse=True)
    want = ref.paged_attention(q, cache, *table, causal=causal)
    assert rel_err(o, want.o) < TOL[jnp.float32]
    assert_lse_close(lse, want.lse)


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
    assert rel_err(attn.run(q, cache, plan), ref.paged_attention(q, cache, *table).o) < TOL[jnp.float32]
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


def test_item_columns_agree():
    assert batch_planner.ITEM_COLUMNS == decode_kernels.MULTI_ITEM_COLUMNS


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
    o, lse = pre.run(jnp.pad(q, ((0, 2), (0, 0), (0, 0))), cache, plan, return_lse=True)
    want = ref.paged_attention(q, cache, *table, causal=causal)
    assert rel_err(o[:8], want.o) < TOL[jnp.float32]
    assert_lse_close(lse[:8], want.lse)
    assert not np.any(np.asarray(o[8:])) and np.all(np.isneginf(np.asarray(lse[8:])))
