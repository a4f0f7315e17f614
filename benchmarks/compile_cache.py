"""First step of a second process: JAX's persistent compilation cache.

    python benchmarks/compile_cache.py            # the MNIST autoencoder, batch 1000
    python benchmarks/compile_cache.py --quick    # a small autoencoder

A K-FAC step compiles into a larger program than SGD's (the statistics, the
EMA, the refresh under a ``lax.cond``, the preconditioning), so its first
step is seconds, not a fraction of one (``benchmarks/step_time.py``'s
"First step" table). JAX can keep compiled programs on disk::

    jax.config.update("jax_compilation_cache_dir", "/path/to/cache")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

(before the first compilation), and a later process with the same program,
JAX version and devices loads it instead of compiling. This script runs
the same training script in three fresh processes, one after the other:
without the cache, with an empty cache (which it fills) and with that
cache. Each prints the time of its first step (tracing, lowering, XLA's
compile or the cache's load, and the run, ``jax.block_until_ready``-ed)
for SGD and for the README's K-FAC recipe in the one-pass style
(``kfl.value_grad_and_stats``, then ``tx.update(..., stats=)``). Tracing
and lowering are not cached: they stay in every process. The model is
``_models``' autoencoder (tanh, linear code; ``--quick``: 64-32-16-32-64)
and the steps are ``_timing``'s, as in ``step_time.py``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _models as M  # noqa: E402  (imports jax: the cache is set before compiling)

QUICK = (64, 32, 16, 32, 64)


def child(dims, batch_size, cache_dir):
  import jax
  if cache_dir:
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  import optax

  import _timing as T
  from _harness import kfl

  loss_fn = M.autoencoder_loss
  params = M.autoencoder_init(dims, jax.random.PRNGKey(0))
  batch = {"x": jax.random.uniform(jax.random.PRNGKey(1),
                                   (batch_size, dims[0]))}
  sgd = optax.sgd(0.01, momentum=0.9)
  tx = optax.chain(kfl.kfac(loss_fn, batch), optax.sgd(0.01, momentum=0.9))
  est_fn = kfl.value_grad_and_stats(loss_fn, params, batch)
  steps = (("sgd", sgd, "grad"), ("kfac", tx, "1-pass"))

  out = {}
  for name, opt, style in steps:
    step = T.jit_step(T.make_step(loss_fn, opt, style, est_fn))
    carry = T.init_carry(params, opt, seed=2)
    t0 = time.perf_counter()
    lowered = step.lower(carry, batch)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    jax.block_until_ready(compiled(carry, batch))
    t3 = time.perf_counter()
    out[name] = {"lower": t1 - t0, "compile": t2 - t1, "run": t3 - t2,
                 "total": t3 - t0}
  print(json.dumps(out))


def run_child(args, cache_dir):
  cmd = [sys.executable, os.path.abspath(__file__), "--child",
         "--batch", str(args.batch)] + (["--quick"] if args.quick else [])
  if cache_dir:
    cmd += ["--cache-dir", cache_dir]
  result = subprocess.run(cmd, capture_output=True, text=True, check=True)
  return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true")
  p.add_argument("--batch", type=int, default=None)
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  dims = QUICK if args.quick else M.AUTOENCODER
  args.batch = args.batch or (256 if args.quick else 1000)
  if args.child:
    return child(dims, args.batch, args.cache_dir)

  import jax
  print(f"jax {jax.__version__} on {jax.default_backend()}, "
        f"{os.cpu_count()} CPUs; model {'-'.join(map(str, dims))}, batch "
        f"{args.batch}; three fresh processes, one after the other")
  with tempfile.TemporaryDirectory() as cache:
    rows = [("no cache", run_child(args, None)),
            ("empty cache (fills it)", run_child(args, cache)),
            ("filled cache", run_child(args, cache))]
    size = sum(os.path.getsize(os.path.join(d, f))
               for d, _, fs in os.walk(cache) for f in fs)
  print(f"\nfirst step, seconds (lower: tracing + lowering; compile: XLA or "
        f"the cache's load; run: the step itself); cache {size / 2**20:.1f} MiB")
  print(f"{'process':<24}{'optimizer':<8}{'lower':>8}{'compile':>9}"
        f"{'run':>7}{'total':>8}{'x no cache':>12}")
  base = rows[0][1]
  for label, times in rows:
    for name in ("sgd", "kfac"):
      t = times[name]
      print(f"{label:<24}{name:<8}{t['lower']:>8.2f}{t['compile']:>9.2f}"
            f"{t['run']:>7.2f}{t['total']:>8.2f}"
            f"{t['total'] / base[name]['total']:>11.2f}x")


if __name__ == "__main__":
  main()
