"""The distributions a loss head may be, and the check by value.

``kinds(graph, v, o, extras, prims)`` lists the ``Kind``s the shapes,
dtypes and primitives of a head allow (``_loss_heads``): which operand is
the target and which are masks. ``verify`` then evaluates the head at
random draws and returns its scale ``a`` (``V = a·k(M)·ℓ(O, T) + d``) or
None:

* with every mask on (``True``/1), ``V(O₁) - V(O₂) = a·(ℓ(O₁) - ℓ(O₂))``
  elementwise for one constant ``a ≠ 0``;
* with random masks, the same holds with ``a·k`` in place of ``a``, ``k``
  the element weights ``element_weights`` computes (``where=`` masks of
  optax's cross-entropies, per-element weights inside the head).

A softmax cross-entropy may also be found as its per-class terms ``X =
y·log_softmax(z)`` (shaped like the logits) under one sum over every axis
(``-jnp.sum(labels * log_probs) / n``, Haiku's MNIST example): a
``summed`` kind, whose element values are ``Σ_k X[..., k]``.

``element_weights`` is also what the inserted mark computes at run time:
``k = ∂V/∂O·δ / (a·∂ℓ/∂O·δ)`` at a reference output ``O*`` and direction
``δ`` chosen so that the denominator is never zero: for a softmax ``O* =
0`` and ``δ`` the (most likely) label's one-hot (``∂ℓ·δ = 1/K - t_max``:
zero only for uniform soft labels, where ``k`` is taken as 1); for a sigmoid
``O* = ±2`` away from the target (``|σ(O*) - t| ≥ 0.38``); for a squared
error ``O* = T + 1``.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax_lite.losses import distributions as dists
from kfac_jax_lite.tagging import _loss_graph

_SQUARES = {"integer_pow", "square", "mul", "pow"}
_LOGS = {"log", "log1p"}
_EXPS = {"exp", "logistic", "exp2"}
CATEGORICAL_INT, CATEGORICAL, BERNOULLI, NORMAL = (
    "categorical_int", "categorical", "bernoulli", "normal")


@dataclasses.dataclass(frozen=True)
class Kind:
  """A candidate reading of a head: ``name`` (one of the four above),
  ``target`` (a graph id; None: zeros) and ``masks`` (graph ids)."""

  name: str
  target: int | None
  masks: tuple = ()
  summed: bool = False  # Values over the classes too: summed over them.

  @property
  def event(self):
    return self.name in (CATEGORICAL_INT, CATEGORICAL)

  def element_shape(self, vshape, oshape):
    """The shape of the per-element values (the twin's)."""
    return tuple(oshape[:-1]) if self.summed else tuple(vshape)

  def per_element(self, x, oshape):
    """The per-element values from the head's output ``x``."""
    return x.reshape(oshape).sum(-1) if self.summed else x


def _squeezed(shape):
  return tuple(n for n in shape if n != 1)


def kinds(graph, v, o, extras, prims):
  """The ``Kind``s a head from ``o`` to ``v`` with batch operands
  ``extras`` and primitives ``prims`` may be (module doc)."""
  vs, os_ = graph.shape(v), graph.shape(o)
  if not vs or len(extras) > 4:
    return []
  sv, so = _squeezed(vs), _squeezed(os_)
  same = len(vs) >= len(os_) and so == sv
  out = []
  for t in [None] + list(extras):
    masks = tuple(e for e in extras if e != t)
    if any(_squeezed(graph.shape(m)) not in (sv, so, _squeezed(os_[:-1]))
           for m in masks):
      continue
    tshape = None if t is None else _squeezed(graph.shape(t))
    floating = t is not None and graph.is_float(t)
    if (t is not None and os_[-1] >= 2 and prims & _EXPS and prims & _LOGS
        and ((len(vs) >= len(os_) - 1 and _squeezed(os_[:-1]) == sv)
             or same)):
      per_class = same  # The per-class terms, summed over the classes.
      if (np.issubdtype(graph.dtype(t), np.integer)
          and tshape == _squeezed(os_[:-1])):
        out.append(Kind(CATEGORICAL_INT, t, masks, per_class))
      elif floating and tshape == so:
        out.append(Kind(CATEGORICAL, t, masks, per_class))
    if same and (t is None or (floating and tshape == so)):
      if prims & _LOGS and prims & _EXPS:
        out.append(Kind(BERNOULLI, t, masks))
      if prims & _SQUARES:
        out.append(Kind(NORMAL, t, masks))
  return out


def reference_loss(name):
  """The per-element loss ``ℓ((o,), (t,))`` of ``name``, ``o`` laid out as
  ``[*values, K]`` for a softmax (a squared error: ``(o - t)²``)."""
  if name == CATEGORICAL_INT:
    return dists.Categorical(integer_labels=True).loss
  if name == CATEGORICAL:
    return dists.Categorical().loss
  if name == BERNOULLI:
    return dists.Bernoulli().loss
  return lambda outs, targets: (outs[0] - targets[0]) ** 2


def distribution(name, a):
  """``(distribution, scale)`` of a head of kind ``name`` and fitted scale
  ``a``; for a squared error ``a·(o - t)² = ±(o - t)²/(2σ²)``: ``σ² =
  1/(2|a|)``, the scale its sign."""
  if name == CATEGORICAL_INT:
    return dists.Categorical(integer_labels=True), a
  if name == CATEGORICAL:
    return dists.Categorical(), a
  if name == BERNOULLI:
    return dists.Bernoulli(), a
  return dists.Normal(0.5 / abs(a)), math.copysign(1.0, a)


def target_layout(name, t, vshape, k, dtype):
  """The target as the twin takes it: labels ``[*values]``, soft labels
  ``[*values, K]``, else ``[*values]`` in the outputs' dtype (zeros for
  None)."""
  if name == CATEGORICAL_INT:
    return t.reshape(vshape)
  shape = vshape + ((k,) if name == CATEGORICAL else ())
  if t is None:
    return jnp.zeros(shape, dtype)
  return t.reshape(shape).astype(dtype)


def element_weights(name, head_fn, vshape, oshape, dtype, t, a):
  """``k`` per element (module doc): ``head_fn(o)`` is the head at the
  actual targets and masks (``o`` of ``oshape`` and ``dtype``) giving the
  per-element values of shape ``vshape``, ``t`` the target laid out by
  ``target_layout``."""
  k = oshape[-1]
  lay = vshape + ((k,) if name in (CATEGORICAL_INT, CATEGORICAL) else ())
  if name == CATEGORICAL_INT:
    o_ref, delta = jnp.zeros(lay, dtype), jax.nn.one_hot(t, k, dtype=dtype)
  elif name == CATEGORICAL:
    o_ref = jnp.zeros(lay, dtype)
    delta = jax.nn.one_hot(jnp.argmax(t, -1), k, dtype=dtype)
  elif name == BERNOULLI:
    o_ref, delta = 2 - 4 * (t > 0.5).astype(dtype), jnp.ones(lay, dtype)
  else:
    o_ref, delta = t + 1, jnp.ones(lay, dtype)
  ref = reference_loss(name)
  num = jax.jvp(lambda ov: head_fn(ov.reshape(oshape)).reshape(vshape),
                (o_ref,), (delta,))[1]
  den = a * jax.jvp(lambda ov: ref((ov,), (t,)), (o_ref,), (delta,))[1]
  ok = den != 0
  return jnp.where(ok, num / jnp.where(ok, den, 1), 1)


def _draw_target(rng, name, oshape, tshape, tdtype):
  if tshape is None:
    return None
  if name == CATEGORICAL_INT:
    return rng.integers(0, oshape[-1], tshape).astype(tdtype)
  if name == CATEGORICAL:
    u = rng.uniform(0.05, 1, oshape)
    return (u / u.sum(-1, keepdims=True)).reshape(tshape).astype(tdtype)
  if name == BERNOULLI:
    return rng.uniform(0, 1, tshape).astype(tdtype)
  return rng.normal(0, 1, tshape).astype(tdtype)


def _draw_mask(rng, shape, dtype, on):
  if np.issubdtype(dtype, np.floating):
    return np.ones(shape, dtype) if on else rng.uniform(0, 1, shape).astype(
        dtype)
  m = np.ones(shape, bool) if on else rng.uniform(0, 1, shape) < 0.6
  return m.astype(dtype)


def _tolerance(dtype):
  return 5e-2 if np.finfo(dtype).bits < 32 else 1e-3


def _snap(a):
  """``a`` as a multiple of 1/64 where it is one to rounding (1, -1, ½, 50
  = 1/(2·0.1²), ...), else as fitted."""
  r = round(a * 64) / 64
  return r if r != 0 and abs(r - a) <= 1e-5 * abs(a) else a


def _close(df, dl, tol):
  return (np.all(np.isfinite(df)) and np.all(np.isfinite(dl))
          and np.max(np.abs(df - dl), initial=0) <= tol * max(
              np.max(np.abs(df), initial=0), 1e-30))


def verify(graph, v, o, nodes, kind):
  """The head's scale ``a`` (module doc), or None when it is not ``kind``."""
  oshape, odtype = graph.shape(o), graph.dtype(o)
  vshape = kind.element_shape(graph.shape(v), oshape)
  rng = np.random.default_rng(0)
  o1, o2 = (rng.normal(0, 2, oshape).astype(odtype) for _ in range(2))
  t = kind.target
  tv = _draw_target(rng, kind.name, oshape,
                    None if t is None else graph.shape(t),
                    None if t is None else graph.dtype(t))
  on = [_draw_mask(rng, graph.shape(m), graph.dtype(m), True)
        for m in kind.masks]
  rand = [_draw_mask(rng, graph.shape(m), graph.dtype(m), False)
          for m in kind.masks]
  ref = reference_loss(kind.name)
  event = oshape[-1:] if kind.event else ()

  def check(o1, o2, tv, on, rand):
    def head(masks):
      def fn(ov):
        inputs = dict(zip(kind.masks, masks))
        inputs[o] = ov
        if t is not None:
          inputs[t] = tv
        x = _loss_graph.evaluate(graph, nodes, inputs)[v]
        return kind.per_element(x, oshape).reshape(vshape)
      return fn
    tt = target_layout(kind.name, None if t is None else jnp.asarray(tv),
                       vshape, oshape[-1], odtype)
    ell = lambda ov: ref((ov.reshape(vshape + event),), (tt,))
    out = (head(on)(o1), head(on)(o2), ell(o1), ell(o2))
    if kind.masks:
      k = element_weights(kind.name, head(rand), vshape, oshape, odtype, tt,
                          1.0)
      out += (head(rand)(o1), head(rand)(o2), k)
    return out

  try:
    with jax.ensure_compile_time_eval():
      got = jax.jit(check)(o1, o2, tv, on, rand)
  except Exception:  # A head that cannot be evaluated is not recognised.
    return None
  got = [np.asarray(x, np.float64).reshape(-1) for x in got]
  df, dl = got[0] - got[1], got[2] - got[3]
  if not (np.any(df) and np.any(dl)):
    return None
  a = float(np.dot(df, dl) / np.dot(dl, dl))
  tol = _tolerance(odtype)
  if not _close(df, a * dl, tol):
    return None
  if kind.masks and not _close(got[4] - got[5], got[6] * dl, tol):
    return None  # (k was computed with a = 1: it is a·k.)
  return _snap(a)
