"""Time to a target loss on the Martens & Grosse MNIST autoencoder.

    python benchmarks/autoencoder.py            # 784-1000-500-250-30-250-500-1000-784, batch 1000, 100 s per run
    python benchmarks/autoencoder.py --quick    # digits, 64-32-8-32-64, 8 steps: a smoke run of seconds

The deep autoencoder of Hinton & Salakhutdinov (2006) as Martens & Grosse
(2015) and kfac-jax's example train it: tanh hidden layers, a linear 30-unit
code, sigmoid cross-entropy summed over the 784 pixels and averaged over
the batch, no weight decay; weights ``N(0, 1/fan_in)``, zero biases. It
trains on the 50 000 MNIST training images in seeded random batches of
1000 and is evaluated on a fixed 5 000-image subset of them (this is an
optimization benchmark). Every optimizer gets the same wall-clock budget
of its own training clock (``_harness``), at its best learning rate from
the stated grid:

* Adam, SGD with momentum 0.9, Muon (``optax.contrib.muon`` with its
  defaults, Adam at ``adam_lr`` on the biases): ``jax.value_and_grad`` then
  ``tx.update``;
* ``optax.chain(kfl.kfac(loss_fn, batch), optax.sgd(lr, momentum=0.9))``
  with the library's **defaults** (only ``lr`` from the grid), and the same
  at its best over a small damping x lr grid (the defaults' runs compete
  too; the damping grid is high because this loss sums 784 pixels: M&G
  and kfac-jax start their adaptive damping at 150, and in a first run
  every damping <= 0.1 diverged); stepped in the one-pass style
  (``kfl.value_grad_and_stats`` then ``tx.update(..., stats=est.stats)``)
  unless ``--kfac-style batch=``;
* ``kfl.kfac_optimizer(loss_fn, batch)`` with its defaults (adaptive
  damping, learning rate and momentum), ``tx.update(..., batch=batch)``;
* ``kfl.eigen_adam`` (Adam in the eigenbasis of K-FAC's factors) and
  its Shampoo-basis control (SOAP), chained with
  ``optax.scale_by_learning_rate(lr)`` on Adam's lr grid;
* kfac-jax 0.0.8 when it is importable (it needs jax 0.9.1; see
  ``benchmarks/README.md``), with the settings of its own autoencoder
  example (adaptive damping, learning rate and momentum, inverse period 5,
  5 burn-in steps, initial damping 150) except ``l2_reg = 0`` and
  minibatches of 1000 instead of the full batch.

The table gives per optimizer the median step time and its ratio to SGD's,
the first (compiling) step, the steps and the final evaluation loss within
the budget, and the training-clock seconds to reach Adam's final loss
(the target) with Adam's time over it. It writes ``results/autoencoder.json``
and ``results/autoencoder.png`` (loss against steps and seconds).
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

import _harness as H  # noqa: E402
import _models as M  # noqa: E402
import _report  # noqa: E402
import _timing as T  # noqa: E402

QUICK_HIDDEN = (32, 8, 32)  # --quick (or inputs that are not 784 pixels).
loss_fn = M.autoencoder_loss  # The model is _models' autoencoder.


def families(params, example, args):
  """The optimizers and their grids (``_harness.Family``)."""
  optax_family = H.optax_families(loss_fn, params, example, args.seed)

  quick = args.quick
  out = [
      optax_family("adam", "Adam", {"lr": [3e-3] if quick else
                                    [3e-4, 1e-3, 3e-3]},
                   lambda lr: optax.adam(lr)),
      optax_family("sgd", "SGD-momentum", {"lr": [3e-3] if quick else
                                           [1e-3, 3e-3, 1e-2]},
                   lambda lr: optax.sgd(lr, momentum=0.9), note="momentum 0.9"),
  ]
  out += H.muon_families(
      optax_family, [2e-2] if quick else [1e-2, 3e-2, 1e-1], 1e-3,
      "Newton-Schulz on the weight matrices, Adam(adam_lr) on biases")
  kfac_lrs = [3e-2] if quick else [1e-2, 3e-2, 1e-1]
  out += [
      *H.kfac_families(optax_family, loss_fn, example, kfac_lrs,
                       [1.0] if quick else [1.0, 10.0, 100.0],
                       [1e-1] if quick else [3e-2, 3e-1], args.kfac_style),
      # Issue 26: Adam in the factors' eigenbasis, K-FAC's and Shampoo's
      # (SOAP); Adam's lr grid (README Results: where it pays).
      *H.eigen_adam_families(optax_family, loss_fn, example,
                             [3e-3] if quick else [3e-4, 1e-3, 3e-3], args.kfac_style),
  ]
  # Issue 25: the amortisation presets at the defaults' best lr (README
  # Results), one setting moved at a time.
  out.append(H.amortised_family(loss_fn, params, example, 3e-2,
                                args.kfac_style, args.seed))
  kfac_jax_family = _kfac_jax_family(params, args)
  if kfac_jax_family is not None:
    out.append(kfac_jax_family)
  return out


# ------------------------------------------------------------- kfac-jax

def _kfac_jax_family(params, args):
  try:
    import kfac_jax
  except ImportError as e:
    print(f"kfac-jax: skipped (not importable here: {e}; see "
          "benchmarks/README.md for its jax 0.9.1 virtualenv)")
    return None
  settings = dict(inverse_update_period=5, damping_adaptation_interval=5,
                  num_burnin_steps=5, curvature_ema=0.95,
                  damping_adaptation_decay=0.95, initial_damping=150.0,
                  min_damping=1e-5, max_damping=1000.0)
  if args.quick:
    settings.update(num_burnin_steps=1, initial_damping=1.0)

  def build():
    return T.KfacJaxStepper(
        kfac_jax, M.autoencoder_kfac_jax_loss, params, args.seed,
        use_adaptive_learning_rate=True, use_adaptive_momentum=True,
        use_adaptive_damping=True, estimation_mode="fisher_gradients",
        **settings)

  cand = H.Candidate("kfac-jax 0.0.8", {"config": "its example"}, "kfac-jax",
                     build)
  return H.Family("kfac_jax", "kfac-jax 0.0.8", {}, lambda s: cand,
                  note="its autoencoder example's settings: " + ", ".join(
                      f"{k}={v}" for k, v in settings.items())
                  + ", adaptive lr/momentum/damping, l2_reg=0")


# ----------------------------------------------------------------- main

def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  H.add_common_args(p)
  p.add_argument("--batch", type=int, default=None,
                 help="batch size (default 1000; quick: 128)")
  p.add_argument("--eval-size", type=int, default=None,
                 help="fixed training subset for the evaluation loss "
                 "(default 5000; quick: 512)")
  H.add_image_args(p)
  p.add_argument("--kfac-style", choices=("1-pass", "batch="), default="1-pass",
                 help="how the kfl.kfac rows step (module docstring)")
  args = H.finish_args(p.parse_args(argv))
  batch_size = args.batch or (128 if args.quick else 1000)
  eval_size = args.eval_size or (512 if args.quick else 5000)
  data, note = H.load_images(args)
  x = data.train_x.reshape(len(data.train_x), -1)
  d = x.shape[1]
  dims = (M.AUTOENCODER if d == 784 and not args.quick
          else (d,) + QUICK_HIDDEN + (d,))
  rng = np.random.default_rng(args.seed)
  eval_x = jnp.asarray(x[rng.permutation(len(x))[:eval_size]])
  train_x = jnp.asarray(x)
  env = H.environment(args, note, f"autoencoder {'-'.join(map(str, dims))} "
                      f"(tanh, linear code), batch {batch_size}, sigmoid "
                      f"cross-entropy .sum(-1).mean(); evaluation loss on a "
                      f"fixed {len(eval_x)}-image training subset")

  take = jax.jit(lambda data, idx: {"x": data[idx]})
  params = M.autoencoder_init(dims, jax.random.PRNGKey(args.seed))
  example = take(train_x, np.arange(batch_size, dtype=np.int32))
  fams = families(params, example, args)
  cands, grids = H.candidates(fams, args)
  H.print_grids(grids, fams)

  @jax.jit
  def evaluate(params):
    return {"loss": loss_fn(params, {"x": eval_x})}

  def batches():
    return H.batch_stream(lambda idx: take(train_x, idx), len(train_x),
                          batch_size, args.seed + 1)

  metrics = [H.Metric("loss", "eval loss", "min")]
  return _report.run_and_report("autoencoder", cands, batches, evaluate, args,
                                env, grids, metrics, "Adam")


if __name__ == "__main__":
  main()
