"""Kernels scaled by a stop-gradient scalar keep their Kronecker block.

``K = V · s`` or ``K = V / s`` with ``s`` a scalar under
``lax.stop_gradient`` (a norm estimate held constant, a temperature):
``y = x K = (s·x) V``, so the per-example gradient with respect to ``V``
is ``s`` times that with respect to ``K`` and the block of ``V`` is the
dense (or conv) block of the input ``s·x``: ``s² A ⊗ G``, exact to the
same degree as ``A ⊗ G`` is for ``K``. The use captures the scaled input
(``("scaled", x, scales)``); the scalar is read where the product is
taken (``Plan.saves``), so the kernel may then be used inside a nested
call or loop body.

A scale that is *differentiated* (weight norm's ``g · v / ‖v‖``,
Equinox's ``SpectralNorm``, whose ``σ = uᵀ W v`` holds only ``u, v``
constant) makes the gradient of ``v`` a projection of the kernel's
(``(g/‖v‖)(I − v̂ v̂ᵀ)`` per output column): it is not a Kronecker
product of an input and an output factor, so such a kernel falls back and
``describe`` says so (``FUNCTION_OF_ITSELF``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import TypeGuard

from kfac_jax_lite.tagging._views import IDENTITY_PRIMS, View

FUNCTION_OF_ITSELF = (
    "scaled by a differentiable function of itself (weight norm's g·v/|v|, "
    "a spectral norm σ(W)): its gradient is a projection of the kernel's, "
    "not a Kronecker product; stop_gradient the scale to keep a block")


@dataclasses.dataclass(frozen=True)
class Scaled(View):
  """A view of a leaf multiplied/divided by stop-gradient scalars:
  ``scales`` holds per factor ``(equation key, operand index, "mul" or
  "div")``, where the scalar is read."""

  scales: tuple = ()


def _producer(var, jaxpr):
  for eqn in jaxpr.eqns:
    if any(o is var for o in eqn.outvars):
      return eqn
  return None


def _stop_gradient(var, jaxpr):
  """Whether ``var``'s value comes from a ``stop_gradient`` (through
  casts and layout changes of a scalar)."""
  while True:
    eqn = _producer(var, jaxpr)
    if eqn is None:
      return False
    name = eqn.primitive.name
    if name == "stop_gradient":
      return True
    if name not in IDENTITY_PRIMS and name not in (
        "reshape", "broadcast_in_dim", "squeeze", "expand_dims"):
      return False
    var = eqn.invars[0]


def scaled_view(eqn, views, key, jaxpr):
  """The ``Scaled`` view of ``eqn`` (``mul``/``div`` of a kernel view and
  a stop-gradient scalar), or None."""
  name = eqn.primitive.name
  if name not in ("mul", "div") or len(eqn.invars) != 2:
    return None
  ks = [j for j, v in enumerate(views) if type(v) in (View, Scaled)]
  if len(ks) != 1 or (name == "div" and ks[0] != 0):
    return None
  k = ks[0]
  other, kv = eqn.invars[1 - k], views[k]
  if (hasattr(other, "val") or any(n != 1 for n in other.aval.shape)
      or tuple(eqn.outvars[0].aval.shape) != tuple(eqn.invars[k].aval.shape)
      or len(other.aval.shape) > len(kv.dims)
      or not _stop_gradient(other, jaxpr)):
    return None
  scales = getattr(kv, "scales", ()) + ((key, 1 - k, name),)
  return Scaled(kv.leaf, kv.dims, kv.leaf_shape, kv.stacked, scales)


def read_scaled(x, scales, saved):
  """The input ``x`` times the kernel's stop-gradient scale."""
  for key, _, op in scales:
    s = saved[key].reshape(()).astype(x.dtype)
    x = x * s if op == "mul" else x / s
  return x


NOT_STOPPED = ("scaled by a scalar that is not under stop_gradient (Equinox's "
               "SpectralNorm σ = uᵀWv, weight norm's |v|): if it depends on "
               "the kernel, the kernel's gradient is a projection of the "
               "scaled kernel's, not a Kronecker product")


def scaled_by_scalar(eqn, views):
  """A ``mul``/``div`` of a kernel view by a (non-parameter) scalar."""
  ks = [j for j, v in enumerate(views) if isinstance(v, View)]
  if len(ks) != 1 or any(v is not None for j, v in enumerate(views)
                         if j != ks[0]):
    return False
  other = eqn.invars[1 - ks[0]]
  return not hasattr(other, "val") and all(n == 1 for n in other.aval.shape)


def plain(view) -> TypeGuard[View]:
  """A ``View`` that is not scaled (a bias or shift must be one)."""
  return isinstance(view, View) and not getattr(view, "scales", ())


def capture(x, kv):
  """The capture of a kernel's input ``x``: scaled with the kernel."""
  scales = getattr(kv, "scales", ())
  return ("scaled", x, scales) if scales else ("var", x)


def normalised_by_itself(eqn, values, out):
  """``v / f(v)`` or ``v * f(v)`` (``f`` reducing some axes, as a norm):
  a kernel whose scale is a differentiable function of itself."""
  if eqn.primitive.name not in ("mul", "div") or not hasattr(out, "how"):
    return False
  shape = tuple(eqn.outvars[0].aval.shape)
  sizes = [math.prod(v.aval.shape) for v in eqn.invars]
  full = [isinstance(x, View) or hasattr(x, "how") for x in values]
  return (all(full) and len(sizes) == 2 and min(sizes) < math.prod(shape)
          and max(sizes) == math.prod(shape))
