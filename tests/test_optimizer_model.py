"""``kfac_optimizer``'s two rules on their own, in float64 against values
worked out by hand: the 2x2 quadratic-model solve for ``(α, μ)`` and the
Levenberg–Marquardt update of the damping from ``ρ``."""
import jax.numpy as jnp
import numpy as np
import pytest

from kfac_jax_lite.optimizers import optimizer

from _helpers import x64_mode


def solve(q, b, **kw):
  return np.asarray(optimizer.quadratic_model_step(
      jnp.asarray(q, jnp.float64), jnp.asarray(b, jnp.float64), **kw))


def test_the_2x2_solve():
  with x64_mode(True):
    # Q = [[2, 1], [1, 4]], b = [-3, -1]: Q⁻¹ = [[4, -1], [-1, 2]] / 7, so
    # -Q⁻¹b = [(12 - 1)/7, (-3 + 2)/7]
    # = [11/7, -1/7]: μ < 0 is clipped to 0 and α = -b₀/Q₀₀ = 3/2.
    np.testing.assert_allclose(solve([[2, 1], [1, 4]], [-3, -1]),
                               [1.5, 0.0], rtol=1e-14)
    # b = [-3, -2]: -Q⁻¹b = [(12 - 2)/7, (-3 + 4)/7] = [10/7, 1/7], inside
    # [0, 0.99]: the unconstrained optimum.
    np.testing.assert_allclose(solve([[2, 1], [1, 4]], [-3, -2]),
                               [10 / 7, 1 / 7], rtol=1e-14)
    # b = [-1, -8]: μ = (-1 + 16)/7 = 15/7 clipped to 0.5, then
    # α = -(b₀ + μ Q₀₁)/Q₀₀ = -(-1 + 0.5)/2 = 0.25.
    np.testing.assert_allclose(
        solve([[2, 1], [1, 4]], [-1, -8], max_momentum=0.5), [0.25, 0.5],
        rtol=1e-14)


def test_the_solve_without_momentum_or_curvature():
  with x64_mode(True):
    # No momentum: α = -b₀/Q₀₀ = 3/2 whatever b₁.
    np.testing.assert_allclose(
        solve([[2, 1], [1, 4]], [-3, -2], use_momentum=False), [1.5, 0.0],
        rtol=1e-14)
    # δ = 0 (the first step): Q is singular, μ = 0.
    np.testing.assert_allclose(solve([[2, 0], [0, 0]], [-3, 0]), [1.5, 0.0],
                               rtol=1e-14)
    # No curvature along Δ: the step is skipped.
    np.testing.assert_array_equal(solve([[0, 0], [0, 1]], [-3, -1]), [0, 0])
    np.testing.assert_array_equal(
        solve([[2, 1], [1, 4]], [np.nan, -1]), [0, 0])


@pytest.mark.parametrize("rho, factor", [
    (0.76, 0.5), (1.3, 0.5),      # ρ > ¾: λ ← ωλ
    (0.75, 1.0), (0.5, 1.0), (0.25, 1.0),  # ¼ ≤ ρ ≤ ¾: unchanged
    (0.24, 2.0), (-3.0, 2.0), (-np.inf, 2.0),  # ρ < ¼: λ ← λ/ω
])
def test_levenberg_marquardt_thresholds(rho, factor):
  with x64_mode(True):
    new = optimizer.levenberg_marquardt(
        jnp.float64(1e-2), jnp.float64(rho), 0.5, 1e-5, 1e8)
    np.testing.assert_allclose(new, 1e-2 * factor, rtol=1e-15)


def test_levenberg_marquardt_clips_to_the_range():
  with x64_mode(True):
    lm = lambda lam, rho: float(optimizer.levenberg_marquardt(
        jnp.float64(lam), jnp.float64(rho), 0.5, 1e-3, 1.0))
    assert lm(1.5e-3, 1.0) == 1e-3
    assert lm(0.8, 0.0) == 1.0


def test_reduction_ratio():
  with x64_mode(True):
    rr = lambda *a: float(optimizer.reduction_ratio(
        *map(jnp.float64, a)))
    # Loss 2 → 1.5 where the model predicted -1: ρ = -0.5 / -1 = 0.5.
    assert rr(1.5, 2.0, -1.0) == 0.5
    # The loss went up: ρ = 0.25 / -1 < 0.
    assert rr(2.25, 2.0, -1.0) == -0.25
    # A non-finite new loss: -inf (λ rises).
    assert rr(np.nan, 2.0, -1.0) == -np.inf
