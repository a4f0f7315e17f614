"""Shared test helpers."""
import contextlib
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(__file__))


def x64_mode(enabled: bool):
  """A context with float64 enabled (or a no-op)."""
  if not enabled:
    return contextlib.nullcontext()
  enable = getattr(jax, "enable_x64", None)
  if enable is None:  # Older JAX.
    from jax.experimental import enable_x64 as enable
  return enable(True)
