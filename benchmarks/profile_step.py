"""Where a K-FAC step's time goes, kernel by kernel, from a JAX profile.

    python benchmarks/profile_step.py                  # one-pass step, no refresh
    python benchmarks/profile_step.py --refresh        # a step that refreshes
    python benchmarks/profile_step.py --style sgd      # SGD's step, for reference
    python benchmarks/profile_step.py --style quiet    # the defaults' quiet step
                                                       # (--refresh, --fraction unused)
    python benchmarks/profile_step.py --quick          # 784-256-64-256-784

The MNIST autoencoder's step (``_models``' loss, ``step_time.py``'s settings, batch
1000, random inputs: time does not depend on the values) is jitted with
its carry donated, run past its warm-up refreshes and then traced with
``jax.profiler.trace`` for ``--steps`` steps. XLA:CPU runs independent
kernels at the same time on its threads, so a kernel's wall time overstates
its cost; each moment of the trace is therefore shared out equally among
the kernels running then (loops and conditionals, which contain kernels,
are left out). The first table sums those shares by kind of kernel
(``ynn_fusion``: matrix products; ``copy_*``: layout changes), the second
lists the costliest kernels with their shape and the JAX operation they
came from (from the optimised HLO). ``busy`` is the time in which any
kernel runs; the step's wall time adds the gaps between kernels. Those
gaps are not all idle: XLA's own (Eigen) products, the ``dot_general``
and ``dot`` kernels that YNNPACK does not take (some of the covariances'
``"ni,nj->ij"``), appear to run asynchronously: the longest gaps follow
them while the thread pool stays busy, so most of their time shows as
gaps (about 75 ms of a one-pass step's, against 15 ms of SGD's).

This is how the covariances' operand transposes were found (17% of the
one-pass step, ``blocks/base.gram``) and the Gauss-Jordan sweep's copy
of the matrix per step (``_inverse``).
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile

import jax
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _models as M  # noqa: E402
import _timing as T  # noqa: E402
from _harness import kfl  # noqa: E402

# Trace events that are not kernels, or contain kernels.
NOT_KERNELS = ("while", "cond", "ThunkExecutor", "$", "PjitFunction",
               "ThreadpoolListener", "Wait for", "PythonRefManager",
               "AllocateOutputBuffers",
               "SlinkyThreadPool", "Common", "end:", "Parse", "Handle")


def make_step(style, loss_fn, params, batch, refresh, fraction):
  """The jitted, donated step (``_timing.make_step``) and its carry."""
  if style == "sgd":
    tx = optax.sgd(0.01, momentum=0.9)
  elif style == "quiet":  # The defaults' plan; traced steps are quiet.
    tx = optax.chain(kfl.kfac(loss_fn, batch), optax.sgd(0.01, momentum=0.9))
  else:
    tx = optax.chain(kfl.kfac(loss_fn, batch, damping=1.0,
                              inverse_every=1 if refresh else 1 << 20,
                              stats_fraction=fraction),
                     optax.sgd(0.01, momentum=0.9))
  est_fn = kfl.value_grad_and_stats(loss_fn, params, batch,
                                    stats_fraction=fraction)
  kind = {"sgd": "grad", "2-pass": "batch=", "1-pass": "1-pass",
          "quiet": "cov"}[style]
  return (T.jit_step(T.make_step(loss_fn, tx, kind, est_fn)),
          T.init_carry(params, tx))


def quiet_start(loss_fn, params, batch, steps):
  """The first step of ``steps`` quiet ones (no statistics, no refresh) of
  ``kfl.kfac``'s planned defaults: after the last young step (a power of
  two) below the shorter interval (``kfl.describe``'s plan)."""
  plan = kfl.describe(loss_fn, params, batch).plan
  interval = min(plan.cov_every, plan.inverse_every)
  start = 1 << (interval - 1).bit_length() - 1 if interval > 1 else 0
  start += 1
  if start + steps > interval:
    raise SystemExit(f"profile_step: the plan (statistics every "
                     f"{plan.cov_every}, refresh every {plan.inverse_every}) "
                     f"has no {steps} quiet steps in a row after step {start}")
  return start


def kernel_shares(events):
  """``{kernel name: µs}``: each moment shared equally among the kernels
  running then."""
  edges = []
  for e in events:
    if (e.get("ph") == "X" and e.get("dur", 0) > 0
        and not e["name"].startswith(NOT_KERNELS)):
      edges += [(e["ts"], 1, e["name"]), (e["ts"] + e["dur"], -1, e["name"])]
  edges.sort(key=lambda x: (x[0], x[1]))
  share, active, last, busy = collections.Counter(), collections.Counter(), None, 0.0
  for t, d, name in edges:
    if last is not None and active:
      k, dt = sum(active.values()), t - last
      busy += dt
      for n, c in active.items():
        share[n] += dt * c / k
    active[name] += d
    if not active[name]:
      del active[name]
    last = t
  return share, busy


def hlo_info(hlo_text, name):
  """``(shape, op_name)`` of the instruction ``name`` in the HLO."""
  line = re.search(r"\n\s*%" + re.escape(name) + r" = (\S+) [^\n]*", hlo_text)
  if not line:
    return "?", ""
  op = re.search(r'op_name="([^"]*)"', line.group(0))
  return line.group(1), op.group(1) if op else ""


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--style", choices=("1-pass", "2-pass", "sgd", "quiet"), default="1-pass")
  p.add_argument("--refresh", action="store_true",
                 help="refresh the inverses every step (inverse_every=1)")
  p.add_argument("--fraction", type=float, default=1.0,
                 help="stats_fraction (statistics on that share of the batch)")
  p.add_argument("--quick", action="store_true")
  p.add_argument("--batch", type=int, default=1000)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--top", type=int, default=25)
  args = p.parse_args(argv)
  dims = M.AUTOENCODER_SMALL if args.quick else M.AUTOENCODER
  params, batch = M.random_problem(dims, args.batch)
  loss_fn = M.autoencoder_loss
  step, carry = make_step(args.style, loss_fn, params, batch, args.refresh,
                          args.fraction)
  hlo = step.lower(carry, batch).compile().as_text()
  warm = 20  # Past the young refreshes (steps 1, 2, 4, 8, 16).
  if args.style == "quiet":
    warm = quiet_start(loss_fn, params, batch, args.steps)
  for _ in range(warm):
    carry, loss = step(carry, batch)
  jax.block_until_ready(loss)
  with tempfile.TemporaryDirectory() as out:
    with jax.profiler.trace(out, create_perfetto_trace=True):
      for _ in range(args.steps):
        # The chain's K-FAC state's flag, read to the host (no kernel).
        if args.style == "quiet" and int(np.asarray(carry[1][0].stats_due)):
          raise SystemExit("profile_step: a traced step of --style quiet "
                           "computes statistics")
        carry, loss = step(carry, batch)
        jax.block_until_ready((carry, loss))
    path, = glob.glob(os.path.join(out, "**", "perfetto_trace.json.gz"),
                      recursive=True)
    with gzip.open(path) as f:
      events = json.load(f)["traceEvents"]
  share, busy = kernel_shares(events)
  ms = lambda us: us / args.steps / 1000
  print(f"model {'-'.join(map(str, dims))}, batch {args.batch}, style "
        f"{args.style}{', refresh every step' if args.refresh else ''}"
        f"{f', stats_fraction {args.fraction:g}' if args.fraction != 1 else ''}; "
        f"jax {jax.__version__}; {args.steps} traced steps")
  print(f"busy (some kernel running): {ms(busy):.1f} ms per step")
  kinds = collections.Counter()
  for name, us in share.items():
    kinds[re.sub(r"\.\d+$", "", name)] += us
  print(f"\n  {'kind of kernel':45s} {'ms/step':>8s} {'share':>6s}")
  for kind, us in kinds.most_common(args.top):
    print(f"  {kind:45s} {ms(us):8.2f} {us / busy:6.1%}")
  print(f"\n  {'kernel':40s} {'ms/step':>8s}  {'shape':28s} from")
  for name, us in share.most_common(args.top):
    shape, op = hlo_info(hlo, name)
    print(f"  {name:40s} {ms(us):8.2f}  {shape[:28]:28s} {op[:60]}")


if __name__ == "__main__":
  main()
