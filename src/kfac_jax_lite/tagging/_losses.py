"""Recognising a hand-written loss in the traced jaxpr (issue 23).

``optax.softmax_cross_entropy_with_integer_labels(logits, y)`` traces (top
level, inlined) to ``ℓ = (log Σ_c exp(z_c - m) + m) - take_along_axis(z, y)``
with ``m = stop_gradient(max_c z_c)``.  Where that ``sub`` is found, a
``loss_tag`` equation (``losses.loss_tag_p``, the registered losses' own
mark) is inserted on ``ℓ`` with ``z`` and ``y`` as its annotations, exactly
as ``kfl.softmax_cross_entropy_with_integer_labels`` would have bound it: the
estimators, the scale convention (weights ``c`` read from the backward pass
to the tag, so any reduction) and Laplace are shared with the registered
twin.  Only this form, at the top level of the loss's jaxpr, is recognised
so far; anything else keeps the unregistered behaviour.
"""
from __future__ import annotations

from jax._src import core as jcore

from kfac_jax_lite import distributions as dists
from kfac_jax_lite import losses


# The distribution the inserted tags carry: ``describe`` tells a recognised
# loss from a registered one by identity.
RECOGNISED_INTEGER_CE = dists.Categorical(integer_labels=True)


def _producers(jaxpr):
  return {id(v): e for e in jaxpr.eqns for v in e.outvars}


def _chain(prod, v, names):
  """Follows ``v`` back through equations named ``names`` (each taking its
  first operand); returns the final operand or None."""
  for name in names:
    e = prod.get(id(v))
    if e is None or e.primitive.name != name:
      return None
    v = e.invars[0]
  return v


def _match_integer_ce(prod, eqn):
  """``(logits, labels)`` if ``eqn`` is optax's integer-label CE ``sub``."""
  if eqn.primitive.name != "sub" or len(eqn.invars) != 2:
    return None
  lse, picked = eqn.invars
  take = _chain(prod, picked, ["jit"])
  e_take = prod.get(id(picked))
  if take is None or e_take.params.get("name") != "_take":
    return None
  e_along = prod.get(id(take))
  if (e_along is None or e_along.primitive.name != "jit"
      or e_along.params.get("name") != "take_along_axis"):
    return None
  logits, idx = e_along.invars
  labels = _chain(prod, idx, ["broadcast_in_dim"])
  e_add = prod.get(id(lse))
  if labels is None or e_add is None or e_add.primitive.name != "add":
    return None
  shifted = _chain(prod, e_add.invars[0],
                   ["log", "abs", "reduce_sum", "exp"])
  e_sub = prod.get(id(shifted))
  if e_sub is None or e_sub.primitive.name != "sub" or e_sub.invars[0] is not logits:
    return None
  return logits, labels


def recognise(closed):
  """``closed`` with a ``loss_tag`` after each recognised loss value (see
  the module doc); ``closed`` itself when none is recognised or the jaxpr
  already holds a registered loss."""
  jaxpr = closed.jaxpr
  if any(e.primitive is losses.loss_tag_p for e in jaxpr.eqns):
    return closed
  prod = _producers(jaxpr)
  eqns, rename, found = [], {}, False
  sub = lambda v: rename.get(id(v), v) if isinstance(v, jcore.Var) else v
  for e in jaxpr.eqns:
    e = e.replace(invars=[sub(v) for v in e.invars])
    eqns.append(e)
    m = _match_integer_ce(prod, e)
    if m is None:
      continue
    logits, labels = (sub(v) for v in m)
    out = e.outvars[0]
    tagged = jcore.Var(out.aval)
    eqns.append(jcore.new_jaxpr_eqn(
        [out, logits, labels], [tagged], losses.loss_tag_p,
        dict(distribution=RECOGNISED_INTEGER_CE,
             num_outputs=1), jcore.no_effects))
    rename[id(out)] = tagged
    found = True
  if not found:
    return closed
  new = jaxpr.replace(eqns=eqns, outvars=[sub(v) for v in jaxpr.outvars])
  return closed.replace(jaxpr=new)
