"""Grouping parameter uses into layers.

Uses are grouped by the parameter leaves they touch (a kernel and its bias,
a scale and its shift, every use of a shared table). A group becomes one
layer of the kind that takes its uses (``_kinds``); otherwise its leaves
get one fallback layer whose ``reason`` says why. Detection chooses no
curvature block: ``make_blocks`` (``kfac_jax_lite._block_policy``) does,
afterwards.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from kfac_jax_lite.tagging import _format as F
from kfac_jax_lite.tagging import _kinds
from kfac_jax_lite.tagging._kinds import FallbackSpec, LayerSpec, Unsupported
from kfac_jax_lite.tagging import _paths


@dataclasses.dataclass(frozen=True)
class Layer:
  """One detected layer (or one group of fallback parameters).

  ``spec``: the kind's record (``DenseSpec``, ``ConvSpec``,
  ``EmbeddingSpec``, ``ScaleAndShiftSpec`` or ``FallbackSpec``) with the
  layer's configuration. ``params``/``leaves``: the parameter paths / leaf
  indices it covers, in the block's parameter order. ``leaf_shapes``: the
  leaves' own shapes (``spec.param_shapes`` may differ from them by unit
  axes, e.g. a conv bias stored ``[C, 1, 1]``; reshape, the sizes agree).
  ``stack``: for a layer stacked along a ``lax.scan`` (a leaf ``[L, ...]``
  sliced per step), L: the spec describes one slice and the block is a
  ``Stacked`` one. ``uses``: how many times the parameters are applied
  (scan steps counted once per equation). ``use_ids``: the graph walk's
  uses, in the spec's order. ``block``: the curvature block, None until
  ``make_blocks`` chose it (``TaggedLoss.with_blocks``). ``penalties``:
  regularisers of its parameters alone inside the loss
  (``_penalties.Penalty``), which are not layer uses; ``penalty_curvature``
  gives their curvature per parameter. ``row_uses``: the layer's input has
  no axis that is the batch's example axis (a time-major scan, ``h.reshape(
  -1, d)`` merging batch and time): every row of its input is a use of one
  pseudo-example ("expand"), whose loss weight is the examples' mean;
  with ``row_map`` the rows reach the loss through ``segment_sum``s whose
  ids say each row's example (``_rows``; a graph network's nodes and
  edges), and each row is a use of its own example (``TaggedLoss``).
  ``spread``: the input's example axis is the batch's but the loss has a
  multiple of its examples (tokens of ``logits.reshape(-1, V)``): the
  layer keeps its examples, each weighted by the loss elements' mean.
  ``steps``: per use, the lengths of the enclosing ``lax.scan``s that
  apply it at every step (the parameter a scan constant: time axes of its
  data, outermost first; ``()`` outside any such scan).
  """
  name: str
  spec: LayerSpec
  params: tuple
  leaves: tuple
  leaf_shapes: tuple
  uses: int
  stack: int | None = None
  use_ids: tuple = ()
  block: Any = None
  penalties: tuple = ()
  row_uses: bool = False
  steps: tuple = ()
  row_map: bool = False
  spread: bool = False

  @property
  def kind(self) -> str:
    """``"dense"``, ``"conv"``, ``"embedding"``, ``"scale_and_shift"`` or
    ``"fallback"`` (a tied embedding is a dense layer reported as
    ``"embedding"``)."""
    return self.spec.kind

  @property
  def is_fallback(self) -> bool:
    return self.spec.is_fallback

  @property
  def reason(self):
    """Why a fallback was used (None for a detected layer)."""
    return self.spec.reason

  @property
  def notes(self) -> str:
    """The fallback reason, or a remark on the layer (tied uses), and
    its parameters' penalties in the loss."""
    names = dict(zip(self.leaves, self.params))
    rows = ["the loss has a multiple of its examples: loss weights spread "
            "evenly"] if self.spread else []
    rows += ["example axis unknown: every input row a use (expand), loss "
            "weights spread evenly"] if self.row_uses and not self.row_map \
        else ["rows: each a use of its example (segment_sum ids); reduce "
              "sums a dense layer's rows per example"] if self.row_uses else []
    return "; ".join([n for n in [self.spec.notes] if n] + rows + [
        p.describe(names[p.leaf]) for p in self.penalties])

  @property
  def penalty_curvature(self) -> dict:
    """``{path: γ}`` for parameters with quadratic penalties ``c·‖w‖²``
    in the loss: their curvature is ``γ·I``, ``γ = 2c``, which the block
    leaves out (None where a penalty's curvature is unknown or not
    quadratic)."""
    out = {}
    for p in self.penalties:
      path = self.params[self.leaves.index(p.leaf)]
      old = out.get(path, 0.0)
      out[path] = (None if old is None or p.curvature is None
                   else old + p.curvature)
    return out


class _UnionFind:

  def __init__(self):
    self.parent = {}

  def find(self, x):
    self.parent.setdefault(x, x)
    while self.parent[x] != x:
      x = self.parent[x] = self.parent[self.parent[x]]
    return x

  def union(self, a, b):
    self.parent[self.find(a)] = self.find(b)


def _leaves_of(use):
  return [v.leaf for v in use.roles.values()]


def _group(uses, leaf_shapes, n_examples, batch_n=None):
  """``(grouping, row_uses, spread)`` of a group of uses; raises
  ``Unsupported``.

  Uses whose example axis is not the loss's (a size other than
  ``n_examples``) make a layer of ``row_uses`` (see ``Layer``), unless
  their rows are the batch's ``batch_n`` examples and the loss has a
  multiple of them (``spread``: a loss over ``logits.reshape(-1, V)``).
  """
  stacked = {v.stacked for u in uses for v in u.roles.values()}
  if len(stacked) != 1:
    raise Unsupported("used both stacked along lax.scan and unstacked")
  stacked = stacked.pop()
  if len(stacked) > 1:
    raise Unsupported("stacked along more than one lax.scan level")
  for u in uses:
    if u.examples is None:
      raise Unsupported(f"cannot identify the example axis of its {u.kind} "
                        f"use (in {u.where})")
  sizes = {u.examples for u in uses}
  row_uses = n_examples is not None and sizes != {n_examples}
  spread = bool(row_uses and batch_n and sizes == {batch_n}
                and n_examples % batch_n == 0)
  row_uses = row_uses and not spread
  if row_uses and len(sizes) > 1:
    raise Unsupported("uses whose example axes differ in size and are not "
                      "the batch's")
  if row_uses and any(u.kind == "conv" for u in uses):
    raise Unsupported("cannot identify the example axis of its conv use (in "
                      f"{uses[0].where}): the batch axis is "
                      f"{uses[0].examples}, not {n_examples}")
  return _kinds.group(uses, leaf_shapes, len(stacked)), row_uses, spread


def build_layers(uses, opaque, paths, leaf_shapes, n_examples, exclude,
                 penalties=(), row_steps=None, batch_n=None):
  """All layers of the model: ``(layers, excluded_paths)``. A pattern of
  ``exclude`` that matches no parameter path is a ``ValueError`` naming
  the nearest paths (it would exclude nothing); a bare string, which would
  be read one character a pattern, is a ``TypeError``."""
  if isinstance(exclude, str):
    raise TypeError(f"exclude= takes a sequence of paths or patterns, got the "
                    f"string {exclude!r}: write exclude=[{exclude!r}]")
  exclude = tuple(exclude)
  for e in exclude:
    if not any(_paths.matches(e, p) for p in paths):
      raise ValueError(f"exclude= pattern {e!r} matches no parameter path "
                       f"({_paths.unmatched(e, paths)})")
  excluded = {k for k, p in enumerate(paths) if any(
      _paths.matches(e, p) for e in exclude)}
  reasons = {}
  for o in opaque:
    reasons.setdefault(o.leaf, []).append(o.reason)
  active = []
  for u in uses:
    if u.in_while:
      for leaf in _leaves_of(u):
        reasons.setdefault(leaf, []).append(
            f"a {u.kind} layer inside lax.while_loop, which reverse-mode "
            f"autodiff cannot differentiate (in {u.where})")
    else:
      active.append(u)
  uf = _UnionFind()
  for k in range(len(paths)):
    uf.find(k)
  for u in active:
    ls = _leaves_of(u)
    for a in ls[1:]:
      uf.union(ls[0], a)
  groups = {}
  for k in range(len(paths)):
    groups.setdefault(uf.find(k), []).append(k)
  by_group = {}
  for u in active:
    by_group.setdefault(uf.find(_leaves_of(u)[0]), []).append(u)
  layers = []
  for root, members in groups.items():
    members = sorted(members)
    kept = [k for k in members if k not in excluded]
    if not kept:
      continue
    guses = by_group.get(root, [])
    try:
      if any(k in reasons for k in members):
        raise Unsupported("; ".join(dict.fromkeys(
            r for k in members for r in reasons.get(k, ()))))
      if not guses:
        raise Unsupported("no layer pattern uses it")
      (spec, leaves), row_uses, spread = _group(guses, leaf_shapes,
                                                n_examples, batch_n)
      if set(leaves) & excluded:
        raise Unsupported("its layer's other parameters are excluded")
    except Unsupported as e:
      spec = FallbackSpec(tuple(tuple(leaf_shapes[k]) for k in kept), str(e))
      leaves, guses, row_uses, spread = tuple(kept), [], False, False
    layer = _layer(spec, leaves, guses, paths, leaf_shapes)
    if row_uses or spread:
      layer = dataclasses.replace(layer, row_uses=row_uses, spread=spread,
                                  row_map=row_uses and all(
                                      u.uid in (row_steps or {})
                                      for u in guses))
    pens = () if spec.is_fallback else tuple(
        p for p in penalties if p.leaf in leaves)
    layers.append(dataclasses.replace(layer, penalties=pens) if pens
                  else layer)
  layers.sort(key=lambda l: min(l.leaves))
  return tuple(layers), tuple(paths[k] for k in sorted(excluded))


def _layer(spec, leaves, guses, paths, leaf_shapes):
  stack = None
  if guses and next(iter(guses[0].roles.values())).stacked:
    stack = leaf_shapes[leaves[0]][0]
  lpaths = tuple(paths[k] for k in leaves)
  return Layer(name=lpaths[0], spec=spec, params=lpaths, leaves=tuple(leaves),
               leaf_shapes=tuple(tuple(leaf_shapes[k]) for k in leaves),
               uses=len(guses), stack=stack,
               use_ids=tuple(u.uid for u in guses),
               steps=tuple(_time_steps(u) for u in guses))


def _time_steps(use):
  """The lengths of the scans that reuse ``use``'s parameters at every step."""
  return tuple(n for (_, n), label in zip(use.levels, F.level_labels(use))
               if label[0] == "t")
