"""Kronecker-factored products, shared by every Kronecker block.

A Kronecker block approximates its curvature as ``F = c · (A ⊗ G)`` with an
input factor ``A`` (size ``a``), an output factor ``G`` (size ``b``) and a
static renormalisation coefficient ``c``. Parameters are laid out as
matrices ``V`` of shape ``[groups, a, b]`` (one Kronecker product per group;
row-major vec), so that ``(A ⊗ G) vec(V) = vec(A V G)``.

Damping ``λ`` of ``F + λI`` comes in two modes:

* ``"pi"`` — factored Tikhonov (Martens & Grosse 2015, §6.3):
  ``F + λI ≈ c (A + π√(λ/c) I) ⊗ (G + √(λ/c)/π I)`` with
  ``π = sqrt((tr A / a) / (tr G / b))``.
* ``"exact"`` — ``(F + λI)^p`` exactly, from ``A = Q_A Λ_A Q_Aᵀ`` and
  ``G = Q_G Λ_G Q_Gᵀ``: ``(Q_A ⊗ Q_G) (c Λ_A ⊗ Λ_G + λ)^p (Q_A ⊗ Q_G)ᵀ``.

Either factor may be diagonal (the embedding block's input factor is).
"""
from __future__ import annotations

from typing import Generic, NamedTuple, TypeVar

import jax.numpy as jnp
from jax.scipy.linalg import block_diag

from kfac_jax_lite import factor as fac

DAMPING_MODES = ("pi", "exact")


# A block state's leaves: ``fac.FactorState`` in a state, ``jax.Array`` in
# statistics (the same pytree structure with the new covariances as leaves).
Leaf = TypeVar("Leaf")


class KroneckerState(NamedTuple, Generic[Leaf]):
  """State of a Kronecker block: input factor ``a`` and output factor ``g``
  (as statistics: the arrays ``A`` and ``G``)."""

  a: Leaf
  g: Leaf


def check_damping_mode(mode: str, where: str):
  if mode not in DAMPING_MODES:
    raise ValueError(f"{where}: damping_mode must be one of {DAMPING_MODES}, "
                     f"got {mode!r}")


def _t(x):
  return jnp.swapaxes(x, -1, -2)


def left(m, v, diagonal):
  """``m @ v`` for a factor matrix (or diagonal) ``m`` [g, a(, a)], v [g, a, b]."""
  return m[..., :, None] * v if diagonal else m @ v


def right(v, m, diagonal):
  """``v @ m`` for a factor matrix (or diagonal) ``m`` [g, b(, b)]."""
  return v * m[..., None, :] if diagonal else v @ m


def _mean_trace(state: fac.FactorState):
  c = fac.factor_value(state)
  diag = c if fac.is_diagonal(state) else jnp.diagonal(c, axis1=-2, axis2=-1)
  return jnp.mean(diag, axis=-1)


def pi_adjusted_damping(s: KroneckerState, damping, renorm_coeff):
  """Per-factor damping ``(π√(λ/c), √(λ/c)/π)`` of the π-adjusted scheme.

  ``π`` falls back to 1 where a trace is zero or not finite.
  """
  ta, tg = _mean_trace(s.a), _mean_trace(s.g)
  ratio = ta / jnp.where(tg > 0, tg, 1)
  good = (ta > 0) & (tg > 0) & jnp.isfinite(ratio)
  pi = jnp.sqrt(jnp.where(good, ratio, 1))
  root = jnp.sqrt(jnp.asarray(damping, pi.dtype) / renorm_coeff)
  return pi * root, root / pi


def multiply(s: KroneckerState, v, renorm_coeff):
  """``c · A V G``."""
  out = right(left(fac.factor_value(s.a), v, fac.is_diagonal(s.a)),
              fac.factor_value(s.g), fac.is_diagonal(s.g))
  return renorm_coeff * out


def _eigen(state: fac.FactorState, use_cache: bool):
  """(eigenvalues, eigenvectors or None for a diagonal factor)."""
  if fac.is_diagonal(state):
    vals = state.cache.eigvals if use_cache else fac.factor_value(state)
    return jnp.maximum(vals, 0), None
  if use_cache:
    return state.cache.eigvals, state.cache.eigvecs
  return fac.eigh(fac.factor_value(state))


def _to_eigenbasis(v, qa, qg):
  v = v if qa is None else _t(qa) @ v
  return v if qg is None else v @ qg


def _from_eigenbasis(v, qa, qg):
  v = v if qa is None else qa @ v
  return v if qg is None else v @ _t(qg)


def _exact_spectrum(s, damping, renorm_coeff, use_cache):
  """Eigenbases and the damped spectrum ``c λ_A λ_Gᵀ + λ`` [g, a, b]."""
  (wa, qa), (wg, qg) = _eigen(s.a, use_cache), _eigen(s.g, use_cache)
  lam = jnp.asarray(damping, wa.dtype)[..., None, None]
  return qa, qg, renorm_coeff * wa[..., :, None] * wg[..., None, :] + lam


def cache_kind(mode):
  """The factors' cache for a damping mode: ``"pi"`` keeps the damped powers
  (one ``n×n`` array per factor), ``"exact"`` the eigendecompositions."""
  return "eigh" if mode == "exact" else "power"


def matpower(s: KroneckerState, v, damping, precon_power, mode,
             renorm_coeff, use_cache=False, inverse_method="auto"):
  """``(F + λI)^p V`` (``p = precon_power``) in the given damping mode.

  With ``use_cache`` in ``"pi"`` mode the factors' cached damped powers
  (computed by ``refresh``, with the damping and power given then) are
  used; in ``"exact"`` mode the cached eigendecompositions are used with
  the damping and power given now. ``inverse_method``: how damped inverses
  are computed without the cache (``factor.INVERSES``).
  """
  if mode == "exact":
    qa, qg, spec = _exact_spectrum(s, damping, renorm_coeff, use_cache)
    return _from_eigenbasis(
        spec ** precon_power * _to_eigenbasis(v, qa, qg), qa, qg)
  if use_cache:
    pa, pg = s.a.cache.matpower, s.g.cache.matpower
  else:
    da, dg = pi_adjusted_damping(s, damping, renorm_coeff)
    pa = fac.damped_matpower(s.a, da, precon_power, method=inverse_method)
    pg = fac.damped_matpower(s.g, dg, precon_power, method=inverse_method)
  out = right(left(pa, v, fac.is_diagonal(s.a)), pg, fac.is_diagonal(s.g))
  return renorm_coeff ** precon_power * out


def refresh(s: KroneckerState, damping, precon_power, mode, renorm_coeff,
            step, inverse_method="auto"):
  """Cache what ``matpower(..., use_cache=True)`` needs: in ``"exact"`` mode
  the eigendecompositions, in ``"pi"`` mode the π-damped powers (inverses
  by ``inverse_method``, see ``factor.INVERSES``)."""
  if mode == "exact":
    return KroneckerState(fac.refresh_cache(s.a, step),
                          fac.refresh_cache(s.g, step))
  da, dg = pi_adjusted_damping(s, damping, renorm_coeff)
  return KroneckerState(
      fac.refresh_cache(s.a, step, damping=da, exp=precon_power,
                        method=inverse_method),
      fac.refresh_cache(s.g, step, damping=dg, exp=precon_power,
                        method=inverse_method))


def cholesky(s: KroneckerState, v, damping, mode, renorm_coeff, *,
             inverse=False, transpose=False):
  """Products with a square-root factor ``L`` of the damped block, L Lᵀ = F + λI.

  In ``"pi"`` mode ``L = √c · L_A ⊗ L_G`` with ``L_A``, ``L_G`` the
  (lower-triangular) Cholesky factors of the damped factors, so ``L`` is the
  Cholesky factor of the damped Kronecker product. In ``"exact"`` mode the
  damped block is not a Kronecker product and ``L = (Q_A ⊗ Q_G)
  diag(√(cλ_A⊗λ_G + λ))``. Computes ``L v``, ``Lᵀ v``, ``L⁻¹ v`` or
  ``L⁻ᵀ v``.
  """
  if mode == "exact":
    qa, qg, spec = _exact_spectrum(s, damping, renorm_coeff, False)
    root = jnp.sqrt(spec) if not inverse else 1 / jnp.sqrt(spec)
    # L = Q diag(root): L v = Q(root∘v); Lᵀ v = root∘(Qᵀv). L⁻¹ = diag(1/root)Qᵀ.
    if transpose != inverse:
      return root * _to_eigenbasis(v, qa, qg)
    return _from_eigenbasis(root * v, qa, qg)
  da, dg = pi_adjusted_damping(s, damping, renorm_coeff)
  la, lg = fac.damped_cholesky(s.a, da), fac.damped_cholesky(s.g, dg)
  diag_a, diag_g = fac.is_diagonal(s.a), fac.is_diagonal(s.g)
  scale = jnp.sqrt(jnp.asarray(renorm_coeff, v.dtype))
  if not inverse:
    # vec(L_A V L_Gᵀ) = (L_A ⊗ L_G) vec(V); transposed: L_Aᵀ V L_G.
    ma = la if (diag_a or not transpose) else _t(la)
    mg = lg if (diag_g or transpose) else _t(lg)
    return scale * right(left(ma, v, diag_a), mg, diag_g)
  # L⁻¹: L_A⁻¹ V L_G⁻ᵀ; L⁻ᵀ: L_A⁻ᵀ V L_G⁻¹.
  if diag_a:
    out = v / la[..., :, None]
  else:
    out = fac.solve_triangular(la, v, lower=True, trans=1 if transpose else 0)
  if diag_g:
    out = out / lg[..., None, :]
  else:
    # out @ L_G⁻ᵀ = (L_G⁻¹ outᵀ)ᵀ ; out @ L_G⁻¹ = (L_G⁻ᵀ outᵀ)ᵀ.
    out = _t(fac.solve_triangular(lg, _t(out), lower=True,
                              trans=1 if transpose else 0))
  return out / scale


def to_dense(s: KroneckerState, renorm_coeff):
  """The canonical dense matrix ``c · blockdiag_g(A_g ⊗ G_g)`` [g·a·b]²."""
  a, g = fac.factor_value(s.a), fac.factor_value(s.g)
  if fac.is_diagonal(s.a):
    a = jnp.vectorize(jnp.diag, signature="(n)->(n,n)")(a)
  if fac.is_diagonal(s.g):
    g = jnp.vectorize(jnp.diag, signature="(n)->(n,n)")(g)
  blocks = [jnp.kron(a[i], g[i]) for i in range(a.shape[0])]
  return renorm_coeff * block_diag(*blocks)
