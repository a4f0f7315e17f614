"""``kfl.kfac``: the K-FAC preconditioner as an optax transformation.

    tx = optax.chain(kfl.kfac(loss_fn, example_batch), optax.sgd(lr, momentum=0.9))
    updates, state = tx.update(grads, state, params, batch=batch)

Each ``update``:

1. every ``cov_every`` steps, estimates the statistics of every block on
   ``batch`` (its first ``stats_fraction`` share), or takes ``stats=`` from
   ``kfl.value_grad_and_stats`` so the forward pass is shared with the
   gradient; averages them over ``axis_name`` (``pmap``/``shard_map``);
   folds them into the factors' EMA (decay ``cov_decay``);
2. every ``inverse_every`` steps (from step 0), refreshes each block's
   cached decomposition at the current damping; under ``axis_name`` each
   device refreshes only its share of the blocks (block ``i`` on device
   ``i mod n``) and the caches are then shared with a ``psum``;
3. returns ``u = (F + λI)^p g`` per block (``p = precon_power``, ``λ`` the
   damping, a float or an optax schedule of the step), scaled by
   ``s = min(1, √(norm_constraint / ⟨u, g⟩))`` when ``norm_constraint`` is
   set, so that ``(s·u)ᵀ F (s·u) = s²⟨u, g⟩`` (the KL of the step, up to
   the learning rate squared) stays below it (KL clipping, Ba et al. 2017).
   Parameters the tagging excluded pass through unchanged.

Safe fallbacks: non-finite gradients give a zero update (the step is
skipped) and count in ``num_bad_grads``; non-finite statistics leave the
factors as they were (each factor's ``num_skipped``); a preconditioned
update that is not finite although the gradient is (a broken cache) falls
back to the raw gradient and counts in ``num_bad_updates``.

Everything lives in ``KfacState``; ``init`` and ``update`` are pure and
trace to one program (``lax.cond`` for the periodic work).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from kfac_jax_lite import estimators
from kfac_jax_lite import factor as fac
from kfac_jax_lite import tagging


class KfacState(NamedTuple):
  count: Any  # int32: updates so far.
  key: Any  # PRNG key for the sampled estimators.
  blocks: dict  # layer name -> block state (leading stack axis if stacked).
  num_bad_grads: Any  # int32: updates skipped for non-finite gradients.
  num_bad_updates: Any  # int32: preconditioned updates replaced by the gradient.


def _slice_batch(batch, fraction):
  if fraction >= 1.0:
    return batch
  n = tagging._tagged._batch_size(batch)
  if n is None:
    raise ValueError("stats_fraction < 1 needs batch arrays that share one "
                     "leading batch size")
  k = max(1, int(round(n * fraction)))
  return jax.tree.map(lambda x: x[:k] if jnp.ndim(x) else x, batch)


def find_layers_cached(cache: dict, loss_fn, params, example_batch, **options):
  """``tagging.find_layers``, once per params structure, shapes and dtypes."""
  leaves, treedef = jax.tree.flatten(params)
  sig = (treedef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves))
  if sig not in cache:
    cache[sig] = tagging.find_layers(loss_fn, params, example_batch, **options)
  return cache[sig]


def _stacked(layer, fn):
  return jax.vmap(fn) if layer.stack else fn


class _Layers:
  """The detected layers of one params structure, and per-layer helpers."""

  def __init__(self, tagged: tagging.TaggedLoss):
    self.tagged = tagged
    self.layers = tagged.layers

  def init(self):
    states = {}
    for l in self.layers:
      s = l.block.init()
      if l.stack:
        s = jax.tree.map(lambda x: jnp.broadcast_to(x, (l.stack,) + x.shape), s)
      states[l.name] = s
    return states

  def vectors(self, layer, leaves):
    lead = (layer.stack,) if layer.stack else ()
    return tuple(leaves[i].reshape(lead + tuple(s))
                 for i, s in zip(layer.leaves, layer.block.param_shapes))


def _owner_mask(index, axis_name):
  """On device ``index mod n`` under ``axis_name``: True; else False."""
  n = jax.lax.psum(1, axis_name)
  return jax.lax.axis_index(axis_name) == index % n


def _share_caches(refreshed, old, mine, axis_name):
  """Every device gets the owner's refreshed caches (a psum of one share)."""
  def share(new_f, old_f):
    return old_f._replace(cache=jax.tree.map(
        lambda x: jax.lax.psum(jnp.where(mine, x, jnp.zeros_like(x)),
                               axis_name), new_f.cache))
  is_factor = lambda x: isinstance(x, fac.FactorState)
  return jax.tree.map(share, refreshed, old, is_leaf=is_factor)


def kfac(loss_fn: Callable, example_batch, *, damping=1e-3,
         estimation="fisher", num_samples=1, cov_decay=0.95, cov_every=1,
         inverse_every=10, damping_mode="pi", stats_fraction=1.0,
         precon_power=-1.0, norm_constraint=None, blocks=None, exclude=(),
         weight_sharing="expand", axis_name=None, has_aux=False,
         seed=0, inverse_method="auto") -> optax.GradientTransformationExtraArgs:
  """The K-FAC preconditioner; see the module docstring.

  ``stats_fraction`` applies to statistics computed here from ``batch=``;
  ``stats=`` from ``kfl.value_grad_and_stats`` are used as given.
  ``loss_fn(params, batch)`` returns the loss (``(loss, aux)`` with
  ``has_aux``); ``example_batch`` (arrays or ``jax.ShapeDtypeStruct``s) is
  only traced to find the layers. ``blocks``/``exclude`` override the
  detected blocks per path or kind (see ``kfl.find_layers``).
  ``update(grads, state, params, *, batch=None, stats=None, damping=None)``;
  a ``damping`` given there overrides the configured one for that step.
  ``inverse_method``: how each refresh computes the damped inverses
  ``(C + d·I)⁻¹`` of the π-damped factors (``precon_power=-1``):
  ``"gauss_jordan"`` (blocked Gauss–Jordan elimination, XLA matrix products
  only, 2n³ flops), ``"cholesky"`` (LAPACK/cuSOLVER ``L Lᵀ``, then ``L⁻ᵀL⁻¹``),
  ``"newton_schulz"`` (``X ← X + X(I − (C + d·I)X)`` from the previous
  inverse, Gauss–Jordan when that does not converge), ``"eigh"``; ``"auto"``
  (default): ``"gauss_jordan"`` on CPU, ``"cholesky"`` elsewhere. All are
  exact to rounding; see ``kfl.factor``. Other powers and
  ``damping_mode="exact"`` use eigendecompositions.
  """
  estimators.check_estimation(estimation, num_samples)
  fac.check_inverse_method(inverse_method)
  if not 0 < stats_fraction <= 1:
    raise ValueError(f"stats_fraction must be in (0, 1], got {stats_fraction}")
  for name, value in (("cov_every", cov_every), ("inverse_every", inverse_every)):
    if not (isinstance(value, int) and value >= 1):
      raise ValueError(f"{name} must be a positive int, got {value!r}")
  default_damping = damping
  damping_fn = damping if callable(damping) else (lambda _: default_damping)
  cache: dict = {}
  layers: dict = {}

  def layers_for(params) -> _Layers:
    tagged = find_layers_cached(
        cache, loss_fn, params, example_batch, has_aux=has_aux, blocks=blocks,
        exclude=exclude, weight_sharing=weight_sharing,
        damping_mode=damping_mode)
    if tagged not in layers:
      layers[tagged] = _Layers(tagged)
    return layers[tagged]

  def init_fn(params):
    return KfacState(
        count=jnp.zeros((), jnp.int32), key=jax.random.PRNGKey(seed),
        blocks=layers_for(params).init(),
        num_bad_grads=jnp.zeros((), jnp.int32),
        num_bad_updates=jnp.zeros((), jnp.int32))

  def update_fn(grads, state, params=None, *, batch=None, stats=None,
                damping=None, **extra_args):
    del extra_args
    if params is None:
      raise ValueError("kfac needs params: call tx.update(grads, state, params, "
                       "batch=batch)")
    lay = layers_for(params)
    key, stats_key = jax.random.split(state.key)
    if axis_name is not None:  # Independent samples on every device.
      stats_key = jax.random.fold_in(stats_key, jax.lax.axis_index(axis_name))
    lam = jnp.asarray(damping_fn(state.count) if damping is None else damping,
                      jnp.float32)
    if stats is None and batch is None:
      raise ValueError("kfac.update needs batch= (or precomputed stats=)")
    if batch is not None and jax.tree.structure(batch) != lay.tagged.batch_treedef:
      raise ValueError(f"batch structure {jax.tree.structure(batch)} differs "
                       f"from the example batch's {lay.tagged.batch_treedef}")

    def new_stats():
      if stats is not None:
        s = stats
      else:
        s = estimators.estimate(
            lay.tagged, params, _slice_batch(batch, stats_fraction), stats_key,
            estimation=estimation, num_samples=num_samples).stats
      return jax.lax.pmean(s, axis_name) if axis_name else s

    def accumulate(states):
      s = new_stats()
      return {l.name: _stacked(l, lambda st, x, b=l.block: b.update(
          st, x, cov_decay))(states[l.name], s[l.name]) for l in lay.layers}

    states = jax.lax.cond(state.count % cov_every == 0, accumulate,
                          lambda st: st, state.blocks)

    def refresh(states):
      out = {}
      for i, l in enumerate(lay.layers):
        fn = _stacked(l, lambda st, b=l.block: b.refresh(
            st, lam, precon_power, step=state.count, method=inverse_method))
        if axis_name is None:
          out[l.name] = fn(states[l.name])
        else:
          mine = _owner_mask(i, axis_name)
          new = jax.lax.cond(mine, fn, lambda st: st, states[l.name])
          out[l.name] = _share_caches(new, states[l.name], mine, axis_name)
      return out

    states = jax.lax.cond(state.count % inverse_every == 0, refresh,
                          lambda st: st, states)

    leaves, treedef = jax.tree.flatten(grads)
    out = list(leaves)
    for l in lay.layers:
      fn = _stacked(l, lambda st, v, b=l.block: b.multiply_matpower(
          st, v, lam, precon_power, use_cache=True))
      u = fn(states[l.name], lay.vectors(l, leaves))
      for i, x in zip(l.leaves, u):
        out[i] = x.reshape(leaves[i].shape).astype(leaves[i].dtype)
    if norm_constraint is not None:
      inner = sum(jnp.vdot(u.astype(jnp.float32), g.astype(jnp.float32))
                  for u, g in zip(out, leaves))
      scale = jnp.where(inner > 0, jnp.sqrt(norm_constraint / jnp.where(
          inner > 0, inner, 1)), 1.0)
      scale = jnp.minimum(1.0, scale)
      out = [(u * scale).astype(u.dtype) for u in out]
    grads_ok = fac.all_finite(leaves)
    update_ok = fac.all_finite(out)
    out = [jnp.where(grads_ok, jnp.where(update_ok, u, g), jnp.zeros_like(g))
           for u, g in zip(out, leaves)]
    new_state = KfacState(
        count=state.count + 1, key=key, blocks=states,
        num_bad_grads=state.num_bad_grads + (~grads_ok).astype(jnp.int32),
        num_bad_updates=state.num_bad_updates
        + (grads_ok & ~update_ok).astype(jnp.int32))
    return jax.tree.unflatten(treedef, out), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
