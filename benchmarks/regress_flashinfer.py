"""FlashInfer 0.5.3 beside jaxinfer in regress.py's process (its --flashinfer column).

Adapted from ../shared/anchors/anchors_flashinfer.py: the same wrappers (tensor-core decode,
fa3 prefill, the two-level cascade, BatchAttention), but on jaxinfer's own inputs, shared
zero-copy through DLPack, so both libraries read the same pages in the same order and FlashInfer's
output is checked against the same float32 reference. Each method returns run(): `calls` calls,
one per q of the row (and cache copy), returning their outputs, as regress.Case.run does.
"""
import traceback

import jax
import jax.numpy as jnp
import numpy as np

WORKSPACE_BYTES = 256 << 20


def load(log):
    """A FlashInfer helper, or None (logged) when torch or flashinfer does not import or run."""
    try:
        return FlashInfer()
    except Exception:
        log("FlashInfer unavailable, its column stays blank:\n" + traceback.format_exc(limit=2))
        return None


class FlashInfer:
    def __init__(self):
        import flashinfer
        import torch
        self.torch, self.fi = torch, flashinfer
        self.ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
        self.version = flashinfer.__version__

    # jax <-> torch, zero-copy
    def tensor(self, x):
        """A jax array as a torch tensor on the same memory; fp8 through a uint8 bit view."""
        torch = self.torch
        if x.dtype == jnp.float8_e4m3fn:
            return torch.from_dlpack(jax.lax.bitcast_convert_type(x, jnp.uint8)).view(torch.float8_e4m3fn)
        if x.dtype == jnp.float8_e5m2:
            return torch.from_dlpack(jax.lax.bitcast_convert_type(x, jnp.uint8)).view(torch.float8_e5m2)
        return torch.from_dlpack(x)

    def as_jax(self, t):
        return jnp.from_dlpack(t.contiguous())

    def ints(self, a):
        return self.torch.as_tensor(np.asarray(a, np.int32), device="cuda")

    def sync(self, _=None):
        self.torch.cuda.synchronize()

    def _inputs(self, qs, caches):
        q = self.tensor(qs)  # [calls, T, Hq, D]
        kv = [(self.tensor(c.k_pages), self.tensor(c.v_pages)) for c in caches]
        return q, kv, kv[0][0].dtype

    def _runner(self, run_one, q, kv):
        def run():
            return [run_one(q[i], kv[i % len(kv)]) for i in range(q.shape[0])]
        return run

    # the rows
    def decode(self, qs, caches, indptr, indices, last, hq, hkv, head_dim, page, kv_scale=None):
        q, kv, kv_dtype = self._inputs(qs, caches)
        w = self.fi.BatchDecodeWithPagedKVCacheWrapper(self.ws, "NHD", use_tensor_cores=True)
        w.plan(self.ints(indptr), self.ints(indices), self.ints(last), hq, hkv, head_dim, page,
               q_data_type=q.dtype, kv_data_type=kv_dtype)
        scales = {} if kv_scale is None else {"k_scale": kv_scale[0], "v_scale": kv_scale[1]}
        return self._runner(lambda q, kv: w.run(q, kv, **scales), q, kv)

    def cascade(self, qs, caches, levels, hq, hkv, head_dim, page):
        q, kv, kv_dtype = self._inputs(qs, caches)
        w = self.fi.MultiLevelCascadeAttentionWrapper(len(levels), self.ws, "NHD")
        w.plan([self.ints(lv[0]) for lv in levels], [self.ints(lv[1]) for lv in levels],
               [self.ints(lv[2]) for lv in levels], [self.ints(lv[3]) for lv in levels],
               hq, hkv, head_dim, page, causal=False, q_data_type=q.dtype, kv_data_type=kv_dtype)
        return self._runner(w.run, q, kv)

    def paged_prefill(self, qs, caches, qo_indptr, indptr, indices, last, hq, hkv, head_dim, page):
        q, kv, kv_dtype = self._inputs(qs, caches)
        w = self.fi.BatchPrefillWithPagedKVCacheWrapper(self.ws, "NHD", backend="fa3")
        w.plan(self.ints(qo_indptr), self.ints(indptr), self.ints(indices), self.ints(last), hq, hkv,
               head_dim, page, causal=True, q_data_type=q.dtype, kv_data_type=kv_dtype)
        return self._runner(w.run, q, kv)

    def attention(self, qs, caches, qo_indptr, indptr, indices, kv_lens, hq, hkv, head_dim, page):
        q, kv, kv_dtype = self._inputs(qs, caches)
        w = self.fi.BatchAttention("NHD")
        w.plan(self.ints(qo_indptr), self.ints(indptr), self.ints(indices), self.ints(kv_lens), hq, hkv,
               head_dim, head_dim, page, causal=True, q_data_type=q.dtype, kv_data_type=kv_dtype)
        return self._runner(lambda q, kv: w.run(q, kv, logits_soft_cap=0.0)[0], q, kv)

    def ragged(self, q, k, v, indptr, hq, hkv, head_dim, soft_cap=None, window_left=-1):
        q, k, v = self.tensor(q), self.tensor(k), self.tensor(v)
        w = self.fi.BatchPrefillWithRaggedKVCacheWrapper(self.ws, "NHD", backend="fa3")
        ind = self.ints(indptr)
        w.plan(ind, ind, hq, hkv, head_dim, causal=True, logits_soft_cap=soft_cap, window_left=window_left,
               q_data_type=q.dtype, kv_data_type=k.dtype)
        return lambda: [w.run(q, k, v)]

    def sampling(self, name, xs, args):
        """flashinfer.sampling.<name>(x, *args) once per input x of xs (jax arrays [B, V])."""
        fn, ts = getattr(self.fi.sampling, name), [self.tensor(x) for x in xs]
        return lambda: [fn(t, *args) for t in ts]

    def mla(self, qn, qp, ckv, kpe, qo_indptr, indptr, indices, kv_lens, heads, page, causal, sm_scale):
        """BatchMLAPagedAttentionWrapper (fa3): qn [calls, T, H, 512], qp [calls, T, H, 64]."""
        qn, qp, ckv, kpe = (self.tensor(x) for x in (qn, qp, ckv, kpe))
        w = self.fi.mla.BatchMLAPagedAttentionWrapper(self.ws, backend="fa3")
        w.plan(self.ints(qo_indptr), self.ints(indptr), self.ints(indices), self.ints(kv_lens), heads,
               qn.shape[-1], qp.shape[-1], page, causal, sm_scale, qn.dtype, ckv.dtype)
        return lambda: [w.run(qn[i], qp[i], ckv, kpe) for i in range(qn.shape[0])]
