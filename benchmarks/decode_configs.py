"""The decode rows of bench_decode.py (NumPy only)."""
import numpy as np

HQ, HKV, D, PAGE = 32, 8, 128, 16


def decode_rows(seed=0):
    """(name, kv_lens) for each row; the same seed gives the same lengths in both scripts."""
    rng = np.random.default_rng(seed)
    zipf = rng.zipf(1.5, 16).astype(np.float64)
    zipf = np.clip(np.round(zipf * 1024 / zipf.mean()), 1, 16384).astype(np.int64)
    return [
        ("B64 kv4096", np.full(64, 4096)),
        ("B128 kv2048", np.full(128, 2048)),
        ("B16 kv1024", np.full(16, 1024)),
        ("B1 kv32768", np.full(1, 32768)),
        ("B16 U[512,1024]", rng.integers(512, 1025, 16)),
        ("B16 zipf mean1024", zipf),
        ("B64 U[512,4096]", rng.integers(512, 4097, 64)),
    ]
