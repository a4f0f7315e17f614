"""A GPT-style decoder as people write it keeps every K-FAC block.

One causal decoder layer (token + learned position embeddings, pre-
LayerNorm, causal multi-head attention with a fused QKV kernel, a GELU
MLP, a tied or untied output head; ``_tagging_models.gpt_*``) written in
plain JAX (the fused kernel split with ``jnp.split`` and weight decay in
the loss), Flax nnx, Flax linen, Equinox and Haiku: ``describe`` shows no
fallback, and ``kfl.kfac`` + SGD lowers the loss of a tiny char task.
"""
import functools

import jax
import numpy as np
import optax
import pytest

import _tagging_models as M
import kfac_jax_lite as kfl

FRAMEWORKS = ("jax", "nnx", "linen", "eqx", "haiku")
# Compiling the K-FAC step is this file's cost: XLA's cheaper CPU
# optimisation level halves it (these steps run in well under a second).
FAST_COMPILE = {"xla_backend_optimization_level": 0,
                "xla_llvm_disable_expensive_passes": True}


@functools.lru_cache(maxsize=None)
def _model(name):
  return getattr(M, f"gpt_{name}")()


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_gpt_has_no_fallback_and_kfac_trains_it(name):
  loss, params, batch = _model(name)
  rows = kfl.describe(loss, params, batch)
  assert all(r.kind != "fallback" for r in rows), str(rows)
  assert rows.first_step is None, str(rows)   # describe predicts the step
  d = M.GPT_D
  # The fused QKV kernel is one dense block over its 3·d outputs; both
  # embeddings (tied ones included) and every LayerNorm keep their blocks.
  dense = {r.factors[1][1:] for r in rows if r.kind == "dense"}
  assert (3 * d, 3 * d) in dense, str(rows)
  kinds = [r.kind for r in rows]
  assert kinds.count("scale_and_shift") >= 3 and "embedding" in kinds
  assert sum(len(r.params) for r in rows) == len(jax.tree.leaves(params))
  tx = optax.chain(kfl.kfac(loss, batch), optax.sgd(0.05, momentum=0.9))

  def step(params, state):
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, state = tx.update(grads, state, params, batch=batch)
    return optax.apply_updates(params, updates), state, value
  state = tx.init(params)
  step = jax.jit(step).lower(params, state).compile(FAST_COMPILE)
  values = []
  for _ in range(20):
    params, state, value = step(params, state)
    values.append(float(value))
  assert np.all(np.isfinite(values)), values
  assert values[-1] < 0.5 * values[0], values
