"""Rows that are not examples: which example each row of a layer serves.

A graph network applies its node and edge layers to every node and edge
of a batch of graphs and pools them per graph with ``jax.ops.segment_sum``
(a ``scatter-add`` whose indices are the segment ids); the loss has one
example per graph. ``find(jaxpr, key, n)`` follows the leading (row) axis
of a layer's output forward through the ops that keep rows apart
(elementwise ops, calls such as ``relu``, concatenation or contraction of
feature axes, layout changes of the other axes) and through each
``segment_sum`` (row ``r`` goes to row ``ids[r]``), until it reaches a
value whose leading axis has the loss's ``n`` examples. It returns the
chain of segment-id variables (``Step``s), or None: the map is then
unknown (``Layer.row_uses`` without a map, ``_layers``).

At run time the ids are captured (``_interpret``) and ``examples`` composes
them: ``ex[r]`` the example of row ``r``, -1 for a row no example uses (an
id out of range, which ``segment_sum`` drops). Other paths from a row to
the loss (messages to neighbouring nodes of the same graph) are taken to
stay within its example, as K-FAC takes examples to be independent.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

import jax.numpy as jnp

from kfac_jax_lite.tagging import _views

# The capture slots of the segment ids: ``SLOTS + 64·uid + j`` (ints, so
# the captures stay a dict with sortable keys; probes and uses are below).
SLOTS = 1 << 24

_ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "max", "min", "neg", "tanh", "logistic",
    "exp", "log", "log1p", "expm1", "sqrt", "rsqrt", "integer_pow", "pow",
    "abs", "sign", "erf", "square", "select_n", "stop_gradient", "sin",
    "cos", "add_any", "atan2", "erf_inv", "clamp", "nextafter", "tan",
    "cbrt", "is_finite", "ne", "eq", "lt", "gt", "le", "ge"})
_CALLS = frozenset({"custom_jvp_call", "custom_vjp_call", "jit", "pjit",
                    "closed_call", "remat2", "checkpoint"})


@dataclasses.dataclass(frozen=True)
class Step:
  """One ``segment_sum`` on the way: the ``scatter-add`` at equation
  ``key`` whose ids (its operand 1, ``[R, 1]``, captured when it runs)
  send its ``R`` rows to ``size`` rows."""
  key: tuple
  size: int


def _keeps_rows(eqn, pos, rows):
  """Whether output 0 of ``eqn`` keeps axis 0 (``rows`` long) of its
  operand ``pos`` as its own axis 0."""
  name = eqn.primitive.name
  out = eqn.outvars[0].aval
  if not getattr(out, "shape", ()) or out.shape[0] != rows:
    return False
  if name in _ELEMENTWISE or name in _CALLS or name in _views.IDENTITY_PRIMS:
    return True
  p = eqn.params
  if name == "concatenate":
    return p["dimension"] != 0
  if name == "dot_general":
    (lc, _), (lb, rb) = p["dimension_numbers"]
    return pos == 0 and not lb and not rb and 0 not in lc
  if name in ("reduce_sum", "reduce_max", "reduce_min", "argmax", "argmin"):
    return 0 not in p["axes"]
  if name in _views.LAYOUT_PRIMS:
    mapping = _views.layout_map(eqn)
    if mapping is not None:
      return mapping[0] == 0
    return name == "reshape" and p.get("dimensions") is None
  if name == "slice":
    return p["start_indices"][0] == 0 and (p["strides"] or (1,))[0] == 1
  return False


def _segment(eqn, pos):
  """The number of segments when ``eqn`` is a ``segment_sum`` of operand
  ``pos`` along its rows, else None."""
  if eqn.primitive.name != "scatter-add" or pos != 2:
    return None
  dn = eqn.params["dimension_numbers"]
  ids = eqn.invars[1]
  if (tuple(dn.inserted_window_dims) != (0,)
      or tuple(dn.scatter_dims_to_operand_dims) != (0,)
      or 0 in dn.update_window_dims or getattr(dn, "operand_batching_dims", ())
      or len(ids.aval.shape) != 2 or ids.aval.shape[1] != 1):
    return None
  return eqn.outvars[0].aval.shape[0]


def find(jaxpr, key, n):
  """The ``Step``s from the rows of the output of the equation at ``key``
  (in ``jaxpr`` or a call nested in it) to ``n`` examples, or None
  (module doc). Breadth-first: the fewest ``segment_sum``s."""
  from kfac_jax_lite.tagging._analysis import inner_jaxpr
  prefix = key[:-1]
  for k in range(0, len(prefix), 2):
    inner = inner_jaxpr(jaxpr.eqns[prefix[k]])
    if inner is None or prefix[k + 1] != 0:
      return None  # A loop or branch body: its rows are not followed.
    jaxpr = inner[0]
  start = jaxpr.eqns[key[-1]].outvars[0]
  shape = getattr(start.aval, "shape", ())
  if not shape or shape[0] == n:
    return None
  consumers = collections.defaultdict(list)
  for i, eqn in enumerate(jaxpr.eqns):
    for p, v in enumerate(eqn.invars):
      if not hasattr(v, "val"):
        consumers[v].append((i, p))
  queue: collections.deque[tuple[Any, tuple]] = collections.deque(
      [(start, ())])
  seen = {start}
  while queue:
    var, chain = queue.popleft()
    rows = var.aval.shape[0]
    if rows == n and chain:
      return chain
    for i, pos in consumers.get(var, ()):
      eqn = jaxpr.eqns[i]
      seg = _segment(eqn, pos)
      if seg is not None:
        nxt = (eqn.outvars[0], chain + (Step(prefix + (i,), seg),))
      elif _keeps_rows(eqn, pos, rows):
        nxt = (eqn.outvars[0], chain)
      else:
        continue
      if nxt[0] not in seen and len(queue) < 10_000:
        seen.add(nxt[0])
        queue.append(nxt)
  return None


def slot(uid, j):
  return SLOTS + 64 * uid + j


def examples(steps, uid, captures, rows):
  """``ex [rows]``: the example of each row (-1: none), composing the
  captured segment ids of ``steps`` (those of use ``uid``)."""
  ex = jnp.arange(rows)
  for j, step in enumerate(steps):
    ids = jnp.asarray(captures[slot(uid, j)]).reshape(-1).astype(jnp.int32)
    ok = (ex >= 0) & (ex < ids.shape[0])
    nxt = ids[jnp.clip(ex, 0, ids.shape[0] - 1)]
    ex = jnp.where(ok & (nxt >= 0) & (nxt < step.size), nxt, -1)
  return ex


def per_example(x, ex, n):
  """``Σ_{r: ex[r] = i} x[r]`` ``[n, ...]`` over axis 0 of ``x`` (rows of
  no example dropped) and the rows' counts ``[n]``."""
  idx = jnp.where(ex >= 0, ex, n)
  total = jnp.zeros((n,) + x.shape[1:], x.dtype).at[idx].add(x, mode="drop")
  count = jnp.zeros((n,), x.dtype).at[idx].add(1, mode="drop")
  return total, count


def mapped_data(layer, steps, uid, captures, inputs, cts, weights):
  """``LayerData`` of a ``row_map`` layer: each row a use of its example.

  ``inputs``/``cts``: the layer's data (``LayerSpec.data``), its rows in
  place of examples; ``steps``: the segment ids of its use ``uid``;
  ``weights``: the examples' ``c_i`` (None: 1/N). "expand" (and every kind
  but a dense layer's "reduce"): the rows are the examples of the block's
  data, row ``r`` weighted by its example's ``c_i`` (its cotangent is
  already that example's own, ``∂ℓ_i/∂y_r``), so ``A`` averages the rows
  by their examples' weights and ``G`` sums ``c_i g_r g_rᵀ`` over the
  rows: the sums over uses. A dense layer's "reduce" sums each example's
  rows first: its input the mean ``ã_i`` over the example's rows (and
  shared axes), its cotangent the sum ``ĝ_i``, one position per example;
  an example with no rows weighs nothing."""
  from kfac_jax_lite import blocks as B
  stacked = bool(layer.stack)
  ex = examples(steps, uid, captures, inputs.shape[1 if stacked else 0])
  n = steps[-1].size
  c = (jnp.full((n,), 1.0 / n, cts.dtype) if weights is None
       else jnp.asarray(weights))
  spec = layer.spec
  if (getattr(layer.block, "weight_sharing", None) == "reduce"
      and not stacked and spec.kind == "dense"
      and set(getattr(spec, "roles", ())) == {"normal"}):
    in_dims = inputs.shape[inputs.ndim - len(spec.in_axes):]
    out_dims = cts.shape[cts.ndim - len(spec.out_axes):]
    a = inputs.reshape(inputs.shape[0], -1, math.prod(in_dims))
    total, count = per_example(a.sum(1), ex, n)
    mean = total / jnp.where(count > 0, count * a.shape[1], 1)[:, None]
    g = cts.reshape(cts.shape[:2] + (-1, math.prod(out_dims))).sum(2)
    g_hat = jnp.moveaxis(per_example(jnp.moveaxis(g, 1, 0), ex, n)[0], 0, 1)
    return B.LayerData(
        inputs=mean.reshape((n, 1) + tuple(in_dims)).astype(inputs.dtype),
        cotangents=g_hat.reshape(g_hat.shape[:2] + (1,) + tuple(out_dims)),
        weights=jnp.where(count > 0, c, 0))
  w = jnp.where(ex >= 0, c[jnp.clip(ex, 0, n - 1)], 0)
  return B.LayerData(inputs=inputs, cotangents=cts,
                     weights=spec.example_weights(w, inputs, stacked))
