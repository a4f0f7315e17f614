"""``kfl.kfac_optimizer``: the full K-FAC optimizer of Martens & Grosse (2015).

Each step, with ``g`` the gradient, ``Δ = -(F̂ + λI)⁻¹ g`` the K-FAC
direction (``kfl.kfac`` at the current damping ``λ``) and ``δ`` the previous
update:

1. **Learning rate and momentum from the exact quadratic model** (§7).
   With ``C = Jᵀ H J + (λ + η) I`` (``H`` the output GGN, or Fisher,
   of the registered losses; ``η`` the ``l2_reg``), minimise
   ``M(αΔ + μδ) = ½ [α μ] Q [α μ]ᵀ + [α μ]·b`` where
   ``Q_ij = v_iᵀ C v_j`` and ``b_i = gᵀ v_i`` for ``(v_1, v_2) = (Δ, δ)``:
   ``[α, μ] = -Q⁻¹ b`` (just ``α`` on the first step), with ``μ`` kept in
   ``[0, max_momentum]`` (the model is convex, so the constrained optimum
   is the clipped ``μ`` with ``α`` re-minimised for it: unclipped, ``μ``
   reached -0.8 on an easy problem and the loss climbed back up). The
   quadratic forms come from forward-mode products ``J v`` (``jax.jvp``),
   ``‖Bᵀ J v‖²`` weighted by the loss weights ``c`` read from the
   backward pass.
2. **Levenberg–Marquardt damping** (§6.5). Every
   ``damping_adaptation_interval`` steps (T₁, default every step) the
   reduction ratio ``ρ = (L(θ + step) − L(θ)) / (M(step) − M(0))`` (with
   ``M`` the quadratic model without ``λ``) updates ``λ ← ωλ`` if
   ``ρ > ¾`` and ``λ ← λ/ω`` if ``ρ < ¼``, ``ω = damping_decay^{T₁}``,
   clipped to ``[min_damping, max_damping]``. A non-finite ``ρ`` counts as
   a bad one (λ rises), and a step after the first with ``ρ < 0`` (its own
   batch's loss rose; a non-finite loss, on any step) is also rejected (a
   zero update), as a trust
   region's acceptance test does (Nocedal & Wright, Alg. 4.1); a step the
   model predicted no reduction for (e.g. a skipped one) leaves λ as it
   was.

   The floor ``min_damping=1e-5`` is M&G's: their ℓ2 coefficient
   ``η = 1e-5`` is part of the damping (``λ + η``), so the damping never
   falls below it; kfac-jax's MNIST examples also use ``min_damping=1e-5``.
   On an easy problem ρ stays above ¾ (about 1.3 on digits) and λ decays
   geometrically; with a floor of ``1e-8`` it went 0.1 → 3e-8 in 300
   steps, after which a hard patch needs ~50 rises (250 steps) to get back
   to 1e-2. With ``1e-5`` the final loss of those runs was within 1.5× of
   the ``1e-8`` one (``benchmarks/robustness.py``, README "Defaults").

   The start ``initial_damping=1.0`` (it was 0.1, issue 36): ρ is measured
   on the batch that chose the step, so it cannot see a step that fits
   that batch at the cost of examples it does not hold. On digits
   standardised as ``(x - mean) / (std + 1e-3)`` a pixel lit in 7 of 1797
   images becomes an input of 21; at batch 128 one such image in a batch
   moved its first-layer row by 2.4 (pre-activation +50 on the other six,
   other classes), the batch's loss fell as predicted (ρ ≈ 1), and the
   full-data loss went 0.05 → 0.44, later to 1e34. That happened only
   while λ was still falling from 0.1 (0.036 at step 35), with the large
   early gradients; from λ = 1 the same four MLPs (ReLU 64-100-10,
   64-100-100-10, 64-256-256-10, tanh 64-64-10) all reached a full-data
   loss below 1e-3 in 200 steps, with λ down to 5e-5 by then
   (``tests/test_optimizer_standardised.py``). A held-out ρ (the previous
   step's change on the next batch) was tried instead: it stays near 0.05
   while the loss falls, so λ climbs to 300 and training stalls.

   ρ on every step (T₁ = 1, it was 5) and the rejection of a step that
   raised its own batch's loss (issue 36): on the 64-100-100-10 ReLU MLP
   of that test, from λ = 1, the steps that broke training were steps 34,
   40, 63 and 72, each raising its own batch's loss (0.24 → 1.34 at step
   63, α = 1.33), on batches holding an image the network got badly wrong;
   with ρ read every 5th step none of them was seen, and the full-data
   loss reached NaN by step 120. With ρ on every step but no rejection it
   reached 2e31; with both it ends at 0.006 after 200 steps. The price is
   one forward pass of the batch per step (it was one per 5 steps).

   The first update is kept whatever its ρ (if finite; λ still rises):
   from the deep autoencoder's initialisation (all 784 outputs near ½,
   loss 551) every K-FAC step raises the batch's loss at first (ρ ≈ -0.6
   at λ = 1, 4, 16; accepted from λ ≈ 64). Rejecting the first step left
   the optimizer in place for 50+ steps while λ climbed by 1/ω (or, with
   λ multiplied by 4 on each rejection, left λ near 60 to decay for the
   next 80 steps: evaluation loss 74 at step 120); keeping it (the loss
   551 → 624) the next steps had ρ ≈ 0.8-1.1 and reached 63.6 at step 120,
   as the old rule did (63.0 at step 101). The standardised-input MLPs'
   first steps lower the loss, so their rejections are unchanged.

Extra args: ``update(grads, state, params, *, batch, stats=None)`` needs
the batch, for the quadratic model's products and, without ``stats=``, for
the preconditioner's statistics (its own pass). ``stats=`` takes them from
the one-pass estimate instead, as ``kfl.kfac``'s ``update`` does::

    est = est_fn(params, batch, key, with_stats=kfl.stats_due(state))
    step, state = opt.update(est.grads, state, params, batch=batch,
                             stats=est.stats, loss=est.loss)

(``est_fn = kfl.value_grad_and_stats(loss_fn, params, batch, ...)`` with
the same estimation options). To read the loss at the new parameters it
evaluates ``loss_fn(params + step, batch)`` itself (one more forward pass
on T₁-th steps, every step by default) — no other extra argument is read.
The returned update is the whole step: apply it with ``optax.apply_updates`` (do not chain a learning rate).
The preconditioner's damping is ``λ + η`` (M&G's γ adaptation is replaced
by tying γ² to it).
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
import functools
import typing
from typing import Any, Callable, NamedTuple

import chex

import jax
import jax.numpy as jnp
import optax

from kfac_jax_lite import estimators
from kfac_jax_lite.factor import float_dtype
from kfac_jax_lite.optimizers import options as O
from kfac_jax_lite.optimizers import _find
from kfac_jax_lite.optimizers import _pending
from kfac_jax_lite.optimizers import transform
# The quadratic model's math (its own module; these names stay here too).
from kfac_jax_lite.optimizers._quadratic import (  # noqa: F401
    curvature_forms as _curvature_forms, levenberg_marquardt,
    quadratic_model_step, reduction_ratio, tree_dot as _tree_dot)


class KfacOptimizerState(NamedTuple):
  """The state of ``kfl.kfac_optimizer``: the inner ``KfacState`` and the
  adapted damping, step and momentum (a pytree of arrays).

  Attributes:
    kfac: the ``KfacState`` of the preconditioner (its statistics, caches
      and safeguard counters; ``kfl.health`` reads it).
    damping: ``λ``, adapted by the Levenberg–Marquardt rule
      (``levenberg_marquardt``); the preconditioner's is ``λ + l2_reg``.
    velocity: the previous update ``δ`` (a pytree like the parameters),
      the momentum direction.
    learning_rate: ``α`` of the last step (``quadratic_model_step``).
    momentum: ``μ`` of the last step.
    rho: the last reduction ratio ``ρ`` (``reduction_ratio``), from the
      last step that adapted the damping.
    pending: the slot (``_pending.Pending``) of the batch (and
      statistics) ``update`` uses when called without ``batch=``
      (``kfl.with_batch``, ``kfl.with_stats``): made by ``init`` (zeros of
      the example batch's shapes), returned without the statistics (used
      once); the inner ``kfac``
      state has none (None).
  """

  kfac: transform.KfacState
  damping: Any
  velocity: Any
  learning_rate: Any
  momentum: Any
  rho: Any
  pending: Any = None  # _pending.Pending (None: a state of an older version)


def _require(ok, message):
  if not ok:
    raise ValueError(f"kfac_optimizer: {message}")


def kfac_optimizer(loss_fn: Callable, example_batch: chex.ArrayTree, *,
                   initial_damping: float = 1.0, min_damping: float = 1e-5,
                   max_damping: float = 1e8, damping_decay: float = 19 / 20,
                   damping_adaptation_interval: int = 1, l2_reg: float = 0.0,
                   curvature: str = "ggn", use_momentum: bool = True,
                   max_momentum: float = 0.99, model_fraction: float = 1.0,
                   estimation: str = "fisher", num_samples: int = 1,
                   cov_decay: float = 0.95, cov_every: int | None = 1,
                   stats_fraction: float = 1.0,
                   blocks: Mapping[str, Any] | None = None,
                   exclude: Sequence[str] = (), weight_sharing: str = "expand",
                   example_axis: chex.ArrayTree | None = None,
                   has_aux: bool = False, axis_name: Hashable | None = None,
                   seed: int = 0, inverse_every: int | None = 10,
                   budget: float | None = None,
                   damping_mode: str = "pi", precon_power: float = -1.0,
                   norm_constraint: float | None = None,
                   inverse_method: str = "auto", layout: str | None = None,
                   gather: str = "updates"
                   ) -> optax.GradientTransformationExtraArgs:
  """The Martens–Grosse K-FAC optimizer (module docstring).

      opt = kfl.kfac_optimizer(loss_fn, batch)
      state = opt.init(params)
      step, state = opt.update(grads, state, params, batch=batch)
      params = optax.apply_updates(params, step)   # no learning rate

  It takes ``kfl.kfac``'s arguments (``kfl.CurvatureOptions``,
  ``kfl.PreconditionerOptions``) but ``damping``, which it adapts from
  ``initial_damping``, and ``mesh``: the quadratic model averages over
  ``axis_name``, so call it inside ``shard_map``/``pmap``
  (``layout="sharded"`` works there).

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss`` (``(loss, aux)`` with
      ``has_aux``), computed with a registered loss
      (``kfl.softmax_cross_entropy``, ...) or a standard one recognised in
      the jaxpr (optax's, or written out): the quadratic model needs its
      output curvature (``init`` refuses a loss without one).
    example_batch: a batch (arrays or ``jax.ShapeDtypeStruct``s), only
      traced to find the layers.
    initial_damping: the starting ``λ`` of the Levenberg–Marquardt
      adaptation (1.0: from 0.1 a standardised-input MLP blew up at batch
      128, module docstring); the preconditioner is ``(F̂ + (λ + l2_reg) I)⁻¹``. In π
      mode (``kfl.kfac``'s default) an adapted ``λ`` reaches the cached
      inverses at their next refresh (``inverse_every``); the quadratic
      model uses the current ``λ`` at every step.
    min_damping: the floor of the range ``λ`` is clipped to. The floor
      (default 1e-5, as in kfac-jax's examples; Martens & Grosse count their
      ℓ2 term η = 1e-5 in the damping) keeps an easy problem from driving
      ``λ`` so low that a harder patch needs hundreds of steps to recover.
    max_damping: the ceiling of that range.
    damping_decay: ``ω`` per step: every ``damping_adaptation_interval``
      (``T₁``) steps ``λ`` is multiplied by ``ω^{T₁}`` when ``ρ > ¾`` and
      divided by it when ``ρ < ¼``; in ``(0, 1)``.
    damping_adaptation_interval: ``T₁``, a positive int; on those steps the
      loss is evaluated at the new parameters (one more forward pass) and
      a step that raised it is rejected (the first is kept, module
      docstring). Default 1 (module docstring: the
      steps that broke a standardised-input MLP were all off the 5th).
    l2_reg: ``η ≥ 0``, an L2 regularisation the loss does not contain,
      added to the quadratic model's curvature (and to the damping).
    curvature: the quadratic model's curvature, ``"ggn"`` (``Jᵀ H J``, the
      output Hessian) or ``"fisher"`` (the output Fisher); the same for
      losses in natural parameters.
    use_momentum: whether the quadratic model also chooses a momentum
      ``μ`` along the previous update (else ``μ = 0``).
    max_momentum: ``μ`` is kept in ``[0, max_momentum]`` (and ``α``
      re-minimised for the clipped ``μ``); in ``[0, 1)``.
    model_fraction: the share ``f`` in ``(0, 1]`` of each batch the
      quadratic model sees: its products ``J v``, loss weights and ρ's two
      losses are computed on the first ``round(f · N)`` examples (the
      leaves ``kfl.describe`` lists under ``examples:``), as
      ``stats_fraction`` cuts the statistics' share; the gradient ``g`` in
      ``b = [gᵀΔ, gᵀδ]`` stays the whole batch's. Martens (2010) took
      curvature-vector products on 1/100 of the data. 1 (the default):
      the whole batch, the step as before.
    estimation: ``kfl.CurvatureOptions.estimation``.
    num_samples: ``kfl.CurvatureOptions.num_samples``.
    cov_decay: ``kfl.CurvatureOptions.cov_decay``.
    cov_every: ``kfl.CurvatureOptions.cov_every``: 1, statistics every
      step (below); None: planned within ``budget``.
    stats_fraction: ``kfl.CurvatureOptions.stats_fraction``.
    blocks: ``kfl.CurvatureOptions.blocks``.
    exclude: ``kfl.CurvatureOptions.exclude``.
    weight_sharing: ``kfl.CurvatureOptions.weight_sharing``.
    axis_name: ``kfl.CurvatureOptions.axis_name``.
    has_aux: ``kfl.CurvatureOptions.has_aux``.
    example_axis: ``kfl.CurvatureOptions.example_axis``.
    seed: ``kfl.CurvatureOptions.seed``.
    inverse_every: ``kfl.PreconditionerOptions.inverse_every``: 10; None:
      planned within ``budget``.
    budget: for an interval given as None, the planned mean step in SGD
      steps of the model's FLOPs (``kfl.PreconditionerOptions.budget``),
      this optimizer's every-step work included: the gradient, the
      preconditioning and its quadratic model (``2·model_fraction`` SGD
      steps: a linearised forward pass with two directions and ρ's
      forward pass). None (the default): that work plus 0.3 SGD steps for
      the statistics and the refreshes, the overhead ``kfl.kfac``'s
      default budget allows them. ``kfl.describe(..., model_fraction=f)``
      prints the plan and its price (``cov_every=1, inverse_every=10``:
      the price of the defaults). Not planned by default: the plan was 8%
      sooner to Adam's loss on the MNIST autoencoder at batch 1000 and let
      a batch-128 MLP's loss climb back (``docs/defaults.md``,
      "kfac_optimizer's intervals").
    damping_mode: ``kfl.PreconditionerOptions.damping_mode``.
    precon_power: ``kfl.PreconditionerOptions.precon_power``.
    norm_constraint: ``kfl.PreconditionerOptions.norm_constraint``, but
      None by default here: the quadratic model chooses the step's size.
    inverse_method: ``kfl.PreconditionerOptions.inverse_method``.
    layout: ``kfl.PreconditionerOptions.layout``.
    gather: ``kfl.PreconditionerOptions.gather``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update(grads,
    state, params, *, batch, stats=None, loss=None)`` returns the whole step
    ``αΔ + μδ`` (``stats=``: the statistics of ``kfl.value_grad_and_stats``,
    used by the preconditioner instead of its own pass, with ``loss=`` the
    batch's loss for ``kfl.health``, as ``kfl.kfac``'s; module docstring).

  References:
    Martens, J. and Grosse, R. (2015). Optimizing neural networks with
      Kronecker-factored approximate curvature. ICML. arXiv:1503.05671.
  """
  adaptation = Adaptation(
      initial_damping=initial_damping, min_damping=min_damping,
      max_damping=max_damping, damping_decay=damping_decay,
      interval=damping_adaptation_interval, l2_reg=l2_reg,
      curvature=curvature, use_momentum=use_momentum,
      max_momentum=max_momentum, model_fraction=model_fraction)
  adaptation.check()
  shared = O.CurvatureOptions(
      estimation=estimation, num_samples=num_samples, cov_decay=cov_decay,
      cov_every=cov_every, stats_fraction=stats_fraction, blocks=blocks,
      exclude=exclude, weight_sharing=weight_sharing,
      example_axis=example_axis, has_aux=has_aux, axis_name=axis_name,
      seed=seed)
  preconditioner = O.PreconditionerOptions(
      damping=initial_damping, inverse_every=inverse_every, budget=budget,
      damping_mode=damping_mode, precon_power=precon_power,
      norm_constraint=norm_constraint, inverse_method=inverse_method,
      layout=layout, gather=gather)
  inner, layers = transform.build(loss_fn, example_batch, shared,
                                  preconditioner,
                                  model_fraction=model_fraction)
  cfg = _Optimizer(loss_fn, has_aux, axis_name, inner, layers, adaptation)
  return optax.GradientTransformationExtraArgs(
      functools.partial(_init, cfg), functools.partial(_update, cfg))


class Adaptation(NamedTuple):
  """``kfac_optimizer``'s own options (its Args): the Levenberg–Marquardt
  damping and the quadratic model's step."""

  initial_damping: float
  min_damping: float
  max_damping: float
  damping_decay: float
  interval: int  # damping_adaptation_interval
  l2_reg: float
  curvature: str
  use_momentum: bool
  max_momentum: float
  model_fraction: float = 1.0

  def check(self) -> None:
    """A ``ValueError`` for an option out of its range."""
    a = self
    if a.curvature not in ("ggn", "fisher"):
      raise ValueError(f"curvature must be 'ggn' or 'fisher', got "
                       f"{a.curvature!r}")
    _require(0 < a.min_damping <= a.initial_damping <= a.max_damping,
             "need 0 < min_damping <= initial_damping <= max_damping, got "
             f"{a.min_damping!r}, {a.initial_damping!r}, {a.max_damping!r}")
    _require(0 < a.damping_decay < 1,
             f"damping_decay must be in (0, 1), got {a.damping_decay!r}")
    _require(isinstance(a.interval, int) and a.interval >= 1,
             "damping_adaptation_interval must be a positive int, got "
             f"{a.interval!r}")
    _require(a.l2_reg >= 0, f"l2_reg must be >= 0, got {a.l2_reg!r}")
    _require(0 <= a.max_momentum < 1,
             f"max_momentum must be in [0, 1), got {a.max_momentum!r}")
    _require(0 < a.model_fraction <= 1,
             f"model_fraction must be in (0, 1], got {a.model_fraction!r}")


class _Optimizer(NamedTuple):
  """What one ``kfac_optimizer`` fixes when built."""

  loss_fn: Callable
  has_aux: bool
  axis_name: Hashable | None
  inner: optax.GradientTransformationExtraArgs  # kfl.kfac's transform.
  layers: Callable  # The preconditioner's detection (one trace serves both).
  adaptation: Adaptation

  def device_mean(self, x) -> Any:
    """Under ``axis_name`` each device holds a shard of the batch: the
    quadratic model and the losses ρ compares are the device means (as the
    statistics)."""
    return jax.lax.pmean(x, self.axis_name) if self.axis_name else x

  def model_batch(self, params, batch):
    """The detection and the share of ``batch`` the quadratic model sees
    (``model_fraction``: the first examples; the whole batch at 1)."""
    tagged = self.tagged(params)
    f = self.adaptation.model_fraction
    if f >= 1.0:
      return tagged, batch
    sub = estimators.stats_slice(batch, f, "kfac_optimizer(model_fraction)",
                                 tagged.examples)
    return self.layers(params, sub), sub

  def value(self, params, batch):
    out = self.loss_fn(params, batch)
    return out[0] if self.has_aux else out

  def tagged(self, params):
    """The detection, refusing a loss_fn without a registered or
    recognised loss (the quadratic model needs its curvature)."""
    tagged = self.layers(params)
    if not tagged.losses:
      seen = ("; its terms: " + "; ".join(tagged.unrecognised)
              if tagged.unrecognised else "")
      raise ValueError(
          "kfl.kfac_optimizer needs a registered or recognised loss for its "
          f"quadratic model, and none was found in loss_fn{seen}. Compute "
          "the loss with kfl.softmax_cross_entropy, "
          "kfl.softmax_cross_entropy_with_integer_labels, "
          "kfl.sigmoid_binary_cross_entropy, kfl.squared_error (or "
          "kfl.registered_loss), or with optax's namesakes or a standard "
          "form written out (recognised: see kfl.describe); or use kfl.kfac "
          "with estimation='empirical'")
    return tagged


def _init(cfg: _Optimizer, params) -> KfacOptimizerState:
  params = _find.unwrap(params)  # nnx.Optimizer inits on Variables.
  _find.check_unmasked(params, "kfl.kfac_optimizer")
  _find.check_not_in_multisteps("kfl.kfac_optimizer")
  cfg.tagged(params)  # Refuse a loss_fn without a loss here, not at a step.
  zeros = jax.tree.map(jnp.zeros_like, params)
  scalar = lambda x: jnp.asarray(x, float_dtype(params))
  # optax types every transform's state as OptState; kfac's is a KfacState.
  kfac_state = typing.cast(transform.KfacState, cfg.inner.init(params))
  # The stored batch's slot is this state's (``update`` passes the inner
  # one keyword arguments): moved here, not kept twice.
  return KfacOptimizerState(kfac_state._replace(pending=None),
                            scalar(cfg.adaptation.initial_damping),
                            zeros, scalar(0.0), scalar(0.0), scalar(0.0),
                            kfac_state.pending)


def _update(cfg: _Optimizer, updates, state, params=None, *, batch=None,
            stats=None, loss=None, **extra_args):
  """``update``: the preconditioned direction, the quadratic model's
  ``α`` and ``μ`` (``_model_step``) and, every ``interval`` steps, the
  damping's adaptation (``_adapt``)."""
  del extra_args
  if params is None:
    raise ValueError("kfac_optimizer.update needs params and batch=")
  grads = updates  # Their structure (flax wrappers included) comes back.
  params, updates = _find.unwrap_update(params, updates,
                                           "kfl.kfac_optimizer")
  step, new_state = _pending.stored(
      lambda state, batch, stats, loss: _given(
          cfg, updates, state, params, batch=batch, stats=stats, loss=loss),
      state, batch, stats, loss, needs="batch")
  return _find.rewrap(grads, step), new_state


def _given(cfg: _Optimizer, updates, state, params, *, batch, stats, loss):
  """``update`` on the unwrapped gradients and params, with the batch (and
  statistics) given or stored (``_pending.stored``)."""
  if batch is None:
    raise ValueError(_pending.missing(
        "kfac_optimizer.update", "batch= (its quadratic model evaluates "
        "the loss on it; stats= are optional)"))
  a = cfg.adaptation
  dtype = float_dtype(params)
  lam = state.damping.astype(dtype)
  precond, kstate = cfg.inner.update(updates, state.kfac, params, batch=batch,
                                     stats=stats, damping=lam + a.l2_reg,
                                     loss=loss)
  kstate = typing.cast(transform.KfacState, kstate)  # As in _init.
  delta = jax.tree.map(lambda u: -u, precond)
  tagged, batch = cfg.model_batch(params, batch)
  first = kstate.count == 1
  step, coeffs, model_change, loss = _model_step(
      cfg, tagged, params, batch, updates, delta, state.velocity, lam,
      first=first, dtype=dtype)
  new_lam, rho, step = jax.lax.cond(
      kstate.count % a.interval == 0,
      functools.partial(_adapt, cfg, params, batch, loss, model_change, first),
      lambda op: (op[0], state.rho.astype(dtype), op[1]), (lam, step))
  new_state = KfacOptimizerState(
      kstate, new_lam.astype(state.damping.dtype),
      jax.tree.map(lambda s, v: s.astype(v.dtype), step, state.velocity),
      coeffs[0].astype(state.learning_rate.dtype),
      coeffs[1].astype(state.momentum.dtype), rho.astype(state.rho.dtype),
      state.pending)
  return _skip_if_guarded(state, new_state, step)


def _skip_if_guarded(state, new_state, step):
  """``(step, new_state)``, or a zero step and ``state``'s damping,
  velocity and coefficients (the new K-FAC state kept, with its counters)
  when the inner ``kfl.kfac`` skipped or replaced this update (a
  non-finite gradient or loss, a label outside its classes: its
  ``health.last_bad`` is this step), so that the momentum does not carry
  the step on (issue 38; PyTorch's ``GradScaler`` skips it the same way)."""
  skipped = new_state.kfac.health.last_bad == state.kfac.count
  keep = lambda new, old: jax.tree.map(
      lambda n, o: jnp.where(skipped, o, n).astype(o.dtype), new, old)
  step = jax.tree.map(lambda x: jnp.where(skipped, jnp.zeros_like(x), x),
                      step)
  return step, new_state._replace(**{
      f: keep(getattr(new_state, f), getattr(state, f))
      for f in ("damping", "velocity", "learning_rate", "momentum", "rho")})


def _model_step(cfg: _Optimizer, tagged, params, batch, grads, delta, vel,
                lam, *, first, dtype):
  """The step ``αΔ + μδ`` minimising the quadratic model (module doc, 1.),
  its coefficients ``[α, μ]``, the model's change without ``λ`` and the
  loss of ``batch`` (the model's share, ``_Optimizer.model_batch``; from
  the same linearised pass). One linearisation serves both directions:
  ``J V`` is its linear map ``vmap``-ed over the stacked ``[Δ, δ]``."""
  a = cfg.adaptation
  dirs = jax.tree.map(lambda d, v: jnp.stack([d, v.astype(d.dtype)]),
                      delta, vel)
  forms, loss = cfg.device_mean(_curvature_forms(
      tagged, params, batch, dirs, a.curvature))
  forms = forms.astype(dtype)
  gram = jnp.array([[_tree_dot(delta, delta), _tree_dot(delta, vel)],
                    [_tree_dot(vel, delta), _tree_dot(vel, vel)]], dtype)
  b = jnp.array([_tree_dot(grads, delta), _tree_dot(grads, vel)], dtype)
  q_undamped = forms + a.l2_reg * gram
  coeffs = quadratic_model_step(q_undamped + lam * gram, b,
                                use_momentum=(~first) & a.use_momentum,
                                max_momentum=a.max_momentum)
  alpha, mu = coeffs[0], coeffs[1]
  step = jax.tree.map(
      lambda d, v: (alpha * d + mu * v.astype(d.dtype)).astype(d.dtype),
      delta, vel)
  model_change = 0.5 * coeffs @ q_undamped @ coeffs + coeffs @ b
  return step, coeffs, model_change, loss


def _adapt(cfg: _Optimizer, params, batch, loss, model_change, first,
           operand):
  """Levenberg–Marquardt (module doc, 2.): ``(λ, step)`` -> the new ``λ``,
  ``ρ`` and the step (zero if the new loss is not finite, or if it rose
  and this is not the ``first`` update)."""
  a = cfg.adaptation
  lam, step = operand
  dtype = lam.dtype
  new_loss = cfg.device_mean(cfg.value(optax.apply_updates(params, step),
                                       batch))
  # ρ = actual / predicted reduction. A step the model predicts no
  # reduction for (a skipped one) leaves λ alone; a non-finite or
  # negative ρ raises it (M&G §6.5) and rejects the step (a trust
  # region's acceptance test: the loss rose on the batch that chose it).
  rho = reduction_ratio(new_loss, loss, model_change).astype(dtype)
  omega = a.damping_decay ** a.interval
  new_lam = levenberg_marquardt(lam, rho, omega, a.min_damping, a.max_damping)
  moved = (model_change < 0) | ~jnp.isfinite(new_loss)
  keep = jnp.isfinite(new_loss) & ((new_loss <= loss) | (model_change >= 0)
                                   | first)
  step = jax.tree.map(lambda s: jnp.where(keep, s, jnp.zeros_like(s)), step)
  return jnp.where(moved, new_lam, lam), rho, step
