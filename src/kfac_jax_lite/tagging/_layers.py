"""Grouping parameter uses into layers, and the per-layer statistics data.

Uses are grouped by the parameter leaves they touch (a kernel and its bias,
a scale and its shift, every use of a shared table). A group becomes one
layer when its uses are compatible; otherwise its leaves get one fallback
block whose ``reason`` says why.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from kfac_jax_lite.tagging import _blocks
from kfac_jax_lite.tagging import _format as F


@dataclasses.dataclass(frozen=True)
class Layer:
  """One curvature block: what was detected and how it is handled.

  ``params``/``leaves``: the parameter paths / leaf indices it covers, in
  the block's parameter order. ``leaf_shapes``: the leaves' own shapes
  (``block.param_shapes`` may differ from them by unit axes, e.g. a conv
  bias stored ``[C, 1, 1]``; reshape, the sizes agree). ``stack``: for a
  layer stacked along a ``lax.scan`` (a leaf ``[L, ...]`` sliced per step),
  L: the block describes one slice and its state and statistics carry a
  leading axis of L (``jax.vmap`` the block functions). ``uses``: how many
  times the parameters are applied (scan steps counted once per equation).
  ``reason``: why a fallback was used.
  """
  name: str
  kind: str
  block: Any
  params: tuple
  leaves: tuple
  leaf_shapes: tuple
  uses: int
  stack: int | None = None
  reason: str | None = None
  notes: str = ""
  use_ids: tuple = ()
  use_roles: tuple = ()     # per use: "normal" | "swapped" | "lookup"
  spec: Any = dataclasses.field(default=None, compare=False, repr=False)


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


def _fail(reason):
  return {"kind": "fallback", "reason": reason}


def _group_spec(uses, leaf_shapes, n_examples):
  """The layer spec of a group of compatible uses, or a fallback spec."""
  kinds = {u.kind for u in uses}
  stacked = {v.stacked for u in uses for v in u.roles.values()}
  if len(stacked) != 1:
    return _fail("used both stacked along lax.scan and unstacked")
  stacked = stacked.pop()
  if len(stacked) > 1:
    return _fail("stacked along more than one lax.scan level")
  base = len(stacked)
  for u in uses:
    size = F.example_axis_size(u)
    if size is None or (n_examples is not None and size != n_examples):
      return _fail(f"cannot identify the example axis of its {u.kind} use "
                   f"(in {u.where})")
  if kinds <= {"dense", "embedding"}:
    return _dense_like(uses, leaf_shapes, base)
  if kinds == {"conv"}:
    if len(uses) != 1:
      return _fail(f"a convolution kernel used {len(uses)} times "
                   "(KroneckerConv takes a single use)")
    u = uses[0]
    if any(l[0] == "t" for l in F.level_labels(u)):
      return _fail("a convolution reused at every step of lax.scan")
    return dict(kind="conv", conv=u.config, has_bias="bias" in u.roles,
                main=u.roles["kernel"].leaf,
                leaves=tuple(v.leaf for v in u.roles.values()),
                roles=("normal",))
  if kinds == {"scale_shift"}:
    sig = {(u.roles["scale"].leaf if "scale" in u.roles else None,
            u.roles["shift"].leaf if "shift" in u.roles else None)
           for u in uses}
    if len(sig) != 1:
      return _fail("scale/shift parameters paired differently across uses")
    scale, shift = sig.pop()
    leaf = scale if scale is not None else shift
    pshape = tuple(s for s in leaf_shapes[leaf][base:] if s > 1)
    return dict(kind="scale_and_shift", param_shape=pshape,
                has_scale=scale is not None, has_shift=shift is not None,
                main=leaf, leaves=tuple(l for l in (scale, shift)
                                        if l is not None),
                roles=("normal",) * len(uses))
  return _fail("used as " + " and ".join(sorted(
      k.replace("scale_shift", "scale/shift") for k in kinds))
               + " (incompatible layer kinds)")


def _dense_like(uses, leaf_shapes, base):
  mains = {(u.roles.get("kernel") or u.roles["table"]).leaf for u in uses}
  if len(mains) != 1:
    return _fail("kernel and bias shared across different layers")
  main = mains.pop()
  biases = {u.roles["bias"].leaf if "bias" in u.roles else None for u in uses}
  if len(biases) != 1:
    return _fail("a bias added after some of its uses only")
  bias = biases.pop()
  kshape = tuple(leaf_shapes[main][base:])
  kinds = {u.kind for u in uses}
  leaves = (main,) + ((bias,) if bias is not None else ())
  if kinds == {"embedding"}:
    return dict(kind="embedding", vocab_size=kshape[0], dim=kshape[1],
                main=main, leaves=leaves, roles=("lookup",) * len(uses))
  canon = (0,) if "embedding" in kinds else next(
      u.config["in_axes"] for u in uses if u.kind == "dense")
  comp = tuple(a for a in range(len(kshape)) if a not in canon)
  roles = []
  for u in uses:
    if u.kind == "embedding":
      roles.append("lookup")
    elif u.config["in_axes"] == canon:
      roles.append("normal")
    elif u.config["in_axes"] == comp:
      roles.append("swapped")
    else:
      return _fail("kernel contracted along different axes in different uses")
  if bias is not None and "swapped" in roles:
    return _fail("a bias on a kernel also used transposed")
  kind = "embedding" if "embedding" in kinds else "dense"
  return dict(kind="dense", layer_kind=kind, kernel_shape=kshape,
              in_axes=canon, has_bias=bias is not None, main=main,
              leaves=leaves, roles=tuple(roles))


def build_layers(uses, opaque, paths, leaf_shapes, n_examples, overrides,
                 exclude, options):
  """All blocks of the model: ``(layers, excluded_paths)``."""
  import fnmatch
  excluded = {k for k, p in enumerate(paths) if any(
      p == e or fnmatch.fnmatchcase(p, e) for e in exclude)}
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
    gl = [k for k in members if k not in excluded]
    if not gl:
      continue
    guses = by_group.get(root, [])
    if any(k in reasons for k in members):
      why = "; ".join(dict.fromkeys(r for k in members for r in reasons.get(k, ())))
      spec = _fail(why)
    elif not guses:
      spec = _fail("no layer pattern uses it")
    else:
      spec = _group_spec(guses, leaf_shapes, n_examples)
      if spec["kind"] != "fallback" and set(spec["leaves"]) & excluded:
        spec = _fail("its layer's other parameters are excluded")
    if spec["kind"] == "fallback":
      spec["leaves"] = tuple(gl)
      spec["param_shapes"] = tuple(tuple(leaf_shapes[k]) for k in gl)
      guses = []
    layers.append(_make_layer(spec, guses, paths, leaf_shapes, overrides,
                              options))
  layers.sort(key=lambda l: min(l.leaves))
  return tuple(layers), tuple(paths[k] for k in sorted(excluded))


def _make_layer(spec, guses, paths, leaf_shapes, overrides, options):
  kind = spec.get("layer_kind", spec["kind"])
  leaves = tuple(spec["leaves"])
  lpaths = tuple(paths[k] for k in leaves)
  stack = None
  if guses and next(iter(guses[0].roles.values())).stacked:
    stack = leaf_shapes[leaves[0]][0]
  notes = ""
  roles = spec.get("roles", ())
  if "swapped" in roles or ("lookup" in roles and spec["kind"] == "dense"):
    notes = (f"tied: {roles.count('lookup')} lookup(s), "
             f"{roles.count('normal')} direct and {roles.count('swapped')} "
             "transposed dense use(s)")
  elif "swapped" in roles:
    notes = "transposed uses swap the factors"
  info = dict(name=lpaths[0], kind=kind, params=lpaths, leaves=leaves,
              leaf_shapes=tuple(tuple(leaf_shapes[k]) for k in leaves),
              uses=len(guses), stack=stack, reason=spec.get("reason"),
              notes=notes, use_ids=tuple(u.uid for u in guses),
              use_roles=tuple(roles), spec=spec)
  override = _blocks.find_override(overrides, lpaths, kind)
  block = _blocks.choose(spec, override, options,
                         lambda b: Layer(block=b, **info))
  return Layer(block=block, **info)


# ----------------------------------------------------------- statistics data
def _samples(use, ct):
  return ct.ndim == len(F.stacked_shape(use, use.probe_aval)) + 1


def _arr(use, x, korder, samples=False, out=True):
  labels = F.level_labels(use) + (use.out_labels if out else use.in_labels)
  arr, labels = F.arrange(x, labels, korder, samples)
  return arr, labels


def _use_dense(layer, use, role, cap, ct, samples):
  """Canonical ``(inputs [L?, N, *sh, in], cots [L?, S?, N, *sh, out])``."""
  spec = layer.spec
  base = 1 if layer.stack else 0
  canon = [a + base for a in spec["in_axes"]]
  rest = [a + base for a in range(len(spec["kernel_shape"]))
          if a + base not in canon]
  if role == "lookup":
    ids, _ = _arr(use, cap, (), out=False)
    ids = ids[..., use.config["id_pos"]]
    cot, _ = _arr(use, ct, rest, samples)
    return F.one_hot(ids, spec["kernel_shape"][0], cot.dtype), cot
  if role == "normal":
    return (_arr(use, cap, canon, out=False)[0],
            _arr(use, ct, rest, samples)[0])
  # Swapped: the output cotangent plays the input role and vice versa.
  return (_arr(use, ct, canon, samples)[0],
          _arr(use, cap, rest, out=False)[0])


def _combine(parts, layer, samples):
  """Concatenate per-use data along one shared axis (after the examples).

  ``parts``: per use ``(inputs [N, *sh, in], cots [S?, N, *sh, out])`` in
  the canonical orientation (no stack axis). When a transposed use puts a
  cotangent in the input role and there is a samples axis, the samples are
  folded into the shared axis ("expand"): the other side repeats over S and
  the cotangent side is scaled by 1/sqrt(S), so G still averages over S.
  """
  swapped = "swapped" in layer.use_roles
  n_in = len(layer.spec["in_axes"])
  n_out = len(layer.spec["kernel_shape"]) - n_in

  def flat(x, nfeat):  # [N, *sh, *feat] -> [N, R, *feat]
    return x.reshape(x.shape[:1] + (-1,) + x.shape[x.ndim - nfeat:])

  def tile(x, s):  # [N, ...] -> [N, S, ...]
    return jnp.broadcast_to(x[:, None], x.shape[:1] + (s,) + x.shape[1:])

  ins, outs = [], []
  for (inp, cot), role in zip(parts, layer.use_roles):
    if not (samples and swapped):
      ins.append(flat(inp, n_in))
      outs.append(jax.vmap(lambda c: flat(c, n_out))(cot) if samples
                  else flat(cot, n_out))
      continue
    if role == "swapped":
      s = inp.shape[0]
      inp, cot = jnp.moveaxis(inp, 0, 1), tile(cot, s)
    else:
      s = cot.shape[0]
      inp, cot = tile(inp, s), jnp.moveaxis(cot, 0, 1)
    ins.append(flat(inp, n_in))
    outs.append(flat(cot, n_out) / math.sqrt(s))
  cot_axis = 2 if samples and not swapped else 1
  return jnp.concatenate(ins, axis=1), jnp.concatenate(outs, axis=cot_axis)


def layer_data(layer, uses, captures, cotangents):
  """The natural ``compute_stats`` data of a detected layer:
  ``(inputs, cotangents)`` (``inputs`` are ids for an embedding block and
  zeros for a shift-only scale/shift block). None for a fallback."""
  if layer.kind == "fallback":
    return None
  us = [uses[i] for i in layer.use_ids]
  spec = layer.spec
  samples = _samples(us[0], cotangents[us[0].uid])
  base = 1 if layer.stack else 0
  if spec["kind"] == "conv":
    u = us[0]
    return (_arr(u, captures[u.uid], (), out=False)[0],
            _arr(u, cotangents[u.uid], (), samples)[0])
  if spec["kind"] == "scale_and_shift":
    parts = []
    for u in us:
      view = u.roles.get("scale") or u.roles["shift"]
      shape = u.probe_aval.shape
      korder = sorted(d for d in view.nonunit(shape) if d is not None)
      cot = _arr(u, cotangents[u.uid], korder, samples)[0]
      # A shift-only block ignores its inputs: zeros shaped like the output.
      inp = (_arr(u, captures[u.uid], korder, out=False)[0]
             if spec["has_scale"] else
             jnp.zeros(cot.shape[:base] + cot.shape[base + int(samples):],
                       cot.dtype))
      parts.append((inp, cot))
    if len(parts) == 1:
      return parts[0]
    nf = len(spec["param_shape"])
    def flat(x, nlead):
      return x.reshape(x.shape[:nlead + 1] + (-1,) + x.shape[x.ndim - nf:])
    inp = jnp.concatenate(
        [flat(p[0], base) for p in parts], axis=base + 1)
    cot = jnp.concatenate([flat(p[1], base + int(samples)) for p in parts],
                          axis=base + 1 + int(samples))
    return inp, cot
  if spec["kind"] == "embedding":
    parts = []
    for u in us:
      ids, _ = _arr(u, captures[u.uid], (), out=False)
      ids = ids[..., u.config["id_pos"]]
      d = base + 1  # the table's dim axis (vocab is its first axis)
      parts.append((ids, _arr(u, cotangents[u.uid], [d], samples)[0]))
    if len(parts) == 1:
      return parts[0]
    ids = jnp.concatenate([p[0].reshape(p[0].shape[:base + 1] + (-1,))
                           for p in parts], axis=base + 1)
    cot = jnp.concatenate([p[1].reshape(p[1].shape[:base + 1 + int(samples)]
                                        + (-1, spec["dim"])) for p in parts],
                          axis=base + 1 + int(samples))
    return ids, cot
  parts = [_use_dense(layer, u, r, captures[u.uid], cotangents[u.uid], samples)
           for u, r in zip(us, layer.use_roles)]
  if len(parts) == 1 and layer.use_roles[0] == "normal":
    return parts[0]
  if layer.stack:
    return jax.vmap(lambda ps: _combine(ps, layer, samples))(parts)
  return _combine(parts, layer, samples)

