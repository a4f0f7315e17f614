"""The example axis of a batch that carries more than examples.

``estimation="empirical"`` without a loss whose elements the estimator sees
scales each example's gradient by the number of examples ``N`` (a mean over
the batch assumed), so it needs ``N``. A batch may also hold model state (an
``eqx.nn.State``, BatchNorm statistics), a PRNG key, a learning-rate scalar:
leaves with no example axis, or one of another size. ``find(batch, uses)``
takes as examples:

1. every array leaf, when they all share one leading size (``"the batch's
   arrays"``);
2. else the leaves whose leading size is the example-axis size most layer
   uses found in the trace (the first non-feature axis of each layer's
   input, ``_analysis.Use.examples``): ``"the layers' inputs"``;
3. else the leaves of the most common leading size (``"the most common
   leading size"``).

Leaves without a leading axis (scalars, typed PRNG keys) are never
examples. ``describe`` prints which leaves were taken.

``example_axis=`` (of ``kfl.kfac``, ``kfl.describe``, ...; ``resolve``)
says it instead: an int (that axis of every leaf with any axis) or a
pytree of the batch's structure with an int or None (no examples) per
leaf. Time-major data ``[T, B]`` then has ``example_axis=1``. When the
choice was not said and is not determined (a leaf has another axis of the
examples' size: ``T = B``; or the layers' example axis is a later axis of
a leaf), ``ExampleAxis.hints`` says what was taken and how to change it
(and ``TaggedLoss`` warns when a ``lax.scan`` runs over the axis taken:
``scanned``). With ``example_axis=``, ``located`` finds each layer use's
and loss's example axis by tracing again with one more example.
"""
from __future__ import annotations

import collections
import dataclasses
import warnings

import jax
import numpy as np

from kfac_jax_lite.tagging._paths import path_name


@dataclasses.dataclass(frozen=True)
class ExampleAxis:
  """``size`` (N at the traced batch; None: no leaf has a leading axis),
  ``leaves`` (indices, in ``jax.tree.leaves`` order, of the example
  leaves), ``names``/``others`` (their paths and the other leaves'), and
  ``how`` they were chosen (module doc)."""

  size: int | None
  leaves: tuple
  names: tuple
  others: tuple
  how: str
  #: Per example leaf (in ``leaves``' order), its example axis (0 unless
  #: ``example_axis=`` said otherwise).
  axes: tuple = ()
  #: What ``describe`` adds when the choice was a guess (module doc).
  hints: tuple = ()

  def axis_of(self, k):
    """The example axis of the ``k``-th example leaf."""
    return self.axes[k] if self.axes else 0

  def count(self, batch):
    """``N`` of ``batch`` (same structure): the size of its example leaves'
    example axes, which must agree."""
    leaves = jax.tree.leaves(batch)
    sizes = {np.shape(leaves[i])[self.axis_of(k)]
             for k, i in enumerate(self.leaves)}
    if len(sizes) != 1:
      raise ValueError(
          "estimation='empirical' without a recognised loss needs the batch's "
          f"example leaves ({', '.join(self.names) or 'none found'}) to share "
          f"one leading size; got sizes {sorted(sizes)}")
    return sizes.pop()

  def describe(self):
    if self.size is None:
      return "examples: none found (no batch leaf has a leading axis)"
    rest = f"; not examples: {', '.join(self.others)}" if self.others else ""
    axes = set(self.axes) or {0}
    which = ("the leading axis" if axes == {0} else f"axis {axes.pop()}"
             if len(axes) == 1 else "the example axes")
    return (f"examples: {which} (N={self.size}) of "
            f"{', '.join(self.names)} ({self.how}){rest}")


def _name(path):
  return "batch" + ("/" + path_name(path) if path else "")


def resolve(batch, example_axis):
  """Per batch leaf (``jax.tree.leaves`` order), its example axis (an int
  ≥ 0) or None, from ``example_axis`` (module doc). Raises ``ValueError``
  for a value that is not an int, None or such a pytree, an axis a leaf
  does not have, or example axes whose sizes differ."""
  flat = jax.tree_util.tree_flatten_with_path(batch)[0]
  treedef = jax.tree.structure(batch)
  if _is_axis(example_axis):
    per_leaf = [example_axis if np.ndim(x) > 0 else None for _, x in flat]
  else:
    try:
      per_leaf = treedef.flatten_up_to(example_axis)
    except (ValueError, TypeError) as e:
      raise ValueError(
          "example_axis must be an int, or a pytree of the batch's structure "
          f"({treedef}) with an int or None per leaf; got {example_axis!r} "
          f"({e})") from None
  out = []
  for (path, x), a in zip(flat, per_leaf):
    if a is None:
      out.append(None)
      continue
    if not _is_axis(a):
      raise ValueError(f"example_axis for {_name(path)} must be an int or "
                       f"None, got {a!r}")
    nd = np.ndim(x)
    if not -nd <= a < nd:
      raise ValueError(f"example_axis={a} for {_name(path)}, which has "
                       f"shape {tuple(np.shape(x))}: no such axis")
    out.append(a % nd)
  sizes = {np.shape(x)[a] for (_, x), a in zip(flat, out) if a is not None}
  if not sizes:
    raise ValueError(f"example_axis={example_axis!r} names no axis of the "
                     "batch's leaves")
  if len(sizes) > 1:
    raise ValueError("example_axis: the example axes of the batch's leaves "
                     f"differ in size ({sorted(sizes)}); " + ", ".join(
                         f"{_name(p)} {tuple(np.shape(x))} axis {a}"
                         for (p, x), a in zip(flat, out) if a is not None))
  return tuple(out)


def _is_axis(a):
  return isinstance(a, (int, np.integer)) and not isinstance(a, bool)


def moved(batch, axes, size):
  """``batch`` (arrays or ``ShapeDtypeStruct``s) as abstract values, its
  example axes (``resolve``) of size ``size``: the batch ``TaggedLoss``
  traces a second time to see which axis of every layer's input and every
  loss's values the examples are."""
  leaves, treedef = jax.tree.flatten(batch)
  out = []
  for x, a in zip(leaves, axes):
    shape = list(np.shape(x))
    if a is not None:
      shape[a] = size
    out.append(jax.ShapeDtypeStruct(tuple(shape), jax.numpy.result_type(x)))
  return jax.tree.unflatten(treedef, out)


def given(batch, axes):
  """The ``ExampleAxis`` of ``batch`` with ``axes`` from ``resolve``."""
  flat = jax.tree_util.tree_flatten_with_path(batch)[0]
  names = [_name(p) for p, _ in flat]
  chosen = tuple(i for i, a in enumerate(axes) if a is not None)
  size = np.shape(flat[chosen[0]][1])[axes[chosen[0]]]
  return ExampleAxis(size, chosen, tuple(names[i] for i in chosen),
                     tuple(n for i, n in enumerate(names) if i not in chosen),
                     "example_axis=", tuple(axes[i] for i in chosen))


def guess_hints(axis, batch, uses=()):
  """``axis`` (from ``find``) with its ``hints``: a leaf with another axis
  of the examples' size (``T = B``: which was taken is a guess) that a
  layer sees as a sequence axis, or layer
  inputs whose example axis is not the batch's but has the size of a later
  axis of an example leaf (time-major data with ``T ≠ B``)."""
  if axis.size is None:
    return axis
  leaves = jax.tree.leaves(batch)
  hints = []
  # Only when some layer sees a second axis of that size that is not a
  # feature axis (a later activation axis, or a scan's length): a square
  # ``[N, N]`` input of a dense layer, or a conv's ``[N, N, N, C]``, is
  # not ambiguous.
  n = axis.size
  seen = any(
      any(l[0] == "b" and l != ("b", 0) and m == n
          for l, m in zip(u.out_labels, u.probe_aval.shape))
      or any(m == n for _, m in u.levels) for u in uses)
  for k, i in enumerate(axis.leaves):
    shape = np.shape(leaves[i])
    same = [a for a, m in enumerate(shape) if m == n and a != 0]
    if same and seen:
      hints.append(
          f"example axis ambiguous: {axis.names[k]} {list(shape)} has axes 0 "
          f"and {same[0]} of size {axis.size}; took axis 0 (the leading one) "
          f"as the examples. If the examples are on axis {same[0]} "
          f"(time-major data), pass example_axis={same[0]}")
      break
  other = {u.examples for u in uses} - {axis.size, None}
  for k, i in enumerate(axis.leaves):
    if hints:
      break
    shape = np.shape(leaves[i])
    later = [a for a, n in enumerate(shape) if a > 0 and n in other]
    if later:
      a = later[0]
      hints.append(
          f"example axis unknown for layers whose inputs have {shape[a]} "
          f"rows of examples: took axis 0 of {axis.names[k]} {list(shape)}; "
          f"if its axis {a} holds the examples (time-major data), pass "
          f"example_axis={a}")
  return dataclasses.replace(axis, hints=tuple(hints))


def find(batch, uses=()):
  """The ``ExampleAxis`` of ``batch`` (module doc); ``uses``: the graph
  walk's layer uses."""
  flat = jax.tree_util.tree_flatten_with_path(batch)[0]
  names = [_name(p) for p, _ in flat]
  lead = [np.shape(x)[0] if np.ndim(x) > 0 else None for _, x in flat]
  sizes = {n for n in lead if n is not None}
  if not sizes:
    return ExampleAxis(None, (), (), tuple(names), "")
  if len(sizes) == 1:
    size, how = sizes.pop(), "the batch's arrays"
  else:
    counts = collections.Counter(u.examples for u in uses
                                 if u.examples in sizes)
    if counts:
      size, how = counts.most_common(1)[0][0], "the layers' inputs"
    else:
      counts = collections.Counter(n for n in lead if n is not None)
      size, how = counts.most_common(1)[0][0], "the most common leading size"
  chosen = tuple(i for i, n in enumerate(lead) if n == size)
  return ExampleAxis(size, chosen, tuple(names[i] for i in chosen),
                     tuple(n for i, n in enumerate(names) if i not in chosen),
                     how)


def shrunk(batch, size=2):
  """``batch`` with its example leaves (``find``) cut to their first
  ``size`` examples (``jax.ShapeDtypeStruct``s stay abstract), or None when
  it has no more than ``size``: a small batch to trace the loss at."""
  axis = find(batch)
  if axis.size is None or axis.size <= size:
    return None
  chosen = set(axis.leaves)

  def cut(i, x):
    if i not in chosen:
      return x
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct((size,) + tuple(x.shape[1:]), x.dtype)
    return x[:size]
  leaves, treedef = jax.tree.flatten(batch)
  return jax.tree.unflatten(treedef, [cut(i, x) for i, x in enumerate(leaves)])


def signature(u):
  """What must match between two traces' layer uses: their kind, roles,
  labels, nesting, place and configuration."""
  return (u.kind, tuple(sorted((r, v.leaf, v.stacked) for r, v in
                               u.roles.items())),
          u.in_labels, u.out_labels, len(u.levels), u.where,
          tuple(sorted((k, repr(v)) for k, v in u.config.items())))


def scanned(trace, tr, ex, params, batch):
  """``ex`` (an ``ExampleAxis`` whose leading axis was a guess, with
  ``hints``) checked: ``trace(params, batch)`` (a ``_Trace``, ``tr`` that
  of ``batch``) once more with the axis one longer; if a ``lax.scan`` that
  applies a layer gets longer, the axis taken as the examples is a time
  axis (time-major data): ``ex`` with a hint saying so, and a warning
  (``UserWarning``), as the statistics will be those of time steps as
  examples; else ``ex``."""
  axes: list[int | None] = [None] * len(jax.tree.leaves(batch))
  for i in ex.leaves:
    axes[i] = 0
  try:
    other = trace(params, moved(batch, axes, ex.size + 1))
  except Exception:  # noqa: BLE001 (a loss tied to its batch size)
    return ex
  if len(other.uses) != len(tr.uses) or not any(
      [n for _, n in u.levels] != [n for _, n in v.levels]
      for u, v in zip(tr.uses, other.uses)):
    return ex
  hint = (f"{ex.hints[0]}. A lax.scan runs over the axis taken (the "
          "data look time-major)")
  warnings.warn(f"kfac_jax_lite: {hint}", UserWarning, stacklevel=4)
  return dataclasses.replace(ex, hints=(hint,) + ex.hints[1:])


def located(trace, tr, ex, params, batch, axes):
  """``(ex, relabels, loss_axes)``: the examples' axis of every layer use
  and loss of ``tr`` (the ``_Trace`` of ``batch`` by ``trace(params,
  batch)``) found for ``example_axis=`` (``axes`` per batch leaf, from
  ``resolve``; ``ex`` the ``ExampleAxis`` they give). The loss is traced
  again with the example axes one longer, and the axis of each use's
  output (each loss's values) whose size changed is the examples'. A use
  whose example axis is a later activation axis gets a relabelling
  (``relabels[uid]``) that makes it ``("b", 0)`` (the layer's data then has
  the examples first, ``_format.arrange``); a use whose changed axis is
  not the examples' alone (``h.reshape(-1, d)`` merging them with time)
  keeps its labels (its rows are uses, ``Layer.row_uses``);
  ``loss_axes[j]`` is loss ``j``'s values' example axis. When the loss
  does not trace at that size (or traces to other layers), the first
  activation axis of the examples' size is taken as theirs (and ``ex``
  gets a hint saying so)."""
  relabels, loss_axes = {}, {}
  n = ex.size
  try:
    other = trace(params, moved(batch, axes, n + 1))
    if [signature(u) for u in other.uses] != [signature(u)
                                               for u in tr.uses]:
      other = None
  except Exception:  # noqa: BLE001 (a loss tied to its batch size)
    other = None
  if other is None:
    ex = dataclasses.replace(ex, hints=(
        f"example axis guessed: the loss does not trace the same with "
        f"{n + 1} examples, so each layer's example axis is its first "
        f"activation axis of size {n}",))
  for u in tr.uses:
    shape = u.probe_aval.shape
    if other is not None:
      changed = [j for j, (a, b) in enumerate(zip(
          shape, other.uses[u.uid].probe_aval.shape)) if a != b]
    else:
      changed = [j for j, l in enumerate(u.out_labels)
                 if l[0] == "b" and shape[j] == n][:1]
    if len(changed) != 1 or shape[changed[0]] != n:
      continue
    label = u.out_labels[changed[0]]
    if label[0] == "b" and label[1] > 0:
      m = label[1]
      relabels[u.uid] = {("b", k): ("b", k + 1 if k < m else 0)
                         for k in range(m + 1)}
  if other is not None:
    for j, (t, t2) in enumerate(zip(tr.losses, other.losses)):
      changed = [k for k, (a, b) in enumerate(zip(
          t.values_shape, t2.values_shape)) if a != b]
      if len(changed) == 1:
        loss_axes[j] = changed[0]
  return ex, relabels, loss_axes


def relabel(use, mapping):
  """Rename ``use``'s axis labels by ``mapping`` (in place), and set its
  example size to that of its new ``("b", 0)`` axis."""
  if not mapping:
    return
  use.in_labels = tuple(mapping.get(l, l) for l in use.in_labels)
  use.out_labels = tuple(mapping.get(l, l) for l in use.out_labels)
  use.examples = next(n for l, n in zip(use.out_labels, use.probe_aval.shape)
                      if l == ("b", 0))
