"""Inverses of symmetric positive-definite matrices built from matrix products.

On CPU, jaxlib's ``cholesky``/``eigh``/``triangular_solve`` call LAPACK
(scipy's OpenBLAS, with a thread pool of its own that competes with XLA's),
and on TPUs they are slow next to matrix products. The algorithms here
run as XLA matrix products plus a short loop of rank-one updates, in XLA's
own threads, the same way on every backend. All take ``m [..., n, n]``
(leading axes are a batch) and compute ``m⁻¹`` in ``m``'s dtype; products
use ``Precision.HIGHEST`` (TPUs and recent GPUs otherwise round float32
operands to bfloat16 / TF32).

* ``gauss_jordan_inverse`` — blocked Gauss–Jordan elimination without
  pivoting, in its symmetric form (the sweep operator, Goodnight 1979).
  With ``B`` the pivot block of rows/columns ``k`` (``nb`` wide), ``C`` the
  current column block and ``P = C_k`` the pivot, one step is

      W = C P⁻¹,   A ← A − W Cᵀ,   A[:, k] ← W,   A[k, :] ← Wᵀ,   A[k, k] ← −P⁻¹

  and after sweeping every block ``A = −m⁻¹``. By symmetry the row write
  is never made (the matrix is mirrored at the end), which saves a pass
  over the matrix per step: the sweep is bound by memory traffic more
  than by flops on CPU (measured: 5-8% of its time on the autoencoder's
  factors). ``P⁻¹`` comes from scalar
  Gauss–Jordan (``nb`` rank-one updates). ``2n³`` flops, all but ``O(n²·nb)``
  of them in ``[n, nb] × [nb, n]`` products. The pivots are those of
  Cholesky / LDLᵀ without pivoting, so ``m`` is numerically positive
  definite exactly when every pivot is positive: that is the returned
  ``ok``, and then the accuracy is that of a Cholesky-based inverse
  (Higham 2002, §14.4).
* ``schur_inverse`` — one Schur-complement split. ``m = [[A, B], [Bᵀ, D]]``
  split near ``n/2`` (at a multiple of the pivot block) when ``n`` exceeds
  ``leaf_size``; then ``m⁻¹ = [[A⁻¹ + W S⁻¹ Wᵀ, −W S⁻¹], [−S⁻¹ Wᵀ, S⁻¹]]``
  with ``W = A⁻¹ B`` and the Schur complement ``S = D − Bᵀ W`` (positive
  definite when ``m`` is), ``A⁻¹`` and ``S⁻¹`` by ``gauss_jordan_inverse``.
  ``W`` gets one step of iterative refinement, ``W ← W + A⁻¹(B − A W)``:
  formed as ``A⁻¹ B`` alone it carries the ``κ(A)·ε`` error of the computed
  ``A⁻¹``, which swamps the small eigenvalues of ``S`` (measured: 10-1000×
  Cholesky's forward error, and non-positive pivots at ``κ(m)·ε ≈ 0.1``);
  refined, the forward error stays within about 2× that of
  ``gauss_jordan_inverse`` (``benchmarks/README.md``). Recursing (splitting
  ``A`` and ``S`` again) was faster still but failed at ``κ(m)·ε ≈ 0.1``
  even refined, so there is one split. ``A``'s pivots and ``S``'s are
  those of ``m``'s LDLᵀ without pivoting (``S`` is the Schur complement of
  a matrix near ``m``), so ``ok`` means what it means for
  ``gauss_jordan_inverse``. Flops: six products of size ``n/2``
  (``1.5n³``) plus two sweeps of size ``n/2`` (``n³/2``): ``2n³`` like the
  sweep of the whole, but three quarters of them in square products, which
  run at matmul speed where the sweep's rank-64 updates do not.
* ``newton_schulz_inverse`` — ``X ← X + X R`` with ``R = I − m X``, from a
  warm start ``x0`` (the previous refresh's inverse: factors move slowly).
  ``R`` is squared each step (``R_{k+1} = R_k²``), so from ``‖R₀‖ < 1`` the
  error falls quadratically until rounding stops it; it iterates while
  ``‖R‖_F`` at least halves, keeps the best iterate, and reports
  ``converged`` when the residual is at rounding level,
  ``‖R‖_F ≤ n·ε·‖m‖_F·‖X‖_F`` (the residual of a backward-stable inverse).
  ``4n³`` flops a step.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kfac_jax_lite.factor import _packing

HIGHEST = lax.Precision.HIGHEST
BLOCK_SIZE = 64  # Pivot block width of gauss_jordan_inverse (measured on CPU).
# Largest matrix schur_inverse sweeps whole (larger ones are split once).
# Measured on the MNIST autoencoder's 16 factors (2-core CPU,
# benchmarks/README.md): 0.75-0.86x gauss_jordan's time, its program 1.5x
# gauss_jordan's fusions (XLA:CPU compiles a kernel per fusion).
LEAF_SIZE = 512
# Stacks per padded size in gauss_jordan_inverses. Measured on the 2-core
# CPU (102 factors of a 6-block transformer, 16 of the MNIST autoencoder):
# one stack per size ran 1.3x and 1.1x slower than one sweep per matrix
# (XLA:CPU runs a batched product's matrices on one thread, independent
# loops side by side); two ran 0.99x and 0.89x, four 1.2x and 0.95x. The
# compile was the same with one or two.
STACKS = 2


def _mm(a, b):
  return jnp.matmul(a, b, precision=HIGHEST)


def _t(x):
  return jnp.swapaxes(x, -1, -2)


def _leaf_inverse(p):
  """Scalar Gauss–Jordan: ``(p⁻¹, smallest pivot)`` for ``p [..., n, n]``
  (the smallest pivot of each matrix: ``p.shape[:-2]``)."""
  n = p.shape[-1]
  idx = jnp.arange(n)

  def step(k, carry):
    a, low = carry
    col = lax.dynamic_index_in_dim(a, k, axis=-1, keepdims=False)  # [..., n]
    pivot = lax.dynamic_index_in_dim(col, k, axis=-1, keepdims=True)
    # Column k becomes e_k; then row k is scaled by 1/pivot and eliminated
    # from every other row (row k itself ends as that scaled row).
    a = jnp.where(idx == k, (idx[:, None] == k).astype(a.dtype), a)
    row = lax.dynamic_index_in_dim(a, k, axis=-2, keepdims=False) / pivot
    factor = jnp.where(idx == k, pivot - 1, col)
    a = a - factor[..., :, None] * row[..., None, :]
    return a, jnp.minimum(low, pivot[..., 0])

  # With p's vma (shard_map); one smallest pivot per matrix of the batch.
  init = (p, jnp.full_like(p, jnp.inf, shape=p.shape[:-2]))
  return lax.fori_loop(0, n, step, init)


def _padded_size(n, block_size):
  """The side ``_pad`` gives an ``n``-wide matrix: a multiple of
  ``block_size``, one block at least."""
  return max(1, -(-n // block_size)) * block_size


def _pad(m, block_size):
  """``m`` padded to a multiple of ``block_size`` with an identity block.

  ``m ⊕ I`` is block diagonal: its inverse is ``m⁻¹ ⊕ I``, and every
  elimination step on the real rows meets the padding only through exact
  zeros (``x − 0·y = x``), so the top-left ``n × n`` block of either
  elimination here is the one of ``m`` unpadded, bit for bit where ``m``
  is finite (the padding's pivots are 1). A matrix narrower than one block
  is padded to one block, so that all of them share one scalar elimination
  (the sweep's own, on its pivot blocks) instead of one per size.
  """
  n = m.shape[-1]
  size = _padded_size(n, block_size)
  if size == n:
    return m
  pad = [(0, 0)] * (m.ndim - 2) + [(0, size - n), (0, size - n)]
  return jnp.pad(m, pad) + jnp.diag(jnp.arange(size) >= n).astype(m.dtype)


def _negated_padded(a, block_size):
  """``(−a⁻¹, smallest pivot)`` for ``a`` a multiple of ``block_size`` wide:
  scalar Gauss–Jordan for one block, the blocked sweep for more."""
  if a.shape[-1] == block_size:
    return _negated_leaf_inverse(a)
  return _sweep(a, block_size)


def _negated_gauss_jordan(m, block_size):
  """``(−m⁻¹, smallest pivot)`` by the blocked sweep (``gauss_jordan_inverse``).

  The sweep ends with ``−m⁻¹``; returning it as it is saves a pass over the
  matrix (and a compiled kernel) where the caller folds the sign in. The
  matrix is padded to a multiple of ``block_size`` (``_pad``; one block at
  least) and swept by one jitted function per padded size: factors of
  nearby sizes (a layer's 785-wide input factor and its 784-wide output
  one, the encoder's layers and the decoder's) then share one trace and
  one lowering of the sweep, and XLA compiles the kernels they share once.
  Sixteen sweeps traced one by one were about 40% of the time spent
  tracing and lowering the MNIST autoencoder's K-FAC step, which now takes
  1.4-2.5 s instead of 1.8-3.2 s; XLA inlines the calls, so the compiled
  program is the same.
  """
  n = m.shape[-1]
  a, low = _negated_padded(_pad(m, block_size), block_size)
  return a[..., :n, :n], low


@jax.jit
def _negated_leaf_inverse(m):
  """``(−m⁻¹, smallest pivot)`` by scalar Gauss–Jordan, symmetrised."""
  inv, low = _leaf_inverse(m)
  return -(inv + _t(inv)) / 2, low


@functools.partial(jax.jit, static_argnames="block_size")
def _sweep(a, block_size):
  """``(−a⁻¹, smallest pivot)`` for ``a`` a multiple of ``block_size`` wide
  (the smallest pivot of each matrix of the batch).

  Row block ``k`` is never written (by symmetry it is the transpose of
  column block ``k``): each step then makes one pass over the matrix
  fewer, which is most of a step's memory traffic. Entry ``(i, j)`` is
  therefore current where block(i) ≤ block(j) (its last write was a
  column write) or neither block is swept; the pivot's column block reads
  its swept rows from the pivot's row block instead, and the result is
  mirrored from the upper block triangle (exactly symmetric).
  """
  size = a.shape[-1]
  rows = jnp.arange(size)[:, None]

  def sweep(k, carry):
    a, low = carry
    start = k * block_size
    col = lax.dynamic_slice_in_dim(a, start, block_size, axis=-1)
    row = lax.dynamic_slice_in_dim(a, start, block_size, axis=-2)
    col = jnp.where(rows < start, _t(row), col)  # Swept rows: from row k.
    pivot = lax.dynamic_slice_in_dim(col, start, block_size, axis=-2)
    pivot_inv, pivot_low = _leaf_inverse(pivot)
    w = _mm(col, pivot_inv)
    a = a - _mm(w, _t(col))
    w = lax.dynamic_update_slice_in_dim(w, -pivot_inv, start, axis=-2)
    a = lax.dynamic_update_slice_in_dim(a, w, start, axis=-1)
    return a, jnp.minimum(low, pivot_low)

  init = (a, jnp.full_like(a, jnp.inf, shape=a.shape[:-2]))
  a, low = lax.fori_loop(0, size // block_size, sweep, init)
  # Kept: the upper block triangle, and the upper triangle of each diagonal
  # block (whose two halves agree only up to rounding): exactly symmetric.
  i = jnp.arange(size)
  upper = (i[:, None] // block_size < i[None, :] // block_size) | (
      i[:, None] <= i[None, :])
  return jnp.where(upper, a, _t(a)), low


def _finish(negated_inv, low, symmetric=False):
  """``(m⁻¹, ok)`` from ``−m⁻¹`` and the smallest pivots (``ok`` one scalar
  for the whole batch); ``negated_inv`` is symmetrised unless it is
  ``symmetric`` already."""
  inv = -negated_inv if symmetric else -(negated_inv + _t(negated_inv)) / 2
  # One reduction (isfinite then all would write a boolean matrix first).
  return inv, jnp.all(low > 0) & _packing.all_finite(inv)


def gauss_jordan_inverse(m, block_size: int = BLOCK_SIZE):
  """``(m⁻¹, ok)`` for symmetric ``m [..., n, n]`` by blocked Gauss–Jordan.

  ``ok`` (a scalar bool) says every pivot was positive and finite, i.e.
  ``m`` is numerically positive definite (like a successful Cholesky). The
  matrix is padded to a multiple of ``block_size`` with an identity block
  (whose inverse is itself, so the top-left block of the result is exact).
  """
  n = m.shape[-1]
  inv, ok = _padded_gauss_jordan(_pad(m, block_size), block_size)
  return inv[..., :n, :n], ok


def gauss_jordan_inverses(ms, block_size: int = BLOCK_SIZE):
  """``[(m⁻¹, ok)]`` for a list of symmetric ``m [..., n, n]`` of any sizes,
  as ``gauss_jordan_inverse`` of each, computed together.

  The matrices are padded (``_pad``) and stacked by padded size and dtype
  (in ``STACKS`` stacks, dealt round-robin, so that XLA:CPU runs them side
  by side), and each stack is swept as one batch: a loop and a set of
  kernels per stack instead of one loop per matrix. XLA inlines every call
  of a jitted function, so a model's dozens of equal factors were dozens
  of copies of the sweep's loop in the compiled program (on a 12-block
  transformer, half of the update's compile time went to the refresh).
  The results are those of the matrices swept one by one: the batch
  shares no arithmetic. ``ok`` is each input's own verdict (its matrices'
  pivots and finiteness).
  """
  groups = {}
  for i, m in enumerate(ms):
    size = _padded_size(m.shape[-1], block_size)
    groups.setdefault((size, jnp.dtype(m.dtype)), []).append(i)
  chunks = []
  for (size, _), members in groups.items():
    parts = min(STACKS, len(members))
    chunks += [(size, members[j::parts]) for j in range(parts)]
  out: list = [None] * len(ms)
  for size, members in chunks:
    flat = [_pad(ms[i], block_size).reshape(-1, size, size) for i in members]
    neg_inv, low = _negated_padded(jnp.concatenate(flat), block_size)
    ok = (low > 0) & jnp.isfinite(jnp.sum(neg_inv - neg_inv, axis=(-2, -1)))
    start = 0
    for i, part in zip(members, flat):
      m, stop = ms[i], start + part.shape[0]
      n = m.shape[-1]
      inv = -neg_inv[start:stop, :n, :n].reshape(m.shape)
      out[i] = inv, jnp.all(ok[start:stop])
      start = stop
  return out


class Batch:
  """The ``method`` ``factor.batched_inverses`` hands its function in
  place of ``"gauss_jordan"``: it records the damped matrices of the first
  pass (``inverse`` answers zeros) and answers the second pass from
  ``results`` (``gauss_jordan_inverses`` of the recorded ones), in the
  order they were asked for."""

  def __init__(self):
    self.matrices: list[jax.Array] = []
    self.results: list[tuple[jax.Array, jax.Array]] | None = None

  def inverse(self, m):
    """``(m⁻¹, ok)`` for a damped matrix ``m``, as the pass requires."""
    if self.results is None:
      self.matrices.append(m)
      return jnp.zeros_like(m), jnp.ones((), bool)
    if not self.results:
      raise RuntimeError("batched_inverses: the second pass asked for more "
                         "inverses than the first")
    inv, ok = self.results.pop(0)
    if inv.shape != m.shape or inv.dtype != m.dtype:
      raise RuntimeError(
          f"batched_inverses: the second pass asked for a {m.dtype} "
          f"{m.shape} inverse where the first asked for {inv.dtype} "
          f"{inv.shape}: the function must ask for the same inverses in "
          f"the same order each time")
    return inv, ok

  def compute(self):
    """Inverts the recorded matrices together, for the second pass."""
    self.results = gauss_jordan_inverses(self.matrices)


@functools.partial(jax.jit, static_argnames="block_size")
def _padded_gauss_jordan(a, block_size):
  """``gauss_jordan_inverse`` of an ``a`` already padded (``_pad``).

  The negation and the finiteness check run on the padded matrix, in this
  function of the padded size only: XLA:CPU compiles a kernel per distinct
  fusion and shape, so the factors that share a padded size share these
  kernels as well as the sweep's (the MNIST autoencoder's K-FAC step:
  369 distinct kernels instead of 385, its StableHLO 494k characters
  instead of 509k). The verdict is the one of the unpadded inverse: the
  padding meets the real entries only through zeros, which stay finite
  unless a real entry is not, and a non-finite real entry stays
  non-finite to the end of the elimination.
  """
  return _finish(*_negated_padded(a, block_size), symmetric=True)


def _negated_schur(m, leaf_size, block_size) -> tuple[jax.Array, jax.Array]:
  """``(−m⁻¹, smallest pivot)`` by one Schur-complement split.

  With ``N_A = −A⁻¹``, ``V = N_A B`` (refined once), ``S = D + Bᵀ V``,
  ``N_S = −S⁻¹`` and ``U = V N_S``: ``−m⁻¹ = [[N_A + U Vᵀ, U], [Uᵀ, N_S]]``
  (no negations). ``A⁻¹`` and ``S⁻¹`` come from the sweep.
  """
  n = m.shape[-1]
  if n <= leaf_size:
    return _negated_gauss_jordan(m, block_size)
  # Split near n/2 at a multiple of the pivot block: only S's sweep pads.
  h = max(1, round(n / 2 / block_size)) * block_size
  a, b, d = m[..., :h, :h], m[..., :h, h:], m[..., h:, h:]
  neg_a_inv, a_low = _negated_gauss_jordan(a, block_size)
  v = _mm(neg_a_inv, b)  # −A⁻¹ B
  # One step of iterative refinement (residual B − A W, W = −V): without it
  # S inherits the κ(A)·ε error of the computed A⁻¹ (see the module docstring).
  v = v + _mm(neg_a_inv, b + _mm(a, v))
  neg_s_inv, s_low = _negated_gauss_jordan(d + _mm(_t(b), v), block_size)
  u = _mm(v, neg_s_inv)  # A⁻¹ B S⁻¹
  top = jnp.concatenate([neg_a_inv + _mm(u, _t(v)), u], axis=-1)
  bottom = jnp.concatenate([_t(u), neg_s_inv], axis=-1)
  return jnp.concatenate([top, bottom], axis=-2), jnp.minimum(a_low, s_low)


def schur_inverse(m, leaf_size: int = LEAF_SIZE, block_size: int = BLOCK_SIZE):
  """``(m⁻¹, ok)`` for symmetric ``m [..., n, n]`` by recursive Schur complements.

  ``ok`` (a scalar bool) says every leaf pivot was positive and finite, i.e.
  ``m`` is numerically positive definite (see the module docstring).
  ``leaf_size``: a matrix of at most this size is inverted by the blocked
  Gauss–Jordan sweep with pivot blocks of ``block_size`` (at least as big)
  directly; a larger one is split once, near half at a multiple of
  ``block_size``, and its two diagonal blocks swept.
  """
  if leaf_size < block_size:
    raise ValueError(f"schur_inverse: leaf_size ({leaf_size}) must be at "
                     f"least block_size ({block_size})")
  return _finish(*_negated_schur(m, leaf_size, block_size))


def _frobenius(x):
  return jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1)))


def newton_schulz_inverse(m, x0, max_iterations: int = 10):
  """``(X, converged)``: Newton–Schulz iterations for ``m⁻¹`` from ``x0``.

  See the module docstring for the stopping rule. Batch axes iterate
  together (the worst residual decides); ``converged`` is a scalar bool.
  """
  n = m.shape[-1]
  eye = jnp.eye(n, dtype=m.dtype)
  eps = jnp.finfo(m.dtype).eps

  def residual(x):
    r = eye - _mm(m, x)
    return r, jnp.max(_frobenius(r))

  def keep_going(carry):
    k, _, _, _, improving = carry
    return (k < max_iterations) & improving

  def step(carry):
    k, x, r, err, _ = carry
    x_new = x + _mm(x, r)
    r_new, err_new = residual(x_new)
    better = err_new <= err  # NaN compares False: keeps the last good one.
    x, r, err_out = (jnp.where(better, x_new, x), jnp.where(better, r_new, r),
                     jnp.where(better, err_new, err))
    return k + 1, x, r, err_out, err_new < err / 2

  r0, err0 = residual(x0)
  _, x, _, err, _ = lax.while_loop(
      keep_going, step, (0, x0, r0, err0, jnp.isfinite(err0)))
  scale = jnp.max(_frobenius(m) * _frobenius(x))
  converged = jnp.isfinite(err) & (err <= n * eps * scale)
  return (x + _t(x)) / 2, converged
