"""Rank-one Kronecker-vector blocks of dense and conv layers (Eva; Zhang et al. 2023).

Where K-FAC keeps the second moments ``A`` and ``G`` of a layer's inputs
and output cotangents, this block keeps their first moments, one vector
each, and approximates the layer's curvature by one rank-one matrix:

    ā = Σ_i w_i (1/R) Σ_r ā_ir               (ā_ir = [x_ir, 1] with a bias)
    ḡ = (1/S) Σ_s Σ_i c_i Σ_r g_sir / √(Σ_i c_i)
    F ≈ v vᵀ,   v = ā ⊗ ḡ                     (so F = (ā āᵀ) ⊗ (ḡ ḡᵀ))

(``L = Σ_i c_i ℓ_i``, ``w_i = c_i / Σ_j c_j``, ``g_sir = ∂ℓ_i/∂y_ir`` for
the S sampled targets, R the positions an example applies the layer at.)
A convolution is a dense layer on its patches shared over its output
locations (R = the locations, one such block per feature group), as in
KFC. For one example at one position ``v vᵀ`` is that example's outer product
of gradients, the empirical Fisher: the block's scale is K-FAC's. When
every example has the same input, ``v = ∇_W L / √(Σc)``. The cotangents
are averaged before the outer product, so the vectors are meant for the
data targets (``estimation="empirical"`` / ``"empirical_shared"``): with
sampled targets ``ḡ`` averages draws of zero mean and the block tends to
damped gradient descent.

Damping is exact, by Sherman–Morrison and its generalisation to any power
(``P = v vᵀ / |v|²``, ``s = |v|² = |ā|² |ḡ|²``):

    (F + λI)^p = λ^p (I − P) + (λ + s)^p P

so ``(F + λI)⁻¹ ∇ = (∇ − (āᵀ ∇ ḡ) / (λ + s) · ā ḡᵀ) / λ`` in the kernel's
``[a, b]`` matrix form: ``O(a·b)`` per product, ``O(a + b)`` memory, no
factorisation. The state holds the two vectors as diagonal-shaped
``FactorState``s (their zero-debiased EMAs); a refresh copies them into
the caches (``FactorCache.matpower``, ``[groups, n]``) and the cached
products read them from there, so that a sharded refresh's gathered
caches are all a device needs. The damping and power are applied at
product time. The square-root factor of ``multiply_cholesky`` is the
symmetric root ``(F + λI)^{1/2}`` (``transpose`` changes nothing).

Off the vector the preconditioned gradient is ``∇/λ``, so where the KL
clip binds the damping sets the step's length (about
``lr·√(norm_constraint/λ)`` along ``∇/|∇|`` there):
use Eva's ``damping=0.03``. On standardised digits (a Flax MLP and CNN,
the one-pass loop, 300 steps, lr 0.003-0.03, batch 32 and 128) all 12
runs at 0.03 trained with ``kfl.health`` ok, while at the library's
default 1e-3 six of the twelve (lr 0.01 and 0.03) ended at 0.68-12.8 from
2.44, each flagged by ``kfl.health``.

Chosen with ``kfl.kfac(..., blocks={"dense": "kronecker_vector",
"conv": "kronecker_vector"}, damping=0.03)``.
Measured on the MNIST autoencoder, the conv net and the char LM of
``benchmarks/`` (``docs/results.md``): the cheapest curvature step
(1.05-1.46x Adam's), but slower to Adam's loss than Adam and than K-FAC's
own blocks on all three.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
from jax.scipy.linalg import block_diag

from kfac_jax_lite import factor as fac
from kfac_jax_lite.blocks import _kron
from kfac_jax_lite.blocks import _layout
from kfac_jax_lite.blocks import base
from kfac_jax_lite.blocks import conv
from kfac_jax_lite.blocks import dense


def vector_stats(a, g, c, w):
  """``KroneckerState(a=ā [k, a], g=ḡ [k, b])`` (k groups) from
  ``a [N, R, k, a]``, ``g [S, N, R, k, b]``, ``c [N]``, ``w [N]``."""
  a_bar = jnp.einsum("n,nrki->ki", w, a) / a.shape[1]
  total = jnp.sum(c)
  root = jnp.sqrt(jnp.where(total > 0, total, 1))
  g_bar = jnp.einsum("n,snrkj->kj", c, g) / (g.shape[0] * root)
  return _kron.KroneckerState(a=a_bar, g=g_bar)


def _power_scale(s, lam, exp):
  """``((λ + s)^p − λ^p) / s`` per group (0 where ``s = 0``), as
  ``λ^p · expm1(p · log1p(s/λ)) / s``: no cancellation when ``s ≪ λ``."""
  safe = jnp.where(s > 0, s, 1)
  out = lam ** exp * jnp.expm1(exp * jnp.log1p(safe / lam)) / safe
  return jnp.where(s > 0, out, 0)


class KroneckerVectorBlock(base.Block):
  """What the Kronecker-vector blocks share: the state, the refresh and
  the products, over the layout's ``[groups, a, b]`` view. Subclasses give
  ``layout``, ``decay`` and ``compute_stats``."""

  symmetric_stats: ClassVar[bool] = False  # Vectors, not covariances.
  layout: _layout.Layout  # Provided by each subclass (a property).
  decay: float | None

  def _check_decay(self):
    if self.decay is not None and not 0 <= self.decay < 1:
      raise ValueError(f"{type(self).__name__}: decay must be in [0, 1) or "
                       f"None, got {self.decay}")

  @property
  def param_shapes(self):
    return self.layout.param_shapes

  @property
  def factor_shapes(self):
    """The two vectors ``ā`` and ``ḡ`` (leading axis: groups)."""
    lay = self.layout
    return (lay.groups, lay.a), (lay.groups, lay.b)

  def init(self, dtype=jnp.float32) -> _kron.KroneckerState:
    lay = self.layout
    vec = lambda n: fac.init_factor(n, diagonal=True, batch_shape=(lay.groups,),
                                    dtype=dtype, cache="power")
    return _kron.KroneckerState(a=vec(lay.a), g=vec(lay.b))

  def update(self, state, stats, decay, weight=1.0):
    decay = decay if self.decay is None else self.decay
    ok = fac.all_finite(stats)
    return _kron.KroneckerState(
        a=fac.update_cov_if(state.a, stats.a, decay, weight, ok),
        g=fac.update_cov_if(state.g, stats.g, decay, weight, ok))

  def refresh(self, state, damping, exp=-1.0, step=0, method="auto"):
    """The current vectors into the caches (nothing to factorise:
    ``damping``, ``exp`` and ``method`` are applied, or unused, at product
    time); non-finite vectors keep the last cache and count as failed."""
    del damping, exp, method
    values = (fac.factor_value(state.a), fac.factor_value(state.g))
    ok = fac.all_finite(values)

    def snap(f, value):
      old = f.cache
      return f._replace(cache=old._replace(
          matpower=jnp.where(ok, value, old.matpower),
          step=jnp.where(ok, jnp.asarray(step, jnp.int32), old.step),
          num_failed=old.num_failed + jnp.where(ok, 0, 1).astype(jnp.int32)))

    return _kron.KroneckerState(snap(state.a, values[0]),
                                snap(state.g, values[1]))

  # ---------------------------------------------------------------- products
  def _vectors(self, state, use_cache):
    if use_cache:
      return state.a.cache.matpower, state.g.cache.matpower
    return fac.factor_value(state.a), fac.factor_value(state.g)

  def _apply(self, state, v, fn, use_cache=False):
    """``fn(ā [g, a], ḡ [g, b], V [g, a, b])`` on the parameters ``v``."""
    def on_matrix(m):
      a, g = (x.astype(m.dtype) for x in self._vectors(state, use_cache))
      return fn(a, g, m)
    return base.on_layout_matrix(self, v, on_matrix)

  def multiply(self, state, v):
    """``F v = (vᵀ x) v``: ``(āᵀ V ḡ) ā ḡᵀ`` per group."""
    def fn(a, g, m):
      proj = jnp.einsum("ga,gab,gb->g", a, m, g)
      return proj[:, None, None] * a[:, :, None] * g[:, None, :]
    return self._apply(state, v, fn)

  def multiply_matpower(self, state, v, damping, exp, use_cache=False):
    """``(F + λI)^p v = λ^p V + ((λ + s)^p − λ^p)/s · (āᵀ V ḡ) ā ḡᵀ``."""
    def fn(a, g, m):
      lam = jnp.asarray(damping, m.dtype)
      s = jnp.sum(a * a, -1) * jnp.sum(g * g, -1)
      proj = jnp.einsum("ga,gab,gb->g", a, m, g)
      coef = _power_scale(s, lam, exp) * proj
      return lam ** exp * m + coef[:, None, None] * a[:, :, None] * g[:, None, :]
    return self._apply(state, v, fn, use_cache)

  def multiply_inverse(self, state, v, damping, use_cache=False):
    return self.multiply_matpower(state, v, damping, -1.0, use_cache)

  def multiply_cholesky(self, state, v, damping, transpose=False):
    """``L v`` with the symmetric root ``L = (F + λI)^{1/2}`` (= ``Lᵀ``)."""
    del transpose
    return self.multiply_matpower(state, v, damping, 0.5)

  def multiply_cholesky_inverse(self, state, v, damping, transpose=False):
    """``L⁻¹ v = (F + λI)^{-1/2} v`` (= ``L⁻ᵀ v``)."""
    del transpose
    return self.multiply_matpower(state, v, damping, -0.5)

  def to_dense(self, state):
    a, g = self._vectors(state, False)
    kron = (a[:, :, None] * g[:, None, :]).reshape(a.shape[0], -1)
    return base.from_canonical(
        self, block_diag(*[jnp.outer(k, k) for k in kron]))


@dataclasses.dataclass(frozen=True)
class KroneckerVectorDense(KroneckerVectorBlock):
  """Rank-one Kronecker-vector block of a dense layer; see the module
  docstring.

  ``kernel_shape``, ``in_axes``, ``has_bias``: the layer (as
  ``KroneckerDense``). ``decay``: the EMA decay of the two vectors (Eva's
  code weighs the newest vectors 0.95: ``decay=0.05``); None uses the one
  the optimizer passes (``kfl.kfac``'s ``cov_decay``).
  """

  kernel_shape: tuple
  in_axes: tuple = (0,)
  has_bias: bool = False
  decay: float | None = None

  def __post_init__(self):
    object.__setattr__(self, "kernel_shape", tuple(self.kernel_shape))
    object.__setattr__(self, "in_axes", tuple(self.in_axes))
    self._check_decay()
    self.layout  # Validates the axes.

  @classmethod
  def like(cls, block, **options):
    """The Kronecker-vector block of the layer of a ``KroneckerDense``
    ``block`` (``options``: ``decay``)."""
    return cls(block.kernel_shape, block.in_axes, block.has_bias, **options)

  @property
  def layout(self):
    return _layout.DenseLayout(self.kernel_shape, self.in_axes, self.has_bias)

  def compute_stats(self, inputs, cotangents, weights=None):
    """``ā [1, a]`` and ``ḡ [1, b]`` from the arguments of
    ``KroneckerDense.compute_stats``."""
    a, g, c, w = dense.dense_data(self.layout, inputs, cotangents, weights,
                                  repr(self))
    return vector_stats(a[:, :, None], g[:, :, :, None], c, w)


@dataclasses.dataclass(frozen=True)
class KroneckerVectorConv(conv.ConvConfig, KroneckerVectorBlock):
  """Rank-one Kronecker-vector block of a convolution (arguments as
  ``KroneckerConv``; ``decay`` as ``KroneckerVectorDense``): per feature
  group, ``ā`` the mean patch over examples and locations, ``ḡ`` the
  cotangents summed over locations."""

  decay: float | None = None

  def __post_init__(self):
    self._setup()
    self._check_decay()

  def compute_stats(self, inputs, cotangents, weights=None):
    """``ā [groups, a]`` and ``ḡ [groups, b]`` from the arguments of
    ``KroneckerConv.compute_stats``."""
    return vector_stats(*conv.conv_data(self, inputs, cotangents, weights))
