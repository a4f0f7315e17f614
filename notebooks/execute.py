"""Execute the notebooks at full size and save them with their outputs.

    python notebooks/execute.py                        # every notebook
    python notebooks/execute.py 03_distributed.ipynb   # some of them

Each runs in a fresh kernel (``nbclient``) from the ``notebooks/`` folder,
with this checkout's ``src`` first on ``PYTHONPATH`` and
``KFL_NOTEBOOK_QUICK=0``; a notebook whose cell raises is not saved, and the
script exits non-zero. ``tests/test_notebooks.py`` runs them at the quick
sizes instead and checks that the committed copies are executed.
"""
import os
import pathlib
import sys
import time

import nbformat
from nbclient import NotebookClient

HERE = pathlib.Path(__file__).resolve().parent


def main(names):
  names = names or sorted(p.name for p in HERE.glob("*.ipynb"))
  src = str(HERE.parent / "src")
  path = os.environ.get("PYTHONPATH", "")
  os.environ["PYTHONPATH"] = src + (os.pathsep + path if path else "")
  os.environ["KFL_NOTEBOOK_QUICK"] = "0"
  failed = []
  for name in names:
    nb = nbformat.read(HERE / name, as_version=4)
    start = time.perf_counter()
    try:
      NotebookClient(nb, timeout=1800, kernel_name="python3",
                     resources={"metadata": {"path": str(HERE)}}).execute()
    except Exception as e:  # pylint: disable=broad-except
      print(f"{name}: FAILED after {time.perf_counter() - start:.0f} s: {e}",
            flush=True)
      failed.append(name)
      continue
    nbformat.write(nb, HERE / name)
    print(f"{name}: executed in {time.perf_counter() - start:.0f} s", flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
