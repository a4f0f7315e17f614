"""Registered losses: drop-in replacements for optax's that mark the model
output and its predictive distribution for the curvature estimators.

Layer 1. Owns the registered losses and their predictive distributions
(``losses.distributions``). May import: ``factor``.

Each function returns exactly what its optax namesake returns (per-element
values, to be reduced by the caller with ``.mean()``, ``.sum()``, a mask...)
and routes the values through ``loss_tag``, an identity primitive that also
carries the model outputs and targets as annotations. The tagging transform
finds the tag in the traced loss; the per-element weights ``c`` of
``L = Σ c ℓ`` are then read from the backward pass to the tag's output, so
any reduction is handled without telling the library.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from kfac_jax_lite.losses import distributions as dists

__all__ = [
    "gaussian_nll", "l2_loss", "registered_loss", "sigmoid_binary_cross_entropy",
    "softmax_cross_entropy", "softmax_cross_entropy_with_integer_labels",
    "squared_error",
]

loss_tag_p = Primitive("kfl_loss_tag")


def _impl(values, *annotations, distribution, num_outputs):
  del annotations, distribution, num_outputs
  return values


loss_tag_p.def_impl(_impl)
loss_tag_p.def_abstract_eval(lambda values, *a, **kw: values)
mlir.register_lowering(loss_tag_p, mlir.lower_fun(_impl, multiple_results=False))


def _jvp(primals, tangents, **params):
  out = loss_tag_p.bind(*primals, **params)
  return out, ad.instantiate_zeros(tangents[0])


ad.primitive_jvps[loss_tag_p] = _jvp


def _batch(args, dims, **params):
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  args = [jnp.broadcast_to(a, (size,) + a.shape) if d is None
          else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
  return loss_tag_p.bind(*args, **params), 0


batching.primitive_batchers[loss_tag_p] = _batch


def registered_loss(distribution: dists.PredictiveDistribution,
                    outputs: ArrayLike | Sequence[ArrayLike],
                    targets: ArrayLike | Sequence[ArrayLike]) -> jax.Array:
  """Per-element NLL of ``targets`` under ``distribution(outputs)``, tagged.

  ``outputs`` and ``targets``: arrays or tuples of arrays, as the
  distribution lays them out. Use this to register a custom distribution.
  """
  outs = tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
  targs = tuple(targets) if isinstance(targets, (tuple, list)) else (targets,)
  if len(outs) != len(distribution.event_ndims):
    raise ValueError(f"{type(distribution).__name__} takes "
                     f"{len(distribution.event_ndims)} outputs, got {len(outs)}")
  values = distribution.loss(outs, targs)
  return loss_tag_p.bind(values, *outs, *targs, distribution=distribution,
                         num_outputs=len(outs))


def softmax_cross_entropy(logits: jax.Array, labels: ArrayLike) -> jax.Array:
  """``optax.softmax_cross_entropy``: ``-Σ labels · log_softmax(logits)``."""
  return registered_loss(dists.Categorical(), logits, labels)


def softmax_cross_entropy_with_integer_labels(logits: jax.Array,
                                              labels: ArrayLike) -> jax.Array:
  """``optax.softmax_cross_entropy_with_integer_labels``."""
  return registered_loss(dists.Categorical(integer_labels=True), logits, labels)


def sigmoid_binary_cross_entropy(logits: jax.Array,
                                 labels: ArrayLike) -> jax.Array:
  """``optax.sigmoid_binary_cross_entropy``, elementwise."""
  return registered_loss(dists.Bernoulli(), logits, jnp.asarray(labels, logits.dtype))


def squared_error(predictions: jax.Array,
                  targets: ArrayLike | None = None) -> jax.Array:
  """``optax.squared_error``: ``(predictions - targets)²``, a Normal of
  variance ½."""
  targets = jnp.zeros_like(predictions) if targets is None else targets
  return registered_loss(dists.Normal(0.5), predictions, targets)


def l2_loss(predictions: jax.Array,
            targets: ArrayLike | None = None) -> jax.Array:
  """``optax.l2_loss``: ``½(predictions - targets)²``, a Normal of variance 1."""
  targets = jnp.zeros_like(predictions) if targets is None else targets
  return registered_loss(dists.Normal(1.0), predictions, targets)


def gaussian_nll(mean: jax.Array, variance: jax.Array,
                 targets: ArrayLike) -> jax.Array:
  """``½ log(2π·variance) + (targets - mean)²/(2·variance)``, elementwise."""
  return registered_loss(dists.NormalMeanVariance(), (mean, variance), targets)
