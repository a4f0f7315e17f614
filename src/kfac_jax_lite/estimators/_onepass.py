"""The one-pass estimate for ``kfl.kfac``: the loss, its gradient and every
block's curvature statistics from one forward pass, and when to skip them.

    est_fn = kfl.value_grad_and_stats(loss_fn, params, batch)
    tx = optax.chain(kfl.kfac(loss_fn, batch, cov_every=k), optax.sgd(lr, 0.9))

    def step(params, state, batch, key):
      est = est_fn(params, batch, key, with_stats=kfl.stats_due(state))
      updates, state = tx.update(est.grads, state, params, stats=est.stats,
                                 loss=est.loss)   # loss: for kfl.health
      ...

Amortisation. ``kfl.kfac`` accumulates statistics only at the updates
where ``count % cov_every == 0`` (``count``: the updates so far); at the
others it ignores ``stats=``. ``kfl.stats_due(state)`` reads that
condition for the next update from the optax state (``KfacState.stats_due``),
and ``with_stats=`` makes the statistics cost only then: with that traced
flag ``est_fn`` computes the loss and gradient and leaves the statistics
to the update (``est.stats`` holds a ``_deferred.Deferred``), which
computes them inside its own conditional branch, on the statistics steps
only, from a forward pass of their own (from the step's pass when it folds
statistics in on every update, ``cov_every=1``). A statistics step folds
in exactly what ``est_fn`` computes without the flag; the others cost one
gradient and write nothing of the statistics' size, and
``stats_fraction < 1`` makes the statistics steps themselves cheaper (their
own pass over the first share of the batch). Without the flag every step
pays for the statistics whatever ``cov_every`` says.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax_lite import tagging
from kfac_jax_lite.estimators import _devices
from kfac_jax_lite.estimators._checks import (
    check_estimation, check_example_axis, check_has_loss)
from kfac_jax_lite.estimators._deferred import deferred_estimate
from kfac_jax_lite.estimators._estimate import (
    RUN_ENTRY, Estimate, estimate, when)
from kfac_jax_lite.estimators._fraction import (
    check_stats_fraction, stats_batch_size, stats_slice)


def value_grad_and_stats(loss_fn: Callable, params: chex.ArrayTree,
                         batch: chex.ArrayTree, *, estimation: str = "fisher",
                         num_samples: int = 1, stats_fraction: float = 1.0,
                         has_aux: bool = False,
                         blocks: Mapping[str, Any] | None = None,
                         exclude: Sequence[str] = (),
                         weight_sharing: str = "expand",
                         damping_mode: str = "pi",
                         example_axis: chex.ArrayTree | None = None,
                         axis_name: Any = None, mesh: Any = None
                         ) -> Callable[..., Estimate]:
  """``fn(params, batch, key) -> Estimate``: the loss, its gradient and the
  curvature statistics of every block, for ``kfac``'s ``update(..., stats=)``.

      est_fn = kfl.value_grad_and_stats(loss_fn, params, batch)
      est = est_fn(params, batch, key)           # in the jitted step
      updates, state = tx.update(est.grads, state, params, stats=est.stats)

  ``est.loss`` and ``est.grads`` equal ``jax.value_and_grad(loss_fn)(params,
  batch)`` (``est.aux`` the auxiliary output with ``has_aux``); ``est.stats``
  maps each block name to its statistics, ``est.weights`` are the examples'
  loss weights ``c_i`` (module docstring). With ``stats_fraction = 1`` all of
  it comes from one forward pass (one ``jax.vjp``: the gradient's backward
  pass and the statistics' sampled one share its residuals), the cheapest
  way to feed ``kfl.kfac``.

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss`` (``(loss, aux)`` with
      ``has_aux``); traced once here, at ``params`` and ``batch`` (arrays or
      ``jax.ShapeDtypeStruct``s), to find its layers. ``fn.tagged`` holds
      them with their blocks; ``fn`` is pure and jittable and takes any
      batch of the same structure.
    estimation: how the output cotangents behind the statistics are drawn
      (module docstring): ``"fisher"`` (targets sampled from the model's
      registered predictive distribution: the true Fisher), ``"empirical"``
      (``"fisher"`` at the data targets; works without a registered or
      recognised loss), ``"empirical_shared"`` (``"empirical"`` read from
      the gradient's own backward pass, so no second one: equal to it for a
      mean, sum or masked loss; module doc of ``kfl.estimators``),
      ``"curvature_prop"`` (Rademacher projections of a square root of the
      output Fisher), ``"exact"`` (all its columns: the exact Kronecker
      factors, cost × output size), and ``"curvature_prop_ggn"``,
      ``"exact_ggn"`` (the same with the output Hessian: the GGN).
    num_samples: draws per example for the sampled modes (``"fisher"``,
      ``"curvature_prop"``); the statistics average them. Must be 1 for the
      others to mean anything (they ignore it but for its check).
    stats_fraction: the share ``f`` in ``(0, 1]`` of each batch the
      statistics are computed on: its first ``round(N·f)`` examples, at least
      2 (Martens & Grosse use 1/8). The loss and gradient always use the
      whole batch. The statistics are then exactly those of
      ``kfl.kfac(..., stats_fraction=f)`` with ``batch=``: ``loss_fn`` on the
      first examples gives their weights ``c_i`` (1/k for a mean over the
      slice). They take their own forward pass on the slice (``f·2·M·a·b``
      FLOPs per dense layer, ``a``/``b`` its input/output sizes, ``M`` the
      batch), because a generic ``loss_fn`` cannot be split: sharing the
      whole batch's forward pass instead would need the sampled backward
      pass over all ``M`` examples (``2·M·a·b`` rather than ``f·2·M·a·b``),
      the dearer choice for any ``f < 1/2``.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    blocks: curvature block overrides per parameter path or layer kind, as
      in ``kfl.kfac`` (see ``kfl.tagging.find_layers``); ``exclude``:
      parameter paths (or patterns) left out of the curvature (their
      gradient passes through).
    weight_sharing: ``"expand"`` or ``"reduce"`` (Eschenhagen et al. 2023)
      for layers applied over extra axes (sequence positions, a
      convolution's output locations), as in
      ``kfl.kfac``; it must match the transform's for the statistics to fit
      its blocks.
    damping_mode: ``"pi"`` or ``"exact"``, as in ``kfl.kfac``: it chooses
      the blocks' caches, so it must match the transform's too.
    example_axis: which axis of the batch's leaves holds the examples, as
      in ``kfl.kfac`` (``kfl.tagging.find_layers``): None the leading
      one, an int for every leaf, or a pytree of the batch's structure
      with an int or None per leaf (``example_axis=1`` for time-major
      ``[T, B]`` data); other than 0 it needs ``stats_fraction=1``.
    axis_name: the mesh axis the batch is sharded over, as in
      ``kfl.kfac(..., axis_name=)``; used with ``mesh``.
    mesh: as in ``kfl.kfac(..., mesh=)``, for plain
      ``jit`` on a batch sharded over ``mesh``'s ``axis_name``: ``fn`` then
      runs per device (a ``shard_map``; ``_devices``) and returns
      ``stats`` un-reduced, every leaf with a leading axis of the ``D``
      devices (row ``d``: device ``d``'s examples; the entry
      ``"~devices"`` marks them), so that ``kfl.kfac(..., mesh=)``
      reduce-scatters them to their owners instead of XLA all-reducing
      them first; ``loss`` and ``grads`` are the device means (the whole
      batch's for a loss averaging equal shards), ``aux`` is stacked
      ``[D, ...]``, ``weights`` are each device's ``c_i / D``, and every
      device draws its own samples (``key`` folded with its index); with
      ``stats_fraction < 1`` each device takes the first share of its own
      examples (as ``kfl.kfac``'s ``batch=`` style does). Any other
      consumer of such stats averages them over the devices. Inside a
      ``pmap``/``shard_map`` binding ``axis_name`` the mesh is not used.

  Returns:
    ``fn(params, batch, key, states=None, *, with_stats=True) -> Estimate``
    (``key`` a PRNG key for the sampled modes; ``states``, a ``kfl.kfac``
    state's ``blocks``, is needed by blocks whose statistics depend on their
    state, ``"ekfac"``), with ``fn.tagged``. ``with_stats`` says whether to
    compute the statistics at all (amortisation, module doc): ``True`` (the
    default) always; ``False`` never (the plain ``jax.value_and_grad``, with
    zero ``stats`` and ``weights`` of the same shapes); a concrete boolean
    array (outside ``jit``) as its value; a traced boolean,
    ``kfl.stats_due(state)`` of the state the estimate's update gets: the
    statistics are deferred to that update (module doc), which computes
    them when its own flag says so (the value passed is not read): ``stats``
    are then the run entry and ``estimators.DEFERRED_ENTRY`` (no block
    entries; ``estimators.resolve`` computes them) and ``weights`` None.
    Only ``kfl.kfac``, ``kfl.kfac_optimizer`` and ``kfl.eigen_adam`` (and
    ``kfl.with_stats``) take such stats. With ``mesh`` (the per-device
    statistics leave a ``shard_map`` as arrays) a traced flag instead puts
    the statistics' own work (the sampled backward pass, the factors'
    products) under one ``lax.cond``, with zeros where it is False. The
    gradient stays outside any conditional because XLA:CPU compiles a
    convolution's gradient in a conditional branch without its fast
    kernels (9x slower on the conv net of ``benchmarks/``).
  """
  check_estimation(estimation, num_samples)
  _devices.check_mesh(mesh, axis_name)
  check_stats_fraction(stats_fraction)
  stats_batch_size(batch, stats_fraction, "value_grad_and_stats(batch)")
  check_example_axis(example_axis, batch, stats_fraction,
                     "value_grad_and_stats")
  tagged = tagging.find_layers(
      loss_fn, params, batch, has_aux=has_aux, exclude=exclude,
      example_axis=example_axis).with_blocks(
          blocks, damping_mode=damping_mode, weight_sharing=weight_sharing)
  check_has_loss(tagged, estimation, "value_grad_and_stats")
  stats_batch_size(batch, stats_fraction, "value_grad_and_stats(batch)",
                   tagged.examples)  # Now knowing which leaves are examples.

  def part(params, batch, key, states):
    """``(stats, weights)`` of the statistics' own pass on the first
    ``stats_fraction`` of ``batch``."""
    return estimate(
        tagged, params, stats_slice(batch, stats_fraction,
                                    "value_grad_and_stats", tagged.examples),
        key, estimation=estimation, num_samples=num_samples,
        states=states)[3:]

  def with_statistics(params, batch, key, states):
    if stats_fraction >= 1.0:
      return estimate(tagged, params, batch, key, estimation=estimation,
                      num_samples=num_samples, states=states)
    loss, aux, grads = plain(params, batch)
    stats, weights = part(params, batch, key, states)
    return Estimate(loss, aux, grads, _run_loss(stats, loss), weights)

  def plain(params, batch):
    out, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(params, batch)
    loss, aux = out if has_aux else (out, None)
    return loss, aux, grads

  def without_statistics(params, batch, key, states):
    shapes = jax.eval_shape(with_statistics, params, batch, key, states)
    loss, aux, grads = plain(params, batch)
    zeros = lambda s: jnp.zeros(s.shape, s.dtype)
    return Estimate(loss, aux, grads,
                    _run_loss(jax.tree.map(zeros, shapes.stats), loss),
                    zeros(shapes.weights))

  def gated(params, batch, key, states, flag):
    """The statistics' own work (the sampled backward pass, the factors'
    products; a slice's whole pass) under a ``lax.cond`` on the traced
    ``flag``, zeros where it is False: per device on a mesh, whose
    per-device statistics leave the ``shard_map`` as arrays."""
    if stats_fraction >= 1.0:
      return estimate(tagged, params, batch, key, estimation=estimation,
                      num_samples=num_samples, states=states,
                      with_stats=flag)
    loss, aux, grads = plain(params, batch)
    stats, weights = when(flag, lambda: part(params, batch, key, states))
    return Estimate(loss, aux, grads, _run_loss(stats, loss), weights)

  def deferred(params, batch, key, states):
    """The statistics left to the update's own conditional
    (``_deferred``): the forward and gradient passes only, here."""
    del states  # The update passes its own.
    est = deferred_estimate(tagged, params, batch, key,
                            estimation=estimation, num_samples=num_samples,
                            stats_fraction=stats_fraction)
    return est._replace(stats=_run_loss(est.stats, est.loss))

  def one_device(params, batch, key, states, flag):
    if isinstance(flag, bool):
      branch = with_statistics if flag else without_statistics
      return branch(params, batch, key, states)
    return gated(params, batch, key, states, flag)

  def fn(params, batch, key, states=None, *, with_stats=True):
    on_mesh = mesh is not None and not _devices.axis_is_bound(axis_name)
    run = (_devices.on_mesh(one_device, tagged.examples, mesh, axis_name)
           if on_mesh else one_device)
    if isinstance(with_stats, (bool, np.bool_)):
      return run(params, batch, key, states, bool(with_stats))
    flag = jnp.asarray(with_stats)
    if flag.shape != () or flag.dtype != jnp.bool_:
      raise ValueError("with_stats must be a bool or a scalar boolean array "
                       f"(kfl.stats_due(state)), got {flag.dtype}{list(flag.shape)}")
    try:  # Known now (outside jit): its value.
      known = bool(flag)
    except jax.errors.ConcretizationTypeError:
      known = None  # Traced: decided when the step runs.
    if known is not None:
      return run(params, batch, key, states, known)
    if not on_mesh:
      return deferred(params, batch, key, states)
    return run(params, batch, key, states, flag)

  fn.tagged = tagged
  return fn


def _run_loss(stats, loss):
  """``stats`` whose run entry (``RUN_ENTRY``: what ``kfl.kfac`` and
  ``kfl.health`` read for the loss when no ``loss=`` is given) holds the
  whole batch's ``loss``, also on a step without statistics (whose zeros
  would read as a loss of 0) and with a statistics share (whose pass sees
  the first examples only)."""
  run = dict(stats[RUN_ENTRY])
  run["loss"] = jnp.asarray(loss, run["loss"].dtype)
  return {**stats, RUN_ENTRY: run}
