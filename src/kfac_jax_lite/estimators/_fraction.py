"""The share of a batch the curvature statistics are computed on
(``stats_fraction`` of ``kfl.kfac`` and ``kfl.value_grad_and_stats``)."""
from __future__ import annotations

import jax
import numpy as np

from kfac_jax_lite import tagging


def _example_leaves(leaves, examples):
  """Indices of the leaves that hold examples: ``examples.leaves`` (the
  detection's, ``tagging.TaggedLoss.examples``) when given, else every
  leaf with a leading axis."""
  if examples is not None:
    return tuple(examples.leaves)
  return tuple(i for i, x in enumerate(leaves) if np.ndim(x) > 0)


def stats_batch_size(batch, fraction, where="kfac", examples=None):
  """The number of examples the statistics see: ``round(N · fraction)``.

  Args:
    batch: the batch; its example leaves share a leading size ``N``.
    fraction: the share in ``(0, 1]``.
    where: the caller, named in errors.
    examples: which leaves hold the examples (``TaggedLoss.examples``,
      ``describe``'s "examples:" line); the others (a dropout PRNG key,
      model state) are not counted. None before the detection: every leaf
      with a leading axis, and a batch whose leaves disagree is not
      refused (its detection decides, later).

  Returns:
    ``round(N · fraction)``; None for ``fraction = 1`` and a batch without
    one leading size (the statistics then see the whole batch), or before
    the detection when the leaves' sizes disagree.

  Raises:
    ValueError: for an empty batch, for ``fraction < 1`` when the example
      leaves do not share a leading size, and for a ``fraction`` that
      leaves fewer than 2 examples (one example's statistics are a
      rank-one curvature: its damped inverse blows the update up by
      ``1/damping``).
  """
  leaves = jax.tree.leaves(batch)
  sizes = {np.shape(leaves[i])[0] for i in _example_leaves(leaves, examples)}
  n = sizes.pop() if len(sizes) == 1 else None
  if n is None:
    if fraction < 1.0 and (examples is not None or not sizes):
      raise ValueError(f"{where}: stats_fraction < 1 needs example leaves "
                       "that share one leading batch size (see kfl.describe)")
    return None
  if n == 0:
    raise ValueError(f"{where}: the batch is empty (its arrays have a leading "
                     "batch size of 0)")
  if fraction >= 1.0:
    return n
  k = int(round(n * fraction))
  if k < 2:
    raise ValueError(
        f"{where}: stats_fraction={fraction} leaves {k} example(s) of a "
        f"batch of {n} for the statistics; they need at least 2 (use a "
        "larger stats_fraction or batch)")
  return k


def stats_slice(batch, fraction, where="kfac", examples=None):
  """``batch`` with its example leaves cut to their first
  ``stats_batch_size(batch, fraction, where, examples)`` examples.

  Only the leaves that hold examples (``examples``, as for
  ``stats_batch_size``) are sliced: a PRNG key for dropout, model state or
  a scalar in the batch passes through as it is, so the statistics' pass
  runs the model on the first examples with the same key. The whole batch
  for ``fraction = 1``.
  """
  if fraction >= 1.0:
    return batch
  k = stats_batch_size(batch, fraction, where, examples)
  if k is None:  # Leaves of several sizes, and no detection to choose.
    raise ValueError(f"{where}: stats_fraction < 1 needs to know which batch "
                     "leaves hold the examples")
  leaves, treedef = jax.tree.flatten(batch)
  cut = set(_example_leaves(leaves, examples))
  return jax.tree.unflatten(treedef, [x[:k] if i in cut else x
                                      for i, x in enumerate(leaves)])


def check_stats_fraction(stats_fraction):
  """A ``stats_fraction`` must be in ``(0, 1]``."""
  if not 0 < stats_fraction <= 1:
    raise ValueError(f"stats_fraction must be in (0, 1], got {stats_fraction!r}")
