"""Convolutions: a ``conv_general_dilated`` with a parameter kernel.

One use of the kernel (any rank, dimension numbers, strides, padding,
dilation, feature groups), with the bias added to its output in the
conv's own output layout. The data is the conv input and the output
cotangent, both in the conv's own layout; the block (KFC) extracts the
patches itself.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from kfac_jax_lite import blocks as B
from kfac_jax_lite.tagging import _format as F
from kfac_jax_lite.tagging._kinds.base import Grouping, LayerSpec, Unsupported


@dataclasses.dataclass(frozen=True)
class ConvSpec(LayerSpec):
  """The arguments of ``lax.conv_general_dilated`` and ``has_bias``."""

  name = "conv"
  patterns = frozenset({"conv"})

  kernel_shape: tuple
  window_strides: tuple
  padding: tuple
  lhs_dilation: tuple
  rhs_dilation: tuple
  dimension_numbers: lax.ConvDimensionNumbers
  feature_group_count: int
  has_bias: bool

  @property
  def param_shapes(self):
    k = tuple(self.kernel_shape)
    bias = ((k[self.dimension_numbers.rhs_spec[0]],),) if self.has_bias else ()
    return (k,) + bias

  @property
  def _window(self):
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

  @classmethod
  def group(cls, uses, leaf_shapes, depth):
    del leaf_shapes, depth
    if len(uses) != 1:
      raise Unsupported(f"a convolution kernel used {len(uses)} times "
                        "(KroneckerConv takes a single use)")
    u = uses[0]
    if any(l[0] == "t" for l in F.level_labels(u)):
      raise Unsupported("a convolution reused at every step of lax.scan")
    c = u.config
    spec = cls(kernel_shape=c["kernel_shape"],
               window_strides=c["window_strides"], padding=c["padding"],
               lhs_dilation=c["lhs_dilation"], rhs_dilation=c["rhs_dilation"],
               dimension_numbers=c["dimension_numbers"],
               feature_group_count=c["feature_group_count"],
               has_bias="bias" in u.roles)
    return Grouping(spec, tuple(v.leaf for v in u.roles.values()))

  def default_block(self, *, damping_mode, weight_sharing):
    del weight_sharing  # KFC: the locations are always "expand"-ed.
    return B.KroneckerConv(**self._window, damping_mode=damping_mode)

  def block_for(self, choice, default):
    if choice == "diagonal":
      return B.DiagonalConv(**self._window)
    return super().block_for(choice, default)

  def data(self, uses, captures, cotangents, stacked):
    """``(conv input, output cotangents [S, ...])``, both in the conv's
    own layout (with a leading stack axis when ``stacked``)."""
    del stacked
    (u,) = uses
    return (F.arranged(u, captures[u.uid], out=False),
            F.arranged(u, cotangents[u.uid], samples=True))

  def per_example_grads(self, inputs, cotangents):
    dn = self.dimension_numbers
    kernel = jnp.zeros(self.kernel_shape, inputs.dtype)

    def one(x, gy):  # one example, its batch axis kept with size 1
      f = lambda k: lax.conv_general_dilated(
          x, k, self.window_strides, self.padding, self.lhs_dilation,
          self.rhs_dilation, dn, self.feature_group_count)
      return jax.vjp(f, kernel)[1](gy)[0]
    b_in, b_out = dn.lhs_spec[0], dn.out_spec[0]
    per = jax.vmap(jax.vmap(one, (b_in, b_out)), (None, 0))(
        jnp.expand_dims(inputs, b_in + 1),
        jnp.expand_dims(cotangents, 2 + b_out))
    if not self.has_bias:
      return (per,)
    g = cotangents
    axes = tuple(1 + a for a in range(g.ndim - 1)
                 if a not in (b_out, dn.out_spec[1]))
    bias = g.sum(axes)
    if dn.out_spec[1] < b_out:
      bias = jnp.swapaxes(bias, 1, 2)
    return per, bias
