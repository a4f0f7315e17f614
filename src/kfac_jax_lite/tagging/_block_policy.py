"""The block policy: the curvature block of every detected layer.

Detection (``tagging.find_layers``) finds layers and returns them without
blocks (``Layer.block`` None); this module, above both ``tagging`` and
``blocks``, chooses their curvature (``make_blocks``) and gives the
detection with them (``with_blocks``: a new ``TaggedLoss`` of new
``Layer`` records, the detection itself unchanged), so the damping and
sharing policy never reaches the graph walk and changing it does not
re-trace. What a layer of each kind gets is its kind's to say (its spec's
``default_block``, ``block_for`` and ``with_options``, in
``tagging/_kinds/<kind>.py``), so a new kind brings its blocks with it;
this module applies the overrides and the stacking. Overrides (``blocks=``) map a parameter path (an exact
path or an ``fnmatch`` pattern such as ``"*/bias"``; a prefix is no match,
``"l0/*"`` takes ``l0/w`` and ``l0/b``, ``"l0"`` neither) or a layer kind
(``"dense"``, ``"conv"``, ``"embedding"``, ``"scale_and_shift"``,
``"fallback"``) to one of:

* ``"kronecker"`` (the default for dense/conv/embedding), ``"diagonal"``,
  ``"full"``, ``"naive_diagonal"`` (what each means per kind: the kind's
  ``block_for``); ``"kronecker_vector"`` (dense and conv: Eva's rank-one
  ``blocks.KroneckerVectorDense`` / ``KroneckerVectorConv``); ``"ekfac"``
  (dense and conv: ``blocks.eigen_corrected``);
  ``"series1"``, ``"series2"``, ``"kron_indep"`` (a dense layer applied at
  every step of one ``lax.scan``: ``blocks.series_block``, T the scan's
  length; ``ValueError`` for a layer not used that way);
* a ``dict`` of keyword arguments for the default block (e.g.
  ``{"weight_sharing": "reduce"}``): the block's fields that the layer does
  not fix (``damping_mode``, ``weight_sharing``, ``renorm_coeff`` of a
  Kronecker block; ``full`` of a scale-and-shift; none for a fallback); an
  unknown key is a ``ValueError`` naming the layer, the key and the allowed
  ones;
* a block instance (used as is; its ``param_shapes`` must match);
* a callable ``f(layer) -> block`` (``layer``: the ``Layer`` record with the
  default block filled in).

Paths take precedence over kinds; the first matching path pattern wins; a
key that is no kind and matches no layer's parameter path is a
``ValueError`` naming the nearest paths. A layer stacked along
``lax.scan`` gets ``Stacked(block, L)`` of the chosen (one-slice) block.
"""
from __future__ import annotations

import dataclasses
import typing

from kfac_jax_lite import blocks as B
from kfac_jax_lite.tagging import _kinds
from kfac_jax_lite.tagging import _paths

SERIES_CHOICES = ("series1", "series2", "kron_indep")
CHOICES = ("kronecker", "diagonal", "full", "naive_diagonal", "ekfac",
           "kronecker_vector") + SERIES_CHOICES


def _matches(pattern, paths):
  """Whether ``pattern`` (an exact path or an ``fnmatch`` pattern) names
  one of ``paths``."""
  return any(_paths.matches(pattern, p) for p in paths)


def find_override(overrides, paths, kind):
  """The override for a layer with parameter ``paths`` and ``kind``."""
  if not overrides:
    return None
  for pattern, choice in overrides.items():
    if pattern in _kinds.REGISTRY:
      continue
    if _matches(pattern, paths):
      return choice
  return overrides.get(kind)


def make_blocks(layers, overrides=None, *, damping_mode="pi",
                weight_sharing="expand"):
  """The curvature block of each of ``layers`` (a tuple in their order).

  ``overrides``: the ``blocks=`` mapping (see the module docstring);
  ``damping_mode`` (``"pi"`` or ``"exact"``) and ``weight_sharing``
  (``"expand"`` or ``"reduce"``) configure the default Kronecker blocks.
  """
  _check_keys(overrides, layers)
  return tuple(_block(l, find_override(overrides, l.params, l.kind),
                      damping_mode, weight_sharing) for l in layers)


def _check_keys(overrides, layers):
  """A ``blocks=`` key that is neither a layer kind nor matches a detected
  layer's parameter path would be ignored: a ``ValueError`` naming it and
  the paths it could have meant."""
  paths = [p for l in layers for p in l.params]
  for pattern in overrides or ():
    if pattern in _kinds.REGISTRY or _matches(pattern, paths):
      continue
    raise ValueError(
        f"blocks= key {pattern!r} is neither a layer kind "
        f"{tuple(_kinds.REGISTRY)} nor matches a parameter of a detected "
        f"layer (excluded parameters have no block; "
        f"{_paths.unmatched(pattern, paths)})")


def with_blocks(tagged, overrides=None, *, damping_mode="pi",
                weight_sharing="expand"):
  """``tagged`` (a ``TaggedLoss``) with every layer's block chosen by
  ``make_blocks(tagged.layers, overrides, damping_mode=, weight_sharing=)``:
  a new ``TaggedLoss`` sharing the detection (no re-trace), whose layers are
  new ``Layer`` records; ``tagged`` is left as it is."""
  chosen = make_blocks(tagged.layers, overrides, damping_mode=damping_mode,
                       weight_sharing=weight_sharing)
  return tagged.replace(layers=tuple(
      dataclasses.replace(l, block=b) for l, b in zip(tagged.layers, chosen)))


def _block(layer, override, damping_mode, weight_sharing):
  spec = layer.spec
  default = spec.default_block(damping_mode=damping_mode,
                               weight_sharing=weight_sharing)
  where = f"blocks= override for {layer.name!r}"
  if override is None:
    block = default
  elif isinstance(override, dict):
    block = _with_options(spec, default, override, where)
  elif isinstance(override, str):
    if override not in CHOICES:
      raise ValueError(f"unknown block choice {override!r}; expected one of "
                       f"{CHOICES}, a dict of options, a block or a callable")
    if override == "ekfac":
      block = B.eigen_corrected(default, where)
    elif override in SERIES_CHOICES:
      block = _series(layer, override, default, where)
    else:
      try:
        block = spec.block_for(override, default)
      except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
  else:
    if callable(override) and not hasattr(override, "param_shapes"):
      block = override(dataclasses.replace(layer, block=default))
    else:
      block = override
    B.check_block(block, where)
    # A duck-typed block (not necessarily a subclass): check_block verified
    # the Block interface.
    block = typing.cast(B.Block, block)
    shapes = tuple(map(tuple, spec.param_shapes))
    if tuple(map(tuple, block.param_shapes)) != shapes:
      raise ValueError(f"override block {block!r} has parameter shapes "
                       f"{block.param_shapes}, the layer needs {shapes}")
  if layer.is_fallback and block.consumes != B.GRADIENTS:
    raise ValueError(f"{where}: {block!r} consumes {block.consumes}, but a "
                     f"fallback ({layer.reason}) only has parameter "
                     f"gradients; use a block that consumes {B.GRADIENTS!r} "
                     "(Full, NaiveDiagonal)")
  return B.Stacked(block, layer.stack) if layer.stack else block


def allowed_options(spec, default):
  """The keyword options a ``blocks=`` dict may set on ``default``, the
  default block of a layer of ``spec``: its fields that the layer does not
  fix (a field named like one of the spec's is the layer's: its shape,
  window, bias...); none for a fallback."""
  if spec.is_fallback:
    return ()
  fixed = {f.name for f in dataclasses.fields(spec)}
  return tuple(f.name for f in dataclasses.fields(default)
               if f.name not in fixed)


def _with_options(spec, default, override, where):
  """``default`` with the options of a ``blocks=`` dict; ``ValueError``
  naming the layer, the unknown keys and the allowed ones."""
  allowed = allowed_options(spec, default)
  unknown = sorted(set(override) - set(allowed), key=str)
  if unknown:
    raise ValueError(
        f"{where}: {type(default).__name__} takes no option "
        f"{', '.join(map(repr, unknown))}; its options are "
        + (", ".join(allowed) if allowed else "none (a fallback's block is "
           "chosen by name, block or callable)"))
  try:
    return spec.with_options(default, override)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{where}: {e}") from e


def _series(layer, option, default, where):
  """The series block of a dense layer used once per step of one scan."""
  steps = layer.steps
  if layer.is_fallback or not steps or any(len(s) != 1 for s in steps):
    raise ValueError(
        f"{where}: {option!r} is for a dense layer applied at every step of "
        f"one lax.scan (its parameters scan constants), but "
        f"{layer.name!r} is " + (
            f"a fallback ({layer.reason})" if layer.is_fallback else
            "not used inside a lax.scan" if not any(steps) else
            "used inside nested scans" if any(len(s) > 1 for s in steps)
            else "also used outside its scan") + "; select the recurrent "
        "layers by path (e.g. blocks={'cell/*': 'series1'})")
  if len(steps) != 1:
    raise ValueError(f"{where}: {option!r} needs one use per step, but "
                     f"{layer.name!r} has {len(steps)} uses (shared or tied "
                     "weights)")
  return B.series_block(default, option, steps[0][0],
                        time_axis=1 if layer.row_uses and not layer.row_map
                        else 0, where=where)
