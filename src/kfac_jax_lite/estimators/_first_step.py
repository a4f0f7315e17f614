"""What the first step would refuse, found when K-FAC is built.

``refusal(tagged, params, batch, estimation)`` traces one statistics pass
(``estimate``) and every block's ``update`` of its fresh
state with those statistics, abstractly (``jax.eval_shape``: a trace, no
compilation, no arithmetic), on the example batch. It returns None, or the
error the first step would raise, as ``"ValueError: ..."``. ``kfl.kfac``
(and so ``kfl.kfac_optimizer``) raises it at ``tx.init``; ``kfl.describe``
prints it under the table (``Table.first_step``). A loss whose trace needs
a bound mesh axis (a ``pmean`` in ``loss_fn``) is checked where ``init``
is called; outside any mesh the check is skipped for it.
"""
from __future__ import annotations

import jax

from kfac_jax_lite import tagging
from kfac_jax_lite.estimators._estimate import estimate
from kfac_jax_lite.factor import float_dtype


def refusal(tagged, params, batch, estimation="fisher", num_samples=1):
  """None, or the first step's error on ``batch`` (module doc);
  ``tagged`` has its blocks (``TaggedLoss.with_blocks``)."""
  leaves = jax.tree.leaves(params)

  def one(p, b):
    states = {l.name: l.block.init(float_dtype(
        [leaves[i] for i in l.leaves]))
        for l in tagged.layers}
    est = estimate(tagged, p, b, jax.random.PRNGKey(0),
                   estimation=estimation, num_samples=num_samples,
                   states=states)
    return {l.name: l.block.update(states[l.name], est.stats[l.name], 0.95)
            for l in tagged.layers}
  try:
    jax.eval_shape(one, jax.tree.map(tagging.abstract_value, params),
                   jax.tree.map(tagging.abstract_value, batch))
  except NameError as e:  # An axis name bound only inside the mesh.
    if "axis name" in str(e):
      return None
    return f"{type(e).__name__}: {e}"
  except Exception as e:  # noqa: BLE001 (any refusal is reported)
    return f"{type(e).__name__}: {e}"
  return None
