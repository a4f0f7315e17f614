"""Few reduction kernels for many leaves.

XLA:CPU compiles and launches a kernel per reduction: a sum over each leaf
of a pytree is one kernel per leaf (three for a small one: an elementwise
pass and two reduction stages), and the step's compile time follows that
count. ``pack`` hands the leaves to reduce as few arrays: every leaf of at
least ``SMALL`` elements as it is (its reduction reads it in place, at full
speed), the smaller ones (biases, scales) raveled and concatenated in
groups of at most ``GROUP`` elements (XLA fuses the concatenation into the
reduction, which then reads each element once but more slowly, so the
groups stay small). The grouping depends only on the sizes, so the same
shapes pack the same way (``pack(u)`` and ``pack(g)`` pair up).
"""
from __future__ import annotations

import jax.numpy as jnp

SMALL = 1 << 14
GROUP = 1 << 16


def pack(arrays):
  """``arrays`` (one dtype) as a list of arrays with the same elements."""
  out, group, size = [], [], 0
  for x in arrays:
    if x.size >= SMALL:
      out.append(x)
      continue
    if group and size + x.size > GROUP:
      out.append(jnp.concatenate(group))
      group, size = [], 0
    group.append(jnp.ravel(x))
    size += x.size
  if group:
    out.append(jnp.concatenate(group) if len(group) > 1 else group[0])
  return out
