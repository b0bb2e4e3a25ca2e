"""Multi-head latent attention (MLA) on Mosaic GPU (Hopper): TMA loads, wgmma, warp specialization.

The work list is planner/mla.py's (columns: work_items.MLA) with tiles of 64 query rows and
32-key blocks: a tile is 64 heads of one query token (num_heads a multiple of 64), or 64 / H
tokens of H heads (causal: row r's keys end at its token's diagonal, masked in the blocks past
the first row's). A decode step of 8-32 heads takes tiles of one token (tile_rows = H): the
wgmma still computes 64 rows, the rest stale and never stored, and the latent cache is read
once per request. Grid (num_cells,), three warpgroups per cell, the cell's items run in order:

- the memory warpgroup loads each item's q (q_nope [64, Dc], q_pe [64, Dr]) once both compute
  warpgroups are done with the previous item, then streams the item's latent blocks (ckv
  [32, Dc], kpe [32, Dr]: 32-key runs of one page, by TMA) through SLOTS shared-memory slots.
  Blocks of 32 keys keep three in flight while one is computed; with 64-key blocks only two
  fit, and the kernel ran 216.3 µs against 186.6 (H100, 128 heads B64 kv4096);
- compute warpgroup 0 computes each block's scores s = q_nope ckv^T + q_pe kpe^T (q_pe held in
  registers), runs the online softmax (base 2) and hands p (bf16, shared memory) and the rescale
  alpha to warpgroup 1; each then accumulates its own half of the output columns,
  o[:, h Dc/2 : (h+1) Dc/2] += p ckv[:, that half] (a [64, Dc] f32 accumulator does not fit one
  warpgroup's registers). At an item's end warpgroup 0 hands over l. Letting both warpgroups
  compute the scores (no handoff, 1.5x the tensor work), or FlashMLA's seesaw (each scoring
  alternate blocks), measured the same on an H100 (docs/design.md).

Keys outside [kv_start, kv_end) get score -inf, and a block's ckv rows there are zeroed in
shared memory (each warpgroup its own column half) before P V: a freed page keeps its last
owner's values, NaN included, and 0 * NaN is NaN. Items with part_base < 0 write the final rows
of o (q's dtype) and lse; split items write partial states (o in q's dtype, as FlashInfer's
split-KV buffers, lse in float32), tile_rows consecutive rows from part_base
(planner.mla.plan(tile_merge=True)), merged by whole tiles afterwards.
"""
import functools
import inspect
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _common

WG_ROWS = 64   # query rows a warpgroup computes (one wgmma M): a tile's rows and padding
BLOCK_KV = 32  # keys per block
SLOTS = 4      # blocks in flight (shared memory: q 64 KiB + 4 x 36 KiB of latent rows + p and q_pe)
SWIZZLE = 64   # bytes: 32 bf16 columns, so that a block's 32 keys are one wgmma K group of P V
TILE_ROWS = (8, 16, 32, 64)  # a tile's rows: 64; fewer (one token of 8-32 heads, decode) pad the wgmma's M
LOG2E = math.log2(math.e)
COMPUTE_REGISTERS, MEMORY_REGISTERS = 232, 40  # per thread (2 x 232 + 40 warps of 128 fit 64K)
_LOAD_IDX = (((),) if getattr(inspect.signature(plgpu.load).parameters.get("idx"), "default", None)
             is inspect.Parameter.empty else ())  # plgpu.load's index, where required (see prefill_mosaic)


def limits(*, num_heads, head_dim_ckv, head_dim_kpe, page_size):
    """Why the kernel cannot run these sizes (None when it can)."""
    if num_heads % WG_ROWS and WG_ROWS % num_heads:
        return f"num_heads must divide {WG_ROWS} or be a multiple of it (a tile's rows), got {num_heads}"
    if page_size % BLOCK_KV:
        return f"page_size must be a multiple of {BLOCK_KV} (a block is {BLOCK_KV} keys of one page), got {page_size}"
    if head_dim_ckv % 128 or head_dim_ckv > 512:
        return f"head_dim_ckv must be a multiple of 128 up to 512 (half a row per warpgroup), got {head_dim_ckv}"
    if head_dim_kpe != 64:
        return f"head_dim_kpe must be 64 (one wgmma K group of q_pe kpe^T), got {head_dim_kpe}"
    return None


def _kernel(items_ref, cell_indptr_ref, kv_indices_ref, q_nope_ref, q_pe_ref, ckv_ref, kpe_ref,
            o_ref, lse_ref, o_part_ref, lse_part_ref, scoped, *, columns, num_heads, page_size, sm_scale, causal,
            tile_rows, slots, interpret):
    # items_ref int32[W * len(columns)] (flattened; columns: planner.mla.COLUMNS' names)
    # cell_indptr_ref int32[cells + 1]; kv_indices_ref int32[I]
    # q_nope_ref [N, 2, Dc/2], q_pe_ref [N, Dr]: q as rows token * H + head, ckv's columns in halves
    # ckv_ref [P, S, 2, Dc/2], kpe_ref [P, S, Dr]: the latent cache's pages
    # o_ref [N, 2, Dc/2] (q's dtype), lse_ref f32[N]; o_part_ref f32[parts, 2, Dc/2], lse_part_ref f32[parts]
    (qn_smem, ckv_smem, kpe_smem, p_smem, qpe_smem, vec_smem, lse_smem), (q_bar, kv_bar, p_ready), (q_free, kv_free, p_free) = scoped
    # qn_smem [2, 64, Dc/2]; ckv_smem [slots, 2, 32, Dc/2], kpe_smem [slots, 32, Dr];
    # p_smem [64, 32]: each block's p; qpe_smem [64, Dr]: an item's q_pe until warpgroup 0
    # holds it in registers; vec_smem f32[64]: each block's alpha, then the item's l; lse_smem f32[64]
    wg = lax.axis_index("wg")
    cell = lax.axis_index("cells")
    first_item, end_item = cell_indptr_ref[cell], cell_indptr_ref[cell + 1]
    dtype = q_nope_ref.dtype
    half = qn_smem.shape[-1]
    c = sm_scale * LOG2E  # base 2, the scale folded into the exponent's multiply-add
    per_row_limits = causal and num_heads < tile_rows  # a tile holds tile_rows / H tokens

    def fields(w):
        load = lambda name: items_ref[w * len(columns) + columns.index(name)]  # (flattened: 1-D loads)
        kv_start, kv_end = load("kv_start"), load("kv_end")
        kv_begin = lax.div(kv_start, jnp.int32(BLOCK_KV)) * BLOCK_KV
        steps = jnp.where(kv_end > kv_start, pl.cdiv(kv_end - kv_begin, jnp.int32(BLOCK_KV)), 0)
        # causal: row r sees keys <= limit + r // H (its token's diagonal; one token per tile where H >= 64)
        limit = load("first_pos") + lax.div(load("row_start"), jnp.int32(num_heads))
        return dict(page_base=load("page_base"), q_row=load("q_row"), part_base=load("part_base"),
                    kv_start=kv_start, kv_end=kv_end, kv_begin=kv_begin, steps=steps, limit=limit)

    iota = (functools.partial(lax.broadcasted_iota, jnp.int32) if interpret else
            functools.partial(plgpu.broadcasted_iota, jnp.int32, layout=plgpu.Layout.WGMMA))
    cast = (lambda x, _: x) if interpret else plgpu.layout_cast

    def load_smem(ref):  # a shared-memory buffer into registers (WGMMA layout)
        return ref[...] if interpret else plgpu.load(ref, *_LOAD_IDX, layout=plgpu.Layout.WGMMA, optimized=False)

    def memory_item(w, g):
        """Item w's q, then its blocks; g: blocks this cell loaded before it (their slots)."""
        f = fields(w)

        @pl.when(w > first_item)
        def _():  # the previous item's QK^T is done in both compute warpgroups
            plgpu.barrier_wait(q_free.at[0])

        rows, mine = pl.ds(f["q_row"], tile_rows), pl.ds(0, tile_rows)  # (rows past tile_rows: stale, unstored)
        for h in range(2):
            plgpu.copy_gmem_to_smem(q_nope_ref.at[rows, h], qn_smem.at[h, mine], q_bar.at[0])
        plgpu.copy_gmem_to_smem(q_pe_ref.at[rows], qpe_smem.at[mine], q_bar.at[0])

        def fill(j, _):
            n = g + j
            slot = lax.rem(n, jnp.int32(slots))
            key = f["kv_begin"] + j * BLOCK_KV
            page = kv_indices_ref[f["page_base"] + lax.div(key, jnp.int32(page_size))]
            keys = pl.ds(lax.rem(key, jnp.int32(page_size)), BLOCK_KV)

            @pl.when(n >= slots)
            def _():
                plgpu.barrier_wait(kv_free.at[slot])

            for h in range(2):
                plgpu.copy_gmem_to_smem(ckv_ref.at[page, keys, h], ckv_smem.at[slot, h], kv_bar.at[slot])
            plgpu.copy_gmem_to_smem(kpe_ref.at[page, keys], kpe_smem.at[slot], kv_bar.at[slot])

        lax.fori_loop(0, f["steps"], fill, None)
        return g + f["steps"]

    def clean_ckv(f, j, slot):
        """Zeroes this warpgroup's half of block j's ckv rows outside [kv_start, kv_end)."""
        start = f["kv_begin"] + j * BLOCK_KV
        lo = jnp.clip(f["kv_start"] - start, 0, BLOCK_KV)
        hi = jnp.clip(f["kv_end"] - start, 0, BLOCK_KV)

        @pl.when((lo > 0) | (hi < BLOCK_KV))
        def _():
            rows = ckv_smem.at[slot, wg]  # [32, Dc/2]: fewer rows than the WGMMA layout's 64
            if interpret:
                x = rows[...]
                r = lax.broadcasted_iota(jnp.int32, x.shape, 0)
            else:
                layout = plgpu.Layout.SMEM_GMEM_COPY(rows.shape, rows.dtype, SWIZZLE)
                x = plgpu.load(rows, *_LOAD_IDX, layout=layout, optimized=False)
                r = plgpu.broadcasted_iota(jnp.int32, x.shape, 0, layout=layout)
            rows[...] = jnp.where((r >= lo) & (r < hi), x, jnp.zeros((), x.dtype))
            plgpu.commit_smem()

    def mask(f, j, s):
        """s [64, 32] with -inf outside [kv_start, kv_end) (and, several tokens a tile, past each row's diagonal)."""
        key = iota(s.shape, 1) + (f["kv_begin"] + j * BLOCK_KV)
        visible = (key >= f["kv_start"]) & (key < f["kv_end"])
        if per_row_limits:  # key <= limit + r // H  <=>  (key - limit) H <= r
            visible = visible & ((key - f["limit"]) * num_heads <= iota(s.shape, 0))
        return jnp.where(visible, s, -jnp.inf)

    def scores(f, j, slot, masked, q_pe):
        """Block j's scores s [64, 32] f32 = q_nope ckv^T + q_pe kpe^T, masked if `masked`."""
        if interpret:  # the interpreter's wgmma takes no transposed operand: plain dots
            nt = (((1,), (1,)), ((), ()))
            s = lax.dot_general(q_pe, kpe_smem[slot], nt, preferred_element_type=jnp.float32)
            for h in range(2):
                s = s + lax.dot_general(qn_smem[h], ckv_smem[slot, h], nt, preferred_element_type=jnp.float32)
        else:
            def qk(s_ref):  # q_nope from shared memory, q_pe from registers
                for h in range(2):
                    plgpu.wgmma(s_ref, qn_smem.at[h], ckv_smem.at[slot, h].transpose((1, 0)))
                plgpu.wgmma(s_ref, q_pe, kpe_smem.at[slot].transpose((1, 0)))
                return s_ref[...]
            s = pl.run_scoped(qk, plgpu.ACC((WG_ROWS, BLOCK_KV), jnp.float32))
        return mask(f, j, s) if masked else s

    def online_softmax(s, m, l):
        """(p [64, 32] f32 relative to m_new, m_new, l_new, alpha [64]): base 2, the scale folded in."""
        m_new = jnp.maximum(m, s.max(axis=1) * c)
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_safe)
        p = jnp.exp2(s * c - lax.broadcast_in_dim(m_safe, s.shape, [0]))
        return p, m_new, l * alpha + p.sum(axis=1), alpha

    def pv(acc, p16, slot):
        """acc [64, Dc/2] += p16 [64, 32] (registers, or a shared-memory ref) x this warpgroup's half of ckv."""
        if interpret:
            return acc + jnp.dot(p16 if isinstance(p16, jax.Array) else p16[...], ckv_smem[slot, wg],
                                 preferred_element_type=jnp.float32)

        def scope(acc_ref):
            plgpu.wgmma(acc_ref, p16, ckv_smem.at[slot, wg])
        return pl.run_state(scope)(plgpu.ACC.init(acc))

    def rescale(acc, alpha):
        return acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

    def finish(f, acc, m, l):
        """Item f's normalized half of o (and, in warpgroup 0, lse) stored, final rows or partial
        ones (q's dtype too), through shared memory: o staged in this warpgroup's half of
        qn_smem, free once the item's score dots are done (TMA stores whole 32-byte sectors,
        which stores from WGMMA-layout registers do not); then q is free for the next item."""
        nonempty = l > 0
        l_safe = jnp.where(nonempty, l, 1.0)
        o_smem = qn_smem.at[wg]  # [64, Dc/2]
        o_smem[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(dtype)
        if m is not None:
            lse_smem[...] = jnp.where(nonempty, (m + jnp.log2(l_safe)) * (1 / LOG2E), -jnp.inf)  # natural log
        plgpu.commit_smem()
        split = f["part_base"] >= 0
        rows, mine = pl.ds(jnp.where(split, f["part_base"], f["q_row"]), tile_rows), pl.ds(0, tile_rows)

        @pl.when(~split)
        def _():
            plgpu.copy_smem_to_gmem(o_smem.at[mine], o_ref.at[rows, wg])
            if m is not None:
                plgpu.copy_smem_to_gmem(lse_smem.at[mine], lse_ref.at[rows])

        @pl.when(split)
        def _():
            plgpu.copy_smem_to_gmem(o_smem.at[mine], o_part_ref.at[rows, wg])
            if m is not None:
                plgpu.copy_smem_to_gmem(lse_smem.at[mine], lse_part_ref.at[rows])

        plgpu.wait_smem_to_gmem(0)
        plgpu.barrier_arrive(q_free.at[0])  # q_nope's and p's buffers are free for the next item

    def segments(f, block, carry):
        """block(j, carry, masked) over item f's blocks: a lead block that starts before kv_start,
        the blocks every row sees whole, then the rest (the partial last one; with several tokens
        per tile, those past the first row's diagonal)."""
        lead = jnp.minimum(jnp.where(f["kv_start"] > f["kv_begin"], 1, 0), f["steps"])
        end = jnp.minimum(f["kv_end"], f["limit"] + 1) if per_row_limits else f["kv_end"]
        n_full = jnp.clip(lax.div(end - f["kv_begin"], jnp.int32(BLOCK_KV)), lead, f["steps"])
        carry = lax.fori_loop(0, lead, functools.partial(block, masked=True), carry)
        carry = lax.fori_loop(lead, n_full, functools.partial(block, masked=False), carry)
        return lax.fori_loop(n_full, f["steps"], functools.partial(block, masked=True), carry)

    def zeros_state():
        m = cast(jnp.full((WG_ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l = cast(jnp.zeros((WG_ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        return cast(jnp.zeros((WG_ROWS, half), jnp.float32), plgpu.Layout.WGMMA), m, l

    def handoff(hs):
        """Warpgroup 0, before writing p_smem / vec_smem: warpgroup 1 is done with the last ones."""
        pl.when(hs > 0)(lambda: plgpu.barrier_wait(p_free.at[0]))

    def load_vec():
        return vec_smem[...] if interpret else plgpu.load(vec_smem, *_LOAD_IDX, layout=plgpu.Layout.WGMMA.reduce(1),
                                                          optimized=False)

    def hand_over(vec, hs, p16=None):
        """Warpgroup 0 to 1 through shared memory: p16 [64, 32] and alpha, or (p16 None) l."""
        handoff(hs)
        if p16 is not None:
            p_smem[...] = p16
        vec_smem[...] = vec
        plgpu.commit_smem()
        plgpu.barrier_arrive(p_ready.at[0])

    def scorer_item(w, carry):
        """Warpgroup 0: scores, softmax, p and alpha handed to warpgroup 1, then its own half of
        P V; at the item's end, l handed over. (FA3's intra-warpgroup overlap here, block j's
        score dots issued with block j - 1's P V, measured slower on an H100: 277.2 against
        about 207 µs with 64-key blocks, 128 heads B64 kv4000; it keeps the accumulator, two score tiles and q_pe
        live in 232 registers a thread, likely spilling.)"""
        g, hs = carry
        f = fields(w)
        plgpu.barrier_wait(q_bar.at[0])
        q_pe = load_smem(qpe_smem)  # [64, Dr]

        def block(j, carry, masked):
            acc, m, l, hs = carry
            slot = lax.rem(g + j, jnp.int32(slots))
            plgpu.barrier_wait(kv_bar.at[slot])
            p, m, l, alpha = online_softmax(scores(f, j, slot, masked, q_pe), m, l)
            p16 = p.astype(dtype)
            hand_over(alpha, hs, p16)
            acc = rescale(acc, alpha)
            if masked:
                clean_ckv(f, j, slot)
            acc = pv(acc, p16, slot)
            plgpu.barrier_arrive(kv_free.at[slot])
            return acc, m, l, hs + 1

        acc, m, l, hs = segments(f, block, zeros_state() + (hs,))
        hand_over(l, hs)
        finish(f, acc, m, l)
        return g + f["steps"], hs + 1

    def follower_item(w, g):
        """Warpgroup 1: its half of P V from warpgroup 0's p and alpha."""
        f = fields(w)
        plgpu.barrier_wait(q_bar.at[0])

        def block(j, acc, masked):
            slot = lax.rem(g + j, jnp.int32(slots))
            plgpu.barrier_wait(kv_bar.at[slot])
            plgpu.barrier_wait(p_ready.at[0])
            acc = rescale(acc, load_vec())
            if masked:
                clean_ckv(f, j, slot)
            acc = pv(acc, p_smem, slot)
            plgpu.barrier_arrive(p_free.at[0])
            plgpu.barrier_arrive(kv_free.at[slot])
            return acc

        acc = segments(f, block, zeros_state()[0])
        plgpu.barrier_wait(p_ready.at[0])
        l = load_vec()
        plgpu.barrier_arrive(p_free.at[0])
        finish(f, acc, None, l)
        return g + f["steps"]

    @pl.when(wg < 2)
    def _compute():
        if not interpret:
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
        @pl.when(wg == 0)
        def _():
            _, hs = lax.fori_loop(first_item, end_item, scorer_item, (jnp.int32(0), jnp.int32(0)))
            handoff(hs)  # every phase awaited

        @pl.when(wg == 1)
        def _():
            lax.fori_loop(first_item, end_item, follower_item, jnp.int32(0))

    @pl.when(wg == 2)
    def _memory():
        if not interpret:
            plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")
        g = lax.fori_loop(first_item, end_item, memory_item, jnp.int32(0))
        # Every barrier phase is awaited: the last item's q and the last blocks' releases.
        pl.when(end_item > first_item)(lambda: plgpu.barrier_wait(q_free.at[0]))

        @pl.loop(jnp.maximum(g - slots, 0), g)
        def _(n):
            plgpu.barrier_wait(kv_free.at[lax.rem(n, jnp.int32(slots))])


@_common.compiled_once
def mla_mosaic(q_nope, q_pe, ckv_rows, kpe_rows, kv_indices, items, cell_indptr, *, columns, num_parts,
               num_heads, page_size, sm_scale, causal, block_rows, interpret, config=None, scales=None, slots=SLOTS):
    """Runs the MLA work list (planner/mla.py, tiles of block_rows M rows (TILE_ROWS), tile_merge:
    a split item's partial rows are part_base .. part_base + M - 1).

    q_nope [N, Dc], q_pe [N, Dr]: q as rows token * num_heads + head, every tile M rows of one
    request (num_heads a multiple of 64 and M = 64, or dividing M with each request's qo_len x
    num_heads a multiple of M: dispatch's mla_mosaic cost is infinite otherwise); ckv_rows [num_pages *
    page_size, Dc], kpe_rows [.., Dr] in q's dtype (16-bit); kv_indices int32[I]; items
    int32[W, len(columns)]; cell_indptr int32[num_cells + 1]. causal as the planner's (kv_end is
    each tile's last row's causal limit); config is unused (the MLAConfig of the Triton kernel);
    scales must be None. Returns (o [N, Dc] q's dtype, lse f32[N], o_part
    [max(num_parts, 1), Dc] q's dtype, lse_part f32[max(num_parts, 1)]); rows of o written by no
    writethrough item are the merge's.
    """
    del config
    if scales is not None:
        raise ValueError("mla_mosaic: fp8 latent caches run on the Triton kernel")
    if block_rows not in TILE_ROWS or (num_heads < block_rows and block_rows % num_heads):
        raise ValueError(f"mla_mosaic: plans need tiles of whole tokens of 8, 16, 32 or 64 rows, got {block_rows}")
    n, dc = q_nope.shape
    dr = q_pe.shape[-1]
    why = limits(num_heads=num_heads, head_dim_ckv=dc, head_dim_kpe=dr, page_size=page_size)
    if why is not None:
        raise ValueError(f"mla_mosaic: {why}")
    num_parts = max(int(num_parts), 1)
    half = dc // 2
    q_halves = q_nope.reshape(n, 2, half)
    ckv = ckv_rows.reshape(-1, page_size, 2, half)
    kpe = kpe_rows.reshape(-1, page_size, dr)
    num_cells = cell_indptr.shape[0] - 1
    kw = {}
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        kw = dict(interpret=InterpretGPUParams(uninitialized_memory="nan"))  # outputs poisoned
        if num_cells > 2:  # each interpreted grid point compiles anew: the cells merged into two
            cell_indptr = cell_indptr[jnp.array([0, num_cells // 2, num_cells])]
            num_cells = 2

    def entry(items_ref, cell_indptr_ref, kv_indices_ref, q_nope_ref, q_pe_ref, ckv_ref, kpe_ref,
              o_ref, lse_ref, o_part_ref, lse_part_ref):
        # q_nope, ckv and p (operands of one wgmma each) share SWIZZLE; q_pe and kpe (K = Dr = 64) 128 bytes
        narrow = (plgpu.TilingTransform((8, SWIZZLE // 2)), plgpu.SwizzleTransform(SWIZZLE))  # (16-bit)
        wide = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        smem = (plgpu.SMEM((2, WG_ROWS, half), q_nope.dtype, transforms=narrow),
                plgpu.SMEM((slots, 2, BLOCK_KV, half), q_nope.dtype, transforms=narrow),
                plgpu.SMEM((slots, BLOCK_KV, dr), q_nope.dtype, transforms=wide),
                plgpu.SMEM((WG_ROWS, BLOCK_KV), q_nope.dtype, transforms=narrow),  # p
                plgpu.SMEM((WG_ROWS, dr), q_nope.dtype, transforms=wide),  # q_pe
                plgpu.SMEM((WG_ROWS,), jnp.float32),  # alpha or l
                plgpu.SMEM((WG_ROWS,), jnp.float32))  # lse
        loaded = (plgpu.Barrier(num_arrivals=3, num_barriers=1),      # q: two halves of q_nope, q_pe
                  plgpu.Barrier(num_arrivals=3, num_barriers=slots),  # a block: two halves of ckv, kpe
                  plgpu.Barrier(num_arrivals=1, num_barriers=1))      # p and alpha (or l) handed over
        freed = (plgpu.Barrier(num_arrivals=2, num_barriers=1),       # q, by both compute warpgroups
                 plgpu.Barrier(num_arrivals=2, num_barriers=slots),
                 plgpu.Barrier(num_arrivals=1, num_barriers=1))       # p_smem / vec_smem read
        pl.run_scoped(
            lambda *scoped: _kernel(items_ref, cell_indptr_ref, kv_indices_ref, q_nope_ref, q_pe_ref, ckv_ref,
                                    kpe_ref, o_ref, lse_ref, o_part_ref, lse_part_ref, scoped, columns=tuple(columns),
                                    num_heads=num_heads, page_size=page_size, sm_scale=float(sm_scale),
                                    causal=causal, tile_rows=block_rows, slots=slots, interpret=interpret),
            smem, loaded, freed, collective_axes="wg")

    out_type = (jax.ShapeDtypeStruct((n, 2, half), q_nope.dtype),
                jax.ShapeDtypeStruct((n,), jnp.float32),
                jax.ShapeDtypeStruct((num_parts, 2, half), q_nope.dtype),
                jax.ShapeDtypeStruct((num_parts,), jnp.float32))
    o, lse, o_part, lse_part = plgpu.kernel(
        entry, out_type=out_type, grid=(num_cells,), grid_names=("cells",), num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        **kw)(items.reshape(-1), cell_indptr, kv_indices, q_halves, q_pe, ckv, kpe)
    return o.reshape(n, dc), lse, o_part.reshape(num_parts, dc), lse_part
