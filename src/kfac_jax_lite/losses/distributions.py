"""Predictive distributions behind the registered losses.

A registered loss is the negative log-likelihood ``ℓ(o, t)`` of targets
``t`` under a distribution whose parameters are the model outputs ``o``.
The estimators need three things of it, per loss *element* (one example,
or one token, or one output unit, as the loss's per-element values are laid
out):

* ``sample(key, outputs)`` — targets drawn from the model (``"fisher"``);
* ``fisher_sqrt(outputs)`` — ``B`` with ``B Bᵀ = E_t[∇ℓ ∇ℓᵀ]``, the Fisher
  of the distribution w.r.t. the outputs (``"curvature_prop"``, ``"exact"``);
* ``ggn_sqrt(outputs, targets)`` — ``B`` with ``B Bᵀ = ∂²ℓ/∂o²`` (clipped to
  be PSD), the output Hessian of the generalized Gauss-Newton. For losses in
  the natural parameters of an exponential family (softmax, sigmoid, fixed-
  variance Normal) it equals the Fisher, and the default returns that.

``outputs`` and ``targets`` are tuples of arrays. Output ``j`` has shape
``loss_shape + event_shape_j`` with ``len(event_shape_j) =
event_ndims[j]``; a square root is a tuple of arrays ``loss_shape +
event_shape_j + (K,)``, column ``k`` of the joint ``B`` being the ``k``-th
slice of each. ``loss(outputs, targets)`` returns the per-element values,
shaped ``loss_shape``; gradients are taken by autodiff of it.

To add a distribution, subclass ``PredictiveDistribution`` as a frozen
dataclass (it must be hashable) and call ``kfl.registered_loss(dist,
outputs, targets)`` in the loss function. For example a Laplace likelihood
with unit scale, ``ℓ = |o - t|`` (Fisher 1 per output)::

    @dataclasses.dataclass(frozen=True)
    class UnitLaplace(kfl.PredictiveDistribution):
      event_ndims = (0,)
      def loss(self, outputs, targets):
        return jnp.abs(outputs[0] - targets[0])
      def sample(self, key, outputs):
        return (outputs[0] + jax.random.laplace(key, outputs[0].shape),)
      def fisher_sqrt(self, outputs):
        return (jnp.ones(outputs[0].shape + (1,)),)
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from kfac_jax_lite.factor import float_dtype


class PredictiveDistribution:
  """Base class; see the module docstring for the protocol."""

  event_ndims: tuple = (0,)
  natural = True  # GGN equals Fisher: ggn_sqrt defaults to fisher_sqrt.

  def loss(self, outputs, targets):
    raise NotImplementedError

  def sample(self, key, outputs):
    raise NotImplementedError

  def fisher_sqrt(self, outputs):
    raise NotImplementedError

  def ggn_sqrt(self, outputs, targets):
    if not self.natural:
      raise NotImplementedError(
          f"{type(self).__name__} has a GGN that differs from its Fisher; "
          "implement ggn_sqrt")
    return self.fisher_sqrt(outputs)

  def bad_targets(self, outputs, targets):
    """int32: how many targets lie outside the distribution's support, so
    that ``loss`` would fold them silently into another value (an integer
    label outside ``[0, classes)``); 0 unless a subclass can tell."""
    del outputs, targets
    return jnp.zeros((), jnp.int32)


def at_least_f32(x):
  """``x`` as a float of at least 32 bits (float64 stays float64)."""
  x = jnp.asarray(x)
  return x.astype(float_dtype(x))


def psd_sqrt(hessian):
  """``B`` with ``B Bᵀ = H₊`` for symmetric ``H [..., n, n]`` (eigenvalues clipped)."""
  w, q = jnp.linalg.eigh(hessian)
  return q * jnp.sqrt(jnp.maximum(w, 0))[..., None, :]


@dataclasses.dataclass(frozen=True)
class Categorical(PredictiveDistribution):
  """Softmax over the last axis; targets one-hot (or integer labels)."""

  integer_labels: bool = False
  event_ndims = (1,)

  def loss(self, outputs, targets):
    if self.integer_labels:
      return optax.softmax_cross_entropy_with_integer_labels(outputs[0], targets[0])
    return optax.softmax_cross_entropy(outputs[0], targets[0])

  def sample(self, key, outputs):
    logits = outputs[0]
    ids = jax.random.categorical(key, logits, axis=-1)
    if self.integer_labels:
      return (ids,)
    return (jax.nn.one_hot(ids, logits.shape[-1], dtype=logits.dtype),)

  def bad_targets(self, outputs, targets):
    """Integer labels outside ``[0, K)`` (``K = outputs[0].shape[-1]``):
    JAX's indexing would wrap ``-1`` to class ``K - 1`` and give ``K`` a
    NaN or clipped loss (PyTorch: ``Target K is out of bounds``)."""
    if not self.integer_labels:
      return jnp.zeros((), jnp.int32)
    t = targets[0]
    return jnp.sum((t < 0) | (t >= outputs[0].shape[-1])).astype(jnp.int32)

  def fisher_sqrt(self, outputs):
    # diag(p) - p pᵀ = B Bᵀ with B[v, k] = √p_k (δ_vk - p_v).
    p = jax.nn.softmax(at_least_f32(outputs[0]), axis=-1)
    eye = jnp.eye(p.shape[-1], dtype=p.dtype)
    return ((eye - p[..., :, None]) * jnp.sqrt(p)[..., None, :],)


@dataclasses.dataclass(frozen=True)
class Bernoulli(PredictiveDistribution):
  """Independent sigmoids per output; targets in [0, 1]."""

  event_ndims = (0,)

  def loss(self, outputs, targets):
    return optax.sigmoid_binary_cross_entropy(outputs[0], targets[0])

  def sample(self, key, outputs):
    logits = outputs[0]
    return (jax.random.bernoulli(key, jax.nn.sigmoid(logits)).astype(logits.dtype),)

  def fisher_sqrt(self, outputs):
    p = jax.nn.sigmoid(at_least_f32(outputs[0]))
    return (jnp.sqrt(p * (1 - p))[..., None],)


@dataclasses.dataclass(frozen=True)
class Normal(PredictiveDistribution):
  """Fixed-variance Normal: ``ℓ = (o - t)² / (2σ²)`` (constants dropped).

  ``variance=0.5`` gives optax's ``squared_error`` ``(o - t)²``;
  ``variance=1`` gives ``l2_loss`` ``(o - t)²/2``.
  """

  variance: float = 0.5
  event_ndims = (0,)

  def loss(self, outputs, targets):
    if self.variance == 0.5:
      return optax.squared_error(outputs[0], targets[0])
    if self.variance == 1.0:
      return optax.l2_loss(outputs[0], targets[0])
    return (outputs[0] - targets[0]) ** 2 / (2 * self.variance)

  def sample(self, key, outputs):
    o = outputs[0]
    return (o + jnp.sqrt(self.variance) * jax.random.normal(key, o.shape, o.dtype),)

  def fisher_sqrt(self, outputs):
    o = at_least_f32(outputs[0])
    return (jnp.full(o.shape + (1,), 1 / jnp.sqrt(self.variance), o.dtype),)


@dataclasses.dataclass(frozen=True)
class NormalMeanVariance(PredictiveDistribution):
  """Normal with predicted mean ``μ`` and variance ``v`` (two outputs).

  ``ℓ = ½ log(2πv) + (t - μ)²/(2v)``. Its Fisher w.r.t. ``(μ, v)`` is
  ``diag(1/v, 1/(2v²))``; its output Hessian at the data target,
  ``[[1/v, r/v²], [r/v², r²/v³ - 1/(2v²)]]`` with ``r = t - μ``, depends on the target
  and is indefinite away from it, so the GGN (its PSD part) differs.
  """

  event_ndims = (0, 0)
  natural = False

  def loss(self, outputs, targets):
    mean, var = outputs
    return 0.5 * jnp.log(2 * jnp.pi * var) + (targets[0] - mean) ** 2 / (2 * var)

  def sample(self, key, outputs):
    mean, var = outputs
    return (mean + jnp.sqrt(var) * jax.random.normal(key, mean.shape, mean.dtype),)

  def fisher_sqrt(self, outputs):
    mean, var = (at_least_f32(o) for o in outputs)
    zero = jnp.zeros_like(mean)
    return (jnp.stack([1 / jnp.sqrt(var), zero], -1),
            jnp.stack([zero, 1 / (jnp.sqrt(jnp.asarray(2.0, var.dtype)) * var)], -1))

  def ggn_sqrt(self, outputs, targets):
    mean, var = (at_least_f32(o) for o in outputs)
    r = at_least_f32(targets[0]) - mean
    h = jnp.stack([jnp.stack([1 / var, r / var**2], -1),
                   jnp.stack([r / var**2, r**2 / var**3 - 1 / (2 * var**2)], -1)],
                  -2)
    b = psd_sqrt(h)  # [..., 2 (output), 2 (column)]
    return (b[..., 0, :], b[..., 1, :])
