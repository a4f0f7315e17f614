"""The names of pytree paths: a parameter leaf's (a layer's name) and a
batch leaf's, the same whether or not the arrays sit in framework wrappers
(flax ``nnx.Variable``s: ``nnx.split(model, nnx.Param)`` gives a state of
them, whose flattening adds a ``.value`` element to every path), and the
one matcher of the ``blocks=`` keys and ``exclude=`` patterns that name
them."""
from __future__ import annotations

import difflib
import fnmatch

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


def matches(pattern: str, path: str) -> bool:
  """Whether ``pattern`` names ``path``: the path itself, or an ``fnmatch``
  pattern matching all of it (case-sensitive; ``*`` crosses ``/``). A
  prefix is no match: ``"l0"`` names no ``l0/w``, ``"l0/*"`` does."""
  return path == pattern or fnmatch.fnmatchcase(path, pattern)


def unmatched(pattern: str, paths) -> str:
  """What to say of ``pattern`` matching none of ``paths``: the paths
  nearest to it (those under it when it is a prefix, with the pattern that
  takes them; else the five most alike, ``difflib``'s ratio)."""
  stem = pattern.rstrip("/*")
  under = [p for p in paths if p.startswith(stem + "/")]
  near = under or difflib.get_close_matches(pattern, paths, 5, cutoff=0.0)
  shown = ", ".join(near[:5]) + (", ..." if len(near) > 5 else "")
  hint = (f"; to take the parameters under it use the pattern "
          f"{stem + '/*'!r}" if under else "")
  return f"the nearest of its {len(paths)} paths: {shown}{hint}"
