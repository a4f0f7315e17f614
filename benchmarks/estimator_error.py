"""Relative error of each estimation mode's factors against the exact ones.

    python benchmarks/estimator_error.py

A 64-32-32-10 tanh MLP on 256 scikit-learn digits (softmax cross-entropy,
mean reduction). ``"exact"`` backpropagates every column of the output
Fisher's square root, so its factors are the reference; the table gives
``‖G_mode - G_exact‖_F / ‖G_exact‖_F`` per layer (the input factors ``A``
do not depend on the mode) for several sample counts, each the mean over
5 seeds.
"""
import jax
import jax.numpy as jnp
import numpy as np
from sklearn.datasets import load_digits

import kfac_jax_lite as kfl

SIZES = (64, 32, 32, 10)


def main():
  x, y = load_digits(return_X_y=True)
  batch = {"x": jnp.asarray(x[:256] / 16.0, jnp.float32), "y": jnp.asarray(y[:256])}
  keys = jax.random.split(jax.random.PRNGKey(0), len(SIZES))
  params = [(jax.random.normal(k, (i, o)) / np.sqrt(i), jnp.zeros(o))
            for k, i, o in zip(keys, SIZES[:-1], SIZES[1:])]

  def loss_fn(p, b):
    h = b["x"]
    for i, (w, c) in enumerate(p):
      h = h @ w + c
      h = jnp.tanh(h) if i < len(p) - 1 else h
    return kfl.softmax_cross_entropy_with_integer_labels(h, b["y"]).mean()

  def factors(mode, samples, seed):
    fn = kfl.value_grad_and_stats(loss_fn, params, batch, estimation=mode,
                                  num_samples=samples)
    return jax.jit(fn)(params, batch, jax.random.PRNGKey(seed)).stats

  exact = factors("exact", 1, 0)
  names = sorted(exact)
  print(f"{'mode':<20} {'samples':>7} " + " ".join(f"{n:>10}" for n in names))
  for mode in ("fisher", "curvature_prop", "empirical"):
    for samples in ((1,) if mode == "empirical" else (1, 4, 16, 64)):
      errs = []
      for seed in range(1 if mode == "empirical" else 5):
        est = factors(mode, samples, seed + 1)
        errs.append([float(jnp.linalg.norm(est[n].g - exact[n].g) /
                           jnp.linalg.norm(exact[n].g)) for n in names])
      row = np.mean(errs, axis=0)
      print(f"{mode:<20} {samples:>7} " + " ".join(f"{e:>10.3f}" for e in row))


if __name__ == "__main__":
  main()
