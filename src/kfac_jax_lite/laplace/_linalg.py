"""The posterior precision ``P = H + diag(τ)``: log-determinant, square-root
products, samples and the dense matrix, for every structure.

Blockwise structures (``"kron"``, ``"diag"``) give every layer one prior
precision, so ``P`` is block-diagonal with blocks ``H_l + τ_l I`` and each
block's exact damping does the work: for a Kronecker block
``c·A ⊗ G + τI = (Q_A ⊗ Q_G)(c Λ_A ⊗ Λ_G + τ)(Q_A ⊗ Q_G)ᵀ``. ``"full"``
uses the Cholesky factor ``P = L Lᵀ`` (and, for a scalar ``τ``, the
eigenvalues of ``H`` for the log-determinant).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular

from kfac_jax_lite.laplace import _posterior as P


def _check(post):
  if not isinstance(post, P.Posterior):
    raise TypeError(f"expected a kfl.laplace.Posterior (from "
                    f"kfl.laplace.fit), got {type(post).__name__}")


def prior(post, prior_precision):
  """``(τ per layer [L], is_scalar)`` in the posterior's dtype."""
  _check(post)
  scalar = jnp.ndim(prior_precision) == 0
  tau = P.prior_per_layer(post.meta, prior_precision)
  return tau.astype(jnp.result_type(tau, P.compute_dtype(post))), scalar


def logdet(post: P.Posterior, prior_precision):
  """``log det P`` for ``P = H + τ I`` (``τ`` a scalar or one per layer).

  Exact for every structure: for a Kronecker block ``Σ_ij log(c λ_A,i
  λ_G,j + τ)`` from the eigenvalues of its factors, for a diagonal
  ``Σ log(h + τ)``; for ``"full"`` the eigenvalues of ``H`` (scalar ``τ``)
  or a Cholesky factor of ``P`` (per-layer ``τ``). Differentiable in
  ``prior_precision``.
  """
  tau, scalar = prior(post, prior_precision)
  return logdet_at(post, tau, scalar)


@functools.partial(jax.jit, static_argnums=2)
def logdet_at(post, tau, scalar):
  """``logdet`` at a checked prior ``(tau, scalar)`` from ``prior``, jitted."""
  if post.meta.structure == "full":
    if scalar:
      return jnp.sum(jnp.log(post.spectrum + tau[0]))
    chol = _dense_cholesky(post, tau)
    return 2 * jnp.sum(jnp.log(jnp.diagonal(chol)))
  return sum(jnp.sum(jnp.log(post.spectrum[l.name] + t))
             for l, t in zip(post.meta.layers, tau))


def dense_precision(post: P.Posterior, prior_precision):
  """``P = H + diag(τ)`` as a ``[P, P]`` matrix (tiny models and tests),
  indexed like ``jax.flatten_util.ravel_pytree(post.mean)``."""
  tau, _ = prior(post, prior_precision)
  return _dense_precision(post, tau)


@jax.jit
def _dense_precision(post, tau):
  meta = post.meta
  diag = P.prior_per_param(meta, tau)
  if meta.structure == "full":
    return post.curvature.astype(diag.dtype) + jnp.diag(diag)
  out = jnp.diag(diag)
  for l in meta.layers:
    state = post.curvature[l.name]
    dense = (jax.vmap(l.block.to_dense)(state) if l.stack
             else l.block.to_dense(state)[None])
    for s in range(l.index.shape[0]):
      idx = l.index[s]
      out = out.at[idx[:, None], idx[None, :]].add(dense[s].astype(out.dtype))
  return out


def root_product(post, tau, scalar, v, transpose=False):
  """``R v`` (or ``Rᵀ v``) for ``v [M, P]``, with ``R Rᵀ = P⁻¹``.

  Blockwise: the symmetric ``R = P^{-1/2}`` (through each block's exact
  damped power); ``"full"``: ``R = L⁻ᵀ`` for ``P = L Lᵀ``.
  """
  meta = post.meta
  if meta.structure == "full":
    del scalar
    chol = _dense_cholesky(post, tau)
    out = solve_triangular(chol, v.T.astype(chol.dtype), lower=True,
                           trans=0 if transpose else 1)
    return out.T
  out = jnp.zeros_like(v)
  for l, t in zip(meta.layers, tau):
    x = v[:, l.index]  # [M, stack, size]
    state = post.curvature[l.name]
    shapes = l.block.param_shapes

    def one(st, xs, block=l.block, shapes=shapes, t=t):
      parts, start = [], 0
      for s in shapes:
        size = math.prod(s)
        parts.append(xs[start:start + size].reshape(s))
        start += size
      res = block.multiply_matpower(st, tuple(parts), t, -0.5)
      return jnp.concatenate([r.ravel() for r in res])

    per_slice = (jax.vmap(one) if l.stack else
                 lambda st, xs, one=one: one(st, xs[0])[None])
    y = jax.vmap(per_slice, in_axes=(None, 0))(state, x)
    out = out.at[:, l.index].set(y.astype(out.dtype))
  return out


def _dense_cholesky(post, tau):
  h = post.curvature
  diag = P.prior_per_param(post.meta, tau).astype(h.dtype)
  return jnp.linalg.cholesky(h + jnp.diag(diag))


def sample(post: P.Posterior, key, prior_precision, num_samples: int):
  """``num_samples`` parameter pytrees from ``N(mean, P⁻¹)``.

  Returns a pytree shaped like ``post.mean`` with a leading axis of
  ``num_samples`` on every leaf: ``mean + R z``, ``z ~ N(0, I)``, ``R
  Rᵀ = P⁻¹`` (each block's eigenbasis for the blockwise structures, the
  Cholesky factor for ``"full"``).
  """
  if not (isinstance(num_samples, int) and num_samples >= 1):
    raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
  tau, scalar = prior(post, prior_precision)
  return sample_at(post, key, tau, scalar, num_samples)


@functools.partial(jax.jit, static_argnums=(3, 4))
def sample_at(post, key, tau, scalar, num_samples):
  """``sample`` at a checked prior ``(tau, scalar)`` from ``prior``, jitted."""
  dtype = P.compute_dtype(post)
  z = jax.random.normal(key, (num_samples, post.meta.num_params), dtype)
  delta = root_product(post, tau, scalar, z)
  mean = P.ravel(post.meta, post.mean).astype(dtype)
  return P.unravel(post.meta, mean[None] + delta, P.leaf_dtypes(post))
