"""Subprocesses with several XLA:CPU devices, for the tests that need them.

The device count is fixed when JAX starts, so tests of ``pmap``, meshes
and ``layout="sharded"`` run their scenarios in fresh interpreters with
``--xla_force_host_platform_device_count``.

**Thread slack.** XLA:CPU's client runs each device's part of a program on
one thread pool of ``max(NPROC or cores, devices)`` threads, and a
collective holds a thread per device until every device has reached it
(``GetPjRtCpuClient``: "Need at least CpuDeviceCount threads to launch one
collective"). On a 2-core machine 8 devices therefore get exactly 8 threads:
anything else that holds one of them while a collective gathers leaves one
device without a thread, and XLA ends the process when its rendezvous times
out. It happened twice in full parallel runs of the suite on 2 cores, 7 of
8 devices arrived at an all-reduce: once after XLA's 40 s, once after 300 s
(CI, 2026-11-28), so a deadlock, not slowness. ``env`` gives the pool twice
as many threads as devices (XLA reads ``NPROC`` for its pool size; measured:
8 -> 16 threads, the 8-device sharded worker's run time unchanged at
113-114 s on 2 cores).

**One retry.** That the slack removes the deadlock is the best explanation,
not a proof: neither failure could be reproduced here (two 8-device
stress loops, 400 000 collective steps between them). So ``run`` runs a
scenario again, once, when and only when XLA ended it for a rendezvous
timeout, and warns (``XlaRendezvousTimeout``) so the event shows in the
test summary. Any other failure, and a second timeout, fail the test.
"""
from __future__ import annotations

import fcntl
import glob
import json
import os
import subprocess
import tempfile
import warnings

TESTS = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(TESTS), "src")
RENDEZVOUS_TIMEOUT = "threads to join the rendezvous"


class XlaRendezvousTimeout(UserWarning):
  """XLA:CPU ended a scenario: not every device reached a collective."""


def env(devices: int, base: dict | None = None) -> dict:
  """``base`` (default ``os.environ``) for an interpreter with ``devices``
  CPU devices, JAX on the CPU, ``src/`` and ``tests/`` importable, and
  XLA's client pool at least ``2·devices`` threads (``NPROC``)."""
  out = dict(os.environ if base is None else base)
  flags = [f for f in out.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  out["XLA_FLAGS"] = " ".join(
      flags + [f"--xla_force_host_platform_device_count={devices}"])
  out["JAX_PLATFORMS"] = "cpu"
  out["PYTHONPATH"] = os.pathsep.join(
      [SRC, TESTS]
      + [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p])
  nproc = out.get("NPROC", "")
  if not (nproc.isdigit() and int(nproc) >= 2 * devices):
    out["NPROC"] = str(max(2 * devices, os.cpu_count() or 1))
  return out


def run(cmd: list[str], environ: dict, timeout: float,
        cwd: str | None = None) -> subprocess.CompletedProcess:
  """``subprocess.run(cmd)``, captured as text, run once more if XLA ended
  it for a rendezvous timeout (see the module's docstring). Raises
  ``subprocess.TimeoutExpired`` as ``subprocess.run`` does."""
  proc = subprocess.run(cmd, env=environ, capture_output=True, text=True,
                        timeout=timeout, cwd=cwd)
  if proc.returncode and RENDEZVOUS_TIMEOUT in proc.stderr:
    first = [l for l in proc.stderr.splitlines() if RENDEZVOUS_TIMEOUT in l]
    warnings.warn(XlaRendezvousTimeout(
        f"{os.path.basename(cmd[1]) if len(cmd) > 1 else cmd[0]}: XLA:CPU "
        f"ended the run (exit {proc.returncode}), a collective's rendezvous "
        f"timed out; ran it again. {first[0][-300:]}"))
    proc = subprocess.run(cmd, env=environ, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)
  return proc


def _shared_path(run, scenario):
  return os.path.join(tempfile.gettempdir(), f"kfl-{run}-{scenario}.json")


def remove_shared(run):
  """Removes run ``run``'s shared results and their locks (the xdist
  controller calls it when the run ends)."""
  for name in glob.glob(_shared_path(glob.escape(run), "*") + "*"):
    try:
      os.remove(name)
    except FileNotFoundError:
      pass


def shared_across_workers(scenario, compute):
  """``compute()`` (a JSON-able result) once per run of the suite: xdist
  hands a file's tests to both of its workers, and an ``lru_cache`` lives
  in one process, so each worker ran the minutes-long subprocess itself.
  The first worker to ask runs it and writes the result; the other waits
  on the lock and reads it. A failure writes nothing (the next asker
  runs it again)."""
  run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
  if run is None:  # Not under xdist: one process.
    return compute()
  path = _shared_path(run, scenario)
  with open(path + ".lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if os.path.exists(path):
      with open(path) as f:
        return json.load(f)
    out = compute()
    with open(path + ".tmp", "w") as f:
      json.dump(out, f)
    os.replace(path + ".tmp", path)
    return out
