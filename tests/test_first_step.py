"""``describe`` predicts the first step.

Whatever the first K-FAC step would refuse, ``kfl.describe`` reports
(``Table.first_step``, a line under the table) and ``kfl.kfac`` raises at
``tx.init``: both trace one statistics pass and the blocks' updates
abstractly on the example batch. Every model of ``_tagging_models`` (the
GPTs are trained in ``test_tagging_gpt``) is described, then takes one
jitted step, which must not raise what ``describe`` did not report.
"""
import dataclasses
from typing import Any

import jax
import numpy as np
import optax
import pytest

import _tagging_models as M
import kfac_jax_lite as kfl

MODELS = ("jax_mlp", "jax_cnn", "jax_text", "jax_transformer", "jax_scan",
          "jax_cond", "linen_mlp", "linen_cnn", "linen_transformer",
          "linen_scan", "nnx_mlp", "haiku_mlp", "haiku_text", "eqx_mlp",
          "eqx_cnn", "gnn", "pos_none", "pos_broadcast_to")
# XLA's cheaper CPU optimisation: compiling the step is this file's cost.
FAST_COMPILE = {"xla_backend_optimization_level": 0,
                "xla_llvm_disable_expensive_passes": True}


def _model(name):
  if name.startswith("pos_"):
    return M.pos_lookup(name[4:])
  return getattr(M, name)()


def _step(loss, params, batch, tx):
  state = tx.init(params)

  def step(params, state):
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, state = tx.update(grads, state, params, batch=batch)
    return optax.apply_updates(params, updates), state, value
  return jax.jit(step).lower(params, state).compile(FAST_COMPILE)(
      params, state)


@pytest.mark.parametrize("name", MODELS)
def test_describe_predicts_the_first_step(name):
  loss, params, batch = _model(name)
  rows = kfl.describe(loss, params, batch)
  # Every model here is one K-FAC takes: nothing is refused.
  assert rows.first_step is None, str(rows)
  assert "first step" not in str(rows)
  tx = optax.chain(kfl.kfac(loss, batch), optax.sgd(0.01))
  new, _, value = _step(loss, params, batch, tx)
  assert np.isfinite(float(value))
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(new))


def test_a_refusal_is_reported_before_the_step():
  # A block whose statistics refuse the layer's data: describe says so
  # under its table, and kfl.kfac refuses at tx.init, not at the step.
  loss, params, batch = M.jax_mlp()

  @dataclasses.dataclass(frozen=True)
  class Refusing:
    inner: Any

    def __getattr__(self, attr):
      return getattr(self.inner, attr)

    def layer_stats(self, data, state=None):
      raise ValueError("these rows are not examples")

  blocks = {"l1/w": lambda layer: Refusing(layer.block)}
  rows = kfl.describe(loss, params, batch, blocks=blocks)
  assert "these rows are not examples" in rows.first_step
  assert "first step: refused: ValueError: these rows" in str(rows)
  tx = kfl.kfac(loss, batch, blocks=blocks)
  with pytest.raises(ValueError, match="first step would fail.*these rows"):
    tx.init(params)
