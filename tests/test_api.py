"""The public surface: what the top package exports, where the rest lives,
and that no module reaches into another module's private names.

Static checks only (no tracing, no compiles).
"""
import ast
import importlib
import pathlib

import kfac_jax_lite as kfl

SRC = pathlib.Path(kfl.__file__).parent

TOP_LEVEL = {
    "kfac", "KfacState", "kfac_optimizer", "KfacOptimizerState",
    "eigen_adam", "EigenAdamState", "CurvatureOptions", "PreconditionerOptions",
    "value_grad_and_stats", "stats_due", "Estimate", "ESTIMATIONS",
    "with_batch", "with_stats", "inject_hyperparams",
    "describe", "health", "Health",
    "PredictiveDistribution", "gaussian_nll", "l2_loss", "registered_loss",
    "sigmoid_binary_cross_entropy", "softmax_cross_entropy",
    "softmax_cross_entropy_with_integer_labels", "squared_error",
    "FactorState", "update_cov", "damped_matpower", "multiply_inverse",
    "blocks", "estimators", "factor", "influence", "laplace", "losses",
    "sharding", "tagging",
}

# Names that left the top package (issue 10) and the module that owns them.
MOVED = {
    "blocks": ["DiagonalConv", "DiagonalDense", "Full", "KroneckerConv",
               "KroneckerDense", "KroneckerEmbedding", "KroneckerState",
               "NaiveDiagonal", "ScaleAndShift"],
    "factor": ["FactorCache", "damped_cholesky", "factor_value", "init_factor",
               "multiply", "multiply_matpower", "refresh_cache"],
    "tagging": ["Layer", "TaggedLoss", "find_layers"],
}


def test_top_level_all_is_exactly_the_user_api():
  # Changing the top-level surface is a deliberate act: edit this set too.
  assert len(kfl.__all__) == len(set(kfl.__all__))
  assert set(kfl.__all__) == TOP_LEVEL
  for name in kfl.__all__:
    assert getattr(kfl, name) is not None, name
  public = {n for n in vars(kfl) if not n.startswith("_")}
  # Besides __all__, only the submodules that importing the package loads.
  extra = {n for n in public - TOP_LEVEL
           if type(getattr(kfl, n)).__name__ != "module"}
  assert not extra, f"public top-level names outside __all__: {sorted(extra)}"


def test_moved_names_live_in_the_module_that_owns_them():
  for module, names in MOVED.items():
    mod = getattr(kfl, module)
    for name in names:
      assert name in mod.__all__, (module, name)
      assert getattr(mod, name) is not None
      assert not hasattr(kfl, name), f"kfl.{name} should be kfl.{module}.{name}"
  # The design brief's low-level names are the owning module's objects.
  for name in ("FactorState", "update_cov", "damped_matpower",
               "multiply_inverse"):
    assert getattr(kfl, name) is getattr(kfl.factor, name)


def _module_name(path):
  rel = path.relative_to(SRC.parent).with_suffix("")
  parts = list(rel.parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _is_module(name):
  try:
    importlib.import_module(name)
  except ImportError:
    return False
  return True


def _reach_ins(path):
  """``[(line, text)]``: private names of another module used in ``path``.

  Importing a private *module* (``from kfac_jax_lite.blocks import
  _layout``) is how private helpers are shared; importing or reading a
  ``_name`` *defined in* another module is a reach-in.
  """
  tree = ast.parse(path.read_text())
  modules, found = {}, []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module:
      for alias in node.names:
        full = f"{node.module}.{alias.name}"
        if _is_module(full):
          modules[alias.asname or alias.name] = full
        elif alias.name.startswith("_") and not alias.name.startswith("__"):
          found.append((node.lineno, f"from {node.module} import {alias.name}"))
    elif isinstance(node, ast.Import):
      for alias in node.names:
        if alias.asname:
          modules[alias.asname] = alias.name
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id in modules and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and not _is_module(f"{modules[node.value.id]}.{node.attr}")):
      found.append((node.lineno, f"{node.value.id}.{node.attr}"))
  return found


def test_no_module_reaches_into_another_modules_private_names():
  found = {}
  for path in sorted(SRC.rglob("*.py")):
    hits = _reach_ins(path)
    if hits:
      found[_module_name(path)] = hits
  assert not found, f"private reach-ins: {found}"


def test_the_reach_in_check_finds_one(tmp_path):
  path = tmp_path / "m.py"
  path.write_text("from kfac_jax_lite import factor as fac\n"
                  "from kfac_jax_lite.factor import _damped\n"
                  "from kfac_jax_lite.blocks import _layout\n"
                  "x = fac._eye_like\n"
                  "y = _layout.flatten\n")
  assert [t for _, t in _reach_ins(path)] == [
      "from kfac_jax_lite.factor import _damped", "fac._eye_like"]


def test_package_is_typed():
  """PEP 561: ``py.typed`` ships in the package (pyproject's package-data)."""
  assert (SRC / "py.typed").is_file()
  pyproject = (SRC.parent.parent / "pyproject.toml").read_text()
  assert 'kfac_jax_lite = ["py.typed"]' in pyproject
