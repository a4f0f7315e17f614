"""The names of pytree paths: a parameter leaf's (a layer's name) and a
batch leaf's."""
from __future__ import annotations


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
