"""Eigenvalue-corrected K-FAC (EKFAC, George et al. 2018) for dense and conv layers.

K-FAC's ``A ⊗ G = (Q_A ⊗ Q_G)(Λ_A ⊗ Λ_G)(Q_A ⊗ Q_G)ᵀ`` keeps the Kronecker
eigenbasis but its eigenvalues ``λ_A,i λ_G,j`` are only right when the
Kronecker assumption is. EKFAC keeps the basis and re-estimates the
eigenvalues: per feature group,

    F ≈ (Q_A ⊗ Q_G) diag(s) (Q_A ⊗ Q_G)ᵀ,
    s_ij = Σ_n c_n E[(Q_Aᵀ ∇_W ℓ_n Q_G)_ij²],

the second moment of the per-example gradients projected into the basis,
which is the diagonal of the exact curvature ``Σ_n c_n E[∇ℓ_n ∇ℓ_nᵀ]`` in
that basis (the Frobenius-closest matrix of this form to it). The gradient
of example ``n`` is ``∇_W ℓ_n = Σ_r ā_nr g_nrᵀ`` (``ā`` the layer input
with a 1 for the bias, ``g`` the output cotangent, ``r`` the R positions
of a shared layer or the T locations of a convolution), so its projection
is ``Σ_r (Q_Aᵀ ā_nr)(Q_Gᵀ g_nr)ᵀ``; with R = 1 the squares are formed
from the projected ``ā`` and ``g`` alone, without any per-example gradient
(``N·(a + b)`` floats, then an ``a × b`` product), otherwise from the
projected per-example gradients (``S·N·a·b`` floats). ``c_n`` and the mean
over the S sampled cotangents are those of the other blocks
(``blocks.base``); ``A`` and ``G`` are the Kronecker block's (its
``weight_sharing``, ``"expand"`` or ``"reduce"``, for dense and conv alike;
the scalings are the exact per-example second moments either way).

Damping is added to the corrected eigenvalues: ``(F + λI)^p = (Q_A ⊗ Q_G)
diag((s + λ)^p) (Q_A ⊗ Q_G)ᵀ`` exactly, for any power.

State (``EkfacState``): the factors ``A`` and ``G`` with eigendecomposition
caches (the basis ``Q_A``, ``Q_G`` of the last refresh), and ``scale``, a
diagonal factor ``[groups, a, b]`` whose cache ``eigvals`` holds the
corrected eigenvalues ``s`` *in the current basis* — what every product
uses. Its running average is kept there so that a refresh changes caches
only (as every block's refresh does: under ``axis_name`` the transform
shares refreshed caches between devices, not statistics):

* ``update`` — the zero-debiased EMA of the factors, and for ``s`` the
  same EMA started from the current ``s`` with the running weight ``W``:
  ``s ← (decay·W·s + (1−decay)·w·X) / (decay·W + (1−decay)·w)``, ``X`` the
  fresh projected second moments (``scale.cov`` = ``s·W`` afterwards).
* ``refresh`` — new eigenbases of the current ``A`` and ``G``. The running
  ``s`` was measured in the old basis; it is carried into the new one
  (``rebase="project"``, the default) as the diagonal there of the old
  EKFAC matrix, ``s' = (R_A∘R_A)ᵀ s (R_G∘R_G)`` with ``R = Q_oldᵀ Q_new``,
  so that the measured correction survives the refresh (a refresh whose
  basis does not move leaves ``F`` unchanged) and fresh statistics keep
  re-estimating it; or (``rebase="kfac"``, the paper's reference code)
  restarted at K-FAC's eigenvalues ``λ_A,i λ_G,j`` of the new basis, which
  the running average then corrects. ``damping``, ``exp`` and ``method``
  are not used (nothing is inverted: powers of ``s + λ`` are elementwise).
* Before the first refresh there is no basis: the block reads as zero and
  its scalings' statistics are zero (they are still counted in ``W``);
  the first refresh starts ``s`` at K-FAC's eigenvalues of its basis
  (``λ_A,i λ_G,j``: EKFAC starts as K-FAC with exact damping), which the
  statistics of later steps correct.

Statistics depend on the state (the basis they are measured in):
``layer_stats(data, state)`` / ``compute_stats(..., state=state)`` need the
state they will be ``update``-d into, as ``kfl.kfac`` passes it.
``use_cache`` is accepted and changes nothing: ``F`` is always defined by
the cached basis and the current ``s``.

References:
  George, T., Laurent, C., Bouthillier, X., Ballas, N. and Vincent, P.
    (2018). Fast approximate natural gradient descent in a Kronecker-factored
    eigenbasis. NeurIPS. arXiv:1806.03884.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar, Generic, NamedTuple

import jax
import jax.numpy as jnp
from jax.scipy.linalg import block_diag

from kfac_jax_lite.blocks import _kron
from kfac_jax_lite.factor import float_dtype
from kfac_jax_lite import factor as fac
from kfac_jax_lite.blocks import _layout
from kfac_jax_lite.blocks import base
from kfac_jax_lite.blocks import conv
from kfac_jax_lite.blocks import dense

REBASES = ("project", "kfac")


class EkfacState(NamedTuple, Generic[_kron.Leaf]):
  """State (and statistics) of an EKFAC block; see the module docstring.

  As statistics: ``a [g, a, a]``, ``g [g, b, b]``, ``scale [g, a, b]``.
  """

  # fac.FactorState leaves in a state, arrays in statistics.
  a: _kron.Leaf  # A, "eigh" cache: λ_A, Q_A of the last refresh.
  g: _kron.Leaf  # G, "eigh" cache: λ_G, Q_G of the last refresh.
  scale: _kron.Leaf  # Diagonal [g, a, b]; cache.eigvals: s, current basis.


def has_basis(state: EkfacState):
  """Whether both factors have an eigenbasis (a refresh succeeded)."""
  return (state.a.cache.step >= 0) & (state.g.cache.step >= 0)


def projected_second_moments(a, g, c, qa, qg):
  """``s [G, a, b]``: ``Σ_n c_n mean_s (Q_Aᵀ (Σ_r ā_nr g_snrᵀ) Q_G)²``.

  ``a [N, R, G, a]``, ``g [S, N, R, G, b]``, ``c [N]``, ``qa [G, a, a]``,
  ``qg [G, b, b]``.
  """
  pa = jnp.einsum("nrki,kij->nrkj", a, qa)  # rows of Q_Aᵀ ā
  pg = jnp.einsum("snrki,kij->snrkj", g, qg)  # rows of Q_Gᵀ g
  if a.shape[1] == 1:  # (Q_Aᵀ ā)² (Q_Gᵀ g)²ᵀ: no per-example gradient.
    out = jnp.einsum("nki,snkj->kij", pa[:, 0] ** 2 * c[:, None, None],
                     pg[:, :, 0] ** 2)
  else:
    per_example = jnp.einsum("nrki,snrkj->snkij", pa, pg)
    out = jnp.einsum("n,snkij->kij", c, per_example ** 2)
  return out / g.shape[0]


def _project(s, qa_old, qa_new, qg_old, qg_new):
  """The diagonal in the new basis of ``(Q_A ⊗ Q_G) diag(s) (...)ᵀ``."""
  ra = jnp.swapaxes(qa_old, -1, -2) @ qa_new
  rg = jnp.swapaxes(qg_old, -1, -2) @ qg_new
  return jnp.swapaxes(ra ** 2, -1, -2) @ s @ rg ** 2


class EigenCorrected(base.Block):
  """The EKFAC block of a layer's ``[groups, a, b]`` layout (see the module
  docstring). Subclasses provide ``layout``, ``rebase`` and
  ``_data(inputs, cotangents, weights)`` returning ``(ā [N, R, G, a],
  g [S, N, R, G, b], c, w)``, and ``weight_sharing`` for ``A`` and ``G``."""

  damping_mode: ClassVar[str] = "exact"  # λ is added to the eigenvalues s.
  stats_use_state: ClassVar[bool] = True  # Scalings in the current basis.
  # Provided by each subclass (dataclass fields or properties).
  layout: _layout.Layout
  rebase: str
  weight_sharing: str

  @abc.abstractmethod
  def _data(self, inputs, cotangents, weights) -> tuple:
    """``(ā [N, R, G, a], g [S, N, R, G, b], c, w)`` of the layer."""

  @property
  def param_shapes(self):
    return self.layout.param_shapes

  @property
  def factor_shapes(self):
    lay, g = self.layout, self.layout.groups
    return (g, lay.a, lay.a), (g, lay.b, lay.b), (g, lay.a, lay.b)

  def check_rebase(self):
    if self.rebase not in REBASES:
      raise ValueError(f"{type(self).__name__}: rebase must be one of "
                       f"{REBASES}, got {self.rebase!r}")

  def init(self, dtype=jnp.float32) -> EkfacState:
    lay = self.layout
    return EkfacState(
        a=fac.init_factor(lay.a, batch_shape=(lay.groups,), dtype=dtype,
                          cache="eigh"),
        g=fac.init_factor(lay.b, batch_shape=(lay.groups,), dtype=dtype,
                          cache="eigh"),
        scale=fac.init_factor(lay.b, diagonal=True, dtype=dtype, cache="eigh",
                              batch_shape=(lay.groups, lay.a)))

  # ------------------------------------------------------------ statistics
  def layer_stats(self, data: base.LayerData, state=None):
    return self.compute_stats(data.inputs, data.cotangents,
                              weights=data.weights, state=state)

  def compute_stats(self, inputs, cotangents, weights=None, state=None):
    """``EkfacState``-shaped statistics from the layer's inputs and output
    cotangents (as the Kronecker block of the layer takes them) and the
    block's current ``state``, whose basis the scalings are measured in
    (zero before its first refresh)."""
    if state is None:
      raise ValueError(
          f"{self!r}: EKFAC statistics are measured in the block's current "
          "eigenbasis, so they need its state: layer_stats(data, state) (or "
          "kfl.value_grad_and_stats(...)(params, batch, key, states=...) with "
          "the K-FAC state's blocks)")
    a, g, c, w = self._data(inputs, cotangents, weights)
    mode = self.weight_sharing
    big_a = jax.vmap(lambda x: dense.input_stats(x, w, mode), in_axes=2)(a)
    big_g = jax.vmap(lambda y: dense.output_stats(y, c, mode), in_axes=3)(g)
    qa = state.a.cache.eigvecs.astype(a.dtype)
    qg = state.g.cache.eigvecs.astype(a.dtype)
    scale = projected_second_moments(a, g, c, qa, qg)
    scale = jnp.where(has_basis(state), scale, jnp.zeros_like(scale))
    return EkfacState(a=big_a, g=big_g, scale=scale)

  def update(self, state, stats, decay, weight=1.0):
    ok = fac.all_finite(stats) & jnp.isfinite(jnp.asarray(weight))
    sc = state.scale
    # The EMA of s continues from the current s (it may have been carried
    # into a new basis by a refresh since the last update).
    rebased = fac.update_cov_if(
        sc._replace(cov=sc.cache.eigvals * sc.weight), stats.scale, decay,
        weight, ok)
    scale = rebased._replace(
        cov=jnp.where(ok, rebased.cov, sc.cov),
        cache=sc.cache._replace(eigvals=jnp.where(
            ok, fac.factor_value(rebased), sc.cache.eigvals)))
    return EkfacState(
        a=fac.update_cov_if(state.a, stats.a, decay, weight, ok),
        g=fac.update_cov_if(state.g, stats.g, decay, weight, ok),
        scale=scale)

  def refresh(self, state, damping=None, exp=-1.0, step=0, method="auto"):
    del damping, exp, method  # Only eigenbases are computed.
    a = fac.refresh_cache(state.a, step)
    g = fac.refresh_cache(state.g, step)
    new = EkfacState(a, g, state.scale)
    kfac = a.cache.eigvals[..., :, None] * g.cache.eigvals[..., None, :]
    s = state.scale.cache.eigvals
    if self.rebase == "project":
      moved = _project(s, state.a.cache.eigvecs, a.cache.eigvecs,
                       state.g.cache.eigvecs, g.cache.eigvecs)
    else:
      moved = kfac
    s = jnp.where(has_basis(state), moved, jnp.where(has_basis(new), kfac, s))
    cache = state.scale.cache._replace(
        eigvals=s, step=jnp.where(has_basis(new), jnp.asarray(step, jnp.int32),
                                  state.scale.cache.step))
    return new._replace(scale=state.scale._replace(cache=cache))

  # -------------------------------------------------------------- products
  def _products(self, state, v, fn):
    """``fn(Qᵀ V, s)`` in the eigenbasis, mapped back with ``to_basis``."""
    _layout.check_params(self, v, self.param_shapes)
    dtypes = [jnp.asarray(x).dtype for x in v]
    m = self.layout.to_mat(tuple(v))
    dtype = float_dtype(m)
    qa = state.a.cache.eigvecs.astype(dtype)
    qg = state.g.cache.eigvecs.astype(dtype)
    s = state.scale.cache.eigvals.astype(dtype)
    out = fn(m.astype(dtype), qa, qg, s)
    return tuple(x.astype(d) for x, d in zip(self.layout.from_mat(out), dtypes))

  def multiply(self, state, v):
    return self._products(state, v, lambda m, qa, qg, s: _from_basis(
        s * _to_basis(m, qa, qg), qa, qg))

  def multiply_matpower(self, state, v, damping, exp, use_cache=False):
    del use_cache  # F is always the cached basis with the current s.
    return self._products(state, v, lambda m, qa, qg, s: _from_basis(
        _damped(s, damping) ** exp * _to_basis(m, qa, qg), qa, qg))

  def multiply_inverse(self, state, v, damping, use_cache=False):
    return self.multiply_matpower(state, v, damping, -1.0, use_cache)

  def multiply_cholesky(self, state, v, damping, transpose=False):
    """``L = (Q_A ⊗ Q_G) diag(√(s + λ))``: ``L v`` or ``Lᵀ v``."""
    def fn(m, qa, qg, s):
      root = jnp.sqrt(_damped(s, damping))
      if transpose:
        return root * _to_basis(m, qa, qg)
      return _from_basis(root * m, qa, qg)
    return self._products(state, v, fn)

  def multiply_cholesky_inverse(self, state, v, damping, transpose=False):
    """``L⁻¹ v = diag(1/√(s + λ)) Qᵀ v`` or ``L⁻ᵀ v = Q (v / √(s + λ))``."""
    def fn(m, qa, qg, s):
      root = jnp.sqrt(_damped(s, damping))
      if transpose:
        return _from_basis(m / root, qa, qg)
      return _to_basis(m, qa, qg) / root
    return self._products(state, v, fn)

  def to_dense(self, state):
    qa, qg = state.a.cache.eigvecs, state.g.cache.eigvecs
    s = state.scale.cache.eigvals
    per_group = []
    for k in range(s.shape[0]):
      q = jnp.kron(qa[k], qg[k])
      per_group.append((q * s[k].ravel()) @ q.T)
    canon = block_diag(*per_group)
    idx = self.layout.to_mat(_layout.param_index(self.param_shapes)).ravel()
    return jnp.zeros_like(canon).at[idx[:, None], idx[None, :]].set(canon)


def _to_basis(m, qa, qg):
  """``Q_Aᵀ V Q_G`` per group: ``(Q_A ⊗ Q_G)ᵀ vec(V)``."""
  return jnp.swapaxes(qa, -1, -2) @ m @ qg


def _from_basis(m, qa, qg):
  return qa @ m @ jnp.swapaxes(qg, -1, -2)


def _damped(s, damping):
  return s + jnp.asarray(damping, s.dtype)


@dataclasses.dataclass(frozen=True)
class EkfacDense(EigenCorrected):
  """EKFAC block of a dense layer (arguments as ``KroneckerDense``; the
  damping is always exact). ``rebase``: ``"project"`` or ``"kfac"``."""

  kernel_shape: tuple
  in_axes: tuple = (0,)
  has_bias: bool = False
  weight_sharing: str = "expand"
  rebase: str = "project"

  def __post_init__(self):
    object.__setattr__(self, "kernel_shape", tuple(self.kernel_shape))
    object.__setattr__(self, "in_axes", tuple(self.in_axes))
    dense.check_weight_sharing(self.weight_sharing, type(self).__name__)
    self.check_rebase()
    self.layout  # Validates the axes.

  @property
  def layout(self):
    return _layout.DenseLayout(self.kernel_shape, self.in_axes, self.has_bias)

  def _data(self, inputs, cotangents, weights):
    a, g, c, w = dense.dense_data(self.layout, inputs, cotangents, weights,
                                  repr(self))
    return a[:, :, None], g[:, :, :, None], c, w


@dataclasses.dataclass(frozen=True)
class EkfacConv(conv.ConvConfig, EigenCorrected):
  """EKFAC block of a convolution (arguments as ``KroneckerConv``; one
  basis and one set of scalings per feature group)."""

  rebase: str = "project"
  weight_sharing: str = "expand"

  def __post_init__(self):
    self._setup()
    self.check_rebase()
    dense.check_weight_sharing(self.weight_sharing, type(self).__name__)

  def _data(self, inputs, cotangents, weights):
    return conv.conv_data(self, inputs, cotangents, weights)


def eigen_corrected(block, where="ekfac"):
  """The EKFAC block of the layer a ``KroneckerDense`` or ``KroneckerConv``
  covers (the ``"ekfac"`` block choice); ``ValueError`` for other blocks."""
  if isinstance(block, dense.KroneckerDense):
    return EkfacDense(block.kernel_shape, block.in_axes, block.has_bias,
                      weight_sharing=block.weight_sharing)
  if isinstance(block, conv.KroneckerConv):
    return EkfacConv(**{f.name: getattr(block, f.name)
                        for f in dataclasses.fields(conv.ConvConfig)},
                     weight_sharing=block.weight_sharing)
  raise ValueError(f"{where}: 'ekfac' is for dense and conv layers (whose "
                   f"default block is KroneckerDense or KroneckerConv), not "
                   f"{type(block).__name__}")
