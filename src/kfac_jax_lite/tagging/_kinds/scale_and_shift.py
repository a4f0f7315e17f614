"""Scale and shift: ``y = x · scale + shift`` with broadcast parameters.

A parameter multiplied and/or added elementwise, broadcast over the other
axes (norm layers, including the ``(x - μ) · (rsqrt(σ²+ε) · scale) + bias``
form of Flax and Haiku, where the scale's input is ``(x - μ) · rsqrt(σ²+ε)``).
The data is that input (zeros for a shift alone) and the cotangent of
``y``, with the parameter's axes last.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from kfac_jax_lite import blocks as B
from kfac_jax_lite.tagging import _format as F
from kfac_jax_lite.tagging import _matching
from kfac_jax_lite.tagging import _scaled
from kfac_jax_lite.tagging._kinds.base import Grouping, LayerSpec, Unsupported


@dataclasses.dataclass(frozen=True)
class ScaleAndShiftSpec(LayerSpec):
  """``param_shape`` (the non-unit axes both parameters share)."""

  name = "scale_and_shift"
  patterns = frozenset({"scale_and_shift"})
  primitives = ("mul", "add")

  param_shape: tuple
  has_scale: bool
  has_shift: bool

  def output_size(self, use):
    """The parameters' (non-unit) size: one scaled and shifted row."""
    del use
    return math.prod(self.param_shape)

  @property
  def param_shapes(self):
    return (tuple(self.param_shape),) * (
        int(self.has_scale) + int(self.has_shift))

  @classmethod
  def group(cls, uses, leaf_shapes, depth):
    pairs = {(u.roles["scale"].leaf if "scale" in u.roles else None,
              u.roles["shift"].leaf if "shift" in u.roles else None)
             for u in uses}
    if len(pairs) != 1:
      raise Unsupported("scale/shift parameters paired differently across "
                        "uses")
    scale, shift = pairs.pop()
    leaf = scale if scale is not None else shift
    spec = cls(param_shape=tuple(s for s in leaf_shapes[leaf][depth:] if s > 1),
               has_scale=scale is not None, has_shift=shift is not None)
    return Grouping(spec, tuple(l for l in (scale, shift) if l is not None))

  @classmethod
  def recognise(cls, walk, i, eqn, views, ctx):
    """A parameter multiplied (``mul``) or added (``add``) elementwise."""
    if eqn.primitive.name == "mul":
      return cls._recognise_mul(walk, i, eqn, views, ctx)
    return cls._recognise_add(walk, i, eqn, views, ctx)

  @classmethod
  def _recognise_mul(cls, walk, i, eqn, views, ctx):
    """``x · scale`` (and ``+ shift`` right after), the scale broadcast;
    the Flax/Haiku ``(x - μ) · (rsqrt(σ²+ε) · scale)`` included."""
    if views[0] is not None and views[1] is not None:
      return "multiplied by another parameter"
    k = 0 if views[0] is not None else 1
    sv = views[k]
    other = eqn.invars[1 - k]
    out = eqn.outvars[0]
    shape = tuple(out.aval.shape)
    if not sv.covers(shape):
      return "multiplied after a reduction or broadcast of its axes"
    labels, nonunit = walk._broadcast_labels(sv, shape)
    capture, cap_i = ("var", other), i
    y, y_i = out, i
    j = walk._single_consumer(out, ctx)
    if j is not None:
      e2 = ctx["jaxpr"].eqns[j]
      z = [w for w in e2.invars if w is not out]
      shape2 = tuple(e2.outvars[0].aval.shape)
      if (e2.primitive.name == "mul" and len(z) == 1 and _matching.is_var(z[0])
          and ctx["env"].get(z[0]) is None and len(shape2) == len(shape)
          and all(a in (b, 1) for a, b in zip(shape, shape2))):
        # ``(x - μ) · (rsqrt(σ²+ε) · scale)``; with batch statistics the
        # first product has no example axis (``[1, C]``): it gets one here.
        capture, cap_i = ("mul", other, z[0]), j
        y, y_i = e2.outvars[0], j
        ctx["claimed"].add(j)
        if shape2 != shape:
          shape = shape2
          labels, nonunit = walk._broadcast_labels(sv, shape)
          out = y
    roles = {"scale": sv}
    probe_i, probe_aval = y_i, y.aval
    j = walk._single_consumer(y, ctx)
    if j is not None and j not in ctx["claimed"]:
      e3 = ctx["jaxpr"].eqns[j]
      w = [v for v in e3.invars if v is not y]
      hv = ctx["env"].get(w[0]) if len(w) == 1 and _matching.is_var(w[0]) else None
      if (e3.primitive.name == "add" and _scaled.plain(hv) and hv.leaf != sv.leaf
          and hv.stacked == sv.stacked
          and tuple(e3.outvars[0].aval.shape) == shape
          and hv.nonunit(shape) == nonunit and hv.covers(shape)):
        roles["shift"] = hv
        ctx["claimed"].add(j)
        probe_i, probe_aval = j, e3.outvars[0].aval
    cap_aval = out.aval
    walk._record("scale_and_shift", roles, ctx, cap_i, capture + (shape,),
                 cap_aval, probe_i, probe_aval, labels, labels, {})
    return None

  @classmethod
  def _recognise_add(cls, walk, i, eqn, views, ctx):
    """``x + shift`` alone, the shift broadcast."""
    if views[0] is not None and views[1] is not None:
      return "added to another parameter"
    k = 0 if views[0] is not None else 1
    hv = views[k]
    out = eqn.outvars[0]
    shape = tuple(out.aval.shape)
    if not hv.covers(shape):
      return "added after a reduction or broadcast of its axes"
    labels, _ = walk._broadcast_labels(hv, shape)
    walk._record("scale_and_shift", {"shift": hv}, ctx, None, None, None, i,
                 out.aval, labels, labels, {})
    return None

  def default_block(self, *, damping_mode, weight_sharing):
    del damping_mode, weight_sharing  # A diagonal (or full) matrix.
    return B.ScaleAndShift(self.param_shape, has_scale=self.has_scale,
                           has_shift=self.has_shift)

  def block_for(self, choice, default):
    if choice == "diagonal":
      return default
    if choice == "full":
      return dataclasses.replace(default, full=True)
    return super().block_for(choice, default)

  def data(self, uses, captures, cotangents, stacked):
    """``(inputs [L?, N, *y], cots [L?, S, N, *y])``, the parameter's axes
    last (several uses: their other axes merged and concatenated)."""
    base = 1 if stacked else 0
    parts = []
    for u in uses:
      view = u.roles.get("scale") or u.roles["shift"]
      korder = sorted(d for d in view.nonunit(u.probe_aval.shape)
                      if d is not None)
      cot = F.arranged(u, cotangents[u.uid], korder, samples=True)
      # A shift-only block ignores its inputs: zeros shaped like the output.
      inp = (F.arranged(u, captures[u.uid], korder, out=False)
             if self.has_scale else
             jnp.zeros(cot.shape[:base] + cot.shape[base + 1:], cot.dtype))
      parts.append((inp, cot))
    if len(parts) == 1:
      return parts[0]
    nf = len(self.param_shape)

    def flat(x, nlead):
      return x.reshape(x.shape[:nlead + 1] + (-1,) + x.shape[x.ndim - nf:])
    inp = jnp.concatenate([flat(p[0], base) for p in parts], axis=base + 1)
    cot = jnp.concatenate([flat(p[1], base + 1) for p in parts],
                          axis=base + 2)
    return inp, cot

  def per_example_grads(self, inputs, cotangents):
    nf = len(self.param_shape)
    g = cotangents
    axes = tuple(range(2, g.ndim - nf))
    out = []
    if self.has_scale:
      out.append((inputs[None] * g).sum(axes))
    if self.has_shift:
      out.append(g.sum(axes))
    return tuple(out)
