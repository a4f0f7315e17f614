"""The posterior pytree, its static layout, and the prior precision's forms.

Parameters are indexed like ``jax.flatten_util.ravel_pytree(params)``: the
leaves in tree order, each raveled. A *layer* is one block of the tagging
(``kfl.describe`` lists them: a kernel with its bias, a scale with its
shift, a fallback group, ...); every parameter belongs to exactly one.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax_lite.factor import float_dtype


@dataclasses.dataclass(frozen=True)
class LayerSlot:
  """One layer of the posterior: its ``name`` and ``kind`` (as
  ``kfl.describe`` shows them), its curvature ``block`` (None for the
  ``"full"`` structure, whose curvature spans all layers), the parameter
  ``leaves`` it covers (in the block's parameter order), ``stack`` (L for a
  layer stacked along a ``lax.scan``, else None) and ``index``: the raveled
  positions of its parameters, ``[stack or 1, size]`` in block order."""

  name: str
  kind: str
  block: Any
  leaves: tuple
  stack: Any
  index: Any  # A numpy array, compared by identity (static data).

  def __hash__(self):
    return hash((self.name, self.leaves, self.stack))

  def __eq__(self, other):
    return (isinstance(other, LayerSlot) and self.name == other.name and
            self.block == other.block and self.leaves == other.leaves and
            self.stack == other.stack)


@dataclasses.dataclass(frozen=True)
class Meta:
  """Static description of a posterior (a pytree node without leaves)."""

  structure: str
  estimation: str
  layers: tuple  # LayerSlot per layer.
  treedef: Any
  leaf_shapes: tuple
  distributions: tuple  # The registered losses' predictive distributions.

  @property
  def num_params(self):
    return sum(math.prod(s) for s in self.leaf_shapes)

  @property
  def layer_sizes(self):
    return tuple(int(l.index.size) for l in self.layers)

  def layer_of_param(self):
    """``[P]`` numpy array: the layer of each raveled parameter."""
    out = np.empty(self.num_params, np.int32)
    for i, l in enumerate(self.layers):
      out[l.index.ravel()] = i
    return out


jax.tree_util.register_pytree_node(
    Meta, lambda m: ((), m), lambda m, _: m)


class Posterior(NamedTuple):
  """A Laplace posterior ``N(mean, P⁻¹)``, ``P = H + diag(τ)``.

  ``H`` is the curvature summed over the training examples, held as
  ``curvature`` in the form of ``meta.structure``: for ``"kron"``/``"diag"``
  a dict ``{layer name: block state}`` (``kfl.blocks`` states, stacked for
  scanned layers), for ``"full"`` the dense ``[P, P]`` matrix. ``spectrum``
  holds eigenvalues for the log-determinant: per layer an array whose
  entries ``s`` give ``log det(H_layer + τ I) = Σ log(s + τ)``
  (``"full"``: the eigenvalues of ``H``). ``num_examples``: how many
  examples the fit saw; ``loss``: ``Σ_n ℓ_n`` at ``mean`` (the data's
  negative log-likelihood, as the loss defines it).
  """

  mean: Any
  curvature: Any
  spectrum: Any
  num_examples: Any
  loss: Any
  meta: Meta

  @property
  def layer_names(self):
    """The layers' names, in the order of a per-layer prior precision."""
    return tuple(l.name for l in self.meta.layers)


def layer_index(leaf_shapes, leaves, stack):
  """``[stack or 1, size]`` raveled positions of a layer's parameters.

  A stacked leaf ``[L, ...]`` holds slice ``s`` of the layer at
  ``offset + s·slice_size + j``; the block sees its leaves' slices
  concatenated in its parameter order.
  """
  offsets = np.cumsum([0] + [math.prod(s) for s in leaf_shapes])
  n = stack or 1
  rows = []
  for s in range(n):
    parts = []
    for k in leaves:
      size = math.prod(leaf_shapes[k]) // n
      parts.append(offsets[k] + s * size + np.arange(size))
    rows.append(np.concatenate(parts))
  return np.stack(rows)


def prior_per_layer(meta: Meta, prior_precision):
  """``τ`` as one value per layer ``[L]``, from a scalar or an ``[L]`` array.

  Raises ``ValueError`` on another shape, or on a concrete value that is
  not positive and finite.
  """
  tau = jnp.asarray(prior_precision)
  if not jnp.issubdtype(tau.dtype, jnp.floating):
    tau = tau.astype(jnp.result_type(float))
  n = len(meta.layers)
  if tau.ndim == 0:
    tau = jnp.broadcast_to(tau, (n,))
  elif tau.shape != (n,):
    raise ValueError(
        f"prior_precision must be a scalar or one value per layer, shape "
        f"({n},) in the order of post.layer_names; got shape {tau.shape}")
  try:
    values = np.asarray(tau)
  except (jax.errors.TracerArrayConversionError,
          jax.errors.ConcretizationTypeError):
    return tau  # Traced (jit, grad): checked where it is concrete.
  if not np.all(np.isfinite(values) & (values > 0)):
    raise ValueError(f"prior_precision must be positive and finite, got "
                     f"{values.tolist()}")
  return tau


def prior_per_param(meta: Meta, tau_layers):
  """``[P]``: each raveled parameter's prior precision."""
  return tau_layers[meta.layer_of_param()]


def ravel(meta: Meta, tree):
  """A params-shaped pytree (optionally with leading axes) as ``[..., P]``."""
  leaves = jax.tree.leaves(tree)
  lead = leaves[0].shape[:leaves[0].ndim - len(meta.leaf_shapes[0])]
  return jnp.concatenate([x.reshape(lead + (-1,)) for x in leaves], axis=-1)


def unravel(meta: Meta, flat, dtypes):
  """``[..., P]`` back to a params-shaped pytree with the leading axes."""
  lead = flat.shape[:-1]
  sizes = np.cumsum([0] + [math.prod(s) for s in meta.leaf_shapes])
  leaves = [flat[..., a:b].reshape(lead + tuple(s)).astype(d)
            for a, b, s, d in zip(sizes[:-1], sizes[1:], meta.leaf_shapes,
                                  dtypes)]
  return jax.tree.unflatten(meta.treedef, leaves)


def leaf_dtypes(post: Posterior):
  return [x.dtype for x in jax.tree.leaves(post.mean)]


def compute_dtype(post: Posterior):
  """The dtype of the posterior's arithmetic: its mean's, at least float32."""
  return float_dtype(leaf_dtypes(post))
