"""A short check that ``kfl.kfac`` at its defaults trains the MNIST autoencoder.

``python benchmarks/autoencoder_check.py [--steps 60]``: the model and loss of
``benchmarks/autoencoder.py`` (``_models``: 784-1000-500-250-30-250-500-
1000-784, batch 1000, sigmoid cross-entropy summed over pixels),
``optax.chain(kfl.kfac(loss_fn, batch), optax.sgd(lr, momentum=0.9))`` at
lr 0.01, 0.03 and 0.1 against Adam 1e-3, the same minibatches for all.
Prints the evaluation loss (a fixed 5000-image training subset) every 10
steps, the wall time of each run (compilation included) and ``kfl.health``
of the K-FAC states. A quick look, not the time-to-target benchmark
(``benchmarks/autoencoder.py``).
"""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import _data
import _models as M
import _timing as T
from _harness import kfl

loss_fn = M.autoencoder_loss


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=60)
  p.add_argument("--lrs", type=float, nargs="+", default=[0.01, 0.03, 0.1])
  p.add_argument("--mnist", default=None, help="a local mnist.pkl.gz")
  args = p.parse_args()
  data = _data.load_mnist(args.mnist)
  x = data.train_x.reshape(len(data.train_x), -1).astype(np.float32)
  evaluation = {"x": jnp.asarray(x[:5000])}
  batch_size = 1000
  params0 = M.autoencoder_init(M.AUTOENCODER, jax.random.PRNGKey(0))
  example = {"x": jnp.asarray(x[:batch_size])}
  eval_loss = jax.jit(loss_fn)
  print(f"jax {jax.__version__} on {jax.default_backend()}; {data.source}; "
        f"batch {batch_size}, {args.steps} steps")
  configs = [("adam 1e-3", optax.adam(1e-3), False)] + [
      (f"kfac defaults + sgd({lr})",
       optax.chain(kfl.kfac(loss_fn, example), optax.sgd(lr, momentum=0.9)),
       True) for lr in args.lrs]
  for name, tx, is_kfac in configs:
    stepper = T.Stepper(loss_fn, params0, tx, "batch=" if is_kfac else "grad")
    rng = np.random.default_rng(0)
    start, out = time.time(), []
    for t in range(args.steps):
      idx = rng.integers(0, len(x), batch_size)
      stepper.step({"x": jnp.asarray(x[idx])})
      if t % 10 == 9 or t == args.steps - 1:
        value = float(eval_loss(stepper.params(), evaluation))
        out.append(f"{t + 1}:{value:.1f}")
    print(f"{name:26s} {time.time() - start:5.0f} s  " + " ".join(out),
          flush=True)
    if is_kfac:
      print("   ", kfl.health(stepper.opt_state()[0]), flush=True)


if __name__ == "__main__":
  main()
