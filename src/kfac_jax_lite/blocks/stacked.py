"""``Stacked(block, n)``: n independent copies of a block, one per slice.

A layer stacked along ``lax.scan`` (a parameter leaf ``[n, ...]`` sliced
once per step) is n layers that share a structure. Its curvature is block
diagonal over the slices, ``F = blockdiag_l(F_l)``, each ``F_l`` the inner
block's curvature of slice ``l``. ``Stacked`` implements the block
interface by ``jax.vmap``-ing the inner block over a leading axis of n of
its state, its statistics, its parameters and its ``LayerData`` (the
examples' ``weights`` are shared by all slices). On CPU, the operations
that call LAPACK's Cholesky and triangular solves (a refresh by
``method="cholesky"``, products without the cache, the Cholesky
products) loop over the slices with ``lax.map`` instead: a vmapped batch
of those calls can hang jaxlib 0.10's CPU runtime (see
``kfac_jax_lite.factor.sequential_on_cpu``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from kfac_jax_lite import factor as fac
from kfac_jax_lite.blocks import _layout
from kfac_jax_lite.blocks import base


def _over_slices(fn, *args, lapack=False):
  """``fn`` applied to each slice of ``args`` (leading axis), stacked:
  ``jax.vmap``, or a sequential ``lax.map`` on CPU where ``fn`` calls
  LAPACK's Cholesky or triangular solves (``lapack``)."""
  if lapack and fac.sequential_on_cpu():
    return jax.lax.map(lambda xs: fn(*xs), args)
  return jax.vmap(fn)(*args)


def _cholesky_refresh(method) -> bool:
  """Whether a refresh by ``method`` factors by Cholesky (a power other
  than -1 uses ``eigh`` instead, and then only loops needlessly)."""
  return fac.check_inverse_method(method) == "cholesky"


@dataclasses.dataclass(frozen=True)
class Stacked(base.Block):
  """``n`` copies of ``block``; parameters ``[n, *shape]`` per inner shape."""

  block: Any
  n: int

  def __post_init__(self):
    if not (isinstance(self.n, int) and self.n >= 1):
      raise ValueError(f"Stacked: n must be a positive int, got {self.n!r}")
    base.check_block(self.block, "Stacked")

  @property
  def consumes(self):
    return self.block.consumes

  @property
  def param_shapes(self):
    return tuple((self.n,) + tuple(s) for s in self.block.param_shapes)

  @property
  def factor_shapes(self):
    return tuple((self.n,) + tuple(s) for s in self.block.factor_shapes)

  def init(self, dtype=jnp.float32):
    one = self.block.init(dtype)
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (self.n,) + x.shape), one)

  def compute_stats(self, *args, weights=None):
    """The inner ``compute_stats`` per slice: every argument has a leading
    axis of n; ``weights`` are shared."""
    return jax.vmap(lambda *a: self.block.compute_stats(*a, weights=weights))(
        *args)

  def layer_stats(self, data, state=None):
    weights = data.weights
    fn = lambda d, st: self.block.layer_stats(d._replace(weights=weights), st)
    return jax.vmap(fn)(data._replace(weights=None), state)

  def update(self, state, stats, decay, weight=1.0):
    return jax.vmap(lambda st, x: self.block.update(st, x, decay, weight))(
        state, stats)

  def refresh(self, state, damping, exp=-1.0, step=0, method="auto"):
    return _over_slices(lambda st: self.block.refresh(st, damping, exp, step,
                                                      method), state,
                        lapack=_cholesky_refresh(method))

  def multiply(self, state, v):
    return jax.vmap(self.block.multiply)(state, tuple(v))

  def multiply_matpower(self, state, v, damping, exp, use_cache=False):
    return _over_slices(lambda st, x: self.block.multiply_matpower(
        st, x, damping, exp, use_cache), state, tuple(v),
                        lapack=not use_cache)

  def multiply_inverse(self, state, v, damping, use_cache=False):
    return _over_slices(lambda st, x: self.block.multiply_inverse(
        st, x, damping, use_cache), state, tuple(v), lapack=not use_cache)

  def multiply_cholesky(self, state, v, damping, transpose=False):
    return _over_slices(lambda st, x: self.block.multiply_cholesky(
        st, x, damping, transpose), state, tuple(v), lapack=True)

  def multiply_cholesky_inverse(self, state, v, damping, transpose=False):
    return _over_slices(lambda st, x: self.block.multiply_cholesky_inverse(
        st, x, damping, transpose), state, tuple(v), lapack=True)

  @property
  def one_slice(self):
    return self.block

  def caches(self, state):
    return jax.vmap(base.as_block(self.block).caches)(state)

  def with_caches(self, state, caches):
    return jax.vmap(base.as_block(self.block).with_caches)(state, caches)

  def has_statistics(self, state):
    """Whether every slice has statistics."""
    return jnp.all(jax.vmap(base.as_block(self.block).has_statistics)(state))

  def is_ready(self, state):
    """Whether every slice is ready."""
    return jnp.all(jax.vmap(base.as_block(self.block).is_ready)(state))

  def refresh_caches(self, state, damping, exp=-1.0, step=0, method="auto"):
    """Each slice's ``refresh_caches`` (a slice without statistics keeps
    its caches)."""
    return _over_slices(lambda st: base.as_block(self.block).refresh_caches(
        st, damping, exp, step, method), state,
                        lapack=_cholesky_refresh(method))

  def precondition(self, state, vectors, damping, exp):
    """Each slice's ``precondition`` (a slice that is not ready passes its
    vectors through)."""
    return jax.vmap(lambda st, x: base.as_block(self.block).precondition(
        st, x, damping, exp))(state, tuple(vectors))

  def to_dense(self, state):
    """The block-diagonal matrix, indexed like the stacked parameters."""
    per_slice = jax.vmap(self.block.to_dense)(state)  # [n, m, m]
    index = _layout.param_index(self.param_shapes)  # [n, *shape] per param
    idx = jnp.concatenate(
        [i.reshape(self.n, -1) for i in index], axis=1)  # [n, m]
    size = sum(math.prod(s) for s in self.param_shapes)
    dense = jnp.zeros((size, size), per_slice.dtype)
    return dense.at[idx[:, :, None], idx[:, None, :]].set(per_slice)
