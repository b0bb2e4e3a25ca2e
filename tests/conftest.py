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


# The longest tests (about 6-50 s each on the 2-core machine with the flags above, `--durations`),
# with those seconds: run first, longest first, so that under pytest-xdist they overlap the short
# ones instead of ending the suite alone. They all start in the first worker's share (worksteal
# hands out contiguous shares), so the generate.py sampling and TP tests run on one worker and
# share their one-device runs (test_examples' _runs cache: the TP test's reference).
LONG_TESTS = {
    "test_sharded_equals_one_device": 50, "test_fuzz_400": 25,
    "test_mixed_kernel_matches_reference": 17, "test_unpadded_cache_runs_in_place": 15,
    "test_generate_sampling_deterministic_and_in_range": 13, "test_generate_tensor_parallel_on_host_devices": 17,
    "test_mosaic_prefill_variants_match_reference": 12,
    "test_serve_tensor_parallel_on_host_devices": 12, "test_mosaic_prefill_configs_lower_for_cuda": 12,
    "test_paged_prefill": 11, "test_serve_chunked_prefill_equals_unchunked": 10,
    "test_serve_batched_equals_alone": 9.5, "test_batch_attention": 9,
    "test_two_processes_jax_distributed": 9,
    "test_cascade_variant_positions": 8, "test_paged_prefill_boundaries": 6}


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: -LONG_TESTS.get(item.originalname, 0))  # stable: otherwise collection order
