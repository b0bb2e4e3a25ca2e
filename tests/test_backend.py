"""Backend selection: interpret mode on CPU by default, forced by argument or environment."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from helpers import randn
from jaxinfer import _backend
from pallas_kernels import merge as merge_kernels


def test_default_is_interpret_on_cpu(monkeypatch):
    monkeypatch.delenv("JAXINFER_BACKEND", raising=False)
    assert _backend.use_interpret() is True
    assert _backend.use_interpret("interpret") is True
    assert _backend.use_interpret("gpu") is False


def test_environment_variable_forces_the_backend(monkeypatch):
    monkeypatch.setenv("JAXINFER_BACKEND", "gpu")
    assert _backend.use_interpret() is False
    assert _backend.use_interpret("interpret") is True  # the argument wins
    monkeypatch.setenv("JAXINFER_BACKEND", "cuda")
    with pytest.raises(ValueError, match="backend"):
        _backend.use_interpret()


def test_bad_backend_and_impl_are_rejected(rng):
    q = randn(rng, (4, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="backend"):
        ji.single_decode_with_kv_cache(q[0], q, q, backend="tpu")
    lse = jnp.zeros((4, 2))
    with pytest.raises(ValueError, match="unknown impl 'mosaic'"):
        merge_kernels.merge_pair(q, lse, q, lse, jnp.ones(4, jnp.int32), interpret=True, impl="mosaic")


def test_explicit_interpret_matches_reference(rng):
    q, k = randn(rng, (3, 2, 16), jnp.float32), randn(rng, (7, 1, 16), jnp.float32)
    o = ji.single_prefill_with_kv_cache(q, k, k, backend="interpret")
    np.testing.assert_allclose(o, ji.reference.attention(q, k, k).o, rtol=2e-5, atol=2e-6)


def test_eager_calls_compile_each_kernel_once(rng):
    """Eager run() and sampling calls jit their kernels (non-array arguments static), so a
    repeated call compiles nothing: an eager pallas_call alone traces its kernel anew and misses
    the compile cache (seconds a call)."""
    from jax._src import monitoring

    from helpers import page_table, random_cache
    compiles = []

    def listen(name, secs, **kw):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(secs)

    hq, hkv, d, page = 4, 2, 16, 8
    qo, kv = np.array([1, 20]), np.array([30, 20])  # a decode row and a prefill tile
    indptr, indices, last, num_pages = page_table(rng, kv, page)
    cache = random_cache(rng, num_pages, page, hkv, d, jnp.float32, "NHD")
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    q = randn(rng, (int(qo_indptr[-1]), hq, d), jnp.float32)
    attn = ji.BatchAttention(hq, hkv, d, page, num_ctas=4)
    plan = attn.plan(qo_indptr, indptr, indices, last, num_pages=num_pages)
    assert plan.impl == "decode_triton+prefill_triton"
    probs = jax.nn.softmax(randn(rng, (2, 40), jnp.float32), axis=1)
    calls = [lambda: attn.run(q, cache, plan),
             lambda: ji.sampling.top_p_sampling_from_probs(probs, 0.5, key=jax.random.key(0))]
    firsts = [np.asarray(call()) for call in calls]
    monitoring.register_event_duration_secs_listener(listen)
    try:
        seconds = [np.asarray(call()) for call in calls]
    finally:
        monitoring.unregister_event_duration_listener(listen)
    assert compiles == []
    for a, b in zip(firsts, seconds):
        np.testing.assert_array_equal(a, b)


def test_interpret_mode_poisons_outputs():
    """Interpret mode starts every float output as NaN, so any element a kernel fails to
    write shows up as NaN (helpers.rel_err rejects NaN): the suite's poisoned outputs."""
    from jax.experimental import pallas as pl

    def writes_nothing(x_ref, o_ref):
        pass

    out = pl.pallas_call(writes_nothing, out_shape=jax.ShapeDtypeStruct((4, 8), jnp.float32),
                         interpret=True)(jnp.ones((4, 8)))
    assert np.all(np.isnan(np.asarray(out)))


def test_ptx_float_literals_round_trip():
    """The softmax scale is baked into the GPU kernels' inline PTX as an f32 literal."""
    from pallas_kernels import _common
    assert _common._ptx_f32(1.0) == "0f3F800000"
    assert _common._ptx_f32(-2.5) == "0fC0200000"
    scale = 0.08838834764831845 * _common.LOG2E
    bits = int(_common._ptx_f32(scale)[2:], 16)
    assert np.float32(scale) == np.frombuffer(np.uint32(bits).tobytes(), np.float32)[0]


def test_math_helpers_are_jnp_outside_compiled_kernels_and_asm_inside(rng):
    from pallas_kernels import _common
    s = randn(rng, (8, 16), jnp.float32).at[0, :3].set(-jnp.inf)
    m = randn(rng, (8,), jnp.float32)
    np.testing.assert_array_equal(_common.exp2(s), jnp.exp2(s))
    np.testing.assert_array_equal(_common.exp2_scaled(s, 0.25, m), jnp.exp2(s * 0.25 - m[:, None]))
    np.testing.assert_array_equal(ji.variants.tanh(s), jnp.tanh(s))
    for fast in (False, True):
        with _common.kernel_math(fast):
            for fn in (lambda x: _common.exp2(x), lambda x: _common.tanh(x),
                       lambda x: _common.exp2_scaled(x, 0.25, m)):  # fresh functions: traces are cached
                jaxpr = str(jax.make_jaxpr(fn)(s))
                assert ("elementwise_inline_asm" in jaxpr) == fast


def test_uniform_marks_scalars_only_inside_compiled_kernels():
    from pallas_kernels import _common
    x = jnp.int32(7)
    assert _common.uniform(x) is x
    for fast in (False, True):
        with _common.kernel_math(fast):
            jaxpr = str(jax.make_jaxpr(lambda v: _common.uniform(v) + 1)(x))
            assert ("jaxinfer_uniform" in jaxpr) == fast


def cuda_target():
    """Context for lowering to CUDA on a host without a GPU. Pallas' Triton lowering asks for the
    target GPU's compute capability; jax >= 0.11 takes it only from an abstract mesh's
    AbstractDevice (0.10 falls back to a default), so name an H100 for every version."""
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev))


def lower_for_cuda(fn, *args):
    """The StableHLO text of fn(*args) lowered for CUDA."""
    with cuda_target():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


TRITON_CALL = "__gpu$xla.gpu.triton"  # the custom call of a Pallas-Triton kernel
MOSAIC_CALL = "mosaic_gpu"  # ... and of a Mosaic GPU one


def compiled_decode_case(d, variant=None, b=2, s=40, hq=8, hkv=2, page=16):
    """A bf16 paged cache of b requests of s tokens, q of ones [b, hq, d], and a compiled-backend
    decode wrapper with its plan: (cache, (indptr, indices, last), q, dec, plan)."""
    from benchmarks.common import random_paged_cache
    cache, indptr, indices, last = random_paged_cache(np.random.default_rng(0), np.full(b, s), page, hkv, d,
                                                      jnp.bfloat16)
    dec = ji.BatchDecodeWithPagedKVCache(hq, hkv, d, page, backend="gpu", variant=variant)
    plan = dec.plan(indptr, indices, last, num_pages=cache.num_pages)
    return cache, (indptr, indices, last), jnp.ones((b, hq, d), jnp.bfloat16), dec, plan


def test_gpu_kernels_lower_for_cuda_on_any_host():
    """The compiled (non-interpret) decode and prefill kernels lower to Triton IR for CUDA; this
    runs the Pallas-Triton lowering rules (inline PTX, the uniform scalar rule) without a GPU."""
    b, s, hq, hkv, d, page = 2, 40, 8, 2, 64, 16
    cache, (indptr, indices, last), q, dec, plan = compiled_decode_case(d)
    num_pages = cache.num_pages
    assert TRITON_CALL in lower_for_cuda(dec.run, q, cache, plan)
    for fp8 in (jnp.float8_e4m3fn, jnp.float8_e5m2):  # V read as byte pairs, widened by inline PTX
        c8 = ji.PagedKVCache(cache.k_pages.astype(fp8), cache.v_pages.astype(fp8))
        assert TRITON_CALL in lower_for_cuda(dec.run, q, c8, plan)
    qo_indptr = (np.arange(b + 1) * 7).astype(np.int32)
    pre = ji.BatchPrefillWithPagedKVCache(hq, hkv, d, page, backend="gpu")
    plan = pre.plan(qo_indptr, indptr, indices, last, num_pages=num_pages)
    qp = jnp.ones((b * 7, hq, d), jnp.bfloat16)
    assert TRITON_CALL in lower_for_cuda(pre.run, qp, cache, plan)
    # impl="mosaic" (Mosaic GPU): its Python lowering passes (layouts, TMA descriptors) run here too,
    # on ragged K/V (paged without a variant: test_mosaic_paged_prefill_lowers_for_cuda, under slow)
    k = jnp.ones((b * s, hkv, d), jnp.bfloat16)
    pre = ji.BatchPrefillWithRaggedKVCache(hq, hkv, d, backend="gpu", impl="mosaic")
    assert MOSAIC_CALL in lower_for_cuda(pre.run, qp, k, k, pre.plan(qo_indptr, (np.arange(b + 1) * s).astype(np.int32)))
    # ... and on pages with variants: the built-ins' hooks traced into the Mosaic kernel.
    from jaxinfer import variants as V
    for var in (V.compose(V.soft_cap(), V.alibi(), V.sliding_window(), V.sinks()), V.sigmoid()):
        pre = ji.BatchPrefillWithPagedKVCache(hq, hkv, d, page, backend="gpu", impl="mosaic", variant=var)
        plan = pre.plan(qo_indptr, indptr, indices, last, num_pages=num_pages)
        run = lambda q, c, p, vp: pre.run(q, c, p, variant_params=vp)  # noqa: E731
        assert MOSAIC_CALL in lower_for_cuda(run, qp, cache, plan, V.default_params(var, hq))


@pytest.mark.parametrize("d", [96, 80])
def test_triton_kernels_lower_for_cuda_at_head_dims_they_pad(d):
    """Triton tiles only powers of two: q, K, V and o of head dims like 96 (Phi-3) or 80 are read
    and stored in padded tiles (pallas_kernels._common.tile_width), so every Triton kernel lowers:
    decode (bf16 and fp8, the fused append), the paged and ragged prefill, BatchAttention, the
    KV write and the merges. Interpret mode runs the same tiles (tests/test_head_dims.py)."""
    b, s, hq, hkv, page = 2, 40, 8, 2, 16
    cache, (indptr, indices, last), q, dec, plan = compiled_decode_case(d)
    num_pages = cache.num_pages
    c8 = ji.PagedKVCache(cache.k_pages.astype(jnp.float8_e4m3fn), cache.v_pages.astype(jnp.float8_e4m3fn))
    kv_new = jnp.ones((b, hkv, d), jnp.bfloat16)
    lowered = [lower_for_cuda(dec.run, q, cache, plan), lower_for_cuda(dec.run, q, c8, plan),
               lower_for_cuda(lambda q, c, p, k: dec.run(q, c, p, append_kv=(k, k)), q, cache, plan, kv_new)]
    qo_indptr = (np.arange(b + 1) * 7).astype(np.int32)
    qp = jnp.ones((b * 7, hq, d), jnp.bfloat16)
    for w in (ji.BatchPrefillWithPagedKVCache(hq, hkv, d, page, backend="gpu"), ji.BatchAttention(hq, hkv, d, page, backend="gpu")):
        lowered.append(lower_for_cuda(w.run, qp, cache, w.plan(qo_indptr, indptr, indices, last, num_pages=num_pages)))
    k = jnp.ones((b * s, hkv, d), jnp.bfloat16)
    rag = ji.BatchPrefillWithRaggedKVCache(hq, hkv, d, backend="gpu")
    lowered.append(lower_for_cuda(rag.run, qp, k, k, rag.plan(qo_indptr, (np.arange(b + 1) * s).astype(np.int32))))
    from jaxinfer.page import write_slots  # append_paged_kv_cache's KV write, compiled
    slots = jnp.arange(b, dtype=jnp.int32)
    lowered.append(lower_for_cuda(lambda c, k: write_slots(c, slots, slots, k, k, interpret=False), cache, kv_new))
    states = ji.AttentionState(jnp.ones((b, 3, hq, d), jnp.float32), jnp.zeros((b, 3, hq), jnp.float32))
    lowered.append(lower_for_cuda(lambda st: ji.merge_states(st, backend="gpu"), states))
    one = ji.AttentionState(states.o[:, 0], states.lse[:, 0])
    lowered.append(lower_for_cuda(lambda x, y: ji.merge_state(x, y, backend="gpu"), one, one))
    assert all(TRITON_CALL in text for text in lowered)


def test_variant_params_as_python_numbers_lower_for_cuda():
    """variant_params={"logits_soft_cap": 30.0}: a Python float is weakly typed, which Triton's
    lowering of the soft cap's jnp.where rejected (an internal AssertionError); the kernels take
    each parameter in its own dtype."""
    cache, _, q, dec, plan = compiled_decode_case(64, ji.variants.soft_cap())
    run = lambda q, c, p: dec.run(q, c, p, variant_params={"logits_soft_cap": 30.0})  # noqa: E731
    assert TRITON_CALL in lower_for_cuda(run, q, cache, plan)


@pytest.mark.slow  # the paged Mosaic kernel lowers by default with variants (the test above)
def test_mosaic_paged_prefill_lowers_for_cuda():
    from benchmarks.common import random_paged_cache
    b, s, hq, hkv, d, page = 2, 40, 8, 2, 64, 16
    cache, indptr, indices, last = random_paged_cache(np.random.default_rng(0), np.full(b, s), page, hkv, d,
                                                      jnp.bfloat16)
    qo_indptr = (np.arange(b + 1) * 7).astype(np.int32)
    pre = ji.BatchPrefillWithPagedKVCache(hq, hkv, d, page, backend="gpu", impl="mosaic")
    plan = pre.plan(qo_indptr, indptr, indices, last, num_pages=cache.num_pages)
    assert MOSAIC_CALL in lower_for_cuda(pre.run, jnp.ones((b * 7, hq, d), jnp.bfloat16), cache, plan)


def test_triton_deprecation_is_hidden_for_jaxinfer_kernels_only(rng):
    """jax >= 0.11 warns that Pallas' Triton backend is deprecated whenever a Triton kernel lowers.
    jaxinfer hides that warning while its own kernels lower (pallas_kernels/_common.py); a user's
    own Triton kernel and a user's own warnings still warn."""
    from jax._src import deprecations
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton
    jax_warns = "jax-pallas-triton" in deprecations._registered_deprecations  # jax >= 0.11

    def user_kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    user_call = pl.pallas_call(user_kernel, out_shape=jax.ShapeDtypeStruct((16, 16), jnp.float32),
                               compiler_params=pl_triton.CompilerParams(num_warps=4))  # Triton
    q = randn(rng, (2, 4, 32), jnp.float32)  # [S, H, D]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert TRITON_CALL in lower_for_cuda(
            lambda q: ji.single_decode_with_kv_cache(q[0], q, q, backend="gpu"), q)
        jaxinfer_warnings = [str(w.message) for w in caught]
        warnings.warn("the user's own deprecation", DeprecationWarning)
        assert TRITON_CALL in lower_for_cuda(user_call, jnp.ones((16, 16), jnp.float32))
    assert not [m for m in jaxinfer_warnings if "deprecated" in m], jaxinfer_warnings
    user_warnings = [str(w.message) for w in caught[len(jaxinfer_warnings):]]
    assert user_warnings[0] == "the user's own deprecation"
    triton = [m for m in user_warnings if m.startswith("The Pallas Triton backend is deprecated")]
    assert len(triton) == (1 if jax_warns else 0), (jax.__version__, user_warnings)


MOSAIC_TUNINGS = [  # (head_dim, config): the dispatch defaults at 128 / 256, the other pipelines
    (128, None), (256, None), (128, dict(pipeline="free", compute_wgs=3, tree_max=True)), (128, dict(pipeline="overlap"))]


@pytest.mark.slow  # their branches lower by default too (the test below, test_gpu_kernels_lower_for_cuda_on_any_host)
@pytest.mark.parametrize("i", range(1, len(MOSAIC_TUNINGS)))
def test_mosaic_prefill_tunings_lower_for_cuda(i):
    _lower_mosaic_prefill(*MOSAIC_TUNINGS[i])


def _lower_mosaic_prefill(d, config):
    from benchmarks.common import random_paged_cache
    b, s, hq, hkv, page = 2, 200, 4, 2, 16
    qo_indptr = (np.arange(b + 1) * 70).astype(np.int32)
    config = None if config is None else ji.MosaicPrefillConfig(**config)
    cache, indptr, indices, last = random_paged_cache(np.random.default_rng(0), np.full(b, s), page, hkv, d,
                                                      jnp.bfloat16)
    pre = ji.BatchPrefillWithPagedKVCache(hq, hkv, d, page, backend="gpu", impl="mosaic", config=config)
    plan = pre.plan(qo_indptr, indptr, indices, last, num_pages=cache.num_pages)
    q = jnp.ones((int(qo_indptr[-1]), hq, d), jnp.bfloat16)
    assert MOSAIC_CALL in lower_for_cuda(pre.run, q, cache, plan), (d, config)


def test_mosaic_prefill_configs_lower_for_cuda():
    """Every Mosaic prefill tuning lowers for CUDA without a GPU (layouts, TMA, register splits):
    the dispatch default at head_dim 128 here (256's and the other pipelines under slow:
    test_mosaic_prefill_tunings_lower_for_cuda; head_dim 64's, three compute warpgroups, lowers paged
    and ragged in test_gpu_kernels_lower_for_cuda_on_any_host), and ragged_paged_attention's
    persistent Mosaic class (row stores)."""
    from benchmarks.common import random_paged_cache
    _lower_mosaic_prefill(*MOSAIC_TUNINGS[0])
    b, s, hq, hkv, page = 2, 200, 4, 2, 16
    # ragged_paged_attention: two sequences of 70 and 90 new tokens, the Mosaic class as the base.
    d, pages_per_seq = 128, 16
    cache, *_ = random_paged_cache(np.random.default_rng(0), np.full(b, s), page, hkv, d, jnp.bfloat16)
    q_lens, kv_lens = np.array([70, 90]), np.array([150, 200], np.int32)
    t = int(q_lens.sum())
    queries, keys = jnp.ones((t, hq, d), jnp.bfloat16), jnp.ones((t, hkv, d), jnp.bfloat16)
    args = (queries, keys, keys, cache, jnp.asarray(kv_lens),
            jnp.arange(b * pages_per_seq, dtype=jnp.int32) % cache.num_pages,
            jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32), jnp.array([0, b, b], jnp.int32))
    rpa = lambda *a: ji.ragged_paged_attention(*a, backend="gpu", impl="mosaic")[0]  # noqa: E731
    assert MOSAIC_CALL in lower_for_cuda(rpa, *args)
