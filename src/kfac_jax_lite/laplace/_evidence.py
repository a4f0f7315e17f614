"""The log marginal likelihood of a Laplace posterior, and the prior
precision that maximises it."""
from __future__ import annotations

import functools
import typing

import jax
import jax.numpy as jnp
import optax

from kfac_jax_lite.laplace import _linalg
from kfac_jax_lite.laplace import _posterior as P


def log_marginal_likelihood(post: P.Posterior, prior_precision,
                            loss_at_map=None):
  """The Laplace approximation of ``log p(D | τ)`` (MacKay 1992):

      log p(D) ≈ -Σ_n ℓ_n(θ*) - ½ (log det P - log det P₀ + θ*ᵀ P₀ θ*)

  with the prior ``N(0, P₀⁻¹)``, ``P₀ = diag(τ)`` (a scalar or one value
  per layer) and ``P = H + P₀`` (as laplace-torch; the ``2π`` terms
  cancel). ``loss_at_map``: ``Σ_n ℓ_n(θ*)`` over the training set, the
  data term only; by default the one ``fit`` accumulated (the loss's own
  constants, e.g. none for ``squared_error``). Differentiable in
  ``prior_precision``.
  """
  tau, scalar = _linalg.prior(post, prior_precision)
  loss = post.loss if loss_at_map is None else loss_at_map
  return _log_marginal_likelihood(post, tau, scalar, loss)


@functools.partial(jax.jit, static_argnums=2)
def _log_marginal_likelihood(post, tau, scalar, loss):
  meta = post.meta
  theta = P.ravel(meta, post.mean).astype(tau.dtype)
  scatter = jnp.sum(P.prior_per_param(meta, tau) * theta ** 2)
  sizes = jnp.asarray(meta.layer_sizes, tau.dtype)
  logdet_prior = jnp.sum(sizes * jnp.log(tau))
  logdet_post = _linalg.logdet_at(post, tau, scalar)
  return -jnp.asarray(loss, tau.dtype) - 0.5 * (
      logdet_post - logdet_prior + scatter)


def optimize_prior_precision(post: P.Posterior, *, init=1.0, per_layer=False,
                             num_steps=100, learning_rate=0.1,
                             loss_at_map=None):
  """The prior precision that maximises ``log_marginal_likelihood``.

  Adam on ``log τ`` (as laplace-torch), ``num_steps`` steps of
  ``learning_rate`` from ``init`` (a positive scalar, or one value per
  layer). Returns ``τ``: a scalar, or ``[L]`` (one per layer, in the order
  of ``post.layer_names``) with ``per_layer=True`` or an ``[L]`` ``init``.
  """
  _linalg.prior(post, init)  # Validates init.
  if not (isinstance(num_steps, int) and num_steps >= 1):
    raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")
  dtype = P.compute_dtype(post)
  log_tau = jnp.log(jnp.asarray(init, dtype))
  if per_layer and log_tau.ndim == 0:
    log_tau = jnp.broadcast_to(log_tau, (len(post.meta.layers),))
  loss = post.loss if loss_at_map is None else jnp.asarray(loss_at_map)
  return _adam(post, log_tau, loss, num_steps, float(learning_rate))


@functools.partial(jax.jit, static_argnums=(3, 4))
def _adam(post, log_tau, loss, num_steps, learning_rate):
  opt = optax.adam(learning_rate)

  def objective(lt):
    return -log_marginal_likelihood(post, jnp.exp(lt), loss)

  def step(carry, _):
    lt, state = carry
    updates, state = opt.update(jax.grad(objective)(lt), state, lt)
    return (optax.apply_updates(lt, updates), state), None

  (log_tau, _), _ = jax.lax.scan(step, (log_tau, opt.init(log_tau)), None,
                                 length=num_steps)
  # optax.apply_updates is typed on pytrees; log_tau stays one array.
  return jnp.exp(typing.cast(jax.Array, log_tau))
