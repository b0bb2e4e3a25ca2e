import os
import sys
import zlib

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

# The Mosaic GPU interpreter needs more XLA CPU threads than its 3-4 warpgroups, or it can
# deadlock on small machines (see pallas_kernels/prefill_mosaic.py). Set before JAX starts.
os.environ.setdefault("PJRT_NPROC", "8")


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test's name (reproducible, not shared)."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
