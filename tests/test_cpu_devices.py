"""``tests/_cpu_devices``: the multi-device subprocesses' thread slack and
their one retry (see that module's docstring for why)."""
import os
import sys

import pytest

import _cpu_devices as cpu_devices

_THREADS = """
import collections, os
import jax, jax.numpy as jnp
jax.pmap(lambda v: jax.lax.psum(v, "i"), axis_name="i")(
    jnp.ones(jax.local_device_count())).block_until_ready()
names = collections.Counter(
    open(f"/proc/self/task/{t}/comm").read().strip()
    for t in os.listdir("/proc/self/task"))
print("DEVICES", jax.local_device_count(), "EIGEN", names["tf_XLAEigen"])
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"),
                    reason="thread names are read from /proc")
def test_env_gives_xla_twice_as_many_threads_as_devices():
  """XLA reads ``NPROC`` for its CPU client's pools: with ``env(8)`` the
  intra-op pool has at least 16 threads, whatever the machine's cores (on
  2 cores it has 8 without it). Fails if a jaxlib stops reading it."""
  environ = cpu_devices.env(8)
  assert int(environ["NPROC"]) >= 16
  proc = cpu_devices.run([sys.executable, "-c", _THREADS], environ,
                         timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("DEVICES")][-1]
  _, devices, _, eigen = line.split()
  assert int(devices) == 8
  assert int(eigen) >= 16


def _script(tmp_path, first_stderr, first_rc):
  """A command that fails the first time (``first_stderr``, exit
  ``first_rc``) and succeeds after, counting its runs in a file."""
  count = tmp_path / "runs"
  code = (f"import pathlib, sys\n"
          f"p = pathlib.Path({str(count)!r})\n"
          f"n = int(p.read_text()) if p.exists() else 0\n"
          f"p.write_text(str(n + 1))\n"
          f"if n == 0:\n"
          f"  sys.stderr.write({first_stderr!r})\n"
          f"  sys.exit({first_rc})\n"
          f"print('RESULT ok')\n")
  return [sys.executable, "-c", code], count


def test_run_retries_once_after_a_rendezvous_timeout_and_warns(tmp_path):
  message = ("F1128 rendezvous.cc:161] [id=2] Termination timeout for `all "
             "reduce` of 300 seconds exceeded. Expected 8 threads to join "
             "the rendezvous, but only 7 of them arrived on time.\n")
  cmd, count = _script(tmp_path, message, 134)
  with pytest.warns(cpu_devices.XlaRendezvousTimeout, match="ran it again"):
    proc = cpu_devices.run(cmd, dict(os.environ), timeout=60)
  assert proc.returncode == 0 and "RESULT ok" in proc.stdout
  assert count.read_text() == "2"


def test_run_does_not_retry_other_failures(tmp_path):
  cmd, count = _script(tmp_path, "Traceback: AssertionError\n", 1)
  proc = cpu_devices.run(cmd, dict(os.environ), timeout=60)
  assert proc.returncode == 1 and "AssertionError" in proc.stderr
  assert count.read_text() == "1"


def test_run_retries_only_once(tmp_path):
  """A second rendezvous timeout is returned as the failure it is."""
  message = "Expected 8 threads to join the rendezvous, but only 7 arrived\n"
  code = (f"import sys\nsys.stderr.write({message!r})\nsys.exit(134)\n")
  with pytest.warns(cpu_devices.XlaRendezvousTimeout):
    proc = cpu_devices.run([sys.executable, "-c", code], dict(os.environ),
                           timeout=60)
  assert proc.returncode == 134
