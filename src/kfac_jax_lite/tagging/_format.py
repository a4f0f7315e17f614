"""Turn captured arrays into the ``compute_stats`` argument layouts.

Every axis of a captured input or probed output carries a label:
``("b", i)`` the i-th activation axis that is not a parameter axis (``b0``
is the example axis), ``("k", d)`` axis ``d`` of the parameter leaf,
``("c", p)`` axis ``p`` of a convolution's own layout, ``("iv", p)`` the
index-vector axis of a gather, ``("u",)`` a unit axis to drop. Enclosing
``lax.scan`` levels prepend ``("L",)`` (the parameter is stacked along that
level: one layer per step) or ``("t", j)`` (a layer reused at every step:
a weight-sharing axis).
"""
from __future__ import annotations

import typing

import jax
import jax.numpy as jnp
import numpy as np


def level_labels(use):
  """Labels of the axes that enclosing scans prepend to ``use``'s arrays."""
  stacked = set()
  for view in use.roles.values():
    stacked.update(view.stacked)
  return tuple(("L",) if lk in stacked else ("t", j)
               for j, (lk, _) in enumerate(use.levels))


def _key(label, korder):
  tag = label[0]
  if tag == "L":
    return (0,)
  if tag == "S":
    return (1,)
  if tag == "b":
    return (2,) if label[1] == 0 else (4, label[1])
  if tag == "t":
    return (3, label[1])
  if tag == "k":
    return (5, korder.index(label[1]))
  if tag == "c":
    return (6, label[1])
  if tag == "iv":
    return (7,)
  raise ValueError(label)


def arrange(arr, labels, korder=(), samples=False):
  """Transpose ``arr`` (axes ``labels``, plus a leading samples axis when
  ``samples``) into ``[L?, S?, N, *t, *b, *k-in-korder]`` (or the conv
  layout), dropping unit axes. Works on shapes too (``arr`` a tuple)."""
  labels = ((("S",),) if samples else ()) + tuple(labels)
  is_shape = isinstance(arr, tuple)
  shape = arr if is_shape else arr.shape
  if len(shape) != len(labels):
    raise ValueError(f"array of shape {shape} does not match {len(labels)} "
                     "labelled axes")
  keep = [i for i, l in enumerate(labels) if l[0] != "u"]
  order = sorted(keep, key=lambda i: _key(labels[i], list(korder)))
  if is_shape:
    return tuple(shape[i] for i in order), [labels[i] for i in order]
  arr = arr.reshape(tuple(shape[i] for i in keep)) if len(keep) < len(
      labels) else arr
  pos = {i: j for j, i in enumerate(keep)}
  arr = jnp.transpose(arr, [pos[i] for i in order])
  return arr, [labels[i] for i in order]


def arranged(use, x, korder=(), samples=False, out=True) -> jax.Array:
  """``use``'s captured input (``out=False``) or probed output ``x``, with
  the axes its enclosing scans prepend, arranged by ``arrange``."""
  labels = level_labels(use) + (use.out_labels if out else use.in_labels)
  # x is an array here, so arrange returns one (a shape only for a shape).
  return typing.cast(jax.Array, arrange(x, labels, korder, samples)[0])


def stacked_shape(use, aval):
  return tuple(n for _, n in use.levels) + tuple(aval.shape)


def one_hot(ids, n, dtype):
  return (ids[..., None] == np.arange(n)).astype(dtype)
