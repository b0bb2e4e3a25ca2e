"""The work-item schema: the named int32 columns of every plan's items, one definition each.

Planners (host: planner/, device: jaxinfer/ragged) write items and kernels read them by name,
e.g. items[:, PREFILL.kv_end]; jaxinfer hands the schema to each kernel launch as its static
`columns` argument (pallas_kernels/ imports no planner module). Pure Python.
"""
import dataclasses


@dataclasses.dataclass(frozen=True)
class Columns:
    """An item's column names in order; `schema.name` is that column's index (static)."""
    names: tuple

    def __post_init__(self):
        for i, name in enumerate(self.names):  # plain attributes: plan() reads them per column
            object.__setattr__(self, name, i)

    def __getattr__(self, name):  # only for names that are not columns
        raise AttributeError(f"work items have no column {name!r} (columns: {self.names})")

    @property
    def width(self):
        return len(self.names)

    def ordered(self, **values):
        """The values of one item (or a column of items each), named, in column order."""
        if values.keys() != set(self.names):
            raise ValueError(f"items need exactly the columns {self.names}, got {tuple(values)}")
        return [values[name] for name in self.names]

    def extend(self, *names):
        return Columns(self.names + names)

    def rename(self, **new_of_old):
        """The same columns, some under the names another kernel reads them by."""
        return Columns(tuple(new_of_old.get(n, n) for n in self.names))


# The decode kernel: keys [tok_start, tok_end) of one request (page_base: its first entry in
# kv_indices); part_slot: the partial-state row of a split request, or -1 (written through).
DECODE = Columns(("request", "page_base", "tok_start", "tok_end", "part_slot"))
# ... with up to tokens_per_item query tokens of one request (q rows q_start .. q_start + qo_len):
# part_stride is the request's number of KV chunks (its partial rows per token).
DECODE_MULTI = DECODE.extend("part_stride", "q_start", "qo_len")

# The prefill kernels: one query tile (tile_tok tokens of a request from q row q_row_start) over
# keys [kv_start, kv_end) of its kv_len. part_base / num_chunks / chunk: a split tile's partial
# rows (-1: unsplit); mask_base: the custom mask's offset (-1: none); kv_pos_offset: the keys'
# position offset (cascade levels); tail: the tail map's row (-1: none); kv_first: the first
# key of the request's pages (aligned tiles); q_pos_min / q_pos_max: the tile's query positions.
PREFILL = Columns(("q_row_start", "tile_tok", "qo_len", "page_base", "kv_len", "kv_start", "kv_end",
                   "part_base", "num_chunks", "chunk", "mask_base", "kv_pos_offset", "tail", "kv_first",
                   "q_pos_min", "q_pos_max"))
# The mixed Mosaic launch: prefill items that never split, whose split columns name the item's
# query head, its lse slot and whether it is a packed tile of short requests (1) or a query tile;
# last_row: the row of the sanitized copy of its request's partly filled last page (-1: none).
MIXED = PREFILL.rename(part_base="head", num_chunks="lse_slot", chunk="packed", mask_base="last_row")
# The MLA kernel: a tile of `rows` query rows (q viewed as [T * H, D], from q_row; row_start: the
# tile's first row within its request) against keys [kv_start, kv_end); first_pos: the request's
# first query position (causal); part_base < 0: the item writes o / lse, else row r's partial
# state is row part_base + r * part_stride.
MLA = Columns(("page_base", "q_row", "rows", "row_start", "first_pos", "kv_start", "kv_end", "part_base",
               "part_stride"))
