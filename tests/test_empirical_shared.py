"""``estimation="empirical_shared"``: the empirical statistics read from the
gradient's own backward pass (``kfl.estimators`` module doc).

Pinned by properties, not by one code path against another:
* for every standard reduction (a mean, a sum, a sum over outputs then a
  mean, a masked per-token mean with examples of different lengths) it
  equals ``"empirical"``, float64 and float32;
* with unequal weights inside an example it is the brute-force
  ``G = Σ_i c_i/(Σ_{e∈i} c_e²) Σ_t g_it g_itᵀ`` of the loss's own output
  cotangents ``g = ∂L/∂o``;
* the program has no backward pass beyond the gradient's: its products are
  ``jax.value_and_grad``'s plus two Gram products per layer.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kfl

import _helpers
from _helpers import x64_mode

N, T, D, H, C = 5, 4, 3, 6, 4


def _params(dtype):
  return {"w1": _helpers.rand(1, (D, H), dtype),
          "b1": 0.1 * _helpers.rand(2, (H,), dtype),
          "w2": _helpers.rand(3, (H, C), dtype)}


def _batch(dtype):
  lengths = np.array([4, 1, 3, 0, 2])  # Example 3 has no token left.
  return {"x": _helpers.rand(4, (N, T, D), dtype),
          "y": np.random.default_rng(5).integers(0, C, (N, T)).astype(np.int32),
          "t": _helpers.rand(6, (N, T, C), dtype),
          "mask": (np.arange(T)[None] < lengths[:, None]).astype(dtype),
          "w": np.abs(_helpers.rand(7, (N, T), dtype)) + 0.1}


def _logits(p, x):
  return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]


LOSSES = {
    # Per-token CE, a mean over all N·T tokens.
    "token_mean": lambda p, b: optax.softmax_cross_entropy_with_integer_labels(
        _logits(p, b["x"]), b["y"]).mean(),
    # The same summed.
    "token_sum": lambda p, b: optax.softmax_cross_entropy_with_integer_labels(
        _logits(p, b["x"]), b["y"]).sum(),
    # Per-token CE under a mask, divided by its count: examples of 4, 1, 3,
    # 0 and 2 tokens.
    "masked": lambda p, b: (optax.softmax_cross_entropy_with_integer_labels(
        _logits(p, b["x"]), b["y"]) * b["mask"]).sum() / b["mask"].sum(),
    # Squared error summed over the outputs, then a mean: C elements of one
    # token each.
    "outputs_sum_mean": lambda p, b: kfl.squared_error(
        _logits(p, b["x"][:, 0]), b["t"][:, 0]).sum(-1).mean(),
}

_SHARED = {}


def _stats_fn(name, dtype):
  """Both estimations of one loss, one compiled program (cached)."""
  key = (name, np.dtype(dtype).name)
  if key not in _SHARED:
    params, batch = _params(dtype), _batch(dtype)
    fns = {e: kfl.value_grad_and_stats(LOSSES[name], params, batch,
                                       estimation=e)
           for e in ("empirical", "empirical_shared")}
    _SHARED[key] = jax.jit(
        lambda p, b, k: {e: fn(p, b, k) for e, fn in fns.items()})
  return _SHARED[key]


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_equals_empirical_for_every_standard_reduction_in_float64(name):
  with x64_mode(True):
    ests = _stats_fn(name, np.float64)(_params(np.float64),
                                       _batch(np.float64),
                                       jax.random.PRNGKey(0))
    want, got = ests["empirical"], ests["empirical_shared"]
    assert set(got.stats) == set(want.stats) and got.stats
    for layer in want.stats:
      for w, g in zip(jax.tree.leaves(want.stats[layer]),
                      jax.tree.leaves(got.stats[layer])):
        assert g.dtype == jnp.float64
        np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-14 * np.abs(
            w).max(initial=1.0), err_msg=f"{name} {layer}")
    np.testing.assert_allclose(got.weights, want.weights, rtol=1e-14)
    np.testing.assert_allclose(
        jax.tree.leaves(got.grads)[0], jax.tree.leaves(want.grads)[0],
        rtol=1e-13)


def test_equals_empirical_in_float32_within_rounding():
  ests = _stats_fn("masked", np.float32)(_params(np.float32),
                                         _batch(np.float32),
                                         jax.random.PRNGKey(0))
  for layer, want in ests["empirical"].stats.items():
    for w, g in zip(jax.tree.leaves(want),
                    jax.tree.leaves(ests["empirical_shared"].stats[layer])):
      # Each entry: a sum over N·T rows of products that went through a
      # forward and two backward layers (depth 3), rescaled by √T-size
      # factors (one more rounding step).
      _helpers.assert_rounding_close(g, w, terms=N * T * max(H, C), depth=4,
                                     err_msg=layer)


def test_unequal_weights_in_an_example_give_the_stated_rule():
  """A weighted per-token loss: ``"empirical_shared"``'s output factor of
  the last layer is ``Σ_i c_i/q_i Σ_t g_it g_itᵀ`` (``q_i = Σ_t c_it²``,
  ``g = ∂L/∂logits`` by autodiff of the loss), not ``"empirical"``'s."""
  with x64_mode(True):
    params, batch = _params(np.float64), _batch(np.float64)
    weights = batch["w"] * batch["mask"]

    def loss_fn(p, b):
      values = optax.softmax_cross_entropy_with_integer_labels(
          _logits(p, b["x"]), b["y"])
      return (values * b["w"] * b["mask"]).sum() / (b["w"] * b["mask"]).sum()

    fn = kfl.value_grad_and_stats(loss_fn, params, batch,
                                  estimation="empirical_shared")
    est = jax.jit(fn)(params, batch, jax.random.PRNGKey(0))
    c_e = weights / weights.sum()
    c_i, q_i = c_e.sum(1), (c_e ** 2).sum(1)
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    g = jax.grad(lambda o: (optax.softmax_cross_entropy_with_integer_labels(
        o, batch["y"]) * c_e).sum())(hidden @ params["w2"])  # [N, T, C]
    scale = np.where(q_i > 0, c_i / np.where(q_i > 0, q_i, 1), 0)
    want = np.einsum("n,nti,ntj->ij", scale, g, g)
    layer = [k for k in est.stats if "w2" in k][0]
    got = est.stats[layer].g[0]
    np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-15)
    # It is not "empirical"'s here: the rule differs with unequal weights.
    emp = jax.jit(kfl.value_grad_and_stats(
        loss_fn, params, batch, estimation="empirical"))(
            params, batch, jax.random.PRNGKey(0)).stats[layer].g[0]
    assert np.abs(np.asarray(emp) - want).max() > 1e-6 * np.abs(want).max()


def _dots(jaxpr):
  """The number of ``dot_general`` equations in a jaxpr and its sub-jaxprs
  (a ``cond``'s branches each counted)."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name == "dot_general"
    for sub in jax.core.subjaxprs(eqn) if hasattr(jax.core, "subjaxprs") else ():
      count += _dots(sub)
    for v in eqn.params.values():
      for j in (v if isinstance(v, (tuple, list)) else (v,)):
        inner = getattr(j, "jaxpr", None)
        if inner is not None and hasattr(inner, "eqns"):
          count += _dots(inner)
        elif hasattr(j, "eqns"):
          count += _dots(j)
  return count


def test_no_backward_pass_beyond_the_gradients():
  """The program's products: the gradient's (forward and backward) plus the
  two Gram products (``A`` and ``G``) of each of the two layers, where
  ``"empirical"`` has a second backward pass."""
  params, batch = _params(np.float32), _batch(np.float32)
  loss_fn = LOSSES["token_mean"]
  key = jax.random.PRNGKey(0)
  base = _dots(jax.make_jaxpr(jax.value_and_grad(loss_fn))(params, batch).jaxpr)
  count = {}
  for e in ("empirical", "empirical_shared"):
    fn = kfl.value_grad_and_stats(loss_fn, params, batch, estimation=e)
    count[e] = _dots(jax.make_jaxpr(fn)(params, batch, key).jaxpr)
  assert count["empirical_shared"] == base + 2 * 2, (base, count)
  assert count["empirical"] > count["empirical_shared"], count


def test_trains_through_kfac_and_without_a_recognised_loss():
  """Through the public transform, in both styles (``batch=`` and the
  one-pass ``stats=``), a recognised loss and one no detection reads (a
  hand-written log-cosh): 30 steps lower the loss, the health is ok."""
  params, batch = _params(np.float32), _batch(np.float32)

  def unread(p, b):
    return jnp.mean(jnp.log(jnp.cosh(_logits(p, b["x"]) - b["t"])))

  for loss_fn in (LOSSES["masked"], unread):
    tx = optax.chain(kfl.kfac(loss_fn, batch, estimation="empirical_shared"),
                     optax.sgd(0.03, momentum=0.9))
    est_fn = kfl.value_grad_and_stats(loss_fn, params, batch,
                                      estimation="empirical_shared")

    @jax.jit
    def step(p, s, key):
      est = est_fn(p, batch, key, with_stats=kfl.stats_due(s[0]))
      u, s = tx.update(est.grads, s, p, stats=est.stats, loss=est.loss)
      return optax.apply_updates(p, u), s, est.loss

    p, s = params, tx.init(params)
    first = loss_fn(p, batch)
    for i in range(30):
      p, s, _ = step(p, s, jax.random.PRNGKey(i))
    assert loss_fn(p, batch) < 0.9 * first
    assert kfl.health(s[0]).ok, kfl.health(s[0])

  # The batch= style: the transform computes the statistics itself.
  tx = optax.chain(kfl.kfac(unread, batch, estimation="empirical_shared"),
                   optax.sgd(0.03, momentum=0.9))

  @jax.jit
  def batch_step(p, s):
    loss, g = jax.value_and_grad(unread)(p, batch)
    u, s = tx.update(g, s, p, batch=batch, loss=loss)
    return optax.apply_updates(p, u), s

  p, s = params, tx.init(params)
  for _ in range(30):
    p, s = batch_step(p, s)
  assert unread(p, batch) < 0.9 * unread(params, batch)
  assert kfl.health(s[0]).ok, kfl.health(s[0])


def test_laplace_refuses_it_with_the_alternative():
  with pytest.raises(ValueError, match="estimation='empirical'"):
    kfl.laplace.fit(LOSSES["token_mean"], _params(np.float32),
                    [_batch(np.float32)], estimation="empirical_shared")
