"""``kfl.kfac_optimizer``: the quadratic model against a brute-force GGN."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

import kfac_jax_lite as kfl
from kfac_jax_lite import distributions as dists
from kfac_jax_lite import optimizer

SIZES = (4, 6, 3)
N = 8


def init_params():
  keys = jax.random.split(jax.random.PRNGKey(0), 2)
  return [(jax.random.normal(k, (a, b)) / np.sqrt(a), jnp.zeros(b))
          for k, a, b in zip(keys, SIZES[:-1], SIZES[1:])]


def net(p, x):
  h = jnp.tanh(x @ p[0][0] + p[0][1])
  return h @ p[1][0] + p[1][1]


def loss_fn(p, b):
  return kfl.softmax_cross_entropy_with_integer_labels(net(p, b["x"]), b["y"]).mean()


X = jax.random.normal(jax.random.PRNGKey(1), (N, SIZES[0]))
BATCH = {"x": X, "y": jnp.argmax(X[:, :3], -1)}


def brute_ggn(params):
  flat, unravel = ravel_pytree(params)
  jac = jax.jacrev(lambda f: net(unravel(f), X))(flat)  # [N, C, P]
  root = dists.Categorical(True).fisher_sqrt((net(params, X),))[0]  # [N, C, K]
  h = jnp.einsum("nck,ndk->ncd", root, root)
  return np.asarray(jnp.einsum("ncp,ncd,ndq->pq", jac, h, jac) / N, np.float64)


def test_curvature_forms_match_brute_force_ggn():
  params = init_params()
  tagged = kfl.find_layers(loss_fn, params, BATCH)
  vs = [jax.tree.map(lambda x, i=i: jax.random.normal(
      jax.random.PRNGKey(10 + i), x.shape), params) for i in range(2)]
  dirs = jax.tree.map(lambda a, b: jnp.stack([a, b]), *vs)
  forms, loss = optimizer._curvature_forms(tagged, params, BATCH, dirs, "ggn")
  np.testing.assert_allclose(loss, loss_fn(params, BATCH), rtol=1e-6)
  g = brute_ggn(params)
  flat = np.stack([np.asarray(ravel_pytree(v)[0]) for v in vs])
  np.testing.assert_allclose(forms, flat @ g @ flat.T, rtol=1e-4)
  fisher, _ = optimizer._curvature_forms(tagged, params, BATCH, dirs, "fisher")
  np.testing.assert_allclose(fisher, forms, rtol=1e-5)  # Softmax: GGN = Fisher.


def test_learning_rate_and_momentum_minimise_the_exact_quadratic_model():
  params = init_params()
  tx = kfl.kfac_optimizer(loss_fn, BATCH, initial_damping=0.5,
                          damping_adaptation_interval=1000)
  state = tx.init(params)
  update = jax.jit(tx.update)
  for step in range(2):
    grads = jax.grad(loss_fn)(params, BATCH)
    velocity = state.velocity
    new, state = update(grads, state, params, batch=BATCH)
    lam = 0.5
    g = np.asarray(ravel_pytree(grads)[0], np.float64)
    c = brute_ggn(params) + lam * np.eye(len(g))
    alpha, mu = float(state.learning_rate), float(state.momentum)
    s = np.asarray(ravel_pytree(new)[0], np.float64)
    v = np.asarray(ravel_pytree(velocity)[0], np.float64)
    delta = (s - mu * v) / alpha
    if step == 0:
      assert mu == 0.0
      np.testing.assert_allclose(alpha, -(g @ delta) / (delta @ c @ delta),
                                 rtol=1e-3)
    else:
      basis = np.stack([delta, v])
      q, b = basis @ c @ basis.T, basis @ g
      np.testing.assert_allclose([alpha, mu], -np.linalg.solve(q, b), rtol=2e-3)
    params = optax.apply_updates(params, new)


def test_damping_adapts_and_training_converges():
  params = init_params()
  tx = kfl.kfac_optimizer(loss_fn, BATCH, initial_damping=10.0,
                          damping_adaptation_interval=2)

  @jax.jit
  def step(params, state):
    loss, grads = jax.value_and_grad(loss_fn)(params, BATCH)
    updates, state = tx.update(grads, state, params, batch=BATCH)
    return optax.apply_updates(params, updates), state, loss

  state = tx.init(params)
  losses, dampings = [], []
  for _ in range(20):
    params, state, loss = step(params, state)
    losses.append(float(loss))
    dampings.append(float(state.damping))
  assert dampings[-1] < 10.0  # Good reductions (ρ > 3/4) lower λ.
  assert losses[-1] < 0.5 * losses[0], losses
  assert np.isfinite(float(state.rho))


def test_needs_a_registered_loss_and_rejects_fixed_damping():
  plain = lambda p, b: optax.softmax_cross_entropy_with_integer_labels(
      net(p, b["x"]), b["y"]).mean()
  tx = kfl.kfac_optimizer(plain, BATCH, estimation="empirical")
  params = init_params()
  with pytest.raises(ValueError, match="registered loss"):
    tx.update(jax.grad(plain)(params, BATCH), tx.init(params), params,
              batch=BATCH)
  with pytest.raises(ValueError, match="initial_damping"):
    kfl.kfac_optimizer(loss_fn, BATCH, damping=1e-3)
