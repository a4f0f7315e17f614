"""The curvature state's memory, checked before ``tx.init`` allocates it.

``check_fits(layers, params, where, extra)`` prices the blocks' states by
their shapes alone (``jax.eval_shape``: nothing is allocated), with the
rest of the state (``extra``), and refuses, with
the fixes named, a state that together with the parameters, their
gradients and the update (three more copies of the parameters) and the
refresh's workspace (two matrices of the largest factor's size: the damped
factor it inverts and the inverse it writes before the old one is freed)
would not fit the memory of the device the parameters live on: a GPU's
``bytes_limit``, or the host's physical memory on a CPU.
"""
from __future__ import annotations

import math
import os

import jax
import numpy as np

from kfac_jax_lite.estimators import human_bytes
from kfac_jax_lite.factor import float_dtype


def device_bytes(leaves) -> int | None:
  """The memory of the device holding ``leaves`` (the first one's, or the
  default device): ``memory_stats()["bytes_limit"]`` where the backend
  reports it, else the host's physical memory; None where neither is
  known."""
  try:
    device = next(iter(leaves[0].devices())) if leaves and hasattr(
        leaves[0], "devices") else jax.devices()[0]
    stats = device.memory_stats() or {}
    if stats.get("bytes_limit"):
      return int(stats["bytes_limit"])
  except Exception:  # Tracers, backends without stats: the host below.
    pass
  try:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError, AttributeError):
    return None


def _bytes(tree) -> int:
  """Bytes of the leaves of ``tree`` (arrays, ``ShapeDtypeStruct``s or
  Python scalars)."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is None or dtype is None:
      shape, dtype = np.shape(x), np.result_type(x)
    total += math.prod(shape) * np.dtype(dtype).itemsize
  return total


def check_fits(layers, params, where, extra=None, limit=None):
  """``ValueError`` when the blocks of ``layers`` (``tagging.Layer``s with
  their blocks) and ``extra`` (the rest of the state: arrays or
  ``ShapeDtypeStruct``s, e.g. the stored batch's slot or Adam's moments)
  would need more memory, with ``params`` and three copies of them, than
  the device has (``limit``: its bytes, ``device_bytes`` if None), with
  the refresh's workspace, two arrays of the size of the largest array of
  any block's state (module docstring); the message gives the state's
  bytes, its largest blocks and the fixes."""
  leaves = jax.tree.leaves(params)
  limit = device_bytes(leaves) if limit is None else limit
  if not limit:
    return
  priced: dict = {}  # Repeated layers (equal blocks) priced once.

  def price(l):  # (the block state's bytes, its largest array's)
    dtype = float_dtype([leaves[i] for i in l.leaves])

    def fn():
      shapes = jax.tree.leaves(jax.eval_shape(lambda: l.block.init(dtype)))
      return _bytes(shapes), max(map(_bytes, shapes), default=0)
    try:
      key = (l.block, jax.numpy.dtype(dtype))
      if key not in priced:
        priced[key] = fn()
      return priced[key]
    except TypeError:  # An unhashable (duck-typed) block.
      return fn()
  prices = {l.name: price(l) for l in layers}
  sizes = {name: b for name, (b, _) in prices.items()}
  state = sum(sizes.values()) + _bytes(extra)
  workspace = 2 * max((m for _, m in prices.values()), default=0)
  param_bytes = _bytes(params)
  if state + 4 * param_bytes + workspace <= limit:
    return
  largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
  raise ValueError(
      f"{where}: the curvature state needs {human_bytes(state)} "
      f"({state / max(param_bytes, 1):.1f}x the parameters' "
      f"{human_bytes(param_bytes)}), which with the parameters, gradients, "
      f"update and the refresh's workspace ({human_bytes(workspace)}: two "
      "copies of the largest factor) does not fit the device's "
      f"{human_bytes(limit)}; largest blocks: "
      + ", ".join(f"{n} {human_bytes(b)}" for n, b in largest)
      + ". Keep large factor sides diagonal (blocks={'dense': "
      "{'max_dense_side': 512}}, or per layer by path), give those layers "
      "cheaper blocks (blocks={'<path>': 'diagonal'}) or exclude= them, or "
      "spread the state over devices (layout='sharded'); kfl.describe "
      "prints every block's bytes")
