"""``kfl.health(state)``: the health counters of a K-FAC state, in one line.

K-FAC never raises inside a jitted step: what goes wrong is skipped and
counted in the state (``kfl.kfac``'s module docstring lists the fallbacks).
``health`` finds the K-FAC state inside any optimizer state (an
``optax.chain``, ``inject_hyperparams``, ``MultiSteps``, a
``kfl.kfac_optimizer`` state, a pmapped state with a device axis) and sums
the counters, so a run can be checked with one line::

    print(kfl.health(opt_state))
    # kfac: 300 steps | bad grads 0 | non-finite params 0 | bad damping 0 | ...
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import numpy as np

from kfac_jax_lite import factor as fac
from kfac_jax_lite import optimizer
from kfac_jax_lite import transform


# A run whose parameter norm grew more than this many times since its first
# update is reported as blown up. Issue 24's runs that did not learn grew
# their weights while every counter stayed 0. On benchmarks/robustness.py
# (digits, batch 128) the runs at lr 0.01 grew 1.4-3.7x in 100 or 300
# steps, at lr 0.03 2.4-8.9x (all trained), at lr 0.1 8-14x in 100 steps
# (benchmarks/results/robustness_issue24_health.txt). Growth alone does not
# separate a run that learns slowly from one that fails (the Haiku conv net
# with weight decay in the loss failed at lr 0.1 growing 8x): the limit is
# set above every run that trained.
PARAM_GROWTH_LIMIT = 10.0


class Health(NamedTuple):
  """Counters of one K-FAC state (summed over several, and over devices).

  ``steps``: updates so far. ``bad_grads``: updates skipped because the
  gradient was not finite. ``nonfinite_params``: updates called with
  parameters that were not finite (training has diverged: every later
  step is skipped too). ``bad_damping``: updates skipped because the
  damping was not positive and finite. ``bad_updates``: preconditioned
  updates that were not finite and were replaced by the gradient.
  ``skipped_stats``: factor updates refused for non-finite statistics.
  ``failed_inverses``: factor decompositions that were not finite (the
  last good one was kept). ``unready_blocks``: blocks that have no
  decomposition of real statistics yet (their gradient passes through
  unpreconditioned). ``damping``, ``rho``, ``learning_rate``,
  ``momentum``: ``kfac_optimizer``'s adapted values (``None`` otherwise).
  ``clipped``: updates the KL clip scaled down. ``param_growth``: the
  parameters' norm at the latest update over that at the first (the
  largest over several states; inf once they are not finite).

  A run is also not ``ok`` when its parameters' norm grew more than
  ``PARAM_GROWTH_LIMIT`` times since the first update: a run that blows up
  its weights while every step is finite (issue 24). ``clipped`` is shown
  but not judged: with the default ``norm_constraint`` the clip scales
  most updates of runs that train well too (47-89 of 100 at lr 0.01 in
  ``benchmarks/results/robustness_issue24_health.txt``).
  """

  steps: int
  bad_grads: int
  nonfinite_params: int
  bad_damping: int
  bad_updates: int
  skipped_stats: int
  failed_inverses: int
  unready_blocks: int
  damping: Optional[float] = None
  rho: Optional[float] = None
  learning_rate: Optional[float] = None
  momentum: Optional[float] = None
  clipped: int = 0
  param_growth: float = 1.0

  @property
  def blew_up(self) -> bool:
    """The parameters' norm grew more than ``PARAM_GROWTH_LIMIT`` times."""
    return not self.param_growth <= PARAM_GROWTH_LIMIT

  @property
  def ok(self) -> bool:
    """No step was skipped or replaced, every block is preconditioned,
    and the parameters did not blow up."""
    return not (self.bad_grads or self.nonfinite_params or self.bad_damping
                or self.bad_updates or self.skipped_stats
                or self.failed_inverses or self.unready_blocks
                or self.blew_up)

  def __str__(self):
    head = "kfac: ok" if self.ok else "kfac: PROBLEMS"
    parts = [head, f"{self.steps} steps", f"bad grads {self.bad_grads}",
             f"non-finite params {self.nonfinite_params}",
             f"bad damping {self.bad_damping}",
             f"bad updates {self.bad_updates}",
             f"skipped stats {self.skipped_stats}",
             f"failed inverses {self.failed_inverses}",
             f"unready blocks {self.unready_blocks}",
             f"clipped {self.clipped}",
             f"param growth {self.param_growth:.3g}x"
             + (" (BLEW UP)" if self.blew_up else "")]
    for name in ("damping", "rho", "learning_rate", "momentum"):
      value = getattr(self, name)
      if value is not None:
        parts.append(f"{name.replace('_', ' ')} {value:.3g}")
    return " | ".join(parts)

  __repr__ = __str__


def _is_state(x):
  return isinstance(x, (transform.KfacState, optimizer.KfacOptimizerState))


def _is_factor(x):
  return isinstance(x, fac.FactorState)


def _total(x) -> int:
  return int(np.sum(np.asarray(x)))


def _first(x) -> float:
  return float(np.asarray(x).ravel()[0])


def _block_counts(blocks):
  """(skipped stats, failed inverses, unready blocks) of a state's blocks."""
  skipped = failed = unready = 0
  for block in blocks.values():
    factors = [f for f in jax.tree.leaves(block, is_leaf=_is_factor)
               if _is_factor(f)]
    skipped += sum(_total(f.num_skipped) for f in factors)
    failed += sum(_total(f.cache.num_failed) for f in factors)
    # Leading axes (a scan stack, a pmap device axis) are separate blocks.
    steps = [np.asarray(f.cache.step) for f in factors]
    unready += int(np.sum(np.any(np.stack(steps) < 0, axis=0)))
  return skipped, failed, unready


def health(state) -> Health:
  """The health counters of every K-FAC state inside ``state``, summed.

  ``state`` is any pytree holding ``kfl.kfac`` or ``kfl.kfac_optimizer``
  states (e.g. the state of ``optax.chain(kfl.kfac(...), ...)``). Prints
  as one line; ``.ok`` is False when any counter is non-zero. A pmapped
  state (a leading device axis) counts its devices' steps once.
  """
  found = [x for x in jax.tree.leaves(state, is_leaf=_is_state) if _is_state(x)]
  if not found:
    raise ValueError("kfl.health: no kfl.kfac or kfl.kfac_optimizer state "
                     f"found in {type(state).__name__}")
  totals = np.zeros(9, np.int64)
  extra = {}
  growth = 1.0
  for s in found:
    if isinstance(s, optimizer.KfacOptimizerState):
      extra = dict(damping=_first(s.damping), rho=_first(s.rho),
                   learning_rate=_first(s.learning_rate),
                   momentum=_first(s.momentum))
      s = s.kfac
    count = np.asarray(s.count)
    devices = count.size  # pmapped: one count per device.
    counters = (np.max(count), _total(s.num_bad_grads) // devices,
                _total(s.num_nonfinite_params) // devices,
                _total(s.num_bad_damping) // devices,
                _total(s.num_bad_updates) // devices)
    blocks = [c // devices for c in _block_counts(s.blocks)]
    clipped = _total(s.num_clipped) // devices
    totals += np.array(list(counters) + blocks + [clipped], np.int64)
    first = np.asarray(s.param_norm_first, np.float64).ravel()
    last = np.asarray(s.param_norm, np.float64).ravel()
    with np.errstate(divide="ignore", invalid="ignore"):
      ratio = np.where(first > 0, last / np.where(first > 0, first, 1), 1.0)
    if np.max(count) > 0:
      ratio = np.where(np.isfinite(last), ratio, np.inf)
      growth = max(growth, float(np.max(ratio)))
  *counts, clipped = (int(t) for t in totals)
  return Health(*counts, **extra, clipped=clipped, param_growth=growth)
