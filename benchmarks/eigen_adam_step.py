"""What a ``kfl.eigen_adam`` step costs against Adam's, and its FLOP floor.

    python benchmarks/eigen_adam_step.py            # MNIST autoencoder, batch 1000
    python benchmarks/eigen_adam_step.py --quick    # 784-256-64-256-784, batch 64, 5 rounds

Times one jitted, donated step (``_timing.Stepper``) of each configuration
on the autoencoder of ``autoencoder.py`` (random inputs: a step's time does
not depend on the values), round-robin so that a drifting machine slows
all alike, after two warm-up steps each:

* Adam (``jax.value_and_grad`` then ``optax.adam``);
* ``kfl.eigen_adam`` in K-FAC's basis, in the one-pass style
  (``kfl.value_grad_and_stats``, ``stats=``), with ``cov_every`` 1, 5 and
  10 (above 1 stepped with ``with_stats=kfl.stats_due(state)``, so the
  sampled pass is skipped where the transform does not fold), and with
  ``refresh="power"``;
* SOAP (``basis="shampoo"``), ``cov_every`` 1 and 5.

It prints per configuration the median step, the mean step (which carries
the refreshes: every ``refresh_every = 10`` steps), both over Adam's
median, and the FLOP floor of the rotations: rotating a layer's ``a x b``
matrix in and the step back out costs ``4ab(a + b)`` against ``6Nab`` for
its share of Adam's forward and backward pass at batch ``N``. On this model
at batch 1000 that floor is 1.06x Adam's step (``eigen_adam``'s module
docstring).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import optax  # noqa: E402

import _harness as H  # noqa: E402
import _models as M  # noqa: E402
import _timing as T  # noqa: E402
from _harness import kfl  # noqa: E402


def rotation_floor(dims, batch):
  """FLOPs over those of Adam's step (``6Nab`` a layer: forward, input and
  weight gradients) of the rotations (``4ab(a + b)``), the statistics'
  products ``Xᵀ X``, ``Gᵀ G`` (``2N(a² + b²)``) and the sampled backward
  pass (the layers' output cotangents: ``2Nab``), for the dense layers
  ``dims`` (the bias in the input factor)."""
  layers = [(i + 1, o) for i, o in zip(dims[:-1], dims[1:])]
  step = sum(6 * batch * a * b for a, b in layers)
  rotate = sum(4 * a * b * (a + b) for a, b in layers)
  products = sum(2 * batch * (a * a + b * b) for a, b in layers)
  sampled = sum(2 * batch * a * b for a, b in layers)
  return rotate / step, products / step, sampled / step


def configurations(loss_fn, batch):
  """``[(name, tx, style)]``: Adam, then the ``eigen_adam`` variants."""
  lr = optax.scale_by_learning_rate(1e-3)

  def ea(**options):
    return optax.chain(kfl.eigen_adam(loss_fn, batch, **options), lr)
  return [
      ("Adam", optax.adam(1e-3), "grad"),
      ("eigen_adam, 1-pass", ea(), "1-pass"),
      ("eigen_adam cov_every=5", ea(cov_every=5), "cov"),
      ("eigen_adam cov_every=10", ea(cov_every=10), "cov"),
      ("eigen_adam cov_every=10 power", ea(cov_every=10, refresh="power"),
       "cov"),
      ("SOAP", ea(basis="shampoo"), "grad"),
      ("SOAP cov_every=5", ea(basis="shampoo", cov_every=5), "grad"),
  ]


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true",
                 help="small model, batch 64, 5 rounds (a smoke run)")
  p.add_argument("--rounds", type=int, default=40,
                 help="timed rounds per configuration (default 40)")
  p.add_argument("--blas-threads", type=int, default=0,
                 help="cap the OpenBLAS pools at N threads (default 0: as "
                 "found)")
  args = p.parse_args(argv)
  args.blas = H.blas_pools(args.blas_threads)
  dims = M.AUTOENCODER_SMALL if args.quick else M.AUTOENCODER
  batch_size = 64 if args.quick else 1000
  rounds = 5 if args.quick else args.rounds
  params, batch = M.random_problem(dims, batch_size)
  loss_fn = M.autoencoder_loss
  H.environment(args, "random inputs (a step's time does not depend on "
                "the values)", f"autoencoder {'-'.join(map(str, dims))}, "
                f"batch {batch_size}; {rounds} rounds round-robin after 2 "
                "warm-up steps each")

  configs = configurations(loss_fn, batch)
  steppers = [T.Stepper(loss_fn, params, tx, style, batch, name=name)
              for name, tx, style in configs]
  for s in steppers:
    s.step(batch)
    s.step(batch)
  times = T.round_robin([s.step for s in steppers], [batch], rounds)
  adam = statistics.median(times[0])
  rotate, products, sampled = rotation_floor(dims, batch_size)
  print(f"\nFLOPs over Adam's step: rotations {rotate:.2f}x, the statistics' "
        f"products {products:.2f}x, the sampled backward pass {sampled:.2f}x"
        f" (a step in K-FAC's basis costs at least "
        f"{1 + rotate + products + sampled:.2f}x Adam's with its statistics "
        f"on every step, {1 + rotate:.2f}x without them)")
  print(f"{'configuration':32s}{'style':>8s}{'median ms':>11s}"
        f"{'/ Adam':>8s}{'mean ms':>9s}{'/ Adam':>8s}")
  rows = []
  for (name, _, style), ts in zip(configs, times):
    median, mean = statistics.median(ts), statistics.mean(ts)
    rows.append(dict(name=name, median_ms=1e3 * median, mean_ms=1e3 * mean))
    print(f"{name:32s}{style:>8s}{1e3 * median:11.1f}{median / adam:7.2f}x"
          f"{1e3 * mean:9.1f}{mean / adam:7.2f}x")
  print("mean: with the refreshes (eigh or a power step every 10 steps)")
  return rows


if __name__ == "__main__":
  main()
