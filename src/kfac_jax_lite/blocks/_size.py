"""The Kronecker blocks' size policy and the price of a block's state.

A factor side over ``MAX_DENSE_SIDE`` (a block's ``max_dense_side``; an
input side counted without the bias's row) keeps only its diagonal; a side
over a block's ``side_block`` (and within the limit) is partitioned into
``⌈n / side_block⌉`` equal diagonal blocks (``partitions``);
``state_bytes`` prices a block's state from its shapes alone, for
``kfl.describe`` and ``tx.init``'s memory check.
"""
from __future__ import annotations

import functools
import math

import jax

MAX_DENSE_SIDE = 1024
"""The size policy of the Kronecker blocks (``KroneckerDense``,
``KroneckerConv``, ``KroneckerEmbedding``): a factor side larger than this
keeps only its diagonal (``max_dense_side``, None: no limit); an input
side is counted without the bias's row, so a 1024-wide layer with a bias
(a side of 1025) stays dense. A dense side of ``n`` costs ``2n²`` floats
(covariance and cached inverse) and ``~n³`` FLOPs a refresh: at 50257
(GPT-2's vocabulary) 9.4 GiB and an hour on a CPU; its diagonal costs
``2n`` and ``n``. At 1024 (Shampoo's block size) a 768-wide transformer
block keeps its 768- and 769-wide sides dense and its 2304- and 3072-wide
ones diagonal. Measured against 2048 (issue 47,
``benchmarks/sizes.py --small``: a 17M decoder whose 1536-wide MLP sides
are the only ones in between; 30 steps): the mean step 0.66x, the state
1.10x the parameters against 4.43x, the loss no worse (3.42-3.47 /
3.39-3.73 in two runs at lr 0.01 / 0.03 against 3.67 / 3.72: within the
runs' spread); a ResNet-50's state 1.91x against 4.29x."""


def beyond_limit(side: int, max_dense_side: int | None) -> bool:
  """Whether a factor side of ``side`` is over the size policy's limit."""
  return max_dense_side is not None and side > max_dense_side


def partitions(side: int, side_block: int | None) -> int:
  """How many diagonal blocks a factor side of ``side`` (counted as the
  limit counts it: an input side without the bias's row) is split into:
  ``⌈side / side_block⌉``, 1 (whole) when ``side_block`` is None or not
  smaller. Each block has ``⌈n / p⌉`` rows of the side's ``n`` (the bias's
  row counted), the last padded."""
  if side_block is None or side <= side_block:
    return 1
  return -(-side // side_block)


def block_side(n: int, parts: int) -> int:
  """The side ``k = ⌈n / parts⌉`` of each of a partitioned side's blocks
  (``n`` with the bias's row; the side padded to ``parts·k``)."""
  return -(-n // parts)


def check_side_block(side_block, where):
  """``ValueError`` (naming ``where``) unless ``side_block`` is an int of
  at least 2 or None."""
  if side_block is not None and (isinstance(side_block, bool)
                                 or not isinstance(side_block, int)
                                 or side_block < 2):
    raise ValueError(f"{where}: side_block must be an int >= 2 or None (no "
                     f"partitions), got {side_block!r}")


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
