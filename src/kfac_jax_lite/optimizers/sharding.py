"""The sharded layout of the K-FAC state: every block kept by one device.

``kfl.kfac(..., axis_name="data", layout="sharded")`` (the default when a
``mesh`` is given) keeps each block's factors and caches on one *owner*
device instead of on every device. ``KfacState.blocks`` is then a
``ShardedBlocks``: per dtype, one buffer ``[D, L]`` over the ``D`` devices
of ``axis_name``, row ``d`` (held by device ``d`` only) the concatenation
of the leaves of the blocks ``d`` owns, padded to the longest row ``L``.
Owners are chosen by ``plan``: blocks in decreasing order of cost go to
the device with the least cost so far, a block's cost being its share of
all blocks' state bytes (``∝ n²``) plus its share of their refresh work
(``∝ n³``), so that both the bytes and the refresh work per device stay
near ``1/D`` of the total plus one block.

One update under this layout (``transform``'s ``update``; the replicated
layout's stages in ``_stages`` do the per-block work):

1. every device computes the statistics of all blocks on its own examples
   (they need its activations), packs them into ``[D, S]`` (row ``d`` the
   blocks ``d`` owns) and ``psum_scatter``-s them: each device receives the
   device mean of its own blocks' statistics (a reduce-scatter moves half
   the bytes an all-reduce does). In the one-pass style under a mesh
   (``stats=`` of ``kfl.value_grad_and_stats(..., axis_name=, mesh=)``:
   each device's statistics, a leading device axis) every device packs
   its own row of them the same way; statistics that are already the
   device mean (a ``stats=`` computed by ``jit`` over the whole batch,
   which XLA all-reduced) are only sliced, each device taking its share;
2. each device folds them into its blocks' EMAs and refreshes its blocks'
   caches (``lax.switch`` on ``axis_index``: the branch of device ``d``
   holds the work of ``d``'s blocks only);
3. ``gather="updates"`` (the default): each device preconditions the
   gradient of its own blocks (the gradient is replicated) and the
   preconditioned pieces are ``all_gather``-ed, so every device ends with
   the whole update (bytes of the parameters, not of the curvature).
   ``gather="inverses"``: after a step on which some owner refreshed, the
   owners' caches are ``all_gather``-ed into ``ShardedBlocks.inverses``,
   kept on every device, and every device preconditions every block (no
   per-step gather; all caches on every device: where memory allows). The
   KL clip and the safeguards then run on every device as in the
   replicated layout.

Results equal the replicated layout's up to the order of the device sums
(float64: ~1e-15). The state depends on ``D``: a checkpoint is written in
the replicated layout (``unshard``), which restores on any device count
(``shard_like`` puts it into another layout).
"""
from __future__ import annotations

from collections.abc import Sequence
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax_lite.blocks import base as blocks_base
from kfac_jax_lite.optimizers._state import KfacState

__all__ = ["GATHERS", "Layout", "ShardedBlocks", "bytes_per_device",
           "owners", "plan", "shard_like", "specs", "unshard",
           "unshard_blocks"]

GATHERS = ("updates", "inverses")
"""What the sharded layout gathers (``kfl.kfac(..., gather=)``): the
preconditioned gradient (the owners precondition their blocks) or the
inverses (each refresh's caches, kept on every device, which then
preconditions every block itself)."""


class Layout(NamedTuple):
  """Where every block's state lives (static: hashable, in the treedef).

  Attributes:
    axis_name: the device axis the blocks are spread over.
    devices: ``D``, its size.
    names: the layer names, in the layers' order.
    owners: the owner device of each name.
    treedefs: each block state's pytree structure.
    slots: per block, per leaf ``(dtype name, offset, shape)`` in its
      owner's row of the dtype's buffer.
    lengths: ``((dtype name, L), ...)``: the row length of each buffer.
  """

  axis_name: Any
  devices: int
  names: tuple
  owners: tuple
  treedefs: tuple
  slots: tuple
  lengths: tuple

  @property
  def owner_of(self) -> dict:
    """``{layer name: owner device}``."""
    return dict(zip(self.names, self.owners))


@jax.tree_util.register_pytree_node_class
class ShardedBlocks:
  """``KfacState.blocks`` in the sharded layout: ``buffers``, one array per
  dtype (``layout.lengths``' order) of shape ``[D, L]`` globally (under
  ``pmap``: ``[D, 1, L]``; each device's own view ``[1, L]``), and the
  static ``layout``; with ``gather="inverses"`` also ``inverses``, every
  block's caches (``{layer name: caches}``, the same on every device),
  else None. ``unshard`` turns it into the replicated layout's
  ``{layer name: block state}``."""

  def __init__(self, buffers, layout: Layout, inverses=None):
    self.buffers = tuple(buffers)
    self.layout = layout
    self.inverses = inverses

  def tree_flatten(self):
    return (self.buffers, self.inverses), self.layout

  @classmethod
  def tree_unflatten(cls, layout, children):
    return cls(children[0], layout, children[1])

  def __repr__(self):
    return (f"ShardedBlocks({len(self.layout.names)} blocks over "
            f"{self.layout.devices} devices of {self.layout.axis_name!r}"
            f"{', inverses gathered' if self.inverses is not None else ''})")


# --------------------------------------------------------------- packing
# A packing places items (blocks; their statistics; their updates), each a
# list of arrays, into per-dtype rows, one row per device: row d holds the
# items d owns, raveled and concatenated, zero-padded to the longest row.

class Packing(NamedTuple):
  owners: tuple  # per item
  slots: tuple  # per item: per leaf (dtype name, offset, shape)
  lengths: tuple  # ((dtype name, L), ...)


def packing(items: Sequence[Sequence[Any]], owners: Sequence[int]
            ) -> Packing:
  """The packing of ``items`` (each a sequence of arrays or shape-dtype
  structs) with item ``i`` on device ``owners[i]``."""
  used: dict = {}  # (device, dtype) -> length so far
  dtypes: list = []
  slots = []
  for leaves, d in zip(items, owners):
    item = []
    for x in leaves:
      name = jnp.dtype(x.dtype).name
      if name not in dtypes:
        dtypes.append(name)
      offset = used.get((d, name), 0)
      item.append((name, offset, tuple(x.shape)))
      used[(d, name)] = offset + math.prod(x.shape)
    slots.append(tuple(item))
  lengths = tuple((name, max([1] + [n for (_, t), n in used.items()
                                     if t == name]))
                  for name in sorted(dtypes))
  return Packing(tuple(owners), tuple(slots), lengths)


def pack_row(p: Packing, device: int, items: dict) -> tuple:
  """Device ``device``'s rows ``(one [L] per dtype)``: ``items`` maps item
  index to its leaves (those of other devices are ignored)."""
  rows = []
  for name, length in p.lengths:
    parts = []
    for i, (owner, slots) in enumerate(zip(p.owners, p.slots)):
      if owner != device:
        continue
      for (dt, _, shape), x in zip(slots, items[i]):
        if dt == name:
          parts.append(jnp.ravel(x).astype(name))
    size = sum(x.size for x in parts)
    parts.append(jnp.zeros((length - size,), name))
    rows.append(jnp.concatenate(parts) if len(parts) > 1 else parts[0])
  return tuple(rows)


def unpack_row(p: Packing, device: int, rows: Sequence[Any]) -> dict:
  """``{item index: leaves}`` for the items ``device`` owns, read from its
  rows (each ``[L]``, or any shape with ``L`` elements)."""
  by_name = {name: jnp.ravel(r) for (name, _), r in zip(p.lengths, rows)}
  out = {}
  for i, (owner, slots) in enumerate(zip(p.owners, p.slots)):
    if owner == device:
      out[i] = [by_name[dt][o:o + math.prod(s)].reshape(s)
                for dt, o, s in slots]
  return out


def unpack_all(p: Packing, buffers: Sequence[Any]) -> dict:
  """``{item index: leaves}`` for every item, from the ``[D, L]`` buffers."""
  out = {}
  for d in sorted(set(p.owners)):
    out.update(unpack_row(p, d, [b[d] for b in buffers]))
  return out


def pack_all(p: Packing, items: dict, devices: int) -> tuple:
  """The ``[D, L]`` buffers of all ``items`` (``{item index: leaves}``)."""
  rows = [pack_row(p, d, items) for d in range(devices)]
  return tuple(jnp.stack(r) for r in zip(*rows))


# --------------------------------------------------------------- layouts

def block_costs(states: Sequence[Any]) -> list[tuple[int, float]]:
  """``(bytes, refresh flops)`` of each block state: every leaf's bytes;
  ``n³`` per square matrix leaf (a factor's covariance ``[..., n, n]``,
  times its leading stack), the order of its refresh's decomposition."""
  costs = []
  for st in states:
    leaves = jax.tree.leaves(st)
    nbytes = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
                 for x in leaves)
    flops = 0.0
    for f in jax.tree.leaves(st, is_leaf=lambda x: hasattr(x, "cov")):
      cov = getattr(f, "cov", None)
      if cov is not None and cov.ndim >= 2 and cov.shape[-1] == cov.shape[-2]:
        flops += math.prod(cov.shape[:-2]) * float(cov.shape[-1]) ** 3
    costs.append((nbytes, flops))
  return costs


def assign_owners(costs: Sequence[tuple[int, float]], devices: int
                  ) -> tuple[int, ...]:
  """Greedy (longest processing time first): blocks by decreasing cost go
  to the device with the least cost so far (ties: the lower index); a
  block's cost is its share of the total bytes plus its share of the total
  refresh flops. Each device then holds at most ``1/D`` of the total plus
  one block."""
  total_b = sum(b for b, _ in costs) or 1
  total_f = sum(f for _, f in costs) or 1
  cost = [b / total_b + f / total_f for b, f in costs]
  load = [0.0] * devices
  owners = [0] * len(costs)
  for i in sorted(range(len(costs)), key=lambda i: (-cost[i], i)):
    d = min(range(devices), key=lambda d: (load[d], d))
    owners[i] = d
    load[d] += cost[i]
  return tuple(owners)


def plan(names: Sequence[str], states: Sequence[Any], devices: int,
         axis_name) -> Layout:
  """The layout of block ``states`` (named ``names``) over ``devices``."""
  if not (isinstance(devices, int) and devices >= 1):
    raise ValueError(f"the sharded layout needs a device count >= 1, got "
                     f"{devices!r}")
  owners = assign_owners(block_costs(states), devices)
  leaves = [jax.tree.leaves(st) for st in states]
  p = packing(leaves, owners)
  return Layout(axis_name, devices, tuple(names), owners,
                tuple(jax.tree.structure(st) for st in states), p.slots,
                p.lengths)


def _state_packing(layout: Layout) -> Packing:
  return Packing(layout.owners, layout.slots, layout.lengths)


def pack_states(layout: Layout, states: dict) -> tuple:
  """``{name: block state}`` as the ``[D, L]`` buffers of ``layout``."""
  items = {i: jax.tree.leaves(states[n]) for i, n in enumerate(layout.names)}
  return pack_all(_state_packing(layout), items, layout.devices)


def own_states(layout: Layout, device: int, rows: Sequence[Any]) -> dict:
  """``{name: block state}`` of the blocks ``device`` owns, from its rows."""
  got = unpack_row(_state_packing(layout), device, rows)
  return {layout.names[i]: jax.tree.unflatten(layout.treedefs[i], leaves)
          for i, leaves in got.items()}


def own_rows(layout: Layout, device: int, states: dict) -> tuple:
  """``device``'s rows holding ``states`` (its own blocks)."""
  index = {n: i for i, n in enumerate(layout.names)}
  items = {index[n]: jax.tree.leaves(st) for n, st in states.items()}
  return pack_row(_state_packing(layout), device, items)


# ------------------------------------------------------- user functions

def _is_sharded(x) -> bool:
  return isinstance(x, ShardedBlocks)


def unshard_blocks(blocks: ShardedBlocks) -> dict:
  """The replicated layout's ``{layer name: block state}`` of ``blocks``
  (whose buffers must be addressable here: on several processes, gather
  them first, e.g. ``jax.experimental.multihost_utils.process_allgather``)."""
  layout = blocks.layout  # (``inverses``, if any, are the owners' caches.)
  buffers = []
  for b in blocks.buffers:
    if isinstance(b, jax.Array) and not b.is_fully_addressable:
      raise ValueError(
          "kfl.sharding.unshard: the curvature buffers are spread over "
          "several processes; gather them first (jax.experimental."
          "multihost_utils.process_allgather)")
    buffers.append(jnp.reshape(jnp.asarray(b), (layout.devices, -1)))
  got = unpack_all(_state_packing(layout), buffers)
  return {layout.names[i]: jax.tree.unflatten(layout.treedefs[i], got[i])
          for i in range(len(layout.names))}


def unshard(state):
  """``state`` (any pytree holding ``kfl.kfac`` states, e.g. an optax
  chain's) with every ``ShardedBlocks`` replaced by the replicated layout's
  ``{layer name: block state}``: the one checkpoint format, which restores
  on any number of devices (``shard_like``). Other leaves are unchanged
  (under ``pmap`` they keep their device axis)."""
  return jax.tree.map(
      lambda x: unshard_blocks(x) if _is_sharded(x) else x, state,
      is_leaf=_is_sharded)


def _kfac_states(tree):
  is_state = lambda x: isinstance(x, KfacState)
  leaves, treedef = jax.tree.flatten(tree, is_leaf=is_state)
  return leaves, treedef, is_state


def shard_like(state, like):
  """``state``'s K-FAC curvature in ``like``'s layout: for each
  ``kfl.kfac`` state inside ``state`` (either layout, any device count),
  the ``blocks`` of the corresponding state of ``like`` (e.g. ``tx.init``
  of the transform that will continue the run) are replaced by ``state``'s
  block states, packed and placed as ``like``'s are. Everything else is
  taken from ``state``.

      saved = kfl.sharding.unshard(state)             # on 8 devices
      state4 = kfl.sharding.shard_like(saved, tx4.init(params))  # on 4
  """
  leaves, treedef, is_state = _kfac_states(state)
  like_leaves, like_def, _ = _kfac_states(like)
  if treedef.num_leaves != like_def.num_leaves:
    raise ValueError("kfl.sharding.shard_like: state and like have different "
                     "structures")
  mine = [x for x in leaves if is_state(x)]
  theirs = [x for x in like_leaves if is_state(x)]
  if len(mine) != len(theirs):
    raise ValueError(f"kfl.sharding.shard_like: state holds {len(mine)} "
                     f"kfl.kfac states, like {len(theirs)}")
  it = iter(theirs)
  out = []
  for x in leaves:
    if not is_state(x):
      out.append(x)
      continue
    target = next(it)
    blocks = (unshard_blocks(x.blocks) if _is_sharded(x.blocks)
              else x.blocks)
    if _is_sharded(target.blocks):
      layout = target.blocks.layout
      if set(blocks) != set(layout.names):
        raise ValueError(
            f"kfl.sharding.shard_like: the blocks {sorted(blocks)} differ "
            f"from like's {sorted(layout.names)}")
      packed = pack_states(layout, blocks)
      placed = []
      for new, old in zip(packed, target.blocks.buffers):
        new = jnp.reshape(new, old.shape).astype(old.dtype)
        sharding = getattr(old, "sharding", None)
        placed.append(jax.device_put(new, sharding) if sharding is not None
                      else new)
      inverses = None
      if target.blocks.inverses is not None:
        inverses = jax.tree.map(
            lambda new, old: jnp.reshape(new, old.shape).astype(old.dtype),
            {n: blocks_base.caches(blocks[n]) for n in layout.names},
            target.blocks.inverses)
      blocks = ShardedBlocks(placed, layout, inverses)
    out.append(x._replace(blocks=blocks))
  return jax.tree.unflatten(treedef, out)


def specs(state):
  """``jax.sharding.PartitionSpec``s for ``state`` (e.g. ``shard_map``'s
  ``in_specs``/``out_specs`` for an optax state holding ``kfl.kfac``
  states): ``P(axis_name)`` for the sharded curvature buffers, ``P()`` (the
  same on every device) for every other leaf."""
  from jax.sharding import PartitionSpec as P

  def one(x):
    if _is_sharded(x):
      return ShardedBlocks(
          [P(x.layout.axis_name)] * len(x.buffers), x.layout,
          None if x.inverses is None else jax.tree.map(lambda _: P(),
                                                       x.inverses))
    return P()
  return jax.tree.map(one, state, is_leaf=_is_sharded)


def owners(state) -> dict:
  """``{layer name: owner device}`` of the (first) sharded K-FAC state in
  ``state``; empty when it holds none."""
  found = [x for x in jax.tree.leaves(state, is_leaf=_is_sharded)
           if _is_sharded(x)]
  return found[0].layout.owner_of if found else {}


def bytes_per_device(blocks: ShardedBlocks) -> int:
  """The bytes one device holds of ``blocks``: its row of every buffer,
  and the gathered ``inverses`` when there are any."""
  rows = sum(n * np.dtype(name).itemsize for name, n in blocks.layout.lengths)
  if blocks.inverses is None:
    return rows
  return rows + sum(math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize
                    for x in jax.tree.leaves(blocks.inverses))
