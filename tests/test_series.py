"""RNN series blocks (Martens, Ba & Johnson 2018): ``blocks.SeriesDense``.

Each option's ``multiply_inverse`` is checked against the dense inverse of
the matrix that option assumes, ``Σ_{t,s} E[a_t a_sᵀ] ⊗ E[g_t g_sᵀ]``,
built from the autocovariances of linear-Gaussian (VAR(1)) processes
``a_{t+1} = Φ a_t + ε`` whose statistics satisfy the option's assumptions
exactly (the lag-d covariances are formed by iterating Φ, not from the
block's formulas); then the statistics through the scan, the agreement of
the options without temporal correlation, and training through
``kfl.kfac``.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kfl
from _helpers import x64_mode

B = kfl.blocks


# --- linear-Gaussian processes ---------------------------------------------

def _random_pd(rng, n, scale=1.0):
  m = rng.normal(size=(n, n))
  return scale * (m @ m.T / n + 0.5 * np.eye(n))


def _sqrtm(c):
  w, q = np.linalg.eigh(c)
  return (q * np.sqrt(w)) @ q.T


def symmetric_var1(rng, n, rho=0.8):
  """``(C₀, Φ)`` of a stationary VAR(1) whose lag-1 covariance ``C₁ =
  C₀Φᵀ`` is symmetric (option 1's assumption): ``C₁ = C₀^{1/2} Ψ̂ C₀^{1/2}``,
  ``Ψ̂`` symmetric with eigenvalues in ``(-rho, rho)``."""
  c0 = _random_pd(rng, n)
  q, _ = np.linalg.qr(rng.normal(size=(n, n)))
  psi = (q * rng.uniform(-rho, rho, size=n)) @ q.T
  s = _sqrtm(c0)
  c1 = s @ psi @ s
  return c0, (np.linalg.solve(c0, c1)).T  # Φᵀ = C₀⁻¹C₁.


def general_var1(rng, n, rho=0.7):
  """``(C₀, Φ)``: any stable Φ (spectral radius ``rho``), the stationary
  ``C₀ = Σ_k Φᵏ Σ_ε Φᵀᵏ`` (option 2's assumption, C₁ not symmetric)."""
  phi = rng.normal(size=(n, n))
  phi *= rho / np.max(np.abs(np.linalg.eigvals(phi)))
  sigma = _random_pd(rng, n)
  c0, term = np.zeros((n, n)), sigma
  for _ in range(400):
    c0, term = c0 + term, phi @ term @ phi.T
  return c0, phi


def lag_cov(c0, phi, d):
  """``E[x_t x_{t+d}ᵀ] = C₀ (Φᵀ)^d`` (``d ≥ 0``), its transpose for d < 0."""
  m = c0 @ np.linalg.matrix_power(phi.T, abs(d))
  return m if d >= 0 else m.T


def assumed_matrix(a, g, num_steps, infinite):
  """``Σ_{t,s=0}^{T-1} A_{s-t} ⊗ G_{s-t}``, or (``infinite``) ``T Σ_d A_d ⊗
  G_d`` over all lags; ``a = (C₀, Φ)`` of the inputs, ``g`` of the
  cotangents."""
  if infinite:
    return num_steps * sum(np.kron(lag_cov(*a, d), lag_cov(*g, d))
                           for d in range(-150, 151))
  return sum(np.kron(lag_cov(*a, s - t), lag_cov(*g, s - t))
             for t in range(num_steps) for s in range(num_steps))


def pi_damped(a0, g0, damping, num_steps):
  """TF's π-adjusted damping of ``A₀``, ``G₀`` at ``λ / T``."""
  pi = np.sqrt((np.trace(a0) / len(a0)) / (np.trace(g0) / len(g0)))
  root = np.sqrt(damping / num_steps)
  return a0 + pi * root * np.eye(len(a0)), g0 + root / pi * np.eye(len(g0))


@functools.partial(jax.jit, static_argnums=(0,))
def _from_stats(block, stats):
  return block.update(block.init(stats[0].dtype), stats, 0.9)


@functools.partial(jax.jit, static_argnums=(0,))
def _inverses(block, stats, v, damping):
  """``(F + λI)⁻¹ v`` computed now and from a refresh's cache."""
  state = _from_stats(block, stats)
  now = block.multiply_inverse(state, v, damping)
  state = block.refresh(state, damping, -1.0, step=1)
  return now, block.multiply_inverse(state, v, damping, use_cache=True)


def block_inverses(block, a0, a1, g0, g1, v, damping, dtype):
  """Both inverses as flat float64 vectors (kernel ``[a, b]``, no bias)."""
  stats = B.SeriesState(*[jnp.asarray(x, dtype)[None]
                          for x in (a0, a1, g0, g1)])
  out = _inverses(block, stats, (jnp.asarray(v, dtype),), damping)
  return [np.asarray(u[0], np.float64).ravel() for u in out]


CASES = [("series1", 4, False), ("series2", 5, True)]


@pytest.mark.parametrize("x64", [False, True])
@pytest.mark.parametrize("option,num_steps,infinite", CASES)
def test_inverse_is_the_dense_inverse_of_the_assumed_matrix(
    option, num_steps, infinite, x64):
  """A VAR(1) input and cotangent process satisfying the option's
  assumptions: ``multiply_inverse`` is the inverse of the assumed matrix,
  undamped and (π-adjusted) damped."""
  rng = np.random.default_rng(0 if option == "series1" else 1)
  make = general_var1 if infinite else symmetric_var1
  a, g = make(rng, 3), make(rng, 2)
  a1 = lag_cov(*a, 1)
  g1 = lag_cov(*g, 1)
  with x64_mode(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    block = B.SeriesDense((3, 2), num_steps=num_steps, option=option)
    v = rng.normal(size=(3, 2))
    tol = 1e-9 if x64 else 2e-4
    # Undamped: the assumed matrix of the processes themselves.
    f = assumed_matrix(a, g, num_steps, infinite)
    want = np.linalg.solve(f, v.ravel())
    for got in block_inverses(block, a[0], a1, g[0], g1, v, 0.0, dtype):
      np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(
          want).max())
    # Damped: the same structure from the π-damped lag-0 factors (the
    # lag-1 ones as they are): A_d = A₀'(A₀'⁻¹A₁)^d.
    lam = 0.3
    a0d, g0d = pi_damped(a[0], g[0], lam, num_steps)
    phi_a = np.linalg.solve(a0d, a1).T
    phi_g = np.linalg.solve(g0d, g1).T
    f = assumed_matrix((a0d, phi_a), (g0d, phi_g), num_steps, infinite)
    want = np.linalg.solve(f, v.ravel())
    for got in block_inverses(block, a[0], a1, g[0], g1, v, lam, dtype):
      np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(
          want).max())


_gamma = jax.jit(B.series.gamma, static_argnums=(1,))


@pytest.mark.parametrize("x64", [False, True])
def test_gamma_is_the_reciprocal_of_the_lag_sum(x64):
  """``γ(x) = 1/Σ_{t,s} x^{|t-s|}`` on ``[-1, 1]``, including next to 1
  where the closed form cancels (float32 too)."""
  xs = np.concatenate([np.linspace(-0.99, 0.99, 41),
                       1 - np.logspace(-7, -1, 13), [1.0]])
  with x64_mode(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    for t in (1, 2, 7, 40):
      got = np.asarray(_gamma(jnp.asarray(xs, dtype), t))
      d = np.abs(np.subtract.outer(np.arange(t), np.arange(t)))
      want = 1 / np.array([np.sum(np.float64(x) ** d) for x in xs])
      np.testing.assert_allclose(got, want, rtol=1e-10 if x64 else 3e-5)


@functools.partial(jax.jit, static_argnums=(0,))
def _stats(block, x, g, c):
  return block.compute_stats(x, g, weights=c)


def _data(rng, n, t, a, b, s=2, extra=()):
  x = rng.normal(size=(n,) + extra + (t, a))
  g = rng.normal(size=(s, n) + extra + (t, b))
  c = rng.uniform(0.1, 1.0, size=n)
  return x, g, c


def test_statistics_are_the_lagged_moments():
  """``compute_stats`` against loops over examples, samples and steps
  (bias column included), with the time axis after the example axis or
  after another shared axis (``time_axis=1``: independent sequences)."""
  rng = np.random.default_rng(3)
  n, t, a, b, s = 3, 4, 2, 3, 2
  for extra, time_axis in (((), 0), ((2,), 1)):
    x, g, c = _data(rng, n, t, a, b, s, extra)
    block = B.SeriesDense((a, b), has_bias=True, num_steps=t,
                          option="series1", time_axis=time_axis)
    with x64_mode(True):
      st = _stats(block, x, g, c)
    w = c / c.sum()
    xs = np.concatenate([x, np.ones(x.shape[:-1] + (1,))], -1).reshape(
        n, -1, t, a + 1)
    gs = g.reshape(s, n, -1, t, b)
    r = xs.shape[1]
    want = {k: 0.0 for k in ("a0", "a1", "g0", "g1")}
    for i in range(n):
      for p in range(r):
        for k in range(t):
          want["a0"] += w[i] / r / t * np.outer(xs[i, p, k], xs[i, p, k])
          if k + 1 < t:
            want["a1"] += w[i] / r / t * np.outer(xs[i, p, k], xs[i, p, k + 1])
          for j in range(s):
            want["g0"] += c[i] / s / t * np.outer(gs[j, i, p, k], gs[j, i, p, k])
            if k + 1 < t:
              want["g1"] += c[i] / s / t * np.outer(gs[j, i, p, k],
                                                    gs[j, i, p, k + 1])
    for k, v in want.items():
      np.testing.assert_allclose(np.asarray(getattr(st, k))[0], v, rtol=1e-10)


@functools.partial(jax.jit, static_argnums=(0,))
def _uncorrelated(blocks, x, g, c, v):
  """Per block: its statistics, and its inverse at λ = 0.05 with the lag-1
  statistics (if any) set to zero (one compile for all the blocks)."""
  out = []
  for block in blocks:
    st = block.compute_stats(x, g, weights=c)
    if isinstance(st, B.SeriesState):
      st = st._replace(a1=jnp.zeros_like(st.a1), g1=jnp.zeros_like(st.g1))
    state = block.update(block.init(x.dtype), st, 0.9)
    out.append((st, block.multiply_inverse(state, v, 0.05)))
  return out


def test_options_agree_without_temporal_correlation():
  """With ``A₁ = G₁ = 0`` the three options are one matrix: the
  ``KroneckerDense`` ``"expand"`` block of the same data (``A = A₀``,
  ``G = T·G₀``), at the same π-damped λ."""
  rng = np.random.default_rng(4)
  n, t, a, b = 6, 5, 3, 2
  x, g, c = _data(rng, n, t, a, b)
  v = (rng.normal(size=(a, b)), rng.normal(size=b))
  with x64_mode(True):
    v = tuple(jnp.asarray(u) for u in v)
    blocks = (B.KroneckerDense((a, b), has_bias=True),) + tuple(
        B.SeriesDense((a, b), has_bias=True, num_steps=t, option=o)
        for o in B.series.OPTIONS)
    (ks, want), *series = _uncorrelated(blocks, x, g, c, v)
    for st, got in series:
      np.testing.assert_allclose(st.a0, ks.a, rtol=1e-12)
      np.testing.assert_allclose(t * st.g0, ks.g, rtol=1e-12)
      for u, w in zip(got, want):
        np.testing.assert_allclose(u, w, rtol=1e-10)


def test_only_the_inverse_and_clear_errors():
  block = B.SeriesDense((3, 2), num_steps=4, option="series2")
  state = block.init()
  v = (jnp.ones((3, 2)),)
  with pytest.raises(NotImplementedError, match="power"):
    block.multiply_matpower(state, v, 0.1, -0.5)
  with pytest.raises(NotImplementedError, match="power"):
    block.refresh(state, 0.1, exp=-0.5)
  for name in ("multiply", "to_dense"):
    with pytest.raises(NotImplementedError, match="only the inverse"):
      getattr(block, name)(state, *((v,) if name == "multiply" else ()))
  with pytest.raises(NotImplementedError, match="only the inverse"):
    block.multiply_cholesky(state, v, 0.1)
  with pytest.raises(ValueError, match="5 time steps.*num_steps=4"):
    block.compute_stats(jnp.ones((2, 5, 3)), jnp.ones((2, 5, 2)))
  with pytest.raises(ValueError, match="time axis"):
    block.compute_stats(jnp.ones((2, 3)), jnp.ones((2, 2)))
  with pytest.raises(ValueError, match="option must be one of"):
    B.SeriesDense((3, 2), num_steps=4, option="series3")


# --- through kfl.kfac -------------------------------------------------------

N, T, D, H = 16, 6, 3, 5


def rnn_loss(params, batch):
  """An Elman RNN over ``x [N, T, D]`` (a ``lax.scan`` over time), reading
  out every step."""
  def step(h, x_t):
    h = jnp.tanh(x_t @ params["cell"]["wx"] + h @ params["cell"]["wh"]
                 + params["cell"]["b"])
    return h, h
  h0 = jnp.zeros((batch["x"].shape[0], H), batch["x"].dtype)
  _, hs = jax.lax.scan(step, h0, jnp.swapaxes(batch["x"], 0, 1))
  pred = jnp.swapaxes(hs, 0, 1) @ params["out"]["w"] + params["out"]["b"]
  return jnp.mean(kfl.squared_error(pred, batch["y"]))


def rnn_setup(dtype):
  ks = jax.random.split(jax.random.PRNGKey(0), 5)
  params = {"cell": {"wx": jax.random.normal(ks[0], (D, H)) / np.sqrt(D),
                     "wh": jax.random.normal(ks[1], (H, H)) * 0.3,
                     "b": jnp.zeros(H)},
            "out": {"w": jax.random.normal(ks[2], (H, 1)) / np.sqrt(H),
                    "b": jnp.zeros(1)}}
  x = jax.random.normal(ks[3], (N, T, D))
  y = jnp.cumsum(x[..., :1], axis=1) * 0.5  # A running sum: needs memory.
  return (jax.tree.map(lambda p: p.astype(dtype), params),
          {"x": x.astype(dtype), "y": y.astype(dtype)})


@functools.lru_cache(maxsize=None)
def _train(option, x64):
  with x64_mode(x64):
    params, batch = rnn_setup(jnp.float64 if x64 else jnp.float32)
    blocks = {"cell/w*": option}
    table = kfl.describe(rnn_loss, params, batch, blocks=blocks)
    tx = optax.chain(kfl.kfac(rnn_loss, batch, blocks=blocks, damping=1e-2),
                     optax.sgd(0.05, momentum=0.9))
    state = tx.init(params)

    @jax.jit
    def step(p, state):
      loss, grads = jax.value_and_grad(rnn_loss)(p, batch)
      updates, state = tx.update(grads, state, p, batch=batch)
      return optax.apply_updates(p, updates), state, loss

    losses = []
    for _ in range(20):
      params, state, loss = step(params, state)
      losses.append(float(loss))
    return table, losses, state, jax.tree.leaves(params)[0].dtype


@pytest.mark.parametrize("option,x64", [("series1", False), ("series2", True)])
def test_kfac_with_series_blocks_trains_an_rnn(option, x64):
  table, losses, state, dtype = _train(option, x64)
  rows = {r.name: r for r in table}
  assert not [r for r in table if r.kind == "fallback"], str(table)
  assert rows["cell/wx"].block == rows["cell/wh"].block == "SeriesDense"
  assert losses[-1] < 0.5 * losses[0], losses
  assert np.all(np.isfinite(losses)), losses
  assert kfl.health(state).ok, kfl.health(state)
  assert dtype == (jnp.float64 if x64 else jnp.float32)
  wh = state[0].blocks["cell/wh"]
  assert isinstance(wh, B.SeriesState)
  assert np.all(np.asarray(wh.a0.cache.step) >= 0)
  assert wh.a0.cov.dtype == dtype


def test_series_choices_and_errors():
  """``"kron_indep"`` is the ``"expand"`` Kronecker block (whatever the
  default sharing); a series choice for a layer outside a scan, or another
  power than -1, is a clear error."""
  params, batch = rnn_setup(jnp.float32)
  table = kfl.describe(rnn_loss, params, batch, blocks={"cell/wh": "series1"})
  assert {r.name: r.sharing for r in table}["cell/wh"] == "series1 (T=6)"
  table = kfl.describe(rnn_loss, params, batch, weight_sharing="reduce",
                       blocks={"cell/wh": "kron_indep"})
  assert {r.name: (r.block, r.sharing) for r in table}["cell/wh"] == (
      "KroneckerDense", "expand")
  for choice in B.series.OPTIONS:
    with pytest.raises(ValueError, match="not used inside a lax.scan"):
      kfl.describe(rnn_loss, params, batch, blocks={"out/w": choice})
  with pytest.raises(ValueError, match="not used inside a lax.scan"):
    kfl.describe(rnn_loss, params, batch, blocks={"dense": "series2"})
  with pytest.raises(NotImplementedError, match="only the inverse"):
    tx = kfl.kfac(rnn_loss, batch, blocks={"cell/wh": "series2"},
                  precon_power=-0.5)
    jax.eval_shape(lambda p: tx.update(p, tx.init(p), p, batch=batch), params)


def test_scan_statistics_are_the_steps_in_order():
  """Through ``kfl.value_grad_and_stats`` (float64, empirical): the series
  statistics of the RNN's two recurrent kernels are the lagged moments of
  the step inputs (``x_t`` and ``h_{t-1}``) and of the cotangents of each
  step's gate pre-activation, formed by brute force (a perturbation added
  at every step). The loss has T elements of weight ``1/(NT)`` per example
  (a squared error at every step), so "empirical" ("fisher" at the data
  targets) backpropagates ``Σ_t √(c_nt/c_n) ∇ℓ_nt``: ``√T`` times the
  per-example gradient of the mean over steps."""
  with x64_mode(True):
    params, batch = rnn_setup(jnp.float64)
    blocks = {"cell/w*": "series2"}
    est = jax.jit(kfl.value_grad_and_stats(
        rnn_loss, params, batch, estimation="empirical", blocks=blocks))(
            params, batch, jax.random.PRNGKey(0))

    def perturbed(e, p):  # e [T, N, H] added to the gate pre-activations.
      def step(h, xe):
        x_t, e_t = xe
        h = jnp.tanh(x_t @ p["cell"]["wx"] + h @ p["cell"]["wh"]
                     + p["cell"]["b"] + e_t)
        return h, h
      h0 = jnp.zeros((N, H), jnp.float64)
      _, hs = jax.lax.scan(step, h0, (jnp.swapaxes(batch["x"], 0, 1), e))
      pred = jnp.swapaxes(hs, 0, 1) @ p["out"]["w"] + p["out"]["b"]
      return jnp.mean((pred - batch["y"]) ** 2), hs

    e = jnp.zeros((T, N, H), jnp.float64)
    cot, hs = jax.grad(perturbed, has_aux=True)(e, params)
    # √T ∂ℓ_n/∂z_t, [N, T, H], ℓ_n the mean over the steps.
    g = np.asarray(jnp.swapaxes(cot, 0, 1)) * N * np.sqrt(T)
    h_prev = np.concatenate([np.zeros((N, 1, H)),
                             np.asarray(jnp.swapaxes(hs, 0, 1))[:, :-1]], 1)
    for name, a in (("cell/wx", np.asarray(batch["x"])), ("cell/wh", h_prev)):
      want = dict(a0=np.einsum("nti,ntj->ij", a, a),
                  a1=np.einsum("nti,ntj->ij", a[:, :-1], a[:, 1:]),
                  g0=np.einsum("nti,ntj->ij", g, g),
                  g1=np.einsum("nti,ntj->ij", g[:, :-1], g[:, 1:]))
      st = est.stats[name]
      for k, v in want.items():
        np.testing.assert_allclose(np.asarray(getattr(st, k))[0], v / (N * T),
                                   rtol=1e-9, atol=1e-12, err_msg=name + k)


def test_flax_rnn_tags_its_gates_as_series():
  """Flax ``nn.RNN(nn.LSTMCell)``: every gate kernel is a series block of
  the sequence's length (detection only: the statistics through a scan
  are pinned on the plain-JAX RNN above)."""
  nn = pytest.importorskip("flax.linen")

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(1)(nn.RNN(nn.LSTMCell(4))(x))

  model = Model()
  x = jnp.ones((N, T, D))
  batch = (x, x[..., :1])
  params = jax.eval_shape(model.init, jax.random.PRNGKey(1), x)

  def loss(p, b):
    return jnp.mean(kfl.squared_error(model.apply(p, b[0]), b[1]))

  blocks = {"params/LSTMCell_0/*": "series1"}
  table = kfl.describe(loss, params, batch, blocks=blocks)
  series = [r.name for r in table if r.block == "SeriesDense"]
  assert len(series) == 8 and all(
      r.sharing == f"series1 (T={T})" for r in table if r.name in series)
