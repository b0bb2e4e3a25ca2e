"""One causal prefill launch of jaxinfer (ragged) and of JAX's Pallas-Triton mha, for ncu."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer as ji
from jax.experimental.pallas.ops.gpu import attention as att

B, S, H, D = 4, 4096, 16, 128
q = jax.random.normal(jax.random.key(0), (B * S, H, D), jnp.bfloat16)
k = jax.random.normal(jax.random.key(1), (B * S, H, D), jnp.bfloat16)
indptr = (np.arange(B + 1) * S).astype(np.int32)
pre = ji.BatchPrefillWithRaggedKVCache(H, H, D, causal=True)
run = jax.jit(pre.run)
plan = pre.plan(indptr, indptr)
jax.block_until_ready(run(q, k, k, plan))
mha = jax.jit(functools.partial(att.mha, segment_ids=None, sm_scale=1 / math.sqrt(D), causal=True,
                                block_sizes=att.BlockSizes(block_q=128, block_k=64), num_warps=4, num_stages=2))
qb = q.reshape(B, S, H, D)
jax.block_until_ready(mha(qb, qb, qb))
