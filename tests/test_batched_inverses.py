"""The refresh's inverses computed together (``factor.batched_inverses``,
``_inverse.gauss_jordan_inverses``) and the sums of per-leaf scalars kept
as one reduction (``factor.sum_scalars``): the same numbers as one at a
time, each input's own verdict, and a compiled update whose program does
not grow with the number of equal layers the way it did."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kfl
from kfac_jax_lite import factor as fac
from kfac_jax_lite.factor import _inverse

from _helpers import x64_mode


def random_psd(rng, n, batch=()):
  m = rng.normal(size=batch + (n, n + 2))
  return m @ np.swapaxes(m, -1, -2) / m.shape[-1]


SIZES = ((5, ()), (64, ()), (70, ()), (100, (3,)), (127, ()), (129, (2, 2)))
"""Sides and batch axes: one pivot block, exactly one, two (three of them,
one a batch of 3), and three blocks with two batch axes."""


def test_inverses_computed_together_equal_one_at_a_time():
  """Float64: each of the mixed sizes and batches equals
  ``gauss_jordan_inverse`` of it alone (the batch shares no arithmetic:
  within rounding of the batched products) and the exact inverse."""
  rng = np.random.default_rng(0)
  with x64_mode(True):
    ms = [jnp.asarray(random_psd(rng, n, batch) + 0.1 * np.eye(n))
          for n, batch in SIZES]
    together = _inverse.gauss_jordan_inverses(ms)
    for m, (inv, ok) in zip(ms, together):
      alone, alone_ok = _inverse.gauss_jordan_inverse(m)
      exact = np.linalg.inv(np.asarray(m))
      scale = np.abs(exact).max()
      assert inv.shape == m.shape and inv.dtype == m.dtype
      assert bool(ok) and bool(alone_ok) and ok.shape == ()
      np.testing.assert_allclose(inv, alone, rtol=0, atol=1e-13 * scale)
      np.testing.assert_allclose(inv, exact, rtol=0, atol=1e-11 * scale)


def test_each_input_keeps_its_own_verdict():
  """In one stack (all pad to 128), an indefinite matrix, one with a NaN
  and one with an inf are each not ok, and the good ones beside them are
  ok and right; a batch of two with one bad matrix is not ok as a whole."""
  rng = np.random.default_rng(1)
  good = [jnp.asarray(random_psd(rng, n) + np.eye(n), jnp.float32)
          for n in (100, 120)]
  indefinite = good[0] - 3 * jnp.max(jnp.diag(good[0])) * jnp.eye(100)
  nan = good[1].at[3, 7].set(jnp.nan)
  inf = good[0].at[50, 50].set(jnp.inf)
  pair = jnp.stack([good[1], nan])
  out = _inverse.gauss_jordan_inverses(
      [good[0], indefinite, nan, good[1], inf, pair])
  assert [bool(ok) for _, ok in out] == [True, False, False, True, False,
                                         False]
  for m, (inv, _) in ((good[0], out[0]), (good[1], out[3])):
    eye = np.asarray(m, np.float64) @ np.asarray(inv, np.float64)
    np.testing.assert_allclose(eye, np.eye(m.shape[0]), atol=1e-3)


def filled(rng, n, dtype):
  state = fac.init_factor(n, dtype=dtype)
  return fac.update_cov(state, jnp.asarray(random_psd(rng, n), dtype), 0.9)


@pytest.mark.parametrize("x64", [False, True])
def test_refreshes_through_one_batch_equal_their_own(x64):
  """``batched_inverses(fn)`` gives ``fn``'s result with every method
  name: the refreshed caches of factors of several sizes (with different
  dampings) equal their refresh one at a time, float32 within rounding
  and float64 to 1e-13; a power other than -1 (by ``eigh``) passes
  through."""
  rng = np.random.default_rng(2)
  with x64_mode(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    states = [filled(rng, n, dtype) for n in (7, 64, 65, 64, 130)]
    dampings = [0.1, 0.01, 0.2, 0.05, 0.3]

    def fn(method):
      out = [fac.refresh_cache(s, 3, damping=d, method=method)
             for s, d in zip(states, dampings)]
      out.append(fac.refresh_cache(states[1], 3, damping=0.1, exp=-0.5,
                                   method=method))
      return out

    together = jax.jit(lambda: fac.batched_inverses(fn, "gauss_jordan"))()
    alone = jax.jit(lambda: fn("gauss_jordan"))()
    for t, a in zip(together, alone):
      scale = float(jnp.abs(a.cache.matpower).max())
      tol = 1e-13 if x64 else 1e-4
      np.testing.assert_allclose(t.cache.matpower, a.cache.matpower,
                                 rtol=0, atol=tol * scale)
      assert int(t.cache.step) == 3 and int(t.cache.num_failed) == 0
    # "cholesky" and the other methods are not batched: the same result,
    # from one call of fn.
    calls = []
    counted = lambda method: (calls.append(method), fn(method))[1]
    chol = jax.jit(lambda: fac.batched_inverses(counted, "cholesky"))()
    assert calls == ["cholesky"]
    for t, a in zip(chol, jax.jit(lambda: fn("cholesky"))()):
      np.testing.assert_array_equal(t.cache.matpower, a.cache.matpower)


def test_a_function_that_asks_differently_the_second_time_is_refused():
  rng = np.random.default_rng(3)
  states = [filled(rng, n, jnp.float32) for n in (8, 9)]
  calls = []

  def changing(method):
    calls.append(None)
    picked = states if len(calls) == 1 else states[::-1]
    return [fac.refresh_cache(s, 1, damping=0.1, method=method)
            for s in picked]

  with pytest.raises(RuntimeError, match="same inverses in the same order"):
    fac.batched_inverses(changing, "gauss_jordan")

  def fewer(method):
    calls.append(None)
    picked = states if len(calls) % 2 else states[:1]
    return [fac.refresh_cache(s, 1, damping=0.1, method=method)
            for s in picked]

  calls.clear()
  with pytest.raises(RuntimeError, match="fewer inverses"):
    fac.batched_inverses(fewer, "gauss_jordan")


def test_sum_scalars_adds_them_all():
  xs = [jnp.float32(i) for i in range(1, 11)]
  assert float(fac.sum_scalars(xs)) == 55.0
  assert float(fac.sum_scalars(xs[:3])) == 6.0
  assert float(fac.sum_scalars([])) == 0.0
  total = fac.sum_scalars([jnp.float32(1), jnp.float32(jnp.nan)] + xs)
  assert np.isnan(float(total))
  assert fac.sum_scalars(xs, jnp.float16).dtype == jnp.float16


WIDTH = 130  # 130² weights are over factor._packing.SMALL: not packed.


def _update_program(depth):
  """The compiled text of K-FAC + SGD's step on an MLP of ``depth`` equal
  hidden layers of width ``WIDTH``."""
  dims = (10,) + (WIDTH,) * depth + (3,)
  keys = jax.random.split(jax.random.PRNGKey(0), len(dims))
  params = [{"w": jax.random.normal(k, (i, o)) / np.sqrt(i),
             "b": jnp.zeros(o)}
            for k, i, o in zip(keys, dims[:-1], dims[1:])]
  batch = {"x": jax.random.normal(keys[-1], (16, 10)),
           "y": jnp.arange(16) % 3}

  def loss_fn(p, b):
    h = b["x"]
    for layer in p[:-1]:
      h = jnp.tanh(h @ layer["w"] + layer["b"])
    logits = h @ p[-1]["w"] + p[-1]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, b["y"]).mean()

  tx = optax.chain(kfl.kfac(loss_fn, batch, estimation="empirical_shared",
                            inverse_method="gauss_jordan"),
                   optax.sgd(0.01))
  est = kfl.value_grad_and_stats(loss_fn, params, batch,
                                 estimation="empirical_shared")

  def step(p, s, b, k):
    e = est(p, b, k)
    u, s = tx.update(e.grads, s, p, stats=e.stats)
    return optax.apply_updates(p, u), s

  args = (params, tx.init(params), batch, jax.random.PRNGKey(1))
  return jax.jit(step).lower(*args).compile().as_text()


def test_the_compiled_update_does_not_copy_work_per_equal_layer():
  """From 2 to 8 equal hidden layers (4 to 10 Kronecker blocks): the
  refresh keeps its Gauss–Jordan loops per padded size (the factors of
  11, 130, 131 and 3 sides pad to 64 and 192: ``STACKS`` loops per size
  whatever the depth; one loop per factor before, 11 → 35), and the
  scalar additions of the KL clip and the finiteness verdicts grow with
  the layers, not with their square (a chain of ``n`` per-leaf sums fused
  into each of the ``n`` leaves' kernels: 117 → 621 before, 5.3x)."""
  programs = {d: _update_program(d) for d in (2, 8)}
  loops = {d: len(re.findall(r" while\(", t)) for d, t in programs.items()}
  assert loops[8] == loops[2], loops
  adds = {d: len(re.findall(r"= f32\[\] add\(", t))
          for d, t in programs.items()}
  assert adds[8] <= 3 * adds[2], adds


def test_a_refresh_with_side_effects_runs_once_per_refresh():
  """``batched_inverses`` traces the refreshes that join it twice, so only
  the library's own Kronecker refresh joins: a subclass that overrides
  ``refresh`` (here to call back to the host) and a duck-typed block are
  refreshed once per refresh step, and the plain blocks beside them still
  join (their caches equal the unbatched refresh's)."""
  import dataclasses
  calls = []

  def counted(name, step):
    jax.debug.callback(lambda s: calls.append((name, int(s))), step)

  @dataclasses.dataclass(frozen=True)
  class CountingDense(kfl.blocks.KroneckerDense):
    def refresh(self, state, damping, exp=-1.0, step=0, method="auto"):
      counted("subclass", step)
      return super().refresh(state, damping, exp, step, method)

  @dataclasses.dataclass(frozen=True)
  class Counting:
    inner: object

    def __getattr__(self, attr):
      return getattr(self.inner, attr)

    def refresh(self, state, damping, exp=-1.0, step=0, **kwargs):
      counted("duck", step)
      return self.inner.refresh(state, damping, exp, step, **kwargs)

  def override(layer):
    if layer.name.startswith("0/"):
      return CountingDense(**{f.name: getattr(layer.block, f.name)
                              for f in dataclasses.fields(layer.block)})
    return Counting(layer.block) if layer.name.startswith("1/") else layer.block

  params = [{"w": jax.random.normal(jax.random.PRNGKey(i), (6, 6)) / 3,
             "b": jnp.zeros(6)} for i in range(3)]
  batch = {"x": jax.random.normal(jax.random.PRNGKey(9), (8, 6)),
           "y": jnp.arange(8) % 6}

  def loss_fn(p, b):
    h = b["x"]
    for layer in p:
      h = jnp.tanh(h @ layer["w"] + layer["b"])
    return optax.softmax_cross_entropy_with_integer_labels(h, b["y"]).mean()

  grads = jax.grad(loss_fn)(params, batch)
  for blocks in ({"dense": override}, None):
    tx = kfl.kfac(loss_fn, batch, blocks=blocks,
                  inverse_method="gauss_jordan")
    state = tx.init(params)
    update = jax.jit(lambda g, s: tx.update(g, s, params, batch=batch))
    for _ in range(2):  # The first refresh, then the young one.
      _, state = update(grads, state)
    jax.effects_barrier()
    if blocks is not None:
      counted_state = state
  assert sorted(calls) == [("duck", 0), ("duck", 1), ("subclass", 0),
                           ("subclass", 1)], calls
  leaves = jax.tree.leaves(counted_state.blocks)
  for a, b in zip(leaves, jax.tree.leaves(state.blocks)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
