"""single_prefill / single_decode (Pallas kernels in interpret mode) against the reference and float64."""
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from helpers import TOL, assert_lse_close, np64_attention, randn, rel_err
from jaxinfer import reference as ref


@pytest.mark.parametrize("qo, kv, hq, hkv, d, causal, dtype", [
    pytest.param(37, 54, 8, 2, 64, True, jnp.float32, marks=pytest.mark.slow),  # the branches of the f16 / bf16 cases
    # non-causal: the single-key case below, and test_boundary.test_single_prefill_boundaries[5-26-256-False]
    pytest.param(37, 54, 8, 2, 64, False, jnp.float32, marks=pytest.mark.slow),
    (17, 97, 4, 4, 128, True, jnp.bfloat16),
    (40, 23, 4, 1, 64, True, jnp.float16),   # qo_len > kv_len: leading rows see no key
    (5, 1, 2, 1, 64, False, jnp.float32),    # a single visible key
])
def test_single_prefill(rng, qo, kv, hq, hkv, d, causal, dtype):
    q, k, v = randn(rng, (qo, hq, d), dtype), randn(rng, (kv, hkv, d), dtype), randn(rng, (kv, hkv, d), dtype)
    o, lse = ji.single_prefill_with_kv_cache(q, k, v, causal=causal, return_lse=True)
    want = ref.attention(q, k, v, causal=causal)
    o64, lse64 = np64_attention(q, k, v, causal=causal)
    assert o.dtype == dtype and lse.dtype == jnp.float32
    assert rel_err(o, want.o) < TOL[dtype] and rel_err(o, o64) < TOL[dtype]
    assert_lse_close(lse, lse64, 1e-4 if dtype == jnp.float32 else 1e-2)
    if causal and qo > kv:
        assert np.all(np.asarray(o[: qo - kv]) == 0) and np.all(np.isneginf(lse[: qo - kv]))


def test_single_prefill_sm_scale_and_plain_output(rng):
    q, k, v = randn(rng, (9, 2, 64), jnp.float32), randn(rng, (11, 2, 64), jnp.float32), randn(rng, (11, 2, 64), jnp.float32)
    o = ji.single_prefill_with_kv_cache(q, k, v, sm_scale=0.3)
    o64, _ = np64_attention(q, k, v, sm_scale=0.3)
    assert rel_err(o, o64) < 2e-5


@pytest.mark.parametrize("kv, hq, hkv, d, dtype", [
    pytest.param(97, 8, 2, 64, jnp.float32, marks=pytest.mark.slow), (300, 4, 4, 128, jnp.bfloat16), (1, 8, 1, 64, jnp.float16), (0, 4, 2, 64, jnp.float32)])
def test_single_decode(rng, kv, hq, hkv, d, dtype):
    q, k, v = randn(rng, (hq, d), dtype), randn(rng, (kv, hkv, d), dtype), randn(rng, (kv, hkv, d), dtype)
    o, lse = ji.single_decode_with_kv_cache(q, k, v, return_lse=True, num_ctas=16)
    o64, lse64 = np64_attention(q[None], k, v)
    if kv == 0:
        assert np.all(np.asarray(o) == 0) and np.all(np.isneginf(lse))
        return
    assert rel_err(o, o64[0]) < TOL[dtype]
    assert_lse_close(lse, lse64[0], 1e-4 if dtype == jnp.float32 else 1e-2)


def test_single_rejects_bad_input(rng):
    q, k = randn(rng, (4, 6, 64), jnp.float32), randn(rng, (5, 4, 64), jnp.float32)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ji.single_prefill_with_kv_cache(q, k, k)
    with pytest.raises(ValueError, match="head_dim"):
        ji.single_prefill_with_kv_cache(randn(rng, (4, 8, 32), jnp.float32), k, k)
    with pytest.raises(ValueError, match="one shape"):
        ji.single_decode_with_kv_cache(randn(rng, (8, 64), jnp.float32), k, k[:3])
    with pytest.raises(ValueError, match="dtype"):
        ji.single_decode_with_kv_cache(randn(rng, (8, 64), jnp.bfloat16), k, k)
