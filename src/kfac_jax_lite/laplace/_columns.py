"""Per-example curvature columns: parameter gradients whose outer products
sum to an example's curvature, cross-layer terms included.

For a batch with loss ``L = Σ_e c_e ℓ_e`` over the elements ``e`` of its
registered losses (``c_e`` read from the backward pass, as the estimators
do) the elements' weights are rescaled to average 1 over the elements that
count: ``w_e = c_e / c̄``, ``c̄ = Σ_e c_e / #{e : c_e > 0}`` over the
elements of all the registered losses, so that a mean, a sum or a masked
mean over examples, outputs, tokens or pixels all give ``Σ_e ℓ_e``, the
sum of the elements' negative log-likelihoods (masked ones left out),
never divided by their number per example. Example ``n`` with outputs
``o_n`` (Jacobian ``J_n``) gets columns ``γ = J_nᵀ d`` for cotangents
``d`` on its outputs, one per direction of the estimation mode (``u``,
``B`` as in ``kfl.estimators``):

* ``"exact"``/``"exact_ggn"`` — ``d = √w_e b_ek`` at element ``e`` only,
  for every element and column of ``B`` (``B Bᵀ`` the output Fisher /
  Hessian), so ``Σ γγᵀ = Σ_e w_e J_eᵀ B_e B_eᵀ J_e`` exactly;
* ``"fisher"``, ``"curvature_prop"(_ggn)`` — ``d = √(w_e/S) u_e`` on all
  elements at once, S samples (cross-element terms vanish in expectation);
* ``"empirical"`` — ``"fisher"`` at the data's targets: one column, ``d =
  √w_e ∇_o ℓ_e`` on all elements at once, whose expectation over targets
  drawn from the model is the Fisher's. Without a registered loss there
  are no elements: the loss of the batch holding example n alone is
  differentiated (``L`` assumed a mean or a sum over examples), the
  per-example empirical Fisher.

Examples are processed one at a time (``vmap`` over single-example
batches), so the loss must accept a batch of one.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def batch_axes(batch):
  """``vmap`` axes of a batch: 0 for arrays, None for scalars; and N."""
  leaves = jax.tree.leaves(batch)
  sizes = {jnp.shape(x)[0] for x in leaves if jnp.ndim(x) > 0}
  if len(sizes) != 1:
    raise ValueError(
        "kfl.laplace needs batches whose arrays share one leading example "
        f"axis; got leading sizes {sorted(sizes)}")
  axes = jax.tree.map(lambda x: 0 if jnp.ndim(x) > 0 else None, batch)
  return axes, sizes.pop()


def _one(example, axes):
  """An example sliced by ``vmap`` as a batch of one."""
  return jax.tree.map(lambda x, a: x if a is None else x[None], example, axes)


def _merge(params, leaves, sub):
  flat, treedef = jax.tree.flatten(params)
  flat = list(flat)
  for k, x in zip(leaves, sub):
    flat[k] = x
  return jax.tree.unflatten(treedef, flat)


def element_weights(tagged, params, batch):
  """``(loss, [c_e per registered loss], c_n [N])`` of a whole batch."""
  probes = tagged.zero_probes(params, batch)
  uids = [t.uid for t in tagged.losses]

  def loss_of(loss_probes):
    loss, _, _ = tagged.apply(params, batch, {**probes, **loss_probes})
    return loss

  loss, grads = jax.value_and_grad(loss_of)({u: probes[u] for u in uids})
  c_elems = [grads[u] for u in uids]
  n = jnp.shape(c_elems[0])[0] if jnp.ndim(c_elems[0]) else 1
  c_i = sum(c.reshape(n, -1).sum(-1) if c.ndim else jnp.broadcast_to(c, (n,))
            for c in c_elems)
  return loss, c_elems, c_i


def mean_weight(c_elems, c_i):
  """``(c̄, count)``: the mean positive element weight over all the
  registered losses' elements ``c_elems`` (without a registered loss, the
  mean positive example weight of ``c_i``), and how many examples count
  (``c_n > 0``)."""
  weights = [jnp.ravel(c) for c in c_elems] or [c_i]
  total = sum(jnp.sum(jnp.where(c > 0, c, 0)) for c in weights)
  elements = sum(jnp.sum(c > 0) for c in weights)
  cbar = jnp.where(elements > 0, total / jnp.maximum(elements, 1), 1)
  return cbar, jnp.sum(c_i > 0)


def _directions(dist, outs, targets, w, mode, key, num_samples):
  """Cotangents on one loss's outputs, a tuple of ``[C, 1, *values, *ev]``."""
  values = w.shape  # [1, *rest]
  root = lambda x: jnp.sqrt(w).reshape(values + (1,) * (x.ndim - w.ndim))
  if mode == "empirical":
    g = jax.grad(lambda o: jnp.sum(dist.loss(o, targets)))(outs)
    return tuple((x * root(x))[None] for x in g)
  if mode == "fisher":
    def one(k):
      t = dist.sample(k, outs)
      g = jax.grad(lambda o: jnp.sum(dist.loss(o, t)))(outs)
      return tuple(x * root(x) / math.sqrt(num_samples) for x in g)
    return jax.vmap(one)(jax.random.split(key, num_samples))
  roots = (dist.ggn_sqrt(outs, targets) if mode.endswith("_ggn")
           else dist.fisher_sqrt(outs))
  roots = tuple(b.astype(o.dtype) for b, o in zip(roots, outs))
  k = roots[0].shape[-1]
  if mode.startswith("curvature_prop"):
    def one_probe(key_s):
      r = jax.random.rademacher(key_s, values + (k,), roots[0].dtype)
      return tuple(
          jnp.einsum("...k,...k->...", b, r.reshape(
              values + (1,) * (b.ndim - 1 - len(values)) + (k,)))
          * root(b[..., 0]) / math.sqrt(num_samples) for b in roots)
    return jax.vmap(one_probe)(jax.random.split(key, num_samples))
  # Exact: one column per element position and column of B.
  e = math.prod(values[1:])
  mask = jnp.eye(e, dtype=roots[0].dtype).reshape((e, 1) + values)
  cols = []
  for b in roots:  # [*values, *event, K]
    bk = jnp.moveaxis(b * root(b), -1, 0)  # [K, *values, *event]
    m = mask.reshape(mask.shape + (1,) * (bk.ndim - 1 - len(values)))
    cols.append((m * bk[None]).reshape((e * k,) + bk.shape[1:]))
  return tuple(cols)


def example_columns(tagged, params, batch, key, *, estimation, num_samples,
                    leaves, c_elems, cbar):
  """``[N, C, P_sel]``: every example's columns for the parameter leaves
  ``leaves`` (indices into ``jax.tree.leaves(params)``), raveled in that
  order. ``c_elems``/``cbar`` from ``element_weights``/``mean_weight``."""
  axes, n = batch_axes(batch)
  flat = jax.tree.leaves(params)
  sub = tuple(flat[k] for k in leaves)
  keys = jax.random.split(key, n)

  def per_example(example, c_list, k):
    example = _one(example, axes)
    if not tagged.losses:  # Empirical without a registered loss.
      def loss(s):
        out = tagged.loss_fn(_merge(params, leaves, s), example)
        return out[0] if tagged.has_aux else out
      return _ravel(jax.tree.map(lambda x: x[None], jax.grad(loss)(sub)))
    probes = tagged.zero_probes(params, example)

    def outputs(s):
      _, _, caps = tagged.apply(_merge(params, leaves, s), example, probes)
      outs = tuple(tuple(t.split(caps)[0]) for t in tagged.losses)
      return outs, caps

    outs, vjp_fn, caps = jax.vjp(outputs, sub, has_aux=True)
    per_loss = []
    for j, (t, c) in enumerate(zip(tagged.losses, c_list)):
      w = (c / cbar)[None].astype(outs[j][0].dtype)
      w = jnp.maximum(w, 0)
      targets = tuple(caps[t.uid][t.num_outputs:])
      d = _directions(t.distribution, outs[j], targets, w, estimation,
                      jax.random.fold_in(k, j), num_samples)
      per_loss.append(d)
    # Each loss's columns beside zeros on the other losses' outputs.
    counts = [d[0].shape[0] for d in per_loss]
    cots = tuple(
        tuple(jnp.concatenate([
            per_loss[i][o] if i == j else
            jnp.zeros((counts[i],) + outs[j][o].shape, outs[j][o].dtype)
            for i in range(len(per_loss))]) for o in range(len(outs[j])))
        for j in range(len(outs)))
    (grads,) = jax.vmap(vjp_fn)(cots)
    return _ravel(grads)

  c_batched = [c if c.ndim else jnp.broadcast_to(c, (n,)) for c in c_elems]
  return jax.vmap(per_example, in_axes=(axes, 0, 0))(batch, c_batched, keys)


def _ravel(grads):
  """A tuple of ``[C, *shape]`` gradients as ``[C, P_sel]``."""
  return jnp.concatenate([g.reshape(g.shape[0], -1) for g in grads], axis=1)
