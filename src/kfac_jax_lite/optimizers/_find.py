"""Finding the K-FAC states inside any optax state, and the arrays inside
framework wrappers: one finder for ``kfl.stats_due``, ``kfl.health``,
``kfl.with_batch`` and ``kfl.with_stats``.

An optax state nests its transforms' states however the user composed
them: ``chain``/``named_chain`` (tuples, dicts), ``MultiSteps``
(``inner_opt_state``), ``inject_hyperparams`` (``inner_state``),
``apply_if_finite``, ``masked`` and ``multi_transform`` (``inner_states``).
All are pytrees, so ``jax.tree`` walks them with the K-FAC states as
leaves (``states``, ``replace``). Framework wrappers around the arrays
(flax ``nnx.Variable``, and ``nnx.Optimizer``'s ``OptArray`` around every
optax state leaf) are pytrees whose flattening adds a path element
(``.value``): ``unwrap`` returns the same tree with their values, so that
layer names and counters read the same whichever way the tree was built.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import jax
import optax

from kfac_jax_lite.tagging import is_wrapper


def unwrap(tree):
  """``tree`` with every flax ``Variable`` replaced by its value (a tree
  without wrappers is returned as it is)."""
  if not any(is_wrapper(x) for x in jax.tree.leaves(tree, is_leaf=is_wrapper)):
    return tree
  return jax.tree.map(lambda x: x.get_value() if is_wrapper(x) else x, tree,
                      is_leaf=is_wrapper)


def unwrap_update(params, updates, where: str):
  """``(params, updates)`` unwrapped (``unwrap``), checked to have one
  structure: a gradient tree that does not match the parameters is a
  ``ValueError`` naming ``where`` and the usual cause, ``nnx.Optimizer(...,
  wrt=nnx.Param)`` keeping only the gradients wrapped as ``nnx.Param``
  (plain arrays, e.g. of an estimate given ``nnx.as_pure(...)``, are
  dropped before the transform sees them)."""
  params, updates = unwrap(params), unwrap(updates)
  if params is not None and (jax.tree.structure(params)
                             != jax.tree.structure(updates)):
    n, m = len(jax.tree.leaves(updates)), len(jax.tree.leaves(params))
    raise ValueError(
        f"{where}: the gradients ({n} leaves) do not have the parameters' "
        f"structure ({m} leaves). Under nnx.Optimizer(model, tx, "
        "wrt=nnx.Param) only gradients wrapped as nnx.Param reach the "
        "transform: give kfl.value_grad_and_stats nnx.state(model, "
        "nnx.Param) (not nnx.as_pure(...)), so that est.grads keep the "
        "wrappers, or pass gradients of the params' structure")
  return params, updates


def rewrap(like, tree):
  """``tree``, the unwrapped form of a tree shaped as ``like``, in
  ``like``'s wrappers (``unwrap``'s inverse: an update computed on the
  values is returned in the structure of the gradients it came from)."""
  if like is tree:
    return tree
  return jax.tree.unflatten(jax.tree.structure(like), jax.tree.leaves(tree))


def states(state, kinds: tuple) -> list:
  """Every state of one of the NamedTuple types ``kinds`` inside the optax
  state ``state`` (any nesting; module docstring), outermost first and
  without looking inside a found one, with wrappers unwrapped."""
  is_kind = lambda x: isinstance(x, kinds)
  return [unwrap(s) for s in jax.tree.leaves(unwrap(state), is_leaf=is_kind)
          if is_kind(s)]


def replace(state, kinds: tuple, fn: Callable[[Any], Any]):
  """``state`` with every state of a type in ``kinds`` (not looking inside
  a found one) replaced by ``fn(it)``; the number replaced is checked by
  the caller through ``states``."""
  is_kind = lambda x: isinstance(x, kinds)
  return jax.tree.map(lambda x: fn(x) if is_kind(x) else x, state,
                      is_leaf=is_kind)


def check_unmasked(params, where: str) -> None:
  """Refuses ``params`` with ``optax.MaskedNode`` leaves: a K-FAC
  transform inside ``optax.masked``/``optax.multi_transform`` gets only its
  share of the parameters, but its tagging traces ``loss_fn`` on the whole
  model. The error names the pattern that works: K-FAC on the full tree
  with the frozen parameters excluded, and the mask after it."""
  is_masked = lambda x: isinstance(x, optax.MaskedNode)
  if any(is_masked(x) for x in jax.tree.leaves(params, is_leaf=is_masked)):
    raise ValueError(
        f"{where} got parameters with optax.MaskedNode leaves: it is inside "
        "optax.masked or optax.multi_transform, which hand it only part of "
        "the model, but it traces loss_fn on the whole model. Put it "
        "outside, on the full tree, with the other parameters excluded from "
        "the curvature, and the partition after it: optax.chain("
        f"{where}(loss_fn, batch, exclude=[...frozen paths...]), "
        "optax.multi_transform({'train': optax.sgd(lr), 'frozen': "
        "optax.set_to_zero()}, labels))")


def check_not_in_multisteps(where: str) -> None:
  """Refuses an ``init`` called by ``optax.MultiSteps`` (found among the
  callers' frames): MultiSteps runs its inner ``update`` on every
  micro-step and keeps one result in k, so K-FAC's statistics, refresh and
  preconditioning would be paid k times per update (4.3-5.8x the work of k
  SGD micro-steps plus one K-FAC step, ``benchmarks/multisteps.py``). The
  error names the accumulation pattern that pays them once."""
  frame = inspect.currentframe()
  try:
    f = frame.f_back if frame is not None else None
    for _ in range(16):
      if f is None:
        return
      if isinstance(f.f_locals.get("self"), optax.MultiSteps):
        raise ValueError(
            f"{where} inside optax.MultiSteps would run its whole update "
            "(statistics, refresh, preconditioning) on every micro-step and "
            "discard k-1 of them. Accumulate the gradient in your step "
            "instead and call tx.update once per k micro-batches: "
            "grads = mean of jax.grad(loss_fn)(params, b) over the "
            "micro-batches b (a lax.scan), then tx.update(grads, state, "
            "params, batch=last_micro_batch) (docs/guide.md, 'Gradient "
            "accumulation')")
      f = f.f_back
  finally:
    del frame
