"""``KfacState``, the state of ``kfl.kfac``: its own module so that the
sharded layout (``sharding``) and the transform both read it, neither
through the other."""
from __future__ import annotations

from typing import Any, NamedTuple


class KfacState(NamedTuple):
  """The state of ``kfl.kfac``: step count, block states and safeguard
  counters (a pytree of arrays; checkpoint it like any other).

  Attributes:
    count: int32, the number of ``update`` calls so far.
    key: the PRNG key the sampled estimators draw from under ``batch=``
      (split at every update; from ``seed``).
    blocks: ``{layer name: block state}`` (``kfl.blocks``; a leading stack
      axis for a layer stacked along ``lax.scan``): the factors' EMAs and
      their cached decompositions; in the sharded layout a
      ``kfl.sharding.ShardedBlocks`` holding them on their owners
      (``kfl.sharding.unshard`` gives the dict).
    num_bad_grads: int32, updates skipped (a zero update) for non-finite
      gradients.
    num_bad_updates: int32, preconditioned updates that were not finite and
      were replaced by the gradient.
    num_bad_damping: int32, updates skipped for a damping that is not
      positive and finite.
    num_nonfinite_params: int32, updates called with non-finite parameters.
    health: the running summaries ``kfl.health`` reads to tell a run that
      diverges or stalls from one that trains (``_health_state``).
    stats_due: int32, 1 when the next update accumulates statistics
      (``count % cov_every == 0``), else 0 (an int, not a bool, so that
      arithmetic over the state's leaves works); ``kfl.stats_due`` reads it.
    pending: the slot (``_pending.Pending``) of the batch/statistics that
      ``update`` uses when called without ``batch=``/``stats=``
      (``kfl.with_batch``, ``kfl.with_stats``): made by ``init`` with
      zeros of the example batch, so that storing a batch keeps the
      state's structure (one compile); ``update`` returns it without the
      statistics (used once). None inside ``kfl.kfac_optimizer``'s state (whose own
      slot it is), after ``kfl.with_batch(state, None)`` and in states of
      older versions.
  """

  count: Any
  key: Any
  blocks: Any  # dict, or sharding.ShardedBlocks in the sharded layout
  num_bad_grads: Any
  num_bad_updates: Any
  num_bad_damping: Any
  num_nonfinite_params: Any
  health: Any  # _health_state.HealthState
  stats_due: Any
  pending: Any = None  # _pending.Pending, or None
