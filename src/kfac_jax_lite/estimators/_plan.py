"""The plan: how often ``kfl.kfac`` computes statistics and refreshes its
inverses, chosen from the cost model (``_cost``) and the model's shapes so
that the mean step over a refresh period stays within a budget.

With the blocks' FLOPs at the example batch (``describe``'s rows) summed
into SGD's share ``W``, the statistics of one update ``S`` (on the
``stats_fraction`` share, with their own forward pass: the dearer of the
two step styles), the preconditioning ``P`` (every step) and one refresh
``R``, statistics every ``K`` steps and a refresh every ``T`` cost, per
step and in SGD steps,

    price(K, T) = 1 + (S / K + P + R / T) / W.

The plan takes the smallest ``T`` of ``INVERSE_EVERY``, then the smallest
``K ≤ T`` of ``COV_EVERY``, whose price is at most the budget: fresh
inverses first (they are what the preconditioner uses), then statistics as
often as the budget leaves room for. The preconditioning is paid every
step whatever the plan, so ``1 + P / W`` is the floor; where the floor
leaves less than ``MIN_SHARE`` of the budget's overhead ``budget − 1``, the
plan prices against ``floor + MIN_SHARE·(budget − 1)`` instead (the
statistics and refresh still get their share, the budget is reported as
not met), and where nothing fits, the sparsest pair.

``kfl.kfac_optimizer`` pays every step for its quadratic model too
(``Q``, ``_cost.quadratic_model``): its price adds ``Q / W`` and so does its
floor, ``1 + (Q + P) / W``; its budget, unless given, is that floor plus
``DEFAULT_BUDGET − 1``: the statistics and the refresh get the same 0.3
SGD steps as ``kfl.kfac``'s, on top of the work the optimizer does every
step whatever the plan (a given budget's overhead is ``budget − 1 −
Q/W``). It plans only where asked (``cov_every=None`` or
``inverse_every=None``; its docstring has the measurements): on the MNIST
autoencoder at batch 1000, with the model on a quarter of the batch, the
plan is statistics and a refresh every 10 steps, the best of ``cov_every``
1, 10, 50 × ``inverse_every`` 10, 50 by time to Adam's loss (30.1 s
against 32.6 s for its default every-step statistics, 34.9-37.3 s for
the sparser pairs), but sparser statistics broke a small-batch MLP's run.

Horizon. Statistics every ``K`` steps on the whole batch average as many
examples per update as every step does, so the EMA's decay ``β`` is kept:
its effective number of examples ``M·(1 + β)/(1 − β)`` (the variance of
the averaged statistics; ``M`` per update) is the same, and its span in
steps is ``K`` times longer. The young refreshes (steps 1, 2, 4, ...
below ``T``: ``is_refresh_step``) stay, so the first inverses follow the
first statistics.
"""
from __future__ import annotations

from typing import NamedTuple

from kfac_jax_lite.estimators import _cost

DEFAULT_BUDGET = 1.3
"""``kfl.kfac``'s ``budget``: the planned mean step, in SGD steps."""
INVERSE_EVERY = (10, 20, 50, 100)
"""The refresh intervals the plan chooses from, in order of preference."""
COV_EVERY = (1, 2, 5, 10, 20, 50, 100)
"""The statistics intervals the plan chooses from (at most ``T``)."""
MIN_SHARE = 0.25
"""The least share of ``budget − 1`` the statistics and the refresh are
priced against when the preconditioning alone takes more."""


class Plan(NamedTuple):
  """What the plan chose and what the cost model predicts for it.

  Attributes:
    cov_every: ``K``, statistics every ``K`` steps.
    inverse_every: ``T``, a refresh every ``T`` steps.
    budget: the budget it was planned for (SGD steps), or None when both
      intervals were given.
    price: the predicted mean step, in SGD steps (None without an SGD share).
    every_step: the price with statistics every step and a refresh every
      10 (the fixed defaults before the plan).
    floor: the price of the preconditioning alone (``1 + P / W``).
    planned: the names of the options the plan chose (the others given).
    partition: where the floor is over the budget, ``(side_block, kinds,
      floor)``: the Kronecker blocks of those layer kinds partitioned by
      ``side_block`` (``blocks={kind: {"side_block": ...}}``) would bring
      the floor to ``floor`` (the largest of ``PARTITIONS`` whose floor
      leaves the statistics and refresh their share, else the one with
      the lowest floor); None otherwise (``plan_for`` sets it).
    model: ``kfl.kfac_optimizer``'s quadratic model every step, in SGD
      steps (``Q / W``, part of ``price``, ``every_step`` and ``floor``);
      None for ``kfl.kfac``.
    refresh_name: the refresh interval's name in ``line`` (the planned
      optimizer's: ``"refresh_every"`` for ``kfl.eigen_adam``); ``planned``
      says ``"inverse_every"`` whatever it is.
  """

  cov_every: int
  inverse_every: int
  budget: float | None
  price: float | None
  every_step: float | None
  floor: float | None
  planned: tuple
  partition: tuple | None = None
  model: float | None = None
  refresh_name: str = "inverse_every"

  @property
  def met(self) -> bool:
    """Whether the predicted price is within the budget."""
    return (self.budget is None or self.price is None
            or self.price <= self.budget + 1e-9)

  @property
  def line(self) -> str:
    """``plan: statistics every 5 steps, refresh every 20 (planned for
    budget 1.3: ~1.25x an SGD step; every-step statistics ~2.7x; floor
    1.05x)``."""
    what = (f"plan: statistics every {self.cov_every} step"
            f"{'s' if self.cov_every > 1 else ''}, refresh every "
            f"{self.inverse_every}")
    if self.price is None:
      return what + " (no SGD share known: nothing to plan against)"
    name = lambda n: self.refresh_name if n == "inverse_every" else n
    given = [name(n) for n in ("cov_every", "inverse_every")
             if n not in self.planned]
    planned = [name(n) for n in self.planned]
    how = (f"planned ({', '.join(planned)}) for budget "
           f"{self.budget:.3g}" if self.planned else "as given")
    if given and self.planned:
      how += f", {', '.join(given)} given"
    alone = ("the preconditioning alone costs" if self.model is None else
             "the quadratic model and the preconditioning alone cost")
    verdict = "" if self.met else (
        f"; the budget is NOT met: {alone} {self.floor:.2f}x every step")
    if not self.met and self.partition is not None:
      side_block, kinds, floor = self.partition
      option = ", ".join(f"{k!r}: {{'side_block': {side_block}}}"
                         for k in kinds)
      verdict += (f"; blocks={{{option}}} partitions the factor sides: "
                  f"floor {floor:.2f}x")
    if self.model is not None:
      how += f"; quadratic model {self.model:.2f}x every step"
    return (f"{what} ({how}: ~{self.price:.2f}x an SGD step; every-step "
            f"statistics ~{self.every_step:.2f}x; floor {self.floor:.2f}x"
            f"{verdict})")


PARTITIONS = (512, 256, 128)
"""The ``side_block`` values a plan over its budget suggests
(``Plan.partition``), largest first."""


def floor(flops, model_fraction: float | None = None) -> float | None:
  """The price of the preconditioning alone, ``1 + P / W`` (with
  ``model_fraction``, ``kfl.kfac_optimizer``'s: ``1 + (Q + P) / W``; None
  without an SGD share)."""
  w, _, p, _ = _parts(flops)
  return 1 + (_model_flops(w, model_fraction) + p) / w if w else None


def _model_flops(w, model_fraction):
  """``Q``: ``kfl.kfac_optimizer``'s quadratic model for an SGD share
  ``w`` (0 for ``kfl.kfac``, ``model_fraction`` None)."""
  return 0.0 if model_fraction is None else _cost.quadratic_model(
      w, model_fraction)


def _parts(flops):
  """``(W, S, P, R)``: SGD's share, one update's statistics, the
  preconditioning and one refresh, summed over blocks priced at
  ``K = T = 1``."""
  total = _cost.price(flops).flops
  return total.sgd, total.statistics, total.precondition, total.refresh


def plan(flops, *, budget: float | None = DEFAULT_BUDGET,
         cov_every: int | None = None,
         inverse_every: int | None = None,
         model_fraction: float | None = None) -> Plan:
  """The ``Plan`` for blocks priced ``flops`` (``_cost.Flops`` per block at
  ``cov_every = inverse_every = 1``; module docstring).

  Args:
    flops: the blocks' ``Flops`` at ``K = T = 1``.
    budget: the mean step allowed, in SGD steps (> 1); None: the floor
      plus ``DEFAULT_BUDGET − 1`` (``kfl.kfac_optimizer``'s and
      ``kfl.eigen_adam``'s default), priced against as it is (above the
      floor by construction, so not raised by ``MIN_SHARE``).
    cov_every: ``K`` when given (then only ``T`` is planned).
    inverse_every: ``T`` when given (then only ``K`` is planned).
    model_fraction: ``kfl.kfac_optimizer``'s plan, its quadratic model on
      this share of the batch (``_cost.quadratic_model``) paid every step;
      None: ``kfl.kfac``'s.
  """
  w, s, p, r = _parts(flops)
  q = _model_flops(w, model_fraction)
  model = None if model_fraction is None or not w else q / w
  planned = tuple(n for n, v in (("cov_every", cov_every),
                                 ("inverse_every", inverse_every))
                  if v is None)
  price = (lambda k, t: 1 + (q + s / k + p + r / t) / w) if w else None
  ts = INVERSE_EVERY if inverse_every is None else (inverse_every,)
  pairs = [(k, t) for t in ts
           for k in (COV_EVERY if cov_every is None else (cov_every,))
           if cov_every is not None or k <= t]
  if price is None or not planned:
    k, t = (cov_every or 1, inverse_every or INVERSE_EVERY[0])
    if price is None:
      return Plan(k, t, budget, None, None, None, planned, model=model)
    return Plan(k, t, None, price(k, t), price(1, 10), 1 + (q + p) / w, (),
                model=model)
  floor = 1 + (q + p) / w
  if budget is None:  # Over the floor by construction: not raised.
    budget = target = floor + (DEFAULT_BUDGET - 1)
  else:
    target = max(budget, floor + MIN_SHARE * (budget - 1 - q / w))
  k, t = next((pair for pair in pairs if price(*pair) <= target),
              max(pairs, key=lambda kt: (kt[1], kt[0])))
  return Plan(k, t, budget, price(k, t), price(1, 10), floor, planned,
              model=model)
