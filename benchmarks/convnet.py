"""Time to a target loss and accuracy of a small conv net on MNIST.

    python benchmarks/convnet.py            # MNIST 28x28, batch 256, 100 s per run
    python benchmarks/convnet.py --quick    # digits 8x8, two tiny conv layers, 8 steps

The classifier: three 3x3 convolutions (16, 32, 64 channels, ``SAME``
padding) each followed by a normalisation of the example's whole feature
map with a learned per-channel scale and shift, and a ReLU; 2x2 average
pooling after the first two; a global average, a dense layer of 128 ReLU
units and a dense layer of 10 logits (33 130 parameters); softmax
cross-entropy averaged over the batch. Plain JAX (``lax.conv_general_dilated``
in NHWC/HWIO), weights ``N(0, 1/fan_in)`` (He-scaled for the ReLU layers),
zero biases and shifts, unit scales.

It trains on the 50 000 MNIST training images in seeded random batches and
is evaluated on a fixed 2 000-image subset of them (train loss) and on the
10 000 test images (accuracy). Optimizers, clock, grids and report as in
``autoencoder.py`` (see ``_harness``): Adam, SGD-momentum and Muon (its
Newton-Schulz step on the dense matrices and on the conv kernels seen as
``(3·3·C_in) x C_out`` matrices, Adam on the rest) at their best learning
rate, ``kfl.kfac`` + SGD at the defaults and tuned,
``kfl.kfac_optimizer``, and ``kfl.eigen_adam`` with K-FAC's and with
Shampoo's basis (SOAP) on Adam's lr grid. There are two targets: Adam's final train loss and
Adam's final test accuracy. Writes ``results/convnet.json`` and ``.png``.
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

FULL = dict(channels=(16, 32, 64), hidden=128)
QUICK = dict(channels=(4, 8), hidden=16)


loss_fn = M.convnet_loss  # The model is _models' conv net.


def families(params, example, args):
  optax_family = H.optax_families(loss_fn, params, example, args.seed)

  q = args.quick
  out = [
      optax_family("adam", "Adam", {"lr": [3e-3] if q else [3e-4, 1e-3, 3e-3]},
                   lambda lr: optax.adam(lr)),
      optax_family("sgd", "SGD-momentum", {"lr": [0.1] if q else [0.03, 0.1, 0.3]},
                   lambda lr: optax.sgd(lr, momentum=0.9), note="momentum 0.9"),
  ]
  out += H.muon_families(
      optax_family, [0.02] if q else [0.01, 0.03, 0.1], 3e-3,
      "Newton-Schulz on conv kernels and dense matrices, Adam(adam_lr) on "
      "biases and norms", dims=M.convnet_muon_dims)
  out += [
      *H.kfac_families(optax_family, loss_fn, example,
                       [0.03] if q else [0.01, 0.03, 0.1],
                       [0.1] if q else [1e-2, 1e-1, 1.0],
                       [0.1] if q else [0.03, 0.1], args.kfac_style),
      # Issue 26: Adam in the factors' eigenbasis, K-FAC's and Shampoo's
      # (SOAP); Adam's lr grid (README Results: where it pays).
      *H.eigen_adam_families(optax_family, loss_fn, example,
                             [3e-3] if q else [3e-4, 1e-3, 3e-3], args.kfac_style),
  ]
  # Issue 25: the amortisation presets at the defaults' best lr (README
  # Results), one setting moved at a time.
  out.append(H.amortised_family(loss_fn, params, example, 1e-2,
                                args.kfac_style, args.seed))
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  H.add_common_args(p, evals=25)
  p.add_argument("--batch", type=int, default=None,
                 help="batch size (default 256; quick: 64)")
  p.add_argument("--eval-size", type=int, default=None,
                 help="fixed training subset for the train loss (default "
                 "2000; quick: 256)")
  H.add_image_args(p)
  p.add_argument("--kfac-style", choices=("1-pass", "batch="), default="1-pass")
  args = H.finish_args(p.parse_args(argv))
  batch_size = args.batch or (64 if args.quick else 256)
  eval_size = args.eval_size or (256 if args.quick else 2000)
  data, note = H.load_images(args)
  widths = QUICK if args.quick else FULL
  rng = np.random.default_rng(args.seed)
  sub = rng.permutation(len(data.train_x))[:eval_size]
  train = {"x": jnp.asarray(data.train_x), "y": jnp.asarray(data.train_y)}
  probe = {"x": jnp.asarray(data.train_x[sub]), "y": jnp.asarray(data.train_y[sub])}
  chunk = 1000 if len(data.test_x) % 1000 == 0 else len(data.test_x)
  test_x = jnp.asarray(data.test_x).reshape((-1, chunk) + data.test_x.shape[1:])
  test_y = jnp.asarray(data.test_y).reshape(-1, chunk)
  params = M.convnet_init(widths["channels"], widths["hidden"],
                       jax.random.PRNGKey(args.seed))
  n_params = sum(x.size for x in jax.tree.leaves(params))
  side = data.train_x.shape[1]
  env = H.environment(
      args, note, f"conv net {side}x{side}: conv3x3 {widths['channels']} + "
      f"per-example norm (scale, shift) + ReLU, avg-pool, global mean, dense "
      f"{widths['hidden']}, dense 10 ({n_params} parameters), batch "
      f"{batch_size}; train loss on a fixed {len(sub)}-image training subset,"
      f" accuracy on {len(data.test_x)} test images")

  take = jax.jit(lambda d, idx: jax.tree.map(lambda a: a[idx], d))
  example = take(train, np.arange(batch_size, dtype=np.int32))
  fams = families(params, example, args)
  cands, grids = H.candidates(fams, args)
  H.print_grids(grids, fams)

  @jax.jit
  def evaluate(params):
    def correct(xy):
      return (M.convnet_logits(params, xy[0]).argmax(-1) == xy[1]).sum()
    hits = jax.lax.map(correct, (test_x, test_y)).sum()
    return {"loss": loss_fn(params, probe),
            "accuracy": hits / (test_x.shape[0] * test_x.shape[1])}

  def batches():
    return H.batch_stream(lambda idx: take(train, idx), len(data.train_x),
                          batch_size, args.seed + 1)

  metrics = [H.Metric("loss", "train loss", "min"),
             H.Metric("accuracy", "test acc", "max")]
  return _report.run_and_report("convnet", cands, batches, evaluate, args,
                                env, grids, metrics, "Adam")


if __name__ == "__main__":
  main()
