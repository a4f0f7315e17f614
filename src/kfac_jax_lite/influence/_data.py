"""Per-example training gradients in factored form, from one pass.

For a dense or conv layer with augmented inputs ``ā_nr`` (a 1 appended for
the bias) and output cotangents ``g_nr = ∂ℓ_n/∂y_nr`` at the R positions
``r`` of example ``n`` (R = 1 for a plain dense layer, the spatial
locations of a convolution, the tokens of a sequence), the gradient of
example ``n``'s loss with respect to the layer's weight matrix (the
blocks' layout ``[a, b]``, bias last row, per feature group) is

    ∇_W ℓ_n = Σ_r ā_nr g_nrᵀ,

so ``(ā [N, R, G, a], g [N, R, G, b])`` *is* the batch's per-example
gradient, in ``N·R·G·(a + b)`` floats instead of ``N·G·a·b``. Both come
from one forward pass of the tagged loss and one backward pass to its
layer-output probes (``kfl.tagging``): the ``N × P`` matrix of
per-example gradients is never formed.

Per-example loss. The loss of a batch is read as ``L = Σ_e c_e ℓ_e`` over
its registered losses' elements (``kfl.estimators``: an element is one
value of a loss's output, an example, an output unit, a token; ``c_e``
from the backward pass), and example ``i``'s loss is its share ``L_i =
Σ_{e∈i} c_e ℓ_e`` of ``L`` in units of the batch's mean element weight:

    ℓ_i = Σ_{e∈i} (c_e / c̄) ℓ_e = L_i / c̄,
    c̄ = the mean of the positive c_e over all the batch's elements,

so ``L = c̄ Σ_i ℓ_i``. For every mean, sum and binary-masked mean ``ℓ_i``
is the sum of example ``i``'s unmasked loss elements (``se =
kfl.squared_error(outputs, targets)`` of shape ``[N, C]``, ``ce`` a
cross-entropy per example):

* ``jnp.mean(ce)`` (one element per example): its cross-entropy;
* ``jnp.sum(se)`` and ``se.sum(-1).mean()`` over ``C`` outputs: its
  squared error summed over its ``C`` outputs (a sum stays a sum);
* ``jnp.mean(se)`` over all ``N·C`` elements, a per-token mean over
  ``N·T`` tokens: the sum over its ``C`` outputs (``T`` tokens), ``C``
  (``T``) times its mean;
* a masked mean ``Σ_e m_e ℓ_e / Σ_e m_e``: ``Σ_{e∈i} m_e ℓ_e``, the sum
  over its unmasked tokens (an example with none has ``ℓ_i = 0``).

That is kronfluence's per-example loss, whose ``compute_train_loss`` is a
sum (``c_e = 1``, ``c̄ = 1``: ``ℓ_i = L_i``), and ``kfl.laplace``'s
``ℓ_n``. Within a batch ``ℓ_i`` is proportional to what example ``i``
contributes to ``L``; the unit ``c̄`` makes it independent of the batch
(its size, its masks), so that examples scored in different batches, and
queries, share one scale. (The weights ``c_e`` alone cannot tell a mean
over an example's outputs from a sum over them: ``jnp.sum(se)``,
``se.sum(-1).mean()`` and ``jnp.mean(se)`` have proportional ``c_e``,
so all three score the sum.) Elements weighted unequally (a weighted
mean) keep their relative weights, in units of the batch's mean positive
weight. The layer cotangents of ``ℓ_i`` are the probes' cotangents of
``L`` divided by ``c̄``.

Estimations (``"empirical"`` the data's targets, ``"fisher"`` targets
drawn once per example from the model's predictive distribution; the
curvature of the fit, never the gradients being scored, which always use
the data's targets). For ``"fisher"`` the cotangent put on the model
outputs of element ``e`` is ``(c_e / c̄) ∇_o ℓ(o_e, t̃_e)``: the gradient
of ``ℓ_i`` with the sampled targets.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from kfac_jax_lite import blocks as kfl_blocks
from kfac_jax_lite.blocks import conv as kfl_conv
from kfac_jax_lite.blocks import dense as kfl_dense
from kfac_jax_lite.factor import float_dtype

ESTIMATIONS = ("fisher", "empirical")
"""The ``estimation`` choices of ``kfl.influence.fit``."""


def check_layers(tagged, where):
  """Raise unless every layer is a plain (unstacked) dense or conv layer
  whose rows are its examples: the layer kinds ``kfl.influence`` scores."""
  if not tagged.losses:
    raise ValueError(f"{where}: no registered or recognised loss in the "
                     "loss function; write it with kfl.softmax_cross_entropy "
                     "(or another registered loss) so that per-example "
                     "losses are defined")
  bad = []
  for l in tagged.layers:
    block = None if l.is_fallback else l.block
    if not isinstance(block, (kfl_blocks.KroneckerDense,
                              kfl_blocks.KroneckerConv)):
      bad.append(f"{l.name} ({l.kind})")
    elif l.stack or l.row_map or l.spread or l.row_uses:
      bad.append(f"{l.name} (stacked, or rows that are not examples)")
  if bad:
    raise ValueError(f"{where}: influence is defined for dense and conv "
                     f"layers whose rows are examples; unsupported: {bad}. "
                     "Leave their parameters out with exclude=[paths] (as "
                     "kronfluence tracks only Linear and Conv2d modules)")


def _per_example(c_elem, n, axis):
  if not c_elem.ndim:
    return jnp.broadcast_to(c_elem, (n,))
  return jnp.moveaxis(c_elem, axis, 0).reshape(n, -1).sum(-1)


def mean_weight(c_elems):
  """``c̄``: the mean of the positive element weights ``c_e`` over every
  registered loss's elements (1 when none is positive), the unit of the
  per-example losses (module docstring).

  Computed as ``c_max · mean(c_e / c_max)``, so that when the positive
  weights are equal (a mean, a sum, a binary mask) ``c̄`` is exactly that
  weight: a mean over one element per example scores the same floats as
  ``1/c_i`` did.
  """
  top = max(jnp.max(c, initial=0) for c in c_elems)
  ref = jnp.where(top > 0, top, 1)
  total = sum(jnp.sum(jnp.where(c > 0, c / ref, 0)) for c in c_elems)
  count = sum(jnp.sum(c > 0) for c in c_elems)
  return jnp.where(count > 0, ref * (total / jnp.maximum(count, 1)), 1)


def _sampled_cotangents(tagged, caps, c_elems, cbar, key):
  """Cotangents ``(c_e/c̄) ∇_o ℓ(o_e, t̃_e)`` on every loss's outputs."""
  out = []
  for tag, c_elem, k in zip(tagged.losses, c_elems,
                            jax.random.split(key, len(tagged.losses))):
    outs, _ = tag.split(caps)
    dist = tag.distribution
    t = dist.sample(k, outs)
    u = jax.grad(lambda o, t=t, dist=dist: jnp.sum(dist.loss(o, t)))(outs)
    w = c_elem / cbar
    out.append(tuple(
        (x * w.reshape(w.shape + (1,) * (x.ndim - w.ndim))).astype(x.dtype)
        for x in u))
  return tuple(out)


def example_data(tagged, params, batch, key, estimation
                 ) -> tuple[dict, Any, Any]:
  """``({layer name: (ā [N,R,G,a], g [N,R,G,b])}, c_i [N], loss)``.

  ``g`` is ``∂ℓ_n/∂y`` of the per-example loss of the module docstring,
  with the data's targets (``"empirical"``) or sampled ones
  (``"fisher"``, from ``key``); ``tagged`` has its blocks
  (``with_blocks``) and passed ``check_layers``.
  """
  probes = tagged.zero_probes(params, batch)

  def f(pr):
    loss, _, caps = tagged.apply(params, batch, pr)
    return (loss, tuple(t.split(caps)[0] for t in tagged.losses)), caps

  (loss, outs), vjp_fn, caps = jax.vjp(f, probes, has_aux=True)
  zero_outs = jax.tree.map(jnp.zeros_like, outs)
  (ct,) = vjp_fn((jnp.ones_like(loss), zero_outs))
  c_elems = [ct[t.uid].astype(float_dtype(ct[t.uid].dtype))
             for t in tagged.losses]
  first = tagged.losses[0]
  n = c_elems[0].shape[first.example_axis] if c_elems[0].ndim else 1
  c_i = sum(_per_example(c, n, t.example_axis)
            for c, t in zip(c_elems, tagged.losses))
  cbar = mean_weight(c_elems)
  scale = 1 / cbar
  if estimation == "fisher":
    d = _sampled_cotangents(tagged, caps, c_elems, cbar, key)
    (ct,) = vjp_fn((jnp.zeros_like(loss), d))
    scale = jnp.ones_like(cbar)
  layer_data = tagged.layer_data(caps, ct, c_i)
  out = {}
  for l in tagged.detected:
    data, block = layer_data[l.name], l.block
    if isinstance(block, kfl_blocks.KroneckerDense):
      a, g, _, _ = kfl_dense.dense_data(block.layout, data.inputs,
                                        data.cotangents, data.weights, l.name)
      a, g = a[:, :, None], g[:, :, :, None]
    else:
      a, g, _, _ = kfl_conv.conv_data(block, data.inputs, data.cotangents,
                                      data.weights)
    g = g[0] * scale.astype(g.dtype)
    out[l.name] = (a, g)
  return out, c_i, loss


def layer_params(tagged, params):
  """``{layer name: W [G, a, b]}``: each layer's parameters (or a
  params-shaped gradient) in its block's matrix layout."""
  leaves = dict(zip(tagged.paths, jax.tree.leaves(params)))
  return {l.name: l.block.layout.to_mat(tuple(leaves[p] for p in l.params))
          for l in tagged.detected}


def unflatten_params(tagged, mats, params):
  """The params-shaped pytree of ``{layer name: W [G, a, b]}`` (zeros for
  parameters of no layer)."""
  leaves = {p: jnp.zeros_like(x)
            for p, x in zip(tagged.paths, jax.tree.leaves(params))}
  for l in tagged.detected:
    for p, x in zip(l.params, l.block.layout.from_mat(mats[l.name])):
      leaves[p] = x.reshape(leaves[p].shape)
  return jax.tree.unflatten(tagged.param_treedef,
                            [leaves[p] for p in tagged.paths])
