"""Robust out of the box (issue 8): safe defaults, no silent failure.

* the defaults of ``kfl.kfac`` (what the README recommends) chained with
  ``optax.sgd(lr, momentum=0.9)`` train at lr 0.01 (the README's promise;
  on this full-batch conv net with normalisation also at 0.1), the
  learning rate is a knob (the default best of {0.3x, 1x, 3x} on the
  minibatch MLP, a run that blows up never called ok by ``kfl.health``),
  and ``kfl.kfac_optimizer``'s defaults do not blow up;
* bad arguments (non-positive damping, an empty batch, a ``stats_fraction``
  leaving < 2 examples) raise ``ValueError`` naming the problem; a bad
  damping that arrives traced skips and counts the update;
* a block that never received statistics passes its gradient through;
* non-finite parameters are counted, and ``kfl.health`` reports every
  counter from any optimizer state.

Models are tiny and every jitted step is compiled once per test.
"""
import functools
import inspect
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kfl
from _helpers import assert_rounding_close, block_stats, optimized_jit

SIZES = (5, 8, 3)
N = 16


def init_params():
  keys = jax.random.split(jax.random.PRNGKey(0), len(SIZES) - 1)
  return {f"dense{i}": {"w": jax.random.normal(k, (a, b)) / np.sqrt(a),
                        "b": jnp.zeros(b)}
          for i, (k, a, b) in enumerate(zip(keys, SIZES[:-1], SIZES[1:]))}


def loss_fn(params, batch):
  h = batch["x"]
  for i in range(len(SIZES) - 1):
    h = h @ params[f"dense{i}"]["w"] + params[f"dense{i}"]["b"]
    if i < len(SIZES) - 2:
      h = jnp.tanh(h)
  return kfl.softmax_cross_entropy_with_integer_labels(h, batch["y"]).mean()


def make_batch(seed, n=N):
  x = jax.random.normal(jax.random.PRNGKey(seed), (n, SIZES[0]))
  return {"x": x, "y": jnp.argmax(x[:, :SIZES[-1]], -1)}


BATCH = make_batch(0)


def tree_allclose(a, b, **kw):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, **kw)


# --- arguments -----------------------------------------------------------------

@pytest.mark.parametrize("damping", [0.0, -1.0, float("nan"), float("inf"),
                                     optax.constant_schedule(0.0)])
def test_non_positive_damping_is_an_error_at_construction(damping):
  with pytest.raises(ValueError, match="damping must be positive"):
    kfl.kfac(loss_fn, BATCH, damping=damping)


@pytest.mark.parametrize("kwargs,match", [
    (dict(initial_damping=0.0), "min_damping <= initial_damping"),
    (dict(min_damping=0.0), "min_damping"),
    (dict(initial_damping=1e9), "max_damping"),
    (dict(damping_decay=1.5), "damping_decay"),
    (dict(damping_adaptation_interval=0), "damping_adaptation_interval"),
    (dict(l2_reg=-1.0), "l2_reg"),
    (dict(max_momentum=1.0), "max_momentum"),
])
def test_kfac_optimizer_rejects_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    kfl.kfac_optimizer(loss_fn, BATCH, **kwargs)


def test_empty_batch_and_too_small_stats_fraction_are_named():
  empty = make_batch(0, n=0)
  with pytest.raises(ValueError, match="empty"):
    kfl.kfac(loss_fn, empty)
  with pytest.raises(ValueError, match="empty"):
    kfl.value_grad_and_stats(loss_fn, init_params(), BATCH)(
        init_params(), empty, jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match=r"stats_fraction=0.05 leaves 1 example"):
    kfl.kfac(loss_fn, BATCH, stats_fraction=0.05)
  tx = kfl.kfac(loss_fn, BATCH, stats_fraction=0.25)  # 4 of 16: fine.
  params = init_params()
  state = tx.init(params)
  small = make_batch(1, n=4)  # 1 of 4 at update time: not.
  with pytest.raises(ValueError, match=r"leaves 1 example\(s\) of a batch of 4"):
    tx.update(jax.grad(loss_fn)(params, small), state, params, batch=small)
  with pytest.raises(ValueError, match="empty"):
    tx.update(jax.grad(loss_fn)(params, BATCH), state, params, batch=empty)


@functools.lru_cache(maxsize=None)
def _jitted_update(**kw):
  tx = kfl.kfac(loss_fn, BATCH, **kw)
  return tx, jax.jit(tx.update)


def test_traced_bad_damping_skips_and_counts_the_update():
  tx, update = _jitted_update(damping=1e-2, estimation="exact", norm_constraint=None)
  params = init_params()
  grads = jax.grad(loss_fn)(params, BATCH)
  state = tx.init(params)
  for bad in (-1.0, 0.0, float("nan")):
    u, state = update(grads, state, params, batch=BATCH, damping=bad)
    assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(u))
  assert int(state.num_bad_damping) == 3 and int(state.num_bad_grads) == 0
  health = kfl.health(state)
  assert health.bad_damping == 3 and not health.ok
  assert "bad damping 3" in str(health)
  u, state = update(grads, state, params, batch=BATCH, damping=1e-2)
  assert all(np.any(np.asarray(x) != 0) for x in jax.tree.leaves(u))
  assert int(state.num_bad_damping) == 3


# --- factors without statistics --------------------------------------------------

def test_block_without_statistics_passes_the_gradient_through():
  """Statistics that are not finite leave a factor empty: it is neither
  refreshed nor used (the update is the gradient, not ``g / damping``);
  the first good statistics make the block ready at once (not only at the
  next ``inverse_every`` step), and its update is then the one a fresh
  state would give."""
  tx, update = _jitted_update(damping=1e-2, estimation="exact", norm_constraint=None)
  params = init_params()
  fn = kfl.value_grad_and_stats(loss_fn, params, BATCH, estimation="exact")
  est = fn(params, BATCH, jax.random.PRNGKey(0))
  bad_stats = {k: jax.tree.map(lambda x: x * jnp.nan, v)  # Blocks only:
               for k, v in block_stats(est.stats).items()}
  bad_stats["~run"] = est.stats["~run"]  # the loss stays finite.
  state = tx.init(params)
  u, state = update(est.grads, state, params, stats=bad_stats)
  tree_allclose(u, est.grads, rtol=0, atol=0)
  health = kfl.health(state)
  assert health.unready_blocks == 2 and health.skipped_stats == 4
  assert "unready blocks 2" in str(health)
  # Step 3 is not a refresh step (3 < 10 is no power of two) ...
  state = state._replace(count=jnp.asarray(3, jnp.int32))
  u, state = update(est.grads, state, params, stats=est.stats)
  fresh, _ = update(est.grads, tx.init(params), params, stats=est.stats)
  tree_allclose(u, fresh, rtol=1e-6)  # ... but the blocks were not ready.
  assert kfl.health(state).unready_blocks == 0


def test_a_block_with_one_factor_decomposed_is_unready():
  """A block is ready when *every* factor has a decomposition: one whose
  ``G`` has none (``cache.step = -1``, as after a first decomposition that
  failed, with no good one to keep) while its ``A`` has one is unready,
  for the transform (``is_ready``: it passes its gradient through) and for
  ``kfl.health``, which counts it once."""
  tx, update = _jitted_update(damping=1e-2, estimation="exact", norm_constraint=None)
  params = init_params()
  _, state = update(jax.grad(loss_fn)(params, BATCH), tx.init(params), params,
                    batch=BATCH)
  assert kfl.health(state).ok

  def unready(state, name, factors):
    block = state.blocks[name]
    block = block._replace(**{f: getattr(block, f)._replace(
        cache=getattr(block, f).cache._replace(step=jnp.asarray(-1, jnp.int32)))
        for f in factors})
    return state._replace(blocks=dict(state.blocks, **{name: block}))

  half = unready(state, "dense0/w", ["g"])
  assert int(half.blocks["dense0/w"].a.cache.step) == 0
  assert not bool(kfl.optimizers.transform.is_ready(half.blocks["dense0/w"]))
  health = kfl.health(half)
  assert health.unready_blocks == 1 and not health.ok
  assert "unready blocks 1" in str(health)
  both = unready(half, "dense1/w", ["a", "g"])
  assert kfl.health(both).unready_blocks == 2


def test_nan_first_batch_does_not_leave_a_run_on_damping_alone():
  """The issue's case: a NaN in the very first batch (the update norm then
  reached 18.8 against 1.3 in a clean run, preconditioned by the damping
  alone for 9 steps). The step is skipped and counted; the next batch's
  statistics are decomposed at once, and its update is as large as a
  clean run's first one, not ``1/damping`` times the gradient."""
  tx, update = _jitted_update()
  params = init_params()
  norm = lambda t: float(jnp.sqrt(sum(jnp.vdot(x, x) for x in jax.tree.leaves(t))))
  bad = dict(BATCH, x=BATCH["x"].at[0, 0].set(jnp.nan))
  nxt = make_batch(1)
  grads = jax.grad(loss_fn)(params, nxt)
  state = tx.init(params)
  u, state = update(jax.grad(loss_fn)(params, bad), state, params, batch=bad)
  assert norm(u) == 0.0 and kfl.health(state).unready_blocks == 2
  u, state = update(grads, state, params, batch=nxt)
  clean, _ = update(grads, tx.init(params), params, batch=nxt)
  health = kfl.health(state)
  assert health.bad_grads == 1 and health.unready_blocks == 0
  assert 0.5 < norm(u) / norm(clean) < 2.0, (norm(u), norm(clean))


# --- non-finite parameters and kfl.health ----------------------------------------

def test_nonfinite_params_are_counted_and_health_finds_every_state():
  params = init_params()
  grads = jax.grad(loss_fn)(params, BATCH)
  chain = optax.chain(optax.clip_by_global_norm(1.0),
                      kfl.kfac(loss_fn, BATCH, estimation="exact"),
                      optax.sgd(0.1, momentum=0.9))
  state = chain.init(params)
  update = jax.jit(chain.update)  # One compile for both calls.
  _, state = update(grads, state, params, batch=BATCH)
  health = kfl.health(state)
  assert health.ok and health.steps == 1 and str(health).startswith("kfac: ok")
  nan_params = jax.tree.map(lambda x: x * jnp.nan, params)
  nan_grads = jax.grad(loss_fn)(nan_params, BATCH)
  _, state = update(nan_grads, state, nan_params, batch=BATCH)
  health = kfl.health(state)
  assert (health.nonfinite_params, health.bad_grads, health.steps) == (1, 1, 2)
  assert "non-finite params 1" in str(health) and not health.ok
  # Inside inject_hyperparams, and the kfac_optimizer's own state.
  injected = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
  combo = optax.chain(kfl.kfac(loss_fn, BATCH), injected)
  assert kfl.health(combo.init(params)).steps == 0
  opt = kfl.kfac_optimizer(loss_fn, BATCH)
  ostate = opt.init(params)
  health = kfl.health(ostate)
  assert health.damping == pytest.approx(
      inspect.signature(kfl.kfac_optimizer).parameters["initial_damping"].default)
  assert "damping" in str(health)
  with pytest.raises(ValueError, match="no kfl.kfac"):
    kfl.health(optax.sgd(0.1).init(params))


@functools.lru_cache(maxsize=None)
def _sgd_runner(steps, **kfac_options):
  """``run(params, lr) -> (params, state)``: ``steps`` of the recommended
  recipe on the test MLP, one batch per step, jitted once for every lr
  (``optax.sgd(lr, momentum=0.9)`` written as its trace and its scale by
  ``-lr``, the lr traced)."""
  tx = optax.chain(kfl.kfac(loss_fn, BATCH, **kfac_options),
                   optax.trace(decay=0.9))

  @jax.jit
  def run(params, lr):
    def step(carry, seed):
      params, state = carry
      batch = make_batch(seed)
      grads = jax.grad(loss_fn)(params, batch)
      updates, state = tx.update(grads, state, params, batch=batch)
      updates = jax.tree.map(lambda u: -lr * u, updates)
      return (optax.apply_updates(params, updates), state), None
    return jax.lax.scan(step, (params, tx.init(params)),
                        jnp.arange(steps))[0]
  return run


def _run_sgd(lr, steps, **kfac_options):
  """``(initial params, (params, state))`` after ``_sgd_runner``'s steps."""
  params = init_params()
  return params, _sgd_runner(steps, **kfac_options)(params, lr)


def test_health_reports_a_run_that_blows_up_its_parameters():
  """Issue 24: runs that did not learn at lr 0.1 grew their weights while
  every counter stayed 0 and ``kfl.health`` said ok. The state keeps the
  parameters' norm at the first and the latest update; growth beyond
  ``PARAM_GROWTH_LIMIT`` is not ok."""
  import importlib
  limit = importlib.import_module("kfac_jax_lite.optimizers.health").PARAM_GROWTH_LIMIT
  init, (_, state) = _run_sgd(0.01, 60)
  health = kfl.health(state)
  norm = lambda t: float(np.sqrt(sum(np.sum(np.square(x))
                                     for x in jax.tree.leaves(t))))
  kstate = state[0]
  assert float(kstate.health.param_norm_first) == pytest.approx(
      norm(init), rel=1e-5)
  assert health.ok and not health.blew_up, str(health)
  assert "param growth" in str(health) and "clipped" in str(health)
  _, (params, state) = _run_sgd(30.0, 60)
  health = kfl.health(state)
  assert not health.ok and health.blew_up, str(health)
  assert health.param_growth > limit
  assert "BLEW UP" in str(health)


LR_SWEEP = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0)


def test_the_learning_rate_is_a_knob():
  """Issue 36: K-FAC + SGD's learning rate acts as SGD users expect. With
  the defaults (``norm_constraint=1``) the KL clip bounds ``u``'s length
  in the preconditioner's metric (``√⟨u, g⟩``) by ``√norm_constraint``
  before SGD multiplies it by the lr, so the lr scales every step, clipped
  or not (the README's old ``norm_constraint=(0.01 / lr)**2`` undid that:
  every clipped step was the same at every lr). On the test MLP (100
  minibatch steps, the loss on 512 fresh examples): the default lr 0.01 is
  the best of {0.3x, 1x, 3x} (within 10%, the issue's criterion; measured
  0.133 against 0.196 and 0.142; before the young statistics 0.116 against
  0.21 and 0.19), a neighbour is measurably worse (not an inert lr: with
  the old constraint every clipped step was the same whatever the lr, and
  the three ended alike), and over a sweep 0.001-1 every run either trains with
  ``kfl.health`` ok or health says it is not ok (0.1 and above blew up:
  no run that blows up is called ok)."""
  init, held_out = init_params(), make_batch(1000, 512)
  start = float(loss_fn(init, held_out))
  final, ok = {}, {}
  for lr in LR_SWEEP:
    params, state = _run_sgd(lr, 100)[1]
    final[lr] = float(loss_fn(params, held_out))
    ok[lr] = kfl.health(state).ok
    trained = np.isfinite(final[lr]) and final[lr] < 0.5 * start
    assert trained or not ok[lr], (lr, start, final[lr], str(kfl.health(state)))
  around = [final[lr] for lr in (0.003, 0.01, 0.03)]
  assert final[0.01] <= 1.1 * min(around), final
  assert max(final[0.003], final[0.03]) > 1.3 * final[0.01], final
  assert ok[0.003] and ok[0.01] and ok[0.03], ok


# --- defaults ------------------------------------------------------------------------

def readme_defaults():
  """``{name: value}`` from the table of ``kfl.kfac`` defaults (the site's
  ``docs/defaults.md``, which the README links to)."""
  path = os.path.join(os.path.dirname(__file__), os.pardir, "docs",
                      "defaults.md")
  with open(path, encoding="utf-8") as f:
    text = f.read()
  section = text.split("\n## ", 1)[0]
  rows = re.findall(r"^\| `(\w+)` \| `([^`]+)` \|", section, re.M)
  return {name: eval(value, {"None": None}) for name, value in rows}  # noqa: S307


def test_readme_defaults_are_the_defaults():
  documented = readme_defaults()
  params = inspect.signature(kfl.kfac).parameters
  assert {"damping", "norm_constraint", "inverse_every", "cov_decay",
          "damping_mode", "estimation"} <= set(documented)
  for name, value in documented.items():
    assert params[name].default == value, name


def digits_batch(n=128):
  from sklearn.datasets import load_digits
  x, y = load_digits(return_X_y=True)
  return {"x": jnp.asarray(x[:n] / 16.0, jnp.float32), "y": jnp.asarray(y[:n])}


def conv_net():
  import flax.linen as nn

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = x.reshape(-1, 8, 8, 1)
      x = nn.relu(nn.LayerNorm()(nn.Conv(8, (3, 3))(x)))
      x = nn.relu(nn.Conv(16, (3, 3), strides=2)(x))
      return nn.Dense(10)(x.reshape(x.shape[0], -1))
  net = Net()
  params = net.init(jax.random.PRNGKey(0), jnp.zeros((1, 64)))

  def loss(p, b):
    return kfl.softmax_cross_entropy_with_integer_labels(
        net.apply(p, b["x"]), b["y"]).mean()
  return params, loss


def test_defaults_train_a_conv_net_with_sgd_momentum_at_every_lr():
  """``kfl.kfac(loss_fn, batch)`` + ``sgd(lr, momentum=0.9)`` at lr 0.01
  and 0.1 (the learning rate is an argument: one compile), 30 steps on
  digits; and ``kfac_optimizer`` with its defaults."""
  params, loss = conv_net()
  batch = digits_batch()
  tx = optax.chain(kfl.kfac(loss, batch), optax.trace(decay=0.9))

  @optimized_jit  # Its time is running 30 conv steps, not compiling.
  def run(params, lr):
    def step(carry, _):
      params, state = carry
      grads = jax.grad(loss)(params, batch)
      updates, state = tx.update(grads, state, params, batch=batch)
      updates = jax.tree.map(lambda u: -lr * u, updates)
      return (optax.apply_updates(params, updates), state), None
    (params, state), _ = jax.lax.scan(step, (params, tx.init(params)), None, 30)
    return loss(params, batch), state

  initial = float(loss(params, batch))
  for lr in (0.01, 0.1):
    final, state = run(params, jnp.float32(lr))
    assert np.isfinite(float(final)) and float(final) < 0.5 * initial, (lr, final)
    assert kfl.health(state).ok, kfl.health(state)


# --- kfac_optimizer ------------------------------------------------------------------

def test_kfac_optimizer_raises_damping_and_rejects_a_non_finite_step():
  """A step whose new loss is not finite (ρ = -inf) raises λ by 1/ω and is
  rejected (a zero update); a step the model predicts no reduction for
  (a zero gradient) leaves λ alone."""
  start = init_params()["dense0"]["w"]  # Computed once, eagerly.

  def fragile_loss(params, batch):  # NaN once the first kernel moves at all.
    moved = jnp.any(params["dense0"]["w"] != start)
    return jnp.where(moved, jnp.nan, loss_fn(params, batch))

  opt = kfl.kfac_optimizer(fragile_loss, BATCH, initial_damping=0.1,
                           damping_adaptation_interval=1)
  params = init_params()
  state = opt.init(params)
  grads = jax.grad(loss_fn)(params, BATCH)
  step, state = jax.jit(opt.update)(grads, state, params, batch=BATCH)
  omega = (19 / 20) ** 1
  assert float(state.rho) == -np.inf
  # 0.1 / ω^1 in a handful of float32 operations.
  assert_rounding_close(np.asarray(state.damping), 0.1 / omega, terms=1,
                        depth=4)
  assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(step))
  zero = jax.tree.map(jnp.zeros_like, grads)
  _, state2 = jax.jit(opt.update)(zero, state, params, batch=BATCH)
  np.testing.assert_allclose(float(state2.damping), float(state.damping))


def test_kfac_optimizer_defaults_keep_momentum_sane_and_train():
  """Defaults on the digits MLP, 60 steps: finite, trains, μ in [0, 0.99]
  (unclipped it reached -0.8 in issue 8), damping above its floor."""
  from sklearn.datasets import load_digits
  x, y = load_digits(return_X_y=True)
  batch = {"x": jnp.asarray(x / 16.0, jnp.float32), "y": jnp.asarray(y)}
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  sizes = (64, 32, 32, 10)
  params = [(jax.random.normal(k, (i, o)) / np.sqrt(i), jnp.zeros(o))
            for k, i, o in zip(keys, sizes[:-1], sizes[1:])]

  def mlp_loss(params, batch):
    h = batch["x"]
    for i, (w, b) in enumerate(params):
      h = h @ w + b
      h = jnp.tanh(h) if i < len(params) - 1 else h
    return kfl.softmax_cross_entropy_with_integer_labels(h, batch["y"]).mean()

  opt = kfl.kfac_optimizer(mlp_loss, batch)

  @jax.jit
  def run(params):
    def step(carry, _):
      params, state = carry
      grads = jax.grad(mlp_loss)(params, batch)
      updates, state = opt.update(grads, state, params, batch=batch)
      return (optax.apply_updates(params, updates), state), (
          state.momentum, state.learning_rate, state.damping)
    (params, state), trace = jax.lax.scan(
        step, (params, opt.init(params)), None, 60)
    return mlp_loss(params, batch), state, trace

  initial = float(mlp_loss(params, batch))
  final, state, (mu, alpha, damping) = run(params)
  assert np.isfinite(float(final)) and float(final) < 0.1 * initial
  assert np.all((mu >= 0) & (mu <= 0.99)) and np.all(np.isfinite(alpha))
  floor = inspect.signature(kfl.kfac_optimizer).parameters["min_damping"].default
  assert np.all(damping > floor)
  assert kfl.health(state).ok
