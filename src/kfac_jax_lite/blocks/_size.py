"""The Kronecker blocks' size policy and the price of a block's state.

A factor side over ``MAX_DENSE_SIDE`` (a block's ``max_dense_side``) keeps
only its diagonal; ``state_bytes`` prices a block's state from its shapes
alone, for ``kfl.describe`` and ``tx.init``'s memory check.
"""
from __future__ import annotations

import functools
import math

import jax

MAX_DENSE_SIDE = 2048
"""The size policy of the Kronecker blocks (``KroneckerDense``,
``KroneckerConv``, ``KroneckerEmbedding``): a factor side larger than this
keeps only its diagonal (``max_dense_side``, None: no limit). A dense side
of ``n`` costs ``2n²`` floats (covariance and cached inverse) and ``~n³``
FLOPs a refresh: at 50257 (GPT-2's vocabulary) 9.4 GiB and an hour on a
CPU; its diagonal costs ``2n`` and ``n``. At 2048 a 768-wide transformer
block keeps its 768- and 769-wide sides dense and its 2304- and
3072-wide ones diagonal."""


def beyond_limit(side: int, max_dense_side: int | None) -> bool:
  """Whether a factor side of ``side`` is over the size policy's limit."""
  return max_dense_side is not None and side > max_dense_side


def check_max_dense_side(limit, where):
  """``ValueError`` (naming ``where``) unless ``limit`` is a positive int
  or None."""
  if limit is not None and (isinstance(limit, bool)
                            or not isinstance(limit, int) or limit < 1):
    raise ValueError(f"{where}: max_dense_side must be a positive int or "
                     f"None (no limit), got {limit!r}")


def state_bytes(block) -> int:
  """Bytes of the block's state (float32 factors), from its shapes alone
  (``jax.eval_shape``); remembered per block, so the repeated layers of a
  deep model are priced once."""
  try:
    return _state_bytes(block)
  except TypeError:  # An unhashable (duck-typed) block.
    return _state_bytes.__wrapped__(block)


@functools.lru_cache(maxsize=1024)
def _state_bytes(block) -> int:
  shapes = jax.eval_shape(block.init)
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes))
