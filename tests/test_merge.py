"""The ⊕ merge kernels (interpret mode) against the reference and attention over whole KV sets."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jaxinfer as ji
from helpers import np64_attention, randn, rel_err
from jaxinfer import reference as ref


_ref_merge_state = jax.jit(ref.merge_state)  # one program per shape, not one per op
_ref_merge_states = jax.jit(ref.merge_states)


def _random_state(rng, lead, h=4, d=16, empty_frac=0.0):
    lse = rng.standard_normal(lead + (h,)) * 4
    lse[rng.random(lse.shape) < empty_frac] = -np.inf
    return ji.AttentionState(randn(rng, lead + (h, d), jnp.float32), jnp.asarray(lse, jnp.float32))


def _states_of_split(q, k, v, cuts):
    """States of q over consecutive KV segments split at `cuts` (float64 NumPy attention, as
    float32 host arrays: an empty segment gives o = 0, lse = -inf)."""
    bounds = [0, *cuts, k.shape[0]]
    q, k, v = (np.asarray(x) for x in (q, k, v))
    return [ji.AttentionState(*(x.astype(np.float32) for x in np64_attention(q, k[a:b], v[a:b])))
            for a, b in zip(bounds[:-1], bounds[1:])]


def test_merge_state_matches_reference(rng):
    a, b = _random_state(rng, (6,), empty_frac=0.2), _random_state(rng, (6,), empty_frac=0.2)
    out = ji.merge_state(a, b)
    want = _ref_merge_state(a, b)
    assert rel_err(out.o, want.o) < 1e-6
    np.testing.assert_allclose(out.lse, want.lse, rtol=1e-6)


def test_merge_with_empty_is_identity_and_two_empties_are_empty(rng):
    a = _random_state(rng, (3,))
    empty = ji.AttentionState(randn(rng, (3, 4, 16), jnp.float32), jnp.full((3, 4), -jnp.inf))
    for out in (ji.merge_state(a, empty), ji.merge_state(empty, a)):
        np.testing.assert_allclose(out.o, a.o, rtol=1e-6)
        np.testing.assert_array_equal(out.lse, a.lse)
    both = ji.merge_state(empty, empty)
    assert np.all(np.asarray(both.o) == 0) and np.all(np.isneginf(both.lse))


def test_masked_merge_keeps_first_state(rng):
    a, b = _random_state(rng, (5,)), _random_state(rng, (5,))
    mask = np.array([True, False, True, False, False])
    out, full, a_np = (ji.AttentionState(np.asarray(x.o), np.asarray(x.lse))  # indexed on the host
                       for x in (ji.merge_state(a, b, mask), _ref_merge_state(a, b), a))
    np.testing.assert_allclose(out.o[mask], full.o[mask], rtol=1e-6)
    np.testing.assert_array_equal(out.o[~mask], a_np.o[~mask])
    np.testing.assert_array_equal(out.lse[~mask], a_np.lse[~mask])
    with pytest.raises(ValueError, match="mask"):
        ji.merge_state(a, b, mask[:3])


# The order is data (one path): shuffled by default, forward and reverse under slow.
@pytest.mark.parametrize("order", [pytest.param(o, marks=pytest.mark.slow) if o != "shuffled" else o
                                   for o in ("forward", "reverse", "shuffled")])
def test_any_split_merged_in_any_order_equals_whole(rng, order):
    q, k, v = randn(rng, (3, 4, 16), jnp.float32), randn(rng, (40, 2, 16), jnp.float32), randn(rng, (40, 2, 16), jnp.float32)
    parts = _states_of_split(q, k, v, sorted(rng.choice(np.arange(1, 40), 4, replace=False)))
    idx = {"forward": range(5), "reverse": range(4, -1, -1), "shuffled": rng.permutation(5)}[order]
    parts = [parts[i] for i in idx]
    acc = ji.AttentionState(*map(jnp.asarray, parts[0]))
    for p in parts[1:]:
        acc = ji.merge_state(acc, ji.AttentionState(*map(jnp.asarray, p)))
    o64, lse64 = np64_attention(q, k, v)
    assert rel_err(acc.o, o64) < 1e-5
    np.testing.assert_allclose(acc.lse, lse64, rtol=1e-5)
    stacked = ji.AttentionState(jnp.asarray(np.stack([p.o for p in parts], 1)),
                                jnp.asarray(np.stack([p.lse for p in parts], 1)))
    multi = ji.merge_states(stacked)
    assert rel_err(multi.o, o64) < 1e-5
    np.testing.assert_allclose(multi.lse, lse64, rtol=1e-5)


def test_extreme_logits_do_not_overflow():
    q = jnp.full((1, 2, 16), 64.0)
    k = jnp.concatenate([jnp.full((3, 1, 16), -64.0), jnp.full((3, 1, 16), 64.0)])
    v = jnp.asarray(np.random.default_rng(0).standard_normal((6, 1, 16)), jnp.float32)
    a = ji.single_prefill_with_kv_cache(q, k[:3], v[:3], return_lse=True)
    b = ji.single_prefill_with_kv_cache(q, k[3:], v[3:], return_lse=True)
    merged = ji.merge_state(a, b)
    o64, lse64 = np64_attention(q, k, v)
    assert np.all(np.isfinite(np.asarray(merged.o))) and np.all(np.isfinite(np.asarray(merged.lse)))
    assert rel_err(merged.o, o64) < 1e-5
    np.testing.assert_allclose(merged.lse, lse64, rtol=1e-6)


def test_varlen_merge_groups_and_empty_groups(rng):
    states = _random_state(rng, (9,), empty_frac=0.3)
    indptr = np.array([0, 3, 3, 4, 9], np.int32)
    out = ji.merge_state_varlen(states, indptr)
    out, (s_o, s_lse) = ji.AttentionState(np.asarray(out.o), np.asarray(out.lse)), map(np.asarray, states)
    for g in range(4):  # (indexed on the host: no program per slice)
        lo, hi = indptr[g], indptr[g + 1]
        if lo == hi:
            assert np.all(out.o[g] == 0) and np.all(np.isneginf(out.lse[g]))
            continue
        want = _ref_merge_states(ji.AttentionState(s_o[lo:hi][None], s_lse[lo:hi][None]))
        np.testing.assert_allclose(out.o[g], want.o[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out.lse[g], want.lse[0], rtol=1e-6)
    with pytest.raises(ValueError, match="indptr"):
        ji.merge_state_varlen(states, np.array([0, 3, 2], np.int32))
    with pytest.raises(ValueError, match="indptr must be int32"):
        ji.merge_state_varlen(states, np.array([0, 3], np.int64))


def test_varlen_merge_looping_programs_writes_what_one_per_group_writes(rng):
    """merge_varlen with num_programs (each program loops over groups p, p + P, ...) and num_live
    (groups from it on write nothing): the same rows as one program per group, other rows kept."""
    from pallas_kernels import merge as merge_kernels
    states = _random_state(rng, (12,), h=8, empty_frac=0.2)
    indptr = jnp.asarray([0, 3, 3, 4, 9, 12, 12, 12], jnp.int32)  # 7 groups, two empty
    dest = jnp.asarray([5, 0, 2, -1, 7, 3, 6], jnp.int32)
    poison = (jnp.full((8, 8, 16), 7.0, jnp.float32), jnp.full((8, 8), 7.0, jnp.float32))
    want = merge_kernels.merge_varlen(states.o, states.lse, indptr, dest, out=poison, interpret=True)
    got = merge_kernels.merge_varlen(states.o, states.lse, indptr, dest, out=poison, interpret=True,
                                     num_programs=3, num_live=jnp.int32(7))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.all(np.asarray(want[0])[[1, 4]] == 7.0)  # rows no group names, and dest -1
    live5 = merge_kernels.merge_varlen(states.o, states.lse, indptr, dest, out=poison, interpret=True,
                                       num_programs=2, num_live=jnp.int32(5))
    np.testing.assert_array_equal(np.asarray(live5[0])[[5, 0, 2, 7]], np.asarray(want[0])[[5, 0, 2, 7]])
    assert np.all(np.asarray(live5[0])[[3, 6]] == 7.0)  # groups 5 and 6 are past num_live
    with pytest.raises(ValueError, match="num_live"):
        merge_kernels.merge_varlen(states.o, states.lse, indptr, dest, out=poison, interpret=True,
                                   num_live=jnp.int32(5))
    # Without num_live, a program stops at its first group with dest < 0 (plans list live groups
    # first): live groups 0-4, then dead ones; the groups after group 3 (dest -1) in program 1's
    # sequence 1, 3, 5 are not reached, program 0's 0, 2, 4, 6 all are.
    prefix = jnp.asarray([5, 0, 2, 7, 3, -1, -1], jnp.int32)
    full = merge_kernels.merge_varlen(states.o, states.lse, indptr, prefix, out=poison, interpret=True)
    looped = merge_kernels.merge_varlen(states.o, states.lse, indptr, prefix, out=poison, interpret=True,
                                        num_programs=2)
    for a, b in zip(looped, full):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.all(np.asarray(looped[0])[[1, 4, 6]] == 7.0)
    stops = jnp.asarray([5, -1, 2, 7, 3, 0, 6], jnp.int32)  # a dead group in program 1's sequence
    cut = merge_kernels.merge_varlen(states.o, states.lse, indptr, stops, out=poison, interpret=True,
                                     num_programs=2)
    every = merge_kernels.merge_varlen(states.o, states.lse, indptr, stops, out=poison, interpret=True)
    np.testing.assert_array_equal(np.asarray(cut[0])[[5, 2, 3, 6]], np.asarray(every[0])[[5, 2, 3, 6]])
    assert np.all(np.asarray(cut[0])[[7, 0]] == 7.0)  # groups 3 and 5 follow program 1's dead group 1


@settings(max_examples=8, deadline=None)
@given(st.integers(2, 30), st.integers(1, 4), st.data())
def test_property_random_ragged_splits(kv_len, n_parts, data):
    rng = np.random.default_rng(kv_len * 7 + n_parts)
    q, k, v = randn(rng, (2, 2, 16), jnp.float32), randn(rng, (kv_len, 1, 16), jnp.float32), randn(rng, (kv_len, 1, 16), jnp.float32)
    cuts = sorted(data.draw(st.lists(st.integers(0, kv_len), min_size=n_parts - 1, max_size=n_parts - 1)))
    parts = _states_of_split(q, k, v, cuts)  # segments may be empty
    n = len(parts)  # rows ordered (query row, part): group r holds query r's n partial states
    o = jnp.asarray(np.stack([p.o for p in parts], 1).reshape(2 * n, 2, 16))  # stacked on the host
    lse = jnp.asarray(np.stack([p.lse for p in parts], 1).reshape(2 * n, 2))
    out = ji.merge_state_varlen(ji.AttentionState(o, lse), np.array([0, n, 2 * n], np.int32))
    o64, lse64 = np64_attention(q, k, v)
    assert rel_err(out.o, o64) < 1e-5
    np.testing.assert_allclose(out.lse, lse64, rtol=1e-5)
