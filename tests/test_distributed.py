"""Distribution: ``kfl.kfac`` across devices and processes (issue 5).

* ``axis_name`` under ``pmap`` (and ``shard_map``): statistics are
  ``pmean``-ed over the axis, block ``i`` is refreshed on device
  ``i mod n`` only and the caches are shared with a ``psum``;
* plain ``jit`` on a batch sharded with ``NamedSharding``, no ``axis_name``;
* multi-host: two processes on loopback (``jax.distributed`` + gloo).

The main pytest process may already have initialised JAX with one CPU
device, and the device count is fixed at start-up, so every scenario runs
in a fresh interpreter (``tests/_distributed_worker.py``) with
``--xla_force_host_platform_device_count`` set; the worker prints its
numbers as JSON and the comparisons are made here. Every subprocess has a
timeout, so a hang fails the test instead of blocking the run.

Model: a 6-8-8-4 tanh MLP (three Kronecker dense blocks, kernel + bias),
batch 32 (4 examples per device on 8 devices), ``inverse_every=2`` so five
steps contain three refreshes (steps 0, 2, 4).

The equivalence tests use ``estimation="exact"``: the sampled estimators
(``"fisher"``) draw targets with the state's key, and a device holding
examples 4..7 of the batch draws different targets for them than the one
device holding all 32 does, so the two runs would differ by sampling noise,
not by any error. The exact Fisher has no sampling, so pmapped statistics
must equal the whole-batch ones up to float rounding. The sampled Fisher
is compared with one device given the same draws (``stats=``), in
float64.
"""
from __future__ import annotations

import functools
import json
import math
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import _cpu_devices as cpu_devices
from _helpers import assert_rounding_close

# Minute-long multi-device workers: the slow tier (``-m slow``; CI runs it
# as a step of its own, conftest.py).
pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_distributed_worker.py")

# float64 throughout (the worker enables x64). Averaging 8 per-device means
# (pmean) instead of one mean over the batch reorders sums of ≤ N = 32 terms
# (≤ N·ε each); every step's update then solves with the damped blocks,
# condition ≤ 1 + ‖A‖‖G‖/λ ≲ 1e4 here (λ = 1e-2; unit inputs, tanh, softmax:
# ‖A‖‖G‖ ≲ 1e2), and the steps chain: ≤ steps·N·ε·κ of each leaf's size.
N, STEPS, COND = 32, 5, 1e4
UPDATE_TOL = dict(depth=STEPS)
CACHE_TOL = UPDATE_TOL
MULTIHOST_TOL = dict(depth=20)  # 20 steps.


def _result(stdout):
  for line in reversed(stdout.splitlines()):
    if line.startswith("RESULT "):
      return json.loads(line[len("RESULT "):])
  return None


def _parse(stdout, stderr, what):
  result = _result(stdout)
  if result is not None:
    return result
  pytest.fail(f"{what}: no RESULT line.\nstdout tail:\n{stdout[-3000:]}\n"
              f"stderr tail:\n{stderr[-3000:]}")


def _command(scenario, devices, *extra):
  return [sys.executable, WORKER, "--devices", str(devices), scenario, *extra]


@functools.lru_cache(maxsize=None)
def run_worker(scenario, devices=8, timeout=150):
  """Runs one scenario in a fresh interpreter with ``devices`` CPU devices
  (once per run of the suite: ``cpu_devices.shared_across_workers``)."""
  return cpu_devices.shared_across_workers(
      f"distributed-{scenario}-{devices}",
      lambda: _run_worker(scenario, devices, timeout))


# Scenarios that compare, bit for bit, programs compiled in different
# contexts (a decomposition inside the owner's ``lax.cond`` against the same
# one unsplit): they hold under XLA's default CPU code generation, which
# the suite's cheap-compile flags replace (``conftest.py``); XLA's older
# elemental emitters round the two contexts apart in the last bit (measured:
# 18 of 81 entries of a ``pi_sqrt`` cache off by 2e-16 in float64).
DEFAULT_CODEGEN = {"split_refresh"}
_OLD_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _worker_env(scenario, devices):
  env = cpu_devices.env(devices)
  if scenario in DEFAULT_CODEGEN:
    env["XLA_FLAGS"] = " ".join(
        f for f in env["XLA_FLAGS"].split() if f != _OLD_EMITTERS)
  return env


def _run_worker(scenario, devices, timeout):
  try:
    proc = cpu_devices.run(_command(scenario, devices),
                           _worker_env(scenario, devices),
                           timeout=timeout, cwd=os.path.dirname(HERE))
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"worker {scenario!r} timed out after {timeout} s; stderr:\n"
                f"{(e.stderr or b'')[-3000:]!r}")
  if proc.returncode:
    pytest.fail(f"worker {scenario!r} exited with {proc.returncode}:\n"
                f"{proc.stderr[-5000:]}")
  return _parse(proc.stdout, proc.stderr, scenario)


def _leaves(tree):
  if isinstance(tree, dict):
    return [(f"{k}/{p}" if p else k, x) for k in sorted(tree)
            for p, x in _leaves(tree[k])]
  if isinstance(tree, list) and tree and isinstance(tree[0], dict):
    return [(f"{i}/{p}", x) for i, t in enumerate(tree) for p, x in _leaves(t)]
  return [("", np.asarray(tree))]


def assert_trees(got, want, exact=False, depth=STEPS):
  """Leaf by leaf: equal (``exact``), or within float64 rounding of ``depth``
  steps (the comment on ``UPDATE_TOL``), at each leaf's own size."""
  got, want = _leaves(got), _leaves(want)
  assert [p for p, _ in got] == [p for p, _ in want]
  for (path, a), (_, b) in zip(got, want):
    if exact:
      np.testing.assert_array_equal(a, b, err_msg=path)
    else:
      assert_rounding_close(np.asarray(a, np.float64), b, terms=N,
                            depth=depth, cond=COND, err_msg=path)


def max_abs_diff(a, b):
  return max((float(np.max(np.abs(x - y), initial=0.0))
              for (_, x), (_, y) in zip(_leaves(a), _leaves(b))), default=0.0)


# ---------------------------------------------------------------------------
# 1. pmap over 8 devices == one device on the whole batch.


def test_pmap_over_8_devices_matches_one_device_on_the_whole_batch():
  """Each of 8 devices gets 4 of the 32 examples; the step ``pmean``s the
  gradients and ``kfl.kfac(..., axis_name="i")`` the statistics. Over 5
  steps (refreshes at 0, 2, 4) every update, the final parameters and the
  final factors and caches match one device on the whole batch (tolerances
  ``UPDATE_TOL``/``CACHE_TOL``), and all 8 devices hold bit-identical
  parameters and states."""
  r = run_worker("pmap")
  assert r["devices"] == 8 and r["pmap_count"] == 5
  assert len(r["pmap_updates"]) == 5
  assert_trees(r["pmap_updates"], r["single_updates"], **UPDATE_TOL)
  assert_trees(r["pmap_params"], r["single_params"], **UPDATE_TOL)
  assert_trees(r["pmap_caches"], r["single_caches"], **CACHE_TOL)
  assert r["pmap_spread"] == 0.0
  # The run really moved the parameters (it is not comparing zeros).
  assert max(abs(x) for _, u in _leaves(r["single_updates"])
             for x in np.ravel(u)) > 1e-3


def test_pmap_with_sampled_fisher_equals_one_device_with_the_same_draws():
  """``estimation="fisher"`` under pmap, float64: device k draws the
  targets of its 4 examples with ``fold_in(stats_key, k)``. One device
  given (``stats=``) the mean over k of ``kfl.value_grad_and_stats`` on the
  same examples with the same keys, its state's key advancing as the
  pmapped one does, makes the same 5 steps: same updates, parameters,
  factors and caches. A device sampling with another key (or all with
  the same) would differ by sampling noise, ~1e-1 relative."""
  r = run_worker("pmap")
  assert r["fisher64_dtype"] == "float64"
  assert r["fisher64_bad"] == [0, 0] and r["fisher64_spread"] == 0.0
  # float64: pmean reorders the statistics' sums, which five steps of
  # damped inverses grow (``UPDATE_TOL``).
  assert_trees(r["fisher64_updates"], r["fisher64_single_updates"])
  assert_trees(r["fisher64_params"], r["fisher64_single_params"])
  assert_trees(r["fisher64_caches"], r["fisher64_single_caches"])
  assert max(abs(x) for _, u in _leaves(r["fisher64_single_updates"])
             for x in np.ravel(u)) > 1e-3  # Not comparing zeros.


def test_shard_map_matches_one_device():
  """The same per-device step under ``jax.shard_map`` (Mesh of 8, batch
  ``P("data")``, ``axis_name="data"``), run with ``check_vma=False``."""
  r = run_worker("shard_map")
  assert_trees(r["shard_map_updates"], r["single_updates"], **UPDATE_TOL)
  assert_trees(r["shard_map_caches"], r["single_caches"], **CACHE_TOL)


def test_shard_map_with_vma_checks_matches_one_device():
  """The default ``check_vma=True``: traces, runs, and gives the same
  updates and caches as one device on the whole batch. (The tagged loss
  is traced with the batch's varying mesh axes, so the ``pvary`` casts
  JAX inserts are in the jaxpr it replays, and its probes vary like the
  outputs they are added to.) The step takes the gradient at params cast
  to device-varying: ``jax.grad`` at the replicated ones is already summed
  over the devices under ``check_vma=True``."""
  r = run_worker("shard_map")
  assert r["vma_error"] is None, r["vma_error"]
  assert_trees(r["vma_updates"], r["single_updates"], **UPDATE_TOL)
  assert_trees(r["vma_caches"], r["single_caches"], **CACHE_TOL)


def test_one_pass_statistics_under_shard_map_with_vma_checks():
  """``kfl.value_grad_and_stats`` (exact estimation) inside
  ``shard_map(check_vma=True)`` on a model with a fallback block
  (``temp``, used through ``exp``): the device mean of the loss and of
  every block's statistics equals one device on the whole batch. The
  fallback's statistics need each device's own per-example parameter
  gradients (not their sum over the devices, which ``jax.vjp`` at the
  replicated params would give); ``est.grads`` is ``jax.grad``'s under
  ``check_vma=True``, the sum over the 8 devices of their gradients."""
  r = run_worker("shard_map")
  assert r["vma_error"] is None, r["vma_error"]
  assert r["vgs_error"] is None, r["vgs_error"]
  assert r["vgs_fallbacks"] == ["temp"]
  # A mean over N examples of the MLP's losses (≤ 6 chained reductions).
  assert_rounding_close(np.asarray(r["vgs_loss"]), r["vgs_single_loss"],
                        terms=N, depth=6)
  assert_trees(r["vgs_stats"], r["vgs_single_stats"], **UPDATE_TOL)
  eight = {k: {p: 8 * np.asarray(x) for p, x in v.items()} if isinstance(
      v, dict) else 8 * np.asarray(v) for k, v in r["vgs_single_grads"].items()}
  assert_trees(r["vgs_grads"], eight, **UPDATE_TOL)


def test_kfac_optimizer_under_shard_map_with_vma_checks_matches_one_device():
  """``kfl.kfac_optimizer(..., axis_name="data")`` under
  ``shard_map(check_vma=True)``, 5 steps (the 5th adapts the damping):
  its quadratic model and the losses of its reduction ratio are device
  means, so every step, the damping and ρ equal one device on the whole
  batch (without the means each device would choose its own α, μ and λ,
  which ``check_vma`` refuses to return as replicated)."""
  r = run_worker("shard_map")
  assert r["vma_error"] is None, r["vma_error"]
  assert r["opt_error"] is None, r["opt_error"]
  assert_trees(r["opt_updates"], r["opt_single_updates"], **UPDATE_TOL)
  assert_rounding_close(np.asarray(r["opt_damping"]), r["opt_single_damping"],
                        terms=N, depth=STEPS, cond=COND)
  # The damping really adapted (step 5) from its initial 0.1.
  assert r["opt_single_damping"][0] != 0.1


# ---------------------------------------------------------------------------
# 2. The split refresh computes exactly what the unsplit one does.


@pytest.mark.parametrize("config", ["pi", "pi_sqrt"])
def test_split_refresh_gives_the_same_caches_as_the_unsplit_one(config):
  """From one and the same state, one refresh-only step (no statistics
  update) split over 8 devices (``lax.cond`` on the owner, ``psum`` of the
  caches) and unsplit on one device give bit-identical caches and updates:
  each cache comes from one device's decomposition plus zeros from the
  others, which is exact in floating point. ``"pi"`` caches the damped
  inverse (``matpower``); ``"pi_sqrt"`` (``precon_power=-0.5``) the damped
  matrix power (``matpower``). The refresh uses another damping than the
  training did, so every cache really changes."""
  r = run_worker("split_refresh")[config]
  assert_trees(r["split"], r["single"], exact=True)
  assert_trees(r["split_updates"], r["single_updates"], exact=True)
  assert r["spread"] == 0.0
  fields = {"pi": ("matpower",), "pi_sqrt": ("matpower",)}[config]
  for name, after in r["single"].items():
    field = name.rsplit("/", 1)[1]
    before = np.asarray(r["before"][name])
    if field == "step":
      assert after == 6, name
    elif field in fields:
      assert np.max(np.abs(np.asarray(after) - before)) > 1e-3, name
    elif field in ("cov", "weight"):  # A refresh-only step.
      np.testing.assert_array_equal(after, before, err_msg=name)


# ---------------------------------------------------------------------------
# 3. Each device refreshes only its share of the blocks.


def _per_device(calls):
  out = {}
  for device, name, step in calls:
    out.setdefault(step, {}).setdefault(device, []).append(name)
  return out


@pytest.mark.parametrize("model", ["three", "ten"])
def test_each_device_refreshes_only_its_own_blocks(model):
  """Counted at run time. Every dense block is wrapped (a ``blocks=``
  override) so that its ``refresh`` first calls ``jax.debug.callback`` with
  the device's ``axis_index`` and the step. The callback sits inside the
  block's refresh, i.e. in the same branch of the owner ``lax.cond`` as the
  decompositions, so it fires on a device exactly when that device executes
  the block's decompositions (a branch with a host callback has a side
  effect, so XLA can neither drop nor speculate it). Inspecting HLO would
  not show this: under SPMD every device runs the same program, which
  contains every block's decomposition; only the runtime branch differs.

  With B blocks on 8 devices each refresh step runs every block exactly
  once, block i on device i mod 8, so no device runs more than
  ceil(B / 8) refreshes per refresh step; nothing runs on other steps.
  Unsplit (no ``axis_name``) the one device runs all B every time."""
  r = run_worker("count")
  assert r["devices"] == 8
  r = r[model]
  layers, steps = r["layers"], r["steps"]
  blocks = len(layers)
  assert blocks == {"three": 3, "ten": 10}[model]
  # inverse_every=2: steps 0, 2, 4, ... and the young refresh at step 1.
  refresh_steps = sorted({0, 1} | set(range(0, steps, 2)))
  per_step = _per_device(r["pmap_calls"])
  assert sorted(per_step) == refresh_steps
  for step, by_device in per_step.items():
    assert sorted(n for names in by_device.values() for n in names) == sorted(
        layers), step
    assert max(map(len, by_device.values())) <= math.ceil(blocks / 8)
    for device, names in by_device.items():
      assert all(layers.index(n) % 8 == device for n in names), (step, device)
  if "single_calls" in r:
    single = _per_device(r["single_calls"])
    assert sorted(single) == refresh_steps
    assert all(sorted(d[0]) == sorted(layers) for d in single.values())


# ---------------------------------------------------------------------------
# 4. jit with a sharded batch, no axis_name.


def test_jit_with_a_batch_sharded_over_8_devices_matches_unsharded():
  """The single-device ``jit`` step, unchanged and without ``axis_name``,
  fed a batch placed with ``NamedSharding(Mesh(8 devices, "data"),
  P("data"))`` (4 examples per device) and replicated params/state: GSPMD
  partitions it and the updates, parameters and caches match the unsharded
  run (``UPDATE_TOL``/``CACHE_TOL``)."""
  r = run_worker("jit_sharded")
  assert r["batch_devices"] == 8 and r["shard_shape"] == [4, 6]
  assert_trees(r["sharded_updates"], r["single_updates"], **UPDATE_TOL)
  assert_trees(r["sharded_params"], r["single_params"], **UPDATE_TOL)
  assert_trees(r["sharded_caches"], r["single_caches"], **CACHE_TOL)


# ---------------------------------------------------------------------------
# 5. Multi-host on loopback.


def _free_port():
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_processes(commands, envs, timeout):
  procs = [subprocess.Popen(c, env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(HERE))
           for c, e in zip(commands, envs)]
  deadline = time.monotonic() + timeout
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
  except subprocess.TimeoutExpired:
    for p in procs:
      if p.poll() is None:
        p.kill()
    for p in procs:
      p.communicate()
    pytest.fail(f"multi-host processes did not finish within {timeout} s")
  return [(p.returncode, o, e) for p, (o, e) in zip(procs, outs)]


@pytest.mark.multihost
def test_two_processes_on_loopback_train_like_one_process():
  """2 processes x 2 CPU devices, ``jax.distributed.initialize`` on
  127.0.0.1 with gloo CPU collectives; ``pmap`` over the 4 global devices
  (``axis_name="i"``), each process feeding its 2 devices their quarter of
  the batch each; 20 steps (10 refreshes). Both processes end with
  bit-identical parameters, equal (``MULTIHOST_TOL``) to one process with
  4 devices, and each process refreshed only the blocks its global devices
  own (3 blocks: devices 0, 1 on process 0, device 2 on process 1)."""
  n_procs, steps = 2, 20
  ref_cmd = _command("reference4", 4)
  for attempt in range(2):
    port = _free_port()
    commands = [_command("multihost", 2, "--port", str(port), "--process-id",
                         str(i), "--num-processes", str(n_procs))
                for i in range(n_procs)]
    results = _run_processes(commands + [ref_cmd],
                             [cpu_devices.env(2)] * n_procs + [cpu_devices.env(4)], timeout=150)
    in_use = any("address already in use" in e.lower()
                 for rc, _, e in results[:n_procs] if rc)
    if not in_use:
      break
  for _, out, _ in results[:n_procs]:
    result = _result(out)
    if result and "skip" in result:  # No gloo here: not a failure.
      pytest.skip(result["skip"])
  parsed = []
  for i, (rc, out, err) in enumerate(results):
    if rc:
      pytest.fail(f"process {i} exited with {rc}:\n{err[-5000:]}")
    parsed.append(_parse(out, err, f"process {i}"))
  *hosts, ref = parsed
  assert ref["devices"] == 4 and ref["count"] == steps and ref["spread"] == 0
  for i, h in enumerate(hosts):
    assert (h["process_index"], h["process_count"]) == (i, n_procs)
    assert (h["local_devices"], h["global_devices"]) == (2, 4)
    assert h["count"] == steps and h["spread"] == 0.0
  between = max_abs_diff(hosts[0]["params"], hosts[1]["params"])
  vs_ref = max_abs_diff(hosts[0]["params"], ref["params"])
  print(f"multi-host: max |process 0 - process 1| = {between:.3g}, "
        f"max |multi-host - 4-device single process| = {vs_ref:.3g}")
  assert_trees(hosts[1]["params"], hosts[0]["params"], exact=True)
  assert_trees(hosts[0]["params"], ref["params"], **MULTIHOST_TOL)
  # The 4-device run itself equals one device on the whole batch.
  assert_trees(ref["params"], ref["single_device_params"], **MULTIHOST_TOL)
  # Block i refreshed on global device i mod 4 only, once per refresh step.
  owners = {(d, name) for h in hosts for d, name, _ in h["calls"]}
  assert owners == {(0, "dense0/w"), (1, "dense1/w"), (2, "dense2/w")}
  for h in hosts:
    assert len(h["calls"]) == len({(d, n) for d, n, _ in h["calls"]}) * (
        steps // 2 + 1)  # Every 2 steps, and the young refresh at step 1.
  assert {d for d, _, _ in hosts[0]["calls"]} == {0, 1}
  assert {d for d, _, _ in hosts[1]["calls"]} == {2}
  # The same run in the sharded layout (issue 27): each block kept by one
  # of the 4 global devices; parameters and (gathered from both processes)
  # every factor and cache equal one device's.
  for h in hosts:
    assert_trees(h["sharded_params"], ref["single_device_params"],
                 **MULTIHOST_TOL)
    assert_trees(h["sharded_caches"], ref["single_device_caches"],
                 **MULTIHOST_TOL)
  assert sorted(hosts[0]["sharded_owners"].values()) == [0, 1, 2]
