"""Amortised statistics in the one-pass style (issue 25, point 1).

``est_fn(..., with_stats=kfl.stats_due(state))`` computes the curvature
statistics only on the updates where ``kfl.kfac`` accumulates them
(``count % cov_every == 0``):

* the flag follows ``cov_every`` and is found in any optax state holding
  one ``kfl.kfac`` state;
* the statistics are left to the update (``estimators.Deferred``), and
  computed there they are the flagless estimate's;
* on the other steps the program computes no statistics: their own work
  (products and random draws) sits in the update's conditional branch,
  the estimate is the gradient's program (checked on the program, not by
  timing), also with ``stats_fraction``; on every update they share the
  step's forward pass;
* a training run in this style follows the ``batch=`` style, where
  ``cov_every`` gates the statistics inside ``update``, to float64
  rounding.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kfl
from _helpers import (
    assert_rounding_close, block_stats, count_primitives, x64_mode)

SIZES = (5, 7, 4)
N = 12
# The primitives that do a statistics pass's work: products and draws.
WORK = ("dot_general", "random_bits", "random_wrap", "threefry2x32")


def init_params(dtype=jnp.float32):
  keys = jax.random.split(jax.random.PRNGKey(0), len(SIZES) - 1)
  return [{"w": (jax.random.normal(k, (i, o)) / np.sqrt(i)).astype(dtype),
           "b": jnp.full((o,), 0.1, dtype)}
          for k, i, o in zip(keys, SIZES[:-1], SIZES[1:])]


def make_batch(seed=1, dtype=jnp.float32):
  kx, ky = jax.random.split(jax.random.PRNGKey(seed))
  return {"x": jax.random.normal(kx, (N, SIZES[0])).astype(dtype),
          "y": jax.random.randint(ky, (N,), 0, SIZES[-1])}


def loss_fn(params, batch):
  h = batch["x"]
  for i, layer in enumerate(params):
    h = h @ layer["w"] + layer["b"]
    if i < len(params) - 1:
      h = jnp.tanh(h)
  return optax.softmax_cross_entropy_with_integer_labels(
      h, batch["y"]).mean()


def count_work(jaxpr):
  """The number of WORK equations in ``jaxpr`` and every jaxpr inside it."""
  return count_primitives(jaxpr, WORK)


def test_stats_due_follows_cov_every_in_any_state():
  params, batch = init_params(), make_batch()
  tx = optax.chain(kfl.kfac(loss_fn, batch, cov_every=3),
                   optax.sgd(0.01, momentum=0.9))
  state = tx.init(params)
  grads = jax.grad(loss_fn)(params, batch)
  update = jax.jit(functools.partial(tx.update, batch=batch))
  due = []
  for _ in range(7):
    due.append(bool(kfl.stats_due(state)))
    _, state = update(grads, state, params)
  # Every 3 updates from 0, and the young updates 1 and 2 (1, 2, 4, ... < 3).
  assert due == [True, True, True, True, False, False, True]

  opt = kfl.kfac_optimizer(loss_fn, batch)
  assert bool(kfl.stats_due(opt.init(params)))
  with pytest.raises(ValueError, match="exactly one kfl.kfac"):
    kfl.stats_due(optax.adam(1e-3).init(params))


def test_with_stats_flag_is_checked():
  params, batch = init_params(), make_batch()
  est_fn = kfl.value_grad_and_stats(loss_fn, params, batch)
  with pytest.raises(ValueError, match="with_stats must be a bool"):
    est_fn(params, batch, jax.random.PRNGKey(0), with_stats=jnp.int32(1))


def outside_conds(jaxpr):
  """The WORK equations of ``jaxpr`` and the jaxprs inside it, cond
  branches left out."""
  return count_primitives(jaxpr, WORK, skip=("cond",))


@pytest.mark.parametrize("stats_fraction", [1.0, 0.25])
def test_deferred_statistics_are_the_flagless_estimate(stats_fraction):
  """With a traced flag the statistics are left to the update
  (``estimators.Deferred``): both ways to compute them, from the step's
  own forward pass and from a pass of their own, give the flagless
  estimate's; the loss, the gradient and the run entry are given now."""
  params, batch = init_params(), make_batch()
  est_fn = kfl.value_grad_and_stats(loss_fn, params, batch,
                                    stats_fraction=stats_fraction)
  key = jax.random.PRNGKey(3)
  want = jax.jit(est_fn)(params, batch, key)
  # One computation in two programs: rounding of 2 layers forward and back
  # and the softmax over N examples.
  close = functools.partial(assert_rounding_close, terms=N, depth=6)

  @jax.jit
  def deferred(p, b, k, f):
    est = est_fn(p, b, k, with_stats=f)
    assert kfl.estimators.is_deferred(est.stats) and est.weights is None
    return est.loss, est.grads, est.stats[kfl.estimators.RUN_ENTRY], [
        kfl.estimators.resolve(est.stats, None, every_step=e)
        for e in (True, False)]
  for flag in (True, False):  # The update decides; the flag is its own.
    loss, grads, run, (shared, own) = deferred(params, batch, key,
                                              jnp.bool_(flag))
    for a, b in zip(jax.tree.leaves((loss, grads)),
                    jax.tree.leaves((want.loss, want.grads))):
      close(a, b)
    for a, b in zip(jax.tree.leaves(run), jax.tree.leaves(
        want.stats[kfl.estimators.RUN_ENTRY])):
      close(a, b)
    for got in (shared, own):
      assert got.keys() == block_stats(want.stats).keys()
      for a, b in zip(jax.tree.leaves(got),
                      jax.tree.leaves(block_stats(want.stats))):
        close(a, b)


@pytest.mark.parametrize("stats_fraction", [1.0, 0.25])
def test_other_steps_compute_no_statistics(stats_fraction):
  """The README's one-pass step with a traced flag: the estimate does the
  gradient's work only, and the statistics' work (products and draws)
  sits in the update's conditional branch; with statistics on every update
  (``cov_every=1``) they share the step's one forward pass."""
  params, batch = init_params(), make_batch()
  est_fn = kfl.value_grad_and_stats(loss_fn, params, batch,
                                    stats_fraction=stats_fraction)
  key = jax.random.PRNGKey(0)
  plain = count_work(jax.make_jaxpr(jax.value_and_grad(loss_fn))(
      params, batch).jaxpr)
  full = count_work(jax.make_jaxpr(est_fn)(params, batch, key).jaxpr)
  # The statistics are real work: more products, and the sampled targets.
  assert full["dot_general"] > plain["dot_general"]
  assert full["random_bits"] > 0 and plain["random_bits"] == 0

  # A Python False: the program is the gradient's.
  never = jax.make_jaxpr(functools.partial(est_fn, with_stats=False))(
      params, batch, key)
  assert count_work(never.jaxpr) == plain

  # A traced flag: the estimate is the gradient's program, no conditional.
  traced = jax.make_jaxpr(lambda p, b, k, f: est_fn(p, b, k, with_stats=f))(
      params, batch, key, jnp.bool_(True))
  assert not any(e.primitive.name == "cond" for e in traced.jaxpr.eqns)
  assert count_work(traced.jaxpr) == plain

  def step_work(cov_every, with_stats):
    tx = kfl.kfac(loss_fn, batch, cov_every=cov_every, inverse_every=1 << 20,
                  stats_fraction=stats_fraction)
    state = tx.init(params)

    def step(p, s, b, k):
      est = est_fn(p, b, k, with_stats=with_stats(s))
      return tx.update(est.grads, s, p, stats=est.stats, loss=est.loss)
    jaxpr = jax.make_jaxpr(step)(params, state, batch, key).jaxpr
    return outside_conds(jaxpr), count_work(jaxpr)

  # Statistics every 3 updates: none of their work outside a conditional.
  outside, total = step_work(3, kfl.stats_due)
  assert outside["random_bits"] == 0 and total["random_bits"] > 0
  assert outside["dot_general"] < total["dot_general"]
  # Every update: the deferred statistics cost what the flagless estimate's
  # do (one forward pass between them), nothing under a conditional.
  outside, total = step_work(1, kfl.stats_due)
  assert outside == total == step_work(1, lambda s: True)[1]


@pytest.mark.parametrize("cov_every", [1, 3])
def test_amortised_one_pass_run_follows_the_batch_style(cov_every):
  """Deferred statistics, from the step's own pass (``cov_every=1``) or
  from their own pass in the update's branch (``cov_every=3``), train as
  the ``batch=`` style does, to float64 rounding."""
  with x64_mode(True):
    params = init_params(jnp.float64)
    batches = [make_batch(seed, jnp.float64) for seed in range(7)]
    options = dict(cov_every=cov_every, inverse_every=2, damping=1e-2, seed=4)
    tx_one = optax.chain(kfl.kfac(loss_fn, batches[0], **options),
                         optax.sgd(0.05, momentum=0.9))
    tx_two = optax.chain(kfl.kfac(loss_fn, batches[0], **options),
                         optax.sgd(0.05, momentum=0.9))
    est_fn = kfl.value_grad_and_stats(loss_fn, params, batches[0])

    @jax.jit
    def one_pass(params, state, batch):
      # The key kfac draws its own statistics' key from, so both styles
      # sample the same targets: the second half of split(state.key).
      key = jax.random.split(state[0].key)[1]
      est = est_fn(params, batch, key, with_stats=kfl.stats_due(state))
      updates, state = tx_one.update(est.grads, state, params,
                                     stats=est.stats, loss=est.loss)
      return optax.apply_updates(params, updates), state

    @jax.jit
    def batch_style(params, state, batch):
      grads = jax.grad(loss_fn)(params, batch)
      updates, state = tx_two.update(grads, state, params, batch=batch)
      return optax.apply_updates(params, updates), state

    p1, s1 = params, tx_one.init(params)
    p2, s2 = params, tx_two.init(params)
    for batch in batches:
      p1, s1 = one_pass(p1, s1, batch)
      p2, s2 = batch_style(p2, s2, batch)
    moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in
                zip(jax.tree.leaves(p2), jax.tree.leaves(params)))
    assert moved > 1e-2  # It trained: the comparison is not vacuous.
    for a, b in zip(jax.tree.leaves((p1, s1[0].blocks)),
                    jax.tree.leaves((p2, s2[0].blocks))):
      np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_kfac_optimizer_takes_one_pass_statistics():
  """``kfl.kfac_optimizer``'s ``update(..., batch=, stats=)`` uses the
  one-pass statistics instead of its own pass, amortised with
  ``kfl.stats_due``: the run follows the ``batch=`` style in float64."""
  with x64_mode(True):
    params = init_params(jnp.float64)
    # One batch (random labels: nothing to learn across batches), so that
    # "it trained" can be checked on it.
    batches = [make_batch(1, jnp.float64)] * 6
    options = dict(cov_every=2, inverse_every=2, seed=3)
    opt_one = kfl.kfac_optimizer(loss_fn, batches[0], **options)
    opt_two = kfl.kfac_optimizer(loss_fn, batches[0], **options)
    est_fn = kfl.value_grad_and_stats(loss_fn, params, batches[0])

    @jax.jit
    def one_pass(params, state, batch):
      key = jax.random.split(state.kfac.key)[1]
      est = est_fn(params, batch, key, with_stats=kfl.stats_due(state))
      step, state = opt_one.update(est.grads, state, params, batch=batch,
                                   stats=est.stats, loss=est.loss)
      return optax.apply_updates(params, step), state

    @jax.jit
    def batch_style(params, state, batch):
      grads = jax.grad(loss_fn)(params, batch)
      step, state = opt_two.update(grads, state, params, batch=batch)
      return optax.apply_updates(params, step), state

    p1, s1 = params, opt_one.init(params)
    p2, s2 = params, opt_two.init(params)
    for batch in batches:
      p1, s1 = one_pass(p1, s1, batch)
      p2, s2 = batch_style(p2, s2, batch)
    assert float(loss_fn(p2, batches[0])) < 0.9 * float(
        loss_fn(params, batches[0]))  # It trained.
    # The parameters, the curvature and the quadratic model's choices (not
    # kfl.health's loss record: batch= sees a loss on statistics steps
    # only, loss= on every step).
    same = lambda p, s: (p, s.kfac.blocks, s.damping, s.velocity,
                         s.learning_rate, s.momentum, s.rho)
    for a, b in zip(jax.tree.leaves(same(p1, s1)),
                    jax.tree.leaves(same(p2, s2))):
      np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_a_flag_known_outside_jit_gives_plain_statistics():
  """Outside ``jit`` ``kfl.stats_due(state)`` is a concrete array: the
  estimate takes its value (plain statistics, or zeros), not a deferred
  computation, so a jitted update given estimates made step by step
  compiles once."""
  params, batch = init_params(), make_batch()
  tx = kfl.kfac(loss_fn, batch, cov_every=2)
  state = tx.init(params)
  est_fn = kfl.value_grad_and_stats(loss_fn, params, batch)
  traces = []

  @jax.jit
  def update(grads, state, stats):
    traces.append(1)  # Once per trace (compile).
    return tx.update(grads, state, params, stats=stats)[1]
  for i in range(4):
    est = est_fn(params, batch, jax.random.PRNGKey(i),
                 with_stats=kfl.stats_due(state))
    assert not kfl.estimators.is_deferred(est.stats)
    assert any(np.any(np.asarray(x)) for x in jax.tree.leaves(
        block_stats(est.stats))) == bool(i % 2 == 0 or i == 1)
    state = update(est.grads, state, est.stats)
  assert len(traces) == 1
