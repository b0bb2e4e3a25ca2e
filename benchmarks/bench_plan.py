"""plan() latency on the host: NumPy planning alone, and with the host-to-device copy.

    PYTHONPATH=. python3 benchmarks/bench_plan.py
"""
import time

import jax
import numpy as np

import jaxinfer as ji
from planner.decode import plan_decode


def timeit(fn, iters=2000):
    """Median microseconds per call (the machine is shared and noisy: many repeats)."""
    fn()
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e6


def main():
    rng = np.random.default_rng(0)
    page = 16
    print(f"jax {jax.__version__} backend {jax.default_backend()}")
    print(f"{'batch':>6} {'kv_len':>14} {'plan() us':>10} {'+ transfer us':>14}")
    for batch, lo, hi in ((16, 512, 1024), (64, 512, 4096), (128, 2048, 2048), (128, 512, 4096), (256, 512, 4096)):
        lens = rng.integers(lo, hi + 1, batch)
        npages = -(-lens // page)
        indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
        indices = rng.permutation(int(indptr[-1])).astype(np.int32)
        last = (lens - (npages - 1) * page).astype(np.int32)
        dec = ji.BatchDecodeWithPagedKVCache(32, 8, 128, page, max_batch_size=batch,
                                             max_num_pages=int(indptr[-1]), num_ctas=264)
        host = timeit(lambda: plan_decode(indptr, indices, last, page_size=page, num_cells=dec.num_cells,
                                          num_pages=int(indptr[-1]), max_batch_size=batch,
                                          max_num_pages=int(indptr[-1])))
        full = timeit(lambda: jax.block_until_ready(
            dec.plan(indptr, indices, last, num_pages=int(indptr[-1])).buffer))
        print(f"{batch:>6} {f'[{lo}, {hi}]':>14} {host:>10.1f} {full:>14.1f}")


if __name__ == "__main__":
    main()
