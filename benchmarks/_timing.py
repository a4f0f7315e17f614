"""Training steps and their timing, shared by the benchmark scripts.

* :func:`make_step` is the one definition of a training step in each
  style the benchmarks time: ``(params, opt_state, key)`` in, the same
  out, and the loss; :class:`Stepper` jits it with the carry donated, as a
  training loop should be written (without donation XLA copies the state
  buffers that the step passes through a ``lax.cond``).
* :func:`round_robin` times several steps one step of each in turn, so a
  machine whose load drifts slows all of them alike; :func:`median_times`
  does the same for plain functions.
* :class:`KfacJaxStepper` drives ``kfac_jax.Optimizer`` (kfac-jax 0.0.8,
  in its own jax 0.9.1 virtualenv) behind the same ``.step(batch)``.
"""
from __future__ import annotations

import statistics
import time
import warnings

import jax
import jax.numpy as jnp
import optax

from _kfl import kfl

STYLES = ("grad", "batch=", "1-pass", "1-pass+batch=", "cov", "cov+batch=")


def fresh(tree):
  """A copy of ``tree`` in which every leaf has its own buffer: a donated
  carry must not share one (an optimizer state may hold an array twice),
  and the caller's arrays stay valid."""
  return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def make_step(loss_fn, tx, style, est_fn=None):
  """``step(carry, batch) -> (carry, loss)``, ``carry = (params, opt_state,
  key)``: one update of ``tx`` on ``loss_fn(params, batch)``.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``.
    tx: an ``optax.GradientTransformation`` (``kfl.kfac`` and
      ``kfl.kfac_optimizer`` take the keywords below).
    style: how the update is computed:
      ``"grad"``: ``jax.value_and_grad(loss_fn)``, ``tx.update(g, s, p)``;
      ``"batch="``: the same, then ``tx.update(g, s, p, batch=batch)``
      (K-FAC's statistics take their own forward pass);
      ``"1-pass"``: ``est = est_fn(p, batch, key)``, then ``tx.update(
      est.grads, s, p, stats=est.stats)`` (the gradient and the statistics
      share one forward pass); ``"1-pass+batch="``: the same, also passing
      ``batch=`` (``kfl.kfac_optimizer``'s quadratic model uses it);
      ``"cov"``: ``"1-pass"`` with ``est_fn(..., with_stats=kfl.stats_due(
      s))``, so the statistics are computed only on the updates that
      accumulate them (``kfl.kfac(..., cov_every=K)``); ``"cov+batch="``:
      ``"cov"`` also passing ``batch=`` (a planned ``kfl.kfac_optimizer``).
    est_fn: ``kfl.value_grad_and_stats(loss_fn, ...)``, for the ``1-pass``
      styles.
  """
  if style not in STYLES:
    raise ValueError(f"unknown style {style!r}; one of {STYLES}")
  if style.startswith("1-pass") or style.startswith("cov"):
    if est_fn is None:
      raise ValueError(f"style {style!r} needs est_fn")

  def step(carry, batch):
    p, s, key = carry
    key, sub = jax.random.split(key)
    if style in ("grad", "batch="):
      loss, g = jax.value_and_grad(loss_fn)(p, batch)
      u, s = (tx.update(g, s, p, batch=batch) if style == "batch="
              else tx.update(g, s, p))
    else:
      extra = ({"with_stats": kfl.stats_due(s)} if style.startswith("cov")
               else {})
      est = est_fn(p, batch, sub, **extra)
      loss = est.loss
      kw = {"batch": batch} if style.endswith("+batch=") else {}
      u, s = tx.update(est.grads, s, p, stats=est.stats, **kw)
    return (optax.apply_updates(p, u), s, key), loss

  return step


def init_carry(params, tx, seed=0):
  """``fresh((params, tx.init(params), PRNGKey(seed)))``: a step's carry."""
  return fresh((params, tx.init(params), jax.random.PRNGKey(seed)))


def jit_step(step):
  """``jax.jit(step, donate_argnums=0)``: the carry is donated."""
  return jax.jit(step, donate_argnums=0)


def state_bytes(tree):
  """Bytes of the arrays in ``tree``."""
  return sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


class Stepper:
  """A jitted, donated :func:`make_step` with its carry.

  ``stepper.step(batch)`` runs one update and returns its loss, blocked on
  (``jax.block_until_ready``); ``stepper.params()`` and
  ``stepper.opt_state()`` the current parameters and optimizer state.
  ``name`` labels it in a table; ``state_bytes`` is the optimizer state's
  size.
  """

  def __init__(self, loss_fn, params, tx, style, example_batch=None, seed=0,
               name="", est_fn=None):
    if est_fn is None and style not in ("grad", "batch="):
      est_fn = kfl.value_grad_and_stats(loss_fn, params, example_batch)
    self.name = name
    self._step = jit_step(make_step(loss_fn, tx, style, est_fn))
    self._carry = init_carry(params, tx, seed)
    self.state_bytes = state_bytes(self._carry[1])

  def step(self, batch):
    self._carry, loss = self._step(self._carry, batch)
    return jax.block_until_ready(loss)

  def params(self):
    return self._carry[0]

  def opt_state(self):
    return self._carry[1]


def round_robin(steps, batches, n, start=0):
  """Seconds of each of ``n`` rounds per step function, round-robin.

  Round ``i`` calls every ``step(batches[(start + i) % len(batches)])`` in
  turn; each must block until its result is ready. Returns one list of
  ``n`` durations per step function.
  """
  times = [[] for _ in steps]
  for i in range(n):
    batch = batches[(start + i) % len(batches)]
    for ts, step in zip(times, steps):
      t0 = time.perf_counter()
      step(batch)
      ts.append(time.perf_counter() - t0)
  return times


def median_times(pieces, reps):
  """Median seconds of each ``(name, fn, args, ...)``, ``reps`` runs
  round-robin after a first, compiling call of each."""
  calls = [lambda _, fn=fn, args=args: jax.block_until_ready(fn(*args))
           for _, fn, args, *_ in pieces]
  for call in calls:
    call(None)  # Compile.
  return [statistics.median(ts) for ts in round_robin(calls, [None], reps)]


class KfacJaxStepper:
  """``kfac_jax.Optimizer`` behind :class:`Stepper`'s interface.

  Args:
    kfac_jax: the imported ``kfac_jax`` module.
    loss_fn: the loss with kfac-jax's loss registration.
    params: the initial parameters (copied).
    seed: seeds the optimizer's keys.
    name: the row name.
    **settings: ``kfac_jax.Optimizer``'s keywords besides
      ``value_and_grad_func``, ``l2_reg=0`` and ``multi_device=False``.
      With ``num_burnin_steps = n > 0`` the first step runs kfac-jax's
      burn-in (``n`` statistics steps) on its batch; with
      ``use_adaptive_damping`` the first step also compiles the step that
      adapts the damping, on a copy that is then dropped, so that the
      compile is not on a later step's clock (ours is not either).
  """

  def __init__(self, kfac_jax, loss_fn, params, seed=0, name="kfac-jax 0.0.8",
               **settings):
    # kfac-jax's burn-in donates a batch-shaped buffer XLA cannot reuse.
    warnings.filterwarnings("ignore", "Some donated buffers were not usable")
    self.name = name
    self._opt = kfac_jax.Optimizer(
        value_and_grad_func=jax.value_and_grad(loss_fn), l2_reg=0.0,
        multi_device=False, **settings)
    self._burnin = settings.get("num_burnin_steps", 0)
    self._adapt = (settings.get("use_adaptive_damping", False)
                   and settings.get("damping_adaptation_interval"))
    self._params = fresh(params)
    self._key = jax.random.PRNGKey(seed)
    self._state = None
    self.state_bytes = None

  def init(self, batch):
    """Initialises the optimizer state on ``batch`` (else the first step
    does); sets ``state_bytes``."""
    self._key, key = jax.random.split(self._key)
    self._state = self._opt.init(self._params, key, batch)
    self.state_bytes = state_bytes(self._state)

  def step(self, batch):
    first = self._state is None
    if first:
      self.init(batch)
    self._key, key = jax.random.split(self._key)
    if first and self._burnin:
      # Burn-in statistics on the first batch (kfac-jax takes an iterator).
      data = {"data_iterator": iter([batch] * (self._burnin + 1))}
    else:
      data = {"batch": batch}
    self._params, self._state, stats = self._opt.step(
        self._params, self._state, key, **data)
    if first and self._adapt:
      state = fresh(self._state)
      state.step_counter = jnp.asarray(self._adapt - 1,
                                       state.step_counter.dtype)
      jax.block_until_ready(self._opt.step(fresh(self._params), state, key,
                                           batch=batch))
    return jax.block_until_ready(stats["loss"])

  def params(self):
    return self._params
