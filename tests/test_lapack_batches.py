"""On CPU, LAPACK's Cholesky and triangular solves see one matrix at a time.

jaxlib 0.10's CPU kernels for a batch of those calls wait, on XLA's
intra-op pool, for parts they scheduled on the same pool; as many of them
at once as the pool has threads hang the step forever (a scanned
transformer's K-FAC step with ``inverse_method="cholesky"`` did, on 2
cores). ``kfac_jax_lite.factor._lapack`` loops over batch axes on CPU and
``blocks.Stacked`` loops over its slices where they call LAPACK: the tests
check that no compiled LAPACK call takes a batch (which does not depend on
the machine's core count), that the loops give the batched results, in
float32 and float64, and that they stay differentiable.
"""
import re

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
import optax
import pytest
from jax import lax

import kfac_jax_lite as kfl
from kfac_jax_lite import blocks as B
from kfac_jax_lite import factor as fac

from _helpers import rand, x64_mode

LAPACK_CALL = re.compile(r"= \(?(\w+)\[([\d,]*)\][^=]*custom-call\([^\n]*"
                         r"custom_call_target=\"lapack_(\w+)")


def lapack_batches(fn, *args):
  """``[(kernel, shape)]`` of the LAPACK calls in ``fn``'s compiled program
  whose first output holds more than one matrix."""
  text = jax.jit(fn).lower(*args).compile().as_text()
  out = []
  for dtype, dims, kernel in LAPACK_CALL.findall(text):
    shape = tuple(int(d) for d in dims.split(",") if d)
    if len(shape) > 2 and np.prod(shape[:-2]) > 1:
      out.append((kernel, shape))
  return out


def spd(key, batch, n, dtype):
  x = jax.random.normal(jax.random.PRNGKey(key), batch + (n, n), dtype)
  return x @ jnp.swapaxes(x, -1, -2) / n + jnp.eye(n, dtype=dtype)


def factor_of(m):
  """A factor whose statistics are ``m`` (weight 1)."""
  state = fac.init_factor(m.shape[-1], batch_shape=m.shape[:-2], dtype=m.dtype)
  return fac.update_cov(state, m, 0.0)


@pytest.fixture(scope="module")
def cpu():
  if jax.default_backend() != "cpu":
    pytest.skip("the loop is CPU-only")


def test_the_hlo_check_sees_a_batched_call(cpu):
  # The check itself: jnp's own batched Cholesky is one batched call.
  m = spd(0, (3,), 8, jnp.float32)
  assert lapack_batches(jnp.linalg.cholesky, m)


@pytest.mark.parametrize("x64", [False, True])
def test_factor_functions_loop_over_batches_and_match(cpu, x64):
  with x64_mode(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    eps = float(jnp.finfo(dtype).eps)
    n = 8
    m = spd(1, (2, 3), n, dtype)
    state = factor_of(m)
    x = rand(2, (2, 3, n, 5)).astype(dtype)
    fns = {
        "damped_cholesky": lambda s: fac.damped_cholesky(s, 0.1),
        "multiply_inverse": lambda s, x: fac.multiply_inverse(s, x, 0.1),
        "solve_triangular": lambda s, x: fac.solve_triangular(
            fac.damped_cholesky(s, 0.1), x, lower=True, trans=1),
        "refresh": lambda s: fac.refresh_cache(
            s, 0, damping=0.1, method="cholesky").cache.matpower,
    }
    args = {"damped_cholesky": (state,), "refresh": (state,)}
    damped = np.asarray(m, np.float64) + 0.1 * np.eye(n)
    chol = np.linalg.cholesky(damped)
    want = {
        "damped_cholesky": chol,
        "multiply_inverse": np.linalg.solve(damped, np.asarray(x, np.float64)),
        "solve_triangular": np.linalg.solve(np.swapaxes(chol, -1, -2),
                                            np.asarray(x, np.float64)),
        "refresh": np.linalg.inv(damped),
    }
    # κ(m + 0.1 I) ≤ ~50 here: a backward-stable solve is within κ·n·ε.
    cond = float(np.max(np.linalg.cond(damped)))
    for name, fn in fns.items():
      a = args.get(name, (state, x))
      assert lapack_batches(fn, *a) == [], name
      scale = np.max(np.abs(want[name]))
      np.testing.assert_allclose(np.asarray(jax.jit(fn)(*a), np.float64),
                                 want[name],
                                 atol=10 * cond * n * eps * scale,
                                 err_msg=name)


def test_the_loop_is_differentiable(cpu):
  with x64_mode(True):
    m = spd(3, (3,), 6, jnp.float64)
    x = rand(4, (3, 6, 2))
    loss = lambda m: jnp.sum(fac.multiply_inverse(factor_of(m), x, 0.1) ** 2)
    batched = lambda m: jnp.sum(jsl.cho_solve(
        (jnp.linalg.cholesky(m + 0.1 * jnp.eye(6)), True), x) ** 2)
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(m),
                               jax.jit(jax.grad(batched))(m),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("x64", [False, True])
def test_stacked_cholesky_refresh_and_products_loop_over_slices(cpu, x64):
  n = 4
  inner = B.KroneckerDense((5, 3), has_bias=True)
  block = B.Stacked(inner, n)
  with x64_mode(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    xs, cots = rand(0, (n, 16, 5)), rand(1, (n, 1, 16, 3))
    state = jax.jit(lambda xs, cots: block.update(
        block.init(dtype), block.layer_stats(B.LayerData(
            xs, cots, jnp.ones(16))), 0.0))(xs, cots)
    v = (rand(3, (n, 5, 3)).astype(dtype), rand(4, (n, 3)).astype(dtype))

    def refreshed(method):
      return lambda st: block.precondition(
          block.refresh(st, 0.1, method=method), v, 0.1, -1.0)

    products = {
        "refresh": refreshed("cholesky"),
        "multiply_inverse": lambda st: block.multiply_inverse(st, v, 0.1),
        "multiply_cholesky": lambda st: block.multiply_cholesky(st, v, 0.1),
        "multiply_cholesky_inverse": lambda st: block.multiply_cholesky_inverse(
            st, v, 0.1, transpose=True),
    }
    for name, fn in products.items():
      assert lapack_batches(fn, state) == [], name
    # The reference: the same π-damped inverse by Gauss–Jordan (XLA's own
    # products, no LAPACK), vmapped over the slices.
    flat = lambda us: np.concatenate([np.ravel(np.asarray(u, np.float64))
                                      for u in us])
    want = flat(jax.jit(refreshed("gauss_jordan"))(state))
    dense = np.asarray(jax.jit(block.to_dense)(state), np.float64)
    eps = float(jnp.finfo(dtype).eps)
    tol = 100 * np.linalg.cond(dense + 0.1 * np.eye(len(dense))) * eps
    close = lambda got, ref, what: np.testing.assert_allclose(
        got, ref, atol=tol * np.max(np.abs(ref)), err_msg=what)
    for name in ("refresh", "multiply_inverse"):
      close(flat(jax.jit(products[name])(state)), want, name)
    # L Lᵀ is the damped block whose inverse multiply_inverse applies, and
    # L⁻ᵀ undoes Lᵀ, slice by slice.
    @jax.jit
    def round_trips(st):
      lt = block.multiply_cholesky(st, v, 0.1, transpose=True)
      llt = block.multiply_cholesky(st, lt, 0.1)
      return (block.multiply_inverse(st, llt, 0.1),
              block.multiply_cholesky_inverse(st, lt, 0.1, transpose=True))
    inv_llt, back = round_trips(state)
    close(flat(inv_llt), flat(v), "L Lᵀ")
    close(flat(back), flat(v), "L⁻ᵀ Lᵀ")


def test_kfac_step_with_cholesky_on_scanned_layers(cpu):
  # Through the public API: a step of K-FAC + SGD on layers stacked under
  # lax.scan, refreshed by Cholesky, has no batched LAPACK call and agrees
  # with the default method.
  k = jax.random.split(jax.random.PRNGKey(0), 4)
  params = {"stack": {"w": 0.3 * jax.random.normal(k[0], (4, 6, 6)),
                      "b": jnp.zeros((4, 6))},
            "head": 0.3 * jax.random.normal(k[1], (6, 3))}
  batch = {"x": jax.random.normal(k[2], (32, 6)),
           "y": jax.random.randint(k[3], (32,), 0, 3)}

  def loss_fn(p, b):
    h, _ = lax.scan(lambda h, wb: (jnp.tanh(h @ wb["w"] + wb["b"]), None),
                    b["x"], p["stack"])
    return optax.softmax_cross_entropy_with_integer_labels(
        h @ p["head"], b["y"]).mean()

  def step(method):
    tx = optax.chain(kfl.kfac(loss_fn, batch, inverse_method=method,
                              estimation="empirical"), optax.sgd(0.1))

    def run(p, s, b):
      g = jax.grad(loss_fn)(p, b)
      u, s = tx.update(g, s, p, batch=b)
      return u, s
    return run, tx.init(params)

  run, state = step("cholesky")
  assert lapack_batches(run, params, state, batch) == []
  got, _ = jax.jit(run)(params, state, batch)
  run_gj, state_gj = step("gauss_jordan")
  want, _ = jax.jit(run_gj)(params, state_gj, batch)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
