"""Issue 23: losses as their authors write them, recognised in the jaxpr.

Each hand-written form, under each reduction, must give exactly the
statistics of its registered twin (the ``kfl`` loss with the same values)
in float64: the same loss and gradient, and the same ``"fisher"`` (same
draws) and ``"empirical"`` (same data targets) statistics, which pins the
element weights ``c_e``, the model outputs, the targets and the
distribution the recognition chose.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kfl
from kfac_jax_lite.losses.distributions import Normal

from _helpers import rand, x64_mode

N, K = 6, 4
SIGMA = 0.3  # The hand-written Gaussian's standard deviation.


def _data():
  """float64 params and a batch with every target kind (call in x64)."""
  params = {"w1": jnp.asarray(rand(0, (3, 5))),
            "w2": jnp.asarray(rand(1, (5, K)))}
  y = jnp.array([0, 1, 2, 3, 0, 1])
  u = np.random.default_rng(2).uniform(0.1, 1, (N, K))
  batch = {"x": jnp.asarray(rand(3, (N, 3))), "y": y,
           "onehot": jax.nn.one_hot(y, K, dtype=jnp.float64),
           "soft": jnp.asarray(u / u.sum(-1, keepdims=True)),
           "t": jnp.asarray(rand(4, (N, K))),
           "tb": jnp.asarray(np.random.default_rng(5).uniform(0, 1, (N, K))),
           "m": jnp.array([1.0, 1, 0, 1, 0, 1]),
           "w": jnp.array([0.5, 2.0, 1.0, 0.25, 3.0, 1.0])}
  return params, batch


def _logits(p, b):
  return jnp.tanh(b["x"] @ p["w1"]) @ p["w2"]


_CONST = jnp.log(SIGMA) + 0.5 * jnp.log(2 * jnp.pi)
# name: (hand-written per-element values, the registered twin's) of
# (model output z, batch b); the twin has the same values.
FORMS = {
    "optax_ce_integer_labels": (
        lambda z, b: optax.softmax_cross_entropy_with_integer_labels(z, b["y"]),
        lambda z, b: kfl.softmax_cross_entropy_with_integer_labels(z, b["y"])),
    "optax_ce_one_hot": (
        lambda z, b: optax.softmax_cross_entropy(z, b["onehot"]),
        lambda z, b: kfl.softmax_cross_entropy(z, b["onehot"])),
    "optax_ce_integer_labels_where": (
        lambda z, b: optax.softmax_cross_entropy_with_integer_labels(
            z, b["y"], where=b["m"] > 0),
        lambda z, b: jnp.where(
            b["m"] > 0,
            kfl.softmax_cross_entropy_with_integer_labels(z, b["y"]), 0.0)),
    "optax_ce_one_hot_where": (
        lambda z, b: optax.softmax_cross_entropy(z, b["onehot"],
                                                 where=b["m"] > 0),
        lambda z, b: jnp.where(b["m"] > 0, kfl.softmax_cross_entropy(
            z, b["onehot"]), 0.0)),
    "optax_ce_soft_labels": (
        lambda z, b: optax.softmax_cross_entropy(z, b["soft"]),
        lambda z, b: kfl.softmax_cross_entropy(z, b["soft"])),
    "log_softmax_take_along_axis": (
        lambda z, b: -jnp.take_along_axis(jax.nn.log_softmax(z),
                                          b["y"][:, None], axis=-1)[:, 0],
        lambda z, b: kfl.softmax_cross_entropy_with_integer_labels(z, b["y"])),
    "log_softmax_one_hot_product": (
        lambda z, b: -jnp.sum(jax.nn.log_softmax(z) * b["onehot"], -1),
        lambda z, b: kfl.softmax_cross_entropy(z, b["onehot"])),
    "log_softmax_indexed": (
        lambda z, b: -jax.nn.log_softmax(z)[jnp.arange(N), b["y"]],
        lambda z, b: kfl.softmax_cross_entropy_with_integer_labels(z, b["y"])),
    "logits_minus_logsumexp": (
        lambda z, b: jax.nn.logsumexp(z, -1) - jnp.take_along_axis(
            z, b["y"][:, None], -1)[:, 0],
        lambda z, b: kfl.softmax_cross_entropy_with_integer_labels(z, b["y"])),
    "optax_sigmoid_bce": (
        lambda z, b: optax.sigmoid_binary_cross_entropy(z, b["tb"]),
        lambda z, b: kfl.sigmoid_binary_cross_entropy(z, b["tb"])),
    "bce_log_sigmoid": (
        lambda z, b: -(b["tb"] * jax.nn.log_sigmoid(z)
                       + (1 - b["tb"]) * jax.nn.log_sigmoid(-z)),
        lambda z, b: kfl.sigmoid_binary_cross_entropy(z, b["tb"])),
    "bce_logaddexp": (
        lambda z, b: jnp.logaddexp(0.0, z) - b["tb"] * z,
        lambda z, b: kfl.sigmoid_binary_cross_entropy(z, b["tb"])),
    "bernoulli_likelihood_of_probabilities": (
        lambda z, b: -(b["tb"] * jnp.log(jax.nn.sigmoid(z))
                       + (1 - b["tb"]) * jnp.log(1 - jax.nn.sigmoid(z))),
        lambda z, b: kfl.sigmoid_binary_cross_entropy(z, b["tb"])),
    "optax_l2_loss": (
        lambda z, b: optax.l2_loss(z, b["t"]),
        lambda z, b: kfl.l2_loss(z, b["t"])),
    "optax_squared_error": (
        lambda z, b: optax.squared_error(z, b["t"]),
        lambda z, b: kfl.squared_error(z, b["t"])),
    "squared_difference": (
        lambda z, b: (z - b["t"]) ** 2,
        lambda z, b: kfl.squared_error(z, b["t"])),
    "gaussian_likelihood": (
        lambda z, b: 0.5 * ((b["t"] - z) / SIGMA) ** 2 + _CONST,
        lambda z, b: kfl.registered_loss(Normal(SIGMA ** 2), z, b["t"])
        + _CONST),
}


def _per_example(v, x):
  """``x`` [N] laid out against values ``v`` ([N] or [N, K])."""
  return x.reshape((N,) + (1,) * (v.ndim - 1))


# How the per-element values ``v`` become the loss.
REDUCTIONS = {
    "mean": lambda v, b: v.mean(),
    "sum": lambda v, b: v.sum(),
    "per_example_then_mean": lambda v, b: v.reshape(N, -1).sum(-1).mean(),
    "mask_over_its_count": lambda v, b: (
        (v * _per_example(v, b["m"])).sum()
        / (b["m"].sum() * (v.size // N))),
    "weighted_mean": lambda v, b: jnp.average(
        v, weights=jnp.broadcast_to(_per_example(v, b["w"]), v.shape)),
}
ESTIMATIONS = ("fisher", "empirical")


def _loss(values, reduction):
  return lambda p, b: REDUCTIONS[reduction](values(_logits(p, b), b), b)


def _assert_same(got, want, what):
  # Both sides run the same float64 operations but for the recognised mark
  # (x + 0, the probe scaled by ±1): equal up to a few roundings of O(1)
  # values through three reductions of N·K terms.
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12, err_msg=what)


@pytest.mark.parametrize("form", list(FORMS))
def test_hand_written_loss_has_its_registered_twins_statistics(form):
  plain, twin = FORMS[form]
  with x64_mode(True):
    params, batch = _data()
    fns = {(r, e, which): kfl.value_grad_and_stats(
        _loss(values, r), params, batch, estimation=e)
           for r in REDUCTIONS for e in ESTIMATIONS
           for which, values in (("plain", plain), ("twin", twin))}
    for (r, e, which), fn in fns.items():
      assert len(fn.tagged.losses) == 1, (r, which)
      assert (fn.tagged.losses[0].recognised is None) == (which == "twin")
      assert not fn.tagged.unrecognised, fn.tagged.unrecognised
    key = jax.random.PRNGKey(3)
    out = jax.jit(lambda p, b: {k: fn(p, b, key) for k, fn in fns.items()})(
        params, batch)
    for r in REDUCTIONS:
      for e in ESTIMATIONS:
        got, want = out[(r, e, "plain")], out[(r, e, "twin")]
        _assert_same((got.loss, got.grads, got.stats, got.weights),
                     (want.loss, want.grads, want.stats, want.weights),
                     f"{form}, {r}, {e}")


def _framework_cases():
  """name -> (hand-written loss, its registered twin, params, batch) of a
  float64 model; call in x64 mode."""
  params, batch = _data()
  cases = {}

  def per_example(p, b):  # A single example's CE, vmapped over the batch.
    ce = lambda z, y: optax.softmax_cross_entropy_with_integer_labels(z, y)
    return jnp.mean(jax.vmap(ce)(_logits(p, b), b["y"]))

  cases["vmap_per_example"] = (
      per_example, lambda p, b: kfl.softmax_cross_entropy_with_integer_labels(
          _logits(p, b), b["y"]).mean(), params, batch)
  cases["jit"] = (
      jax.jit(lambda p, b: optax.sigmoid_binary_cross_entropy(
          _logits(p, b), b["tb"]).mean()),
      lambda p, b: kfl.sigmoid_binary_cross_entropy(
          _logits(p, b), b["tb"]).mean(), params, batch)

  @jax.custom_jvp
  def log_softmax(z):
    return z - jax.nn.logsumexp(z, -1, keepdims=True)

  @log_softmax.defjvp
  def _(primals, tangents):
    (z,), (dz,) = primals, tangents
    y = log_softmax(z)
    return y, dz - jnp.sum(jnp.exp(y) * dz, -1, keepdims=True)

  cases["custom_jvp"] = (
      lambda p, b: -jnp.take_along_axis(log_softmax(_logits(p, b)),
                                        b["y"][:, None], -1).mean(),
      lambda p, b: kfl.softmax_cross_entropy_with_integer_labels(
          _logits(p, b), b["y"]).mean(), params, batch)

  import flax.linen as nn
  mlp = nn.Sequential([nn.Dense(5, param_dtype=jnp.float64), nn.tanh,
                       nn.Dense(K, param_dtype=jnp.float64)])
  fp = mlp.init(jax.random.PRNGKey(0), batch["x"])
  cases["flax_linen"] = (
      lambda p, b: optax.softmax_cross_entropy(
          mlp.apply(p, b["x"]), b["onehot"]).mean(),
      lambda p, b: kfl.softmax_cross_entropy(
          mlp.apply(p, b["x"]), b["onehot"]).mean(), fp, batch)

  import haiku as hk

  def haiku_loss(registered):
    def f(x, y):  # Haiku's MNIST example: one sum, then ÷ the batch.
      logits = hk.nets.MLP([5, K], activation=jnp.tanh)(x)
      labels = jax.nn.one_hot(y, K, dtype=logits.dtype)
      if registered:
        return kfl.softmax_cross_entropy(logits, labels).sum() / x.shape[0]
      return -jnp.sum(labels * jax.nn.log_softmax(logits)) / x.shape[0]
    t = hk.without_apply_rng(hk.transform(f))
    return t, lambda p, b: t.apply(p, b["x"], b["y"])

  t, plain = haiku_loss(False)
  hp = jax.tree.map(lambda a: a.astype(jnp.float64),
                    t.init(jax.random.PRNGKey(0), batch["x"], batch["y"]))
  cases["haiku"] = (plain, haiku_loss(True)[1], hp, batch)

  import equinox as eqx
  model = eqx.nn.MLP(3, K, 5, 1, activation=jnp.tanh,
                     key=jax.random.PRNGKey(0), dtype=jnp.float64)
  ep, static = eqx.partition(model, eqx.is_array)

  def eqx_loss(p, b):  # A per-example squared error under filter_vmap.
    net = eqx.combine(p, static)
    per = eqx.filter_vmap(lambda x, t: jnp.sum((net(x) - t) ** 2))
    return jnp.mean(per(b["x"], b["t"]))

  cases["equinox_filter_vmap"] = (
      eqx_loss, lambda p, b: kfl.squared_error(
          jax.vmap(eqx.combine(p, static))(b["x"]), b["t"]).sum(-1).mean(),
      ep, batch)
  return cases


FRAMEWORKS = ("vmap_per_example", "jit", "custom_jvp", "flax_linen", "haiku",
              "equinox_filter_vmap")


@pytest.mark.parametrize("case", FRAMEWORKS)
def test_recognised_inside_frameworks_and_transforms(case):
  with x64_mode(True):
    plain, twin, params, batch = _framework_cases()[case]
    fns = {(e, which): kfl.value_grad_and_stats(f, params, batch,
                                                estimation=e)
           for e in ESTIMATIONS for which, f in (("plain", plain),
                                                  ("twin", twin))}
    (tag,) = fns[("fisher", "plain")].tagged.losses
    assert tag.recognised is not None, case
    assert not fns[("fisher", "plain")].tagged.unrecognised
    key = jax.random.PRNGKey(3)
    out = jax.jit(lambda p, b: {k: fn(p, b, key) for k, fn in fns.items()})(
        params, batch)
    for e in ESTIMATIONS:
      got, want = out[(e, "plain")], out[(e, "twin")]
      _assert_same((got.loss, got.grads, got.stats, got.weights),
                   (want.loss, want.grads, want.stats, want.weights),
                   f"{case}, {e}")


def test_a_fitted_variance_survives_a_retrace_at_another_batch_size():
  """A Gaussian of σ = 0.3 in float32: its variance is fitted (not a round
  number); the step's re-trace at other batch sizes must find the same
  distribution, not one refitted at other draws."""
  def loss(p, b):
    return jnp.mean(0.5 * ((_logits(p, b) - b["t"]) / SIGMA) ** 2)

  params = {"w1": jnp.asarray(rand(0, (3, 5), np.float32)),
            "w2": jnp.asarray(rand(1, (5, K), np.float32))}
  batch = lambda n: {"x": jnp.asarray(rand(n, (n, 3), np.float32)),
                     "t": jnp.asarray(rand(n + 1, (n, K), np.float32))}
  fn = kfl.value_grad_and_stats(loss, params, batch(N))
  (tag,) = fn.tagged.losses
  # float32 rounding of 0.3² and of the fit: a few ulps of 0.09.
  np.testing.assert_allclose(tag.distribution.variance, SIGMA ** 2,
                             rtol=1e-6)
  step = jax.jit(fn)
  for n in (5, 7):  # Each a new trace of the same loss.
    assert np.isfinite(step(params, batch(n), jax.random.PRNGKey(0)).loss)


def test_two_hand_written_losses_in_one_loss_fn():
  """A classifier head and a regression head trained together: both are
  recognised (and an L1 term reported, not), with the statistics of the
  same two losses registered."""
  def loss(registered):
    def fn(p, b):
      z = _logits(p, b)
      if registered:
        ce = kfl.softmax_cross_entropy_with_integer_labels(z[:, :2], b["y"] % 2)
        se = kfl.squared_error(z[:, 2:], b["t"][:, 2:])
      else:
        ce = optax.softmax_cross_entropy_with_integer_labels(z[:, :2],
                                                            b["y"] % 2)
        se = (z[:, 2:] - b["t"][:, 2:]) ** 2
      return ce.mean() + 0.5 * se.sum(-1).mean() + 0.1 * jnp.abs(z).mean()
    return fn

  with x64_mode(True):
    params, batch = _data()
    fns = [kfl.value_grad_and_stats(loss(r), params, batch) for r in (0, 1)]
    plain = fns[0].tagged
    assert [type(t.distribution).__name__ for t in plain.losses] == [
        "Categorical", "Normal"]
    assert all(t.recognised is not None for t in plain.losses)
    assert plain.unrecognised == (
        "a scalar term from `mul` (reaches `abs` without a loss head)",)
    key = jax.random.PRNGKey(3)
    got, want = jax.jit(lambda p, b: [fn(p, b, key) for fn in fns])(
        params, batch)
    _assert_same((got.loss, got.grads, got.stats, got.weights),
                 (want.loss, want.grads, want.stats, want.weights), "two")


def test_a_large_head_is_verified_on_two_examples(monkeypatch):
  """A head above VERIFY_LIMIT output elements (an LM's logits) is checked
  on a trace of the loss at 2 examples, not at the batch's size; a loss
  that only traces at its own batch size is checked at it."""
  from kfac_jax_lite.tagging import _loss_heads, _tagged
  monkeypatch.setattr(_tagged, "VERIFY_LIMIT", 10)
  monkeypatch.setattr(_loss_heads, "_VERIFIED", {})
  params = {"w1": jnp.asarray(rand(0, (3, 5), np.float32)),
            "w2": jnp.asarray(rand(1, (5, K), np.float32))}
  batch = {"x": jnp.asarray(rand(2, (N, 3), np.float32)),
           "y": jnp.arange(N) % K}
  fixed_size = lambda p, b: -jax.nn.log_softmax(_logits(p, b))[
      jnp.arange(N), b["y"]].mean()  # Traces at N examples only.
  for loss, n in ((lambda p, b: optax.softmax_cross_entropy_with_integer_labels(
      _logits(p, b), b["y"]).mean(), 2), (fixed_size, N)):
    _loss_heads._VERIFIED.clear()
    (tag,) = kfl.tagging.find_layers(loss, params, batch).losses
    assert tag.recognised is not None
    shapes = {ref[1] for _, (ref, *_), *_ in _loss_heads._VERIFIED}
    assert shapes == {f"float32[{n},{K}]"}, shapes
