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
import numpy as np

from kfac_jax_lite import blocks as B
from kfac_jax_lite.tagging import _format as F
from kfac_jax_lite.tagging._kinds.base import Grouping, LayerSpec


@dataclasses.dataclass(frozen=True)
class EmbeddingSpec(LayerSpec):
  """A table ``[vocab_size, dim]`` (one slice if stacked)."""

  name = "embedding"
  patterns = frozenset({"embedding"})
  primitives = ("gather",)

  vocab_size: int
  dim: int

  def output_size(self, use):
    """``dim``: one looked-up row."""
    del use
    return self.dim

  @property
  def param_shapes(self):
    return ((self.vocab_size, self.dim),)

  @classmethod
  def recognise(cls, walk, i, eqn, views, ctx):
    """A ``gather`` of rows of a 2-D table with integer ids (``E[ids]``),
    or of rows looked up once and added to every example
    (``walk._lookup_site``)."""
    if views[1] is not None:
      return "used as gather indices"
    tv = views[0]
    ind = eqn.invars[1]
    dn = eqn.params["dimension_numbers"]
    shape = tuple(eqn.invars[0].aval.shape)
    sizes = tuple(eqn.params["slice_sizes"])
    if (not tv.pure or len(shape) != 2 or dn.operand_batching_dims
        or not np.issubdtype(ind.aval.dtype, np.integer)):
      return "a gather that is not an embedding lookup"
    va = [a for a in range(2) if sizes[a] == 1 and sizes[1 - a] == shape[1 - a]]
    va = [a for a in va if a in dn.start_index_map]
    if len(va) != 1 or shape[va[0]] == 1:
      return "a gather that is not a row lookup of a 2-D table"
    va = va[0]
    if tv.dims[va] != len(tv.stacked):
      return "an embedding table gathered along its second axis"
    pos = list(dn.start_index_map).index(va)
    n_idx = len(ind.aval.shape) - 1
    out = eqn.outvars[0]
    on = len(out.aval.shape)
    kept = [a for a in range(2) if a not in dn.collapsed_slice_dims]
    out_labels, b = [], 0
    for q in range(on):
      if q in dn.offset_dims:
        a = kept[list(dn.offset_dims).index(q)]
        out_labels.append(("u",) if a == va else ("k", tv.dims[a]))
      else:
        out_labels.append(("b", b))
        b += 1
    in_labels = [("b", j) for j in range(n_idx)] + [("iv", pos)]
    capture, cap_aval, probe_i, probe_aval = ("var", ind), ind.aval, i, out.aval
    site, in_labels = walk._lookup_site(out, out_labels, in_labels, ind, ctx)
    if site is not None:
      # Rows looked up without an example axis (``pos[jnp.arange(T)]``) and
      # added to every example: probe the sum, where each example has its
      # own cotangent, and broadcast the ids over the new leading axes.
      probe_i, probe_aval, out_labels, new_sizes = site  # A full key.
      m = len(new_sizes)
      in_labels = [("b", j) for j in range(m)] + [
          ("b", l[1] + m) if l[0] == "b" else l for l in in_labels]
      shape = tuple(new_sizes) + tuple(ind.aval.shape)
      capture = ("var", ind, shape)
      cap_aval = ind.aval.update(shape=shape)
    elif n_idx == 0:
      return "an embedding lookup with no example axis"
    walk._record("embedding", {"table": tv}, ctx, i, capture, cap_aval,
                 probe_i, probe_aval, in_labels, out_labels,
                 dict(vocab_size=shape[va], dim=shape[1 - va], id_pos=pos))
    return None

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
