"""The names of pytree paths: a parameter leaf's (a layer's name) and a
batch leaf's, the same whether or not the arrays sit in framework wrappers
(flax ``nnx.Variable``s: ``nnx.split(model, nnx.Param)`` gives a state of
them, whose flattening adds a ``.value`` element to every path)."""
from __future__ import annotations

import jax


def is_wrapper(x) -> bool:
  """Whether ``x`` is a flax ``Variable`` (``nnx.Param``, ``OptArray``,
  ...): an object of a ``flax`` module with ``get_value``. Duck-typed, so
  that flax stays an optional dependency."""
  t = type(x)
  return t.__module__.startswith("flax.") and hasattr(t, "get_value")


def path_name(path):
  """``params/Dense_0/kernel`` from a key path."""
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts) if parts else "params"


def named_leaves(tree) -> list:
  """``[(name, leaf)]`` in ``jax.tree.leaves(tree)``'s order, each leaf
  named by ``path_name`` of its path without the element a wrapper adds:
  ``fc1/kernel`` for a plain array and for an ``nnx.Param`` alike, so that
  ``describe``, the estimate, the transforms and the ``blocks=``/``exclude=``
  patterns agree on a model however it was split."""
  out = []
  for path, node in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=is_wrapper)[0]:
    inner = jax.tree_util.tree_flatten_with_path(node)[0]
    if is_wrapper(node) and len(inner) == 1:
      out.append((path_name(path), inner[0][1]))
    else:
      out.extend((path_name(path + p), leaf) for p, leaf in inner)
  return out
