"""The last stages of a K-FAC update: KL clipping and the finiteness guard.

``clip`` scales the preconditioned update ``u`` so that the quadratic
model's step ``⟨u, g⟩`` stays within ``norm_constraint`` (Ba et al. 2017);
``guard`` applies that scale and keeps non-finite numbers out of the
parameters: a zero update for non-finite gradients or a bad damping, the
gradient itself for a non-finite preconditioned update.
"""
from __future__ import annotations

import jax.numpy as jnp
import optax

from kfac_jax_lite import factor as _factor
from kfac_jax_lite import factor as fac


def inner_product(updates, grad_leaves, dtype):
  """``⟨u, g⟩`` over all leaves, in ``dtype`` (the small leaves packed
  into few kernels, ``factor.pack``; one ``optax.tree_utils.tree_vdot``
  per packed array, added by ``factor.sum_scalars``, so that the scale
  made of it is not recomputed in every leaf's kernel)."""
  us = _factor.pack([u.astype(dtype) for u in updates])
  gs = _factor.pack([g.astype(dtype) for g in grad_leaves])
  return _factor.sum_scalars(
      [optax.tree_utils.tree_vdot(u, g) for u, g in zip(us, gs)], dtype)


def clip(updates, grad_leaves, norm_constraint, dtype):
  """The KL clipping scale (Ba et al. 2017) ``s = min(1, √(norm_constraint
  / ⟨u, g⟩))``; 1 when ``⟨u, g⟩ ≤ 0`` (or NaN) or ``norm_constraint`` is
  None. ``s`` is in ``[0, 1]``, so ``s·u`` is finite exactly when ``u``
  is; ``guard`` applies it."""
  if norm_constraint is None:
    return jnp.ones((), dtype)
  inner = inner_product(updates, grad_leaves, dtype)
  scale = jnp.where(inner > 0, jnp.sqrt(norm_constraint / jnp.where(
      inner > 0, inner, 1)), 1.0)
  return jnp.minimum(1.0, scale)


def guard(updates, grad_leaves, damping_ok, scale):
  """``(updates, grads_ok, update_ok)``: ``s·u`` (``s = scale``, from
  ``clip``), a zero update for non-finite gradients or a bad damping, the
  gradient for a non-finite update; one elementwise pass per leaf. The
  verdicts are ``factor.all_finite`` of ``g`` and of ``u`` (that of
  ``s·u``, as ``s`` is in ``[0, 1]``)."""
  grads_ok = fac.all_finite(grad_leaves)
  update_ok = fac.all_finite(updates)
  good = grads_ok & damping_ok
  out = [jnp.where(good, jnp.where(update_ok, (u * scale).astype(u.dtype), g),
                   jnp.zeros_like(g))
         for u, g in zip(updates, grad_leaves)]
  return out, grads_ok, update_ok
