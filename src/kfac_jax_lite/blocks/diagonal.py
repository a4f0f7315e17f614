"""Diagonal blocks of dense and conv layers: the "sum of squares" estimator.

The diagonal of the curvature is estimated by the weighted mean of squared
per-example gradients, ``F_diag = Σ_i c_i E[(∂ℓ_i/∂θ)²]``, a lower-variance
estimator than squaring the batch gradient. For a dense layer used once per
example the per-example gradient is ``ā_i ⊗ g_i``, so the sum is formed
without any per-example gradient: ``F_diag = (ā²)ᵀ diag(c) (g²)``. When the
layer is applied at R > 1 positions of an example (a sequence axis, a
convolution's locations) its per-example gradient is ``Σ_r ā_ir ⊗ g_ir``
and is formed explicitly (N·a·b floats), then squared.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kfac_jax_lite.blocks import _layout
from kfac_jax_lite.blocks import flat
from kfac_jax_lite.blocks import conv
from kfac_jax_lite.blocks import dense


class _DiagonalOfLayout(flat.FlatBlock):
  """A diagonal block whose statistics come in the layout's matrix form."""

  diagonal = True
  layout: _layout.Layout  # Provided by each subclass (a property).

  @property
  def param_shapes(self):
    return self.layout.param_shapes

  def _to_flat(self, mat):
    return _layout.flatten(self.layout.from_mat(mat))


@dataclasses.dataclass(frozen=True)
class DiagonalDense(_DiagonalOfLayout):
  """Diagonal block of a dense layer (arguments as ``KroneckerDense``)."""

  kernel_shape: tuple
  in_axes: tuple = (0,)
  has_bias: bool = False

  def __post_init__(self):
    object.__setattr__(self, "kernel_shape", tuple(self.kernel_shape))
    object.__setattr__(self, "in_axes", tuple(self.in_axes))
    self.layout  # Validates the axes.

  @property
  def layout(self):
    return _layout.DenseLayout(self.kernel_shape, self.in_axes, self.has_bias)

  def compute_stats(self, inputs, cotangents, weights=None):
    """``[n]`` diagonal from the same arguments as ``KroneckerDense``."""
    a, g, c, _ = dense.dense_data(self.layout, inputs, cotangents, weights,
                                  repr(self))
    s = g.shape[0]
    if a.shape[1] == 1:
      mat = jnp.einsum("ni,snj->ij", a[:, 0] ** 2 * c[:, None], g[:, :, 0] ** 2)
    else:
      per_example = jnp.einsum("nri,snrj->snij", a, g)
      mat = jnp.einsum("n,snij->ij", c, per_example ** 2)
    return self._to_flat(mat[None] / s)


@dataclasses.dataclass(frozen=True)
class DiagonalConv(conv.ConvConfig, _DiagonalOfLayout):
  """Diagonal block of a convolution (arguments as ``KroneckerConv``)."""

  def __post_init__(self):
    self._setup()

  def compute_stats(self, inputs, cotangents, weights=None):
    """``[n]`` diagonal: ``Σ_i c_i (Σ_t ā_it g_itᵀ)²`` per group."""
    a, g, c, _ = conv.conv_data(self, inputs, cotangents, weights)
    per_example = jnp.einsum("ntki,sntkj->snkij", a, g)  # k: group
    mat = jnp.einsum("n,snkij->kij", c, per_example ** 2) / g.shape[0]
    return self._to_flat(mat)
