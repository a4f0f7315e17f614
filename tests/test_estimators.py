"""Estimators against the exact Fisher / GGN formed from per-example Jacobians."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kfl
from kfac_jax_lite import distributions as dists

N, D_IN, H, D_OUT = 4, 3, 4, 3
KEY = jax.random.PRNGKey(0)
PARAMS = {
    "w1": jax.random.normal(jax.random.PRNGKey(1), (D_IN, H)),
    "b1": 0.1 * jax.random.normal(jax.random.PRNGKey(2), (H,)),
    "scale": 1.0 + 0.1 * jax.random.normal(jax.random.PRNGKey(3), (H,)),
    "w2": jax.random.normal(jax.random.PRNGKey(4), (H, D_OUT)),
}
X = jax.random.normal(jax.random.PRNGKey(5), (N, D_IN))
LABELS = jnp.array([0, 2, 1, 1])
TARGETS = jax.random.normal(jax.random.PRNGKey(6), (N, D_OUT))


def net(p, x):
  h = jnp.tanh(x @ p["w1"] + p["b1"]) * p["scale"]
  return h @ p["w2"]


LOSSES = {
    "softmax": (lambda o, b: kfl.softmax_cross_entropy_with_integer_labels(o, b["y"]),
                lambda o, y: dists.Categorical(True).fisher_sqrt((o,))[0]),
    "sigmoid": (lambda o, b: kfl.sigmoid_binary_cross_entropy(o, b["t"] > 0).sum(-1),
                lambda o, y: jnp.vectorize(jnp.diag, signature="(n)->(n,n)")(
                    dists.Bernoulli().fisher_sqrt((o,))[0][..., 0])),
    "squared": (lambda o, b: kfl.squared_error(o, b["t"]).sum(-1),
                lambda o, y: jnp.sqrt(2.0) * jnp.broadcast_to(
                    jnp.eye(o.shape[-1]), o.shape + o.shape[-1:])),
}
BATCH = {"x": X, "y": LABELS, "t": TARGETS}


def make_loss(kind, reduce="mean"):
  per_example = LOSSES[kind][0]

  def loss_fn(p, b):
    values = per_example(net(p, b["x"]), b)
    if reduce == "mean":
      return values.mean()
    if reduce == "sum":
      return values.sum()
    mask = b["mask"]
    return (values * mask).sum() / mask.sum()
  return loss_fn


@functools.lru_cache(maxsize=None)
def estimator(kind, estimation, num_samples=1, reduce="mean", n=N, masked=False):
  batch = dict(BATCH, mask=jnp.ones(N)) if masked else BATCH
  batch = jax.tree.map(lambda x: x[:n], batch)
  fn = kfl.value_grad_and_stats(make_loss(kind, reduce), PARAMS, batch,
                                estimation=estimation, num_samples=num_samples)
  return fn.tagged, jax.jit(fn)


def dense_blocks(kind, estimation, batch, num_samples=1, reduce="mean",
                 key=KEY, masked=False):
  """``{block name: to_dense}`` after one estimate."""
  tagged, fn = estimator(kind, estimation, num_samples, reduce,
                         len(batch["x"]), masked)
  est = fn(PARAMS, batch, key)
  out = {}
  for layer in tagged.layers:
    state = layer.block.update(layer.block.init(), est.stats[layer.name], 0.5)
    out[layer.name] = np.asarray(layer.block.to_dense(state), np.float64)
  return out, tagged


def exact_fisher(kind, batch, c, layer, ggn=False):
  """``Σ_i c_i J_iᵀ M_i J_i`` over the layer's parameters, brute force."""
  names = layer.params

  def logits(theta, x):
    p = dict(PARAMS, **dict(zip(names, theta)))
    return net(p, x[None])[0]

  theta = tuple(PARAMS[k] for k in names)
  total = 0
  for i in range(len(batch["x"])):
    jac = jax.jacrev(logits)(theta, batch["x"][i])
    jac = np.concatenate([np.asarray(j).reshape(D_OUT, -1) for j in jac], 1)
    o = net(PARAMS, batch["x"][i:i + 1])
    b = np.asarray(LOSSES[kind][1](o, None))[0]
    total = total + c[i] * jac.T @ (b @ b.T) @ jac
  return total


@pytest.mark.parametrize("kind", sorted(LOSSES))
@pytest.mark.parametrize("estimation", ["exact", "exact_ggn"])
def test_exact_mode_with_one_example_is_the_exact_fisher(kind, estimation):
  batch = jax.tree.map(lambda x: x[:1], BATCH)
  got, tagged = dense_blocks(kind, estimation, batch)
  assert {l.kind for l in tagged.layers} == {"dense", "scale_and_shift"}
  for layer in tagged.layers:
    expected = exact_fisher(kind, batch, [1.0], layer)
    if layer.kind == "scale_and_shift":  # Diagonal block: the diagonal.
      expected = np.diag(np.diag(expected))
    np.testing.assert_allclose(got[layer.name], expected, rtol=1e-4,
                               atol=1e-5 * np.abs(expected).max())


def factors(kind, estimation, batch, **kw):
  tagged, fn = estimator(kind, estimation, kw.pop("num_samples", 1),
                         kw.pop("reduce", "mean"), len(batch["x"]),
                         kw.pop("masked", False))
  est = fn(PARAMS, batch, kw.pop("key", KEY))
  return {k: jax.tree.map(np.asarray, v) for k, v in est.stats.items()}, est


def test_exact_mode_over_a_batch_combines_examples_as_the_brief_says():
  # A = Σ w_i a_i a_iᵀ and G = Σ c_i G_i, with G_i the one-example factor.
  full, _ = factors("softmax", "exact", BATCH)
  singles = [factors("softmax", "exact", jax.tree.map(lambda x: x[i:i + 1],
                                                       BATCH))[0]
             for i in range(N)]
  for name in ("w1", "w2"):
    np.testing.assert_allclose(full[name].a, sum(s[name].a for s in singles) / N,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(full[name].g, sum(s[name].g for s in singles) / N,
                               rtol=1e-5, atol=1e-6)


def relative_error(kind, estimation, num_samples):
  exact, _ = factors(kind, "exact", BATCH)
  approx, _ = factors(kind, estimation, BATCH, num_samples=num_samples,
                      key=jax.random.PRNGKey(42))
  g, g_hat = exact["w1"].g, approx["w1"].g
  return float(np.linalg.norm(g_hat - g) / np.linalg.norm(g))


@pytest.mark.parametrize("estimation", ["fisher", "curvature_prop"])
def test_sampled_modes_converge_to_exact(estimation):
  errors = [relative_error("softmax", estimation, s) for s in (1, 16, 1024)]
  assert errors[2] < 0.06, errors  # Fixed seed; the tolerance is ~3/√1024.
  assert errors[2] < errors[0] / 4, errors


def test_empirical_mode_uses_data_targets():
  got, est = factors("softmax", "empirical", BATCH)

  def per_example_loss(s, y):  # ℓ_i as a function of the w2 pre-activation.
    return optax.softmax_cross_entropy_with_integer_labels(s, y)

  h = jnp.tanh(X @ PARAMS["w1"] + PARAMS["b1"]) * PARAMS["scale"]
  g = jax.vmap(jax.grad(per_example_loss))(h @ PARAMS["w2"], LABELS)
  np.testing.assert_allclose(got["w2"].g[0], np.asarray(g.T @ g) / N, rtol=1e-5)
  np.testing.assert_allclose(got["w2"].a[0], np.asarray(h.T @ h) / N, rtol=1e-5)
  # Without a registered loss: the same, assuming a mean over the batch.
  plain = lambda p, b: optax.softmax_cross_entropy_with_integer_labels(
      net(p, b["x"]), b["y"]).mean()
  fn = kfl.value_grad_and_stats(plain, PARAMS, BATCH, estimation="empirical")
  est2 = jax.jit(fn)(PARAMS, BATCH, KEY)
  np.testing.assert_allclose(est2.stats["w2"].g, got["w2"].g, rtol=1e-5)
  with pytest.raises(ValueError, match="registered loss.*softmax_cross_entropy"):
    kfl.value_grad_and_stats(plain, PARAMS, BATCH, estimation="fisher")(
        PARAMS, BATCH, KEY)


def test_one_pass_loss_and_gradient_equal_value_and_grad():
  loss_fn = make_loss("softmax")
  _, est = factors("softmax", "fisher", BATCH)
  loss, grads = jax.jit(jax.value_and_grad(loss_fn))(PARAMS, BATCH)
  np.testing.assert_array_equal(est.loss, loss)
  for k in grads:
    np.testing.assert_allclose(est.grads[k], grads[k], rtol=1e-6, atol=1e-7)


def test_sum_reduction_and_masks_read_weights_from_the_backward_pass():
  mean, _ = factors("softmax", "exact", BATCH)
  total, est = factors("softmax", "exact", BATCH, reduce="sum")
  np.testing.assert_allclose(est.weights, np.ones(N))
  np.testing.assert_allclose(total["w2"].g, N * mean["w2"].g, rtol=1e-5)
  np.testing.assert_allclose(total["w2"].a, mean["w2"].a, rtol=1e-5)
  # Masking out the last example = the first three alone.
  masked = dict(BATCH, mask=jnp.array([1.0, 1.0, 1.0, 0.0]))
  got, est = factors("softmax", "exact", masked, reduce="masked", masked=True)
  np.testing.assert_allclose(est.weights, [1 / 3, 1 / 3, 1 / 3, 0], rtol=1e-6)
  three, _ = factors("softmax", "exact", jax.tree.map(lambda x: x[:3], BATCH))
  for name in ("w1", "w2"):
    np.testing.assert_allclose(got[name].a, three[name].a, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got[name].g, three[name].g, rtol=1e-5, atol=1e-7)


def test_fisher_and_ggn_differ_only_for_the_mean_variance_normal():
  def loss_fn(p, b):
    o = net(p, b["x"])
    return kfl.gaussian_nll(o[:, 0], jax.nn.softplus(o[:, 1]) + 0.1,
                            b["t"][:, 0]).mean()

  natural = {e: factors("softmax", e, BATCH)[0] for e in ("exact", "exact_ggn")}
  np.testing.assert_allclose(natural["exact"]["w1"].g, natural["exact_ggn"]["w1"].g,
                             rtol=1e-5)
  out = {}
  for e in ("exact", "exact_ggn"):
    fn = kfl.value_grad_and_stats(loss_fn, PARAMS, BATCH, estimation=e)
    out[e] = np.asarray(jax.jit(fn)(PARAMS, BATCH, KEY).stats["w1"].g)
  assert np.all(np.isfinite(out["exact_ggn"]))
  assert np.linalg.norm(out["exact"] - out["exact_ggn"]) > 0.05 * np.linalg.norm(
      out["exact"])


def test_bad_estimation_names_the_choices():
  with pytest.raises(ValueError, match="estimation must be one of"):
    kfl.value_grad_and_stats(make_loss("softmax"), PARAMS, BATCH,
                             estimation="natural")


def conv_embed_net(p, b):
  # A conv whose window covers its input (one output location), and an
  # embedding lookup of one id per example, feeding a dense softmax head.
  y = (jax.lax.conv_general_dilated(
      b["img"], p["kernel"], (1,), "VALID",
      dimension_numbers=("NWC", "WIO", "NWC")) + p["conv_bias"])[:, 0]
  return (jnp.tanh(y) + p["table"][b["ids"]]) @ p["head"]


def test_exact_mode_is_the_exact_fisher_for_conv_and_embedding_layers():
  p = {"kernel": jax.random.normal(KEY, (3, 2, 4)), "conv_bias": jnp.zeros(4),
       "table": jax.random.normal(jax.random.PRNGKey(7), (5, 4)),
       "head": jax.random.normal(jax.random.PRNGKey(8), (4, 3))}
  b = {"img": jax.random.normal(jax.random.PRNGKey(9), (1, 3, 2)),
       "ids": jnp.array([3]), "y": jnp.array([1])}
  loss_fn = lambda p, b: kfl.softmax_cross_entropy_with_integer_labels(
      conv_embed_net(p, b), b["y"]).mean()
  fn = kfl.value_grad_and_stats(loss_fn, p, b, estimation="exact")
  est = jax.jit(fn)(p, b, KEY)
  kinds = {l.name: l.kind for l in fn.tagged.layers}
  assert kinds == {"kernel": "conv", "table": "embedding", "head": "dense"}
  o = conv_embed_net(p, b)
  root = np.asarray(dists.Categorical(True).fisher_sqrt((o,))[0][0])
  for layer in fn.tagged.layers:
    def logits(theta):
      return conv_embed_net(dict(p, **dict(zip(layer.params, theta))), b)[0]
    jac = jax.jacrev(logits)(tuple(p[k] for k in layer.params))
    jac = np.concatenate([np.asarray(j).reshape(3, -1) for j in jac], 1)
    expected = jac.T @ root @ root.T @ jac
    state = layer.block.update(layer.block.init(), est.stats[layer.name], 0.5)
    np.testing.assert_allclose(layer.block.to_dense(state), expected,
                               rtol=1e-4, atol=1e-5 * np.abs(expected).max())


def test_conv_bias_added_after_a_slice_is_a_shift_block_of_its_own():
  def loss_fn(p, b):
    y = jax.lax.conv_general_dilated(
        b["img"], p["kernel"], (1,), "VALID",
        dimension_numbers=("NWC", "WIO", "NWC"))[:, 0] + p["conv_bias"]
    return kfl.softmax_cross_entropy_with_integer_labels(y, b["y"]).mean()

  p = {"kernel": jnp.ones((3, 2, 4)), "conv_bias": jnp.zeros(4)}
  b = {"img": jnp.ones((2, 3, 2)), "y": jnp.array([1, 0])}
  fn = kfl.value_grad_and_stats(loss_fn, p, b, estimation="exact")
  assert [(l.name, l.kind) for l in fn.tagged.layers] == [
      ("conv_bias", "scale_and_shift"), ("kernel", "conv")]
  est = jax.jit(fn)(p, b, KEY)
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(est.stats))
