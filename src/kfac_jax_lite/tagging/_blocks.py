"""Choosing and constructing the curvature block of a detected layer.

Overrides (``blocks=`` of ``find_layers``) map a parameter path (an exact
path or an ``fnmatch`` pattern such as ``"*/bias"``) or a layer kind
(``"dense"``, ``"conv"``, ``"embedding"``, ``"scale_and_shift"``,
``"fallback"``) to one of:

* ``"kronecker"`` (the default for dense/conv/embedding), ``"diagonal"``,
  ``"full"``, ``"naive_diagonal"``;
* a ``dict`` of keyword arguments for the default block (e.g.
  ``{"weight_sharing": "reduce"}``);
* a block instance (used as is; its ``param_shapes`` must match);
* a callable ``f(layer_info) -> block`` (``layer_info``: the ``Layer``
  record with the default block filled in).

Paths take precedence over kinds; the first matching path pattern wins.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math

from kfac_jax_lite import blocks as B

KINDS = ("dense", "conv", "embedding", "scale_and_shift", "fallback")
CHOICES = ("kronecker", "diagonal", "full", "naive_diagonal")


def find_override(overrides, paths, kind):
  if not overrides:
    return None
  for pattern, choice in overrides.items():
    if pattern in KINDS:
      continue
    if any(p == pattern or fnmatch.fnmatchcase(p, pattern) for p in paths):
      return choice
  return overrides.get(kind)


def default_block(spec, options):
  """The block for a layer spec (dict with ``kind`` and its config)."""
  kind = spec["kind"]
  ws = options.get("weight_sharing", "expand")
  dm = options.get("damping_mode", "pi")
  if kind == "dense":
    return B.KroneckerDense(spec["kernel_shape"], spec["in_axes"],
                            has_bias=spec["has_bias"], damping_mode=dm,
                            weight_sharing=ws)
  if kind == "embedding":
    return B.KroneckerEmbedding(spec["vocab_size"], spec["dim"],
                                damping_mode=dm, weight_sharing=ws)
  if kind == "conv":
    c = spec["conv"]
    return B.KroneckerConv(
        c["kernel_shape"], window_strides=c["window_strides"],
        padding=c["padding"], lhs_dilation=c["lhs_dilation"],
        rhs_dilation=c["rhs_dilation"],
        dimension_numbers=c["dimension_numbers"],
        feature_group_count=c["feature_group_count"],
        has_bias=spec["has_bias"], damping_mode=dm)
  if kind == "scale_and_shift":
    return B.ScaleAndShift(spec["param_shape"], has_scale=spec["has_scale"],
                           has_shift=spec["has_shift"])
  return B.NaiveDiagonal(tuple(spec["param_shapes"]))


def _param_shapes(spec, block):
  return tuple(block.param_shapes)


def choose(spec, override, options, info_fn):
  """The block for ``spec`` under ``override`` (see the module docstring)."""
  block = default_block(spec, options)
  if override is None or override == "kronecker":
    return block
  kind = spec["kind"]
  shapes = _param_shapes(spec, block)
  if isinstance(override, dict):
    if kind == "fallback":
      raise ValueError("fallback blocks take no keyword options")
    return dataclasses.replace(block, **override)
  if isinstance(override, str):
    if override not in CHOICES:
      raise ValueError(f"unknown block choice {override!r}; expected one of "
                       f"{CHOICES}, a dict of options, a block or a callable")
    if override == "full":
      if kind == "scale_and_shift":
        return dataclasses.replace(block, full=True)
      return B.Full(shapes)
    if override == "naive_diagonal":
      return B.NaiveDiagonal(shapes)
    if override == "diagonal":
      if kind == "dense":
        return B.DiagonalDense(block.kernel_shape, block.in_axes,
                               has_bias=block.has_bias)
      if kind == "conv":
        kw = {f.name: getattr(block, f.name) for f in dataclasses.fields(
            B.DiagonalConv) if hasattr(block, f.name)}
        return B.DiagonalConv(**kw)
      if kind == "scale_and_shift":
        return block
      return B.NaiveDiagonal(shapes)
  if callable(override) and not hasattr(override, "param_shapes"):
    block = override(info_fn(block))
  else:
    block = override
  if tuple(map(tuple, block.param_shapes)) != tuple(map(tuple, shapes)):
    raise ValueError(f"override block {block!r} has parameter shapes "
                     f"{block.param_shapes}, the layer needs {shapes}")
  return block


def state_bytes(block, stack=None):
  n = B.state_bytes(block)
  return n * (stack or 1)


def factor_shapes(block):
  shapes = getattr(block, "factor_shapes", None)
  if shapes is None:
    return ()
  return tuple(tuple(s) for s in shapes)


def size(shapes):
  return sum(math.prod(s) for s in shapes)
