"""``kfl.kfac``'s plan (issue 46): statistics and refresh intervals chosen
from the cost model within a budget, checked against hand counts.

The hand counts are the design brief's cost model written out with the
sizes counted by hand (per dense layer ``a = d_in + 1``, ``b = d_out``,
batch ``M``; a convolution ``a = kh·kw·c_in + 1`` with ``P`` output
positions): SGD ``W = 6·M·P·a·b``; one update's statistics in their own
pass ``S = 2·M·P·a·b`` (forward) ``+ 2·M·P·a·b`` (sampled backward)
``+ 2·M·P·(a² + b²)`` (covariances); preconditioning ``P = 2·(a²b + ab²)``;
one refresh ``R = 2·(a³ + b³)`` (Gauss–Jordan, CPU's ``"auto"``). The plan
must be the first pair of the preference order (refresh interval first,
then statistics interval) whose price ``1 + (S/K + P + R/T)/W`` fits.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax_lite as kfl
from kfac_jax_lite.estimators import _plan

TS = (10, 20, 50, 100)
KS = (1, 2, 5, 10, 20, 50, 100)


def _mlp_loss(params, batch):
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  out = h @ params["w2"] + params["b2"]
  return kfl.softmax_cross_entropy_with_integer_labels(out, batch["y"]).mean()


def _mlp(m=64):
  k = jax.random.split(jax.random.PRNGKey(0), 3)
  params = {"w1": jax.random.normal(k[0], (20, 30)) / 5, "b1": jnp.zeros(30),
            "w2": jax.random.normal(k[1], (30, 5)) / 6, "b2": jnp.zeros(5)}
  batch = {"x": jax.random.normal(k[2], (m, 20)),
           "y": jnp.arange(m, dtype=jnp.int32) % 5}
  return params, batch


def _dense_parts(m, layers):
  """``(W, S, P, R)`` by hand for dense layers ``[(a, b)]``."""
  w = sum(6 * m * a * b for a, b in layers)
  s = sum(2 * m * a * b + 2 * m * a * b + 2 * m * (a * a + b * b)
          for a, b in layers)
  p = sum(2 * (a * a * b + a * b * b) for a, b in layers)
  r = sum(2 * (a ** 3 + b ** 3) for a, b in layers)
  return w, s, p, r


def _check_first_fit(chosen, parts, budget, raise_target=True):
  """``chosen`` is the first pair in the preference order that fits the
  budget (or the floor-raised target, unless not ``raise_target``: a
  default budget relative to the floor), priced by hand."""
  w, s, p, r = parts
  price = lambda k, t: 1 + (s / k + p + r / t) / w
  floor = 1 + p / w
  target = (max(budget, floor + _plan.MIN_SHARE * (budget - 1))
            if raise_target else budget)
  order = [(k, t) for t in TS for k in KS if k <= t]
  fits = [pair for pair in order if price(*pair) <= target]
  assert fits, "the test's budget must be feasible"
  assert (chosen.cov_every, chosen.inverse_every) == fits[0]
  assert chosen.price == pytest.approx(price(*fits[0]))
  assert chosen.floor == pytest.approx(floor)
  assert chosen.every_step == pytest.approx(price(1, 10))
  return fits[0]


@pytest.mark.parametrize("budget", [1.6, 2.5, 4.0])
def test_dense_plan_against_a_hand_count(budget):
  params, batch = _mlp()
  plan = kfl.describe(_mlp_loss, params, batch, budget=budget).plan
  # Layer 1: 20 inputs + bias -> 30; layer 2: 30 + bias -> 5; M = 64.
  parts = _dense_parts(64, [(21, 30), (31, 5)])
  k, t = _check_first_fit(plan, parts, budget)
  assert plan.met and plan.price <= budget
  assert plan.planned == ("cov_every", "inverse_every")


def test_the_budgets_give_different_plans():
  """The three budgets above are not one plan: a larger one buys
  statistics (and refreshes) back, down to every step."""
  params, batch = _mlp()
  plans = [kfl.describe(_mlp_loss, params, batch, budget=b).plan
           for b in (1.6, 2.5, 4.0)]
  pairs = [(p.cov_every, p.inverse_every) for p in plans]
  assert len(set(pairs)) == 3, pairs
  assert pairs[-1] == (1, 10)
  assert [p.price for p in plans] == sorted(p.price for p in plans)


def _conv_loss(params, batch):
  h = jax.lax.conv_general_dilated(
      batch["x"], params["k"], (1, 1), "VALID",
      dimension_numbers=("NHWC", "HWIO", "NHWC")) + params["kb"]
  h = jax.nn.relu(h).mean(axis=(1, 2))
  out = h @ params["w"] + params["b"]
  return kfl.softmax_cross_entropy_with_integer_labels(out, batch["y"]).mean()


def test_conv_plan_against_a_hand_count():
  k = jax.random.split(jax.random.PRNGKey(1), 3)
  params = {"k": jax.random.normal(k[0], (3, 3, 2, 8)) / 4,
            "kb": jnp.zeros(8), "w": jax.random.normal(k[1], (8, 4)) / 3,
            "b": jnp.zeros(4)}
  batch = {"x": jax.random.normal(k[2], (16, 6, 6, 2)),
           "y": jnp.arange(16, dtype=jnp.int32) % 4}
  budget = 1.5
  plan = kfl.describe(_conv_loss, params, batch, budget=budget).plan
  # Conv: a = 3·3·2 + 1 = 19, b = 8, P = 4·4 = 16 output positions (VALID
  # on 6x6); dense: a = 9, b = 4, P = 1; M = 16.
  m, pc = 16, 16
  conv_a, conv_b, a2, b2 = 19, 8, 9, 4
  w = 6 * m * pc * conv_a * conv_b + 6 * m * a2 * b2
  s = (4 * m * pc * conv_a * conv_b + 2 * m * pc * (conv_a ** 2 + conv_b ** 2)
       + 4 * m * a2 * b2 + 2 * m * (a2 ** 2 + b2 ** 2))
  p = (2 * (conv_a ** 2 * conv_b + conv_a * conv_b ** 2)
       + 2 * (a2 ** 2 * b2 + a2 * b2 ** 2))
  r = 2 * (conv_a ** 3 + conv_b ** 3) + 2 * (a2 ** 3 + b2 ** 3)
  _check_first_fit(plan, (w, s, p, r), budget)
  assert plan.cov_every > 1  # Every-step statistics would not fit.


def test_given_intervals_win_and_are_not_planned():
  params, batch = _mlp()
  both = kfl.describe(_mlp_loss, params, batch, cov_every=3,
                      inverse_every=7).plan
  assert (both.cov_every, both.inverse_every, both.planned) == (3, 7, ())
  assert "as given" in both.line
  one = kfl.describe(_mlp_loss, params, batch, cov_every=3, budget=2.0).plan
  assert one.cov_every == 3 and one.planned == ("inverse_every",)
  w, s, p, r = _dense_parts(64, [(21, 30), (31, 5)])
  fits = [t for t in TS if 1 + (s / 3 + p + r / t) / w <= 2.0]
  assert one.inverse_every == fits[0]


def test_transform_follows_the_plan():
  """The transform's statistics come every ``K`` updates (``stats_due``)
  and its inverses are refreshed at ``T`` (a block's cache step)."""
  params, batch = _mlp()
  budget = 2.5
  plan = kfl.describe(_mlp_loss, params, batch, budget=budget).plan
  k, t = plan.cov_every, plan.inverse_every
  assert k > 1
  tx = kfl.kfac(_mlp_loss, batch, budget=budget)
  grads = jax.grad(_mlp_loss)(params, batch)
  update = jax.jit(lambda s: tx.update(grads, s, params, batch=batch)[1])
  state = tx.init(params)
  due, refreshed = [], []
  for _ in range(t + 1):
    due.append(bool(kfl.stats_due(state)))
    state = update(state)
    refreshed.append(int(state.blocks["w1"].a.cache.step))
  young = lambda i: 0 < i < k and i & (i - 1) == 0  # 1, 2, 4, ... below K.
  assert due == [i % k == 0 or young(i) for i in range(t + 1)]
  assert refreshed[-1] == t  # The refresh at step T (count t).
  assert refreshed[t - 1] < t


def test_describe_prints_the_plan_line():
  params, batch = _mlp()
  table = kfl.describe(_mlp_loss, params, batch, budget=2.5)
  plan = table.plan
  line = (f"plan: statistics every {plan.cov_every} steps, refresh every "
          f"{plan.inverse_every} (planned (cov_every, inverse_every) for "
          f"budget 2.5: ~{plan.price:.2f}x an SGD step")
  assert line in str(table)
  # The step price line is priced at the plan's intervals.
  assert f"cov_every={plan.cov_every}" in table.price_line
  assert f"inverse_every={plan.inverse_every}" in table.price_line


def test_an_unmeetable_budget_is_said():
  """A wide layer on a small batch: the preconditioning alone is more than
  the budget; the plan says so and keeps the statistics' share small."""
  params = {"w": jnp.ones((64, 64)) / 8}
  batch = {"x": jnp.ones((16, 64)), "y": jnp.zeros((16, 64))}
  loss = lambda p, b: kfl.squared_error(b["x"] @ p["w"], b["y"]).mean()
  plan = kfl.describe(loss, params, batch, budget=1.3).plan
  assert not plan.met and plan.floor > 1.3
  assert "NOT met" in plan.line
  assert plan.price <= plan.floor + _plan.MIN_SHARE * 0.3 + 1e-9


def _optimizer_plan_by_hand(parts, fraction, budget=None):
  """kfl.kfac_optimizer's plan by hand: its quadratic model ``Q = 2·f·W``
  (a linearised forward with two tangents, ``5·W/3``, and ρ's forward,
  ``W/3``, on the share ``f``) in every price and in the floor; budget
  None: the floor plus 0.3; the overhead the statistics and refresh get
  at least ``MIN_SHARE·(budget − 1 − Q/W)``."""
  w, s, p, r = parts
  q = 2 * fraction * w
  price = lambda k, t: 1 + (q + s / k + p + r / t) / w
  floor = 1 + (q + p) / w
  target = floor + 0.3 if budget is None else max(
      budget, floor + _plan.MIN_SHARE * (budget - 1 - q / w))
  budget = floor + 0.3 if budget is None else budget
  order = [(k, t) for t in TS for k in KS if k <= t]
  fits = [pair for pair in order if price(*pair) <= target]
  pair = fits[0] if fits else max(order, key=lambda kt: (kt[1], kt[0]))
  return pair, price(*pair), floor, budget, q / w


@pytest.mark.parametrize("fraction,budget", [(1.0, None), (0.25, None),
                                             (0.5, 4.0), (1.0, 3.5),
                                             (1.0, 2.0)])
def test_optimizer_plan_against_a_hand_count(fraction, budget):
  params, batch = _mlp()
  plan = kfl.describe(_mlp_loss, params, batch, model_fraction=fraction,
                      budget=budget).plan
  parts = _dense_parts(64, [(21, 30), (31, 5)])
  pair, price, floor, want_budget, model = _optimizer_plan_by_hand(
      parts, fraction, budget)
  assert (plan.cov_every, plan.inverse_every) == pair
  assert plan.price == pytest.approx(price)
  assert plan.floor == pytest.approx(floor)
  assert plan.budget == pytest.approx(want_budget)
  assert plan.model == pytest.approx(model)
  line = plan.line
  assert f"quadratic model {model:.2f}x every step" in line
  assert plan.met == (price <= want_budget + 1e-9)
  assert ("NOT met: the quadratic model and the preconditioning" in line) \
      == (not plan.met)
  assert f"for budget {want_budget:.3g}" in line
  # kfl.kfac's plan of the same model prices no quadratic model.
  assert kfl.describe(_mlp_loss, params, batch).plan.model is None


def test_optimizer_plans_when_asked_and_follows_its_plan():
  """kfl.kfac_optimizer keeps statistics every step and a refresh every 10
  by default; with both intervals None it plans them (budget None: its
  every-step work plus 0.3), and its statistics come every K updates."""
  params, batch = _mlp()
  plan = kfl.describe(_mlp_loss, params, batch, model_fraction=1.0).plan
  k, t = plan.cov_every, plan.inverse_every
  assert k > 1, plan.line  # Else the test below tests nothing.
  by_default = kfl.kfac_optimizer(_mlp_loss, batch)
  planned = kfl.kfac_optimizer(_mlp_loss, batch, cov_every=None,
                               inverse_every=None)
  for opt, want_k, want_t in ((by_default, 1, 10), (planned, k, t)):
    due, refreshed = _run_intervals(opt, params, batch, want_k, want_t,
                                    lambda s: s.kfac.blocks)
    young = lambda i: 0 < i < want_k and i & (i - 1) == 0
    assert due == [i % want_k == 0 or young(i)
                   for i in range(len(due))], (want_k, due)
    assert refreshed[want_t] == want_t and refreshed[want_t - 1] < want_t


def _run_intervals(tx, params, batch, want_k, want_t, blocks_of):
  """``(due, refreshed)`` over ``max(2K, T) + 1`` updates of ``tx`` on
  one batch: ``kfl.stats_due`` before each, and after each the step of
  layer ``w1``'s last refresh (``blocks_of(state)``: its block states)."""
  grads = jax.grad(_mlp_loss)(params, batch)
  update = jax.jit(lambda s: tx.update(grads, s, params, batch=batch)[1])
  state = tx.init(params)
  due, refreshed = [], []
  for _ in range(max(2 * want_k, want_t) + 1):
    due.append(bool(kfl.stats_due(state)))
    state = update(state)
    refreshed.append(int(blocks_of(state)["w1"].a.cache.step))
  return due, refreshed


def _eigen_adam_parts(m, layers):
  """``(W, S, P, R)`` by hand of ``kfl.eigen_adam``'s step: K-FAC's
  statistics, the rotations in and out every step (``2 · 2·(a²b + ab²)``:
  ``Q_Aᵀ M Q_G`` and back) and an ``eigh`` of each factor per refresh
  (``10·(a³ + b³)``)."""
  w, s, p, _ = _dense_parts(m, layers)
  return w, s, 2 * p, sum(10 * (a ** 3 + b ** 3) for a, b in layers)


@pytest.mark.parametrize("budget", [None, 3.0])
def test_eigen_adam_plan_against_a_hand_count(budget):
  params, batch = _mlp()
  plan = kfl.describe(_mlp_loss, params, batch, optimizer="eigen_adam",
                      budget=budget).plan
  w, s, p, r = _eigen_adam_parts(64, [(21, 30), (31, 5)])
  floor = 1 + p / w
  want = floor + 0.3 if budget is None else budget
  assert plan.budget == pytest.approx(want)
  _check_first_fit(plan, (w, s, p, r), want, raise_target=budget is not None)
  assert plan.met
  assert "planned (cov_every, refresh_every)" in plan.line


def test_eigen_adam_plans_when_asked_and_follows_its_plan():
  """kfl.eigen_adam keeps statistics every step and bases every 10 by
  default; with both intervals None it follows describe's plan for it:
  statistics every K updates, the bases refreshed at multiples of T."""
  params, batch = _mlp()
  plan = kfl.describe(_mlp_loss, params, batch, optimizer="eigen_adam").plan
  k, t = plan.cov_every, plan.inverse_every
  assert k > 1, plan.line  # Else the test below tests nothing.
  for tx, want_k, want_t in (
      (kfl.eigen_adam(_mlp_loss, batch), 1, 10),
      (kfl.eigen_adam(_mlp_loss, batch, cov_every=None, refresh_every=None),
       k, t)):
    due, refreshed = _run_intervals(tx, params, batch, want_k, want_t,
                                    lambda s: s.blocks)
    assert due == [i % want_k == 0 for i in range(len(due))], (want_k, due)
    assert refreshed[want_t] == want_t and refreshed[want_t - 1] < want_t


def test_eigen_adam_refuses_to_plan_what_is_not_priced():
  params, batch = _mlp()
  with pytest.raises(ValueError, match="not priced, so not planned"):
    kfl.eigen_adam(_mlp_loss, batch, basis="shampoo", cov_every=None)
  with pytest.raises(ValueError, match="optimizer must be"):
    kfl.describe(_mlp_loss, params, batch, optimizer="adam")
  with pytest.raises(ValueError, match="model_fraction is kfl.kfac_optimizer"):
    kfl.describe(_mlp_loss, params, batch, optimizer="eigen_adam",
                 model_fraction=0.5)


@pytest.mark.parametrize("fraction", [0.0, 1.5])
def test_describe_refuses_a_bad_model_fraction(fraction):
  params, batch = _mlp()
  with pytest.raises(ValueError, match="model_fraction"):
    kfl.describe(_mlp_loss, params, batch, model_fraction=fraction)


@pytest.mark.parametrize("budget", [1.0, 0.5, "2", True])
def test_a_bad_budget_is_refused(budget):
  _, batch = _mlp()
  with pytest.raises(ValueError, match="budget"):
    kfl.kfac(_mlp_loss, batch, budget=budget)


def _effective_examples(weights, m):
  """``M·(Σw)²/Σw²``: the examples an EMA with per-update weights ``w``
  averages, ``M`` examples per update."""
  weights = np.asarray(weights)
  return m * weights.sum() ** 2 / (weights ** 2).sum()


def test_ema_horizon_in_examples_is_kept_under_sparser_statistics():
  """Statistics every ``K`` steps (and at the young steps) average as many
  examples as every step (float64). One dense layer without bias whose step-``t`` batch is ``M``
  copies of the one-hot input ``e_t``: the input factor's diagonal is then
  the EMA's weight of each step's statistics, read from the real state."""
  with jax.enable_x64(True):
    n, k, m = 8, 4, 3
    d = n * k

    def loss(p, b):
      return kfl.squared_error(b["x"] @ p["w"], b["y"]).mean()

    params = {"w": jnp.zeros((d, 2), jnp.float64)}
    eye = jnp.eye(d, dtype=jnp.float64)

    def weights(cov_every, steps):
      tx = kfl.kfac(loss, {"x": jnp.zeros((m, d)), "y": jnp.zeros((m, 2))},
                    cov_every=cov_every, inverse_every=1000)
      grads = {"w": jnp.zeros((d, 2), jnp.float64)}
      update = jax.jit(lambda s, x: tx.update(
          grads, s, params, batch={"x": x, "y": jnp.ones((m, 2))})[1])
      state = tx.init(params)
      for t in range(steps):
        state = update(state, jnp.tile(eye[t], (m, 1)))
      a = state.blocks["w"].a
      assert a.cov.dtype == jnp.float64
      return np.diagonal(np.asarray(a.cov / a.weight), axis1=-2,
                         axis2=-1).reshape(-1)

    sparse = weights(k, n * k)
    # Steps 0, K, 2K, ... and the young steps 1, 2 (1, 2, 4, ... below K).
    steps = sorted({0, 1, 2} | set(range(0, n * k, k)))
    np.testing.assert_array_equal(np.flatnonzero(sparse), steps)
    every = weights(1, len(steps))  # As many updates, every step.
    np.testing.assert_allclose(every.sum(), 1.0, rtol=1e-12)
    np.testing.assert_allclose(sparse.sum(), 1.0, rtol=1e-12)
    np.testing.assert_allclose(
        _effective_examples(sparse[steps], m),
        _effective_examples(every, m), rtol=1e-12)
    # And the weights are the same EMA's, update for update.
    np.testing.assert_allclose(sparse[steps], every[:len(steps)], rtol=1e-12)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_health_sees_every_loss_of_the_planned_one_pass_step(fraction):
  """The README's step with ``with_stats=kfl.stats_due(state)`` and no
  ``loss=``: the estimate's run entry carries the whole batch's loss also on
  the steps without statistics (not their zeros, not the share's loss)."""
  params, batch = _mlp()
  tx = kfl.kfac(_mlp_loss, batch, budget=2.5, stats_fraction=fraction)
  est_fn = kfl.value_grad_and_stats(_mlp_loss, params, batch,
                                    stats_fraction=fraction)

  @jax.jit
  def step(state, key):
    est = est_fn(params, batch, key, with_stats=kfl.stats_due(state))
    return tx.update(est.grads, state, params, stats=est.stats)[1]

  state = tx.init(params)
  for i in range(6):
    state = step(state, jax.random.PRNGKey(i))
  h = kfl.health(state)
  assert h.num_losses == 6
  # The parameters do not move here: every loss seen is the batch's.
  loss = float(_mlp_loss(params, batch))
  assert h.loss_first == pytest.approx(loss, rel=1e-5)
  assert h.loss_recent == pytest.approx(loss, rel=1e-5)
