"""``kfl``, the library, for every benchmark: the installed package, or this
checkout's ``src/`` when it is not installed (the lowest module of
``benchmarks/``: it imports none of the others)."""
from __future__ import annotations

import os
import sys

try:
  import kfac_jax_lite as kfl
except ImportError:  # Not installed: run from a checkout (src layout).
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                  os.pardir, "src"))
  import kfac_jax_lite as kfl

__all__ = ["kfl"]
