"""``kfl.kfac``: the K-FAC preconditioner as an optax transformation.

    tx = optax.chain(kfl.kfac(loss_fn, example_batch), optax.sgd(lr, momentum=0.9))
    updates, state = tx.update(grads, state, params, batch=batch)

Each ``update``:

0. plans ``cov_every`` and ``inverse_every`` when they are not given: the
   most frequent statistics and refreshes whose mean step the cost model
   prices within ``budget`` SGD steps (``kfl.estimators``' ``_plan``;
   ``kfl.describe`` prints the plan);
1. every ``cov_every`` steps (from step 0; while the statistics are young
   also at steps 1, 2, 4, 8, ... below ``cov_every``, so that the young
   refreshes below decompose new statistics; and while a block is not
   ready), takes
   ``stats=`` from
   ``kfl.value_grad_and_stats`` (the forward pass shared with the
   gradient: the README's way), or estimates the statistics of every block
   on ``batch=`` (its first ``stats_fraction`` share); averages them over
   ``axis_name`` (``pmap``/``shard_map``; with ``mesh=``, statistics of
   ``value_grad_and_stats(..., axis_name=, mesh=)`` come per device and
   the sharded layout reduce-scatters them to their owners);
   folds them into the factors' EMA (decay ``cov_decay``);
2. every ``inverse_every`` steps (from step 0) and, while the statistics
   are young, at steps 1, 2, 4, 8, ... below ``inverse_every``
   (``is_refresh_step``), refreshes each block's cached decomposition at
   the current damping; under ``axis_name`` each device refreshes only its
   share of the blocks (block ``i`` on device ``i mod n``) and the caches
   are then shared with a ``psum``. A block that is not ready (no
   decomposition of real statistics yet) is refreshed as soon as its
   factors have statistics, whatever the step;
3. returns ``u = (F + λI)^p g`` per block (``p = precon_power``, ``λ`` the
   damping, a float or an optax schedule of the step), scaled by
   ``s = min(1, √(norm_constraint / ⟨u, g⟩))`` (default 1.0; ``None``
   turns it off), so that ``(s·u)ᵀ F (s·u) = s²⟨u, g⟩`` (the KL of the
   step, up to the learning rate squared) stays below it (KL clipping,
   Ba et al. 2017). Parameters the tagging excluded, and blocks that are
   not ready, pass their gradient through unchanged.

Defaults (``damping=1e-3``, ``norm_constraint=1.0``, the planned
intervals with the young refreshes) are the README's recommended settings: chained
with ``optax.sgd(lr, momentum=0.9)`` at lr 0.01 they train ordinary small
models (``benchmarks/robustness.py``). The KL clip bounds the update before
the learning rate scales it, so the lr scales every step, clipped or not:
tune it as SGD's (0.003-0.03; issue 36). ``norm_constraint=(0.01 /
lr)**2`` would keep lr 0.01's clipped step at every lr and so turn the lr
off on clipped steps.

Safe fallbacks (``kfl.health(state)`` prints every counter): non-finite
gradients give a zero update (the step is skipped) and count in
``num_bad_grads``; so does a damping that is not positive and finite
(``num_bad_damping``; a constant one is a ``ValueError`` at construction);
non-finite statistics leave the factors as they were (each factor's
``num_skipped``); a preconditioned update that is not finite although the
gradient is (a broken cache) falls back to the raw gradient and counts in
``num_bad_updates``; ``num_nonfinite_params`` counts the updates called
with non-finite parameters (the run has diverged). A loss seen (``loss=``,
or the ``Estimate.stats`` run entry, ``estimators.RUN_ENTRY``) that is not
finite although the gradient is, and a registered or recognised
classification loss's integer label outside ``[0, classes)``, skip the
update and leave its statistics out (``health.num_bad_losses``,
``health.num_bad_inputs``). A state that does not belong to these params
or this configuration (another ``blocks=``, ``damping_mode=``, layout, a
checkpoint of another run) is refused at the first update
(``_restore_check``). Factors are kept in
the parameters' dtype, at least float32 (``float_dtype``).

Damping reaches the preconditioner one of two ways: π mode (and diagonal
blocks) bakes the refresh's ``λ`` into the cached inverses, so a new
per-call or scheduled ``λ`` takes effect at the next refresh; ``"exact"``
mode uses each call's ``λ``.

Everything lives in ``KfacState``; ``init`` and ``update`` are pure and
trace to one program. ``update`` runs the stages below in turn
(``statistics``, ``accumulate``, ``refresh``, ``precondition``, then
``_safeguards``' ``clip`` and ``guard``); one ``lax.cond`` gates all
refreshes and returns only the caches, so a step without a refresh moves
no covariance through a conditional (``cov_every > 1`` adds one around the
statistics). The finiteness checks are one reduction per large leaf and
per group of small ones (``factor.all_finite``); ``guard`` applies the
clipping scale in the same pass as its selects.
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
import functools
import warnings
from typing import Any, Callable, NamedTuple

import chex

import jax
import jax.numpy as jnp
import optax

from kfac_jax_lite import estimators
from kfac_jax_lite import tagging
from kfac_jax_lite.factor import all_finite, float_dtype
from kfac_jax_lite.optimizers import _detection
from kfac_jax_lite.optimizers import _find
from kfac_jax_lite.optimizers import _pending
from kfac_jax_lite.optimizers import _planning
from kfac_jax_lite.optimizers import _health_state
from kfac_jax_lite.optimizers import _layouts
from kfac_jax_lite.optimizers import _memory
from kfac_jax_lite.optimizers import _restore_check
from kfac_jax_lite.optimizers import _sharded_step
from kfac_jax_lite.optimizers import options as O
from kfac_jax_lite.optimizers import sharding
from kfac_jax_lite.optimizers._safeguards import (  # noqa: F401
    clip, guard, inner_product)
from kfac_jax_lite.optimizers._state import KfacState as KfacState
# The stages of ``update`` (module docstring), public here as before.
from kfac_jax_lite.optimizers._stages import (  # noqa: F401
    accumulate, has_statistics, is_ready, is_refresh_step,
    precondition, refresh, statistics)


def _check_axis_name(axis_name, params, data):
  """Inside ``shard_map(check_vma=True)``: statistics that vary over mesh
  axes the parameters do not (a sharded batch, replicated parameters) must
  be averaged over them, which needs ``axis_name``."""
  if axis_name is not None:
    return
  missing = tagging.varying_axes(data) - tagging.varying_axes(params)
  if missing:
    axes = tuple(sorted(missing, key=str))
    raise ValueError(
        f"kfac: the batch/statistics vary over the mesh axes {axes} (inside "
        "shard_map) and the parameters do not, but kfac has no axis_name: "
        "each device would keep its own curvature and the replicas would "
        f"drift apart. Pass kfl.kfac(..., axis_name={axes[0]!r}) (the data "
        "axis), as under pmap")


def kfac(loss_fn: Callable, example_batch: chex.ArrayTree, *,
         damping: float | optax.Schedule = O.DEFAULT_DAMPING,
         estimation: str = "fisher", num_samples: int = 1,
         cov_decay: float = 0.95, cov_every: int | None = None,
         inverse_every: int | None = None,
         budget: float = estimators.DEFAULT_BUDGET,
         damping_mode: str = "pi", stats_fraction: float = 1.0,
         precon_power: float = -1.0,
         norm_constraint: float | None = O.DEFAULT_NORM_CONSTRAINT,
         blocks: Mapping[str, Any] | None = None, exclude: Sequence[str] = (),
         weight_sharing: str = "expand", axis_name: Hashable | None = None,
         has_aux: bool = False, seed: int = 0, inverse_method: str = "auto",
         example_axis: chex.ArrayTree | None = None,
         layout: str | None = None, mesh: Any = None,
         gather: str = "updates"
         ) -> optax.GradientTransformationExtraArgs:
  """The K-FAC preconditioner as an optax transformation (module docstring).

      est_fn = kfl.value_grad_and_stats(loss_fn, params, batch)  # one pass
      tx = optax.chain(kfl.kfac(loss_fn, batch), optax.sgd(lr, momentum=0.9))
      est = est_fn(params, batch, key)
      updates, state = tx.update(est.grads, state, params, stats=est.stats,
                                 loss=est.loss)  # loss: for kfl.health
      # or: tx.update(grads, state, params, batch=batch)  (its own pass)

  Every argument but ``loss_fn`` and ``example_batch`` is documented
  once, in the options record it fills: ``kfl.PreconditionerOptions`` and
  ``kfl.CurvatureOptions`` (shared with ``kfl.kfac_optimizer`` and
  ``kfl.eigen_adam``).

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss`` (``(loss, aux)`` with
      ``has_aux``), a scalar; every estimation but ``"empirical"`` needs a
      loss whose predictive distribution is known: a registered loss
      (``kfl.softmax_cross_entropy``, ...) or a standard one recognised in
      the jaxpr (optax's, or written out: ``kfl.describe`` shows which);
      else ``init`` refuses.
    example_batch: a batch (arrays or ``jax.ShapeDtypeStruct``s), only
      traced (at ``init``) to find the layers; later batches may have any
      batch size but the same structure.
    damping: ``kfl.PreconditionerOptions.damping``.
    inverse_every: ``kfl.PreconditionerOptions.inverse_every``.
    budget: ``kfl.PreconditionerOptions.budget``.
    damping_mode: ``kfl.PreconditionerOptions.damping_mode``.
    precon_power: ``kfl.PreconditionerOptions.precon_power``.
    norm_constraint: ``kfl.PreconditionerOptions.norm_constraint``.
    inverse_method: ``kfl.PreconditionerOptions.inverse_method``.
    layout: ``kfl.PreconditionerOptions.layout``.
    mesh: ``kfl.PreconditionerOptions.mesh``.
    gather: ``kfl.PreconditionerOptions.gather``.
    estimation: ``kfl.CurvatureOptions.estimation``.
    num_samples: ``kfl.CurvatureOptions.num_samples``.
    cov_decay: ``kfl.CurvatureOptions.cov_decay``.
    cov_every: ``kfl.CurvatureOptions.cov_every``.
    stats_fraction: ``kfl.CurvatureOptions.stats_fraction``.
    blocks: ``kfl.CurvatureOptions.blocks``.
    exclude: ``kfl.CurvatureOptions.exclude``.
    weight_sharing: ``kfl.CurvatureOptions.weight_sharing``.
    axis_name: ``kfl.CurvatureOptions.axis_name``.
    has_aux: ``kfl.CurvatureOptions.has_aux``.
    example_axis: ``kfl.CurvatureOptions.example_axis``.
    seed: ``kfl.CurvatureOptions.seed``.

  Returns:
    An ``optax.GradientTransformationExtraArgs``: ``init(params)`` and
    ``update(grads, state, params, *, batch=None, stats=None,
    damping=None, loss=None)``, which needs ``params`` and either
    ``batch=`` (the statistics take their own pass on its first
    ``stats_fraction``) or ``stats=`` (an ``Estimate.stats``), or, for a
    loop that passes no extra arguments (flax's ``TrainState``), the ones
    ``kfl.with_batch``/``kfl.with_stats`` stored in the state; ``damping``
    overrides the configured one for that call (see ``damping``);
    ``loss`` (``Estimate.loss``; else ``batch=``'s statistics pass's) is
    kept for ``kfl.health`` (``_health_state``). The layers and blocks it
    uses: ``kfl.describe(loss_fn, params, batch, ...)`` with the same
    options prints them, ``kfac_with_layers`` returns them with the
    transform.

  References:
    Martens, J. and Grosse, R. (2015). Optimizing neural networks with
      Kronecker-factored approximate curvature. ICML. arXiv:1503.05671.
    Grosse, R. and Martens, J. (2016). A Kronecker-factored approximate
      Fisher matrix for convolution layers. ICML. arXiv:1602.01407.
    Ba, J., Grosse, R. and Martens, J. (2017). Distributed second-order
      optimization using Kronecker-factored approximations. ICLR.
    Eschenhagen, R., Immer, A., Turner, R. E., Schneider, F. and Hennig, P.
      (2023). Kronecker-factored approximate curvature for modern neural
      network architectures. NeurIPS. arXiv:2311.00636.
  """
  curvature = O.CurvatureOptions(
      estimation=estimation, num_samples=num_samples, cov_decay=cov_decay,
      cov_every=cov_every, stats_fraction=stats_fraction, blocks=blocks,
      exclude=exclude, weight_sharing=weight_sharing,
      example_axis=example_axis, has_aux=has_aux, axis_name=axis_name,
      seed=seed)
  preconditioner = O.PreconditionerOptions(
      damping=damping, inverse_every=inverse_every, budget=budget,
      damping_mode=damping_mode, precon_power=precon_power,
      norm_constraint=norm_constraint, inverse_method=inverse_method,
      layout=layout, mesh=mesh, gather=gather)
  return build(loss_fn, example_batch, curvature, preconditioner).transform


class KfacWithLayers(NamedTuple):
  """``kfac_with_layers``' result: the transform and its detection."""

  transform: optax.GradientTransformationExtraArgs
  # layers(params, batch=None) -> tagging.TaggedLoss, with the blocks.
  layers: Callable


def kfac_with_layers(loss_fn: Callable, example_batch,
                     **options: Any) -> KfacWithLayers:
  """``kfac(loss_fn, example_batch, **options)`` and the detection it uses.

  For code built on ``kfac`` that needs its layers (tests, benchmarks; the
  library's own optimizers call ``build`` with their records): the
  transform and ``layers`` share one trace of ``loss_fn`` per params and
  batch signature.

  Args:
    loss_fn: as for ``kfac``.
    example_batch: as for ``kfac``.
    **options: ``kfac``'s keyword arguments (the fields of
      ``CurvatureOptions`` and ``PreconditionerOptions``; their defaults
      otherwise); another name is a ``TypeError``.

  Returns:
    ``build``'s ``KfacWithLayers``.
  """
  curvature, preconditioner = O.split(options, "kfac")
  return build(loss_fn, example_batch, curvature, preconditioner)


class _Kfac(NamedTuple):
  """What one ``kfl.kfac`` fixes when built: the loss, its example batch,
  the two option records, the damping schedule and the detection."""

  loss_fn: Callable
  example_batch: Any
  curvature: O.CurvatureOptions
  preconditioner: O.PreconditionerOptions
  layout: str  # "replicated" or "sharded" (``_layouts.check``)
  damping_schedule: Callable
  layers: Callable  # (params, batch=None) -> tagging.TaggedLoss
  plan: Callable  # (params) -> estimators.Plan


def build(loss_fn: Callable, example_batch, curvature: O.CurvatureOptions,
          preconditioner: O.PreconditionerOptions, where: str = "kfac",
          model_fraction: float | None = None) -> KfacWithLayers:
  """The transform of ``kfac`` for the two option records, checked here
  (before any trace), and ``layers(params, batch=None)``: the
  ``tagging.TaggedLoss`` (with its blocks) it uses for ``params`` and
  ``batch`` (None: the example batch). ``kfl.kfac_optimizer`` and
  ``kfl.eigen_adam`` build on it (``where``: the name their errors give;
  ``model_fraction``: ``kfl.kfac_optimizer``'s, whose quadratic model its
  plan prices)."""
  curvature.check(example_batch, where)
  preconditioner.check()
  p = preconditioner
  layout = _layouts.check(p.layout, curvature.axis_name, p.mesh, p.gather)
  damping_schedule = (p.damping if callable(p.damping)
                      else (lambda _: p.damping))
  layers = _detection_of(loss_fn, example_batch, curvature, p.damping_mode)
  cfg = _Kfac(loss_fn, example_batch, curvature, p, layout, damping_schedule,
              layers, _planning.plan_of(layers, example_batch, curvature, p,
                                        model_fraction))
  return KfacWithLayers(
      optax.GradientTransformationExtraArgs(functools.partial(_init, cfg),
                                            functools.partial(_update, cfg)),
      layers)


def _detection_of(loss_fn, example_batch, curvature, damping_mode):
  """``layers(params, batch=None)``: the layers of ``params``' structure
  for ``batch`` (None: the example batch), with their blocks, one trace per
  params and batch signature; the same blocks as for the example batch, or
  an error."""
  c = curvature
  detection_cache: dict = {}
  with_blocks: dict = {}

  def layers(params, batch=None) -> tagging.TaggedLoss:
    tagged = _detection.find_layers_cached(
        detection_cache, loss_fn, params,
        example_batch if batch is None else batch,
        has_aux=c.has_aux, exclude=c.exclude, example_axis=c.example_axis)
    if tagged not in with_blocks:
      with_blocks[tagged] = tagged.with_blocks(
          c.blocks, damping_mode=damping_mode,
          weight_sharing=c.weight_sharing)
    if batch is not None:
      _detection.check_same_layers(layers(params), with_blocks[tagged])
    return with_blocks[tagged]
  return layers


def _init(cfg: _Kfac, params) -> KfacState:
  """``tx.init``: refuses here, the first point with params to trace, what
  the first step would refuse; then the blocks' fresh states."""
  c = cfg.curvature
  params = _find.unwrap(params)  # nnx.Optimizer inits on Variables.
  _find.check_unmasked(params, "kfl.kfac")
  _find.check_not_in_multisteps("kfl.kfac")
  tagged = cfg.layers(params)
  estimators.check_has_loss(tagged, c.estimation, "kfl.kfac")
  refused = estimators.first_step_refusal(
      tagged, params, estimators.stats_slice(
          cfg.example_batch, c.stats_fraction, examples=tagged.examples),
      c.estimation, c.num_samples)
  if refused:
    raise ValueError("kfl.kfac: the first step would fail on the example "
                     f"batch (see kfl.describe): {refused}")
  if cfg.layout != "sharded":  # Sharded: each device holds its share.
    _memory.check_fits(tagged.layers, params, "kfl.kfac",
                       extra=cfg.example_batch)  # With the batch's slot.
  leaves = jax.tree.leaves(params)
  zero = lambda: jnp.zeros((), jnp.int32)  # Own buffers: donatable.
  blocks = {l.name: l.block.init(float_dtype([leaves[i] for i in l.leaves]))
            for l in tagged.layers}
  if cfg.layout == "sharded":
    blocks = _layouts.sharded_init(
        tagged.layers, blocks, axis_name=c.axis_name,
        mesh=cfg.preconditioner.mesh, gather=cfg.preconditioner.gather)
  return KfacState(
      count=zero(), key=jax.random.PRNGKey(c.seed), blocks=blocks,
      num_bad_grads=zero(), num_bad_updates=zero(), num_bad_damping=zero(),
      num_nonfinite_params=zero(),
      health=_health_state.init(params, float_dtype(leaves)),
      stats_due=jnp.ones((), jnp.int32),
      pending=_pending.empty(cfg.example_batch, float_dtype(leaves)))


def _update(cfg: _Kfac, updates, state, params=None, *, batch=None,
            stats=None, damping=None, loss=None, **extra_args):
  """``tx.update`` (``kfac``'s Returns): ``_given`` with the keyword
  arguments, or with what ``kfl.with_batch``/``kfl.with_stats`` stored
  (``_pending.stored``)."""
  del extra_args
  if params is None:
    raise ValueError("kfac needs params: call tx.update(grads, state, params, "
                     "batch=batch)")
  grads = updates  # Their structure (flax wrappers included) comes back.
  params, updates = _find.unwrap_update(params, updates, "kfl.kfac")
  out, state = _pending.stored(
      lambda state, batch, stats, loss: _given(
          cfg, updates, state, params, batch=batch, stats=stats,
          damping=damping, loss=loss),
      state, batch, stats, loss, needs="one")
  return _find.rewrap(grads, out), state


def _given(cfg: _Kfac, updates, state, params, *, batch, stats, damping,
           loss):
  """``update`` on the unwrapped gradients and params, with the batch or
  statistics given or stored (``_pending.stored``): on the mesh when one is
  configured and no map is bound, else ``_run`` here."""
  if stats is None and batch is None:
    raise ValueError(_pending.missing("kfac.update"))
  mesh, axis_name = cfg.preconditioner.mesh, cfg.curvature.axis_name
  if mesh is not None and not estimators.axis_is_bound(axis_name):
    stats = estimators.materialise(  # Not per device: summed by XLA.
        stats, state.stats_due > 0,
        state.blocks if isinstance(state.blocks, dict) else None)
    if (stats is not None and cfg.layout == "sharded"
        and mesh.shape[axis_name] > 1 and not estimators.is_per_device(stats)):
      warnings.warn(
          "kfac_jax_lite: kfl.kfac(mesh=) got statistics summed over the "
          "devices (kfl.value_grad_and_stats without mesh=): XLA all-reduces "
          "them before the sharded layout can reduce-scatter them to their "
          "owners. Pass value_grad_and_stats(..., axis_name="
          f"{axis_name!r}, mesh=mesh) to send each device its share only.",
          UserWarning, stacklevel=5)
    examples = None if batch is None else cfg.layers(params, batch).examples
    out, state = _layouts.on_mesh(
        functools.partial(_run, cfg), examples, updates, state, params, batch,
        stats, damping, loss, mesh=mesh, axis_name=axis_name)
  else:  # Per-device statistics (value_grad_and_stats(mesh=)): their mean.
    out, state = _run(cfg, updates, state, params, batch=batch,
                      stats=estimators.device_mean(stats), damping=damping,
                      loss=loss)
  return out, state


def _tagged_for_batch(cfg: _Kfac, params, batch, stats):
  """The detection for ``batch`` (checked against the example batch's)."""
  tagged = cfg.layers(params)
  if batch is None:
    return tagged
  if jax.tree.structure(batch) != tagged.batch_treedef:
    raise ValueError(f"batch structure {jax.tree.structure(batch)} differs "
                     f"from the example batch's {tagged.batch_treedef}")
  tagged = cfg.layers(params, batch)
  if stats is None:
    estimators.stats_batch_size(batch, cfg.curvature.stats_fraction,
                                "kfac.update", tagged.examples)
  return tagged


def _run(cfg: _Kfac, updates, state, params, *, batch, stats, damping, loss,
         replicated_stats=False):
  """``update`` on one device (or each device of a map): the curvature's
  stages (``_curvature``), then the KL clip, the guard and the counters.

  The run entry of ``stats`` (``estimators.RUN_ENTRY``: the estimate's
  loss and its count of targets outside their support) stands for
  ``loss=`` when that is not given; a non-finite loss (with a finite
  gradient) or a bad target skips the update (a zero update, statistics
  left out) and is counted (``_health_state``)."""
  cfg = _planning.planned(cfg, params)
  c, p = cfg.curvature, cfg.preconditioner
  stats, run = estimators.split_run(stats)
  tagged = _tagged_for_batch(cfg, params, batch, stats)
  _restore_check.check(cfg, tagged, state, params)
  _check_axis_name(c.axis_name, params, stats if stats is not None else batch)
  key, stats_key = jax.random.split(state.key)
  if c.axis_name is not None:  # Independent samples on every device.
    stats_key = jax.random.fold_in(stats_key, jax.lax.axis_index(c.axis_name))
  dtype = float_dtype(params)
  lam = jnp.asarray(cfg.damping_schedule(state.count) if damping is None
                    else damping, dtype)
  damping_ok = (lam > 0) & jnp.isfinite(lam)
  mean = (lambda x: x) if replicated_stats or not c.axis_name else (
      lambda x: jax.lax.pmean(x, c.axis_name))
  if loss is None and run is not None:
    loss = run["loss"]
  given_ok = (jnp.ones((), bool) if loss is None
              else jnp.isfinite(mean(jnp.asarray(loss, dtype))))
  targets_ok = (jnp.ones((), bool) if run is None else
                mean(jnp.asarray(run["bad_targets"], dtype)) == 0)
  # The state's flag (``kfl.stats_due``): every ``cov_every`` updates, and
  # on every update while a block is not ready (``_planning.stats_due``).
  due = state.stats_due > 0
  leaves, treedef = jax.tree.flatten(updates)  # The gradients.
  out, states, (pass_loss, pass_ok) = _curvature(
      cfg, tagged, state, params, leaves, batch=batch, stats=stats,
      stats_key=stats_key, lam=lam, damping_ok=damping_ok, due=due,
      mean=mean, replicated_stats=replicated_stats, dtype=dtype,
      # A batch whose gradient is not finite is left out whole: a layer
      # whose statistics stay finite (a saturated tanh after an inf input)
      # does not fold them in either.
      input_ok=given_ok & targets_ok & all_finite(leaves))
  if loss is None:  # The statistics pass's loss and targets, when it ran.
    seen = (pass_loss, due & (stats is None) & pass_ok)
    given_ok = ~seen[1] | jnp.isfinite(pass_loss)
    targets_ok = targets_ok & pass_ok
  else:  # A loss of bad targets is not the run's: left out.
    seen = (mean(jnp.asarray(loss, dtype)), targets_ok)
  scale = clip(out, leaves, p.norm_constraint, dtype)
  out, grads_ok, update_ok = guard(out, leaves,
                                   damping_ok & given_ok & targets_ok, scale)
  new_state = state._replace(
      count=state.count + 1, key=key, blocks=states,
      stats_due=_planning.stats_due(tagged.layers, states,
                                    state.count + 1, c.cov_every),
      **_health_state.counted(state, params, grads_ok, update_ok,
                              damping_ok, scale < 1, seen, dtype,
                              (given_ok, targets_ok)))
  return jax.tree.unflatten(treedef, out), new_state


def _curvature(cfg: _Kfac, tagged, state, params, leaves, *, batch, stats,
               stats_key, lam, damping_ok, due, mean, replicated_stats, dtype,
               input_ok):
  """The stages on ``state.blocks``: statistics (``stats=``, or their own
  pass on ``batch``) folded in when ``due``, the refresh when it is due,
  and the preconditioned gradient ``leaves``; in either layout.
  Statistics of a bad input (``input_ok`` False, or the own pass's targets
  outside their support) are made non-finite, so every factor leaves them
  out (and counts them). Returns ``(preconditioned leaves, new block
  states, (the statistics pass's loss or 0, whether its targets were in
  their support))``."""
  c, p = cfg.curvature, cfg.preconditioner
  layers = tagged.layers
  refresh_due = is_refresh_step(state.count, p.inverse_every)
  poison = lambda st, ok: jax.tree.map(
      lambda x: jnp.where(ok, x, jnp.nan).astype(x.dtype)
      if jnp.issubdtype(x.dtype, jnp.inexact) else x, st)
  # Statistics given (stats=), or deferred by the one-pass estimate to this
  # update's conditional branch (``estimators.resolve``).
  given = lambda states: estimators.resolve(stats, states,
                                            every_step=c.cov_every == 1)
  if isinstance(state.blocks, sharding.ShardedBlocks):
    _sharded_step.check_layout(state.blocks, layers)
    local = lambda: ((poison(given(None), input_ok), 0.0) if stats is not None
                     else statistics(
        tagged, params, batch, stats_key, None, estimation=c.estimation,
        num_samples=c.num_samples, stats_fraction=c.stats_fraction))
    out, states, seen = _sharded_step.step(
        layers, state.blocks, leaves, local,
        stats_due=None if c.cov_every == 1 else due,
        stats_replicated=replicated_stats and stats is not None, lam=lam,
        damping_ok=damping_ok, refresh_due=refresh_due, count=state.count,
        cov_decay=c.cov_decay, precon_power=p.precon_power,
        inverse_method=p.inverse_method)
    return out, states, (jnp.asarray(seen, dtype), jnp.ones((), bool))

  def statistics_and_accumulate(states):
    if stats is not None:
      new, value, ok = mean(given(states)), 0.0, jnp.ones((), bool)
    else:
      new, value = statistics(tagged, params, batch, stats_key, states,
                              estimation=c.estimation,
                              num_samples=c.num_samples,
                              stats_fraction=c.stats_fraction,
                              axis_name=c.axis_name)
      new, run = estimators.split_run(new)
      ok = (jnp.ones((), bool) if run is None
            else jnp.asarray(run["bad_targets"]) == 0)
    new = poison(new, input_ok & ok)
    return (accumulate(layers, states, new, c.cov_decay),
            (jnp.asarray(value, dtype), ok))

  states, seen = (statistics_and_accumulate(state.blocks) if c.cov_every == 1
                  else jax.lax.cond(due, statistics_and_accumulate,
                                    lambda st: (st, (jnp.zeros((), dtype),
                                                     jnp.ones((), bool))),
                                    state.blocks))
  states = refresh(layers, states, lam, damping_ok, refresh_due, state.count,
                   precon_power=p.precon_power,
                   inverse_method=p.inverse_method, axis_name=c.axis_name)
  return precondition(layers, states, leaves, lam, p.precon_power), states, seen
