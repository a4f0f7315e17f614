"""``kfl.kfac_optimizer(model_fraction=f)``: the quadratic model on the first
share of the batch (issue 36, lever 1), in float64.

With the preconditioner fed the same statistics (``stats=``), a step with
``model_fraction=f`` on a batch of 16 must equal, to rounding, the step of
``model_fraction=1`` given the first ``round(16 f)`` examples as its batch
(same gradient): the share is the first examples, ρ's two losses are on
it, and nothing else changes. A share gives a different step from the
whole batch's (so the comparison can fail).
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kfl

import _helpers

SIZES = (5, 4, 3)
N = 16
STEPS = 2


def loss_fn(params, batch):
  h = jnp.tanh(batch["x"] @ params[0]["w"] + params[0]["b"])
  logits = h @ params[1]["w"] + params[1]["b"]
  return kfl.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]).mean()


def setup():
  rng = np.random.default_rng(0)
  params = [{"w": jnp.asarray(rng.normal(size=(a, b)) / np.sqrt(a)),
             "b": jnp.zeros(b, jnp.asarray(0.0).dtype)}
            for a, b in zip(SIZES[:-1], SIZES[1:])]
  x = jnp.asarray(rng.normal(size=(N, SIZES[0])))
  batch = {"x": x, "y": jnp.asarray(rng.integers(0, 3, N))}
  return params, batch


def run(opt, params, batches, grads_and_stats, steps=None):
  """``steps`` updates (adapting λ every step) from ``params``; the
  gradient, statistics and loss of step i come from ``grads_and_stats[i]``
  whatever batch the model sees."""
  state = opt.init(params)
  update = jax.jit(opt.update)
  out = []
  for i in range(steps or STEPS):
    est = grads_and_stats[i]
    step, state = update(est.grads, state, params, batch=batches[i],
                         stats=est.stats, loss=est.loss)
    params = optax.apply_updates(params, step)
    out.append((step, state.damping, state.learning_rate, state.momentum,
                state.rho))
  return out


@pytest.mark.parametrize("fraction", [0.5, 0.25])
def test_model_fraction_is_the_model_on_the_first_examples(fraction):
  with _helpers.x64_mode(True):
    params, batch = setup()
    est_fn = kfl.value_grad_and_stats(loss_fn, params, batch)
    # The estimate on the whole batch at each step's parameters: run once
    # with the full model to get the trajectory's estimates, then replay.
    ests, p = [], params
    opt_full = kfl.kfac_optimizer(loss_fn, batch)
    state, update = opt_full.init(params), jax.jit(opt_full.update)
    est_fn = jax.jit(est_fn)
    for i in range(STEPS):
      est = est_fn(p, batch, jax.random.PRNGKey(i))
      ests.append(est)
      step, state = update(est.grads, state, p, batch=batch,
                           stats=est.stats, loss=est.loss)
      p = optax.apply_updates(p, step)
    # Same gradients and statistics for both runs (fixed, not recomputed:
    # the two runs' parameters differ after the first step, the
    # comparison is of the model's share only).
    k = int(round(N * fraction))
    head = jax.tree.map(lambda x: x[:k], batch)
    sliced = run(kfl.kfac_optimizer(loss_fn, batch, model_fraction=fraction),
                 params, [batch] * STEPS, ests)
    by_hand = run(kfl.kfac_optimizer(loss_fn, batch), params,
                  [head] * STEPS, ests)
    whole = run(kfl.kfac_optimizer(loss_fn, batch, model_fraction=1.0),
                params, [batch] * STEPS, ests)
    for a, b in zip(jax.tree.leaves(sliced), jax.tree.leaves(by_hand)):
      assert a.dtype == jnp.float64
      np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15)
    # The share matters: its first step's length differs from the whole's.
    alpha_share, alpha_whole = float(sliced[0][2]), float(whole[0][2])
    assert abs(alpha_share - alpha_whole) > 1e-6 * abs(alpha_whole), (
        alpha_share, alpha_whole)


def test_model_fraction_is_checked():
  params, batch = setup()
  with pytest.raises(ValueError, match="model_fraction"):
    kfl.kfac_optimizer(loss_fn, batch, model_fraction=0.0)
  with pytest.raises(ValueError, match="model_fraction"):
    kfl.kfac_optimizer(loss_fn, batch, model_fraction=1.5)
