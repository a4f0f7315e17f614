"""Statistics left for the update to compute, inside its own conditional.

With a traced ``with_stats`` (``kfl.stats_due(state)``) the one-pass
estimate does not compute the statistics under a conditional of its own:
``est.stats`` holds, in its entry ``DEFERRED_ENTRY``, a ``Deferred``, two
ways to compute them that ``kfl.kfac``'s (and ``kfl.eigen_adam``'s) update
calls where it folds statistics in (``resolve``):

* ``shared(states)`` forms them from the step's own forward pass
  (its captured inputs and pullback, the one-pass way): the update calls
  it when statistics are folded in on every update (``cov_every=1``), where
  no conditional is involved and sharing the pass is cheapest;
* ``own(states)`` takes a forward pass of its own over the batch
  (the statistics' share of it) with the same key: the update calls it
  inside the branch that runs on the statistics steps only
  (``cov_every > 1``), so a step without statistics carries nothing of
  theirs.

Why not the estimate's own ``lax.cond``: every value that crosses a
conditional's boundary is written out on every step, whether or not its
branch runs. The estimate's conditional returned the statistics (zeros of
every factor's size on a step without them, ``[1, n, n]`` each, and a copy
for every repeated shape) and took the forward pass's residuals (the
``1 − tanh²`` of each layer, the loss's pieces) as operands, which the
gradient's backward pass alone would have fused away; the update's own
conditional then took the statistics again. On the MNIST autoencoder at
the planned defaults (statistics and refresh every 50 steps) the mean step
over two refresh periods was 1.87x Adam's this way and 1.80x with the
statistics' own pass in the update's branch; on the conv net 1.40x against
1.30x, on the char LM 1.27x against 1.17x (2026-11-29, 2-core CPU; the
extra forward pass on a statistics step costs less than the quiet steps
save). Pytrees throughout (``jax.tree_util.Partial``): a ``Deferred``
passes through ``jit``, ``lax.cond`` and ``kfl.with_stats``' slot; an
estimate jitted apart from its update returns what the deferred
computation holds (the batch, the forward pass's residuals) as outputs,
so jit the step whole. Outside ``jit`` the flag is concrete and the
estimate follows its value instead (``value_grad_and_stats``).
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
from jax.tree_util import Partial

from kfac_jax_lite.estimators._estimate import (
    RUN_ENTRY, Estimate, estimate, forward_pass, pass_statistics, run_entry,
    when)
from kfac_jax_lite.estimators._fraction import stats_slice

DEFERRED_ENTRY = "~deferred"
"""The ``Estimate.stats`` entry of statistics left to the update: a
``Deferred`` (module docstring); its presence means the stats hold no
block entries of their own."""


class Deferred(NamedTuple):
  """Two ways to compute an estimate's statistics (module docstring), each
  ``fn(states) -> {block name: statistics}`` without the run entry; the
  estimate's parameters, batch and key are held in it, and ``states`` is
  ``{layer name: block state}`` for the blocks whose statistics depend on
  their state, or None."""
  shared: Any  # Partial: from the step's own forward pass
  own: Any  # Partial: from a forward pass of their own


def deferred_estimate(tagged, params, batch, key, *, estimation: str,
                      num_samples: int, stats_fraction: float) -> Estimate:
  """The loss and gradient of ``batch`` now, the statistics deferred: an
  ``Estimate`` whose ``stats`` are the run entry (the whole batch's loss
  and bad targets) and ``DEFERRED_ENTRY``; ``weights`` None.

  The statistics ``resolve`` computes are those of ``estimate(tagged,
  params, stats_slice(batch, stats_fraction), key, ...)``: the same key
  draws the same samples.
  """
  fp = forward_pass(tagged, params, batch)
  own = _partial(functools.partial(
      _own, tagged, estimation, num_samples, stats_fraction), params, batch,
                 key)
  shared = own if stats_fraction < 1 else _partial(functools.partial(
      _shared, tagged, estimation, num_samples), fp, batch, key)
  stats = {RUN_ENTRY: run_entry(tagged, fp),
           DEFERRED_ENTRY: Deferred(shared, own)}
  return Estimate(fp.loss, fp.aux, fp.grads, stats, None)


def _partial(fn, *args):
  """``Partial``: ``fn(*args, states)``, with ``args`` held as a flat list
  of arrays and their structure kept apart: a consumer that rebuilds the
  pytrees it passes on (``nnx.Optimizer.update`` strips ``nnx.Param``
  wrappers from its keyword arguments) leaves a list of arrays alone."""
  leaves, treedef = jax.tree.flatten(args)
  return Partial(functools.partial(_unflattened, fn, treedef), leaves)


def _unflattened(fn, treedef, leaves, states):
  return fn(*jax.tree.unflatten(treedef, leaves), states)


def _shared(tagged, estimation, num_samples, fp, batch, key, states):
  return pass_statistics(tagged, fp, batch, key, estimation, num_samples,
                         states)[0]


def _own(tagged, estimation, num_samples, stats_fraction, params, batch, key,
         states):
  part = stats_slice(batch, stats_fraction, "value_grad_and_stats",
                     tagged.examples)
  stats = estimate(tagged, params, part, key, estimation=estimation,
                   num_samples=num_samples, states=states).stats
  return {k: v for k, v in stats.items() if k != RUN_ENTRY}


def is_deferred(stats) -> bool:
  """Whether ``stats`` (an ``Estimate.stats``, or None) are deferred."""
  return isinstance(stats, dict) and DEFERRED_ENTRY in stats


def resolve(stats, states, *, every_step: bool):
  """The block statistics of ``stats``: its own entries, or, deferred,
  computed here (``Deferred.shared`` when ``every_step``, the statistics
  folded in on every update; else ``Deferred.own``, for a conditional
  branch). The run entry is left out if ``stats`` are deferred; None gives
  None."""
  if not is_deferred(stats):
    return stats
  deferred = stats[DEFERRED_ENTRY]
  return (deferred.shared if every_step else deferred.own)(states)


def materialise(stats, due, states=None):
  """``stats`` with deferred statistics computed here, as arrays: under a
  ``lax.cond`` on the traced ``due`` (zeros where it is False), for an
  update that needs them before its own conditional (``kfl.kfac(mesh=)``
  given an estimate made without ``mesh=``: XLA sums them over the
  devices, as it did before they were deferred). Others unchanged."""
  if not is_deferred(stats):
    return stats
  new = when(due, lambda: resolve(stats, states, every_step=False))
  return {**new, RUN_ENTRY: stats[RUN_ENTRY]}
