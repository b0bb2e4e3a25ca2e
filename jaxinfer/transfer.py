"""The host-to-device copy of a plan's packed buffer: the last step of every plan().

Measured on the 2-core dev CPU (issue 22, BENCHMARKS.md): jax.device_put costs about 30 µs of
Python dispatch whatever the size; a jitted identity goes through jit's C++ dispatch and costs
7-10 µs up to ~1 MB, but compiles once per buffer shape, so it serves wrappers whose capacities
fix the shape. Keeping the NumPy buffer in the plan instead would move the copy into every run()
call (each layer), so plans hold device arrays.
"""
import functools

import jax

from planner import packing

# On the CPU backend a copy of a large buffer costs more than device_put, which aliases it
# (planner buffers this large start 64-byte aligned, as XLA's CPU buffers must; a NumPy
# array that is not aligned is copied).
CPU_ALIAS_BYTES = packing.ALIAS_BYTES

_copy = jax.jit(lambda buf: buf)  # a copy on the device: the plan owns its buffer


@functools.lru_cache(maxsize=1)
def _on_cpu():
    return jax.default_backend() == "cpu"


def plan_buffer(buf, fixed_shape):
    """buf (a NumPy array plan() made for this plan and never writes again) as a device array.

    fixed_shape: the wrapper's capacities fix buf's shape (so the jitted copy compiles once per
    wrapper configuration); otherwise every batch size could compile another copy, and
    jax.device_put is used."""
    if fixed_shape and not (buf.nbytes >= CPU_ALIAS_BYTES and _on_cpu()):
        return _copy(buf)
    return jax.device_put(buf, may_alias=True)  # buf is fresh and never written again

