"""jaxinfer.sampling on the CPU: the Pallas kernels in interpret mode against exact distributions.

Distribution tests draw thousands of tokens in one call (output rows share a few input rows
through `indices`) and run a chi-square goodness-of-fit test per (row, parameters) group against
the filtered, renormalised distribution of the reference; with fixed seeds each p-value is
deterministic and must exceed ALPHA = 1e-4, or else the group drawn again with 10x the draws under
another key must (a true bias only grows more visible; about 300 groups at 1e-4 would otherwise
fail one in 35 runs of a correct sampler whenever its draws change). Tokens outside the kept set
must never be drawn.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxinfer import dispatch
from jaxinfer import sampling as S
from pallas_kernels import sampling as sampling_kernels

ALPHA = 1e-4
V = 37                      # not a multiple of the block: the tail block is masked
# Three blocks per row (the last one 5 lanes). SMALL tracks one value per lane: most thresholds
# lie below a dropped value, so rows draw by rejection; TRACKED keeps every value (the draw from
# the tracked values) and compacts at most 4 of them for the thresholds (a bisection first, or
# to the threshold itself when more are tied at it); EXACT allows no rejection round (the exact
# search, then one race).
SMALL = S.SamplingConfig(block_v=16, track=1)
TRACKED = S.SamplingConfig(block_v=16, track=3, band=4)
EXACT = S.SamplingConfig(block_v=16, track=1, max_rounds=0)
CONFIGS = {"small": SMALL, "tracked": TRACKED, "exact": EXACT}
ROWS = 4                    # distinct input rows per distribution test
GROUPS = 12                 # (row, parameters) groups
DRAWS = 300                 # draws per group


# The references as one jitted program each (per filter combination and shape) instead of one per
# eager op; the same functions and the same arithmetic.
_ref_probs = jax.jit(S._reference_probs, static_argnames=("from_logits", "filter_apply_order"))
_ref_top_k_renorm = jax.jit(S._reference_top_k_renorm_probs)
_ref_top_p_renorm = jax.jit(S._reference_top_p_renorm_probs)
_ref_top_k_mask = jax.jit(S._reference_top_k_mask_logits)


def _rows(seed):
    """ROWS logit rows [ROWS, V] with ties: values on a 0.5 grid (so filters meet tied tokens)."""
    x = np.random.default_rng(seed).normal(size=(ROWS, V)) * 1.5
    return jnp.asarray(np.round(x * 2) / 2, jnp.float32)


def _chi2_pvalue(tokens, probs, draws):
    """p-value of observed tokens [N] against probs [V]; bins expected < 5 are pooled. Fails at
    once when a token of probability 0 is drawn."""
    counts = np.bincount(np.asarray(tokens), minlength=probs.shape[0])
    probs = np.asarray(probs, np.float64)
    assert np.all(counts[probs == 0] == 0), f"drew filtered tokens {np.nonzero(counts * (probs == 0))[0]}"
    expected = probs * draws
    small = expected < 5
    obs = np.append(counts[~small & (probs > 0)], counts[small & (probs > 0)].sum())
    exp = np.append(expected[~small & (probs > 0)], expected[small & (probs > 0)].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    if len(exp) < 2:  # one token carries all the mass: the check above is the test
        return 1.0
    return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def _group_params(values, groups=GROUPS, draws=DRAWS):
    """Per output row: the input row (group % ROWS) and the group's parameter (values cycle)."""
    g = np.repeat(np.arange(groups), draws)
    return jnp.asarray(g % ROWS, jnp.int32), np.asarray(values)[g % len(values)], g


CASES = {
    # name: (from_logits, parameter tables cycled over groups, call(x, idx, params, key, config))
    "sampling_from_logits": (
        True, {"temperature": [1.0, 0.5, 2.0, 0.0, 1.0, 0.7]},
        lambda x, i, a, k, c: S.sampling_from_logits(x, i, key=k, temperature=a["temperature"], config=c)),
    "sampling_from_probs": (
        False, {}, lambda x, i, a, k, c: S.sampling_from_probs(x, i, key=k, config=c)),
    "top_k_sampling_from_probs": (
        False, {"top_k": [1, 3, 5, 0, 12, 40, 36]},
        lambda x, i, a, k, c: S.top_k_sampling_from_probs(x, a["top_k"], i, key=k, config=c)),
    "top_p_sampling_from_probs": (
        False, {"top_p": [0.3, 0.6, 0.9, 1.0, 0.05, 0.75, 0.99]},
        lambda x, i, a, k, c: S.top_p_sampling_from_probs(x, a["top_p"], i, key=k, config=c)),
    "min_p_sampling_from_probs": (
        False, {"min_p": [0.0, 0.1, 0.5, 1.0, 0.3]},
        lambda x, i, a, k, c: S.min_p_sampling_from_probs(x, a["min_p"], i, key=k, config=c)),
    "top_k_top_p_sampling_from_logits": (
        True, {"top_k": [5, 0, 12, 3, 40, 8, 20], "top_p": [0.8, 0.5, 1.0, 0.9, 0.6, 0.95, 0.3],
               "temperature": [1.0, 0.8, 1.5, 1.0, 1.0]},
        lambda x, i, a, k, c: S.top_k_top_p_sampling_from_logits(x, a["top_k"], a["top_p"], i, key=k,
                                                                 temperature=a["temperature"], config=c)),
    "top_k_top_p_sampling_from_logits_joint": (
        True, {"top_k": [5, 0, 12, 3, 40, 8, 20], "top_p": [0.8, 0.5, 1.0, 0.9, 0.6, 0.95, 0.3]},
        lambda x, i, a, k, c: S.top_k_top_p_sampling_from_logits(x, a["top_k"], a["top_p"], i, "joint", key=k,
                                                                 config=c)),
    "top_k_top_p_sampling_from_probs": (
        False, {"top_k": [6, 0, 12, 3, 40, 8, 20], "top_p": [0.7, 0.5, 1.0, 0.9, 0.6, 0.95, 0.3]},
        lambda x, i, a, k, c: S.top_k_top_p_sampling_from_probs(x, a["top_k"], a["top_p"], i, key=k, config=c)),
    "top_k_top_p_sampling_from_probs_joint": (
        False, {"top_k": [6, 0, 12, 3, 40, 8, 20], "top_p": [0.7, 0.5, 1.0, 0.9, 0.6, 0.95, 0.3]},
        lambda x, i, a, k, c: S.top_k_top_p_sampling_from_probs(x, a["top_k"], a["top_p"], i, "joint", key=k,
                                                                config=c)),
}
# Every function with SMALL (rejection, and the search for top_k_first rows); one also with
# TRACKED; all filtered ones with TRACKED and EXACT under -m slow.
FAST_RUNS = {("top_k_top_p_sampling_from_logits", "tracked")}
RUNS = [(n, "small") for n in sorted(CASES)] + [
    pytest.param(n, c, marks=() if (n, c) in FAST_RUNS else pytest.mark.slow)
    for c in ("tracked", "exact") for n in sorted(CASES) if not n.startswith("sampling_")]


@pytest.mark.parametrize("name,config", RUNS)
def test_draws_follow_the_filtered_distribution(name, config):
    from_logits, tables, call = CASES[name]
    logits = _rows(len(name))
    x = logits if from_logits else jax.nn.softmax(logits, axis=1)
    g = np.repeat(np.arange(GROUPS), DRAWS)
    idx = jnp.asarray(g % ROWS, jnp.int32)
    per_row = {p: np.asarray(vals)[g % len(vals)] for p, vals in tables.items()}
    args = {p: jnp.asarray(v) for p, v in per_row.items()}
    cfg = CONFIGS[config]
    tokens = np.asarray(jax.jit(lambda *xs: call(*xs, cfg))(x, idx, args, jax.random.key(7)))
    assert tokens.shape == (GROUPS * DRAWS,) and tokens.dtype == np.int32
    order = "joint" if name.endswith("joint") else "top_k_first"
    ref = _ref_probs(np.asarray(x)[np.asarray(idx)], from_logits=from_logits, top_k=per_row.get("top_k"),
                     top_p=per_row.get("top_p"), min_p=per_row.get("min_p"),
                     temperature=per_row.get("temperature"), filter_apply_order=order)
    ref = np.asarray(ref)
    for grp in range(GROUPS):
        rows = g == grp
        pval = _chi2_pvalue(tokens[rows], ref[np.argmax(rows)], DRAWS)
        if pval <= ALPHA:  # second stage: the group again, 10x the draws under another key
            n = 10 * DRAWS
            one = {p: jnp.full((n,), v[np.argmax(rows)]) for p, v in per_row.items()}
            again = jax.jit(lambda *xs: call(*xs, cfg))(x, jnp.full((n,), grp % ROWS, jnp.int32), one,
                                                        jax.random.key(8 + grp))
            pval = _chi2_pvalue(np.asarray(again), ref[np.argmax(rows)], n)
        assert pval > ALPHA, (name, grp, {p: v[np.argmax(rows)] for p, v in per_row.items()}, pval)


def test_reference_semantics_on_ties():
    """The documented tie rules, checked on the reference itself (the kernels are compared to it)."""
    probs = jnp.asarray([[0.3, 0.2, 0.2, 0.2, 0.1]])
    keep = lambda **kw: np.asarray(_ref_probs(probs, from_logits=False, **kw)[0] > 0)
    assert keep(top_k=2).tolist() == [True, True, True, True, False]    # tied with the 2nd: kept
    assert keep(top_k=1).tolist() == [True, False, False, False, False]
    assert keep(top_p=0.3).tolist() == [True, False, False, False, False]  # 0.3 reaches 0.3
    assert keep(top_p=0.31).tolist() == [True, True, True, True, False]   # the tied 0.2s all kept
    assert keep(min_p=0.6).tolist() == [True, True, True, True, False]  # 0.2 >= 0.3 * 0.6
    assert keep(min_p=0.7).tolist() == [True, False, False, False, False]


def test_renorm_and_mask_match_reference(rng):
    """top_k_renorm_probs, top_p_renorm_probs and top_k_mask_logits: exact per-row thresholds,
    mixed per-row parameters, ties (a 0.5 grid) and bfloat16 logits; the renormalisations also
    with a band of 4 compacted values (TRACKED)."""
    logits = _rows(3)
    probs = jax.nn.softmax(logits, axis=1)
    ks = jnp.asarray([3, 0, 36, 37])
    ps = jnp.asarray([0.5, 1.0, 0.93, 0.05])
    lb = jnp.asarray((np.asarray(logits) * 7.3).astype(jnp.bfloat16))

    @jax.jit  # the four kernels and their references in one program
    def both(probs, logits, lb, ks, ps):
        return ((S.top_k_renorm_probs(probs, ks, config=SMALL), S._reference_top_k_renorm_probs(probs, ks)),
                (S.top_p_renorm_probs(probs, ps, config=SMALL), S._reference_top_p_renorm_probs(probs, ps)),
                (S.top_k_mask_logits(logits, ks, config=SMALL), S._reference_top_k_mask_logits(logits, ks)),
                (S.top_k_mask_logits(lb, 5), S._reference_top_k_mask_logits(lb, 5)),
                (S.top_k_renorm_probs(probs, ks, config=TRACKED), S.top_p_renorm_probs(probs, ps, config=TRACKED)))

    (k_got, k_want), (p_got, p_want), (masked, m_want), (out, b_want), (k_band, p_band) = both(probs, logits, lb, ks, ps)
    np.testing.assert_allclose(k_got, k_want, atol=1e-6)
    np.testing.assert_allclose(p_got, p_want, atol=1e-6)
    np.testing.assert_allclose(k_band, k_want, atol=1e-6)
    np.testing.assert_allclose(p_band, p_want, atol=1e-6)
    np.testing.assert_array_equal(masked, m_want)
    kept = np.isfinite(np.asarray(masked)).sum(1)
    assert kept[1] == V and kept[2] >= 36 and kept[0] >= 3  # 0 and >= V keep all; ties may add
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), b_want)


@pytest.mark.parametrize("band,track,block_v,vocab", [(8, 2, 32, 70), (4, 3, 16, V), (64, 3, 32, 90)])
def test_top_k_thresholds_at_the_band_edges(band, track, block_v, vocab):
    """The compacted band's edges: k = 1, band - 1, band, band + 1, beyond the tracked values,
    V - 1, on continuous rows and on rows tied on a 0.5 grid: top_k_mask_logits exactly,
    top_k_renorm_probs and top_p_renorm_probs (p = 0.5 and 0.95) to 1e-6 of the references."""
    rng = np.random.default_rng(band)
    ks = np.asarray([1, band - 1, band, band + 1, min(track * block_v + 3, vocab - 1), vocab - 1])
    cont = rng.normal(size=(len(ks), vocab)) * 2
    logits = jnp.asarray(np.concatenate([cont, np.round(cont * 2) / 2]), jnp.float32)  # [2 x 6, V]
    probs = jax.nn.softmax(logits, axis=1)
    top_k = jnp.asarray(np.concatenate([ks, ks]), jnp.int32)
    top_p = jnp.asarray(np.resize([0.5, 0.95], logits.shape[0]), jnp.float32)
    cfg = S.SamplingConfig(block_v=block_v, track=track, band=band)

    @jax.jit  # the kernels and the references in one program
    def run(logits, probs, top_k, top_p):
        return ((S.top_k_mask_logits(logits, top_k, config=cfg), _ref_top_k_mask(logits, top_k)),
                (S.top_k_renorm_probs(probs, top_k, config=cfg), _ref_top_k_renorm(probs, top_k)),
                (S.top_p_renorm_probs(probs, top_p, config=cfg), _ref_top_p_renorm(probs, top_p)))

    (masked, m_want), (k_got, k_want), (p_got, p_want) = run(logits, probs, top_k, top_p)
    np.testing.assert_array_equal(masked, m_want)
    np.testing.assert_allclose(k_got, k_want, atol=1e-6)
    np.testing.assert_allclose(p_got, p_want, atol=1e-6)


def test_large_vocab_non_multiple_of_block():
    """V = 50_000 (13 blocks of 4096, the last partial): the exact top-k mask (k = 50 from the
    tracked values, k = 1000 by the search), and top-k + top-p draws inside the kept set."""
    vocab = 50_000
    logits = jax.random.normal(jax.random.key(3), (2, vocab), jnp.float32) * 3
    ks = jnp.asarray([50, 1000])

    @jax.jit  # the kernels and the references in one program
    def run(logits, ks, key):
        return (S.top_k_mask_logits(logits, ks), S._reference_top_k_mask_logits(logits, ks),
                S.top_k_top_p_sampling_from_logits(logits, ks, 0.9, key=key),
                S._reference_probs(logits, from_logits=True, top_k=ks, top_p=0.9, filter_apply_order="top_k_first"))

    masked, want, tok, ref = (np.asarray(a) for a in run(logits, ks, jax.random.key(0)))
    np.testing.assert_array_equal(masked, want)
    assert np.all(ref[np.arange(2), tok] > 0)


@pytest.mark.slow
def test_large_vocab_renorm_and_draws():
    """V = 50_000 with the default config: top-k / top-p renormalisation against the reference,
    and top-p / min-p draws (rejection, and the tracked values) inside the kept set."""
    vocab = 50_000
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(4), (2, vocab), jnp.float32) * 3, axis=1)
    np.testing.assert_allclose(S.top_k_renorm_probs(probs, jnp.asarray([50, 3000])),
                               S._reference_top_k_renorm_probs(probs, jnp.asarray([50, 3000])), atol=1e-6)
    np.testing.assert_allclose(S.top_p_renorm_probs(probs, 0.9), S._reference_top_p_renorm_probs(probs, 0.9),
                               atol=1e-6)
    idx = jnp.asarray(np.arange(128) % 2, jnp.int32)
    for call, kw in [(S.top_p_sampling_from_probs, dict(top_p=0.9)), (S.min_p_sampling_from_probs, dict(min_p=0.1))]:
        tok = np.asarray(call(probs, *kw.values(), idx, key=jax.random.key(1)))
        ref = np.asarray(S._reference_probs(probs, from_logits=False, **kw))
        assert np.all(ref[np.asarray(idx), tok] > 0), call.__name__


def test_dispatch_picks_the_race_for_unfiltered_draws_only():
    assert dispatch.sampling_row(S.Filters(from_logits=True)).name == "sampling_race"
    assert dispatch.sampling_row(S.Filters(from_logits=False, min_p=True)).name == "sampling_pallas"
    assert dispatch.sampling_row(S.Filters(from_logits=False, top_k=True, sample=False)).name == "sampling_pallas"


def test_unfiltered_draws_do_not_depend_on_the_split():
    """An unfiltered draw splits each row among several programs (config.splits; by default two
    per SM in all): every column's race key is its own, so any split gives the same tokens, greedy
    rows (temperature 0) included, on a partial last block; the default config on two rows of
    two blocks (two programs a row)."""
    logits = _rows(11)[:, :V - 3]  # three blocks, the last partial
    temps = jnp.asarray([1.0, 0.0, 0.5, 2.0])
    probs = jax.nn.softmax(logits, axis=1)

    def draws(splits):  # both calls in one program per split
        cfg = dataclasses.replace(SMALL, splits=splits)
        return jax.jit(lambda lg, pr, t, key: (S.sampling_from_logits(lg, key=key, temperature=t, config=cfg),
                                               S.sampling_from_probs(pr, key=key, config=cfg)))(
            logits, probs, temps, jax.random.key(4))

    whole = draws(1)
    for splits in (2, 3):
        for got, want in zip(draws(splits), whole):
            np.testing.assert_array_equal(got, want)
    big = jax.random.normal(jax.random.key(5), (2, 5_000), jnp.float32) * 3
    race = jax.jit(lambda x, key, c: S.sampling_from_logits(x, key=key, config=c), static_argnums=2)
    np.testing.assert_array_equal(race(big, jax.random.key(6), None), race(big, jax.random.key(6), S.SamplingConfig(splits=1)))


# A split pass 1's code differs by top-p (lane masses, from probabilities or relative to the lane
# maximum for logits), by logits (tempered, greedy rows) and by whether it races (a draw, or the
# threshold alone): min-p, top-k first from logits and the top-p threshold cover every branch by
# default; the joint top-k + top-p draw from probabilities under slow.
SPLIT_CALLS = {
    "joint_probs": lambda x, probs, ks, ps, temps, key, c: S.top_k_top_p_sampling_from_probs(
        probs, ks, ps, filter_apply_order="joint", key=key, config=c),
    "min_p": lambda x, probs, ks, ps, temps, key, c: S.min_p_sampling_from_probs(
        probs, jnp.asarray([0.1, 0.0, 0.5, 0.2, 0.05]), key=key, config=c),
    "top_k_first_logits": lambda x, probs, ks, ps, temps, key, c: S.top_k_top_p_sampling_from_logits(
        x, ks, ps, key=key, temperature=temps, config=c),
    "top_p_renorm": lambda x, probs, ks, ps, temps, key, c: S.top_p_renorm_probs(probs, ps, config=c),
}


@pytest.mark.parametrize("call", [pytest.param(n, marks=pytest.mark.slow) if n == "joint_probs" else n
                                  for n in SPLIT_CALLS])
def test_split_pass_one_draws_the_same_tokens(call):
    """A filtered draw's pass 1 split among programs (lanes of 128 each; config.splits 3 rounds
    down to 2) gives the fused pass 1's values, so the same tokens and thresholds: min-p from
    probabilities, top-k first from tempered and greedy logits, the top-p threshold alone (top-k
    and top-p from probabilities, joint, under slow). One value tracked per lane over 5 blocks (the
    last partial) sends rows through rejection and the exact search. The default config splits the
    large-vocabulary test's rows 32 ways."""
    x = jax.random.normal(jax.random.key(0), (5, 1_100), jnp.float32) * 3
    probs = jax.nn.softmax(x, axis=1)
    ks, ps = jnp.asarray([5, 50, 0, 3, 400]), jnp.asarray([0.9, 0.5, 0.99, 1.0, 0.8])
    temps = jnp.asarray([1.0, 0.7, 0.0, 1.3, 1.0])
    fused = S.SamplingConfig(block_v=256, track=1, splits=1)
    split = dataclasses.replace(fused, splits=3)
    assert sampling_kernels.lane_splits(split, x.shape[1]) == 2 and sampling_kernels.lane_splits(fused, x.shape[1]) == 1
    run = jax.jit(SPLIT_CALLS[call], static_argnums=6)
    args = (x, probs, ks, ps, temps, jax.random.key(3))
    np.testing.assert_array_equal(run(*args, split), run(*args, fused))


def test_dispatch_splits_pass_one_for_small_batches_only():
    """Programs per row by default: an unfiltered draw gives every SM two; a filtered draw splits
    its pass 1 only when each row gets dispatch.MIN_LANE_SPLITS or more; a given count is kept."""
    race, topk = S.Filters(from_logits=True), S.Filters(from_logits=False, top_k=True)
    cfg = S.SamplingConfig()
    assert dispatch.sampling_config(race, cfg, 64, 132).splits == 5
    assert dispatch.sampling_config(topk, cfg, 1, 132).splits == 264
    assert sampling_kernels.lane_splits(dispatch.sampling_config(topk, cfg, 1, 132), 128_256) == 32
    assert sampling_kernels.lane_splits(dispatch.sampling_config(topk, cfg, 32, 132), 128_256) == dispatch.MIN_LANE_SPLITS
    assert dispatch.sampling_config(topk, cfg, 64, 132).splits == 1
    assert dispatch.sampling_config(topk, dataclasses.replace(cfg, splits=4), 64, 132).splits == 4


def test_deterministic_per_key_and_compiled_once():
    """Same key, same tokens; another key, other tokens; one trace for every parameter value."""
    traces = []

    @jax.jit
    def step(logits, k, p, t, key):
        traces.append(1)
        return S.top_k_top_p_sampling_from_logits(logits, k, p, key=key, temperature=t, config=SMALL)

    logits = jnp.tile(_rows(5), (64, 1))
    a = step(logits, 5, 0.9, 1.0, jax.random.key(1))
    b = step(logits, 5, 0.9, 1.0, jax.random.key(1))
    c = step(logits, 5, 0.9, 1.0, jax.random.key(2))
    np.testing.assert_array_equal(a, b)
    assert np.any(np.asarray(a) != np.asarray(c))
    step(logits, 20, 0.5, 0.7, jax.random.key(3))
    step(logits, 0, 1.0, 0.0, jax.random.key(4))
    step(logits, jnp.arange(256) % 9, jnp.linspace(0.1, 1.0, 256), jnp.full(256, 0.8), jax.random.key(5))
    assert len(traces) == 2  # scalar parameters, then [B] arrays (another input shape)


def test_vmap_and_greedy():
    """vmap over a leading axis equals separate calls; temperature 0 takes the first argmax."""
    logits = jnp.stack([_rows(8), _rows(9)])  # [2, ROWS, V]
    keys = jax.random.split(jax.random.key(0), 2)
    f = lambda x, k: S.sampling_from_logits(x, key=k, temperature=0.9, config=SMALL)
    np.testing.assert_array_equal(jax.vmap(f)(logits, keys), jnp.stack([f(logits[i], keys[i]) for i in range(2)]))
    tied = jnp.zeros((ROWS, V)).at[0, 7].set(1.0).at[0, 20].set(1.0).at[1, 30].set(2.0)
    greedy = S.sampling_from_logits(tied, key=jax.random.key(1), temperature=0.0, config=SMALL)
    np.testing.assert_array_equal(greedy, [7, 30, 0, 0])


def test_bad_inputs_raise_when_concrete_and_are_documented_under_jit():
    key = jax.random.key(0)
    x = _rows(1)
    probs = jax.nn.softmax(x, axis=1)
    with pytest.raises(ValueError, match="NaN"):
        S.sampling_from_logits(x.at[1, 3].set(jnp.nan), key=key)
    with pytest.raises(ValueError, match="no finite logit"):
        S.sampling_from_logits(x.at[2].set(-jnp.inf), key=key)
    with pytest.raises(ValueError, match=r"\+inf"):
        S.top_k_mask_logits(x.at[0, 0].set(jnp.inf), 3)
    with pytest.raises(ValueError, match="summing to 0"):
        S.sampling_from_probs(probs.at[1].set(0.0), key=key)
    with pytest.raises(ValueError, match="negative"):
        S.top_p_sampling_from_probs(probs.at[1, 1].set(-0.1), 0.9, key=key)
    with pytest.raises(ValueError, match="top_p"):
        S.top_p_sampling_from_probs(probs, 0.0, key=key)
    with pytest.raises(ValueError, match="top_p"):
        S.top_p_sampling_from_probs(probs, jnp.asarray([0.5, 1.5, 0.5, 0.5]), key=key)
    with pytest.raises(ValueError, match="min_p"):
        S.min_p_sampling_from_probs(probs, -0.1, key=key)
    with pytest.raises(ValueError, match="top_k"):
        S.top_k_sampling_from_probs(probs, jnp.asarray([1, 2]), key=key)
    with pytest.raises(ValueError, match="top_k"):
        S.top_k_sampling_from_probs(probs, 2.5, key=key)
    with pytest.raises(ValueError, match="temperature"):
        S.sampling_from_logits(x, key=key, temperature=-1.0)
    with pytest.raises(ValueError, match="filter_apply_order"):
        S.top_k_top_p_sampling_from_logits(x, 3, 0.9, filter_apply_order="top_p_first", key=key)
    with pytest.raises(ValueError, match="indices"):
        S.sampling_from_probs(probs, jnp.asarray([0, 4]), key=key)
    with pytest.raises(ValueError, match="key"):
        S.sampling_from_probs(probs, key=3)
    with pytest.raises(ValueError, match="logits"):
        S.sampling_from_logits(x[0], key=key)
    for field, value in (("band", 48), ("block_v", 0), ("num_warps", 6), ("track", 0), ("splits", 0)):
        with pytest.raises(ValueError, match=f"SamplingConfig: {field}"):
            S.SamplingConfig(**{field: value})
    # Under jit nothing is checked: a row with no finite logit gives token 0, the others sample.
    bad = x.at[2].set(-jnp.inf)
    tok = jax.jit(lambda v, k: S.sampling_from_logits(v, key=k, config=SMALL))(bad, key)
    assert int(tok[2]) == 0 and np.all((np.asarray(tok) >= 0) & (np.asarray(tok) < V))


SPEC_N = 3


def _spec_case(seed, batch):
    rng = np.random.default_rng(seed)
    draft = jax.nn.softmax(jnp.asarray(rng.normal(size=(batch, SPEC_N, V)), jnp.float32), axis=-1)
    target = jax.nn.softmax(jnp.asarray(rng.normal(size=(batch, SPEC_N + 1, V)) * 1.5, jnp.float32), axis=-1)
    ids = jnp.asarray(rng.integers(0, V, size=(batch, SPEC_N)), jnp.int32)
    return draft, ids, target


def test_chain_speculative_sampling_counts():
    """Constructed cases: drafts equal to the target are all accepted (bonus token from the last
    target row); a draft the target gives probability 0 is rejected at once."""
    draft, ids, target = _spec_case(0, 4)
    spec = jax.jit(lambda d, i, t, k: S.chain_speculative_sampling(d, i, t, key=k, config=SMALL))
    same = np.concatenate([np.asarray(draft), np.asarray(target)[:, -1:]], axis=1)  # on the host: no program
    out, accepted, emitted = spec(draft, ids, same, jax.random.key(0))
    np.testing.assert_array_equal(emitted, [SPEC_N] * 4)
    np.testing.assert_array_equal(accepted, [SPEC_N] * 4)
    np.testing.assert_array_equal(out[:, :SPEC_N], ids)
    assert np.all(np.asarray(out[:, SPEC_N]) >= 0)
    # Row 0: first draft impossible under the target; row 1: second; rows 2, 3: all accepted.
    ids_np, t = np.asarray(ids), same.copy()
    t[0, 0, ids_np[0, 0]] = t[1, 1, ids_np[1, 1]] = 0.0
    t = jnp.asarray(t / np.sum(t, axis=-1, keepdims=True))
    out, accepted, emitted = spec(draft, ids, t, jax.random.key(1))
    np.testing.assert_array_equal(emitted, [0, 1, SPEC_N, SPEC_N])
    np.testing.assert_array_equal(accepted, [SPEC_N - 1, SPEC_N - 1, SPEC_N, SPEC_N])
    out = np.asarray(out)
    assert out[0, 0] != ids[0, 0] and np.all(out[0, 1:] == -1)
    assert out[1, 0] == ids[1, 0] and out[1, 1] != ids[1, 1] and np.all(out[1, 2:] == -1)
    np.testing.assert_array_equal(out[2:, :SPEC_N], ids[2:])
    ref = jax.jit(S._reference_chain_speculative_sampling)(draft, ids, t, key=jax.random.key(1))
    np.testing.assert_array_equal(emitted, ref[2])
    np.testing.assert_array_equal(accepted, ref[1])


def test_chain_speculative_sampling_follows_the_target():
    """Drafts drawn from the draft model: the first emitted token follows target row 0, and the
    second (when the first draft was accepted) target row 1 (chi-square, ALPHA)."""
    batch = 3000
    draft1, _, target1 = _spec_case(1, 1)

    @jax.jit  # the drafts and the step in one program
    def step(draft1, target1, key_draft, key):
        draft = jnp.broadcast_to(draft1, (batch, SPEC_N, V))
        target = jnp.broadcast_to(target1, (batch, SPEC_N + 1, V))
        ids = jax.random.categorical(key_draft, jnp.log(draft), axis=-1).astype(jnp.int32)
        out, _, emitted = S.chain_speculative_sampling(draft, ids, target, key=key, config=SMALL)
        return out, emitted, ids

    out, emitted, ids = step(draft1, target1, jax.random.key(2), jax.random.key(3))
    out, emitted, ids = np.asarray(out), np.asarray(emitted), np.asarray(ids)
    assert _chi2_pvalue(out[:, 0], target1[0, 0], batch) > ALPHA
    # Given the first draft was accepted, the second emitted token follows target row 1.
    second = out[emitted >= 1, 1]
    assert _chi2_pvalue(second, target1[0, 1], len(second)) > ALPHA
    assert 0 < np.mean(emitted) < SPEC_N


GPU_CALLS = {
    "race": lambda x, k: S.sampling_from_logits(x, key=k, temperature=0.7, backend="gpu"),
    "top_k_top_p_logits": lambda x, k: S.top_k_top_p_sampling_from_logits(x, 5, 0.9, key=k, backend="gpu"),
    "joint_probs": lambda x, k: S.top_k_top_p_sampling_from_probs(x, 5, 0.9, filter_apply_order="joint", key=k,
                                                                  backend="gpu"),
    "min_p": lambda x, k: S.min_p_sampling_from_probs(x, 0.1, key=k, backend="gpu"),
    "top_p": lambda x, k: S.top_p_sampling_from_probs(x, 0.9, key=k, backend="gpu"),
    "top_p_renorm": lambda x, k: S.top_p_renorm_probs(x, 0.9, backend="gpu"),
    "top_k_mask": lambda x, k: S.top_k_mask_logits(x, 5, backend="gpu"),
}


# By default every kind of kernel once (the race; draws from logits with top-k and top-p, in
# bfloat16; joint top-k and top-p from probabilities; min-p; a threshold alone, renormalised and
# masked); under slow the rest of the grid (top-p alone, and top-k + top-p logits in float32).
@pytest.mark.parametrize("call, dtype", [
    ("race", jnp.float32), ("top_k_top_p_logits", jnp.bfloat16), ("joint_probs", jnp.float32),
    ("min_p", jnp.float32), ("top_p_renorm", jnp.float32), ("top_k_mask", jnp.float32),
    pytest.param("top_k_top_p_logits", jnp.float32, marks=pytest.mark.slow),
    pytest.param("top_p", jnp.float32, marks=pytest.mark.slow)])
def test_gpu_kernels_lower_for_cuda_on_any_host(call, dtype):
    """The compiled kernels (backend="gpu") lower to Triton IR for an H100 without a GPU (the
    Pallas-Triton rules run; Triton does not)."""
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)
    x = jnp.ones((4, 1000), dtype)  # concrete arrays are made outside the abstract mesh
    key = jax.random.key(0)
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(GPU_CALLS[call]).trace(x, key).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text
