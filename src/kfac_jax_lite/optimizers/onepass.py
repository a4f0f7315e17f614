"""``kfl.stats_due``: whether the next update of a ``kfl.kfac`` or
``kfl.eigen_adam`` state accumulates statistics, read from the optax state
so that the one-pass estimate (``kfl.value_grad_and_stats``) computes them
only on the steps that use them (the pattern: ``kfl.estimators``'
``value_grad_and_stats``)."""
from __future__ import annotations

import jax
import optax

from kfac_jax_lite.optimizers import _find
from kfac_jax_lite.optimizers._state import KfacState
from kfac_jax_lite.optimizers.eigen_adam import EigenAdamState


def stats_due(state: optax.OptState) -> jax.Array:
  """Whether the next ``kfl.kfac`` (or ``kfl.eigen_adam``) update
  accumulates statistics.

  ``state``: an optax state holding one ``kfl.kfac`` state (its own, a
  chain's, or ``kfl.kfac_optimizer``'s) or one ``kfl.eigen_adam`` state,
  nested in any optax combinator (``MultiSteps``, ``inject_hyperparams``,
  ``apply_if_finite``, ``masked``, ``multi_transform``, ...) and with its
  leaves in flax wrappers or not (``nnx.Optimizer``'s ``opt_state``).
  Returns a scalar boolean from its ``stats_due``: ``count % cov_every ==
  0`` for the update to come; pass it as ``est_fn(...,
  with_stats=kfl.stats_due(state))`` so the statistics are computed only
  on the steps that use them (module doc).
  """
  found = _find.states(state, (KfacState, EigenAdamState))
  if len(found) != 1:
    raise ValueError(
        "kfl.stats_due needs an optax state that holds exactly one kfl.kfac "
        "or kfl.eigen_adam state (KfacState, EigenAdamState); found "
        f"{len(found)} in {type(state).__name__}")
  return found[0].stats_due > 0
