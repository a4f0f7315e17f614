"""``describe``: the blocks of a model as a list of rows that prints as a table."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import chex

from kfac_jax_lite import blocks as B
from kfac_jax_lite import tagging
from kfac_jax_lite.estimators import _first_step
from kfac_jax_lite.estimators._checks import (
    check_estimation, check_has_loss, partial_loss)


class Row(dict):
  """One block: ``name``, ``kind``, ``block``, ``params``, ``factors``
  (factor shapes), ``sharing`` (the weight-sharing convention of a
  Kronecker block: ``"expand"``/``"reduce"``, ``"expand (rows)"`` for a
  layer whose input rows are the uses, ``"-"`` otherwise), ``bytes`` (state
  bytes), ``uses``, ``stack``, ``notes`` (the fallback reason for
  fallbacks). Fields read as keys or attributes."""

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
    out.append(f"{len(self)} blocks, {total} bytes of state "
               f"({total / 2**20:.1f} MiB)")
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

  @property
  def total_bytes(self):
    """Bytes of the curvature state of all blocks (the total line)."""
    return sum(r["bytes"] for r in self)

  __repr__ = __str__


def rows(tagged):
  """The rows of a ``TaggedLoss`` whose layers have their blocks."""
  table = Table()
  for l in tagged.layers:
    block = B.as_block(l.block).one_slice
    table.append(Row(
        name=l.name, kind=l.kind, block=type(block).__name__,
        params=tuple(l.params),
        factors=tuple(tuple(s) for s in block.factor_shapes),
        sharing=_sharing(l, block), bytes=B.state_bytes(l.block),
        uses=l.uses, stack=l.stack, notes=l.notes))
  table.loss_lines = loss_lines(tagged)
  return table


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


def describe(loss_fn: Callable, params: chex.ArrayTree,
             batch: chex.ArrayTree, *, has_aux: bool = False,
             exclude: Sequence[str] = (),
             blocks: Mapping[str, Any] | None = None,
             damping_mode: str = "pi", weight_sharing: str = "expand",
             estimation: str | None = None,
             example_axis: chex.ArrayTree | None = None) -> Table:
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
  ``kfl.value_grad_and_stats`` does when built)."""
  tagged = tagging.find_layers(loss_fn, params, batch, has_aux=has_aux,
                       exclude=exclude, example_axis=example_axis)
  if estimation is not None:
    check_estimation(estimation)
    check_has_loss(tagged, estimation, "kfl.describe")
  tagged = tagged.with_blocks(blocks, damping_mode=damping_mode,
                              weight_sharing=weight_sharing)
  table = rows(tagged)
  table.first_step = _first_step.refusal(
      tagged, params, batch,
      estimation or ("fisher" if tagged.losses else "empirical"))
  return table
