"""The stages of one ``kfl.kfac`` update, in turn: ``statistics``,
``accumulate``, ``refresh``, ``precondition`` (then ``_safeguards``'
``clip`` and ``guard``), and the refresh schedule ``is_refresh_step``.

Each stage is a pure function of the layers (``tagged.layers``, each with
its block) and the block states ``{layer name: block state}``; the blocks
know their own state (``Block.is_ready``, ``caches``, ``refresh_caches``,
``precondition``; a ``Stacked`` block maps them over its stack).
``kfl.transform`` re-exports them; ``kfl.eigen_adam`` reuses
``statistics`` and ``accumulate``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kfac_jax_lite import estimators
from kfac_jax_lite import factor as fac
from kfac_jax_lite.blocks import KroneckerState
from kfac_jax_lite.blocks import base as blocks_base


def _block(layer):
  """``layer``'s block as a ``Block`` (``blocks.base.as_block``)."""
  return blocks_base.as_block(layer.block)


def has_statistics(block_state):
  """Whether every factor of one (unstacked) block has received statistics
  (``FactorState.weight > 0``): before that a factor reads as zero
  (``Block.has_statistics``)."""
  return blocks_base.has_statistics(block_state)


def is_ready(block_state):
  """Whether every factor of one (unstacked) block has a cached
  decomposition of real statistics (``FactorState.cache.step >= 0``); a
  block that is not ready passes its gradient through unpreconditioned
  (``Block.is_ready``)."""
  return blocks_base.is_ready(block_state)


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
  return (count % inverse_every == 0) | is_young_step(count, inverse_every)


def is_young_step(count, every):
  """Steps 1, 2, 4, 8, ... below ``every``: the extra statistics
  (``_planning.stats_due``) and refreshes (``is_refresh_step``) of a young
  run, when the EMA gives the newest batch a weight of about ``1/(t+1)``
  and the parameters move fastest."""
  return (count > 0) & (count < every) & ((count & (count - 1)) == 0)


def _owner_mask(index, axis_name):
  """On device ``index mod n`` under ``axis_name``: True; else False."""
  n = jax.lax.psum(1, axis_name)
  return jax.lax.axis_index(axis_name) == index % n


# ------------------------------------------------------------------ stages
# One ``update`` is these stages in turn (``kfac``'s ``update_fn``); each is
# a pure function of the layers (``tagged.layers``, each with its block)
# and the block states ``{layer name: block state}``.

def statistics(tagged, params, batch, key, states, *, estimation,
               num_samples, stats_fraction, axis_name=None):
  """``(stats, loss)``: every block's statistics on the first
  ``stats_fraction`` of ``batch`` (``estimators.estimate``) and the loss
  there, averaged over ``axis_name`` when given."""
  est = estimators.estimate(
      tagged, params, estimators.stats_slice(
          batch, stats_fraction, examples=tagged.examples), key,
      estimation=estimation, num_samples=num_samples, states=states)
  out = (est.stats, est.loss)
  return jax.lax.pmean(out, axis_name) if axis_name else out


_STATS_FIX = ("statistics from kfl.value_grad_and_stats (stats=) must come "
              "from the transform's own blocks: give value_grad_and_stats "
              "the same blocks= (and exclude=) as the transform")


def accumulate(layers, states, stats, cov_decay):
  """Folds ``stats`` into every block's factors (EMA of decay ``cov_decay``;
  non-finite statistics leave a factor as it was). Statistics missing for a
  layer, or not of its block's shapes (an estimate made with other
  ``blocks=``), are a ``ValueError`` naming the layer and the fix."""
  out = {}
  for l in layers:
    if l.name not in stats:
      raise ValueError(
          f"no statistics for layer {l.name!r} (given for "
          f"{sorted(k for k in stats if not k.startswith('~'))[:4]}...): "
          f"{_STATS_FIX}")
    misfit = _misfit(states[l.name], stats[l.name])
    if misfit is None:  # Other block kinds: their own shape errors.
      try:
        out[l.name] = l.block.update(states[l.name], stats[l.name],
                                     cov_decay)
      except (ValueError, TypeError) as e:
        misfit = str(e)
    if misfit is not None:
      raise ValueError(f"the statistics of layer {l.name!r} do not fit its "
                       f"block {l.block!r} ({misfit}); {_STATS_FIX}")
  return out


def _shapes(tree):
  return [tuple(jnp.shape(x)) for x in jax.tree.leaves(tree)]


def _misfit(state, stats):
  """Why ``stats`` cannot be a Kronecker or one-factor block's statistics
  (``state``), or None (other blocks check their own)."""
  if isinstance(state, KroneckerState):
    want = KroneckerState(state.a.cov, state.g.cov)
  elif isinstance(state, fac.FactorState):
    want = state.cov
  else:
    return None
  if (jax.tree.structure(stats) != jax.tree.structure(want)
      or _shapes(stats) != _shapes(want)):
    return (f"given {type(stats).__name__} of shapes {_shapes(stats)}, "
            f"its factors take {type(want).__name__} of shapes "
            f"{_shapes(want)}")
  return None


def refresh_needs(layers, states, damping_ok, due):
  """Per layer, whether ``refresh`` refreshes it: with a good damping, on a
  refresh step (``due``) or while its block is not ready."""
  return [damping_ok & (due | ~_block(l).is_ready(states[l.name]))
          for l in layers]


def refresh(layers, states, damping, damping_ok, due, step, *, precon_power,
            inverse_method, axis_name=None):
  """Refreshes the cached decompositions at ``damping`` where needed.

  With a good damping (``damping_ok``), block ``i`` is refreshed when
  ``due`` (a refresh step, ``is_refresh_step``) or while it is not ready (no
  decomposition of real statistics yet), as soon as its factors have
  statistics; ``step`` is recorded in the caches. One ``lax.cond`` gates
  the work of all blocks, and it returns only the caches (``FactorCache``s),
  not the covariances: a step without a refresh then moves no curvature
  data through a conditional. The Kronecker blocks' Gauss–Jordan inverses
  are computed together, stacked by padded size
  (``factor.batched_inverses``): the compiled program then holds a copy of
  the sweep per stack (two per size), not one per factor. Under
  ``axis_name`` each device refreshes only its share (block ``i`` on
  device ``i mod n``) and the caches are shared with a ``psum``.
  """
  needs = refresh_needs(layers, states, damping_ok, due)
  if not layers:
    return states

  need_of = {l.name: need for l, need in zip(layers, needs)}
  index_of = {l.name: i for i, l in enumerate(layers)}

  def refreshed(subset, states, method):
    out = {}
    for l in subset:
      st, block = states[l.name], _block(l)
      fn = functools.partial(block.refresh_caches, damping=damping,
                             exp=precon_power, step=step, method=method)
      if axis_name is None:
        new = fn(st)
      else:  # Refreshed on its owner, then shared.
        mine = _owner_mask(index_of[l.name], axis_name)
        new = jax.lax.cond(mine, fn, block.caches, st)
        new = jax.tree.map(lambda x: jax.lax.psum(
            jnp.where(mine, x, jnp.zeros_like(x)), axis_name), new)
      need = need_of[l.name]
      out[l.name] = jax.tree.map(lambda n, o: jnp.where(need, n, o), new,
                                 block.caches(st))
    return out

  def run(states):
    if axis_name is not None:  # Each device inverts only its own share.
      return refreshed(layers, states, inverse_method)
    joining = [l for l in layers if _batches(_block(l))]
    out = refreshed([l for l in layers if not _batches(_block(l))], states,
                    inverse_method)
    if joining:  # Traced twice (factor.batched_inverses).
      out.update(fac.batched_inverses(
          functools.partial(refreshed, joining, states), inverse_method))
    return out

  def keep(states):
    return {l.name: _block(l).caches(states[l.name]) for l in layers}

  caches = jax.lax.cond(jnp.any(jnp.stack(needs)), run, keep, states)
  blocks = {l.name: _block(l) for l in layers}
  return {name: (blocks[name].with_caches(st, caches[name])
                 if name in caches else st)
          for name, st in states.items()}


def _batches(block):
  """Whether ``refresh`` lets ``block``'s inverses join the batch
  (``factor.batched_inverses``, which traces their refresh twice): the
  library's Kronecker blocks with the library's own refresh, which
  inverts each factor once, outside any ``vmap`` or loop, and does
  nothing else. A subclass that overrides the refresh (it may call back
  to the host, say), a ``Stacked`` block (it maps its refresh over its
  slices: their inverses are batched already) and the other blocks are
  left to their own refresh, traced once."""
  kind = type(block)
  return (isinstance(block, blocks_base.KroneckerBlock)
          and kind.refresh is blocks_base.KroneckerBlock.refresh
          and kind.refresh_caches is blocks_base.Block.refresh_caches)


def precondition(layers, states, grad_leaves, damping, precon_power):
  """The flat list of updates: each layer's leaves preconditioned by its
  block, the other leaves (excluded or fallback-free) as they are."""
  out = list(grad_leaves)
  for l in layers:
    vectors = tuple(grad_leaves[i].reshape(s)
                    for i, s in zip(l.leaves, l.block.param_shapes))
    u = _block(l).precondition(states[l.name], vectors, damping,
                               precon_power)
    for i, x in zip(l.leaves, u):
      out[i] = x.reshape(grad_leaves[i].shape).astype(grad_leaves[i].dtype)
  return out
