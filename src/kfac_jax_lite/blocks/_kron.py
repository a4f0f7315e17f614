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

Either factor may be diagonal (the embedding block's input factor is), or
partitioned: a side of ``n`` split into ``p`` equal diagonal blocks of
``k = ⌈n/p⌉`` (Shampoo's partitions; the factor ``[g, p, k, k]``, the side
padded with ``p·k − n`` zero rows that the products never read back), so
that ``A = blockdiag(A_1, ..., A_p)``. A partitioned side's covariance is
the dense one's diagonal blocks; every function here is then exact for that
block-diagonal matrix (the padding is a direct summand the products crop).
The π trace counts the side's real ``n`` (``sizes``).
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


def is_partitioned(state: fac.FactorState) -> bool:
  """Whether a Kronecker factor is partitioned (``[g, p, k, k]``)."""
  return state.cov.ndim == 4


def _form(state: fac.FactorState):
  """``"diagonal"``, ``"dense"`` or ``"blocks"`` (partitioned)."""
  if fac.is_diagonal(state):
    return "diagonal"
  return "blocks" if is_partitioned(state) else "dense"


def _by_blocks(fn, m, v):
  """``fn(m, V)`` on the row blocks of ``v [g, p·k, b]`` against the
  partitioned ``m [g, p, k, k]``."""
  g, rows, cols = v.shape
  p, k = m.shape[-3], m.shape[-1]
  return fn(m, v.reshape(g, p, k, cols)).reshape(g, rows, cols)


def left(m, v, form):
  """``m @ v`` for a factor's matrix ``m`` (``form``: ``"dense"`` [g, a, a],
  ``"diagonal"`` [g, a], ``"blocks"`` [g, p, k, k] with ``v`` padded to
  ``p·k`` rows), ``v [g, a, b]``."""
  if form == "diagonal":
    return m[..., :, None] * v
  if form == "blocks":
    return _by_blocks(jnp.matmul, m, v)
  return m @ v


def right(v, m, form):
  """``v @ m`` for a factor's matrix ``m`` [g, b(, b)] (``form`` as
  ``left``; ``"blocks"``: ``m [g, q, l, l]``, ``v`` padded to ``q·l``
  columns)."""
  if form == "diagonal":
    return v * m[..., None, :]
  if form == "blocks":
    return _t(_by_blocks(jnp.matmul, _t(m), _t(v)))
  return v @ m


def _padded_side(state: fac.FactorState, n: int) -> int:
  """The side's length in the products: ``p·k`` for a partitioned factor,
  else ``n``."""
  if is_partitioned(state):
    return state.cov.shape[-3] * state.cov.shape[-1]
  return n


def _pad(s: KroneckerState, v):
  """``v [g, a, b]`` padded with zeros to the partitioned sides' lengths,
  and the function that crops a result back."""
  a, b = v.shape[-2:]
  pa, pb = _padded_side(s.a, a), _padded_side(s.g, b)
  if (pa, pb) == (a, b):
    return v, lambda x: x
  return (jnp.pad(v, ((0, 0), (0, pa - a), (0, pb - b))),
          lambda x: x[:, :a, :b])


def _mean_trace(state: fac.FactorState, n=None):
  """``tr C / n`` per group; ``n`` the side's real length (a partitioned
  factor's padding is not counted)."""
  c = fac.factor_value(state)
  diag = c if fac.is_diagonal(state) else jnp.diagonal(c, axis1=-2, axis2=-1)
  if is_partitioned(state):
    if n is None:
      raise ValueError("the π damping of a partitioned factor needs its "
                       "side's length (sizes=)")
    return jnp.sum(diag, axis=(-2, -1)) / n
  return jnp.mean(diag, axis=-1)


def _per_block(damping, state: fac.FactorState):
  """A factor's damping ``[g]`` broadcast over a partitioned factor's
  blocks (``[g, 1]``)."""
  return damping[..., None] if is_partitioned(state) else damping


def pi_adjusted_damping(s: KroneckerState, damping, renorm_coeff,
                        sizes=None):
  """Per-factor damping ``(π√(λ/c), √(λ/c)/π)`` of the π-adjusted scheme.

  ``π`` falls back to 1 where a trace is zero or not finite. ``sizes``:
  the sides' real lengths ``(a, b)``, needed for a partitioned factor.
  """
  na, nb = sizes if sizes is not None else (None, None)
  ta, tg = _mean_trace(s.a, na), _mean_trace(s.g, nb)
  ratio = ta / jnp.where(tg > 0, tg, 1)
  good = (ta > 0) & (tg > 0) & jnp.isfinite(ratio)
  pi = jnp.sqrt(jnp.where(good, ratio, 1))
  root = jnp.sqrt(jnp.asarray(damping, pi.dtype) / renorm_coeff)
  return pi * root, root / pi


def multiply(s: KroneckerState, v, renorm_coeff):
  """``c · A V G``."""
  v, crop = _pad(s, v)
  out = right(left(fac.factor_value(s.a), v, _form(s.a)),
              fac.factor_value(s.g), _form(s.g))
  return renorm_coeff * crop(out)


def _eigen(state: fac.FactorState, use_cache: bool):
  """(eigenvalues, eigenvectors or None for a diagonal factor); a
  partitioned factor's eigenvalues flattened to its padded side."""
  if fac.is_diagonal(state):
    vals = state.cache.eigvals if use_cache else fac.factor_value(state)
    return jnp.maximum(vals, 0), None
  if use_cache:
    w, q = state.cache.eigvals, state.cache.eigvecs
  else:
    w, q = fac.eigh(fac.factor_value(state))
  if is_partitioned(state):
    w = w.reshape(w.shape[:-2] + (-1,))
  return w, q


def _to_eigenbasis(v, qa, qg, forms):
  v = v if qa is None else left(_t(qa), v, forms[0])
  return v if qg is None else right(v, qg, forms[1])


def _from_eigenbasis(v, qa, qg, forms):
  v = v if qa is None else left(qa, v, forms[0])
  return v if qg is None else right(v, _t(qg), forms[1])


def _exact_spectrum(s, damping, renorm_coeff, use_cache):
  """Eigenbases and the damped spectrum ``c λ_A λ_Gᵀ + λ`` [g, a, b] (on
  the padded sides of partitioned factors)."""
  (wa, qa), (wg, qg) = _eigen(s.a, use_cache), _eigen(s.g, use_cache)
  lam = jnp.asarray(damping, wa.dtype)[..., None, None]
  return qa, qg, renorm_coeff * wa[..., :, None] * wg[..., None, :] + lam


def cache_kind(mode):
  """The factors' cache for a damping mode: ``"pi"`` keeps the damped powers
  (one ``n×n`` array per factor), ``"exact"`` the eigendecompositions."""
  return "eigh" if mode == "exact" else "power"


def _sizes(v):
  """The sides' real lengths ``(a, b)`` of parameters ``v [g, a, b]``."""
  return tuple(v.shape[-2:])


def matpower(s: KroneckerState, v, damping, precon_power, mode,
             renorm_coeff, use_cache=False, inverse_method="auto"):
  """``(F + λI)^p V`` (``p = precon_power``) in the given damping mode.

  With ``use_cache`` in ``"pi"`` mode the factors' cached damped powers
  (computed by ``refresh``, with the damping and power given then) are
  used; in ``"exact"`` mode the cached eigendecompositions are used with
  the damping and power given now. ``inverse_method``: how damped inverses
  are computed without the cache (``factor.INVERSES``).
  """
  forms = (_form(s.a), _form(s.g))
  sizes = _sizes(v)
  v, crop = _pad(s, v)
  if mode == "exact":
    qa, qg, spec = _exact_spectrum(s, damping, renorm_coeff, use_cache)
    return crop(_from_eigenbasis(
        spec ** precon_power * _to_eigenbasis(v, qa, qg, forms), qa, qg,
        forms))
  if use_cache:
    pa, pg = s.a.cache.matpower, s.g.cache.matpower
  else:
    da, dg = pi_adjusted_damping(s, damping, renorm_coeff, sizes)
    pa = fac.damped_matpower(s.a, _per_block(da, s.a), precon_power,
                             method=inverse_method)
    pg = fac.damped_matpower(s.g, _per_block(dg, s.g), precon_power,
                             method=inverse_method)
  out = right(left(pa, v, forms[0]), pg, forms[1])
  return renorm_coeff ** precon_power * crop(out)


def refresh(s: KroneckerState, damping, precon_power, mode, renorm_coeff,
            step, inverse_method="auto", sizes=None):
  """Cache what ``matpower(..., use_cache=True)`` needs: in ``"exact"`` mode
  the eigendecompositions, in ``"pi"`` mode the π-damped powers (inverses
  by ``inverse_method``, see ``factor.INVERSES``). ``sizes``: the sides'
  real lengths ``(a, b)``, needed for a partitioned factor's π."""
  if mode == "exact":
    return KroneckerState(fac.refresh_cache(s.a, step),
                          fac.refresh_cache(s.g, step))
  da, dg = pi_adjusted_damping(s, damping, renorm_coeff, sizes)
  return KroneckerState(
      fac.refresh_cache(s.a, step, damping=_per_block(da, s.a),
                        exp=precon_power, method=inverse_method),
      fac.refresh_cache(s.g, step, damping=_per_block(dg, s.g),
                        exp=precon_power, method=inverse_method))


def _solve(l, v, form, transpose):
  """``L⁻¹ v`` (``transpose``: ``L⁻ᵀ v``) for a lower-triangular factor
  ``L`` of a dense or partitioned side (``v [g, a, b]``)."""
  solve = lambda m, x: fac.solve_triangular(m, x, lower=True,
                                            trans=1 if transpose else 0)
  return _by_blocks(solve, l, v) if form == "blocks" else solve(l, v)


def cholesky(s: KroneckerState, v, damping, mode, renorm_coeff, *,
             inverse=False, transpose=False):
  """Products with a square-root factor ``L`` of the damped block, L Lᵀ = F + λI.

  In ``"pi"`` mode ``L = √c · L_A ⊗ L_G`` with ``L_A``, ``L_G`` the
  (lower-triangular) Cholesky factors of the damped factors, so ``L`` is the
  Cholesky factor of the damped Kronecker product. In ``"exact"`` mode the
  damped block is not a Kronecker product and ``L = (Q_A ⊗ Q_G)
  diag(√(cλ_A⊗λ_G + λ))``; with a partitioned side, whose padded
  eigenbasis is not the parameters' space, the symmetric root ``L = (Q_A
  ⊗ Q_G) diag(√(cλ_A⊗λ_G + λ)) (Q_A ⊗ Q_G)ᵀ`` (``L = Lᵀ``). Computes
  ``L v``, ``Lᵀ v``, ``L⁻¹ v`` or ``L⁻ᵀ v``.
  """
  forms = (_form(s.a), _form(s.g))
  sizes = _sizes(v)
  v, crop = _pad(s, v)
  if mode == "exact":
    qa, qg, spec = _exact_spectrum(s, damping, renorm_coeff, False)
    root = jnp.sqrt(spec) if not inverse else 1 / jnp.sqrt(spec)
    if "blocks" in forms:
      return crop(_from_eigenbasis(
          root * _to_eigenbasis(v, qa, qg, forms), qa, qg, forms))
    # L = Q diag(root): L v = Q(root∘v); Lᵀ v = root∘(Qᵀv). L⁻¹ = diag(1/root)Qᵀ.
    if transpose != inverse:
      return crop(root * _to_eigenbasis(v, qa, qg, forms))
    return crop(_from_eigenbasis(root * v, qa, qg, forms))
  da, dg = pi_adjusted_damping(s, damping, renorm_coeff, sizes)
  la = fac.damped_cholesky(s.a, _per_block(da, s.a))
  lg = fac.damped_cholesky(s.g, _per_block(dg, s.g))
  diag_a, diag_g = forms[0] == "diagonal", forms[1] == "diagonal"
  scale = jnp.sqrt(jnp.asarray(renorm_coeff, v.dtype))
  if not inverse:
    # vec(L_A V L_Gᵀ) = (L_A ⊗ L_G) vec(V); transposed: L_Aᵀ V L_G.
    ma = la if (diag_a or not transpose) else _t(la)
    mg = lg if (diag_g or transpose) else _t(lg)
    return crop(scale * right(left(ma, v, forms[0]), mg, forms[1]))
  # L⁻¹: L_A⁻¹ V L_G⁻ᵀ; L⁻ᵀ: L_A⁻ᵀ V L_G⁻¹.
  out = v / la[..., :, None] if diag_a else _solve(la, v, forms[0], transpose)
  if diag_g:
    out = out / lg[..., None, :]
  else:
    # out @ L_G⁻ᵀ = (L_G⁻¹ outᵀ)ᵀ ; out @ L_G⁻¹ = (L_G⁻ᵀ outᵀ)ᵀ.
    out = _t(_solve(lg, _t(out), forms[1], transpose))
  return crop(out / scale)


def _dense_factor(state: fac.FactorState, n: int):
  """A factor's value as dense matrices ``[g, n, n]``."""
  c = fac.factor_value(state)
  if fac.is_diagonal(state):
    return jnp.vectorize(jnp.diag, signature="(n)->(n,n)")(c)
  if is_partitioned(state):
    c = jnp.stack([block_diag(*blocks) for blocks in c])
    return c[:, :n, :n]
  return c


def to_dense(s: KroneckerState, renorm_coeff, sizes=None):
  """The canonical dense matrix ``c · blockdiag_g(A_g ⊗ G_g)`` [g·a·b]²
  (``sizes``: the sides' real lengths, needed for a partitioned factor)."""
  na, nb = sizes if sizes is not None else (
      s.a.cov.shape[-1], s.g.cov.shape[-1])
  a, g = _dense_factor(s.a, na), _dense_factor(s.g, nb)
  blocks = [jnp.kron(a[i], g[i]) for i in range(a.shape[0])]
  return renorm_coeff * block_diag(*blocks)
