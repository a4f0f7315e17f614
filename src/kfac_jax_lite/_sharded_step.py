"""One ``kfl.kfac`` update's curvature work in the sharded layout
(``kfl.sharding``): statistics reduce-scattered to the blocks' owners,
accumulated and refreshed there, the owners' preconditioned gradients
all-gathered. Runs on every device of the layout's axis (inside ``pmap``
or ``shard_map``; under ``jit`` with a mesh ``_layouts.on_mesh`` wraps the
update in a ``shard_map``); the per-block work is ``_stages``' ``accumulate``,
``refresh`` and ``precondition``, called on each device's own blocks.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax_lite import sharding
from kfac_jax_lite import tagging
from kfac_jax_lite.blocks import base as blocks_base
from kfac_jax_lite.factor import FactorState
from kfac_jax_lite._stages import (accumulate, precondition, refresh,
                                   refresh_needs)


def device_count(axis_name) -> int:
  """The size of the bound ``axis_name`` (a ``NameError`` if unbound)."""
  return jax.lax.psum(1, axis_name)


def axis_is_bound(axis_name) -> bool:
  """Whether ``axis_name`` is bound here (inside ``pmap``/``shard_map``)."""
  try:
    jax.lax.axis_index(axis_name)
  except NameError:
    return False
  return True


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
      on every device): each device takes its own blocks' share, no
      reduce-scatter.
    lam, damping_ok, refresh_due, count, cov_decay, precon_power,
    inverse_method: as for ``_stages.refresh``/``accumulate``.
  """
  layout = blocks.layout
  axis, devices = layout.axis_name, layout.devices
  names = layout.names
  owner = layout.owner_of
  index = {n: i for i, n in enumerate(names)}
  me = jax.lax.axis_index(axis)

  stats_p = None
  stats_defs: list = []
  shapes: dict = {}
  halves: list = []
  stat_rows: tuple = ()
  loss = jnp.zeros((), grad_leaves[0].dtype if grad_leaves else jnp.float32)
  if compute_stats is not None:
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
        return rows, jnp.asarray(value, loss.dtype)
      rows = tuple(jax.lax.psum_scatter(b, axis, scatter_dimension=0,
                                        tiled=False) / devices
                   for b in packed)
      return rows, jax.lax.pmean(jnp.asarray(value, loss.dtype), axis)

    if stats_due is None:
      stat_rows, loss = scattered()
    else:
      zeros = lambda: (tuple(jnp.zeros((n,), t) for t, n in stats_p.lengths),
                       jnp.zeros((), loss.dtype))
      stat_rows, loss = jax.lax.cond(stats_due, scattered, zeros)

  inverses = blocks.inverses
  if inverses is None:  # The owners precondition; their updates gathered.
    items = [[grad_leaves[i] for i in l.leaves] for l in layers]
  else:  # The owners' caches gathered after a refresh.
    items = [jax.tree.leaves(inverses[n]) for n in names]
  out_p = sharding.packing(items, layout.owners)
  local = tuple(jnp.reshape(b, (-1,)) for b in blocks.buffers)

  def branch(d):
    mine = [l for l in layers if owner[l.name] == d]

    def run(rows, stat_rows):
      states = sharding.own_states(layout, d, rows)
      if stats_p is not None and mine:
        got = sharding.unpack_row(stats_p, d, stat_rows)
        stats = {names[i]: jax.tree.unflatten(stats_defs[i], [
            _symmetric_from(x, jax.tree.leaves(shapes[names[i]])[k].shape)
            if halves[i][k] else x for k, x in enumerate(leaves)])
                 for i, leaves in got.items()}
        fold = lambda s: accumulate(mine, s, stats, cov_decay)
        states = (fold(states) if stats_due is None else
                  jax.lax.cond(stats_due, fold, lambda s: s, states))
      needs = refresh_needs(mine, states, damping_ok, refresh_due)
      states = refresh(mine, states, lam, damping_ok, refresh_due, count,
                       precon_power=precon_power,
                       inverse_method=inverse_method)
      if inverses is None:
        out = precondition(mine, states, grad_leaves, lam, precon_power)
        own = {index[l.name]: [out[i] for i in l.leaves] for l in mine}
      else:
        own = {index[l.name]: jax.tree.leaves(_block(l).caches(
            states[l.name])) for l in mine}
      refreshed = jnp.any(jnp.stack(needs)) if needs else jnp.bool_(False)
      return (sharding.own_rows(layout, d, states),
              sharding.pack_row(out_p, d, own), refreshed)
    return run

  new_rows, out_rows, refreshed = jax.lax.switch(
      me, [branch(d) for d in range(devices)], local, stat_rows)
  gather = lambda: sharding.unpack_all(
      out_p, [_gather(r, axis, devices, me) for r in out_rows])
  out = list(grad_leaves)
  if inverses is None:
    got = gather()
    for l in layers:
      for i, x in zip(l.leaves, got[index[l.name]]):
        out[i] = x
  else:
    # Gathered only when some owner refreshed (one int all-reduced).
    any_refreshed = jax.lax.psum(refreshed.astype(jnp.int32), axis) > 0
    leaves = jax.lax.cond(
        any_refreshed, lambda: [gather()[i] for i in range(len(names))],
        lambda: [jax.tree.leaves(inverses[n]) for n in names])
    inverses = {n: jax.tree.unflatten(jax.tree.structure(inverses[n]), x)
                for n, x in zip(names, leaves)}
    out = precondition(layers, _with_inverses(layout, inverses), grad_leaves,
                       lam, precon_power)
  new_blocks = sharding.ShardedBlocks(
      [jnp.reshape(r, b.shape) for r, b in zip(new_rows, blocks.buffers)],
      layout, inverses)
  return out, new_blocks, loss


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
