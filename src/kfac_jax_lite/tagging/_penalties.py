"""Penalties: regularisers of a parameter alone, added to the loss.

Weight decay is often written into the loss: ``L = ℓ(model) + c·Σ‖w‖²``.
The penalty is a function of one parameter leaf and constants only; it
does not feed the model's outputs, so it is not a layer use and must not
turn the parameter's layer block into a fallback. The graph walk
(``_analysis``) tracks such values with a small algebra:

* ``Derived`` — a value computed from one leaf alone: ``k·w`` (``"lin"``,
  any re-layout of the leaf), ``k·w²`` elementwise, possibly summed over
  some axes (``"sq"``), the scalar ``k·‖w‖²`` (``"ssq"``), the scalar
  ``k·‖w‖`` (``"norm"``), or anything else (``"other"``: ``|w|``, ...).
  ``w**2``, ``jnp.square``, ``w * w``, ``optax.l2_loss``, ``jnp.vdot(w, w)``,
  ``jnp.linalg.norm(w) ** 2``, ``jnp.mean(w ** 2)`` all end as ``"ssq"``.
* ``Tail`` — once a *scalar* ``Derived`` is combined with anything else it
  is a penalty (a ``Penalty`` record) and the value it flows into is
  tracked as ``Σ_p k_p · P_p`` (the penalty values ``P_p`` with their
  derivatives ``k_p``) through scalar ``add``/``sub``/``neg``/products and
  quotients by literals. Reaching the loss output gives each penalty its
  scale ``∂L/∂P``; any other operation leaves the scale unknown.

A non-scalar ``Derived`` combined with other values, or a ``Tail`` that
becomes non-scalar (a penalty broadcast into activations), feeds the model:
the walk then reports the leaf as an unmatched use, as before.

For ``P = a·‖w‖²`` with scale ``k`` the penalty's curvature is exactly
``2ak·I`` (``Penalty.curvature``); other penalties (L1, ``‖w‖``, ...) have
no curvature K-FAC keeps (``curvature`` None).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

from kfac_jax_lite.tagging._views import (IDENTITY_PRIMS, LAYOUT_PRIMS,
                                          Regrouped, View)

# Elementwise primitives of one operand that keep a penalty a penalty
# (the result's form is "other" unless the algebra below knows better).
_UNARY = frozenset({
    "abs", "neg", "sqrt", "rsqrt", "integer_pow", "square", "exp", "log",
    "log1p", "tanh", "logistic", "sign", "sin", "cos", "pow", "max", "min",
    "reduce_sum", "reduce_max", "reduce_min", "mul", "div", "add", "sub",
    "dot_general", "select_n", "stop_gradient", "real", "conj", "cumsum"})


@dataclasses.dataclass(frozen=True)
class Derived:
  """A value computed from parameter leaf ``leaf`` alone (see the module
  doc for ``form``); ``coef`` is its ``k``; ``how`` the first operation,
  for the reasons shown when it turns out to feed the model."""

  leaf: int
  form: str
  coef: float
  how: str


@dataclasses.dataclass(frozen=True)
class Tail:
  """A scalar ``Σ k·P`` of penalties: ``terms`` are ``(penalty id, k)``
  with ``k`` None where the derivative is unknown."""

  terms: tuple


@dataclasses.dataclass
class Penalty:
  """A penalty ``P`` on parameter leaf ``leaf``: ``P = coef·‖w‖²`` (coef
  None: not quadratic), entering the loss with ``scale = ∂L/∂P`` (None:
  unknown or not the loss)."""

  pid: int
  leaf: int
  coef: float | None
  how: str
  scale: float | None = None

  @property
  def curvature(self):
    """``2·coef·scale`` (the penalty's Hessian is that times I), or None."""
    if self.coef is None or self.scale is None:
      return None
    return 2.0 * self.coef * self.scale

  def describe(self, name):
    """A one-line note for ``describe``."""
    if self.coef is not None and self.scale is not None:  # A curvature.
      c = self.coef * self.scale
      return (f"penalty {c:.3g}·‖{name}‖² (curvature {self.curvature:.3g}·I,"
              " left out: the damping stands in)")
    what = "quadratic" if self.coef is not None else "non-quadratic"
    return (f"penalty on {name} ({self.how}): {what}, curvature left out")


def is_tracked(value):
  return isinstance(value, (Derived, Tail))


def literal_scalar(var):
  """The Python value of a scalar literal operand, else None."""
  if not hasattr(var, "val"):
    return None
  try:
    return float(var.val)
  except (TypeError, ValueError):
    return None


def _size(aval):
  return math.prod(aval.shape)


def as_derived(value, how):
  """A ``View`` (or ``Derived``) as a ``Derived``."""
  if isinstance(value, Derived):
    return value
  if isinstance(value, Regrouped):  # Every element once: still ``w``.
    return Derived(value.leaf, "lin", 1.0, how)
  return Derived(value.leaf, "lin" if value.pure else "other", 1.0, how)


def layout(value, eqn):
  """The value after a layout/identity primitive (a re-laid-out ``w`` is
  still ``k·w``; a broadcast that repeats elements is ``"other"``)."""
  out = eqn.outvars[0].aval
  if isinstance(value, Tail):
    return value if _size(out) == 1 else None
  same = _size(out) == _size(eqn.invars[0].aval)
  if value.form in ("lin", "sq") and not same:
    return dataclasses.replace(value, form="other")
  return value


def starts(eqn, values):
  """Whether ``eqn`` computes from one leaf alone (a penalty's first step):
  every non-literal operand a view/derived value of the same leaf."""
  if eqn.primitive.name not in _UNARY:
    return False
  leaves = set()
  for var, val in zip(eqn.invars, values):
    if hasattr(var, "val"):
      continue
    if not isinstance(val, (View, Derived, Regrouped)):
      return False
    leaves.add(val.leaf)
  return len(leaves) == 1


def step(eqn, values):
  """The ``Derived`` output of ``eqn`` whose operands pass ``starts``."""
  name = eqn.primitive.name
  how = f"used by `{name}`"
  ds = [None if hasattr(var, "val") else as_derived(val, how)
        for var, val in zip(eqn.invars, values)]
  d = [x for x in ds if x is not None]
  lits = [literal_scalar(var) for var in eqn.invars]
  first = d[0]
  how = first.how
  out_shape = tuple(eqn.outvars[0].aval.shape)

  def make(form, coef=1.0):
    return Derived(first.leaf, form, coef, how)

  if name in ("integer_pow", "square"):
    if name == "square" or eqn.params.get("y") == 2:
      if first.form == "lin":
        return make("sq", first.coef ** 2)
      if first.form == "norm":
        return make("ssq", first.coef ** 2)
    return make("other")
  if name == "mul" and len(d) == 2:
    a, b = d
    if eqn.invars[0] is eqn.invars[1] or (
        eqn.invars[0].aval.shape == eqn.invars[1].aval.shape
        and values[0] == values[1]):
      if a.form == "lin":
        return make("sq", a.coef * b.coef)
      if a.form == "norm" and not out_shape:
        return make("ssq", a.coef * b.coef)
    return make("other")
  if name in ("mul", "div") and len(d) == 1:
    k = lits[1] if ds[0] is not None else lits[0]
    if k is None or (name == "div" and (ds[1] is not None or k == 0)):
      return make("other")
    k = k if name == "mul" else 1.0 / k
    return make(first.form, first.coef * k)
  if name == "neg":
    return make(first.form, -first.coef)
  if name in ("add", "sub") and len(d) == 1 and first.form == "ssq":
    # A constant offset (``0 + Σ‖w‖²`` from Python's ``sum``) keeps the
    # curvature; ``c - a‖w‖²`` flips its sign.
    return make("ssq", -first.coef if (name == "sub" and ds[1] is not None)
                else first.coef)
  if name == "reduce_sum":
    if first.form == "sq":
      return make("ssq" if not out_shape else "sq", first.coef)
    return make("other")
  if name == "sqrt" and first.form == "ssq" and first.coef > 0:
    return make("norm", math.sqrt(first.coef))
  if name == "dot_general" and len(d) == 2:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    a, b = d
    nd = len(eqn.invars[0].aval.shape)
    if (a.form == b.form == "lin" and not out_shape and not lb and not rb
        and values[0] == values[1] and tuple(lc) == tuple(rc)
        and sorted(lc) == list(range(nd))):
      return make("ssq", a.coef * b.coef)
    return make("other")
  return make("other")


def tail_step(eqn, values):
  """The ``Tail`` output of a scalar equation with a ``Tail`` operand, or
  None when the result is not an affine scalar function of the penalties
  (non-scalar, or an operation other than ±, negation and products or
  quotients by literals): the caller then sets the terms' scales unknown,
  and a non-scalar result means the penalties feed the model."""
  name = eqn.primitive.name
  if eqn.outvars[0].aval.shape:
    return None
  tails = [(i, v) for i, v in enumerate(values) if isinstance(v, Tail)]
  others = [i for i, v in enumerate(values) if not isinstance(v, Tail)]
  if name in IDENTITY_PRIMS or name in LAYOUT_PRIMS:
    return tails[0][1]
  if name in ("add", "sub", "add_any"):
    terms = []
    for i, t in tails:
      sign = -1.0 if (name == "sub" and i == 1) else 1.0
      terms += [(p, None if k is None else sign * k) for p, k in t.terms]
    return Tail(tuple(terms))
  if name == "neg":
    return Tail(tuple((p, None if k is None else -k)
                      for p, k in tails[0][1].terms))
  if name in ("mul", "div") and len(tails) == 1 and len(others) == 1:
    i, t = tails[0]
    c = literal_scalar(eqn.invars[others[0]])
    if c is not None and not (name == "div" and (i == 1 or c == 0)):
      c = c if name == "mul" else 1.0 / c
      return Tail(tuple((p, None if k is None else k * c)
                        for p, k in t.terms))
  return Tail(tuple((p, None) for t in (v for _, v in tails)
                    for p, _ in t.terms))


class PenaltyWalk:
  """The graph walk's (``_analysis.Analysis``) handling of penalty values:
  it keeps ``self.penalties`` and reports through ``self._opaque``."""

  # Provided by _analysis.Analysis, which this is a mixin of.
  penalties: list[Penalty]
  _opaque: Callable[..., None]

  def _untracked(self, value, name, where):
    """``value`` if a ``View``; a penalty value entering ``name`` (a scan,
    cond or while) is reported as an unmatched use."""
    if is_tracked(value):
      self._opaque(value, f"{getattr(value, 'how', 'a penalty')}, then "
                   f"passed to `{name}`", where)
      return None
    return value

  def _tracked(self, eqn, values, ctx):
    """An equation on values of one leaf alone, or on penalties (see
    ``_penalties``): its output's ``Derived``/``Tail``, or unmatched uses
    when the values feed the model."""
    env, where, name = ctx["env"], ctx["where"], eqn.primitive.name
    if not any(isinstance(v, Tail) for v in values) and starts(
        eqn, values):
      env[eqn.outvars[0]] = step(eqn, values)
      return
    scalar_out = not eqn.outvars[0].aval.shape
    vals = list(values)
    for j, (var, v) in enumerate(zip(eqn.invars, values)):
      if isinstance(v, Derived) and scalar_out and not var.aval.shape:
        pen = Penalty(len(self.penalties), v.leaf,
                      v.coef if v.form == "ssq" else None, v.how)
        self.penalties.append(pen)
        k = 1.0 if name in ("add", "add_any", "sub") else None
        vals[j] = Tail(((pen.pid, k),))   # tail_step applies the sign
      elif isinstance(v, (Derived, View)):
        how = v.how if isinstance(v, Derived) else (
            "the gain of a kernel normalised by its own norm (weight norm's "
            "g), which falls back" if any(
                isinstance(w, Derived) and w.how.startswith(
                    "scaled by a differentiable") for w in values)
            else "combined with a penalty")
        self._opaque(v, f"{how}, then `{name}`", where)
        vals[j] = None
    if any(isinstance(v, Tail) for v in vals):
      new = vals
      out = tail_step(eqn, new)
      if out is None:
        for v in new:
          if isinstance(v, Tail):
            self._opaque(v, "a penalty that feeds the model (a function of "
                         "the parameter alone, combined with activations)",
                         where)
      else:
        env[eqn.outvars[0]] = out

  def _loss_scales(self, tail):
    """Each penalty's ``∂L/∂P`` from the loss output's ``Tail``."""
    scales = {}
    for pid, k in tail.terms:
      old = scales.get(pid, 0.0)
      scales[pid] = None if k is None or old is None else old + k
    for pid, k in scales.items():
      self.penalties[pid].scale = k
