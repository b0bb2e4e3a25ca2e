"""New K/V rows written into a paged cache in place, K and V in one launch.

An XLA scatter of the same rows (`.at[page, slot].set`) ran at about 110 GB/s on an H100: 36-41 µs
per array for 2108 tokens x 8 heads x 128. Here each program copies
ROWS (token, head) rows of D elements, so the write runs at copy speed. (The interpreter copies
the whole cache in every program: it runs up to INTERPRET_ROWS rows in each.)

    k_rows, v_rows = write_rows(k_rows, v_rows, dest, k_new, v_new, interpret=False)

k_rows, v_rows [R, D]: the cache viewed as rows (any layout; updated in place when donated).
dest int32[N]: the cache row of new row i; rows whose dest lies outside [0, R) are dropped (padding).
k_new, v_new [N, D], in the cache's dtype.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _common

ROWS = 16  # (token, head) rows per program on the GPU
INTERPRET_ROWS = 4096  # in the interpreter, where each program copies the whole cache: few programs


def _write_kernel(dest_ref, k_new_ref, v_new_ref, k_in_ref, v_in_ref, k_out_ref, v_out_ref, *, block):
    del k_in_ref, v_in_ref  # aliased to the outputs
    n = dest_ref.shape[0]
    rows = pl.program_id(0) * block + jnp.arange(block)  # [block]
    inside = rows < n
    dest = _common.load_rows(dest_ref, rows, inside)  # [block] (0 where outside: masked below)
    write = inside & (dest >= 0) & (dest < k_out_ref.shape[0])
    for new_ref, out_ref in ((k_new_ref, k_out_ref), (v_new_ref, v_out_ref)):
        _common.store_rows(out_ref, dest, _common.load_rows(new_ref, rows, write, fill=False), write)


def write_rows(k_rows, v_rows, dest, k_new, v_new, *, interpret, num_warps=4):
    """k_rows, v_rows [R, D] with rows dest[i] set to k_new[i], v_new[i] [N, D] (dest outside [0, R):
    dropped). Returns the new (k_rows, v_rows); in place when the inputs are donated."""
    n, d = k_new.shape
    if n == 0:
        return k_rows, v_rows
    block = min(INTERPRET_ROWS, _common.next_pow2(n)) if interpret else ROWS
    return pl.pallas_call(
        functools.partial(_write_kernel, block=block),
        grid=(pl.cdiv(n, block),),
        out_shape=(jax.ShapeDtypeStruct(k_rows.shape, k_rows.dtype),
                   jax.ShapeDtypeStruct(v_rows.shape, v_rows.dtype)),
        input_output_aliases={3: 0, 4: 1},
        compiler_params=_common.compiler_params(num_warps, 1),
        interpret=interpret,
        name="jaxinfer_kv_write",
    )(dest, k_new.astype(k_rows.dtype), v_new.astype(v_rows.dtype), k_rows, v_rows)
