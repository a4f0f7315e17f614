"""``kfl.kfac``: the K-FAC preconditioner as an optax transformation.

    tx = optax.chain(kfl.kfac(loss_fn, example_batch), optax.sgd(lr, momentum=0.9))
    updates, state = tx.update(grads, state, params, batch=batch)

Each ``update``:

1. every ``cov_every`` steps, takes ``stats=`` from
   ``kfl.value_grad_and_stats`` (the forward pass shared with the
   gradient: the README's way), or estimates the statistics of every block
   on ``batch=`` (its first ``stats_fraction`` share); averages them over ``axis_name`` (``pmap``/``shard_map``);
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

Defaults (``damping=1e-3``, ``norm_constraint=1.0``, ``inverse_every=10``
with the young refreshes) are the README's recommended settings: chained
with ``optax.sgd(lr, momentum=0.9)`` at lr 0.01 they train ordinary small
models (``benchmarks/robustness.py``). The KL clip bounds the update before
the learning rate scales it: at a larger lr pass
``norm_constraint=(0.01 / lr)**2`` to keep lr 0.01's bound (issue 24: with
the defaults two Haiku conv nets did not train at lr 0.1).

Safe fallbacks (``kfl.health(state)`` prints every counter): non-finite
gradients give a zero update (the step is skipped) and count in
``num_bad_grads``; so does a damping that is not positive and finite
(``num_bad_damping``; a constant one is a ``ValueError`` at construction);
non-finite statistics leave the factors as they were (each factor's
``num_skipped``); a preconditioned update that is not finite although the
gradient is (a broken cache) falls back to the raw gradient and counts in
``num_bad_updates``; ``num_nonfinite_params`` counts the updates called
with non-finite parameters (the run has diverged). Factors are kept in
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
import inspect
from typing import Any, Callable, NamedTuple

import chex

import jax
import jax.numpy as jnp
import optax

from kfac_jax_lite import _block_policy
from kfac_jax_lite import _detection
from kfac_jax_lite import _first_step
from kfac_jax_lite import _health_state
from kfac_jax_lite import _layouts
from kfac_jax_lite import _sharded_step
from kfac_jax_lite import estimators
from kfac_jax_lite import factor as fac
from kfac_jax_lite import sharding
from kfac_jax_lite import tagging
from kfac_jax_lite._dtypes import float_dtype
from kfac_jax_lite._safeguards import clip, guard, inner_product  # noqa: F401
# The stages of ``update`` (module docstring), public here as before.
from kfac_jax_lite._stages import (  # noqa: F401
    accumulate, has_statistics, is_ready, is_refresh_step,
    precondition, refresh, statistics)


class KfacState(NamedTuple):
  """The state of ``kfl.kfac``: step count, block states and safeguard
  counters (a pytree of arrays; checkpoint it like any other).

  Attributes:
    count: int32, the number of ``update`` calls so far.
    key: the PRNG key the sampled estimators draw from under ``batch=``
      (split at every update; from ``seed``).
    blocks: ``{layer name: block state}`` (``kfl.blocks``; a leading stack
      axis for a layer stacked along ``lax.scan``): the factors' EMAs and
      their cached decompositions; in the sharded layout a
      ``kfl.sharding.ShardedBlocks`` holding them on their owners
      (``kfl.sharding.unshard`` gives the dict).
    num_bad_grads: int32, updates skipped (a zero update) for non-finite
      gradients.
    num_bad_updates: int32, preconditioned updates that were not finite and
      were replaced by the gradient.
    num_bad_damping: int32, updates skipped for a damping that is not
      positive and finite.
    num_nonfinite_params: int32, updates called with non-finite parameters.
    health: the running summaries ``kfl.health`` reads to tell a run that
      diverges or stalls from one that trains (``_health_state``).
    stats_due: int32, 1 when the next update accumulates statistics
      (``count % cov_every == 0``), else 0 (an int, not a bool, so that
      arithmetic over the state's leaves works); ``kfl.stats_due`` reads it.
  """

  count: Any
  key: Any
  blocks: Any  # dict, or sharding.ShardedBlocks in the sharded layout
  num_bad_grads: Any
  num_bad_updates: Any
  num_bad_damping: Any
  num_nonfinite_params: Any
  health: Any  # _health_state.HealthState
  stats_due: Any


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


def _check_damping(damping, where="kfac"):
  """A constant damping must be a positive finite number; a schedule is
  checked at step 0 when it can be evaluated there."""
  value: Any = damping  # A number, an array or a tracer: float() decides.
  if callable(damping):
    try:
      value = damping(0)
    except Exception:  # A schedule that cannot run eagerly: checked at run time.
      return
  try:
    value = float(value)
  except (TypeError, jax.errors.ConcretizationTypeError):
    return  # Traced: checked at run time (the update is skipped and counted).
  if not (value > 0 and value < float("inf")):
    raise ValueError(f"{where}: damping must be positive and finite, got "
                     f"{value!r}{' (the schedule at step 0)' if callable(damping) else ''}")


DEFAULT_DAMPING = 1e-3
DEFAULT_NORM_CONSTRAINT = 1.0


def kfac(loss_fn: Callable, example_batch: chex.ArrayTree, *,
         damping: float | optax.Schedule = DEFAULT_DAMPING,
         estimation: str = "fisher", num_samples: int = 1,
         cov_decay: float = 0.95, cov_every: int = 1, inverse_every: int = 10,
         damping_mode: str = "pi", stats_fraction: float = 1.0,
         precon_power: float = -1.0,
         norm_constraint: float | None = DEFAULT_NORM_CONSTRAINT,
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
    damping: ``λ`` of ``(F + λI)^p``, a positive float or an optax schedule
      of the step count; ``update(..., damping=λ)`` overrides it for that
      call. In π mode (and for diagonal blocks) ``λ`` is baked into the
      cached inverses at each refresh, so a new per-call or scheduled ``λ``
      reaches the preconditioner at the next refresh; ``damping_mode=
      "exact"`` uses the ``λ`` of every call.
    estimation: where the statistics' output cotangents come from:
      ``"fisher"`` (targets sampled from the model: the true Fisher),
      ``"empirical"`` (``"fisher"`` at the data targets; any loss works),
      ``"empirical_shared"`` (``"empirical"`` from the gradient's own
      backward pass: no second backward pass; equal to ``"empirical"`` for
      a mean, sum or masked loss),
      ``"curvature_prop"`` (Rademacher projections of the output Fisher's
      square root), ``"exact"`` (all its columns), and
      ``"curvature_prop_ggn"``/``"exact_ggn"`` (the output Hessian's: the
      GGN); see ``kfl.estimators``.
    num_samples: sampled targets (or projections) per example for the
      sampled modes; the statistics average them.
    cov_decay: ``β`` of the zero-debiased EMA ``C ← β C + (1-β) X`` of the
      factors.
    cov_every: statistics are computed and accumulated every ``cov_every``
      steps (from step 0). With ``stats=`` they are used only on those
      steps: compute them only then with ``est_fn(..., with_stats=
      kfl.stats_due(state))`` (``KfacState.stats_due``; ``kfl.onepass``).
    inverse_every: the caches are refreshed every ``inverse_every`` steps,
      and at steps 1, 2, 4, 8, ... below it (``is_refresh_step``).
    damping_mode: ``"pi"`` (factored Tikhonov: ``A + π√λ I`` and
      ``G + √λ/π I``, ``π = √((tr A/dim A)/(tr G/dim G))``; the cache holds
      the damped inverses) or ``"exact"`` (``(A⊗G + λI)^p`` through the
      eigendecompositions of ``A`` and ``G``; the cache holds them).
    stats_fraction: the share ``f`` in ``(0, 1]`` of each ``batch=`` the
      statistics are computed on (its first ``round(N·f)`` examples, at
      least 2; Martens & Grosse use 1/8). ``stats=`` are used as given: ask
      ``kfl.value_grad_and_stats(..., stats_fraction=f)`` for them.
    precon_power: ``p``: -1 the natural gradient, -0.5 a square-root
      preconditioner; other powers than -1 use eigendecompositions.
    norm_constraint: KL clipping: the update ``u`` is scaled by
      ``min(1, √(norm_constraint / ⟨u, g⟩))``; None turns it off.
    blocks: overrides of the curvature block per parameter path or layer
      kind (``"kronecker"``, ``"diagonal"``, ``"full"``,
      ``"naive_diagonal"``, ``"ekfac"`` for eigenvalue-corrected K-FAC on
      dense and conv layers, or a block instance; see
      ``kfl.tagging.find_layers``).
    exclude: parameter paths (or patterns) left out of the curvature; their
      gradient passes through unchanged.
    weight_sharing: for a layer applied over extra axes (sequence
      positions of a dense layer, output locations of a convolution):
      ``"expand"`` (the positions are examples; KFC for convolutions) or
      ``"reduce"`` (inputs averaged and cotangents summed over them first),
      as in Eschenhagen et al. 2023. ``kfl.describe`` shows each block's.
    axis_name: the ``pmap``/``shard_map`` axis (or ``mesh`` axis) to
      average the statistics over and split the refreshes across; None
      outside such a map.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    example_axis: the batch leaves' example axis: None the leading one
      (``kfl.describe`` says when that is a guess), an int, or a pytree of
      the batch's structure with an int or None per leaf; 1 for time-major
      ``[T, B]`` data (``kfl.tagging.find_layers``); needs
      ``stats_fraction=1`` unless 0.
    seed: the seed of the PRNG key (in the state) of the sampled estimators
      under ``batch=``.
    inverse_method: how a refresh computes the π-damped inverses
      ``(C + d·I)⁻¹`` (``precon_power=-1``): ``"auto"`` (``"gauss_jordan"``
      on CPU, ``"cholesky"`` elsewhere: ``kfl.factor.AUTO_METHODS``) or a
      name of ``kfl.factor.INVERSES``, where the methods
      (``"gauss_jordan"``, ``"schur"``, ``"cholesky"``,
      ``"newton_schulz"``, ``"eigh"``) are described. Other powers and
      ``damping_mode="exact"`` use eigendecompositions.
    layout: where the curvature lives across the devices of ``axis_name``:
      ``"replicated"`` (every device keeps every block; statistics
      all-reduced, refreshes split and their caches all-reduced) or
      ``"sharded"`` (``kfl.sharding``: each block kept by one owner device,
      statistics reduce-scattered to it, the owners' preconditioned
      gradients all-gathered; state bytes per device about ``1/D``). None:
      ``"sharded"`` with a ``mesh``, else ``"replicated"``. ``"sharded"``
      needs ``axis_name``; its ``init`` runs inside the ``pmap``/
      ``shard_map`` (or anywhere with a ``mesh``).
    mesh: a ``jax.sharding.Mesh`` with the axis ``axis_name``, for use
      under plain ``jax.jit``: ``update`` (called outside any map) runs its
      work in a ``shard_map`` over that axis (batch leaves split along
      their example axis; gradients, params and ``stats=`` taken as the
      same on every device) and ``init`` places the sharded curvature on
      the mesh. Inside your own ``shard_map`` the mesh is not used.
    gather: in the sharded layout, what crosses the devices after the
      owners' work: ``"updates"`` (each owner preconditions its blocks'
      gradient and the pieces are all-gathered every step: bytes of the
      parameters) or ``"inverses"`` (after a refresh the owners' caches are
      all-gathered and kept on every device, which preconditions every
      block itself: no per-step traffic beyond the statistics, at the
      memory of all caches on every device; KAISA's gradient-worker
      fraction at its two ends).

  Returns:
    An ``optax.GradientTransformationExtraArgs``: ``init(params)`` and
    ``update(grads, state, params, *, batch=None, stats=None,
    damping=None, loss=None)``, which needs ``params`` and either
    ``batch=`` (the statistics take their own pass on its first
    ``stats_fraction``) or ``stats=`` (an ``Estimate.stats``); ``damping``
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
  options = dict(locals())  # First statement: exactly the arguments.
  del options["loss_fn"], options["example_batch"]
  return _kfac(loss_fn, example_batch, **options).transform


class KfacWithLayers(NamedTuple):
  """``kfac_with_layers``' result: the transform and its detection."""

  transform: optax.GradientTransformationExtraArgs
  # layers(params, batch=None) -> tagging.TaggedLoss, with the blocks.
  layers: Callable


def kfac_with_layers(loss_fn: Callable, example_batch,
                     **options) -> KfacWithLayers:
  """``kfac(loss_fn, example_batch, **options)`` and the detection it uses.

  For code built on ``kfac`` that needs its layers (``kfl.kfac_optimizer``'s
  quadratic model reads the registered losses; ``kfl.eigen_adam`` its
  blocks): the transform and ``layers`` share one trace of ``loss_fn`` per
  params and batch signature. (A returned transform wrapped in
  ``optax.chain`` or elsewhere keeps working; ``layers`` is a plain
  function, not an attribute of it.)

  Args:
    loss_fn: as for ``kfac``.
    example_batch: as for ``kfac``.
    **options: ``kfac``'s keyword arguments (its defaults otherwise).

  Returns:
    ``KfacWithLayers(transform, layers)``: ``transform`` is
    ``kfac(loss_fn, example_batch, **options)``; ``layers(params,
    batch=None)`` the ``tagging.TaggedLoss`` (with its blocks) it uses for
    ``params`` and ``batch`` (None: the example batch).
  """
  defaults = {name: p.default
              for name, p in inspect.signature(kfac).parameters.items()
              if p.kind is inspect.Parameter.KEYWORD_ONLY}
  unknown = sorted(set(options) - set(defaults))
  if unknown:
    raise TypeError(f"kfac() got unexpected keyword arguments {unknown}")
  return _kfac(loss_fn, example_batch, **{**defaults, **options})


def _kfac(loss_fn, example_batch, *, damping, estimation, num_samples,
          cov_decay, cov_every, inverse_every, damping_mode, stats_fraction,
          precon_power, norm_constraint, blocks, exclude, weight_sharing,
          axis_name, has_aux, seed, inverse_method, example_axis, layout,
          mesh, gather) -> KfacWithLayers:
  """``kfac_with_layers`` with every option given (``kfac``'s body)."""
  estimators.check_estimation(estimation, num_samples)
  fac.check_inverse_method(inverse_method)
  estimators.check_stats_fraction(stats_fraction)
  for name, value in (("cov_every", cov_every), ("inverse_every", inverse_every)):
    if not (isinstance(value, int) and value >= 1):
      raise ValueError(f"{name} must be a positive int, got {value!r}")
  if norm_constraint is not None and not norm_constraint > 0:
    raise ValueError(f"norm_constraint must be positive (or None), got "
                     f"{norm_constraint!r}")
  _check_damping(damping)
  estimators.stats_batch_size(example_batch, stats_fraction,
                              "kfac(example_batch)")
  estimators.check_example_axis(example_axis, example_batch, stats_fraction,
                                "kfac")
  layout = _layouts.check(layout, axis_name, mesh, gather)
  configured_damping = damping
  damping_schedule = (damping if callable(damping)
                      else (lambda _: configured_damping))
  detection_cache: dict = {}
  with_blocks: dict = {}

  def tagged_for(params, batch=None) -> tagging.TaggedLoss:
    """The layers of ``params``' structure for ``batch`` (None: the
    example batch), with their blocks; the same blocks as for the example
    batch, or an error."""
    tagged = _detection.find_layers_cached(
        detection_cache, loss_fn, params,
        example_batch if batch is None else batch,
        has_aux=has_aux, exclude=exclude, example_axis=example_axis)
    if tagged not in with_blocks:
      with_blocks[tagged] = _block_policy.with_blocks(
          tagged, blocks, damping_mode=damping_mode,
          weight_sharing=weight_sharing)
    if batch is not None:
      _detection.check_same_layers(tagged_for(params), with_blocks[tagged])
    return with_blocks[tagged]

  def init_fn(params):
    # The first point with params to trace: refuse here, not at a step.
    estimators.check_has_loss(tagged_for(params), estimation, "kfl.kfac")
    refused = _first_step.refusal(
        tagged_for(params), params, estimators.stats_slice(
            example_batch, stats_fraction,
            examples=tagged_for(params).examples), estimation, num_samples)
    if refused:
      raise ValueError("kfl.kfac: the first step would fail on the example "
                       f"batch (see kfl.describe): {refused}")
    leaves = jax.tree.leaves(params)
    zero = lambda: jnp.zeros((), jnp.int32)  # Own buffers: donatable.
    blocks = {l.name: l.block.init(float_dtype([leaves[i] for i in l.leaves]))
              for l in tagged_for(params).layers}
    if layout == "sharded":
      blocks = _layouts.sharded_init(tagged_for(params).layers, blocks,
                                     axis_name=axis_name, mesh=mesh,
                                     gather=gather)
    return KfacState(
        count=zero(), key=jax.random.PRNGKey(seed), blocks=blocks,
        num_bad_grads=zero(), num_bad_updates=zero(), num_bad_damping=zero(),
        num_nonfinite_params=zero(),
        health=_health_state.init(params, float_dtype(leaves)),
        stats_due=jnp.ones((), jnp.int32))

  def update_fn(updates, state, params=None, *, batch=None, stats=None,
                damping=None, loss=None, **extra_args):
    del extra_args
    if params is None:
      raise ValueError("kfac needs params: call tx.update(grads, state, params, "
                       "batch=batch)")
    if stats is None and batch is None:
      raise ValueError("kfac.update needs batch= (or precomputed stats=)")
    if mesh is not None and not _sharded_step.axis_is_bound(axis_name):
      examples = None if batch is None else tagged_for(params, batch).examples
      return _layouts.on_mesh(run, examples, updates, state, params, batch,
                              stats, damping, loss, mesh=mesh,
                              axis_name=axis_name)
    return run(updates, state, params, batch=batch, stats=stats,
               damping=damping, loss=loss)

  def run(updates, state, params, *, batch, stats, damping, loss,
          replicated_stats=False):
    """``update`` on one device (or each device of a map)."""
    tagged = tagged_for(params)
    if batch is not None:
      if jax.tree.structure(batch) != tagged.batch_treedef:
        raise ValueError(f"batch structure {jax.tree.structure(batch)} differs "
                         f"from the example batch's {tagged.batch_treedef}")
      tagged = tagged_for(params, batch)
      if stats is None:
        estimators.stats_batch_size(batch, stats_fraction, "kfac.update",
                                    tagged.examples)
    _check_axis_name(axis_name, params, stats if stats is not None else batch)
    layers = tagged.layers
    key, stats_key = jax.random.split(state.key)
    if axis_name is not None:  # Independent samples on every device.
      stats_key = jax.random.fold_in(stats_key, jax.lax.axis_index(axis_name))
    dtype = float_dtype(params)
    lam = jnp.asarray(damping_schedule(state.count) if damping is None
                      else damping, dtype)
    damping_ok = (lam > 0) & jnp.isfinite(lam)

    mean = (lambda x: x) if replicated_stats or not axis_name else (
        lambda x: jax.lax.pmean(x, axis_name))
    due = state.count % cov_every == 0
    leaves, treedef = jax.tree.flatten(updates)  # The gradients.
    if isinstance(state.blocks, sharding.ShardedBlocks):
      _sharded_step.check_layout(state.blocks, layers)
      local = lambda: ((stats, 0.0) if stats is not None else statistics(
          tagged, params, batch, stats_key, None, estimation=estimation,
          num_samples=num_samples, stats_fraction=stats_fraction))
      out, states, seen = _sharded_step.step(
          layers, state.blocks, leaves, local,
          stats_due=None if cov_every == 1 else due,
          stats_replicated=replicated_stats and stats is not None, lam=lam,
          damping_ok=damping_ok,
          refresh_due=is_refresh_step(state.count, inverse_every),
          count=state.count, cov_decay=cov_decay, precon_power=precon_power,
          inverse_method=inverse_method)
      seen = jnp.asarray(seen, dtype)
    else:
      def statistics_and_accumulate(states):
        if stats is not None:
          new = mean(stats), 0.0
        else:
          new = statistics(tagged, params, batch, stats_key, states,
                           estimation=estimation, num_samples=num_samples,
                           stats_fraction=stats_fraction, axis_name=axis_name)
        return accumulate(layers, states, new[0], cov_decay), jnp.asarray(
            new[1], dtype)

      states, seen = (statistics_and_accumulate(state.blocks) if cov_every == 1
                      else jax.lax.cond(due, statistics_and_accumulate,
                                        lambda st: (st, jnp.zeros((), dtype)),
                                        state.blocks))
      states = refresh(layers, states, lam, damping_ok,
                       is_refresh_step(state.count, inverse_every),
                       state.count, precon_power=precon_power,
                       inverse_method=inverse_method, axis_name=axis_name)
      out = precondition(layers, states, leaves, lam, precon_power)
    seen = ((seen, due & (stats is None)) if loss is None else
            (mean(loss), True))
    scale = clip(out, leaves, norm_constraint, dtype)
    out, grads_ok, update_ok = guard(out, leaves, damping_ok, scale)
    new_state = state._replace(
        count=state.count + 1, key=key, blocks=states,
        stats_due=((state.count + 1) % cov_every == 0).astype(jnp.int32),
        **_health_state.counted(state, params, grads_ok, update_ok,
                                damping_ok, scale < 1, seen, dtype))
    return jax.tree.unflatten(treedef, out), new_state

  return KfacWithLayers(
      optax.GradientTransformationExtraArgs(init_fn, update_fn), tagged_for)
