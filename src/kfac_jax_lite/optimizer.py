"""``kfl.kfac_optimizer``: the full K-FAC optimizer of Martens & Grosse (2015).

Each step, with ``g`` the gradient, ``Δ = -(F̂ + λI)⁻¹ g`` the K-FAC
direction (``kfl.kfac`` at the current damping ``λ``) and ``δ`` the previous
update:

1. **Learning rate and momentum from the exact quadratic model** (§7).
   With ``C = Jᵀ H J + (λ + η) I`` (``H`` the output GGN, or Fisher,
   of the registered losses; ``η`` the ``l2_reg``), minimise
   ``M(αΔ + μδ) = ½ [α μ] Q [α μ]ᵀ + [α μ]·b`` where
   ``Q_ij = v_iᵀ C v_j`` and ``b_i = gᵀ v_i`` for ``(v_1, v_2) = (Δ, δ)``:
   ``[α, μ] = -Q⁻¹ b`` (just ``α`` on the first step). The quadratic forms
   come from forward-mode products ``J v`` (``jax.jvp``), ``‖Bᵀ J v‖²``
   weighted by the loss weights ``c`` read from the backward pass.
2. **Levenberg–Marquardt damping** (§6.5). Every
   ``damping_adaptation_interval`` steps (T₁) the reduction ratio
   ``ρ = (L(θ + step) − L(θ)) / (M(step) − M(0))`` (with ``M`` the
   quadratic model without ``λ``) updates ``λ ← ωλ`` if ``ρ > ¾`` and
   ``λ ← λ/ω`` if ``ρ < ¼``, ``ω = damping_decay^{T₁}``, clipped to
   ``[min_damping, max_damping]``.

Extra args: ``update(grads, state, params, *, batch)`` needs only the
batch. To read the loss at the new parameters it evaluates
``loss_fn(params + step, batch)`` itself (one more forward pass on T₁-th
steps) — no other extra argument is read. The returned update is the whole
step: apply it with ``optax.apply_updates`` (do not chain a learning rate).
The preconditioner's damping is ``λ + η`` (M&G's γ adaptation is replaced
by tying γ² to it).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from kfac_jax_lite import estimators
from kfac_jax_lite import transform


class KfacOptimizerState(NamedTuple):
  kfac: transform.KfacState
  damping: Any  # λ, adapted by Levenberg–Marquardt.
  velocity: Any  # The previous update δ.
  learning_rate: Any  # α of the last step.
  momentum: Any  # μ of the last step.
  rho: Any  # The last reduction ratio ρ.


def _tree_dot(a, b):
  return sum(jnp.vdot(x.astype(jnp.float32), y.astype(jnp.float32))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _curvature_forms(tagged, params, batch, directions, curvature):
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
    c_e = jnp.maximum(c[j].astype(jnp.float32), 0)
    proj = 0.0
    for b, v in zip(roots, jv[j]):  # b [*values, *event, K], v [2, *values, *event]
      event = b.ndim - 1 - c_e.ndim
      prod = b[None] * v[..., None].astype(b.dtype)
      proj = proj + prod.sum(axis=tuple(range(1 + c_e.ndim, 1 + c_e.ndim + event)))
    # proj [2, *values, K]: Bᵀ J v per element.
    total = total + jnp.einsum("i...k,j...k,...->ij", proj, proj, c_e)
  return total, loss


def kfac_optimizer(loss_fn: Callable, example_batch, *, initial_damping=0.1,
                   min_damping=1e-8, max_damping=1e8, damping_decay=19 / 20,
                   damping_adaptation_interval=5, l2_reg=0.0,
                   curvature="ggn", use_momentum=True, has_aux=False,
                   **kfac_options) -> optax.GradientTransformationExtraArgs:
  """The Martens–Grosse K-FAC optimizer; see the module docstring.

  ``kfac_options`` go to ``kfl.kfac`` (``estimation``, ``cov_decay``,
  ``inverse_every``, ``damping_mode``, ``blocks``, ``axis_name``, ...), except
  ``damping``, which this optimizer adapts.
  """
  if curvature not in ("ggn", "fisher"):
    raise ValueError(f"curvature must be 'ggn' or 'fisher', got {curvature!r}")
  if "damping" in kfac_options:
    raise ValueError("kfac_optimizer adapts the damping: pass initial_damping")
  interval = damping_adaptation_interval
  inner = transform.kfac(loss_fn, example_batch, has_aux=has_aux,
                         damping=initial_damping, **kfac_options)
  omega = damping_decay ** interval
  tagged_cache = {}

  def tagged_for(params):
    tagged = transform.find_layers_cached(
        tagged_cache, loss_fn, params, example_batch, has_aux=has_aux,
        exclude=kfac_options.get("exclude", ()))
    if not tagged.losses:
      raise ValueError("kfac_optimizer needs a registered loss (e.g. "
                       "kfl.softmax_cross_entropy) for its quadratic model")
    return tagged

  def value(params, batch):
    out = loss_fn(params, batch)
    return out[0] if has_aux else out

  def init_fn(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    return KfacOptimizerState(inner.init(params), f32(initial_damping), zeros,
                              f32(0.0), f32(0.0), f32(0.0))

  def update_fn(grads, state, params=None, *, batch=None, **extra_args):
    del extra_args
    if params is None or batch is None:
      raise ValueError("kfac_optimizer.update needs params and batch=")
    tagged = tagged_for(params)
    lam = state.damping
    precond, kstate = inner.update(grads, state.kfac, params, batch=batch,
                                   damping=lam + l2_reg)
    delta = jax.tree.map(lambda u: -u, precond)
    first = kstate.count == 1
    vel = state.velocity
    dirs = jax.tree.map(lambda a, b: jnp.stack([a, b.astype(a.dtype)]), delta, vel)
    forms, loss = _curvature_forms(tagged, params, batch, dirs, curvature)
    gram = jnp.array([[_tree_dot(delta, delta), _tree_dot(delta, vel)],
                      [_tree_dot(vel, delta), _tree_dot(vel, vel)]])
    b = jnp.array([_tree_dot(grads, delta), _tree_dot(grads, vel)])
    q_undamped = forms + l2_reg * gram
    q = q_undamped + lam * gram
    alpha_only = -b[0] / jnp.where(q[0, 0] > 0, q[0, 0], 1.0)
    det = q[0, 0] * q[1, 1] - q[0, 1] * q[1, 0]
    solved = -jnp.linalg.solve(q + 1e-30 * jnp.eye(2), b)
    use_both = (~first) & use_momentum & (det > 1e-12 * q[0, 0] * q[1, 1])
    coeffs = jnp.where(use_both, solved, jnp.array([alpha_only, 0.0]))
    coeffs = jnp.where(jnp.all(jnp.isfinite(coeffs)), coeffs, jnp.zeros(2))
    alpha, mu = coeffs[0], coeffs[1]
    step = jax.tree.map(lambda d, v: (alpha * d + mu * v.astype(d.dtype)).astype(d.dtype),
                        delta, vel)
    model_change = 0.5 * coeffs @ q_undamped @ coeffs + coeffs @ b

    def adapt(lam):
      new_loss = value(optax.apply_updates(params, step), batch)
      rho = (new_loss - loss) / jnp.where(
          model_change < 0, model_change, -1e-30)
      rho = jnp.where(jnp.isfinite(rho), rho, -jnp.inf)
      lam = jnp.where(rho > 0.75, lam * omega, jnp.where(rho < 0.25, lam / omega, lam))
      return jnp.clip(lam, min_damping, max_damping), rho.astype(jnp.float32)

    new_lam, rho = jax.lax.cond(
        kstate.count % interval == 0, adapt, lambda l: (l, state.rho), lam)
    ok = jnp.all(jnp.isfinite(jnp.array([alpha, mu])))
    new_state = KfacOptimizerState(
        kstate, new_lam, jax.tree.map(lambda s, v: s.astype(v.dtype), step, vel),
        jnp.where(ok, alpha, 0.0).astype(jnp.float32),
        jnp.where(ok, mu, 0.0).astype(jnp.float32), rho)
    return step, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
