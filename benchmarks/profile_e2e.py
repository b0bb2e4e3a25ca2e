"""Where a Llama decode step's time goes: ITL of variants and a breakdown from a profiler trace.

    PYTHONPATH=. python3 benchmarks/profile_e2e.py                # one H100: Llama-3-8B shapes, batch 1
    PYTHONPATH=. python3 benchmarks/profile_e2e.py --batch 64
    PYTHONPATH=. python3 benchmarks/profile_e2e.py --smoke        # tiny model on CPU (checks the script)

The decode step of examples/llama.py (jaxinfer paged attention, greedy, the cache donated),
random bfloat16 weights, context lengths uniform on --context-len (the cache holds zeros: only
lengths matter for time). Three parts, printed in this order, tables last:

1. Weight copies in the compiled step, per layer loop: instructions outside fusions that write
   an array shaped like one layer's weight (or the stacked weights), i.e. a materialized
   dynamic-slice/copy before a matmul, counted per step (a while body's count times its trip
   count) with their bytes.
2. Variants, each compiled (time printed) and run for --steps steps, ITL = interval between
   successive steps' tokens reaching the host: unroll (the default step); sync (each step's
   tokens reach the host before the next is planned and launched); no-attention (q + K + V in
   place of attention and the cache write: attention's cost by difference); sampled (Gumbel
   sampling at temperature 1 instead of greedy argmax); scan (stacked weights in one lax.scan).
3. For the variants in --trace: --trace-steps steps under jax.profiler.trace(create_perfetto_trace
   =True); device kernel time per step by category: matmul, attention (jaxinfer kernels and the
   KV append), sampling, copies/slices, other fusions (norms, RoPE, residuals, embedding),
   transfers (memcpy); busy = union of all device intervals, idle = traced ITL - busy; and the
   host's plan + device_put time per step, measured around the call. Categories come from the
   kernel's HLO instruction (event arg hlo_op) looked up in the compiled HLO for its op_name
   (the model's jax.named_scope: qkv_proj, attention, o_proj, mlp, lm_head, sampling) and from
   kernel-name patterns. XLA turns off command buffers (CUDA graphs) while profiling, so the
   traced ITL can exceed the untraced one: idle includes that launch overhead.

Results go to $OUT/profile_e2e.json (OUT defaults to ./out), traces to $OUT/profile_trace/<variant>.
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

VARIANTS = ("unroll", "sync", "no-attention", "sampled", "scan")
CATEGORIES = ("matmul", "attention", "sampling", "copies/slices", "other fusions", "transfers")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny float32 model, short contexts, few steps (CPU)")
    ap.add_argument("--batch", type=int, default=None, help="requests decoded together (default 1; smoke 2)")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the config's")
    ap.add_argument("--context-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                    help="KV lengths at the first step, uniform on [MIN, MAX] (default 512 2048; smoke 8 24)")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps per variant (default 64; smoke 4)")
    ap.add_argument("--trace-steps", type=int, default=None,
                    help="decode steps under the profiler per traced variant (default 16; smoke 3)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated variants to time, drawn from {','.join(VARIANTS)} (default all)")
    ap.add_argument("--trace", default="unroll,scan",
                    help="comma-separated variants to trace (of those timed; empty: none)")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per KV cache page")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights, lengths and tokens")
    args = ap.parse_args(argv)
    args.config = "tiny" if args.smoke else "llama3-8b"
    args.batch = args.batch or (2 if args.smoke else 1)
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
    for name in ("batch", "steps", "trace_steps", "page_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
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

def op_names(hlo_text):
    """{instruction name: op_name metadata} of a compiled module's text."""
    names = {}
    for line in hlo_text.splitlines():
        m = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*\bop_name=\"([^\"]*)\"", line)
        if m:
            names[m.group(1)] = m.group(2)
    return names


def classify(kernel, hlo_op, op_name):
    """The category of one device event: kernel name, its HLO instruction, that instruction's op_name."""
    text = f"{kernel} {hlo_op}".lower()
    scopes = op_name.split("/")
    if re.search(r"memcpy|memset", text):
        return "transfers"
    if "attention" in scopes or re.search(r"cudnn|fmha|flash|paged_decode|merge_varlen", text):
        return "attention"
    if re.search(r"copy|dynamic[-_]slice|dynamic[-_]update|(^|[^a-z])slice|transpose", text):
        return "copies/slices"
    if "sampling" in scopes:
        return "sampling"
    if re.search(r"gemm|cublas|nvjet|xmma|cutlass|matmul|(^|[^a-z])dot|ynn_fusion", text):
        return "matmul"
    return "other fusions"


def union_us(intervals):
    """Total length of the union of (start, end) intervals."""
    total, end = 0.0, -np.inf
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def trace_breakdown(trace_dir, hlo_text, steps):
    """Per-step device time (µs) by category from the perfetto trace under trace_dir, with busy
    (union of device intervals) and the ten costliest kernels. Device events: those of
    /device:GPU processes; with none (CPU), host events that carry an hlo_op."""
    paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        raise ValueError(f"no perfetto_trace.json.gz under trace_dir={trace_dir!r}")
    with gzip.open(max(paths, key=os.path.getmtime)) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    spans = [e for e in events if e.get("ph") == "X" and e.get("dur") is not None]
    device = [e for e in spans if "GPU" in procs.get(e["pid"], "")]
    if not device:
        device = [e for e in spans if "hlo_op" in e.get("args", {})]
    names = op_names(hlo_text)
    per_cat, per_kernel, intervals = collections.Counter(), collections.Counter(), []
    for e in device:
        args = e.get("args", {})
        hlo_op = args.get("hlo_op", "")
        cat = classify(e["name"], hlo_op, names.get(hlo_op, ""))
        per_cat[cat] += e["dur"]
        per_kernel[(cat, e["name"][:60])] += e["dur"]
        intervals.append((e["ts"], e["ts"] + e["dur"]))
    return dict(device_events=len(device), category_us={c: per_cat[c] / steps for c in CATEGORIES},
                busy_us=union_us(intervals) / steps,
                top_kernels=[(cat, name, us / steps) for (cat, name), us in per_kernel.most_common(10)])


# --- setup and variants ------------------------------------------------------------------------

class Setup:
    """Page tables, decode wrapper and per-step inputs for `batch` requests at given lengths."""

    def __init__(self, cfg, args, lens):
        self.cfg, self.lens, self.ps = cfg, lens, args.page_size
        batch, most = len(lens), args.steps + args.trace_steps
        pages = -(-(lens + most) // self.ps)
        self.num_pages = int(pages.sum())
        allocator = PageAllocator(self.num_pages)
        self.page_lists = [allocator.alloc(int(n)) for n in pages]
        opts = {} if jax.default_backend() == "gpu" else {"num_ctas": 8}
        self.decode = ji.BatchDecodeWithPagedKVCache(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.ps,
                                                     max_batch_size=batch, max_num_pages=self.num_pages, **opts)
        self.rows = np.arange(batch, dtype=np.int32)
        self.plan_s = []

    def inputs(self, step, attention_on=True):
        """Step `step`'s (positions, attention) on the device; the host time goes to plan_s."""
        t = time.perf_counter()
        kv_lens = self.lens + step + 1
        pos = (kv_lens - 1).astype(np.int32)
        if attention_on:
            kv_indptr, kv_indices, last = page_table(self.page_lists, kv_lens, self.ps)
            plan = self.decode.plan(kv_indptr, kv_indices, last, num_pages=self.num_pages)
            attention = llama.PagedAttention(self.decode, self.num_pages, plan, self.rows, pos, kv_indptr,
                                             pad(kv_indices, self.num_pages))
        else:
            attention = NoAttention()
        out = jax.device_put((pos, attention))
        self.plan_s.append(time.perf_counter() - t)
        return out


def run_variant(name, model, setup, kv_cache, args, rng, trace_dir=None):
    """Compiles and runs one variant; returns (row dict, kv_cache, compiled HLO text)."""
    graphdef, params = model
    batch = len(setup.lens)
    step = llama.make_step(graphdef, greedy=name != "sampled")
    sampling = jax.device_put((np.full(batch, 0.0 if name != "sampled" else 1.0, np.float32),
                               np.arange(batch, dtype=np.int32)))
    attention_on = name != "no-attention"
    state = {"kv_cache": kv_cache}

    def call_args(tokens, inputs):
        pos, attention = inputs
        return params, tokens, pos, state["kv_cache"], attention, None, *sampling

    def dispatch(tokens, inputs):
        tok, state["kv_cache"] = fn(*call_args(tokens, inputs))
        return tok, tok

    first = jax.device_put(rng.integers(0, setup.cfg.vocab_size, batch).astype(np.int32))
    t = time.perf_counter()
    fn = step.lower(*call_args(first, setup.inputs(0, attention_on))).compile()
    compile_s = time.perf_counter() - t
    hlo = fn.as_text()
    setup.plan_s.clear()
    _, itl = generate.decode_loop(dispatch, lambda s: setup.inputs(s, attention_on), first, args.steps,
                                  overlap=name != "sync")
    row = dict(variant=name, layer_loop=setup.cfg.layer_loop, compile_s=compile_s,
               itl_ms_p50=float(np.median(itl)) * 1e3, itl_ms_mean=float(np.mean(itl)) * 1e3,
               plan_ms=float(np.median(setup.plan_s)) * 1e3)
    if trace_dir is not None:
        setup.plan_s.clear()
        offset = args.steps  # later positions than the timed steps (their pages are allocated)
        jax.block_until_ready(state["kv_cache"])
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            _, traced = generate.decode_loop(dispatch, lambda s: setup.inputs(offset + s, attention_on), first,
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
    print(f"\n{'variant':<13} {'loop':<7} {'compile s':>9} {'ITL p50 ms':>10} {'ITL mean':>9} {'plan ms':>8}")
    for r in rows:
        print(f"{r['variant']:<13} {r['layer_loop']:<7} {r['compile_s']:>9.1f} {r['itl_ms_p50']:>10.3f} "
              f"{r['itl_ms_mean']:>9.3f} {r['plan_ms']:>8.3f}")
    traced = [r for r in rows if "busy_us" in r]
    for r in traced:
        print(f"\ntrace of {r['variant']} ({r['device_events']} device events): per step, µs")
        for c in CATEGORIES:
            print(f"  {c:<15} {r['category_us'][c]:>10.1f}")
        idle = r["traced_itl_ms"] * 1e3 - r["busy_us"]
        print(f"  {'busy (union)':<15} {r['busy_us']:>10.1f}\n  {'idle':<15} {idle:>10.1f}\n"
              f"  {'traced ITL':<15} {r['traced_itl_ms'] * 1e3:>10.1f}\n"
              f"  {'host plan+put':<15} {r['traced_plan_ms'] * 1e3:>10.1f}  (host, overlapped with the device)")
        for cat, name, us in r["top_kernels"]:
            print(f"    {us:>9.1f}  {cat:<14} {name}")


def main(argv=None):
    args = parse_args(argv)
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    lens = rng.integers(args.context_len[0], args.context_len[1] + 1, args.batch)
    print(json.dumps(dict(config=args.config, batch=args.batch, context_lens=lens.tolist()[:8],
                          device=str(jax.devices()[0].device_kind), jax=jax.__version__)), flush=True)
    rows, copies = [], {}
    for loop in llama.LAYER_LOOPS:
        names = [v for v in args.variants if (v == "scan") == (loop == "scan")]
        if not names:
            continue
        cfg = llama.get_config(args.config, args.layers, loop)
        t = time.perf_counter()
        model = build(cfg, args.seed)
        print(f"{loop}: weights {time.perf_counter() - t:.1f} s", flush=True)
        setup = Setup(cfg, args, lens)
        kv_cache = llama.paged_kv_cache(cfg, setup.num_pages, args.page_size)
        for name in names:
            trace_dir = os.path.join(out_dir, "profile_trace", name) if name in args.trace else None
            row, kv_cache, hlo = run_variant(name, model, setup, kv_cache, args, rng, trace_dir)
            if name in ("unroll", "scan"):
                copies[loop] = weight_copies(hlo, cfg)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "top_kernels"}), flush=True)
        del model, kv_cache  # free this loop's weights and cache before the next
    path = os.path.join(out_dir, "profile_e2e.json")
    with open(path, "w") as f:
        json.dump(dict(config=args.config, batch=args.batch, copies=copies, rows=rows), f, indent=1)
    print(f"total {time.perf_counter() - start:.0f} s; results in {path}")
    print_tables(copies, rows)
    return copies, rows


if __name__ == "__main__":
    main()
