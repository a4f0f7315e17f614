"""The check, at the first update, that a ``kfl.kfac`` state belongs to
this transform and these params (issue 38).

A state made by ``tx.init`` for other params (one more layer), or
restored from a checkpoint of another configuration (``blocks=``,
``damping_mode=``, ``layout=``), used to fail deep inside the stages
(``KeyError: '2/w'``, ``'KroneckerState' object has no attribute
'cov'``) or with an error that did not mention the checkpoint. As orbax
refuses a restore whose tree does not match its target, ``check``
compares, at trace time, the state's blocks with those this transform's
``init`` would make for ``params`` (names, state types, shapes and
dtypes; ``jax.eval_shape``, nothing computed) and raises one
``ValueError`` naming both. The sharded layout has its own check
(``_sharded_step.check_layout``); here only the layout itself is compared.
"""
from __future__ import annotations

import jax

from kfac_jax_lite.factor import float_dtype
from kfac_jax_lite.optimizers import sharding

_FIX = ("The state was made by tx.init for other params, or restored from a "
        "checkpoint saved under another configuration: call tx.init(params) "
        "for these params, or build kfl.kfac with the checkpoint's options "
        "(blocks=, damping_mode=, layout=, exclude=)")

# (tagged, dtype) -> the block states' shapes init would make.
_expected_cache: dict = {}


def _expected(tagged, params):
  leaves = jax.tree.leaves(params)
  key = (tagged, tuple((x.shape, str(x.dtype)) for x in leaves))
  if key not in _expected_cache:
    _expected_cache[key] = jax.eval_shape(lambda: {
        l.name: l.block.init(float_dtype([leaves[i] for i in l.leaves]))
        for l in tagged.layers})
  return _expected_cache[key]


def _describe(tree) -> str:
  leaves = jax.tree.leaves(tree)
  return (f"{type(tree).__name__} with {len(leaves)} arrays "
          f"{[tuple(x.shape) for x in leaves][:4]}"
          + ("..." if len(leaves) > 4 else ""))


def _options(cfg) -> str:
  p = cfg.preconditioner
  return (f"blocks={cfg.curvature.blocks!r}, damping_mode={p.damping_mode!r}, "
          f"layout={cfg.layout!r}")


def check(cfg, tagged, state, params) -> None:
  """Raises a ``ValueError`` when ``state`` (a ``KfacState``) is not one
  this transform (``cfg``, a ``transform._Kfac``) makes for ``params``
  (``tagged``: their detection)."""
  sharded = isinstance(state.blocks, sharding.ShardedBlocks)
  if sharded != (cfg.layout == "sharded"):
    raise ValueError(
        f"kfl.kfac: the state's blocks are in the "
        f"{'sharded' if sharded else 'replicated'} layout, this transform "
        f"({_options(cfg)}) keeps them {cfg.layout}. {_FIX}")
  n = len(jax.tree.leaves(params))
  kept = state.health.leaf_norm.shape[-1]
  if kept != n:
    raise ValueError(
        f"kfl.kfac: the params have {n} leaves, the state was made for "
        f"params with {kept}. {_FIX}")
  if sharded:
    return
  expected = _expected(tagged, params)
  have, want = set(state.blocks), set(expected)
  if have != want:
    raise ValueError(
        f"kfl.kfac: the state's layers {sorted(have)} differ from this "
        f"transform's for these params {sorted(want)} (only in the state: "
        f"{sorted(have - want)}; only in the params: {sorted(want - have)}). "
        f"{_FIX}")
  for name in sorted(want):
    got, new = state.blocks[name], expected[name]
    same = (jax.tree.structure(got) == jax.tree.structure(new) and all(
        tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(new))))
    if not same:
      raise ValueError(
          f"kfl.kfac: layer {name!r}: the state holds a {_describe(got)}, "
          f"this transform ({_options(cfg)}) makes a {_describe(new)}. "
          f"{_FIX}")
