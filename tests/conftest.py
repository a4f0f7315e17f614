"""pytest configuration: puts ``tests/`` on ``sys.path`` so that test files
can import the shared helpers (``import _helpers``, ``import _brute``).

``x64_mode`` lives in ``_helpers``; it is re-exported here only so that
older ``from conftest import x64_mode`` imports keep working.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from _helpers import x64_mode  # noqa: E402,F401  (re-export)
