"""jaxinfer in one page: a paged KV cache, append, a jitted batch-decode step, merge, prefill.

    python examples/quickstart.py
Runs on CPU (Pallas interpret mode) or GPU (compiled Pallas kernels).
"""
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer as ji

num_qo_heads, num_kv_heads, head_dim, page_size = 8, 2, 64, 16
num_pages, batch = 64, 4
rng = np.random.default_rng(0)

# A paged cache (NHD: [num_pages, page_size, Hkv, D]) and a CSR page table per request.
k_pages = jnp.asarray(rng.standard_normal((num_pages, page_size, num_kv_heads, head_dim)), jnp.bfloat16)
v_pages = jnp.asarray(rng.standard_normal((num_pages, page_size, num_kv_heads, head_dim)), jnp.bfloat16)
cache = ji.PagedKVCache(k_pages, v_pages, layout="NHD")
kv_lens = np.array([45, 3, 100, 17])
pages_per_req = -(-kv_lens // page_size)
kv_indptr = np.concatenate([[0], np.cumsum(pages_per_req)]).astype(np.int32)
kv_indices = rng.permutation(num_pages)[: kv_indptr[-1]].astype(np.int32)  # any page order
kv_last_page_len = (kv_lens - (pages_per_req - 1) * page_size).astype(np.int32)

# Write each request's newest token (its last position) into the cache.
new_k = jnp.asarray(rng.standard_normal((batch, num_kv_heads, head_dim)), jnp.bfloat16)
batch_idx, pos = ji.get_batch_indices_positions(np.arange(batch + 1, dtype=np.int32),
                                                kv_lens.astype(np.int32), batch)
cache = jax.jit(ji.append_paged_kv_cache, donate_argnums=0)(cache, new_k, new_k, batch_idx, pos,
                                                           kv_indices, kv_indptr)

# Decode: plan on the host once per step, run (jitted, shared by every layer) on the device.
decode = ji.BatchDecodeWithPagedKVCache(num_qo_heads, num_kv_heads, head_dim, page_size,
                                        max_batch_size=batch, max_num_pages=num_pages)
plan = decode.plan(kv_indptr, kv_indices, kv_last_page_len, num_pages=num_pages)
q = jnp.asarray(rng.standard_normal((batch, num_qo_heads, head_dim)), jnp.bfloat16)
run = jax.jit(lambda q, cache, plan: decode.run(q, cache, plan, return_lse=True))
t = time.perf_counter()
o, lse = run(q, cache, plan)
jax.block_until_ready(o)
print(f"decode ({jax.default_backend()}): o {o.shape} {o.dtype}, lse {lse.shape}, {time.perf_counter() - t:.2f} s")

want = ji.reference.decode(q, cache, kv_indptr, kv_indices, kv_last_page_len)
err = np.linalg.norm(np.asarray(o, np.float32) - np.asarray(want.o, np.float32)) / np.linalg.norm(np.asarray(want.o, np.float32))
print(f"  relative error against jaxinfer.reference: {err:.1e}")

# Attention over two halves of a KV set, merged exactly with the ⊕ operator.
k = jnp.asarray(rng.standard_normal((96, num_kv_heads, head_dim)), jnp.float32)
v = jnp.asarray(rng.standard_normal((96, num_kv_heads, head_dim)), jnp.float32)
q1 = jnp.asarray(rng.standard_normal((num_qo_heads, head_dim)), jnp.float32)
a = ji.single_decode_with_kv_cache(q1, k[:40], v[:40], return_lse=True)
b = ji.single_decode_with_kv_cache(q1, k[40:], v[40:], return_lse=True)
merged = ji.merge_state(a, b)
whole = ji.single_decode_with_kv_cache(q1, k, v)
print(f"merge: max |a ⊕ b - whole| = {float(jnp.max(jnp.abs(merged.o - whole))):.1e}")

# Causal prefill of one request (bottom-right aligned).
qp = jnp.asarray(rng.standard_normal((32, num_qo_heads, head_dim)), jnp.float32)
o_prefill = ji.single_prefill_with_kv_cache(qp, k, v, causal=True)
print(f"prefill: o {o_prefill.shape}")

# Batch append over the paged cache: each request's last qo_len tokens attend causally.
qo_lens = np.array([5, 1, 12, 3])
qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
prefill = ji.BatchPrefillWithPagedKVCache(num_qo_heads, num_kv_heads, head_dim, page_size, causal=True)
plan = prefill.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, num_pages=num_pages)
qa = jnp.asarray(rng.standard_normal((qo_indptr[-1], num_qo_heads, head_dim)), jnp.bfloat16)
oa = jax.jit(prefill.run)(qa, cache, plan)
print(f"batch prefill: o {oa.shape}, tile height {plan.layout.rows} rows")
