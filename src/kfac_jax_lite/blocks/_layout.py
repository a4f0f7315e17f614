"""How a block's parameters map onto the matrices its factors act on.

A Kronecker block sees its parameters as ``[groups, a, b]``: rows indexed by
the layer's inputs (plus one row for the bias, the bias acting as an input
of 1), columns by its outputs, one matrix per feature group. A flat block
sees them as one vector, the concatenation of the raveled arrays. In both
cases the dense matrix of a block (``to_dense``) is indexed like that flat
vector, in the order the block lists its parameters.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np


def check_params(block, params, shapes):
  """ValueError naming the block and both shape lists on a mismatch."""
  got = tuple(tuple(jnp.shape(p)) for p in params)
  if got != tuple(shapes):
    raise ValueError(f"{block!r}: expected parameters of shapes "
                     f"{tuple(shapes)}, got {got}")


def flatten(params):
  return jnp.concatenate([jnp.ravel(p) for p in params])


def unflatten(vec, shapes):
  sizes = [math.prod(s) for s in shapes]
  parts = jnp.split(vec, np.cumsum(sizes)[:-1])
  return tuple(p.reshape(s) for p, s in zip(parts, shapes))


def param_index(shapes):
  """Integer arrays shaped like the parameters, numbering the flat vector."""
  return unflatten(jnp.arange(sum(math.prod(s) for s in shapes)), shapes)


@dataclasses.dataclass(frozen=True)
class DenseLayout:
  """A kernel whose ``in_axes`` contract with the input; the rest are outputs.

  ``kernel`` -> ``transpose(in_axes + out_axes).reshape(a, b)``; the bias,
  shaped like the output axes, is the last row.
  """

  kernel_shape: tuple
  in_axes: tuple
  has_bias: bool

  def __post_init__(self):
    nd = len(self.kernel_shape)
    axes = tuple(a % nd if nd else a for a in self.in_axes)
    if len(set(axes)) != len(axes) or not axes or any(
        a >= nd or a < 0 for a in axes) or len(axes) == nd:
      raise ValueError(f"in_axes {self.in_axes} do not name distinct input "
                       f"axes of a kernel of shape {self.kernel_shape}, "
                       "leaving at least one output axis")
    object.__setattr__(self, "in_axes", axes)

  @property
  def out_axes(self):
    return tuple(i for i in range(len(self.kernel_shape)) if i not in self.in_axes)

  @property
  def in_dims(self):
    return tuple(self.kernel_shape[i] for i in self.in_axes)

  @property
  def out_dims(self):
    return tuple(self.kernel_shape[i] for i in self.out_axes)

  @property
  def param_shapes(self):
    return (tuple(self.kernel_shape),) + ((self.out_dims,) if self.has_bias else ())

  groups = 1

  @property
  def a(self):
    return math.prod(self.in_dims) + int(self.has_bias)

  @property
  def b(self):
    return math.prod(self.out_dims)

  def to_mat(self, params):
    k = jnp.transpose(params[0], self.in_axes + self.out_axes)
    k = k.reshape(math.prod(self.in_dims), self.b)
    if self.has_bias:
      k = jnp.concatenate([k, params[1].reshape(1, self.b)], axis=0)
    return k[None]

  def from_mat(self, m):
    m = m[0]
    n_in = math.prod(self.in_dims)
    k = m[:n_in].reshape(self.in_dims + self.out_dims)
    k = jnp.transpose(k, np.argsort(self.in_axes + self.out_axes).tolist())
    return (k, m[n_in].reshape(self.out_dims)) if self.has_bias else (k,)


@dataclasses.dataclass(frozen=True)
class ConvLayout:
  """A convolution kernel in its own layout ``rhs_spec`` (out, in, *spatial).

  Canonical order per group: rows ``(*spatial, in_per_group)`` row-major
  (the order of ``conv_general_dilated_patches`` once regrouped), columns
  the group's output features. Output features are grouped contiguously,
  as ``feature_group_count`` defines them.
  """

  kernel_shape: tuple
  rhs_spec: tuple
  groups: int
  has_bias: bool

  @property
  def spatial(self):
    return tuple(self.kernel_shape[i] for i in self.rhs_spec[2:])

  @property
  def in_per_group(self):
    return self.kernel_shape[self.rhs_spec[1]]

  @property
  def out_features(self):
    return self.kernel_shape[self.rhs_spec[0]]

  @property
  def param_shapes(self):
    return (tuple(self.kernel_shape),) + (
        ((self.out_features,),) if self.has_bias else ())

  @property
  def patch_size(self):
    return math.prod(self.spatial) * self.in_per_group

  @property
  def a(self):
    return self.patch_size + int(self.has_bias)

  @property
  def b(self):
    return self.out_features // self.groups

  def _perm(self):
    return tuple(self.rhs_spec[2:]) + (self.rhs_spec[1], self.rhs_spec[0])

  def to_mat(self, params):
    k = jnp.transpose(params[0], self._perm())
    k = k.reshape(self.patch_size, self.groups, self.b).transpose(1, 0, 2)
    if self.has_bias:
      k = jnp.concatenate([k, params[1].reshape(self.groups, 1, self.b)], 1)
    return k

  def from_mat(self, m):
    k = m[:, :self.patch_size].transpose(1, 0, 2)
    k = k.reshape(self.spatial + (self.in_per_group, self.out_features))
    k = jnp.transpose(k, np.argsort(self._perm()).tolist())
    if self.has_bias:
      return k, m[:, self.patch_size].reshape(self.out_features)
    return (k,)


@dataclasses.dataclass(frozen=True)
class TableLayout:
  """An embedding table ``[vocab, dim]``: rows are ids, columns features."""

  vocab_size: int
  dim: int
  groups = 1
  has_bias = False

  @property
  def param_shapes(self):
    return ((self.vocab_size, self.dim),)

  @property
  def a(self):
    return self.vocab_size

  @property
  def b(self):
    return self.dim

  def to_mat(self, params):
    return params[0][None]

  def from_mat(self, m):
    return (m[0],)


# Any of the layouts above (what a Kronecker or EKFAC block's ``layout`` is).
Layout = DenseLayout | ConvLayout | TableLayout
