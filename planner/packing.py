"""One int32 buffer holding all of a plan's arrays: one host-to-device copy per step."""


class PackedLayout:
    """Base for plan layouts: subclasses list (name, size) sections and their item width."""

    ITEM_FIELDS = 1

    def sections(self):
        raise NotImplementedError

    @property
    def size(self):
        return sum(n for _, n in self.sections())

    def unpack(self, buf):
        """Splits the packed buffer (NumPy or jax array) into its named sections (views)."""
        out, off = {}, 0
        for name, n in self.sections():
            out[name] = buf[off:off + n]
            off += n
        out["items"] = out["items"].reshape(-1, self.ITEM_FIELDS)
        return out
