"""The API reference (``mkdocs.yml``, ``docs/``) covers the public surface.

Every name in ``kfac_jax_lite.__all__`` and in the public submodules'
``__all__`` has a non-empty docstring (read from the source as mkdocstrings
reads it: a function's or class's own docstring, a constant's string literal
right after its assignment) and is rendered by a ``::: kfac_jax_lite...``
directive of some page under ``docs/``. Static checks only: no mkdocs needed
(``mkdocs build --strict`` in ``.ci/run`` checks that the pages render).
"""
import ast
import functools
import importlib
import importlib.util
import pathlib
import re

import kfac_jax_lite as kfl

SRC = pathlib.Path(kfl.__file__).parent
DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
PUBLIC_MODULES = ("blocks", "estimators", "factor", "influence", "laplace",
                  "losses", "sharding", "tagging")


def _public_names():
  """``[(module, name)]``: every name of every public ``__all__``."""
  out = [("kfac_jax_lite", n) for n in kfl.__all__]
  for sub in PUBLIC_MODULES:
    mod = importlib.import_module(f"kfac_jax_lite.{sub}")
    assert hasattr(mod, "__all__"), f"kfac_jax_lite.{sub} has no __all__"
    out += [(mod.__name__, n) for n in mod.__all__]
  for module, name in out:
    assert hasattr(importlib.import_module(module), name), (module, name)
  return out


@functools.cache
def _tree(module):
  mod = importlib.import_module(module)
  return ast.parse(pathlib.Path(mod.__file__).read_text())


def _docstring(module, name, depth=0):
  """The docstring of ``module.name`` as its source gives it, following
  ``from ... import name`` to the module that defines it."""
  assert depth < 10, (module, name)
  full = f"{module}.{name}"
  if _is_submodule(module, name):
    return ast.get_docstring(_tree(full))
  body = _tree(module).body
  for i, node in enumerate(body):
    if (isinstance(node, (ast.FunctionDef, ast.ClassDef))
        and node.name == name):
      return ast.get_docstring(node)
    targets = (node.targets if isinstance(node, ast.Assign)
               else [node.target] if isinstance(node, ast.AnnAssign) else [])
    if any(isinstance(t, ast.Name) and t.id == name for t in targets):
      nxt = body[i + 1] if i + 1 < len(body) else None
      if (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
          and isinstance(nxt.value.value, str)):
        return nxt.value.value
      return None
  for node in body:
    if isinstance(node, ast.ImportFrom) and node.module:
      for alias in node.names:
        if (alias.asname or alias.name) == name:
          return _docstring(node.module, alias.name, depth + 1)
  raise AssertionError(f"{full}: no definition found in the source")


def _is_submodule(module, name):
  if not hasattr(importlib.import_module(module), "__path__"):
    return False
  return importlib.util.find_spec(f"{module}.{name}") is not None


def _documented():
  """The identifiers of every ``::: identifier`` directive under docs/."""
  found = set()
  for page in DOCS.rglob("*.md"):
    for m in re.finditer(r"^:::\s+(\S+)", page.read_text(), re.MULTILINE):
      found.add(m.group(1))
  return found


def test_every_public_name_has_a_docstring():
  missing = [f"{m}.{n}" for m, n in _public_names()
             if not (_docstring(m, n) or "").strip()]
  assert not missing, f"public names without a docstring: {missing}"


def test_every_public_name_is_in_the_api_reference():
  documented = _documented()
  missing = [f"{m}.{n}" for m, n in _public_names()
             if f"{m}.{n}" not in documented]
  assert not missing, (
      f"public names in no docs/ page's ':::' directive: {missing}")


def test_the_docstring_check_finds_a_constant_without_one():
  # ``PER_EXAMPLE_FALLBACKS`` is documented by a comment, not a docstring.
  assert _docstring("kfac_jax_lite.estimators", "PER_EXAMPLE_FALLBACKS") is None
  assert _docstring("kfac_jax_lite", "kfac")
  assert _docstring("kfac_jax_lite", "blocks")
