"""Fallback: parameters no layer pattern explains, with the reason why.

Their block (``NaiveDiagonal`` by default, or ``Full``) consumes
``GRADIENTS``: the estimators give it S gradient samples of the whole loss
(``LayerData.grads`` ``[S, 1, *shape]`` with weight 1), never captured
layer data.
"""
from __future__ import annotations

import dataclasses

from kfac_jax_lite import blocks as B
from kfac_jax_lite.tagging._kinds.base import LayerSpec, Unsupported


@dataclasses.dataclass(frozen=True)
class FallbackSpec(LayerSpec):
  """``param_shapes`` of the leaves and the ``reason`` they fell back."""

  name = "fallback"
  is_fallback = True

  leaf_shapes: tuple
  why: str

  @property
  def param_shapes(self):
    return tuple(tuple(s) for s in self.leaf_shapes)

  @property
  def reason(self):
    return self.why

  @property
  def notes(self):
    return self.why

  @classmethod
  def group(cls, uses, leaf_shapes, depth):
    raise Unsupported("a fallback is never grouped from uses")

  def default_block(self, *, damping_mode, weight_sharing):
    del damping_mode, weight_sharing
    return B.NaiveDiagonal(self.param_shapes)

  def with_options(self, default, options):
    raise ValueError("fallback blocks take no keyword options")

  def data(self, uses, captures, cotangents, stacked):
    raise ValueError("a fallback layer has no captured data: its block "
                     "reads parameter gradients (LayerData.grads)")

  def per_example_grads(self, inputs, cotangents):
    raise ValueError("a fallback layer has no captured data to rebuild "
                     "per-example gradients from")
