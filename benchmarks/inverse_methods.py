"""The refresh's damped inverses on their own: time, compile size and accuracy.

    python benchmarks/inverse_methods.py            # the autoencoder's 16 factor sizes
    python benchmarks/inverse_methods.py --quick    # 4 small sizes, for a smoke run

Part 1 inverts random SPD matrices of the sizes of the MNIST autoencoder's
Kronecker factors (784-1000-500-250-30-250-500-1000-784: A sizes 785, 1001,
501, 251, 31, 251, 501, 1001; G sizes 1000, 500, 250, 30, 250, 500, 1000,
784) in one jitted call per method, timed round-robin (median of
``--reps``), with each program's compile time, fusion and while-loop counts
(XLA:CPU compiles one kernel per fusion). Methods: the library's
``gauss_jordan_inverse`` and ``schur_inverse`` (one Schur split) and
jaxlib's Cholesky followed by ``cho_solve`` against the identity. Nothing
is tuned: no ``threadpoolctl``, no thread variables (what a plain ``python
train.py`` gets).

Part 2 measures accuracy on SPD matrices with a known spectrum (log-spaced
eigenvalues from 1 to 1/κ, random eigenvectors): the relative forward error
``‖X − m⁻¹‖_F / ‖m⁻¹‖_F`` (reference: float64 inverse of the float32
matrix, or the known eigendecomposition in float64), the residual
``‖m X − I‖_F / √n`` and the method's ``ok``; float32 at κ = 1e4, 1e6 and
float64 (``jax_enable_x64``) at κ = 1e8, 1e12.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

try:
  import kfac_jax_lite  # noqa: F401
except ImportError:  # Not installed: run from a checkout (src layout).
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                  os.pardir, "src"))
from kfac_jax_lite.factor import _inverse  # The algorithms themselves.

AUTOENCODER_FACTORS = (785, 1001, 501, 251, 31, 251, 501, 1001,
                       1000, 500, 250, 30, 250, 500, 1000, 784)
QUICK_FACTORS = (31, 100, 257, 300)


def _cholesky(m):
  inv = jax.scipy.linalg.cho_solve((jnp.linalg.cholesky(m), True),
                                   jnp.eye(m.shape[-1], dtype=m.dtype))
  return inv, jnp.all(jnp.isfinite(inv))


METHODS = {
    "gauss_jordan": _inverse.gauss_jordan_inverse,
    "schur": _inverse.schur_inverse,
    "cholesky + cho_solve(I)": _cholesky,
}


def time_methods(sizes, reps):
  key = jax.random.PRNGKey(0)
  mats = []
  for i, s in enumerate(sizes):
    u = jax.random.normal(jax.random.fold_in(key, i), (s, s))
    mats.append(u @ u.T / s + jnp.eye(s))
  compiled, rows = {}, {}
  for name, fn in METHODS.items():
    f = jax.jit(lambda ms, fn=fn: [fn(u) for u in ms])
    jax.clear_caches()  # Each method compiles as in a fresh process.
    t0 = time.perf_counter()
    compiled[name] = f.lower(mats).compile()
    text = compiled[name].as_text()
    rows[name] = [time.perf_counter() - t0, text.count(" fusion("),
                  text.count(" while(")]
    jax.block_until_ready(compiled[name](mats))
  times = {name: [] for name in METHODS}
  for _ in range(reps):
    for name, f in compiled.items():
      t0 = time.perf_counter()
      jax.block_until_ready(f(mats))
      times[name].append(time.perf_counter() - t0)
  cube = sum(s ** 3 for s in sizes)
  base = statistics.median(times["gauss_jordan"])
  print(f"Part 1: {len(sizes)} factors {sizes}, Σn³ = {cube / 1e9:.2f} G; "
        f"median of {reps}, round-robin")
  print(f"  {'method':<26}{'ms':>9}{'x gj':>7}{'GFLOP/s (n³)':>14}"
        f"{'compile s':>11}{'fusions':>9}{'loops':>7}")
  for name in METHODS:
    t = statistics.median(times[name])
    c, fusions, loops = rows[name]
    print(f"  {name:<26}{1e3 * t:>9.1f}{t / base:>7.2f}{cube / t / 1e9:>14.1f}"
          f"{c:>11.1f}{fusions:>9}{loops:>7}")


def _spd(rng, n, cond):
  q, _ = np.linalg.qr(rng.normal(size=(n, n)))
  w = np.geomspace(1, 1 / cond, n)
  return (q * w) @ q.T, (q / w) @ q.T


def accuracy(sizes):
  print("Part 2: forward error / residual ‖mX − I‖_F/√n (NOT OK: the method's "
        "ok flag is False)")
  for x64, conds in ((False, (1e4, 1e6)), (True, (1e8, 1e12))):
    jax.config.update("jax_enable_x64", x64)
    dtype = np.float64 if x64 else np.float32
    fns = {name: jax.jit(fn) for name, fn in METHODS.items()}
    rng = np.random.default_rng(0)
    for cond in conds:
      for n in sizes:
        m, inv = _spd(rng, n, cond)
        m = np.asarray(m, dtype)
        ref = inv if x64 else np.linalg.inv(m.astype(np.float64))
        cells = []
        for name, fn in fns.items():
          x, ok = fn(jnp.asarray(m))
          x = np.asarray(x, np.float64)
          fwd = np.linalg.norm(x - ref) / np.linalg.norm(ref)
          res = np.linalg.norm(m.astype(np.float64) @ x - np.eye(n)) / np.sqrt(n)
          cells.append(f"{name.split()[0][:5]} {fwd:.1e}/{res:.1e}"
                       f"{'' if bool(ok) else ' NOT OK'}")
        print(f"  {'f64' if x64 else 'f32'} κ={cond:.0e} n={n:<5}" + "  ".join(cells))
  jax.config.update("jax_enable_x64", False)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--quick", action="store_true")
  p.add_argument("--reps", type=int, default=7)
  p.add_argument("--no-accuracy", dest="accuracy", action="store_false")
  p.add_argument("--no-timing", dest="timing", action="store_false")
  args = p.parse_args(argv)
  print(f"jax {jax.__version__}, devices {jax.devices()}, {os.cpu_count()} CPUs; "
        "no thread settings")
  sizes = QUICK_FACTORS if args.quick else AUTOENCODER_FACTORS
  if args.timing:
    time_methods(sizes, args.reps)
  if args.accuracy:
    accuracy(QUICK_FACTORS if args.quick else (250, 785, 1001))


if __name__ == "__main__":
  main()
