"""Boundary grid: every entry point that takes a page table or ragged q, at every edge its planners
and dispatch have, against jaxinfer.reference request by request (rows of one request at a time:
one wrong request is never averaged away), lse too where the entry point returns it.

Query lengths sit at b - 1, b, b + 1 of every boundary b, derived from the code (edge_classes), so
the grid follows the constants when they change:
- "short_cut": planner.batch.short_cap(group), the longest short request (the decode kernel's
  items) before the long class (prefill tiles): dispatch's cost model and every planner share it;
- "short_tokens": planner.batch.SHORT_TOKENS below the cut (the tokens_per_item of a short step);
- "tile_rows": planner.prefill.TILE_ROWS // group (choose_tile_rows' 16/32/64/128-row tiles; past
  the largest, a second tile);
- "ragged_class": jaxinfer.ragged_plan.classes, the q_len classes of ragged_paged_attention (T_s on
  16-row, T_m on 32-row and T_l on 64-row decode tiles, then dispatch.ragged_prefill_rows(group) // group tokens per prefill tile);
- "dispatch": the lengths where jaxinfer.dispatch's choice for a one-request step flips (there
  prefill_short -> prefill_triton on the cost model, before or at the cut).
Key lengths: page edges (k * page - 1, k * page, k * page + 1) and the split-KV edges
(SPLIT_TOKENS: the planners' min_split_tokens defaults and ragged's MIN_CHUNK_UNITS x CHUNK_UNIT).
Heads: GQA groups 1, 2, 4, 8 and (Hq, Hkv) = (6, 1), (20, 4); head_dim 32; float32 (GRID; the
items marked gpu, run with -m gpu on a GPU machine: bfloat16, head_dim 128, dispatch's GPU kernels).
Steps: each length alone, and all of a group's lengths mixed in one step with qo_len 0 requests
(and a step of qo_len 0 requests only where the API allows); page sizes 1, 8, 16; NHD and HND;
causal and not.

Interpret-mode compiles dominate (a few seconds per program; the steps run in milliseconds):
each kernel config runs under fixed capacities, so its jitted run() compiles once per program (per
tree structure of the plan: one per short-token class or tile height) and every step of that class
reuses it. The default subset gives each entry point one to three rows of pairwise_row (the group,
with an orthogonal array of page / layout / causal); of the alone steps it runs every length of the
classes (programs) on both sides of a change of plan.impl (impl_edges: the short/long cut,
dispatch's flip), and the mixed step (every length in one step, on one tile height). The prefill
wrapper takes groups 1 (MHA: cut and flip at 16) and 4 (flip at 8), BatchAttention group 6 (cut
8); ragged_paged_attention (one program for every length) runs every length of group 1; the other
entry points one row each. The default rows hold pages 1, 8 and 16, NHD and HND, causal and not.
The rows the default subset held before (SLOW_*: the paged wrappers' groups 2, 8 and 5 with
fixed shapes, ragged_paged_attention's group 6, ...) run under `-m slow`, as does the full product
(every row, every length alone). test_plan_boundaries crosses every planner boundary of every
group with planning alone (no kernels), and test_default_grid_reaches_every_impl checks that the
default grid reaches every plan.impl a CPU can. Cache slots past kv_len hold finite random values
(NaN poisoning is tested elsewhere); the Mosaic impls run in the gpu items only.
"""
import collections
import dataclasses
import functools
import inspect
import itertools
import traceback
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from helpers import TOL, assert_lse_close, rel_err, zero_written_tails
from jaxinfer import _backend, dispatch, ragged_plan
from jaxinfer import reference as ref
from planner import batch as batch_planner
from planner import decode as decode_planner
from planner import prefill as prefill_planner

HEADS = {1: (4, 4), 2: (8, 4), 4: (8, 2), 8: (8, 1), 6: (6, 1), 5: (20, 4)}  # group: (Hq, Hkv)
GROUPS = tuple(HEADS)
PAGE_SIZES = (1, 8, 16)
LAYOUTS = ("NHD", "HND")
CAUSAL = (True, False)


@dataclasses.dataclass(frozen=True)
class Grid:
    """How the runners below run: the inputs' dtype and head_dim, the wrappers' num_ctas (None:
    dispatch's own grids), whether plans are told the dtypes (q_data_type, as FlashInfer's users
    pass it: BatchAttention's mixed launch needs it), the tolerances, and whether each plan.impl
    must be the CPU's route (expected_impl; a GPU adds the Mosaic rows). The default is the CPU's:
    float32, head_dim 32, 8 CTAs (cells = 8 // Hkv: small interpret-mode grids, and long
    requests still split)."""
    dtype: object = jnp.float32
    head_dim: int = 32
    num_ctas: Optional[int] = 8
    told: bool = False
    tol: float = TOL[jnp.float32]
    lse_tol: float = 1e-4
    cpu_routes: bool = True


GRID = Grid()


def _default(fn, name):
    return inspect.signature(fn).parameters[name].default


# Keys past which one item (or tile) splits, when the step's keys are few for its cells.
SPLIT_TOKENS = tuple(sorted({
    _default(decode_planner.plan_decode, "min_split_tokens"),  # BatchDecode
    _default(batch_planner.plan_short, "min_split_tokens"),    # short requests (decode kernel items)
    _default(prefill_planner.plan_prefill, "min_split_tokens"),  # prefill tiles
    ragged_plan.MIN_CHUNK_UNITS * ragged_plan.CHUNK_UNIT}))               # ragged_paged_attention blocks


# ---------------------------------------------------------------- boundaries, from the code
def _dispatch_flips(group, head_dim, longest=160):
    """The lengths after which dispatch's choice for a one-request paged prefill step changes."""
    hq, hkv = HEADS[group]
    problem = dispatch.Problem("prefill", hq, hkv, head_dim, "paged", 16)
    names = [dispatch.choose(problem, np.array([n]), np.array([max(n, 64)]), True).name
             for n in range(1, longest)]
    return [n for n in range(1, len(names)) if names[n] != names[n - 1]]


def edge_classes(group):
    """{query length: the kinds of boundary it is b - 1, b or b + 1 of}, for one GQA group (at
    GRID's head_dim)."""
    return _edge_classes(group, GRID.head_dim)


@functools.lru_cache(maxsize=None)
def _edge_classes(group, head_dim):
    cap = batch_planner.short_cap(group)
    bounds = [("short_cut", cap)]
    bounds += [("short_tokens", t) for t in batch_planner.SHORT_TOKENS if t < cap]
    bounds += [("tile_rows", rows // group) for rows in prefill_planner.TILE_ROWS if rows >= group]
    for c in ragged_plan.classes(1 << 12, 64, 4, group):
        bounds.append(("ragged_class", c.tokens_per_item if c.prefill else c.max_q))
    bounds += [("dispatch", b) for b in _dispatch_flips(group, head_dim)]
    out = collections.defaultdict(set)
    for kind, b in bounds:
        for n in (b - 1, b, b + 1):
            if n >= 1:
                out[n].add(kind)
    return {n: frozenset(k) for n, k in sorted(out.items())}


def q_lengths(group):
    return tuple(edge_classes(group))


def kv_choices(qo, page):
    """Key lengths >= qo at the edges: page edges around the first page boundary at or past qo
    (and the next one), the split edges, and qo itself (the causal diagonal)."""
    k = max(1, -(-qo // page))
    edges = [k2 * page + d for k2 in (k, k + 1) for d in (-1, 0, 1)]
    edges += [s + d for s in SPLIT_TOKENS for d in (-1, 0, 1)]
    return [qo] + sorted({e for e in edges if e >= max(qo, 1) and e != qo})


def _kv_for(qo, page, i):
    """The i-th step's key length for a request of qo tokens (cycling through kv_choices)."""
    ch = kv_choices(qo, page)
    return ch[i % len(ch)]


# ---------------------------------------------------------------- configs and steps
@dataclasses.dataclass(frozen=True)
class Cfg:
    group: int
    page: int = 16
    layout: str = "NHD"
    causal: bool = True
    pick: int = 0  # the row index: rotates key lengths and the default subset's extra alone class

    @property
    def heads(self):
        return HEADS[self.group]

    def __str__(self):
        hq, hkv = self.heads
        return f"g{self.group}({hq}/{hkv})-p{self.page}-{self.layout}-{'causal' if self.causal else 'full'}"


@dataclasses.dataclass
class Step:
    kind: str          # "alone", "mixed" or "empty"
    qo: np.ndarray     # [B] query lengths
    kv: np.ndarray     # [B] key lengths

    def __str__(self):
        return f"{self.kind} qo={self.qo.tolist()} kv={self.kv.tolist()}"


# (page, layout, causal) of 6 rows holding every pair of values once or twice (an orthogonal array:
# each page with both layouts and both causal values, every layout x causal pair), and rows 0-2 and
# 3-5 each with both layouts and both causal values.
ROTATION = ((1, "NHD", True), (8, "HND", True), (16, "NHD", False), (1, "HND", False), (8, "NHD", False),
            (16, "HND", True))


def pairwise_row(i):
    """Row i of the default grid: group GROUPS[i % 6] and ROTATION[(i + i // 6) % 6] (any 6
    consecutive rows hold each group once; past 6 the groups meet other rotation rows)."""
    return Cfg(GROUPS[i % len(GROUPS)], *ROTATION[(i + i // 6) % len(ROTATION)], pick=i)


def full_rows(layouts=LAYOUTS, pages=PAGE_SIZES, causal=CAUSAL):
    return [Cfg(g, p, lay, c) for g, p, lay, c in itertools.product(GROUPS, pages, layouts, causal)]


def alone_steps(group, page, lengths=None, kv_index=0):
    return [Step("alone", np.array([n]), np.array([_kv_for(n, page, kv_index + i)]))
            for i, n in enumerate(q_lengths(group) if lengths is None else lengths)]


def mixed_step(group, page, zeros=3, kv_index=0):
    """All of the group's lengths in one step (shuffled deterministically), with qo_len 0 requests."""
    lengths = list(q_lengths(group)) + [0] * zeros
    order = np.random.default_rng(group * 7 + page).permutation(len(lengths))
    qo = np.array(lengths)[order]
    kv = np.array([_kv_for(max(int(n), 1), page, kv_index + i) for i, n in enumerate(qo)])
    return Step("mixed", qo, kv)


# ---------------------------------------------------------------- reference and checks
REF_Q_PAD = (16, 256, 1024)      # reference shapes (powers of two: jaxinfer.reference pads to them):
REF_KV_PAD = (256, 1024, 4096)   # a few compiles per head count, however many lengths


def _pad(x, n):
    return np.concatenate([x, np.zeros((n - x.shape[0],) + x.shape[1:], x.dtype)])


def _visible(qo, kv, causal):
    vis = np.ones((qo, kv), bool)
    if causal:  # bottom-right: query i sees keys j <= i + kv - qo
        vis &= np.arange(kv)[None, :] <= np.arange(qo)[:, None] + kv - qo
    return vis


def reference(q, k, v, vis):
    """jaxinfer.reference.attention for one request (host q [qo, Hq, D], k/v [kv, Hkv, D], vis
    [qo, kv] bool), padded to fixed shapes with the padding hidden. Returns (o, lse) host arrays."""
    qo, kv = vis.shape
    qp = next(n for n in REF_Q_PAD if n >= qo)
    kp = next(n for n in REF_KV_PAD if n >= kv)
    mask = np.zeros((qp, kp), bool)
    mask[:qo, :kv] = vis
    state = ref.attention(_pad(q, qp), _pad(k, kp), _pad(v, kp), mask=mask)
    return np.asarray(state.o)[:qo], np.asarray(state.lse)[:qo]


class Failures(list):
    """Every failing request of a test item, with what ran, reported together at the end."""

    def compare(self, what, o, want_o, lse=None, want_lse=None):
        try:
            err = rel_err(o, want_o)  # (fails on NaN)
        except AssertionError as e:
            self.append(f"{what}: {e}")
            return
        if not err < GRID.tol:
            self.append(f"{what}: rel_err {err:.3g}")
        if lse is not None:
            try:
                assert_lse_close(lse, want_lse, tol=GRID.lse_tol)
            except AssertionError as e:
                worst = np.nanmax(np.abs(np.where(np.isfinite(want_lse), np.asarray(lse, np.float64) - want_lse, 0)))
                self.append(f"{what}: lse differs (max abs {worst:.3g}; {str(e).strip().splitlines()[0]})")

    def raised(self, what, err):
        tb = traceback.extract_tb(err.__traceback__)[-1]
        self.append(f"{what}: raised {type(err).__name__}: {str(err)[:300]} (at {tb.filename}:{tb.lineno})")

    def check(self, header):
        assert not self, f"{header}: {len(self)} failing request(s)\n  " + "\n  ".join(self[:40])


def _randn(rng, shape):
    """Random normal host values (float32) that GRID's dtype holds exactly: the reference sees
    what the kernels see."""
    return rng.standard_normal(shape).astype(GRID.dtype).astype(np.float32)


def _dev(x):
    """A host array of _randn's on the device, in GRID's dtype."""
    return jnp.asarray(x, GRID.dtype)


def _told():
    """plan()'s dtype arguments under GRID."""
    return dict(q_data_type=GRID.dtype, kv_data_type=GRID.dtype) if GRID.told else {}


class PagedCache:
    """A random (finite) cache of num_pages pages in GRID's dtype and its host copy (float32; K and
    V apart, NHD_FUSED's as NHD)."""

    def __init__(self, rng, num_pages, page, hkv, layout):
        d = GRID.head_dim
        shape = (num_pages, hkv, page, d) if layout == "HND" else (num_pages, page, hkv, d)
        self.k, self.v = _randn(rng, shape), _randn(rng, shape)
        self.page, self.layout, self.num_pages = page, layout, num_pages
        if layout == "NHD_FUSED":  # RPA v3's fused cache, as jaxinfer reads it: [P, S, Hkv, 2, D]
            self.cache = ji.PagedKVCache.fused(_dev(np.stack([self.k, self.v], axis=3)))
        else:
            self.cache = ji.PagedKVCache(_dev(self.k), _dev(self.v), layout)

    def table(self, rng, kv):
        """A CSR page table of distinct random pages for key lengths kv."""
        npg = -(-kv // self.page)
        indptr = np.concatenate([[0], np.cumsum(npg)]).astype(np.int32)
        indices = rng.permutation(self.num_pages)[: indptr[-1]].astype(np.int32)
        last = np.where(npg > 0, kv - (npg - 1) * self.page, 1).astype(np.int32)
        return indptr, indices, last

    def keys(self, pages, n, k=None, v=None):
        """Host K, V [n, Hkv, D] of a page list (token order)."""
        k, v = (self.k if k is None else k), (self.v if v is None else v)
        kp, vp = k[pages], v[pages]
        if self.layout == "HND":
            kp, vp = kp.transpose(0, 2, 1, 3), vp.transpose(0, 2, 1, 3)
        return kp.reshape(-1, kp.shape[2], GRID.head_dim)[:n], vp.reshape(-1, vp.shape[2], GRID.head_dim)[:n]


def _num_pages(steps, page, extra=4):
    return max(int(np.sum(-(-s.kv // page))) for s in steps) + extra


def _plan_key(plan):
    """What keys the jitted run's compile: the plan's tree structure (static layouts and impl)."""
    return jax.tree_util.tree_structure(plan)


def _jit_counted(fn):
    traces = []
    jitted = jax.jit(lambda *a: (traces.append(1), fn(*a))[1])
    jitted.traces = traces
    return jitted


# ---------------------------------------------------------------- paged prefill wrappers
PAGED_PREFILL = {"BatchAttention": ji.BatchAttention,
                 "BatchPrefillWithPagedKVCache": ji.BatchPrefillWithPagedKVCache}
# The impls a CPU reaches with impl="auto" (dispatch: Mosaic needs a compiled Hopper GPU; a
# BatchAttention step's long requests never take the short path, so never "+prefill_short").
REACHABLE = {
    "BatchAttention": {"decode_triton", "prefill_triton", "decode_triton+prefill_triton", "none (no query rows)"},
    "BatchPrefillWithPagedKVCache": {"prefill_short", "prefill_triton"},
    "BatchDecodeWithPagedKVCache": {"decode_triton"},
    "BatchPrefillWithRaggedKVCache": {"prefill_triton"},
    "BlockSparseAttention": {"prefill_triton"},
    "MultiLevelCascadeAttention": {"cascade(prefill_triton, prefill_triton)"},
}


def expected_impl(entry, group, qo, kv, causal, problem=None, fixed=False):
    """plan.impl as the routing rule says: short requests (qo_len <= short_cap) on the decode kernel,
    the others on prefill tiles; the prefill wrapper's all-short steps as dispatch chooses. fixed
    (every capacity given): one structure for every step, both launches (BatchAttention) or the
    prefill kernel alone."""
    if fixed:
        return "decode_triton+prefill_triton" if entry == "BatchAttention" else "prefill_triton"
    short = qo <= batch_planner.short_cap(group)
    if entry == "BatchAttention":
        parts = ["decode_triton"] if np.any(short & (qo > 0)) else []
        parts += ["prefill_triton"] if np.any(~short) else []
        return "+".join(parts) or "none (no query rows)"
    if not np.all(short):
        return "prefill_triton"
    return dispatch.choose(problem, qo, kv, causal).name


def make_paged_wrapper(entry, cfg, caps=None, impl="auto"):
    hq, hkv = cfg.heads
    return PAGED_PREFILL[entry](hq, hkv, GRID.head_dim, cfg.page, causal=cfg.causal, layout=cfg.layout,
                                num_ctas=GRID.num_ctas, impl=impl, **(caps or {}))


def _plan_paged(w, cache, rng, step):
    indptr, indices, last = cache.table(rng, step.kv)
    qo_indptr = np.concatenate([[0], np.cumsum(step.qo)]).astype(np.int32)
    plan = w.plan(qo_indptr, indptr, indices, last, num_pages=cache.num_pages, **_told())
    return plan, (qo_indptr, indptr, indices, last)


def _route(plan):
    """The step-level choices a plan made (for failure reports): tokens per item, tile rows."""
    lay = getattr(plan, "layout", None)
    long = getattr(plan, "long", None)
    out = []
    if hasattr(lay, "tokens_per_item") and getattr(plan, "has_short", True):
        out.append(f"tokens_per_item={lay.tokens_per_item}")
    for p in (plan, long):
        if p is not None and hasattr(p.layout, "rows"):
            out.append(f"rows={p.layout.rows}")
    return ",".join(out)


def paged_prefill_steps(entry, cfg, slow):
    """The steps one config runs: alone steps (all in slow; in default those of the classes
    holding impl_edges' lengths), the mixed step, and (BatchAttention) a step of qo_len 0
    requests."""
    steps = alone_steps(cfg.group, cfg.page, kv_index=cfg.pick)
    if not slow:
        w, table = make_paged_wrapper(entry, cfg), _HostTable(cfg.page)
        rng = np.random.default_rng(0)
        plans = [_plan_paged(w, table, rng, s)[0] for s in steps]
        steps = select_alone(steps, plans, impl_edges(steps, plans))
    steps.append(mixed_step(cfg.group, cfg.page, kv_index=cfg.pick))
    if entry == "BatchAttention":
        steps.append(Step("empty", np.zeros(3, np.int64), np.array([5, 0, cfg.page + 1])))
    return steps


def impl_edges(steps, plans):
    """The lengths on both sides of every change of plan.impl between consecutive alone lengths:
    the routing edges where a step moves to another kernel (BatchAttention: the short/long cut;
    the prefill wrapper: dispatch's flip from prefill_short to prefill_triton, at the cut for
    groups 1 and 2, before it for group 4). Tile heights and item sizes that change without
    another impl run in the mixed step, and all of them alone under -m slow."""
    keep = set()
    for (a, pa), (b, pb) in itertools.pairwise(zip(steps, plans)):
        if pa.impl != pb.impl:
            keep |= {int(a.qo[0]), int(b.qo[0])}
    return keep


def select_alone(steps, plans, keep):
    """The alone steps of every class (one compiled program each: the plan's impl and step-level
    choices) that holds a length in `keep`: all of a class's lengths run on its one program.
    plans: each step's plan (planning only, host NumPy)."""
    by_class = collections.defaultdict(list)
    for s, plan in zip(steps, plans):
        by_class[(plan.impl, _route(plan))].append(s)
    return [s for c in by_class.values() if any(int(s.qo[0]) in keep for s in c) for s in c]


class _HostTable:
    """PagedCache's table() without a cache (planning only)."""

    def __init__(self, page, num_pages=1 << 14):
        self.page, self.num_pages = page, num_pages

    table = PagedCache.table


def run_paged_prefill(entry, cfg, steps, rng, fixed, impl="auto"):
    """Plans and runs every step through one wrapper (impl: the wrapper's) with all three
    capacities (one jitted run()); fixed: fixed_shapes (plans of one structure: one compile), else
    fixed_shapes=False (each step's own kernels under the same shapes: one compile per class, as
    without capacities). Returns (Failures, impls seen, number of compiles)."""
    hq, hkv = cfg.heads
    tcap = max(int(s.qo.sum()) for s in steps) + 5  # + rows past the step (must give o = 0)
    num_pages = _num_pages(steps, cfg.page)
    caps = dict(max_batch_size=max(len(s.qo) for s in steps), max_num_tokens=tcap, max_num_pages=num_pages,
                fixed_shapes=fixed)
    w = make_paged_wrapper(entry, cfg, caps, impl)
    cache = PagedCache(rng, num_pages, cfg.page, hkv, cfg.layout)
    run = _jit_counted(lambda q, c, p: w.run(q, c, p, return_lse=True))
    fails, seen = Failures(), set()
    for step in steps:
        what = f"{entry} {cfg} {step}"
        try:
            plan, (qo_indptr, indptr, indices, last) = _plan_paged(w, cache, rng, step)
            what += f" impl={plan.impl} {_route(plan)}"
            seen.add(plan.impl)
            want_impl = expected_impl(entry, cfg.group, step.qo, step.kv, cfg.causal, w.problem, fixed)
            if GRID.cpu_routes and plan.impl != want_impl:
                fails.append(f"{what}: impl {plan.impl}, the routing rule says {want_impl}")
            q = _randn(rng, (tcap, hq, GRID.head_dim))
            o, lse = (np.asarray(x) for x in run(_dev(q), cache.cache, plan))
        except Exception as e:  # noqa: BLE001 - reported with the step
            fails.raised(what, e)
            continue
        for b in range(len(step.qo)):
            r0, r1 = qo_indptr[b], qo_indptr[b + 1]
            if r1 == r0:
                continue
            k, v = cache.keys(indices[indptr[b]:indptr[b + 1]], int(step.kv[b]))
            want_o, want_lse = reference(q[r0:r1], k, v, _visible(r1 - r0, int(step.kv[b]), cfg.causal))
            fails.compare(f"{what} request {b} (qo {r1 - r0}, kv {step.kv[b]})", o[r0:r1], want_o, lse[r0:r1],
                          want_lse)
        nnz = int(qo_indptr[-1])
        if np.any(o[nnz:] != 0):
            fails.append(f"{what}: rows past the step are not 0")
    return fails, seen, len(run.traces)


# The default configs of each entry point (rows of pairwise_row): the prefill wrapper takes group
# 1 (MHA: the cut and dispatch's flip at 16, 17-32 tokens on 32-row tiles) and group 4 (dispatch
# flips to Triton at 8, before the cut), BatchAttention group 6 (cut 8, non-power-of-two heads:
# 48-row decode tiles); together pages 1, 8 and 16, NHD, causal and not, each without fixed shapes
# (prefill_short and BatchAttention's one-launch plans run). SLOW_*: the rows the default subset
# held before (group 2 and fixed shapes; groups 8 and 5, fixed; ragged_paged_attention group 6;
# decode on 16-token pages; block-sparse group 6), under -m slow with the full grids. HND and
# fixed shapes (all three capacities) of the paged wrappers run by default in test_short_path,
# test_poison and test_fuzz.
DEFAULT_PAGED = [("BatchPrefillWithPagedKVCache", pairwise_row(0)), ("BatchPrefillWithPagedKVCache", pairwise_row(2)),
                 ("BatchAttention", pairwise_row(4))]
SLOW_PAGED = [("BatchPrefillWithPagedKVCache", pairwise_row(1)), ("BatchAttention", pairwise_row(3)),
              ("BatchAttention", pairwise_row(5))]
# group 1 (T_s = T_l: two classes), page 1, HND, not causal; group 4 on RPA v3's fused cache (NHD_FUSED)
DEFAULT_RPA = [pairwise_row(18), Cfg(4, 16, "NHD_FUSED", True, pick=2)]
SLOW_RPA = [pairwise_row(6), pairwise_row(4)]  # group 1 causal; group 6 (three classes: test_poison's group 2 by default)
DEFAULT_DECODE = [pairwise_row(3)]  # page 1
SLOW_DECODE = [pairwise_row(2)]     # page 16
DEFAULT_RAGGED = [pairwise_row(3)]
DEFAULT_CASCADE = [pairwise_row(1)]


def _with_slow(default, slow):
    """default's parameter sets, then slow's marked slow."""
    as_tuple = lambda x: x if isinstance(x, tuple) else (x,)
    return list(default) + [pytest.param(*as_tuple(x), marks=pytest.mark.slow) for x in slow]


@pytest.mark.parametrize("entry, cfg", _with_slow(DEFAULT_PAGED, SLOW_PAGED), ids=str)
def test_paged_prefill_boundaries(rng, entry, cfg):
    """Rows of odd pick run with fixed shapes (all three capacities: one program for every step);
    the default rows all have even picks."""
    fixed = cfg.pick % 2 == 1
    fails, seen, compiles = run_paged_prefill(entry, cfg, paged_prefill_steps(entry, cfg, slow=False), rng, fixed)
    assert compiles == 1 or not fixed, compiles
    assert seen <= REACHABLE[entry], seen
    fails.check(f"{entry} {cfg}")


@pytest.mark.slow
@pytest.mark.parametrize("entry, cfg", [(e, c) for e in PAGED_PREFILL for c in full_rows()], ids=str)
@pytest.mark.parametrize("fixed", [False, True])
def test_paged_prefill_boundaries_full(rng, entry, cfg, fixed):
    fails, seen, compiles = run_paged_prefill(entry, cfg, paged_prefill_steps(entry, cfg, slow=True), rng, fixed)
    assert compiles == 1 or not fixed, compiles
    assert seen <= REACHABLE[entry], seen
    fails.check(f"{entry} {cfg}")


# ---------------------------------------------------------------- ragged_paged_attention
def rpa_steps(cfg, slow):
    """Every length alone (one program serves them all: the classes are static) and mixed; slow:
    each length alone at two more key lengths."""
    steps = alone_steps(cfg.group, cfg.page, kv_index=cfg.pick)
    if slow:
        steps += alone_steps(cfg.group, cfg.page, kv_index=cfg.pick + 3)
        steps += alone_steps(cfg.group, cfg.page, kv_index=cfg.pick + 7)
    mixed = mixed_step(cfg.group, cfg.page, kv_index=cfg.pick)
    first = np.argsort(mixed.qo != 1, kind="stable")  # decode rows (q_len 1) first: distribution[0]
    steps.append(Step("mixed", mixed.qo[first], mixed.kv[first]))
    return steps


def run_rpa(cfg, steps, rng):
    """One jitted ragged_paged_attention for every step (fixed T, S, pages): the written cache
    exact, each sequence's rows against the reference, padding rows 0; which q_len class
    (ragged_plan.classes) each length took."""
    hq, hkv = cfg.heads
    page = cfg.page
    s_cap = max(len(s.qo) for s in steps) + 1           # + a padding sequence
    t_cap = max(int(s.qo.sum()) for s in steps) + 3      # + padding rows
    pps = max(int(np.max(-(-s.kv // page))) for s in steps)
    cache = PagedCache(rng, _num_pages(steps, page), page, hkv, cfg.layout)
    problem = dispatch.Problem("prefill", hq, hkv, GRID.head_dim, "paged", page, cfg.layout,
                               interpret=_backend.use_interpret())
    long_impl = dispatch.ragged_long_impl(problem, "auto", GRID.dtype, GRID.dtype, False, 1.0)
    cells = max(1, (GRID.num_ctas or 2 * _backend.num_sms()) // hkv)  # (the classes' bounds do not depend on it)
    classes = ragged_plan.classes(t_cap, s_cap, cells, cfg.group, mixed=long_impl.name == "batch_mosaic")
    fn = _jit_counted(lambda *a: ji.ragged_paged_attention(*a, causal=cfg.causal, num_ctas=GRID.num_ctas))
    fails, taken = Failures(), set()
    for step in steps:
        what = f"ragged_paged_attention {cfg} {step} (long impl {long_impl.name})"
        n = len(step.qo)
        q_len, kv = step.qo.astype(np.int64), step.kv.astype(np.int64)
        npg = -(-kv // page)
        ids = rng.permutation(cache.num_pages).astype(np.int32)
        page_indices = rng.integers(0, cache.num_pages, (s_cap, pps)).astype(np.int32)  # unused entries: any page
        first = np.concatenate([[0], np.cumsum(npg)])
        for i in range(n):
            page_indices[i, :npg[i]] = ids[first[i]:first[i + 1]]
        cu = np.full(s_cap + 1, q_len.sum(), np.int32)
        cu[: n + 1] = np.concatenate([[0], np.cumsum(q_len)])
        kv_lens = np.zeros(s_cap, np.int32)
        kv_lens[:n] = kv
        n_decode = int(np.argmax(q_len != 1)) if np.any(q_len != 1) else n
        dist = np.array([n_decode, n_decode, n], np.int32)
        q, k_new, v_new = (_randn(rng, (t_cap, h, GRID.head_dim)) for h in (hq, hkv, hkv))
        want_k, want_v = cache.k.copy(), cache.v.copy()
        for i in range(n):
            for j in range(q_len[i]):
                pos = kv[i] - q_len[i] + j
                pg, slot = page_indices[i, pos // page], pos % page
                idx = (pg, slice(None), slot) if cfg.layout == "HND" else (pg, slot)
                want_k[idx], want_v[idx] = k_new[cu[i] + j], v_new[cu[i] + j]
        last_page = [page_indices[i, npg[i] - 1] if npg[i] else 0 for i in range(n)]
        zero_written_tails(want_v, cfg.layout, cu[: n + 1], np.arange(n + 1), last_page, kv - (npg - 1) * page)
        for c in classes:
            if np.any((q_len >= c.min_q) & (q_len <= c.max_q)):
                taken.add((c.min_q, c.max_q, "prefill" if c.prefill else f"decode x{c.tokens_per_item}"))
        try:
            out, new_cache = fn(_dev(q), _dev(k_new), _dev(v_new), cache.cache,
                                jnp.asarray(kv_lens), jnp.asarray(page_indices.reshape(-1)), jnp.asarray(cu),
                                jnp.asarray(dist))
            out = np.asarray(out)
            for got, want, name in ((new_cache.k_pages, want_k, "k"), (new_cache.v_pages, want_v, "v")):
                if not np.array_equal(np.asarray(got), want):
                    fails.append(f"{what}: the written {name} cache differs from the scatter")
        except Exception as e:  # noqa: BLE001 - reported with the step
            fails.raised(what, e)
            continue
        for i in range(n):
            if q_len[i] == 0:
                continue
            rows = slice(cu[i], cu[i + 1])
            k, v = cache.keys(page_indices[i, :npg[i]], int(kv[i]), want_k, want_v)
            want_o, _ = reference(q[rows], k, v, _visible(int(q_len[i]), int(kv[i]), cfg.causal))
            fails.compare(f"{what} sequence {i} (q_len {q_len[i]}, kv_len {kv[i]})", out[rows], want_o)
        if np.any(out[cu[n]:] != 0):
            fails.append(f"{what}: padding rows are not 0")
    return fails, taken, classes, len(fn.traces)


@pytest.mark.parametrize("cfg", _with_slow(DEFAULT_RPA, SLOW_RPA), ids=str)
def test_ragged_paged_attention_boundaries(rng, cfg):
    fails, taken, classes, traces = run_rpa(cfg, rpa_steps(cfg, slow=False), rng)
    fails.check(f"ragged_paged_attention {cfg}")
    assert traces == 1
    assert {(c.min_q, c.max_q) for c in classes} == {t[:2] for t in taken}, (classes, taken)  # every class ran


@pytest.mark.slow
@pytest.mark.parametrize("cfg", full_rows(), ids=str)
def test_ragged_paged_attention_boundaries_full(rng, cfg):
    fails, taken, classes, traces = run_rpa(cfg, rpa_steps(cfg, slow=True), rng)
    fails.check(f"ragged_paged_attention {cfg}")
    assert {(c.min_q, c.max_q) for c in classes} == {t[:2] for t in taken}, (classes, taken)


# ---------------------------------------------------------------- batch decode
def decode_steps(cfg, slow):
    """Key lengths at the page and split edges, each alone (slow) or a few (default), and all of
    them in one batch with a request of no pages (kv_len 0)."""
    kvs = sorted(set(kv_choices(1, cfg.page)) | {cfg.page - 1, cfg.page, cfg.page + 1} - {0})
    alone = kvs if slow else kvs[cfg.pick % 3::3]
    steps = [Step("alone", np.ones(1, np.int64), np.array([k])) for k in alone]
    mixed = np.array(kvs + [0])[np.random.default_rng(cfg.page).permutation(len(kvs) + 1)]
    return steps + [Step("mixed", np.ones(len(mixed), np.int64), mixed)]


def run_decode(cfg, steps, rng):
    hq, hkv = cfg.heads
    bcap, num_pages = max(len(s.kv) for s in steps), _num_pages(steps, cfg.page)
    w = ji.BatchDecodeWithPagedKVCache(hq, hkv, GRID.head_dim, cfg.page, layout=cfg.layout, max_batch_size=bcap,
                                       max_num_pages=num_pages, num_ctas=GRID.num_ctas)
    cache = PagedCache(rng, num_pages, cfg.page, hkv, cfg.layout)
    run = _jit_counted(lambda q, c, p: w.run(q, c, p, return_lse=True))
    fails, seen = Failures(), set()
    for step in steps:
        what = f"BatchDecodeWithPagedKVCache {cfg} {step}"
        try:
            indptr, indices, last = cache.table(rng, step.kv)
            plan = w.plan(indptr, indices, last, num_pages=num_pages)
            seen.add(plan.impl)
            what += f" impl={plan.impl}"
            q = _randn(rng, (bcap, hq, GRID.head_dim))
            o, lse = (np.asarray(x) for x in run(_dev(q), cache.cache, plan))
        except Exception as e:  # noqa: BLE001
            fails.raised(what, e)
            continue
        for b, n in enumerate(step.kv):
            k, v = cache.keys(indices[indptr[b]:indptr[b + 1]], int(n))
            want_o, want_lse = reference(q[b:b + 1], k, v, np.ones((1, int(n)), bool))
            fails.compare(f"{what} request {b} (kv {n})", o[b:b + 1], want_o, lse[b:b + 1], want_lse)
        if np.any(o[len(step.kv):] != 0):
            fails.append(f"{what}: rows past the batch are not 0")
    return fails, seen, len(run.traces)


@pytest.mark.parametrize("cfg", _with_slow(DEFAULT_DECODE, SLOW_DECODE), ids=str)
def test_decode_boundaries(rng, cfg):
    fails, seen, traces = run_decode(cfg, decode_steps(cfg, slow=False), rng)
    fails.check(f"BatchDecodeWithPagedKVCache {cfg}")
    assert seen <= REACHABLE["BatchDecodeWithPagedKVCache"] and traces == 1


@pytest.mark.slow
@pytest.mark.parametrize("cfg", full_rows(causal=(True,)), ids=str)
def test_decode_boundaries_full(rng, cfg):
    fails, seen, _ = run_decode(cfg, decode_steps(cfg, slow=True), rng)
    fails.check(f"BatchDecodeWithPagedKVCache {cfg}")
    assert seen <= REACHABLE["BatchDecodeWithPagedKVCache"]



# ---------------------------------------------------------------- other head dims and groups
OTHER_HEADS = {3: (12, 4), 7: (28, 4), 16: (16, 1)}  # groups the grid above does not hold


@pytest.mark.slow
@pytest.mark.parametrize("head_dim, group, page, layout, causal", [
    (128, 3, 4, "NHD", True), (256, 16, 64, "HND", False), (64, 7, 32, "NHD", False)])
def test_boundaries_at_other_head_dims_and_groups(rng, monkeypatch, head_dim, group, page, layout, causal):
    """The paged and ragged prefill wrappers and the cascade (every length alone and mixed),
    ragged_paged_attention and decode at head dims 64-256 and groups 3, 7 and 16: the kernels'
    tiles and the classes' edges follow both."""
    monkeypatch.setitem(globals(), "GRID", dataclasses.replace(GRID, head_dim=head_dim))  # (runners read GRID, HEADS)
    monkeypatch.setitem(HEADS, group, OTHER_HEADS[group])
    cfg = Cfg(group, page, layout, causal)
    for entry in PAGED_PREFILL:
        fails, seen, _ = run_paged_prefill(entry, cfg, paged_prefill_steps(entry, cfg, slow=True), rng, False)
        fails.check(f"{entry} {cfg} head_dim {head_dim}")
        assert seen <= REACHABLE[entry], seen
    fails, taken, classes, _ = run_rpa(cfg, rpa_steps(cfg, slow=False), rng)
    fails.check(f"ragged_paged_attention {cfg} head_dim {head_dim}")
    assert {(c.min_q, c.max_q) for c in classes} == {t[:2] for t in taken}, (classes, taken)
    check_decode_ragged_and_cascade(cfg, rng, f" head_dim {head_dim}")


@pytest.mark.parametrize("head_dim, group, page, layout, causal", [
    (96, 2, 16, "NHD", True), (80, 1, 8, "HND", False)])
def test_boundaries_at_head_dims_triton_pads(rng, monkeypatch, head_dim, group, page, layout, causal):
    """Head dims that are not powers of two (Phi-3's 96, 80): the Triton kernels read q, K and V
    in tiles padded with zero columns (q and K of a multiple of 16 in column blocks) and store
    only the real columns. The paged prefill wrappers, ragged_paged_attention, decode, ragged
    prefill and the cascade, every length alone and mixed."""
    monkeypatch.setitem(globals(), "GRID", dataclasses.replace(GRID, head_dim=head_dim))
    check_every_entry(Cfg(group, page, layout, causal), rng, f" head_dim {head_dim}")


def check_every_entry(cfg, rng, label, paged_only=False):
    """The paged prefill wrappers on cfg's row (the default steps), then (unless paged_only)
    ragged_paged_attention, decode, ragged prefill and the cascade, each checked."""
    for entry in PAGED_PREFILL:
        fails, _, _ = run_paged_prefill(entry, cfg, paged_prefill_steps(entry, cfg, slow=False), rng, False)
        fails.check(f"{entry} {cfg}{label}")
    if not paged_only:
        fails, _, _, _ = run_rpa(cfg, rpa_steps(cfg, slow=False), rng)
        fails.check(f"ragged_paged_attention {cfg}{label}")
        check_decode_ragged_and_cascade(cfg, rng, label)


def check_decode_ragged_and_cascade(cfg, rng, label=""):
    """Decode, ragged prefill and the two-level cascade on cfg's row, each checked."""
    fails, _, _ = run_decode(cfg, decode_steps(cfg, slow=False), rng)
    fails.check(f"BatchDecodeWithPagedKVCache {cfg}{label}")
    fails, _, _ = run_ragged(cfg, ragged_steps(cfg, slow=True), rng)
    fails.check(f"BatchPrefillWithRaggedKVCache {cfg}{label}")
    fails, _, _ = run_cascade(cfg, cascade_steps(cfg, slow=True), rng)
    fails.check(f"MultiLevelCascadeAttention {cfg}{label}")

# ---------------------------------------------------------------- ragged (contiguous) K/V prefill
def _ragged_plan(w, step, kcap):
    """Plans with a trailing qo_len 0 request holding the keys up to kcap (plans are specialized
    on the K/V rows: one program per tile height)."""
    qo = np.append(step.qo, 0)
    kv = np.append(step.kv, kcap - int(step.kv.sum()))
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv)]).astype(np.int32)
    return w.plan(qo_indptr, kv_indptr), qo_indptr, kv_indptr


def ragged_steps(cfg, slow):
    """Every length alone (slow; in default those of the classes holding impl_edges' lengths:
    none, every step is prefill_triton) and all of them mixed in one step (one tile height)."""
    steps = alone_steps(cfg.group, 1, kv_index=cfg.pick)
    if not slow:
        hq, hkv = cfg.heads
        w = ji.BatchPrefillWithRaggedKVCache(hq, hkv, GRID.head_dim, causal=cfg.causal, num_ctas=GRID.num_ctas)
        plans = [_ragged_plan(w, s, int(s.kv.sum()))[0] for s in steps]
        steps = select_alone(steps, plans, impl_edges(steps, plans))
    return steps + [mixed_step(cfg.group, 1, kv_index=cfg.pick)]


def run_ragged(cfg, steps, rng):
    hq, hkv = cfg.heads
    tcap, kcap = max(int(s.qo.sum()) for s in steps) + 3, max(int(s.kv.sum()) for s in steps) + 1
    w = ji.BatchPrefillWithRaggedKVCache(hq, hkv, GRID.head_dim, causal=cfg.causal, num_ctas=GRID.num_ctas,
                                         max_num_tokens=tcap,
                                         max_batch_size=max(len(s.qo) for s in steps) + 1)
    run = _jit_counted(lambda q, k, v, p: w.run(q, k, v, p, return_lse=True))
    fails, seen = Failures(), set()
    for step in steps:
        what = f"BatchPrefillWithRaggedKVCache {cfg} {step}"
        try:
            plan, qo_indptr, kv_indptr = _ragged_plan(w, step, kcap)
            seen.add(plan.impl)
            what += f" impl={plan.impl} {_route(plan)}"
            q, k, v = (_randn(rng, (n, h, GRID.head_dim)) for n, h in ((tcap, hq), (kcap, hkv), (kcap, hkv)))
            o, lse = (np.asarray(x) for x in run(_dev(q), _dev(k), _dev(v), plan))
        except Exception as e:  # noqa: BLE001
            fails.raised(what, e)
            continue
        for b in range(len(step.qo)):
            r0, r1, k0, k1 = qo_indptr[b], qo_indptr[b + 1], kv_indptr[b], kv_indptr[b + 1]
            if r1 > r0:
                want_o, want_lse = reference(q[r0:r1], k[k0:k1], v[k0:k1], _visible(r1 - r0, k1 - k0, cfg.causal))
                fails.compare(f"{what} request {b} (qo {r1 - r0}, kv {k1 - k0})", o[r0:r1], want_o, lse[r0:r1],
                              want_lse)
        if np.any(o[qo_indptr[-1]:] != 0):
            fails.append(f"{what}: rows past the step are not 0")
    return fails, seen, len(run.traces)


@pytest.mark.parametrize("cfg", DEFAULT_RAGGED, ids=str)
def test_ragged_kv_prefill_boundaries(rng, cfg):
    fails, seen, _ = run_ragged(cfg, ragged_steps(cfg, slow=False), rng)
    fails.check(f"BatchPrefillWithRaggedKVCache {cfg}")
    assert seen <= REACHABLE["BatchPrefillWithRaggedKVCache"]


@pytest.mark.slow
@pytest.mark.parametrize("cfg", full_rows(layouts=("NHD",), pages=(1,)), ids=str)
def test_ragged_kv_prefill_boundaries_full(rng, cfg):
    fails, seen, _ = run_ragged(cfg, ragged_steps(cfg, slow=True), rng)
    fails.check(f"BatchPrefillWithRaggedKVCache {cfg}")
    assert seen <= REACHABLE["BatchPrefillWithRaggedKVCache"]


# ---------------------------------------------------------------- block-sparse
def bsr_case(rng, group, rows, cols):
    """Two row blocks of `rows` query rows over column blocks of `cols` keys: the first lists every
    column block (keys past the prefill split edge), the second a random half, with in-block masks."""
    ncb = -(-(max(SPLIT_TOKENS) + 1) // cols)
    m, n = 2 * rows, ncb * cols
    second = np.sort(rng.permutation(ncb)[: max(1, ncb // 2)])
    indices = np.concatenate([rng.permutation(ncb), second]).astype(np.int32)
    indptr = np.array([0, ncb, ncb + len(second)], np.int32)
    mask = rng.random((len(indices), rows, cols)) < 0.8
    return ji.BlockSparseMatrix(indptr, indices, (rows, cols), (m, n), block_mask=mask)


def run_bsr(group, rows, cols, rng):
    hq, hkv = HEADS[group]
    bsr = bsr_case(rng, group, rows, cols)
    m, n = bsr.shape
    w = ji.BlockSparseAttention(hq, hkv, GRID.head_dim, num_ctas=GRID.num_ctas)
    fails = Failures()
    what = f"BlockSparseAttention g{group}({hq}/{hkv}) R={rows} C={cols} M={m} N={n}"
    try:
        plan = w.plan(bsr)
        what += f" impl={plan.impl} {_route(plan)}"
        q, k, v = (_randn(rng, (r, h, GRID.head_dim)) for r, h in ((m, hq), (n, hkv), (n, hkv)))
        o, lse = (np.asarray(x) for x in w.run(_dev(q), _dev(k), _dev(v), plan, return_lse=True))
    except Exception as e:  # noqa: BLE001
        fails.raised(what, e)
        return fails, None
    dense = np.asarray(bsr.to_dense_mask())
    for b in range(2):  # each row block on its own
        r = slice(b * rows, (b + 1) * rows)
        want_o, want_lse = reference(q[r], k, v, dense[r])
        fails.compare(f"{what} row block {b}", o[r], want_o, lse[r], want_lse)
    return fails, plan.impl


def bsr_rows(group):
    """Block heights at the tile-rows edges (BlockSparseAttention is Triton-only)."""
    return [n for n, kinds in edge_classes(group).items() if "tile_rows" in kinds]


BSR_DEFAULT = [(1, 16, 1)]  # (group, R, C): R at 16-row tiles' edge (16 x 1), single-key column blocks
BSR_SLOW = [(6, 6, 16)]    # 32 // 6 + 1 rows: a 64-row tile


@pytest.mark.parametrize("group, rows, cols", _with_slow(BSR_DEFAULT, BSR_SLOW))
def test_block_sparse_boundaries(rng, group, rows, cols):
    assert rows in bsr_rows(group)
    fails, impl = run_bsr(group, rows, cols, rng)
    fails.check("BlockSparseAttention")
    assert impl in REACHABLE["BlockSparseAttention"]


@pytest.mark.slow
@pytest.mark.parametrize("group, rows, cols", [(g, r, c) for g in GROUPS for r in bsr_rows(g) for c in PAGE_SIZES])
def test_block_sparse_boundaries_full(rng, group, rows, cols):
    fails, impl = run_bsr(group, rows, cols, rng)
    fails.check("BlockSparseAttention")
    assert impl in REACHABLE["BlockSparseAttention"]


# ---------------------------------------------------------------- cascade
def cascade_steps(cfg, slow):
    """Requests in consecutive groups of three that share `shared` leading pages (level 0), each
    with its own suffix (level 1) of at least its query length (causal: the prefix lies before
    every query); all of the group's lengths in one step, and in slow each length in a group of
    two requests."""
    lengths = list(q_lengths(cfg.group)) + [0, 0]  # (two requests without queries)
    kv = [_kv_for(max(n, 1), cfg.page, cfg.pick + i) for i, n in enumerate(lengths)]
    steps = [Step("mixed", np.array(lengths), np.array(kv))]
    if slow:
        steps += [Step("alone", np.array([n, n]), np.array([_kv_for(n, cfg.page, i), _kv_for(n, cfg.page, i + 1)]))
                  for i, n in enumerate(lengths)]
    return steps


def _cascade_table(rng, step, page, num_pages, per_group=3, shared=2):
    """(kv_indptr, kv_indices, last, kv_lens): request b = its group's shared pages + own suffix."""
    ids = iter(rng.permutation(num_pages).tolist())
    indices, lens, indptr = [], [], [0]
    for g0 in range(0, len(step.qo), per_group):
        prefix = [next(ids) for _ in range(shared)]
        for b in range(g0, min(g0 + per_group, len(step.qo))):
            own = int(step.kv[b])
            indices += prefix + [next(ids) for _ in range(-(-own // page))]
            lens.append(shared * page + own)
            indptr.append(len(indices))
    lens = np.array(lens)
    npg = np.diff(indptr)
    last = (lens - (npg - 1) * page).astype(np.int32)
    return np.array(indptr, np.int32), np.array(indices, np.int32), last, lens


def run_cascade(cfg, steps, rng):
    hq, hkv = cfg.heads
    num_pages = sum(int(np.sum(-(-s.kv // cfg.page))) + 2 * len(s.qo) for s in steps) + 4
    tcap = max(int(s.qo.sum()) for s in steps) + 3
    w = ji.MultiLevelCascadeAttention(2, hq, hkv, GRID.head_dim, cfg.page, causal=cfg.causal, layout=cfg.layout,
                                      max_batch_size=max(len(s.qo) for s in steps), max_num_tokens=tcap,
                                      max_num_pages=num_pages, num_ctas=GRID.num_ctas)
    cache = PagedCache(rng, num_pages, cfg.page, hkv, cfg.layout)
    run = _jit_counted(lambda q, c, p: w.run(q, c, p, return_lse=True))
    fails, seen = Failures(), set()
    for step in steps:
        what = f"MultiLevelCascadeAttention {cfg} {step} (kv: own suffix past 2 shared pages)"
        try:
            indptr, indices, last, kv = _cascade_table(rng, step, cfg.page, num_pages)
            qo_indptr = np.concatenate([[0], np.cumsum(step.qo)]).astype(np.int32)
            levels, saved = ji.two_level_cascade(qo_indptr, indptr, indices, last, cfg.page, causal=cfg.causal)
            plan = w.plan(levels, num_pages=num_pages)
            seen.add(plan.impl)
            what += f" impl={plan.impl} saved_pages={saved}"
            q = _randn(rng, (tcap, hq, GRID.head_dim))
            o, lse = (np.asarray(x) for x in run(_dev(q), cache.cache, plan))
        except Exception as e:  # noqa: BLE001
            fails.raised(what, e)
            continue
        for b in range(len(step.qo)):
            r0, r1 = qo_indptr[b], qo_indptr[b + 1]
            if r1 == r0:
                continue
            k, v = cache.keys(indices[indptr[b]:indptr[b + 1]], int(kv[b]))
            want_o, want_lse = reference(q[r0:r1], k, v, _visible(r1 - r0, int(kv[b]), cfg.causal))
            fails.compare(f"{what} request {b} (qo {r1 - r0}, kv {kv[b]})", o[r0:r1], want_o, lse[r0:r1], want_lse)
    return fails, seen, len(run.traces)


@pytest.mark.parametrize("cfg", DEFAULT_CASCADE, ids=str)
def test_cascade_boundaries(rng, cfg):
    fails, seen, _ = run_cascade(cfg, cascade_steps(cfg, slow=False), rng)
    fails.check(f"MultiLevelCascadeAttention {cfg}")
    assert seen <= REACHABLE["MultiLevelCascadeAttention"]


@pytest.mark.slow
@pytest.mark.parametrize("cfg", full_rows(), ids=str)
def test_cascade_boundaries_full(rng, cfg):
    fails, seen, _ = run_cascade(cfg, cascade_steps(cfg, slow=True), rng)
    fails.check(f"MultiLevelCascadeAttention {cfg}")
    assert seen <= REACHABLE["MultiLevelCascadeAttention"]


# ---------------------------------------------------------------- single request
def run_single(group, qo, kv, causal, rng):
    hq, hkv = HEADS[group]
    q, k, v = (_randn(rng, (n, h, GRID.head_dim)) for n, h in ((qo, hq), (kv, hkv), (kv, hkv)))
    fails = Failures()
    what = (f"single_prefill_with_kv_cache g{group}({hq}/{hkv}) qo={qo} kv={kv} causal={causal} "
            f"(tile rows {prefill_planner.choose_tile_rows(np.array([qo]), group)})")
    try:
        o, lse = (np.asarray(x) for x in ji.single_prefill_with_kv_cache(
            _dev(q), _dev(k), _dev(v), causal=causal, return_lse=True))
    except Exception as e:  # noqa: BLE001
        fails.raised(what, e)
        return fails
    want_o, want_lse = reference(q, k, v, _visible(qo, kv, causal))
    fails.compare(what, o, want_o, lse, want_lse)
    return fails


SINGLE_DEFAULT = [(1, 17, 513, True), (5, 26, 256, False)]  # 16 | 17 rows; 128 // 5 + 1: two tiles


@pytest.mark.parametrize("group, qo, kv, causal", SINGLE_DEFAULT)
def test_single_prefill_boundaries(rng, group, qo, kv, causal):
    assert qo in edge_classes(group)
    run_single(group, qo, kv, causal, rng).check("single_prefill_with_kv_cache")


SINGLE_FULL = [(g, n, c) for g in GROUPS for n, kinds in edge_classes(g).items() if "tile_rows" in kinds
               for c in CAUSAL]


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(SINGLE_FULL)))
def test_single_prefill_boundaries_full(rng, i):
    group, qo, causal = SINGLE_FULL[i]  # (one compile per shape: one key length each, rotating)
    run_single(group, qo, _kv_for(qo, 16, i), causal, rng).check("single_prefill_with_kv_cache")


# ---------------------------------------------------------------- planning only (no kernels)
@pytest.mark.parametrize("group", GROUPS)
def test_plan_boundaries(group):
    """Every query length at every boundary of this group, alone and mixed, every page size and
    causal: the plans route as the rule says (short requests on the decode kernel's items of
    short_tokens' size, the others on prefill tiles of choose_tile_rows' height), for
    BatchAttention and BatchPrefillWithPagedKVCache. Host NumPy only."""
    rng = np.random.default_rng(group)
    cap = batch_planner.short_cap(group)
    for page, causal, entry in itertools.product(PAGE_SIZES, CAUSAL, PAGED_PREFILL):
        cfg = Cfg(group, page, "NHD", causal)
        w, table = make_paged_wrapper(entry, cfg), _HostTable(page)
        for i, step in enumerate(alone_steps(group, page, kv_index=page) + [mixed_step(group, page, kv_index=page)]):
            plan, _ = _plan_paged(w, table, rng, step)
            what = (entry, str(cfg), str(step), plan.impl)
            assert plan.impl == expected_impl(entry, group, step.qo, step.kv, causal, w.problem), what
            short = step.qo <= cap
            longs = step.qo[~short]
            if plan.impl == "prefill_triton" and entry != "BatchAttention":
                assert plan.layout.rows == prefill_planner.choose_tile_rows(step.qo, group), what
            if entry == "BatchAttention":
                tokens, is_short = batch_planner.short_tokens(step.qo, group)
                np.testing.assert_array_equal(is_short, short)
                assert plan.info["num_short"] == np.count_nonzero(short & (step.qo > 0)), what
                if plan.has_short and plan.info["num_short"]:
                    assert plan.layout.tokens_per_item == tokens >= step.qo[short].max(), what
                if len(longs):
                    assert plan.long.layout.rows == prefill_planner.choose_tile_rows(longs, group), what
                    assert plan.info["num_long_tokens"] == longs.sum(), what
            elif plan.impl == "prefill_short":
                assert plan.layout.tokens_per_item == batch_planner.short_tokens(step.qo, group)[0], what


def _default_grid_plans():
    """(entry, plan.impl) of every step the default kernel tests plan (no kernels run)."""
    rng = np.random.default_rng(0)
    for entry, cfg in DEFAULT_PAGED:
        w, table = make_paged_wrapper(entry, cfg), _HostTable(cfg.page)
        for step in paged_prefill_steps(entry, cfg, slow=False):
            yield entry, _plan_paged(w, table, rng, step)[0].impl
    for cfg in DEFAULT_DECODE:
        w = ji.BatchDecodeWithPagedKVCache(*cfg.heads, GRID.head_dim, cfg.page, num_ctas=GRID.num_ctas)
        for step in decode_steps(cfg, slow=False):
            table = _HostTable(cfg.page).table(rng, step.kv)
            yield "BatchDecodeWithPagedKVCache", w.plan(*table, num_pages=1 << 14).impl
    for cfg in DEFAULT_RAGGED:
        w = ji.BatchPrefillWithRaggedKVCache(*cfg.heads, GRID.head_dim, causal=cfg.causal, num_ctas=GRID.num_ctas)
        for step in ragged_steps(cfg, slow=False):
            yield "BatchPrefillWithRaggedKVCache", _ragged_plan(w, step, int(step.kv.sum()))[0].impl
    for group, rows, cols in BSR_DEFAULT:
        bsa = ji.BlockSparseAttention(*HEADS[group], GRID.head_dim)
        yield "BlockSparseAttention", bsa.plan(bsr_case(rng, group, rows, cols)).impl
    for cfg in DEFAULT_CASCADE:
        w = ji.MultiLevelCascadeAttention(2, *cfg.heads, GRID.head_dim, cfg.page, causal=cfg.causal,
                                          num_ctas=GRID.num_ctas)
        for step in cascade_steps(cfg, slow=False):
            indptr, indices, last, _ = _cascade_table(rng, step, cfg.page, 1 << 14)
            qo_indptr = np.concatenate([[0], np.cumsum(step.qo)]).astype(np.int32)
            levels, _ = ji.two_level_cascade(qo_indptr, indptr, indices, last, cfg.page, causal=cfg.causal)
            yield "MultiLevelCascadeAttention", w.plan(levels, num_pages=1 << 14).impl


def test_default_grid_reaches_every_impl():
    """The default grid's steps reach every plan.impl the CPU can reach with impl="auto" (REACHABLE,
    from dispatch's table: the Mosaic rows need a compiled Hopper GPU), and nothing else: in
    particular no BatchAttention step runs a long request on the short path ("+prefill_short")."""
    seen = collections.defaultdict(set)
    for entry, impl in _default_grid_plans():
        seen[entry].add(impl)
    assert dict(seen) == REACHABLE
    problem = make_paged_wrapper("BatchPrefillWithPagedKVCache", Cfg(2)).problem
    assert set(dispatch.supported(problem)) == REACHABLE["BatchPrefillWithPagedKVCache"]


def test_edges_follow_the_constants():
    """The grid's lengths come from the planners' constants: every group crosses its own short/long
    cut, every SHORT_TOKENS choice below it, every tile height and ragged class."""
    for group in GROUPS:
        edges = edge_classes(group)
        cap = batch_planner.short_cap(group)
        assert {cap, cap + 1} <= set(edges) and all("short_cut" in edges[n] for n in (cap - 1, cap, cap + 1))
        for rows in prefill_planner.TILE_ROWS:  # n tokens fit the tile, n + 1 need the next (or two)
            n = rows // group
            assert {n, n + 1} <= set(edges)
            assert prefill_planner.choose_tile_rows(np.array([n]), group) <= rows
            if rows < prefill_planner.TILE_ROWS[-1]:
                assert prefill_planner.choose_tile_rows(np.array([n + 1]), group) > rows
        for c in ragged_plan.classes(1 << 12, 64, 4, group):
            assert (c.tokens_per_item if c.prefill else c.max_q) + 1 in edges


# ---------------------------------------------------------------- RPA v3's fused cache
FUSED_ROWS = [Cfg(g, 16, "NHD_FUSED", c, pick=g) for g in GROUPS for c in CAUSAL]


@pytest.mark.slow
@pytest.mark.parametrize("cfg", FUSED_ROWS, ids=str)
def test_fused_layout_boundaries(rng, cfg):
    """Every paged entry point on RPA v3's fused cache (NHD_FUSED: K and V of a slot in one array),
    read and written in place: the paged wrappers, ragged_paged_attention, decode and cascade."""
    for entry in PAGED_PREFILL:
        fails, _, _ = run_paged_prefill(entry, cfg, paged_prefill_steps(entry, cfg, slow=True), rng, False)
        fails.check(f"{entry} {cfg}")
    fails, _, _, _ = run_rpa(cfg, rpa_steps(cfg, slow=True), rng)
    fails.check(f"ragged_paged_attention {cfg}")
    fails, _, _ = run_decode(cfg, decode_steps(cfg, slow=False), rng)
    fails.check(f"BatchDecodeWithPagedKVCache {cfg}")
    fails, _, _ = run_cascade(cfg, cascade_steps(cfg, slow=False), rng)
    fails.check(f"MultiLevelCascadeAttention {cfg}")


# ---------------------------------------------------------------- on a GPU
# The grid at dispatch's GPU defaults (-m gpu, on a GPU machine): bfloat16, head_dim 128, dispatch's
# own grids, each paged wrapper told the dtypes or not (BatchAttention's mixed launch needs them),
# and the Mosaic kernels forced where they run (NHD, pages of 8 or 16 rows): impl="mosaic" for the
# prefill wrapper, impl="mixed" for BatchAttention. The routes are dispatch's (the CPU's rule does
# not hold: the Mosaic rows join), so only the outputs are checked.
GPU_GRID = Grid(dtype=jnp.bfloat16, head_dim=128, num_ctas=None, told=True, tol=TOL[jnp.bfloat16], lse_tol=3e-2,
                cpu_routes=False)
GPU_ROWS = [pairwise_row(i) for i in range(len(GROUPS))]  # each group once; pages 1, 8, 16; NHD, HND; causal, not
MOSAIC_ROWS = [Cfg(g, 16, "NHD", True, pick=g) for g in GROUPS if g != 6] + [pairwise_row(2), pairwise_row(4)]
GPU_FUSED_ROWS = [row for row in FUSED_ROWS if row.group in (1, 4, 8)]  # RPA v3's cache (not yet run on a GPU)
GPU_PAGED = ([(entry, "auto", False, told, cfg) for entry in PAGED_PREFILL for told in (False, True)
              for cfg in GPU_ROWS]
             + [("BatchAttention", "auto", True, True, cfg) for cfg in GPU_ROWS]
             + [(entry, impl, fixed, True, cfg) for entry, impl, fixed in (
                 ("BatchPrefillWithPagedKVCache", "mosaic", False), ("BatchAttention", "mixed", False),
                 ("BatchAttention", "mixed", True)) for cfg in MOSAIC_ROWS + GPU_FUSED_ROWS])


def _on_gpu(monkeypatch, told=True):
    assert jax.default_backend() == "gpu", "-m gpu runs the grid on a GPU"
    monkeypatch.setitem(globals(), "GRID", dataclasses.replace(GPU_GRID, told=told))


@pytest.mark.gpu
@pytest.mark.parametrize("entry, impl, fixed, told, cfg", GPU_PAGED, ids=str)
def test_gpu_paged_boundaries(rng, monkeypatch, entry, impl, fixed, told, cfg):
    _on_gpu(monkeypatch, told)
    steps = paged_prefill_steps(entry, cfg, slow=True)
    fails, _, compiles = run_paged_prefill(entry, cfg, steps, rng, fixed, impl)
    fails.check(f"{entry} impl={impl} {cfg} fixed={fixed} told={told}")
    assert compiles == 1 or not fixed, compiles


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", GPU_ROWS + MOSAIC_ROWS[:-2] + GPU_FUSED_ROWS, ids=str)
def test_gpu_rpa_boundaries(rng, monkeypatch, cfg):
    """ragged_paged_attention: its mixed launch on Hopper where the cache is NHD or NHD_FUSED with
    pages of 8 or 16 rows (MOSAIC_ROWS' five causal rows and the fused ones: not yet run on a
    GPU), Triton elsewhere."""
    _on_gpu(monkeypatch)
    fails, taken, classes, traces = run_rpa(cfg, rpa_steps(cfg, slow=False), rng)
    fails.check(f"ragged_paged_attention {cfg}")
    assert traces == 1 and {(c.min_q, c.max_q) for c in classes} == {t[:2] for t in taken}, (classes, taken)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", GPU_ROWS, ids=str)
def test_gpu_decode_ragged_and_cascade_boundaries(rng, monkeypatch, cfg):
    """Decode, ragged prefill and (not yet run on a GPU) the two-level cascade."""
    _on_gpu(monkeypatch)
    check_decode_ragged_and_cascade(cfg, rng)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, group, page, layout, causal", [
    (96, 2, 16, "NHD", True), (80, 1, 8, "HND", False), (96, 4, 1, "HND", True), (72, 8, 16, "NHD", False),
    (192, 1, 16, "NHD", True)])
def test_gpu_boundaries_at_head_dims_triton_pads(rng, monkeypatch, head_dim, group, page, layout, causal):
    """test_boundaries_at_head_dims_triton_pads compiled: 96 (Phi-3), 80 and 72 in the Triton
    kernels' padded tiles; 192 padded to 256 in Triton's, whole in the Mosaic kernels' (which take
    multiples of 64 only). The paged wrappers told their dtypes and not."""
    for told in (False, True):
        _on_gpu(monkeypatch, told)
        monkeypatch.setitem(globals(), "GRID", dataclasses.replace(GRID, head_dim=head_dim))
        check_every_entry(Cfg(group, page, layout, causal), rng, f" head_dim {head_dim} told={told}",
                          paged_only=not told)
