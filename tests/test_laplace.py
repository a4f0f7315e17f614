"""kfl.laplace against dense brute force.

Ground truth is formed here, independently of the library: per-example
Jacobians of the model outputs w.r.t. the raveled parameters
(``jax.jacfwd``) and per-example output Hessians of the loss
(``jax.hessian``), giving the exact GGN ``Σ_n J_nᵀ H_n J_n``; the K-FAC
blocks from the layers' inputs and the Jacobians w.r.t. their
pre-activations.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

import kfac_jax_lite as kfl
from _helpers import assert_rounding_close, rounding_tol, split_batch, x64_mode

N = 6
STRUCTURES = ("full", "diag", "kron")


# --- models ---------------------------------------------------------------

def mlp(p, x, eps=None):
  """3 -> 4 (bias, tanh) -> + sin(odd) (a fallback) -> 3."""
  z1 = x @ p["w1"] + p["b1"]
  if eps is not None:
    z1 = z1 + eps[0]
  h = jnp.tanh(z1) + jnp.sin(p["odd"])
  z2 = h @ p["w2"]
  if eps is not None:
    z2 = z2 + eps[1]
  return z2


def mlp_loss(p, batch):
  x, y = batch
  return kfl.softmax_cross_entropy_with_integer_labels(mlp(p, x), y).mean()


def mlp_sum_loss(p, batch):
  x, y = batch
  return kfl.softmax_cross_entropy_with_integer_labels(mlp(p, x), y).sum()


def mlp_plain_loss(p, batch):  # optax CE by hand: recognised (issue 23).
  x, y = batch
  return optax.softmax_cross_entropy_with_integer_labels(mlp(p, x), y).mean()


def scan_net(p, x):
  """Two dense layers stacked along lax.scan, then a linear read-out."""
  def body(h, wb):
    return jnp.tanh(h @ wb[0] + wb[1]), None
  h, _ = jax.lax.scan(body, x, (p["ws"], p["bs"]))
  return h @ p["out"]


def scan_loss(p, batch):
  x, y = batch
  return kfl.squared_error(scan_net(p, x), y).mean()


def zoo(p, batch):
  """An embedding, a 1-D convolution with bias, a layer norm, a read-out."""
  ids, x = batch[0], batch[1]
  h = jnp.concatenate([jnp.take(p["table"], ids, axis=0), x], -1)
  h = jax.lax.conv_general_dilated(
      h, p["conv"], (1,), "VALID", dimension_numbers=("NWC", "WIO", "NWC"))
  h = h + p["conv_b"]
  mu = h.mean(-1, keepdims=True)
  var = ((h - mu) ** 2).mean(-1, keepdims=True)
  h = (h - mu) * jax.lax.rsqrt(var + 1e-5) * p["ln_s"] + p["ln_b"]
  return jnp.tanh(h).mean(1) @ p["out"]


def zoo_loss(p, batch):
  return kfl.softmax_cross_entropy_with_integer_labels(
      zoo(p, batch), batch[2]).mean()


def _zoo_data():
  k = jax.random.split(jax.random.PRNGKey(1), 8)
  p = {"table": jax.random.normal(k[0], (5, 3)),
       "conv": 0.5 * jax.random.normal(k[1], (2, 5, 3)),
       "conv_b": 0.1 * jax.random.normal(k[2], (3,)),
       "ln_s": 1 + 0.1 * jax.random.normal(k[3], (3,)),
       "ln_b": 0.1 * jax.random.normal(k[4], (3,)),
       "out": jax.random.normal(k[5], (3, 2))}
  batch = (jax.random.randint(k[6], (N, 4), 0, 5),
           jax.random.normal(k[7], (N, 4, 2)), jnp.arange(N) % 2)
  return p, batch


def _data(x64):
  dtype = jnp.float64 if x64 else jnp.float32
  k = jax.random.split(jax.random.PRNGKey(0), 9)
  mlp_params = {
      "w1": jax.random.normal(k[0], (3, 4), dtype),
      "b1": 0.3 * jax.random.normal(k[1], (4,), dtype),
      "odd": jax.random.normal(k[2], (4,), dtype),
      "w2": jax.random.normal(k[3], (4, 3), dtype)}
  x = jax.random.normal(k[4], (N, 3), dtype)
  y = jax.random.randint(k[5], (N,), 0, 3)
  scan_params = {
      "ws": jax.random.normal(k[6], (2, 2, 2), dtype),
      "bs": 0.3 * jax.random.normal(k[7], (2, 2), dtype),
      "out": jax.random.normal(k[8], (2, 1), dtype)}
  t = jnp.sin(x[:, :1] * 2)
  return mlp_params, (x, y), scan_params, (x[:, :2], t)


def _batches(batch, sizes):
  return split_batch(batch, sizes)


@functools.lru_cache(maxsize=None)
def _fit(model, structure, x64, sizes=(3, 3), estimation="exact_ggn"):
  """A cached fit (inside x64_mode(x64))."""
  mp, mb, sp, sb = _data(x64)
  loss, params, batch = {
      "mlp": (mlp_loss, mp, mb), "mlp_sum": (mlp_sum_loss, mp, mb),
      "plain": (mlp_plain_loss, mp, mb), "scan": (scan_loss, sp, sb),
      "zoo": (zoo_loss,) + _zoo_data()}[model]
  return kfl.laplace.fit(loss, params, _batches(batch, sizes),
                         structure=structure, estimation=estimation)


fit = _fit


# --- brute force ----------------------------------------------------------

@functools.partial(jax.jit, static_argnums=0)
def _jacobians_jit(model, params, x):
  flat, unravel = ravel_pytree(params)
  one = lambda f, xi: model(unravel(f), xi[None])[0]
  return jax.vmap(jax.jacfwd(one), (None, 0))(flat, x)


def _jacobians(model, params, x):
  """``[N, O, P]`` Jacobians of the outputs w.r.t. the raveled params."""
  return np.asarray(_jacobians_jit(model, params, x), np.float64)


def _softmax_xent(o, t):
  return optax.softmax_cross_entropy_with_integer_labels(o, t)


def _squared(o, t):
  return jnp.sum((o - t) ** 2)


@functools.partial(jax.jit, static_argnums=0)
def _hessians_jit(fn, outputs, targets):
  return jax.vmap(jax.hessian(fn))(outputs, targets)


def _hessians(kind, outputs, targets):
  """``[N, O, O]`` Hessians of each example's loss w.r.t. its outputs."""
  fn = _softmax_xent if kind == "softmax" else _squared
  return np.asarray(_hessians_jit(fn, outputs, targets), np.float64)


@functools.lru_cache(maxsize=None)
def exact_ggn(model_name, x64, n=N):
  mp, (x, y), sp, (xs, t) = _data(x64)
  x, y, xs, t = x[:n], y[:n], xs[:n], t[:n]
  if model_name == "mlp":
    jac, h = _jacobians(mlp, mp, x), _hessians("softmax", mlp(mp, x), y)
  else:
    jac, h = _jacobians(scan_net, sp, xs), _hessians("sq", scan_net(sp, xs), t)
  return np.einsum("nop,noq,nqr->pr", jac, h, jac)


# Raveled positions (dict keys sort: b1, odd, w1, w2) of the MLP's layers.
W1 = 8 + np.arange(12).reshape(3, 4)
B1 = np.arange(4)
ODD = 4 + np.arange(4)
W2 = 20 + np.arange(12).reshape(4, 3)


@functools.lru_cache(maxsize=None)
def kron_mlp(n, x64):
  """The MLP's K-FAC precision over the first n examples, by definition:
  per dense layer ``A ⊗ G`` with ``A = mean_n āāᵀ`` and ``G = Σ_n J_zᵀ H
  J_z`` (``J_z`` the Jacobian w.r.t. the layer's pre-activation), the
  fallback's exact diagonal."""
  mp, (x, y), _, _ = _data(x64)
  x, y = x[:n], y[:n]
  eps = (jnp.zeros(4, x.dtype), jnp.zeros(3, x.dtype))
  out = lambda e, xi: mlp(mp, xi[None], e)[0]
  jz = jax.jit(jax.vmap(jax.jacfwd(out), (None, 0)))(eps, x)  # [n,3,4|3]
  h = _hessians("softmax", mlp(mp, x), y)
  mp = jax.tree.map(lambda a: np.asarray(a, np.float64), mp)
  x = np.asarray(x, np.float64)
  a1 = np.concatenate([x, np.ones((n, 1))], 1)
  a2 = np.tanh(x @ mp["w1"] + mp["b1"]) + np.sin(mp["odd"])
  dense = np.zeros((32, 32))
  for a, jac, rows in ((a1, jz[0], np.concatenate([W1, B1[None]], 0)),
                       (a2, jz[1], W2)):
    jac = np.asarray(jac)
    big_a = a.T @ a / n
    big_g = np.einsum("noi,nop,npj->ij", jac, h, jac)
    idx = rows.ravel()
    dense[np.ix_(idx, idx)] = np.kron(big_a, big_g)
  dense[ODD, ODD] = np.diag(exact_ggn("mlp", x64, n))[ODD]
  return dense


def _close(got, want, x64, scale=None, cond=1.0):
  # A sum over the N examples of Jacobian products through the MLP's two
  # layers and its softmax (≤ 4 chained reductions of ≤ N terms), then
  # (``cond``) a solve with the precision.
  assert_rounding_close(np.asarray(got, np.float64 if x64 else np.float32),
                        want, terms=N, depth=4, scale=scale, cond=cond)


def _close_logdet(got, want, dense, x64):
  # log det P = Σ log λ_i: each eigenvalue computed to n·ε·‖P‖ moves it by
  # at most n·ε·κ(P) (n = P's size), the sum of n such terms.
  n = len(dense)
  tol = rounding_tol(np.float64 if x64 else np.float32, n * n, 1.0,
                     cond=np.linalg.cond(dense))
  np.testing.assert_allclose(got, want, rtol=0, atol=tol)


# --- the precision against brute force -----------------------------------

@pytest.mark.parametrize("x64", [False, True])
def test_full_is_the_exact_ggn_summed_over_examples(x64):
  with x64_mode(x64):
    tau = 0.7
    want = exact_ggn("mlp", x64) + tau * np.eye(32)
    for model in ("mlp", "mlp_sum")[:1 if x64 else 2]:  # Mean or sum: Σ_n.
      post = fit(model, "full", x64)
      _close(kfl.laplace.dense_precision(post, tau), want, x64)
      assert int(post.num_examples) == N
    post = fit("scan", "full", x64)
    want = exact_ggn("scan", x64) + tau * np.eye(14)
    _close(kfl.laplace.dense_precision(post, tau), want, x64)


@pytest.mark.parametrize("x64", [False, True])
def test_diag_is_the_diagonal_of_the_exact_ggn(x64):
  with x64_mode(x64):
    for model, p in (("mlp", 32), ("scan", 14)):
      post = fit(model, "diag", x64)
      got = np.asarray(kfl.laplace.dense_precision(post, 0.5), np.float64)
      want = np.diag(exact_ggn(model, x64)) + 0.5
      _close(np.diag(got), want, x64)
      assert np.count_nonzero(got - np.diag(np.diag(got))) == 0


def test_diag_is_the_diagonal_of_full_for_every_layer_kind():
  """Embedding, convolution (with bias) and layer-norm blocks: their
  "diag" blocks are exact, so they equal the diagonal of "full"."""
  full = kfl.laplace.dense_precision(fit("zoo", "full", False), 0.5)
  diag = kfl.laplace.dense_precision(fit("zoo", "diag", False), 0.5)
  _close(jnp.diag(diag), jnp.diag(full), False)
  assert fit("zoo", "kron", False).layer_names == ("conv", "ln_s", "out",
                                                   "table")


def test_sampled_estimations_of_full():
  """The exact Fisher equals the GGN (natural losses); sampled Fisher and
  curvature propagation approach it."""
  want = exact_ggn("mlp", False)
  exact = kfl.laplace.dense_precision(
      fit("mlp", "full", False, estimation="exact"), 1.0) - jnp.eye(32)
  _close(exact, want, False)
  for mode in ("fisher", "curvature_prop_ggn"):
    mp, batch, _, _ = _data(False)
    post = kfl.laplace.fit(mlp_loss, mp, [batch], structure="full",
                           estimation=mode, num_samples=2000)
    got = np.asarray(kfl.laplace.dense_precision(post, 1.0)) - np.eye(32)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < 0.1, (mode, err)


@pytest.mark.parametrize("x64", [False, True])
def test_kron_of_one_example_is_the_exact_block_diagonal(x64):
  """With one example K-FAC is exact per block: each dense layer (each
  scan slice too) is the GGN's diagonal block, a fallback its diagonal."""
  with x64_mode(x64):
    post = fit("mlp", "kron", x64, sizes=(1,))
    ggn = exact_ggn("mlp", x64, n=1)
    group = np.zeros(32, int)
    group[np.concatenate([W1.ravel(), B1])] = 1
    group[W2.ravel()] = 2
    group[ODD] = 3 + np.arange(4)  # The fallback: its diagonal only.
    want = ggn * (group[:, None] == group[None, :]) + 1.0 * np.eye(32)
    _close(kfl.laplace.dense_precision(post, 1.0), want, x64)
    _close(want[np.ix_(W2.ravel(), W2.ravel())],
           kron_mlp(1, x64)[np.ix_(W2.ravel(), W2.ravel())] + np.eye(12), x64)

    post = fit("scan", "kron", x64, sizes=(1,))
    ggn = exact_ggn("scan", x64, n=1)
    # Keys sort bs [2,2], out [2,1], ws [2,2,2]: slice s is bs[s], ws[s].
    group = np.array([0, 0, 1, 1, 2, 2] + [0] * 4 + [1] * 4)
    want = ggn * (group[:, None] == group[None, :]) + np.eye(14)
    _close(kfl.laplace.dense_precision(post, 1.0), want, x64)


@pytest.mark.parametrize("x64", [False, True])
def test_kron_sums_g_and_averages_a_over_batches(x64):
  """Several batches of a mean loss: A the mean over all examples, G the
  sum (laplace-torch's convention), whatever the batching."""
  with x64_mode(x64):
    want = kron_mlp(N, x64) + 0.5 * np.eye(32)
    for sizes in ((3, 3), (6,)):
      post = fit("mlp", "kron", x64, sizes=sizes)
      _close(kfl.laplace.dense_precision(post, 0.5), want, x64)


@pytest.mark.parametrize("x64", [False, True])
def test_empirical_fisher_from_per_example_gradients(x64):
  """A loss without a registered loss: ``Σ_n ∇ℓ_n ∇ℓ_nᵀ``."""
  with x64_mode(x64):
    mp, batch, _, _ = _data(x64)
    flat, unravel = ravel_pytree(mp)
    grads = jax.jit(jax.vmap(lambda xi, yi: ravel_pytree(jax.grad(
        mlp_plain_loss)(mp, (xi[None], yi[None])))[0]))(*batch)
    grads = np.asarray(grads, np.float64)
    ef = grads.T @ grads
    full = fit("plain", "full", x64, estimation="empirical")
    diag = fit("plain", "diag", x64, estimation="empirical")
    _close(kfl.laplace.dense_precision(full, 1.0), ef + np.eye(32), x64)
    _close(np.diag(kfl.laplace.dense_precision(diag, 1.0)),
           np.diag(ef) + 1.0, x64, scale=np.abs(ef).max())


# --- log-determinant, samples, evidence ----------------------------------

@pytest.mark.parametrize("x64", [False, True])
@pytest.mark.parametrize("structure", STRUCTURES)
def test_logdet_is_slogdet_of_the_dense_precision(structure, x64):
  # The GGN fit, in float32 and in float64.
  with x64_mode(x64):
    post = fit("mlp", structure, x64)
    for tau in (0.3, jnp.array([0.2, 1.5, 4.0])):
      got = float(kfl.laplace.logdet(post, tau))
      dense = np.asarray(kfl.laplace.dense_precision(post, tau), np.float64)
      sign, want = np.linalg.slogdet(dense)
      assert sign == 1
      _close_logdet(got, want, dense, x64)
  if not x64:  # A stacked layer.
    for model in ("scan", "zoo"):  # Stacked, conv, embedding, norm blocks.
      other = fit(model, structure, False)
      tau = jnp.linspace(0.5, 2.0, len(other.layer_names))
      got = float(kfl.laplace.logdet(other, tau))
      dense = np.asarray(kfl.laplace.dense_precision(other, tau), np.float64)
      _close_logdet(got, np.linalg.slogdet(dense)[1], dense, False)


@pytest.mark.parametrize("structure", STRUCTURES)
def test_sample_covariance_is_the_inverse_precision(structure):
  post = fit("mlp", structure, False)
  tau = jnp.array([0.5, 2.0, 1.0])  # Per layer.
  samples = kfl.laplace.sample(post, jax.random.PRNGKey(1), tau, 20000)
  assert jax.tree.structure(samples) == jax.tree.structure(post.mean)
  flat = np.asarray(jnp.concatenate(
      [x.reshape(20000, -1) for x in jax.tree.leaves(samples)], 1), np.float64)
  cov = np.linalg.inv(np.asarray(kfl.laplace.dense_precision(post, tau),
                                 np.float64))
  mean = np.asarray(ravel_pytree(post.mean)[0])
  sd = np.sqrt(np.diag(cov))
  # Standard errors: mean sd/√n, covariance ≈ sd_i sd_j √(2/n); 5σ.
  assert np.abs(flat.mean(0) - mean).max() < 5 * sd.max() / np.sqrt(20000)
  err = (np.cov(flat.T) - cov) / np.outer(sd, sd)
  assert np.abs(err).max() < 5 * np.sqrt(2 / 20000), np.abs(err).max()


def _dense_lml(post, tau_layers, loss):
  sizes = np.array([12 + 4, 4, 12])  # Layers w1+b1, odd, w2.
  per_param = np.repeat(tau_layers, sizes)
  order = np.concatenate([np.concatenate([B1, W1.ravel()]), ODD, W2.ravel()])
  prior = np.empty(32)
  prior[order] = per_param
  theta = np.asarray(ravel_pytree(post.mean)[0], np.float64)
  logdet = np.linalg.slogdet(np.asarray(
      kfl.laplace.dense_precision(post, jnp.asarray(tau_layers)), np.float64))[1]
  return -loss - 0.5 * (logdet - np.sum(np.log(prior)) + prior @ theta ** 2)


@pytest.mark.parametrize("structure", STRUCTURES)
def test_log_marginal_likelihood_is_the_dense_formula(structure):
  post = fit("mlp", structure, False)
  assert post.layer_names == ("w1", "odd", "w2")
  mp, (x, y), _, _ = _data(False)
  loss = float(optax.softmax_cross_entropy_with_integer_labels(
      mlp(mp, x), y).sum())
  np.testing.assert_allclose(float(post.loss), loss, rtol=1e-5)
  for tau in (np.full(3, 0.8), np.array([0.3, 2.0, 5.0])):
    got = kfl.laplace.log_marginal_likelihood(post, jnp.asarray(tau))
    np.testing.assert_allclose(float(got), _dense_lml(post, tau, loss),
                               rtol=1e-5)
  got = kfl.laplace.log_marginal_likelihood(post, 0.8, loss_at_map=2 * loss)
  want = _dense_lml(post, np.full(3, .8), 2 * loss)
  np.testing.assert_allclose(float(got), want, rtol=1e-5)


@pytest.mark.parametrize("structure", ("full", "kron"))
def test_optimized_prior_precision_matches_a_grid_search(structure):
  post = fit("mlp", structure, False)
  grid = jnp.logspace(-3, 3, 601)
  lml = jax.jit(jax.vmap(
      lambda t: kfl.laplace.log_marginal_likelihood(post, t)))(grid)
  best = float(grid[jnp.argmax(lml)])
  tau = float(kfl.laplace.optimize_prior_precision(post, num_steps=300))
  assert abs(np.log10(tau) - np.log10(best)) < 0.02, (tau, best)
  if structure == "full":
    return
  # Per layer: at least as good, and stationary in log τ.
  layers = kfl.laplace.optimize_prior_precision(post, per_layer=True,
                                                num_steps=300)
  assert layers.shape == (3,)
  objective = lambda lt: kfl.laplace.log_marginal_likelihood(post, jnp.exp(lt))
  assert float(objective(jnp.log(layers))) >= float(lml.max()) - 1e-4
  grad = jax.grad(objective)(jnp.log(layers))
  assert np.abs(np.asarray(grad)).max() < 1e-2, grad


# --- predictive ----------------------------------------------------------

@pytest.mark.parametrize("structure", STRUCTURES)
def test_glm_predictive_is_j_inverse_precision_jt(structure):
  post = fit("mlp", structure, False)
  mp, (x, y), _, _ = _data(False)
  tau = jnp.array([0.5, 2.0, 1.0])
  jac = _jacobians(mlp, mp, x)
  precision = np.asarray(kfl.laplace.dense_precision(post, tau), np.float64)
  cov = np.linalg.inv(precision)
  want = np.einsum("nop,pq,nrq->nor", jac, cov, jac)
  mean, got = kfl.laplace.glm_moments(post, mlp, x, tau)
  # The same MLP in two programs: ≤ 4 chained reductions of ≤ 4 terms.
  assert_rounding_close(mean, mlp(mp, x), terms=4, depth=4)
  # J P⁻¹ Jᵀ at the size of its terms |J| |P⁻¹| |J|ᵀ, a solve of condition
  # κ(P) away from the precision's rounding.
  size = np.einsum("nop,pq,nrq->nor", np.abs(jac), np.abs(cov), np.abs(jac))
  _close(got, want, False, scale=size.max(), cond=np.linalg.cond(precision))
  probs = kfl.laplace.predictive(post, mlp, x, tau)  # GLM, probit.
  kappa = 1 / np.sqrt(1 + np.pi / 8 * np.einsum("noo->no", want))
  np.testing.assert_allclose(np.asarray(probs), np.asarray(
      jax.nn.softmax(np.asarray(mean) * kappa)), atol=1e-5)
  if structure == "diag":  # Elementwise sigmoids, read as binary outputs.
    binary = kfl.laplace.predictive(post, mlp, x, tau, likelihood="binary")
    np.testing.assert_allclose(np.asarray(binary), np.asarray(
        jax.nn.sigmoid(np.asarray(mean) * kappa)), atol=1e-5)
  # The MC link against a numpy Monte Carlo of the same Gaussian.
  mc = kfl.laplace.predictive(post, mlp, x, tau, link="mc", num_samples=20000,
                              key=jax.random.PRNGKey(2))
  rng = np.random.default_rng(0)
  f = np.stack([rng.multivariate_normal(m, (c + c.T) / 2, 20000,
                                        method="eigh", check_valid="ignore")
                for m, c in zip(np.asarray(mean, np.float64), want)], 1)
  ref = np.asarray(jax.nn.softmax(f, -1)).mean(0)
  np.testing.assert_allclose(np.asarray(mc), ref, atol=0.015)


def test_predictive_regression_and_parameter_samples():
  post = fit("scan", "kron", False)
  _, _, sp, (xs, _) = _data(False)
  jac = _jacobians(scan_net, sp, xs)
  precision = np.asarray(kfl.laplace.dense_precision(post, 1.0), np.float64)
  cov = np.linalg.inv(precision)
  mean, got = kfl.laplace.predictive(post, scan_net, xs, 1.0)
  size = np.einsum("nop,pq,nrq->nor", np.abs(jac), np.abs(cov), np.abs(jac))
  _close(got, np.einsum("nop,pq,nrq->nor", jac, cov, jac), False,
         scale=size.max(), cond=np.linalg.cond(precision))
  # Parameter samples: the mean output and its covariance, close to the
  # linearisation at a tight posterior.
  tight = 1e3
  key = jax.random.PRNGKey(3)
  mc_mean, mc_cov = kfl.laplace.predictive(post, scan_net, xs, tight,
                                           method="mc", key=key,
                                           num_samples=2000)
  lin_mean, lin_cov = kfl.laplace.glm_moments(post, scan_net, xs, tight)
  np.testing.assert_allclose(mc_mean, lin_mean, atol=0.01)
  np.testing.assert_allclose(mc_cov, lin_cov, rtol=0.15,
                             atol=0.05 * float(jnp.max(lin_cov)))


def test_mc_predictive_averages_the_sampled_networks():
  post = fit("mlp", "diag", False)
  _, (x, _), _, _ = _data(False)
  key = jax.random.PRNGKey(4)
  got = kfl.laplace.predictive(post, mlp, x, 1.0, method="mc", key=key,
                               num_samples=64)
  thetas = kfl.laplace.sample(post, key, 1.0, 64)
  want = jax.nn.softmax(jax.jit(jax.vmap(mlp, (0, None)))(thetas, x),
                        -1).mean(0)
  np.testing.assert_allclose(got, want, rtol=1e-6)


# --- pytree and errors ---------------------------------------------------

def test_posterior_is_a_pytree_through_jit():
  post = fit("mlp", "kron", False)
  got = jax.jit(kfl.laplace.logdet)(post, 0.5)
  np.testing.assert_allclose(got, kfl.laplace.logdet(post, 0.5), rtol=1e-6)
  doubled = jax.tree.map(lambda a: a, post)
  assert doubled.meta == post.meta and doubled.layer_names == post.layer_names


def test_clear_errors():
  mp, batch, _, _ = _data(False)
  post = fit("mlp", "kron", False)
  with pytest.raises(ValueError, match="structure"):
    kfl.laplace.fit(mlp_loss, mp, [batch], structure="dense")
  with pytest.raises(ValueError, match="estimation"):
    kfl.laplace.fit(mlp_loss, mp, [batch], estimation="hessian")
  with pytest.raises(ValueError, match="empty"):
    kfl.laplace.fit(mlp_loss, mp, [])
  with pytest.raises(ValueError, match="kfl.laplace.fit: .*registered or "
                     "recognised loss"):
    kfl.laplace.fit(  # An L1 loss: neither registered nor recognised.
        lambda p, b: jnp.abs(mlp(p, b[0])).mean(), mp, [batch],
        structure="full")
  with pytest.raises(ValueError, match="one value per layer"):
    kfl.laplace.logdet(post, jnp.ones(2))
  with pytest.raises(ValueError, match="positive"):
    kfl.laplace.sample(post, jax.random.PRNGKey(0), -1.0, 2)
  with pytest.raises(ValueError, match="key"):
    kfl.laplace.predictive(post, mlp, batch[0], 1.0, method="mc")
  with pytest.raises(ValueError, match="link"):
    kfl.laplace.predictive(fit("scan", "kron", False), scan_net,
                           batch[0][:, :2], 1.0, link="probit")
  bad = dict(mp, w1=mp["w1"].at[0, 0].set(jnp.nan))
  with pytest.raises(ValueError, match="not finite"):
    kfl.laplace.fit(mlp_loss, bad, [batch], structure="diag")


def _accuracy():
  """The figures these tests measure (``PYTHONPATH=src python
  tests/test_laplace.py``): relative errors against the brute force."""
  rel = lambda a, b: float(np.abs(np.asarray(a, np.float64) - b).max()
                           / np.abs(b).max())
  print("dense_precision vs brute force (max |error| / max |P|), τ = 0.5")
  for x64 in (False, True):
    with x64_mode(x64):
      want = {"full": exact_ggn("mlp", x64) + 0.5 * np.eye(32),
              "diag": np.diag(np.diag(exact_ggn("mlp", x64)) + 0.5),
              "kron": kron_mlp(N, x64) + 0.5 * np.eye(32)}
      for s in STRUCTURES:
        post = _fit("mlp", s, x64)
        err = f"{rel(kfl.laplace.dense_precision(post, 0.5), want[s]):.1e}"
        print(f"  {'float64' if x64 else 'float32'} {s:5s} {err}")
  print("logdet vs slogdet(dense_precision), relative, per-layer τ")
  tau = jnp.array([0.2, 1.5, 4.0])
  for x64 in (False, True):
    with x64_mode(x64):
      for s in STRUCTURES:
        post = _fit("plain", s, x64, estimation="empirical") if x64 else (
            _fit("mlp", s, x64))
        want = np.linalg.slogdet(np.asarray(
            kfl.laplace.dense_precision(post, tau), np.float64))[1]
        got = float(kfl.laplace.logdet(post, tau))
        print(f"  {'float64' if x64 else 'float32'} {s:5s} "
              f"{abs(got - want) / abs(want):.1e}")
  mp, (x, y), _, _ = _data(False)
  loss = float(optax.softmax_cross_entropy_with_integer_labels(
      mlp(mp, x), y).sum())
  jac = _jacobians(mlp, mp, x)
  print("float32, per-layer τ: 20k-sample covariance (max |Ĉ - C| / "
        "sd_i sd_j; 5σ = 0.050), log marginal likelihood, GLM J P⁻¹ Jᵀ, "
        "optimised scalar τ vs a 601-point grid (|Δ log10 τ|)")
  for s in STRUCTURES:
    post = _fit("mlp", s, False)
    tau = jnp.array([0.5, 2.0, 1.0])
    cov = np.linalg.inv(np.asarray(kfl.laplace.dense_precision(post, tau),
                                   np.float64))
    samples = kfl.laplace.sample(post, jax.random.PRNGKey(1), tau, 20000)
    flat = np.asarray(jnp.concatenate(
        [v.reshape(20000, -1) for v in jax.tree.leaves(samples)], 1))
    sd = np.sqrt(np.diag(cov))
    sample_err = np.abs((np.cov(flat.T) - cov) / np.outer(sd, sd)).max()
    lml = float(kfl.laplace.log_marginal_likelihood(post, tau))
    lml_err = abs(lml - _dense_lml(post, np.asarray(tau), loss)) / abs(lml)
    _, glm = kfl.laplace.glm_moments(post, mlp, x, tau)
    glm_err = rel(glm, np.einsum("nop,pq,nrq->nor", jac, cov, jac))
    grid = jnp.logspace(-3, 3, 601)
    best = grid[jnp.argmax(jax.jit(jax.vmap(
        lambda t: kfl.laplace.log_marginal_likelihood(post, t)))(grid))]
    opt = kfl.laplace.optimize_prior_precision(post, num_steps=300)
    print(f"  {s:5s} samples {sample_err:.3f}  lml {lml_err:.1e}  "
          f"glm {glm_err:.1e}  τ {float(opt):.4g} vs grid {float(best):.4g} "
          f"(Δ {abs(np.log10(float(opt) / float(best))):.4f})")


if __name__ == "__main__":
  _accuracy()
