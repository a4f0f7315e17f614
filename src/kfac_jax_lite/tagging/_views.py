"""Parameter views: a jaxpr variable that is a (re-laid-out) parameter leaf.

A view records, for each axis of the variable, which axis of the parameter
leaf it is (``int``) or ``None`` for an axis the view inserted (a unit axis,
or a broadcast one). Only layout changes are followed: dtype casts, copies,
transposes, unit-axis reshapes/squeezes, ``broadcast_in_dim`` and the
per-step slice that ``lax.scan`` takes of a stacked parameter. A reshape
that splits or merges a kernel's axes gives a ``Regrouped`` view, a
``slice``/``split`` a ``Sliced`` one (a block of the leaf). Anything else
applied to a parameter ends the view (and is reported as an unmatched use).
"""
from __future__ import annotations

import dataclasses

# Primitives that keep the value (up to dtype) and layout of their operand
# (``pvary``: the cast of a replicated value to a device-varying one that
# ``shard_map(check_vma=True)`` inserts, see ``_vma``).
IDENTITY_PRIMS = frozenset({
    "convert_element_type", "copy", "copy_p", "reduce_precision",
    "optimization_barrier", "pvary"})
LAYOUT_PRIMS = frozenset({"transpose", "reshape", "squeeze",
                          "broadcast_in_dim", "expand_dims"})


@dataclasses.dataclass(frozen=True)
class View:
  leaf: int               # index of the parameter leaf (tree_flatten order)
  dims: tuple             # per axis of the variable: leaf axis or None
  leaf_shape: tuple       # the full leaf shape
  stacked: tuple = ()     # scan levels (ids) that sliced a leading leaf axis

  @property
  def remaining(self):
    """Leaf axes still present (the leading ``len(stacked)`` are sliced)."""
    return tuple(range(len(self.stacked), len(self.leaf_shape)))

  @property
  def pure(self):
    """A permutation of the (unsliced) leaf axes, nothing inserted."""
    return None not in self.dims and sorted(self.dims) == list(self.remaining)

  def nonunit(self, shape):
    """Per axis of a variable of ``shape``: the leaf axis it carries with
    size > 1 (both in the leaf and in ``shape``), else None."""
    out = []
    for d, n in zip(self.dims, shape):
      out.append(d if d is not None and self.leaf_shape[d] > 1 and n > 1
                 and n == self.leaf_shape[d] else None)
    return tuple(out)

  def covers(self, shape):
    """Every non-unit leaf axis appears (unbroadcast) in ``shape``."""
    got = {d for d in self.nonunit(shape) if d is not None}
    need = {d for d in self.remaining if self.leaf_shape[d] > 1}
    return got == need


@dataclasses.dataclass(frozen=True)
class Sliced(View):
  """A view of a contiguous block of a leaf (``W[:, :d]``, one output of
  ``jnp.split``): ``window`` gives, per leaf axis, its ``(start, stop)``.
  Only a dense kernel (and its bias) takes it, as a column block of the
  dense layer of the whole leaf; anything else applied to it is an
  unmatched use."""

  window: tuple = ()

  @property
  def pure(self):
    return False

  def size(self, d):
    lo, hi = self.window[d]
    return hi - lo

  def nonunit(self, shape):
    return tuple(d if d is not None and self.size(d) > 1 and n > 1
                 and n == self.size(d) else None
                 for d, n in zip(self.dims, shape))

  def covers(self, shape):
    got = {d for d in self.nonunit(shape) if d is not None}
    return got == {d for d in self.remaining if self.size(d) > 1}


def slice_views(view, eqn):
  """The ``Sliced`` views of the outputs of a ``slice`` (unit strides) or
  ``split`` of ``view`` (a ``View`` or ``Sliced``), or None."""
  name = eqn.primitive.name
  if (not isinstance(view, View) or None in view.dims
      or getattr(view, "scales", ())):  # A scaled kernel is not sliced.
    return None
  window = list(getattr(view, "window", ()) or
                [(0, n) for n in view.leaf_shape])
  p = eqn.params
  if name == "slice":
    if p.get("strides") and any(s != 1 for s in p["strides"]):
      return None
    bounds = [tuple(zip(p["start_indices"], p["limit_indices"]))]
  elif name == "split":
    ax, bounds, lo = p["axis"], [], 0
    full = [(0, n) for n in eqn.invars[0].aval.shape]
    for n in p["sizes"]:
      b = list(full)
      b[ax] = (lo, lo + int(n))
      bounds.append(tuple(b))
      lo += int(n)
  else:
    return None
  out = []
  for b in bounds:
    w = list(window)
    for axis, (lo, hi) in enumerate(b):
      d = view.dims[axis]
      if d < len(view.stacked) and (lo, hi) != (0, view.leaf_shape[d]):
        return None  # A scan-stacked axis is sliced per step only.
      w[d] = (w[d][0] + int(lo), w[d][0] + int(hi))
    if all(w[d] == (0, view.leaf_shape[d]) for d in view.remaining):
      # ``pos[:t]`` of a table of t rows is the table itself.
      out.append(View(view.leaf, view.dims, view.leaf_shape, view.stacked))
    else:
      out.append(Sliced(view.leaf, view.dims, view.leaf_shape, view.stacked,
                        tuple(w)))
  return out


def _unit_map(in_shape, out_shape):
  """For a reshape that only inserts/removes unit axes: for each output axis
  the input axis it is (or None for an inserted unit axis); None if the
  reshape mixes axes."""
  src = [i for i, n in enumerate(in_shape) if n != 1]
  dst = [j for j, n in enumerate(out_shape) if n != 1]
  if [in_shape[i] for i in src] != [out_shape[j] for j in dst]:
    return None
  mapping: list[int | None] = [None] * len(out_shape)
  for i, j in zip(src, dst):
    mapping[j] = i
  return mapping


def layout_map(eqn):
  """For a layout primitive: per output axis, the operand axis it comes
  from (None: inserted or broadcast). None if not a pure layout change."""
  name = eqn.primitive.name
  in_shape = tuple(eqn.invars[0].aval.shape)
  out_shape = tuple(eqn.outvars[0].aval.shape)
  if name in IDENTITY_PRIMS:
    return list(range(len(in_shape)))
  if name == "transpose":
    return list(eqn.params["permutation"])
  if name in ("reshape", "squeeze", "expand_dims"):
    if name == "reshape" and eqn.params.get("dimensions") is not None:
      return None
    return _unit_map(in_shape, out_shape)
  if name == "broadcast_in_dim":
    mapping: list[int | None] = [None] * len(out_shape)
    for i, j in enumerate(eqn.params["broadcast_dimensions"]):
      mapping[j] = i if in_shape[i] == out_shape[j] else None
    return mapping
  return None


def apply_layout(view, eqn):
  """The view of ``eqn``'s output, or None when the layout is unsupported."""
  mapping = layout_map(eqn)
  if mapping is None:
    return None
  dims = tuple(None if m is None else view.dims[m] for m in mapping)
  return dataclasses.replace(view, dims=dims)


@dataclasses.dataclass(frozen=True)
class Regrouped:
  """A kernel reshaped so that some of its axes are split or merged
  (``W.reshape(d, heads, head_dim)``, ``conv_kernel.reshape(-1, c_out)``).

  ``groups``: per axis of the variable, the index of its group;
  ``real``: per group, the (consecutive) leaf axes it is made of. Axes of
  one group flatten, in order, to the group's leaf axes flattened in order
  (row-major), so data laid out over a group's axes reshapes to the leaf's.
  Only dense kernels (``dot_general``) use it; anything else applied to it
  is an unmatched use.
  """

  leaf: int
  leaf_shape: tuple
  shape: tuple
  groups: tuple
  real: tuple
  how: str
  stacked: tuple = ()

  @property
  def pure(self):
    return False


def _reshape_groups(in_shape, out_shape):
  """Pairs ``(in axes, out axes)`` of consecutive axes with equal sizes
  that a row-major reshape maps onto each other, or None."""
  pairs, i, j = [], 0, 0
  while i < len(in_shape) or j < len(out_shape):
    gi, gj = [i], [j]
    if i >= len(in_shape) or j >= len(out_shape):
      return None
    a, b = in_shape[i], out_shape[j]
    while a != b:
      if a < b:
        i += 1
        if i >= len(in_shape):
          return None
        gi.append(i)
        a *= in_shape[i]
      else:
        j += 1
        if j >= len(out_shape):
          return None
        gj.append(j)
        b *= out_shape[j]
    pairs.append((tuple(gi), tuple(gj)))
    i, j = i + 1, j + 1
  return pairs


def regroup(view, eqn):
  """The ``Regrouped`` view of a ``reshape`` of an unstacked, untransposed
  leaf that only splits or merges axes, or None."""
  if (eqn.primitive.name != "reshape" or eqn.params.get("dimensions")
      is not None or type(view) is not View or view.stacked
      or view.dims != tuple(range(len(view.leaf_shape)))):
    return None
  in_shape = tuple(eqn.invars[0].aval.shape)
  out_shape = tuple(eqn.outvars[0].aval.shape)
  pairs = _reshape_groups(in_shape, out_shape)
  if pairs is None:
    return None
  groups: list[int | None] = [None] * len(out_shape)
  for g, (_, outs) in enumerate(pairs):
    for j in outs:
      groups[j] = g
  return Regrouped(view.leaf, view.leaf_shape, out_shape, tuple(groups),
                   tuple(ins for ins, _ in pairs),
                   f"reshaped by `reshape` {in_shape} -> {out_shape}")
