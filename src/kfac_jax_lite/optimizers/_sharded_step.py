"""One ``kfl.kfac`` update's curvature work in the sharded layout
(``kfl.sharding``): statistics reduce-scattered to the blocks' owners,
accumulated and refreshed there, the owners' preconditioned gradients
all-gathered. Runs on every device of the layout's axis (inside ``pmap``
or ``shard_map``; under ``jit`` with a mesh ``_layouts.on_mesh`` wraps the
update in a ``shard_map``); the per-block work is ``_stages``' ``accumulate``,
``refresh`` and ``precondition``, called on each device's own blocks.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax_lite import tagging
from kfac_jax_lite.blocks import base as blocks_base
from kfac_jax_lite.factor import FactorState
from kfac_jax_lite.optimizers import sharding
from kfac_jax_lite.optimizers._stages import (accumulate, precondition, refresh,
                                   refresh_needs)


def device_count(axis_name) -> int:
  """The size of the bound ``axis_name`` (a ``NameError`` if unbound)."""
  return jax.lax.psum(1, axis_name)


def _gather(row, axis, devices, me):
  """``[D, P]``: every device's ``row``, the same on every device. Inside
  ``shard_map(check_vma=True)`` the result must be typed invariant over
  ``axis``, which ``all_gather``'s is not (JAX's ``all_gather_invariant``
  is, where public); there the rows are summed into place with a ``psum``
  (twice an all-gather's bytes)."""
  if axis not in tagging.varying_axes(row):
    return jax.lax.all_gather(row, axis, tiled=False)
  invariant = getattr(jax.lax, "all_gather_invariant", None)
  if invariant is not None:
    return invariant(row, axis, tiled=False)
  full = jnp.zeros((devices,) + row.shape, row.dtype)
  return jax.lax.psum(jax.lax.dynamic_update_index_in_dim(full, row, me, 0),
                      axis)


def check_layout(blocks, layers):
  """The state's layout fits this run: the same blocks, the same device
  count; else a ``ValueError`` that says how to convert it."""
  layout = blocks.layout
  names = tuple(l.name for l in layers)
  if names != layout.names:
    raise ValueError(
        f"kfl.kfac: the sharded state holds the blocks {list(layout.names)}, "
        f"the model has {list(names)}")
  n = device_count(layout.axis_name)
  if n != layout.devices:
    raise ValueError(
        f"kfl.kfac: the state is sharded over {layout.devices} devices, this "
        f"step runs on {n} (axis {layout.axis_name!r}): put it into this "
        "run's layout with kfl.sharding.shard_like(state, tx.init(params))")


def init_rows(layout, states):
  """This device's rows ``([1, L] per dtype)`` of the blocks ``states`` (the
  same on every device, e.g. fresh ones): row ``axis_index`` of their
  packing."""
  packed = sharding.pack_states(layout, states)
  d = jax.lax.axis_index(layout.axis_name)
  return tuple(jax.lax.dynamic_slice_in_dim(b, d, 1, axis=0) for b in packed)


def step(layers, blocks, grad_leaves, compute_stats, *, stats_due,
         stats_replicated, lam, damping_ok, refresh_due, count, cov_decay,
         precon_power, inverse_method):
  """``(updates, blocks, loss)``: the flat list of updates (each layer's
  leaves preconditioned by its owner and gathered; the other leaves as they
  are), the new ``ShardedBlocks`` and the device mean of the statistics'
  loss (0 when none were computed).

  Args:
    layers: the tagged layers, in the layout's order.
    blocks: this device's ``ShardedBlocks`` (rows ``[1, L]``).
    grad_leaves: the flat gradient, the same on every device.
    compute_stats: ``() -> ({name: stats}, loss)`` on this device's
      examples, or None for no statistics this step.
    stats_due: a bool scalar gating the statistics (``cov_every > 1``), or
      None (every step).
    stats_replicated: the statistics are already the device mean (the same
      on every device: a ``stats=`` that ``jit`` summed over the whole
      batch, which XLA all-reduced): each device takes its own blocks'
      share, no reduce-scatter. False for ``batch=``'s own pass and for
      the per-device ``stats=`` of ``value_grad_and_stats(mesh=)``
      (``_layouts.on_mesh`` hands each device its row).
    lam, damping_ok, refresh_due, count, cov_decay, precon_power,
    inverse_method: as for ``_stages.refresh``/``accumulate``.
  """
  layout = blocks.layout
  names, me = layout.names, jax.lax.axis_index(layout.axis_name)
  dtype = grad_leaves[0].dtype if grad_leaves else jnp.float32
  st = _scatter_statistics(layers, layout, compute_stats, stats_due,
                           stats_replicated, dtype)
  inverses = blocks.inverses
  if inverses is None:  # The owners precondition; their updates gathered.
    items = [[grad_leaves[i] for i in l.leaves] for l in layers]
  else:  # The owners' caches gathered after a refresh.
    items = [jax.tree.leaves(inverses[n]) for n in names]
  out_p = sharding.packing(items, layout.owners)
  local = tuple(jnp.reshape(b, (-1,)) for b in blocks.buffers)
  work = _OwnerWork(layers, layout, st, out_p, grad_leaves, inverses is None,
                    stats_due, lam, damping_ok, refresh_due, count, cov_decay,
                    precon_power, inverse_method)
  new_rows, out_rows, refreshed = jax.lax.switch(
      me, [functools.partial(_owner_branch, work, d)
           for d in range(layout.devices)], local, st.rows)
  out, inverses = _gathered(layers, layout, out_p, out_rows, refreshed,
                            grad_leaves, inverses, lam, precon_power)
  new_blocks = sharding.ShardedBlocks(
      [jnp.reshape(r, b.shape) for r, b in zip(new_rows, blocks.buffers)],
      layout, inverses)
  return out, new_blocks, st.loss


class _Stats(NamedTuple):
  """This device's rows of its own blocks' statistics (the device mean),
  and how to unpack them; ``packing`` None when none were computed."""

  packing: Any
  defs: list  # Per block (layout order): its statistics' tree structure.
  shapes: dict  # name -> its statistics' shapes.
  halves: list  # Per block, per leaf: crosses as its upper triangle.
  rows: tuple
  loss: Any


def _scatter_statistics(layers, layout, compute_stats, stats_due,
                        stats_replicated, dtype) -> _Stats:
  """The statistics of every block on this device's examples, packed
  ``[D, S]`` by owner (symmetric ones as their triangle) and
  reduce-scattered: each device receives its own blocks' device mean (or,
  ``stats_replicated``, takes its share); gated by ``stats_due``."""
  loss = jnp.zeros((), dtype)
  if compute_stats is None:
    return _Stats(None, [], {}, [], (), loss)
  axis, devices, names = layout.axis_name, layout.devices, layout.names
  me = jax.lax.axis_index(axis)
  shapes, _ = jax.eval_shape(compute_stats)
  by_name = {l.name: l for l in layers}
  halves = [[_symmetric(by_name[n], x) for x in jax.tree.leaves(shapes[n])]
            for n in names]
  items = [[_triangle(x) if h else x
            for x, h in zip(jax.tree.leaves(shapes[n]), half)]
           for n, half in zip(names, halves)]
  stats_defs = [jax.tree.structure(shapes[n]) for n in names]
  stats_p = sharding.packing(items, layout.owners)

  def scattered():
    stats, value = compute_stats()
    leaves = {i: [_triangle(x) if h else x
                  for x, h in zip(jax.tree.leaves(stats[n]), halves[i])]
              for i, n in enumerate(names)}
    packed = sharding.pack_all(stats_p, leaves, devices)  # [D, S]
    if stats_replicated:
      rows = tuple(jax.lax.dynamic_index_in_dim(b, me, keepdims=False)
                   for b in packed)
      return rows, jnp.asarray(value, dtype)
    rows = tuple(jax.lax.psum_scatter(b, axis, scatter_dimension=0,
                                      tiled=False) / devices
                 for b in packed)
    return rows, jax.lax.pmean(jnp.asarray(value, dtype), axis)

  if stats_due is None:
    rows, loss = scattered()
  else:
    # Zeros of the scattered rows' types, their varying mesh axes included
    # (inside shard_map(check_vma=True) the branches' types must agree).
    zeros = lambda: jax.tree.map(
        lambda s: tagging.varying_zeros(s.shape, s.dtype, s),
        jax.eval_shape(scattered))
    rows, loss = jax.lax.cond(stats_due, scattered, zeros)
  return _Stats(stats_p, stats_defs, shapes, halves, rows, loss)


class _OwnerWork(NamedTuple):
  """What every owner's branch of ``step`` reads (``step``'s Args)."""

  layers: Any
  layout: Any
  stats: _Stats
  out_packing: Any
  grad_leaves: Any
  gather_updates: bool  # gather="updates" (else the caches are gathered).
  stats_due: Any
  lam: Any
  damping_ok: Any
  refresh_due: Any
  count: Any
  cov_decay: Any
  precon_power: Any
  inverse_method: Any


def _owner_branch(w: _OwnerWork, d, rows, stat_rows):
  """Device ``d``'s work on the blocks it owns: fold its statistics,
  refresh, and precondition its blocks' gradient (or pack its caches).
  Returns its new rows, its packed output row and whether it refreshed."""
  layout, st = w.layout, w.stats
  names, index = layout.names, {n: i for i, n in enumerate(layout.names)}
  mine = [l for l in w.layers if layout.owner_of[l.name] == d]
  states = sharding.own_states(layout, d, rows)
  if st.packing is not None and mine:
    got = sharding.unpack_row(st.packing, d, stat_rows)
    stats = {names[i]: jax.tree.unflatten(st.defs[i], [
        _symmetric_from(x, jax.tree.leaves(st.shapes[names[i]])[k].shape)
        if st.halves[i][k] else x for k, x in enumerate(leaves)])
             for i, leaves in got.items()}
    fold = lambda s: accumulate(mine, s, stats, w.cov_decay)
    states = (fold(states) if w.stats_due is None else
              jax.lax.cond(w.stats_due, fold, lambda s: s, states))
  needs = refresh_needs(mine, states, w.damping_ok, w.refresh_due)
  states = refresh(mine, states, w.lam, w.damping_ok, w.refresh_due, w.count,
                   precon_power=w.precon_power,
                   inverse_method=w.inverse_method)
  if w.gather_updates:
    out = precondition(mine, states, w.grad_leaves, w.lam, w.precon_power)
    own = {index[l.name]: [out[i] for i in l.leaves] for l in mine}
  else:
    own = {index[l.name]: jax.tree.leaves(_block(l).caches(
        states[l.name])) for l in mine}
  refreshed = jnp.any(jnp.stack(needs)) if needs else jnp.bool_(False)
  return (sharding.own_rows(layout, d, states),
          sharding.pack_row(w.out_packing, d, own), refreshed)


def _gathered(layers, layout, out_p, out_rows, refreshed, grad_leaves,
              inverses, lam, precon_power):
  """The whole update from the owners' rows: their preconditioned pieces
  all-gathered (``inverses`` None), or the caches all-gathered when some
  owner refreshed and every block preconditioned here. Returns the flat
  updates and the (new) gathered caches."""
  axis, devices, names = layout.axis_name, layout.devices, layout.names
  me = jax.lax.axis_index(axis)
  index = {n: i for i, n in enumerate(names)}
  gather = lambda: sharding.unpack_all(
      out_p, [_gather(r, axis, devices, me) for r in out_rows])
  out = list(grad_leaves)
  if inverses is None:
    got = gather()
    for l in layers:
      for i, x in zip(l.leaves, got[index[l.name]]):
        out[i] = x
    return out, None
  # Gathered only when some owner refreshed (one int all-reduced).
  any_refreshed = jax.lax.psum(refreshed.astype(jnp.int32), axis) > 0
  leaves = jax.lax.cond(
      any_refreshed, lambda: [gather()[i] for i in range(len(names))],
      lambda: [jax.tree.leaves(inverses[n]) for n in names])
  inverses = {n: jax.tree.unflatten(jax.tree.structure(inverses[n]), x)
              for n, x in zip(names, leaves)}
  out = precondition(layers, _with_inverses(layout, inverses), grad_leaves,
                     lam, precon_power)
  return out, inverses


def _block(layer):
  return blocks_base.as_block(layer.block)


# A symmetric statistic ``[..., n, n]`` (a Kronecker factor's ``XᵀX``, a
# full block's ``Σ ggᵀ``: ``Block.symmetric_stats``) crosses the devices as
# its upper triangle, ``n(n+1)/2`` numbers instead of ``n²``.

def _symmetric(layer, x) -> bool:
  return (getattr(_block(layer).one_slice, "symmetric_stats", False)
          and len(x.shape) >= 2 and x.shape[-1] == x.shape[-2])


def _triangle(x):
  """The upper triangle (diagonal included) of ``x [..., n, n]``, row by
  row: ``[..., n(n+1)/2]`` (a shape-dtype struct for one)."""
  n = x.shape[-1]
  if isinstance(x, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(x.shape[:-2] + (n * (n + 1) // 2,), x.dtype)
  i, j = np.triu_indices(n)
  return x[..., i, j]


def _symmetric_from(v, shape):
  """The symmetric ``[..., n, n]`` whose upper triangle ``_triangle`` gave."""
  n = shape[-1]
  i, j = np.triu_indices(n)
  upper = jnp.zeros(shape, v.dtype).at[..., i, j].set(v)
  return upper + jnp.swapaxes(jnp.triu(upper, 1), -1, -2)


def _with_inverses(layout, inverses):
  """``{name: block state}`` for preconditioning on any device: zero
  factors (never read by a preconditioner that uses the cache; XLA drops
  them) carrying the gathered ``inverses``."""
  out = {}
  for i, name in enumerate(layout.names):
    zeros = [jnp.zeros(shape, dtype) for dtype, _, shape in layout.slots[i]]
    template = jax.tree.unflatten(layout.treedefs[i], zeros)
    is_factor = lambda x: isinstance(x, FactorState)
    out[name] = jax.tree.map(
        lambda f, c: f._replace(cache=c) if is_factor(f) else c, template,
        inverses[name], is_leaf=is_factor)
  return out
