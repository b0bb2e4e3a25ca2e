"""KV-cache and sparse formats, all registered pytrees usable as jit arguments."""
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from planner import prefix as prefix_planner
from planner import validate

FUSED = "NHD_FUSED"  # K and V in one array (RPA v3's fused cache, reshaped): PagedKVCache.fused
LAYOUTS = ("NHD", "HND", FUSED)


class AttentionState(NamedTuple):
    """Attention over a subset of keys: o [..., H, D] and lse [..., H] float32.

    lse is the NATURAL-log log-sum-exp of the scaled logits (as
    jax.nn.logsumexp). FlashInfer returns log2; convert with lse / ln(2).
    A row that sees no key has o = 0 and lse = -inf.
    """
    o: jax.Array
    lse: jax.Array


class CascadeLevel(NamedTuple):
    """One level: query groups (qo_indptr int32[G+1]) and each group's CSR page list."""
    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    kv_last_page_len: np.ndarray



def two_level_cascade(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size, *,
                      causal=True, min_shared_pages=1):
    """Shared prefixes detected from a plain page table (no index surgery by the user): two
    CascadeLevels (each group's shared pages, then each request's own) and the pages no longer
    read per step (planner.prefix.two_level_cascade)."""
    levels, saved = prefix_planner.two_level_cascade(qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                                                     page_size, causal=causal, min_shared_pages=min_shared_pages)
    return tuple(CascadeLevel(*level) for level in levels), saved


def check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


@jax.tree_util.register_pytree_node_class
class PagedKVCache:
    """Paged K and V caches.

    NHD: k_pages, v_pages [num_pages, page_size, num_kv_heads, head_dim]
    HND: k_pages, v_pages [num_pages, num_kv_heads, page_size, head_dim]
    NHD_FUSED: one array kv_pages [num_pages, page_size, num_kv_heads, 2, head_dim], K of a
    (page, slot, head) at [..., 0, :] and V at [..., 1, :] (PagedKVCache.fused): tpu-inference's
    RPA v3 cache reshaped (compat.tpu_inference), read and written in place. As rows, K of NHD row
    r is row 2r and V row 2r + 1 (pallas_kernels._common.kv_rows).
    v_pages' last axis (head_dim_vo) may differ from k_pages' (head_dim): prefill wrappers made
    with head_dim_vo read such caches (q, k of 192, v, o of 128: DeepSeek's prefill).
    """

    def __init__(self, k_pages, v_pages, layout="NHD"):
        check_layout(layout)
        if layout == FUSED:
            raise ValueError(f"a {FUSED} cache holds one array: PagedKVCache.fused(kv_pages)")
        if k_pages.shape[:-1] != v_pages.shape[:-1]:
            raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} must have one shape "
                             "(but for head_dim, the last axis)")
        if k_pages.ndim != 4:
            raise ValueError(f"k_pages must be 4-D, got shape {k_pages.shape}")
        if k_pages.dtype != v_pages.dtype:
            raise ValueError(f"k_pages {k_pages.dtype} and v_pages {v_pages.dtype} must have one dtype")
        self.arrays, self.layout = (k_pages, v_pages), layout

    @classmethod
    def fused(cls, kv_pages):
        """The NHD_FUSED cache of kv_pages [num_pages, page_size, num_kv_heads, 2, head_dim]."""
        if kv_pages.ndim != 5 or kv_pages.shape[3] != 2:
            raise ValueError(f"kv_pages must be [num_pages, page_size, num_kv_heads, 2, head_dim], got shape "
                             f"{kv_pages.shape}")
        return cls.tree_unflatten(FUSED, (kv_pages,))

    @property
    def kv_pages(self):
        """An NHD_FUSED cache's one array [num_pages, page_size, num_kv_heads, 2, head_dim]."""
        if self.layout != FUSED:
            raise ValueError(f"kv_pages: a {self.layout} cache holds k_pages and v_pages")
        return self.arrays[0]

    @property
    def k_pages(self):
        """K pages (NHD_FUSED: a strided slice of kv_pages, which XLA copies unless fused into its reader)."""
        return self.arrays[0][..., 0, :] if self.layout == FUSED else self.arrays[0]

    @property
    def v_pages(self):
        return self.arrays[0][..., 1, :] if self.layout == FUSED else self.arrays[1]

    @property
    def num_pages(self):
        return self.arrays[0].shape[0]

    @property
    def page_size(self):
        return self.arrays[0].shape[2 if self.layout == "HND" else 1]

    @property
    def num_kv_heads(self):
        return self.arrays[0].shape[1 if self.layout == "HND" else 2]

    @property
    def head_dim(self):
        return self.arrays[0].shape[-1]

    @property
    def head_dim_vo(self):
        return self.arrays[-1].shape[-1]

    @property
    def dtype(self):
        return self.arrays[0].dtype

    def rows(self):
        """K and V viewed as [num_pages * page_size * num_kv_heads, head_dim (V: head_dim_vo)] (a
        free reshape) for the kernels' reads. NHD_FUSED: the one array as rows [num_pages *
        page_size * num_kv_heads * 2, head_dim], twice (K at even rows, V at odd ones)."""
        if self.layout == FUSED:
            return self.stored_rows() * 2
        return self.stored_rows()

    def stored_rows(self):
        """The stored arrays as rows (a free reshape), each once: (K rows, V rows), or NHD_FUSED's
        (KV rows,). Writers update these (an array aliased twice would be copied)."""
        return tuple(x.reshape(-1, x.shape[-1]) for x in self.arrays)

    def with_rows(self, rows):
        """This cache with its stored arrays replaced by rows (stored_rows' shapes): a free reshape."""
        return self.tree_unflatten(self.layout, tuple(r.reshape(x.shape) for r, x in zip(rows, self.arrays)))

    def tree_flatten(self):
        return self.arrays, self.layout

    @classmethod
    def tree_unflatten(cls, layout, children):
        obj = object.__new__(cls)
        obj.arrays, obj.layout = tuple(children), layout
        return obj

    def __repr__(self):
        return (f"PagedKVCache(num_pages={self.num_pages}, page_size={self.page_size}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                + (f"head_dim_vo={self.head_dim_vo}, " if self.head_dim_vo != self.head_dim else "")
                + f"dtype={self.dtype}, layout={self.layout!r})")


@jax.tree_util.register_pytree_node_class
class BlockSparseMatrix:
    """Block-sparse row (BSR) matrix of shape (M, N) with blocks (R, C).

    Row block i holds the column blocks indices[indptr[i]:indptr[i+1]]; block
    (i, j) covers rows [i*R, (i+1)*R) and columns [j*C, (j+1)*C). An optional
    block_mask [nnz, R, C] (bool) marks the visible entries inside each block.
    This is the paper's unified format: a page table is a BSR with C = page_size.
    """

    def __init__(self, indptr, indices, block_shape, shape, block_mask=None):
        R, C = (int(b) for b in block_shape)
        M, N = (int(s) for s in shape)
        if R < 1 or C < 1:
            raise ValueError(f"block_shape must be positive, got {block_shape}")
        if M % R or N % C:
            raise ValueError(f"shape {shape} must be a multiple of block_shape {block_shape}")
        if not isinstance(indptr, jax.core.Tracer):
            indptr_np = validate.check_indptr("indptr", indptr)
            if indptr_np.shape[0] != M // R + 1:
                raise ValueError(f"indptr must have shape [{M // R + 1}], got {indptr_np.shape}")
            indices_np = validate.as_int32("indices", indices)
            used = indices_np[: indptr_np[-1]]
            if used.size and (used.min() < 0 or used.max() >= N // C):
                raise ValueError(f"indices holds column blocks outside [0, {N // C})")
            if block_mask is not None and tuple(np.shape(block_mask)) != (indices_np.shape[0], R, C):
                raise ValueError(f"block_mask must have shape [{indices_np.shape[0]}, {R}, {C}], "
                                 f"got {np.shape(block_mask)}")
        self.indptr, self.indices, self.block_mask = indptr, indices, block_mask
        self.block_shape, self.shape = (R, C), (M, N)

    @classmethod
    def from_page_table(cls, kv_indptr, kv_indices, kv_last_page_len, page_size, num_pages):
        """Decode view of a page table: row i is request i (R = 1), C = page_size.

        Slots past kv_last_page_len in a request's last page are masked out.
        """
        kv_indptr, kv_indices, kv_last_page_len, _, _ = validate.check_page_table(
            kv_indptr, kv_indices, kv_last_page_len, page_size, num_pages)
        nnz = int(kv_indptr[-1])
        mask = np.ones((nnz, 1, page_size), bool)
        for b in range(kv_indptr.shape[0] - 1):
            if kv_indptr[b + 1] > kv_indptr[b]:
                mask[kv_indptr[b + 1] - 1, 0, kv_last_page_len[b]:] = False
        batch = kv_indptr.shape[0] - 1
        return cls(kv_indptr, kv_indices[:nnz], (1, page_size), (batch, num_pages * page_size), mask)

    def to_dense_mask(self):
        """Dense boolean [M, N] visibility (host NumPy; for tests and the reference)."""
        R, C = self.block_shape
        M, N = self.shape
        indptr, indices = np.asarray(self.indptr), np.asarray(self.indices)
        dense = np.zeros((M, N), bool)
        for i in range(M // R):
            for e in range(indptr[i], indptr[i + 1]):
                j = indices[e]
                blk = True if self.block_mask is None else np.asarray(self.block_mask[e])
                dense[i * R:(i + 1) * R, j * C:(j + 1) * C] |= blk
        return dense

    def tree_flatten(self):
        return (self.indptr, self.indices, self.block_mask), (self.block_shape, self.shape)

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)
        obj.indptr, obj.indices, obj.block_mask = children
        obj.block_shape, obj.shape = aux
        return obj

    def __repr__(self):
        return f"BlockSparseMatrix(shape={self.shape}, block_shape={self.block_shape}, nnz_blocks={np.shape(self.indices)[0]})"


def check_paged_cache(kv_cache, q, page_size, num_kv_heads, head_dim, layout, head_dim_vo=None):
    """run() argument checks shared by the paged wrappers (head_dim_vo: V's width, default head_dim)."""
    if not isinstance(kv_cache, PagedKVCache):
        raise ValueError("kv_cache must be a PagedKVCache")
    got = (kv_cache.page_size, kv_cache.num_kv_heads, kv_cache.head_dim, kv_cache.layout)
    want = (page_size, num_kv_heads, head_dim, layout)
    if got != want:
        raise ValueError(f"kv_cache (page_size, num_kv_heads, head_dim, layout) = {got}, expected {want}")
    want_vo = head_dim if head_dim_vo is None else head_dim_vo
    if kv_cache.head_dim_vo != want_vo:
        raise ValueError(f"kv_cache's v_pages have head_dim {kv_cache.head_dim_vo}, expected head_dim_vo {want_vo}")
    check_kv_dtype(q.dtype, kv_cache.dtype, "kv_cache")


FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


Q_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)


def check_sinks(sinks, num_qo_heads):
    """Attention sinks: None or a float array [Hq], one logit per query head (ValueError otherwise)."""
    if sinks is not None and (jnp.shape(sinks) != (num_qo_heads,)
                              or not jnp.issubdtype(jnp.result_type(sinks), jnp.floating)):
        raise ValueError(f"sinks must be a float array of shape [{num_qo_heads}] (one logit per query head), got "
                         f"{jnp.result_type(sinks)}{list(jnp.shape(sinks))}")


def check_q(q, name="q"):
    """q (or another query-side array) is an array of a dtype the kernels compute in."""
    if not hasattr(q, "dtype") or jnp.dtype(q.dtype) not in Q_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {getattr(q, 'dtype', type(q))}")


def check_kv_dtype(q_dtype, kv_dtype, name):
    """K/V in q's dtype, or fp8 (e4m3fn / e5m2) under a float16 or bfloat16 q."""
    if kv_dtype == q_dtype:
        return
    if jnp.dtype(kv_dtype) in FP8_DTYPES and jnp.dtype(q_dtype) in (jnp.float16, jnp.bfloat16):
        return
    raise ValueError(f"{name} dtype {kv_dtype} must match q's dtype {q_dtype} (or be float8_e4m3fn / "
                     "float8_e5m2 with a float16 or bfloat16 q)")


def kv_scales(k_scale, v_scale, kv_dtype, num_kv_heads):
    """(k_scale, v_scale) as float32[Hkv] (a scalar is per tensor, an array per head), or None
    when neither is given and K/V are not fp8 (no scaling in the kernel)."""
    if k_scale is None and v_scale is None and jnp.dtype(kv_dtype) not in FP8_DTYPES:
        return None
    out = []
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        s = jnp.asarray(1.0 if s is None else s, jnp.float32)
        if s.ndim == 0:
            s = jnp.broadcast_to(s, (num_kv_heads,))
        if s.shape != (num_kv_heads,):
            raise ValueError(f"{name} must be a scalar or have shape [{num_kv_heads}], got {s.shape}")
        out.append(s)
    return tuple(out)


def check_qkv(q, k, name_q="q", name_k="k"):
    """Common shape checks: last dims match and Hq is a multiple of Hkv."""
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"head_dim mismatch: {name_q} has {q.shape[-1]}, {name_k} has {k.shape[-1]}")
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv < 1 or hq % hkv:
        raise ValueError(f"num_qo_heads ({hq}) must be a multiple of num_kv_heads ({hkv})")


def default_sm_scale(head_dim, sm_scale):
    return float(1.0 / np.sqrt(head_dim)) if sm_scale is None else float(sm_scale)


def check_int32(name, x):
    """Index arrays must be int32 (NumPy or jax); raises ValueError naming the argument."""
    if isinstance(x, (list, tuple)):
        raise ValueError(f"{name} must be an int32 array, got a Python {type(x).__name__} "
                         f"(pass np.asarray({name}, np.int32))")
    dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    if dtype != np.int32:
        raise ValueError(f"{name} must be int32, got {dtype}")


def is_concrete(*xs):
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


def check_power_of_two(name, x, least=16):
    """x as an int; ValueError naming `name` unless it is a power of two >= least."""
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < least or x & (x - 1):
        raise ValueError(f"{name} must be a power of two >= {least}, got {x!r}")
    return int(x)


def check_scale(name, x):
    """A dequantization scale (a scalar: Python / NumPy, checked > 0 here, or a 0-d array, as data) as
    float32[], or None."""
    if x is None:
        return None
    if isinstance(x, bool) or not hasattr(x, "dtype") and not isinstance(x, (int, float)):
        raise ValueError(f"{name} must be a positive float or a 0-d array, got {type(x).__name__}")
    if isinstance(x, (int, float, np.number, np.ndarray)):
        v = np.asarray(x, np.float64)
        if v.shape != () or not (np.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be a positive finite scalar, got {x!r}")
    elif jnp.shape(x) != () or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be a float scalar (0-d), got shape {jnp.shape(x)} {x.dtype}")
    return jnp.asarray(x, jnp.float32)
