"""Which way the Pallas kernels run: compiled for the GPU, or in Pallas interpret mode.

Default ("auto"): compiled when JAX's default backend is a GPU, interpret mode
otherwise (CPU). Force either with backend="interpret" / backend="gpu" on any
entry point, or with the environment variable JAXINFER_BACKEND. Interpret mode
runs the same kernel code (never a jnp stand-in), so CPU tests test the kernels.
"""
import os

import jax

try:
    # jax 0.12 adds a value to the tracing context when this module is first imported, which
    # happens inside the first interpret-mode kernel's trace: a jitted step would then miss its
    # cache on its second call and compile again. Imported up front, the context stays fixed.
    import jax._src.pallas.mosaic.interpret.interpret_pallas_call  # noqa: F401
except ImportError:  # not in every jax version: nothing to pin there
    pass

BACKENDS = ("auto", "interpret", "gpu")


def use_interpret(backend=None):
    choice = backend or os.environ.get("JAXINFER_BACKEND", "auto")
    if choice not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {choice!r}")
    if choice == "auto":
        return jax.default_backend() != "gpu"
    return choice == "interpret"


def num_sms(default=132):
    """Streaming multiprocessors of the first GPU (used to size the grid); `default` without one."""
    try:
        dev = jax.devices()[0]
        return int(getattr(dev, "core_count", None) or default)
    except RuntimeError:
        return default


def mosaic_available(interpret):
    """Whether compiled Mosaic GPU kernels (wgmma, TMA: Hopper, compute capability 9.x) can run."""
    if interpret:
        return False
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return False
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")
