"""Step time of kfac-jax 0.0.8 against this library, same model and settings.

    /work/venv091/bin/python benchmarks/kfac_jax_compare.py          # the autoencoder, batch 1000
    /work/venv091/bin/python benchmarks/kfac_jax_compare.py --quick  # 784-256-30-256-784, batch 256

kfac-jax 0.0.8 runs only on jax 0.9.1 (see ``benchmarks/README.md`` for
the one-line virtualenv); without it the script says so and exits (with
``--ours-only`` it still times this library against SGD).

Model: the MNIST autoencoder of ``autoencoder.py`` (784-1000-500-250-30-
250-500-1000-784, tanh with a linear code, sigmoid cross-entropy summed
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
import numpy as np  # noqa: E402
import optax  # noqa: E402

import _data  # noqa: E402
import _harness as H  # noqa: E402
import autoencoder  # noqa: E402
from _harness import kfl  # noqa: E402

FULL = autoencoder.FULL
QUICK = (784, 256, 30, 256, 784)
MISSING = ("kfac-jax is not importable here ({why}), so there is nothing to "
           "compare: kfac-jax 0.0.8 needs jax 0.9.1. Make its virtualenv "
           "(benchmarks/README.md) and run this script with its python.")


def state_bytes(tree):
  return sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


class Jitted:
  """One of our configurations: a donated, jitted step."""

  def __init__(self, name, step, carry):
    self.name, self._step = name, jax.jit(step, donate_argnums=0)
    self._carry = jax.tree.map(lambda x: jnp.array(x, copy=True), carry)
    self.state_bytes = state_bytes(carry[1])

  def step(self, batch):
    self._carry, loss = self._step(self._carry, batch)
    return jax.block_until_ready(loss)


class KfacJax:
  """kfac-jax's optimizer with the settings of the module docstring."""

  def __init__(self, kfac_jax, params, batch, args):
    lr, momentum, damping = args.lr, 0.9, args.damping
    self.name = "kfac-jax 0.0.8"
    self._opt = kfac_jax.Optimizer(
        value_and_grad_func=jax.value_and_grad(autoencoder.kfac_jax_loss),
        l2_reg=0.0, use_adaptive_learning_rate=False,
        use_adaptive_momentum=False, use_adaptive_damping=False,
        learning_rate_schedule=lambda _: lr,
        momentum_schedule=lambda _: momentum,
        damping_schedule=lambda _: damping,
        estimation_mode="fisher_gradients", num_estimator_samples=1,
        curvature_ema=args.cov_decay, curvature_update_period=1,
        inverse_update_period=args.inverse_every, use_exact_inverses=False,
        norm_constraint=None, num_burnin_steps=0, multi_device=False)
    self._key = jax.random.PRNGKey(args.seed)
    self._params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
    self._state = self._opt.init(self._params, jax.random.PRNGKey(1), batch)
    self.state_bytes = state_bytes(self._state)

  def step(self, batch):
    self._key, sub = jax.random.split(self._key)
    self._params, self._state, stats = self._opt.step(
        self._params, self._state, sub, batch=batch)
    return jax.block_until_ready(stats["loss"])


def ours(params, batch, args, style):
  tx = optax.chain(
      kfl.kfac(autoencoder.loss_fn, batch, damping=args.damping,
               estimation="fisher", num_samples=1, cov_decay=args.cov_decay,
               cov_every=1, inverse_every=args.inverse_every,
               damping_mode="pi", norm_constraint=None),
      optax.sgd(args.lr, momentum=0.9))
  est_fn = kfl.value_grad_and_stats(autoencoder.loss_fn, params, batch,
                                    estimation="fisher", num_samples=1)

  def step(carry, batch):
    p, s, key = carry
    key, sub = jax.random.split(key)
    if style == "1-pass":
      est = est_fn(p, batch, sub)
      loss, u_s = est.loss, tx.update(est.grads, s, p, stats=est.stats)
    else:
      loss, g = jax.value_and_grad(autoencoder.loss_fn)(p, batch)
      u_s = tx.update(g, s, p, batch=batch)
    u, s = u_s
    return (optax.apply_updates(p, u), s, key), loss

  return Jitted(f"ours {style}", step,
                (params, tx.init(params), jax.random.PRNGKey(args.seed)))


def sgd(params, args):
  tx = optax.sgd(args.lr, momentum=0.9)

  def step(carry, batch):
    p, s = carry
    loss, g = jax.value_and_grad(autoencoder.loss_fn)(p, batch)
    u, s = tx.update(g, s, p)
    return (optax.apply_updates(p, u), s), loss

  return Jitted("SGD-momentum", step, (params, tx.init(params)))


def make_batches(args, dims):
  rng = np.random.default_rng(args.seed)
  n = 4
  note = "random uniform inputs (--random-data)"
  x = None
  if not args.random_data:
    try:
      data = _data.load_mnist(args.mnist, not args.no_download)
      x = data.train_x.reshape(len(data.train_x), -1)
      note = data.source
    except _data.DataUnavailable as e:
      note = f"random uniform inputs (MNIST unavailable: {e})"
  if x is None or x.shape[1] != dims[0] or len(x) < n * args.batch:
    x = rng.uniform(size=(n * args.batch, dims[0])).astype(np.float32)
  idx = rng.permutation(len(x))[:n * args.batch].reshape(n, args.batch)
  return [{"x": jnp.asarray(x[i])} for i in idx], note


def time_round_robin(configs, batches, rounds, steps):
  """``{name: [(median, mean) per round]}`` after one compiling step each."""
  first = {}
  for c in configs:
    t = time.perf_counter()
    c.step(batches[0])
    first[c.name] = time.perf_counter() - t
  out = {c.name: [] for c in configs}
  k = 1
  for _ in range(rounds):
    times = {c.name: [] for c in configs}
    for _ in range(steps):
      for c in configs:
        t = time.perf_counter()
        c.step(batches[k % len(batches)])
        times[c.name].append(time.perf_counter() - t)
      k += 1
    for name, ts in times.items():
      out[name].append((statistics.median(ts), statistics.mean(ts)))
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
  dims = QUICK if args.quick else FULL
  batches, note = make_batches(args, dims)
  args.budget, args.evals, args.max_steps = 0, 0, None
  args.blas = H._blas_pools(args.blas_threads)
  H.environment(args, note, f"autoencoder {'-'.join(map(str, dims))}, batch "
                f"{args.batch}")
  print(f"settings: damping {args.damping} (pi-adjusted), lr {args.lr}, "
        f"momentum 0.9, cov EMA {args.cov_decay} every step, inverses every "
        f"{args.inverse_every} steps, Fisher with 1 sampled target, no norm "
        f"constraint, no burn-in; {args.rounds} round(s) of {args.steps} "
        "steps, round-robin")
  params = autoencoder.init_params(dims, jax.random.PRNGKey(args.seed))
  configs = [sgd(params, args)]
  configs += [ours(params, batches[0], args, s) for s in args.styles.split(",")]
  if kfac_jax is not None:
    configs.append(KfacJax(kfac_jax, params, batches[0], args))
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
