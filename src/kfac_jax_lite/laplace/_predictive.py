"""Predictive distributions of a Laplace posterior: the linearised (GLM)
predictive and Monte Carlo over parameter samples."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from kfac_jax_lite.losses import distributions as dists
from kfac_jax_lite.laplace import _columns
from kfac_jax_lite.laplace import _linalg
from kfac_jax_lite.laplace import _posterior as P

LIKELIHOODS = ("classification", "binary", "regression")
METHODS = ("glm", "mc")
LINKS = ("probit", "mc")


def glm_moments(post: P.Posterior, apply_fn, x, prior_precision):
  """Mean and covariance of the linearised model's outputs.

  ``f_lin(x; θ) = f(x; θ*) + J (θ - θ*)`` with ``θ ~ N(θ*, P⁻¹)`` has mean
  ``f(x; θ*)`` and covariance ``J P⁻¹ Jᵀ`` per input, ``J = ∂f(x_n)/∂θ``.

  Args:
    post: a ``Posterior``.
    apply_fn: ``apply_fn(params, x) -> outputs [N, *out]``, per example
      (it is differentiated on batches of one).
    x: the inputs, arrays (or a pytree) with a leading example axis.
    prior_precision: ``τ``, a scalar or one value per layer.

  Returns:
    ``(mean [N, *out], covariance [N, O, O])`` with ``O = prod(out)``.
  """
  tau, scalar = _linalg.prior(post, prior_precision)
  return _glm_moments(post, apply_fn, x, tau, scalar)


@functools.partial(jax.jit, static_argnums=(1, 4))
def _glm_moments(post, apply_fn, x, tau, scalar):
  axes, n = _columns.batch_axes(x)
  mean = apply_fn(post.mean, x)

  def one(params, xi):
    xi = jax.tree.map(lambda v, a: v if a is None else v[None], xi, axes)
    return apply_fn(params, xi)[0]

  jac = jax.vmap(jax.jacrev(one), in_axes=(None, axes))(post.mean, x)
  rows = P.ravel(post.meta, jac)  # [N, *out, P]
  o = math.prod(mean.shape[1:])
  rows = rows.reshape(n * o, -1).astype(tau.dtype)
  v = _linalg.root_product(post, tau, scalar, rows, transpose=True)
  v = v.reshape(n, o, -1)
  return mean, jnp.einsum("nop,nqp->noq", v, v)


def _likelihood(post, likelihood):
  if likelihood is not None:
    if likelihood not in LIKELIHOODS:
      raise ValueError(f"likelihood must be one of {LIKELIHOODS}, got "
                       f"{likelihood!r}")
    return likelihood
  found = post.meta.distributions
  if len(found) == 1:
    if isinstance(found[0], dists.Categorical):
      return "classification"
    if isinstance(found[0], dists.Bernoulli):
      return "binary"
    if isinstance(found[0], dists.Normal):
      return "regression"
  raise ValueError(
      "cannot tell the likelihood from the fitted loss "
      f"({[type(d).__name__ for d in found]}); pass likelihood= one of "
      f"{LIKELIHOODS}")


def _squash(f, likelihood):
  return jax.nn.softmax(f, axis=-1) if likelihood == "classification" else (
      jax.nn.sigmoid(f))


def predictive(post: P.Posterior, apply_fn, x, prior_precision, *,
               method="glm", link=None, likelihood=None, num_samples=100,
               key=None):
  """The posterior predictive at inputs ``x``.

  * ``method="glm"`` — the linearised model (``glm_moments``):
    classification (softmax over the last axis) or binary (elementwise
    sigmoid) with ``link="probit"`` (the default) gives
    ``σ(μ / √(1 + π/8 · diag Σ))`` (MacKay 1992; for softmax the
    per-class version, as laplace-torch), with ``link="mc"`` the mean of
    ``σ(f)`` over ``num_samples`` draws ``f ~ N(μ, Σ)``; regression gives
    ``(μ, Σ)``, the Gaussian predictive of the outputs (add the
    observation noise for that of the targets).
  * ``method="mc"`` — ``num_samples`` parameter draws from ``sample``:
    the mean of ``σ(f(x; θ_s))``, or for regression the outputs' sample
    mean and covariance ``[N, O, O]``.

  Args:
    post: as for ``glm_moments``.
    apply_fn: as for ``glm_moments``.
    x: as for ``glm_moments``.
    prior_precision: as for ``glm_moments``.
    method: ``"glm"`` or ``"mc"``.
    link: ``"probit"`` or ``"mc"`` for a GLM classifier; None (probit)
      otherwise.
    likelihood: ``"classification"``, ``"binary"`` or ``"regression"``;
      by default read from the fitted loss (softmax cross-entropy,
      sigmoid cross-entropy, squared error / l2).
    num_samples: Monte Carlo draws.
    key: PRNG key, needed by the Monte Carlo paths.
  """
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
  if link is not None and link not in LINKS:
    raise ValueError(f"link must be one of {LINKS}, got {link!r}")
  likelihood = _likelihood(post, likelihood)
  if likelihood == "regression" and link is not None:
    raise ValueError("link applies to classification; a regression "
                     "predictive is Gaussian")
  if method == "mc" and link == "probit":
    raise ValueError("link='probit' applies to method='glm'")
  if not (isinstance(num_samples, int) and num_samples >= 2):
    raise ValueError(f"num_samples must be an int >= 2, got {num_samples!r}")
  needs_key = method == "mc" or link == "mc"
  if needs_key and key is None:
    raise ValueError("the Monte Carlo predictive needs key=")

  tau, scalar = _linalg.prior(post, prior_precision)
  return _predictive(post, apply_fn, x, tau, key, scalar, method, link,
                     likelihood, num_samples)


@functools.partial(jax.jit, static_argnums=(1, 5, 6, 7, 8, 9))
def _predictive(post, apply_fn, x, tau, key, scalar, method, link, likelihood,
                num_samples):
  if method == "mc":
    thetas = _linalg.sample_at(post, key, tau, scalar, num_samples)
    f = jax.vmap(apply_fn, in_axes=(0, None))(thetas, x)  # [S, N, *out]
    if likelihood != "regression":
      return jnp.mean(_squash(f, likelihood), axis=0)
    flat = f.reshape(f.shape[:2] + (-1,))
    centred = flat - flat.mean(0)
    cov = jnp.einsum("sno,snq->noq", centred, centred) / (num_samples - 1)
    return f.mean(0), cov

  mean, cov = _glm_moments(post, apply_fn, x, tau, scalar)
  if likelihood == "regression":
    return mean, cov
  if link in (None, "probit"):
    var = jnp.diagonal(cov, axis1=-2, axis2=-1).reshape(mean.shape)
    return _squash(mean / jnp.sqrt(1 + jnp.pi / 8 * var), likelihood)
  w, q = jnp.linalg.eigh(cov)
  root = q * jnp.sqrt(jnp.maximum(w, 0))[..., None, :]  # [N, O, O]
  eps = jax.random.normal(key, (num_samples,) + cov.shape[:2], cov.dtype)
  f = mean.reshape(cov.shape[:2])[None] + jnp.einsum("noq,snq->sno", root, eps)
  return jnp.mean(_squash(f.reshape((num_samples,) + mean.shape), likelihood),
                  axis=0)
