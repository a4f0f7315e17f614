"""The one-pass style under plain ``jit`` with a mesh (issue 36):
``kfl.value_grad_and_stats(..., axis_name="data", mesh=mesh)`` returns each
device's statistics un-reduced (a leading device axis), and
``kfl.kfac(..., mesh=mesh)`` reduce-scatters them to the blocks' owners
instead of XLA all-reducing them before the transform sees them.

One worker (``tests/_sharded_worker.py onepass``: 8 CPU devices, float64,
the ten-block MLP, batch 32, 6 steps, ``cov_every=2`` with
``with_stats=kfl.stats_due(state)``, exact statistics) runs the one-pass
style into the sharded layout, the replicated layout and a transform
without a mesh, and compares each with one device's ``batch=`` style and
with the sharded ``batch=`` style on the mesh. Tolerances: float64
rounding of the chained steps (``test_sharded``'s), the device sums being
taken in another order.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

import test_distributed as td
import _cpu_devices as cpu_devices
import test_sharded

# Minute-long multi-device workers: the slow tier (``-m slow``; CI runs it
# as a step of its own, conftest.py).
pytestmark = pytest.mark.slow

STEPS = 6
TOL = dict(depth=STEPS)
F64 = 8  # bytes
# The scalars a step all-reduces besides the gradient (the loss, the
# targets' check, the health counters): a few float64 at most.
SCALARS = 8 * F64


@functools.lru_cache(maxsize=None)
def result():
  return cpu_devices.shared_across_workers(
      "onepass", lambda: test_sharded.run_worker("onepass", patient=False))


def test_estimate_per_device_has_the_whole_batch_mean():
  """The estimate on the mesh: every statistic has a leading axis of the 8
  devices, sharded over "data"; its device mean equals the plain estimate's
  statistics on the whole batch (a mean loss over equal shards), and the
  loss, gradient and weights ``c_i`` equal the plain ones."""
  e = result()["estimate"]
  assert e["rows"] == [8] and e["devices"] == list(range(8))
  assert e["spec"] == "P('data',)"
  assert abs(e["loss"][0] - e["loss"][1]) < 1e-14
  for name in ("grads", "stats", "weights"):
    got, want = (_arrays(t) for t in e[name])
    assert len(got) == len(want)
    for a, b in zip(got, want):
      td.assert_rounding_close(a, b, terms=td.N, depth=1, cond=td.COND,
                               err_msg=name)


def _arrays(tree):
  """The arrays of a JSON tree (dicts, and lists that are not one array)."""
  if isinstance(tree, dict):
    return [x for k in sorted(tree) for x in _arrays(tree[k])]
  try:
    return [np.asarray(tree, np.float64)]
  except ValueError:  # A list of arrays of different shapes.
    return [x for t in tree for x in _arrays(t)]


@pytest.mark.parametrize("consumer", ["sharded", "replicated", "no_mesh"])
def test_one_pass_on_a_mesh_equals_the_batch_style(consumer):
  """After 6 steps (statistics on every other), the parameters and every
  cache equal one device's ``batch=`` style and the sharded ``batch=``
  style on the mesh: into the sharded layout (reduce-scattered), the
  replicated layout under the mesh (all-reduced) and a transform without
  a mesh (their device mean under GSPMD)."""
  r = result()
  td.assert_trees(r[consumer]["params"], r["single"]["params"], **TOL)
  td.assert_trees(r[consumer]["caches"], r["single"]["caches"], **TOL)
  td.assert_trees(r[consumer]["params"], r["batch"]["params"], **TOL)
  assert td.max_abs_diff(r[consumer]["params"], r["batch"]["params"]) < 1e-12


def _all_reduced(summary):
  row = summary["all-reduce"]
  return row["every"] + row["cond"]


def test_statistics_reach_their_owners_by_reduce_scatter():
  """The compiled one-pass step (the sharded layout, estimator on the
  mesh) all-reduces the gradient and a few scalars only, and
  reduce-scatters the statistics: the scatter's input (8 x its per-device
  output) holds every statistic's upper triangle. Control: with the
  estimator unaware of the mesh (before issue 36) the same count sees the
  statistics all-reduced."""
  r = result()
  grads, stats = r["grad_bytes"], r["stats_bytes"]
  mesh, plain = r["hlo_mesh"], r["hlo_plain"]
  assert _all_reduced(mesh) <= grads + SCALARS, mesh
  scattered = mesh["reduce-scatter"]["every"] + mesh["reduce-scatter"]["cond"]
  # Ten blocks of A [5, 5] and G [4, 4], as triangles: 10 * (15 + 10).
  triangles = 10 * (15 + 10) * F64
  assert stats == 10 * (25 + 16) * F64
  assert 8 * scattered >= triangles
  assert _all_reduced(plain) > grads + SCALARS, plain
  assert plain["reduce-scatter"]["every"] + plain["reduce-scatter"][
      "cond"] == 0


def test_statistics_summed_before_a_sharded_layout_are_reported():
  """Not silent: statistics of an estimator unaware of the mesh, given to
  the sharded layout on a mesh, warn (once per trace) and name the fix;
  per-device statistics, and the replicated layout (which needs the sum),
  do not."""
  caught = {name: [m for m in messages if "summed over the devices" in m]
            for name, messages in result()["warnings"].items()}
  assert caught["plain"], caught  # One per trace (the step traces twice).
  assert all("value_grad_and_stats(..., axis_name='data', mesh=mesh)" in m
             for m in caught["plain"])
  assert not caught["sharded"] + caught["replicated"] + caught["no_mesh"]


def test_mesh_needs_one_of_its_axes():
  import jax
  import kfac_jax_lite as kfl
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  loss = lambda p, b: kfl.softmax_cross_entropy_with_integer_labels(
      b["x"] @ p, b["y"]).mean()
  params = np.zeros((3, 2), np.float32)
  batch = {"x": np.ones((4, 3), np.float32), "y": np.zeros((4,), np.int32)}
  with pytest.raises(ValueError, match="axis_name must name one"):
    kfl.value_grad_and_stats(loss, params, batch, mesh=mesh, axis_name="i")
