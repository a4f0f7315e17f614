"""A short K-FAC training run: ``python -m kfac_jax_lite.demo``.

Trains a 2-hidden-layer tanh MLP classifier on a synthetic 10-class problem
(a random teacher network labels Gaussian inputs), preconditioning the
gradient with one ``KroneckerDense`` block per layer: the layer inputs come
from the forward pass, the output cotangents from a backward pass of the
loss on targets sampled from the model (the Fisher), exactly as the blocks
document. Plain SGD with momentum runs beside it for comparison, at its own
best learning rate of {0.05, 0.1, 0.3, 1.0} on this problem (0.3). Only
jax, optax and the library are needed.
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


def forward(params, x, probes=None):
  """Logits, the inputs of each layer, with zero probes added to its outputs."""
  inputs, h = [], x
  for i, (w, b) in enumerate(params):
    inputs.append(h)
    s = h @ w + b
    if probes is not None:
      s = s + probes[i]
    h = jnp.tanh(s) if i < len(params) - 1 else s
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


BLOCKS = [kfl.KroneckerDense((i, o), has_bias=True)
          for i, o in zip(SIZES[:-1], SIZES[1:])]


def kfac_stats(params, x, key):
  """Per-layer Kronecker statistics with targets sampled from the model."""
  n = x.shape[0]
  probes = [jnp.zeros((n, o)) for o in SIZES[1:]]
  (logits, inputs), vjp = jax.vjp(lambda p: forward(params, x, p), probes)
  sampled = jax.random.categorical(key, jax.lax.stop_gradient(logits))
  # ∂ℓ_i/∂logits for ℓ_i = CE(logits_i, sampled_i), back to every layer.
  dlogits = jax.nn.softmax(logits) - jax.nn.one_hot(sampled, SIZES[-1])
  (cotangents,) = vjp((dlogits, [jnp.zeros_like(a) for a in inputs]))
  return [blk.compute_stats(a, g) for blk, a, g in zip(BLOCKS, inputs, cotangents)]


def train(steps, lr, damping, use_kfac, seed=0, batch=256, inverse_every=5):
  key = jax.random.PRNGKey(seed)
  data_key, init_key, key = jax.random.split(key, 3)
  x_all, y_all = make_data(data_key, 4096)
  params = init_params(init_key)
  opt = optax.sgd(lr, momentum=0.9)
  opt_state = opt.init(params)
  curv = [blk.init() for blk in BLOCKS]

  @jax.jit
  def step(params, opt_state, curv, key, i):
    k_batch, k_sample = jax.random.split(key)
    idx = jax.random.choice(k_batch, x_all.shape[0], (batch,), replace=False)
    x, y = x_all[idx], y_all[idx]
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    if use_kfac:
      stats = kfac_stats(params, x, k_sample)
      curv = [blk.update(s, st, 0.95) for blk, s, st in zip(BLOCKS, curv, stats)]
      curv = jax.lax.cond(
          i % inverse_every == 0,
          lambda c: [blk.refresh(s, damping, step=i) for blk, s in zip(BLOCKS, c)],
          lambda c: c, curv)
      grads = [blk.multiply_inverse(s, g, damping, use_cache=True)
               for blk, s, g in zip(BLOCKS, curv, grads)]
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, curv, loss

  losses = []
  for i in range(steps):
    key, sub = jax.random.split(key)
    params, opt_state, curv, loss = step(params, opt_state, curv, sub, i)
    losses.append(float(loss))
  return losses, loss_fn(params, x_all, y_all)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--lr", type=float, default=0.01)
  parser.add_argument("--sgd-lr", type=float, default=0.3)
  parser.add_argument("--damping", type=float, default=1e-3)
  args = parser.parse_args(argv)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; MLP {SIZES}, "
        f"{args.steps} steps, momentum 0.9, lr {args.lr} (K-FAC) and "
        f"{args.sgd_lr} (SGD)")
  t0 = time.perf_counter()
  kfac_losses, kfac_final = train(args.steps, args.lr, args.damping, True)
  t1 = time.perf_counter()
  sgd_losses, sgd_final = train(args.steps, args.sgd_lr, args.damping, False)
  print(f"{'step':>6} {'K-FAC loss':>12} {'SGD loss':>12}")
  for i in list(range(0, args.steps, max(1, args.steps // 10))) + [args.steps - 1]:
    print(f"{i:>6} {kfac_losses[i]:>12.4f} {sgd_losses[i]:>12.4f}")
  print(f"full-data loss after training: K-FAC {float(kfac_final):.4f}, "
        f"SGD {float(sgd_final):.4f} (K-FAC run took {t1 - t0:.1f}s)")
  if not kfac_losses[-1] < kfac_losses[0]:
    raise SystemExit("the K-FAC loss did not fall")


if __name__ == "__main__":
  main()
