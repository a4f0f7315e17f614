"""Brute-force curvature from per-example Jacobians (the tests' ground truth).

A layer is given as ``fn(params, x_n) -> y_n`` for one example, ``y_n`` of
shape ``[R, O]`` (R uses of the weights: positions, locations; O outputs).
Parameters are a tuple of arrays; the flat order is their raveled
concatenation, as the blocks' ``to_dense`` uses.
"""
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree


def jacobians(fn, params, xs):
  """``[N, R, O, P]``: ∂y_nro/∂θ_p for every example."""
  flat, unravel = ravel_pytree(tuple(params))
  jac = jax.jacrev(lambda p, x: fn(unravel(p), x))
  # Jitted: one compile instead of one per primitive (eager), same math.
  return np.asarray(jax.jit(jax.vmap(jac, in_axes=(None, 0)))(flat, xs),
                    np.float64)


def weights_of(c, n):
  c = np.full(n, 1.0 / n) if c is None else np.asarray(c, np.float64)
  return c, c / c.sum()


def kronecker_curvature(jac, cots, c=None, mode="expand", out_groups=1):
  """The Kronecker approximation written with Jacobians.

  ``jac [N, R, O, P]``, ``cots [S, N, R, O]``. "expand":
  ``F = Σ_nr (w_n/R) J_nrᵀ G J_nr`` with ``G = Σ_n c_n mean_s Σ_r g gᵀ``;
  "reduce": ``F = Σ_n w_n J̄_nᵀ G J̄_n`` with ``J̄_n = mean_r J_nr`` and
  ``G = Σ_n c_n mean_s ĝ ĝᵀ``, ``ĝ = Σ_r g``. Output channels in different
  groups get no cross terms in ``G``.
  """
  cots = np.asarray(cots, np.float64)
  n, r, o, _ = jac.shape
  c, w = weights_of(c, n)
  if mode == "expand":
    g = np.einsum("n,snri,snrj->ij", c, cots, cots) / cots.shape[0]
  else:
    gh = cots.sum(2)
    g = np.einsum("n,sni,snj->ij", c, gh, gh) / cots.shape[0]
  group = np.arange(o) // (o // out_groups)
  g = g * (group[:, None] == group[None, :])
  if mode == "expand":
    return np.einsum("n,nrip,ij,nrjq->pq", w / r, jac, g, jac)
  jbar = jac.mean(1)
  return np.einsum("n,nip,ij,njq->pq", w, jbar, g, jbar)


def per_example_grads(fn, params, xs, cots):
  """``[S, N, P]``: gradients of ``<g_sn, fn(θ, x_n)>`` by ``vmap(grad)``."""
  def loss(p, x, g):
    return jnp.sum(fn(p, x) * g)
  grad = jax.jit(jax.vmap(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0)),
                          in_axes=(None, None, 0)))(tuple(params), xs, cots)
  return np.concatenate(
      [np.asarray(x, np.float64).reshape(x.shape[0], x.shape[1], -1)
       for x in grad], axis=-1)


def sum_of_squares(grads, c=None):
  """``Σ_n c_n mean_s grad_sn²``."""
  c, _ = weights_of(c, grads.shape[1])
  return np.einsum("n,snp->p", c, grads ** 2) / grads.shape[0]


def block_diagonal(m, parts):
  """``m [n, n]`` with only its ``parts`` diagonal blocks of ``⌈n/parts⌉``
  rows kept (the last one shorter): a partitioned factor side
  (``side_block``) as a dense matrix."""
  n = m.shape[0]
  which = np.arange(n) // -(-n // parts)
  return m * (which[:, None] == which[None, :])


def partitioned(m, features, side_block):
  """``m`` as a side partitioned by ``side_block``: its ``⌈features /
  side_block⌉`` diagonal blocks (``block_diagonal``), ``features`` the side
  counted as the policy counts it (an input side without the bias's row);
  ``m`` whole where ``features <= side_block``."""
  parts = -(-features // side_block) if features > side_block else 1
  return block_diagonal(m, parts)
