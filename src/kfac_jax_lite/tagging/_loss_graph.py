"""The traced loss as one flat graph, for recognising hand-written losses.

``LossGraph(closed, num_params)`` inlines every call-like nested jaxpr
(``jit``/``pjit``, ``custom_jvp_call``, ``custom_vjp_call``, ``checkpoint``;
``_analysis.CALL_PRIMS``) into one list of primitive ``Node``s in
topological order, so that a loss written through ``optax`` (whose pieces
sit in nested ``jit``s: ``take_along_axis``, ``log_softmax``,
``logsumexp``) reads as one computation. A value has one id however many
scopes it crosses: a nested jaxpr's inputs are its caller's operands, a
call's outputs are the nested jaxpr's outputs. Each id remembers where it
is visible (``homes``: the scope, the jaxpr variable and how it is defined
there), since a loss mark can only be inserted in one scope, next to the
values it annotates.

Every value is classified by what it is computed from: ``pdep`` (depends on
a parameter leaf), ``bdep`` (on a batch leaf); neither is a constant
(literals, closed-over arrays, ``iota``). ``scan``, ``cond`` and ``while``
are single opaque nodes (their outputs depend on all their inputs).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from kfac_jax_lite.tagging import _analysis


@dataclasses.dataclass
class Node:
  """One primitive equation: ``ins``/``outs`` value ids, ``key`` its
  equation key (``_analysis`` convention: the scope's prefix then its
  index), ``scope`` that prefix."""

  eqn: Any
  ins: tuple
  outs: tuple
  key: tuple
  index: int  # Position in ``LossGraph.nodes`` (topological).

  @property
  def name(self):
    return self.eqn.primitive.name

  @property
  def scope(self):
    return self.key[:-1]


@dataclasses.dataclass(frozen=True)
class Home:
  """Where a value is visible: in ``scope``, as jaxpr variable ``var``,
  defined there as ``how``: ``("in", i)`` the scope's i-th input,
  ``("eqn", j, k)`` output k of its equation j (a call's output too),
  ``("const", i)`` its i-th constant."""

  scope: tuple
  var: Any
  how: tuple


def _is_literal(v):
  return hasattr(v, "val")


class LossGraph:
  """See the module docstring. ``nodes``; ``producer[id] = (node, k)``
  (absent for inputs and constants); ``consumers[id]``: nodes; ``aval[id]``;
  ``value[id]``: the value of a literal or closed-over constant;
  ``homes[id]``: ``Home``s; ``scopes[prefix]``: the jaxpr of each scope;
  ``params``/``batch``: the top-level input ids; ``out``: the loss id."""

  def __init__(self, closed, num_params):
    self.nodes: list[Node] = []
    self.producer, self.consumers = {}, {}
    self.aval, self.value, self.homes, self.scopes = {}, {}, {}, {}
    self._next = 0
    jaxpr = closed.jaxpr
    ins = [self._new(v.aval) for v in jaxpr.invars]
    self.params = frozenset(ins[:num_params])
    self.batch = frozenset(ins[num_params:])
    outs = self._build(jaxpr, closed.consts, ins, ())
    self.out = outs[0]
    self.pdep = self._depending_on(self.params)
    self.bdep = self._depending_on(self.batch)

  # ------------------------------------------------------------ building
  def _new(self, aval):
    i = self._next
    self._next += 1
    self.aval[i] = aval
    self.homes[i] = []
    return i

  def _home(self, i, scope, var, how):
    self.homes[i].append(Home(scope, var, how))

  def _build(self, jaxpr, consts, in_ids, scope):
    self.scopes[scope] = jaxpr
    env = {}
    for n, (v, c) in enumerate(zip(jaxpr.constvars, consts)):
      env[v] = self._new(v.aval)
      self.value[env[v]] = c
      self._home(env[v], scope, v, ("const", n))
    for n, (v, i) in enumerate(zip(jaxpr.invars, in_ids)):
      env[v] = i
      self._home(i, scope, v, ("in", n))

    def read(v):
      if _is_literal(v):
        i = self._new(v.aval)
        self.value[i] = v.val
        return i
      return env[v]

    for j, eqn in enumerate(jaxpr.eqns):
      ins = [read(v) for v in eqn.invars]
      inner = _analysis.inner_jaxpr(eqn)
      if inner is not None and len(inner[0].invars) == len(ins):
        outs = self._build(inner[0], inner[1], ins, scope + (j, 0))
      else:
        outs = [self._new(v.aval) for v in eqn.outvars]
        node = Node(eqn, tuple(ins), tuple(outs), scope + (j,),
                    len(self.nodes))
        self.nodes.append(node)
        for k, o in enumerate(outs):
          self.producer[o] = (node, k)
        for i in set(ins):
          self.consumers.setdefault(i, []).append(node)
      for k, (v, o) in enumerate(zip(eqn.outvars, outs)):
        env[v] = o
        self._home(o, scope, v, ("eqn", j, k))
    return [read(v) for v in jaxpr.outvars]

  def _depending_on(self, sources):
    dep = set(sources)
    for node in self.nodes:
      if any(i in dep for i in node.ins):
        dep.update(node.outs)
    return frozenset(dep)

  # ------------------------------------------------------------- queries
  def shape(self, i):
    return tuple(self.aval[i].shape)

  def dtype(self, i):
    return np.dtype(self.aval[i].dtype)

  def is_float(self, i):
    return np.issubdtype(self.dtype(i), np.floating)

  def node_of(self, i):
    """The node computing ``i`` (None for an input or constant)."""
    got = self.producer.get(i)
    return None if got is None else got[0]

  def home_in(self, i, scope):
    """``i``'s ``Home`` in ``scope``, or None where it is not visible."""
    return next((h for h in self.homes[i] if h.scope == scope), None)

  def defined_homes(self, i):
    """The scopes where ``i`` is an equation's output, outermost first."""
    return sorted((h for h in self.homes[i] if h.how[0] == "eqn"),
                  key=lambda h: len(h.scope))

  def is_constant(self, i):
    """Computed from literals and closed-over arrays only."""
    return i not in self.pdep and i not in self.bdep


def evaluate(graph, nodes, inputs):
  """The values of ``nodes`` (in order) from ``inputs`` ``{id: array}``;
  literal and constant ids take their values. Returns the environment."""
  from kfac_jax_lite.tagging._interpret import bind_equation
  env = dict(inputs)

  def read(i):
    return env[i] if i in env else graph.value[i]

  for node in nodes:
    outs = bind_equation(node.eqn, [read(i) for i in node.ins])
    env.update(zip(node.outs, outs))
  return env
