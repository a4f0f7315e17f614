"""``describe``: the blocks of a model as a list of rows that prints as a table."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import dataclasses
import math
import typing
from typing import Any

import chex

from kfac_jax_lite import blocks as B
from kfac_jax_lite import tagging
from kfac_jax_lite import factor as fac
from kfac_jax_lite.estimators import _cost
from kfac_jax_lite.estimators import _first_step
from kfac_jax_lite.estimators import _fraction
from kfac_jax_lite.estimators import _plan
from kfac_jax_lite.estimators._checks import (
    check_estimation, check_has_loss, partial_loss)


class Row(dict):
  """One block: ``name``, ``kind``, ``block``, ``params``, ``factors``
  (factor shapes), ``sharing`` (the weight-sharing convention of a
  Kronecker block: ``"expand"``/``"reduce"``, ``"expand (rows)"`` for a
  layer whose input rows are the uses, ``"-"`` otherwise), ``bytes`` (state
  bytes), ``param_bytes`` (its parameters' bytes in float32), ``uses``,
  ``stack``, ``notes`` (the fallback reason for fallbacks; what the size
  policy made diagonal, ``size_note``), ``positions`` (rows per example the parameters write, all
  uses, scan steps and slices: ``TaggedLoss.positions``; None for a
  fallback) and ``flops`` (the block's price per step, an
  ``estimators._cost.Flops``: ``sgd``, ``statistics``, ``precondition``,
  ``refresh``). Fields read as keys or attributes."""

  __getattr__ = dict.__getitem__


class Table(list):
  """A list of ``Row``s whose ``str`` is an aligned text table."""

  COLUMNS = ("name", "kind", "block", "params", "factors", "sharing", "bytes",
             "uses", "notes")

  def __str__(self):
    def cell(row, c):
      v = row[c]
      if c == "params":
        return ", ".join(v)
      if c == "factors":
        return " ⊗ ".join("x".join(map(str, s)) for s in v) or "-"
      if c == "block" and row["stack"]:
        return f"{v}[×{row['stack']}]"
      return "" if v is None else str(v)
    cells = [[cell(r, c) for c in self.COLUMNS] for r in self]
    widths = [max([len(c)] + [len(r[i]) for r in cells])
              for i, c in enumerate(self.COLUMNS)]
    line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()
    out = [line(self.COLUMNS), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    total = self.total_bytes
    params = sum(r.get("param_bytes", 0) for r in self)
    ratio = f", {total / params:.2f}x the parameters'" if params else ""
    big = sorted(self, key=lambda r: -r["bytes"])[:3]
    largest = ("; largest: " + ", ".join(
        f"{r['name']} {human_bytes(r['bytes'])}" for r in big)) if big else ""
    out.append(f"{len(self)} blocks, {total} bytes of state "
               f"({total / 2**20:.1f} MiB{ratio}{largest})")
    if self.price_line:
      out.append(self.price_line)
    if self.plan is not None:
      out.append(self.plan.line)
    out += self.loss_lines
    if self.first_step:
      out.append(f"first step: refused: {self.first_step}")
    return "\n".join(out)

  #: One line per registered loss found in the trace, or one saying none was
  #: found and what that means for each estimation (set by ``rows``).
  loss_lines: tuple = ()
  #: The error the first K-FAC step on the example batch would raise (what
  #: ``kfl.kfac`` refuses at ``tx.init``), or None (set by ``describe``).
  first_step: str | None = None
  #: The settings the rows' ``flops`` were priced at (set by ``describe``).
  price_settings: str = ""
  #: The statistics and refresh intervals ``kfl.kfac`` plans for these
  #: blocks (``_plan.Plan``; set by ``describe``).
  plan: _plan.Plan | None = None

  @property
  def price(self) -> _cost.Price:
    """The step's price summed over the rows (``_cost.Price``: the
    FLOPs, K-FAC's step over SGD's and each piece's share of SGD's)."""
    return _cost.price([r["flops"] for r in self if r.get("flops")])

  @property
  def price_line(self) -> str:
    """``step price: ~2.9x an SGD step (statistics 0.8x, ...)``; empty
    for a table without prices."""
    if not self.price_settings:
      return ""
    p = self.price
    if p.ratio is None:
      f = p.flops
      return (f"step price: no SGD share known (fallbacks only): "
              f"statistics {f.statistics:.3g}, preconditioning "
              f"{f.precondition:.3g}, refresh {f.refresh:.3g} FLOPs per step "
              f"at {self.price_settings}")
    return (f"step price: ~{p.ratio:.2f}x an SGD step of these layers' FLOPs "
            f"(statistics {p.statistics:.2f}x, preconditioning "
            f"{p.precondition:.2f}x, refresh {p.refresh:.2f}x per step at "
            f"{self.price_settings})")

  @property
  def total_bytes(self):
    """Bytes of the curvature state of all blocks (the total line)."""
    return sum(r["bytes"] for r in self)

  __repr__ = __str__


def rows(tagged, pricing=None):
  """The rows of a ``TaggedLoss`` whose layers have their blocks, priced
  with ``pricing`` (keyword arguments of ``block_flops`` but the layer's;
  None: ``flops`` None)."""
  table = Table()
  for l in tagged.layers:
    block = B.as_block(l.block).one_slice
    positions = tagged.positions(l)
    notes = "; ".join(n for n in (l.notes, size_note(block, l.stack)) if n)
    row = Row(
        name=l.name, kind=l.kind, block=type(block).__name__,
        params=tuple(l.params),
        factors=tuple(tuple(s) for s in block.factor_shapes),
        sharing=_sharing(l, block), bytes=B.state_bytes(l.block),
        param_bytes=4 * sum(math.prod(s) for s in l.block.param_shapes),
        uses=l.uses, stack=l.stack, notes=notes, positions=positions)
    row["flops"] = (None if pricing is None else
                    block_flops(row, l, block, **pricing))
    table.append(row)
  table.loss_lines = loss_lines(tagged)
  return table


def size_note(block, stack=None):
  """What the size policy did to a Kronecker ``block`` (one slice): each
  side kept as its diagonal because it is over ``max_dense_side``
  (``blocks.MAX_DENSE_SIDE``), with what the dense side would have cost,
  and each side partitioned by ``side_block``; empty for every other
  block."""
  if not isinstance(block, B.KroneckerBlock):
    return ""
  lay, parts = block.layout, []
  sides = (("A", lay.a, block.input_diagonal
            and not isinstance(block, B.KroneckerEmbedding),
            block.input_parts),
           ("G", lay.b, block.output_diagonal, block.output_parts))
  for name, n, diagonal, p in sides:
    if p > 1:
      k = block.factor_shapes[0 if name == "A" else 1][-1]
      parts.append(f"{name} partitioned: side {n} in {p} blocks of {k} "
                   f"(side_block={block.side_block})")
    if diagonal and block.max_dense_side is not None:
      dense = 2 * 4 * lay.groups * n * n * (stack or 1)
      parts.append(f"{name} diagonal: side {n} > max_dense_side="
                   f"{block.max_dense_side} (dense: {human_bytes(dense)} and "
                   f"~{lay.groups * n ** 3 * (stack or 1):.1e} FLOPs a "
                   "refresh)")
  return "; ".join(parts)


def human_bytes(n: float) -> str:
  """``n`` bytes for a reader: ``"1.5 GiB"``, ``"12.0 KiB"``, ``"80 B"``
  (also ``tx.init``'s memory check's, ``optimizers._memory``)."""
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      return f"{n / size:.1f} {unit}"
  return f"{int(n)} B"


def block_flops(row, layer, block, *, m, stats_m, inverse_every, cov_every,
                c, own_forward, backward, damping_mode):
  """The ``_cost.Flops`` of ``row``'s block (``block``: one slice of
  ``layer``'s): a Kronecker-family block (two factors or more) by
  ``_cost.kronecker``, a Kronecker-vector one by
  ``_cost.kronecker_vector``, a flat one by ``_cost.flat``."""
  common: dict[str, Any] = dict(
      positions=row["positions"], stats_m=stats_m, slices=row["stack"] or 1,
      c=c, inverse_every=inverse_every, cov_every=cov_every,
      own_forward=own_forward, backward=backward)
  factors = row["factors"]
  if isinstance(block, B.KroneckerVectorBlock):
    return _cost.kronecker_vector(factors, m, **common)
  if len(factors) == 1:
    out = layer.spec.output_size(0) if row["positions"] is not None else None
    return _cost.flat(factors[0][0], m, kind=row["kind"],
                      diagonal=len(factors[0]) == 1, output_size=out,
                      **common)
  eigen = isinstance(block, B.EigenCorrected) or damping_mode == "exact"
  sizes = ((block.layout.a, block.layout.b)
           if isinstance(block, B.KroneckerBlock) else None)
  return _cost.kronecker(factors, m, eigenbasis=eigen,
                         reduce=getattr(block, "weight_sharing", None)
                         == "reduce",
                         embedding=isinstance(block, B.KroneckerEmbedding),
                         sizes=sizes, **common)


def loss_lines(tagged):
  """What ``describe`` says about ``tagged``'s losses: per loss, registered
  (its distribution: ``Categorical`` a softmax cross-entropy, ``Bernoulli``
  a sigmoid binary cross-entropy, ``Normal`` a squared error, …) or
  recognised in the jaxpr (its form, the registered twin it is treated as,
  its reduction), the shape of its per-element values and the layers its
  model outputs come from; the loss's terms not recognised; with no loss,
  what that leaves for each estimation and which batch leaves the empirical
  estimation takes as examples."""
  lines = []
  if not tagged.losses:
    lines.append(
        "loss: none registered or recognised — estimation='empirical' only "
        "(per-example gradients, a mean over the batch assumed); 'fisher', "
        "'curvature_prop(_ggn)', 'exact(_ggn)' and kfl.kfac_optimizer refuse "
        "(value_grad_and_stats when built, kfl.kfac at tx.init): compute the "
        "loss with kfl.softmax_cross_entropy_with_integer_labels, "
        "kfl.squared_error, … (or optax's, which are recognised) to use them")
  for t, layers in zip(tagged.losses, tagging.output_layers(tagged)):
    src = f" of {', '.join(layers)}" if layers else ""
    if t.recognised is None:
      lines.append(f"loss: {type(t.distribution).__name__} (registered), "
                   f"per-element values {list(t.values_shape)}; outputs{src}")
      continue
    r = t.recognised
    lines.append(
        f"loss: {r.form} (recognised, as {r.twin}), per-element values "
        f"{list(t.values_shape)}, reduction {r.reduction}; outputs "
        f"{list(r.output)}{src}, targets {r.target}")
  if tagged.unrecognised:
    lines.append("loss terms not recognised (no curvature from them): "
                 + "; ".join(tagged.unrecognised))
  partial = partial_loss(tagged)
  if partial:  # Issue 38: refused by every estimation; say so here.
    lines.append(f"loss REFUSED (recognised only in part): {partial}")
  if not tagged.losses or tagged.examples.how == "example_axis=":
    lines.append(tagged.examples.describe())
  lines.extend(tagged.examples.hints)
  return tuple(lines)


def _sharing(layer, block):
  """The weight-sharing convention of ``layer``'s ``block`` (see ``Row``):
  its ``weight_sharing`` (Kronecker and EKFAC dense, conv, embedding and
  series blocks), ``"-"`` for blocks without one (diagonal, full,
  scale-and-shift, fallback)."""
  mode = getattr(block, "weight_sharing", None)
  if mode is None:
    return "-"
  return f"{mode} (rows)" if layer.row_uses else mode


# ``kfl.kfac``'s defaults (``optimizers.options``; the estimators cannot
# import them: tests/test_describe_price.py checks they agree). None: the
# plan chooses (``_plan``).
INVERSE_EVERY = None
STATS_FRACTION = 1.0
COV_EVERY = None
INVERSE_METHOD = "auto"
STYLES = ("1-pass", "2-pass")


def describe(loss_fn: Callable, params: chex.ArrayTree,
             batch: chex.ArrayTree, *, has_aux: bool = False,
             exclude: Sequence[str] = (),
             blocks: Mapping[str, Any] | None = None,
             damping_mode: str = "pi", weight_sharing: str = "expand",
             estimation: str | None = None,
             example_axis: chex.ArrayTree | None = None,
             inverse_every: int | None = INVERSE_EVERY,
             stats_fraction: float = STATS_FRACTION,
             cov_every: int | None = COV_EVERY,
             inverse_method: str = INVERSE_METHOD,
             style: str = "1-pass",
             budget: float | None = None,
             model_fraction: float | None = None,
             optimizer: str = "kfac") -> Table:
  """The curvature blocks of ``loss_fn``'s layers, as rows.

  ``has_aux``/``exclude``/``example_axis`` are those of ``find_layers``
  (``example_axis``: which axis of the batch's leaves holds the examples;
  without it, when that is not determined, e.g. time-major ``[T, B]``
  data with ``T = B``, a line says which axis was taken and how to say
  another); ``blocks``,
  ``damping_mode`` and ``weight_sharing`` those of ``make_blocks`` (and of
  ``kfl.kfac``). Prints as a table; fallbacks carry their reason; the last
  lines say which loss was found (registered, or recognised in the jaxpr:
  its form, reduction and the layers of its outputs) or that none was, and
  then which batch leaves hold the examples, and the error the first
  K-FAC step would raise, if any (``Table.first_step``, which
  ``kfl.kfac`` raises at ``tx.init``). ``estimation``: when given,
  a ``ValueError`` if ``kfl.kfac`` with it would refuse this loss (as
  ``kfl.value_grad_and_stats`` does when built).

  The price of a step: each row's ``flops`` (``_cost.Flops``: its
  layer's share of SGD's step, forward and backward, and K-FAC's
  statistics, preconditioning and refresh, per step) and ``positions``,
  ``Table.price`` their sum, and a line ``step price: ~2.7x an SGD step
  of these layers' FLOPs (statistics 0.9x, preconditioning 0.6x, refresh
  0.1x per step at ...)``. The FLOP model is the design brief's
  (``estimators._cost``: per dense layer ``6·M·a·b`` for SGD, K-FAC's
  statistics ``2·m·a·b + 2·m·(a² + b²)`` on ``m = round(M·f)`` examples,
  preconditioning ``2·(a²·b + a·b²)``, refresh ``c·(a³ + b³)/T``); a
  floor, not a timing: the activations, the loss and every other
  operation are left out of both steps. Priced at the batch's size ``M``
  and ``kfl.kfac``'s settings of the same names and defaults:
  ``inverse_every`` (``T``), ``stats_fraction`` (``f``), ``cov_every``
  (the statistics' share of a step ``1/K``; None for both: as
  ``kfl.kfac`` plans them for ``budget``, its 1.3 when None, shown on
  the plan line: ``Table.plan``, ``plan_for``), ``inverse_method`` (``c`` of
  ``c·n³``: ``_cost.INVERSE_COSTS``, 2 for Gauss–Jordan, 7/3 Cholesky, 10
  eigh; ``"auto"`` as resolved on this backend); ``style``: ``"1-pass"``
  (the statistics share the gradient's forward pass:
  ``kfl.value_grad_and_stats``, ``stats=``) or ``"2-pass"`` (``batch=``:
  their own forward pass, as a 1-pass estimate with ``stats_fraction <
  1`` also takes).

  ``model_fraction``: plan and price ``kfl.kfac_optimizer``'s step instead
  (its ``model_fraction``, 1 for its default): its quadratic model on that
  share of the batch is paid every step (``_cost.quadratic_model``), and
  ``budget`` None (its default) is its floor plus 0.3 SGD steps for the
  statistics and the refresh (``_plan``). ``optimizer``: ``"kfac"`` (also
  ``kfl.kfac_optimizer``'s, with ``model_fraction``) or ``"eigen_adam"``
  (``kfl.eigen_adam(basis="kfac")``'s step: priced with
  ``damping_mode="exact"``, the rotations into the eigenbases and back
  every step and an ``eigh`` per refresh; ``inverse_every`` is its
  ``refresh_every``, and ``budget`` None its floor plus 0.3, as it plans
  them when given None)."""
  tagged = tagging.find_layers(loss_fn, params, batch, has_aux=has_aux,
                       exclude=exclude, example_axis=example_axis)
  if estimation is not None:
    check_estimation(estimation)
    check_has_loss(tagged, estimation, "kfl.describe")
  if style not in STYLES:
    raise ValueError(f"describe: style must be one of {STYLES}, got "
                     f"{style!r}")
  if optimizer not in ("kfac", "eigen_adam"):
    raise ValueError(f"describe: optimizer must be 'kfac' or 'eigen_adam', "
                     f"got {optimizer!r}")
  if optimizer == "eigen_adam":
    if model_fraction is not None:
      raise ValueError("describe: model_fraction is kfl.kfac_optimizer's, "
                       "not eigen_adam's")
    damping_mode = "exact"  # Its bases: the blocks' eigendecompositions.
  elif budget is None and model_fraction is None:
    budget = _plan.DEFAULT_BUDGET  # kfl.kfac's.
  method = fac.check_inverse_method(inverse_method)
  _fraction.check_stats_fraction(stats_fraction)
  tagged = tagged.with_blocks(blocks, damping_mode=damping_mode,
                              weight_sharing=weight_sharing)
  m = tagged.examples.size or 1
  stats_m = _fraction.stats_batch_size(batch, stats_fraction,
                                       "describe", tagged.examples) or m
  own = style == "2-pass" or stats_m < m
  c = _cost.INVERSE_COSTS[method]
  if model_fraction is not None and not 0 < model_fraction <= 1:
    raise ValueError(f"describe: model_fraction must be in (0, 1] "
                     f"(kfl.kfac_optimizer's), got {model_fraction!r}")
  plan = plan_for(tagged, batch, budget=budget, cov_every=cov_every,
                  inverse_every=inverse_every, stats_fraction=stats_fraction,
                  estimation=estimation, inverse_method=inverse_method,
                  damping_mode=damping_mode, model_fraction=model_fraction)
  if optimizer == "eigen_adam":  # Its name for the refresh interval.
    plan = plan._replace(refresh_name="refresh_every")
  inverse_every, cov_every = plan.inverse_every, plan.cov_every
  table = rows(tagged, dict(
      m=m, stats_m=stats_m, inverse_every=inverse_every, cov_every=cov_every,
      c=c, own_forward=own, backward=estimation != "empirical_shared",
      damping_mode=damping_mode))
  table.plan = plan
  refresh = (f"inverse_method={method!r} (c={c:.3g})"
             if damping_mode != "exact" else
             f"eigendecompositions (c={_cost.EIGH_COST:.3g})")
  table.price_settings = (
      f"inverse_every={inverse_every}, {refresh}, "
      f"stats_fraction={stats_fraction:g} ({stats_m} of {m} examples), "
      f"cov_every={cov_every}, {style}")
  table.first_step = _first_step.refusal(
      tagged, params, batch,
      estimation or ("fisher" if tagged.losses else "empirical"))
  return table


def plan_for(tagged, batch, *, budget: float | None = _plan.DEFAULT_BUDGET,
             cov_every: int | None = None, inverse_every: int | None = None,
             stats_fraction: float = STATS_FRACTION,
             estimation: str | None = None,
             inverse_method: str = INVERSE_METHOD,
             damping_mode: str = "pi",
             model_fraction: float | None = None) -> _plan.Plan:
  """``kfl.kfac``'s plan (``_plan``) for ``tagged`` (a ``TaggedLoss`` with
  its blocks) at ``batch``'s size: the blocks priced at ``K = T = 1`` in
  the dearer step style (the statistics with their own forward pass), then
  ``_plan.plan``. ``cov_every``/``inverse_every`` given are kept; the
  other arguments are ``kfl.kfac``'s of the same names (``estimation``
  None: ``"fisher"``). ``model_fraction``: ``kfl.kfac_optimizer``'s plan
  instead, its quadratic model on that share of the batch priced every
  step (``_cost.quadratic_model``); ``budget`` None: its floor plus
  ``DEFAULT_BUDGET − 1`` (``_plan.plan``)."""
  method = fac.check_inverse_method(inverse_method)
  m = tagged.examples.size or 1
  stats_m = _fraction.stats_batch_size(batch, stats_fraction, "kfl.kfac",
                                       tagged.examples) or m
  pricing = dict(
      m=m, stats_m=stats_m, inverse_every=1, cov_every=1,
      c=_cost.INVERSE_COSTS[method], own_forward=True,
      backward=estimation != "empirical_shared", damping_mode=damping_mode)
  plan = _plan.plan(_flops(tagged, pricing), budget=budget,
                    cov_every=cov_every, inverse_every=inverse_every,
                    model_fraction=model_fraction)
  if plan.met or plan.floor is None:
    return plan
  return plan._replace(partition=_partition(tagged, pricing, plan,
                                            model_fraction))


def _flops(tagged, pricing):
  """The ``_cost.Flops`` of each of ``tagged``'s blocks priced with
  ``pricing`` (``rows``' without the rest of a row: no state bytes, no
  notes)."""
  out = []
  for l in tagged.layers:
    block = B.as_block(l.block).one_slice
    row = dict(kind=l.kind, stack=l.stack, positions=tagged.positions(l),
               factors=tuple(tuple(s) for s in block.factor_shapes))
    out.append(block_flops(row, l, block, **pricing))
  return out


def _partition(tagged, pricing, plan, model_fraction=None):
  """``Plan.partition`` of a plan whose floor is over its budget: the
  largest ``side_block`` of ``_plan.PARTITIONS`` whose floor leaves the
  statistics and refresh their share (``_plan.MIN_SHARE`` of the budget's
  overhead), else the lowest floor below the plan's; None if no side would
  be partitioned."""
  target = plan.budget - _plan.MIN_SHARE * (plan.budget - 1
                                            - (plan.model or 0.0))
  best = None
  for side_block in _plan.PARTITIONS:
    alt, kinds = _partitioned(tagged, side_block)
    if not kinds:
      continue
    floor = _plan.floor(_flops(alt, pricing), model_fraction)
    if floor is None or floor >= plan.floor:
      continue
    if floor <= target:
      return side_block, kinds, floor
    if best is None or floor < best[2]:
      best = side_block, kinds, floor
  return best


def _partitioned(tagged, side_block):
  """``(tagged with its whole-sided Kronecker blocks partitioned by
  side_block, the layer kinds whose sides that splits)``."""
  layers, kinds = [], []
  for l in tagged.layers:
    block = l.block
    inner = B.as_block(block).one_slice
    if isinstance(inner, B.KroneckerBlock) and inner.side_block is None:
      # Every Kronecker block is a dataclass (dense, conv, embedding).
      new = dataclasses.replace(typing.cast(Any, inner),
                                side_block=side_block)
      if new.input_parts > 1 or new.output_parts > 1:
        kinds += [l.kind] if l.kind not in kinds else []
        block = B.Stacked(new, block.n) if isinstance(block, B.Stacked) \
            else new
    layers.append(dataclasses.replace(l, block=block))
  return tagged.replace(layers=tuple(layers)), tuple(kinds)
