"""pytest configuration.

* Puts ``tests/`` on ``sys.path`` so that test files can import the shared
  helpers (``import _helpers``, ``import _brute``).
* Compiles with XLA's cheap CPU back-end settings (``XLA_FLAGS``, set here
  before JAX is imported, and inherited by the notebook kernels and the
  multi-process workers the tests start): the suite's time is mostly XLA
  compiling many small programs once each (a cold run compiles ~12,000,
  ~10,000 of them single eager operations). LLVM's optimisation level 0
  (measured on 2 cores: 81 s -> 52-57 s for ``test_onepass.py`` +
  ``test_tagging_state.py``) and XLA's older elemental emitters instead of
  its fusion emitters (``--xla_cpu_use_fusion_emitters=false``: an eager
  operation's compile 25 -> 13 ms, a small K-FAC step's 2.1 -> 1.1 s; the
  five slowest test files, cold, 340 -> 191 s). Code compiled this way
  runs slower (a conv net's training scan 5x), so the few tests whose time
  is running long scans compile them with XLA's defaults (full
  optimisation, fusion emitters) with ``_helpers.optimized_jit``. The
  library itself sets no flags: users get XLA's defaults (at the
  autoencoder's size the older emitters compile no faster and run the
  K-FAC step 1.4x slower).
* Keeps the compiled programs in JAX's persistent compilation cache
  (``.pytest_cache/jax-compilation-cache``; a ``JAX_COMPILATION_CACHE_DIR``
  of your own wins), for the notebook kernels and the workers too. Its key
  is the program, the XLA flags and the versions, so a change to the
  library recompiles what it changed and nothing else. Measured on 2
  cores (``test_loss_recognition.py`` + ``test_first_step.py``, ``-n 2``):
  138 s without it, 126 s filling it (the two workers share programs),
  49 s from a filled one. Past 2 GiB the oldest entries go at the start of
  a run. The processes share it without a lock: a reader that meets an
  entry still being written fails to decompress it, and JAX then warns
  and compiles (``jax._src.compiler._cache_read``).
* The slow tier: tests marked ``slow`` (the multi-device and multi-process
  workers, the benchmark scripts' runs, the notebooks' runs, the
  convergence runs: each a minute or more of compiling) run only when
  asked for: ``python -m pytest -n 2 -q -m slow`` (CI runs it as a step
  of its own after the README's command); any ``-m`` expression, or
  naming tests by their node ids, chooses for itself.
"""
import os
import sys
import uuid

_CHEAP_COMPILE = ("--xla_backend_optimization_level=0",
                  "--xla_llvm_disable_expensive_passes=true",
                  "--xla_cpu_use_fusion_emitters=false")
_flags = os.environ.get("XLA_FLAGS", "").split()
_flags += [f for f in _CHEAP_COMPILE
           if not any(g.startswith(f.split("=")[0] + "=") for g in _flags)]
os.environ["XLA_FLAGS"] = " ".join(_flags)

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_JAX_CACHE = os.path.join(_ROOT, ".pytest_cache", "jax-compilation-cache")
_JAX_CACHE_BYTES = 2 << 30
for _name, _value in (("JAX_COMPILATION_CACHE_DIR", _JAX_CACHE),
                      ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0"),
                      ("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")):
  os.environ.setdefault(_name, _value)


def _trim_jax_cache(path, limit):
  """When the compilation cache at ``path`` holds more than ``limit``
  bytes, deletes its oldest entries down to ``limit / 2``. Once a run,
  before the workers start; JAX's own bound
  (``jax_compilation_cache_max_size``) would rescan every entry at each
  write, quadratic in the suite's thousands of programs."""
  try:
    entries = [(e.stat().st_mtime, e.stat().st_size, e.path)
               for e in os.scandir(path) if e.is_file()]
  except FileNotFoundError:
    return
  total = sum(size for _, size, _ in entries)
  if total <= limit:
    return
  for _, size, name in sorted(entries):
    if total <= limit // 2:
      break
    os.remove(name)
    total -= size


sys.path.insert(0, os.path.dirname(__file__))


# --- tolerance margins (``--tolerance-report=FILE``) -------------------------
#
# ``python -m pytest --tolerance-report=margins.jsonl`` records, for every
# ``np.testing.assert_allclose`` the suite makes, how much of its tolerance
# the comparison used: ``max |actual − desired| / (atol + rtol·|desired|)``
# (1 fails), with the call site and the compared dtypes. A float32 comparison
# that uses a large share on one CPU is the one that fails on another, whose
# XLA picks other kernels and summation orders; ``tests/other_cpus.sh`` runs
# the suite the way such a CPU would compute.

def pytest_addoption(parser):
  parser.addoption("--tolerance-report", default=None, metavar="FILE",
                   help="append every assert_allclose's used share of its "
                        "tolerance to FILE (JSON lines)")


def pytest_configure(config):
  controller = not hasattr(config, "workerinput")  # Or no xdist.
  if controller and os.environ["JAX_COMPILATION_CACHE_DIR"] == _JAX_CACHE:
    _trim_jax_cache(_JAX_CACHE, _JAX_CACHE_BYTES)
  if controller and getattr(config.option, "testrunuid", "absent") is None:
    # xdist's controller: the run's id chosen here (xdist would choose one
    # of its own) so that pytest_unconfigure can remove the results its
    # workers shared (``_cpu_devices.shared_across_workers``).
    config.option.testrunuid = uuid.uuid4().hex
  report = config.getoption("--tolerance-report")
  if report:
    _record_margins(os.path.abspath(report))


def pytest_unconfigure(config):
  run = getattr(config.option, "testrunuid", None)
  if not hasattr(config, "workerinput") and run:
    import _cpu_devices
    _cpu_devices.remove_shared(run)


SLOW_COMMAND = "python -m pytest -n 2 -q -m slow"


def _slow_tier_left_out(config):
  """Whether this run leaves the ``slow`` tests out: no ``-m`` given and
  not every argument a node id (``file::test``)."""
  named = config.args and all("::" in a for a in config.args)
  return not config.option.markexpr and not named


def pytest_collection_modifyitems(config, items):
  if not _slow_tier_left_out(config):
    return
  slow = [i for i in items if i.get_closest_marker("slow")]
  if slow:
    config.hook.pytest_deselected(items=slow)
    items[:] = [i for i in items if not i.get_closest_marker("slow")]


def pytest_terminal_summary(terminalreporter, config):
  if _slow_tier_left_out(config):
    terminalreporter.write_line(
        f"The slow tier (tests marked slow) was left out: `{SLOW_COMMAND}` "
        "runs it (CI does, after this command).")


def _record_margins(path):
  import inspect
  import json

  import numpy as np
  original = np.testing.assert_allclose

  def assert_allclose(actual, desired, rtol=1e-7, atol=0, *args, **kwargs):
    try:
      a = np.asarray(actual)
      d = np.asarray(desired)
      dtypes = sorted({str(x.dtype) for x in (a, d)})
      a, d = (np.asarray(x, np.float64) for x in (a, d))
      allowed = atol + rtol * np.abs(d)
      with np.errstate(divide="ignore", invalid="ignore"):
        err = np.abs(a - d)
        used = np.where(err == 0, 0.0, err / allowed)
      share = float(np.nanmax(used)) if used.size else 0.0
      caller = next(f for f in inspect.stack()[1:]  # The test's own line.
                    if os.path.basename(f.filename) != "_helpers.py")
      line = {"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
              "site": f"{os.path.basename(caller.filename)}:{caller.lineno}",
              "dtypes": dtypes, "rtol": rtol, "atol": float(atol),
              "used": share}
      with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
    except Exception:  # The report must never change what a test does.
      pass
    return original(actual, desired, rtol, atol, *args, **kwargs)

  np.testing.assert_allclose = assert_allclose
