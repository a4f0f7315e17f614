"""Convergence in steps (not time) against the best Adam, on digits.

Goals (issue 5): ``kfac`` + SGD-momentum needs ≥ 1.5× fewer steps than the
best Adam of lr ∈ {1e-3, 3e-3, 1e-2, 3e-2} on the digits MLP; the adaptive
``kfac_optimizer`` needs fewer steps than Adam there and ≥ 3× fewer on a
small deep autoencoder. Fixed seeds, full batch; the asserts keep a margin
below what was measured (printed with ``pytest -s``).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from sklearn.datasets import load_digits

import kfac_jax_lite as kfl
from _helpers import optimized_jit

ADAM_LRS = (1e-3, 3e-3, 1e-2, 3e-2)
MAX_OURS = 150  # Step cap for K-FAC (it needs 27-73 steps here).


@functools.lru_cache(maxsize=None)
def digits():
  x, y = load_digits(return_X_y=True)
  return {"x": jnp.asarray(x / 16.0, jnp.float32), "y": jnp.asarray(y)}


def mlp_params(sizes, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), len(sizes) - 1)
  return [(jax.random.normal(k, (i, o)) / np.sqrt(i), jnp.zeros(o))
          for k, i, o in zip(keys, sizes[:-1], sizes[1:])]


def mlp(params, x):
  for i, (w, b) in enumerate(params):
    x = x @ w + b
    x = jnp.tanh(x) if i < len(params) - 1 else x
  return x


def classifier_loss(params, batch):
  return kfl.softmax_cross_entropy_with_integer_labels(
      mlp(params, batch["x"]), batch["y"]).mean()


def autoencoder_loss(params, batch):
  return kfl.sigmoid_binary_cross_entropy(
      mlp(params, batch["x"]), batch["x"]).sum(-1).mean()


def steps_to(tx, loss_fn, params, target, max_steps):
  """Steps until the full-batch loss is below ``target`` (max_steps if never)."""
  batch = digits()

  @optimized_jit  # Its time is running the steps, not compiling.
  def run(params):
    def step(carry, _):
      params, state = carry
      loss, grads = jax.value_and_grad(loss_fn)(params, batch)
      updates, state = tx.update(grads, state, params, batch=batch)
      return (optax.apply_updates(params, updates), state), loss
    _, losses = jax.lax.scan(step, (params, tx.init(params)), None, max_steps)
    return losses

  losses = np.asarray(run(params))
  below = np.nonzero(losses < target)[0]
  return int(below[0]) if len(below) else max_steps


def best_adam(loss_fn, params, target, max_steps):
  """The fewest steps any Adam of ``ADAM_LRS`` needs (``max_steps`` if none).

  The tests only assert that Adam needs at least ``ratio x`` our steps, so
  Adam is run for exactly that many steps: reaching the target within them
  fails the test, not reaching it proves the claim (the count is then a
  lower bound, printed as ">= max_steps").
  """
  steps = {lr: steps_to(optax.adam(lr), loss_fn, params, target, max_steps)
           for lr in ADAM_LRS}
  return min(steps.values()), steps


def report(name, ours, adam, adam_steps, cap):
  bound = ">=" if adam >= cap else ""
  print(f"\n{name}: {ours} steps vs best Adam {bound}{adam} ({adam_steps}); "
        f"ratio {bound}{adam / max(ours, 1):.1f}x")


@pytest.mark.slow
def test_kfac_and_kfac_optimizer_beat_adam_on_the_digits_mlp():
  params = mlp_params((64, 128, 128, 10))
  target = 1e-3
  kfac = optax.chain(kfl.kfac(classifier_loss, digits(), damping=1e-2),
                     optax.sgd(0.1, momentum=0.9))
  kfac_steps = steps_to(kfac, classifier_loss, params, target, MAX_OURS)
  opt = kfl.kfac_optimizer(classifier_loss, digits())
  opt_steps = steps_to(opt, classifier_loss, params, target, MAX_OURS)
  assert kfac_steps < MAX_OURS and opt_steps < MAX_OURS, (kfac_steps, opt_steps)
  # Adam runs just long enough to decide both claims below.
  cap = int(max(3.0 * kfac_steps, 1.5 * opt_steps))
  adam, adam_steps = best_adam(classifier_loss, params, target, cap)
  report("digits MLP, kfac + sgd(0.1, momentum 0.9)", kfac_steps, adam,
         adam_steps, cap)
  report("digits MLP, kfac_optimizer", opt_steps, adam, adam_steps, cap)
  # Measured: kfac 27 steps (25 unclipped, 38 at norm_constraint=0.1),
  # kfac_optimizer 54, best Adam 148 (lr 3e-2). Issue 36 (2026-11-27):
  # kfac_optimizer 95 against Adam's 142, from initial_damping=1.0 (52 from
  # 0.1 with the same rejection and rho every step): the start that keeps
  # a standardised-input MLP at batch 128 from blowing up
  # (test_optimizer_standardised.py) costs this full-batch problem ~40
  # steps while lambda comes down; hence 1.4x, not 1.5x.
  assert adam >= 3.0 * kfac_steps, (kfac_steps, adam_steps)
  assert adam >= 1.4 * opt_steps, (opt_steps, adam_steps)


@pytest.mark.slow
def test_kfac_optimizer_beats_adam_on_a_deep_autoencoder():
  params = mlp_params((64, 32, 16, 8, 16, 32, 64))
  target = 17.0
  opt = kfl.kfac_optimizer(autoencoder_loss, digits())
  opt_steps = steps_to(opt, autoencoder_loss, params, target, MAX_OURS)
  assert opt_steps < MAX_OURS, opt_steps
  cap = int(5.0 * opt_steps)  # Adam runs just long enough to decide.
  adam, adam_steps = best_adam(autoencoder_loss, params, target, cap)
  report("digits autoencoder 64-32-16-8-16-32-64, kfac_optimizer", opt_steps,
         adam, adam_steps, cap)
  # Measured: kfac_optimizer 73 steps (64 before min_damping=1e-5 and the
  # unclipped Δ; not separated), best
  # Adam 649 (lr 3e-2).
  assert adam >= 5.0 * opt_steps, (opt_steps, adam_steps)
