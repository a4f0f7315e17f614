"""Curvature factors: immutable pytrees and the pure functions over them.

A factor is a running estimate of a symmetric positive semi-definite matrix
``C`` (``[..., n, n]``) or of its diagonal (``[..., n]``); the leading ``...``
are batch axes (one factor per convolution feature group, say). It is held
as a zero-debiased exponential moving average

    S_t = decay * S_{t-1} + (1 - decay) * w_t * X_t
    W_t = decay * W_{t-1} + (1 - decay) * w_t
    C_t = S_t / W_t

so the first update already gives ``C_1 = X_1`` whatever the decay.

Beside the running estimate a factor carries a cache of its last
decomposition (eigenvalues, eigenvectors, and a damped matrix power), the
step at which it was computed, and two health counters: how many updates
were refused for non-finite statistics and how many decompositions failed
(the last good cache is kept then).

Everything here is a pure function on ``FactorState``; nothing traces user
code and nothing depends on optax.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.scipy import linalg as jsl

Array = jax.Array


class FactorState(NamedTuple):
  """One curvature factor (a pytree; checkpoint it like any other)."""

  cov: Array  # EMA accumulator S_t: [..., n, n] (dense) or [..., n] (diagonal).
  weight: Array  # EMA of the update weights W_t; C_t = cov / weight.
  num_skipped: Array  # int32: updates refused for non-finite statistics.
  eigvals: Array  # cache: eigenvalues of C (clipped at 0), [..., n].
  eigvecs: Array  # cache: eigenvectors of C, [..., n, n]; [..., 0] if diagonal.
  matpower: Array  # cache: (C + d I)^p at the last refresh's damping d, power p.
  cache_step: Array  # int32: step of the last good refresh (-1: never).
  num_failed: Array  # int32: refreshes whose decomposition was non-finite.


def init_factor(dim: int, *, diagonal: bool = False, batch_shape=(),
                dtype=jnp.float32) -> FactorState:
  """A factor of size ``dim`` with no statistics yet (it reads as zero)."""
  batch_shape = tuple(batch_shape)
  vec = jnp.zeros(batch_shape + (dim,), dtype)
  mat = vec if diagonal else jnp.zeros(batch_shape + (dim, dim), dtype)
  eigvecs = jnp.zeros(batch_shape + (0,), dtype) if diagonal else mat
  return FactorState(
      cov=mat, weight=jnp.zeros((), dtype),
      num_skipped=jnp.zeros((), jnp.int32), eigvals=vec, eigvecs=eigvecs,
      matpower=mat, cache_step=jnp.full((), -1, jnp.int32),
      num_failed=jnp.zeros((), jnp.int32))


def is_diagonal(state: FactorState) -> bool:
  """Whether the factor holds only a diagonal (decided by static shapes)."""
  return state.cov.ndim == state.eigvals.ndim


def factor_value(state: FactorState) -> Array:
  """The debiased estimate ``C = S / W`` (zeros before the first update)."""
  safe = jnp.where(state.weight > 0, state.weight, 1)
  return jnp.where(state.weight > 0, state.cov / safe, jnp.zeros_like(state.cov))


def all_finite(tree) -> Array:
  """A scalar bool: every leaf of ``tree`` is finite."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def _check_stats_shape(state: FactorState, new_stats, where: str):
  if tuple(jnp.shape(new_stats)) != tuple(state.cov.shape):
    raise ValueError(
        f"{where}: new statistics of shape {tuple(jnp.shape(new_stats))} do "
        f"not match the factor's shape {tuple(state.cov.shape)}")


def update_cov_if(state: FactorState, new_stats, decay, weight, ok) -> FactorState:
  """``update_cov`` with the finiteness verdict given (for joint checks).

  Blocks with several factors decide once for all of them, so that one bad
  factor never leaves its siblings updated alone.
  """
  _check_stats_shape(state, new_stats, "update_cov")
  dtype = state.cov.dtype
  new_stats = jnp.asarray(new_stats).astype(dtype)
  decay = jnp.asarray(decay, dtype)
  weight = jnp.asarray(weight, dtype)
  ok = jnp.logical_and(ok, jnp.isfinite(weight))
  new_cov = decay * state.cov + (1 - decay) * weight * new_stats
  new_weight = decay * state.weight + (1 - decay) * weight
  return state._replace(
      cov=jnp.where(ok, new_cov, state.cov),
      weight=jnp.where(ok, new_weight, state.weight),
      num_skipped=state.num_skipped + jnp.where(ok, 0, 1).astype(jnp.int32))


def update_cov(state: FactorState, new_stats, decay, weight=1.0) -> FactorState:
  """Zero-debiased EMA update of a factor with fresh statistics ``new_stats``.

  ``S <- decay*S + (1-decay)*weight*new_stats``, ``W <- decay*W +
  (1-decay)*weight``. If ``new_stats`` (or ``weight``) has a non-finite
  entry the state is returned unchanged except ``num_skipped``, which counts
  the refusal. A shape mismatch raises ``ValueError`` naming both shapes.
  """
  return update_cov_if(state, new_stats, decay, weight, all_finite(new_stats))


# --- damped powers ---------------------------------------------------------

def _eye_like(c: Array) -> Array:
  return jnp.broadcast_to(jnp.eye(c.shape[-1], dtype=c.dtype), c.shape)


def _damping_array(damping, dtype) -> Array:
  """Damping as an array broadcastable against eigenvalues [..., n]."""
  return jnp.asarray(damping, dtype)[..., None]


def _is_minus_one(exp) -> bool:
  return isinstance(exp, (int, float)) and float(exp) == -1.0


def _eigh(c: Array):
  """Symmetric eigendecomposition with eigenvalues clipped at zero."""
  w, q = jnp.linalg.eigh((c + jnp.swapaxes(c, -1, -2)) / 2)
  return jnp.maximum(w, 0), q


def _power_from_eigh(w, q, damping, exp) -> Array:
  d = _damping_array(damping, w.dtype)
  return (q * (w + d)[..., None, :] ** exp) @ jnp.swapaxes(q, -1, -2)


def _damped(c: Array, damping) -> Array:
  return c + jnp.asarray(damping, c.dtype)[..., None, None] * _eye_like(c)


def damped_cholesky(state: FactorState, damping) -> Array:
  """Lower-triangular ``L`` with ``L Lᵀ = C + damping·I`` (diagonal: ``√(c+d)``)."""
  c = factor_value(state)
  if is_diagonal(state):
    return jnp.sqrt(jnp.maximum(c, 0) + _damping_array(damping, c.dtype)[..., 0])
  return jnp.linalg.cholesky(_damped(c, damping))


def damped_matpower(state: FactorState, damping, exp, *,
                    use_cache: bool = False) -> Array:
  """``(C + damping·I)^exp`` for any real ``exp``.

  Computed through a symmetric eigendecomposition whose eigenvalues are
  clipped at 0 before damping; ``exp = -1`` takes the Cholesky fast path
  (falling back to the eigendecomposition if the Cholesky factor is not
  finite). With ``use_cache=True`` the cached eigendecomposition from the
  last ``refresh_cache`` is used instead of decomposing now. ``damping`` may
  be an array over the factor's batch axes. A diagonal factor returns the
  diagonal of the result.
  """
  if is_diagonal(state):
    c = state.eigvals if use_cache else factor_value(state)
    return (jnp.maximum(c, 0) + _damping_array(damping, c.dtype)[..., 0]) ** exp
  if use_cache:
    return _power_from_eigh(state.eigvals, state.eigvecs, damping, exp)
  c = factor_value(state)
  if _is_minus_one(exp):
    def by_cholesky(c):
      chol = jnp.linalg.cholesky(_damped(c, damping))
      return jsl.cho_solve((chol, True), _eye_like(c))

    def by_eigh(c):
      return _power_from_eigh(*_eigh(c), damping, -1.0)

    inv = by_cholesky(c)
    return jax.lax.cond(all_finite(inv), lambda _: inv, by_eigh, c)
  return _power_from_eigh(*_eigh(c), damping, exp)


def refresh_cache(state: FactorState, step, *, damping=None,
                  exp=-1.0) -> FactorState:
  """Recompute the cached decomposition at ``step``.

  With ``damping=None`` the eigendecomposition is cached (for exact damping
  and arbitrary powers, applied later with any damping). With a damping the
  damped power ``(C + damping·I)^exp`` is cached as well (for ``exp = -1``
  through the Cholesky fast path, leaving the eigen cache as it was).
  A decomposition with a non-finite entry keeps the last good cache and
  counts in ``num_failed``.
  """
  c = factor_value(state)
  if is_diagonal(state):
    eigvals, eigvecs = jnp.maximum(c, 0), state.eigvecs
  elif damping is not None and _is_minus_one(exp):
    eigvals, eigvecs = state.eigvals, state.eigvecs
  else:
    eigvals, eigvecs = _eigh(c)
  new = state._replace(eigvals=eigvals, eigvecs=eigvecs)
  if damping is not None:
    new = new._replace(matpower=damped_matpower(
        new, damping, exp, use_cache=not _is_minus_one(exp)))
  ok = all_finite((new.eigvals, new.eigvecs, new.matpower))
  keep = lambda n, o: jnp.where(ok, n, o)
  return state._replace(
      eigvals=keep(new.eigvals, state.eigvals),
      eigvecs=keep(new.eigvecs, state.eigvecs),
      matpower=keep(new.matpower, state.matpower),
      cache_step=jnp.where(ok, jnp.asarray(step, jnp.int32), state.cache_step),
      num_failed=state.num_failed + jnp.where(ok, 0, 1).astype(jnp.int32))


# --- products with one factor ----------------------------------------------

def _apply(m: Array, x: Array, diagonal: bool) -> Array:
  """``m @ x`` for a dense ``m`` [..., n, n], or ``m[..., :, None] * x``."""
  if diagonal:
    return m[..., :, None] * x if x.ndim == m.ndim + 1 else m * x
  return m @ x if x.ndim == m.ndim else (m @ x[..., None])[..., 0]


def multiply(state: FactorState, x: Array) -> Array:
  """``C @ x`` for ``x`` of shape [..., n] or [..., n, k]."""
  return _apply(factor_value(state), x, is_diagonal(state))


def multiply_matpower(state: FactorState, x: Array, damping, exp, *,
                      use_cache: bool = False) -> Array:
  """``(C + damping·I)^exp @ x``."""
  return _apply(damped_matpower(state, damping, exp, use_cache=use_cache), x,
                is_diagonal(state))


def multiply_inverse(state: FactorState, x: Array, damping, *,
                     use_cache: bool = False) -> Array:
  """``(C + damping·I)^{-1} @ x``; a Cholesky solve unless ``use_cache``."""
  if use_cache or is_diagonal(state):
    return multiply_matpower(state, x, damping, -1.0, use_cache=use_cache)
  chol = damped_cholesky(state, damping)
  vec = x.ndim == chol.ndim - 1
  out = jsl.cho_solve((chol, True), x[..., None] if vec else x)
  return out[..., 0] if vec else out
