"""Kronecker blocks for a dense layer applied at every step of a recurrence
(Martens, Ba & Johnson 2018, "Kronecker-factored curvature approximations
for recurrent neural networks"; TensorFlow K-FAC's ``FullyConnectedSeriesFB``).

A kernel used at the T steps of a ``lax.scan`` has, per example, the
gradient ``∇_W ℓ = Σ_t ā_t g_tᵀ`` (``ā_t`` the step's input with a 1 for
the bias, ``g_t = ∂ℓ/∂y_t``; row-major ``vec(ā gᵀ) = ā ⊗ g``), so its
curvature is ``F = Σ_{t,s} E[ā_t ā_sᵀ ⊗ g_t g_sᵀ]``. Assuming the inputs
independent of the cotangents and both temporally homogeneous,

    F = Σ_{t,s=0}^{T-1} A_{s-t} ⊗ G_{s-t},
    A_d = E[ā_t ā_{t+d}ᵀ],  G_d = E[g_t g_{t+d}ᵀ],  A_{-d} = A_dᵀ.

Statistics (``SeriesState``), per step (averaged over the T steps; a lag
product over T-1 pairs is still divided by T, the sequence padded with
zeros, which keeps every block-Toeplitz matrix of them PSD), with the
examples' ``c_i`` and ``w_i = c_i / Σc`` of the other blocks
(``blocks.base``) and the mean over the S sampled cotangents:

    A₀ = Σ_i w_i (1/T) Σ_t ā_it ā_itᵀ,   A₁ = Σ_i w_i (1/T) Σ_t ā_it ā_i,t+1ᵀ,
    G₀ = Σ_i c_i (1/T) Σ_t g_it g_itᵀ,   G₁ = Σ_i c_i (1/T) Σ_t g_it g_i,t+1ᵀ.

Other shared axes of the layer's data (positions inside a step, or the
rows of a layer whose example axis is not the batch's) are independent
sequences, as ``"expand"`` treats positions: averaged in ``A``, summed in
``G``.

Damping is π-adjusted on the lag-0 factors before any transform (as TF):
``A₀ ← A₀ + π√(λ/T) I``, ``G₀ ← G₀ + √(λ/T)/π I``, ``π = sqrt((tr A₀ /
a)/(tr G₀ / b))``. Write ``C^{-1/2}`` for the damped factor's inverse root
and ``Ψ̂ = C₀^{-1/2} C₁ C₀^{-1/2}``. The options (``option``):

* ``"kron_indep"`` — the steps independent: ``F ≈ T A₀ ⊗ G₀``, the same
  block as ``KroneckerDense`` under ``"expand"`` (whose ``G`` sums over
  the steps), inverse ``T⁻¹ (A₀+d_A)⁻¹ ⊗ (G₀+d_G)⁻¹``.
* ``"series1"`` — option 1: ``ā_t`` and ``g_t`` each a linear-Gaussian
  (VAR(1)) process with a symmetric ``Ψ̂`` (``C₁`` is symmetrised), so
  ``A_d = A₀^{1/2} Ψ̂_A^{|d|} A₀^{1/2}``. With ``Ψ̂ = U diag(ψ) Uᵀ`` and
  ``L = C₀^{-1/2} U``,
  ``F⁻¹ = (L_A ⊗ L_G) diag(γ(ψ_A ψ_Gᵀ)) (L_A ⊗ L_G)ᵀ``,
  ``γ(x) = 1/Σ_{t,s} x^{|t-s|} = (1-x)² / (T(1-x²) - 2x(1-x^T))``
  (computed without the cancellation near ``x = 1``: a Taylor series in
  ``T(1-x)`` there, ``γ(1) = 1/T²``; for even T the sum vanishes at
  ``x = -1``, which damping keeps away: ``|ψ| < 1`` once ``λ > 0``).
* ``"series2"`` — option 2: VAR(1) processes on infinitely long sequences,
  ``F ≈ T Σ_{d=-∞}^{∞} A_d ⊗ G_d`` with ``A_d = A₀^{1/2} Ψ̂_A^d A₀^{1/2}``
  (``d ≥ 0``). With ``Ψ = Ψ̂_A ⊗ Ψ̂_G``, ``Σ_d = (I-Ψ)⁻¹ (I - ΨΨᵀ)
  (I-Ψᵀ)⁻¹``, so with ``Ψ̂Ψ̂ᵀ = E diag(μ) Eᵀ`` (``μ`` the squared singular
  values, clipped to ``[0, 1]``), ``K = C₀^{-1/2} E`` and ``P = C₁ C₀⁻¹``:
  ``F⁻¹ vec(V)`` is ``Z = K_Aᵀ (V - P_A V P_Gᵀ) K_G``, ``Z ← Z / (1 -
  μ_A μ_Gᵀ)`` (a gap that is exactly 0 divides by 1 instead, as TF did),
  ``Y = K_A Z K_Gᵀ``, ``(Y - P_Aᵀ Y P_G) / T``.

With ``A₁ = G₁ = 0`` the three options are the same matrix. The
``blocks=`` choice ``"kron_indep"`` (``series_block``) is therefore the
layer's ``KroneckerDense`` under ``"expand"`` itself, with every power and
product and no lag-1 statistics; ``SeriesDense(option="kron_indep")``
exists to compare the options on one state.

Only the inverse is provided (as in TF): ``multiply_matpower`` with a power
other than -1, ``refresh`` with ``exp != -1``, ``multiply``, the Cholesky
products and ``to_dense`` raise ``NotImplementedError``.

State: ``a0``, ``g0`` (``"eigh"`` caches: ``eigvals`` ψ or μ, ``eigvecs``
``L`` or ``K`` of the last refresh) and ``a1``, ``g1`` (``"power"``
caches: ``matpower`` ``P`` for ``"series2"``, zeros otherwise). A refresh
computes these at its damping (``use_cache`` products use them, like the
π-damped inverses of ``KroneckerDense``); a refresh whose result is not
finite keeps the last good caches and counts in every factor's
``num_failed``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Generic, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax_lite.factor import float_dtype
from kfac_jax_lite.blocks import _kron
from kfac_jax_lite import factor as fac
from kfac_jax_lite.blocks import _layout
from kfac_jax_lite.blocks import base
from kfac_jax_lite.blocks import dense

OPTIONS = ("kron_indep", "series1", "series2")


class SeriesState(NamedTuple, Generic[_kron.Leaf]):
  """Lag-0 and lag-1 factors (each ``[1, n, n]``); see the module docstring."""

  # fac.FactorState leaves in a state, arrays in statistics.
  a0: _kron.Leaf  # A₀; cache: ψ or μ, L or K.
  a1: _kron.Leaf  # A₁ = E[ā_t ā_{t+1}ᵀ] (not symmetric); cache: P.
  g0: _kron.Leaf
  g1: _kron.Leaf


def lag_stats(x, weights, num_samples=1):
  """``(C₀, C₁)`` [n, n] from ``x [S?, N, R, T, n]`` and per-example
  ``weights [N]``: ``Σ_n weights_n mean_s Σ_r (1/T) Σ_t x_t x_{t+d}ᵀ``."""
  t = x.shape[-2]
  xw = x * weights[:, None, None, None]
  c0 = base.gram(xw, x) / (t * num_samples)
  c1 = base.gram(xw[..., :-1, :], x[..., 1:, :]) / (t * num_samples)
  return c0, c1


def gamma(x, num_steps):
  """``γ(x) = 1 / Σ_{t,s=0}^{T-1} x^{|t-s|}`` elementwise, ``x ∈ [-1, 1]``.

  The closed form ``(1-x)² / (T(1-x²) - 2x(1-x^T))`` loses digits as ``x →
  1`` (numerator and denominator vanish); for ``z = T(1-x) < 1`` the sum is
  evaluated as its Taylor series in ``z``, whose coefficients are exact
  integers at ``x = 1`` (``Σ = T²`` there).
  """
  big_t = num_steps
  x = jnp.clip(x, -1, 1)
  y = 1 - x
  near = big_t * y < 1
  # Away from 1 (y >= 1/T): 1 - x^T >= 1 - e^-1, no cancellation there.
  xs = jnp.where(near, 0.0, x)
  ys = 1 - xs
  closed = ys ** 2 / (big_t * ys * (1 + xs) - 2 * xs * (1 - xs ** big_t))
  # Σ_d (T-|d|)(1-y)^|d| = Σ_k c_k y^k, c_k = (-1)^k Σ_d (T-|d|) C(|d|, k)
  # = (-1)^k (2 C(T+1, k+2) - T [k = 0]) (twice the hockey-stick identity);
  # in z = T·y, scaled by 1/T², the coefficients are c_k / T^(k+2).
  coeffs = [(-1) ** k * (2 * math.comb(big_t + 1, k + 2) - (big_t if k == 0
                                                            else 0))
            / big_t ** (k + 2) for k in range(16)]
  z = big_t * y
  series = jnp.zeros_like(z)
  for c in reversed(coeffs):
    series = series * z + c
  return jnp.where(near, 1 / (big_t ** 2 * series), closed)


def _sym(m):
  return (m + jnp.swapaxes(m, -1, -2)) / 2


def _t(m):
  return jnp.swapaxes(m, -1, -2)


def _inv_sqrt(c0, damping):
  """``(C₀ + d I)^{-1/2}``, symmetric, through the eigendecomposition."""
  w, q = fac.eigh(c0)
  root = (q * (w + damping[..., None]) ** -0.5) @ _t(q)
  return _sym(root)


def _option_quantities(option, c0, c1, damping):
  """``(vals, vecs, p)`` of one side: ψ, L (options 1 and kron_indep) or
  μ, K, P (option 2) from ``C₀``, ``C₁`` and the side's damping."""
  r = _inv_sqrt(c0, damping)
  if option == "series2":
    psi_hat = r @ c1 @ r
    e, s, _ = jnp.linalg.svd(psi_hat)
    mu = jnp.clip(s ** 2, 0, 1)
    return mu, r @ e, c1 @ r @ r
  if option == "kron_indep":
    c1 = jnp.zeros_like(c1)
  psi, u = jnp.linalg.eigh(_sym(r @ _sym(c1) @ r))
  return jnp.clip(psi, -1, 1), r @ u, jnp.zeros_like(c1)


@dataclasses.dataclass(frozen=True)
class SeriesDense(base.Block):
  """Series block of a dense layer used at every step of a scan.

  ``kernel_shape``, ``in_axes``, ``has_bias``: as ``KroneckerDense``.
  ``num_steps``: T, the scan's length (the inverse depends on it; data
  with another number of steps is refused). ``option``: ``"series1"``,
  ``"series2"`` or ``"kron_indep"`` (module docstring). ``time_axis``: the
  time axis among the data's shared axes (the axes between the example
  axis and the input dims); the other shared axes are independent
  sequences. Parameters: ``(kernel,)`` or ``(kernel, bias)``.
  """

  kernel_shape: tuple
  in_axes: tuple = (0,)
  has_bias: bool = False
  num_steps: int = 2
  option: str = "series2"
  time_axis: int = 0

  def __post_init__(self):
    object.__setattr__(self, "kernel_shape", tuple(self.kernel_shape))
    object.__setattr__(self, "in_axes", tuple(self.in_axes))
    if self.option not in OPTIONS:
      raise ValueError(f"SeriesDense: option must be one of {OPTIONS}, got "
                       f"{self.option!r}")
    if not (isinstance(self.num_steps, int) and self.num_steps >= 1):
      raise ValueError(f"SeriesDense: num_steps must be a positive int, got "
                       f"{self.num_steps!r}")
    if not (isinstance(self.time_axis, int) and self.time_axis >= 0):
      raise ValueError(f"SeriesDense: time_axis must be an int >= 0, got "
                       f"{self.time_axis!r}")
    self.layout  # Validates the axes.

  @property
  def layout(self):
    return _layout.DenseLayout(self.kernel_shape, self.in_axes, self.has_bias)

  @property
  def param_shapes(self):
    return self.layout.param_shapes

  @property
  def factor_shapes(self):
    a, b = self.layout.a, self.layout.b
    return (1, a, a), (1, a, a), (1, b, b), (1, b, b)

  @property
  def weight_sharing(self):
    """How the steps are combined (``describe``'s sharing column)."""
    return f"{self.option} (T={self.num_steps})"

  def init(self, dtype=jnp.float32) -> SeriesState:
    a, b = self.layout.a, self.layout.b
    mk = lambda n, cache: fac.init_factor(n, batch_shape=(1,), dtype=dtype,
                                          cache=cache)
    return SeriesState(a0=mk(a, "eigh"), a1=mk(a, "power"),
                       g0=mk(b, "eigh"), g1=mk(b, "power"))

  # ------------------------------------------------------------ statistics
  def _data(self, inputs, cotangents, weights):
    """``(ā [N, R, T, a], g [S, N, R, T, b], c, w)``."""
    where = repr(self)
    inputs = jnp.asarray(inputs)
    n_in = len(self.layout.in_dims)
    shared = inputs.ndim - 1 - n_in
    if shared <= self.time_axis:
      raise ValueError(
          f"{where}: inputs of shape {inputs.shape} have {max(shared, 0)} "
          f"axes between the example axis and the input dims "
          f"{self.layout.in_dims}; the time axis is shared axis "
          f"{self.time_axis} (a series block needs the layer's data with its "
          "scan's time axis, [N, T, *in_dims])")
    steps = inputs.shape[1 + self.time_axis]
    if steps != self.num_steps:
      raise ValueError(
          f"{where}: the data has {steps} time steps, the block was made for "
          f"num_steps={self.num_steps} (its inverse depends on T: make the "
          "block for this sequence length)")
    a, g, c, w = dense.dense_data(self.layout, inputs, cotangents, weights,
                                  where)
    # dense_data flattened the shared axes row-major: split out time.
    lead = inputs.shape[1:1 + self.time_axis]
    trail = inputs.shape[2 + self.time_axis:1 + shared]
    r1, r2 = math.prod(lead), math.prod(trail)
    n, s = a.shape[0], g.shape[0]
    a = a.reshape(n, r1, steps, r2, -1)
    g = g.reshape(s, n, r1, steps, r2, g.shape[-1])
    a = jnp.moveaxis(a, 2, 3).reshape(n, r1 * r2, steps, -1)
    g = jnp.moveaxis(g, 3, 4).reshape(s, n, r1 * r2, steps, g.shape[-1])
    return a, g, c, w

  def compute_stats(self, inputs, cotangents, weights=None):
    """Statistics from inputs ``[N, *shared, *in_dims]`` and cotangents
    ``[(S,) N, *shared, *out_dims]``, the shared axes holding the time
    axis (``time_axis``) of length ``num_steps``, in step order."""
    a, g, c, w = self._data(inputs, cotangents, weights)
    a0, a1 = lag_stats(a, w / a.shape[1])
    g0, g1 = lag_stats(g, c, num_samples=g.shape[0])
    return SeriesState(a0=a0[None], a1=a1[None], g0=g0[None], g1=g1[None])

  def update(self, state, stats, decay, weight=1.0):
    ok = fac.all_finite(stats)
    return SeriesState(*[fac.update_cov_if(f, x, decay, weight, ok)
                         for f, x in zip(state, stats)])

  # ---------------------------------------------------------------- refresh
  def _damping(self, state, damping):
    """π-adjusted damping of ``A₀`` and ``G₀`` at ``λ / T``."""
    lam = jnp.asarray(damping, state.a0.cov.dtype) / self.num_steps
    return _kron.pi_adjusted_damping(
        _kron.KroneckerState(state.a0, state.g0), lam, 1.0)

  def refresh(self, state, damping, exp=-1.0, step=0, method="auto"):
    """Caches the option's quantities (module docstring) of ``state`` at
    ``damping`` λ (π-adjusted at ``λ/T``), recording ``step``. ``exp``
    must be -1 (``NotImplementedError`` otherwise); ``method`` is not used
    (the inverse roots come from eigendecompositions)."""
    del method
    _check_precon_power(exp)
    da, dg = self._damping(state, damping)
    val = fac.factor_value
    qa = _option_quantities(self.option, val(state.a0), val(state.a1), da)
    qg = _option_quantities(self.option, val(state.g0), val(state.g1), dg)
    ok = fac.all_finite((qa, qg))

    def put(f0, f1, q):
      vals, vecs, p = q
      new0 = f0.cache._replace(eigvals=vals, eigvecs=vecs)
      new1 = f1.cache._replace(matpower=p)
      return _keep(f0, new0, ok, step), _keep(f1, new1, ok, step)

    a0, a1 = put(state.a0, state.a1, qa)
    g0, g1 = put(state.g0, state.g1, qg)
    return SeriesState(a0, a1, g0, g1)

  # -------------------------------------------------------------- products
  def multiply_inverse(self, state, v, damping, use_cache=False):
    """``(F + λI)⁻¹ v`` under the option, ``v`` a tuple shaped like
    ``param_shapes``: with ``use_cache`` from the quantities the last
    ``refresh`` cached (at its damping; ``damping`` is then not used),
    else computed now at ``damping``."""
    _layout.check_params(self, v, self.param_shapes)
    if not use_cache:
      state = self.refresh(state, damping)
    dtypes = [jnp.asarray(x).dtype for x in v]
    m = self.layout.to_mat(tuple(v))
    dtype = float_dtype(m)
    c = jax.tree.map(lambda x: x.astype(dtype),
                     (state.a0.cache, state.a1.cache, state.g0.cache,
                      state.g1.cache))
    out = self._inverse(m.astype(dtype), *c)
    return tuple(x.astype(d) for x, d in zip(self.layout.from_mat(out), dtypes))

  def _inverse(self, v, a0, a1, g0, g1):
    if self.option != "series2":
      la, lg = a0.eigvecs, g0.eigvecs
      x = a0.eigvals[..., :, None] * g0.eigvals[..., None, :]
      z = gamma(x, self.num_steps) * (_t(la) @ v @ lg)
      return la @ z @ _t(lg)
    ka, kg, pa, pg = a0.eigvecs, g0.eigvecs, a1.matpower, g1.matpower
    z = _t(ka) @ (v - pa @ v @ _t(pg)) @ kg
    gap = 1 - a0.eigvals[..., :, None] * g0.eigvals[..., None, :]
    z = z / jnp.where(gap == 0, 1, gap)
    y = ka @ z @ _t(kg)
    return (y - _t(pa) @ y @ pg) / self.num_steps

  def multiply_matpower(self, state, v, damping, exp, use_cache=False):
    _check_precon_power(exp)
    return self.multiply_inverse(state, v, damping, use_cache)

  def multiply(self, state, v):
    raise NotImplementedError(_ONLY_INVERSE.format(self=self, what="multiply"))

  def multiply_cholesky(self, state, v, damping, transpose=False):
    raise NotImplementedError(
        _ONLY_INVERSE.format(self=self, what="multiply_cholesky"))

  def multiply_cholesky_inverse(self, state, v, damping, transpose=False):
    raise NotImplementedError(
        _ONLY_INVERSE.format(self=self, what="multiply_cholesky_inverse"))

  def to_dense(self, state):
    raise NotImplementedError(_ONLY_INVERSE.format(self=self, what="to_dense"))


_ONLY_INVERSE = ("{self!r}: a series block provides only the inverse "
                 "(multiply_inverse, precon_power=-1), as TensorFlow K-FAC's "
                 "FullyConnectedSeriesFB did; {what} is not available")


def _check_precon_power(precon_power):
  if not (isinstance(precon_power, (int, float, np.floating))
          and float(precon_power) == -1.0):
    raise NotImplementedError(
        f"series blocks provide only the inverse (power -1, "
        f"precon_power=-1.0), got power {precon_power!r}")


def _keep(f, new, ok, step):
  """``f`` with cache ``new`` where ``ok``, else its old cache, one more
  ``num_failed``."""
  old = f.cache
  keep = lambda n, o: jnp.where(ok, n, o)
  return f._replace(cache=old._replace(
      eigvals=keep(new.eigvals, old.eigvals),
      eigvecs=keep(new.eigvecs, old.eigvecs),
      matpower=keep(new.matpower, old.matpower),
      step=jnp.where(ok, jnp.asarray(step, jnp.int32), old.step),
      num_failed=old.num_failed + jnp.where(ok, 0, 1).astype(jnp.int32)))


def series_block(block, option, num_steps, time_axis=0, where="series"):
  """The ``option`` block of the layer a ``KroneckerDense`` covers:
  ``SeriesDense`` for ``"series1"``/``"series2"``, and for
  ``"kron_indep"`` the ``KroneckerDense`` itself under ``"expand"`` (the
  same matrix, with every power and product). ``ValueError`` for other
  blocks."""
  if not isinstance(block, dense.KroneckerDense):
    raise ValueError(f"{where}: {option!r} is for dense layers (whose "
                     f"default block is KroneckerDense), not "
                     f"{type(block).__name__}")
  if option not in OPTIONS:
    raise ValueError(f"{where}: option must be one of {OPTIONS}, got "
                     f"{option!r}")
  if option == "kron_indep":
    return dataclasses.replace(block, weight_sharing="expand")
  return SeriesDense(block.kernel_shape, block.in_axes, block.has_bias,
                     num_steps=num_steps, option=option, time_axis=time_axis)
