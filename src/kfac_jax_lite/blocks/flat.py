"""Flat blocks: a diagonal or a full matrix over a layer's flat parameter
vector (``diagonal.py``, ``full.py``, ``scale_shift.py`` build on it); the
Kronecker family is ``base.KroneckerBlock``."""
from __future__ import annotations

import math
from typing import ClassVar

import jax.numpy as jnp

from kfac_jax_lite import factor as fac
from kfac_jax_lite.blocks import _layout
from kfac_jax_lite.blocks.base import Block
from kfac_jax_lite.factor import float_dtype


class FlatBlock(Block):
  """A block over the flat parameter vector: a diagonal or a full matrix.

  Subclasses provide ``param_shapes``, ``diagonal`` and ``compute_stats``
  returning the new diagonal ``[n]`` or matrix ``[n, n]``.
  """

  diagonal: bool  # Provided by each subclass (a field or class attribute).
  symmetric_stats: ClassVar[bool] = True  # [n] or Σ g gᵀ [n, n].

  @property
  def size(self):
    return sum(math.prod(s) for s in self.param_shapes)

  @property
  def factor_shapes(self):
    return ((self.size,) if self.diagonal else (self.size, self.size),)

  def init(self, dtype=jnp.float32) -> fac.FactorState:
    return fac.init_factor(self.size, diagonal=self.diagonal, dtype=dtype)

  def update(self, state, stats, decay, weight=1.0):
    return fac.update_cov(state, stats, decay, weight)

  def refresh(self, state, damping, exp=-1.0, step=0, method="auto"):
    return fac.refresh_cache(state, step, damping=damping, exp=exp,
                             method=method)

  def _apply(self, v, fn):
    _layout.check_params(self, v, self.param_shapes)
    dtypes = [jnp.asarray(x).dtype for x in v]
    flat = _layout.flatten(v)
    out = fn(flat.astype(float_dtype(flat)))
    return tuple(x.astype(d) for x, d in zip(
        _layout.unflatten(out, self.param_shapes), dtypes))

  def multiply(self, state, v):
    return self._apply(v, lambda x: fac.multiply(state, x))

  def multiply_matpower(self, state, v, damping, exp, use_cache=False):
    if use_cache:  # The cache holds the damped power chosen at refresh.
      return self._apply(v, lambda x: fac.multiply_matpower(
          state, x, damping, exp, use_cache=True))
    return self._apply(v, lambda x: fac.multiply_matpower(state, x, damping, exp))

  def multiply_inverse(self, state, v, damping, use_cache=False):
    if use_cache:
      return self.multiply_matpower(state, v, damping, -1.0, use_cache=True)
    return self._apply(v, lambda x: fac.multiply_inverse(state, x, damping))

  def _cholesky(self, state, v, damping, inverse, transpose):
    def fn(x):
      chol = fac.damped_cholesky(state, damping)
      if self.diagonal:
        return x / chol if inverse else x * chol
      if inverse:
        return fac.solve_triangular(
            chol, x, lower=True, trans=1 if transpose else 0)
      return (chol.T if transpose else chol) @ x
    return self._apply(v, fn)

  def multiply_cholesky(self, state, v, damping, transpose=False):
    return self._cholesky(state, v, damping, False, transpose)

  def multiply_cholesky_inverse(self, state, v, damping, transpose=False):
    return self._cholesky(state, v, damping, True, transpose)

  def to_dense(self, state):
    value = fac.factor_value(state)
    return jnp.diag(value) if self.diagonal else value
