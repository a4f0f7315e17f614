"""Kronecker-factored convolutions (KFC, Grosse & Martens 2016).

A convolution is a dense layer applied at every output location ``t`` to
the input patch ``ā_it`` (raveled receptive field, plus 1 for the bias).
Under KFC's assumptions (spatially homogeneous, uncorrelated derivatives)

    A = Σ_i w_i (1/T) Σ_t ā_it ā_itᵀ,   G = Σ_i c_i Σ_t g_it g_itᵀ,
    F ≈ c · A ⊗ G,

i.e. the ``"expand"`` rule of the dense block with the T locations as the
shared axis: the number of locations (TF K-FAC's ``renorm_coeff``) is folded
into ``G``, so a convolution with one output location is exactly the dense
block of the same weights. Feature groups (``feature_group_count``, with
depthwise as the extreme case) give one Kronecker product per group: the
group's input channels times its output channels.

``weight_sharing="reduce"`` (K-FAC-reduce, Eschenhagen et al. 2023, the
dense block's ``"reduce"`` with the locations as the shared axis) first
aggregates over the locations of each example, then takes outer products
over the examples:

    A = Σ_i w_i ã_i ã_iᵀ,  ã_i = (1/T) Σ_t ā_it   (the bias entry stays 1)
    G = Σ_i c_i E[ĝ_i ĝ_iᵀ], ĝ_i = Σ_t g_it,

exact (like ``"expand"``) for one location, and exact for any T when the
conv's output is summed over its locations before a loss whose curvature
does not depend on the input (a linear model with a Gaussian output: its
GGN is ``Σ_i c_i (Σ_t ā_it)(Σ_t ā_it)ᵀ ⊗ H``).

A kernel applied ``repeats`` > 1 times per example (a siamese conv, a conv
at every ``lax.scan`` step) takes its R applications stacked along the
batch axis, ``[R·N, ...]`` in R chunks of the N examples, with the loss
weights of the N examples: the applications' locations are all locations
of the example (``T`` above counts R·T), so per-example gradients (and
``"reduce"``) aggregate over all of them.

Any rank (1D, 2D, 3D...), dimension numbers, strides, padding and
dilations are supported: patches come from ``lax.conv_general_dilated_patches``
with the layer's own window.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import typing

import jax
import jax.numpy as jnp
from jax import lax

from kfac_jax_lite.blocks import _layout
from kfac_jax_lite.blocks import _size
from kfac_jax_lite.blocks import base
from kfac_jax_lite.blocks import dense


def _conv_dims(dimension_numbers, ndim):
  if dimension_numbers is None:
    return lax.ConvDimensionNumbers(
        tuple(range(ndim)), tuple(range(ndim)), tuple(range(ndim)))
  if isinstance(dimension_numbers, lax.ConvDimensionNumbers):
    return dimension_numbers
  # (lhs_spec, rhs_spec, out_spec) strings like ("NHWC", "HWIO", "NHWC").
  shape = (1,) * ndim
  return lax.conv_dimension_numbers(shape, shape, tuple(dimension_numbers))


def _freeze(x):
  if isinstance(x, str) or x is None:
    return x
  return tuple(_freeze(v) if isinstance(v, (list, tuple)) else int(v) for v in x)


def _patches(x, window, strides, padding, lhs_dilation, rhs_dilation):
  """``lax.conv_general_dilated_patches`` of ``x [N, C, *spatial]``:
  ``[N, C·K, *out_spatial]``, features in ``(c, k)`` order (``k`` the
  window position, row-major).

  Without input dilation, by strided slices of the padded input: no
  arithmetic, where JAX's patches are a convolution with a one-hot kernel
  (``N·T·(C·K)²`` multiply-adds: on the conv net of ``benchmarks/`` more
  than its whole training step, and on XLA:CPU slower still inside a
  ``lax.cond``). With ``lhs_dilation`` (a transposed convolution), JAX's.
  """
  nsp = len(window)
  strides = tuple(strides) if strides is not None else (1,) * nsp
  if lhs_dilation is not None and any(d != 1 for d in lhs_dilation):
    return lax.conv_general_dilated_patches(
        x, window, strides, padding, lhs_dilation=lhs_dilation,
        rhs_dilation=rhs_dilation, precision=lax.Precision.HIGHEST)
  dilation = (tuple(rhs_dilation) if rhs_dilation is not None
              else (1,) * nsp)
  extent = tuple((k - 1) * d + 1 for k, d in zip(window, dilation))
  if isinstance(padding, str):
    pads = lax.padtype_to_pads(x.shape[2:], extent, strides, padding)
  else:
    pads = tuple(tuple(p) for p in padding)
  xp = lax.pad(x, jnp.zeros((), x.dtype), ((0, 0, 0), (0, 0, 0)) + tuple(
      (lo, hi, 0) for lo, hi in pads))
  out = tuple((p - e) // s + 1
              for p, e, s in zip(xp.shape[2:], extent, strides))
  slices = []
  for offsets in itertools.product(*(range(k) for k in window)):
    start = (0, 0) + tuple(o * d for o, d in zip(offsets, dilation))
    limit = x.shape[:2] + tuple(b + (o - 1) * s + 1
                                for b, o, s in zip(start[2:], out, strides))
    slices.append(lax.slice(xp, start, limit, (1, 1) + strides))
  patches = jnp.stack(slices, axis=2)  # N, C, K, *out_spatial
  return patches.reshape((x.shape[0], x.shape[1] * len(slices)) + out)


def conv_data(block, inputs, cotangents, weights):
  """Per-example patches and cotangents of a convolution, per group.

  Returns ``(a [N, T, g, P(+1)], g [S, N, T, g, b], c, w)``; with
  ``block.repeats`` = R the batch of R·N applications is folded into N
  examples of R·T locations (application-major).
  """
  lay, dn, where = block.layout, block.dims, repr(block)
  inputs, cotangents = jnp.asarray(inputs), jnp.asarray(cotangents)
  nsp = len(lay.spatial)
  if inputs.ndim != nsp + 2:
    raise ValueError(f"{where}: inputs of shape {inputs.shape} should have "
                     f"{nsp + 2} axes")
  channels = inputs.shape[dn.lhs_spec[1]]
  if channels != lay.in_per_group * lay.groups:
    raise ValueError(f"{where}: inputs of shape {inputs.shape} have "
                     f"{channels} channels, the kernel expects "
                     f"{lay.in_per_group * lay.groups}")
  dtype = base.stats_dtype(inputs, cotangents)
  x = jnp.transpose(inputs, dn.lhs_spec).astype(dtype)  # N, C, *spatial
  patches = _patches(x, lay.spatial, block.window_strides, block.padding,
                     block.lhs_dilation, block.rhs_dilation)
  n = x.shape[0]
  k = math.prod(lay.spatial)
  patches = patches.reshape(n, lay.groups, lay.in_per_group, k, -1)
  a = jnp.transpose(patches, (0, 4, 1, 3, 2))  # N, T, g, K, I_g
  t = a.shape[1]
  a = a.reshape(n, t, lay.groups, lay.patch_size)
  if lay.has_bias:
    a = jnp.concatenate([a, jnp.ones(a.shape[:-1] + (1,), dtype)], axis=-1)
  g = base.split_samples(cotangents, nsp + 2, where)
  g = jnp.moveaxis(g, [1 + i for i in dn.out_spec], range(1, nsp + 3))
  if g.shape[1] != n or g.shape[2] != lay.out_features or math.prod(
      g.shape[3:]) != t:
    raise ValueError(f"{where}: cotangents of shape {cotangents.shape} do "
                     f"not match the convolution's output ({n} examples, "
                     f"{lay.out_features} features, {t} locations)")
  g = jnp.moveaxis(g.reshape(g.shape[0], n, lay.out_features, t), 2, 3)
  g = g.reshape(g.shape[0], n, t, lay.groups, lay.b).astype(dtype)
  r = block.repeats
  if r > 1:
    if n % r:
      raise ValueError(f"{where}: a batch of {n} applications does not "
                       f"split into {r} applications per example")
    n //= r
    a = jnp.swapaxes(a.reshape((r, n) + a.shape[1:]), 0, 1).reshape(
        (n, r * t) + a.shape[2:])
    g = jnp.swapaxes(g.reshape((g.shape[0], r, n) + g.shape[2:]), 1, 2
                     ).reshape((g.shape[0], n, r * t) + g.shape[3:])
  hint = ""
  if weights is not None and r == 1 and jnp.ndim(weights) == 1 and 0 < len(
      weights) < n and n % len(weights) == 0:
    hint = (f" (the convolution ran on {n} inputs: if the kernel is applied "
            f"{n // len(weights)} times per example, build the block with "
            f"repeats={n // len(weights)})")
  c, w = base.normalized_weights(weights, n, dtype, where, hint)
  return a, g, c, w


@dataclasses.dataclass(frozen=True)
class ConvConfig:
  """The convolution's static window, as given to ``conv_general_dilated``,
  ``has_bias``, and ``repeats``: the applications of the kernel per example
  stacked along the batch axis (module docstring; 1 for a conv used once).
  """

  kernel_shape: tuple
  window_strides: tuple | None = None
  padding: object = "VALID"
  lhs_dilation: tuple | None = None
  rhs_dilation: tuple | None = None
  # As conv_general_dilated takes it; _setup stores the normalised
  # lax.ConvDimensionNumbers (see dims).
  dimension_numbers: object = None
  feature_group_count: int = 1
  has_bias: bool = False
  repeats: int = 1

  def _setup(self):
    set_ = lambda k, v: object.__setattr__(self, k, v)
    set_("kernel_shape", tuple(int(s) for s in self.kernel_shape))
    nsp = len(self.kernel_shape) - 2
    set_("window_strides", _freeze(self.window_strides) or (1,) * nsp)
    set_("padding", _freeze(self.padding))
    set_("lhs_dilation", _freeze(self.lhs_dilation) or (1,) * nsp)
    set_("rhs_dilation", _freeze(self.rhs_dilation) or (1,) * nsp)
    dn = _conv_dims(self.dimension_numbers, nsp + 2)
    set_("dimension_numbers", lax.ConvDimensionNumbers(
        *(tuple(int(i) for i in spec) for spec in dn)))
    out = self.kernel_shape[self.dims.rhs_spec[0]]
    if self.feature_group_count < 1 or out % self.feature_group_count:
      raise ValueError(f"{type(self).__name__}: {out} output features do not "
                       f"split into {self.feature_group_count} groups")
    if int(self.repeats) != self.repeats or self.repeats < 1:
      raise ValueError(f"{type(self).__name__}: repeats must be a positive "
                       f"integer, got {self.repeats!r}")
    set_("repeats", int(self.repeats))

  @property
  def dims(self) -> lax.ConvDimensionNumbers:
    # _setup (run by every subclass's __post_init__) replaced the field's
    # user-facing forms by this normalised tuple.
    return typing.cast(lax.ConvDimensionNumbers, self.dimension_numbers)

  @property
  def layout(self):
    return _layout.ConvLayout(self.kernel_shape, tuple(self.dims.rhs_spec),
                              self.feature_group_count, self.has_bias)


@dataclasses.dataclass(frozen=True)
class KroneckerConv(ConvConfig, base.KroneckerBlock):
  """KFC block of a convolution; see the module docstring.

  Arguments mirror ``lax.conv_general_dilated`` (``dimension_numbers`` as a
  ``ConvDimensionNumbers``, a ``(lhs, rhs, out)`` string triple, or None
  for NCHW/OIHW); ``batch_group_count`` other than 1 is not supported.
  ``weight_sharing``: ``"expand"`` (KFC, the default) or ``"reduce"`` over
  the output locations; ``repeats``: see ``ConvConfig``;
  ``max_dense_side``: a factor side (a group's patch, ``window · in``, the
  bias's row not counted, or its output channels) larger than this keeps
  only its diagonal (``blocks.MAX_DENSE_SIDE``; None: no limit);
  ``side_block``: a side within the limit but larger than this is
  partitioned into equal diagonal blocks (``KroneckerBlock``; None, the
  default: whole).
  Parameters: ``(kernel,)`` or ``(kernel, bias)`` with ``bias [out]``.
  """

  damping_mode: str = "pi"
  weight_sharing: str = "expand"
  renorm_coeff: float = 1.0
  max_dense_side: int | None = _size.MAX_DENSE_SIDE
  side_block: int | None = None

  def __post_init__(self):
    self._setup()
    self.check_options()
    dense.check_weight_sharing(self.weight_sharing, type(self).__name__)

  def compute_stats(self, inputs, cotangents, weights=None):
    """Statistics from the conv input (its own layout) and the cotangent of
    the conv output (its own layout, optionally with a leading samples axis)."""
    a, g, c, w = conv_data(self, inputs, cotangents, weights)
    # Each group is a dense layer shared over the locations.
    per_group = jax.vmap(
        lambda ai, gi: dense.kronecker_stats(
            ai, gi, c, w, self.weight_sharing, self.input_diagonal,
            self.output_diagonal, self.input_parts, self.output_parts),
        in_axes=(2, 3))(a, g)
    return jax.tree.map(lambda x: x[:, 0], per_group)
