"""The detection cache of ``kfl.kfac``: one ``tagging.find_layers`` per
params and batch signature (tree structure, shapes and dtypes), and the
check that a batch's detection gives the example batch's blocks."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kfac_jax_lite import tagging


def _signature(tree):
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple(_leaf_signature(x) for x in leaves)


def _leaf_signature(x):
  """``(shape, dtype)`` of a leaf; for one that is not an array (a whole
  Equinox model's functions), its type, so that the detection itself says
  what is wrong with it (``tagging``'s parameter check)."""
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return tuple(x.shape), str(jnp.result_type(x))
  if isinstance(x, (bool, int, float, complex)):
    return (), str(jnp.result_type(x))
  return None, type(x).__qualname__


def find_layers_cached(cache: dict, loss_fn, params, example_batch, **options):
  """``tagging.find_layers`` (the detection, no blocks), once per params
  and batch structure, shapes and dtypes (a batch whose dtypes change
  between steps, e.g. BatchNorm statistics that come back float64 under
  ``jax_enable_x64``, traces differently: it gets its own detection)."""
  sig = (_signature(params), _signature(example_batch))
  if sig not in cache:
    cache[sig] = tagging.find_layers(loss_fn, params, example_batch, **options)
  return cache[sig]


def check_same_layers(expected, got):
  """A detection for another batch must give the example batch's blocks
  (the state holds theirs)."""
  key = lambda t: [(l.name, l.params, l.spec, l.block, l.row_uses, l.row_map,
                    l.spread)
                   for l in t.layers]
  if key(got) != key(expected):
    raise ValueError(
        "kfac: the layers found for this batch differ from those of the "
        "example batch (its shapes or dtypes make the loss trace "
        f"differently): {[l.name for l in got.layers]} with blocks "
        f"{[type(l.block).__name__ for l in got.layers]} vs "
        f"{[l.name for l in expected.layers]}; pass an example batch like "
        "the batches you train on")
