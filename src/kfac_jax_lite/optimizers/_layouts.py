"""``kfl.kfac``'s ``layout``, ``mesh`` and ``gather`` options: their checks,
the sharded layout's ``init`` (``kfl.sharding``) and ``update`` under plain
``jit`` with a mesh (the same update in a ``shard_map``)."""
from __future__ import annotations

import jax

from kfac_jax_lite import estimators
from kfac_jax_lite.optimizers import _sharded_step
from kfac_jax_lite.optimizers import sharding
from kfac_jax_lite.blocks import base as blocks_base

LAYOUTS = ("replicated", "sharded")


def check(layout, axis_name, mesh, gather):
  """The layout to use (``kfac``'s ``layout``, ``mesh`` and ``gather``), or
  a ``ValueError`` naming what is missing."""
  if layout is None:
    layout = "sharded" if mesh is not None else "replicated"
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS} (or None), got "
                     f"{layout!r}")
  if gather not in sharding.GATHERS:
    raise ValueError(f"gather must be one of {sharding.GATHERS}, got "
                     f"{gather!r}")
  if gather != "updates" and layout != "sharded":
    raise ValueError(
        f"kfl.kfac(gather={gather!r}) chooses what the sharded layout "
        f"gathers; the {layout!r} layout keeps every cache on every device "
        "already: pass layout='sharded' (with axis_name) or drop gather=")
  if mesh is not None:
    if axis_name is None or axis_name not in getattr(mesh, "axis_names", ()):
      raise ValueError(
          f"kfl.kfac(mesh=...): axis_name must name one of the mesh's axes "
          f"{tuple(getattr(mesh, 'axis_names', ()))}, got {axis_name!r}")
  if layout == "sharded" and (axis_name is None
                              or isinstance(axis_name, (tuple, list))):
    raise ValueError(
        "kfl.kfac(layout='sharded') spreads the blocks over the devices of "
        f"one axis: pass axis_name= (one mesh/pmap axis), got {axis_name!r}")
  return layout


def sharded_init(layers, blocks, *, axis_name, mesh, gather):
  """Fresh block states ``{name: state}`` of ``layers`` in the sharded
  layout: this device's rows inside a map over ``axis_name``, else all rows
  placed on ``mesh``."""
  for l in layers:
    if getattr(blocks_base.as_block(l.block).one_slice, "stats_use_state",
               False):
      raise ValueError(
          f"kfl.kfac(layout='sharded'): the block of {l.name!r} "
          f"({l.block!r}) measures its statistics in its own state (EKFAC), "
          "which only its owner holds; use layout='replicated' or another "
          "block for it (blocks=)")
  inverses = ({n: blocks_base.caches(st) for n, st in blocks.items()}
              if gather == "inverses" else None)
  if estimators.axis_is_bound(axis_name):
    lay = sharding.plan(list(blocks), list(blocks.values()),
                        _sharded_step.device_count(axis_name), axis_name)
    return sharding.ShardedBlocks(_sharded_step.init_rows(lay, blocks), lay,
                                  inverses)
  if mesh is None:
    raise ValueError(
        "kfl.kfac(layout='sharded'): init needs the device count: call "
        f"tx.init inside the pmap/shard_map over {axis_name!r}, or pass mesh=")
  lay = sharding.plan(list(blocks), list(blocks.values()),
                      int(mesh.shape[axis_name]), axis_name)
  place = jax.sharding.NamedSharding(mesh,
                                     jax.sharding.PartitionSpec(axis_name))
  return sharding.ShardedBlocks(
      [jax.device_put(b, place) for b in sharding.pack_states(lay, blocks)],
      lay, inverses)


def on_mesh(run, examples, updates, state, params, batch, stats, damping,
            loss, *, mesh, axis_name):
  """``run(updates, state, params, batch=, stats=, damping=, loss=,
  replicated_stats=)`` in a ``shard_map`` over ``mesh``'s ``axis_name``:
  batch leaves split along their example axis (``examples``, a ``tagging``
  ``ExampleAxis``; leaves without one replicated), the sharded curvature by
  its rows (``sharding.specs``), per-device statistics
  (``value_grad_and_stats(mesh=)``: a leading device axis) by their rows,
  each device's own then reduced by ``run`` (the sharded layout: a
  reduce-scatter to the owners); everything else the same on every device
  (other statistics: the whole batch's, ``replicated_stats``)."""
  P = jax.sharding.PartitionSpec
  batch_specs = None
  if batch is not None:
    batch_specs = estimators.batch_specs(examples, batch, axis_name)
  state_specs = sharding.specs(state)
  replicated = lambda tree: jax.tree.map(lambda _: P(), tree)
  per_device = estimators.is_per_device(stats)
  stats_specs = (jax.tree.map(lambda _: P(axis_name), stats) if per_device
                 else replicated(stats))

  def body(updates, state, params, batch, stats, damping, loss):
    if per_device:
      stats = estimators.local_stats(stats)
    return run(updates, state, params, batch=batch, stats=stats,
               damping=damping, loss=loss, replicated_stats=not per_device)
  mapped = jax.shard_map(
      body, mesh=mesh,
      in_specs=(replicated(updates), state_specs, replicated(params),
                batch_specs, stats_specs, replicated(damping),
                replicated(loss)),
      out_specs=(replicated(updates), state_specs), check_vma=False)
  return mapped(updates, state, params, batch, stats, damping, loss)
