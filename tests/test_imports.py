"""The package's layers, read from its own imports (every ``import`` in
``src/`` and ``benchmarks/``, at module level or inside a function).

* No import circle, in ``src/kfac_jax_lite`` or in ``benchmarks/``; a
  submodule's import counts as an import of every package above it (their
  ``__init__`` runs first), except the package root's, which is the public
  facade over the layers and is imported by no layer.
* Each layer imports only the layers below it (``LAYERS``), never one above
  or beside it.
* No module reaches into another subpackage's private (``_``-prefixed)
  modules: what a layer offers the layers above is in its ``__init__`` or a
  public module.
"""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
SRC = os.path.join(ROOT, "src")
PKG = "kfac_jax_lite"

# The layers, lowest first; a subpackage imports only those of a lower rank.
LAYERS = {
    "factor": 0,       # math core: FactorState and the pure functions on it
    "blocks": 1,       # one curvature block per layer kind
    "losses": 1,       # registered losses and their predictive distributions
    "tagging": 2,      # finds the layers (and the loss) in a traced loss
    "estimators": 3,   # loss, gradient and statistics from one pass; describe
    "optimizers": 4,   # kfac, kfac_optimizer, eigen_adam, sharding, health
    "laplace": 4,      # Laplace posteriors on the same curvature
    "influence": 4,    # influence functions (EK-FAC) on the same curvature
    "sharding": 5,     # kfl.sharding: the public face of optimizers.sharding
    "demo": 5,         # python -m kfac_jax_lite.demo (uses the public API)
}


def _modules(root, package):
  """``{module name: file}`` under ``root/package`` (``package`` None: the
  plain scripts of ``root``, each its own top-level module)."""
  out = {}
  base = root if package is None else os.path.join(root, package)
  for dirpath, _, files in os.walk(base):
    for f in files:
      if not f.endswith(".py"):
        continue
      path = os.path.join(dirpath, f)
      rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
      if rel.endswith(".__init__"):
        rel = rel[:-len(".__init__")]
      out[rel] = path
    if package is None:
      break
  return out


def _imports(name, path, known):
  """The modules of ``known`` that ``name`` (at ``path``) imports."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  is_pkg = path.endswith("__init__.py")
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        parts = name.split(".") if is_pkg else name.split(".")[:-1]
        parts = parts[:len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
      else:
        base = node.module or ""
      targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                 for a in node.names]
    else:
      continue
    for t in targets:
      # Importing a.b.c from outside a.b runs a.b's __init__ too (but not
      # the root facade's); inside a.b, a.b is already being imported.
      parts = t.split(".")
      for i in range(len(parts), 1 if parts[0] == PKG else 0, -1):
        m = ".".join(parts[:i])
        inside = (name + ".").startswith(m + ".")
        if m in known and m != name and (i == len(parts) or not inside):
          found.add(m)
  return found


def _graph(root, package):
  known = _modules(root, package)
  return {m: _imports(m, p, known) for m, p in known.items()}


def _cycles(graph):
  """The strongly connected components with more than one module."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def _layer(module):
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else None  # None: the root facade.


def test_no_import_cycle_in_src():
  assert _cycles(_graph(SRC, PKG)) == []


def test_no_import_cycle_in_benchmarks():
  assert _cycles(_graph(os.path.join(ROOT, "benchmarks"), None)) == []


def test_layers_import_only_layers_below():
  graph = _graph(SRC, PKG)
  layers = {_layer(m) for m in graph} - {None}
  assert layers == set(LAYERS), "a new subpackage needs its place in LAYERS"
  upward = []
  for m, targets in graph.items():
    a = _layer(m)
    for t in targets:
      b = _layer(t)
      if a == b:
        continue
      if a is not None and (b is None or LAYERS[b] >= LAYERS[a]):
        upward.append(f"{m} -> {t}")
  assert upward == []


def test_no_reach_into_another_layers_private_modules():
  graph = _graph(SRC, PKG)
  reach = [f"{m} -> {t}" for m, targets in graph.items() for t in targets
           if _layer(m) != _layer(t)
           and any(p.startswith("_") for p in t.split(".")[2:])]
  assert reach == []


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_every_layer_says_what_it_owns_and_may_import(layer):
  path = os.path.join(SRC, PKG, layer, "__init__.py")
  if not os.path.exists(path):
    path = os.path.join(SRC, PKG, layer + ".py")
  with open(path, encoding="utf-8") as f:
    doc = ast.get_docstring(ast.parse(f.read()))
  assert doc, f"{layer} has no docstring"
  if os.path.basename(path) == "__init__.py":
    assert "May import" in doc, f"{layer}'s docstring names no imports"


def test_the_checker_sees_a_cycle_and_an_upward_arrow(tmp_path):
  pkg = tmp_path / PKG
  (pkg / "factor").mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "factor" / "__init__.py").write_text(
      "from kfac_jax_lite.factor import _a\n")
  (pkg / "factor" / "_a.py").write_text(
      "def f():\n  from kfac_jax_lite.factor import _b\n")
  (pkg / "factor" / "_b.py").write_text("import kfac_jax_lite.factor._a\n"
                                        "from kfac_jax_lite import blocks\n")
  (pkg / "blocks.py").write_text("")
  graph = _graph(str(tmp_path), PKG)
  assert _cycles(graph) == [[f"{PKG}.factor._a", f"{PKG}.factor._b"]]
  assert f"{PKG}.blocks" in graph[f"{PKG}.factor._b"]
