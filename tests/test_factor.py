"""The math core: factors, zero-debiased EMA, damped powers and their caches."""
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax_lite as kfl
from kfac_jax_lite import factor as fac

from _helpers import x64_mode

SETTINGS = hypothesis.settings(max_examples=12, deadline=None)


def random_psd(rng, n, rank=None, batch=()):
  m = rng.normal(size=batch + (n, rank or n + 2))
  return m @ np.swapaxes(m, -1, -2) / m.shape[-1]


def filled(c, dtype=jnp.float32, diagonal=False):
  c = np.asarray(c)
  state = kfl.init_factor(c.shape[-1], diagonal=diagonal,
                          batch_shape=c.shape[:-1] if diagonal else c.shape[:-2],
                          dtype=dtype)
  return kfl.update_cov(state, c, 0.5)


def brute_power(c, damping, exp):
  w, q = np.linalg.eigh(np.asarray(c, np.float64))
  w = np.maximum(w, 0)
  return (q * (w + damping) ** exp) @ q.T


def test_first_update_is_debiased_and_ema_matches_formula():
  rng = np.random.default_rng(0)
  xs = [random_psd(rng, 3) for _ in range(4)]
  ws = [1.0, 2.0, 0.5, 3.0]
  decay = 0.8
  state = kfl.init_factor(3)
  np.testing.assert_array_equal(kfl.factor_value(state), np.zeros((3, 3)))
  for i, (x, w) in enumerate(zip(xs, ws)):
    state = kfl.update_cov(state, x, decay, weight=w)
    coeffs = [(1 - decay) * decay ** (i - j) * ws[j] for j in range(i + 1)]
    expected = sum(c * xs[j] for j, c in enumerate(coeffs)) / sum(coeffs)
    np.testing.assert_allclose(kfl.factor_value(state), expected, rtol=1e-5)
  np.testing.assert_allclose(
      kfl.factor_value(kfl.update_cov(kfl.init_factor(3), xs[0], 0.99)), xs[0],
      rtol=1e-5)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("diagonal", [False, True])
def test_non_finite_statistics_leave_state_exactly_unchanged(bad, diagonal):
  rng = np.random.default_rng(1)
  c = random_psd(rng, 4)
  c = np.diag(c) if diagonal else c
  state = kfl.refresh_cache(filled(c, diagonal=diagonal), 3, damping=0.1)
  new = np.array(c)
  new.flat[2] = bad
  after = kfl.update_cov(state, new, 0.9)
  for name in state._fields:
    if name != "num_skipped":
      np.testing.assert_array_equal(getattr(after, name), getattr(state, name))
  assert int(after.num_skipped) == int(state.num_skipped) + 1
  after = kfl.update_cov(state, c, 0.9, weight=np.nan)
  np.testing.assert_array_equal(after.cov, state.cov)
  assert int(after.num_skipped) == 1


def test_shape_mismatch_names_both_shapes():
  with pytest.raises(ValueError, match=r"\(4, 4\).*\(3, 3\)"):
    kfl.update_cov(kfl.init_factor(3), np.eye(4), 0.9)


@SETTINGS
@hypothesis.given(n=st.integers(1, 6), damping=st.floats(1e-3, 10.0),
                  exp=st.sampled_from([-1.0, -0.5, -0.25, 0.5, 1.0, 2.0, -1.5]),
                  seed=st.integers(0, 2**16), x64=st.booleans())
def test_damped_matpower_matches_brute_force(n, damping, exp, seed, x64):
  rng = np.random.default_rng(seed)
  c = random_psd(rng, n, rank=max(1, n - 2))  # Singular when rank < n.
  with x64_mode(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    state = filled(c, dtype)
    got = kfl.damped_matpower(state, damping, exp)
    assert got.dtype == dtype
    tol = 1e-9 if x64 else 2e-4
    expected = brute_power(c, damping, exp)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(got, expected, atol=tol * scale, rtol=tol * 10)
    # The cached eigendecomposition gives the same power at any damping.
    cached = kfl.refresh_cache(state, 1)
    np.testing.assert_allclose(
        kfl.damped_matpower(cached, damping, exp, use_cache=True), expected,
        atol=tol * scale, rtol=tol * 10)
    # Diagonal factors: elementwise.
    d = np.abs(np.diag(c))
    np.testing.assert_allclose(
        kfl.damped_matpower(filled(d, dtype, diagonal=True), damping, exp),
        (d + damping) ** exp, rtol=tol * 10)


def test_negative_eigenvalues_are_clipped_and_cholesky_falls_back():
  # Not PSD: the Cholesky factor of C + dI fails; the eigh path clips at 0.
  c = np.array([[1.0, 0.0], [0.0, -0.5]])
  state = filled(c)
  got = kfl.damped_matpower(state, 0.1, -1.0)
  np.testing.assert_allclose(got, np.diag([1 / 1.1, 1 / 0.1]), rtol=1e-5)
  np.testing.assert_allclose(kfl.damped_matpower(state, 0.1, 1.0),
                             np.diag([1.1, 0.1]), rtol=1e-5)


def test_batched_factors_take_per_group_damping():
  rng = np.random.default_rng(3)
  c = random_psd(rng, 3, batch=(2,))
  damping = np.array([0.1, 2.0])
  got = kfl.damped_matpower(filled(c), damping, -0.5)
  for i in range(2):
    np.testing.assert_allclose(got[i], brute_power(c[i], damping[i], -0.5),
                               rtol=1e-4, atol=1e-5)


def test_refresh_caches_power_and_keeps_last_good_cache_on_failure():
  rng = np.random.default_rng(4)
  c = random_psd(rng, 4)
  state = kfl.refresh_cache(filled(c), 7, damping=0.3, exp=-1.0)
  np.testing.assert_allclose(state.matpower, np.linalg.inv(c + 0.3 * np.eye(4)),
                             rtol=1e-4)
  assert int(state.cache_step) == 7
  state = kfl.refresh_cache(state, 8, damping=0.3, exp=-0.5)
  np.testing.assert_allclose(state.matpower, brute_power(c, 0.3, -0.5),
                             rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(
      state.eigvecs @ np.diag(state.eigvals) @ state.eigvecs.T, c, atol=1e-5)
  # A corrupted running estimate (NaN) makes the decomposition fail.
  broken = state._replace(cov=state.cov.at[0, 0].set(jnp.nan))
  after = kfl.refresh_cache(broken, 9, damping=0.3)
  for name in ("eigvals", "eigvecs", "matpower", "cache_step"):
    np.testing.assert_array_equal(getattr(after, name), getattr(state, name))
  assert int(after.num_failed) == 1


def test_factor_products():
  rng = np.random.default_rng(5)
  c = random_psd(rng, 3)
  state = filled(c)
  x = rng.normal(size=(3, 2)).astype(np.float32)
  np.testing.assert_allclose(kfl.multiply(state, x), c @ x, rtol=1e-5)
  np.testing.assert_allclose(kfl.multiply(state, x[:, 0]), c @ x[:, 0], rtol=1e-5)
  inv = np.linalg.inv(c + 0.2 * np.eye(3))
  np.testing.assert_allclose(kfl.multiply_inverse(state, x, 0.2), inv @ x,
                             rtol=1e-4)
  np.testing.assert_allclose(kfl.multiply_inverse(state, x[:, 1], 0.2),
                             inv @ x[:, 1], rtol=1e-4)
  np.testing.assert_allclose(kfl.multiply_matpower(state, x, 0.2, -0.5),
                             brute_power(c, 0.2, -0.5) @ x, rtol=1e-4)
  chol = kfl.damped_cholesky(state, 0.2)
  np.testing.assert_allclose(chol @ chol.T, c + 0.2 * np.eye(3), rtol=1e-5)
  assert np.allclose(np.triu(chol, 1), 0)


def test_factor_functions_jit_and_are_pytrees():
  state = kfl.init_factor(3)
  update = jax.jit(kfl.update_cov)
  state = update(state, jnp.eye(3), 0.9)
  refresh = jax.jit(lambda s, d: fac.refresh_cache(s, 1, damping=d))
  state = refresh(state, 0.1)
  np.testing.assert_allclose(state.matpower, np.eye(3) / 1.1, rtol=1e-6)
  leaves, treedef = jax.tree.flatten(state)
  assert isinstance(jax.tree.unflatten(treedef, leaves), kfl.FactorState)
