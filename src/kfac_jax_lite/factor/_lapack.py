"""Cholesky factors and triangular solves, one matrix at a time on CPU.

On CPU, jaxlib 0.10's kernels for a *batch* of Cholesky factorisations
(LAPACK ``potrf``) and triangular solves (``trsm``; ``jnp.linalg.inv``'s
LU path too) split the batch over XLA's intra-op thread pool and wait for
the parts on a thread of that same pool (``eigh``'s ``syevd`` did not hang
in the same test). When as many such calls run at once as the pool has
threads (the refreshes of independent factors do), every thread waits for
work that no thread is free to run, and the step never finishes: on a
2-core machine, four independent ``[6, 512, 512]`` Cholesky
factorisations in one jitted function hang (jaxlib 0.10.2; 0.9.1 does
not), eight unbatched ``[512, 512]`` ones do not. So on CPU these
functions hand LAPACK one matrix at a time (``tests/test_lapack_batches.py``
checks the compiled programs): leading batch axes of size > 1 become a ``lax.map`` (a sequential
loop, differentiable like the batched call). Other backends get the
batched call as it is.

A batch that ``jax.vmap`` adds from outside is not seen here: the
callers that vmap over slices (``blocks.Stacked``) loop on CPU instead
(``sequential_on_cpu``).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl


def sequential_on_cpu() -> bool:
  """Whether batches of LAPACK calls run one matrix at a time: when JAX's
  default backend (where a jitted step runs unless placed elsewhere) is the
  CPU."""
  return jax.default_backend() == "cpu"


def _one_at_a_time(fn, *arrays):
  """``fn(*arrays)`` (each array ``[..., n, k]``; leading batch axes
  broadcast), looped over the batch on CPU where it has more than one
  matrix."""
  batch = jnp.broadcast_shapes(*(a.shape[:-2] for a in arrays))
  size = math.prod(batch)
  if size <= 1 or not sequential_on_cpu():
    return fn(*arrays)
  flat = [jnp.broadcast_to(a, batch + a.shape[-2:]).reshape(
      (size,) + a.shape[-2:]) for a in arrays]
  out = jax.lax.map(lambda xs: fn(*xs), tuple(flat))
  return out.reshape(batch + out.shape[-2:])


def cholesky(m):
  """Lower Cholesky factor of ``m [..., n, n]`` (``jnp.linalg.cholesky``)."""
  return _one_at_a_time(jnp.linalg.cholesky, m)


def cho_solve(chol, b):
  """``(L Lᵀ)⁻¹ b`` for lower ``chol [..., n, n]``, ``b [..., n, k]``."""
  return _one_at_a_time(lambda c, x: jsl.cho_solve((c, True), x), chol, b)


def solve_triangular(a, b, **kwargs):
  """``jax.scipy.linalg.solve_triangular(a, b, **kwargs)`` for ``a [..., n,
  n]``, ``b [..., n, k]`` with the same batch axes."""
  return _one_at_a_time(lambda x, y: jsl.solve_triangular(x, y, **kwargs),
                        a, b)
