"""Estimators against the exact Fisher / GGN formed from per-example Jacobians."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kfl

import _helpers
from _helpers import x64_mode

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


# kind -> (per-example loss, its output curvature M(logits) [..., K, K]).
# M is built from first principles (not from the library's square roots):
# softmax diag(p) − ppᵀ, sigmoid diag(σ(1 − σ)), squared error (o − t)²: 2I.
# For these natural-parameter losses Fisher = GGN = the Hessian in o.
LOSSES = {
    "softmax": (lambda o, b: kfl.softmax_cross_entropy_with_integer_labels(o, b["y"]),
                _helpers.softmax_fisher),
    "sigmoid": (lambda o, b: kfl.sigmoid_binary_cross_entropy(o, b["t"] > 0).sum(-1),
                _helpers.sigmoid_fisher),
    "squared": (lambda o, b: kfl.squared_error(o, b["t"]).sum(-1),
                lambda o: 2.0 * np.broadcast_to(
                    np.eye(o.shape[-1]), o.shape + o.shape[-1:])),
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


# The references and the blocks' dense forms are jitted: one compile per
# model, layer (or block) and shapes, shared by the tests, where eager mode
# compiles every operation.
@functools.partial(jax.jit, static_argnums=0)
def block_dense(block, stats):
  """``to_dense`` after one update of a fresh state with ``stats``."""
  return block.to_dense(block.update(block.init(), stats, 0.5))


@functools.partial(jax.jit, static_argnames=("model", "names"))
def jacobian_and_logits(params, inputs, i, model, names):
  """The Jacobian of example ``i``'s logits in ``params[names]`` (one array
  per name) and those logits; ``model(params, inputs)`` maps a batch of
  inputs (a pytree with examples on the leading axis) to logits."""
  one = jax.tree.map(lambda a: a[i][None], inputs)

  def logits(theta):
    return model(dict(params, **dict(zip(names, theta))), one)[0]

  theta = tuple(params[k] for k in names)
  return jax.jacrev(logits)(theta), logits(theta)


def dense_blocks(kind, estimation, batch, num_samples=1, reduce="mean",
                 key=KEY, masked=False):
  """``{block name: to_dense}`` after one estimate."""
  tagged, fn = estimator(kind, estimation, num_samples, reduce,
                         len(batch["x"]), masked)
  est = fn(PARAMS, batch, key)
  out = {}
  for layer in tagged.layers:
    out[layer.name] = _dense_of(layer, est.stats[layer.name])
  return out, tagged


def exact_fisher(kind, batch, c, layer, curvature=None, model=None,
                 params=None):
  """``Σ_i c_i J_iᵀ M_i J_i`` over the layer's parameters, brute force;
  ``M_i = curvature(logits_i, i)`` (default: the loss's exact Fisher).
  ``model(params, x)`` (default ``net``) maps a batch of inputs to logits."""
  model = net if model is None else model
  params = PARAMS if params is None else params
  total = 0
  for i in range(len(batch["x"])):
    jac, o = jacobian_and_logits(params, batch["x"], i, model=model,
                                 names=tuple(layer.params))
    jac = np.concatenate([np.asarray(j).reshape(D_OUT, -1) for j in jac], 1)
    o = np.asarray(o)
    m = LOSSES[kind][1](o) if curvature is None else curvature(o, i)
    total = total + c[i] * jac.T @ m @ jac
  return total


def empirical_curvature(labels):
  """``M_i = r_i r_iᵀ``, ``r_i = softmax(o_i) − e_{y_i}``: the softmax
  cross-entropy's gradient in the logits at the data label, outer itself."""
  def m(o, i):
    p = np.exp(o - o.max())
    r = p / p.sum() - np.eye(len(o))[int(labels[i])]
    return np.outer(r, r)
  return m


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

  @jax.jit  # One compile instead of one per operation.
  def reference(p, x, labels):
    h = jnp.tanh(x @ p["w1"] + p["b1"]) * p["scale"]
    g = jax.vmap(jax.grad(per_example_loss))(h @ p["w2"], labels)
    return g.T @ g, h.T @ h

  gg, hh = reference(PARAMS, X, LABELS)
  np.testing.assert_allclose(got["w2"].g[0], np.asarray(gg) / N, rtol=1e-5)
  np.testing.assert_allclose(got["w2"].a[0], np.asarray(hh) / N, rtol=1e-5)
  # Without a loss the estimator sees (the CE computed in a lax.scan step,
  # which the recognition does not enter; issue 23): the same, assuming a
  # mean over the batch.
  def plain(p, b):
    step = lambda c, _: (c, optax.softmax_cross_entropy_with_integer_labels(
        net(p, b["x"]), b["y"]).mean())
    return jax.lax.scan(step, 0.0, None, length=1)[1][0]

  fn = kfl.value_grad_and_stats(plain, PARAMS, BATCH, estimation="empirical")
  assert not fn.tagged.losses
  est2 = jax.jit(fn)(PARAMS, BATCH, KEY)
  np.testing.assert_allclose(est2.stats["w2"].g, got["w2"].g, rtol=1e-5)


def _unrecognised_loss(p, b):
  """A loss no registration marks: the estimations that need one refuse."""
  return jnp.mean(jnp.abs(net(p, b["x"]) - b["t"]))


@pytest.mark.parametrize("estimation",
                         ["fisher", "exact", "curvature_prop"])
def test_a_loss_without_registration_is_refused_when_built_not_at_a_step(
    estimation):
  # Issue 23: value_grad_and_stats at its construction; kfl.kfac and
  # kfl.kfac_optimizer (built without params) at tx.init, before any step.
  fix = ("needs a registered or recognised loss, and none was found in "
         "loss_fn; its terms: a scalar term from `div` \\(reaches `abs` "
         "without a loss head\\).*kfl.softmax_cross_entropy.*or use "
         "estimation='empirical'")
  with pytest.raises(ValueError, match="value_grad_and_stats: .*" + fix):
    kfl.value_grad_and_stats(_unrecognised_loss, PARAMS, BATCH,
                             estimation=estimation)
  tx = kfl.kfac(_unrecognised_loss, BATCH, estimation=estimation)
  with pytest.raises(ValueError, match="kfl.kfac: .*" + fix):
    tx.init(PARAMS)
  opt = kfl.kfac_optimizer(_unrecognised_loss, BATCH)
  with pytest.raises(ValueError, match="kfl.kfac_optimizer needs a registered "
                     "or recognised loss.*none was found"):
    opt.init(PARAMS)


def test_a_loss_without_registration_builds_for_the_empirical_estimation():
  kfl.value_grad_and_stats(_unrecognised_loss, PARAMS, BATCH,
                           estimation="empirical")
  kfl.kfac(_unrecognised_loss, BATCH, estimation="empirical").init(PARAMS)


def test_empirical_without_a_loss_finds_the_examples_beside_a_key_and_state():
  """Issue 23: a batch that also holds a PRNG key (dropout), model state and
  a scalar (no shared leading size): the examples are the leaves of the
  layers' example-axis size, describe says which, and the statistics are
  the per-example gradients' with N = 6 (float64 brute force)."""
  n, k = 6, D_OUT

  def model(p, b):
    h = jnp.tanh(b["x"] @ p["w1"])
    keep = jax.random.bernoulli(b["key"], 0.7, h.shape)
    h = jnp.where(keep, h / 0.7, 0.0) * b["state"]["scale"] * b["step"]
    return h, h @ p["w2"]

  def loss(p, b):  # L1: no loss the estimators know.
    return jnp.mean(jnp.abs(model(p, b)[1] - b["t"]))

  with x64_mode(True):
    params = {"w1": jnp.asarray(_helpers.rand(0, (D_IN, H))),
              "w2": jnp.asarray(_helpers.rand(1, (H, k)))}
    batch = {"x": jnp.asarray(_helpers.rand(2, (n, D_IN))),
             "t": jnp.asarray(_helpers.rand(3, (n, k))),
             "key": jax.random.PRNGKey(7),  # uint32[2]
             "state": {"scale": jnp.asarray(1 + _helpers.rand(4, (H,)))},
             "step": jnp.asarray(1.5)}
    fn = kfl.value_grad_and_stats(loss, params, batch, estimation="empirical")
    assert fn.tagged.examples.names == ("batch/t", "batch/x")
    assert str(kfl.describe(loss, params, batch)).splitlines()[-1] == (
        "examples: the leading axis (N=6) of batch/t, batch/x (the layers' "
        "inputs); not examples: batch/key, batch/state/scale, batch/step")
    est = jax.jit(fn)(params, batch, KEY)
    h, out = jax.jit(model)(params, batch)  # One compile, not one per op.
    g = np.sign(np.asarray(out) - np.asarray(batch["t"])) / k  # ∂ℓ_i/∂s_i.
    h = np.asarray(h)
    # float64 sums of 6 products of O(1) terms (some cancel to 0): within
    # _helpers.rounding_tol(float64, 6, 1) ≈ 1.3e-15.
    tol = _helpers.rounding_tol(np.float64, n, 1.0)
    w2 = jax.tree.map(np.asarray, est.stats["w2"])  # Indexed in numpy.
    np.testing.assert_allclose(w2.g[0], g.T @ g / n, atol=tol)
    np.testing.assert_allclose(w2.a[0], h.T @ h / n, atol=tol)


def test_empirical_without_a_loss_trains_an_equinox_model_with_state_and_key():
  """Issue 23: the fix the refusal names works where the batch holds an
  ``eqx.nn.State`` (BatchNorm statistics) and a dropout key."""
  eqx = pytest.importorskip("equinox")

  class Net(eqx.Module):
    l1: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    drop: eqx.nn.Dropout
    l2: eqx.nn.Linear

    def __init__(self, key, width=5):  # Not N: the state is not examples.
      k1, k2 = jax.random.split(key)
      self.l1 = eqx.nn.Linear(D_IN, width, key=k1)
      self.bn = eqx.nn.BatchNorm(width, axis_name="batch", mode="batch")
      self.drop = eqx.nn.Dropout(0.2)
      self.l2 = eqx.nn.Linear(width, D_OUT, key=k2)

    def __call__(self, x, state, key):
      h, state = self.bn(jnp.tanh(self.l1(x)), state)
      return self.l2(self.drop(h, key=key)), state

  model, state = eqx.nn.make_with_state(Net)(jax.random.PRNGKey(0))
  params, static = eqx.partition(model, eqx.is_array)

  def loss_fn(p, b):
    net = eqx.combine(p, static)
    keys = jax.random.split(b["key"], b["x"].shape[0])
    out, new_state = eqx.filter_vmap(
        net, axis_name="batch", in_axes=(0, None, 0), out_axes=(0, None))(
            b["x"], b["state"], keys)
    return jnp.mean(jnp.abs(out - b["t"])), new_state  # L1: unrecognised.

  batch = {"x": X, "t": TARGETS, "state": state, "key": jax.random.PRNGKey(1)}
  lines = str(kfl.describe(loss_fn, params, batch, has_aux=True)).splitlines()
  assert lines[-1] == (
      "examples: the leading axis (N=4) of batch/t, batch/x (the layers' "
      "inputs); not examples: batch/key, batch/state/0, batch/state/1/0, "
      "batch/state/1/1"), lines[-1]
  tx = kfl.kfac(loss_fn, batch, estimation="empirical", has_aux=True)
  opt_state = tx.init(params)

  @jax.jit
  def step(p, s, b):
    (_, new_state), g = jax.value_and_grad(loss_fn, has_aux=True)(p, b)
    u, s = tx.update(g, s, p, batch=b)
    return optax.apply_updates(p, u), s, new_state

  params2, opt_state, _ = step(params, opt_state, batch)
  assert kfl.health(opt_state).ok
  # numpy: eager jnp would compile each comparison.
  assert all(np.all(np.isfinite(np.asarray(x)))
             for x in jax.tree.leaves(params2))
  assert any(np.any(np.asarray(a) != np.asarray(b)) for a, b in zip(
      jax.tree.leaves(params2), jax.tree.leaves(params)))


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


def _mean_variance(o):
  return o[..., 0], jax.nn.softplus(o[..., 1]) + 0.1


def _normal_nll(mv, t):  # Written out here, independently of the library.
  mean, var = mv
  return 0.5 * jnp.log(2 * jnp.pi * var) + (t - mean) ** 2 / (2 * var)


def mean_variance_loss(p, b):
  mean, var = _mean_variance(net(p, b["x"]))
  return kfl.gaussian_nll(mean, var, b["t"][:, 0]).mean()


@pytest.mark.parametrize("x64", [False, True])
def test_mean_variance_normal_fisher_and_ggn_equal_brute_force(x64):
  # The w1 block's factors from the exact estimators against
  # A = Σ w_i ā_i ā_iᵀ and G = Σ c_i J_iᵀ M_i J_i, J_i = ∂(μ_i, v_i)/∂y_i at
  # w1's pre-activation y_i, with M_i the Fisher diag(1/v, 1/(2v²)) ("exact")
  # or H₊, the PSD part of the autodiff Hessian of ℓ in (μ, v) ("exact_ggn";
  # that Hessian is indefinite everywhere, so the clipping is exercised).
  with x64_mode(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    params, batch = jax.jit(  # One compile for the casts.
        lambda t: jax.tree.map(lambda x: x.astype(dtype) if x.dtype.kind == "f"
                               else x, t))((PARAMS, BATCH))
    got = {}
    for estimation in ("exact", "exact_ggn"):
      fn = kfl.value_grad_and_stats(mean_variance_loss, params, batch,
                                    estimation=estimation)
      got[estimation] = jax.jit(fn)(params, batch, KEY).stats["w1"]
    x = np.asarray(batch["x"], np.float64)

    @jax.jit  # One compile instead of one per operation.
    def reference(params, batch):
      y = batch["x"] @ params["w1"] + params["b1"]

      def head(y_i):  # (μ_i, v_i) from example i's pre-activation of w1.
        o = (jnp.tanh(y_i) * params["scale"]) @ params["w2"]
        return jnp.stack(_mean_variance(o))

      mv = jax.vmap(head)(y)  # [N, 2]
      hess = jax.vmap(jax.hessian(lambda mv, t: _normal_nll(mv, t)))(
          mv, batch["t"][:, 0])
      return jax.vmap(jax.jacrev(head))(y), mv, hess

    jac, mv, hess = reference(params, batch)
    jac = np.asarray(jac, np.float64)  # [N, 2, H]
    mean, var = np.asarray(mv, np.float64).T
    fisher = np.stack([np.diag([1 / v, 1 / (2 * v**2)]) for v in var])
    hess = np.asarray(hess, np.float64)
    assert np.all(np.linalg.eigvalsh(hess)[:, 0] < 0)  # Indefinite.
    a_bar = np.concatenate([x, np.ones((N, 1))], 1)
    want_a = a_bar.T @ a_bar / N
    tol = dict(rtol=1e-10, atol=1e-12) if x64 else dict(rtol=2e-4, atol=1e-6)
    for estimation, m in (("exact", fisher), ("exact_ggn", _helpers.psd_part(hess))):
      stats = got[estimation]
      want_g = np.einsum("nki,nkl,nlj->ij", jac, m, jac) / N
      np.testing.assert_allclose(stats.g[0], want_g, err_msg=estimation, **tol)
      np.testing.assert_allclose(stats.a[0], want_a, err_msg=estimation, **tol)
    # The two differ here (they coincide for natural parameters).
    assert not np.allclose(_helpers.psd_part(hess), fisher, rtol=0.05)


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
  p, img = jax.jit(lambda: (  # One compile instead of one per operation.
      {"kernel": jax.random.normal(KEY, (3, 2, 4)), "conv_bias": jnp.zeros(4),
       "table": jax.random.normal(jax.random.PRNGKey(7), (5, 4)),
       "head": jax.random.normal(jax.random.PRNGKey(8), (4, 3))},
      jax.random.normal(jax.random.PRNGKey(9), (1, 3, 2))))()
  b = {"img": img, "ids": jnp.array([3]), "y": jnp.array([1])}
  loss_fn = lambda p, b: kfl.softmax_cross_entropy_with_integer_labels(
      conv_embed_net(p, b), b["y"]).mean()
  fn = kfl.value_grad_and_stats(loss_fn, p, b, estimation="exact")
  est = jax.jit(fn)(p, b, KEY)
  kinds = {l.name: l.kind for l in fn.tagged.layers}
  assert kinds == {"kernel": "conv", "table": "embedding", "head": "dense"}
  for layer in fn.tagged.layers:
    jac, logits = jacobian_and_logits(p, b, 0, model=conv_embed_net,
                                      names=tuple(layer.params))
    m = _helpers.softmax_fisher(np.asarray(logits))
    jac = np.concatenate([np.asarray(j).reshape(3, -1) for j in jac], 1)
    expected = jac.T @ m @ jac
    # Both sides in float32 (the reference's Jacobian too), each a chain of
    # ≤ 10 steps of ≤ 6 terms (the conv's 3·2 window, the head's 4 inputs,
    # the softmax's 3 logits and its square root, forward and back, the
    # statistics, the EMA), at the size of the summed terms |J|ᵀ|M||J|
    # (M = diag(p) − ppᵀ cancels).
    terms = np.abs(jac).T @ np.abs(m) @ np.abs(jac)
    _helpers.assert_rounding_close(
        block_dense(layer.block, est.stats[layer.name]), expected,
        terms=6, depth=2 * 10, scale=terms.max())


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


# --- Full / NaiveDiagonal blocks through the estimator ----------------------
# They consume per-example (or per-column) parameter gradients, [S·N, ...]
# with S samples (the columns of B in exact mode), so their statistics must
# be divided by S. Every check below has S > 1.

SAMPLED_CASES = [("exact", 1), ("empirical", 3), ("fisher", 2048)]
BLOCK_NAMES = {"full": "Full", "naive_diagonal": "NaiveDiagonal"}


def _check_against(got, want, estimation, name):
  if estimation == "fisher":  # 2048 sampled targets: a few % of noise.
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < 0.1, (name, err)
  else:
    np.testing.assert_allclose(got, want, rtol=1e-4,
                               atol=1e-5 * np.abs(want).max(), err_msg=name)


def _dense_of(layer, stats):
  return np.asarray(block_dense(layer.block, stats), np.float64)


@pytest.mark.parametrize("estimation,num_samples", SAMPLED_CASES)
def test_full_and_naive_diagonal_overrides_equal_the_brute_force_curvature(
    estimation, num_samples):
  # Overrides put w1 (with b1) on a Full block and w2 on a NaiveDiagonal
  # one: their curvature is exact per example, so over the batch it must
  # equal Σ_i c_i J_iᵀ M_i J_i (M: the softmax Fisher diag(p) − ppᵀ, or
  # r rᵀ at the data labels for "empirical"), or its diagonal.
  fn = kfl.value_grad_and_stats(make_loss("softmax"), PARAMS, BATCH,
                                estimation=estimation, num_samples=num_samples,
                                blocks={"w1": "full", "w2": "naive_diagonal"})
  est = jax.jit(fn)(PARAMS, BATCH, KEY)
  curvature = empirical_curvature(LABELS) if estimation == "empirical" else None
  overridden = {l.params: l for l in fn.tagged.layers if l.kind == "dense"}
  for params, choice in ((("w1", "b1"), "full"), (("w2",), "naive_diagonal")):
    layer = overridden[params]
    assert type(layer.block).__name__ == BLOCK_NAMES[choice]
    want = exact_fisher("softmax", BATCH, np.full(N, 1 / N), layer, curvature)
    if choice == "naive_diagonal":
      want = np.diag(np.diag(want))
    _check_against(_dense_of(layer, est.stats[layer.name]), want, estimation,
                   layer.name)


def fallback_net(p, x):
  # ``m``/``f`` reshaped before their products match no layer pattern:
  # two fallbacks (``f`` is given a Full block by an override).
  return (net(p, x) + jnp.tanh(x) @ p["m"].reshape(D_IN, D_OUT)
          + jnp.sin(x) @ p["f"].reshape(D_IN, D_OUT))


FB_PARAMS = dict(PARAMS, **{
    k: 0.3 * jax.random.normal(jax.random.PRNGKey(i), (D_IN * D_OUT,))
    for i, k in ((11, "m"), (12, "f"))})


def fallback_loss(p, b):
  return kfl.softmax_cross_entropy_with_integer_labels(
      fallback_net(p, b["x"]), b["y"]).mean()


def _fallback_check(estimation, num_samples, batch):
  fn = kfl.value_grad_and_stats(fallback_loss, FB_PARAMS, batch,
                                estimation=estimation, num_samples=num_samples,
                                blocks={"f": "full"})
  fallbacks = {l.params: l for l in fn.tagged.layers if l.kind == "fallback"}
  assert {k: type(l.block).__name__ for k, l in fallbacks.items()} == {
      ("m",): "NaiveDiagonal", ("f",): "Full"}
  est = jax.jit(fn)(FB_PARAMS, batch, KEY)
  n = len(batch["x"])
  curvature = (empirical_curvature(batch["y"]) if estimation == "empirical"
               else None)
  for layer in fallbacks.values():
    want = exact_fisher("softmax", batch, np.full(n, 1 / n), layer, curvature,
                        model=fallback_net, params=FB_PARAMS)
    if layer.params == ("m",):
      want = np.diag(np.diag(want))
    _check_against(_dense_of(layer, est.stats[layer.name]), want, estimation,
                   layer.name)


@pytest.mark.parametrize("estimation,num_samples,n", [
    (e, s, N) for e, s in SAMPLED_CASES] + [("exact", 1, 1)])
def test_fallback_blocks_equal_the_brute_force_curvature(estimation,
                                                         num_samples, n):
  # A true fallback in "exact"/"empirical" takes each example's own
  # parameter gradient (per column / sample): the sum of their outer
  # products is exact over a batch, with no cross-example terms
  # √(c_i c_j) J_iᵀ b_i b_jᵀ J_j (the outer product of one batch gradient
  # had them). Sampled "fisher" takes the batch gradient of Σ_e √c_e u_e
  # per sample: unbiased, since the examples' draws are independent.
  _fallback_check(estimation, num_samples, jax.tree.map(lambda x: x[:n], BATCH))


# --- Loss weights that do not sum to one -------------------------------------

def test_embedding_input_factor_uses_normalised_loss_weights():
  # L = Σ_i c_i ℓ_i with c = (0.5, 2, 1.5), Σc = 4: the input factors use
  # w = c / Σc (A = Σ_i w_i e_{id_i} e_{id_i}ᵀ, diagonal, for the table;
  # Σ_i w_i r_i r_iᵀ for the head), the output factors c itself
  # (G = Σ_i c_i J_iᵀ M_i J_i). Weights summing to one would hide a c/w mixup.
  p = jax.jit(lambda: {  # One compile instead of one per operation.
      "table": jax.random.normal(jax.random.PRNGKey(7), (5, 4)),
      "head": jax.random.normal(jax.random.PRNGKey(8), (4, 3))})()
  b = {"ids": jnp.array([3, 1, 3]), "y": jnp.array([1, 0, 2]),
       "c": jnp.array([0.5, 2.0, 1.5])}

  def loss_fn(p, b):
    logits = p["table"][b["ids"]] @ p["head"]
    return (kfl.softmax_cross_entropy_with_integer_labels(logits, b["y"])
            * b["c"]).sum()

  fn = kfl.value_grad_and_stats(loss_fn, p, b, estimation="exact")
  assert {l.name: type(l.block).__name__ for l in fn.tagged.layers} == {
      "table": "KroneckerEmbedding", "head": "KroneckerDense"}
  est = jax.jit(fn)(p, b, KEY)
  stats = jax.tree.map(np.asarray, est.stats)  # Indexed below in numpy.
  c = np.asarray(b["c"], np.float64)
  w = c / c.sum()
  # float32 against float64: sums over the 3 examples of products through
  # the head's 4 inputs and 3 logits (≤ 4 chained reductions of ≤ 4 terms).
  close = functools.partial(_helpers.assert_rounding_close, terms=4, depth=4)
  close(est.weights, c)
  rows = np.asarray(p["table"], np.float64)[np.asarray(b["ids"])]
  head = np.asarray(p["head"], np.float64)
  m = _helpers.softmax_fisher(rows @ head)  # [N, 3, 3]
  want_a = np.zeros(5)
  np.add.at(want_a, np.asarray(b["ids"]), w)  # [0, .5, 0, .5, 0]
  close(stats["table"].a[0], want_a)
  close(stats["table"].g[0], np.einsum("n,ik,nkl,jl->ij", c, head, m, head))
  close(stats["head"].a[0], np.einsum("n,ni,nj->ij", w, rows, rows))
  close(stats["head"].g[0], np.einsum("n,nij->ij", c, m))


# --- Diagonal blocks -----------------------------------------------------------

V_TIED = 5


def tied_net(p, ids):
  # A tied embedding: a lookup, then the transposed table as the output layer.
  h = jnp.tanh(p["embed"][ids] @ p["w"])
  return h @ p["embed"].T


@pytest.mark.parametrize("layer", ["w", "embed"])
def test_diagonal_blocks_in_exact_mode_are_the_exact_fisher_diagonal(layer):
  # The sum-of-squares block Σ_i c_i Σ_k γ_ik² over the columns k of B is the
  # diagonal of the exact Fisher Σ_i c_i J_iᵀ (diag(p) − ppᵀ) J_i. The tied
  # embedding's transposed use folds the columns into its positions (exact
  # for Kronecker factors); the estimator computes its statistics one
  # column at a time, so the squares are not of the columns' sum.
  p = jax.jit(lambda: {  # One compile instead of one per operation.
      "embed": jax.random.normal(jax.random.PRNGKey(0), (V_TIED, 3)),
      "w": jax.random.normal(jax.random.PRNGKey(1), (3, 3))})()
  b = {"ids": jnp.array([0, 3, 3, 1]), "y": jnp.array([1, 2, 0, 4])}

  def loss_fn(p, b):
    return kfl.softmax_cross_entropy_with_integer_labels(
        tied_net(p, b["ids"]), b["y"]).mean()

  kind = {"w": "dense", "embed": "embedding"}[layer]
  fn = kfl.value_grad_and_stats(loss_fn, p, b, estimation="exact",
                                blocks={kind: "diagonal"})
  (found,) = [l for l in fn.tagged.layers if l.name == layer]
  assert type(found.block).__name__ == "DiagonalDense"
  est = jax.jit(fn)(p, b, KEY)

  @jax.jit  # One compile instead of one per operation.
  def reference(p, ids):
    jac = jax.vmap(lambda i: jax.jacrev(lambda t: tied_net(
        dict(p, **{layer: t}), i[None])[0])(p[layer]))(ids)
    return jac, tied_net(p, ids)

  jac, logits = reference(p, b["ids"])
  jac = np.asarray(jac, np.float64).reshape(len(b["ids"]), V_TIED, -1)
  m = _helpers.softmax_fisher(np.asarray(logits))
  want = np.einsum("nkp,nkl,nlp->p", jac, m, jac) / len(b["ids"])
  got = np.diag(_dense_of(found, est.stats[layer]))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6 * want.max())
