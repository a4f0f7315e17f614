"""Regularisers of a parameter alone inside the loss keep its layer block.

Weight decay written into the loss (``ce + c·Σ‖w‖²``) is not a layer use:
the layer keeps its Kronecker block, ``describe`` reports the penalty and
its curvature, the statistics are those of the model alone, and the
gradient is that of the whole loss.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kfl
import _helpers
from _helpers import x64_mode
from kfac_jax_lite.estimators import describe
from kfac_jax_lite.tagging import find_layers

# name -> (penalty of one leaf, its Hessian γ in P = (γ/2)·‖w‖², None if
# not quadratic). The loss adds C·P(w) + C·P(b).
C = 1e-3
PENALTIES = {
    "pow": (lambda w: jnp.sum(w ** 2), 2.0),
    "square": (lambda w: jnp.sum(jnp.square(w)), 2.0),
    "l2_loss": (lambda w: jnp.sum(optax.l2_loss(w)), 1.0),
    "vdot": (lambda w: jnp.vdot(w, w), 2.0),
    "norm_sq": (lambda w: jnp.linalg.norm(w) ** 2, 2.0),
    "mul_mean": (lambda w: jnp.mean(w * w), None),   # γ = 2 / w.size
    "l1": (lambda w: jnp.sum(jnp.abs(w)), None),
}


def _net(p, x):
  h = jnp.tanh(x @ p["w"] + p["b"])
  return h @ p["v"]


def _model(pen_name, dtype=jnp.float32):
  k = jax.random.split(jax.random.key(1), 5)
  p = {"w": jax.random.normal(k[0], (4, 5), dtype) / 2,
       "b": 0.1 * jnp.ones(5, dtype),
       "v": jax.random.normal(k[1], (5, 3), dtype) / 2}
  x = jax.random.normal(k[2], (6, 4), dtype)
  y = jax.random.randint(k[3], (6,), 0, 3)
  pen = PENALTIES[pen_name][0]

  def model_loss(p, batch):
    x, y = batch
    return kfl.softmax_cross_entropy_with_integer_labels(
        _net(p, x), y).mean()

  def loss(p, batch):
    # Python's sum starts from 0: ``0 + P(w)`` must stay a penalty.
    return model_loss(p, batch) + C * sum(pen(p[n]) for n in ("w", "b"))
  return loss, model_loss, p, (x, y)


def _gamma(pen_name, leaf):
  g = PENALTIES[pen_name][1]
  if pen_name == "mul_mean":
    return 2.0 / leaf.size
  return g


@functools.lru_cache(maxsize=None)
def _tagged(pen_name):
  loss, _, p, batch = _model(pen_name)
  return find_layers(loss, p, batch)


@pytest.mark.parametrize("pen_name", sorted(PENALTIES))
def test_penalty_keeps_the_layer_block(pen_name):
  loss, _, p, batch = _model(pen_name)
  rows = describe(loss, p, batch)
  assert [(r.name, r.kind, r.block, r.params) for r in rows] == [
      ("w", "dense", "KroneckerDense", ("w", "b")),
      ("v", "dense", "KroneckerDense", ("v",))], str(rows)
  notes = rows[0].notes
  assert "penalty" in notes and "‖w‖²" in notes or "non-quadratic" in notes
  layer = _tagged(pen_name).layer("w")
  curv = layer.penalty_curvature
  if pen_name == "l1":
    assert curv == {"w": None, "b": None}
    assert "non-quadratic, curvature left out" in notes
    return
  for path in ("w", "b"):
    # Brute force: the Hessian of the penalty term of the loss alone.
    pen = PENALTIES[pen_name][0]
    hess = jax.hessian(lambda w: C * pen(w))(p[path]).reshape(
        p[path].size, p[path].size)
    np.testing.assert_allclose(hess, curv[path] * np.eye(p[path].size),
                               rtol=1e-5, atol=1e-9, err_msg=path)
    np.testing.assert_allclose(curv[path], C * _gamma(pen_name, p[path]),
                               rtol=1e-6)
  assert f"curvature {curv['w']:.3g}·I" in notes
  assert rows[1].notes == ""


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_penalty_stays_out_of_the_statistics(dtype):
  # Through the public estimator: the statistics of loss + penalty equal
  # those of the model's loss alone (the penalty is not a model output),
  # the gradient is that of the whole loss, and the captured layer data
  # rebuild the per-example gradients of the model's loss.
  with x64_mode(dtype == "float64"):
    dt = jnp.dtype(dtype)
    loss, model_loss, p, batch = _model("pow", dt)
    key = jax.random.PRNGKey(3)
    # float64 checks one mode (the precision path is shared): test time.
    modes = ("fisher", "empirical", "exact") if dtype == "float32" else (
        "exact",)
    for estimation in modes:
      with_pen = kfl.value_grad_and_stats(loss, p, batch,
                                          estimation=estimation)
      without = kfl.value_grad_and_stats(model_loss, p, batch,
                                         estimation=estimation)
      assert not with_pen.tagged.fallbacks
      a, b = jax.jit(with_pen)(p, batch, key), jax.jit(without)(p, batch, key)
      assert a.loss.dtype == dt
      # The run entry holds the loss, which the penalty changes.
      for name in kfl.estimators.split_run(b.stats)[0]:
        for x, y in zip(jax.tree.leaves(a.stats[name]),
                        jax.tree.leaves(b.stats[name])):
          assert x.dtype == y.dtype
          np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-12,
                                     err_msg=f"{estimation} {name}")
      want = jax.jit(jax.grad(loss))(p, batch)
      for x, y in zip(jax.tree.leaves(a.grads), jax.tree.leaves(want)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-8)
    tl = find_layers(loss, p, batch)
    per_ex, ref = _helpers.per_example_and_reference(tl, model_loss, p, batch)
    # 2 layers forward and back and the softmax: ≤ 6 chained reductions,
    # none longer than the 5 hidden units.
    _helpers.assert_paths_rounding_close(
        {k: per_ex[k] for k in ("w", "b", "v")}, ref, terms=5, depth=6)


def test_penalty_that_feeds_the_model_falls_back():
  # ``Σw²`` added to the activations is part of the model, not a penalty.
  p = {"w": jnp.ones((3, 3)) / 3}

  def loss(p, x):
    h = x @ p["w"] + jnp.sum(p["w"] ** 2)
    return jnp.mean(h ** 2)
  (row,) = describe(loss, p, jnp.ones((2, 3)))
  assert row.kind == "fallback" and "integer_pow" in row.notes, row

  def loss_carry(p, x):   # The penalty scales activations through a carry.
    def step(c, xt):
      h, s = c
      h = jnp.tanh(h @ p["w"] + xt)
      return (h * s, s + jnp.sum(p["w"] ** 2)), None
    (h, _), _ = jax.lax.scan(step, (jnp.zeros((x.shape[1], 3)), 1.0), x)
    return jnp.mean(h ** 2)
  (row,) = describe(loss_carry, p, jnp.ones((4, 2, 3)))
  assert row.kind == "fallback" and "carried out of a loop" in row.notes, row


def test_penalty_scale_unknown_when_not_affine_in_the_loss():
  p = {"w": jnp.ones((3, 2)) / 3}

  def loss(p, x):
    pen = jnp.sum(p["w"] ** 2)
    return jnp.mean((x @ p["w"]) ** 2) + jnp.log1p(pen)
  (row,) = describe(loss, p, jnp.ones((2, 3)))
  assert row.kind == "dense", row
  assert "quadratic, curvature left out" in row.notes, row


def test_weight_decay_mlp_trains_with_kfac():
  # The model: an MLP with ``1e-4·Σ‖p‖²`` in the loss. Zero
  # fallbacks, and K-FAC + SGD lowers the loss.
  k = jax.random.split(jax.random.key(0), 6)
  sizes = (8, 16, 16, 4)
  params = [{"w": jax.random.normal(k[i], (a, b)) / np.sqrt(a),
             "b": jnp.zeros(b)} for i, (a, b) in enumerate(zip(sizes, sizes[1:]))]
  x = jax.random.normal(k[4], (64, 8))
  y = jnp.argmax(x[:, :4] + 0.5 * x[:, 4:], -1)

  def loss(params, batch):
    x, y = batch
    h = x
    for i, l in enumerate(params):
      h = h @ l["w"] + l["b"]
      if i < len(params) - 1:
        h = jax.nn.relu(h)
    ce = kfl.softmax_cross_entropy_with_integer_labels(h, y).mean()
    return ce + 1e-4 * sum(jnp.sum(l["w"] ** 2) for l in params)
  rows = describe(loss, params, (x, y))
  assert all(r.kind == "dense" for r in rows) and len(rows) == 3, str(rows)
  tx = optax.chain(kfl.kfac(loss, (x, y)), optax.sgd(0.1, momentum=0.9))
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    l, g = jax.value_and_grad(loss)(params, (x, y))
    u, state = tx.update(g, state, params, batch=(x, y))
    return optax.apply_updates(params, u), state, l
  first = None
  for _ in range(15):
    params, state, l = step(params, state)
    first = l if first is None else first
  final = loss(params, (x, y))
  assert np.isfinite(final) and final < 0.5 * first, (first, final)
