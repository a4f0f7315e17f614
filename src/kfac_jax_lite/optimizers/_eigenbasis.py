"""The eigenbases of ``kfl.eigen_adam``: rotating a layer's matrices into
and out of its factors' eigenbases, refreshing a factor's basis (exact, or
SOAP's warm-started power step), carrying Adam's moments across a refresh,
and SOAP's statistics of a gradient (the math: ``eigen_adam``'s module
docstring)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kfac_jax_lite import blocks as B
from kfac_jax_lite import factor as fac


def is_factor(x):
  """Whether ``x`` is a ``FactorState`` (a ``jax.tree`` ``is_leaf``)."""
  return isinstance(x, fac.FactorState)


def basis_of(f):
  """A factor's basis ``Q`` (identity before its first refresh); None for
  a diagonal factor (its basis is the identity)."""
  if fac.is_diagonal(f):
    return None
  eye = jnp.broadcast_to(jnp.eye(f.cov.shape[-1], dtype=f.cov.dtype),
                         f.cov.shape)
  return jnp.where(f.cache.step >= 0, f.cache.eigvecs, eye)


def _t(x):
  return jnp.swapaxes(x, -1, -2)


def to_basis(m, qa, qg):
  """``Q_Aᵀ M Q_G`` per group (``qa`` or ``qg`` None: the identity)."""
  m = m if qa is None else _t(qa) @ m
  return m if qg is None else m @ qg


def from_basis(m, qa, qg):
  """``Q_A M Q_Gᵀ`` per group (``qa`` or ``qg`` None: the identity)."""
  m = m if qa is None else qa @ m
  return m if qg is None else m @ _t(qg)


def power_step(c, q_old):
  """One warm-started power-iteration step, as SOAP's: the columns of
  ``Q_old`` ordered by decreasing ``diag(Q_oldᵀ C Q_old)``, then ``Q`` of
  ``qr(C Q_old)`` with its columns' signs such that ``diag(R) ≥ 0`` (an
  exact eigenbasis of a positive definite ``C`` maps to itself), put back
  in ``Q_old``'s column order (column ``j`` of the new basis continues
  column ``j`` of the old one). Returns ``(diag(Qᵀ C Q), Q)``.

  The order matters: QR orthogonalises the columns in turn, so the first
  ones converge to the dominant eigenvectors; fed ``eigh``'s ascending
  order, it would pull the smallest eigenvector towards the largest
  (``benchmarks/eigenbasis_refresh.py`` measured a basis worse than
  keeping the old one before this ordering)."""
  est = jnp.einsum("...ij,...ik,...kj->...j", q_old, c, q_old)
  order = jnp.argsort(-est, axis=-1)
  q, r = jnp.linalg.qr(c @ jnp.take_along_axis(q_old, order[..., None, :], -1))
  sign = jnp.where(jnp.diagonal(r, axis1=-2, axis2=-1) < 0, -1, 1).astype(q.dtype)
  q = jnp.take_along_axis(q * sign[..., None, :],
                          jnp.argsort(order, axis=-1)[..., None, :], -1)
  return jnp.einsum("...ij,...ik,...kj->...j", q, c, q), q


def refresh_factor(f, step, refresh):
  """``f`` with a new basis in its cache: ``eigh`` of its value, or
  (``refresh="power"``, ``eigen_adam``'s, and a basis already there) one ``power_step`` from
  the cached basis; a result that is not finite keeps the old cache and
  counts in ``cache.num_failed``. A diagonal factor (identity basis) only
  records the step."""
  if fac.is_diagonal(f):  # Its basis is the identity: only the step is kept.
    return f._replace(cache=f.cache._replace(
        step=jnp.asarray(step, jnp.int32)))
  c = fac.factor_value(f)
  if refresh == "power":
    w, q = jax.lax.cond(f.cache.step >= 0,
                        lambda c, q: power_step(c, q),
                        lambda c, q: fac.eigh(c), c, f.cache.eigvecs)
  else:
    w, q = fac.eigh(c)
  ok = fac.all_finite((w, q))
  old = f.cache
  return f._replace(cache=old._replace(
      eigvals=jnp.where(ok, w, old.eigvals),
      eigvecs=jnp.where(ok, q, old.eigvecs),
      step=jnp.where(ok, jnp.asarray(step, jnp.int32), old.step),
      num_failed=old.num_failed + jnp.where(ok, 0, 1).astype(jnp.int32)))


def rebase_moments(m, v, old, new, nu_rebase="project"):
  """The moments ``(m, v)`` of one layer, carried from the bases of the
  block state ``old`` into those of ``new`` (module docstring):
  ``m ← R_Aᵀ m R_G``; ``v ← (R_A∘R_A)ᵀ v (R_G∘R_G)`` (``"project"``) or
  ``v`` (``"keep"``); ``R = Q_oldᵀ Q_new``, the identity for a diagonal
  factor."""
  rs = []
  for fo, fn in ((old.a, new.a), (old.g, new.g)):
    qo, qn = basis_of(fo), basis_of(fn)
    rs.append(None if qo is None or qn is None else _t(qo) @ qn)
  ra, rg = rs
  m = to_basis(m, ra, rg)
  if nu_rebase == "project":
    v = to_basis(v, None if ra is None else ra ** 2,
                 None if rg is None else rg ** 2)
  return m, v


def shampoo_stats(block, vectors):
  """SOAP's statistics of one gradient: ``M Mᵀ`` and ``Mᵀ M`` of its
  ``[groups, a, b]`` matrix ``M`` (the diagonal of ``M Mᵀ`` where the
  block's input factor is diagonal, as an embedding's or a side over the
  size limit; the diagonal of ``Mᵀ M`` where its output factor is)."""
  m = block.layout.to_mat(tuple(vectors))
  a = (jnp.sum(m * m, -1) if block.input_diagonal else m @ _t(m))
  g = (jnp.sum(m * m, -2) if block.output_diagonal else _t(m) @ m)
  return B.KroneckerState(a=a, g=g)
