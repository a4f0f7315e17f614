"""What a K-FAC step without statistics or refresh costs beyond SGD's, by part.

    python benchmarks/quiet_step.py            # the MNIST autoencoder, batch 1000
    python benchmarks/quiet_step.py --steps 25

Most steps of the planned defaults (issue 46) are quiet: the statistics
and the refresh are due every ``cov_every`` / ``inverse_every`` steps, so
the mean step is the quiet step plus their share. This prints the median
quiet step (after the young refreshes, ``jax.block_until_ready``-ed,
round-robin) of the README's one-pass K-FAC + SGD step at the defaults,
against SGD with momentum, the estimator without statistics followed by
SGD (``with_stats=False``: the gradient alone through
``value_grad_and_stats``), and the K-FAC step with its preconditioning
replaced by the identity (the name ``kfac_jax_lite.optimizers.transform``
calls it by, as ``compile_parts.py`` does), with ``norm_constraint=None``
too. The differences price the preconditioning products and the rest of
``tx.update`` (the conditionals of the statistics and refresh, the
guards, the health counters). Each round runs every row's step
once, so drift slows all alike; compare ratios.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _models as M  # noqa: E402
import _timing  # noqa: E402
from _kfl import kfl  # noqa: E402


def rows(loss_fn, params, batch, lr=0.01):
  """``[(name, step)]``: each ``step(batch)`` one blocked update."""
  import jax
  import optax
  from kfac_jax_lite.optimizers import transform as T

  if not callable(getattr(T, "precondition", None)):  # Renamed: no silent row.
    raise SystemExit("kfac_jax_lite.optimizers.transform has no precondition")
  sgd = lambda: optax.sgd(lr, momentum=0.9)

  def stepper(tx, style="cov", identity=False):
    saved = T.precondition
    if identity:
      T.precondition = lambda layers, states, leaves, lam, power: list(leaves)
    try:
      s = _timing.Stepper(loss_fn, params, tx, style, batch)
      s.step(batch)  # Compiled under the replacement.
    finally:
      T.precondition = saved
    return s.step

  est_fn = kfl.value_grad_and_stats(loss_fn, params, batch)
  plain = optax.with_extra_args_support(sgd())

  @jax.jit
  def est_sgd(carry, b):
    p, s, key = carry
    key, sub = jax.random.split(key)
    e = est_fn(p, b, sub, with_stats=False)
    u, s = plain.update(e.grads, s, p)
    return (optax.apply_updates(p, u), s, key), e.loss

  carry = [(params, plain.init(params), jax.random.PRNGKey(0))]

  def est_step(b):
    carry[0], loss = est_sgd(carry[0], b)
    return jax.block_until_ready(loss)

  est_step(batch)
  kfac = lambda **kw: optax.chain(kfl.kfac(loss_fn, batch, **kw), sgd())
  return [("SGD (momentum 0.9)", stepper(plain, "grad")),
          ("estimator, with_stats=False, + SGD", est_step),
          ("K-FAC + SGD, preconditioning = identity", stepper(kfac(),
                                                              identity=True)),
          ("  ... and norm_constraint=None",
           stepper(kfac(norm_constraint=None), identity=True)),
          ("K-FAC + SGD (defaults)", stepper(kfac()))]


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=25, help="timed rounds")
  p.add_argument("--warmup", type=int, default=40,
                 help="rounds first (past the young refreshes at 1, 2, 4, ...)")
  args = p.parse_args(argv)
  import jax
  loss_fn = M.make_autoencoder_loss()
  params, batch = M.random_problem(M.AUTOENCODER, 1000)
  plan = kfl.describe(loss_fn, params, batch).plan
  print(f"$ python benchmarks/quiet_step.py {' '.join(argv or sys.argv[1:])}"
        f"   # {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}")
  print(f"jax {jax.__version__}, {jax.devices()[0].platform} "
        f"({os.cpu_count()} CPUs); autoencoder {M.AUTOENCODER}, batch 1000")
  print(plan.line)
  table = rows(loss_fn, params, batch)
  _timing.round_robin([s for _, s in table], [batch], args.warmup)
  times = _timing.round_robin([s for _, s in table], [batch], args.steps)
  base = statistics.median(times[0])
  print(f"{'step':42s} {'median ms':>10s} {'x SGD':>6s}")
  for (name, _), ts in zip(table, times):
    med = statistics.median(ts)
    print(f"{name:42s} {1e3 * med:10.1f} {med / base:5.2f}x")


if __name__ == "__main__":
  main()
