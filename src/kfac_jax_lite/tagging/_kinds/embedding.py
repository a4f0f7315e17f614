"""Embeddings: rows of a 2-D table gathered with integer ids.

Every use is a lookup ``E[ids]`` of the same table ``[vocab, dim]``; the
data is the ids and the cotangents of the looked-up rows, concatenated
over the uses along one shared axis. A table that is also used as a dense
kernel (``h @ Eᵀ``) is a tied embedding, a dense layer with lookups
(``_kinds.dense``).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kfac_jax_lite import blocks as B
from kfac_jax_lite.tagging import _format as F
from kfac_jax_lite.tagging._kinds.base import Grouping, LayerSpec


@dataclasses.dataclass(frozen=True)
class EmbeddingSpec(LayerSpec):
  """A table ``[vocab_size, dim]`` (one slice if stacked)."""

  name = "embedding"
  patterns = frozenset({"embedding"})

  vocab_size: int
  dim: int

  @property
  def param_shapes(self):
    return ((self.vocab_size, self.dim),)

  @classmethod
  def group(cls, uses, leaf_shapes, depth):
    (table,) = {u.roles["table"].leaf for u in uses}
    vocab_size, dim = leaf_shapes[table][depth:]
    return Grouping(cls(vocab_size=vocab_size, dim=dim), (table,))

  def default_block(self, *, damping_mode, weight_sharing):
    return B.KroneckerEmbedding(self.vocab_size, self.dim,
                                damping_mode=damping_mode,
                                weight_sharing=weight_sharing)

  def data(self, uses, captures, cotangents, stacked):
    """``(ids [L?, N, *shared], cots [L?, S, N, *shared, dim])``."""
    base = 1 if stacked else 0
    parts = []
    for u in uses:
      ids = F.arranged(u, captures[u.uid], out=False)[..., u.config["id_pos"]]
      d = base + 1  # the table's dim axis (vocab is its first axis)
      parts.append((ids, F.arranged(u, cotangents[u.uid], [d], samples=True)))
    if len(parts) == 1:
      return parts[0]
    ids = jnp.concatenate([p[0].reshape(p[0].shape[:base + 1] + (-1,))
                           for p in parts], axis=base + 1)
    cot = jnp.concatenate([p[1].reshape(p[1].shape[:base + 2]
                                        + (-1, self.dim)) for p in parts],
                          axis=base + 2)
    return ids, cot

  def per_example_grads(self, inputs, cotangents):
    g, n = cotangents, inputs.shape[0]
    one_hot = F.one_hot(inputs.reshape(n, -1), self.vocab_size, g.dtype)
    return (jnp.einsum("nrv,snrd->snvd", one_hot,
                       g.reshape(g.shape[0], n, -1, self.dim)),)
