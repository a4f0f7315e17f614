"""Loss heads: per-element loss values recognised by their math.

A *head* is the part of the traced loss that computes per-element values
``V`` from the model's output ``O`` and a target ``T``. ``find_head(graph,
v)`` tells whether the value ``v`` of a ``LossGraph`` is one:

1. ``O`` is a value every parameter-dependent path into ``v`` passes
   through (a dominator), tried from the closest to ``v`` backwards (so a
   model ending in ``tanh`` has the ``tanh``'s output as ``O``, and a
   log-softmax output counts as logits: the softmax of log-probabilities is
   the same distribution, with the same Fisher in the logits). The walk
   stops at a node with a parameter-only operand (a layer).
2. The head is the sub-graph from ``O``, its batch-dependent operands (the
   target and masks, visible in the scope where the mark goes) and
   constants to ``v``. Operands computed from one common batch value (``t``
   and ``1 - t`` of a written-out cross-entropy; a ``where=`` mask and its
   ``any``) are traced back to it. Its shapes and primitives must fit a
   distribution (``_loss_kinds``):

   * ``Categorical`` (softmax cross-entropy): ``O = [..., K]``, ``V`` its
     leading shape (unit axes aside: ``take_along_axis`` keeps one); the
     target integer labels shaped like ``V`` or one-hot/soft labels shaped
     like ``O``; the head uses ``exp`` and ``log``;
   * ``Bernoulli`` (sigmoid binary cross-entropy) and ``Normal`` (squared
     error, a Gaussian of fixed variance): ``V`` shaped like ``O``, the
     target too (or none: zeros); ``log``/``log1p`` and ``exp``/``logistic``
     for the first, a square for the second.
3. The head is evaluated (jitted, once per structure) at two random
   outputs ``O₁, O₂`` and random targets in the distribution's support, and
   must satisfy ``V(O₁) - V(O₂) = a·(ℓ(O₁) - ℓ(O₂))`` elementwise for one
   constant ``a ≠ 0``: ``V = a·ℓ(O, T) + d(T)`` (with masks: ``a·k(M)``,
   ``k`` the mask's weight of each element, ``_loss_kinds``). ``a`` is the
   head's scale (``-1`` for a log-likelihood negated after its reduction,
   ``2`` for twice a cross-entropy), ``d`` a target-dependent constant
   (``½ log 2πσ²`` of a Gaussian written out) that changes no derivative. For ``Normal`` ``a`` fixes the variance: ``V = ±(o - t)²/(2σ²)
   + d``, ``σ² = 1/(2|a|)`` (``(o - t)²`` is ``kfl.squared_error``'s σ² = ½,
   ``½(o - t)²`` ``kfl.l2_loss``'s σ² = 1), and the scale is its sign.

Matching by value rather than by the primitives' spelling covers optax's
implementations (nested ``jit``s, ``custom_jvp``), ``log_softmax`` then
``take_along_axis``, a one-hot product or an index, ``logits -
logsumexp``, ``log_sigmoid``/``logaddexp``/``softplus`` spellings of the
binary cross-entropy, and ``**2``/``square``/``x * x``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from kfac_jax_lite.tagging import _loss_kinds as K

# Primitives a head may not contain (state, randomness, loops, marks).
_FORBIDDEN = ("scan", "while", "cond", "kfl_loss_tag", "random_bits",
              "random_seed", "random_wrap", "random_unwrap", "threefry2x32",
              "rng_bit_generator", "rng_uniform")


@dataclasses.dataclass(frozen=True)
class Head:
  """A recognised head: ``V = scale·k(M)·ℓ(O, T) + d(T)`` with ``ℓ``
  ``distribution``'s per-element negative log-likelihood (``k = 1``
  without masks). ``values``, ``output``, ``target`` (None: zeros) and
  ``masks`` are ``LossGraph`` ids, visible in ``scope``; ``nodes`` the
  head's nodes in order; ``kind`` its ``_loss_kinds`` name."""

  values: int
  output: int
  target: int | None
  masks: tuple
  distribution: Any
  scale: float
  scope: tuple
  nodes: tuple
  kind: Any  # ``_loss_kinds.Kind``
  fit: float  # ``a`` of ``V = a·k·ℓ_ref + d``, ``ℓ_ref`` ``_loss_kinds``'.

  @property
  def event(self):
    return self.distribution.event_ndims[0]


def _order(graph, i):
  node = graph.node_of(i)
  return -1 if node is None else node.index


def _dominators(graph, v, limit=64):
  """Batch- and parameter-dependent float values through which every
  parameter-dependent path into ``v`` passes, closest first."""
  node = graph.node_of(v)
  if node is None:
    return
  frontier = {i for i in node.ins if i in graph.pdep}
  for _ in range(limit):
    if not frontier:
      return
    if len(frontier) == 1:
      (o,) = frontier
      if o in graph.bdep and graph.is_float(o):
        yield o
    y = max(frontier, key=lambda i: _order(graph, i))
    n = graph.node_of(y)
    if (n is None or n.name in _FORBIDDEN or any(
        i in graph.pdep and i not in graph.bdep for i in n.ins)):
      return  # A parameter leaf, a layer, or a loop: not inside a head.
    frontier.remove(y)
    frontier |= {i for i in n.ins if i in graph.pdep}


def _collect(graph, v, o, scope, expand=frozenset(), limit=400):
  """``(nodes, extras)``: the head's nodes from ``o`` (and constants) to
  ``v`` in order, and its batch-dependent operands visible in ``scope``
  (but those in ``expand``, whose nodes join the head); None where it is
  not a head (a parameter enters besides ``o``)."""
  nodes, extras, seen, stack = {}, [], set(), [v]
  while stack:
    i = stack.pop()
    if i in seen or i == o:
      continue
    seen.add(i)
    if i in graph.value:
      continue
    if (i not in graph.pdep and i in graph.bdep and i not in expand
        and graph.home_in(i, scope) is not None):
      extras.append(i)
      continue
    n = graph.node_of(i)
    if (n is None or n.name in _FORBIDDEN or n.eqn.effects
        or len(nodes) >= limit):
      return None
    nodes[n.index] = n
    stack.extend(n.ins)
  if graph.home_in(o, scope) is None:
    return None
  return tuple(nodes[k] for k in sorted(nodes)), sorted(extras)


def _source(graph, e, scope):
  """The one batch value (visible in ``scope``) ``e`` is computed from,
  with constants, or None."""
  n = graph.node_of(e)
  if n is None or n.name in _FORBIDDEN:
    return None
  srcs = {i for i in n.ins if i in graph.bdep}
  if len(srcs) != 1 or srcs & graph.pdep:
    return None
  src = srcs.pop()
  return src if graph.home_in(src, scope) is not None else None


def _ancestry(graph, e, scope):
  chain = [e]
  while len(chain) < 16:
    src = _source(graph, chain[-1], scope)
    if src is None:
      break
    chain.append(src)
  return chain


def _unified(graph, extras, scope):
  """Extras to trace back to their common source (``t`` and ``1 - t``;
  a ``where=`` mask and its ``any``): the values of each one's ancestry
  before the first it shares with another's."""
  chains = {e: _ancestry(graph, e, scope) for e in extras}
  expand = set()
  for e in extras:
    others = {x for f in extras if f != e for x in chains[f]}
    for j, x in enumerate(chains[e]):
      if x in others:
        expand.update(chains[e][:j])
        break
  return expand


def _expandable(graph, extras, scope):
  """The latest extra computed from one batch value (``_source``): the
  stacked ``(arange, y)`` indices of ``logp[jnp.arange(n), y]`` come from
  the labels. None if there is none."""
  for e in sorted(extras, key=lambda i: -_order(graph, i)):
    if _source(graph, e, scope) is not None:
      return e
  return None


# Verification results by head fingerprint, shared by every trace in the
# process (``kfl.kfac``, ``value_grad_and_stats`` and ``describe`` of one
# loss verify its head once); bounded, oldest dropped first.
_VERIFIED: dict = {}
_VERIFIED_MAX = 512


def _fingerprint(graph, nodes, v, o, kind):
  """A hashable description of everything ``_loss_kinds.verify`` reads: the
  head's primitives, parameters, shapes and dtypes, literal and constant
  values, and which values are the output, target, masks and result."""
  local = {}

  def ref(i):
    if i in graph.value and not graph.homes[i]:  # A literal.
      return ("lit", repr(graph.value[i]), str(graph.aval[i]))
    if i in graph.value:
      x = np.asarray(graph.value[i])
      return ("const", x.dtype.str, x.shape, hash(x.tobytes()))
    return local.setdefault(i, (len(local), str(graph.aval[i])))

  roles = (ref(o), None if kind.target is None else ref(kind.target),
           tuple(ref(m) for m in kind.masks))
  body = tuple((n.name, repr(sorted(n.eqn.params.items(), key=str)),
                tuple(ref(i) for i in n.ins), tuple(ref(i) for i in n.outs))
               for n in nodes)
  return (kind, roles, body, ref(v))


class Memo(dict):
  """Verified scales by position in one loss (``_verified``), kept by the
  caller across re-traces; ``limit``: the most model-output elements a
  verification may evaluate (None: any), above which ``TooLarge`` asks the
  caller to verify at a smaller batch first."""

  limit: int | None = None


class TooLarge(Exception):
  """A head is too large to evaluate at this batch (``Memo.limit``)."""


def _verified(graph, v, o, nodes, kind, scope, memo):
  """``_loss_kinds.verify``'s scale, evaluated once per fingerprint in the
  process, and once per position in the loss for ``memo`` (a re-trace of
  the same loss at another batch size must find the same distribution,
  which a refit of ``a`` in float32 at other draws might round apart)."""
  how = lambda i: None if i is None else graph.home_in(i, scope).how
  where = (kind.name, kind.summed, scope, how(v), how(o), how(kind.target),
           tuple(map(how, kind.masks)), tuple((n.key, n.name) for n in nodes))
  if where in memo:
    return memo[where]
  key = _fingerprint(graph, nodes, v, o, kind)
  if (key not in _VERIFIED and memo.limit is not None
      and np.prod(graph.shape(o)) > memo.limit):
    raise TooLarge(graph.shape(o))
  if key not in _VERIFIED:
    if len(_VERIFIED) >= _VERIFIED_MAX:
      _VERIFIED.pop(next(iter(_VERIFIED)))
    _VERIFIED[key] = K.verify(graph, v, o, nodes, kind)
  memo[where] = _VERIFIED[key]
  return memo[where]


def _matches(graph, v, o, scope, memo, need_target=False):
  """The ``(Kind, scale a, nodes)`` of the head from ``o`` to ``v``, or
  None (module doc). Extras are first traced back to common sources
  (``_unified``); then, while they fit no kind, the latest to its source
  (at most 8 steps)."""
  expand = set()
  for _ in range(8):
    got = _collect(graph, v, o, scope, frozenset(expand))
    if got is None:
      return None
    nodes, extras = got
    more = _unified(graph, extras, scope) - expand
    if more:
      expand |= more
      continue
    kinds = K.kinds(graph, v, o, extras, {n.name for n in nodes})
    kinds = [k for k in kinds if k.target is not None or not need_target]
    for kind in kinds:
      a = _verified(graph, v, o, nodes, kind, scope, memo)
      if a is not None:
        return kind, a, nodes
    if kinds:
      return None
    e = _expandable(graph, extras, scope)
    if e is None:
      return None
    expand.add(e)
  return None


def find_head(graph, v, memo):
  """The ``Head`` whose values are ``v``, or None (module docstring).

  Dominators are tried closest first; a head without a target (a squared
  error of ``pred - t`` against zeros) gives way to one further back that
  has one (``pred`` against ``t``). A head's verification is evaluated once
  per fingerprint in the process (``_VERIFIED``) and once per position in
  the loss (``memo``, kept by the caller across re-traces)."""
  if not (graph.is_float(v) and v in graph.pdep and v in graph.bdep
          and graph.shape(v)):
    return None
  homes = graph.defined_homes(v)
  if not homes:
    return None
  scope = homes[0].scope
  first = None
  for o in _dominators(graph, v):
    got = _matches(graph, v, o, scope, memo, need_target=first is not None)
    if got is None:
      continue
    kind, a, nodes = got
    dist, scale = K.distribution(kind.name, a)
    head = Head(v, o, kind.target, kind.masks, dist, scale, scope, nodes,
                kind, a)
    if kind.target is not None:
      return head
    first = first or head
  return first
