"""A short K-FAC training run: ``python -m kfac_jax_lite.demo``.

Trains a 2-hidden-layer tanh MLP classifier on a synthetic 10-class problem
(a random teacher network labels Gaussian inputs) with
``optax.chain(kfl.kfac(loss_fn, batch), optax.sgd(lr, momentum=0.9))`` and
``kfl.kfac``'s defaults (the README's recommended settings): the tagging
finds the three dense layers, the Fisher statistics come from targets
sampled from the model, in the same forward pass as the loss and gradient
(``kfl.value_grad_and_stats``, then ``tx.update(..., stats=est.stats)``).
``kfl.health`` prints the run's counters at the end. Plain SGD with momentum runs beside it for
comparison, at its own best learning rate of {0.05, 0.1, 0.3, 1.0} on this
problem (0.3). Only jax, optax and the library are needed.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import optax

import kfac_jax_lite as kfl

SIZES = (20, 64, 64, 10)


def init_params(key):
  keys = jax.random.split(key, len(SIZES) - 1)
  return [(jax.random.normal(k, (i, o)) / jnp.sqrt(i), jnp.zeros(o))
          for k, i, o in zip(keys, SIZES[:-1], SIZES[1:])]


def forward(params, x):
  """Logits and the input of each layer."""
  inputs, h = [], x
  for i, (w, b) in enumerate(params):
    inputs.append(h)
    h = h @ w + b
    h = jnp.tanh(h) if i < len(params) - 1 else h
  return h, inputs


def loss_fn(params, x, y):
  logits, _ = forward(params, x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_data(key, n):
  k1, k2 = jax.random.split(key)
  teacher = init_params(k1)
  x = jax.random.normal(k2, (n, SIZES[0]))
  logits, _ = forward(teacher, x)
  return x, jnp.argmax(3 * logits, axis=-1)


def kfac_loss(params, batch):
  """The same loss, through the registered loss so K-FAC can sample it."""
  logits, _ = forward(params, batch["x"])
  return kfl.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def train(steps, lr, use_kfac, seed=0, batch=256):
  key = jax.random.PRNGKey(seed)
  data_key, init_key, key = jax.random.split(key, 3)
  x_all, y_all = make_data(data_key, 4096)
  params = init_params(init_key)
  example = {"x": x_all[:batch], "y": y_all[:batch]}
  opt = optax.sgd(lr, momentum=0.9)
  if use_kfac:
    opt = optax.chain(kfl.kfac(kfac_loss, example), opt)
    # Loss, gradient and statistics from one forward pass.
    est_fn = kfl.value_grad_and_stats(kfac_loss, params, example)
  opt_state = opt.init(params)

  @jax.jit
  def step(params, opt_state, key):
    data_key, stats_key = jax.random.split(key)
    idx = jax.random.choice(data_key, x_all.shape[0], (batch,), replace=False)
    b = {"x": x_all[idx], "y": y_all[idx]}
    if use_kfac:
      # Statistics only on the steps the plan uses them (kfl.describe).
      est = est_fn(params, b, stats_key, with_stats=kfl.stats_due(opt_state))
      loss = est.loss
      updates, opt_state = opt.update(est.grads, opt_state, params,
                                      stats=est.stats, loss=est.loss)
    else:
      loss, grads = jax.value_and_grad(kfac_loss)(params, b)
      updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for _ in range(steps):
    key, sub = jax.random.split(key)
    params, opt_state, loss = step(params, opt_state, sub)
    losses.append(float(loss))
  return losses, loss_fn(params, x_all, y_all), opt_state


def main(argv=None):
  parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--lr", type=float, default=0.01,
                      help="K-FAC + SGD learning rate (the README's 0.01 "
                      "with the defaults)")
  parser.add_argument("--sgd-lr", type=float, default=0.3)
  args = parser.parse_args(argv)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; MLP {SIZES}, "
        f"{args.steps} steps, momentum 0.9, lr {args.lr} (K-FAC) and "
        f"{args.sgd_lr} (SGD)")
  t0 = time.perf_counter()
  kfac_losses, kfac_final, kfac_state = train(args.steps, args.lr, True)
  t1 = time.perf_counter()
  sgd_losses, sgd_final, _ = train(args.steps, args.sgd_lr, False)
  print(f"{'step':>6} {'K-FAC loss':>12} {'SGD loss':>12}")
  for i in list(range(0, args.steps, max(1, args.steps // 10))) + [args.steps - 1]:
    print(f"{i:>6} {kfac_losses[i]:>12.4f} {sgd_losses[i]:>12.4f}")
  print(f"full-data loss after training: K-FAC {float(kfac_final):.4f}, "
        f"SGD {float(sgd_final):.4f} (K-FAC run took {t1 - t0:.1f}s)")
  health = kfl.health(kfac_state)
  print(health)
  if not kfac_losses[-1] < kfac_losses[0]:
    raise SystemExit("the K-FAC loss did not fall")
  if not health.ok:
    raise SystemExit("the K-FAC run skipped or replaced updates")


if __name__ == "__main__":
  main()
