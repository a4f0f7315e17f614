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
"""
from __future__ import annotations

import collections
import dataclasses

import jax
import numpy as np


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

  def count(self, batch):
    """``N`` of ``batch`` (same structure): the leading size of its example
    leaves, which must agree."""
    leaves = jax.tree.leaves(batch)
    sizes = {np.shape(leaves[i])[0] for i in self.leaves}
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
    return (f"examples: the leading axis (N={self.size}) of "
            f"{', '.join(self.names)} ({self.how}){rest}")


def _name(path):
  from kfac_jax_lite.tagging._tagged import path_name
  return "batch" + ("/" + path_name(path) if path else "")


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
