"""The size policy (issue 47): a factor side over ``max_dense_side`` keeps
only its diagonal.

Pinned by properties against dense brute force in float64: the diagonal
side's statistics are exactly the diagonal of the dense side's (for dense,
conv and embedding blocks, both weight-sharing rules); the block's damped
inverse is the inverse of ``to_dense + λI`` formed densely; a layer whose
two sides are both diagonal is preconditioned by ``eigen_adam`` exactly as
Adam does (its eigenbases are the identity); ``describe`` says what the
policy did and what it saved; ``tx.init`` refuses a state that does not
fit, naming the fix. The update of ``kfl.kfac`` under the policy against
per-example Jacobians is in ``test_x64.py``.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kfl
from _helpers import rand, x64_mode
from kfac_jax_lite import blocks as B

LAM = 0.1


def _dense_blocks(limit, mode):
  kw = dict(has_bias=True, weight_sharing=mode, damping_mode="exact")
  return (B.KroneckerDense((5, 7), max_dense_side=limit, **kw),
          B.KroneckerDense((5, 7), max_dense_side=None, **kw),
          (rand(0, (9, 3, 5)), rand(1, (2, 9, 3, 7))))


def _conv_blocks(limit, mode):
  kw = dict(kernel_shape=(3, 3, 2, 4), dimension_numbers=("NHWC", "HWIO", "NHWC"),
            has_bias=True, weight_sharing=mode, damping_mode="exact")
  return (B.KroneckerConv(max_dense_side=limit, **kw),
          B.KroneckerConv(max_dense_side=None, **kw),
          (rand(2, (3, 5, 5, 2)), rand(3, (1, 3, 3, 3, 4))))


def _embedding_blocks(limit, mode):
  kw = dict(vocab_size=6, dim=5, weight_sharing=mode, damping_mode="exact")
  ids = jnp.asarray(np.random.default_rng(4).integers(0, 6, (7, 3)))
  return (B.KroneckerEmbedding(max_dense_side=limit, **kw),
          B.KroneckerEmbedding(max_dense_side=None, **kw),
          (ids, rand(5, (1, 7, 3, 5))))


@pytest.mark.parametrize("make,limit,diagonal", [
    (_dense_blocks, 6, (False, True)),     # A: 6 (5 + bias), G: 7.
    (_dense_blocks, 5, (False, True)),     # 5 inputs: the bias not counted.
    (_dense_blocks, 4, (True, True)),
    (_conv_blocks, 4, (True, False)),      # A: 3·3·2 + 1 = 19, G: 4.
    (_embedding_blocks, 4, (True, True)),  # A always diagonal; G: 5.
])
@pytest.mark.parametrize("mode", ["expand", "reduce"])
def test_a_side_over_the_limit_keeps_exactly_the_dense_diagonal(
    make, limit, diagonal, mode):
  """Statistics: each side over the limit is the diagonal of the dense
  block's side (the others equal it); the state's factors have the shapes
  ``describe`` prints; ``multiply_inverse`` (from the cache and without)
  is ``(to_dense + λI)⁻¹ v`` formed densely, and ``multiply`` is
  ``to_dense · v``."""
  with x64_mode(True):
    small, big, (x, g) = make(limit, mode)
    assert (small.input_diagonal, small.output_diagonal) == diagonal
    v = tuple(jnp.asarray(rand(6 + i, s)) for i, s in
              enumerate(small.param_shapes))

    @jax.jit  # One program for the numbers below (not one per operation).
    def numbers(x, g, v):
      s_small = small.compute_stats(x, g)
      state = small.update(small.init(jnp.float64), s_small, 0.0)
      cached = small.refresh(state, LAM)
      return (s_small, big.compute_stats(x, g), state, small.to_dense(state),
              (small.multiply_inverse(state, v, LAM),
               small.multiply_inverse(cached, v, LAM, use_cache=True)),
              small.multiply(state, v))
    s_small, s_big, state, dense, inverses, product = numbers(x, g, v)
    for got, dense_side, diag in ((s_small.a, s_big.a, diagonal[0]),
                                  (s_small.g, s_big.g, diagonal[1])):
      want = (jnp.diagonal(dense_side, axis1=-2, axis2=-1)
              if diag and dense_side.ndim == 3 else dense_side)
      np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-14)
    assert tuple(f.cov.shape for f in state) == tuple(
        tuple(s) for s in small.factor_shapes)
    flat = jnp.concatenate([p.ravel() for p in v])
    want = np.linalg.solve(dense + LAM * np.eye(dense.shape[0]), flat)
    for out in inverses:
      got = jnp.concatenate([p.ravel() for p in out])
      np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    got = jnp.concatenate([p.ravel() for p in product])
    np.testing.assert_allclose(got, dense @ flat, rtol=1e-12, atol=1e-13)


def test_the_default_limit_and_its_option():
  """By default a side over ``blocks.MAX_DENSE_SIDE`` is diagonal (a
  GPT-2-sized head's 50257 outputs), one at the limit stays dense, and the
  state is what the shapes say; ``max_dense_side`` must be a positive int
  or None."""
  head = B.KroneckerDense((768, 50257))
  assert B.MAX_DENSE_SIDE == 1024
  assert (head.input_diagonal, head.output_diagonal) == (False, True)
  assert B.state_bytes(head) < 2 * 4 * (768 ** 2 + 50257) + 4096
  at_limit = B.KroneckerDense((B.MAX_DENSE_SIDE - 1, B.MAX_DENSE_SIDE),
                              has_bias=True)
  assert not (at_limit.input_diagonal or at_limit.output_diagonal)
  # The bias's row does not count: a layer as wide as the limit, with a
  # bias (a factor side one over it), stays dense; one feature more not.
  wide = B.KroneckerDense((B.MAX_DENSE_SIDE, 10), has_bias=True)
  assert wide.factor_shapes[0] == (1, B.MAX_DENSE_SIDE + 1,
                                   B.MAX_DENSE_SIDE + 1)
  assert not wide.input_diagonal
  assert B.KroneckerDense((B.MAX_DENSE_SIDE + 1, 10),
                          has_bias=True).input_diagonal
  assert B.KroneckerDense((B.MAX_DENSE_SIDE + 1, 10),
                          has_bias=False).input_diagonal
  assert not B.KroneckerDense((B.MAX_DENSE_SIDE, 10),
                              has_bias=False).input_diagonal
  assert B.KroneckerDense((768, 50257), max_dense_side=None).factor_shapes[1] \
      == (1, 50257, 50257)
  for bad in (0, -3, 2.5, True, "big"):
    with pytest.raises(ValueError, match="max_dense_side"):
      B.KroneckerDense((4, 4), max_dense_side=bad)


def _mlp(widths):
  params = [{"w": jnp.asarray(rand(10 + i, (a, b)) / np.sqrt(a), jnp.float32),
             "b": jnp.zeros(b, jnp.float32)}
            for i, (a, b) in enumerate(zip(widths[:-1], widths[1:]))]
  x = jnp.asarray(rand(20, (16, widths[0])), jnp.float32)
  batch = {"x": x, "y": jnp.argmax(x[:, :widths[-1]], -1)}

  def loss_fn(params, batch):
    h = batch["x"]
    for i, p in enumerate(params):
      h = h @ p["w"] + p["b"]
      h = jnp.tanh(h) if i < len(params) - 1 else h
    return kfl.softmax_cross_entropy_with_integer_labels(h, batch["y"]).mean()
  return params, batch, loss_fn


def test_describe_says_what_the_policy_did():
  """``describe`` gives the diagonal sides with the limit and the dense
  cost avoided, every block's bytes and their total against the
  parameters' bytes; ``max_dense_side=None`` keeps every side dense."""
  params, batch, loss_fn = _mlp((6, 9, 3))
  table = kfl.describe(loss_fn, params, batch,
                       blocks={"dense": {"max_dense_side": 7}})
  text = str(table)
  assert "A diagonal: side 10 > max_dense_side=7" in text, text
  assert "G diagonal: side 9 > max_dense_side=7" in text, text
  assert [r["factors"] for r in table] == [((1, 7, 7), (1, 9)),
                                           ((1, 10), (1, 3, 3))]
  want = 4 * (7 * 7 + 9) * 2  # Covariance + cache, per factor.
  assert table[0]["bytes"] >= want
  params_bytes = 4 * (6 * 9 + 9 + 9 * 3 + 3)
  ratio = table.total_bytes / params_bytes
  assert f"{ratio:.2f}x the parameters'" in text, text
  dense = kfl.describe(loss_fn, params, batch,
                       blocks={"dense": {"max_dense_side": None}})
  assert [r["factors"] for r in dense] == [((1, 7, 7), (1, 9, 9)),
                                           ((1, 10, 10), (1, 3, 3))]
  assert "diagonal" not in " ".join(r["notes"] for r in dense)
  assert dense.total_bytes > table.total_bytes


def test_init_refuses_a_state_that_does_not_fit(monkeypatch):
  """``tx.init`` of ``kfl.kfac`` and ``kfl.eigen_adam`` prices the state
  by its shapes and refuses one that does not fit the device (here a
  device of 1 KiB), naming the state's size, its largest block and the
  fixes; nothing is allocated first."""
  from kfac_jax_lite.optimizers import _memory
  params, batch, loss_fn = _mlp((6, 9, 3))
  monkeypatch.setattr(_memory, "device_bytes", lambda leaves: 1024)
  for tx in (kfl.kfac(loss_fn, batch), kfl.eigen_adam(loss_fn, batch)):
    with pytest.raises(ValueError, match="does not fit the device's 1.0 KiB"
                       ) as e:
      tx.init(params)
    assert "max_dense_side" in str(e.value) and "layout='sharded'" in str(
        e.value)
  monkeypatch.setattr(_memory, "device_bytes", lambda leaves: 2**30)
  kfl.kfac(loss_fn, batch).init(params)  # Fits.


def test_init_counts_the_refreshs_workspace(monkeypatch):
  """The memory check counts, beyond the state and four copies of the
  parameters, the refresh's workspace: two arrays of the largest factor's
  size (its 201-side input factor here). A device short of that by one
  byte refuses, naming the workspace; one that has it accepts."""
  from kfac_jax_lite.optimizers import _memory
  params, batch, loss_fn = _mlp((6, 200, 3))
  leaf_bytes = lambda t: sum(x.size * x.dtype.itemsize
                             for x in jax.tree.leaves(t))
  blocks = kfl.describe(loss_fn, params, batch).total_bytes
  largest = 201 * 201 * 4  # The second layer's float32 input factor.
  need = blocks + leaf_bytes(batch) + 4 * leaf_bytes(params) + 2 * largest
  monkeypatch.setattr(_memory, "device_bytes", lambda leaves: need - 1)
  with pytest.raises(ValueError, match="refresh's workspace"):
    kfl.kfac(loss_fn, batch).init(params)
  monkeypatch.setattr(_memory, "device_bytes", lambda leaves: need)
  kfl.kfac(loss_fn, batch).init(params)  # Fits.

@pytest.mark.parametrize("basis", ["kfac", "shampoo"])
def test_eigen_adam_with_both_sides_diagonal_is_adam(basis):
  """A layer whose two sides are diagonal has the identity for both
  eigenbases: ``eigen_adam`` then is Adam, step for step (float64); SOAP's
  first step only starts its statistics (a zero update), so there Adam's
  three steps are its steps two to four."""
  skip = 1 if basis == "shampoo" else 0
  with x64_mode(True):
    params, batch, loss_fn = _mlp((4, 5, 3))
    params = jax.tree.map(lambda x: x.astype(jnp.float64), params)
    batch = {"x": batch["x"].astype(jnp.float64), "y": batch["y"]}
    tx = optax.chain(
        kfl.eigen_adam(loss_fn, batch, basis=basis,
                       blocks={"dense": {"max_dense_side": 1}}),
        optax.scale_by_learning_rate(0.05))
    ref = optax.adam(0.05)

    @jax.jit
    def run(params):
      p, q, s, r = params, params, tx.init(params), ref.init(params)
      for i in range(3 + skip):
        g = jax.grad(loss_fn)(p, batch)
        u, s = tx.update(g, s, p, batch=batch)
        p = optax.apply_updates(p, u)
        if i < skip:
          continue
        h = jax.grad(loss_fn)(q, batch)
        v, r = ref.update(h, r, q)
        q = optax.apply_updates(q, v)
      return p, q
    got, want = run(params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
