"""Scale and shift: ``y = x · scale + shift`` with broadcast parameters.

A parameter multiplied and/or added elementwise, broadcast over the other
axes (norm layers, including the ``(x - μ) · (rsqrt(σ²+ε) · scale) + bias``
form of Flax and Haiku, where the scale's input is ``(x - μ) · rsqrt(σ²+ε)``).
The data is that input (zeros for a shift alone) and the cotangent of
``y``, with the parameter's axes last.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kfac_jax_lite import blocks as B
from kfac_jax_lite.tagging import _format as F
from kfac_jax_lite.tagging._kinds.base import Grouping, LayerSpec, Unsupported


@dataclasses.dataclass(frozen=True)
class ScaleAndShiftSpec(LayerSpec):
  """``param_shape`` (the non-unit axes both parameters share)."""

  name = "scale_and_shift"
  patterns = frozenset({"scale_and_shift"})

  param_shape: tuple
  has_scale: bool
  has_shift: bool

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
