"""pytest configuration.

* Puts ``tests/`` on ``sys.path`` so that test files can import the shared
  helpers (``import _helpers``, ``import _brute``).
* Compiles with XLA's cheap CPU back-end settings (``XLA_FLAGS``, set here
  before JAX is imported, and inherited by the notebook kernels and the
  multi-process workers the tests start): the suite's time is mostly XLA
  compiling many small programs once each (measured on 2 cores: 81 s ->
  52-57 s for ``test_onepass.py`` + ``test_tagging_state.py``). Code
  compiled this way runs slower (a conv net's training scan 5x), so the
  few tests whose time is running long scans compile them at full
  optimisation with ``_helpers.optimized_jit``. The library itself sets no
  flags: users get XLA's defaults.
"""
import os
import sys

_CHEAP_COMPILE = ("--xla_backend_optimization_level=0",
                  "--xla_llvm_disable_expensive_passes=true")
_flags = os.environ.get("XLA_FLAGS", "").split()
_flags += [f for f in _CHEAP_COMPILE
           if not any(g.startswith(f.split("=")[0] + "=") for g in _flags)]
os.environ["XLA_FLAGS"] = " ".join(_flags)

sys.path.insert(0, os.path.dirname(__file__))
