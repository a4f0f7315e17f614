"""The notebooks in ``notebooks/`` run end to end, and are committed executed.

Each notebook is executed in a fresh kernel with ``nbclient`` at its quick
sizes: the test sets ``KFL_NOTEBOOK_QUICK=1`` in the kernel's environment and
every notebook's first code cell reads it (tagged ``parameters``). A cell that
raises fails the test. The kernel finds ``kfac_jax_lite`` through
``PYTHONPATH`` (this checkout's ``src`` first), so the test also runs from a
checkout that is not installed.

The notebooks plot with matplotlib: without it they are skipped, with the
reason; ``nbclient``, ``nbformat`` and ``ipykernel`` are test requirements
(``pip install -e ".[test]"``), and a missing one is a failure.
"""
from __future__ import annotations

import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(p.name for p in NOTEBOOK_DIR.glob("*.ipynb"))
QUICK_SWITCH = "KFL_NOTEBOOK_QUICK"


def _read(name):
  import nbformat
  return nbformat.read(NOTEBOOK_DIR / name, as_version=4)


def test_notebooks_exist():
  assert len(NOTEBOOKS) >= 5, NOTEBOOKS


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_committed_executed(name):
  """Every code cell ran, in order, without an error output, and the first
  code cell reads the quick switch (so the test below really shrinks it)."""
  nb = _read(name)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert code, f"{name} has no code cells"
  assert QUICK_SWITCH in code[0].source, (
      f"{name}: the first code cell must read {QUICK_SWITCH}")
  counts = [c.execution_count for c in code]
  assert all(isinstance(n, int) for n in counts), (
      f"{name}: not executed (execution counts {counts})")
  assert counts == sorted(counts), f"{name}: cells ran out of order {counts}"
  for c in code:
    for out in c.outputs:
      assert out.output_type != "error", (
          f"{name}: committed with an error: {out.get('ename')}: "
          f"{out.get('evalue')}")
  images = sum("image/png" in out.get("data", {})
               for c in code for out in c.outputs)
  assert images >= 1, f"{name}: committed without its plots"


def _execute_module():
  import importlib.util
  spec = importlib.util.spec_from_file_location(
      "notebooks_execute", NOTEBOOK_DIR / "execute.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_was_executed_with_this_source(name):
  """The committed outputs are today's: the notebook was executed (by
  ``notebooks/execute.py``) with the library source of this checkout."""
  recorded = _read(name).metadata.get("kfac_jax_lite", {}).get("source_sha256")
  assert recorded == _execute_module().source_digest(), (
      f"{name} was executed with other library source than this checkout's "
      "(src/ changed since): run `python notebooks/execute.py` and commit "
      "the notebooks")


def test_source_digest_sees_every_change(tmp_path):
  digest = _execute_module().source_digest
  (tmp_path / "pkg").mkdir()
  (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
  first = digest(tmp_path)
  (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
  assert digest(tmp_path) != first
  (tmp_path / "pkg" / "a.py").write_text("x = 1\r\n")  # line endings only
  assert digest(tmp_path) == first
  (tmp_path / "pkg" / "b.py").write_text("")
  assert digest(tmp_path) != first


@pytest.mark.slow  # Runs a notebook (conftest.py: the slow tier).
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, monkeypatch):
  pytest.importorskip(
      "matplotlib",
      reason="the notebooks plot with matplotlib, which is not installed "
             "(pip install matplotlib, or the [test] extra)")
  from nbclient import NotebookClient

  src = str(ROOT / "src")
  path = os.environ.get("PYTHONPATH", "")
  monkeypatch.setenv("PYTHONPATH", src + (os.pathsep + path if path else ""))
  monkeypatch.setenv(QUICK_SWITCH, "1")
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  nb = _read(name)
  client = NotebookClient(
      nb, timeout=600, kernel_name="python3",
      resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
  client.execute()  # raises CellExecutionError, with the traceback, on error
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert all(isinstance(c.execution_count, int) for c in code)
