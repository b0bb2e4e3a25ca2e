"""One int32 buffer holding all of a plan's arrays: one host-to-device copy per step."""
from functools import cached_property

import numpy as np

SECTION_ALIGN = 64  # int32 entries: every section starts 256-byte aligned (Mosaic GPU kernels
# take their inputs only at such addresses, and XLA may hand a section to a kernel in place)


ALIAS_BYTES = 1 << 20  # buffers this large start aligned, so jax on the CPU backend aliases them


def new_buffer(size):
    """A fresh int32[size] plan buffer. One of ALIAS_BYTES or more starts at a 256-byte aligned
    address (NumPy's arrays start 16-byte aligned): jax on the CPU backend aliases such an
    array instead of copying it (XLA's CPU buffers need 64-byte alignment; CPU plans keep their
    buffer, jaxinfer.transfer). Smaller buffers are cheap to copy, and finding an address costs
    more than their allocation."""
    if size * 4 < ALIAS_BYTES:
        return np.empty(size, np.int32)
    raw = np.empty(size + SECTION_ALIGN, np.int32)
    start = (-raw.__array_interface__["data"][0] & 255) >> 2  # (C-level: .ctypes runs Python code)
    return raw[start:start + size]


class PackedLayout:
    """Base for plan layouts: subclasses list (name, size) sections and their items' schema.

    Layouts are frozen dataclasses; the section offsets are computed once per instance
    (cached_property writes the instance __dict__, which frozen dataclasses allow)."""

    ITEMS = None  # the work-item schema (planner.work_items)

    def sections(self):
        raise NotImplementedError

    @cached_property
    def offsets(self):
        """{name: (start, stop)} of the sections, each start a multiple of SECTION_ALIGN."""
        out, off = {}, 0
        for name, n in self.sections():
            out[name] = (off, off + n)
            off += -(-n // SECTION_ALIGN) * SECTION_ALIGN
        return out

    @cached_property
    def starts(self):
        """The sections' start offsets, in sections() order (a tuple to unpack)."""
        return tuple(start for start, _ in self.offsets.values())

    @cached_property
    def size(self):
        return max((stop for start, stop in self.offsets.values()), default=0)

    def section_range(self, name):
        """(start, stop) of a named section in the buffer."""
        return self.offsets[name]

    def unpack(self, buf):
        """Splits the packed buffer (NumPy or jax array) into its named sections (views)."""
        return self.named(tuple(buf[start:stop] for start, stop in self.offsets.values()))

    def named(self, parts):
        """{name: section} of the sections given in sections() order (items as rows)."""
        out = dict(zip(self.offsets, parts))
        out["items"] = out["items"].reshape(-1, self.ITEMS.width)
        return out
