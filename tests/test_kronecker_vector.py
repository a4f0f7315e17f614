"""Eva's rank-one Kronecker-vector block through the public API.

The block's algebra against its own dense matrix is in ``test_blocks``;
here its convention is pinned by properties of the preconditioned update
``kfl.kfac`` returns (``F = v vᵀ``, ``v = ā ⊗ ḡ``, exact damping):

* one example: ``v`` is that example's gradient, so each layer's update is
  ``∇/(λ + |∇|²)``;
* a batch sharing one input: ``v = ∇L/√(Σ c_i)`` (a mean and a sum);
* any batch: ``(v vᵀ + λI)⁻¹ ∇`` with ``v`` from per-example cotangents
  taken by ``jax.grad`` and the dense matrix solved by numpy, in float32
  and float64.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kfl
from kfac_jax_lite import blocks as B

from _helpers import x64_mode

LAM = 0.05
EVA = {"dense": "kronecker_vector"}


def _mlp_loss(params, batch, reduce="mean"):
  h = jnp.tanh(batch["x"] @ params["l0"]["w"] + params["l0"]["b"])
  logits = h @ params["l1"]["w"] + params["l1"]["b"]
  per = kfl.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
  return per.mean() if reduce == "mean" else per.sum()


def _mlp(dtype, n=6, same_input=False, seed=0):
  k = jax.random.split(jax.random.PRNGKey(seed), 4)
  params = {"l0": {"w": jax.random.normal(k[0], (4, 5), dtype),
                   "b": 0.1 * jax.random.normal(k[1], (5,), dtype)},
            "l1": {"w": jax.random.normal(k[2], (5, 3), dtype),
                   "b": jnp.zeros((3,), dtype)}}
  x = jax.random.normal(k[3], (1 if same_input else n, 4), dtype)
  x = jnp.broadcast_to(x, (n, 4))
  return params, {"x": x, "y": jnp.arange(n) % 3}


@functools.partial(jax.jit, static_argnums=(0,))
def _update(loss_fn, params, batch):
  """``kfl.kfac``'s first update at damping ``LAM``, no clip, with the
  dense layers' blocks Kronecker vectors (the empirical estimate)."""
  tx = kfl.kfac(loss_fn, batch, estimation="empirical", damping=LAM,
                norm_constraint=None, blocks=EVA)
  grads = jax.grad(loss_fn)(params, batch)
  updates, _ = tx.update(grads, tx.init(params), params, batch=batch)
  return grads, updates


def _layers(tree):
  return {k: np.concatenate([np.ravel(tree[k]["w"]), np.ravel(tree[k]["b"])])
          for k in ("l0", "l1")}


@pytest.mark.parametrize("x64", [False, True])
@pytest.mark.parametrize("reduce,n,same", [("mean", 1, False), ("mean", 6, True),
                                           ("sum", 6, True)])
def test_update_is_gradient_over_damping_plus_its_norm(reduce, n, same, x64):
  """One example, or one input shared by the batch: ``v = ∇/√(Σc)`` per
  layer, so the update is ``∇/(λ + |∇|²/Σc)`` (``Σc``: 1 for a mean, N
  for a sum)."""
  with x64_mode(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    params, batch = _mlp(dtype, n, same_input=same)
    loss_fn = functools.partial(_mlp_loss, reduce=reduce)
    grads, updates = _update(loss_fn, params, batch)
    total_c = 1.0 if reduce == "mean" else float(n)
    g, u = _layers(grads), _layers(updates)
    for name in g:
      s = g[name] @ g[name] / total_c
      expected = g[name] / (LAM + s)
      tol = _rtol(x64, s)  # Relative to the largest entry, as v and ∇
      np.testing.assert_allclose(u[name], expected, rtol=tol,  # are summed
                                 atol=tol * np.abs(expected).max(),  # apart.
                                 err_msg=name)


def _rtol(x64, s):
  """The update ``∇/λ`` less its rank-one part: when ``∇`` lies along
  ``v`` the two cancel down to ``∇/(λ + s)``, losing ``(1 + s/λ)`` of the
  working precision (``s = |v|²``); 30 roundings' worth above that."""
  eps = np.finfo(np.float64 if x64 else np.float32).eps
  return 30 * eps * (1 + s / LAM)


def _brute_force_update(params, batch):
  """``((v vᵀ + λI)⁻¹ ∇, |v|²)`` per layer, ``v = ā ⊗ ḡ`` from the inputs and
  ``jax.grad`` cotangents of each example's own loss (mean loss:
  ``c_i = 1/N``, ``ḡ = Σ_i c_i g_i``), in float64 numpy."""
  p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
  x, y = np.asarray(batch["x"], np.float64), np.asarray(batch["y"])
  n = len(x)
  pre0 = x @ p["l0"]["w"] + p["l0"]["b"]
  h = np.tanh(pre0)
  logits = h @ p["l1"]["w"] + p["l1"]["b"]

  def ce(z, label):
    return -jax.nn.log_softmax(z)[label]
  g1 = np.asarray(jax.vmap(jax.grad(ce))(jnp.asarray(logits), y),
                  np.float64)                                # ∂ℓ_i/∂logits
  g0 = (g1 @ p["l1"]["w"].T) * (1 - h ** 2)                   # ∂ℓ_i/∂pre0
  grads = jax.grad(_mlp_loss)(params, batch)
  out = {}
  for name, inp, cot in (("l0", x, g0), ("l1", h, g1)):
    a_bar = np.append(inp.mean(0), 1.0)
    g_bar = cot.sum(0) / n
    v = np.outer(a_bar, g_bar).ravel()        # [a, b] row-major, bias last
    grad = np.concatenate([np.asarray(grads[name]["w"], np.float64),
                           np.asarray(grads[name]["b"], np.float64)[None]])
    dense = np.outer(v, v) + LAM * np.eye(len(v))
    u = np.linalg.solve(dense, grad.ravel()).reshape(grad.shape)
    out[name] = np.concatenate([u[:-1].ravel(), u[-1]]), v @ v
  return out


@pytest.mark.parametrize("x64", [False, True])
def test_update_against_the_dense_rank_one_matrix(x64):
  with x64_mode(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    params, batch = _mlp(dtype, n=7, seed=3)
    _, updates = _update(_mlp_loss, params, batch)
    expected = _brute_force_update(params, batch)
    got = _layers(updates)
    for name, (want, s) in expected.items():
      # Relative to the largest entry: the rank-one part cancels in some.
      tol = _rtol(x64, s)
      np.testing.assert_allclose(got[name], want, rtol=tol,
                                 atol=tol * np.abs(want).max(), err_msg=name)


def test_a_conv_at_one_location_is_the_dense_block():
  """KFC's convention: a convolution whose output is one location (its
  kernel covers the input, VALID) has the dense layer's statistics on the
  flattened input; with two examples, two sampled targets, weights."""
  x = np.random.default_rng(0).normal(size=(2, 3, 3, 2))
  g = np.random.default_rng(1).normal(size=(2, 2, 1, 1, 4))
  c = np.array([0.3, 0.9])
  conv = B.KroneckerVectorConv((3, 3, 2, 4), dimension_numbers=(
      "NHWC", "HWIO", "NHWC"), has_bias=True)
  dense = B.KroneckerVectorDense((18, 4), has_bias=True)
  got = conv.compute_stats(x, g, weights=c)
  want = dense.compute_stats(x.reshape(2, 18), g.reshape(2, 2, 4), weights=c)
  np.testing.assert_allclose(got.a, want.a, rtol=1e-6)
  np.testing.assert_allclose(got.g, want.g, rtol=1e-6)


def test_embeddings_take_no_kronecker_vectors():
  def loss_fn(params, batch):
    out = params["table"][batch["ids"]]
    return kfl.squared_error(out, batch["y"]).mean()
  params = {"table": jnp.ones((5, 3))}
  batch = {"ids": jnp.array([0, 2, 4]), "y": jnp.zeros((3, 3))}
  with pytest.raises(ValueError, match=r"override for 'table'.*'kronecker_vector'.*kind 'embedding'"):
    kfl.kfac(loss_fn, batch, blocks={"embedding": "kronecker_vector"}
             ).init(params)


def test_describe_prices_the_vectors_by_hand():
  """One dense layer 5 -> 3 with a bias, batch 7: a = 6, b = 3."""
  params = {"w": jnp.ones((5, 3)) * 0.1, "b": jnp.zeros(3)}
  batch = {"x": jnp.ones((7, 5)), "y": jnp.zeros((7, 3))}

  def loss_fn(p, b):
    return kfl.squared_error(b["x"] @ p["w"] + p["b"], b["y"]).mean()
  (row,) = kfl.describe(loss_fn, params, batch, blocks=EVA, inverse_every=10,
                        cov_every=1)
  assert row.block == "KroneckerVectorDense"
  assert row.factors == ((1, 6), (1, 3))
  f = row.flops
  assert f.sgd == pytest.approx(6 * 7 * 6 * 3)
  assert f.statistics == pytest.approx(2 * 7 * 6 * 3      # sampled backward
                                       + 2 * 7 * (6 + 3))  # ā and ḡ
  assert f.precondition == pytest.approx(4 * 6 * 3)
  assert f.refresh == pytest.approx((6 + 3) / 10)


def test_block_options_and_bad_decay():
  block = B.KroneckerVectorDense.like(B.KroneckerDense((3, 4), has_bias=True),
                                      decay=0.05)
  assert (block.kernel_shape, block.has_bias, block.decay) == ((3, 4), True, 0.05)
  with pytest.raises(ValueError, match="KroneckerVectorDense: decay"):
    B.KroneckerVectorDense((3, 4), decay=1.0)
  # Its own decay replaces the optimizer's: the newest vectors weigh 0.95.
  state = block.init()
  ones = B.KroneckerState(a=jnp.ones((1, 4)), g=jnp.ones((1, 4)))
  state = block.update(block.update(state, ones, 0.99), jax.tree.map(
      lambda x: 3 * x, ones), 0.99)
  np.testing.assert_allclose(kfl.factor.factor_value(state.a), (
      0.05 * 0.95 + 0.95 * 3) / (0.05 * 0.95 + 0.95), rtol=1e-6)


def test_trains_a_small_classifier_one_pass():
  """The one-pass loop of the README with the dense layers' blocks
  Kronecker vectors: the loss falls and ``kfl.health`` is ok."""
  params, batch = _mlp(jnp.float32, n=64, seed=5)
  batch = {"x": batch["x"], "y": (batch["x"][:, 0] > 0).astype(jnp.int32)}
  est = kfl.value_grad_and_stats(_mlp_loss, params, batch,
                                 estimation="empirical_shared", blocks=EVA)
  tx = optax.chain(kfl.kfac(_mlp_loss, batch, estimation="empirical_shared",
                            blocks=EVA, damping=0.03, inverse_every=1),
                   optax.sgd(0.03, momentum=0.9))

  @jax.jit
  def run(params):
    def step(carry, _):
      p, s = carry
      e = est(p, batch, None)
      u, s = tx.update(e.grads, s, p, stats=e.stats)
      return (optax.apply_updates(p, u), s), e.loss
    (params, state), losses = jax.lax.scan(step, (params, tx.init(params)),
                                           None, length=100)
    return state, losses
  state, losses = run(params)
  assert float(losses[-1]) < 0.2 * float(losses[0]), losses[::10]
  report = kfl.health(state)
  assert report.ok, report
