"""Compiled (non-interpret) kernels against jaxinfer.reference on small random shapes."""
import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer as ji
from benchmarks.common import random_paged_cache, rel_err
from jaxinfer import reference as ref

rng = np.random.default_rng(0)
print("jax", jax.__version__, jax.devices(), flush=True)
fails = 0


def report(name, err, tol):
    global fails
    ok = err is not None and err < tol
    fails += not ok
    print(f"{'ok  ' if ok else 'FAIL'} {name}: rel_err {err:.2e} (tol {tol})", flush=True)


for dtype, tol in ((jnp.bfloat16, 2e-2), (jnp.float16, 5e-3), (jnp.float32, 1e-5)):
    for (hq, hkv, d, page, layout) in ((32, 8, 128, 16, "NHD"), (4, 4, 64, 1, "HND"), (8, 1, 256, 5, "NHD")):
        lens = rng.integers(0, 700, 9)
        cache, indptr, indices, last = random_paged_cache(rng, lens, page, hkv, d, dtype, layout, 3)
        q = jax.random.normal(jax.random.key(2), (9, hq, d), dtype)
        for split in (None, 2):
            dec = ji.BatchDecodeWithPagedKVCache(hq, hkv, d, page, layout=layout, fixed_split_pages=split)
            plan = dec.plan(indptr, indices, last, num_pages=cache.num_pages)
            o, lse = jax.jit(lambda q, c, p: dec.run(q, c, p, return_lse=True))(q, cache, plan)
            r = ref.decode(q, cache, indptr, indices, last)
            report(f"decode {dtype.__name__} {hq}/{hkv} d{d} p{page} {layout} split={split}", rel_err(o, r.o), tol)
            fin = np.isfinite(np.asarray(r.lse))
            report("  lse", rel_err(np.asarray(lse)[fin], np.asarray(r.lse)[fin]), 1e-3 if dtype != jnp.float32 else 1e-5)
    q = jax.random.normal(jax.random.key(3), (37, 8, 128), dtype)
    k = jax.random.normal(jax.random.key(4), (97, 2, 128), dtype)
    v = jax.random.normal(jax.random.key(5), (97, 2, 128), dtype)
    for causal in (False, True):
        o = ji.single_prefill_with_kv_cache(q, k, v, causal=causal)
        report(f"single_prefill {dtype.__name__} causal={causal}", rel_err(o, ref.attention(q, k, v, causal=causal).o), tol)
    o = ji.single_decode_with_kv_cache(q[0], k, v)
    report(f"single_decode {dtype.__name__}", rel_err(o, ref.attention(q[:1], k, v).o[0]), tol)
    a = ji.AttentionState(q[:5].astype(jnp.float32), jax.random.normal(jax.random.key(6), (5, 8)))
    b = ji.AttentionState(q[5:10].astype(jnp.float32), jax.random.normal(jax.random.key(7), (5, 8)))
    report("merge_state", rel_err(ji.merge_state(a, b).o, ref.merge_state(a, b).o), 1e-5)
print("GPU CHECK", "FAILED" if fails else "PASSED", fails)
