"""The math core: factors, zero-debiased EMA, damped powers and their caches."""
import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax_lite as kfl
from kfac_jax_lite.factor import _inverse
from kfac_jax_lite import factor as fac

from _helpers import (assert_power_close, assert_rounding_close, rounding_tol,
                      x64_mode)

SETTINGS = hypothesis.settings(max_examples=12, deadline=None)
METHODS = ("gauss_jordan", "schur", "cholesky", "newton_schulz", "eigh")


def random_psd(rng, n, rank=None, batch=()):
  m = rng.normal(size=batch + (n, rank or n + 2))
  return m @ np.swapaxes(m, -1, -2) / m.shape[-1]


def filled(c, dtype=jnp.float32, diagonal=False, cache="power"):
  c = np.asarray(c)
  state = fac.init_factor(c.shape[-1], diagonal=diagonal,
                          batch_shape=c.shape[:-1] if diagonal else c.shape[:-2],
                          dtype=dtype, cache=cache)
  return kfl.update_cov(state, c, 0.5)


def assert_same_state(after, before, skip=()):
  for name in before._fields:
    if name not in skip:
      jax.tree.map(np.testing.assert_array_equal, getattr(after, name),
                   getattr(before, name))


def brute_power(c, damping, exp):
  w, q = np.linalg.eigh(np.asarray(c, np.float64))
  w = np.maximum(w, 0)
  return (q * (w + damping) ** exp) @ q.T


def test_first_update_is_debiased_and_ema_matches_formula():
  rng = np.random.default_rng(0)
  xs = [random_psd(rng, 3) for _ in range(4)]
  ws = [1.0, 2.0, 0.5, 3.0]
  decay = 0.8
  state = fac.init_factor(3)
  np.testing.assert_array_equal(fac.factor_value(state), np.zeros((3, 3)))
  for i, (x, w) in enumerate(zip(xs, ws)):
    state = kfl.update_cov(state, x, decay, weight=w)
    coeffs = [(1 - decay) * decay ** (i - j) * ws[j] for j in range(i + 1)]
    expected = sum(c * xs[j] for j, c in enumerate(coeffs)) / sum(coeffs)
    # A weighted mean of i + 1 updates, each a few flops (≤ 4 terms each).
    assert_rounding_close(fac.factor_value(state), expected, terms=4 * (i + 1))
  assert_rounding_close(
      fac.factor_value(kfl.update_cov(fac.init_factor(3), xs[0], 0.99)), xs[0],
      terms=4)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("diagonal", [False, True])
def test_non_finite_statistics_leave_state_exactly_unchanged(bad, diagonal):
  rng = np.random.default_rng(1)
  c = random_psd(rng, 4)
  c = np.diag(c) if diagonal else c
  state = fac.refresh_cache(filled(c, diagonal=diagonal), 3, damping=0.1)
  new = np.array(c)
  new.flat[2] = bad
  after = kfl.update_cov(state, new, 0.9)
  assert_same_state(after, state, skip=("num_skipped",))
  assert int(after.num_skipped) == int(state.num_skipped) + 1
  after = kfl.update_cov(state, c, 0.9, weight=np.nan)
  np.testing.assert_array_equal(after.cov, state.cov)
  assert int(after.num_skipped) == 1


def test_shape_mismatch_names_both_shapes():
  with pytest.raises(ValueError, match=r"\(4, 4\).*\(3, 3\)"):
    kfl.update_cov(fac.init_factor(3), np.eye(4), 0.9)


@SETTINGS
@hypothesis.given(n=st.integers(1, 6), damping=st.floats(1e-3, 10.0),
                  exp=st.sampled_from([-1.0, -0.5, -0.25, 0.5, 1.0, 2.0, -1.5]),
                  method=st.sampled_from(METHODS),
                  seed=st.integers(0, 2**16), x64=st.booleans())
def test_damped_matpower_matches_brute_force(n, damping, exp, method, seed, x64):
  rng = np.random.default_rng(seed)
  c = random_psd(rng, n, rank=max(1, n - 2))  # Singular when rank < n.
  with x64_mode(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    d = np.abs(np.diag(c))
    got, cached, from_eigh, diagonal = _powers(
        filled(c, dtype), filled(c, dtype, cache="eigh"),
        filled(d, dtype, diagonal=True), damping, exp, method)
    assert got.dtype == dtype
    # (C + dI)^exp, C clipped at 0 as brute_power does, to what rounding
    # allows at its condition number.
    w, q = np.linalg.eigh(c)
    damped = (q * (np.maximum(w, 0) + damping)) @ q.T
    assert_power_close(got, damped, exp)
    # A refreshed power cache holds the same power.
    assert_power_close(cached, damped, exp)
    # The cached eigendecomposition gives the same power at any damping.
    assert_power_close(from_eigh, damped, exp)
    # Diagonal factors: elementwise (a power of one number: ≤ 2·|exp| ε).
    np.testing.assert_allclose(diagonal, (d + damping) ** exp, rtol=rounding_tol(
        dtype, 2, 1.0, depth=max(1.0, abs(exp))))


@functools.partial(jax.jit, static_argnums=(4, 5))
def _powers(state, eigh_state, diagonal_state, damping, exp, method):
  """The powers the test above checks, jitted as the library runs (one
  compile per drawn size: eager mode compiles every primitive for it)."""
  return (kfl.damped_matpower(state, damping, exp, method=method),
          fac.refresh_cache(state, 1, damping=damping, exp=exp,
                            method=method).cache.matpower,
          kfl.damped_matpower(fac.refresh_cache(eigh_state, 1), damping, exp,
                              use_cache=True),
          kfl.damped_matpower(diagonal_state, damping, exp))


@pytest.mark.parametrize("method", METHODS)
def test_negative_eigenvalues_are_clipped_and_inverses_fall_back(method):
  # Not PSD: C + dI has a negative pivot, so the fast inverses fail and the
  # eigh path clips at 0.
  c = np.array([[1.0, 0.0], [0.0, -0.5]])
  state = filled(c)
  got = kfl.damped_matpower(state, 0.1, -1.0, method=method)
  np.testing.assert_allclose(got, np.diag([1 / 1.1, 1 / 0.1]), rtol=1e-5)
  np.testing.assert_allclose(kfl.damped_matpower(state, 0.1, 1.0),
                             np.diag([1.1, 0.1]), rtol=1e-5)


def test_batched_factors_take_per_group_damping():
  rng = np.random.default_rng(3)
  c = random_psd(rng, 3, batch=(2,))
  damping = np.array([0.1, 2.0])
  got = kfl.damped_matpower(filled(c), damping, -0.5)
  for i in range(2):
    assert_power_close(got[i], c[i] + damping[i] * np.eye(3), -0.5)


def test_refresh_caches_power_or_eigendecomposition():
  rng = np.random.default_rng(4)
  c = random_psd(rng, 4)
  state = fac.refresh_cache(filled(c), 7, damping=0.3, exp=-1.0)
  assert_power_close(state.cache.matpower, c + 0.3 * np.eye(4), -1.0)
  assert int(state.cache.step) == 7
  state = fac.refresh_cache(state, 8, damping=0.3, exp=-0.5)
  assert_power_close(state.cache.matpower, c + 0.3 * np.eye(4), -0.5)
  eig = fac.refresh_cache(filled(c, cache="eigh"), 8).cache
  # A backward-stable eigendecomposition: Q Λ Qᵀ = C to about 2n·ε·‖C‖,
  # and as much again for the float32 product that checks it.
  assert_rounding_close(eig.eigvecs @ np.diag(eig.eigvals) @ eig.eigvecs.T, c,
                        terms=4, depth=4)
  with pytest.raises(ValueError, match="damping="):
    fac.refresh_cache(state, 9)


def test_cache_keeps_only_what_its_kind_needs():
  n, nbytes = 5, lambda t: sum(x.nbytes for x in jax.tree.leaves(t))
  power, eig = fac.init_factor(n), fac.init_factor(n, cache="eigh")
  # cov + one n×n array (+ the scalars: weight, three counters/steps, and
  # one-element placeholders for what the kind does not keep: never
  # zero-size, which orbax cannot save).
  assert nbytes(power) == 4 * (2 * n * n) + 4 * 4 + 4 * 2
  assert nbytes(eig) == 4 * (2 * n * n + n) + 4 * 4 + 4 * 1
  assert power.cache.eigvecs.size == power.cache.eigvals.size == 1
  assert eig.cache.matpower.size == 1
  assert fac.cache_kind(power) == "power" and fac.cache_kind(eig) == "eigh"
  for dim in (1, 2):  # A one-element factor reads its kind and form too.
    for diagonal in (False, True):
      for kind in ("power", "eigh"):
        f = fac.init_factor(dim, diagonal=diagonal, cache=kind)
        assert fac.cache_kind(f) == kind and fac.is_diagonal(f) == diagonal
        assert all(x.size for x in jax.tree.leaves(f))
  diag = fac.init_factor(n, diagonal=True, batch_shape=(3,))
  assert nbytes(diag) == 4 * (2 * 3 * n) + 4 * 4 + 4 * 3 * 2
  assert fac.is_diagonal(diag)
  assert not fac.is_diagonal(fac.init_factor(n, batch_shape=(3,)))
  with pytest.raises(ValueError, match="cache must be one of"):
    fac.init_factor(n, cache="both")
  with pytest.raises(ValueError, match="inverse_method must be one of"):
    fac.check_inverse_method("lu")


@pytest.mark.parametrize("x64", [False, True])
@pytest.mark.parametrize("method", METHODS)
def test_each_inverse_method_refreshes_the_exact_damped_inverse(method, x64):
  """Sizes below, at and above the Gauss-Jordan block (padding), batched
  groups with their own damping, singular factors."""
  rng = np.random.default_rng(6)
  with x64_mode(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    for n, batch in ((1, ()), (7, (2,)), (70, (2,))):
      c = random_psd(rng, n, rank=max(1, n // 2), batch=batch)
      damping = np.linspace(0.05, 0.5, int(np.prod(batch)) or 1).reshape(batch)
      state = jax.jit(lambda s, d: fac.refresh_cache(s, 4, damping=d,
                                                     method=method))(
          filled(c, dtype), damping)
      got = np.asarray(state.cache.matpower)
      assert got.dtype == dtype and int(state.cache.step) == 4
      flat_c = c.reshape((-1, n, n))
      for i, (ci, di) in enumerate(zip(flat_c, np.ravel(damping))):
        assert_power_close(got.reshape((-1, n, n))[i], ci + di * np.eye(n), -1)


# Small leaves and pivot blocks, so that these sizes split (at multiples of
# 8; S's sweep pads).
_small_schur = jax.jit(lambda m: _inverse.schur_inverse(m, leaf_size=24,
                                                        block_size=8))


@pytest.mark.parametrize("x64", [False, True])
def test_schur_inverse_split_is_the_exact_inverse(x64):
  """Sizes at and off multiples of the pivot block, batch axes,
  ill-conditioned matrices; not ok for indefinite ones."""
  rng = np.random.default_rng(9)
  with x64_mode(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    for n, batch in ((40, (2,)), (61, (3,))):  # 16 + 24; 32 + 29 (padded).
      m = random_psd(rng, n, batch=batch) + 0.1 * np.eye(n)
      got, ok = _small_schur(jnp.asarray(m, dtype))
      assert got.dtype == dtype and got.shape == m.shape and bool(ok)
      np.testing.assert_allclose(got, np.swapaxes(got, -1, -2))
      for g, mi in zip(got, m):
        assert_power_close(g, mi, -1)
    # Indefinite (one negative eigenvalue: its pivot turns up in a later
    # block) or NaN: a batch with one bad member is not ok as a whole.
    q, _ = np.linalg.qr(rng.normal(size=(61, 61)))
    bad = (q * np.r_[np.linspace(1, 2, 60), -0.5]) @ q.T
    nan = np.eye(61)
    nan[40, 40] = np.nan
    for one in (bad, nan):
      m = jnp.asarray(np.stack([np.eye(61), one, np.eye(61)]), dtype)
      assert not bool(_small_schur(m)[1])
    # Ill-conditioned (κ = 1e4 in float32, 1e8 in float64): with the refined
    # Schur complements the forward error stays below κ·ε, that of a
    # backward-stable inverse (unrefined: 5x-1e8x above it).
    cond = 1e8 if x64 else 1e4
    ms, refs = [], []
    for _ in range(3):
      q, _ = np.linalg.qr(rng.normal(size=(61, 61)))
      w = np.geomspace(1, 1 / cond, 61)
      ms.append((q * w) @ q.T)
      refs.append((q / w) @ q.T)
    m = jnp.asarray(np.stack(ms), dtype)
    refs = np.linalg.inv(np.asarray(m, np.float64)) if not x64 else np.stack(refs)
    err = lambda x: np.linalg.norm(np.asarray(x, np.float64) - refs,
                                   axis=(-2, -1)) / np.linalg.norm(refs, axis=(-2, -1))
    got, ok = _small_schur(m)
    assert bool(ok) and np.all(err(got) <= cond * np.finfo(dtype).eps), err(got)
  with pytest.raises(ValueError, match="leaf_size .* at least block_size"):
    _inverse.schur_inverse(jnp.eye(9), leaf_size=4, block_size=8)

_small_gauss_jordan = jax.jit(
    lambda m: _inverse.gauss_jordan_inverse(m, block_size=8))


@pytest.mark.parametrize("x64", [False, True])
def test_gauss_jordan_inverse_over_many_blocks_is_exact_and_symmetric(x64):
  """Eight pivot blocks (the last one padded): the sweep never writes the
  row blocks and mirrors the result from the upper block triangle, which
  must give the inverse, exactly symmetric, with forward error below κ·ε
  on ill-conditioned matrices; an indefinite matrix is not ok."""
  rng = np.random.default_rng(10)
  with x64_mode(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    m = random_psd(rng, 61, batch=(3,)) + 0.1 * np.eye(61)
    got, ok = _small_gauss_jordan(jnp.asarray(m, dtype))
    assert got.dtype == dtype and bool(ok)
    np.testing.assert_array_equal(got, np.swapaxes(got, -1, -2))
    for g, mi in zip(got, m):
      assert_power_close(g, mi, -1)
    cond = 1e8 if x64 else 1e4
    q, _ = np.linalg.qr(rng.normal(size=(61, 61)))
    w = np.geomspace(1, 1 / cond, 61)
    ill = jnp.asarray((q * w) @ q.T, dtype)
    ref = np.linalg.inv(np.asarray(ill, np.float64))
    got, ok = _small_gauss_jordan(ill)
    err = np.linalg.norm(np.asarray(got, np.float64) - ref) / np.linalg.norm(ref)
    assert bool(ok) and err <= cond * np.finfo(dtype).eps, err
    bad = (q * np.r_[np.linspace(1, 2, 60), -0.5]) @ q.T
    assert not bool(_small_gauss_jordan(jnp.asarray(bad, dtype))[1])


@pytest.mark.parametrize("x64", [False, True])
def test_factors_sharing_a_padded_size_share_one_exact_inversion(x64):
  """Damped factors of 30 and 31 (one pivot block of 64) and of 100 and 127
  (two) go through one compiled inversion per padded size (``⊕ I``, the
  damping on the real part only), and the padded inversion equals the
  unpadded one: the scalar elimination at the factor's own size, the sweep
  padded further (to 192); float64 within 1e-12 of the exact damped
  inverse. A NaN, an inf or a negative pivot in a padded factor is not ok."""
  rng = np.random.default_rng(11)
  inverse = fac.INVERSES["gauss_jordan"]
  traces = _inverse._padded_gauss_jordan._cache_size()
  with x64_mode(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    eps = np.finfo(dtype).eps
    for n, damping in ((30, 0.3), (31, 0.05), (100, 0.2), (127, 0.1)):
      c = jnp.asarray(random_psd(rng, n, rank=n // 2), dtype)
      got, ok = inverse(c, jnp.asarray(damping, dtype))
      m = c + damping * jnp.eye(n, dtype=dtype)
      if n < _inverse.BLOCK_SIZE:
        unpadded = -_inverse._negated_leaf_inverse(m)[0]
      else:
        wider = jnp.pad(m, [(0, 192 - n)] * 2) + jnp.diag(
            jnp.arange(192) >= n).astype(dtype)
        unpadded = -_inverse._sweep(wider, _inverse.BLOCK_SIZE)[0][:n, :n]
      exact = np.linalg.inv(np.asarray(m, np.float64))
      scale = np.abs(exact).max()
      assert got.dtype == dtype and got.shape == (n, n) and bool(ok)
      # κ(m) ≤ (‖c‖ + d) / d: the forward error of either elimination.
      cond = (np.linalg.norm(np.asarray(c, np.float64), 2) + damping) / damping
      tol = 1e-12 if x64 else 4 * n * eps * cond
      np.testing.assert_allclose(got, unpadded, rtol=0, atol=tol * scale)
      np.testing.assert_allclose(got, exact, rtol=0,
                                 atol=(1e-12 if x64 else tol) * scale)
      for bad in (np.nan, np.inf):
        assert not bool(inverse(c.at[n // 2, n // 3].set(bad), 0.1)[1])
      assert not bool(inverse(c, -2 * float(jnp.max(jnp.diag(c))))[1])
  # One trace per padded size and dtype (64 and 128), not one per factor.
  assert _inverse._padded_gauss_jordan._cache_size() - traces <= 2


def test_an_inverse_with_positive_pivots_is_ok_only_when_finite():
  """The pivots alone do not make an inverse ok: one non-finite entry
  (±inf, NaN; the other entries finite) makes it not ok."""
  finish = jax.jit(_inverse._finish, static_argnums=2)  # As compiled.
  finite = jnp.array([[2.0, -1.0], [-1.0, 3.0]])
  assert bool(finish(finite, jnp.float32(1.0), True)[1])
  assert not bool(finish(finite, jnp.float32(0.0), True)[1])
  for bad in (jnp.inf, -jnp.inf, jnp.nan):
    for symmetric in (True, False):
      m = finite.at[0, 1].set(bad)
      assert not bool(finish(m, jnp.float32(1.0), symmetric)[1])


def test_inverses_of_device_varying_factors_under_shard_map():
  """Inside ``shard_map(check_vma=True)`` a factor that differs per device
  (one model per device) is inverted with the loops' carries varying like
  it (an invariant initial pivot bound would not match)."""
  from jax.sharding import Mesh, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  m = random_psd(np.random.default_rng(11), 70, batch=(1,)) + 0.1 * np.eye(70)
  for method in ("gauss_jordan", "schur"):
    fn = jax.shard_map(
        lambda c: fac.damped_matpower(kfl.update_cov(fac.init_factor(70), c[0], 0.5),
                                      0.0, -1.0, method=method)[None],
        mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=True)
    assert_power_close(jax.jit(fn)(jnp.asarray(m, jnp.float32))[0], m[0], -1)


def _poisoned_gauss_jordan(monkeypatch):
  """Make the Gauss-Jordan path recognisable: it returns 7·(its inverse)."""
  real = _inverse.gauss_jordan_inverse
  monkeypatch.setattr(_inverse, "gauss_jordan_inverse",
                      lambda m, *a: (lambda r: (7 * r[0], r[1]))(real(m, *a)))


@pytest.mark.parametrize("x64", [False, True])
def test_newton_schulz_warm_start_and_fallback(monkeypatch, x64):
  rng = np.random.default_rng(7)
  n = 6
  c0 = random_psd(rng, n)
  c1 = c0 + 0.1 * random_psd(rng, n)  # Moved a little since the last refresh.
  with x64_mode(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    tol = 1e-9 if x64 else 2e-4
    expected = np.linalg.inv(c1 + 0.5 * np.eye(n))
    close = lambda got, want: np.testing.assert_allclose(
        got, want, atol=tol * np.abs(want).max(), rtol=tol)
    refresh = jax.jit(lambda st, step: fac.refresh_cache(
        st, step, damping=0.5, method="newton_schulz"))
    warm = fac.refresh_cache(filled(c0, dtype), 1, damping=0.5)
    _poisoned_gauss_jordan(monkeypatch)
    # Warm start close enough: Newton-Schulz alone gives the exact inverse.
    moved = warm._replace(cov=filled(c1, dtype).cov)
    close(refresh(moved, 2).cache.matpower, expected)
    # No cache yet (step -1): the Gauss-Jordan fallback computes it.
    close(refresh(filled(c1, dtype), 2).cache.matpower, 7 * expected)
    # A warm start too far away (residual >= 1): the fallback again.
    far = moved._replace(cache=moved.cache._replace(
        matpower=moved.cache.matpower * 10))
    close(refresh(far, 2).cache.matpower, 7 * expected)
    # The iteration itself: quadratic convergence from a close start, and
    # "not converged" from a start whose residual does not shrink.
    m = jnp.asarray(c1 + 0.5 * np.eye(n), dtype)
    x, ok = _inverse.newton_schulz_inverse(m, warm.cache.matpower)
    assert bool(ok)
    close(x, expected)
    assert not bool(_inverse.newton_schulz_inverse(m, jnp.zeros_like(m))[1])


@pytest.mark.parametrize("method", METHODS)
def test_failed_decomposition_keeps_the_last_good_cache(method):
  rng = np.random.default_rng(8)
  c = random_psd(rng, 4)
  state = fac.refresh_cache(filled(c), 7, damping=0.3, method=method)
  # A corrupted running estimate (NaN), and one that no damping makes
  # positive definite (an eigenvalue of -5 with damping 0.3).
  nan = state._replace(cov=state.cov.at[0, 0].set(jnp.nan))
  indefinite = state._replace(cov=filled(c - 5 * np.eye(4)).cov)
  for broken in (nan, indefinite):
    after = fac.refresh_cache(broken, 9, damping=0.3, method=method)
    if method == "eigh" and broken is indefinite:
      continue  # eigh clips the eigenvalues at 0: a valid (damped) inverse.
    assert_same_state(after.cache, state.cache, skip=("num_failed",))
    assert int(after.cache.num_failed) == 1
  eig = fac.refresh_cache(filled(c, cache="eigh"), 7)
  after = fac.refresh_cache(eig._replace(cov=eig.cov.at[0, 0].set(jnp.nan)), 9)
  assert_same_state(after.cache, eig.cache, skip=("num_failed",))
  assert int(after.cache.num_failed) == 1


def test_factor_products():
  rng = np.random.default_rng(5)
  c = random_psd(rng, 3)
  state = filled(c)
  x = rng.normal(size=(3, 2)).astype(np.float32)
  # Products of 3 terms, at the size of the terms |C||x|.
  size = np.abs(c) @ np.abs(x)
  assert_rounding_close(fac.multiply(state, x), c @ x, terms=3, depth=2,
                        scale=size.max())
  assert_rounding_close(fac.multiply(state, x[:, 0]), c @ x[:, 0], terms=3,
                        depth=2, scale=size.max())
  # Solves and powers: the power's forward error (assert_power_close) times
  # |x|'s 3 terms, at κ of the damped factor.
  damped = c + 0.2 * np.eye(3)
  kappa = np.linalg.cond(damped)
  for got, p, v in ((kfl.multiply_inverse(state, x, 0.2), -1.0, x),
                    (kfl.multiply_inverse(state, x[:, 1], 0.2), -1.0, x[:, 1]),
                    (fac.multiply_matpower(state, x, 0.2, -0.5), -0.5, x)):
    power = brute_power(c, 0.2, p)
    assert_rounding_close(got, power @ v, terms=3 + 4, depth=4 * 2,
                          cond=kappa, scale=(np.abs(power) @ np.abs(v)).max())
  chol = fac.damped_cholesky(state, 0.2)
  # Cholesky is backward stable: L Lᵀ = C + dI to about 2n·ε·‖C + dI‖, and
  # as much again for the float32 product that checks it.
  assert_rounding_close(chol @ chol.T, damped, terms=3, depth=4)
  assert np.allclose(np.triu(chol, 1), 0)


def test_factor_functions_jit_and_are_pytrees():
  state = fac.init_factor(3)
  update = jax.jit(kfl.update_cov)
  state = update(state, jnp.eye(3), 0.9)
  refresh = jax.jit(lambda s, d: fac.refresh_cache(s, 1, damping=d))
  state = refresh(state, 0.1)
  assert_power_close(state.cache.matpower, 1.1 * np.eye(3), -1)
  leaves, treedef = jax.tree.flatten(state)
  assert isinstance(jax.tree.unflatten(treedef, leaves), kfl.FactorState)


def test_inverse_method_is_selectable_through_kfac_and_the_optimizer(
    monkeypatch):
  """``inverse_method="schur"`` reaches the refresh: the same update as
  ``"cholesky"`` (both exact), another one when ``schur_inverse`` is
  poisoned; a wrong name is refused at construction."""
  x = jnp.asarray(np.random.default_rng(10).normal(size=(12, 4)), jnp.float32)
  batch = {"x": x, "y": x[:, :3] * 2}
  params = {"w": jnp.ones((4, 3)) / 2, "b": jnp.zeros(3)}

  def loss_fn(p, b):
    return kfl.squared_error(b["x"] @ p["w"] + p["b"], b["y"]).sum(-1).mean()

  grads = jax.grad(loss_fn)(params, batch)

  def update(method):
    tx = kfl.kfac(loss_fn, batch, damping=0.1, inverse_method=method)
    return jax.jit(lambda p: tx.update(grads, tx.init(p), p, batch=batch)[0])(
        params)  # Traced anew per call: the monkeypatch below is seen.

  close = lambda a, b: jax.tree.map(functools.partial(
      np.testing.assert_allclose, rtol=1e-4, atol=1e-6), a, b)
  want = update("cholesky")
  close(update("schur"), want)
  real = _inverse.schur_inverse
  monkeypatch.setattr(_inverse, "schur_inverse",
                      lambda m, *a: (lambda r: (r[0] / 2, r[1]))(real(m, *a)))
  with pytest.raises(AssertionError):
    close(update("schur"), want)
  for make in (kfl.kfac, kfl.kfac_optimizer):
    with pytest.raises(ValueError, match="inverse_method must be one of"):
      make(loss_fn, batch, inverse_method="schur_complement")
