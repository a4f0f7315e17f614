"""Recognising hand-written losses in the traced jaxpr (issue 23).

``recognise(closed, num_params, memo)`` returns the loss's jaxpr with a
``loss_tag`` (``losses.loss_tag_p``, the registered losses' own mark)
inserted at every loss it recognises, so the estimators, the scale
convention (element weights ``c`` read from the backward pass to the tag:
any reduction) and Laplace treat it exactly as its registered twin.

1. **The reduction.** From the loss output, the walk goes back through
   operations that are linear in the loss values with coefficients that do
   not depend on the parameters: sums, means (``÷`` a constant or a batch
   value: a mask's count, a weights' total), products by masks or weights,
   ``where`` with a batch predicate, negation, sums of several terms,
   reshapes, slices and gathers of elements, casts. At each value it asks
   whether the value is a loss head (``_loss_heads``); the first one found
   on a path is that path's loss. A path that reaches a non-linear
   operation (``abs``, ``sqrt`` of a mean, a layer) without a head is an
   unrecognised term, reported by ``describe``. Registered losses (their
   tags) and penalties of a parameter alone (``_penalties``) end a path.
2. **The mark.** With ``V = a·ℓ(O, T) + d(T)`` (``_loss_heads.Head``), the
   values ``V`` are replaced, in the scope where they are computed, by
   ``V + a·loss_tag(0, O, T)``: equal values, and the tag's probe
   cotangent is ``a·∂L/∂V = ∂L/∂ℓ``, the twin's element weights. ``O`` and
   ``T`` are reshaped to the twin's layout (``[*values, K]`` for a softmax,
   ``T`` zeros for a squared error without a target).

A recognised tag carries a ``Recognised`` record (form, registered twin,
reduction) that ``describe`` prints; ``recognise`` also lists the terms it
could not recognise.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core as jcore

from kfac_jax_lite.losses import distributions as dists
from kfac_jax_lite import losses
from kfac_jax_lite.tagging import _analysis
from kfac_jax_lite.tagging import _loss_graph
from kfac_jax_lite.tagging import _loss_heads
from kfac_jax_lite.tagging import _loss_kinds
from kfac_jax_lite.tagging import _vma

# Linear in every parameter-dependent operand.
_LINEAR = frozenset({
    "add", "sub", "add_any", "neg", "reduce_sum", "convert_element_type",
    "copy", "copy_p", "reshape", "squeeze", "expand_dims", "broadcast_in_dim",
    "transpose", "reduce_precision", "pvary", "concatenate", "psum", "cumsum",
    "rev", "slice"})
# Linear in the first operand; the others must not depend on parameters.
_LINEAR_FIRST = frozenset({"div", "gather", "dynamic_slice", "pad"})
# Linear when exactly one operand depends on parameters.
_PRODUCTS = frozenset({"mul", "dot_general"})


@dataclasses.dataclass(frozen=True)
class Recognised:
  """What ``describe`` says of a recognised loss: ``form`` (the loss),
  ``twin`` (the registered call it is treated as), ``reduction`` (how its
  values reach the loss), ``output`` / ``target`` (their shapes)."""

  form: str
  twin: str
  reduction: str
  output: tuple
  target: str


# ----------------------------------------------------------------- the walk
def _continues(graph, node):
  """The operands of a chain ``node`` the walk follows, or None when the
  node is not linear in its parameter-dependent operands."""
  name, ins = node.name, node.ins
  dep = [i in graph.pdep for i in ins]
  if name == "convert_element_type" and not graph.is_float(node.outs[0]):
    return None
  if name in _LINEAR:
    return [i for i, d in zip(ins, dep) if d]
  if name in _LINEAR_FIRST:
    return [ins[0]] if dep[0] and not any(dep[1:]) else None
  if name in _PRODUCTS:
    return [ins[dep.index(True)]] if sum(dep) == 1 else None
  if name == "select_n":
    return None if dep[0] else [i for i, d in zip(ins[1:], dep[1:]) if d]
  return None


def _walk(graph, memo):
  """``(heads, paths, unrecognised)``: the heads found, each with its path
  of chain nodes (loss output first), and the terms not recognised: the
  outermost value of each part of the loss no loss was found in, with the
  non-linear operations the walk stopped at."""
  heads, paths, unrecognised, seen = [], [], [], set()
  found = [0]  # Heads and registered losses met.

  def visit(i, path):
    """The non-linear operations below ``i`` where no loss was found, if
    none was found below ``i`` at all (else they are reported here)."""
    if (i in seen or i not in graph.pdep or i not in graph.bdep
        or not graph.is_float(i)):
      return []  # A constant, a batch value, or a penalty of a parameter.
    seen.add(i)
    node = graph.node_of(i)
    if node is None or node.name == losses.loss_tag_p.name:
      found[0] += node is not None
      return []  # A registered loss (or an input).
    head = _loss_heads.find_head(graph, i, memo)
    if head is not None:
      heads.append(head)
      paths.append(tuple(path))
      found[0] += 1
      return []
    nxt = _continues(graph, node)
    if nxt is None:
      return [node.name]
    before, parts = found[0], []
    for j in nxt:
      parts.append((j, visit(j, path + [node])))
    failed = [(j, stops) for j, stops in parts if stops]
    if found[0] > before:  # Losses below: each other part on its own.
      for j, stops in failed:
        report(j, stops)
      return []
    return list(dict.fromkeys(s for _, stops in failed for s in stops))

  def report(i, stops):
    shape = graph.shape(i)
    unrecognised.append(
        f"{'a scalar' if not shape else f'a {list(shape)}'} term from "
        f"`{graph.node_of(i).name}` (reaches "
        f"{', '.join(f'`{s}`' for s in stops)} without a loss head)")

  stops = visit(graph.out, [])
  if stops:
    report(graph.out, stops)
  return heads, paths, unrecognised


# -------------------------------------------------------------- describing
def _forms(head):
  d = head.distribution
  if isinstance(d, dists.Categorical):
    if d.integer_labels:
      return ("softmax cross-entropy, integer labels",
              "kfl.softmax_cross_entropy_with_integer_labels")
    return ("softmax cross-entropy, one-hot or soft labels",
            "kfl.softmax_cross_entropy")
  if isinstance(d, dists.Bernoulli):
    return "sigmoid binary cross-entropy", "kfl.sigmoid_binary_cross_entropy"
  if d.variance == 0.5:
    return "squared error (a Normal of variance 1/2)", "kfl.squared_error"
  if d.variance == 1.0:
    return "squared error / 2 (a Normal of variance 1)", "kfl.l2_loss"
  return (f"Gaussian NLL of variance {d.variance:.6g}",
          f"kfl.registered_loss(kfl.distributions.Normal({d.variance:.6g}))")


def _reduction(graph, head, path):
  """The chain from the values to the loss in words: ``mean``, ``sum``,
  ``masked or weighted mean``, with the steps (``Σ`` over n elements,
  ``÷`` a constant or batch values, ``×`` batch values, ``where``)."""
  steps, summed, divided, by_batch, masked = [], 1, 1.0, False, False
  for node in reversed(path):
    name = node.name
    other = [i for i in node.ins if i not in graph.pdep]
    if name == "reduce_sum":
      n = math.prod(graph.shape(node.ins[0])) // max(
          1, math.prod(graph.shape(node.outs[0])))
      summed *= n
      steps.append(f"Σ{n}")
    elif name in ("div", "mul") and other:
      c = other[-1]
      if c in graph.value and np.size(graph.value[c]) == 1:
        k = float(np.asarray(graph.value[c]))
        divided *= k if name == "div" else 1 / k
        steps.append(f"{'÷' if name == 'div' else '×'}{k:g}")
      else:
        by_batch = True
        steps.append("÷ batch values" if name == "div" else "× batch values")
    elif name == "dot_general":
      by_batch = True
      steps.append("· batch weights")
    elif name == "select_n":
      masked = True
      steps.append("where(mask)")
    elif name == "neg":
      steps.append("−")
  xshape = graph.shape(head.values)
  eshape = head.kind.element_shape(xshape, graph.shape(head.output))
  close = lambda x, n: abs(x - n) <= 1e-6 * n
  whole = summed == math.prod(xshape)
  if by_batch or masked:
    kind = "masked or weighted"
  elif whole and divided == 1.0:
    kind = "sum"
  elif whole and close(divided, math.prod(eshape)):
    kind = "mean"
  elif whole and close(divided, eshape[0]):
    kind = f"mean over the {eshape[0]} of the leading axis, sum over the rest"
  else:
    kind = "scaled sums"
  return f"{kind} ({', '.join(steps) or 'as is'})"


def _record(graph, head, path):
  form, twin = _forms(head)
  if head.scale == -1:
    form += " as a log-likelihood (negated after)"
  elif head.scale != 1:
    form += f", times {head.scale:g}"
  t = head.target
  target = ("zeros" if t is None else
            f"{graph.dtype(t).name}{list(graph.shape(t))}")
  if head.masks:
    target += ", masks " + ", ".join(
        f"{graph.dtype(m).name}{list(graph.shape(m))}" for m in head.masks)
  return Recognised(form, twin, _reduction(graph, head, path),
                    graph.shape(head.output), target)


# -------------------------------------------------------------- the mark
def _marker(head, graph):
  """The closed jaxpr of ``(V, O, T?, *M) -> V + a·k·loss_tag(0, O', T')``
  (``k`` the masks' element weights, ``_loss_kinds.element_weights``; 1
  without masks). For per-class terms summed over the classes (a
  ``summed`` kind) the tag is per element and its term is spread evenly
  over the classes: ``X + a·k·q/K`` broadcast along the last axis."""
  xshape = graph.shape(head.values)
  oshape = graph.shape(head.output)
  odtype = graph.dtype(head.output)
  kind = head.kind
  vshape = kind.element_shape(xshape, oshape)
  event = oshape[-1:] if head.event else ()
  has_t = head.target is not None
  # Closed-over arrays the head reads (visible where the mark goes): passed
  # in, so that the mark's jaxpr has no constants of its own.
  consts = sorted({i for n in head.nodes for i in n.ins if i in graph.value
                   and graph.home_in(i, head.scope) is not None})
  nm = len(head.masks)

  def mark(v, o, *rest):
    t = rest[0] if has_t else None
    rest = rest[1:] if has_t else rest
    masks, const_values = rest[:nm], rest[nm:]
    o2 = lax.reshape(o, vshape + event)
    t2 = _loss_kinds.target_layout(kind.name, t, vshape, oshape[-1], odtype)
    q = losses.loss_tag_p.bind(lax.full(vshape, 0, v.dtype), o2, t2,
                               distribution=head.distribution, num_outputs=1)
    w = np.asarray(head.scale / (oshape[-1] if kind.summed else 1), v.dtype)
    if head.masks:
      def head_fn(ov):
        inputs = dict(zip(head.masks, masks))
        inputs.update(zip(consts, const_values))
        inputs[head.output] = ov
        if has_t:
          inputs[head.target] = t
        x = _loss_graph.evaluate(graph, head.nodes, inputs)[head.values]
        return kind.per_element(x, oshape).reshape(vshape)
      w = w * _loss_kinds.element_weights(
          kind.name, head_fn, vshape, oshape, odtype, t2, head.fit).astype(
              v.dtype)
    term = q if (w.shape == () and float(w) == 1) else q * w
    if kind.summed:
      term = jnp.broadcast_to(term[..., None], vshape + oshape[-1:]).reshape(
          xshape)
    return v + term

  ids = [head.values, head.output] + ([head.target] if has_t else []) + list(
      head.masks) + (consts if head.masks else [])
  marker = jax.make_jaxpr(mark)(*[
      jax.ShapeDtypeStruct(graph.shape(i), graph.dtype(i)) for i in ids])
  if marker.consts:
    raise ValueError("the mark would close over arrays")
  return marker, ids


def _insert(jaxpr, j, marker, operands):
  """``jaxpr`` with ``marker``'s equations after equation ``j``, its inputs
  ``operands`` and its output in place of ``operands[0]`` from there on."""
  sub = dict(zip(marker.jaxpr.invars, operands))
  rename = lambda v: sub.get(v, v) if isinstance(v, jcore.Var) else v
  new_eqns = [e.replace(invars=[rename(v) for v in e.invars])
              for e in marker.jaxpr.eqns]
  out = marker.jaxpr.outvars[0]
  tag = next(e for e in new_eqns if e.primitive is losses.loss_tag_p)
  old = operands[0]
  after = lambda v: out if v is old else v
  # Equations that do not read ``old`` keep their identity (an earlier
  # mark's tag is found again by it).
  rest = [e.replace(invars=[after(v) for v in e.invars])
          if any(v is old for v in e.invars) else e
          for e in jaxpr.eqns[j + 1:]]
  eqns = list(jaxpr.eqns[:j + 1]) + new_eqns + rest
  outvars = [after(v) for v in jaxpr.outvars]
  return jaxpr.replace(eqns=eqns, outvars=outvars), tag


def _with_inner(eqn, jaxpr):
  name = _analysis.CALL_PRIMS[eqn.primitive.name]
  j = eqn.params[name]
  new = j.replace(jaxpr=jaxpr) if hasattr(j, "consts") else jaxpr
  return eqn.replace(params={**eqn.params, name: new})


def _rewrite(jaxpr, scope, marks):
  """``jaxpr`` (at ``scope``) with the marks ``{scope: [(j, marker,
  operands, record)]}`` inserted; returns it and ``{id(tag eqn): record}``."""
  records = {}
  nested = {s[len(scope)] for s in marks if len(s) > len(scope)
            and s[:len(scope)] == scope}
  if nested:
    eqns = list(jaxpr.eqns)
    for j in nested:
      found = _analysis.inner_jaxpr(eqns[j])
      assert found is not None  # A marked scope is a call's jaxpr.
      inner = found[0]
      new, rec = _rewrite(inner, scope + (j, 0), marks)
      eqns[j] = _with_inner(eqns[j], new)
      records.update(rec)
    jaxpr = jaxpr.replace(eqns=eqns)
  for j, marker, operands, record in sorted(marks.get(scope, ()),
                                            key=lambda m: -m[0]):
    jaxpr, tag = _insert(jaxpr, j, marker, operands)
    records[id(tag)] = record
  return jaxpr, records


def recognise(closed, num_params, memo):
  """``(closed', records, unrecognised)``: ``closed`` with a tag at each
  recognised loss (module doc), ``{id(tag equation): Recognised}``, and the
  terms of the loss no head was found for (``describe``'s notes).

  ``num_params``: the leading jaxpr inputs that are parameter leaves;
  ``memo``: a dict the caller keeps across re-traces of one loss
  (``_loss_heads.find_head``)."""
  try:
    graph = _loss_graph.LossGraph(closed, num_params)
  except Exception:  # An unusual jaxpr: nothing recognised.
    return closed, {}, []
  heads, paths, unrecognised = _walk(graph, memo)
  if any(_vma.aval_vma(a) for a in graph.aval.values()):
    # Traced inside shard_map(check_vma=True): the heads' pvary casts do not
    # evaluate outside it and a mark would need the varying axes.
    return closed, {}, [f"{u}; inside shard_map(check_vma=True) no loss is "
                        "recognised: register it (kfl.softmax_cross_entropy"
                        ", ...)" for u in unrecognised + [
                            f"a {_forms(h)[0]}" for h in heads]]
  marks = {}
  for head, path in zip(heads, paths):
    v_home = graph.defined_homes(head.values)[0]
    def var(i, scope=head.scope):
      home = graph.home_in(i, scope)
      if home is None:  # Not markable (caught below).
        raise ValueError(f"no home of node {i} in scope {scope}")
      return home.var
    try:
      marker, ids = _marker(head, graph)
      operands = [v_home.var] + [var(i) for i in ids[1:]]
    except Exception:  # A layout the twin cannot take: not recognised.
      node = graph.node_of(head.values)
      assert node is not None  # A head's values are a node's output.
      unrecognised.append(f"`{node.name}` -> "
                          f"{list(graph.shape(head.values))} (not markable)")
      continue
    marks.setdefault(head.scope, []).append(
        (v_home.how[1], marker, operands, _record(graph, head, path)))
  if not marks:
    return closed, {}, unrecognised
  jaxpr, records = _rewrite(closed.jaxpr, (), marks)
  return closed.replace(jaxpr=jaxpr), records, unrecognised


def output_layers(tagged):
  """Per loss of ``tagged`` (registered or recognised), the layers whose
  outputs its model outputs are computed from (the nearest on every path
  back from them), for ``describe``."""
  graph = _loss_graph.LossGraph(tagged.closed, len(tagged.leaf_shapes))
  probes = tagged.layer_outputs
  by_key = {n.key: n for n in graph.nodes}
  found = []
  for t in tagged.losses:
    node, names, seen = by_key.get(t.key), [], set()
    stack = [] if node is None else list(node.ins[1:1 + t.num_outputs])
    while stack and len(seen) < 2000:
      i = stack.pop()
      n = graph.node_of(i)
      if i in seen or n is None:
        continue
      seen.add(i)
      if n.key in probes:
        names.append(probes[n.key])
        continue
      stack.extend(j for j in n.ins if j in graph.pdep)
    found.append(tuple(dict.fromkeys(names)))
  return found
