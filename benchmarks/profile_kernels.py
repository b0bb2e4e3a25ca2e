"""One launch of each kernel of interest, for ncu (benchmarks/ncu_report.sh).

    PYTHONPATH=. python3 benchmarks/profile_kernels.py prefill   # row 1 ragged + JAX's Pallas mha
    PYTHONPATH=. python3 benchmarks/profile_kernels.py decode    # (64, 4096) decode, bf16 then e4m3
"""
import functools
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer as ji
from benchmarks.common import random_paged_cache

D = 128


def prefill(B=16, S=4096, H=16, **opts):
    from jax.experimental.pallas.ops.gpu import attention as att
    q = jax.random.normal(jax.random.key(0), (B * S, H, D), jnp.bfloat16)
    k = jax.random.normal(jax.random.key(1), (B * S, H, D), jnp.bfloat16)
    v = jax.random.normal(jax.random.key(2), (B * S, H, D), jnp.bfloat16)
    indptr = (np.arange(B + 1) * S).astype(np.int32)
    pre = ji.BatchPrefillWithRaggedKVCache(H, H, D, causal=True, **opts)
    jax.block_until_ready(jax.jit(pre.run)(q, k, v, pre.plan(indptr, indptr)))
    mha = jax.jit(functools.partial(att.mha, segment_ids=None, sm_scale=1 / math.sqrt(D), causal=True,
                                    block_sizes=att.BlockSizes(block_q=128, block_k=64), num_warps=4,
                                    num_stages=2))
    jax.block_until_ready(mha(*(x.reshape(B, S, H, D) for x in (q, k, v))))


def decode(B=64, S=4096, hq=32, hkv=8, page=16):
    cache, indptr, indices, last = random_paged_cache(np.random.default_rng(0), np.full(B, S), page, hkv, D,
                                                      jnp.bfloat16)
    q = jax.random.normal(jax.random.key(5), (B, hq, D), jnp.bfloat16)
    dec = ji.BatchDecodeWithPagedKVCache(hq, hkv, D, page)
    plan = dec.plan(indptr, indices, last)
    run = jax.jit(functools.partial(dec.run, k_scale=0.9, v_scale=1.1))
    for dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
        c = ji.PagedKVCache(cache.k_pages.astype(dtype), cache.v_pages.astype(dtype))
        jax.block_until_ready(run(q, c, plan))


if __name__ == "__main__":
    {"prefill": prefill, "decode": decode}[sys.argv[1]]()
