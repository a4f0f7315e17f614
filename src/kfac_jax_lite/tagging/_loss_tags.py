"""Registered losses in a traced jaxpr: ``find_loss_tags`` and ``LossTag``.

A registered loss (``kfac_jax_lite.losses``) leaves a ``loss_tag``
equation in the jaxpr; ``find_loss_tags`` finds them (through call-like
nested jaxprs, refusing one inside a loop or branch) and ``TaggedLoss``
keeps one ``LossTag`` per loss.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from kfac_jax_lite import losses
from kfac_jax_lite.tagging import _analysis


@dataclasses.dataclass(frozen=True)
class LossTag:
  """A registered loss found in the trace (``kfac_jax_lite.losses``).

  ``uid`` keys its probe (on the per-element values) and its capture (the
  model outputs followed by the targets) in ``apply``.
  """

  uid: int
  key: tuple
  distribution: Any
  num_outputs: int
  values_shape: tuple
  values_dtype: Any
  values_vma: frozenset = frozenset()  # under shard_map(check_vma=True)
  # A loss recognised in the jaxpr (``_losses.Recognised``); None: registered.
  recognised: Any = None
  # The axis of the per-element values that is the examples' (not 0 only
  # with ``example_axis=``: ``_examples.located``).
  example_axis: int = 0

  def split(self, captures):
    """``(outputs, targets)``: this loss's captured model outputs and
    targets, each a tuple (``captures`` from ``TaggedLoss.apply``)."""
    caps = captures[self.uid]
    return caps[:self.num_outputs], caps[self.num_outputs:]


def find_loss_tags(jaxpr, prefix=(), where=""):
  """``[(key, eqn)]`` of every loss tag, through call-like nested jaxprs."""
  found = []
  for i, eqn in enumerate(jaxpr.eqns):
    key = prefix + (i,)
    if eqn.primitive is losses.loss_tag_p:
      if where:
        raise ValueError(f"a registered loss inside `{where}` is not "
                         "supported; compute the loss outside it")
      found.append((key, eqn))
      continue
    inner = _analysis.inner_jaxpr(eqn)
    if inner is not None:
      found += find_loss_tags(inner[0], key + (0,), where)
    else:
      for sub in _sub_jaxprs(eqn):
        found += find_loss_tags(sub, key + (0,), eqn.primitive.name)
  return found


def _sub_jaxprs(eqn):
  for v in eqn.params.values():
    for j in (v if isinstance(v, (tuple, list)) else (v,)):
      if hasattr(j, "eqns"):
        yield j
      elif hasattr(j, "jaxpr") and hasattr(j.jaxpr, "eqns"):
        yield j.jaxpr
