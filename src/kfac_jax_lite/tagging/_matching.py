"""Matching re-laid-out parameter views to the layer patterns around them.

The graph walk (``_analysis``) classifies the equation that consumes a
parameter; these helpers look at its neighbourhood: the bias ``add`` after
a dense or conv output (through layout ops, a sliced kernel's own block of
a sliced bias, a per-head bias along a ``dot_general`` batch axis), the
``add`` that broadcasts a table looked up without an example axis against
every example, a kernel reshaped by splitting or merging axes
(``_views.Regrouped``) in a ``dot_general``, the rows of a table sliced and
added to every example (``x + pos[:t]``), an embedding lookup
(``gather`` of a table's rows), and the token that names a
layer input (slices of one kernel applied to the same input are one
layer). ``ViewMatching`` is a mixin of ``_analysis.Analysis``: its
methods take the walk's context ``ctx`` (the jaxpr, the views of its
variables, their consumers, the claimed equations).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.core  # Explicit, so that type checkers see jax.core.ShapedArray.
import numpy as np

from kfac_jax_lite.tagging import _scaled
from kfac_jax_lite.tagging import _views
from kfac_jax_lite.tagging._views import Sliced, View


def is_var(v):
  """Whether ``v`` is a jaxpr variable (not a literal)."""
  return not hasattr(v, "val")  # Literals carry .val



class ViewMatching:
  """The neighbourhood matchers of the graph walk (see the module doc)."""

  # Provided by _analysis.Analysis, which this is a mixin of.
  _record: Callable[..., None]

  def _single_consumer(self, var, ctx):
    cons = ctx["consumers"].get(var, [])
    if len(cons) != 1 or var in ctx["outset"]:
      return None
    return cons[0]

  def _follow(self, var, labels, ctx):
    """Follow single-consumer layout ops from ``var``: [(var, labels, idx)]."""
    chain = []
    while True:
      j = self._single_consumer(var, ctx)
      if j is None:
        return chain
      eqn = ctx["jaxpr"].eqns[j]
      if eqn.primitive.name == "broadcast_in_dim":
        return chain
      mapping = _views.layout_map(eqn) if (
          eqn.primitive.name in _views.IDENTITY_PRIMS
          or eqn.primitive.name in _views.LAYOUT_PRIMS) else None
      if mapping is None:
        return chain
      labels = tuple(("u",) if m is None else labels[m] for m in mapping)
      var = eqn.outvars[0]
      chain.append((var, labels, j))

  def _bias_add(self, var, labels, ctx, feature_labels, stack=None):
    """Find ``add(var', bias)`` after ``var`` (through layout ops) where the
    bias covers exactly the axes labelled in ``feature_labels`` (and, for a
    kernel stacked along a ``dot_general`` batch axis, ``stack``: the axis
    labelled ``("L",)`` with its own leading axis).
    Returns (add_index, bias_view, out_labels) or None."""
    cands = [(var, labels, None)] + self._follow(var, labels, ctx)
    for v, labs, _ in cands:
      j = self._single_consumer(v, ctx)
      if j is None:
        continue
      eqn = ctx["jaxpr"].eqns[j]
      if eqn.primitive.name != "add" or j in ctx["claimed"]:
        continue
      other = [w for w in eqn.invars if w is not v]
      if len(other) != 1 or not is_var(other[0]):
        continue
      bview = ctx["env"].get(other[0])
      if not isinstance(bview, View) or getattr(bview, "scales", ()):
        continue
      shape = tuple(eqn.outvars[0].aval.shape)
      if shape != tuple(v.aval.shape):
        continue
      nonunit = bview.nonunit(shape)
      if stack is not None:
        if bview.stacked or [nonunit[k] for k in range(len(shape))
                             if labs[k] == ("L",)] != [0]:
          continue
        nonunit = tuple(None if labs[k] == ("L",) else d
                        for k, d in enumerate(nonunit))
      feats = [(labs[k], nonunit[k]) for k in range(len(shape))
               if labs[k] in feature_labels and shape[k] > 1]
      others = [nonunit[k] for k in range(len(shape))
                if not (labs[k] in feature_labels and shape[k] > 1)]
      if any(o is not None for o in others) or any(b is None for _, b in feats):
        continue
      order = [b for _, b in sorted(feats, key=lambda t: t[0])
               if b is not None]  # (None of them is.)
      if order != sorted(order) or not bview.covers(shape):
        continue
      if stack is not None:
        bview = dataclasses.replace(bview, stacked=stack)
      return j, bview, labs
    return None

  def _source(self, var, ctx):
    """A token naming the value ``var`` (stable across traces): the key of
    the equation that computes it, or of the jaxpr input it is."""
    jaxpr = ctx["jaxpr"]
    if var in jaxpr.invars:
      return ctx["prefix"] + ("in", jaxpr.invars.index(var))
    for j, eqn in enumerate(jaxpr.eqns):
      if any(o is var for o in eqn.outvars):
        return ctx["prefix"] + (j, eqn.outvars.index(var))
    return ctx["prefix"] + ("const", jaxpr.constvars.index(var))

  def _dense_regrouped(self, i, eqn, k, kv, ctx):
    """``x ·W'`` with ``W' = W.reshape(...)`` splitting or merging axes: a
    dense use of ``W`` when the contraction takes whole groups. Its data
    is arranged over ``W'``'s axes (``config["virtual"]``: the contracted
    and free axes of ``W'``) and reshaped to ``W``'s by the dense kind."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    kc, xc = (lc, rc) if k == 0 else (rc, lc)
    if (lb if k == 0 else rb):
      return "a dot_general batch dimension on the kernel (per-group weights)"
    kc, xc = tuple(kc), tuple(xc)
    nk = len(kv.shape)
    cgroups = {kv.groups[a] for a in kc}
    if any(kv.groups[a] in cgroups and a not in kc for a in range(nk)):
      return f"{kv.how}, then contracted over part of a reshaped axis"
    x = eqn.invars[1 - k]
    in_labels, b = [], 0
    for d in range(len(x.aval.shape)):
      if d in xc:
        in_labels.append(("k", kc[xc.index(d)]))
      else:
        in_labels.append(("b", b))
        b += 1
    free = [a for a in range(nk) if a not in kc]
    if b == 0 or not free:
      return f"{kv.how}, then an unsupported dot_general"
    x_free = [("b", j) for j in range(b)]
    k_free = [("k", a) for a in free]
    out_labels = k_free + x_free if k == 0 else x_free + k_free
    in_axes = tuple(sorted(r for g in sorted(cgroups) for r in kv.real[g]))
    self._record_dense(i, eqn, x, kv, in_labels, out_labels, k_free, ctx,
                       dict(in_axes=in_axes, kernel_shape=tuple(kv.leaf_shape),
                            virtual=(tuple(sorted(kc)), tuple(free))))
    return None

  def _record_dense(self, i, eqn, x, kv, in_labels, out_labels, k_free, ctx,
                    config):
    """Records the dense use at equation ``i`` (input ``x``, kernel view
    ``kv``), with the bias added right after it when there is one (then
    the bias's output is the probed value)."""
    probe_i, probe_aval = i, eqn.outvars[0].aval
    roles, labels = {"kernel": kv}, tuple(out_labels)
    stack = kv.stacked if ("L",) in labels else None
    found = self._bias_add(eqn.outvars[0], labels, ctx, set(k_free), stack)
    if found is not None and not same_block(kv, found, ctx):
      found = None  # ``x @ W[:, :d] + b[d:]``: not the kernel's own bias.
    if found is not None:
      j, bview, labels = found
      ctx["claimed"].add(j)
      roles["bias"] = bview
      probe_i, probe_aval = j, ctx["jaxpr"].eqns[j].outvars[0].aval
    self._record("dense", roles, ctx, i, _scaled.capture(x, kv), x.aval,
                 probe_i,
                 probe_aval, in_labels, labels, config)

  def _broadcast_site(self, var, labels: tuple[tuple, ...], ctx):
    """Follow ``var`` (axes ``labels``) through single-consumer layout ops
    to an ``add`` that broadcasts it against an activation. Returns
    ``(add key, add output aval, its labels, new axis sizes)``, the axes
    the value gained there (all in front of its own non-feature axes)
    labelled ``("b", 0..m-1)`` and its own
    ``("b", j)`` shifted to ``("b", j + m)``; None if there is no such add.
    """
    while True:
      j = self._single_consumer(var, ctx)
      if j is None:
        # A value returned by a jit/pjit: go on after the call.
        pc = ctx["parent"]
        if (pc is None or ctx["consumers"].get(var) or not is_var(var)
            or list(ctx["jaxpr"].outvars).count(var) != 1):
          return None
        var = pc[0]["jaxpr"].eqns[pc[1]].outvars[
            list(ctx["jaxpr"].outvars).index(var)]
        ctx = pc[0]
        continue
      eqn = ctx["jaxpr"].eqns[j]
      name = eqn.primitive.name
      if name in _views.IDENTITY_PRIMS or name in _views.LAYOUT_PRIMS:
        mapping = _views.layout_map(eqn)
        if mapping is None:
          return None
        labels = tuple(("u",) if m is None else labels[m] for m in mapping)
        var = eqn.outvars[0]
        continue
      if name != "add" or j in ctx["claimed"]:
        return None
      other = [w for w in eqn.invars if w is not var]
      if len(other) != 1 or not is_var(other[0]) or other[0] in ctx["env"]:
        return None
      out = eqn.outvars[0].aval
      if len(out.shape) != len(labels):
        return None
      new = [k for k, (l, n) in enumerate(zip(labels, out.shape))
             if l == ("u",) and n > 1]
      own = [k for k, l in enumerate(labels) if l[0] == "b"]
      if not new or (own and max(new) > min(own)):
        # Only axes in front of the value's own: ``emb[ids][:, None]``
        # broadcast over positions keeps its examples.
        return None
      rank = {k: r for r, k in enumerate(new)}
      m = len(new)
      out_labels = tuple(
          ("b", rank[k]) if k in rank else
          ("b", l[1] + m) if l[0] == "b" else l
          for k, l in enumerate(labels))
      return (ctx["prefix"] + (j,), out, out_labels,
              tuple(out.shape[k] for k in new))

  def _lookup_site(self, out, out_labels, in_labels, ind, ctx):
    """``(site, in_labels)``: ``_broadcast_site`` of a lookup's output
    ``out``; for ids with unit axes (``pos[jnp.arange(T)[None]]``) not
    found as they are, with those axes taken as broadcast ones (the lookup
    ``pos[jnp.arange(T)]``), the ids' labels relabelled to match."""
    site = self._broadcast_site(out, tuple(out_labels), ctx)
    n_idx = len(ind.aval.shape) - 1
    ones = [j for j in range(n_idx) if ind.aval.shape[j] == 1]
    if site is not None or not ones:
      return site, in_labels
    left = [j for j in range(n_idx) if j not in ones]
    unit = lambda ls: [l if l[0] != "b" else ("u",) if l[1] in ones
                       else ("b", left.index(l[1])) for l in ls]
    site = self._broadcast_site(out, tuple(unit(out_labels)), ctx)
    return site, (unit(in_labels) if site is not None else in_labels)

  def _sliced_rows(self, i, eqn, views, ctx):
    """``x + pos[lo:hi]``: rows of a 2-D table sliced along its first axis
    (a position table longer than the sequence) and added to every
    example, an embedding use whose ids ``lo, ..., hi - 1`` run along the
    rows' axis, broadcast over the others (the capture ``("iota", lo,
    shape, axis)``). The block is over the whole table: rows outside the
    slice get zero statistics. Returns None, or why it is not one."""
    k = 0 if views[0] is not None else 1
    sv, out = views[k], eqn.outvars[0]
    shape = tuple(out.aval.shape)
    if (eqn.primitive.name != "add" or views[1 - k] is not None
        or not isinstance(sv, Sliced) or sv.stacked
        or len(sv.leaf_shape) != 2 or sv.window[1] != (0, sv.leaf_shape[1])
        or not sv.covers(shape)):
      return ("sliced before `" + eqn.primitive.name + "` (only a dense "
              "kernel and its bias, or rows of a 2-D table added to every "
              "example, may be used in slices)")
    nonunit = sv.nonunit(shape)
    if 0 not in nonunit or 1 not in nonunit or len(shape) < 3:
      return "rows of a table sliced and added without an example axis"
    f, r = nonunit.index(1), nonunit.index(0)
    axes = [q for q in range(len(shape)) if q != f]
    out_labels = tuple(("k", 1) if q == f else ("b", axes.index(q))
                       for q in range(len(shape)))
    ids = tuple(shape[q] for q in axes) + (1,)
    self._record("embedding", {"table": View(sv.leaf, (0, 1), sv.leaf_shape)},
                 ctx, i, ("iota", sv.window[0][0], ids, axes.index(r)),
                 jax.core.ShapedArray(ids, np.int32), i, out.aval,
                 [("b", j) for j in range(len(axes))] + [("iv", 0)],
                 out_labels, dict(vocab_size=sv.leaf_shape[0],
                                  dim=sv.leaf_shape[1], id_pos=0))
    return None

  def _broadcast_labels(self, view, shape):
    nonunit = view.nonunit(shape)
    labels, b = [], 0
    for d in nonunit:
      if d is None:
        labels.append(("b", b))
        b += 1
      else:
        labels.append(("k", d))
    return tuple(labels), nonunit


def _window(view, d):
  return view.window[d] if isinstance(view, Sliced) else (
      0, view.leaf_shape[d])


def same_block(kv, found, ctx):
  """Whether the bias of ``found`` (``_bias_add``'s answer) is the block
  of the bias that matches a sliced kernel ``kv``'s output columns."""
  j, bview, labels = found
  if not isinstance(kv, Sliced) and not isinstance(bview, Sliced):
    return True
  shape = tuple(ctx["jaxpr"].eqns[j].outvars[0].aval.shape)
  for lab, e in zip(labels, bview.nonunit(shape)):
    if e is None or lab[0] != "k":
      continue
    d = lab[1]
    if (kv.leaf_shape[d] != bview.leaf_shape[e]
        or _window(kv, d) != _window(bview, e)):
      return False
  return True
