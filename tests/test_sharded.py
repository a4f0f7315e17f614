"""``kfl.kfac(layout="sharded")``: each block kept by one owner device
(``kfl.sharding``), issue 27.

One worker (``tests/_sharded_worker.py``, 8 CPU devices, float64, the
ten-block MLP, 20 steps, ``inverse_every=2``) runs the sharded layout under
``pmap``, under plain ``jit`` with a ``Mesh`` of 1, 2, 4 and 8 devices,
under a user's ``shard_map(check_vma=True)``, in the one-pass style with
``cov_every=2``, and across a checkpoint (8 devices -> 4 and -> 1); the
tests compare each with one device in the replicated layout.

Tolerances: float64 rounding of 20 chained steps (``test_distributed``'s
``MULTIHOST_TOL``): the sharded layout sums the statistics over the devices
in another order than one device's mean over the batch (``psum_scatter``
instead of a mean over 32 examples) and sends a symmetric statistic as its
upper triangle, nothing else; the parameters are also held to the issue's
1e-12 (measured: ~3e-15 relative, lr 0.02).
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys

import numpy as np
import pytest

import _cpu_devices as cpu_devices
import test_distributed as td

# Minute-long multi-device workers: the slow tier (``-m slow``; CI runs it
# as a step of its own, conftest.py).
pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_sharded_worker.py")
TOL = td.MULTIHOST_TOL


# XLA:CPU ends a process whose devices do not all reach a collective within
# 40 s. Twice, in full parallel runs of the suite on 2 cores, one of the 8
# device threads did not (7 arrived), once after 300 s: a deadlock, which
# ``_cpu_devices`` explains (8 devices, 8 threads) and answers with thread
# slack and one retry. The worker's collectives still wait 120 s, so a
# device that is only slow on a loaded machine is not taken for one; a
# jaxlib without the flag refuses it ("Unknown flag"), and the worker then
# runs without it.
PATIENT = "--xla_cpu_collective_call_terminate_timeout_seconds=120"


def _run(scenario, env):
  cmd = [sys.executable, WORKER, scenario, "--devices", "8"]
  try:
    return cpu_devices.run(cmd, env, timeout=400, cwd=os.path.dirname(HERE))
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"{scenario} worker timed out; stderr:\n"
                f"{(e.stderr or b'')[-3000:]!r}")


def run_worker(scenario, patient=True):
  """``_sharded_worker.py``'s ``scenario`` on 8 CPU devices, parsed; with
  ``patient``, XLA's collectives wait up to 120 s (where the flag is
  known)."""
  env = cpu_devices.env(8)
  proc = None
  if patient:
    proc = _run(scenario, dict(env, XLA_FLAGS=f"{env['XLA_FLAGS']} {PATIENT}"))
  if proc is None or (proc.returncode and "nknown flag" in proc.stderr):
    proc = _run(scenario, env)
  if proc.returncode:
    pytest.fail(f"{scenario} worker exited with {proc.returncode}:\n"
                f"{proc.stderr[-5000:]}")
  return td._parse(proc.stdout, proc.stderr, scenario)


@functools.lru_cache(maxsize=None)
def result():
  return cpu_devices.shared_across_workers("sharded", lambda: run_worker("sharded"))


def _same(got, want, **tol):
  td.assert_trees(got, want, **(tol or TOL))


def _params_within_1e12(got, want):
  """The issue's bar: float64 parameters after 20 steps within 1e-12 of
  one device's (they are O(1); measured: ~3e-15)."""
  assert td.max_abs_diff(got, want) < 1e-12


def test_pmap_sharded_equals_one_device():
  """``pmap`` over 8 devices, ``tx.init`` inside the pmap: after 20 steps
  the parameters, every factor and every cache (``kfl.sharding.unshard``)
  equal one device's; all devices hold the same parameters; ten blocks are
  spread over all 8 devices (two own two)."""
  r = result()
  _same(r["pmap_params"], r["single_params"])
  _params_within_1e12(r["pmap_params"], r["single_params"])
  _same(r["pmap_caches"], r["single_caches"])
  assert r["pmap_spread"] == 0.0
  owners = r["owners"]
  assert len(owners) == 10 and set(owners.values()) == set(range(8))
  assert r["pmap_buffer_shapes"][0][:2] == [8, 1]


@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_jit_with_a_mesh_equals_one_device(devices):
  """Plain ``jit``, ``kfl.kfac(..., axis_name="data", mesh=mesh)`` (sharded
  by default under a mesh), batch placed ``P("data")``: the same numbers at
  every device count, and each device holds ``1/D`` of the curvature
  bytes plus at most one block (the balanced owners)."""
  r = result()[f"jit{devices}"]
  want = result()
  _same(r["params"], want["single_params"])
  _params_within_1e12(r["params"], want["single_params"])
  _same(r["caches"], want["single_caches"])
  assert r["layout"] == "ShardedBlocks"
  per_device = r["bytes_per_device"]
  assert len(per_device) == devices
  assert max(per_device.values()) <= (r["state_total"] / devices
                                      + r["largest_block"])
  if devices > 1:
    assert r["spec"] == "P('data',)"


def test_statistics_every_other_step_under_a_mesh_equal_one_device():
  """``cov_every=2`` (as a plan may choose) with ``mesh=``: the statistics'
  conditional traces inside the step's ``shard_map(check_vma=True)`` and
  the run equals one device's with the same interval."""
  r = result()["jit8_cov2"]
  _same(r["params"], r["single_params"])
  _same(r["caches"], r["single_caches"])


def test_replicated_layout_under_a_mesh_equals_one_device():
  r = result()
  _same(r["jit8_replicated"]["params"], r["single_params"])
  _same(r["jit8_replicated"]["caches"], r["single_caches"])


def test_sharded_step_reduce_scatters_statistics_and_gathers_updates():
  """The compiled 8-device step: the statistics go by reduce-scatter and
  the updates by all-gather; the only all-reduces left are scalars (the
  loss), where the replicated layout all-reduces every statistic."""
  r = result()
  sharded, replicated = r["hlo_sharded"], r["hlo_replicated"]
  assert sharded.get("reduce-scatter", 0) > 0
  assert sharded.get("all-gather", 0) > 0
  assert sharded.get("all-reduce", 0) <= 64
  assert replicated.get("all-reduce", 0) > sharded.get("reduce-scatter", 0)


@pytest.mark.parametrize("run", ["inverses_pi", "inverses_exact",
                                 "updates_exact"])
def test_gather_switch_and_exact_damping_equal_one_device(run):
  """``gather="inverses"`` (the owners' caches all-gathered after each
  refresh; every device preconditions every block) and the default
  ``gather="updates"``, in π and ``"exact"`` damping mode: the same numbers
  as one device in that mode."""
  r = result()
  mode = run.split("_")[1]
  _same(r[run]["params"], r[f"single_{mode}"]["params"])
  _same(r[run]["caches"], r[f"single_{mode}"]["caches"])


def test_gathered_inverses_move_nothing_per_step_but_the_statistics():
  """With ``gather="inverses"`` the step's own (entry) computation has no
  all-gather: the caches' all-gather sits in the conditional taken after a
  refresh. Each device then holds its row plus every block's caches."""
  r = result()
  hlo = r["hlo_inverses"]
  assert hlo.get("entry all-gather", 0) == 0
  assert hlo.get("all-gather", 0) > 0
  assert r["inverses_bytes"] > r["jit8"]["bytes_per_device"]["0"]


def test_own_shard_map_with_vma_checks_equals_one_device():
  """A user's ``shard_map`` (``check_vma=True``) with ``in_specs``/
  ``out_specs`` from ``kfl.sharding.specs(state)`` and ``init`` outside
  (``mesh=``)."""
  r = result()
  _same(r["shard_map"]["params"], r["single_params"])
  _same(r["shard_map"]["caches"], r["single_caches"])


def test_one_pass_statistics_every_other_step_equal_one_device():
  """``stats=`` from ``kfl.value_grad_and_stats`` (computed only when
  ``kfl.stats_due``), ``cov_every=2``, under ``pmap``: equal to one device
  with ``batch=`` and the same ``cov_every``."""
  r = result()["onepass"]
  _same(r["params"], r["single_params"])
  _same(r["caches"], r["single_caches"])


@pytest.mark.parametrize("where", ["restored4", "restored1"])
def test_checkpoint_from_8_devices_restores_on_4_and_on_1(where):
  """10 steps on 8 devices, ``kfl.sharding.unshard`` (the replicated
  layout: the one checkpoint format), ``kfl.sharding.shard_like`` into a
  4-device sharded state or a one-device replicated one, 10 more steps:
  the same as 20 steps on one device."""
  r = result()
  _same(r[where]["params"], r["single_params"])
  _params_within_1e12(r[where]["params"], r["single_params"])
  _same(r[where]["caches"], r["single_caches"])
  if where == "restored4":
    assert r[where]["devices"] == 4
  assert "kfac: ok" in r["health"]


def test_kfac_optimizer_in_the_sharded_layout_equals_one_device():
  """``kfl.kfac_optimizer(..., axis_name="i", layout="sharded")`` under
  ``pmap`` (its quadratic model and ρ device means, its inner ``kfl.kfac``
  sharded), 5 steps including a damping adaptation: the parameters of
  one device's run."""
  r = result()["optimizer"]
  _same(r["params"], r["single_params"], depth=5)
  _params_within_1e12(r["params"], r["single_params"])


def test_refusals_name_the_problem():
  e = result()["errors"]
  assert "sharded over 8 devices" in e["devices"] and "shard_like" in e[
      "devices"]
  assert "pass mesh=" in e["no_mesh"]
  assert "EKFAC" in e["ekfac"]
  assert "axis_name" in e["no_axis"]
  assert "gather must be one of" in e["gather"]


def test_layout_helpers_on_one_device():
  """In-process: ``plan`` balances bytes and refresh work; ``unshard`` of
  a packed state gives back every leaf; a bad layout name is refused."""
  import jax
  import jax.numpy as jnp
  import kfac_jax_lite as kfl
  from kfac_jax_lite.optimizers import sharding
  states = {f"b{i}": {"cov": jnp.full((n, n), float(i)),
                      "count": jnp.arange(3, dtype=jnp.int32) + i}
            for i, n in enumerate([8, 2, 6, 4, 3])}
  lay = sharding.plan(list(states), list(states.values()), 3, "d")
  assert lay.owner_of["b0"] != lay.owner_of["b2"]  # The two largest apart.
  blocks = sharding.ShardedBlocks(sharding.pack_states(lay, states), lay)
  back = sharding.unshard_blocks(blocks)
  for name, st in states.items():
    for a, b in zip(jax.tree.leaves(back[name]), jax.tree.leaves(st)):
      np.testing.assert_array_equal(a, b)
      assert a.dtype == b.dtype
  total = sum(x.nbytes for st in states.values() for x in jax.tree.leaves(st))
  largest = max(sum(x.nbytes for x in jax.tree.leaves(st))
                for st in states.values())
  assert sharding.bytes_per_device(blocks) <= total / 3 + largest
  with pytest.raises(ValueError, match="layout must be one of"):
    kfl.kfac(lambda p, b: jnp.sum(p), {"x": jnp.zeros((2, 1))},
             layout="scattered")


def test_mesh_refusals_on_one_device():
  """A mesh without the named axis, and ``kfac_optimizer`` under ``mesh=``
  (its quadratic model needs a bound axis), are refused by name."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import kfac_jax_lite as kfl
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  loss = lambda p, b: kfl.softmax_cross_entropy_with_integer_labels(
      b["x"] @ p, b["y"]).mean()
  batch = {"x": jnp.ones((4, 3)), "y": jnp.zeros((4,), jnp.int32)}
  with pytest.raises(ValueError, match="axis_name must name one of"):
    kfl.kfac(loss, batch, mesh=mesh, axis_name="model")
  with pytest.raises(TypeError, match="mesh"):  # Its model needs the map.
    kfl.kfac_optimizer(loss, batch, mesh=mesh, axis_name="data")
  with pytest.raises(ValueError, match="chooses what the sharded layout"):
    kfl.kfac(loss, batch, gather="inverses")
