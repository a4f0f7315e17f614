"""Models with state: BatchNorm in training mode (batch statistics).

Flax linen with ``mutable=["batch_stats"]`` (the running statistics passed
through the batch, or closed over and returned as aux output), Flax nnx
and Haiku's ``transform_with_state``: the BatchNorm scale/shift is one
``ScaleAndShift`` layer, every parameter keeps its block, the captured
data rebuild the gradient, and ``kfl.kfac``'s ``update`` works.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kfl
from kfac_jax_lite.estimators import describe
from kfac_jax_lite.tagging import find_layers
from kfac_jax_lite.tagging._paths import named_leaves

N, D, C = 8, 5, 6


def _data():
  k = jax.random.split(jax.random.key(0), 2)
  return (jax.random.normal(k[0], (N, D)),
          jax.random.randint(k[1], (N,), 0, 3))


def _xent(out, y):
  return kfl.softmax_cross_entropy_with_integer_labels(out, y).mean()


def linen_batch():
  """Running statistics passed through the batch."""
  import flax.linen as nn

  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.BatchNorm(use_running_average=False)(nn.Dense(C)(x))
      return nn.Dense(3)(nn.relu(x))
  m, (x, y) = M(), _data()
  v = m.init(jax.random.key(1), x)

  def loss(params, batch):
    x, y, stats = batch
    out, _ = m.apply({"params": params, "batch_stats": stats}, x,
                     mutable=["batch_stats"])
    return _xent(out, y)
  return loss, v["params"], (x, y, v["batch_stats"]), False, "BatchNorm_0"


def linen_aux():
  """Running statistics closed over, the updated ones returned as aux."""
  loss_b, params, (x, y, stats), _, name = linen_batch()
  import flax.linen as nn  # noqa: F401
  m_apply = loss_b

  def loss(params, batch):
    return m_apply(params, batch + (stats,)), {"stats": stats}
  return loss, params, (x, y), True, name


def nnx_bn():
  from flax import nnx

  class M(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.Linear(D, C, rngs=rngs)
      self.bn = nnx.BatchNorm(C, rngs=rngs)
      self.l2 = nnx.Linear(C, 3, rngs=rngs)

    def __call__(self, x):
      return self.l2(nnx.relu(self.bn(self.l1(x))))
  graphdef, params, rest = nnx.split(M(nnx.Rngs(0)), nnx.Param, ...)

  def loss(params, batch):
    # The statistics travel in the batch (nnx variables cannot be closed
    # over into a trace and mutated there); the updated ones are aux.
    x, y, stats = batch
    model = nnx.merge(graphdef, params, stats)
    out = _xent(model(x), y)
    return out, nnx.state(model, nnx.BatchStat)
  return loss, params, _data() + (rest,), True, "bn"


def haiku_bn():
  import haiku as hk

  def f(x):
    h = hk.Linear(C)(x)
    h = hk.BatchNorm(True, True, 0.9)(h, is_training=True)
    return hk.Linear(3)(jax.nn.relu(h))
  model = hk.without_apply_rng(hk.transform_with_state(f))
  x, y = _data()
  params, state = model.init(jax.random.key(1), x)

  def loss(params, batch):
    out, new_state = model.apply(params, state, batch[0])
    return _xent(out, batch[1]), new_state
  return loss, params, (x, y), True, "batch_norm"


MODELS = {"linen_batch": linen_batch, "linen_aux": linen_aux,
          "nnx": nnx_bn, "haiku": haiku_bn}


@functools.lru_cache(maxsize=None)
def _model(name):
  return MODELS[name]()


def _value(loss, has_aux, params, batch):
  """The loss alone as ``f(params)``, replayed from its jaxpr (nnx
  variables closed over cannot be mutated under an outer ``jax.grad``)."""
  fn = (lambda p, b: loss(p, b)[0]) if has_aux else loss
  closed = jax.make_jaxpr(fn)(params, batch)
  run = jax.extend.core.jaxpr_as_fun(closed)
  return lambda p: run(*jax.tree.leaves(p), *jax.tree.leaves(batch))[0]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_batchnorm_scale_and_shift(name):
  loss, params, batch, has_aux, bn = _model(name)
  rows = describe(loss, params, batch, has_aux=has_aux)
  assert all(r.kind != "fallback" for r in rows), str(rows)
  (norm,) = [r for r in rows if r.kind == "scale_and_shift"]
  assert norm.block == "ScaleAndShift" and len(norm.params) == 2, str(rows)
  assert all(bn in p for p in norm.params), str(rows)
  assert [r.kind for r in rows].count("dense") == 2, str(rows)
  # The captured data rebuild the gradient: with batch statistics the
  # examples interact, so the per-example gradients are the terms of the
  # gradient (their mean), not vmap(grad) of single examples.
  tl = find_layers(loss, params, batch, has_aux=has_aux)
  probes = tl.zero_probes(params, batch)

  def f(p, pr):
    l, _, caps = tl.apply(p, batch, pr)
    return l, caps

  @jax.jit  # One compile, not the eager operations'.
  def per_example_grads(p, pr):
    l, vjp, caps = jax.vjp(f, p, pr, has_aux=True)
    _, cts = vjp(jnp.ones_like(l))
    return tl.per_example_grads(caps, cts)
  per_ex = per_example_grads(params, probes)
  full = jax.jit(jax.grad(_value(loss, has_aux, params, batch)))(params)
  full = dict(named_leaves(full))  # The layers' naming (no wrapper .value).
  assert set(per_ex) == set(full)
  for path, g in per_ex.items():
    np.testing.assert_allclose(g.sum(0), full[path], rtol=1e-4, atol=1e-6,
                               err_msg=path)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_batchnorm_kfac_update(name):
  loss, params, batch, has_aux, _ = _model(name)
  tx = kfl.kfac(loss, batch, has_aux=has_aux, damping=1e-2)
  state = tx.init(params)
  value = _value(loss, has_aux, params, batch)
  grads = jax.jit(jax.grad(value))(params)
  u, state = jax.jit(tx.update)(grads, state, params, batch=batch)
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(u))
  assert kfl.health(state) is not None
  # A preconditioned step against the gradient lowers the loss.
  new = optax.apply_updates(params, jax.tree.map(lambda x: -0.05 * x, u))
  assert value(new) < value(params)


def test_batch_dtype_changes_between_steps():
  # Under x64, linen's updated running statistics come back float64 while
  # the example batch (and step 0) had float32 ones: ``kfac`` detects the
  # layers again for the new batch signature, finds the same blocks, and
  # the update works. A batch whose layers differ gets a clear error.
  # All abstract (``eval_shape``): the failure was at trace time, and
  # compiling the update is what would cost.
  import flax.linen as nn
  from _helpers import x64_mode

  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(3)(nn.BatchNorm(use_running_average=False)(x))
  with x64_mode(True):
    m = M()
    x = jax.ShapeDtypeStruct((N, D), jnp.float64)
    y = jax.ShapeDtypeStruct((N,), jnp.int32)
    v = jax.eval_shape(m.init, jax.random.key(1), x)
    params, stats = v["params"], v["batch_stats"]
    assert jax.tree.leaves(stats)[0].dtype == jnp.float32

    def loss(params, batch):
      x, y, stats = batch
      out, new = m.apply({"params": params, "batch_stats": stats}, x,
                         mutable=["batch_stats"])
      return _xent(out, y), new["batch_stats"]
    new = jax.eval_shape(loss, params, (x, y, stats))[1]
    assert jax.tree.leaves(new)[0].dtype == jnp.float64
    tx = kfl.kfac(loss, (x, y, stats), has_aux=True, damping=1e-2)
    state = jax.eval_shape(tx.init, params)
    update = lambda g, s, p, b: tx.update(g, s, p, batch=b)
    for b in ((x, y, stats), (x, y, new)):   # step 0, step 1
      u, out = jax.eval_shape(update, params, state, params, b)
      assert jax.tree.structure(out) == jax.tree.structure(state)
      assert [(a.shape, a.dtype) for a in jax.tree.leaves(out)] == [
          (a.shape, a.dtype) for a in jax.tree.leaves(state)]
      assert jax.tree.map(lambda a: a.dtype, u) == jax.tree.map(
          lambda a: a.dtype, params)

    def switch(p, x):  # A dense layer for float32 inputs only.
      h = x @ p["w"] if x.dtype == jnp.float32 else x * p["w"][:, 0]
      return kfl.squared_error(h.sum(-1, keepdims=True)).mean()
    p = {"w": jax.ShapeDtypeStruct((D, 2), jnp.float32)}
    tx = kfl.kfac(switch, jax.ShapeDtypeStruct((N, D), jnp.float32))
    state = jax.eval_shape(tx.init, p)
    with pytest.raises(ValueError, match="layers found for this batch differ"):
      jax.eval_shape(lambda s, p, b: tx.update(p, s, p, batch=b), state, p, x)
