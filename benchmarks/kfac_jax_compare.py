"""Step time of kfac-jax 0.0.8 against this library, same model and settings.

    /work/venv091/bin/python benchmarks/kfac_jax_compare.py          # the autoencoder, batch 1000
    /work/venv091/bin/python benchmarks/kfac_jax_compare.py --quick  # 784-256-30-256-784, batch 256

kfac-jax 0.0.8 runs only on jax 0.9.1 (see ``benchmarks/README.md`` for
the one-line virtualenv); without it the script says so and exits (with
``--ours-only`` it still times this library against SGD).

Model: the MNIST autoencoder of ``autoencoder.py`` (``_models``;
784-1000-500-250-30-250-500-1000-784, tanh with a linear code, sigmoid cross-entropy summed
over pixels and averaged over the batch), MNIST batches (random ones of the
same shape with ``--random-data``: step time does not depend on the
values). Both optimizers do the same work per step, configured alike:

==================  ==========================================  ===========================================
setting             kfac_jax_lite                               kfac_jax.Optimizer
==================  ==========================================  ===========================================
curvature           ``estimation="fisher"``, ``num_samples=1``  ``estimation_mode="fisher_gradients"``,
                                                                ``num_estimator_samples=1``
blocks              Kronecker dense (auto-detected)             Kronecker dense (auto-registered)
covariance EMA      ``cov_decay=0.95``, ``cov_every=1``         ``curvature_ema=0.95``,
                                                                ``curvature_update_period=1``
inverses            ``inverse_every=10``, ``damping_mode="pi"``  ``inverse_update_period=10``,
                                                                ``use_exact_inverses=False`` (pi-adjusted)
damping             fixed ``damping=λ``                         ``damping_schedule=λ``, not adaptive
update              ``optax.sgd(lr, momentum=0.9)`` after it    ``learning_rate_schedule=lr``,
                                                                ``momentum_schedule=0.9``, not adaptive
other               ``norm_constraint=None``                    ``norm_constraint=None``, ``l2_reg=0``,
                                                                ``num_burnin_steps=0``
==================  ==========================================  ===========================================

Ours runs in two styles: ``1-pass`` (``kfl.value_grad_and_stats`` then
``tx.update(..., stats=)``: the statistics share the gradient's forward
pass) and ``batch=`` (``jax.value_and_grad`` then ``tx.update(...,
batch=)``: a second forward pass, as kfac-jax's step does). Each step is a
jitted function with the carry donated (kfac-jax donates its params and
state too) and is blocked on.

Timing: every configuration compiles (its first step, reported), then
``--rounds`` rounds of ``--steps`` steps each, round-robin one step at a
time, so load drifting on a shared machine slows them alike. Per round and
configuration: the median step and the mean step (the mean includes the
refresh steps, one in ``inverse_every``, so it is the amortised cost when
``--steps`` is a multiple of it). The printed ratios take the best (lowest)
round of each configuration: ``kfac-jax / ours`` > 1 means we are faster.
It also prints each optimizer state's bytes.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import _data  # noqa: E402
import _harness as H  # noqa: E402
import _models as M  # noqa: E402
import _timing as T  # noqa: E402
from _harness import kfl  # noqa: E402

QUICK = (784, 256, 30, 256, 784)
MISSING = ("kfac-jax is not importable here ({why}), so there is nothing to "
           "compare: kfac-jax 0.0.8 needs jax 0.9.1. Make its virtualenv "
           "(benchmarks/README.md) and run this script with its python.")


def kfac_jax_stepper(kfac_jax, params, batch, args):
  """kfac-jax's optimizer with the settings of the module docstring."""
  lr, momentum, damping = args.lr, 0.9, args.damping
  stepper = T.KfacJaxStepper(
      kfac_jax, M.autoencoder_kfac_jax_loss, params, args.seed,
      use_adaptive_learning_rate=False, use_adaptive_momentum=False,
      use_adaptive_damping=False, learning_rate_schedule=lambda _: lr,
      momentum_schedule=lambda _: momentum, damping_schedule=lambda _: damping,
      estimation_mode="fisher_gradients", num_estimator_samples=1,
      curvature_ema=args.cov_decay, curvature_update_period=1,
      inverse_update_period=args.inverse_every, use_exact_inverses=False,
      norm_constraint=None, num_burnin_steps=0)
  stepper.init(batch)  # For its state_bytes.
  return stepper


def ours(params, batch, args, style):
  tx = optax.chain(
      kfl.kfac(M.autoencoder_loss, batch, damping=args.damping,
               estimation="fisher", num_samples=1, cov_decay=args.cov_decay,
               cov_every=1, inverse_every=args.inverse_every,
               damping_mode="pi", norm_constraint=None),
      optax.sgd(args.lr, momentum=0.9))
  est_fn = kfl.value_grad_and_stats(M.autoencoder_loss, params, batch,
                                    estimation="fisher", num_samples=1)
  return T.Stepper(M.autoencoder_loss, params, tx, style, seed=args.seed,
                   name=f"ours {style}", est_fn=est_fn)


def sgd(params, args):
  return T.Stepper(M.autoencoder_loss, params, optax.sgd(args.lr, momentum=0.9),
                   "grad", name="SGD-momentum")


def time_round_robin(configs, batches, rounds, steps):
  """``{name: [(median, mean) per round]}`` after one compiling step each."""
  first = {}
  for c in configs:
    t = time.perf_counter()
    c.step(batches[0])
    first[c.name] = time.perf_counter() - t
  out = {c.name: [] for c in configs}
  for r in range(rounds):
    times = T.round_robin([c.step for c in configs], batches, steps,
                          start=1 + r * steps)
    for c, ts in zip(configs, times):
      out[c.name].append((statistics.median(ts), statistics.mean(ts)))
  return first, out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--quick", action="store_true",
                 help=f"{'-'.join(map(str, QUICK))}, batch 256, 1 round of 10")
  p.add_argument("--batch", type=int, default=None, help="default 1000")
  p.add_argument("--rounds", type=int, default=None, help="default 3")
  p.add_argument("--steps", type=int, default=None,
                 help="timed steps per round and configuration (default 30)")
  p.add_argument("--damping", type=float, default=1e-3)
  p.add_argument("--lr", type=float, default=1e-3)
  p.add_argument("--cov-decay", type=float, default=0.95)
  p.add_argument("--inverse-every", type=int, default=10)
  p.add_argument("--styles", default="1-pass,batch=",
                 help="our styles to time (comma-separated)")
  p.add_argument("--ours-only", action="store_true",
                 help="without kfac-jax, still time ours against SGD")
  p.add_argument("--random-data", action="store_true")
  p.add_argument("--mnist", default=None)
  p.add_argument("--no-download", action="store_true")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--platform", default=None)
  p.add_argument("--blas-threads", type=int, default=0,
                 help="cap the BLAS pools (threadpoolctl); 0 leaves them")
  args = p.parse_args(argv)
  args.batch = args.batch or (256 if args.quick else 1000)
  args.rounds = args.rounds or (1 if args.quick else 3)
  args.steps = args.steps or (10 if args.quick else 30)
  if args.platform:
    jax.config.update("jax_platforms", args.platform)
  try:
    import kfac_jax
  except ImportError as e:
    kfac_jax = None
    print(MISSING.format(why=e))
    if not args.ours_only:
      return None
  dims = QUICK if args.quick else M.AUTOENCODER
  xs, note = _data.mnist_batches(args.batch, dims[0], seed=args.seed,
                                 path=args.mnist, download=not args.no_download,
                                 random=args.random_data)
  batches = [{"x": jnp.asarray(x)} for x in xs]
  args.budget, args.evals, args.max_steps = 0, 0, None
  args.blas = H.blas_pools(args.blas_threads)
  H.environment(args, note, f"autoencoder {'-'.join(map(str, dims))}, batch "
                f"{args.batch}")
  print(f"settings: damping {args.damping} (pi-adjusted), lr {args.lr}, "
        f"momentum 0.9, cov EMA {args.cov_decay} every step, inverses every "
        f"{args.inverse_every} steps, Fisher with 1 sampled target, no norm "
        f"constraint, no burn-in; {args.rounds} round(s) of {args.steps} "
        "steps, round-robin")
  params = M.autoencoder_init(dims, jax.random.PRNGKey(args.seed))
  configs = [sgd(params, args)]
  configs += [ours(params, batches[0], args, s) for s in args.styles.split(",")]
  if kfac_jax is not None:
    configs.append(kfac_jax_stepper(kfac_jax, params, batches[0], args))
  first, rounds = time_round_robin(configs, batches, args.rounds, args.steps)
  return print_table(configs, first, rounds, args)


def print_table(configs, first, rounds, args):
  best = {name: (min(m for m, _ in r), min(a for _, a in r))
          for name, r in rounds.items()}
  sgd_med, sgd_mean = best["SGD-momentum"]
  print()
  print(f"{'configuration':<16}{'first s':>9}{'median ms':>11}{'x SGD':>8}"
        f"{'mean ms':>10}{'x SGD':>8}{'state MB':>10}   per-round medians ms")
  for c in configs:
    med, mean = best[c.name]
    per_round = " ".join(f"{1e3 * m:.1f}" for m, _ in rounds[c.name])
    print(f"{c.name:<16}{first[c.name]:>9.1f}{1e3 * med:>11.1f}"
          f"{med / sgd_med:>7.2f}x{1e3 * mean:>10.1f}{mean / sgd_mean:>7.2f}x"
          f"{c.state_bytes / 2**20:>10.1f}   {per_round}")
  result = dict(best=best, first=first)
  if "kfac-jax 0.0.8" in best:
    kj_med, kj_mean = best["kfac-jax 0.0.8"]
    print()
    print("kfac-jax step / our step (best round; > 1: we are faster):")
    for c in configs:
      if c.name.startswith("ours"):
        med, mean = best[c.name]
        print(f"  {c.name:<14} median {kj_med / med:.2f}x, mean (amortised) "
              f"{kj_mean / mean:.2f}x; first step "
              f"{first['kfac-jax 0.0.8'] / first[c.name]:.2f}x")
        result[c.name] = dict(median=kj_med / med, mean=kj_mean / mean)
  print("mean: includes the refresh steps (amortised over the inverse period "
        "when --steps is a multiple of it); state MB: the optimizer state")
  return result


if __name__ == "__main__":
  main()
