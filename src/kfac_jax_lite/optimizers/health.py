"""``kfl.health(state)``: the health counters of a K-FAC state, in one line.

K-FAC never raises inside a jitted step: what goes wrong is skipped and
counted in the state (``kfl.kfac``'s module docstring lists the fallbacks).
``health`` finds the K-FAC state inside any optimizer state (an
``optax.chain``, ``inject_hyperparams``, ``MultiSteps``, a
``kfl.kfac_optimizer`` state, a pmapped state with a device axis) and sums
the counters, so a run can be checked with one line::

    print(kfl.health(opt_state))
    # kfac: 300 steps | bad grads 0 | non-finite params 0 | bad damping 0 | ...

Besides the skip counters it judges what the state keeps of the run's
course (``_health_state``): the parameters' growth (the total norm and
each leaf's) and, from the losses the transform saw (``update(...,
loss=)``, or its statistics pass on ``batch=``) or a sequence passed as
``health(state, losses=...)``, whether the loss made progress.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Optional

import jax
import numpy as np
import optax
from jax.typing import ArrayLike

from kfac_jax_lite import factor as fac
from kfac_jax_lite.optimizers import _find
from kfac_jax_lite.optimizers import _health_state
from kfac_jax_lite.optimizers import _pending
from kfac_jax_lite.optimizers import eigen_adam
from kfac_jax_lite.optimizers import optimizer
from kfac_jax_lite.optimizers import sharding
from kfac_jax_lite.optimizers import transform


# A run whose parameter norm grew more than this many times since its first
# update is reported as blown up. Issue 24's runs that did not learn grew
# their weights while every counter stayed 0. On benchmarks/robustness.py
# (digits, batch 128) the runs at lr 0.01 grew 1.4-3.7x in 100 or 300
# steps, at lr 0.03 2.4-8.9x (all trained), at lr 0.1 8-14x in 100 steps
# (benchmarks/results/robustness_issue24_health.txt). Growth alone does not
# separate a run that learns slowly from one that fails (the Haiku conv net
# with weight decay in the loss failed at lr 0.1 growing 8x): the limit is
# set above every run that trained there. On all seven models
# (robustness_issue24_stall.txt) it also flags runs that trained: at lr 0.1
# the jax MLP (10.5x), the Haiku LSTM (12x) and the Equinox MLP (18.6x) in
# 100 steps, the Equinox MLP at lr 0.03 (10.1x) in 300; the two that failed
# are flagged as stalled by their loss (below) whatever their growth.
PARAM_GROWTH_LIMIT = 10.0

# The largest growth of one leaf (leaves that start at zero, biases, are
# left out) is shown, not judged: issue 24's stalled LSTM LM grew its first
# layer to weights of 8.8 while the total stayed lower, but on
# benchmarks/robustness.py (benchmarks/results/robustness_issue24_stall.txt)
# runs that trained grew one leaf up to 40.5x at lr 0.03 (300 steps) and
# 102x at lr 0.1 (the nnx attention block), more than the runs that failed
# (11.2x and 17.5x): no limit separates them. The loss does (below).

# Stall: after at least STALL_MIN_LOSSES losses, a run whose recent loss
# (an EMA over about the last 10) is not below its starting loss (the mean
# of the first 10) by STALL_MIN_DROP of the starting loss's magnitude has
# made no progress. Issue 24's runs that stalled stayed within a fraction
# of a per cent of their start (an LM at ln 32 = 3.47 for 200 steps). On
# benchmarks/robustness.py (robustness_issue24_stall.txt) every run that
# trained went from its start (the mean of its first 10 losses, 0.82-2.26)
# to at most a third of it in 100 steps, and the two that did not train
# (Haiku conv nets at lr 0.1) went 1.208 -> 1.218 and 1.328 -> 2.346: both
# are flagged, no run that trained is. The averages over 10 losses keep one
# minibatch's noise (a few per cent) from deciding. A run started near its
# optimum (fine-tuning with a fresh state) can be reported as stalled:
# check it against the loss you expect.
STALL_MIN_LOSSES = 100
STALL_MIN_DROP = 0.01

# Rebound (issue 36): a run whose recent loss (the EMA) is above its best
# EMA by more than REBOUND_LIMIT of the progress it had made (start - best)
# has given most of it back. kfac_optimizer(model_fraction=1/4) on a
# standardised-digits MLP 64-100-100-10 at batch 32 went 2.43 -> 0.37 ->
# 91.6 and ended at 2.14 with every counter 0 and health "ok" (below its
# start, under 3x it, parameters within 10x). Minibatch noise on the EMA is
# a few per cent of the loss, far under half the progress; a run that
# recovers from a spike is judged where it ended.
REBOUND_LIMIT = 0.5

# ---- issue 38: rising losses and runs that recovered (kept apart from the
# state finder above, which issue 37 extends).
# Rise: a run whose recent loss (the EMA) is above its reference (the
# smaller of the first loss seen and the mean of the first 10) by more than
# LOSS_RISE_LIMIT times the reference's magnitude is failing, from the
# second loss on: issue 38's held-out runs that blew up went 2.99 -> 59.1
# and 4.96 -> 9.5e5 while health said "ok" (one leaf had grown 162x; the
# total norm stayed under PARAM_GROWTH_LIMIT). A run that trains lowers its
# loss (every run of benchmarks/robustness.py ended at most a third of its
# start, see STALL_MIN_DROP's comment), so its EMA never reaches 3x its
# start; minibatch noise is a few per cent. A loss that starts near 0 (a
# fine-tuned regression) is judged against max(|reference|, 1e-8).
LOSS_RISE_LIMIT = 2.0
# Recovered: a run with skipped or replaced updates whose latest one is at
# least RECOVERY_STEPS updates back, whose parameters stayed finite, whose
# blocks are all preconditioned and which neither blew up, stalled nor
# rose, reads "recovered after 1 bad batch at step 40" rather than
# PROBLEMS; ``Health.ok`` stays False (something did happen), and
# ``Health.failing`` is False.
RECOVERY_STEPS = 10
# Scale (issue 38, goal 4). The defaults assume a loss of order 1 (a mean
# over examples of a cross-entropy or a squared error of standardised
# targets) and layer inputs of order 1 (standardised features, the
# activations of a usual net): ``damping`` is absolute in the factors'
# units (π-damping adds π√λ to A and √λ/π to G: inputs x c scale A by c²,
# so the damping's share of A moves by 1/c), and ``norm_constraint``
# bounds ⟨u, g⟩, which a loss scaled by s scales by s. Inputs x 1e-6 then
# stall (the damping swamps A), x 1e6 blow up (it falls below float32's
# resolution of G), a loss x 1e8 (fp16 loss scaling) stalls under the KL
# clip, x 1e-8 under the damping. A run is flagged OUT OF SCALE when the
# first loss seen is outside LOSS_SCALE (by magnitude), or when an input
# factor's median diagonal (the median second moment of a layer's inputs,
# the bias's constant 1 among them) is outside INPUT_SCALE. The bounds are
# 1e4 away from the defaults' scale: at ln 10 = 2.3 a classifier's first
# loss, 0.1-300 the digits inputs' second moments (pixels 0-16).
LOSS_SCALE = (1e-4, 1e4)
INPUT_SCALE = (1e-8, 1e8)


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
  ``leaf_growth``/``leaf``: the largest such ratio of one parameter leaf
  (leaves that start at zero left out) and its index in
  ``jax.tree.leaves(params)`` (shown, not judged: see
  the comment above ``STALL_MIN_LOSSES``). ``num_losses``, ``loss_start``,
  ``loss_recent``: the losses seen, the mean of the first 10 and the EMA
  of the latest (``_health_state``; None when none was seen);
  ``loss_best``: the EMA's lowest value from the 10th loss on.
  ``missing``: updates skipped because nothing was stored for them
  (``kfl.with_batch``/``kfl.with_stats``) where that was only known at
  run time (``optimizers._pending``); printed only when not 0.

  A run is also not ``ok`` when its parameters' norm grew more than
  ``PARAM_GROWTH_LIMIT`` times since the first update: a run that blows up
  its weights while every step is finite (issue 24); or when it
  ``stalled``: after ``STALL_MIN_LOSSES`` losses the recent one is not
  ``STALL_MIN_DROP`` below the start; or when it ``rebounded``: the
  recent loss gave back more than ``REBOUND_LIMIT`` of the progress from
  the start to the best (the comments above give the thresholds'
  reasons). ``clipped`` is shown
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
  leaf_growth: float = 1.0
  leaf: Optional[int] = None
  num_losses: int = 0
  loss_start: Optional[float] = None
  loss_recent: Optional[float] = None
  bad_losses: int = 0
  bad_inputs: int = 0
  first_bad: Optional[int] = None
  last_bad: Optional[int] = None
  loss_first: Optional[float] = None
  input_scale: Optional[tuple] = None
  loss_best: Optional[float] = None
  missing: int = 0

  @property
  def out_of_scale(self) -> Optional[str]:
    """Why the run is outside the scale the defaults assume (``LOSS_SCALE``,
    ``INPUT_SCALE``), or None."""
    lo, hi = LOSS_SCALE
    if self.loss_first is not None and self.loss_first != 0 and not (
        lo <= abs(self.loss_first) <= hi):
      return (f"first loss {self.loss_first:.3g}: scale damping and "
              "norm_constraint with the loss, or unscale it")
    lo, hi = INPUT_SCALE
    if self.input_scale is not None:
      small, large = self.input_scale
      if not (lo <= small and large <= hi):
        return (f"layer inputs' second moments {small:.3g}-{large:.3g}: "
                "standardise the inputs, or scale damping with them")
    return None

  @property
  def rose(self) -> bool:
    """The recent loss is above the smaller of the first loss and the
    starting mean by more than ``LOSS_RISE_LIMIT`` times its magnitude
    (from the second loss on)."""
    if self.num_losses < 2 or self.loss_recent is None:
      return False
    refs = [x for x in (self.loss_first, self.loss_start) if x is not None]
    ref = min(refs)
    return not self.loss_recent <= ref + LOSS_RISE_LIMIT * max(abs(ref), 1e-8)

  @property
  def rebounded(self) -> bool:
    """The recent loss is above the best (``loss_best``) by more than
    ``REBOUND_LIMIT`` of the progress from the start to the best."""
    if (self.loss_best is None or self.loss_start is None
        or self.loss_recent is None
        or self.num_losses <= _health_state.LOSS_START_WINDOW):
      return False
    progress = self.loss_start - self.loss_best
    return progress > 0 and not (
        self.loss_recent - self.loss_best <= REBOUND_LIMIT * progress)

  @property
  def bad_events(self) -> int:
    """Updates skipped or replaced: bad gradients, losses, inputs, damping
    and updates, and updates with nothing stored (``missing``)."""
    return (self.bad_grads + self.bad_losses + self.bad_inputs
            + self.bad_damping + self.bad_updates + self.missing)

  @property
  def recovered(self) -> bool:
    """Something was skipped (``bad_events``, skipped statistics or failed
    inverses), the latest skipped update is ``RECOVERY_STEPS`` or more
    updates back, and the run is sound now: finite parameters, every block
    preconditioned, no blow-up, stall or rise."""
    happened = self.bad_events or self.skipped_stats or self.failed_inverses
    return bool(happened and self.last_bad is not None
                and self.steps - 1 - self.last_bad >= RECOVERY_STEPS
                and not (self.nonfinite_params or self.unready_blocks
                         or self.blew_up or self.stalled or self.rose
                         or self.rebounded))

  @property
  def failing(self) -> bool:
    """Not ``ok`` and not ``recovered``."""
    return not (self.ok or self.recovered)

  def _head(self) -> str:
    if self.ok:
      return "kfac: ok"
    if not self.recovered:
      return "kfac: PROBLEMS"
    n = self.bad_events or self.skipped_stats or self.failed_inverses
    what = f"{n} bad batch" + ("es" if n != 1 else "")
    where = (f"at step {self.first_bad}" if self.first_bad == self.last_bad
             else f"at steps {self.first_bad}-{self.last_bad}")
    return f"kfac: recovered after {what} {where}"

  @property
  def blew_up(self) -> bool:
    """The parameters' norm grew more than ``PARAM_GROWTH_LIMIT`` times."""
    return not self.param_growth <= PARAM_GROWTH_LIMIT

  @property
  def stalled(self) -> bool:
    """After ``STALL_MIN_LOSSES`` finite losses, the recent loss is not
    below the starting one by ``STALL_MIN_DROP`` of its magnitude."""
    if (self.num_losses < STALL_MIN_LOSSES or self.loss_start is None
        or self.loss_recent is None):
      return False
    target = self.loss_start - STALL_MIN_DROP * abs(self.loss_start)
    return not self.loss_recent < target

  @property
  def ok(self) -> bool:
    """No step was skipped or replaced, every block is preconditioned,
    the parameters did not blow up and the loss did not stall."""
    return not (self.bad_grads or self.nonfinite_params or self.bad_damping
                or self.bad_updates or self.skipped_stats
                or self.failed_inverses or self.unready_blocks
                or self.blew_up or self.stalled or self.bad_losses
                or self.bad_inputs or self.rose or self.rebounded
                or self.out_of_scale or self.missing)

  def __str__(self):
    parts = [self._head(), f"{self.steps} steps"]
    if self.missing:
      parts.append(f"NOTHING STORED for {self.missing} updates (skipped: "
                   "call kfl.with_batch or kfl.with_stats in the step, "
                   "before the update)")
    parts += [f"bad grads {self.bad_grads}",
              f"bad losses {self.bad_losses}",
              f"bad inputs {self.bad_inputs}",
              f"non-finite params {self.nonfinite_params}",
              f"bad damping {self.bad_damping}",
              f"bad updates {self.bad_updates}",
              f"skipped stats {self.skipped_stats}",
              f"failed inverses {self.failed_inverses}",
              f"unready blocks {self.unready_blocks}",
              f"clipped {self.clipped}",
              f"param growth {self.param_growth:.3g}x" + (
                  "" if self.leaf is None else
                  f", leaf {self.leaf} {self.leaf_growth:.3g}x")
              + (" (BLEW UP)" if self.blew_up else ""), self._loss_part()]
    for name in ("damping", "rho", "learning_rate", "momentum"):
      value = getattr(self, name)
      if value is not None:
        parts.append(f"{name.replace('_', ' ')} {value:.3g}")
    return " | ".join(parts)

  def _loss_part(self):
    if not self.num_losses:
      return "loss not seen"
    part = (f"loss {self.loss_start:.4g} -> {self.loss_recent:.4g} over "
            f"{self.num_losses}")
    return part + (" (STALLED)" if self.stalled else "") + (
        " (LOSS ROSE)" if self.rose else "") + (
            f" (LOSS REBOUNDED: its best was {self.loss_best:.4g})"
            if self.rebounded else "") + (
            f" (OUT OF SCALE: {self.out_of_scale})" if self.out_of_scale
            else "")

  __repr__ = __str__


def loss_course(losses):
  """``(num_losses, loss_start, loss_recent, loss_best)`` of a sequence
  of losses, by ``_health_state``'s recurrences (the mean of the first
  ``LOSS_START_WINDOW``, the EMA of decay ``LOSS_DECAY``, its lowest value
  from the ``LOSS_START_WINDOW``-th loss on; non-finite losses left out, as
  the state leaves them out)."""
  values = [float(x) for x in np.asarray(losses, np.float64).ravel()
            if np.isfinite(x)]
  if not values:
    return 0, None, None, None
  window = _health_state.LOSS_START_WINDOW
  start = float(np.mean(values[:window]))
  recent, best = values[0], None
  for i, x in enumerate(values):
    if i:
      recent = _health_state.LOSS_DECAY * recent + (
          1 - _health_state.LOSS_DECAY) * x
    if i + 1 >= window:
      best = recent if best is None else min(best, recent)
  return len(values), start, recent, best


_KINDS = (optimizer.KfacOptimizerState, transform.KfacState,
          eigen_adam.EigenAdamState)


def _guard_view(s):
  """An ``EigenAdamState`` as the ``KfacState`` fields ``health`` reads
  (issue 38: ``eigen_adam``'s guard keeps the same counters; it has no
  damping to refuse). Other states are returned as they are."""
  if not isinstance(s, eigen_adam.EigenAdamState):
    return s
  if s.health is None:
    raise ValueError("kfl.health: this eigen_adam state has no health "
                     "counters (made by an older version): call tx.init")
  return transform.KfacState(
      count=s.count, key=s.key, blocks=s.blocks,
      num_bad_grads=s.num_bad_grads, num_bad_updates=s.num_bad_updates,
      num_bad_damping=np.zeros_like(np.asarray(s.num_bad_grads)),
      num_nonfinite_params=s.num_nonfinite_params, health=s.health,
      stats_due=s.stats_due)


def _input_scale(found):
  """``(smallest, largest)`` median diagonal of the input factors (``a``)
  of the states' blocks, or None (no such factor with statistics)."""
  medians = []
  for s in found:
    blocks = (sharding.unshard_blocks(s.blocks)
              if isinstance(s.blocks, sharding.ShardedBlocks) else s.blocks)
    for block in blocks.values():
      a = getattr(block, "a", None)
      if a is None or not _is_factor(a):
        continue
      cov, w = np.asarray(a.cov, np.float64), np.asarray(a.weight, np.float64)
      if cov.ndim < 2 or cov.shape[-1] != cov.shape[-2] or not np.all(w > 0):
        continue
      diag = np.diagonal(cov, axis1=-2, axis2=-1) / w.reshape(
          w.shape + (1,) * (cov.ndim - 1 - w.ndim))
      if np.all(np.isfinite(diag)):
        medians.append(float(np.median(diag)))
  return (min(medians), max(medians)) if medians else None


def _events(found):
  """``(bad losses, bad inputs, first bad step or None, last bad step or
  None)`` over the states ``found`` (devices counted once)."""
  losses = inputs = 0
  first, last = [], []
  for s in found:
    h = s.health
    devices = np.asarray(s.count).size
    losses += _total(h.num_bad_losses) // devices
    inputs += _total(h.num_bad_inputs) // devices
    f, l = np.asarray(h.first_bad).ravel(), np.asarray(h.last_bad).ravel()
    first += [int(x) for x in f if x >= 0]
    last += [int(x) for x in l if x >= 0]
  return (losses, inputs, min(first) if first else None,
          max(last) if last else None)


def _missing(s) -> int:
  """Updates of the state ``s`` skipped with nothing stored (its slot's
  ``num_missing``; devices counted once)."""
  slot = getattr(s, "pending", None)
  if not isinstance(slot, _pending.Pending) or slot.num_missing is None:
    return 0
  count = (s.kfac if isinstance(s, optimizer.KfacOptimizerState) else s).count
  return _total(slot.num_missing) // np.asarray(count).size


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


def health(state: optax.OptState,
           losses: ArrayLike | Sequence[float] | None = None) -> Health:
  """The health counters of every K-FAC state inside ``state``, summed.

  ``state`` is any pytree holding ``kfl.kfac``, ``kfl.kfac_optimizer`` or
  ``kfl.eigen_adam`` states (e.g. the state of ``optax.chain(kfl.kfac(...),
  ...)``), nested in any optax combinator (``MultiSteps``,
  ``inject_hyperparams``, ``apply_if_finite``, ``multi_transform``, ...),
  its leaves in flax wrappers or not (``nnx.Optimizer``'s ``opt_state``);
  an ``eigen_adam`` state gives the same counters as ``kfl.kfac``'s but
  the damping's and the clip's, which it has none of. Prints
  as one line; ``.ok`` is False when any counter is non-zero, the
  parameters blew up (``Health.blew_up``) or the loss stalled
  (``Health.stalled``). A pmapped state (a leading device axis) counts its
  devices' steps once. ``losses``: the run's losses in order (any
  sequence of scalars), judged instead of those the state kept (which
  has them only when ``update`` got ``loss=`` or ``batch=``).
  """
  found = _find.states(state, _KINDS)
  if not found:
    raise ValueError("kfl.health: no kfl.kfac, kfl.kfac_optimizer or "
                     f"kfl.eigen_adam state found in {type(state).__name__}")
  missing = sum(_missing(x) for x in found)
  found = [_guard_view(x) for x in found]
  events = _events([x.kfac if isinstance(x, optimizer.KfacOptimizerState)
                    else x for x in found])
  totals = np.zeros(9, np.int64)
  extra = {}
  growth, leaf_growth, leaf, course = 1.0, 1.0, None, (0, None, None, None)
  loss_first = None
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
    if isinstance(s.blocks, sharding.ShardedBlocks):  # Each block once.
      blocks = list(_block_counts(sharding.unshard_blocks(s.blocks)))
    else:
      blocks = [c // devices for c in _block_counts(s.blocks)]
    h = s.health
    clipped = _total(h.num_clipped) // devices
    totals += np.array(list(counters) + blocks + [clipped], np.int64)
    if np.max(count) > 0:
      growth = max(growth, float(np.max(_growth(h.param_norm_first,
                                                h.param_norm))))
      ratios = _growth(h.leaf_norm_first, h.leaf_norm)
      ratios = ratios.reshape(-1, ratios.shape[-1]).max(0)
      if ratios.size and float(np.max(ratios)) > leaf_growth:
        leaf, leaf_growth = int(np.argmax(ratios)), float(np.max(ratios))
    n = int(np.asarray(h.num_losses).ravel()[0])
    if n > course[0]:
      course = (n, _first(h.loss_start), _first(h.loss_recent),
                _first(h.loss_best))
      loss_first = _first(h.loss_first)
  if losses is not None:
    course = loss_course(losses)
    finite = np.asarray(losses, np.float64).ravel()
    finite = finite[np.isfinite(finite)]
    loss_first = float(finite[0]) if finite.size else None
  *counts, clipped = (int(t) for t in totals)
  return Health(*counts, **extra, clipped=clipped, param_growth=growth,
                leaf_growth=leaf_growth, leaf=leaf, num_losses=course[0],
                loss_start=course[1], loss_recent=course[2],
                loss_best=course[3],
                bad_losses=events[0], bad_inputs=events[1],
                first_bad=events[2], last_bad=events[3],
                loss_first=loss_first,
                input_scale=_input_scale(
                    [x.kfac if isinstance(x, optimizer.KfacOptimizerState)
                     else x for x in found]), missing=missing)


def _growth(first, last):
  """``last / first`` where ``first > 0`` (1 elsewhere; inf where ``last``
  is not finite)."""
  first = np.asarray(first, np.float64)
  last = np.asarray(last, np.float64)
  with np.errstate(divide="ignore", invalid="ignore"):
    ratio = np.where(first > 0, last / np.where(first > 0, first, 1), 1.0)
  return np.where(np.isfinite(last), ratio, np.inf)
