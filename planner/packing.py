"""One int32 buffer holding all of a plan's arrays: one host-to-device copy per step."""


class PackedLayout:
    """Base for plan layouts: subclasses list (name, size) sections and their item width."""

    ITEM_FIELDS = 1

    def sections(self):
        raise NotImplementedError

    @property
    def size(self):
        return sum(n for _, n in self.sections())

    def section_range(self, name):
        """(start, stop) of a named section in the buffer."""
        off = 0
        for n, size in self.sections():
            if n == name:
                return off, off + size
            off += size
        raise KeyError(name)

    def unpack(self, buf):
        """Splits the packed buffer (NumPy or jax array) into its named sections (views)."""
        out, off = {}, 0
        for name, n in self.sections():
            out[name] = buf[off:off + n]
            off += n
        out["items"] = out["items"].reshape(-1, self.ITEM_FIELDS)
        return out
