"""What ``kfl.health`` reads from a ``kfl.kfac`` state besides the skip
counters: the KL clip, the parameters' growth and the loss's progress.

Issue 24: runs that did not learn (a Haiku LSTM LM at lr 0.1 whose loss
stayed at ln 32 for 200 steps while its first layer's weights reached 8.8;
an Equinox ViT that made no progress in 200 steps) had every skip counter
at 0. ``update`` keeps, at a few scalar operations per step:

* ``num_clipped``: updates the KL clip scaled down;
* ``param_norm_first``/``param_norm``: ``‖θ‖`` at the first and the latest
  update, and ``leaf_norm_first``/``leaf_norm`` the same per parameter
  leaf (a layer that blows up while the others hold the total down);
* ``loss_start``: the mean of the first ``LOSS_START_WINDOW`` losses the
  transform saw, ``loss_recent`` their EMA of decay ``LOSS_DECAY``
  (about the last 10), ``num_losses`` how many it saw. A loss is seen when
  ``update`` is given ``loss=`` (e.g. ``Estimate.loss`` next to ``stats=``)
  or computes statistics on ``batch=`` (the loss of that pass, on the
  ``stats_fraction`` share: the forward pass is already there). A loss
  that is not finite is left out (its update's gradient is not finite
  either: it is skipped and counted in ``num_bad_grads``), so the state
  stays finite.

Issue 38 adds the events a run can recover from:

* ``num_bad_losses``: updates skipped because the loss seen was not
  finite although the gradient was (a label at ``classes`` gives a NaN
  loss with a finite gradient);
* ``num_bad_inputs``: updates skipped because a registered or recognised
  loss's targets lay outside its distribution's support (an integer label
  outside ``[0, classes)``, which JAX's indexing would wrap into another
  class); their statistics are left out too;
* ``first_bad``/``last_bad``: the step (``count``) of the first and the
  latest update that was skipped or replaced for any reason (-1: none), so
  that ``kfl.health`` can tell a run that recovered from one that fails;
* ``loss_first``: the first finite loss seen (a loss far above it is a
  blow-up from the first losses on, ``kfl.health``'s ``rising``);
* ``loss_best``: the lowest ``loss_recent`` once ``LOSS_START_WINDOW``
  losses were seen (a run that gave back most of its progress is
  ``kfl.health``'s ``rebounded``; issue 36).

``kfl.health`` judges them (its thresholds and their reasons are there).
The reductions add no pass over the parameters: the per-leaf squared norms
are the ones the total is summed from.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kfac_jax_lite import factor as fac

# ``loss_start`` averages the first 10 losses seen (minibatch noise of one
# loss is a few per cent; ten average it down); ``loss_recent`` is an EMA of
# decay 0.9, the same window at the end of the run.
LOSS_START_WINDOW = 10
LOSS_DECAY = 0.9


class HealthState(NamedTuple):
  num_clipped: Any  # int32: updates the KL clip scaled down (s < 1).
  param_norm_first: Any  # ‖θ‖ at the first update (curvature dtype).
  param_norm: Any  # ‖θ‖ at the latest update.
  leaf_norm_first: Any  # [leaves] ‖θ_leaf‖ at the first update.
  leaf_norm: Any  # [leaves] ‖θ_leaf‖ at the latest update.
  loss_start: Any  # mean of the first LOSS_START_WINDOW losses seen.
  loss_recent: Any  # EMA (LOSS_DECAY) of the losses seen.
  num_losses: Any  # int32: losses seen.
  loss_first: Any  # the first finite loss seen.
  num_bad_losses: Any  # int32: skipped for a non-finite loss (finite grad).
  num_bad_inputs: Any  # int32: skipped for targets outside their support.
  first_bad: Any  # int32: step of the first skipped/replaced update, or -1.
  last_bad: Any  # int32: step of the latest skipped/replaced update, or -1.
  loss_best: Any  # the lowest loss_recent once LOSS_START_WINDOW losses
  # were seen (0 before).


def init(params, dtype) -> HealthState:
  n = len(jax.tree.leaves(params))
  zero = lambda: jnp.zeros((), dtype)
  return HealthState(
      num_clipped=jnp.zeros((), jnp.int32), param_norm_first=zero(),
      param_norm=zero(), leaf_norm_first=jnp.zeros((n,), dtype),
      leaf_norm=jnp.zeros((n,), dtype), loss_start=zero(),
      loss_recent=zero(), num_losses=jnp.zeros((), jnp.int32),
      loss_first=zero(), num_bad_losses=jnp.zeros((), jnp.int32),
      num_bad_inputs=jnp.zeros((), jnp.int32),
      first_bad=jnp.full((), -1, jnp.int32),
      last_bad=jnp.full((), -1, jnp.int32), loss_best=zero())


def update(h: HealthState, first, params, clipped, loss, seen, dtype
           ) -> HealthState:
  """``h`` after one update: ``first`` whether it is the first (``count ==
  0``), ``clipped`` whether the KL clip scaled it down, ``loss`` the loss
  seen at this step when ``seen`` (a bool; a non-finite ``loss`` is not
  kept). The bad-event fields are ``events``'."""
  sq = jnp.stack([jnp.vdot(p, p).real.astype(dtype)
                  for p in jax.tree.leaves(params)] or [jnp.zeros((), dtype)])
  leaf = jnp.sqrt(sq)[:h.leaf_norm.shape[0]]
  norm = jnp.sqrt(jnp.sum(sq))
  loss = jnp.asarray(loss, dtype)
  seen = jnp.asarray(seen) & jnp.isfinite(loss)
  loss = jnp.where(seen, loss, 0)
  k = h.num_losses
  start = jnp.where(seen & (k < LOSS_START_WINDOW),
                    (h.loss_start * k + loss) / (k + 1), h.loss_start)
  recent = jnp.where(seen, jnp.where(
      k == 0, loss, LOSS_DECAY * h.loss_recent + (1 - LOSS_DECAY) * loss),
                     h.loss_recent)
  return HealthState(
      num_clipped=h.num_clipped + clipped.astype(jnp.int32),
      param_norm_first=jnp.where(first, norm, h.param_norm_first),
      param_norm=norm,
      leaf_norm_first=jnp.where(first, leaf, h.leaf_norm_first),
      leaf_norm=leaf, loss_start=start, loss_recent=recent,
      num_losses=k + seen.astype(jnp.int32),
      loss_first=jnp.where(seen & (k == 0), loss, h.loss_first),
      num_bad_losses=h.num_bad_losses, num_bad_inputs=h.num_bad_inputs,
      first_bad=h.first_bad, last_bad=h.last_bad,
      loss_best=jnp.where(seen & (k + 1 >= LOSS_START_WINDOW), jnp.where(
          k + 1 == LOSS_START_WINDOW, recent,
          jnp.minimum(h.loss_best, recent)), h.loss_best))


def events(h: HealthState, step, bad_loss, bad_input, bad) -> HealthState:
  """``h`` with one update's events counted: ``bad_loss`` (a non-finite
  loss, finite gradient), ``bad_input`` (targets outside their support),
  ``bad`` (the update was skipped or replaced for any reason) at ``step``
  (``count``)."""
  count = lambda x: jnp.asarray(x).astype(jnp.int32)
  return h._replace(
      num_bad_losses=h.num_bad_losses + count(bad_loss),
      num_bad_inputs=h.num_bad_inputs + count(bad_input),
      first_bad=jnp.where(bad & (h.first_bad < 0), step, h.first_bad),
      last_bad=jnp.where(bad, step, h.last_bad))


def counted(state, params, grads_ok, update_ok, damping_ok, scaled,
            seen: tuple[Any, Any], dtype, input_ok=(True, True)) -> dict:
  """The new counters of a ``KfacState`` after one update (its fields, for
  ``state._replace``): the skip counters (the transform's module doc) and
  ``health`` (``update``; ``seen`` its ``(loss, seen)``; ``input_ok``
  ``(loss_ok, targets_ok)``: whether the loss seen was finite and the
  targets in their support, ``events``)."""
  loss_ok, targets_ok = (jnp.asarray(x) for x in input_ok)
  good = grads_ok & damping_ok & loss_ok & targets_ok
  params_ok = fac.all_finite(params)
  bad = ~good | ~update_ok | ~params_ok
  health = update(state.health, state.count == 0, params,
                  good & update_ok & scaled, *seen, dtype)
  health = events(health, state.count, grads_ok & targets_ok & ~loss_ok,
                  grads_ok & ~targets_ok, bad)
  count = lambda x: jnp.asarray(x).astype(jnp.int32)
  return dict(
      num_bad_grads=state.num_bad_grads + count(~grads_ok),
      num_bad_updates=state.num_bad_updates + count(good & ~update_ok),
      num_bad_damping=state.num_bad_damping + count(~damping_ok),
      num_nonfinite_params=state.num_nonfinite_params + count(~params_ok),
      health=health)
