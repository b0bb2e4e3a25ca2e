"""plan() latency on the host, steady state, through the public wrappers (one table).

    PYTHONPATH=. python3 benchmarks/bench_plan.py [--quick] [--thread-time] [--only TEXT]

Rows (issue 22): decode B 1, 64, 128, 256, 1024 at page 1 and 16, cascade off / "auto" (no
request shares a page, so "auto" plans a plain decode); paged prefill B 4 x 2048 (causal) and
B 64 mixed (4 chunks of 512 queries + 60 decode rows); BatchAttention on the same mixed step
(two classes, and impl="mixed": the one launch "auto" picks there on a Hopper GPU)
and on 64 requests of 4 query tokens (speculative verify). Page ids are a shuffled subset of a
cache of num_pages pages (given to plan(), as in serving); every wrapper has fixed capacities;
prefill and BatchAttention plans are told their dtypes (q_data_type="bfloat16"), so a Hopper GPU
plans one kernel, as FlashInfer's plan() is told them.
Columns: median and p99 of the wrapper's plan() in µs (the device copy is asynchronous: plan()
does not wait for it); KB: the packed buffer(s); on a GPU, "copy": putting those buffers on the
device as plan() does and waiting for them (median µs).
"""
import argparse
import time

import jax
import numpy as np

import jaxinfer as ji
from jaxinfer import transfer

HEADS = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128)
DECODE_CTAS = 264      # the wrappers' default on a 132-SM H100: 2 CTAs per SM
PREFILL_CTAS = 2112    # 16 CTAs per SM


CLOCK = time.perf_counter


def timings(fn, budget_s):
    """Per-call µs of fn after a warm-up: (median, p99)."""
    for _ in range(20):
        fn()
    t0 = time.perf_counter()
    fn()
    est = max(time.perf_counter() - t0, 1e-6)
    ts = np.empty(int(np.clip(budget_s / est, 200, 5000)))
    for i in range(ts.shape[0]):
        t = CLOCK()
        fn()
        ts[i] = CLOCK() - t
    return float(np.median(ts)) * 1e6, float(np.percentile(ts, 99)) * 1e6


def page_table(rng, kv_lens, page):
    """Shuffled page ids drawn from a cache with 25% more pages than listed."""
    npages = -(-kv_lens // page)
    indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
    num_pages = int(indptr[-1] * 1.25) + 1
    indices = rng.permutation(num_pages)[: indptr[-1]].astype(np.int32)
    last = (kv_lens - (npages - 1) * page).astype(np.int32)
    return indptr, indices, last, num_pages


def decode_case(rng, batch, page, cascade):
    kv = 4096 if batch <= 64 else 2048
    lens = kv - rng.integers(0, 16, batch)  # last pages partly filled
    indptr, indices, last, num_pages = page_table(rng, lens, page)
    dec = ji.BatchDecodeWithPagedKVCache(**HEADS, page_size=page, max_batch_size=batch,
                                         max_num_pages=int(indptr[-1]), num_ctas=DECODE_CTAS)
    name = f"decode B{batch} kv{kv} page {page}" + (" cascade=auto" if cascade else "")
    return name, lambda: dec.plan(indptr, indices, last, num_pages=num_pages, cascade=cascade)


def prefill_case(rng, qo_lens, kv_lens, name, page=16):
    indptr, indices, last, num_pages = page_table(rng, kv_lens, page)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    pre = ji.BatchPrefillWithPagedKVCache(**HEADS, page_size=page, max_batch_size=len(qo_lens),
                                          max_num_tokens=int(qo_indptr[-1]), max_num_pages=int(indptr[-1]),
                                          num_ctas=PREFILL_CTAS)
    return name, lambda: pre.plan(qo_indptr, indptr, indices, last, num_pages=num_pages, q_data_type="bfloat16")


def batch_case(rng, qo_lens, kv_lens, name, page=16, impl="auto"):
    indptr, indices, last, num_pages = page_table(rng, kv_lens, page)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    attn = ji.BatchAttention(**HEADS, page_size=page, max_batch_size=len(qo_lens),
                             max_num_tokens=int(qo_indptr[-1]), max_num_pages=int(indptr[-1]),
                             num_ctas=DECODE_CTAS, impl=impl)
    return name, lambda: attn.plan(qo_indptr, indptr, indices, last, num_pages=num_pages, q_data_type="bfloat16")


def cases(rng):
    for batch in (1, 64, 128, 256, 1024):
        for page in (1, 16):
            for cascade in (None, "auto"):
                yield decode_case(rng, batch, page, cascade)
    yield prefill_case(rng, np.full(4, 2048), np.full(4, 2048), "prefill B4 x 2048 causal page 16")
    qo = np.r_[np.full(4, 512), np.ones(60, np.int64)]
    kv = np.r_[rng.integers(512, 4097, 4), rng.integers(1024, 4097, 60)]
    yield prefill_case(rng, qo, kv, "prefill B64 mixed (4 x 512 + 60 x 1) page 16")
    yield batch_case(rng, qo, kv, "BatchAttention B64 mixed (4 x 512 + 60 decode)")
    # (what "auto" plans on a Hopper GPU: one mixed launch; the CPU's "auto" plans two classes)
    yield batch_case(rng, qo, kv, "BatchAttention B64 mixed, impl='mixed'", impl="mixed")
    yield batch_case(rng, np.full(64, 4), rng.integers(1024, 4097, 64), "BatchAttention q4 B64")


def packed(plan):
    """[(packed int32 buffer as NumPy, layout)] of the plan and the plans inside it."""
    out = []
    if hasattr(plan, "parts"):
        parts = [np.asarray(part) for part in plan.parts]
        if len(parts) == 1:  # the CPU backend: the buffer whole
            buf = parts[0]
        else:
            buf = np.zeros(plan.layout.size, np.int32)
            for part, (start, stop) in zip(parts, plan.layout.offsets.values()):
                buf[start:stop] = part
        out.append((buf, plan.layout))
    for inner in (getattr(plan, "long", None), getattr(plan, "alt", None), *getattr(plan, "levels", ())):
        out += packed(inner) if inner is not None else []
    return out


def copy_us(bufs, budget_s):
    """The plan's packed buffer(s) put on the device as plan() puts them (transfer.plan_sections:
    copied and split into sections), waited for: median µs (GPU only)."""
    return timings(lambda: jax.block_until_ready([transfer.plan_sections(b, lay) for b, lay in bufs]),
                   budget_s)[0]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="shorter runs (noisier)")
    parser.add_argument("--thread-time", action="store_true",
                        help="time this thread's CPU time instead of wall time: on a machine "
                             "shared with other work, leaves out time the OS gave to others")
    parser.add_argument("--only", default="", help="rows whose name contains this")
    args = parser.parse_args()
    global CLOCK
    if args.thread_time:
        CLOCK = time.thread_time
    budget = 0.2 if args.quick else 1.0
    gpu = jax.default_backend() == "gpu"
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, µs per plan() (steady state, "
          f"{'thread CPU time' if args.thread_time else 'wall time'})")
    head = f"{'plan':<48} {'median':>8} {'p99':>8} {'KB':>7}" + (f" {'copy':>8}" if gpu else "")
    print(head + "\n" + "-" * len(head))
    for name, fn in cases(np.random.default_rng(0)):
        if args.only not in name:
            continue
        med, p99 = timings(fn, budget)
        bufs = packed(fn())
        row = f"{name:<48} {med:>8.1f} {p99:>8.1f} {sum(b.nbytes for b, _ in bufs) / 1e3:>7.0f}"
        if gpu:
            row += f" {copy_us(bufs, budget / 2):>8.1f}"
        print(row, flush=True)


if __name__ == "__main__":
    main()
