"""The share of a batch the curvature statistics are computed on
(``stats_fraction`` of ``kfl.kfac`` and ``kfl.value_grad_and_stats``)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kfac_jax_lite import tagging


def stats_batch_size(batch, fraction, where="kfac"):
  """The number of examples the statistics see: ``round(N · fraction)``.

  ``batch``: the batch (arrays sharing a leading batch size ``N``);
  ``fraction``: the share in ``(0, 1]``; ``where``: the caller, named in
  errors. Returns None for ``fraction = 1`` and a batch without one
  leading size (the statistics then see the whole batch, whatever it is).
  Raises ``ValueError`` for an empty batch, and for a ``fraction`` that
  leaves fewer than 2 examples (one example's statistics are a rank-one
  curvature: its damped inverse blows the update up by ``1/damping``).
  """
  n = tagging.batch_size(batch)
  if n is None:
    if fraction < 1.0:
      raise ValueError(f"{where}: stats_fraction < 1 needs batch arrays that "
                       "share one leading batch size")
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


def stats_slice(batch, fraction, where="kfac"):
  """The first ``stats_batch_size(batch, fraction)`` examples of ``batch``
  (scalars are kept as they are); the whole batch for ``fraction = 1``."""
  if fraction >= 1.0:
    return batch
  k = stats_batch_size(batch, fraction, where)
  return jax.tree.map(lambda x: x[:k] if jnp.ndim(x) else x, batch)


def check_stats_fraction(stats_fraction):
  """A ``stats_fraction`` must be in ``(0, 1]``."""
  if not 0 < stats_fraction <= 1:
    raise ValueError(f"stats_fraction must be in (0, 1], got {stats_fraction!r}")
