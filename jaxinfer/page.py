"""Writing new K/V rows into a paged cache."""
import jax.numpy as jnp
import numpy as np

from jaxinfer import _backend
from jaxinfer.formats import FUSED, PagedKVCache, check_int32, is_concrete
from pallas_kernels import _common, kv_write
from planner import validate


def get_batch_indices_positions(append_indptr, seq_lens, nnz):
    """For the nnz appended rows, the request of each and its absolute position.

    Request b appends rows append_indptr[b]:append_indptr[b+1] at the end of
    its sequence of (new) length seq_lens[b]: seq_len 5 with 2 appended gives
    positions [3, 4]. Rows past append_indptr[-1] get batch index and position -1.
    Returns (batch_indices int32[nnz], positions int32[nnz]); jit-able.
    """
    check_int32("append_indptr", append_indptr)
    check_int32("seq_lens", seq_lens)
    append_indptr, seq_lens = jnp.asarray(append_indptr), jnp.asarray(seq_lens)
    if append_indptr.ndim != 1 or append_indptr.shape[0] < 1:
        raise ValueError(f"append_indptr must be int32[B + 1], got shape {append_indptr.shape}")
    if seq_lens.shape != (append_indptr.shape[0] - 1,):
        raise ValueError(f"seq_lens must have shape [{append_indptr.shape[0] - 1}], got {seq_lens.shape}")
    if is_concrete(append_indptr, seq_lens):
        ip = validate.check_indptr("append_indptr", np.asarray(append_indptr))
        if np.any(np.asarray(seq_lens) < np.diff(ip)):
            raise ValueError("seq_lens must be >= each request's appended rows (append_indptr)")
        if int(ip[-1]) > nnz:
            raise ValueError(f"nnz = {nnz} must be >= append_indptr[-1] = {int(ip[-1])} (rows appended)")
    if seq_lens.shape[0] == 0:  # no requests: every row is padding
        return jnp.full((nnz,), -1, jnp.int32), jnp.full((nnz,), -1, jnp.int32)
    row = jnp.arange(nnz, dtype=jnp.int32)
    batch = (jnp.searchsorted(append_indptr, row, side="right") - 1).astype(jnp.int32)
    live = row < append_indptr[-1]
    b = jnp.clip(batch, 0, seq_lens.shape[0] - 1)
    pos = seq_lens[b] - (append_indptr[b + 1] - row)
    return jnp.where(live, batch, -1), jnp.where(live, pos, -1).astype(jnp.int32)


def append_paged_kv_cache(kv_cache, append_k, append_v, batch_indices, positions, kv_indices, kv_indptr):
    """Writes append_k/append_v [nnz, Hkv, D] into the cache; returns the new PagedKVCache.

    Position p of request b lands in page kv_indices[kv_indptr[b] + p // page_size]
    at slot p % page_size. Rows with batch index < 0 are skipped. Under jax.jit
    with the cache donated (donate_argnums), XLA updates the pages in place.
    Concrete arguments are validated (ValueError). Under jit, where they cannot be, an invalid
    row (batch index >= B, position < 0 or past the request's pages, page id outside
    [0, num_pages)) is dropped: it writes nothing, never another page (docs/safety.md).
    """
    if not isinstance(kv_cache, PagedKVCache):
        raise ValueError("kv_cache must be a PagedKVCache")
    expect = (kv_cache.num_kv_heads, kv_cache.head_dim)
    for name, x in (("append_k", append_k), ("append_v", append_v)):
        if x.ndim != 3 or tuple(x.shape[1:]) != expect:
            raise ValueError(f"{name} must be [nnz, {expect[0]}, {expect[1]}], got {x.shape}")
    if append_k.shape != append_v.shape:
        raise ValueError(f"append_k {append_k.shape} and append_v {append_v.shape} must have one shape")
    nnz = append_k.shape[0]
    for name, x in (("batch_indices", batch_indices), ("positions", positions)):
        check_int32(name, x)
        if jnp.shape(x) != (nnz,):
            raise ValueError(f"{name} must have shape [{nnz}], got {jnp.shape(x)}")
    check_int32("kv_indices", kv_indices)
    check_int32("kv_indptr", kv_indptr)
    p = kv_cache.page_size
    if is_concrete(batch_indices, positions, kv_indices, kv_indptr):
        bi, pos = np.asarray(batch_indices), np.asarray(positions)
        ip, idx = np.asarray(kv_indptr), np.asarray(kv_indices)
        live = bi >= 0
        if np.any(bi[live] >= ip.shape[0] - 1):
            raise ValueError("batch_indices holds requests outside the page table")
        if np.any(pos[live] < 0):
            raise ValueError("positions must be >= 0")
        if np.any(pos[live] // p >= (ip[1:] - ip[:-1])[bi[live]]):
            raise ValueError("positions lie past the pages listed for their request in kv_indices")
        pages = idx[ip[bi[live]] + pos[live] // p]
        if pages.size and (pages.min() < 0 or pages.max() >= kv_cache.num_pages):
            raise ValueError(f"kv_indices holds page ids outside [0, {kv_cache.num_pages})")
    ip, idx = jnp.asarray(kv_indptr), jnp.asarray(kv_indices)
    num_requests = ip.shape[0] - 1
    if num_requests < 1 or idx.shape[0] == 0:  # nothing to write to (every row is padding)
        return kv_cache
    b = jnp.clip(batch_indices, 0, num_requests - 1)
    entry = ip[b] + positions // p  # the row's entry in kv_indices
    page = idx[jnp.clip(entry, 0, idx.shape[0] - 1)]
    ok = ((batch_indices >= 0) & (batch_indices < num_requests) & (positions >= 0) & (entry < ip[b + 1])
          & (page >= 0) & (page < kv_cache.num_pages))
    page = jnp.where(ok, page, kv_cache.num_pages)  # padding and invalid rows: dropped
    return write_slots(kv_cache, page, positions % p, append_k, append_v)


def write_slots(kv_cache, page, slot, k_new, v_new, *, interpret=None, stale_pages=None, stale_from=None):
    """The cache with rows k_new / v_new [n, Hkv, D] written at (page[i], slot[i]); rows whose page
    is out of range (e.g. num_pages, for padding) are dropped. One kernel writes K and V
    (pallas_kernels/kv_write.py), into either layout's arrays in place (NHD_FUSED: its one array),
    and with stale_pages, stale_from int32[S] zeroes V in page stale_pages[i]'s slots from
    stale_from[i] on (0: none) in the same launch; interpret: its interpreter (default: where no
    GPU runs it)."""
    n, hkv, d = k_new.shape
    heads = jnp.arange(hkv, dtype=jnp.int32)
    dest = _common.page_row(slot[:, None], page[:, None], kv_cache.page_size, hkv, heads[None, :], kv_cache.layout)
    dest = jnp.where((page >= 0)[:, None] & (page < kv_cache.num_pages)[:, None], dest, -1)  # [n, Hkv]
    interpret = _backend.use_interpret(None) if interpret is None else interpret
    dest, k_new, v_new = dest.reshape(n * hkv), k_new.reshape(n * hkv, d), v_new.reshape(n * hkv, d)
    tails = None if stale_pages is None else kv_write.StaleTails(
        page=stale_pages, start=stale_from, page_size=kv_cache.page_size, num_kv_heads=hkv)
    if kv_cache.layout == FUSED:
        (kv_rows,) = kv_cache.stored_rows()
        return kv_cache.with_rows((kv_write.write_fused_rows(kv_rows, dest, k_new, v_new, interpret=interpret,
                                                             tails=tails),))
    return kv_cache.with_rows(kv_write.write_rows(*kv_cache.stored_rows(), dest, k_new, v_new, interpret=interpret,
                                                  tails=tails, layout=kv_cache.layout))
