"""The quadratic model of ``kfl.kfac_optimizer`` (Martens & Grosse 2015,
§6-7; the module docstring of ``optimizer`` gives the math): the curvature
forms ``Q_ij = v_iᵀ C v_j`` of the model's directions from one linearised
pass, the step ``[α, μ]`` minimising the model, the reduction ratio ``ρ``
and the Levenberg–Marquardt rule. Pure functions of arrays."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from kfac_jax_lite import estimators
from kfac_jax_lite.factor import float_dtype, sum_scalars


def tree_dot(a, b):
  """``⟨a, b⟩`` over all leaves (``optax.tree_utils.tree_vdot`` per leaf,
  added by ``factor.sum_scalars``), in the wider of their dtypes (at least
  float32)."""
  dtype = float_dtype((a, b))
  return sum_scalars([optax.tree_utils.tree_vdot(x.astype(dtype),
                                                 y.astype(dtype))
                      for x, y in zip(jax.tree.leaves(a),
                                      jax.tree.leaves(b))], dtype)


def curvature_forms(tagged, params, batch, directions, curvature):
  """``(V_iᵀ (Jᵀ H J) V_j, L(θ))`` for the stacked ``directions`` [2, ...].

  Two passes (``estimators.linearized_outputs``): a backward one for the
  loss weights ``c`` (and the loss) and a linearized forward one for
  ``J V`` (and the targets).
  """
  loss, c, outs, targets, jvp_fn = estimators.linearized_outputs(
      tagged, params, batch)
  jv = jax.vmap(jvp_fn)(directions)
  total = 0.0
  for j, t in enumerate(tagged.losses):
    dist = t.distribution
    roots = (dist.ggn_sqrt(outs[j], targets[j]) if curvature == "ggn"
             else dist.fisher_sqrt(outs[j]))
    c_e = jnp.maximum(c[j].astype(float_dtype(c[j])), 0)
    proj = 0.0
    for b, v in zip(roots, jv[j]):  # b [*values, *event, K], v [2, *values, *event]
      event = b.ndim - 1 - c_e.ndim
      prod = b[None] * v[..., None].astype(b.dtype)
      proj = proj + prod.sum(axis=tuple(range(1 + c_e.ndim, 1 + c_e.ndim + event)))
    # proj [2, *values, K]: Bᵀ J v per element.
    total = total + jnp.einsum("i...k,j...k,...->ij", proj, proj, c_e)
  return total, loss


def quadratic_model_step(q, b, *, use_momentum=True, max_momentum=0.99):
  """The ``[α, μ]`` minimising the quadratic model ``½ cᵀ Q c + cᵀ b``.

  ``Q [2, 2]`` and ``b [2]`` are the model along ``(Δ, δ)`` (the K-FAC
  direction and the previous update; module docstring, step 1). The model
  is convex, so its minimum over ``μ ∈ [0, max_momentum]`` is at the
  unconstrained ``μ = -(Q⁻¹ b)₁`` clipped to that interval, with ``α``
  re-minimised for it: ``α = -(b₀ + μ Q₀₁) / Q₀₀``. Without momentum (or
  for a singular ``Q``: ``det Q ≤ 1e-12 Q₀₀ Q₁₁``, e.g. ``δ = 0`` on the
  first step) ``μ = 0`` and ``α = -b₀ / Q₀₀``.

  Args:
    q: ``Q``, the (damped) curvature of the model, ``[2, 2]``.
    b: ``b = [gᵀΔ, gᵀδ]``, ``[2]``.
    use_momentum: whether ``μ`` is solved for (a bool, possibly traced);
      else ``μ = 0``.
    max_momentum: the upper end of ``μ``'s interval.

  Returns:
    ``[α, μ]`` in ``q``'s dtype; ``[0, 0]`` when ``Q₀₀ ≤ 0`` or the result
    is not finite (the step is skipped).
  """
  dtype = q.dtype
  det = q[0, 0] * q[1, 1] - q[0, 1] * q[1, 0]
  solved = -jnp.linalg.solve(q + 1e-30 * jnp.eye(2, dtype=dtype), b)
  use_both = use_momentum & (det > 1e-12 * q[0, 0] * q[1, 1])
  mu = jnp.where(use_both & jnp.isfinite(solved[1]),
                 jnp.clip(solved[1], 0.0, max_momentum), 0.0)
  alpha = -(b[0] + mu * q[0, 1]) / jnp.where(q[0, 0] > 0, q[0, 0], 1.0)
  coeffs = jnp.stack([alpha, mu]).astype(dtype)
  ok = jnp.all(jnp.isfinite(coeffs)) & (q[0, 0] > 0)
  return jnp.where(ok, coeffs, jnp.zeros(2, dtype))


def reduction_ratio(new_loss, loss, model_change):
  """``ρ = (L(θ + step) − L(θ)) / (M(step) − M(0))``, the actual over the
  predicted reduction (M&G §6.5).

  Args:
    new_loss: ``L(θ + step)``.
    loss: ``L(θ)``.
    model_change: ``M(step) − M(0)`` of the undamped quadratic model.

  Returns:
    ``ρ``; ``-inf`` when it is not finite (a non-finite new loss), so that
    ``levenberg_marquardt`` raises the damping. A ``model_change ≥ 0`` (no
    predicted reduction, e.g. a skipped step) gives ``ρ = (L − L_new)``,
    which the caller does not act on.
  """
  predicted = model_change < 0
  rho = (new_loss - loss) / jnp.where(predicted, model_change, -1.0)
  return jnp.where(jnp.isfinite(rho), rho, -jnp.inf)


def levenberg_marquardt(damping, rho, omega, min_damping, max_damping):
  """The Levenberg–Marquardt rule of M&G §6.5 for the damping ``λ``.

  ``λ ← ωλ`` when ``ρ > ¾`` (the model predicted the loss well: trust it
  more), ``λ ← λ/ω`` when ``ρ < ¼`` (including ``ρ = -inf``), ``λ``
  unchanged in between; then clipped to ``[min_damping, max_damping]``.

  Args:
    damping: ``λ``.
    rho: the reduction ratio ``ρ`` (``reduction_ratio``).
    omega: ``ω = damping_decay^{T₁}`` in ``(0, 1)``.
    min_damping: the floor of ``λ``.
    max_damping: the ceiling of ``λ``.

  Returns:
    The new ``λ``.
  """
  new = jnp.where(rho > 0.75, damping * omega,
                  jnp.where(rho < 0.25, damping / omega, damping))
  return jnp.clip(new, min_damping, max_damping)
