"""Host-side checks of page tables and ragged index arrays (NumPy only).

Every check raises ValueError naming the offending argument, so that a bad
page table never reaches a kernel (a kernel must never read a page that is
not in the request's own page list). Each check is a handful of whole-array
NumPy calls: plan() runs them once per step.
"""
import numpy as np


LARGE = 1 << 16  # entries from which np.maximum.reduce's SIMD loop beats argmax's


def largest(x):
    """The largest entry of a non-empty array. On a small one argmax runs its loop without the
    set-up of np.maximum.reduce (on the 2-core dev CPU 0.3 against 0.7 µs); from LARGE entries
    the reduction's SIMD loop is quicker (a 1 MB page table: 10 against 14 µs)."""
    return x[x.argmax()] if x.shape[0] < LARGE else np.maximum.reduce(x)


def smallest(x):
    """The smallest entry of a non-empty array (as largest)."""
    return x[x.argmin()] if x.shape[0] < LARGE else np.minimum.reduce(x)


_INT32 = np.dtype(np.int32)


def as_int32(name, x, ndim=1):
    """Returns x as a host int32 array; rejects other integer widths, floats and Python lists
    (which NumPy would make int64)."""
    if type(x) is np.ndarray and x.dtype is _INT32 and x.ndim == ndim:  # (the common case, in one test)
        return x
    if isinstance(x, (list, tuple)):
        raise ValueError(f"{name} must be an int32 array, got a Python {type(x).__name__} "
                         f"(pass np.asarray({name}, np.int32))")
    arr = x if type(x) is np.ndarray else np.asarray(x)
    if arr.dtype != np.int32:
        raise ValueError(f"{name} must be int32, got {arr.dtype}")
    if arr.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {arr.shape}")
    return arr


def indptr_lengths(name, indptr):
    """Checks indptr (int32[B+1], starts at 0, non-decreasing); returns (indptr, lengths int32[B],
    the smallest length or None when B = 0)."""
    indptr = as_int32(name, indptr)
    if indptr.shape[0] < 1:
        raise ValueError(f"{name} must have at least one entry (B+1), got shape {indptr.shape}")
    if indptr[0] != 0:
        raise ValueError(f"{name} must start at 0, got {int(indptr[0])}")
    lens = indptr[1:] - indptr[:-1]
    least = smallest(lens) if lens.shape[0] else None
    if least is not None and least < 0:
        raise ValueError(f"{name} must be non-decreasing")
    return indptr, lens, least


def check_indptr(name, indptr, total=None):
    """indptr: int32[B+1], starts at 0, non-decreasing, ends at `total` if given."""
    indptr = indptr_lengths(name, indptr)[0]
    if total is not None and int(indptr[-1]) != total:
        raise ValueError(f"{name}[-1] = {int(indptr[-1])} must equal {total}")
    return indptr


def check_page_table(kv_indptr, kv_indices, kv_last_page_len, page_size, num_pages=None):
    """Validates a CSR page table; returns (kv_indptr, kv_indices, kv_last_page_len, kv_lens, pages),
    pages being each request's page count (kv_lens and pages int32[B]). Page ids are checked
    against num_pages when it is given (else see check_page_ids)."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    page_size = int(page_size)
    kv_indptr, pages, least = indptr_lengths("kv_indptr", kv_indptr)
    kv_indices = as_int32("kv_indices", kv_indices)
    kv_last_page_len = as_int32("kv_last_page_len", kv_last_page_len)
    batch = pages.shape[0]
    num_listed = int(kv_indptr[-1])
    if kv_indices.shape[0] < num_listed:
        raise ValueError(f"kv_indices has {kv_indices.shape[0]} entries but kv_indptr[-1] = {num_listed}")
    if kv_last_page_len.shape[0] != batch:
        raise ValueError(f"kv_last_page_len must have shape [{batch}], got {kv_last_page_len.shape}")
    if num_pages is not None:
        check_page_ids(kv_indices[:num_listed], num_pages)
    if not batch:
        return kv_indptr, kv_indices, kv_last_page_len, np.zeros(0, np.int32), pages
    unused = page_size - kv_last_page_len  # in [0, page_size) as uint32 <=> last in [1, page_size]
    if least > 0:  # every request has pages (the common case)
        bad = largest(unused.view(np.uint32)) >= page_size
        kv_lens = pages * page_size
        kv_lens -= unused  # (pages - 1) * page_size + last
    else:
        has_pages = pages > 0
        bad = largest(np.where(has_pages, unused, 0).view(np.uint32)) >= page_size
        kv_lens = np.where(has_pages, pages * page_size - unused, 0).astype(np.int32)
    if bad:
        raise ValueError(f"kv_last_page_len must lie in [1, page_size={page_size}] for requests with pages")
    return kv_indptr, kv_indices, kv_last_page_len, kv_lens, pages


def check_page_ids(ids, num_pages):
    """ValueError unless every page id in ids (int32[n]) lies in [0, num_pages). One pass: as
    uint32, negative ids wrap past any page count."""
    if ids.shape[0] and largest(ids.view(np.uint32)) >= num_pages:
        raise ValueError(f"kv_indices holds page ids outside [0, {num_pages})")


def check_num_pages(num_pages):
    """num_pages: the cache's page count, required by every paged plan (the plan's page ids must
    lie in [0, num_pages), and run() checks the cache has that many pages)."""
    if num_pages is None:
        raise ValueError("num_pages is required: pass the cache's page count (kv_cache.num_pages)")
    if isinstance(num_pages, bool) or not isinstance(num_pages, (int, np.integer)) or num_pages < 1:
        raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
    return int(num_pages)
