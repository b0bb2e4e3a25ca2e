"""The attention-state merge operator ⊕ (paper §2.2) as Pallas kernels."""
import jax.numpy as jnp
import numpy as np

from jaxinfer import _backend
from jaxinfer.formats import AttentionState, check_int32, is_concrete
from pallas_kernels import merge as merge_kernels


def _check_state(name, s):
    if not isinstance(s, tuple) or len(s) != 2:
        raise ValueError(f"{name} must be an AttentionState (o, lse)")
    o, lse = s
    if o.ndim < 2 or lse.shape != o.shape[:-1]:
        raise ValueError(f"{name}: o {o.shape} must be [..., H, D] and lse {lse.shape} [..., H]")
    return AttentionState(o, lse.astype(jnp.float32))


def _empty(shape, dtype):
    """The state of no keys: o = 0 [..., H, D], lse = -inf [..., H]."""
    return AttentionState(jnp.zeros(shape, dtype), jnp.full(shape[:-1], -jnp.inf, jnp.float32))


def merge_state(a, b, mask=None, *, backend=None):
    """a ⊕ b for states o [..., H, D], lse [..., H] (natural log).

    mask [...] (bool, optional): where False, the result is a unchanged
    (FlashInfer's merge_state_in_place mask). An empty state (lse = -inf)
    leaves the other unchanged; two empty states give o = 0, lse = -inf.
    """
    a, b = _check_state("a", a), _check_state("b", b)
    if a.o.shape != b.o.shape:
        raise ValueError(f"a.o {a.o.shape} and b.o {b.o.shape} must have one shape")
    lead, (h, d) = a.o.shape[:-2], a.o.shape[-2:]
    n = int(np.prod(lead))
    if mask is None:
        mask_i = jnp.ones((n,), jnp.int32)
    else:
        if tuple(jnp.shape(mask)) != tuple(lead):
            raise ValueError(f"mask must have shape {tuple(lead)}, got {jnp.shape(mask)}")
        mask_i = jnp.asarray(mask).reshape(n).astype(jnp.int32)
    if n == 0:  # no rows: nothing to merge
        return a
    o, lse = merge_kernels.merge_pair(
        a.o.reshape(n, h, d), a.lse.reshape(n, h), b.o.astype(a.o.dtype).reshape(n, h, d),
        b.lse.reshape(n, h), mask_i, interpret=_backend.use_interpret(backend))
    return AttentionState(o.reshape(a.o.shape), lse.reshape(a.lse.shape))


def merge_states(states, *, backend=None):
    """Merges n states along the axis before H: o [..., n, H, D], lse [..., n, H] -> [..., H, D]."""
    o, lse = _check_state("states", states)
    if o.ndim < 3:
        raise ValueError(f"states.o must be [..., n, H, D], got {o.shape}")
    lead, (n, h, d) = o.shape[:-3], o.shape[-3:]
    rows = int(np.prod(lead))
    if rows == 0 or n == 0:  # no rows, or no states to merge: the empty state (o = 0, lse = -inf)
        return _empty(lead + (h, d), o.dtype)
    indptr = jnp.arange(rows + 1, dtype=jnp.int32) * n
    out_o, out_lse = merge_kernels.merge_varlen(
        o.reshape(rows * n, h, d), lse.reshape(rows * n, h), indptr,
        interpret=_backend.use_interpret(backend))
    return AttentionState(out_o.reshape(*lead, h, d), out_lse.reshape(*lead, h))


def merge_state_varlen(states, indptr, *, backend=None):
    """Merges variable-size groups of states: group i is rows indptr[i]:indptr[i+1]
    of o [P, H, D], lse [P, H]; returns [len(indptr) - 1, H, D]. Groups merge in
    row order, so the result is deterministic. An empty group gives o = 0, lse = -inf."""
    o, lse = _check_state("states", states)
    if o.ndim != 3:
        raise ValueError(f"states.o must be [P, H, D], got {o.shape}")
    check_int32("indptr", indptr)
    if jnp.ndim(indptr) != 1 or jnp.shape(indptr)[0] < 1:
        raise ValueError(f"indptr must be int32[G + 1], got shape {jnp.shape(indptr)}")
    if is_concrete(indptr):
        ip = np.asarray(indptr)
        if ip.ndim != 1 or ip.size < 1 or ip[0] != 0 or np.any(np.diff(ip) < 0) or ip[-1] > o.shape[0]:
            raise ValueError(f"indptr must start at 0, be non-decreasing and end <= {o.shape[0]}")
    groups = jnp.shape(indptr)[0] - 1
    if groups == 0 or o.shape[0] == 0:  # no groups, or only empty ones: o = 0, lse = -inf
        return _empty((groups,) + o.shape[1:], o.dtype)
    out_o, out_lse = merge_kernels.merge_varlen(o, lse, jnp.asarray(indptr),
                                                interpret=_backend.use_interpret(backend))
    return AttentionState(out_o, out_lse)
