"""``kfl.eigen_adam``'s finiteness guard and health counters (issue 38).

One NaN batch used to leave ``eigen_adam``'s moments (and so its
parameters) NaN for good, as in ``optax.adam``; ``optax.apply_if_finite``
fixed it from outside. ``guarded`` gives ``eigen_adam`` the guard of
``kfl.kfac`` from inside: an update whose gradient, loss (``loss=`` or
the ``Estimate.stats`` run entry), targets (a label outside
``[0, classes)``) or result is not good is skipped: a zero update, and
every moment and factor left as they were (as ``apply_if_finite`` leaves
its inner state), with only the count, the key and the schedule moving
on; the event is counted in the state's counters and its
``_health_state.HealthState``, which ``kfl.health`` reads as for
``kfl.kfac``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kfac_jax_lite import factor as fac
from kfac_jax_lite.optimizers import _health_state


def init(params) -> dict:
  """The guard's fields of a fresh ``EigenAdamState``."""
  zero = lambda: jnp.zeros((), jnp.int32)
  return dict(num_bad_grads=zero(), num_bad_updates=zero(),
              num_nonfinite_params=zero(), health=_health_state.init(
                  params, fac.float_dtype(jax.tree.leaves(params))))


def guarded(old, new, out, grad_leaves, params, loss, bad_targets,
            seen=None):
  """``(updates, state)``: ``out`` and ``new`` (an ``EigenAdamState``
  after one update from ``old``) when the gradient ``grad_leaves``,
  ``loss`` (None: not seen; ``seen``, a traced bool, says on which steps it
  was when not every step), the targets (``bad_targets``: their count
  outside their support, or None) and ``out`` are all good; else a zero
  update and ``old``'s moments and factors, with the event counted."""
  dtype = fac.float_dtype(params)
  grads_ok = fac.all_finite(grad_leaves)
  loss_ok = (jnp.ones((), bool) if loss is None
             else jnp.isfinite(jnp.asarray(loss, dtype)))
  targets_ok = (jnp.ones((), bool) if bad_targets is None
                else jnp.asarray(bad_targets) == 0)
  update_ok = fac.all_finite(out)
  good = grads_ok & loss_ok & targets_ok & update_ok
  keep = lambda n, o: jax.tree.map(lambda x, y: jnp.where(good, x, y), n, o)
  state = new._replace(
      blocks=keep(new.blocks, old.blocks),
      mu_basis=keep(new.mu_basis, old.mu_basis),
      nu_basis=keep(new.nu_basis, old.nu_basis),
      mu=keep(new.mu, old.mu), nu=keep(new.nu, old.nu))
  out = [jnp.where(good, u, jnp.zeros_like(u)) for u in out]
  params_ok = fac.all_finite(params)
  count = lambda x: jnp.asarray(x).astype(jnp.int32)
  # A loss of bad targets is not the run's (as kfl.kfac's): left out.
  seen = (jnp.zeros((), dtype) if loss is None else loss,
          (loss is not None if seen is None else seen) & targets_ok)
  health = _health_state.update(old.health, old.count == 0, params,
                                jnp.zeros((), bool), *seen, dtype)
  health = _health_state.events(
      health, old.count, grads_ok & targets_ok & ~loss_ok,
      grads_ok & ~targets_ok, ~good | ~params_ok)
  return out, state._replace(
      num_bad_grads=old.num_bad_grads + count(~grads_ok),
      num_bad_updates=old.num_bad_updates
      + count(grads_ok & loss_ok & targets_ok & ~update_ok),
      num_nonfinite_params=old.num_nonfinite_params + count(~params_ok),
      health=health)
