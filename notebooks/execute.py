"""Execute the notebooks at full size and save them with their outputs.

    python notebooks/execute.py                        # every notebook
    python notebooks/execute.py 03_distributed.ipynb   # some of them

Each runs in a fresh kernel (``nbclient``) from the ``notebooks/`` folder,
with this checkout's ``src`` first on ``PYTHONPATH`` and
``KFL_NOTEBOOK_QUICK=0``; a notebook whose cell raises is not saved, and the
script exits non-zero. Each saved notebook records in its metadata
(``kfac_jax_lite.source_sha256``) the digest of the library source it ran
(``source_digest``). ``tests/test_notebooks.py`` runs them at the quick
sizes instead and checks that the committed copies are executed, and
executed with this checkout's source: after any change under ``src/``, run
this script (about 4 minutes on a 2-core CPU).
"""
import hashlib
import os
import pathlib
import sys
import time

import nbformat
from nbclient import NotebookClient

HERE = pathlib.Path(__file__).resolve().parent
SOURCE = HERE.parent / "src" / "kfac_jax_lite"


def source_digest(root=SOURCE):
  """SHA-256 over the library's ``.py`` files: each one's path relative to
  ``root`` and its bytes with line endings normalised, in path order."""
  digest = hashlib.sha256()
  for path in sorted(root.rglob("*.py")):
    digest.update(path.relative_to(root).as_posix().encode() + b"\0")
    digest.update(path.read_bytes().replace(b"\r\n", b"\n") + b"\0")
  return digest.hexdigest()


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
    nb.metadata["kfac_jax_lite"] = {"source_sha256": source_digest()}
    nbformat.write(nb, HERE / name)
    print(f"{name}: executed in {time.perf_counter() - start:.0f} s", flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
