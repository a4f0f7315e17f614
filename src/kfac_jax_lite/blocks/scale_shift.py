"""Scale-and-shift blocks (LayerNorm, RMSNorm, BatchNorm parameters).

For ``y = x · scale + shift`` with parameters broadcast against ``x``
(right-aligned), example i's gradient is

    ∂ℓ_i/∂scale = Σ_broadcast x_i · g_i,    ∂ℓ_i/∂shift = Σ_broadcast g_i,

summed over the axes the parameters are broadcast along. These are small
(one entry per feature), so they are formed per example and the block is
either their weighted second moment's diagonal ``Σ_i c_i u_i²`` or the full
matrix ``Σ_i c_i u_i u_iᵀ`` over ``u_i = [∂scale, ∂shift]`` (TF K-FAC's
``ScaleAndShiftDiagonalFB`` / ``ScaleAndShiftFullFB``).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kfac_jax_lite.blocks import base
from kfac_jax_lite.blocks import flat


@dataclasses.dataclass(frozen=True)
class ScaleAndShift(flat.FlatBlock):
  """Curvature of elementwise ``scale`` and/or ``shift`` parameters.

  ``param_shape``: the shape of each parameter (both share it);
  ``full=False`` keeps the diagonal, ``full=True`` the whole matrix.
  Parameters: ``(scale, shift)``, or just the one present.
  """

  param_shape: tuple
  has_scale: bool = True
  has_shift: bool = True
  full: bool = False

  def __post_init__(self):
    object.__setattr__(self, "param_shape", tuple(self.param_shape))
    if not (self.has_scale or self.has_shift):
      raise ValueError("ScaleAndShift needs a scale, a shift or both")

  @property
  def diagonal(self):
    return not self.full

  @property
  def param_shapes(self):
    return (self.param_shape,) * (int(self.has_scale) + int(self.has_shift))

  def _reduce(self, t, where):
    """Sum ``t [S, N, *y]`` over the axes the parameter broadcasts along."""
    y = t.shape[2:]
    p = self.param_shape
    if len(p) > len(y):
      raise ValueError(f"{where}: a parameter of shape {p} does not "
                       f"broadcast against outputs of shape {y}")
    padded = (1,) * (len(y) - len(p)) + p
    for pd, yd in zip(padded, y):
      if pd not in (1, yd):
        raise ValueError(f"{where}: a parameter of shape {p} does not "
                         f"broadcast against outputs of shape {y}")
    axes = tuple(2 + i for i, pd in enumerate(padded) if pd == 1)
    return t.sum(axis=axes).reshape(t.shape[:2] + (-1,))

  def compute_stats(self, inputs, cotangents, weights=None):
    """From ``inputs`` ``x [N, *y]`` of ``y = x·scale + shift`` (its values
    matter only with a scale) and the cotangents ``[(S,) N, *y]`` of ``y``."""
    where = repr(self)
    inputs = jnp.asarray(inputs)
    g = base.split_samples(jnp.asarray(cotangents), inputs.ndim, where)
    if g.shape[1:] != inputs.shape:
      raise ValueError(f"{where}: cotangents of shape {g.shape[1:]} do not "
                       f"match inputs of shape {inputs.shape}")
    dtype = base.stats_dtype(g)
    g = g.astype(dtype)
    parts = []
    if self.has_scale:
      x = inputs.astype(dtype)
      parts.append(self._reduce(x[None] * g, where))
    if self.has_shift:
      parts.append(self._reduce(g, where))
    u = jnp.concatenate(parts, axis=-1)  # S, N, size
    c, _ = base.normalized_weights(weights, u.shape[1], dtype, where)
    uc = u * c[None, :, None]
    if self.full:
      return base.gram(uc, u) / u.shape[0]
    return jnp.einsum("sni,sni->i", uc, u) / u.shape[0]
