"""Every entry point lowers for CUDA over a grid of configurations, on any host: the compiled
kernels' Python-side lowering rules (Pallas-Triton's power-of-two shapes, Mosaic GPU's layouts)
run here, so a configuration that only a GPU would reject (an internal error for the user, as
head_dim 96 was) fails on the CPU. Dispatch picks as on a GPU; with `hopper`, as on an H100
(the Mosaic rows). Head groups (8/2, 8/8, 28/4), head dims (64, 96, 128), pages
(1, 16, 64), layouts (NHD, HND, NHD_FUSED), K/V dtypes (bf16, f16, fp8) and variants; the
default run draws a seeded sample, `-m slow` runs the whole product."""
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer import _backend
from jaxinfer import variants as V
from test_backend import MOSAIC_CALL, TRITON_CALL, lower_for_cuda

VARIANTS = {"none": None, "soft_cap": V.soft_cap(), "alibi": V.alibi(), "sliding_window": V.sliding_window(),
            "sinks": V.sinks(), "sigmoid": V.sigmoid(), "rope": V.rope()}
RPA_OPTIONS = {"none": {}, "soft_cap": {"soft_cap": 30.0}, "sliding_window": {"sliding_window": 8}}
GRID = [c for c in itertools.product(
    [(8, 2), (8, 8), (28, 4)], [64, 96, 128], [1, 16, 64], ["NHD", "HND", "NHD_FUSED"],
    ["bfloat16", "float16", "float8_e4m3fn"], list(VARIANTS))
    if not (c[5] == "rope" and c[1] == 96)]  # RoPE needs a power of two (test_head_dims)
SAMPLE = [GRID[i] for i in np.random.default_rng(7).choice(len(GRID), 12, replace=False)]


def paged_cache(kv_lens, page, hkv, d, dtype, layout):
    """A cache of ones in dtype and a page table over it: (cache, indptr, indices, last, num_pages)."""
    n = -(-np.asarray(kv_lens) // page)
    num_pages = int(n.sum()) + 2
    indptr = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    indices = np.random.default_rng(0).permutation(num_pages)[: indptr[-1]].astype(np.int32)
    last = (np.asarray(kv_lens) - (n - 1) * page).astype(np.int32)
    if layout == "NHD_FUSED":
        cache = ji.PagedKVCache.fused(jnp.ones((num_pages, page, hkv, 2, d), dtype))
    else:
        shape = (num_pages, page, hkv, d) if layout == "NHD" else (num_pages, hkv, page, d)
        cache = ji.PagedKVCache(jnp.ones(shape, dtype), jnp.ones(shape, dtype), layout=layout)
    return cache, indptr, indices, last, num_pages


def check_config(heads, d, page, layout, kv_dtype, variant_name):
    """Lowers decode, the paged prefill, BatchAttention and ragged_paged_attention (its options
    where they match the variant) on one configuration; each lowers to a Pallas kernel."""
    (hq, hkv), kv_dtype = heads, jnp.dtype(kv_dtype)
    q_dtype = jnp.dtype(jnp.bfloat16) if kv_dtype.itemsize == 1 else kv_dtype
    var = VARIANTS[variant_name]
    params = None if var is None else V.default_params(var, hq)
    kv_lens = [40, 1, 130]
    cache, indptr, indices, last, num_pages = paged_cache(kv_lens, page, hkv, d, kv_dtype, layout)

    def lowered(w, q, plan):
        run = (lambda q, c, p, vp: w.run(q, c, p)) if var is None else \
            (lambda q, c, p, vp: w.run(q, c, p, variant_params=vp))
        text = lower_for_cuda(run, q, cache, plan, params)
        assert TRITON_CALL in text or MOSAIC_CALL in text

    dec = ji.BatchDecodeWithPagedKVCache(hq, hkv, d, page, layout=layout, backend="gpu", variant=var)
    lowered(dec, jnp.ones((3, hq, d), q_dtype), dec.plan(indptr, indices, last, num_pages=num_pages))
    qo_indptr = np.array([0, 5, 6, 40], np.int32)
    for w in (ji.BatchPrefillWithPagedKVCache(hq, hkv, d, page, causal=True, layout=layout, backend="gpu", variant=var),
              ji.BatchAttention(hq, hkv, d, page, layout=layout, backend="gpu", variant=var)):
        plan = w.plan(qo_indptr, indptr, indices, last, num_pages=num_pages, q_data_type=q_dtype,
                      kv_data_type=kv_dtype)
        lowered(w, jnp.ones((40, hq, d), q_dtype), plan)
    if variant_name in RPA_OPTIONS:
        kv = np.array([45, 7, 160], np.int32)  # after the step's append: 1 decode row, then 5 and 34 tokens
        pages = -(-kv // page)
        page_indices = np.zeros((3, pages.max()), np.int32)
        for b in range(3):
            page_indices[b, :pages[b]] = np.arange(pages[:b].sum(), pages[:b + 1].sum()) % num_pages
        cu, dist = np.array([0, 1, 6, 40], np.int32), np.array([1, 1, 3], np.int32)

        def rpa(q, k, v, c):
            return ji.ragged_paged_attention(q, k, v, c, kv, page_indices.reshape(-1), cu, dist, backend="gpu",
                                             **RPA_OPTIONS[variant_name])[0]
        kv_new = jnp.ones((40, hkv, d), kv_dtype)
        text = lower_for_cuda(rpa, jnp.ones((40, hq, d), q_dtype), kv_new, kv_new, cache)
        assert TRITON_CALL in text or MOSAIC_CALL in text


@pytest.mark.parametrize("hopper", [False, True])
@pytest.mark.parametrize("config", SAMPLE, ids=lambda c: "-".join(map(str, c)))
def test_entry_points_lower_for_cuda(monkeypatch, config, hopper):
    if hopper:
        monkeypatch.setattr(_backend, "mosaic_available", lambda interpret: not interpret)
    check_config(*config)


@pytest.mark.slow
@pytest.mark.parametrize("hopper", [False, True])
def test_entry_points_lower_for_cuda_full_grid(monkeypatch, hopper):
    """The whole product: 1,620 configurations, about 6,000 lowerings a side (both sides took
    25 min on 2 cores)."""
    if hopper:
        monkeypatch.setattr(_backend, "mosaic_available", lambda interpret: not interpret)
    failures = []
    for config in GRID:
        try:
            check_config(*config)
        except Exception as e:  # noqa: BLE001 - every configuration is tried, the failures listed
            failures.append(f"{config}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    assert not failures, f"{len(failures)} configurations do not lower:\n" + "\n".join(failures[:30])
