"""Which kernel runs: a table of what each implementation supports, and a cost model.

Wrappers describe their problem (Problem: static facts) and, at plan time, the step's query and
key lengths; choose() returns the implementation expected fastest among those that support it,
or raises ValueError when none does. Each plan records the choice in plan.impl. A new kernel
family is one Implementation row here, a kernel file in pallas_kernels/ and its tests.

The cost model is a roofline per implementation (the step's K/V bytes, each read once from HBM
with the re-reads of later tiles served by L2, over HBM bandwidth; FLOPs of the tiles actually
computed over each kernel's measured rate), plus, for kernels that never split
KV (Mosaic), the critical path of the longest tile. Its constants are below, each with the
measured row it came from (one H100, jax 0.11.2; benchmarks/regress.py rows).
"""
import dataclasses
import functools
from typing import Callable, Optional

import numpy as np

from jaxinfer import _backend, variants
from jaxinfer.formats import FP8_DTYPES
from pallas_kernels.decode import DecodeConfig
from pallas_kernels import mla as mla_kernels
from pallas_kernels import mla_mosaic as mla_mosaic_kernels
from pallas_kernels import prefill as prefill_kernels
from pallas_kernels import sampling as sampling_kernels
from pallas_kernels.prefill import MosaicPrefillConfig, PrefillConfig
from planner import batch as batch_planner
from planner import mla as mla_planner
from planner import prefill as prefill_planner
from planner import prefix as prefix_planner
from planner import validate

# --- cost-model constants (per µs) -----------------------------------------------------------
HBM_BYTES_PER_US = 2.88e6       # decode (64, 4096) bf16: 1.07 GB of K/V in 372.7 µs (decode kernel)
TRITON_BYTES_PER_US = 2.62e6    # q4 B64 kv4096 through prefill_triton (16-row tiles): 409.5 µs
TRITON_FLOPS_PER_US = 3.8e8     # paged causal prefill B4 S8192 32/8, Triton kernel: ~380 TFLOP/s
MOSAIC_FLOPS_PER_US = 5.3e8     # the same row on the Mosaic GPU kernel: 539-572 TFLOP/s
LAUNCH_US = 8.0                 # one kernel launch plus its merge (decode (16, 1024): 37 µs total)
KV_ITEMSIZE = 2                 # bf16 K/V (plans are made before dtypes are known)

FAMILIES = ("decode", "prefill", "batch", "mla", "sampling")  # batch: BatchAttention's mixed steps
KV_FORMATS = ("paged", "ragged", "bsr")


@dataclasses.dataclass(frozen=True)
class Problem:
    """The static facts of a wrapper's attention calls."""
    family: str                  # "decode": one query token per request; "prefill": any
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    kv_format: str               # "paged", "ragged" (contiguous rows) or "bsr"
    page_size: int = 1
    layout: str = "NHD"
    variant: object = None       # a jaxinfer.AttentionVariant or None
    custom_mask: bool = False
    interpret: bool = True       # Pallas interpret mode (CPU) rather than compiled
    head_dim_vo: Optional[int] = None  # V and o's head_dim where it differs from head_dim (q, K)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        if self.kv_format not in KV_FORMATS:
            raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {self.kv_format!r}")

    @property
    def group(self):
        return self.num_qo_heads // self.num_kv_heads

    @property
    def kv_width(self):
        """Elements of one token's K and V rows of a KV head."""
        return self.head_dim + (self.head_dim if self.head_dim_vo is None else self.head_dim_vo)

    @property
    def hopper(self):
        """Compiled Mosaic GPU kernels can run (a Hopper GPU, not interpret mode)."""
        return _backend.mosaic_available(self.interpret)


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One row of the table. unsupported(problem, explicit) says why the kernel cannot run the
    problem (None when it can; explicit: the user named it, so interpreters count); cost_us
    estimates a step from its query / key lengths."""
    name: str
    family: str
    short_name: str              # the wrapper's impl= value
    config_type: type
    unsupported: Callable[[Problem, bool], Optional[str]]
    cost_us: Callable[[Problem, np.ndarray, np.ndarray, bool], float]
    # Why it cannot take q / K/V of these dtypes (None when it can).
    dtypes_unsupported: Callable[[np.dtype, np.dtype], Optional[str]] = lambda q_dtype, kv_dtype: None
    takes_scales: bool = True    # fp8 K/V with k_scale / v_scale
    whole_tiles: bool = False    # stores whole query tiles: its plans start requests at aligned rows (tails)
    kernel: Optional[Callable] = None  # a prefill row's entry point (pallas_kernels.prefill.run_*)

    def default_config(self, problem):
        if self.config_type is MosaicPrefillConfig:
            return mosaic_default_config(problem)
        return self.config_type()


def mosaic_default_config(problem):
    """The Mosaic prefill kernel's tuning per head_dim (one H100, jax 0.11.2). Variants keep the plain configs: the others were not measured there."""
    if problem.head_dim > 128:  # K/V slots of 128 x 256 overflow shared memory: 64-key blocks
        if problem.head_dim in (192, 256) and problem.variant is None:
            # FA3's intra-warpgroup overlap: ragged d256 B4 S8192 16/8 663.1 TFLOP/s, the
            # ping-pong 601.0 in the same call; DeepSeek's 192/128 ragged causal prefill, 128
            # heads B4 S8192: 565.7 against 533.3 (free-running 519.0).
            return MosaicPrefillConfig(block_kv=64, pipeline="overlap")
        return MosaicPrefillConfig(block_kv=64)
    if problem.head_dim == 64 and problem.variant is None:
        # Three compute warpgroups (192-token tiles), each on its own, row maxima by halving:
        # ragged d64 B4 S8192 32/8 458.4 TFLOP/s, the two-warpgroup ping-pong 413.4 in the
        # same call.
        return MosaicPrefillConfig(compute_wgs=3, pipeline="free", tree_max=True)
    if problem.head_dim == 128 and problem.variant is None and problem.kv_format == "ragged":
        # FA3's overlap on contiguous K/V (regress.py rows in one call, ping-pong before
        # and after): ragged B16 S4096 16/16 528 TFLOP/s against 500 / 497, B4 S8192 32/8 606
        # against 564 / 567, B1 S16384 32/8 609 against 584 / 593. Paged K/V (whole-page TMA
        # copies) gained nothing there (-1.7% to +0.8%), the mixed step lost 1.5-3.7%.
        return MosaicPrefillConfig(pipeline="overlap")
    return MosaicPrefillConfig()


def _visible_keys(qo_lens, kv_lens, tile_tokens, causal):
    """Keys a tile of tile_tokens query tokens computes, summed over each request's tiles."""
    tiles = -(-qo_lens // tile_tokens)
    if not causal:
        return tiles * kv_lens
    # Tile i of a request ends at token min((i + 1) * T, qo) and sees kv - qo + that many keys.
    full = qo_lens // tile_tokens
    ends = tile_tokens * full * (full + 1) / 2.0 + np.where(tiles > full, qo_lens, 0)
    return np.maximum(tiles * (kv_lens - qo_lens) + ends, 0)


def _kv_us(problem, kv_lens, bytes_per_us=HBM_BYTES_PER_US):
    """Reading the step's K/V once (µs)."""
    return KV_ITEMSIZE * problem.num_kv_heads * problem.kv_width * float(kv_lens.sum()) / bytes_per_us


def _decode_cost(problem, qo_lens, kv_lens, causal):
    return LAUNCH_US + _kv_us(problem, kv_lens)


def _triton_prefill_cost(problem, qo_lens, kv_lens, causal):
    rows = prefill_planner.choose_tile_rows(qo_lens, problem.group)
    keys = float(_visible_keys(qo_lens, kv_lens, max(1, rows // problem.group), causal).sum())
    flops = 2.0 * rows * problem.kv_width * keys * problem.num_kv_heads
    return LAUNCH_US + max(flops / TRITON_FLOPS_PER_US, _kv_us(problem, kv_lens, TRITON_BYTES_PER_US))


def _pow2(n):
    return n & (n - 1) == 0


def _triton_unsupported(problem, explicit):
    """The Triton kernels take any head_dim: one that Triton cannot tile (a power of two >= 16)
    runs in column blocks or padded with zero columns (pallas_kernels._common.tile_width), which
    a query / key transform (RoPE) would see: those need a tileable head_dim."""
    v, d = problem.variant, problem.head_dim
    if v is not None and (v.has_query_transform or v.has_key_transform) and not (d >= 16 and _pow2(d)):
        return f"variant {v.name!r} transforms whole q / K rows: head_dim must be a power of two >= 16, got {d}"
    return None


def _mosaic_prefill_cost(problem, qo_lens, kv_lens, causal):
    tile_tokens = mosaic_default_config(problem).tile_tokens
    keys = _visible_keys(qo_lens, kv_lens, tile_tokens, causal)
    tile_flops = 2.0 * tile_tokens * problem.kv_width  # per key, per query head
    total = tile_flops * float(keys.sum()) * problem.num_qo_heads / MOSAIC_FLOPS_PER_US
    # KV is never split: the longest single tile bounds the step (one SM runs it alone).
    longest = tile_flops * float(kv_lens.max(initial=0)) / (MOSAIC_FLOPS_PER_US / _backend.num_sms())
    return LAUNCH_US + max(total, longest, _kv_us(problem, kv_lens))


_INF = float("inf")
SHORT_MAX_ROWS = batch_planner.SHORT_MAX_ROWS
SHORT_FLOPS_PER_US = 1.5e8        # decode-kernel tiles of 16-64 rows (q4 B64 kv4096: 378 µs, K/V-bound)


def _short_cost(problem, qo_lens, kv_lens, causal):
    longest = int(validate.largest(qo_lens)) if qo_lens.shape[0] else 0
    if longest > batch_planner.short_cap(problem.group, SHORT_MAX_ROWS):
        return _INF  # a request the short planner does not take (planner.batch.short_tokens)
    rows = max(16, 1 << max(0, (max(longest, 1) * problem.group - 1).bit_length()))
    flops = 4.0 * rows * problem.head_dim * float(kv_lens.sum()) * problem.num_kv_heads
    return LAUNCH_US + max(flops / SHORT_FLOPS_PER_US, _kv_us(problem, kv_lens))


def _short_unsupported(problem, explicit):
    why = _triton_unsupported(problem, explicit)
    if why is not None:
        return why
    if problem.kv_format != "paged":
        return "short-query tiles read paged caches only"
    if problem.head_dim_vo is not None:
        return "head_dim_qk != head_dim_vo runs on the prefill kernels"
    if problem.custom_mask:
        return "custom masks run on the prefill kernels"
    return None


def _always(problem, explicit):
    return None


def _mosaic_dtypes_unsupported(q_dtype, kv_dtype):
    return prefill_kernels.mosaic_limits(q_dtype=q_dtype, kv_dtype=kv_dtype)


def _mosaic_unsupported(problem, explicit):
    """Why the Mosaic GPU prefill kernel cannot run the problem (its dtypes, 16-bit q/K/V only, are
    _mosaic_dtypes_unsupported: a plan made without dtypes carries a Triton plan for the others)."""
    if not explicit and not problem.hopper:
        return "needs a Hopper GPU (compiled; interpret mode runs it only with impl='mosaic')"
    if problem.kv_format == "bsr":
        return "block-sparse attention runs on Triton only"
    if problem.custom_mask:
        return "custom masks run on Triton only"
    why = prefill_kernels.mosaic_limits(
        head_dim=problem.head_dim, page_size=problem.page_size if problem.kv_format == "paged" else None,
        block_kv=mosaic_default_config(problem).block_kv, layout=problem.layout, head_dim_vo=problem.head_dim_vo)
    if why is not None:
        return why
    v = problem.variant
    if v is not None and (v.has_query_transform or v.has_key_transform):
        return f"variant {v.name!r} has query / key transforms (RoPE runs on Triton)"
    if v is not None and not explicit and not variants.mosaic_ready(v):
        return f"variant {v.name!r} has hooks not checked on the Mosaic kernel (impl='mosaic' forces it)"
    return None


# A mixed step in one persistent Mosaic launch (BatchAttention impl "mixed", planner.batch.plan_mixed),
# measured by its parts in profiler traces (the mixed step 4 x 512
# on 1536 + 60 decode):
MIXED_TILE_FLOPS_PER_US = 4.59e8  # its query tiles alone (the 4 chunks): 62.3 GFLOP in 135.6 µs
MIXED_BYTES_PER_US = 2.75e6       # its packed tiles alone (the 60 decode rows): 566 MB in 205.5 µs
MIXED_OVERLAP = 0.94              # the whole launch (320.4 µs) against its parts' sum (341.1)
# Moving every row of the step once costs its q bytes over HBM_BYTES_PER_US; measured in the same
# traces (2108 rows, 17.3 MB), the two-class path moves them 5.7 times (the long rows' q gathered,
# o and lse put back: 34 µs); the mixed launch reads q and writes o in place.
CLASSES_ROW_PASSES = 5.7
PACKED_TILE_ROWS = 64  # a packed tile's rows: tokens x the head group (prefill_mosaic.WG_ROWS)


def _row_us(problem, qo_lens):
    """One pass over the step's q rows (µs)."""
    return KV_ITEMSIZE * problem.num_qo_heads * problem.head_dim * float(qo_lens.sum()) / HBM_BYTES_PER_US


def _classes(problem, qo_lens):
    """(short, long) bool[B] masks of a step's non-empty requests (planner.batch.short_tokens)."""
    _, is_short = batch_planner.short_tokens(qo_lens, problem.group, SHORT_MAX_ROWS)
    live = qo_lens > 0
    return is_short & live, ~is_short & live


@functools.lru_cache(maxsize=64)
def _prefill_rows(problem, hopper):
    """A batch problem's long requests as a prefill problem, and the prefill rows (other than the
    short-query one) that can run it; hopper (problem.hopper, which can change) keys the cache."""
    prefill = dataclasses.replace(problem, family="prefill")
    return prefill, tuple(i for i in candidates(prefill) if i.cost_us is not _short_cost)


def _batch_classes_cost(problem, qo_lens, kv_lens, causal):
    """Short requests on the decode kernel, then the long ones on the cheaper prefill kernel, their
    rows gathered and put back."""
    short, long_ = _classes(problem, qo_lens)
    cost = _short_cost(problem, qo_lens[short], kv_lens[short], causal) if short.any() else 0.0
    if long_.any():
        prefill, rows = _prefill_rows(problem, problem.hopper)
        cost += min(i.cost_us(prefill, qo_lens[long_], kv_lens[long_], causal) for i in rows)
        if short.any():  # the long rows gathered and put back among the short ones
            cost += CLASSES_ROW_PASSES * _row_us(problem, qo_lens)
    return cost


def _batch_mosaic_cost(problem, qo_lens, kv_lens, causal):
    """Both classes in one launch: the query tiles' FLOPs and the packed tiles' K/V share the
    SMs (their times add, less the measured overlap); the longest unsplit tile (either kind)
    bounds it."""
    short, long_ = _classes(problem, qo_lens)
    tile_tokens = mosaic_default_config(problem).tile_tokens
    tile_flops = 4.0 * tile_tokens * problem.head_dim  # per key, per query head
    keys = float(_visible_keys(qo_lens[long_], kv_lens[long_], tile_tokens, causal).sum())
    kv_short = kv_lens[short]
    total = MIXED_OVERLAP * (tile_flops * keys * problem.num_qo_heads / MIXED_TILE_FLOPS_PER_US
                             + _kv_us(problem, kv_short, MIXED_BYTES_PER_US))
    sms = _backend.num_sms()  # one SM runs a tile at its share of either rate
    longest = max(tile_flops * float(kv_lens[long_].max(initial=0)) / (MIXED_TILE_FLOPS_PER_US / sms),
                  2.0 * KV_ITEMSIZE * problem.head_dim * float(kv_short.max(initial=0)) / (MIXED_BYTES_PER_US / sms))
    return LAUNCH_US + max(total, longest)


def _batch_mosaic_unsupported(problem, explicit):
    if problem.variant is not None:
        return "variants run on the two-class path"
    if problem.group > PACKED_TILE_ROWS:
        return f"a packed tile holds {PACKED_TILE_ROWS} rows, fewer than the head group ({problem.group})"
    if problem.kv_format != "paged":
        return "reads paged caches only"
    return _mosaic_unsupported(problem, explicit)


def _mla_unsupported(problem, explicit):
    if problem.kv_format != "paged" or problem.num_kv_heads != 1:
        return "reads one paged latent cache (num_kv_heads 1)"
    return None


def _mla_dtypes_unsupported(q_dtype, kv_dtype):
    q_dtype, kv_dtype = np.dtype(q_dtype), np.dtype(kv_dtype)
    sixteen = (np.dtype("float16"), np.dtype("bfloat16"))
    if q_dtype in (np.dtype("float32"),) + sixteen and (
            kv_dtype == q_dtype or q_dtype in sixteen and kv_dtype in FP8_DTYPES):
        return None
    return (f"q must be float32, float16 or bfloat16 and the latent cache of its dtype (or fp8 under a "
            f"16-bit q), got {q_dtype} / {kv_dtype}")


def _mla_mosaic_unsupported(problem, explicit):
    why = _mla_unsupported(problem, explicit)
    if why is None and not explicit and not problem.hopper:
        why = "needs a Hopper GPU (compiled; interpret mode runs it only with impl='mosaic')"
    if why is None and problem.head_dim_vo is None:
        why = "needs the latent width (head_dim_vo: head_dim_ckv)"
    if why is None:
        dc = problem.head_dim_vo
        why = mla_mosaic_kernels.limits(num_heads=problem.num_qo_heads, head_dim_ckv=dc,
                                        head_dim_kpe=problem.head_dim - dc, page_size=problem.page_size)
    return why


def _mla_mosaic_cost(problem, qo_lens, kv_lens, causal):
    """_mla_cost, or infinite where a request's rows are not whole tiles (_mla_tile_rows)."""
    qo_lens = np.asarray(qo_lens, np.int64)
    if np.any(qo_lens * problem.num_qo_heads % _mla_tile_rows(problem, qo_lens)):
        return _INF
    return _mla_cost(problem, qo_lens, np.asarray(kv_lens, np.int64), causal, "mla_mosaic")


def _mla_tile_rows(problem, qo_lens):
    """The wrappers' tile rows for a step (planner.mla.block_rows_for of its longest request:
    16 to 64, one token's rows where they fit)."""
    return mla_planner.block_rows_for(problem.num_qo_heads, int(qo_lens.max()) if qo_lens.shape[0] else 1)


def _mla_mosaic_dtypes_unsupported(q_dtype, kv_dtype):
    q_dtype, kv_dtype = np.dtype(q_dtype), np.dtype(kv_dtype)
    if q_dtype in (np.dtype("float16"), np.dtype("bfloat16")) and kv_dtype == q_dtype:
        return None
    return f"q and the latent cache must both be float16 or both bfloat16, got {q_dtype} / {kv_dtype}"


# The MLA kernels on one H100 (bf16, page 64; µs): FLOP/µs of their dots by tile rows and the
# latent cache's bytes/µs. Triton: 128 heads B64 kv4096 448.7 (64-row tiles, 163 TFLOP/s), 32
# heads 252.3 (32 rows, 77), 16 heads 146.2 (16 rows; 2070 GB/s of latent cache, 66 TFLOP/s).
# Mosaic: 128 heads 205.5 (355 TFLOP/s); its wgmma computes 64 rows whatever the tile's, so a
# tile of one token of 16 or 32 heads costs a 64-row tile's dots: 16 and 32 heads B64 kv4096
# 133.3 and 138.0 (2270 and 2190 GB/s).
MLA_FLOPS_PER_US = {"mla_triton": {16: 0.65e8, 32: 0.77e8, 64: 1.6e8}, "mla_mosaic": {64: 3.4e8}}
MLA_BYTES_PER_US = {"mla_triton": 2.07e6, "mla_mosaic": 2.2e6}


def _mla_cost(problem, qo_lens, kv_lens, causal, kernel="mla_triton"):
    """The latent cache read once, or the dots of every tile over its visible keys (tiles of the
    wrapper's rows, planner.mla.block_rows_for; the Mosaic kernel's padded to 64)."""
    latent = KV_ITEMSIZE * problem.head_dim * float(kv_lens.sum()) / MLA_BYTES_PER_US[kernel]
    keys = float(_visible_keys(qo_lens, kv_lens, 1, causal).sum())
    rows = _mla_tile_rows(problem, qo_lens)
    rates = MLA_FLOPS_PER_US[kernel]
    computed = max(rows, min(rates))  # rows the kernel computes per tile
    flops = 2.0 * problem.num_qo_heads * (2 * problem.head_dim) * keys * computed / rows
    return LAUNCH_US + max(latent, flops / rates[computed])


IMPLEMENTATIONS = (
    Implementation("decode_triton", "decode", "triton", DecodeConfig, _triton_unsupported, _decode_cost),
    Implementation("prefill_triton", "prefill", "triton", PrefillConfig, _triton_unsupported,
                   _triton_prefill_cost, kernel=prefill_kernels.run_triton),
    Implementation("prefill_mosaic", "prefill", "mosaic", MosaicPrefillConfig, _mosaic_unsupported,
                   _mosaic_prefill_cost, _mosaic_dtypes_unsupported, takes_scales=False, whole_tiles=True,
                   kernel=prefill_kernels.run_mosaic),
    # Prefill steps whose every request is short (speculative verify, small appends): the decode
    # kernel with each request's tokens x head group in one tile, split-KV (planner.batch).
    Implementation("prefill_short", "prefill", "short", DecodeConfig, _short_unsupported, _short_cost),
    # BatchAttention steps with both short and long requests: the decode kernel for the short ones,
    # then a prefill kernel (the prefill rows' choice) for the long ones ...
    Implementation("batch_classes", "batch", "classes", DecodeConfig, _short_unsupported, _batch_classes_cost),
    # ... or both in one persistent Mosaic GPU launch.
    Implementation("batch_mosaic", "batch", "mixed", MosaicPrefillConfig, _batch_mosaic_unsupported,
                   _batch_mosaic_cost, _mosaic_dtypes_unsupported, takes_scales=False),
    # Multi-head latent attention (BatchMLAPagedAttention): every head of a request over one
    # latent cache, decode and multi-token rows in one kernel, split-KV merged. On Hopper, tiles
    # of up to 64 rows on wgmma (16-bit caches, page a multiple of 32) ...
    Implementation("mla_mosaic", "mla", "mosaic", mla_kernels.MLAConfig, _mla_mosaic_unsupported, _mla_mosaic_cost,
                   _mla_mosaic_dtypes_unsupported, kernel=mla_mosaic_kernels.mla_mosaic),
    # ... else the Triton kernel (any head count, page size and dtype, fp8 latents).
    Implementation("mla_triton", "mla", "triton", mla_kernels.MLAConfig, _mla_unsupported, _mla_cost,
                   _mla_dtypes_unsupported, kernel=mla_kernels.mla_paged),
    # Token sampling (jaxinfer.sampling): one program per row (pass 1 split among several for small
    # batches: sampling_config), threshold search without sorting ...
    Implementation("sampling_pallas", "sampling", "pallas", sampling_kernels.SamplingConfig, _always,
                   lambda problem, qo_lens, kv_lens, causal: 0.0, kernel=sampling_kernels.filtered_sample),
    # ... or, for an unfiltered draw, one exponential race with each row split among programs.
    Implementation("sampling_race", "sampling", "race", sampling_kernels.SamplingConfig, _always,
                   lambda problem, qo_lens, kv_lens, causal: 0.0, kernel=sampling_kernels.race_sample),
)
IMPLEMENTATIONS_BY_NAME = {impl.name: impl for impl in IMPLEMENTATIONS}
_MAY_BE_INFINITE = (_short_cost, _mla_mosaic_cost)  # rows that may not take a step's lengths
WHOLE_TILE_ROWS = tuple(i.name for i in IMPLEMENTATIONS if i.whole_tiles)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLATiling:
    """The plan shape an MLA row's kernel needs (planner.mla.plan's and the device planner's)."""
    block_rows: int    # (token, head) query rows per tile
    block_kv: int      # keys per block: chunks are multiples of it
    num_cells: int     # the kernel's grid
    tile_merge: bool   # split tiles merged whole (partial rows chunk by chunk)


def mla_tiling(implementation, config, num_sms, block_rows):
    """MLATiling of `implementation` (an mla row) under config (an MLAConfig) for block_rows (the
    wrapper's choice for the step's lengths): the Mosaic kernel's tiles of up to 64 rows and
    blocks of its BLOCK_KV keys, one cell per SM (its shared memory fills one), merged whole;
    else the Triton kernel's."""
    if implementation.name == "mla_mosaic":
        return MLATiling(block_rows=min(block_rows, mla_mosaic_kernels.WG_ROWS), block_kv=mla_mosaic_kernels.BLOCK_KV,
                         num_cells=config.num_cells or num_sms, tile_merge=True)
    return MLATiling(block_rows=block_rows, block_kv=config.kv_block(block_rows),
                     num_cells=config.cells(block_rows, num_sms), tile_merge=False)


# A filtered draw splits its pass 1 only when each row gets at least this many programs (H200,
# rows of 128256: one row split 32 ways 1.5-2x faster than one program; 64 rows split 4 ways no
# faster, 256 rows split 2 ways 1.1-1.3x slower: the programs' state is written and read back).
MIN_LANE_SPLITS = 8


def sampling_config(filters, config, batch, num_sms):
    """config (a SamplingConfig) with its programs per row set where it leaves them None: two
    programs per SM in all for an unfiltered draw's race, and for a filtered draw's pass 1 when
    that gives every row MIN_LANE_SPLITS or more (else pass 1 stays in the row's program)."""
    if config.splits is not None:
        return config
    splits = -(-2 * num_sms // max(batch, 1))
    if sampling_row(filters).name == "sampling_pallas" and splits < MIN_LANE_SPLITS:
        splits = 1
    return dataclasses.replace(config, splits=splits)


def sampling_row(filters):
    """The sampling kernel's row for filters (a pallas_kernels.sampling.Filters): the split race
    for an unfiltered draw, else the per-row threshold kernel (every vocabulary, dtype, backend)."""
    unfiltered = filters.sample and not (filters.top_k or filters.top_p or filters.min_p)
    return IMPLEMENTATIONS_BY_NAME["sampling_race" if unfiltered else "sampling_pallas"]


def implementations(problem, impl="auto"):
    """The implementations of problem's family that impl admits: (Implementation, reason or None)."""
    rows = [i for i in IMPLEMENTATIONS if i.family == problem.family]
    if impl != "auto":
        names = [i.short_name for i in rows]
        rows = [i for i in rows if i.short_name == impl]
        if not rows:
            raise ValueError(f"impl must be 'auto' or one of {names} for {problem.family}, got {impl!r}")
    return [(i, i.unsupported(problem, impl != "auto")) for i in rows]


def check(problem, impl="auto"):
    """ValueError (naming impl, or what the problem lacks) unless some implementation can run it."""
    rows = implementations(problem, impl)
    if all(reason is not None for _, reason in rows):
        why = "; ".join(f"{i.name}: {reason}" for i, reason in rows)
        raise ValueError(f"impl={impl!r}: no kernel runs this {problem.family} problem ({why})")


def supported(problem, impl="auto"):
    """Names of the implementations that can run `problem`."""
    return [i.name for i, reason in implementations(problem, impl) if reason is None]


def candidates(problem, impl="auto", dtypes=None):
    """check(problem, impl), then the implementations that can run `problem` (a tuple), and with
    dtypes = (q dtype, K/V dtype) those that take them. Static per wrapper (and dtypes): wrappers
    compute it once and pass it to choose(rows=)."""
    check(problem, impl)
    rows = tuple(i for i, reason in implementations(problem, impl) if reason is None)
    if dtypes is not None:
        why = {i.name: i.dtypes_unsupported(*dtypes) for i in rows}
        if all(why.values()):
            raise ValueError(f"impl={impl!r}: no kernel takes q / K/V of dtypes {dtypes[0]} / {dtypes[1]} ("
                             + "; ".join(f"{name}: {reason}" for name, reason in why.items()) + ")")
        rows = tuple(i for i in rows if why[i.name] is None)
    return rows


def explain(problem, qo_lens=None, kv_lens=None, causal=True, impl="auto", dtypes=None):
    """Why choose() picks what it picks, as lines of text: each row of the problem's family, with
    the reason it cannot run (or the dtypes it cannot take), else its estimated cost for the step
    (qo_lens, kv_lens), then the choice."""
    lines = [f"{problem.family} problem: Hq {problem.num_qo_heads}, Hkv {problem.num_kv_heads}, head_dim "
             f"{problem.head_dim}" + ("" if problem.head_dim_vo is None else f" / vo {problem.head_dim_vo}")
             + f", {problem.kv_format}, page {problem.page_size}, {problem.layout}, "
             f"{'interpret' if problem.interpret else 'compiled'}" + ("" if problem.hopper else " (no Hopper)")]
    for row, reason in implementations(problem, impl):
        if reason is None and dtypes is not None:
            reason = row.dtypes_unsupported(*dtypes)
        if reason is not None:
            lines.append(f"  {row.name}: cannot run: {reason}")
        elif qo_lens is None:
            lines.append(f"  {row.name}: can run")
        else:
            cost = row.cost_us(problem, np.asarray(qo_lens, np.int64), np.asarray(kv_lens, np.int64), causal)
            lines.append(f"  {row.name}: {cost:.1f} µs (cost model)")
    try:
        lines.append(f"choice: {choose(problem, qo_lens, kv_lens, causal, impl, candidates(problem, impl, dtypes)).name}")
    except ValueError as err:
        lines.append(f"choice: none ({err})")
    return "\n".join(lines)


def plan_dtypes(q_data_type, kv_data_type):
    """plan()'s q_data_type / kv_data_type (kv defaults to q, as FlashInfer's) as a (q, kv) pair of
    NumPy dtypes, or None when q_data_type is None (the plan then serves any dtypes)."""
    if q_data_type is None:
        if kv_data_type is not None:
            raise ValueError("kv_data_type needs q_data_type")
        return None
    try:
        q = np.dtype(q_data_type)
        kv = q if kv_data_type is None else np.dtype(kv_data_type)
    except TypeError as err:
        raise ValueError(f"q_data_type / kv_data_type must name dtypes, got {q_data_type!r} / "
                         f"{kv_data_type!r}") from err
    return q, kv


def choose(problem, qo_lens, kv_lens, causal, impl="auto", rows=None, *, fixed_shapes=False,
           often_empty=False, without=(), tile_rows=None):
    """The Implementation that runs one step (qo_lens, kv_lens: host int arrays; None for a
    static choice, as decode's: one kernel serves every length). rows: candidates(problem, impl),
    when the caller has it. fixed_shapes: the wrapper's plans keep one structure for every step
    (capacities given): _fixed_choice (tile_rows: an MLA wrapper's tile rows under its
    capacities). without: names of rows the caller cannot plan for (a pinned tile height or
    cascade positions rule out the short path's own tiles).
    Otherwise the cheapest by the cost model, ties to the first in table order; costs are
    computed only where there is a choice: those that may be infinite first (a length the
    kernel cannot take), the rest only while more than one candidate is left."""
    rows = candidates(problem, impl) if rows is None else rows
    if without:
        rows = tuple(i for i in rows if i.name not in without)
        if not rows:
            raise ValueError(f"impl={impl!r}: no kernel left for this plan (not {', '.join(without)})")
    if fixed_shapes:
        return _fixed_choice(problem, rows, often_empty, tile_rows)
    if qo_lens is None:
        return min(rows, key=lambda i: i.name)
    costs = {}
    if len(rows) > 1 or rows[0].cost_us in _MAY_BE_INFINITE:
        for i in rows:
            if i.cost_us in _MAY_BE_INFINITE:  # (maxima and sums only: any integer dtype, no cast)
                costs[i.name] = i.cost_us(problem, qo_lens, kv_lens, causal)
    finite = [i for i in rows if costs.get(i.name, 0.0) < _INF]
    if not finite:
        raise ValueError(f"impl={impl!r}: no kernel runs this step's lengths "
                         f"({', '.join(i.name for i in rows)} cannot)")
    if len(finite) == 1:
        return finite[0]
    qo_lens, kv_lens = np.asarray(qo_lens, np.int64), np.asarray(kv_lens, np.int64)
    for i in finite:
        if i.name not in costs:
            costs[i.name] = i.cost_us(problem, qo_lens, kv_lens, causal)
    return min(finite, key=lambda i: costs[i.name])


def _fixed_choice(problem, rows, often_empty, tile_rows=None):
    """The one kernel of a wrapper whose plans keep their shapes for every step. A batch
    problem's: its first row. A prefill problem's: Mosaic where it runs, else Triton; never the
    short path (its program depends on the step's longest request). often_empty: the kernel
    launches on steps with no rows for it (BatchAttention's long requests): Triton first, whose
    empty grid costs a few µs, where the Mosaic kernel's (one CTA per SM, a CTA per tile slot
    and head) cost ~170 µs a step (H200, decode B64 kv4096). An MLA problem's: Mosaic where
    every composition is whole tiles of tile_rows (64 of 64-multiple heads, or one token of 16
    or 32 heads: capacities of one token per request), else Triton."""
    if rows[0].family == "batch":
        return rows[0]
    if rows[0].family == "mla":
        h = problem.num_qo_heads
        whole = h % mla_mosaic_kernels.WG_ROWS == 0 or (
            tile_rows is not None and min(tile_rows, mla_mosaic_kernels.WG_ROWS) == h
            and h in mla_mosaic_kernels.TILE_ROWS)
        for i in rows:
            if i.name != "mla_mosaic" or whole:
                return i
        raise ValueError(f"impl='mosaic' cannot serve MLA plans of fixed shapes at num_heads {h} with tiles of "
                         f"{tile_rows} rows (steps whose rows are not whole tiles); use 'auto'")
    order = ("prefill_triton", "prefill_mosaic") if often_empty else ("prefill_mosaic", "prefill_triton")
    for name in order:
        if any(i.name == name for i in rows):
            return IMPLEMENTATIONS_BY_NAME[name]
    raise ValueError(f"impl={rows[0].short_name!r} cannot serve plans of fixed shapes "
                     "(max_batch_size, max_num_tokens and max_num_pages given); use 'auto', 'triton' or 'mosaic'")


def fallback(choice, impl, dtypes):
    """The row whose plan a plan for `choice` carries beside it, or None: impl="auto" plans for
    Mosaic made without dtypes keep a Triton plan for the dtypes Mosaic cannot take."""
    if choice.name == "prefill_mosaic" and impl == "auto" and dtypes is None:
        return IMPLEMENTATIONS_BY_NAME["prefill_triton"]
    return None


def runs_on_fallback(impl_name, q_dtype, kv_dtype, scaled):
    """Whether a plan made for impl_name must run its fallback plan on these inputs (its kernel
    cannot take the dtypes, or fp8 scales)."""
    row = IMPLEMENTATIONS_BY_NAME[impl_name]
    return row.dtypes_unsupported(q_dtype, kv_dtype) is not None or (scaled and not row.takes_scales)


BATCH_IMPLS = ("auto", "triton", "mosaic", "mixed")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchImpls:
    """What BatchAttention's impl= asks of each class: its long requests' prefill impl, and how
    steps with both classes run ("classes": two launches, "mixed": one, "auto": the cost model)."""
    long: str
    both: str


def batch_impls(impl):
    if impl not in BATCH_IMPLS:
        raise ValueError(f"impl must be one of {BATCH_IMPLS}, got {impl!r}")
    return BatchImpls(long="mosaic" if impl == "mixed" else impl,
                      both={"auto": "auto", "mixed": "mixed"}.get(impl, "classes"))


# With every capacity given, BatchAttention's short requests are those whose tokens x group fit
# 16 rows (decode, verify of 16 / group tokens): one decode-kernel (or packed-tile) program
# serves every step; longer ones take prefill tiles.
FIXED_SHORT_ROWS = 16


def batch_classes(qo_lens, group, *, fixed_shapes):
    """BatchAttention's split of a step: (tokens per short item, is_short bool[B]). Short
    requests run on the decode kernel (or the mixed launch's packed tiles); the rest on prefill
    tiles. Under fixed shapes the class is the wrapper's (FIXED_SHORT_ROWS), not the step's."""
    if fixed_shapes:
        tokens = batch_planner.short_cap(group, FIXED_SHORT_ROWS)
        return tokens, qo_lens <= tokens
    return batch_planner.short_tokens(qo_lens, group)


RAGGED_PREFILL_ROWS = 128  # ragged_paged_attention's Triton prefill tiles: rows (tokens x group), as BatchAttention's chunks


def ragged_prefill_rows(group):
    return max(RAGGED_PREFILL_ROWS, 1 << (group - 1).bit_length())


# ragged_paged_attention's decode tile heights, one class (one launch) each: a tile's dots cost its
# rows whatever the tokens in it. One H200, B64 kv4096, Hq 32 / Hkv 8, µs: 8 tokens a request
# took 360.7 on 64-row tiles, 290.6 on 32-row ones (BatchAttention's 32-row tiles: 272.9); the
# 32-row class's launch, empty on other steps, costs decode B64 kv4096 +0.5% and the mixed step +1.3%.
RAGGED_DECODE_ROWS = (FIXED_SHORT_ROWS, 32, SHORT_MAX_ROWS)


def ragged_class_bounds(group, num_tokens, *, mixed):
    """ragged_paged_attention's q_len classes, shortest first: (min_q, max_q, on prefill tiles,
    tokens per item or tile). The decode kernel's classes: q_len <= T_s on 16-row tiles of T_s
    tokens x the group (decode, speculative verify: BatchAttention's fixed short rows), then up to
    T_m on 32-row and T_l on 64-row tiles (each where it holds more tokens than the class before),
    the rest on prefill tiles (not with the mixed launch, which runs them). Classes that no
    sequence of num_tokens rows can reach are left out."""
    bounds = []
    for rows in RAGGED_DECODE_ROWS:
        t = batch_planner.short_cap(group, rows)
        if not bounds or t > bounds[-1][1]:
            bounds.append((bounds[-1][1] + 1 if bounds else 1, t, False, t))
    if not mixed:
        bounds.append((bounds[-1][1] + 1, num_tokens, True, ragged_prefill_rows(group) // group))
    return tuple(x for x in bounds if x[0] <= num_tokens)


def batch_tries_mixed(both, dtypes, is_short, live, *, fixed_shapes):
    """Whether a BatchAttention step weighs the mixed launch: forced (both="mixed"), or with "auto"
    when plan() was told the dtypes and the step has short and long requests."""
    if fixed_shapes:
        return both == "mixed"
    return (dtypes is not None or both == "mixed") and 0 < np.count_nonzero(is_short & live) < np.count_nonzero(live)


def ragged_long_impl(problem, impl, q_dtype, kv_dtype, scaled, sm_scale):
    """The kernel of ragged_paged_attention's long sequences (q_len past the decode tiles): its
    lengths live on the device, so no cost model. "auto": the mixed launch (batch_mosaic: the long
    sequences' query tiles and the short ones' packed tiles in one persistent Mosaic launch,
    planned on the device) wherever it can run, else the Mosaic prefill kernel for steps with no
    variant, else Triton. The Mosaic kernels need (with "auto") a Hopper GPU, compiled; the
    problem's limits as _mosaic_unsupported (the mixed launch: no variant either), 16-bit q and
    K/V of one dtype, no fp8 scales, sm_scale > 0, and no output transform (it needs each row's
    lse, which ragged_paged_attention maps back from the Mosaic launches only for return_lse), except sinks on the
    prefill kernel (it holds them in its softmax state). Steps with a variant (sliding window,
    soft cap, sinks) run on Triton with "auto": on an H200 the Mosaic prefill kernel was 1.08-1.88x
    slower on 13 of 14 such steps (B4 S2048 with a 128-token window 489.0 against 262.5 µs, with
    soft cap 30 746.4 against 652.7; 60 decode rows + 4 chunks of 512 with a 128-token window
    166.0 against 105.2) and 5% faster on the fourteenth (that mixed step with soft cap 30: 462.3
    against 484.9); without a variant it was 0.94-1.15x Triton's time (B4 S2048 d128 527.6
    against 550.1, d64 621.8 against 539.0).
    impl "mixed" or "mosaic" forces that kernel (ValueError naming what it lacks), "triton" the
    Triton kernel."""
    if impl not in ("auto", "mixed", "mosaic", "triton"):
        raise ValueError(f"impl must be 'auto', 'mixed', 'mosaic' or 'triton', got {impl!r}")
    if impl == "triton":
        return IMPLEMENTATIONS_BY_NAME["prefill_triton"]

    def why_not(name):
        row = IMPLEMENTATIONS_BY_NAME[name]
        why = row.unsupported(problem, impl != "auto") or row.dtypes_unsupported(q_dtype, kv_dtype)
        if why is None and scaled and not row.takes_scales:
            why = "fp8 K/V scales run on Triton only"
        if (why is None and problem.variant is not None and problem.variant.output_transforms
                and not (impl == "mosaic" and variants.sinks_only_output(problem.variant))):
            why = f"variant {problem.variant.name!r} transforms the output by each row's lse"
        if why is None:
            why = prefill_kernels.mosaic_limits(sm_scale=sm_scale)
        return why

    auto = ("batch_mosaic",) + (("prefill_mosaic",) if problem.variant is None else ())
    for name in {"auto": auto, "mixed": ("batch_mosaic",), "mosaic": ("prefill_mosaic",)}[impl]:
        why = why_not(name)
        if why is None:
            return IMPLEMENTATIONS_BY_NAME[name]
        if impl != "auto":
            raise ValueError(f"impl={impl!r}: {why}")
    return IMPLEMENTATIONS_BY_NAME["prefill_triton"]


def config_for(implementation, problem, configs):
    """The user's config for this implementation (configs: a config or a tuple of them, matched
    by type), else its default for the problem."""
    for c in configs:
        if isinstance(c, implementation.config_type):
            return c
    return implementation.default_config(problem)


def check_configs(config):
    """config (None, one config dataclass or a tuple of them) as a tuple; ValueError otherwise."""
    configs = () if config is None else tuple(config) if isinstance(config, (tuple, list)) else (config,)
    types = tuple({i.config_type for i in IMPLEMENTATIONS})
    for c in configs:
        if not isinstance(c, types):
            raise ValueError(f"config must hold kernel configs ({', '.join(t.__name__ for t in types)}), "
                             f"got {c!r}")
    return configs


def cascade_pays(qo_lens, kv_pages, levels_groups, *, page_size, problem):
    """Whether a two-level cascade (levels_groups: ((rows, pages) per shared group, (rows, pages)
    per request)) is expected faster than one level; the model and its calibration rows are in
    planner/prefix.py."""
    return prefix_planner.cascade_pays(
        qo_lens, kv_pages, levels_groups, page_size=page_size, num_qo_heads=problem.num_qo_heads,
        num_kv_heads=problem.num_kv_heads, head_dim=problem.head_dim, itemsize=KV_ITEMSIZE)
