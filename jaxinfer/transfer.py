"""The host-to-device copy of a plan's packed buffer, split into its sections on the device:
the last step of every plan().

On a GPU, plans hold each section as its own device array: a slice of one packed buffer inside
a jitted run() is a copy launch per section on every call (1-1.5 µs each on an H100; 7-12 µs per
call for 6-10 sections); split once at plan time, run() reads them in
place.

On the CPU backend plans keep the NumPy buffer: measured on the 2-core dev CPU, jax.device_put costs about 30 µs of Python dispatch whatever the size, and a
jitted copy 7-10 µs of dispatch plus the copy, per plan; a NumPy argument of a jitted step costs
jit's C++ argument handling instead.
"""
import functools

import jax


def _split(buf, bounds):
    """buf's sections [start, stop) as separate arrays (each a copy: the plan owns them)."""
    return tuple(buf[start:stop] for start, stop in bounds)


_copy_split = jax.jit(_split, static_argnums=1)


@functools.lru_cache(maxsize=1)
def _on_cpu():
    return jax.default_backend() == "cpu"


def plan_sections(buf, layout):
    """buf (a NumPy array plan() made for this plan and never writes again) on the device: a
    tuple of arrays, one per section of its layout (a planner PackedLayout), in layout order.

    On a GPU one jitted call copies buf and splits it; it compiles once per layout, as run()
    does (the layout is a static part of the plan). On the CPU backend, whose device memory is
    host memory, the plan keeps buf itself, whole (a 1-tuple; sections() slices it): jit's
    argument handling takes it as it takes any NumPy argument (aliased when 64-byte aligned,
    else copied), where a copy here would cost a jit dispatch (~10 µs) or jax.device_put (~30
    µs of Python) per plan."""
    if _on_cpu():
        return (buf,)
    return _copy_split(buf, tuple(layout.offsets.values()))


def sections(parts, layout):
    """{name: section} of a plan's parts: the sections (plan_sections on a GPU) or a 1-tuple of
    the packed buffer whole."""
    return layout.unpack(parts[0]) if len(parts) == 1 else layout.named(parts)
