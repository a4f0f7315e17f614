"""``Pending``, the slot of a K-FAC state that carries the next update's
batch or statistics (``kfl.with_batch``, ``kfl.with_stats``: ``pending``),
made by ``init`` (``empty``), and how each ``update`` reads it
(``stored``) or refuses without it (``missing``). Its own module so that
the states' modules and ``pending`` all read it, none through another.

The slot is in the state from ``init`` with the structure, shapes and
dtypes of the example batch (zeros), so a jitted step that stores its
batch returns a state of the structure it got and compiles once (it used
to hold None until the first step stored one, whose output then compiled
the step again: issue 48). Statistics (``kfl.with_stats``) are used once:
the update returns the slot without them, so a step that stores them and
updates (the README's loops) also returns the structure it got, and the
state does not keep a copy of the factors' size between steps (the slot
used to keep zeros of the example batch's statistics from ``init`` on:
2.2x the parameters' bytes on a ResNet-50, issue 47). What is stored is
the int32 ``kind``: ``BATCH | STATS`` bits, 0 for nothing.

``update`` reads ``kind`` when it traces. ``with_batch``/``with_stats``
write it as a NumPy constant, so in the step that called them (the
README's loops) it is known there, as it is eagerly: the update takes the
stored batch's path or the statistics' path, and with nothing stored it
raises the error naming the fix (``missing``). Where the state reaches
``update`` as an argument of a trace (a jitted step that forgot
``with_batch`` or called it outside; a ``lax.cond`` or ``lax.scan`` of
the user's that passes the state on) ``kind`` is only known at run time:
both paths are compiled under a ``lax.switch`` and an update with nothing
stored is skipped (a zero update, the state unchanged) and counted in
``num_missing`` (``kfl.health`` reports it), as K-FAC's other faults are.
Before the slot was made at ``init``, a jitted step that forgot
``with_batch`` was refused when it traced: a fixed structure cannot tell
"never stored" from "stored" before it runs.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.core  # Explicit, so that type checkers see jax.core.Tracer.
import jax.numpy as jnp
import numpy as np

# ``Pending.kind``'s bits.
BATCH = 1
STATS = 2


class Pending(NamedTuple):
  """What the next update of a K-FAC state uses when it gets no keyword
  arguments (module docstring); ``init`` makes it with zeros (``empty``).

  Attributes:
    batch: the batch (as ``update(..., batch=)``); the example batch's
      zeros until one is stored.
    stats: one-pass statistics (``Estimate.stats``, as ``stats=``) stored
      for the next update, which drops them; None otherwise.
    loss: the loss for ``kfl.health`` stored with the statistics
      (``Estimate.loss``, as ``loss=``).
    kind: int32, what is stored: ``BATCH | STATS`` bits (0: nothing).
    num_missing: int32, updates that found nothing stored at run time and
      were skipped (module docstring).
  """

  batch: Any = None
  stats: Any = None
  loss: Any = None
  kind: Any = None
  num_missing: Any = None


def _zeros(x):
  return jnp.zeros(np.shape(x), jnp.result_type(x))


def empty(example_batch, loss_dtype) -> Pending:
  """The slot ``init`` makes: zeros of ``example_batch`` (arrays or
  ``jax.ShapeDtypeStruct``s), no statistics, a zero loss of
  ``loss_dtype``, nothing stored."""
  zero = lambda: jnp.zeros((), jnp.int32)  # Own buffers: donatable.
  return Pending(batch=jax.tree.map(_zeros, example_batch), stats=None,
                 loss=jnp.zeros((), loss_dtype), kind=zero(),
                 num_missing=zero())


def _spent(slot: Pending) -> Pending:
  """``slot`` as an update returns it: its statistics dropped (used once)
  and ``kind``'s ``STATS`` bit cleared; the batch kept."""
  if slot.stats is None:
    return slot
  kind = slot.kind
  kind = (np.array(int(kind) & ~STATS, np.int32)
          if isinstance(kind, (int, np.ndarray, np.generic))
          else jnp.bitwise_and(kind, ~STATS))
  return slot._replace(stats=None, kind=kind)


def missing(where: str, what: str = "batch= (or precomputed stats=)") -> str:
  """The error of an update that got neither keyword arguments nor a
  stored batch: what it needs and how each loop passes it."""
  return (
      f"{where} needs {what}. In a plain optax loop: tx.update(grads, "
      "opt_state, params, batch=batch). Where the loop calls tx.update "
      "without extra arguments (flax TrainState.apply_gradients), store it in the state first: "
      "state.replace(opt_state=kfl.with_batch(state.opt_state, batch))"
      ".apply_gradients(grads=grads) (kfl.with_stats for one-pass "
      "statistics); nnx.Optimizer passes keyword arguments: "
      "optimizer.update(model, grads, batch=batch)")


def stored(update: Callable, state, batch, stats, loss, needs: str | None):
  """``update(state, batch, stats, loss) -> (updates, new state)`` with the
  keyword arguments when either of ``batch``/``stats`` is given, else with
  what ``state.pending`` stores (module docstring). ``update`` gets the
  state without its slot and its new state gets the slot back, without
  statistics (``_spent``), so the slot never enters the update's own work
  (a ``shard_map``'s specs, a ``lax.cond``) and comes out as the step
  began with it: a ``lax.cond`` that selects between the step's first and
  its new state, and ``lax.scan`` carries, keep one structure.

  ``needs``: what ``update`` cannot do without, for the run-time choice:
  ``"one"`` (a batch or statistics: ``kfl.kfac``, ``kfl.eigen_adam``),
  ``"batch"`` (statistics optional: ``kfl.kfac_optimizer``), or None
  (neither: ``eigen_adam(basis="shampoo")``)."""
  slot = getattr(state, "pending", None)
  if not isinstance(slot, Pending):  # No slot: dropped, or an older state.
    return update(state, batch, stats, loss)
  bare = state._replace(pending=None)

  def put(out, new, slot=slot):
    return out, new._replace(pending=_spent(slot))
  if batch is not None or stats is not None or needs is None:
    return put(*update(bare, batch, stats, loss))
  stats_loss = slot.loss if loss is None else loss
  kind = slot.kind
  if not isinstance(kind, jax.core.Tracer):  # Known when tracing.
    kind = int(np.asarray(kind))
    with_stats = bool(kind & STATS)
    return put(*update(bare, slot.batch if kind & BATCH else None,
                       slot.stats if with_stats else None,
                       stats_loss if with_stats else loss))
  paths = []  # What can be stored, each path traced once.
  if slot.batch is not None:
    paths.append((BATCH, lambda: update(bare, slot.batch, None, loss)))
  if slot.stats is not None and (needs == "one" or slot.batch is not None):
    paths.append((STATS, lambda: update(
        bare, slot.batch if needs == "batch" else None, slot.stats,
        stats_loss)))
  if not paths:  # Nothing that could be stored: the update's refusal.
    return put(*update(bare, None, None, loss))
  shapes = jax.eval_shape(paths[0][1])

  def skip():  # Nothing stored: a zero update, the state as it came.
    return (jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[0]),
            jax.tree.map(lambda x, s: jnp.asarray(x, s.dtype), bare,
                         shapes[1]))

  def branch(k):  # kind & (BATCH | STATS) -> its path's branch (0: skip).
    want = (STATS if k & STATS and (needs == "one" or k & BATCH)
            else BATCH if k & BATCH else None)
    return next((i for i, (bit, _) in enumerate(paths, 1) if bit == want), 0)
  table = [branch(k) for k in range(4)]
  index = jnp.asarray(table, jnp.int32)[jnp.bitwise_and(kind, BATCH | STATS)]
  out, new = jax.lax.switch(index, [skip] + [run for _, run in paths])
  return put(out, new, slot._replace(num_missing=slot.num_missing + (
      index == 0).astype(slot.num_missing.dtype)))
