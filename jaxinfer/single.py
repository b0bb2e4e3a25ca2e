"""Single-request attention: one query (decode) or many (prefill) over contiguous K/V."""

import jax.numpy as jnp
import numpy as np

from jaxinfer import _backend, dispatch
from jaxinfer.runners import run_decode_sections, run_prefill_sections
from jaxinfer.formats import AttentionState, check_q, check_qkv, default_sm_scale
from jaxinfer.plans import PrefillPlan, WrapperFacts
from planner import decode as decode_planner
from planner import prefill as prefill_planner

def _check_kv(q, k, v, q_ndim):
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_q(x, name)
    if q.ndim != q_ndim or k.ndim != 3:
        raise ValueError(f"q must be {q_ndim}-D and k [kv_len, Hkv, D], got {q.shape} and {k.shape}")
    if k.shape != v.shape:
        raise ValueError(f"k {k.shape} and v {v.shape} must have one shape")
    check_qkv(q, k)
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def _no_keys(q, return_lse):
    """kv_len == 0 (or no query): every row sees no key (o = 0, lse = -inf); no kernel runs."""
    state = AttentionState(jnp.zeros(q.shape, q.dtype), jnp.full(q.shape[:-1], -jnp.inf, jnp.float32))
    return state if return_lse else state.o


def _problem(family, q, k, interpret):
    hq, d = q.shape[-2:]
    problem = dispatch.Problem(family, hq, k.shape[1], d, "ragged", interpret=interpret)
    dispatch.check(problem)
    return problem


def single_decode_with_kv_cache(q, k, v, *, sm_scale=None, return_lse=False, backend=None,
                                num_ctas=None, config=None):
    """q [Hq, D], k/v [kv_len, Hkv, D] -> o [Hq, D] (or AttentionState with lse [Hq]).

    Runs the paged decode kernel (jaxinfer.dispatch's choice) over the rows of k/v viewed as
    pages of one token (no copy), split across the GPU by the decode planner.
    """
    _check_kv(q, k, v, 2)
    kv_len, hkv, d = k.shape
    if kv_len == 0:
        return _no_keys(q, return_lse)
    interpret = _backend.use_interpret(backend)
    problem = _problem("decode", q, k, interpret)
    impl = dispatch.choose(problem, np.ones(1), np.array([kv_len]), False)
    cells = max(1, (num_ctas or 2 * _backend.num_sms()) // hkv)
    layout, buf, _ = decode_planner.plan_decode(  # one request, pages of one token: the rows of k/v
        np.array([0, kv_len], np.int32), np.arange(kv_len, dtype=np.int32), np.array([1], np.int32),
        page_size=1, num_cells=cells)
    sec = layout.unpack(jnp.asarray(buf))
    o, lse = run_decode_sections(
        q[None], k.reshape(kv_len * hkv, d), v.reshape(kv_len * hkv, d), sec, sec["kv_indices"],
        sec["kv_lens"], layout, page_size=1, num_kv_heads=hkv, cache_layout="NHD",
        sm_scale=default_sm_scale(d, sm_scale), interpret=interpret,
        config=dispatch.config_for(impl, problem, dispatch.check_configs(config)))
    return AttentionState(o[0], lse[0]) if return_lse else o[0]


def single_prefill_with_kv_cache(q, k, v, *, causal=False, sm_scale=None, return_lse=False,
                                 backend=None, num_ctas=None, config=None):
    """q [qo_len, Hq, D], k/v [kv_len, Hkv, D] -> o [qo_len, Hq, D] (or AttentionState).

    causal is bottom-right aligned (query i sees keys j <= i + kv_len - qo_len);
    rows that see no key give o = 0 and lse = -inf. Runs the batch prefill
    kernel on one request over contiguous K/V (no copy), on the kernels that take a plan without
    aligned tails (Triton).
    """
    _check_kv(q, k, v, 3)
    qo_len, hq, d = q.shape
    kv_len, hkv, _ = k.shape
    if kv_len == 0 or qo_len == 0:
        return _no_keys(q, return_lse)
    interpret = _backend.use_interpret(backend)
    problem = _problem("prefill", q, k, interpret)
    # (its plan has no aligned tails: no whole-tile kernel)
    impl = dispatch.choose(problem, np.array([qo_len]), np.array([kv_len]), causal, without=dispatch.WHOLE_TILE_ROWS)
    cells = max(1, (num_ctas or 2 * _backend.num_sms()) // hkv)
    layout, buf, _ = prefill_planner.plan_prefill(
        np.array([0, qo_len], np.int32), np.array([kv_len]), np.zeros(1, np.int64),
        np.zeros(0, np.int32), group=hq // hkv, causal=causal, num_cells=cells)
    spec = WrapperFacts("single_prefill_with_kv_cache", hq, hkv, d, 1, "NHD").spec(kv_len, impl.name)
    o, lse = run_prefill_sections(
        q, k.reshape(kv_len * hkv, d), v.reshape(kv_len * hkv, d),
        PrefillPlan((jnp.asarray(buf),), None, layout, causal, spec), None, page_size=1, num_kv_heads=hkv,
        cache_layout="NHD", sm_scale=default_sm_scale(d, sm_scale), interpret=interpret, kernel=impl.kernel,
        config=dispatch.config_for(impl, problem, dispatch.check_configs(config)))
    return AttentionState(o, lse) if return_lse else o
