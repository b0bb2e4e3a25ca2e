"""The host-to-device copy of a plan's packed buffer, split into its sections on the device:
the last step of every plan().

On a GPU, plans hold each section as its own device array: a slice of one packed buffer inside
a jitted run() is a copy launch per section on every call (1-1.5 µs each on an H100; 7-12 µs per
call for 6-10 sections, BENCHMARKS.md session 12); split once at plan time, run() reads them in
place.

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


def _split(buf, bounds):
    """buf's sections [start, stop) as separate arrays (each a copy: the plan owns them)."""
    return tuple(buf[start:stop] for start, stop in bounds)


_copy_split = jax.jit(_split, static_argnums=1)
_copy = jax.jit(lambda buf: buf)  # a copy on the device: the plan owns its buffer


@functools.lru_cache(maxsize=1)
def _on_cpu():
    return jax.default_backend() == "cpu"


def plan_sections(buf, layout, fixed_shape):
    """buf (a NumPy array plan() made for this plan and never writes again) on the device: a
    tuple of arrays, one per section of its layout (a planner PackedLayout), in layout order.

    One jitted call copies buf and splits it; it compiles once per layout, as run() does (the
    layout is a static part of the plan). On the CPU backend, where run() is not timed, the
    buffer stays whole, a 1-tuple (a split would copy it; sections() slices it): a jitted copy
    when fixed_shape (the wrapper's capacities fix buf's shape: it compiles once), else
    jax.device_put, which aliases an aligned buffer of CPU_ALIAS_BYTES or more."""
    if not _on_cpu():
        return _copy_split(buf, tuple(layout.offsets.values()))
    if fixed_shape and buf.nbytes < CPU_ALIAS_BYTES:
        return (_copy(buf),)
    return (jax.device_put(buf, may_alias=True),)  # buf is fresh and never written again


def sections(parts, layout):
    """{name: section} of a plan's parts: the sections (plan_sections on a GPU) or a 1-tuple of
    the packed buffer whole."""
    return layout.unpack(parts[0]) if len(parts) == 1 else layout.named(parts)
