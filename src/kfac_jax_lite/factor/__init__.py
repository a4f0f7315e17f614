"""Curvature factors: immutable pytrees and the pure functions over them.

The math core (layer 0). Owns ``FactorState`` and the functions on it,
the damped inverses built from matrix products (``_inverse``), the packing
of many small leaves into few reductions (``_packing``), LAPACK's
Cholesky and triangular solves one matrix at a time on CPU (``_lapack``,
whose batched kernels can hang jaxlib 0.10's CPU runtime;
``solve_triangular`` and ``sequential_on_cpu`` for the layers above) and
the one "at least float32" dtype rule (``float_dtype``). May import: jax only;
no other layer of the library.

A factor is a running estimate of a symmetric positive semi-definite matrix
``C`` (``[..., n, n]``) or of its diagonal (``[..., n]``); the leading ``...``
are batch axes (one factor per convolution feature group, say). It is held
as a zero-debiased exponential moving average

    S_t = decay * S_{t-1} + (1 - decay) * w_t * X_t
    W_t = decay * W_{t-1} + (1 - decay) * w_t
    C_t = S_t / W_t

so the first update already gives ``C_1 = X_1`` whatever the decay.

Beside the running estimate a factor carries a ``FactorCache`` (its own
sub-pytree, so that it can be shared or checkpointed as one field) of what
its last refresh computed, in one of two kinds chosen at ``init_factor``:

* ``"power"`` — the damped power ``(C + d·I)^p`` at the refresh's damping
  ``d`` and power ``p`` (one ``n×n`` array; K-FAC's π-damped inverses);
* ``"eigh"`` — the eigendecomposition of ``C``, for any damping and power
  later (eigenvalues ``[n]`` and eigenvectors ``n×n``; exact damping).

Parts a kind does not keep have size 0 along their last axis. The cache also
holds the step of the last good refresh and how many refreshes failed (a
decomposition that fails keeps the last good cache).

Damped inverses ``(C + d·I)⁻¹`` come from one of the methods of the
registry ``INVERSES`` (its entry lists them), named by ``inverse_method``
(``kfl.kfac``) or ``method`` (here); ``INVERSE_METHODS`` are those names
and ``"auto"``, which picks per backend (``AUTO_METHODS``). Powers other
than -1 always use ``eigh``. A decomposition fails when the damped factor
is not numerically positive definite (a non-positive pivot) or the result
is not finite.

Everything here is a pure function on ``FactorState``; nothing traces user
code and nothing depends on optax.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from kfac_jax_lite.factor import _inverse
from kfac_jax_lite.factor import _lapack
from kfac_jax_lite.factor import _packing
from kfac_jax_lite.factor._dtypes import float_dtype as float_dtype
from kfac_jax_lite.factor._packing import pack as pack
from kfac_jax_lite.factor._packing import sum_scalars as sum_scalars
from kfac_jax_lite.factor._lapack import sequential_on_cpu as sequential_on_cpu
from kfac_jax_lite.factor._lapack import solve_triangular as solve_triangular

__all__ = [
    "AUTO_DEFAULT", "AUTO_METHODS", "CACHE_KINDS", "FactorCache",
    "FactorState", "INVERSES", "INVERSE_METHODS", "all_finite",
    "batched_inverses", "cache_kind", "float_dtype", "pack",
    "sequential_on_cpu", "solve_triangular", "sum_scalars",
    "check_inverse_method", "damped_cholesky", "damped_matpower", "eigh",
    "factor_value", "init_factor", "is_diagonal", "multiply",
    "multiply_inverse", "multiply_matpower", "refresh_cache", "update_cov",
    "update_cov_if",
]

Array = jax.Array

CACHE_KINDS = ("power", "eigh")
"""The kinds of cached decomposition (``FactorCache``)."""
# "auto" per backend: measured on CPU (benchmarks/README.md); elsewhere the
# vendor's Cholesky until measured (see check_inverse_method).
AUTO_METHODS = {"cpu": "gauss_jordan"}
"""``inverse_method="auto"``'s choice per backend."""
AUTO_DEFAULT = "cholesky"
"""``inverse_method="auto"``'s choice on a backend not in ``AUTO_METHODS``."""


class FactorCache(NamedTuple):
  """What the last refresh computed (see the module docstring)."""

  # Fields a cache kind does not keep hold a one-element placeholder (never
  # a zero-size array: orbax refuses to save those): ``[..., 1]`` for
  # eigvals/eigvecs, ``[..., 1, 1, 1]`` for matpower, whose rank no real
  # ``matpower`` has (``cache_kind`` reads it).
  eigvals: Array  # "eigh": eigenvalues of C clipped at 0, [..., n]; else [..., 1].
  eigvecs: Array  # "eigh" and dense: eigenvectors [..., n, n]; else [..., 1].
  matpower: Array  # "power": (C + d I)^p, [..., n, n] or [..., n]; else [..., 1, 1, 1].
  step: Array  # int32: step of the last good refresh (-1: never).
  num_failed: Array  # int32: refreshes whose decomposition failed.


class FactorState(NamedTuple):
  """One curvature factor (a pytree; checkpoint it like any other)."""

  cov: Array  # EMA accumulator S_t: [..., n, n] (dense) or [..., n] (diagonal).
  weight: Array  # EMA of the update weights W_t; C_t = cov / weight.
  num_skipped: Array  # int32: updates refused for non-finite statistics.
  cache: FactorCache


def init_factor(dim: int, *, diagonal: bool = False, batch_shape=(),
                dtype=jnp.float32, cache: str = "power") -> FactorState:
  """A factor of size ``dim`` with no statistics yet (it reads as zero).

  ``cache``: ``"power"`` keeps the damped power of the last refresh,
  ``"eigh"`` its eigendecomposition.
  """
  if cache not in CACHE_KINDS:
    raise ValueError(f"cache must be one of {CACHE_KINDS}, got {cache!r}")
  batch_shape = tuple(batch_shape)
  # A new buffer per field, never one array twice: a state with a shared
  # buffer cannot be donated (``jax.jit(step, donate_argnums=...)``).
  vec = lambda: jnp.zeros(batch_shape + (dim,), dtype)
  mat = vec if diagonal else (
      lambda: jnp.zeros(batch_shape + (dim, dim), dtype))
  # Placeholders for what the cache kind does not keep (``FactorCache``).
  empty = lambda: jnp.zeros(batch_shape + (1,), dtype)
  no_power = lambda: jnp.zeros(batch_shape + (1, 1, 1), dtype)
  if cache == "eigh":
    parts = dict(eigvals=vec(), eigvecs=empty() if diagonal else mat(),
                 matpower=no_power())
  else:
    parts = dict(eigvals=empty(), eigvecs=empty(), matpower=mat())
  return FactorState(
      cov=mat(), weight=jnp.zeros((), dtype),
      num_skipped=jnp.zeros((), jnp.int32),
      cache=FactorCache(step=jnp.full((), -1, jnp.int32),
                        num_failed=jnp.zeros((), jnp.int32), **parts))


def is_diagonal(state: FactorState) -> bool:
  """Whether the factor holds only a diagonal (decided by static shapes)."""
  return state.cov.ndim == state.cache.eigvals.ndim


def cache_kind(state: FactorState) -> str:
  """``"power"`` or ``"eigh"``: what the factor's cache keeps."""
  # A kept matpower has the covariance's rank; the placeholder never does.
  return "power" if state.cache.matpower.ndim == state.cov.ndim else "eigh"


def check_inverse_method(method: str, where: str = "inverse_method") -> str:
  """``method`` resolved for the default backend (``"auto"``), or an error
  (the ``method`` that ``batched_inverses`` hands its function passes as
  it is)."""
  if isinstance(method, _inverse.Batch):
    return method  # type: ignore[return-value]
  if method not in INVERSE_METHODS:
    raise ValueError(f"{where} must be one of {INVERSE_METHODS}, got {method!r}")
  if method == "auto":
    return AUTO_METHODS.get(jax.default_backend(), AUTO_DEFAULT)
  return method


def factor_value(state: FactorState) -> Array:
  """The debiased estimate ``C = S / W`` (zeros before the first update)."""
  safe = jnp.where(state.weight > 0, state.weight, 1)
  return jnp.where(state.weight > 0, state.cov / safe, jnp.zeros_like(state.cov))


all_finite = _packing.all_finite  # Σ (x − x) over packed leaves.
"""A scalar bool: every entry of every leaf of a pytree is finite."""


def _check_stats_shape(state: FactorState, new_stats, where: str):
  if tuple(jnp.shape(new_stats)) != tuple(state.cov.shape):
    raise ValueError(
        f"{where}: new statistics of shape {tuple(jnp.shape(new_stats))} do "
        f"not match the factor's shape {tuple(state.cov.shape)}")


def update_cov_if(state: FactorState, new_stats, decay, weight, ok) -> FactorState:
  """``update_cov`` with the finiteness verdict given (for joint checks).

  Blocks with several factors decide once for all of them, so that one bad
  factor never leaves its siblings updated alone.
  """
  _check_stats_shape(state, new_stats, "update_cov")
  dtype = state.cov.dtype
  new_stats = jnp.asarray(new_stats).astype(dtype)
  decay = jnp.asarray(decay, dtype)
  weight = jnp.asarray(weight, dtype)
  ok = jnp.logical_and(ok, jnp.isfinite(weight))
  new_cov = decay * state.cov + (1 - decay) * weight * new_stats
  new_weight = decay * state.weight + (1 - decay) * weight
  return state._replace(
      cov=jnp.where(ok, new_cov, state.cov),
      weight=jnp.where(ok, new_weight, state.weight),
      num_skipped=state.num_skipped + jnp.where(ok, 0, 1).astype(jnp.int32))


def update_cov(state: FactorState, new_stats: Array, decay: ArrayLike,
               weight: ArrayLike = 1.0) -> FactorState:
  """Zero-debiased EMA update of a factor with fresh statistics ``new_stats``.

  ``S <- decay*S + (1-decay)*weight*new_stats``, ``W <- decay*W +
  (1-decay)*weight``. If ``new_stats`` (or ``weight``) has a non-finite
  entry the state is returned unchanged except ``num_skipped``, which counts
  the refusal. A shape mismatch raises ``ValueError`` naming both shapes.
  """
  return update_cov_if(state, new_stats, decay, weight, all_finite(new_stats))


# --- damped powers ---------------------------------------------------------

def _eye_like(c: Array) -> Array:
  return jnp.broadcast_to(jnp.eye(c.shape[-1], dtype=c.dtype), c.shape)


def _damping_array(damping, dtype) -> Array:
  """Damping as an array broadcastable against eigenvalues [..., n]."""
  return jnp.asarray(damping, dtype)[..., None]


def _is_minus_one(exp) -> bool:
  return isinstance(exp, (int, float)) and float(exp) == -1.0


def eigh(c: Array):
  """Symmetric eigendecomposition ``(w, Q)`` with eigenvalues clipped at 0."""
  w, q = jnp.linalg.eigh((c + jnp.swapaxes(c, -1, -2)) / 2)
  return jnp.maximum(w, 0), q


def _power_from_eigh(w, q, damping, precon_power) -> Array:
  d = _damping_array(damping, w.dtype)
  return ((q * (w + d)[..., None, :] ** precon_power)
          @ jnp.swapaxes(q, -1, -2))


def _damped(c: Array, damping) -> Array:
  return c + jnp.asarray(damping, c.dtype)[..., None, None] * _eye_like(c)


def _by_gauss_jordan(c, damping, warm=None):
  del warm
  return _inverse.gauss_jordan_inverse(_damped(c, damping))


def _by_schur(c, damping, warm=None):
  del warm
  return _inverse.schur_inverse(_damped(c, damping))


def _by_cholesky(c, damping, warm=None):
  del warm
  m = _damped(c, damping)
  inv = _lapack.cho_solve(_lapack.cholesky(m), _eye_like(m))
  return inv, all_finite(inv)


def _by_newton_schulz(c, damping, warm=None):
  m = _damped(c, damping)
  if warm is None:
    return _inverse.gauss_jordan_inverse(m)
  x, converged = _inverse.newton_schulz_inverse(m, warm)
  return jax.lax.cond(converged, lambda m: (x, converged),
                      _inverse.gauss_jordan_inverse, m)


def _by_eigh(c, damping, warm=None):
  del warm
  inv = _power_from_eigh(*eigh(c), damping, -1.0)
  return inv, all_finite(inv)


INVERSES = {
    "gauss_jordan": _by_gauss_jordan,
    "schur": _by_schur,
    "cholesky": _by_cholesky,
    "newton_schulz": _by_newton_schulz,
    "eigh": _by_eigh,
}
"""The damped-inverse methods: name -> ``fn(c, damping, warm=None) ->
((C + d·I)⁻¹, ok)`` (``ok`` a scalar bool: the inverse is usable; ``warm``
the last refresh's inverse, or None). The one place they are described:

* ``"gauss_jordan"`` — blocked Gauss–Jordan elimination (``_inverse``):
  XLA matrix products only, ``2n³`` flops in rank-64 updates, forward
  error like a Cholesky inverse's (its residual ``‖mX − I‖`` grows like
  ``κ(m)²·ε``, not ``κ(m)·ε``). The default on CPU, where LAPACK's own
  thread pool competes with XLA's (``benchmarks/README.md``, "The
  refresh's inverses on their own", has the timings).
* ``"schur"`` — one Schur-complement split (``_inverse``): above 512,
  ``m⁻¹`` from the sweeps of its leading half ``A`` and of the Schur
  complement ``S = D − Bᵀ A⁻¹ B`` (``A⁻¹ B`` refined once) and six square
  products of size ``n/2``. XLA matrix products only, ``2n³`` flops, three
  quarters of them in square products: faster than ``"gauss_jordan"`` on
  CPU at those sizes, with a larger program (a slower first compile) and
  a forward error of the same order (``benchmarks/README.md``). Below 513
  it is ``"gauss_jordan"``.
* ``"cholesky"`` — ``L Lᵀ = C + d·I`` (LAPACK / cuSOLVER), then
  ``L⁻ᵀ L⁻¹`` by two triangular solves against ``I``. The default on other
  backends.
* ``"newton_schulz"`` — ``X ← X + X(I − (C + d·I) X)`` warm-started from the
  cached inverse of the last refresh, while the residual keeps halving; if
  it does not reach rounding level (or there is no cache yet) the inverse
  is computed by ``"gauss_jordan"`` instead (a ``lax.cond``). Matrix
  products only (``4n³`` flops a step); under ``vmap`` both branches run.
* ``"eigh"`` — ``Q (Λ + d)⁻¹ Qᵀ`` from the eigendecomposition, eigenvalues
  clipped at 0.

All are exact to rounding.
"""
INVERSE_METHODS = ("auto", *INVERSES)
"""The names ``inverse_method`` (``method``) accepts: ``"auto"`` (per
backend, ``AUTO_METHODS``) and the keys of ``INVERSES``."""


def _damped_inverse(c: Array, damping, inverse_method: str, warm=None):
  """``((C + d·I)⁻¹, ok)`` by ``inverse_method`` (resolved, a key of
  ``INVERSES``, or a ``batched_inverses`` batch); ``ok`` a scalar bool."""
  if isinstance(inverse_method, _inverse.Batch):  # Gauss–Jordan, batched.
    return inverse_method.inverse(_damped(c, damping))
  return INVERSES[inverse_method](c, damping, warm)


def batched_inverses(fn, method: str = "auto"):
  """``fn(method)``, with the damped Gauss–Jordan inverses it asks for
  computed together: one sweep per stack of a padded size (two stacks a
  size, ``_inverse.gauss_jordan_inverses``).

  ``fn`` takes the ``method`` to give to ``refresh_cache`` (and the
  blocks' ``refresh``) in place of ``method``, and is called twice: first
  to collect the damped matrices ``C + d·I`` it would invert by
  ``"gauss_jordan"`` (answered with zeros; that pass's results are
  dropped, and XLA drops the work only they use), then, after
  ``_inverse.gauss_jordan_inverses`` has inverted them all at once, to
  build its result with those inverses, the same numbers as one at a
  time. With another ``method`` (the other backends' ``"auto"``) ``fn``
  is called once, with it. ``fn`` must
  ask for the same inverses in the same order each time, and must not
  call ``refresh_cache`` under a ``vmap`` or a loop of its own (the
  matrices recorded there would not exist outside it).

  Why: XLA inlines each call of the sweep, so a model's dozens of equal
  factors were dozens of copies of its loop in the compiled update (on a
  12-block transformer the refresh was half of the update's compile).
  """
  method = check_inverse_method(method)
  if method != "gauss_jordan":  # Nothing to batch: one pass.
    return fn(method)
  batch = _inverse.Batch()
  fn(batch)
  batch.compute()
  out = fn(batch)
  if batch.results:
    raise RuntimeError("batched_inverses: the second pass asked for fewer "
                       "inverses than the first")
  return out


def damped_cholesky(state: FactorState, damping) -> Array:
  """Lower-triangular ``L`` with ``L Lᵀ = C + damping·I`` (diagonal: ``√(c+d)``)."""
  c = factor_value(state)
  if is_diagonal(state):
    return jnp.sqrt(jnp.maximum(c, 0) + _damping_array(damping, c.dtype)[..., 0])
  return _lapack.cholesky(_damped(c, damping))


def damped_matpower(state: FactorState, damping: ArrayLike, exp: float, *,
                    use_cache: bool = False, method: str = "auto") -> Array:
  """``(C + damping·I)^exp`` for any real ``exp``.

  Computed through a symmetric eigendecomposition whose eigenvalues are
  clipped at 0 before damping; ``exp = -1`` takes the fast path of
  ``method`` (see the module docstring; ``"newton_schulz"`` has no warm
  start here and uses ``"gauss_jordan"``), falling back to the
  eigendecomposition when the damped factor is not numerically positive
  definite. With ``use_cache=True`` the cache of the last ``refresh_cache``
  is used instead of decomposing now: an ``"eigh"`` cache at this
  ``damping`` and ``exp``, a ``"power"`` cache as it was computed (the
  damping and power of that refresh; the arguments are not used).
  ``damping`` may be an array over the factor's batch axes. A diagonal
  factor returns the diagonal of the result.
  """
  method = check_inverse_method(method)
  if use_cache:
    cache = state.cache
    if cache_kind(state) == "power":
      return cache.matpower
    if is_diagonal(state):
      return (cache.eigvals + _damping_array(damping, cache.eigvals.dtype)[..., 0]
              ) ** exp
    return _power_from_eigh(cache.eigvals, cache.eigvecs, damping, exp)
  c = factor_value(state)
  if is_diagonal(state):
    return (jnp.maximum(c, 0) + _damping_array(damping, c.dtype)[..., 0]) ** exp
  if _is_minus_one(exp) and method != "eigh":
    inv, ok = _damped_inverse(c, damping, method)
    return jax.lax.cond(
        ok, lambda c: inv, lambda c: _power_from_eigh(*eigh(c), damping, -1.0),
        c)
  return _power_from_eigh(*eigh(c), damping, exp)


def refresh_cache(state: FactorState, step, *, damping=None, exp=-1.0,
                  method: str = "auto") -> FactorState:
  """Recompute the factor's cache at ``step``.

  An ``"eigh"`` cache gets the eigendecomposition of ``C`` (``damping`` and
  ``exp`` are not used: they are applied later). A ``"power"`` cache gets
  ``(C + damping·I)^exp`` (``damping`` required), for ``exp = -1`` by
  ``method`` (``"newton_schulz"`` warm-starts from the cached inverse),
  otherwise through the eigendecomposition. A decomposition that fails (a
  damped factor that is not numerically positive definite, a non-finite
  result) keeps the last good cache and counts in ``num_failed``.
  """
  method = check_inverse_method(method)
  c = factor_value(state)
  old = state.cache
  # ok: the decomposition is usable (finite; for a damped inverse, every
  # method's ok already says so, and no second pass over it is made).
  if cache_kind(state) == "eigh":
    if is_diagonal(state):
      new = old._replace(eigvals=jnp.maximum(c, 0))
    else:
      w, q = eigh(c)
      new = old._replace(eigvals=w, eigvecs=q)
    ok = all_finite((new.eigvals, new.eigvecs))
  else:
    if damping is None:
      raise ValueError("refresh_cache: this factor caches a damped power "
                       "(init_factor(cache='power')), so damping= is needed")
    if is_diagonal(state):
      power = (jnp.maximum(c, 0) + _damping_array(damping, c.dtype)[..., 0]) ** exp
      ok = all_finite(power)
    elif _is_minus_one(exp):
      warm = jnp.where(old.step >= 0, old.matpower, jnp.zeros_like(old.matpower))
      power, ok = _damped_inverse(c, damping, method, warm)
    else:
      power = _power_from_eigh(*eigh(c), damping, exp)
      ok = all_finite(power)
    new = old._replace(matpower=power)
  keep = lambda n, o: jnp.where(ok, n, o)
  return state._replace(cache=FactorCache(
      eigvals=keep(new.eigvals, old.eigvals),
      eigvecs=keep(new.eigvecs, old.eigvecs),
      matpower=keep(new.matpower, old.matpower),
      step=jnp.where(ok, jnp.asarray(step, jnp.int32), old.step),
      num_failed=old.num_failed + jnp.where(ok, 0, 1).astype(jnp.int32)))


# --- products with one factor ----------------------------------------------

def _apply(m: Array, x: Array, diagonal: bool) -> Array:
  """``m @ x`` for a dense ``m`` [..., n, n], or ``m[..., :, None] * x``."""
  if diagonal:
    return m[..., :, None] * x if x.ndim == m.ndim + 1 else m * x
  return m @ x if x.ndim == m.ndim else (m @ x[..., None])[..., 0]


def multiply(state: FactorState, x: Array) -> Array:
  """``C @ x`` for ``x`` of shape [..., n] or [..., n, k]."""
  return _apply(factor_value(state), x, is_diagonal(state))


def multiply_matpower(state: FactorState, x: Array, damping, exp, *,
                      use_cache: bool = False, method: str = "auto") -> Array:
  """``(C + damping·I)^exp @ x`` (arguments as ``damped_matpower``)."""
  return _apply(damped_matpower(state, damping, exp, use_cache=use_cache,
                                method=method), x, is_diagonal(state))


def multiply_inverse(state: FactorState, x: Array, damping: ArrayLike, *,
                     use_cache: bool = False) -> Array:
  """``(C + damping·I)^{-1} @ x``; a Cholesky solve unless ``use_cache``."""
  if use_cache or is_diagonal(state):
    return multiply_matpower(state, x, damping, -1.0, use_cache=use_cache)
  chol = damped_cholesky(state, damping)
  vec = x.ndim == chol.ndim - 1
  out = _lapack.cho_solve(chol, x[..., None] if vec else x)
  return out[..., 0] if vec else out
