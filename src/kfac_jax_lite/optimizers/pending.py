"""``kfl.with_batch`` and ``kfl.with_stats``: the next update's batch (or
one-pass statistics) carried in the optax state, for training loops that
call ``tx.update(grads, opt_state, params)`` with nothing else (flax's
``TrainState.apply_gradients``, any hand-written step that only threads
the state).

    state = state.replace(opt_state=kfl.with_batch(state.opt_state, batch))
    state = state.apply_gradients(grads=grads)

Every K-FAC state inside the optax state (``kfl.kfac``'s ``KfacState``,
``kfl.kfac_optimizer``'s ``KfacOptimizerState``, ``kfl.eigen_adam``'s
``EigenAdamState``; nested however the transform was composed: ``_find``)
has a slot ``pending`` (``_pending.Pending``) that these fill; its
``update``, called without ``batch=``/``stats=``, uses what it holds.
Keyword arguments, when given, win.

Design (issue 48): ``init`` makes the slot with zeros of the example batch
(``_pending.empty``), so storing a batch of the example batch's shapes
keeps the state's structure, shapes and dtypes: a jitted step compiles
once (the slot used to be None until the first step filled it, and the
second call compiled again). Stored statistics are used once: ``update``
returns the slot without them, so a step that calls ``with_stats`` and then
the update returns the state it got (one compile too), a ``lax.cond`` that
selects between the step's first state and its new one and ``lax.scan``
carries work, and no copy of the statistics (the size of the factors)
stays in the state between steps (issue 47: ``init`` used to make one, 2.2x
the parameters' bytes on a ResNet-50). A step that gets a state with
statistics already stored (``with_stats`` called outside it) returns one
without: it compiles once for each of the two structures. A batch of
another size takes the slot's place with its own shapes: the step compiles
for them, as any jit does for new shapes (twice: the first call still sees
the slot's old ones). An update with nothing stored is a trace-time error
naming the fix for each loop (``missing``) where it is known when tracing,
else a skipped and counted update (``_pending``'s module docstring). The
price: a batch in the state from ``init``, and the last one stored stays
there until the next ``with_batch`` replaces it. ``with_batch(state,
None)`` drops the slot (``pending=None``, as states of older versions
have): to save a checkpoint without the batch (restored into
``with_batch(tx.init(params), None)``), or to free its memory in a loop
that passes ``batch=`` itself. A slot dropped in a ``with_batch`` loop
comes back, with one more compile, at the next ``with_batch``.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kfac_jax_lite import estimators
from kfac_jax_lite.optimizers import _find
from kfac_jax_lite.optimizers import _pending
from kfac_jax_lite.optimizers._pending import Pending as Pending
from kfac_jax_lite.optimizers._state import KfacState
from kfac_jax_lite.optimizers.eigen_adam import EigenAdamState
from kfac_jax_lite.optimizers.optimizer import KfacOptimizerState


# The outer kfac_optimizer state first: it passes its pending on.
_KINDS = (KfacOptimizerState, KfacState, EigenAdamState)


def _with(state, fill, where: str):
  found = _find.states(state, _KINDS)
  if not found:
    raise ValueError(
        f"kfl.{where}: no kfl.kfac, kfl.kfac_optimizer or kfl.eigen_adam "
        f"state found in {type(state).__name__}: pass the optax state of a "
        "transform that holds one (e.g. TrainState's opt_state)")
  return _find.replace(state, _KINDS,
                       lambda s: s._replace(pending=fill(s.pending)))


def _kind(bits: int):
  # A NumPy constant: known when the update traces in the same step
  # (``_pending.stored``); an int32 array of the slot's dtype after it.
  return np.array(bits, np.int32)


def _strong(tree):
  """``tree`` with weakly typed leaves (of a Python scalar) given their
  dtype for good, as the slot's zeros have it: one compile, not two."""
  return jax.tree.map(
      lambda x: jax.lax.convert_element_type(x, jnp.result_type(x))
      if getattr(x, "weak_type", False) else x, tree)


def _fresh(slot):
  """A slot to fill: ``slot``, or a new one for a state without any
  (dropped by ``with_batch(state, None)``, or of an older version)."""
  return slot if slot is not None else Pending(
      kind=_kind(0), num_missing=np.zeros((), np.int32))


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
      example batch; its shapes keep the step to one compile); None drops
      the slot (module docstring).

  Returns:
    The same optax state with each K-FAC state's ``pending`` holding
    ``batch`` (its statistics and loss kept), or None.
  """
  if batch is None:
    return _with(state, lambda slot: None, "with_batch")
  return _with(state, lambda slot: _fresh(slot)._replace(
      batch=batch, kind=_kind(_pending.BATCH)), "with_batch")


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
    The same optax state with each K-FAC state's ``pending`` holding
    ``estimate.stats`` and ``estimate.loss`` (the statistics' own, from
    their run entry, when it is None), and ``batch`` when given. The next
    update uses the statistics and drops them (module docstring).
  """
  loss = estimate.loss
  if loss is None:  # The statistics' own (their run entry), if they have it.
    loss = (estimate.stats or {}).get(estimators.RUN_ENTRY, {}).get("loss")

  def fill(slot):
    slot = _fresh(slot)
    return slot._replace(
        batch=slot.batch if batch is None else batch,
        stats=_strong(estimate.stats), loss=_strong(loss),
        kind=_kind(_pending.STATS
                   | (0 if batch is None else _pending.BATCH)))
  return _with(state, fill, "with_stats")
