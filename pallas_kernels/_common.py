"""Helpers shared by the kernel modules."""
import contextlib
import contextvars
import functools
import inspect
import math
import struct
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import triton as plgpu
# Private modules, for one scalar lowering rule (see uniform).
from jax._src import core as jax_core
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas import core as pallas_core
from jax._src.pallas.triton import lowering as triton_lowering

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def compiled_once(entry):
    """A kernel entry point that compiles once per static configuration when called eagerly.

    An eager pallas_call traces its kernel anew on every call, and the new kernel jaxpr misses
    JAX's compile cache: each eager run() would compile its kernels again (seconds each). Called
    on concrete arrays, entry runs under a jax.jit that holds every argument without an array in
    it (configs, sizes, flags, the variant) static, kept per configuration. Under an outer trace
    (the usual jitted step) entry runs as written, so the user's program is unchanged."""
    signature = inspect.signature(entry)

    @functools.wraps(entry)
    def call(*args, **kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        arrays = {k: v for k, v in bound.items() if _holds_arrays(v)}
        if any(isinstance(x, jax_core.Tracer) for x in jax.tree_util.tree_leaves(arrays)):
            return entry(*args, **kwargs)
        statics = tuple((k, v) for k, v in bound.items() if k not in arrays)
        try:
            jitted = _jitted(entry, statics)
        except TypeError:  # an unhashable static argument: run as written
            return entry(*args, **kwargs)
        return jitted(**arrays)

    return call


def _holds_arrays(value):
    return any(isinstance(x, (jax.Array, np.ndarray)) for x in jax.tree_util.tree_leaves(value))


@functools.lru_cache(maxsize=512)
def _jitted(entry, statics):
    return jax.jit(functools.partial(entry, **dict(statics)))


def head_block(num_heads, cap=16):
    """Largest power of two that divides num_heads, at most cap (Triton tiles are powers of two)."""
    hb = 1
    while hb * 2 <= cap and num_heads % (hb * 2) == 0:
        hb *= 2
    return hb


def next_pow2(n):
    return 1 << max(0, (int(n) - 1).bit_length())


def tile_width(d):
    """Columns of an in-kernel tile of rows d wide: d where Triton can tile it (a power of two,
    at least 16), else the next such power. The extra columns read as 0 and are never stored
    (load_rows, whole_rows, store_rows), so head dims like 80 or 96 run exactly."""
    return d if d >= 16 and d & (d - 1) == 0 else max(16, next_pow2(d))


def padded_columns(d, store=False):
    """(column ids, which are real), both [tile_width(d)]. The ids past d are masked off: a load
    repeats d - 1 there, a store points them past the end (interpret mode drops those; repeated
    ids would race the real column's write)."""
    cols = jnp.arange(tile_width(d))
    return (cols if store else jnp.minimum(cols, d - 1)), cols < d


def pow2_columns(d):
    """A width d that is not a power of two as column blocks of powers of two, widest first
    (192: ((0, 128), (128, 64))), for Triton's power-of-two tiles; None when d is one."""
    if d & (d - 1) == 0:
        return None
    blocks, start = [], 0
    for bit in reversed(range(d.bit_length())):
        if d >> bit & 1:
            blocks.append((start, 1 << bit))
            start += 1 << bit
    return tuple(blocks)


def fit_block_kv(block_kv, head_dim, itemsize, num_stages, smem_budget=192 * 1024, head_dim_vo=None):
    """block_kv, halved until the pipelined K and V tiles fit in shared memory
    (num_stages x block_kv x (head_dim + head_dim_vo) x itemsize <= smem_budget; H100 has 227 KB a
    block; head_dim_vo defaults to head_dim). A bound, not the allocation: Triton buffers fewer
    stages than num_stages where a gathered page id takes a stage (the decode loop: one K/V
    buffer at 3 stages)."""
    width = head_dim + (head_dim if head_dim_vo is None else head_dim_vo)
    while block_kv > 16 and num_stages * block_kv * width * itemsize > smem_budget:
        block_kv //= 2
    return block_kv


def _ptx_f32(x):
    """A Python float as a PTX f32 literal (0fXXXXXXXX)."""
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", x))[0]


_FAST_MATH = contextvars.ContextVar("jaxinfer_fast_math", default=False)


@contextlib.contextmanager
def kernel_math(fast):
    """Wraps the tracing of a kernel body: fast (compiled on the GPU) lets exp2 / exp2_scaled /
    tanh use single approximate PTX instructions; otherwise (interpret mode, or outside any
    kernel, as in jaxinfer.reference) they are the jnp functions."""
    token = _FAST_MATH.set(bool(fast))
    try:
        yield
    finally:
        _FAST_MATH.reset(token)


def _asm(asm, *args):
    return plgpu.elementwise_inline_asm(
        asm, args=list(args), constraints=",".join(["=f"] + ["f"] * len(args)), pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, jnp.float32)])[0]


def exp2(x):
    """2 ** x (f32). Fast: one ex2.approx.ftz (MUFU.EX2) per element instead of libdevice's
    exp2f, whose denormal handling costs a compare and two multiplies more; results below
    2^-126 flush to 0 (harmless here: weights next to a maximum weight of 1)."""
    return _asm("ex2.approx.ftz.f32 $0, $1;", x) if _FAST_MATH.get() else jnp.exp2(x)


def exp2_scaled(s, scale, m):
    """2 ** (s * scale - m) for s [M, N], a scale (a static Python float, or a float32 scalar
    traced from the kernel's inputs) and m [M]. Fast: one fused multiply-add and one MUFU.EX2
    per element."""
    if not _FAST_MATH.get():
        return jnp.exp2(s * scale - m[:, None])
    neg_m = jnp.broadcast_to(-m[:, None], s.shape)
    if isinstance(scale, (int, float)):
        asm = "{ .reg .f32 t; fma.rn.ftz.f32 t, $1, %s, $2; ex2.approx.ftz.f32 $0, t; }" % _ptx_f32(scale)
        return _asm(asm, s, neg_m)
    asm = "{ .reg .f32 t; fma.rn.ftz.f32 t, $1, $2, $3; ex2.approx.ftz.f32 $0, t; }"
    return _asm(asm, s, jnp.broadcast_to(jnp.asarray(scale, jnp.float32), s.shape), neg_m)


def tanh(x):
    """tanh. Fast: one tanh.approx.f32 (MUFU.TANH, max relative error about 2^-11, as
    FlashInfer's soft-cap uses) instead of libdevice's tanhf."""
    if not _FAST_MATH.get():
        return jnp.tanh(x)
    return _asm("tanh.approx.f32 $0, $1;", x.astype(jnp.float32)).astype(x.dtype)


def fp8_pairs(rows):
    """fp8 K/V rows [R, D] viewed as uint16 [R, D / 2]: each element a pair of adjacent columns
    (the even one in the low byte). Decode reads fp8 K and V this way (see widen_fp8_pairs)."""
    return lax.bitcast_convert_type(rows.reshape(rows.shape[0], rows.shape[1] // 2, 2), jnp.uint16)


def maybe_fp8_pairs(k_rows, v_rows, variant, enabled):
    """(kv_pairs, k_rows, v_rows): fp8 K/V as column pairs when enabled, no key transform
    needs whole rows and Triton can tile the pairs (kv_pairs is then their fp8 dtype, else None
    and the rows unchanged)."""
    key_transform = variant is not None and variant.has_key_transform
    half = k_rows.shape[1] // 2
    if not enabled or v_rows.dtype.itemsize != 1 or key_transform or tile_width(half) != half:
        return None, k_rows, v_rows
    return v_rows.dtype, fp8_pairs(k_rows), fp8_pairs(v_rows)


_CVT_F16X2 = {jnp.dtype(jnp.float8_e4m3fn): "e4m3x2", jnp.dtype(jnp.float8_e5m2): "e5m2x2"}


def widen_fp8_pairs(pairs, fp8_dtype):
    """uint16 pairs [N, C] of fp8 values (see fp8_pairs) -> float16 (even, odd) [N, C] each:
    the even and odd columns of the fp8 tile, exactly.

    Why pairs: the P.V product reduces over tokens, V's strided axis. An 8-bit V tile must then
    be read from shared memory a byte at a time (no 8-bit transposing ldmatrix before sm_100);
    16-bit pairs transpose like bf16 does. For K, 16-bit tiles keep the q.K dot from taking
    8-bit operand layouts (which cost q register moves). Fast: per two pairs and per half one
    byte permute and one cvt.rn.f16x2 (sm_89+); otherwise the bytes are split with jnp."""
    if not _FAST_MATH.get():
        lo = lax.bitcast_convert_type((pairs & 0xFF).astype(jnp.uint8), fp8_dtype)
        hi = lax.bitcast_convert_type((pairs >> 8).astype(jnp.uint8), fp8_dtype)
        return lo.astype(jnp.float16), hi.astype(jnp.float16)
    cvt = _CVT_F16X2[jnp.dtype(fp8_dtype)]
    # One asm per half (Triton would clone a two-result asm into two layouts): each takes bytes
    # 0 and 2 (even) or 1 and 3 (odd) of two pairs and widens them to one f16x2.
    return tuple(plgpu.elementwise_inline_asm(
        "{ .reg .b32 t; .reg .b16 lo, hi; "
        f"prmt.b32 t, $1, 0, {sel}; mov.b32 {{lo, hi}}, t; cvt.rn.f16x2.{cvt} $0, lo; }}",
        args=[pairs], constraints="=r,r", pack=2,
        result_shape_dtypes=[jax.ShapeDtypeStruct(pairs.shape, jnp.float16)])[0]
        for sel in ("0x0020", "0x0031"))


def uniform(x):
    """An int32 scalar, marked warp-uniform. Fast: redux.sync.min over the warp (the value is
    the same in every lane already), whose result ptxas knows to be uniform. Loop bounds loaded
    from a work list are otherwise per-lane values to ptxas: it then keeps loop counters and
    the wgmma descriptors derived from them in ordinary registers (spills, R2UR per block)."""
    return _uniform_p.bind(x) if _FAST_MATH.get() else x


# A scalar primitive: Pallas' elementwise_inline_asm lowers only tensors (a 0-d result would
# come back through a cross-warp reduction, which ptxas cannot see through).
_uniform_p = jax_core.Primitive("jaxinfer_uniform")
_uniform_p.def_abstract_eval(lambda x: jax_core.ShapedArray((), jnp.int32))


@triton_lowering.register_lowering(_uniform_p)
def _uniform_lowering(ctx, x):
    return tt_dialect.elementwise_inline_asm(
        [ir.IntegerType.get_signless(32)], "redux.sync.min.s32 $0, $1, -1;", constraints="=r,r",
        pure=True, packed_element=1, args=[x])


def dot_precision(dtype):
    """Full float32 products for float32 inputs (Triton would use tf32 otherwise)."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


class _TritonParams(plgpu.CompilerParams):
    """Pallas-Triton compiler params of jaxinfer's own kernels: Pallas picks a kernel's GPU
    lowering rule by the type of its compiler params, so this type marks jaxinfer's kernels."""


def _lower_triton_quietly(ctx, *args, **params):
    """Pallas' Triton lowering, without jax's deprecation warning for it.

    jax >= 0.11 emits a DeprecationWarning ("The Pallas Triton backend is deprecated") each time
    a Pallas kernel lowers to Triton, i.e. when the user's jit compiles a jaxinfer call on a GPU.
    The warning is addressed to jaxinfer, not to its users, so it is filtered here, only while
    jaxinfer's own kernels lower: other Triton kernels still warn and other warnings are
    untouched. It goes away once decode and prefill (and merge) have Mosaic GPU implementations
    everywhere they run (today prefill's impl="mosaic" covers Hopper only)."""
    from jax._src.pallas.triton import pallas_call_registration  # noqa: F401 (registers the rule)
    rule = pallas_core.get_lowering_rule(plgpu.CompilerParams, "gpu")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated",
                                category=DeprecationWarning)
        return rule(ctx, *args, **params)


pallas_core.register_lowering_rule(_TritonParams, _lower_triton_quietly, "gpu")


def compiler_params(num_warps, num_stages):
    return _TritonParams(num_warps=num_warps, num_stages=num_stages)


def dispatch(implementations, impl, name):
    if impl not in implementations:
        raise ValueError(f"{name}: unknown impl {impl!r}; available: {sorted(implementations)}")
    return implementations[impl]


def page_row(tok, page_ids, page_size, num_kv_heads, head, layout):
    """The row of tokens at slot tok % page_size of pages page_ids, kv head `head`, in the cache
    viewed as [num_pages * page_size * Hkv, D] (NHD_FUSED numbers its rows as NHD: see kv_row_pair)."""
    slot = tok % page_size
    if layout == "HND":  # [pages, Hkv, P, D]
        return (page_ids * num_kv_heads + head) * page_size + slot
    return (page_ids * page_size + slot) * num_kv_heads + head  # NHD [pages, P, Hkv, D]


def kv_row_pair(row, layout):
    """A page_row -> (K row, V row) into the cache's K and V rows (PagedKVCache.rows): the row
    itself in both for NHD and HND; NHD_FUSED ([pages, P, Hkv, 2, D]: one array of K and V
    interleaved, as rows [num_pages * page_size * Hkv * 2, D]) has K at 2 row and V at 2 row + 1."""
    if layout == "NHD_FUSED":
        return 2 * row, 2 * row + 1
    return row, row


def kv_rows(tok, page_ids, page_size, num_kv_heads, head, layout):
    """(K row, V row) of tokens at slot tok % page_size of pages page_ids, kv head `head`."""
    return kv_row_pair(page_row(tok, page_ids, page_size, num_kv_heads, head, layout), layout)


def store_rows(ref, rows, val, row_mask):
    """Scatters val [M, D] (or [M]) to rows `rows` [M] of ref [R, D] (or [R]) where row_mask [M].

    Masked-off rows are pointed past the end: the GPU store skips them and
    interpret mode drops them, so duplicate (clamped) row ids never overwrite.
    """
    rows = jnp.where(row_mask, rows, ref.shape[0])
    if val.ndim == 1:
        plgpu.store(ref.at[rows], val, mask=row_mask)
    elif val.shape[1] != ref.shape[1]:  # a padded tile [M, tile_width(D)]: its first D columns
        cols, real = padded_columns(ref.shape[1], store=True)
        plgpu.store(ref.at[rows[:, None], cols[None, :]], val, mask=row_mask[:, None] & real[None, :])
    else:
        cols = jnp.arange(val.shape[1])
        plgpu.store(ref.at[rows[:, None], cols[None, :]], val, mask=row_mask[:, None])


def load_rows(ref, rows, row_mask, fill=True, columns=None):
    """Gathers rows `rows` [M] of ref [R, D] where row_mask [M]; other rows read as 0 (with
    fill=False they are undefined: Triton cannot fill fp8 loads). For a 1-D ref, rows and
    row_mask may have any (matching) shape. columns (start, width), static: only those columns
    ([M, width]); row_mask None: every row (an unmasked load). Without columns, a D that Triton
    cannot tile comes as [M, tile_width(D)], the extra columns 0 (undefined with fill=False).

    Masked-off rows access no memory on the GPU."""
    other = 0 if fill else None
    if len(ref.shape) == 1:
        return plgpu.load(ref.at[rows], mask=row_mask, other=other)
    if columns is None and tile_width(ref.shape[1]) != ref.shape[1]:
        cols, real = padded_columns(ref.shape[1])
        mask = real[None, :] if row_mask is None else row_mask[:, None] & real[None, :]
        return plgpu.load(ref.at[rows[:, None], cols[None, :]], mask=mask, other=other)
    start, width = (0, ref.shape[1]) if columns is None else columns
    cols = start + jnp.arange(width)
    if row_mask is None:
        return plgpu.load(ref.at[rows[:, None], cols[None, :]])
    return plgpu.load(ref.at[rows[:, None], cols[None, :]], mask=row_mask[:, None], other=other)


def zero_padding(x, d):
    """x [M, tile_width(d)] with the columns past d set to 0 (fp8 tiles, loaded unfilled)."""
    if x.shape[1] == d:
        return x
    return jnp.where(padded_columns(d)[1][None, :], x, jnp.zeros_like(x))


def whole_rows(ref, rows, fill=True):
    """Rows `rows` [M] of ref [R, D], every column: ref[rows], or where Triton cannot tile D a
    [M, tile_width(D)] tile (load_rows)."""
    if tile_width(ref.shape[1]) == ref.shape[1]:
        return ref[rows]
    return load_rows(ref, rows, None, fill=fill)


def flatten_params(params):
    """A variant's parameter pytree -> (leaves as kernel inputs, treedef, which leaves are scalars).
    0-d leaves travel as [1] arrays and reach the kernel body as scalars; others as refs."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    # of their own dtype: a Python number's weak type fails Triton's lowering of jnp.where (soft cap)
    leaves = [jnp.asarray(x, jnp.asarray(x).dtype) for x in leaves]
    scalar = tuple(x.ndim == 0 for x in leaves)
    return [x.reshape(1) if s else x for x, s in zip(leaves, scalar)], treedef, scalar


def unflatten_params(refs, treedef, scalar):
    """Inside a kernel: the parameter pytree (scalars loaded, arrays as refs)."""
    return jax.tree_util.tree_unflatten(treedef, [r[0] if s else r for r, s in zip(refs, scalar)])
