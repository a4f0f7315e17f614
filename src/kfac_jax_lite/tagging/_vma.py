"""Varying manual axes (``shard_map(check_vma=True)``) of traced values.

Inside ``shard_map`` with ``check_vma=True`` every value's type records the
mesh axes it varies over (its *vma*): the batch shards vary over the data
axis, replicated parameters do not. A primitive needs operands of one vma,
and JAX's own wrappers (``jnp``, ``lax.add``, ...) insert the ``pvary``
casts that make them so while tracing. The tagged loss is a jaxpr replayed
by binding its primitives directly, so it must be traced with the vma of
the values it will be applied to (then the casts are in the jaxpr), and the
zeros it adds as probes or captures must carry the vma of the values they
stand beside: the cotangent of an invariant probe added to a varying output
would be summed over the devices (the transpose of ``pvary`` is ``psum``).

Outside ``shard_map`` (or with ``check_vma=False``) every vma is empty and
these functions change nothing. The aval field is ``vma`` in jax 0.9.x and
``manual_axis_type.varying`` in 0.10.x; both are read by feature check.
"""
from __future__ import annotations

import jax
import jax.core  # Explicit, so that type checkers see jax.core.Tracer.
import jax.numpy as jnp
import numpy as np
from jax import lax


def aval_vma(aval) -> frozenset:
  """The mesh axes an abstract value varies over (empty outside
  ``shard_map(check_vma=True)``)."""
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", None) or ())


def vma(x) -> frozenset:
  """The mesh axes the traced value ``x`` varies over (empty for a
  concrete array, a ``ShapeDtypeStruct`` or a Python scalar)."""
  if not isinstance(x, jax.core.Tracer):
    return frozenset()
  return aval_vma(jax.typeof(x))


def tree_vma(tree) -> frozenset:
  """The mesh axes any leaf of ``tree`` varies over."""
  return frozenset().union(*(vma(x) for x in jax.tree.leaves(tree)))


def abstract(x):
  """The abstract value ``loss_fn`` is traced at: shape and dtype, and
  the vma of a traced ``x`` varying over manual mesh axes."""
  if vma(x):
    return jax.typeof(x).update(weak_type=False)
  return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))


def cast(x, axes):
  """``x`` made to vary over ``axes`` too (``lax.pcast(..., to="varying")``,
  in jax 0.9.1 and 0.10; a no-op for the axes it already varies over, and
  for no axes)."""
  missing = frozenset(axes) - vma(x)
  if not missing:
    return x
  return lax.pcast(x, tuple(sorted(missing, key=str)), to="varying")


def zeros(shape, dtype, aval):
  """Zeros of ``shape``/``dtype`` that vary over the axes ``aval`` does."""
  return cast(jnp.zeros(shape, dtype), aval_vma(aval))
