"""The short path (the decode kernel's multi-token items) takes exactly the requests the planner
calls short: dispatch's cost model and planner.batch.short_tokens share one rule. MHA (group 1)
requests of 17-32 tokens once went to the short path and were dropped by its planner."""
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from helpers import TOL, page_table, randn, random_cache, rel_err
from jaxinfer import dispatch
from jaxinfer import reference as ref
from planner import batch as batch_planner


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 8, 16, 32, 64, 128])
def test_dispatch_short_rule_is_the_planners(group):
    problem = dispatch.Problem("prefill", 2 * group, 2, 64, "paged", 16)
    short = dispatch.IMPLEMENTATIONS_BY_NAME["prefill_short"]
    for qo in range(1, 70):
        lens = np.array([1, qo], np.int32)
        finite = short.cost_us(problem, lens, np.array([64, 64]), True) < float("inf")
        _, is_short = batch_planner.short_tokens(lens, group)
        assert finite == bool(is_short.all()), (group, qo)


def _check(rng, wrapper, hq, hkv, qo, kv, page, layout, causal):
    d = 64
    indptr, indices, last, num_pages = page_table(rng, kv, page)
    cache = random_cache(rng, num_pages, page, hkv, d, jnp.float32, layout)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    q = randn(rng, (int(qo_indptr[-1]), hq, d), jnp.float32)
    w = wrapper(hq, hkv, d, page, causal=causal, layout=layout, num_ctas=8)
    plan = w.plan(qo_indptr, indptr, indices, last, num_pages=num_pages)
    o = np.asarray(w.run(q, cache, plan))
    want = np.asarray(ref.paged_attention(q, cache, qo_indptr, indptr, indices, last, causal=causal).o)
    for b in range(len(qo)):  # every request on its own: one wrong request is not averaged away
        rows = slice(qo_indptr[b], qo_indptr[b + 1])
        if qo[b]:
            assert rel_err(o[rows], want[rows]) < TOL[jnp.float32], (plan.impl, b)
    return plan.impl


# 16: the last short length (the short path); 17: the first long one, on a 32-row tile, the tile
# 32 fills too (32 under slow: 17's program); 33: the next tile height (under slow: the same
# prefill path as 17 on a 64-row tile). test_boundary's group-1 rows run 31, 32 and 33 (the paged
# prefill wrapper's alone steps and mixed step, a 64-row tile; ragged_paged_attention alone).
# The prefill wrapper's 16 and 17 under slow: test_boundary's group-1 row runs them alone (the classes
# of the cut) with the same wrapper.
@pytest.mark.parametrize("qo, wrapper", [
    pytest.param(qo, w, marks=pytest.mark.slow) if qo >= 32 or w is ji.BatchPrefillWithPagedKVCache
    else (qo, w) for qo in (16, 17, 32, 33) for w in (ji.BatchPrefillWithPagedKVCache, ji.BatchAttention)])
def test_mha_one_request_of_17_to_32_tokens(rng, wrapper, qo):
    _check(rng, wrapper, 4, 4, [qo], [qo], 16, "NHD", True)


# The prefill wrapper's under slow: test_boundary's group-1 row runs 17-32-token requests beside
# 1-16-token ones in one step (its mixed step) with the same wrapper; causal=False: the same branches.
@pytest.mark.parametrize("wrapper", [pytest.param(ji.BatchPrefillWithPagedKVCache, marks=pytest.mark.slow),
                                     ji.BatchAttention])
@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_mha_batch_with_a_20_token_request(rng, wrapper, causal):
    _check(rng, wrapper, 4, 4, [1, 1, 20, 3], [64, 1, 20, 50], 1, "HND", causal)
