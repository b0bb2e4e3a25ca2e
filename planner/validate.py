"""Host-side checks of page tables and ragged index arrays (NumPy only).

Every check raises ValueError naming the offending argument, so that a bad
page table never reaches a kernel (a kernel must never read a page that is
not in the request's own page list).
"""
import numpy as np


def as_int32(name, x, ndim=1):
    """Returns x as a host int32 array; rejects other integer widths and floats."""
    arr = np.asarray(x)
    if arr.dtype != np.int32:
        raise ValueError(f"{name} must be int32, got {arr.dtype}")
    if arr.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {arr.shape}")
    return arr


def check_indptr(name, indptr, total=None):
    """indptr: int32[B+1], starts at 0, non-decreasing, ends at `total` if given."""
    indptr = as_int32(name, indptr)
    if indptr.shape[0] < 1:
        raise ValueError(f"{name} must have at least one entry (B+1), got shape {indptr.shape}")
    if indptr[0] != 0:
        raise ValueError(f"{name} must start at 0, got {int(indptr[0])}")
    if (indptr[1:] < indptr[:-1]).any():
        raise ValueError(f"{name} must be non-decreasing")
    if total is not None and int(indptr[-1]) != total:
        raise ValueError(f"{name}[-1] = {int(indptr[-1])} must equal {total}")
    return indptr


def check_page_table(kv_indptr, kv_indices, kv_last_page_len, page_size, num_pages=None):
    """Validates a CSR page table; returns (kv_indptr, kv_indices, kv_last_page_len, kv_lens, pages),
    pages being each request's page count."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    kv_indptr = check_indptr("kv_indptr", kv_indptr)
    kv_indices = as_int32("kv_indices", kv_indices)
    kv_last_page_len = as_int32("kv_last_page_len", kv_last_page_len)
    batch = kv_indptr.shape[0] - 1
    if kv_indices.shape[0] < kv_indptr[-1]:
        raise ValueError(
            f"kv_indices has {kv_indices.shape[0]} entries but kv_indptr[-1] = {int(kv_indptr[-1])}")
    if kv_last_page_len.shape[0] != batch:
        raise ValueError(f"kv_last_page_len must have shape [{batch}], got {kv_last_page_len.shape}")
    used = kv_indices[: kv_indptr[-1]]
    # One pass: as uint32, negative ids wrap past any page count.
    if num_pages is not None and used.size and used.view(np.uint32).max() >= num_pages:
        raise ValueError(f"kv_indices holds page ids outside [0, {num_pages})")
    pages = kv_indptr[1:] - kv_indptr[:-1]
    has_pages = pages > 0
    if ((kv_last_page_len < 1) | (kv_last_page_len > page_size))[has_pages].any():
        raise ValueError(f"kv_last_page_len must lie in [1, page_size={page_size}] for requests with pages")
    kv_lens = np.where(has_pages, (pages - 1) * page_size + kv_last_page_len, 0).astype(np.int32)
    return kv_indptr, kv_indices, kv_last_page_len, kv_lens, pages


def check_num_pages(num_pages):
    """num_pages: the cache's page count, required by every paged plan (the plan's page ids must
    lie in [0, num_pages), and run() checks the cache has that many pages)."""
    if num_pages is None:
        raise ValueError("num_pages is required: pass the cache's page count (kv_cache.num_pages)")
    if isinstance(num_pages, bool) or not isinstance(num_pages, (int, np.integer)) or num_pages < 1:
        raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
    return int(num_pages)
