"""``Pending``, the next update's batch or statistics carried in a K-FAC
state (``kfl.with_batch``, ``kfl.with_stats``: ``pending``), and how each
``update`` reads it (``resolve``) or refuses without it (``missing``).
Its own module so that the states' modules and ``pending`` all read it,
none through another."""
from __future__ import annotations

from typing import Any, NamedTuple


class Pending(NamedTuple):
  """What the next update of a K-FAC state uses when it gets no keyword
  arguments (module docstring).

  Attributes:
    batch: the batch (as ``update(..., batch=)``), or None.
    stats: one-pass statistics (``Estimate.stats``, as ``stats=``), or None.
    loss: the loss for ``kfl.health`` (``Estimate.loss``, as ``loss=``), or
      None.
  """

  batch: Any = None
  stats: Any = None
  loss: Any = None


def missing(where: str, what: str = "batch= (or precomputed stats=)") -> str:
  """The error of an update that got neither keyword arguments nor a
  pending batch: what it needs and how each loop passes it."""
  return (
      f"{where} needs {what}. In a plain optax loop: tx.update(grads, "
      "opt_state, params, batch=batch). Where the loop calls tx.update "
      "without extra arguments (flax TrainState.apply_gradients, "
      "optax.MultiSteps in such a loop), store it in the state first: "
      "state.replace(opt_state=kfl.with_batch(state.opt_state, batch))"
      ".apply_gradients(grads=grads) (kfl.with_stats for one-pass "
      "statistics); nnx.Optimizer passes keyword arguments: "
      "optimizer.update(model, grads, batch=batch)")


def resolve(state, batch, stats, loss):
  """``(batch, stats, loss)``: the keyword arguments when either of
  ``batch``/``stats`` is given, else the state's ``pending`` ones (all
  None when nothing is pending)."""
  pending = getattr(state, "pending", None)
  if batch is not None or stats is not None or pending is None:
    return batch, stats, loss
  return (pending.batch, pending.stats,
          loss if loss is not None else pending.loss)
