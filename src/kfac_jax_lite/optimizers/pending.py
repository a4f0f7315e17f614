"""``kfl.with_batch`` and ``kfl.with_stats``: the next update's batch (or
one-pass statistics) carried in the optax state, for training loops that
call ``tx.update(grads, opt_state, params)`` with nothing else (flax's
``TrainState.apply_gradients``, ``optax.MultiSteps`` under a loop that
passes no extra arguments, any hand-written step that only threads the
state).

    state = state.replace(opt_state=kfl.with_batch(state.opt_state, batch))
    state = state.apply_gradients(grads=grads)

Every K-FAC state inside the optax state (``kfl.kfac``'s ``KfacState``,
``kfl.kfac_optimizer``'s ``KfacOptimizerState``, ``kfl.eigen_adam``'s
``EigenAdamState``; nested however the transform was composed: ``_find``)
gets ``pending = Pending(batch, stats, loss)``; its ``update``, called
without ``batch=``/``stats=``, uses them. Keyword arguments, when given,
win.

Design: ``init`` leaves ``pending=None`` (an empty pytree: nothing saved in
a checkpoint, nothing kept in memory), so an update with nothing to go on
is a trace-time error naming the fix for each loop (``missing``).
``update`` returns ``pending`` as it came in, so the state's structure is
the same before and after it: ``optax.MultiSteps`` (which selects between
the old and new inner state leaf by leaf) and ``lax.scan`` carries work,
and a jitted step retraces once (the first call sees ``pending=None``),
not at every step. The price: the last batch (or statistics) stays in the
state until the next ``with_batch`` replaces it (one batch of memory);
``with_batch(state, None)`` drops it, e.g. before a checkpoint.
"""
from __future__ import annotations

from typing import Any

import optax

from kfac_jax_lite.optimizers import _find
from kfac_jax_lite.optimizers._pending import Pending as Pending
from kfac_jax_lite.optimizers._state import KfacState
from kfac_jax_lite.optimizers.eigen_adam import EigenAdamState
from kfac_jax_lite.optimizers.optimizer import KfacOptimizerState


# The outer kfac_optimizer state first: it passes its pending on.
_KINDS = (KfacOptimizerState, KfacState, EigenAdamState)


def _with(state, pending: Pending | None, where: str):
  found = _find.states(state, _KINDS)
  if not found:
    raise ValueError(
        f"kfl.{where}: no kfl.kfac, kfl.kfac_optimizer or kfl.eigen_adam "
        f"state found in {type(state).__name__}: pass the optax state of a "
        "transform that holds one (e.g. TrainState's opt_state)")
  return _find.replace(state, _KINDS,
                       lambda s: s._replace(pending=pending))


def with_batch(state: optax.OptState, batch: Any) -> optax.OptState:
  """``state`` with ``batch`` stored for the next update of every K-FAC
  state it holds (module docstring), for loops that call
  ``tx.update(grads, state, params)`` without ``batch=``.

  Args:
    state: an optax state holding at least one ``kfl.kfac``,
      ``kfl.kfac_optimizer`` or ``kfl.eigen_adam`` state, nested in any
      optax combinator (``chain``, ``MultiSteps``, ``inject_hyperparams``,
      ``masked``, ...).
    batch: the batch the gradient was computed on (the structure of the
      example batch); None drops a stored one.

  Returns:
    The same optax state with each K-FAC state's ``pending`` set to
    ``Pending(batch=batch)`` (or None).
  """
  return _with(state, None if batch is None else Pending(batch=batch),
               "with_batch")


def with_stats(state: optax.OptState, estimate: Any, batch: Any = None
               ) -> optax.OptState:
  """``state`` with one-pass statistics stored for the next update (the
  ``stats=``/``loss=`` of ``kfl.value_grad_and_stats``'s estimate), for
  loops that call ``tx.update(grads, state, params)`` without them.

  Args:
    state: as for ``with_batch``.
    estimate: a ``kfl.Estimate`` (its ``stats`` and ``loss`` are stored).
    batch: the batch too, for ``kfl.kfac_optimizer`` (whose quadratic
      model evaluates the loss on it); None for the others.

  Returns:
    The same optax state with each K-FAC state's ``pending`` set to
    ``Pending(batch, estimate.stats, estimate.loss)``.
  """
  return _with(state, Pending(batch=batch, stats=estimate.stats,
                              loss=estimate.loss), "with_stats")
