"""Kronecker-factored embedding lookups.

A lookup ``y = E[id]`` of a table ``E [vocab, dim]`` is a dense layer on the
one-hot input ``e_id``: its input factor ``Σ_i w_i e_id e_idᵀ`` is diagonal,
so the block stores only its diagonal (TF K-FAC's
``EmbeddingInputKroneckerFactor``). With R lookups per example:

* ``"expand"`` — ``A = Σ_i w_i (1/R) Σ_r e_ir e_irᵀ`` is diagonal: the
  share of lookups of each id. Exact.
* ``"reduce"`` — ``ã_i = (1/R) Σ_r e_ir`` (the example's id counts over R);
  ``A = Σ_i w_i diag(ã_i²)`` keeps the diagonal of ``Σ_i w_i ã_i ã_iᵀ``
  (co-occurrences of different ids are dropped; exact for R = 1).

``G`` is the dense block's output factor. For R = 1 both modes equal the
dense block of the same table on one-hot inputs.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from kfac_jax_lite.blocks import _kron
from kfac_jax_lite.blocks import _layout
from kfac_jax_lite.blocks import _size
from kfac_jax_lite.blocks import base
from kfac_jax_lite.blocks import dense


@dataclasses.dataclass(frozen=True)
class KroneckerEmbedding(base.KroneckerBlock):
  """Kronecker block of an embedding table ``[vocab_size, dim]``.

  ``max_dense_side``: an output factor (``dim``) larger than this keeps
  only its diagonal (``blocks.MAX_DENSE_SIDE``; None: no limit), one
  larger than ``side_block`` is partitioned into equal diagonal blocks
  (``KroneckerBlock``; None, the default: whole); the input factor is
  always diagonal. Parameters: ``(table,)``.
  """

  vocab_size: int
  dim: int
  damping_mode: str = "pi"
  weight_sharing: str = "expand"
  renorm_coeff: float = 1.0
  max_dense_side: int | None = _size.MAX_DENSE_SIDE
  side_block: int | None = None

  @property
  def input_diagonal(self) -> bool:
    return True

  def __post_init__(self):
    self.check_options()
    dense.check_weight_sharing(self.weight_sharing, type(self).__name__)

  @property
  def layout(self):
    return _layout.TableLayout(self.vocab_size, self.dim)

  def compute_stats(self, ids, cotangents, weights=None):
    """Statistics from integer ``ids [N, *shared]`` and cotangents
    ``[(S,) N, *shared, dim]`` of the looked-up rows."""
    ids, cotangents = jnp.asarray(ids), jnp.asarray(cotangents)
    where = repr(self)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise ValueError(f"{where}: ids must be integers, got {ids.dtype}")
    expected = tuple(ids.shape) + (self.dim,)
    g = base.split_samples(cotangents, len(expected), where)
    if tuple(g.shape[1:]) != expected:
      raise ValueError(f"{where}: cotangents of shape {cotangents.shape} do "
                       f"not match ids of shape {ids.shape} and dim {self.dim}")
    dtype = base.stats_dtype(cotangents)
    n = ids.shape[0]
    r = math.prod(ids.shape[1:])
    ids = ids.reshape(n, r)
    c, w = base.normalized_weights(weights, n, dtype, where)
    if self.weight_sharing == "expand":
      share = jnp.broadcast_to((w / r)[:, None], (n, r))
    else:  # Σ_v (count_v / R)² spread over the lookups of each id.
      same = (ids[:, :, None] == ids[:, None, :]).sum(-1).astype(dtype)
      share = w[:, None] * same / r**2
    big_a = jnp.zeros((self.vocab_size,), dtype).at[ids.ravel()].add(
        share.ravel(), mode="drop")
    g = g.reshape(g.shape[0], n, r, self.dim).astype(dtype)
    big_g = dense.output_stats(g, c, self.weight_sharing,
                               self.output_diagonal, self.output_parts)
    return _kron.KroneckerState(a=big_a[None], g=big_g[None])
