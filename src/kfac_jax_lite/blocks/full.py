"""Full and naive-diagonal blocks over a group of parameters.

For fallbacks and small parameter groups: the block is an explicit matrix
``F = Σ_k α_k γ_k γ_kᵀ`` (``Full``) or its diagonal ``Σ_k α_k γ_k²``
(``NaiveDiagonal``) over K gradient samples ``γ_k`` with weights ``α_k``
(default ``1/K``). Two uses:

* per-example gradients of ℓ_i with ``α_i = c_i`` — the exact empirical or
  sampled curvature of the group;
* one batch gradient of the mean loss over N examples with ``α = N`` — TF
  K-FAC's naive estimators ("squared batch gradient"): in expectation over
  sampled targets ``N·E[γγᵀ] = F`` of the mean loss.

Both consume ``GRADIENTS``: from a layer's ``LayerData`` with ``grads``
``[S, N, *shape]`` and weights ``c_i`` the statistics are
``Σ_i c_i (1/S) Σ_s γ_si γ_siᵀ`` (the K = S·N gradients with
``α_si = c_i / S``).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kfac_jax_lite.blocks import base
from kfac_jax_lite.blocks import flat


class _GradientBlock(flat.FlatBlock):

  consumes = base.GRADIENTS

  def __post_init__(self):
    object.__setattr__(self, "param_shapes",
                       tuple(tuple(int(d) for d in s) for s in self.param_shapes))

  def compute_stats(self, grads, weights=None):
    """From ``grads``: a tuple of arrays ``[K, *param_shape]``."""
    grads = tuple(jnp.asarray(x) for x in grads)
    got = tuple(tuple(x.shape[1:]) for x in grads)
    if got != self.param_shapes or len({x.shape[0] for x in grads}) != 1:
      raise ValueError(f"{self!r}: expected gradients [K, *shape] for shapes "
                       f"{self.param_shapes}, got shapes "
                       f"{tuple(x.shape for x in grads)}")
    dtype = base.stats_dtype(*grads)
    k = grads[0].shape[0]
    u = jnp.concatenate([x.reshape(k, -1).astype(dtype) for x in grads], 1)
    alpha = (jnp.full((k,), 1.0 / k, dtype) if weights is None
             else jnp.asarray(weights, dtype) * jnp.ones((k,), dtype))
    ua = u * alpha[:, None]
    if self.diagonal:
      return jnp.einsum("ki,ki->i", ua, u)
    return jnp.einsum("ki,kj->ij", ua, u)

  def layer_stats(self, data, state=None):
    """``compute_stats`` of the ``S·N`` gradients ``data.grads``
    (``[S, N, *shape]`` each) with weights ``α_si = c_i / S``."""
    del state
    grads = tuple(jnp.asarray(x) for x in data.grads)
    s, n = grads[0].shape[:2]
    c = (jnp.full((n,), 1.0 / n, base.stats_dtype(*grads))
         if data.weights is None else jnp.asarray(data.weights))
    return self.compute_stats(
        tuple(x.reshape((s * n,) + x.shape[2:]) for x in grads),
        weights=jnp.tile(c, s) / s)


@dataclasses.dataclass(frozen=True)
class Full(_GradientBlock):
  """An explicit curvature matrix over the flattened parameters."""

  param_shapes: tuple
  diagonal = False


@dataclasses.dataclass(frozen=True)
class NaiveDiagonal(_GradientBlock):
  """A diagonal curvature over the flattened parameters."""

  param_shapes: tuple
  diagonal = True
