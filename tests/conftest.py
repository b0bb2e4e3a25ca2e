import gc
import importlib.metadata
import os
import platform
import sys
import zlib

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

# The Mosaic GPU interpreter needs more XLA CPU threads than its 3-4 warpgroups, or it can
# deadlock on small machines (see pallas_kernels/prefill_mosaic.py). Set before JAX starts.
os.environ.setdefault("PJRT_NPROC", "8")
# Interpret-mode kernels on small test shapes are compile-bound (XLA's CPU backend, not the kernels'
# run time). Tests only, set before JAX starts:
# - LLVM at optimization level 0 (15-30% less wall time per test on the 2-core machine);
# - on x86-64, XLA:CPU's elemental emitters instead of its fusion emitters, and code for AVX at
#   most: the fusion emitters take 2-3x the compile time on the interpreted kernels' large loop
#   bodies (the suite's wall time about halves); the elemental emitters at level 0 leave FMA
#   contraction to each program, so two programs that must agree bit for bit (test_decode's
#   fused-append paths) could round apart on an FMA machine, and AVX has no FMA.
# Results stay within every test's tolerance.
# jaxlib 0.12's XLA no longer has the fusion-emitter flag (an unknown XLA flag is fatal): older only.
_OLD_XLA = tuple(int(x) for x in importlib.metadata.version("jaxlib").split(".")[:2]) < (0, 11)
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0",) + (
    (("--xla_cpu_use_fusion_emitters=false",) if _OLD_XLA else ()) + ("--xla_cpu_max_isa=AVX",)
    if platform.machine().lower() in ("x86_64", "amd64") else ())
for _flag in TEST_XLA_FLAGS:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()


# JAX's tracing and lowering allocate many short-lived container objects: at CPython's default
# thresholds (700, 10, 10) the cyclic collector runs thousands of times per test file, and its full
# passes walk every jaxpr, lowering and executable the worker keeps cached: 6% of the time of a
# serial run of test_boundary, test_batch_attention, test_cascade and test_merge (gc.callbacks),
# 2% at these thresholds, with the same peak memory.
gc.set_threshold(50_000, 20, 20)


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test's name (reproducible, not shared)."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


# The longest tests (about 7-57 s each on the 2-core machine with the flags above under jax 0.12,
# less under 0.10.2, `--durations`), with those seconds: run first, longest first, so that under
# pytest-xdist they overlap the short ones instead of ending the suite alone. They all start in the
# first worker's share (worksteal hands out contiguous shares), so the example tests that share
# runs (test_examples' _runs cache: generate.py's TP/CP test makes the end-to-end and sampling
# tests' runs, the serve tests share one engine) run on one worker; a name here that no longer
# matches a test loses both.
LONG_TESTS = {
    "test_sharded_equals_one_device": 70,
    "test_generate_tensor_and_context_parallel_on_host_devices": 43,
    "test_serve_tensor_and_context_parallel_on_host_devices": 32, "test_fuzz_448": 31,
    "test_mosaic_class_holds_the_sinks": 17, "test_decode_only_and_prefill_only": 14,
    "test_unpadded_cache_runs_in_place": 13, "test_mixed_kernel_matches_reference": 13,
    "test_generate_end_to_end_and_scan_horizon": 12, "test_ragged_paged_attention": 12,
    "test_ragged_paged_attention_boundaries": 12, "test_append_kv_fused_equals_append_then_run": 12,
    "test_batch_attention": 11, "test_serve_chunked_prefill_equals_unchunked": 11,
    "test_mla_example_absorbed_decode_and_192_128_prefill_match_dense": 11,
    "test_serve_parallel_samples_draw_through_sampling_indices": 11,
    "test_sliding_window_and_soft_cap_hnd": 10, "test_llama_logits_paged_equal_dense": 10,
    "test_rpa_v3_hd64_grid": 10, "test_two_processes_jax_distributed": 10,
    "test_cascade_variant_positions": 10, "test_paged_prefill": 9,
    "test_kv_share_reads_the_cache_and_leaves_it": 9,
    "test_property_ragged_reference_matches_float64": 9,
    "test_jit_with_donation_compiles_once_and_matches": 9,
    "test_mosaic_192_128_matches_reference": 8, "test_fp8_kv": 8, "test_decode_auto_cascade": 8,
    "test_return_lse_read_kv_lens_and_no_write": 8,
    "test_paged_prefill_boundaries": 8, "test_custom_mask_tril_is_causal_and_packed_form": 7,
    "test_jit_donated_one_compilation": 7, "test_smoke_two_rows": 7,
    "test_eager_calls_compile_each_kernel_once": 7,
    "test_gpu_kernels_lower_for_cuda_on_any_host": 7, "test_ragged_192_128_matches_reference": 7,
    # fast alone (they reuse the runs and the engine above), listed to run on the same worker
    "test_generate_sampling_in_range": 1, "test_serve_batched_equals_alone": 1}


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: -LONG_TESTS.get(item.originalname, 0))  # stable: otherwise collection order
