"""The registry of layer kinds: one ``LayerSpec`` subclass (one file) each.

``REGISTRY`` maps a kind's name to its spec class. The graph walk
(``tagging._analysis``) records *uses* of parameters under pattern names
(``Use.kind``: ``"dense"``, ``"conv"``, ``"embedding"``,
``"scale_and_shift"``); a group of uses of shared parameters belongs to the
kind whose ``patterns`` contain all of theirs, the narrowest such kind when
several do (lookups alone are an embedding; lookups with dense uses, a
tied embedding, are dense). Adding a kind: one file here with its
``LayerSpec`` subclass, and its class in ``_KINDS``.
"""
from __future__ import annotations

from kfac_jax_lite.tagging._kinds.base import Grouping, LayerSpec, Unsupported
from kfac_jax_lite.tagging._kinds.conv import ConvSpec
from kfac_jax_lite.tagging._kinds.dense import DenseSpec
from kfac_jax_lite.tagging._kinds.embedding import EmbeddingSpec
from kfac_jax_lite.tagging._kinds.fallback import FallbackSpec
from kfac_jax_lite.tagging._kinds.scale_and_shift import ScaleAndShiftSpec

_KINDS = (DenseSpec, ConvSpec, EmbeddingSpec, ScaleAndShiftSpec, FallbackSpec)
REGISTRY = {cls.name: cls for cls in _KINDS}
KINDS = tuple(REGISTRY)


def group(uses, leaf_shapes, depth) -> Grouping:
  """The layer of a group of uses: the spec of the kind that takes them."""
  patterns = frozenset(u.kind for u in uses)
  fits = [cls for cls in _KINDS if patterns <= cls.patterns]
  if not fits:
    raise Unsupported("used as " + " and ".join(sorted(patterns))
                      + " (incompatible layer kinds)")
  cls = min(fits, key=lambda c: len(c.patterns))
  return cls.group(uses, leaf_shapes, depth)


__all__ = ["ConvSpec", "DenseSpec", "EmbeddingSpec", "FallbackSpec",
           "Grouping", "KINDS", "LayerSpec", "REGISTRY", "ScaleAndShiftSpec",
           "Unsupported", "group"]
