"""Issue 23: a hand-written optax loss recognised as its registered twin."""
import jax
import jax.numpy as jnp
import optax
import pytest

import kfac_jax_lite as kfl

from _helpers import x64_mode

REDUCTIONS = {
    "mean": lambda v, b: v.mean(),
    "sum": lambda v, b: v.sum(),
    "per_example_then_mean": lambda v, b: jnp.mean(jax.vmap(lambda e: e)(v)),
    "masked_mean": lambda v, b: (v * b["m"]).sum() / b["m"].sum(),
}


def _data():
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  params = {"w1": jax.random.normal(k1, (3, 5)),
            "w2": jax.random.normal(k2, (5, 4))}
  batch = {"x": jax.random.normal(k3, (6, 3)),
           "y": jnp.array([0, 1, 2, 3, 0, 1]),
           "m": jnp.array([1.0, 1, 0, 1, 0, 1])}
  return params, batch


def _logits(p, b):
  return jnp.tanh(b["x"] @ p["w1"]) @ p["w2"]


@pytest.mark.parametrize("reduction", list(REDUCTIONS))
@pytest.mark.parametrize("estimation", ["fisher", "exact", "curvature_prop"])
def test_optax_integer_cross_entropy_has_the_registered_twins_statistics(
    reduction, estimation):
  red = REDUCTIONS[reduction]
  plain = lambda p, b: red(optax.softmax_cross_entropy_with_integer_labels(
      _logits(p, b), b["y"]), b)
  twin = lambda p, b: red(kfl.softmax_cross_entropy_with_integer_labels(
      _logits(p, b), b["y"]), b)
  with x64_mode(True):
    params, batch = jax.tree.map(
        lambda a: a.astype(jnp.float64) if a.dtype == jnp.float32 else a,
        _data())
    key = jax.random.PRNGKey(3)
    got = jax.jit(kfl.value_grad_and_stats(plain, params, batch,
                                           estimation=estimation))(
        params, batch, key)
    want = jax.jit(kfl.value_grad_and_stats(twin, params, batch,
                                            estimation=estimation))(
        params, batch, key)
    # The same jaxpr operations in float64 and the same samples: equal up to
    # a few float64 roundings of O(1) values.
    for a, b in zip(jax.tree.leaves((got.loss, got.grads, got.stats)),
                    jax.tree.leaves((want.loss, want.grads, want.stats))):
      assert jnp.allclose(a, b, rtol=1e-12, atol=1e-12), (a, b)


def test_describe_shows_the_recognised_loss_and_kfac_steps():
  params, batch = _data()
  plain = lambda p, b: optax.softmax_cross_entropy_with_integer_labels(
      _logits(p, b), b["y"]).mean()
  last = str(kfl.describe(plain, params, batch)).splitlines()[-1]
  assert last == ("loss: Categorical (recognised: optax.softmax_cross_"
                  "entropy_with_integer_labels, as its registered twin), "
                  "per-element values [6]"), last
  tx = kfl.kfac(plain, batch)  # estimation="fisher": no refusal.
  state = tx.init(params)
  upd, _ = jax.jit(lambda g, s, p: tx.update(g, s, p, batch=batch))(
      jax.grad(plain)(params, batch), state, params)
  assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(upd))
