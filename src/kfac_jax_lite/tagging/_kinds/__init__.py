"""The registry of layer kinds: one ``LayerSpec`` subclass (one file) each.

A kind's file holds all the library knows of it (``_kinds.base``): its
recogniser of the graph walk (``LayerSpec.recognise``, for the jaxpr
``primitives`` it names), how its uses group into a layer, its default
block and its data layout. The graph walk (``tagging._analysis``) asks the
registered kinds that handle a primitive (``recognisers``) and records
*uses* of parameters under pattern names (``Use.kind``: ``"dense"``,
``"conv"``, ``"embedding"``, ``"scale_and_shift"``); a group of uses of
shared parameters belongs to the kind whose ``patterns`` contain all of
theirs, the narrowest such kind when several do (lookups alone are an
embedding; lookups with dense uses, a tied embedding, are dense).

Adding a kind: its ``LayerSpec`` subclass (here, or in user code) and
``register(cls)``; ``unregister(name)`` removes it. A kind registered later
is asked first for the primitives it shares with earlier ones.
"""
from __future__ import annotations

from kfac_jax_lite.tagging._kinds.base import Grouping, LayerSpec, Unsupported
from kfac_jax_lite.tagging._kinds.conv import ConvSpec
from kfac_jax_lite.tagging._kinds.dense import DenseSpec
from kfac_jax_lite.tagging._kinds.embedding import EmbeddingSpec
from kfac_jax_lite.tagging._kinds.fallback import FallbackSpec
from kfac_jax_lite.tagging._kinds.scale_and_shift import ScaleAndShiftSpec

REGISTRY: dict[str, type[LayerSpec]] = {cls.name: cls for cls in (DenseSpec, ConvSpec, EmbeddingSpec,
                                      ScaleAndShiftSpec, FallbackSpec)}


def kinds() -> tuple:
  """The names of the registered kinds, in registration order."""
  return tuple(REGISTRY)


def register(cls) -> type:
  """Registers the layer kind ``cls`` (a ``LayerSpec`` subclass) under
  ``cls.name``; returns ``cls`` (usable as a class decorator).
  ``ValueError`` when the name is taken."""
  if not (isinstance(cls, type) and issubclass(cls, LayerSpec)):
    raise TypeError(f"{cls!r} is not a LayerSpec subclass")
  if cls.name in REGISTRY:
    raise ValueError(f"a layer kind {cls.name!r} is already registered")
  REGISTRY[cls.name] = cls
  return cls


def unregister(name: str) -> None:
  """Removes the kind registered as ``name``."""
  del REGISTRY[name]


def recognisers(primitive: str) -> tuple:
  """The kinds whose ``recognise`` handles ``primitive``, the latest
  registered first."""
  return tuple(cls for cls in reversed(REGISTRY.values())
               if primitive in cls.primitives)


def group(uses, leaf_shapes, depth) -> Grouping:
  """The layer of a group of uses: the spec of the kind that takes them."""
  patterns = frozenset(u.kind for u in uses)
  fits = [cls for cls in REGISTRY.values() if patterns <= cls.patterns]
  if not fits:
    raise Unsupported("used as " + " and ".join(sorted(patterns))
                      + " (incompatible layer kinds)")
  cls = min(fits, key=lambda c: len(c.patterns))
  return cls.group(uses, leaf_shapes, depth)


__all__ = ["ConvSpec", "DenseSpec", "EmbeddingSpec", "FallbackSpec",
           "Grouping", "LayerSpec", "REGISTRY", "ScaleAndShiftSpec",
           "Unsupported", "group", "kinds", "recognisers", "register",
           "unregister"]
