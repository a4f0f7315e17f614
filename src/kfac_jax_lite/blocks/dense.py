"""Kronecker-factored dense layers (K-FAC, Martens & Grosse 2015).

For ``y = x · W + b`` with ``L = Σ_i c_i ℓ_i`` and ``w_i = c_i / Σ_j c_j``:

    A = Σ_i w_i ā_i ā_iᵀ,   ā_i = [x_i, 1]   (the bias acts as an input of 1)
    G = Σ_i c_i E[g_i g_iᵀ], g_i = ∂ℓ_i/∂y_i
    F ≈ c · A ⊗ G            (c: the static ``renorm_coeff``, default 1)

so for one example ``A ⊗ G`` is that example's exact curvature block.

Weight sharing (the layer applied at R positions of each example, e.g. a
sequence axis; Eschenhagen et al. 2023):

* ``"expand"`` — positions are extra examples for the statistics:
  ``A = Σ_i w_i (1/R) Σ_r ā_ir ā_irᵀ`` and ``G = Σ_i c_i Σ_r g_ir g_irᵀ``
  (the input factor averages, the output factor sums over positions, like
  KFC's convolutions: this is TF K-FAC's ``num_locations`` renormalisation
  folded into ``G``).
* ``"reduce"`` — positions are aggregated first: ``A = Σ_i w_i ã_i ã_iᵀ``
  with ``ã_i = (1/R) Σ_r ā_ir`` and ``G = Σ_i c_i ĝ_i ĝ_iᵀ`` with
  ``ĝ_i = Σ_r g_ir``.

Both are exact when R = 1.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from kfac_jax_lite.blocks import _kron
from kfac_jax_lite.blocks import _layout
from kfac_jax_lite.blocks import _size
from kfac_jax_lite.blocks import base

WEIGHT_SHARING = ("expand", "reduce")


def dense_data(layout, inputs, cotangents, weights, where):
  """Per-example data of a dense layer, flattened for the statistics.

  Returns ``(a [N, R, a], g [S, N, R, b], c [N], w [N])`` with the bias
  column of ones appended to ``a`` when the layer has a bias.
  """
  inputs = jnp.asarray(inputs)
  cotangents = jnp.asarray(cotangents)
  n_in = len(layout.in_dims)
  if inputs.ndim < 1 + n_in or tuple(inputs.shape[inputs.ndim - n_in:]) != layout.in_dims:
    raise ValueError(f"{where}: inputs of shape {inputs.shape} do not end in "
                     f"the kernel's input dims {layout.in_dims}")
  shared = inputs.shape[1:inputs.ndim - n_in]
  expected = (inputs.shape[0],) + tuple(shared) + layout.out_dims
  g = base.split_samples(cotangents, len(expected), where)
  if tuple(g.shape[1:]) != expected:
    raise ValueError(f"{where}: cotangents of shape {cotangents.shape} do "
                     f"not match the expected output shape {expected}")
  dtype = base.stats_dtype(inputs, cotangents)
  n, r = inputs.shape[0], math.prod(shared)
  a = inputs.reshape(n, r, -1).astype(dtype)
  if layout.has_bias:
    a = jnp.concatenate([a, jnp.ones((n, r, 1), dtype)], axis=-1)
  g = g.reshape(g.shape[0], n, r, -1).astype(dtype)
  c, w = base.normalized_weights(weights, n, dtype, where)
  return a, g, c, w


def _second_moment(x, y, diagonal, parts=1):
  """``base.gram(x, y)`` [n, n], only its diagonal [n] (never forming
  the ``n × n`` product), or, for ``parts`` > 1, its ``p = parts``
  diagonal blocks ``[p, k, k]`` of ``k = ⌈n/p⌉`` rows (the side padded
  with zeros to ``p·k``)."""
  if diagonal:
    return jnp.sum((x * y).reshape(-1, x.shape[-1]), axis=0)
  if parts == 1:
    return base.gram(x, y)
  n = x.shape[-1]
  k = _size.block_side(n, parts)
  split = lambda z: jnp.pad(z.reshape(-1, n), ((0, 0), (0, parts * k - n))
                            ).reshape(-1, parts, k)
  return jnp.einsum("mpi,mpj->pij", split(x), split(y))


def input_stats(a, w, weight_sharing, diagonal=False, parts=1):
  """The input factor ``A`` [a, a] (``diagonal``: its diagonal [a];
  ``parts`` > 1: its diagonal blocks ``[p, k, k]``) from ``a [N, R, a]``
  and weights ``w``."""
  if weight_sharing == "expand":
    return _second_moment(a * w[:, None, None], a, diagonal,
                          parts) / a.shape[1]
  a_bar = a.mean(axis=1)
  return _second_moment(a_bar * w[:, None], a_bar, diagonal, parts)


def output_stats(g, c, weight_sharing, diagonal=False, parts=1):
  """The output factor ``G`` [b, b] (``diagonal``: its diagonal [b];
  ``parts`` > 1: its diagonal blocks ``[p, k, k]``) from ``g [S, N, R,
  b]`` and ``c``."""
  if weight_sharing == "expand":
    return _second_moment(g * c[:, None, None], g, diagonal,
                          parts) / g.shape[0]
  g_hat = g.sum(axis=2)
  return _second_moment(g_hat * c[:, None], g_hat, diagonal,
                        parts) / g.shape[0]


def kronecker_stats(a, g, c, w, weight_sharing, input_diagonal=False,
                    output_diagonal=False, input_parts=1, output_parts=1):
  """``KroneckerState``-shaped statistics ``(A [1, a, a], G [1, b, b])``
  (a diagonal side: ``[1, a]`` or ``[1, b]``, its diagonal; a partitioned
  side ``[1, p, k, k]``, its diagonal blocks)."""
  return _kron.KroneckerState(
      a=input_stats(a, w, weight_sharing, input_diagonal, input_parts)[None],
      g=output_stats(g, c, weight_sharing, output_diagonal,
                     output_parts)[None])


def check_weight_sharing(mode, where):
  if mode not in WEIGHT_SHARING:
    raise ValueError(f"{where}: weight_sharing must be one of "
                     f"{WEIGHT_SHARING}, got {mode!r}")


@dataclasses.dataclass(frozen=True)
class KroneckerDense(base.KroneckerBlock):
  """Kronecker block of a dense layer; see the module docstring.

  ``kernel_shape``: the kernel as stored; ``in_axes``: its axes contracted
  with the input (``(0,)`` for ``x @ W``, ``(1,)`` for ``x @ W.T``, several
  for einsum forms); the other axes are outputs, and the bias (if any) is
  shaped like them. ``max_dense_side``: a factor side larger than this
  keeps only its diagonal (``blocks.MAX_DENSE_SIDE``; None: no limit; the
  input side counted without the bias's row); ``side_block``: a side
  within the limit but larger than this is partitioned into
  ``⌈side / side_block⌉`` equal diagonal blocks (``KroneckerBlock``;
  None, the default: whole).
  Parameters: ``(kernel,)`` or ``(kernel, bias)``.
  """

  kernel_shape: tuple
  in_axes: tuple = (0,)
  has_bias: bool = False
  damping_mode: str = "pi"
  weight_sharing: str = "expand"
  renorm_coeff: float = 1.0
  max_dense_side: int | None = _size.MAX_DENSE_SIDE
  side_block: int | None = None

  def __post_init__(self):
    object.__setattr__(self, "kernel_shape", tuple(self.kernel_shape))
    object.__setattr__(self, "in_axes", tuple(self.in_axes))
    self.check_options()
    check_weight_sharing(self.weight_sharing, type(self).__name__)
    self.layout  # Validates the axes.

  @property
  def layout(self):
    return _layout.DenseLayout(self.kernel_shape, self.in_axes, self.has_bias)

  def compute_stats(self, inputs, cotangents, weights=None):
    """Statistics from inputs ``[N, *shared, *in_dims]`` and cotangents
    ``[(S,) N, *shared, *out_dims]`` (``∂ℓ_i/∂y``, S sampled targets)."""
    return kronecker_stats(
        *dense_data(self.layout, inputs, cotangents, weights, repr(self)),
        self.weight_sharing, self.input_diagonal, self.output_diagonal,
        self.input_parts, self.output_parts)
