"""Where a Llama decode step's time goes: ITL of variants and a breakdown from a profiler trace.

    PYTHONPATH=. python3 benchmarks/profile_e2e.py                      # one H100: Llama-3-8B shapes, batch 1
    PYTHONPATH=. python3 benchmarks/profile_e2e.py --batches 1,64 --variants unroll,cudnn --trace unroll,cudnn
    PYTHONPATH=. python3 benchmarks/profile_e2e.py --smoke              # tiny model on CPU (checks the script)

The decode step of examples/llama.py (greedy, the cache donated), random bfloat16 weights,
context lengths uniform on --context-len, caches filled with random values. Three parts,
printed in this order, tables last:

1. Weight copies in the compiled step, per layer loop: instructions outside fusions that write
   an array shaped like one layer's weight (or the stacked weights), i.e. a materialized
   dynamic-slice/copy before a matmul, counted per step (a while body's count times its trip
   count) with their bytes.
2. Variants, each compiled (time printed) and run for --steps steps, --repeats times, ITL =
   interval between successive steps' tokens reaching the host (p50 of each repeat, their
   median and spread, mean, p90, max): unroll (jaxinfer paged attention, the default step:
   the decode kernel appends the step's K/V); scatter (the K/V appended by
   append_paged_kv_cache, a scatter per cache, before the decode kernel); sync (each step's tokens reach the host before the next is planned and launched);
   no-attention (q + K + V in place of attention and the cache write: attention's cost by
   difference); sampled (Gumbel sampling at temperature 1 instead of greedy argmax); scan
   (stacked weights in one lax.scan); cudnn and dense (the baselines of bench_e2e.py:
   DenseAttention over a dense padded cache [B, S, Hkv, D] per layer, S = longest context +
   the steps run, jax.nn.dot_product_attention(implementation="cudnn") or plain jnp).
3. For the variants in --trace: --trace-steps steps under jax.profiler.trace(create_perfetto_trace
   =True); device kernel time per step by category: matmul; attention split into the attention
   kernel (jaxinfer's decode kernel, cuDNN's fused attention, the jnp einsums), the split-KV
   merge, the KV append (scatters into the cache) and other attention work (index math,
   copies, transposes, pads); sampling; copies/slices; other fusions (norms, RoPE, residuals,
   embedding); H2D copies (the step's plan and inputs) and other memcpy/memset; busy = union of
   all device intervals, idle = traced ITL - busy, with the gaps between device work binned
   by length; each attention kernel's launches and µs per step; the host's plan + device_put
   time per step, measured around the call. Categories come from the kernel's HLO instruction
   (event arg hlo_op) looked up in the compiled HLO for its op_name (the model's
   jax.named_scope: qkv_proj, attention, o_proj, mlp, lm_head, sampling) and its fused
   computation's root opcode, and from kernel-name patterns. XLA turns off command buffers
   (CUDA graphs) while profiling, so the traced ITL can exceed the untraced one: idle
   includes that launch overhead.

Results go to $OUT/profile_e2e.json (OUT defaults to ./out), traces to
$OUT/profile_trace/b<batch>_<variant>.
"""
import argparse
import collections
import dataclasses
import functools
import glob
import gzip
import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxinfer as ji
from planner.allocator import PageAllocator, page_table, pad

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import generate  # noqa: E402
import llama  # noqa: E402

VARIANTS = ("unroll", "scatter", "sync", "no-attention", "sampled", "scan", "cudnn", "dense")
DENSE = {"cudnn": "cudnn", "dense": "jnp"}  # variant -> DenseAttention impl
ATTENTION = ("attention kernel", "split-KV merge", "KV append", "attention other")
CATEGORIES = ("matmul", *ATTENTION, "sampling", "copies/slices", "other fusions", "H2D", "other memcpy")
GAP_BINS_US = (2.0, 5.0, 20.0, 100.0)  # idle gaps binned at these bounds (µs)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny float32 model, short contexts, few steps (CPU)")
    ap.add_argument("--batches", default=None,
                    help="comma-separated batch sizes, each run in turn (default 1; smoke 2)")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the config's")
    ap.add_argument("--context-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                    help="KV lengths at the first step, uniform on [MIN, MAX] (default 512 2048; smoke 8 24)")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps per repeat (default 64; smoke 4)")
    ap.add_argument("--repeats", type=int, default=1, help="timed repeats of --steps steps per variant")
    ap.add_argument("--trace-steps", type=int, default=None,
                    help="decode steps under the profiler per traced variant (default 16; smoke 3)")
    ap.add_argument("--variants", default="unroll,sync,no-attention,sampled,scan",
                    help=f"comma-separated variants to time, drawn from {','.join(VARIANTS)} "
                         "(default all but cudnn and dense)")
    ap.add_argument("--trace", default="unroll,scan",
                    help="comma-separated variants to trace (of those timed; empty: none)")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per KV cache page")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights, lengths and tokens")
    args = ap.parse_args(argv)
    args.config = "tiny" if args.smoke else "llama3-8b"
    args.batches = [int(b) for b in (args.batches or ("2" if args.smoke else "1")).split(",")]
    args.context_len = args.context_len or ((8, 24) if args.smoke else (512, 2048))
    args.steps = args.steps or (4 if args.smoke else 64)
    args.trace_steps = args.trace_steps or (3 if args.smoke else 16)
    args.variants = [v for v in args.variants.split(",") if v]
    args.trace = [v for v in args.trace.split(",") if v]
    bad = [v for v in args.variants + args.trace if v not in VARIANTS]
    if bad:
        raise ValueError(f"--variants and --trace must be drawn from {VARIANTS}, got {bad}")
    if missing := [v for v in args.trace if v not in args.variants]:
        raise ValueError(f"--trace names variants that --variants leaves out: {missing}")
    for name in ("steps", "repeats", "trace_steps", "page_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.batches) < 1:
        raise ValueError(f"--batches must be >= 1, got {args.batches}")
    if not 1 <= args.context_len[0] <= args.context_len[1]:
        raise ValueError(f"--context-len must satisfy 1 <= MIN <= MAX, got {args.context_len}")
    return args


@functools.partial(jax.tree_util.register_dataclass, data_fields=[], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class NoAttention:
    """Stands in for attention: o = q + K + V of its group (keeps the K/V projections alive), cache untouched."""

    def __call__(self, layer, q, k, v, kv_cache):
        return q + jnp.repeat(k + v, q.shape[1] // k.shape[1], axis=1), kv_cache   # [N, Hq, D]


# --- weight copies in the compiled HLO ---------------------------------------------------------

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\(?([a-z0-9]+)\[([\d,]*)\][^\s]*\)?\s+([\w\-]+)\(")
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")  # unindented: a computation's header
_NOT_COPIES = {"parameter", "get-tuple-element", "bitcast", "tuple", "while", "constant", "call",
               "conditional", "custom-call"}


def hlo_instructions(hlo_text):
    """[(computation, name, dims tuple, opcode, line)] of an HLO module's text (array-shaped results)."""
    out, comp = [], None
    for line in hlo_text.splitlines():
        m = _COMP.match(line)
        if m:
            comp = m.group(1)
            continue
        m = _INSTR.match(line)
        if m and comp is not None:
            dims = tuple(int(d) for d in m.group(3).split(",") if d)
            out.append((comp, m.group(1), dims, m.group(4), line))
    return out


def weight_copies(hlo_text, cfg):
    """Materialized weight-sized arrays per step in a compiled module: dict(count, bytes, where).

    Counts instructions outside fused computations that are not parameters / bitcasts / tuples
    and produce an array shaped like one layer's weight ([1, ...] included) or the stacked
    [L, ...] weights; an instruction in a while body counts its known trip count times."""
    shapes = set()
    for shape, fan_in in llama.layer_param_shapes(cfg).values():
        if fan_in is not None:
            shapes |= {tuple(shape), (1, *shape), (cfg.num_layers, *shape)}
    fused = set(re.findall(r"calls=%?([\w.\-]+)", hlo_text))
    trips = {}
    for line in hlo_text.splitlines():
        m = re.search(r"\bwhile\(.*body=%?([\w.\-]+)", line)
        if m:
            n = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
            trips[m.group(1)] = int(n.group(1)) if n else 1
    itemsize = jnp.dtype(cfg.dtype).itemsize
    count, nbytes, where = 0, 0, collections.Counter()
    for comp, name, dims, opcode, _ in hlo_instructions(hlo_text):
        if comp in fused or opcode in _NOT_COPIES or dims not in shapes:
            continue
        times = trips.get(comp, 1)
        count += times
        nbytes += times * int(np.prod(dims)) * itemsize
        where[f"{opcode} {list(dims)}" + (f" x{times} (loop body)" if times > 1 else "")] += 1
    return dict(count=count, bytes=nbytes, where=dict(where))


# --- trace breakdown ---------------------------------------------------------------------------

def op_info(hlo_text):
    """{instruction name: (op_name metadata, opcode)} of a compiled module's text; a fusion's
    opcode is its fused computation's root opcode (followed through nested fusions)."""
    roots, calls, info, comp = {}, {}, {}, None
    for line in hlo_text.splitlines():
        m = _COMP.match(line)
        if m:
            comp = m.group(1)
            continue
        m = re.match(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([\w\-]+)\(", line)
        if not m:
            continue
        name, opcode = m.group(2), m.group(3)
        if m.group(1) and comp is not None:
            roots[comp] = name
        called = re.search(r"calls=%?([\w.\-]+)", line)
        if called and opcode == "fusion":
            calls[name] = called.group(1)
        op_name = re.search(r'\bop_name="([^"]*)"', line)
        info[name] = (op_name.group(1) if op_name else "", opcode)

    def root_opcode(name, depth=0):
        opcode = info.get(name, ("", ""))[1]
        if opcode == "fusion" and name in calls and depth < 8:
            return root_opcode(roots.get(calls[name], ""), depth + 1)
        return opcode

    return {_norm(name): (op_name, root_opcode(name)) for name, (op_name, _) in info.items()}


def _norm(name):
    """An HLO instruction name as the trace spells it (fusion.12 -> fusion_12)."""
    return re.sub(r"[.\-]", "_", name)


def classify(kernel, hlo_op, op_name, opcode):
    """The category of one device event: kernel name, its HLO instruction, that instruction's
    op_name and (fusion root) opcode."""
    text = f"{kernel} {hlo_op}".lower()
    scopes = op_name.split("/")
    if re.search(r"memcpy|memset", text):
        return "H2D" if re.search(r"h2d|htod", text) else "other memcpy"
    if "merge_varlen" in text or "merge_pair" in text:
        return "split-KV merge"
    if re.search(r"paged_decode|jaxinfer_|cudnn|fmha|flash|sdpa", text):
        return "attention kernel"
    if not op_name and re.search(r"scatter|dynamic[-_]update[-_]slice", text):
        return "KV append"  # no scope to go by (the step's only scatters write the KV cache)
    if "attention" in scopes:
        if opcode in ("scatter", "dynamic-update-slice") or "scatter" in text:
            return "KV append"
        if opcode == "dot" or re.search(r"gemm|cublas|nvjet|xmma|cutlass|(^|[^a-z])dot", text):
            return "attention kernel"  # the jnp baseline's einsums
        return "attention other"
    if re.search(r"copy|dynamic[-_]slice|dynamic[-_]update|(^|[^a-z])slice|transpose", text) or \
            opcode in ("copy", "dynamic-slice", "dynamic-update-slice", "slice", "transpose"):
        return "copies/slices"
    if "sampling" in scopes:
        return "sampling"
    if opcode == "dot" or re.search(r"gemm|cublas|nvjet|xmma|cutlass|matmul|(^|[^a-z])dot|ynn_fusion", text):
        return "matmul"
    return "other fusions"


def union_gaps(intervals):
    """(total length of the union of (start, end) intervals, [gaps between its pieces])."""
    total, end, gaps = 0.0, None, []
    for s, e in sorted(intervals):
        if end is None or s > end:
            if end is not None:
                gaps.append(s - end)
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total, gaps


def trace_breakdown(trace_dir, hlo_text, steps):
    """Per-step device time (µs) by category from the perfetto trace under trace_dir: busy (union
    of device intervals), idle gaps inside the traced window binned by length, the attention
    kernels (launches and µs per step) and the ten costliest kernels. Device events: those of
    /device:GPU processes; with none (CPU), host events that carry an hlo_op."""
    paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        raise ValueError(f"no perfetto_trace.json.gz under trace_dir={trace_dir!r}")
    with gzip.open(max(paths, key=os.path.getmtime)) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X" and e.get("dur") is not None]
    device = [e for e in spans if "GPU" in procs.get(e["pid"], "")]
    if not device:
        device = [e for e in spans if "hlo_op" in e.get("args", {})]
    info = op_info(hlo_text)
    per_cat, per_kernel, intervals = collections.Counter(), collections.Counter(), []
    launches, per_thread = collections.Counter(), collections.Counter()
    for e in device:
        args = e.get("args", {})
        hlo_op = args.get("hlo_op", "")
        op_name, opcode = info.get(_norm(hlo_op), ("", ""))
        cat = classify(e["name"], hlo_op, op_name, opcode)
        per_cat[cat] += e["dur"]
        key = (cat, e["name"][:60])
        per_kernel[key] += e["dur"]
        launches[key] += 1
        per_thread[threads.get((e["pid"], e["tid"]), str(e["tid"]))] += 1
        intervals.append((e["ts"], e["ts"] + e["dur"]))
        e["cat"] = cat
    busy, gaps = union_gaps(intervals)
    gaps = np.asarray(gaps)
    bounds = (0.0, *GAP_BINS_US, np.inf)
    gap_bins = {f"{lo:g}-{hi:g} us": (float(gaps[(gaps >= lo) & (gaps < hi)].sum()) / steps,
                                      float(((gaps >= lo) & (gaps < hi)).sum()) / steps)
                for lo, hi in zip(bounds[:-1], bounds[1:])}
    attention = sorted(((cat, name, launches[(cat, name)] / steps, us / steps)
                        for (cat, name), us in per_kernel.items() if cat in ATTENTION + ("H2D",)),
                       key=lambda r: -r[3])
    kernels = [e for e in device if "memcpy" not in e["name"].lower()]
    return dict(device_events=len(device), events_per_thread=dict(per_thread), layer=layer_timeline(device, steps),
                op_names_found=sum(1 for e in kernels if _norm(e.get("args", {}).get("hlo_op", "")) in info),
                event_args=sorted(kernels[0].get("args", {})) if kernels else [],
                category_us={c: per_cat[c] / steps for c in CATEGORIES},
                busy_us=busy / steps, gap_bins=gap_bins, attention_kernels=attention,
                top_kernels=[(cat, name, us / steps) for (cat, name), us in per_kernel.most_common(10)])


def layer_timeline(device, steps):
    """One layer of the compute stream, the middle layer of the middle traced step: [(gap from
    the previous kernel's end µs (negative: overlap), duration µs, category, kernel)], from the
    kernel after the previous layer's attention kernel up to the one after this layer's."""
    stream = sorted((e for e in device if "memcpy" not in e["name"].lower()), key=lambda e: e["ts"])
    marks = [i for i, e in enumerate(stream) if e["cat"] == "attention kernel"
             and "reduction" not in e["name"] and "merge" not in e["name"]]
    if len(marks) < 2:
        return []
    per_step = max(len(marks) // steps, 1)
    mid = min((steps // 2) * per_step + per_step // 2, len(marks) - 1)
    lo, hi = marks[max(mid - 1, 0)], marks[mid]
    return [(stream[i]["ts"] - stream[i - 1]["ts"] - stream[i - 1]["dur"], stream[i]["dur"], stream[i]["cat"],
             stream[i]["name"][:60]) for i in range(lo + 1, hi + 2) if i < len(stream)]


# --- setup and variants ------------------------------------------------------------------------

class Setup:
    """Page tables, decode wrapper and per-step inputs for `batch` requests at given lengths."""

    def __init__(self, cfg, args, lens):
        self.cfg, self.lens, self.ps = cfg, lens, args.page_size
        batch = len(lens)
        self.most = args.steps * args.repeats + args.trace_steps  # steps past the first, at most
        pages = -(-(lens + self.most) // self.ps)
        self.num_pages = int(pages.sum())
        allocator = PageAllocator(self.num_pages)
        self.page_lists = [allocator.alloc(int(n)) for n in pages]
        opts = {} if jax.default_backend() == "gpu" else {"num_ctas": 8}
        self.decode = ji.BatchDecodeWithPagedKVCache(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.ps,
                                                     max_batch_size=batch, max_num_pages=self.num_pages, **opts)
        self.rows = np.arange(batch, dtype=np.int32)
        self.plan_s = []

    def kv_cache(self, variant, seed):
        """A cache for the variant (paged, or dense [B, longest + most, Hkv, D] per layer), random."""
        cfg, key = self.cfg, jax.random.key(seed)
        if variant in DENSE:
            cache = llama.dense_kv_cache(cfg, len(self.lens), int(self.lens.max()) + self.most + 1)
        else:
            cache = llama.paged_kv_cache(cfg, self.num_pages, self.ps)
        leaves, treedef = jax.tree_util.tree_flatten(cache)
        leaves = [jax.random.normal(jax.random.fold_in(key, i), x.shape, x.dtype) for i, x in enumerate(leaves)]
        return jax.block_until_ready(jax.tree_util.tree_unflatten(treedef, leaves))

    def inputs(self, step, variant):
        """Step `step`'s (positions, attention) on the device; the host time goes to plan_s."""
        t = time.perf_counter()
        kv_lens = self.lens + step + 1
        pos = (kv_lens - 1).astype(np.int32)
        if variant in DENSE:
            attention = llama.DenseAttention(None, pos[:, None], impl=DENSE[variant])
        elif variant != "no-attention":
            kv_indptr, kv_indices, last = page_table(self.page_lists, kv_lens, self.ps)
            plan = self.decode.plan(kv_indptr, kv_indices, last, num_pages=self.num_pages)
            attention = (llama.PagedAttention(self.decode, self.num_pages, plan, self.rows, pos, kv_indptr,
                                              pad(kv_indices, self.num_pages)) if variant == "scatter"
                         else llama.PagedAttention(self.decode, self.num_pages, plan))  # the kernel appends
        else:
            attention = NoAttention()
        out = jax.device_put((pos, attention))
        self.plan_s.append(time.perf_counter() - t)
        return out


def itl_stats(repeats):
    """ITL figures (ms) from per-repeat lists of step seconds."""
    p50s = [float(np.median(r)) * 1e3 for r in repeats]
    every = np.concatenate([np.asarray(r) for r in repeats]) * 1e3
    return dict(itl_ms_p50=float(np.median(p50s)), itl_ms_p50_repeats=p50s,
                itl_ms_p50_spread=float(max(p50s) - min(p50s)), itl_ms_mean=float(every.mean()),
                itl_ms_p10=float(np.percentile(every, 10)), itl_ms_p90=float(np.percentile(every, 90)),
                itl_ms_max=float(every.max()))


def run_variant(name, model, setup, kv_cache, args, rng, trace_dir=None):
    """Compiles and runs one variant; returns (row dict, kv_cache, compiled HLO text)."""
    graphdef, params = model
    batch = len(setup.lens)
    step = llama.make_step(graphdef, greedy=name != "sampled")
    sampling = jax.device_put((np.full(batch, 0.0 if name != "sampled" else 1.0, np.float32),
                               np.arange(batch, dtype=np.int32)))
    state = {"kv_cache": kv_cache}

    def call_args(tokens, inputs):
        pos, attention = inputs
        return params, tokens, pos, state["kv_cache"], attention, None, *sampling

    def dispatch(tokens, inputs):
        tok, state["kv_cache"] = fn(*call_args(tokens, inputs))
        return tok, tok

    first = jax.device_put(rng.integers(0, setup.cfg.vocab_size, batch).astype(np.int32))
    t = time.perf_counter()
    fn = step.lower(*call_args(first, setup.inputs(0, name))).compile()
    compile_s = time.perf_counter() - t
    hlo = fn.as_text()
    setup.plan_s.clear()
    repeats = []
    for r in range(args.repeats):
        offset = r * args.steps  # each repeat at later positions (their pages are allocated)
        _, itl = generate.decode_loop(dispatch, lambda s: setup.inputs(offset + s, name), first, args.steps,
                                      overlap=name != "sync")
        repeats.append(itl[1:] if len(itl) > 1 else itl)  # the first interval includes the launch
    row = dict(variant=name, batch=batch, layer_loop=setup.cfg.layer_loop, compile_s=compile_s,
               plan_ms=float(np.median(setup.plan_s)) * 1e3, **itl_stats(repeats))
    if trace_dir is not None:
        setup.plan_s.clear()
        offset = args.steps * args.repeats
        jax.block_until_ready(state["kv_cache"])
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            _, traced = generate.decode_loop(dispatch, lambda s: setup.inputs(offset + s, name), first,
                                             args.trace_steps, overlap=name != "sync")
        row["traced_itl_ms"] = float(np.mean(traced)) * 1e3
        row["traced_plan_ms"] = float(np.mean(setup.plan_s)) * 1e3
        row.update(trace_breakdown(trace_dir, hlo, args.trace_steps))
    return row, state["kv_cache"], hlo


def build(cfg, seed):
    model = llama.Llama(cfg, rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(model)
    jax.block_until_ready(params)
    return graphdef, params


def print_tables(copies, rows):
    print("\nweight-sized arrays materialized per decode step (outside fusions):")
    for loop, c in copies.items():
        print(f"  {loop:<7} {c['count']:>5} arrays, {c['bytes'] / 1e9:8.3f} GB  {c['where'] or ''}")
    print(f"\n{'variant':<13} {'batch':>5} {'loop':<7} {'compile s':>9} {'ITL p50 ms':>10} {'(repeats)':<24} "
          f"{'mean':>7} {'p90':>7} {'max':>7} {'plan ms':>8}")
    for r in rows:
        reps = " ".join(f"{x:.3f}" for x in r["itl_ms_p50_repeats"])
        print(f"{r['variant']:<13} {r['batch']:>5} {r['layer_loop']:<7} {r['compile_s']:>9.1f} "
              f"{r['itl_ms_p50']:>10.3f} {reps:<24} {r['itl_ms_mean']:>7.3f} {r['itl_ms_p90']:>7.3f} "
              f"{r['itl_ms_max']:>7.3f} {r['plan_ms']:>8.3f}")
    traced = [r for r in rows if "busy_us" in r]
    if not traced:
        return
    print("\ntraced device time per step (µs):")
    print(f"  {'':<17}" + "".join(f"{r['variant'] + ' b' + str(r['batch']):>16}" for r in traced))
    for c in CATEGORIES:
        print(f"  {c:<17}" + "".join(f"{r['category_us'][c]:>16.1f}" for r in traced))
    lines = (("busy (union)", lambda r: r["busy_us"]),
             ("idle", lambda r: r["traced_itl_ms"] * 1e3 - r["busy_us"]),
             ("traced ITL", lambda r: r["traced_itl_ms"] * 1e3),
             ("host plan+put", lambda r: r["traced_plan_ms"] * 1e3))
    for label, f in lines:
        print(f"  {label:<17}" + "".join(f"{f(r):>16.1f}" for r in traced))
    for b in traced[0]["gap_bins"]:
        print(f"  {'gaps ' + b:<17}" + "".join(
            f"{r['gap_bins'][b][0]:>9.1f} ({r['gap_bins'][b][1]:>4.1f})" for r in traced))
    for r in traced:
        print(f"\n{r['variant']} b{r['batch']}: attention kernels and H2D copies per step "
              f"(launches, µs, µs per launch)")
        for cat, name, n, us in r["attention_kernels"]:
            print(f"    {n:>6.1f} {us:>9.1f} {us / max(n, 1e-9):>7.2f}  {cat:<16} {name}")
        print("  one layer (gap before µs, duration µs):")
        for gap, dur, cat, name in r["layer"]:
            print(f"    {gap:>7.2f} {dur:>8.2f}  {cat:<16} {name}")
        print("  costliest kernels (µs per step):")
        for cat, name, us in r["top_kernels"]:
            print(f"    {us:>9.1f}  {cat:<16} {name}")


def main(argv=None):
    args = parse_args(argv)
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    all_lens = {b: rng.integers(args.context_len[0], args.context_len[1] + 1, b) for b in args.batches}
    print(json.dumps(dict(config=args.config, batches=args.batches,
                          context_lens={b: lens.tolist()[:8] for b, lens in all_lens.items()},
                          device=str(jax.devices()[0].device_kind), jax=jax.__version__)), flush=True)
    rows, copies = [], {}
    if "cudnn" in args.variants and jax.default_backend() != "gpu":
        print("cudnn skipped: it needs a GPU", flush=True)
        args.variants = [v for v in args.variants if v != "cudnn"]
    for loop in llama.LAYER_LOOPS:
        names = [v for v in args.variants if (v == "scan") == (loop == "scan")]
        if not names:
            continue
        cfg = llama.get_config(args.config, args.layers, loop)
        t = time.perf_counter()
        model = build(cfg, args.seed)
        print(f"{loop}: weights {time.perf_counter() - t:.1f} s", flush=True)
        for batch in args.batches:
            setup = Setup(cfg, args, all_lens[batch])
            for name in names:
                kv_cache = setup.kv_cache(name, args.seed)
                trace_dir = (os.path.join(out_dir, "profile_trace", f"b{batch}_{name}")
                             if name in args.trace else None)
                row, kv_cache, hlo = run_variant(name, model, setup, kv_cache, args, rng, trace_dir)
                if name in ("unroll", "scan"):
                    copies[loop] = weight_copies(hlo, cfg)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k not in ("top_kernels", "attention_kernels", "layer",
                                                                              "event_args")}),
                      flush=True)
                del kv_cache  # free this variant's cache before the next
        del model  # free this loop's weights before the next
    path = os.path.join(out_dir, "profile_e2e.json")
    with open(path, "w") as f:
        json.dump(dict(config=args.config, batches=args.batches, device=str(jax.devices()[0].device_kind),
                       jax=jax.__version__, copies=copies, rows=rows), f, indent=1)
    print(f"total {time.perf_counter() - start:.0f} s; results in {path}")
    print_tables(copies, rows)
    return copies, rows


if __name__ == "__main__":
    main()
