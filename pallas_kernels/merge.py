"""Attention-state merge kernels: the exact ⊕ operator on (o, lse) pairs.

(o_a, lse_a) ⊕ (o_b, lse_b) = ((e^lse_a o_a + e^lse_b o_b) / (e^lse_a + e^lse_b),
                               log(e^lse_a + e^lse_b)),
computed with a running max so nothing overflows. lse is the natural log.
An empty state (lse = -inf) has weight 0 and its o is never read into the sum,
so two empty states give o = 0, lse = -inf.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _common


def _accumulate(acc, m, s, o_i, lse_i):
    """One online step of ⊕. acc [Hb, D] f32, m/s/lse_i [Hb] f32 (m is the running max)."""
    m_new = jnp.maximum(m, lse_i)
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    scale_old = jnp.exp(m - m_safe)
    w = jnp.exp(lse_i - m_safe)
    contrib = jnp.where(w[:, None] > 0, w[:, None] * o_i.astype(jnp.float32), 0.0)
    return acc * scale_old[:, None] + contrib, m_new, s * scale_old + w


def _finish(acc, m, s):
    o = acc / jnp.where(s > 0, s, 1.0)[:, None]
    lse = jnp.where(s > 0, m + jnp.log(jnp.where(s > 0, s, 1.0)), -jnp.inf)
    return o, lse


def _empty(hb, d):
    return (jnp.zeros((hb, d), jnp.float32), jnp.full((hb,), -jnp.inf, jnp.float32),
            jnp.zeros((hb,), jnp.float32))


def _load_heads(ref, n, j, hb, heads):
    """[hb, W]: row n's heads j hb ... (the slice `heads`) of ref [N, H, D] (W =
    _common.tile_width(D); columns past D 0)."""
    d = ref.shape[-1]
    if _common.tile_width(d) == d:
        return ref[n, heads, :]
    cols, real = _common.padded_columns(d)
    rows = j * hb + jnp.arange(hb)
    return plgpu.load(ref.at[n, rows[:, None], cols[None, :]],
                      mask=jnp.broadcast_to(real[None, :], (hb, cols.shape[0])), other=0)


def _store_heads(ref, n, j, hb, val, heads=None):
    """Stores val [hb, W] (_load_heads' tile) to row n's heads j hb ... (the slice `heads`, or
    made here) of ref [N, H, D]."""
    d = ref.shape[-1]
    if _common.tile_width(d) == d:
        ref[n, pl.ds(j * hb, hb) if heads is None else heads, :] = val
        return
    cols, real = _common.padded_columns(d, store=True)
    rows = j * hb + jnp.arange(hb)
    plgpu.store(ref.at[n, rows[:, None], cols[None, :]], val,
                mask=jnp.broadcast_to(real[None, :], (hb, cols.shape[0])))


def _pair_kernel(oa_ref, la_ref, ob_ref, lb_ref, mask_ref, o_ref, lse_ref, *, hb):
    n, j = pl.program_id(0), pl.program_id(1)
    heads = pl.ds(j * hb, hb)
    oa, la = _load_heads(oa_ref, n, j, hb, heads), la_ref[n, heads]
    acc, m, s = _accumulate(*_empty(hb, oa.shape[-1]), oa, la)
    acc, m, s = _accumulate(acc, m, s, _load_heads(ob_ref, n, j, hb, heads), lb_ref[n, heads])
    o, lse = _finish(acc, m, s)
    keep_a = mask_ref[n] == 0
    _store_heads(o_ref, n, j, hb, jnp.where(keep_a, oa.astype(jnp.float32), o).astype(o_ref.dtype), heads)
    lse_ref[n, heads] = jnp.where(keep_a, la, lse)


def _merge_pair_triton(o_a, lse_a, o_b, lse_b, mask, *, interpret, num_warps=4):
    n, h, d = o_a.shape
    hb = _common.head_block(h)
    return pl.pallas_call(
        functools.partial(_pair_kernel, hb=hb),
        grid=(n, h // hb),
        out_shape=(jax.ShapeDtypeStruct((n, h, d), o_a.dtype), jax.ShapeDtypeStruct((n, h), jnp.float32)),
        compiler_params=_common.compiler_params(num_warps, 1),
        interpret=interpret,
        name="jaxinfer_merge_pair",
    )(o_a, lse_a, o_b, lse_b, mask)


@_common.compiled_once
def merge_pair(o_a, lse_a, o_b, lse_b, mask, *, interpret, impl="triton"):
    """(o_a, lse_a) ⊕ (o_b, lse_b) row-wise. o [N, H, D], lse [N, H] f32, mask int32 [N]:
    rows with mask 0 keep (o_a, lse_a) unchanged."""
    fn = _common.dispatch({"triton": _merge_pair_triton}, impl, "merge_pair")
    return fn(o_a, lse_a, o_b, lse_b, mask, interpret=interpret)


def _varlen_kernel(indptr_ref, dest_ref, live_ref, op_ref, lp_ref, *refs, hb, parts_per_step, num_programs,
                   live_prefix):
    o_ref, lse_ref = refs[-2:]  # refs may start with aliased copies of the outputs
    p, j = pl.program_id(0), pl.program_id(1)
    d = op_ref.shape[-1]
    heads = j * hb + jnp.arange(hb)
    cols, real = (jnp.arange(d), None) if _common.tile_width(d) == d else _common.padded_columns(d)
    width = cols.shape[0]

    def merge_group(n):
        first, last = indptr_ref[n], indptr_ref[n + 1]

        def body(step, carry):
            acc, m, s = carry
            parts = first + step * parts_per_step + jnp.arange(parts_per_step)  # [PB]
            ok = parts < last
            lse_i = plgpu.load(lp_ref.at[parts[:, None], heads[None, :]], mask=ok[:, None],
                               other=-jnp.inf)  # [PB, Hb]
            o_i = plgpu.load(op_ref.at[parts[:, None, None], heads[None, :, None], cols[None, None, :]],
                             mask=ok[:, None, None] if real is None else ok[:, None, None] & real[None, None, :],
                             other=0)  # [PB, Hb, W] (W = D, or D padded)
            m_new = jnp.maximum(m, jnp.max(lse_i, axis=0))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            scale_old = jnp.exp(m - m_safe)
            w = jnp.exp(lse_i - m_safe[None, :])  # [PB, Hb]
            contrib = jnp.where(w[:, :, None] > 0, w[:, :, None] * o_i.astype(jnp.float32), 0.0)
            return (acc * scale_old[:, None] + jnp.sum(contrib, axis=0), m_new,
                    s * scale_old + jnp.sum(w, axis=0))

        acc, m, s = jax.lax.fori_loop(0, pl.cdiv(last - first, parts_per_step), body, _empty(hb, width))
        o, lse = _finish(acc, m, s)
        row = dest_ref[n]

        @pl.when(row >= 0)
        def _():
            _store_heads(o_ref, row, j, hb, o.astype(o_ref.dtype))
            lse_ref[row, pl.ds(j * hb, hb)] = lse

    num_groups = indptr_ref.shape[0] - 1
    if num_programs is None:  # one program per group
        merge_group(p)
    elif live_prefix:  # groups p, p + P, ... up to the first with dest < 0
        def live(g):
            return (g < num_groups) & (dest_ref[jnp.minimum(g, num_groups - 1)] >= 0)

        def step(g):
            merge_group(g)
            return g + num_programs

        jax.lax.while_loop(live, step, p)
    else:  # groups p, p + P, ... below the live count
        count = jnp.minimum(live_ref[0], num_groups)
        jax.lax.fori_loop(0, pl.cdiv(jnp.maximum(count - p, 0), num_programs),
                          lambda i, _: merge_group(p + i * num_programs), None)


def _merge_varlen_triton(o_parts, lse_parts, indptr, dest, out, num_programs, num_live, *, interpret,
                         num_warps=4, parts_per_step=8):
    num_groups = indptr.shape[0] - 1
    _, h, d = o_parts.shape
    hb = _common.head_block(h, cap=4)
    if num_live is not None and num_programs is None:
        raise ValueError("merge_varlen: num_live needs num_programs (one program per group merges them all)")
    if num_programs is not None:
        num_programs = max(1, min(num_programs, num_groups))
    kernel = functools.partial(_varlen_kernel, hb=hb, parts_per_step=parts_per_step, num_programs=num_programs,
                               live_prefix=num_live is None)
    live = jnp.reshape(num_groups if num_live is None else num_live, (1,)).astype(jnp.int32)
    args = (indptr, dest, live, o_parts, lse_parts)
    aliases = {}
    if out is None:
        out_shape = (jax.ShapeDtypeStruct((num_groups, h, d), o_parts.dtype),
                     jax.ShapeDtypeStruct((num_groups, h), jnp.float32))
    else:
        out_shape = (jax.ShapeDtypeStruct(out[0].shape, out[0].dtype),
                     jax.ShapeDtypeStruct(out[1].shape, jnp.float32))
        args += tuple(out)
        aliases = {5: 0, 6: 1}
    return pl.pallas_call(
        kernel,
        grid=(num_groups if num_programs is None else num_programs, h // hb),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=_common.compiler_params(num_warps, 1),
        interpret=interpret,
        name="jaxinfer_merge_varlen",
    )(*args)


LOOP_PROGRAMS = 128  # merge_varlen's num_programs for plans of fixed capacity (mostly empty merges)


@_common.compiled_once
def merge_varlen(o_parts, lse_parts, indptr, dest=None, out=None, *, interpret, impl="triton",
                 num_programs=None, num_live=None):
    """Merges groups of partial states: group n is rows indptr[n]:indptr[n+1] of
    o_parts [P, H, D] / lse_parts [P, H], merged in row order (deterministic).

    Without `out`, returns new (o [G, H, D], lse [G, H]). With out = (o, lse)
    (donated, updated in place), group n is written to row dest[n] of out and
    groups with dest < 0 are skipped; rows no group names keep their values.
    num_programs (static, optional): a grid of that many programs (per head block), each
    looping over its groups, instead of one per group; num_live (int32 scalar, may be traced;
    with num_programs): only groups below it are merged; without it, the groups before the first
    with dest < 0 (plans list their live groups first). A mostly empty merge then costs a few
    hundred programs, not one per group of its capacity (a fixed-capacity prefill plan's: 21.7
    against 2 µs on an H100).
    """
    num_groups = indptr.shape[0] - 1
    if dest is None:
        dest = jnp.arange(num_groups, dtype=jnp.int32)
    fn = _common.dispatch({"triton": _merge_varlen_triton}, impl, "merge_varlen")
    return fn(o_parts, lse_parts, indptr, dest, out, num_programs, num_live, interpret=interpret)
