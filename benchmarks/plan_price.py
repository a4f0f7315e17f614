"""The price of K-FAC's planned defaults against Adam's step, per model.

    python benchmarks/plan_price.py                      # every model below
    python benchmarks/plan_price.py --only convnet,charlm
    python benchmarks/plan_price.py --set budget=2.0     # options for kfl.kfac

For each model the table gives, in one process and round-robin (one step
of each optimizer in turn, so drift slows all alike):

* ``first s``: the first step, compilation included (a user's run starts
  its clock there), and its ratio to Adam's first step;
* ``mean ms``: the mean step over ``--periods`` whole refresh periods of
  the K-FAC plan (every step ``jax.block_until_ready``-ed; the warm-up is
  the first period, left out), so the statistics and refresh steps count
  at their share;
* ``x Adam``: that mean over Adam's (``optax.adam``), ``x SGD`` over SGD
  with momentum's;
* ``plan``: ``kfl.describe``'s plan line: the statistics and refresh
  intervals chosen from the cost model (``kfl.kfac``'s defaults, or the
  options given with ``--set``) and the price the cost model predicts for
  them, in SGD steps.

K-FAC is the README's one-pass step: ``optax.chain(kfl.kfac(loss_fn,
batch, **options), optax.sgd(lr, momentum=0.9))`` with ``est =
est_fn(params, batch, key, with_stats=kfl.stats_due(state))`` and
``tx.update(est.grads, state, params, stats=est.stats, loss=est.loss)``.
Data are random (time does not depend on the values); the models are the
benchmarks' own (``_models``: the MNIST autoencoder at batch 1000, the conv
net at batch 256, the char LM at 32 windows of 128) and the ten of
``robustness.py`` at batch 128.
"""
from __future__ import annotations

import argparse
import ast
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _models as M  # noqa: E402
import _timing  # noqa: E402
from _kfl import kfl  # noqa: E402


def autoencoder():
  params, batch = M.random_problem(M.AUTOENCODER, 1000)
  return M.make_autoencoder_loss(), params, batch


def convnet():
  key = jax.random.split(jax.random.PRNGKey(0), 3)
  params = M.convnet_init((16, 32, 64), 128, key[0])
  batch = {"x": jax.random.uniform(key[1], (256, 28, 28)),
           "y": jax.random.randint(key[2], (256,), 0, 10)}
  return M.convnet_loss, params, batch


def charlm():
  key = jax.random.split(jax.random.PRNGKey(0), 2)
  params = M.charlm_init(94, 2, 128, 128, key[0])
  tokens = jax.random.randint(key[1], (32, 129), 0, 94)
  return (M.make_charlm_loss(4), params,
          {"x": tokens[:, :-1], "y": tokens[:, 1:]})


def robustness_model(name):
  import robustness as R

  def build():
    data, loss_of, time_major = R.TASKS.get(
        name, (R.digits, None, False))
    x_all, y_all = data()
    params, apply = R.MODELS[name](jax.random.PRNGKey(0))
    idx = np.arange(128) % x_all.shape[0]
    batch = R._batch(x_all[idx], y_all[idx], time_major)
    wd = R.WEIGHT_DECAY.get(name, 0.0)

    def loss_fn(params, batch):
      out = apply(params, batch["x"])
      loss = (loss_of(out, batch["y"]) if loss_of else
              optax.softmax_cross_entropy_with_integer_labels(
                  out, batch["y"]).mean())
      if wd:
        loss = loss + wd / 2 * sum(jnp.sum(p ** 2)
                                   for p in jax.tree.leaves(params))
      return loss
    return loss_fn, params, batch
  return build


MODELS = {"autoencoder": autoencoder, "convnet": convnet, "charlm": charlm}


def all_models():
  import robustness as R
  models = dict(MODELS)
  models.update({f"robustness/{n}": robustness_model(n) for n in R.MODELS})
  return models


def _first_and_stepper(name, loss_fn, params, batch, tx, style, est_fn=None):
  t0 = time.perf_counter()
  stepper = _timing.Stepper(loss_fn, params, tx, style, batch, name=name,
                            est_fn=est_fn)
  stepper.step(batch)
  return time.perf_counter() - t0, stepper


def measure(name, build, options, periods, lr=0.01):
  """One row: Adam, SGD and K-FAC (planned) on ``build()``'s model."""
  loss_fn, params, batch = build()
  table = kfl.describe(loss_fn, params, batch, **{
      k: v for k, v in options.items() if k in ("budget", "cov_every",
                                                "inverse_every",
                                                "estimation",
                                                "stats_fraction",
                                                "blocks")})
  plan = table.plan
  est_fn = kfl.value_grad_and_stats(
      loss_fn, params, batch,
      **{k: v for k, v in options.items()
         if k in ("estimation", "stats_fraction", "blocks")})
  kfac = optax.chain(kfl.kfac(loss_fn, batch, **options),
                     optax.sgd(lr, momentum=0.9))
  adam = optax.with_extra_args_support(optax.adam(1e-3))
  sgd = optax.with_extra_args_support(optax.sgd(lr, momentum=0.9))
  firsts, steppers = [], []
  for label, tx, style, fn in (("adam", adam, "grad", None),
                               ("sgd", sgd, "grad", None),
                               ("kfac", kfac, "cov", est_fn)):
    jax.clear_caches()
    first, stepper = _first_and_stepper(label, loss_fn, params, batch, tx,
                                        style, fn)
    firsts.append(first)
    steppers.append(stepper)
  period = plan.inverse_every
  n = max(period * periods, 20)
  # Warm-up: the rest of the first period (the young refreshes with it).
  _timing.round_robin([s.step for s in steppers], [batch], period - 1)
  times = _timing.round_robin([s.step for s in steppers], [batch], n)
  means = [statistics.fmean(t) for t in times]
  health = kfl.health(steppers[2].opt_state())
  return dict(name=name, first=firsts, mean=means, plan=plan, steps=n,
              health=health.ok or health.recovered)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--only", type=lambda s: s.split(","), default=None,
                 help="models (autoencoder, convnet, charlm, robustness/NAME)")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="a kfl.kfac option (Python literal), e.g. budget=2.0")
  p.add_argument("--periods", type=int, default=2,
                 help="refresh periods timed per model (after one of warm-up)")
  args = p.parse_args(argv)
  options = {}
  for item in args.set:
    key, value = item.split("=", 1)
    try:
      options[key] = ast.literal_eval(value)
    except ValueError:
      options[key] = value
  models = all_models()
  names = args.only or list(models)
  print(f"$ python benchmarks/plan_price.py {' '.join(argv or sys.argv[1:])}"
        f"   # {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}")
  print(f"jax {jax.__version__}, {jax.devices()[0].platform} "
        f"({os.cpu_count()} CPUs); kfl.kfac options: {options or 'defaults'}")
  head = (f"{'model':34s} {'Adam ms':>8s} {'K-FAC ms':>9s} {'x Adam':>7s} "
          f"{'x SGD':>6s} {'first x Adam':>12s}  plan")
  print(head)
  rows = []
  for name in names:
    r = measure(name, models[name], options, args.periods)
    rows.append(r)
    adam, sgd, kfac = r["mean"]
    print(f"{name:34s} {1e3 * adam:8.1f} {1e3 * kfac:9.1f} "
          f"{kfac / adam:6.2f}x {kfac / sgd:5.2f}x "
          f"{r['first'][2] / r['first'][0]:11.1f}x  {r['plan'].line}"
          + ("" if r["health"] else "  [health: not ok]"), flush=True)
  return rows


if __name__ == "__main__":
  main()
