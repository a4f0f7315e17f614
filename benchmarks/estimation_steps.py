"""What a K-FAC step is worth by estimation, at equal steps.

    python benchmarks/estimation_steps.py            # MNIST, 200 steps, lr 0.01 and 0.03
    python benchmarks/estimation_steps.py --quick    # digits, 20 steps: a smoke run

``kfl.kfac``'s statistics from ``"fisher"`` (targets sampled from the
model), ``"empirical"`` (the data's targets, its own backward pass) and
``"empirical_shared"`` (the same statistics read from the gradient's own
backward pass: no second one), each in the README's one-pass step with
``optax.sgd(lr, momentum=0.9)`` and the library's other defaults, on the
autoencoder (784 pixel terms per example) and the conv net (one label per
example) of ``_models``. The table gives the evaluation loss after the
same numbers of steps (on the same batches) and the median step time over
``"fisher"``'s, the three steps timed round-robin (``_timing``) so that a
drifting load slows them alike. Steps to a loss, not seconds: this
separates what a step is worth from what it costs.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import _data  # noqa: E402
import _models as M  # noqa: E402
import _timing as T  # noqa: E402
from _harness import kfl  # noqa: E402

ESTIMATIONS = ("fisher", "empirical", "empirical_shared")


def _problem(name, data, quick):
  """``(loss_fn, params, batch_fn(i), evaluate)`` of one model."""
  n = len(data.train_x)
  rng = np.random.default_rng(0)
  order = rng.permutation(n)
  probe = order[:512 if quick else 5000]
  if name == "autoencoder":
    x = jnp.asarray(data.train_x.reshape(n, -1))
    d = x.shape[1]
    dims = (d, 32, 8, 32, d) if quick else M.AUTOENCODER
    params = M.autoencoder_init(dims, jax.random.PRNGKey(0))
    loss_fn, size = M.autoencoder_loss, 128 if quick else 1000
    batch_of = lambda idx: {"x": x[idx]}
  else:
    train = {"x": jnp.asarray(data.train_x), "y": jnp.asarray(data.train_y)}
    widths = ((4, 8), 16) if quick else ((16, 32, 64), 128)
    params = M.convnet_init(*widths, jax.random.PRNGKey(0))
    loss_fn, size = M.convnet_loss, 64 if quick else 256
    batch_of = lambda idx: jax.tree.map(lambda a: a[idx], train)
  eval_batch = batch_of(probe)
  evaluate = jax.jit(lambda p: loss_fn(p, eval_batch))
  stream = np.random.default_rng(1).permutation(n)

  def batch(i):
    start = (i * size) % (n - size)
    return batch_of(stream[start:start + size])
  return loss_fn, params, batch, evaluate


def run(name, data, lr, steps, checkpoints, quick):
  loss_fn, params, batch, evaluate = _problem(name, data, quick)
  example = batch(0)
  steppers = []
  for e in ESTIMATIONS:
    tx = optax.chain(kfl.kfac(loss_fn, example, estimation=e),
                     optax.sgd(lr, momentum=0.9))
    est_fn = kfl.value_grad_and_stats(loss_fn, params, example, estimation=e)
    steppers.append(T.Stepper(loss_fn, params, tx, "cov", example,
                              est_fn=est_fn, name=e))
  losses = {e: [] for e in ESTIMATIONS}
  times = [[] for _ in steppers]
  for i in range(steps):
    got = T.round_robin([s.step for s in steppers], [batch(i)], 1)
    for ts, t in zip(times, got):
      ts.extend(t)
    if i + 1 in checkpoints:
      for s in steppers:
        losses[s.name].append(float(evaluate(s.params())))
  med = [float(np.median(t[1:])) for t in times]
  rows = []
  for s, m in zip(steppers, med):
    health = kfl.health(s.opt_state()[0])
    rows.append((name, lr, s.name, m / med[0], losses[s.name],
                 "ok" if health.ok else "NOT ok"))
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--quick", action="store_true")
  p.add_argument("--steps", type=int, default=None)
  p.add_argument("--lr", type=lambda s: [float(v) for v in s.split(",")],
                 default=[0.01, 0.03])
  p.add_argument("--models", type=lambda s: s.split(","),
                 default=["autoencoder", "convnet"])
  args = p.parse_args(argv)
  steps = args.steps or (20 if args.quick else 200)
  checkpoints = sorted({max(1, steps // 4), steps // 2, steps})
  data, note = _data.images("digits" if args.quick else "mnist", None, True,
                            fallback=args.quick)
  print(f"data: {note}; {steps} steps, evaluation loss after "
        f"{'/'.join(map(str, checkpoints))} steps")
  rows = []
  for name in args.models:
    for lr in args.lr:
      rows += run(name, data, lr, steps, checkpoints, args.quick)
  print(f"{'model':<12} {'lr':>6} {'estimation':<17} {'step/fisher':>11}  "
        f"{'loss after ' + '/'.join(map(str, checkpoints)) + ' steps':<32} health")
  for name, lr, e, ratio, ls, health in rows:
    print(f"{name:<12} {lr:>6g} {e:<17} {ratio:>10.2f}x  "
          f"{' / '.join(f'{v:.4g}' for v in ls):<32} {health}")
  return rows


if __name__ == "__main__":
  main()
