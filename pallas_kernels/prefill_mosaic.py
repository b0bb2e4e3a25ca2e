"""Prefill attention on Mosaic GPU (Hopper): TMA loads, wgmma, warp specialization.

After JAX's FlashAttention-3 kernel (jax/experimental/pallas/ops/gpu/attention_mgpu.py), on
the prefill work list (columns: planner.work_items.PREFILL, or MIXED for the mixed launch): tiles of
64 x compute_wgs query tokens of one query head, KV never split. A memory warpgroup streams
K/V blocks (whole pages by TMA) through max_concurrent_steps shared-memory slots; the compute
warpgroups ping-pong, run freely or overlap their softmax with their matmuls. Grid (Hq,
num_cells). Keys outside an item's range are masked; a listed page's stale V rows are zeroed in
shared memory before P @ V, or (mixed launches) read from a sanitized copy (LastPages). docs/design.md tells how
tiles align to TMA's 8-row groups, how partial tiles are stored, and how packed tiles of the
mixed launch work.
"""
import dataclasses
import functools
import inspect
import math
import os
import warnings
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _common

WG_ROWS = 64  # query rows per compute warpgroup
LOG2E = math.log2(math.e)
MEMORY_REGISTERS = {2: 40, 3: 24}  # per thread of the memory warpgroup, by compute warpgroups
# plgpu.load's index argument: required in jax 0.10 (the empty index: the whole ref), optional and
# deprecated in 0.11 (left out, the whole ref, the same load), gone in 0.12.
_LOAD_IDX = (((),) if getattr(inspect.signature(plgpu.load).parameters.get("idx"), "default", None)
             is inspect.Parameter.empty else ())


def _warn_if_interpreter_pool_too_small(num_warpgroups):
    """Warns when XLA's CPU thread pool may be too small for the Mosaic GPU interpreter.

    The interpreter runs each warpgroup as an XLA CPU computation; a warpgroup waiting on a
    barrier holds a thread of XLA's intra-op pool (PJRT_NPROC or NPROC threads, else one per
    CPU). With fewer threads than warpgroups the one that would arrive may never run: a
    deadlock, seen on 2-core machines.
    """
    env = os.environ.get("PJRT_NPROC") or os.environ.get("NPROC")
    threads = int(env) if env and env.isdigit() else len(os.sched_getaffinity(0))
    if threads <= num_warpgroups:
        warnings.warn(f"Mosaic GPU interpreter: XLA's CPU pool has {threads} threads for "
                      f"{num_warpgroups} warpgroups and can deadlock; set PJRT_NPROC=8 before "
                      "JAX starts", RuntimeWarning, stacklevel=3)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Item:
    """One work item's fields (columns: work_items.PREFILL) and the KV blocks of its tile."""
    q_row_start: jax.Array
    tile_tok: jax.Array
    qo_len: jax.Array
    page_base: jax.Array
    kv_len: jax.Array
    kv_start: jax.Array
    kv_end: jax.Array
    pos_offset: jax.Array
    tail: jax.Array
    offset: jax.Array      # causal: query token t sees keys <= t + offset
    kv_begin: jax.Array    # the first block's first key (a multiple of block_kv)
    kv_visible: jax.Array  # keys before it are loaded, never shown (kv_first)
    full_lo: Optional[jax.Array]  # a bounded variant's first key every row sees, or None
    tile_steps: jax.Array  # KV blocks the memory warpgroup loads
    head: jax.Array        # the query head (a packed tile: its KV head)
    kv_head: jax.Array
    lse_slot: jax.Array    # its lse rows: lse_items[., lse_slot * T + row]
    packed: object         # a packed tile (mixed launches; False elsewhere)
    last_row: object       # mixed launches: v_last's row for the last page's V (-1: none); else None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class LastPages:
    """The partly filled last pages of a step's requests, for prefill_mosaic's V loads."""
    page: jax.Array    # [R] int32: request r's last page (any page where length is 0)
    length: jax.Array  # [R] int32: its keys in that page (0: no copy needed; slots >= length zeroed)

    def sanitized_v(self, v):
        """v [P, S, Hkv, D], or an NHD_FUSED cache [P, S, Hkv, 2, D] (V at [..., 1, :]) -> [R, S, Hkv,
        D]: each last page's V, slots past its keys zeroed."""
        slot = jnp.arange(v.shape[1], dtype=jnp.int32)
        live = slot[None, :, None, None] < self.length[:, None, None, None]
        # pages as rows of [P, S * Hkv * D]: a row gather (H100: 8 µs for 64 pages, 22 µs as v[page])
        pages = jnp.take(v.reshape(v.shape[0], -1), self.page, axis=0, mode="clip").reshape((-1,) + v.shape[1:])
        if v.ndim == 5:  # fused: V of the gathered pages only
            pages = pages[..., 1, :]
        return jnp.where(live, pages, jnp.zeros((), v.dtype))


def _row_max(s, tree):
    """Row maxima of s [R, C]; tree: halve the columns first (short dependency chains)."""
    while tree and s.shape[1] > 8 and s.shape[1] % 16 == 0:
        h = s.shape[1] // 2
        s = jnp.maximum(s[:, :h], s[:, h:])
    return s.max(axis=1)


def _compute_registers(compute_wgs):
    """Registers per thread of a compute warpgroup: the launch's share of the register file (whole
    warps of multiples of 8 per thread), less the memory warpgroup's, split among them."""
    warpgroups = compute_wgs + 1
    pool = 65536 // (128 * warpgroups) // 8 * 8 * warpgroups
    return min((pool - MEMORY_REGISTERS[compute_wgs]) // compute_wgs // 8 * 8, 232)


def _kernel(items_ref, cell_indptr_ref, kv_indices_ref, q_ref, k_ref, v_ref, v_last_ref, sink_ref, q_pos_ref,
            params, o_ref, lse_ref, o_tail_ref, scoped, *, causal, contiguous, fused, page_size, num_kv_heads, block_kv,
            max_steps, sm_scale, variant, interpret, row_stores, pipeline, tree_max, compute_wgs,
            persistent, packed_tokens, columns):
    # fused: k_ref and v_ref are one NHD_FUSED cache [P, S, Hkv, 2, D] (K at [..., 0, :], V at 1)
    tile_tokens = compute_wgs * WG_ROWS
    cell = lax.axis_index("cells")
    num_qo_heads = q_ref.shape[1]
    dv = v_ref.shape[-1]  # V and o's head_dim
    group = num_qo_heads // num_kv_heads
    mixed = packed_tokens > 0
    smem, (k_bar, v_bar, q_bar, *qp_bar), (k_free, v_free), sched = scoped
    q_smem2, k_smem, v_smem, lse_smem2, *extra_smem = smem
    # o's staging buffer where V's head_dim differs from q's: [wgs, 64, Dv] (else q_smem2 stages o)
    o_smem2 = extra_smem.pop() if v_ref.shape[-1] != q_ref.shape[-1] else None
    qp_smem = extra_smem.pop() if mixed else None  # [wgs, 64, D] unswizzled (store_mixed)
    pos_smem2 = extra_smem[0] if extra_smem else None  # [2, 64] int32 with a variant
    wg = lax.axis_index("wg")
    first_item, end_item = cell_indptr_ref[cell], cell_indptr_ref[cell + 1]
    softmax = variant is None or variant.use_softmax
    bounded = variant is not None and variant.has_bounds
    masked_variant = variant is not None and variant.has_mask
    slots = k_smem.shape[0]

    def item_fields(w, has_item=True):
        """Work item w's fields and the KV blocks of its tile (both branches compute them); none
        (tile_steps 0) where has_item is false."""
        load = lambda name: items_ref[w * columns.width + getattr(columns, name)]  # flattened: 1-D loads
        q_row_start, tile_tok, qo_len = load("q_row_start"), load("tile_tok"), load("qo_len")
        page_base, kv_len = load("page_base"), load("kv_len")
        kv_start, kv_end = load("kv_start"), load("kv_end")
        offset = kv_len - qo_len  # causal: query token t sees keys <= t + offset
        kv_hi = kv_end
        if causal:
            kv_hi = jnp.clip(jnp.minimum(tile_tok + tile_tokens, qo_len) - 1 + offset + 1, kv_start, kv_end)
        # The tile's blocks start at a multiple of block_kv (whole pages, 8-aligned rows): at its
        # first key, or at the first key the variant's mask shows to any of its rows.
        kv_begin, full_lo = kv_start, None
        if bounded:
            lo, full_lo = variant.kv_bounds(params, load("q_pos_min"), load("q_pos_max"))
            kv_begin = jnp.clip(lo - load("kv_pos_offset"), kv_start, kv_hi)
        kv_begin = lax.div(kv_begin, jnp.int32(block_kv)) * block_kv
        last_row = None
        if mixed:  # the item's head and kind
            head, lse_slot, packed = load("head"), load("lse_slot"), load("packed") != 0
            kv_head = jnp.where(packed, head, lax.div(head, jnp.int32(group)))
            last_row = load("last_row") if v_last_ref is not None else None
        else:  # the grid's head
            head, lse_slot, packed = lax.axis_index("heads"), w, False
            kv_head = lax.div(head, jnp.int32(group))
        return _Item(q_row_start=q_row_start, tile_tok=tile_tok, qo_len=qo_len, page_base=page_base, kv_len=kv_len,
                     kv_start=kv_start, kv_end=kv_end, pos_offset=load("kv_pos_offset"), tail=load("tail"),
                     offset=offset, kv_begin=kv_begin, kv_visible=jnp.maximum(kv_start, load("kv_first")),
                     full_lo=full_lo,
                     tile_steps=jnp.where(has_item, pl.cdiv(kv_hi - kv_begin, jnp.int32(block_kv)), 0),
                     head=head, kv_head=kv_head, lse_slot=lse_slot, packed=packed, last_row=last_row)

    def schedule_barrier():
        plgpu.barrier_arrive(sched)
        plgpu.barrier_wait(sched)

    def store_mixed(has_item, f, first_tok, row0):
        """A mixed launch's output rows, from the warpgroup's unswizzled qp_smem: a packed tile's
        G rows per token; a query tile's rows of its request (64 at once, else 8 or 1 at a time:
        rows next to it belong to other requests)."""
        qp = qp_smem.at[wg]
        for t in range(packed_tokens):
            @pl.when(has_item & f.packed & (wg == 0) & (t < f.qo_len))
            def _():
                plgpu.copy_smem_to_gmem(qp.at[pl.ds(t * group, group)],
                                        o_ref.at[f.q_row_start + t, pl.ds(f.kv_head * group, group)])

        lo = jnp.clip(-first_tok, 0, WG_ROWS)  # the request's rows: [lo, hi) of the 64
        hi = jnp.clip(f.qo_len - first_tok, 0, WG_ROWS)
        tile = has_item & ~f.packed
        whole = tile & (lo == 0) & (hi == WG_ROWS)

        @pl.when(whole)
        def _():
            plgpu.copy_smem_to_gmem(qp, o_ref.at[pl.ds(row0, WG_ROWS), f.head])

        part = tile & ~whole
        for j in range(0, WG_ROWS, 8):
            eight = part & (lo <= j) & (j + 8 <= hi)

            @pl.when(eight)
            def _():
                plgpu.copy_smem_to_gmem(qp.at[pl.ds(j, 8)], o_ref.at[pl.ds(row0 + j, 8), f.head])

            for i in range(j, j + 8):
                @pl.when(part & ~eight & (lo <= i) & (i < hi))
                def _():
                    plgpu.copy_smem_to_gmem(qp.at[pl.ds(i, 1)], o_ref.at[pl.ds(row0 + i, 1), f.head])

    iota = (functools.partial(lax.broadcasted_iota, jnp.int32) if interpret else
            functools.partial(plgpu.broadcasted_iota, jnp.int32, layout=plgpu.Layout.WGMMA))

    def clean_v(f, step, slot):
        """Zeroes the V rows of block `step` (in `slot`) outside item f's keys [kv_visible,
        kv_end): a last page's slots past kv_len (a freed page keeps its last owner's values,
        NaN included) would make P @ V NaN where P is 0. Only blocks at the range's ends have
        such rows; every warpgroup that reads the block writes the same zeros (no race)."""
        if mixed or contiguous:  # mixed launches read LastPages' copies (zeroing here cost 24% there);
            return               # contiguous K/V has no stale slots (rows past a request are the next one's)
        start = f.kv_begin + step * block_kv
        lo, hi = jnp.clip(f.kv_visible - start, 0, block_kv), jnp.clip(f.kv_end - start, 0, block_kv)
        for h in range(0, block_kv, WG_ROWS):  # 64-row halves: one WGMMA-layout tile each
            @pl.when((lo > h) | (hi < h + WG_ROWS))
            def _():
                rows = v_smem.at[slot, pl.ds(h, WG_ROWS)]  # [64, D]
                x = rows[...] if interpret else plgpu.load(rows, *_LOAD_IDX, layout=plgpu.Layout.WGMMA,
                                                            optimized=False)
                r = iota(x.shape, 0) + h
                rows[...] = jnp.where((r >= lo) & (r < hi), x, jnp.zeros((), x.dtype))
        plgpu.commit_smem()

    def wg_blocks(f, has_item):
        """This warpgroup's share of item f: (its first query token, its KV blocks, the blocks
        wholly visible to all its rows, the leading blocks that need the mask)."""
        first_tok = f.tile_tok + wg * WG_ROWS
        wg_hi = f.kv_end
        if causal:
            last = jnp.minimum(first_tok + WG_ROWS, f.qo_len) - 1
            wg_hi = jnp.clip(last + f.offset + 1, f.kv_start, f.kv_end)
        has_rows = has_item & (first_tok < f.qo_len) & (first_tok + WG_ROWS > 0)  # rows of the request
        steps = jnp.where(has_rows, pl.cdiv(jnp.maximum(wg_hi - f.kv_begin, 0), jnp.int32(block_kv)), 0)
        # Blocks wholly visible to every row of the warpgroup (and inside the range).
        full_end = jnp.minimum(f.kv_end, first_tok + f.offset + 1) if causal else f.kv_end
        n_full = jnp.clip(lax.div(full_end - f.kv_begin, jnp.int32(block_kv)), 0, steps)
        # Leading blocks that need the mask: keys before kv_visible, or not all inside the variant's.
        lead = jnp.where(f.kv_visible > f.kv_begin, 1, 0)
        if bounded:
            lead = jnp.maximum(lead, pl.cdiv(f.full_lo - f.pos_offset - f.kv_begin, jnp.int32(block_kv)))
        elif masked_variant:
            lead = steps  # no bounds: every block masked
        return first_tok, steps, n_full, jnp.clip(lead, 0, steps)

    def load_q(f, first_tok):
        """The warpgroup's 64 query rows of item f into q_smem (a packed tile's tokens x head group)."""
        q_smem = q_smem2.at[wg]

        def load_rows():  # the warpgroup's 64 query tokens of one head
            plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(f.q_row_start + first_tok, WG_ROWS), f.head], q_smem,
                                    q_bar.at[wg])
            if variant is not None:  # the rows' query positions, by the same barrier
                plgpu.copy_gmem_to_smem(q_pos_ref.at[pl.ds(f.q_row_start + first_tok, WG_ROWS)],
                                        pos_smem2.at[wg], q_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[wg])

        def load_rows_unpadded():
            """load_rows through the unswizzled buffer: TMA into a tiled buffer views q's rows in
            8-row tiles (so q would need padding to a multiple of 8 rows: a copy of q); into an
            untiled one it reads any row count (rows past q's end read as zeros)."""
            plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(f.q_row_start + first_tok, WG_ROWS), f.head], qp_smem.at[wg],
                                    q_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[wg])
            q_smem[...] = qp_smem[wg] if interpret else plgpu.load(
                qp_smem.at[wg], *_LOAD_IDX, layout=plgpu.Layout.WGMMA, optimized=False)
            plgpu.commit_smem()

        if mixed:
            pl.when(~f.packed)(load_rows_unpadded)

            @pl.when(f.packed & (wg == 0))
            def _():  # row t * G + g: token t, query head kv_head * G + g; a token past qo_len
                # only arrives (its rows, like those past packed_tokens x G, are never stored)
                for t in range(packed_tokens):
                    @pl.when(t < f.qo_len)
                    def _():
                        plgpu.copy_gmem_to_smem(q_ref.at[f.q_row_start + t, pl.ds(f.kv_head * group, group)],
                                                qp_smem.at[0, pl.ds(t * group, group)], qp_bar[0])

                    if t:  # (a packed tile has a token)
                        pl.when(t >= f.qo_len)(lambda: plgpu.barrier_arrive(qp_bar[0]))
                plgpu.barrier_wait(qp_bar[0])
                q_smem[...] = qp_smem[0] if interpret else plgpu.load(
                    qp_smem.at[0], *_LOAD_IDX, layout=plgpu.Layout.WGMMA, optimized=False)
                plgpu.commit_smem()
        else:
            load_rows()

    def drain(step, _):
        """Releases block `step`, loaded for the other warpgroup's longer range: every load is
        awaited once by each warpgroup, so each sees every barrier phase (block 0's K was awaited
        before the loop)."""
        slot = lax.rem(step, jnp.int32(slots))

        @pl.when(step > 0)
        def _():
            plgpu.barrier_wait(k_bar.at[slot])

        plgpu.barrier_arrive(k_free.at[slot])
        plgpu.barrier_wait(v_bar.at[slot])
        plgpu.barrier_arrive(v_free.at[slot])
        if pipeline == "pingpong":
            schedule_barrier()
            schedule_barrier()

    def store_item(f, first_tok, has_item, acc, m_i, l_i):
        """The warpgroup's finished state (acc [64, Dv], m_i, l_i [64]) of item f: o normalized and
        stored (whole tile, its own rows, or its tail slot), lse by the item's slot."""
        o_smem, lse_smem = (q_smem2 if o_smem2 is None else o_smem2).at[wg], lse_smem2.at[wg]  # [64, Dv]
        if softmax:
            nonempty = l_i > 0
            l_safe = jnp.where(nonempty, l_i, 1.0)
            o = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
            lse = jnp.where(nonempty, (m_i + jnp.log2(l_safe)) * (1 / LOG2E), -jnp.inf)
        else:  # plain sums: lse 0 (see _attention.finalize)
            o, lse = acc, l_i
        (qp_smem.at[wg] if mixed else o_smem)[...] = o.astype(q_ref.dtype)
        lse_smem[...] = lse
        plgpu.commit_smem()
        row0 = f.q_row_start + first_tok
        if mixed:
            store_mixed(has_item, f, first_tok, row0)
        elif row_stores:  # the tile starts at the request's first row: store its rows, 8 at a time where partial
            n_rows = jnp.clip(f.qo_len - first_tok, 0, WG_ROWS)

            @pl.when(has_item & (n_rows == WG_ROWS))
            def _():
                plgpu.copy_smem_to_gmem(o_smem, o_ref.at[pl.ds(row0, WG_ROWS), f.head])

            for j in range(0, WG_ROWS, 8):  # rows past the request up to its next 8-aligned row: nobody's
                @pl.when(has_item & (n_rows < WG_ROWS) & (j < n_rows))
                def _():
                    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(j, 8)], o_ref.at[pl.ds(row0 + j, 8), f.head])
        else:
            tail = f.tail

            @pl.when(has_item & (tail < 0))  # the tile is wholly the request's rows
            def _():
                plgpu.copy_smem_to_gmem(o_smem, o_ref.at[pl.ds(row0, WG_ROWS), f.head])

            @pl.when(has_item & (tail >= 0))
            def _():
                plgpu.copy_smem_to_gmem(
                    o_smem, o_tail_ref.at[pl.ds(tail * tile_tokens + wg * WG_ROWS, WG_ROWS), f.head])

        # lse rows by slot (a contiguous TMA store needs a 16-byte aligned destination); a packed
        # tile's rows in token-major order
        lse_row = 0 if mixed else f.head

        @pl.when((has_item | (f.packed & (wg == 0))) if mixed else has_item)
        def _():
            plgpu.copy_smem_to_gmem(
                lse_smem, lse_ref.at[lse_row, pl.ds(f.lse_slot * tile_tokens + wg * WG_ROWS, WG_ROWS)])

        plgpu.wait_smem_to_gmem(0)

    def _compute_item(w, f, has_item=True):
        kv_end, offset, kv_begin, kv_visible, tile_steps, pos_offset = (
            f.kv_end, f.offset, f.kv_begin, f.kv_visible, f.tile_steps, f.pos_offset)
        head, packed, q_smem = f.head, f.packed, q_smem2.at[wg]
        first_tok, steps, n_full, lead = wg_blocks(f, has_item)
        load_q(f, first_tok)
        # (The interpreter has no register layouts: plain arrays there.)
        cast = (lambda x, _: x) if interpret else plgpu.layout_cast
        if sink_ref is None:
            m_i = cast(jnp.full((WG_ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l_i = cast(jnp.full((WG_ROWS,), 0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        else:  # the head's sink: a key of logit sink and value 0, in the state from the start
            m_i = cast(jnp.full((WG_ROWS,), sink_ref[head] * LOG2E, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l_i = cast(jnp.full((WG_ROWS,), 1, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc = cast(jnp.full((WG_ROWS, dv), 0, jnp.float32), plgpu.Layout.WGMMA)
        if variant is not None:  # the rows' query positions [64]
            q_pos = (pos_smem2[wg] if interpret else plgpu.load(
                pos_smem2.at[wg], *_LOAD_IDX, layout=plgpu.Layout.WGMMA.reduce(1), optimized=False))

        @pl.when(tile_steps > 0)
        def _():
            plgpu.barrier_wait(k_bar.at[0])

        def probs(step, s, m_i, masked):
            """Block `step`'s scores s [64, BK] (q.k, f32) -> (p [64, BK] f32, m_new [64], alpha [64]
            or None): the variant's logits transform and the masks applied; with softmax, p and
            m_new in base-2 units (p relative to m_new), alpha rescales the state before the block."""
            if masked or variant is not None:
                kv_tok = iota(s.shape, 1) + kv_begin + step * block_kv
            c = sm_scale * LOG2E  # base 2, the scale folded into the exponent's multiply-add
            if variant is not None:
                qo_pos = lax.broadcast_in_dim(q_pos, s.shape, [0])
                kv_pos = kv_tok + pos_offset
            if variant is not None and variant.has_logits_transform:
                s = variant.logits_transform(params, s * sm_scale, qo_pos, kv_pos, head)
                c = LOG2E
            visible = None
            if masked:
                visible = (kv_tok >= kv_visible) & (kv_tok < kv_end)
                if causal and mixed:  # row r is token r // G of a packed tile, else token r
                    rows_per_token = jnp.where(packed, jnp.int32(group), jnp.int32(1))
                    visible = visible & ((kv_tok - first_tok - offset) * rows_per_token <= iota(s.shape, 0))
                elif causal:
                    visible = visible & (kv_tok <= iota(s.shape, 0) + first_tok + offset)
                if masked_variant:
                    visible = visible & variant.logits_mask(params, qo_pos, kv_pos, head)
            if not softmax:  # o = sum_j f(s_ij) v_j (the transform is f)
                return (s if visible is None else jnp.where(visible, s, 0.0)), m_i, None
            if visible is not None:
                s = jnp.where(visible, s, -jnp.inf)
            m_new = jnp.maximum(m_i, _row_max(s, tree_max) * c)
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp2(m_i - m_safe)
            p = jnp.exp2(s * c - lax.broadcast_in_dim(m_safe, s.shape, [0]))
            return p, m_new, alpha

        def row_sums(p, l_i, alpha):  # without softmax the sums are not needed (l stays 0)
            return l_i if alpha is None else l_i * alpha + p.sum(axis=1)

        def segments(kv_step, first, carry):
            """kv_step over blocks [first, steps): the masked lead blocks, the unmasked ones, and
            the masked ones from n_full on."""
            lead_end = jnp.maximum(lead, first)
            unmasked_end = jnp.maximum(jnp.maximum(n_full, lead), first)
            carry = lax.fori_loop(first, lead_end, functools.partial(kv_step, masked=True), carry)
            carry = lax.fori_loop(lead_end, unmasked_end, functools.partial(kv_step, masked=False), carry)
            return lax.fori_loop(unmasked_end, steps, functools.partial(kv_step, masked=True), carry)

        def qk_dot(slot):  # the interpreter's wgmma takes no transposed operand: a plain dot
            return lax.dot_general(q_smem[...], k_smem[slot], (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)

        pingpong = pipeline == "pingpong"
        if pingpong:
            pl.when(wg == 1)(schedule_barrier)

        def kv_step(step, carry, masked):  # ping-pong: the two warpgroups' matmuls alternate
            acc, m_i, l_i = carry
            slot = lax.rem(step, jnp.int32(slots))

            def qk_scope(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                if pingpong:
                    schedule_barrier()
                return acc_ref[...]

            if interpret:
                s = qk_dot(slot)
                if pingpong:
                    schedule_barrier()
            else:
                s = pl.run_scoped(qk_scope, plgpu.ACC((WG_ROWS, block_kv), jnp.float32))  # [64, BK]
            plgpu.barrier_arrive(k_free.at[slot])
            p, m_new, alpha = probs(step, s, m_i, masked)
            if alpha is not None:
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            l_i = row_sums(p, l_i, alpha)
            p16 = p.astype(q_ref.dtype)
            if not interpret:
                acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
            if pingpong:
                plgpu.barrier_arrive(sched)  # done with softmax
            plgpu.barrier_wait(v_bar.at[slot])
            if masked:  # (blocks at the range's ends are masked ones)
                clean_v(f, step, slot)
            if pingpong:
                plgpu.barrier_wait(sched)  # the tensor cores are free

            def wait_next_k():
                nxt = step + 1

                @pl.when(nxt < steps)
                def _():
                    plgpu.barrier_wait(k_bar.at[lax.rem(nxt, jnp.int32(slots))])

            if interpret:  # the interpreter's wgmma takes refs only: a plain dot
                acc = acc + jnp.dot(p16, v_smem[slot], preferred_element_type=jnp.float32)
                wait_next_k()
            else:
                def pv_state(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                    wait_next_k()
                acc = pl.run_state(pv_state)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l_i

        def overlapped(o_ref):
            """Each warpgroup on its own (FA3's intra-warpgroup overlap): block j's QK^T is issued
            with block j-1's PV, and block j's softmax runs while that PV does. o_ref: the output
            accumulator (None when interpreting: the carry holds it). Needs steps >= 1."""
            def qk0_scope(s_ref):
                plgpu.wgmma(s_ref, q_smem, k_smem.at[0].transpose((1, 0)))
                return s_ref[...]

            s = (qk_dot(0) if interpret else
                 pl.run_scoped(qk0_scope, plgpu.ACC((WG_ROWS, block_kv), jnp.float32)))
            plgpu.barrier_arrive(k_free.at[0])
            p, m_0, alpha = probs(0, s, m_i, True)
            carry = (acc if interpret else None, m_0, row_sums(p, l_i, alpha), p.astype(q_ref.dtype), alpha)

            def rescale(acc, alpha):  # the output so far, to the running max of the block after it
                return acc if alpha is None else acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

            def step_j(j, carry, masked):
                acc, m_i, l_i, p16_prev, alpha_prev = carry  # p16_prev, alpha_prev: block j-1's
                slot = lax.rem(j, jnp.int32(slots))
                prev = lax.rem(j - 1, jnp.int32(slots))
                plgpu.barrier_wait(k_bar.at[slot])
                if interpret:
                    s = qk_dot(slot)
                    plgpu.barrier_wait(v_bar.at[prev])
                    clean_v(f, j - 1, prev)
                    acc = rescale(acc, alpha_prev) + jnp.dot(p16_prev, v_smem[prev],
                                                             preferred_element_type=jnp.float32)
                else:
                    def qk_scope(s_ref):
                        plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                        if alpha_prev is not None:  # (block j-2's PV is done)
                            o_ref[...] = rescale(plgpu.wgmma_accumulator_load(o_ref, wait_n=None), alpha_prev)
                        plgpu.barrier_wait(v_bar.at[prev])
                        clean_v(f, j - 1, prev)
                        plgpu.wgmma(o_ref, p16_prev, v_smem.at[prev])
                        return plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # QK^T done, PV may run
                    s = pl.run_scoped(qk_scope, plgpu.ACC((WG_ROWS, block_kv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                p, m_new, alpha = probs(j, s, m_i, masked)
                l_i = row_sums(p, l_i, alpha)
                if not interpret:
                    plgpu.wgmma_wait(0)  # block j-1's PV
                plgpu.barrier_arrive(v_free.at[prev])
                return acc, m_new, l_i, p.astype(q_ref.dtype), alpha

            acc_j, m_j, l_j, p16, alpha = segments(step_j, 1, carry)
            last = lax.rem(steps - 1, jnp.int32(slots))
            plgpu.barrier_wait(v_bar.at[last])
            clean_v(f, steps - 1, last)
            if interpret:
                acc_j = rescale(acc_j, alpha) + jnp.dot(p16, v_smem[last], preferred_element_type=jnp.float32)
            else:
                if alpha is not None:
                    o_ref[...] = rescale(plgpu.wgmma_accumulator_load(o_ref, wait_n=None), alpha)
                plgpu.wgmma(o_ref, p16, v_smem.at[last])
                acc_j = o_ref[...]
            plgpu.barrier_arrive(v_free.at[last])
            return acc_j, m_j, l_j

        if pipeline != "overlap":
            acc, m_i, l_i = segments(kv_step, 0, (acc, m_i, l_i))
        else:
            run = overlapped if interpret else (
                lambda _: pl.run_scoped(overlapped, plgpu.ACC((WG_ROWS, dv), jnp.float32)))
            acc, m_i, l_i = lax.cond(steps > 0, lambda: run(None), lambda: (acc, m_i, l_i))

        lax.fori_loop(steps, tile_steps, drain, None)
        if pingpong:
            pl.when(wg == 0)(schedule_barrier)

        store_item(f, first_tok, has_item, acc, m_i, l_i)

    def _memory_item(f):
        page_base, kv_len, kv_begin, tile_steps, kv_head = f.page_base, f.kv_len, f.kv_begin, f.tile_steps, f.kv_head
        pages_per_block = max(1, block_kv // page_size)
        rows_per_copy = min(page_size, block_kv)
        k_part, v_part = ((0,), (1,)) if fused else ((), ())  # appended to a K / V source index
        last_page = page_base + pl.cdiv(kv_len, jnp.int32(page_size)) - 1  # in kv_indices

        def first_tok(step, i):  # the first key of copy i of block `step`
            return kv_begin + step * block_kv + i * rows_per_copy

        def position(step, i):  # copy i's page in kv_indices (past the last page: the last page)
            return jnp.minimum(page_base + lax.div(first_tok(step, i), jnp.int32(page_size)), last_page)

        def sources(step):
            """(K/V source index, slot rows) of each copy of KV block `step`: the page-index loads,
            issued before waiting for the slot."""
            if contiguous:
                return [((pl.ds(page_base + first_tok(step, 0), block_kv), kv_head), pl.ds(0, block_kv))]
            return [((kv_indices_ref[position(step, i)],
                      pl.ds(lax.rem(first_tok(step, i), jnp.int32(page_size)), rows_per_copy), kv_head),
                     pl.ds(i * rows_per_copy, rows_per_copy)) for i in range(pages_per_block)]  # one TMA per page

        def copy(srcs, slot, ref, part, smem, bar):
            for src, dst in srcs:
                plgpu.copy_gmem_to_smem(ref.at[src + part], smem.at[slot, dst], bar.at[slot])

        def copy_v(step, srcs, slot, final):
            """V of block `step`. Only an item's final block can reach its last page: there (final),
            a sanitized last page comes from v_last (positions recomputed: the memory warpgroup
            has few registers). Other blocks copy with no branch (branches there cost 6-11%)."""
            if not final or f.last_row is None:
                return copy(srcs, slot, v_ref, v_part, v_smem, v_bar)
            reaches = (f.last_row >= 0) & (position(step, pages_per_block - 1) == last_page)
            pl.when(~reaches)(lambda: copy(srcs, slot, v_ref, v_part, v_smem, v_bar))

            @pl.when(reaches)
            def _():
                for i, (src, dst) in enumerate(srcs):
                    at_last = position(step, i) == last_page

                    @pl.when(at_last)
                    def _():
                        plgpu.copy_gmem_to_smem(v_last_ref.at[(f.last_row,) + src[1:]], v_smem.at[slot, dst],
                                                v_bar.at[slot])

                    @pl.when(~at_last)
                    def _():
                        plgpu.copy_gmem_to_smem(v_ref.at[src + v_part], v_smem.at[slot, dst], v_bar.at[slot])

        def fill(step, final, wait):  # block `step` into its slot, once free (wait: it was used before)
            slot = step if isinstance(step, int) else lax.rem(step, jnp.int32(slots))
            srcs = sources(step)
            pl.when(wait)(lambda: plgpu.barrier_wait(k_free.at[slot]))
            copy(srcs, slot, k_ref, k_part, k_smem, k_bar)
            pl.when(wait)(lambda: plgpu.barrier_wait(v_free.at[slot]))
            copy_v(step, srcs, slot, final)

        # Every block but the final one copies with no branch; the final one's code exists once.
        last_step = tile_steps - 1
        for i in range(max_steps):
            pl.when(i < last_step)(lambda: fill(i, False, False))
        pl.loop(max_steps, jnp.maximum(last_step, max_steps))(lambda step: fill(step, False, True))
        pl.when(tile_steps > 0)(lambda: fill(last_step, True, last_step >= max_steps))

        @pl.loop(jnp.maximum(tile_steps - max_steps, 0), tile_steps)
        def _(step):  # the last blocks' releases: every barrier phase is awaited by its waiters
            slot = lax.rem(step, jnp.int32(slots))
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])

    def each_item(run_item):
        """run_item(w, fields, has_item) for the cell's items. Persistent: a loop over them in order
        (every barrier phase of an item is awaited within it, so the next starts from free slots);
        else the cell's one item (if any) in straight-line code: the loop costs 5-40% there."""
        if persistent:
            pl.loop(first_item, end_item)(lambda w: run_item(w, item_fields(w), True))
        else:
            has_item = end_item > first_item
            w = jnp.where(has_item, first_item, 0)
            run_item(w, item_fields(w, has_item), has_item)

    @pl.when(wg < compute_wgs)
    def _compute():
        if not interpret:
            plgpu.set_max_registers(_compute_registers(compute_wgs), action="increase")
        each_item(_compute_item)

    @pl.when(wg == compute_wgs)
    def _memory():
        if not interpret:
            plgpu.set_max_registers(MEMORY_REGISTERS[compute_wgs], action="decrease")
        each_item(lambda w, f, has_item: _memory_item(f))


@_common.compiled_once
def prefill_mosaic(q, k_rows, v_rows, kv_indices, items, cell_indptr, num_tail_rows, *, page_size,
                   num_kv_heads, layout, sm_scale, causal, block_kv=128, max_concurrent_steps=2,
                   pipeline="pingpong", tree_max=False, compute_wgs=2,
                   variant=None, params=None, q_pos=None, interpret=False, row_stores=False,
                   persistent=False, packed_tokens=0, num_lse_slots=None, last_pages=None, sinks=None, columns):
    """q [nnz, Hq, D]; k_rows/v_rows: the cache as [num_pages * page_size * Hkv, D] (layout NHD), one
    array [num_pages * page_size * Hkv * 2, D] as both (NHD_FUSED: K and V interleaved), or
    contiguous [tokens * Hkv, D] with kv_indices None; variant / params / q_pos int32[nnz]: an
    attention variant (no query / key transforms), its parameters and each query token's
    position. row_stores: every request starts at an 8-aligned row of q with its tiles at
    tile_tok 0, T, 2T, ... (T = 64 * compute_wgs tile tokens); a tile stores its own rows (whole
    64-row parts, the rest 8 rows at a time), the rows after a request up to the next 8-aligned
    row are left unwritten, and no tile uses a tail slot. persistent: a cell may hold several work
    items, run in order (else at most one). Returns (o [nnz, Hq, D],
    lse_items [Hq, num_items * T] (item slot w's tokens in rows w * T + i),
    o_tail [num_tail_rows, Hq, D]).

    packed_tokens > 0: a mixed launch (one persistent grid of cells, no variant). Items name their
    head and lse slot (columns: work_items.MIXED); a packed item is a request of at most packed_tokens
    tokens whose G = Hq / Hkv query heads of KV head `head` share one 64-row tile (row t * G + g:
    token t, query head head * G + g), loaded and stored a token at a time; the others are
    query tiles of one query head as above. lse_items is then [1, num_lse_slots * T]: slot s's
    rows at s * T + row (a packed tile's rows in its row order).

    last_pages (a mixed launch on a paged cache): the requests' partly filled last pages; an item
    whose last_row column is r >= 0 reads its last page's V from row r of a copy with the slots
    past kv_len zeroed (a freed slot keeps its last owner's values, NaN included, and 0 * NaN in
    P @ V is NaN). Other launches zero those rows in shared memory.

    sinks f32[Hq] (not mixed, softmax only): attention sinks (gpt-oss), one logit per query head
    in each row's softmax denominator, as a key of value 0 in the state from its start: o and
    lse are final (a row with no visible key gives o = 0 and lse = its sink)."""
    nnz, num_qo_heads, d = q.shape
    dv = v_rows.shape[-1]  # V and o's head_dim (DeepSeek's prefill: 128 beside q / K's 192)
    mixed = packed_tokens > 0
    persistent = persistent or mixed
    if mixed and (variant is not None or row_stores):
        raise ValueError("prefill_mosaic: a mixed launch takes no variant and no row_stores")
    if mixed and dv != d:
        raise ValueError("prefill_mosaic: a mixed launch needs V's head_dim equal to q's")
    if mixed and packed_tokens * (num_qo_heads // num_kv_heads) > WG_ROWS:
        raise ValueError(f"prefill_mosaic: packed_tokens={packed_tokens} x the head group is over {WG_ROWS} rows")
    # TMA into tiled shared memory views token dimensions in tiles of 8 rows: arrays are padded to
    # a multiple of 8 tokens (a copy only when they are not one already), o and lse are allocated
    # so and sliced. A mixed launch moves q and o through untiled buffers: no padding (compiled).
    nnz_pad = nnz if mixed and not interpret else _round_up(nnz, 8)
    # TMA zero-fills reads past an array's end; the interpreter rejects them.
    tile_tokens = compute_wgs * WG_ROWS
    q_in = _pad_rows(q, nnz_pad + (tile_tokens if interpret else 0))
    if layout not in ("NHD", "NHD_FUSED"):
        raise ValueError(f"prefill impl='mosaic': layout must be 'NHD' or 'NHD_FUSED', got {layout!r}")
    contiguous = kv_indices is None
    fused = layout == "NHD_FUSED" and not contiguous
    if contiguous:
        k = k_rows.reshape(-1, num_kv_heads, d)
        v = v_rows.reshape(-1, num_kv_heads, dv)
        kv_pad = _round_up(k.shape[0], 8) + (block_kv if interpret else 0)
        k, v = _pad_rows(k, kv_pad), _pad_rows(v, kv_pad)
        kv_indices = jnp.zeros((1,), jnp.int32)
    else:  # pages [P, S, Hkv, D] (fused: the one array [P, S, Hkv, 2, D] as both)
        kv_shape = (-1, page_size, num_kv_heads) + ((2,) if fused else ())
        k, v = k_rows.reshape(kv_shape + (d,)), v_rows.reshape(kv_shape + (dv,))
    last = [] if last_pages is None or not mixed or contiguous else [last_pages.sanitized_v(v)]
    num_cells = cell_indptr.shape[0] - 1
    if interpret and num_cells > 2:
        # The interpreter compiles each grid point's warpgroups anew (seconds each): its cells
        # are merged into two, each running its items in order as a persistent cell does.
        cell_indptr = cell_indptr[jnp.array([0, num_cells // 2, num_cells])]
        num_cells, persistent = 2, True
    if variant is not None and (variant.has_query_transform or variant.has_key_transform):
        raise ValueError(f"prefill impl='mosaic': variant {variant.name!r} has query / key transforms")
    if sinks is not None and (mixed or not (variant is None or variant.use_softmax)):
        raise ValueError("prefill_mosaic: sinks need a softmax and a launch that is not mixed")
    sink_in = [] if sinks is None else [sinks.astype(jnp.float32)]
    leaves, treedef, scalar = _common.flatten_params(params)
    extra = []
    if variant is not None:  # rows are loaded 64 at a time from 8-aligned starts: padded
        extra = [_pad_rows(q_pos.astype(jnp.int32), nnz_pad + tile_tokens)] + leaves
    interpret_params = None
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        _warn_if_interpreter_pool_too_small(compute_wgs + 1)
        interpret_params = InterpretGPUParams(uninitialized_memory="nan")  # outputs poisoned

    def entry(items_ref, cell_indptr_ref, kv_indices_ref, q_ref, k_ref, v_ref, *refs):
        v_last_ref, refs = (refs[0], refs[1:]) if last else (None, refs)
        sink_ref, refs = (refs[0], refs[1:]) if sinks is not None else (None, refs)
        q_pos_ref, param_refs = (refs[0], refs[1:-3]) if variant is not None else (None, ())
        o_ref, lse_ref, o_tail_ref = refs[-3:]
        tiling = plgpu.TilingTransform((8, 64))
        swizzle = plgpu.SwizzleTransform(128)
        smem = [plgpu.SMEM((compute_wgs, WG_ROWS, d), q.dtype, transforms=(tiling, swizzle)),
                plgpu.SMEM((max_concurrent_steps, block_kv, d), q.dtype, transforms=(tiling, swizzle)),
                plgpu.SMEM((max_concurrent_steps, block_kv, dv), q.dtype, transforms=(tiling, swizzle)),
                plgpu.SMEM((compute_wgs, WG_ROWS), jnp.float32)]
        if variant is not None:
            smem.append(plgpu.SMEM((compute_wgs, WG_ROWS), jnp.int32))
        if mixed:  # unswizzled: a packed tile's q; each warpgroup's output rows
            smem.append(plgpu.SMEM((compute_wgs, WG_ROWS, d), q.dtype))
        if dv != d:  # o staged apart from q
            smem.append(plgpu.SMEM((compute_wgs, WG_ROWS, dv), q.dtype, transforms=(tiling, swizzle)))
        copies = 1 if contiguous else max(1, block_kv // page_size)
        loaded = (plgpu.Barrier(num_arrivals=copies, num_barriers=max_concurrent_steps),
                  plgpu.Barrier(num_arrivals=copies, num_barriers=max_concurrent_steps),
                  plgpu.Barrier(num_arrivals=1 if variant is None else 2, num_barriers=compute_wgs))
        if mixed:  # a packed tile's q: a copy per token
            loaded += (plgpu.Barrier(num_arrivals=packed_tokens),)
        freed = (plgpu.Barrier(num_arrivals=compute_wgs, num_barriers=max_concurrent_steps),) * 2
        pl.run_scoped(
            lambda *scoped: _kernel(
                items_ref, cell_indptr_ref, kv_indices_ref, q_ref, k_ref, v_ref, v_last_ref, sink_ref, q_pos_ref,
                None if variant is None else _common.unflatten_params(param_refs, treedef, scalar),
                o_ref, lse_ref, o_tail_ref, scoped, causal=causal, contiguous=contiguous, fused=fused,
                page_size=page_size, num_kv_heads=num_kv_heads, block_kv=block_kv, max_steps=max_concurrent_steps,
                sm_scale=sm_scale, variant=variant, interpret=interpret, row_stores=row_stores,
                pipeline=pipeline, tree_max=tree_max, compute_wgs=compute_wgs, persistent=persistent,
                packed_tokens=packed_tokens, columns=columns),
            smem, loaded, freed, plgpu.Barrier(num_arrivals=2), collective_axes="wg")

    lse_shape = (1, num_lse_slots * tile_tokens) if mixed else (num_qo_heads, items.shape[0] * tile_tokens)
    out_shape = (jax.ShapeDtypeStruct((nnz_pad, num_qo_heads, dv), q.dtype),
                 jax.ShapeDtypeStruct(lse_shape, jnp.float32),
                 jax.ShapeDtypeStruct((num_tail_rows, num_qo_heads, dv), q.dtype))
    kw = dict(interpret=interpret_params) if interpret else {}
    grid = (1 if mixed else num_qo_heads, num_cells)
    o, lse_items, o_tail = plgpu.kernel(entry, out_type=out_shape, grid=grid,
                        grid_names=("heads", "cells"), num_threads=compute_wgs + 1, thread_name="wg",
                        compiler_params=plgpu.CompilerParams(
                            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane), **kw)(
        items.reshape(-1), cell_indptr, kv_indices, q_in, k, v, *last, *sink_in, *extra)
    return o[:nnz], lse_items, o_tail


def _round_up(n, m):
    return -(-n // m) * m


def _pad_rows(x, rows):
    """x [n, ...] padded with zeros to [rows, ...] (x itself when n == rows)."""
    return x if x.shape[0] == rows else jnp.pad(x, ((0, rows - x.shape[0]),) + ((0, 0),) * (x.ndim - 1))
