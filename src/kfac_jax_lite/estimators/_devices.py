"""Per-device statistics: ``kfl.value_grad_and_stats(..., axis_name=,
mesh=)`` under plain ``jit`` on a batch sharded over a mesh axis.

Without a mesh, ``jit`` computes the statistics as sums over the whole
(sharded) batch, so XLA all-reduces every one of them before anything can
use them. With ``mesh`` (and the axis not bound by an enclosing ``pmap``/
``shard_map``), ``est_fn`` runs in a ``shard_map`` over ``axis_name``
instead: each of the ``D`` devices computes the loss, the gradient and the
statistics of its own examples; the loss and gradient are averaged over the
devices (``pmean``: the whole batch's, for a loss that averages over
equal shards), the statistics are **not**: every leaf of ``Estimate.stats``
gets a leading axis of size ``D`` (sharded over ``axis_name``), row ``d``
being device ``d``'s statistics, and the entry ``DEVICE_ENTRY`` says so.
Their device mean ``(1/D) Σ_d S_d`` is what ``kfl.kfac``'s ``batch=``
style and a ``pmap`` fold in; ``kfl.kfac(..., mesh=)`` reduce-scatters
them to the blocks' owners (the sharded layout: each device receives only
its own blocks' mean), any other consumer takes the mean (``device_mean``).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

DEVICE_ENTRY = "~devices"
"""The ``Estimate.stats`` entry of per-device statistics: ``[D]`` int32,
the device indices; its presence means every other leaf has a leading
axis of the ``D`` devices."""


def is_per_device(stats) -> bool:
  """Whether ``stats`` (an ``Estimate.stats``, or None) are per device."""
  return isinstance(stats, dict) and DEVICE_ENTRY in stats


def device_mean(stats):
  """``stats`` as one device's statistics: per-device ones averaged over
  their leading device axis (the entry dropped), others unchanged."""
  if not is_per_device(stats):
    return stats
  return jax.tree.map(lambda x: jnp.mean(x, axis=0).astype(x.dtype),
                      {k: v for k, v in stats.items() if k != DEVICE_ENTRY})


def local(stats, where: str = "kfl.kfac"):
  """Inside a map over the devices: this device's own rows ``[1, ...]`` of
  per-device ``stats`` as plain statistics (the entry dropped)."""
  rows = stats[DEVICE_ENTRY].shape[0]
  if rows != 1:
    raise ValueError(
        f"{where}: the per-device statistics (value_grad_and_stats(mesh=)) "
        f"are {rows} rows per device here: build the estimate with the same "
        "mesh and axis_name as the transform")
  return jax.tree.map(lambda x: x[0],
                      {k: v for k, v in stats.items() if k != DEVICE_ENTRY})


def axis_is_bound(axis_name) -> bool:
  """Whether ``axis_name`` is bound here (inside ``pmap``/``shard_map``)."""
  try:
    jax.lax.axis_index(axis_name)
  except NameError:
    return False
  return True


def batch_specs(examples, batch, axis_name):
  """``PartitionSpec``s of ``batch``: its example leaves (``examples``, a
  ``tagging.ExampleAxis``) split along their example axis over
  ``axis_name``, the other leaves replicated."""
  P = jax.sharding.PartitionSpec
  axes = {i: examples.axis_of(k) for k, i in enumerate(examples.leaves)}
  leaves, treedef = jax.tree.flatten(batch)
  return jax.tree.unflatten(treedef, [
      P(*([None] * axes[i]), axis_name) if i in axes else P()
      for i in range(len(leaves))])


def on_mesh(fn: Callable, examples, mesh, axis_name) -> Callable:
  """``value_grad_and_stats``' ``fn(params, batch, key, states, flag)``
  (an ``Estimate`` of this device's examples) run per device over
  ``mesh``'s ``axis_name`` (module docstring): the loss and gradient
  averaged, the statistics stacked ``[D, ...]`` with ``DEVICE_ENTRY``,
  ``aux`` stacked ``[D, ...]``, the weights ``c_i / D`` (those of the
  device mean) concatenated along the examples. ``key`` is folded with the
  device index (independent draws); ``flag`` a bool or a traced boolean."""
  P = jax.sharding.PartitionSpec
  split = P(axis_name)

  def run(params, batch, key, states, flag):
    static = isinstance(flag, bool)

    def body(params, batch, key, states, traced):
      flag_here = flag if static else traced
      me = jax.lax.axis_index(axis_name)
      est = fn(params, batch, jax.random.fold_in(key, me), states,
               flag_here)
      devices = jax.lax.psum(1, axis_name)
      mean = lambda t: jax.tree.map(lambda x: jax.lax.pmean(x, axis_name), t)
      row = lambda t: jax.tree.map(lambda x: jnp.asarray(x)[None], t)
      stats = dict(row(est.stats))
      stats[DEVICE_ENTRY] = jnp.reshape(me, (1,)).astype(jnp.int32)
      return est._replace(loss=mean(est.loss), aux=row(est.aux),
                          grads=mean(est.grads), stats=stats,
                          weights=est.weights / devices)

    shapes = jax.eval_shape(lambda: fn(params, batch, key, states, flag))
    rep = lambda t: jax.tree.map(lambda _: P(), t)
    out_specs = shapes._replace(
        loss=P(), aux=jax.tree.map(lambda _: split, shapes.aux),
        grads=rep(shapes.grads),
        stats=jax.tree.map(lambda _: split,
                           dict(shapes.stats, **{DEVICE_ENTRY: 0})),
        weights=split)
    mapped = jax.shard_map(
        body, mesh=mesh,
        in_specs=(rep(params), batch_specs(examples, batch, axis_name),
                  P(), rep(states), P()),
        out_specs=out_specs, check_vma=False)
    return mapped(params, batch, key, states,
                  jnp.zeros((), bool) if static else flag)
  return run


def check_mesh(mesh: Any, axis_name) -> None:
  """``value_grad_and_stats``' ``mesh``/``axis_name``: a mesh needs
  ``axis_name`` naming one of its axes."""
  if mesh is None:
    return
  if axis_name is None or axis_name not in getattr(mesh, "axis_names", ()):
    raise ValueError(
        "value_grad_and_stats(mesh=...): axis_name must name one of the "
        f"mesh's axes {tuple(getattr(mesh, 'axis_names', ()))}, got "
        f"{axis_name!r}")
