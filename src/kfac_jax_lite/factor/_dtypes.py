"""The one "at least float32" rule of the library's arithmetic.

Curvature, statistics and posteriors are kept in the widest floating dtype
of their inputs, at least float32: bf16/fp16 parameters or activations get
float32 factors, float64 ones (under ``jax_enable_x64``) float64 ones.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _dtype(x):
  if isinstance(x, (np.dtype, type)):
    return np.dtype(x)
  return jnp.result_type(x)


def float_dtype(*trees):
  """The widest floating dtype among the leaves of ``trees``, at least float32.

  Args:
    *trees: pytrees whose leaves are arrays, scalars or dtypes; leaves that
      are not floating (integer labels, PRNG keys) are ignored.

  Returns:
    ``jnp.result_type(float32, *floating dtypes)``: float32 for bf16/fp16
    or no floating leaf at all, float64 when one leaf is float64.
  """
  dtypes = [_dtype(x) for x in jax.tree.leaves(trees)]
  return jnp.result_type(jnp.float32, *[
      d for d in dtypes if jnp.issubdtype(d, jnp.floating)])
