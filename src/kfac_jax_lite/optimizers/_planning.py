"""The plan of ``kfl.kfac``'s intervals in its update: ``plan_of`` builds
the plan of a detection (``estimators.plan_for`` at the example batch, once
per detection), ``planned`` resolves a transform's configuration with it,
and ``stats_due`` is the state's flag for the next update (every
``cov_every`` updates, at the young steps 1, 2, 4, ... below it, and while
a block is not ready)."""
from __future__ import annotations

import jax.numpy as jnp

from kfac_jax_lite import blocks as B
from kfac_jax_lite import estimators
from kfac_jax_lite.optimizers import _stages
from kfac_jax_lite.optimizers import sharding


def planned(cfg, params):
  """``cfg`` with ``cov_every`` and ``inverse_every`` as planned for
  ``params`` (``estimators.plan_for`` at the example batch; those given
  are kept)."""
  c, p = cfg.curvature, cfg.preconditioner
  if c.cov_every is not None and p.inverse_every is not None:
    return cfg
  chosen = cfg.plan(params)
  return cfg._replace(
      curvature=c._replace(cov_every=chosen.cov_every),
      preconditioner=p._replace(inverse_every=chosen.inverse_every))


def plan_of(layers, example_batch, curvature, preconditioner,
            model_fraction=None):
  """``plan(params)``: ``estimators.plan_for`` the detection of
  ``params`` at the example batch, once per detection (``model_fraction``:
  ``kfl.kfac_optimizer``'s plan, its quadratic model on that share)."""
  c, p = curvature, preconditioner
  cache: dict = {}

  def plan(params) -> estimators.Plan:
    tagged = layers(params)
    if tagged not in cache:
      cache[tagged] = estimators.plan_for(
          tagged, example_batch, budget=p.budget, cov_every=c.cov_every,
          inverse_every=p.inverse_every, stats_fraction=c.stats_fraction,
          estimation=c.estimation, inverse_method=p.inverse_method,
          damping_mode=p.damping_mode, model_fraction=model_fraction)
    return cache[tagged]
  return plan


def stats_due(layers, states, count, cov_every):
  """Whether update ``count`` takes statistics (int32 0/1): every
  ``cov_every`` updates from update 0; while the statistics are young, also
  at updates 1, 2, 4, 8, ... below ``cov_every`` (``_stages.is_young_step``:
  the young refreshes then decompose new statistics, not step 0's batch
  again; on a 17M-parameter transformer from scratch, at the plan's
  ``cov_every=50``, the loss after 30 steps went 4.46 -> 3.72 at lr 0.01
  and 6.57 -> 3.66 at lr 0.03, for ``log2(cov_every)`` more statistics
  passes a run); and while a block is not ready (no decomposition of real
  statistics yet: a first batch that was skipped, say), so that a planned
  interval never leaves a block unpreconditioned for ``cov_every`` steps.
  In the sharded layout the interval and the young steps alone."""
  due = (count % cov_every == 0) | _stages.is_young_step(count, cov_every)
  if not isinstance(states, sharding.ShardedBlocks):
    for l in layers:
      due = due | ~jnp.all(B.as_block(l.block).is_ready(states[l.name]))
  return due.astype(jnp.int32)
