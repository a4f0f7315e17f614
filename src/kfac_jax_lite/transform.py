"""``kfl.kfac``: the K-FAC preconditioner as an optax transformation.

    tx = optax.chain(kfl.kfac(loss_fn, example_batch), optax.sgd(lr, momentum=0.9))
    updates, state = tx.update(grads, state, params, batch=batch)

Each ``update``:

1. every ``cov_every`` steps, estimates the statistics of every block on
   ``batch`` (its first ``stats_fraction`` share), or takes ``stats=`` from
   ``kfl.value_grad_and_stats`` so the forward pass is shared with the
   gradient; averages them over ``axis_name`` (``pmap``/``shard_map``);
   folds them into the factors' EMA (decay ``cov_decay``);
2. every ``inverse_every`` steps (from step 0) and, while the statistics
   are young, at steps 1, 2, 4, 8, ... below ``inverse_every``
   (``is_refresh_step``), refreshes each block's cached decomposition at
   the current damping; under ``axis_name`` each device refreshes only its
   share of the blocks (block ``i`` on device ``i mod n``) and the caches
   are then shared with a ``psum``. A block that is not ready (no
   decomposition of real statistics yet) is refreshed as soon as its
   factors have statistics, whatever the step;
3. returns ``u = (F + λI)^p g`` per block (``p = precon_power``, ``λ`` the
   damping, a float or an optax schedule of the step), scaled by
   ``s = min(1, √(norm_constraint / ⟨u, g⟩))`` (default 1.0; ``None``
   turns it off), so that ``(s·u)ᵀ F (s·u) = s²⟨u, g⟩`` (the KL of the
   step, up to the learning rate squared) stays below it (KL clipping,
   Ba et al. 2017). Parameters the tagging excluded, and blocks that are
   not ready, pass their gradient through unchanged.

Defaults (``damping=1e-3``, ``norm_constraint=1.0``, ``inverse_every=10``
with the young refreshes) are the README's recommended settings: chained
with ``optax.sgd(lr, momentum=0.9)`` at any lr from 0.01 to 0.1 they train
ordinary small models (``benchmarks/robustness.py``).

Safe fallbacks (``kfl.health(state)`` prints every counter): non-finite
gradients give a zero update (the step is skipped) and count in
``num_bad_grads``; so does a damping that is not positive and finite
(``num_bad_damping``; a constant one is a ``ValueError`` at construction);
non-finite statistics leave the factors as they were (each factor's
``num_skipped``); a preconditioned update that is not finite although the
gradient is (a broken cache) falls back to the raw gradient and counts in
``num_bad_updates``; ``num_nonfinite_params`` counts the updates called
with non-finite parameters (the run has diverged). Factors are kept in
the parameters' dtype, at least float32 (``float_dtype``).

Everything lives in ``KfacState``; ``init`` and ``update`` are pure and
trace to one program (``lax.cond`` for the periodic work).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from kfac_jax_lite.blocks import Stacked
from kfac_jax_lite import estimators
from kfac_jax_lite import factor as fac
from kfac_jax_lite import tagging


class KfacState(NamedTuple):
  count: Any  # int32: updates so far.
  key: Any  # PRNG key for the sampled estimators.
  blocks: dict  # layer name -> block state (leading stack axis if stacked).
  num_bad_grads: Any  # int32: updates skipped for non-finite gradients.
  num_bad_updates: Any  # int32: preconditioned updates replaced by the gradient.
  num_bad_damping: Any  # int32: updates skipped for a damping that is not > 0.
  num_nonfinite_params: Any  # int32: updates called with non-finite params.


def float_dtype(tree):
  """The dtype the curvature is kept in: the floating leaves' widest, at
  least float32 (bf16/fp16 parameters keep float32 factors; float64 ones,
  under ``jax_enable_x64``, float64 ones)."""
  return jnp.result_type(jnp.float32, *[
      x.dtype for x in jax.tree.leaves(tree)
      if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)])


def stats_batch_size(batch, fraction, where="kfac"):
  """The number of examples the statistics see: ``round(N · fraction)``.

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


def _slice_batch(batch, fraction):
  if fraction >= 1.0:
    return batch
  k = stats_batch_size(batch, fraction)
  return jax.tree.map(lambda x: x[:k] if jnp.ndim(x) else x, batch)


def find_layers_cached(cache: dict, loss_fn, params, example_batch, **options):
  """``tagging.find_layers`` (the detection, no blocks), once per params
  structure, shapes and dtypes."""
  leaves, treedef = jax.tree.flatten(params)
  sig = (treedef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves))
  if sig not in cache:
    cache[sig] = tagging.find_layers(loss_fn, params, example_batch, **options)
  return cache[sig]


def _per_slice(layer, fn):
  """``fn(block_state, block, *args)`` on each slice of a layer's state: a
  ``Stacked`` layer (scan) maps it over the stack."""
  if isinstance(layer.block, Stacked):
    inner = layer.block.block
    return jax.vmap(lambda st, *a: fn(st, inner, *a))
  return lambda st, *a: fn(st, layer.block, *a)


class _Layers:
  """The layers of one params structure with their blocks, and helpers."""

  def __init__(self, tagged: tagging.TaggedLoss):
    self.tagged = tagged
    self.layers = tagged.layers

  def init(self, params):
    """Every block's empty state, in its parameters' ``float_dtype``."""
    leaves = jax.tree.leaves(params)
    return {l.name: l.block.init(float_dtype([leaves[i] for i in l.leaves]))
            for l in self.layers}

  def vectors(self, layer, leaves):
    return tuple(leaves[i].reshape(s)
                 for i, s in zip(layer.leaves, layer.block.param_shapes))


def _factors(block_state):
  is_factor = lambda x: isinstance(x, fac.FactorState)
  return [f for f in jax.tree.leaves(block_state, is_leaf=is_factor)
          if is_factor(f)]


def has_statistics(block_state):
  """Whether every factor of one (unstacked) block has received statistics
  (``FactorState.weight > 0``): before that a factor reads as zero."""
  return jnp.all(jnp.stack([f.weight > 0 for f in _factors(block_state)]))


def is_ready(block_state):
  """Whether every factor of one (unstacked) block has a cached
  decomposition of real statistics (``FactorState.cache.step >= 0``); a
  block that is not ready passes its gradient through unpreconditioned."""
  return jnp.all(jnp.stack([f.cache.step >= 0 for f in _factors(block_state)]))


def is_refresh_step(count, inverse_every):
  """Refreshes happen every ``inverse_every`` steps from step 0 and, while
  the statistics are young, at steps 1, 2, 4, 8, ... below ``inverse_every``.

  The zero-debiased EMA of step ``t`` gives the newest batch a weight of
  about ``1/(t+1)`` early on: the statistics decomposed at step 0 are one
  batch's, and reusing them for ``inverse_every`` steps while the
  parameters move fast is where default runs used to diverge. Doubling
  intervals keep the cache no more than half as old as the statistics, for
  ``log2(inverse_every)`` extra refreshes per run.
  """
  young = (count > 0) & (count < inverse_every) & ((count & (count - 1)) == 0)
  return (count % inverse_every == 0) | young


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


def _check_damping(damping, where="kfac"):
  """A constant damping must be a positive finite number; a schedule is
  checked at step 0 when it can be evaluated there."""
  value = damping
  if callable(damping):
    try:
      value = damping(0)
    except Exception:  # A schedule that cannot run eagerly: checked at run time.
      return
  try:
    value = float(value)
  except (TypeError, jax.errors.ConcretizationTypeError):
    return  # Traced: checked at run time (the update is skipped and counted).
  if not (value > 0 and value < float("inf")):
    raise ValueError(f"{where}: damping must be positive and finite, got "
                     f"{value!r}{' (the schedule at step 0)' if callable(damping) else ''}")


DEFAULT_DAMPING = 1e-3
DEFAULT_NORM_CONSTRAINT = 1.0


def kfac(loss_fn: Callable, example_batch, *, damping=DEFAULT_DAMPING,
         estimation="fisher", num_samples=1, cov_decay=0.95, cov_every=1,
         inverse_every=10, damping_mode="pi", stats_fraction=1.0,
         precon_power=-1.0, norm_constraint=DEFAULT_NORM_CONSTRAINT,
         blocks=None, exclude=(), weight_sharing="expand", axis_name=None,
         has_aux=False, seed=0, inverse_method="auto"
         ) -> optax.GradientTransformationExtraArgs:
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
  if norm_constraint is not None and not norm_constraint > 0:
    raise ValueError(f"norm_constraint must be positive (or None), got "
                     f"{norm_constraint!r}")
  _check_damping(damping)
  stats_batch_size(example_batch, stats_fraction, "kfac(example_batch)")
  default_damping = damping
  damping_fn = damping if callable(damping) else (lambda _: default_damping)
  cache: dict = {}
  layers: dict = {}

  def layers_for(params) -> _Layers:
    tagged = find_layers_cached(cache, loss_fn, params, example_batch,
                                has_aux=has_aux, exclude=exclude)
    if tagged not in layers:
      layers[tagged] = _Layers(tagged.with_blocks(
          blocks, damping_mode=damping_mode, weight_sharing=weight_sharing))
    return layers[tagged]

  def init_fn(params):
    zero = jnp.zeros((), jnp.int32)
    return KfacState(
        count=zero, key=jax.random.PRNGKey(seed),
        blocks=layers_for(params).init(params), num_bad_grads=zero,
        num_bad_updates=zero, num_bad_damping=zero, num_nonfinite_params=zero)

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
    dtype = float_dtype(params)
    lam = jnp.asarray(damping_fn(state.count) if damping is None else damping,
                      dtype)
    damping_ok = (lam > 0) & jnp.isfinite(lam)
    if stats is None and batch is None:
      raise ValueError("kfac.update needs batch= (or precomputed stats=)")
    if batch is not None:
      if jax.tree.structure(batch) != lay.tagged.batch_treedef:
        raise ValueError(f"batch structure {jax.tree.structure(batch)} differs "
                         f"from the example batch's {lay.tagged.batch_treedef}")
      if stats is None:
        stats_batch_size(batch, stats_fraction, "kfac.update")

    def new_stats(states):
      if stats is not None:
        s = stats
      else:
        s = estimators.estimate(
            lay.tagged, params, _slice_batch(batch, stats_fraction), stats_key,
            estimation=estimation, num_samples=num_samples,
            states=states).stats
      return jax.lax.pmean(s, axis_name) if axis_name else s

    def accumulate(states):
      s = new_stats(states)
      return {l.name: l.block.update(states[l.name], s[l.name], cov_decay)
              for l in lay.layers}

    states = jax.lax.cond(state.count % cov_every == 0, accumulate,
                          lambda st: st, state.blocks)

    def refresh_one(st, b):
      # Factors without statistics read as zero: leave them unrefreshed
      # (not ready) rather than cache a decomposition of the damping alone.
      new = b.refresh(st, lam, precon_power, step=state.count,
                      method=inverse_method)
      ok = has_statistics(st)
      return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, st)

    due = is_refresh_step(state.count, inverse_every) & damping_ok
    for i, l in enumerate(lay.layers):
      fn = _per_slice(l, refresh_one)
      st = states[l.name]
      # Also refresh a block that is not ready yet, as soon as it can be.
      need = due | (damping_ok & ~jnp.all(_per_slice(l, lambda s, b: is_ready(s))(st)))
      if axis_name is not None:  # Refreshed on one device, then shared.
        def fn(st, fn=fn, mine=_owner_mask(i, axis_name)):
          new = jax.lax.cond(mine, fn, lambda s: s, st)
          return _share_caches(new, st, mine, axis_name)
      states[l.name] = jax.lax.cond(need, fn, lambda s: s, st)

    leaves, treedef = jax.tree.flatten(grads)
    out = list(leaves)
    for l in lay.layers:
      def precondition(st, b, v):
        u = b.multiply_matpower(st, v, lam, precon_power, use_cache=True)
        ready = is_ready(st)
        return tuple(jnp.where(ready, x, y.astype(x.dtype))
                     for x, y in zip(u, v))
      u = _per_slice(l, precondition)(states[l.name], lay.vectors(l, leaves))
      for i, x in zip(l.leaves, u):
        out[i] = x.reshape(leaves[i].shape).astype(leaves[i].dtype)
    if norm_constraint is not None:
      inner = sum(jnp.vdot(u.astype(dtype), g.astype(dtype))
                  for u, g in zip(out, leaves))
      scale = jnp.where(inner > 0, jnp.sqrt(norm_constraint / jnp.where(
          inner > 0, inner, 1)), 1.0)
      scale = jnp.minimum(1.0, scale)
      out = [(u * scale).astype(u.dtype) for u in out]
    grads_ok = fac.all_finite(leaves)
    update_ok = fac.all_finite(out)
    good = grads_ok & damping_ok
    out = [jnp.where(good, jnp.where(update_ok, u, g), jnp.zeros_like(g))
           for u, g in zip(out, leaves)]
    count = lambda x: x.astype(jnp.int32)
    new_state = KfacState(
        count=state.count + 1, key=key, blocks=states,
        num_bad_grads=state.num_bad_grads + count(~grads_ok),
        num_bad_updates=state.num_bad_updates + count(good & ~update_ok),
        num_bad_damping=state.num_bad_damping + count(~damping_ok),
        num_nonfinite_params=state.num_nonfinite_params
        + count(~fac.all_finite(params)))
    return jax.tree.unflatten(treedef, out), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
