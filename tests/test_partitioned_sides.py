"""Partitioned factor sides (``side_block``, issues 46 and 47): a side
larger than ``side_block`` keeps ``p = ⌈n / side_block⌉`` equal diagonal
blocks of the dense side (Shampoo's partitions), padded to ``p·⌈n/p⌉``.

Pinned by properties against dense brute force in float64, for dense, conv
and embedding blocks, both weight-sharing rules and both damping modes:
the statistics are exactly the dense side's diagonal blocks (the padding
zero); ``to_dense`` is ``c·(A_bd ⊗ G_bd)`` of those block-diagonal parts;
``multiply``, ``multiply_inverse`` (now and from the cache) and the
square-root products agree with the damped matrix formed densely (``"exact"``:
``to_dense + λI``; ``"pi"``: ``c(A_bd + π√(λ/c)I) ⊗ (G_bd + √(λ/c)/π I)``
with ``π`` from the traces over the real rows). The update of ``kfl.kfac``
with partitioned sides against per-example Jacobians is in ``test_x64.py``;
here also the same update in float32 against that float64 brute force, what
``describe`` prints and prices, and the refusals.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kfl
from _brute import block_diagonal, partitioned
from _helpers import rand, x64_mode
from kfac_jax_lite import blocks as B

LAM = 0.1


def _dense(side_block, mode, damping):
  kw = dict(has_bias=True, weight_sharing=mode, damping_mode=damping)
  return (B.KroneckerDense((7, 5), side_block=side_block, **kw),
          B.KroneckerDense((7, 5), **kw),
          (rand(0, (9, 3, 7)), rand(1, (2, 9, 3, 5))))


def _conv(side_block, mode, damping):
  kw = dict(kernel_shape=(3, 3, 2, 4),
            dimension_numbers=("NHWC", "HWIO", "NHWC"), has_bias=True,
            weight_sharing=mode, damping_mode=damping)
  return (B.KroneckerConv(side_block=side_block, **kw), B.KroneckerConv(**kw),
          (rand(2, (3, 5, 5, 2)), rand(3, (1, 3, 3, 3, 4))))


def _embedding(side_block, mode, damping):
  kw = dict(vocab_size=6, dim=5, weight_sharing=mode, damping_mode=damping)
  ids = jnp.asarray(np.random.default_rng(4).integers(0, 6, (7, 3)))
  return (B.KroneckerEmbedding(side_block=side_block, **kw),
          B.KroneckerEmbedding(**kw), (ids, rand(5, (1, 7, 3, 5))))


def _blocks_of(dense_side, parts):
  """The ``parts`` diagonal blocks ``[p, k, k]`` of ``dense_side [n, n]``,
  padded with zeros to ``p·k``."""
  n = dense_side.shape[0]
  k = -(-n // parts)
  padded = np.zeros((parts * k, parts * k))
  padded[:n, :n] = dense_side
  return np.stack([padded[i * k:(i + 1) * k, i * k:(i + 1) * k]
                   for i in range(parts)])


def _flat(v):
  return np.concatenate([np.ravel(x) for x in v])


@pytest.mark.parametrize("make,side_block,parts", [
    (_dense, 3, (3, 2)),     # A: 7 + bias = 8 in 3 blocks of 3; G: 5 in 2 of 3.
    (_dense, 7, (1, 1)),     # 7 inputs: the bias's row is not counted.
    (_conv, 8, (3, 1)),      # A: 3·3·2 + 1 = 19 in 3 blocks of 7; G: 4.
    (_embedding, 2, (1, 3)),  # A diagonal (ids); G: 5 in 3 blocks of 2.
])
@pytest.mark.parametrize("mode", ["expand", "reduce"])
@pytest.mark.parametrize("damping", ["pi", "exact"])
def test_a_partitioned_side_is_exactly_the_dense_sides_diagonal_blocks(
    make, side_block, parts, mode, damping):
  with x64_mode(True):
    small, big, (x, g) = make(side_block, mode, damping)
    assert (small.input_parts, small.output_parts) == parts
    v = tuple(jnp.asarray(rand(6 + i, s)) for i, s in
              enumerate(small.param_shapes))

    @jax.jit  # One program for the numbers below (not one per operation).
    def numbers(x, g, v):
      s_small, s_big = small.compute_stats(x, g), big.compute_stats(x, g)
      state = small.update(small.init(jnp.float64), s_small, 0.0)
      cached = small.refresh(state, LAM)
      return (s_small, s_big, state, small.to_dense(state),
              small.multiply(state, v), small.multiply_inverse(state, v, LAM),
              small.multiply_inverse(cached, v, LAM, use_cache=True),
              small.multiply_cholesky(
                  state, small.multiply_cholesky(state, v, LAM,
                                                 transpose=True), LAM),
              small.multiply_cholesky_inverse(
                  state, small.multiply_cholesky_inverse(state, v, LAM), LAM,
                  transpose=True))
    (s_small, s_big, state, dense, product, inverse, cached, llt,
     inv_llt) = numbers(x, g, v)
    # Statistics: the dense side's diagonal blocks (a diagonal side as is).
    sides = []
    for got, whole, p in ((s_small.a, s_big.a, parts[0]),
                          (s_small.g, s_big.g, parts[1])):
      whole = np.asarray(whole[0])
      want = _blocks_of(whole, p) if p > 1 else whole
      np.testing.assert_allclose(got[0], want, rtol=1e-13, atol=1e-14)
      sides.append(whole if whole.ndim == 1 else block_diagonal(whole, p))
    assert tuple(f.cov.shape for f in state) == tuple(
        tuple(s) for s in small.factor_shapes)
    # to_dense: the whole-side block's, of the block-diagonal parts.
    masked = type(s_big)(*(jnp.asarray(s)[None] for s in sides))
    want_dense = big.to_dense(big.update(big.init(jnp.float64), masked, 0.0))
    np.testing.assert_allclose(dense, want_dense, rtol=1e-13, atol=1e-14)
    flat = _flat(v)
    np.testing.assert_allclose(_flat(product), dense @ flat, rtol=1e-12,
                               atol=1e-13)
    # The damped matrix, formed densely (in the parameters' order: the
    # whole-side block's to_dense of the damped factors, π computed here).
    if damping == "exact":
      damped = dense + LAM * np.eye(dense.shape[0])
    else:
      mean = lambda s: (np.sum(s) if s.ndim == 1 else np.trace(s)) / len(s)
      add = lambda s, d: s + d if s.ndim == 1 else s + d * np.eye(len(s))
      pi = np.sqrt(mean(sides[0]) / mean(sides[1]))
      shifted = type(s_big)(
          jnp.asarray(add(sides[0], pi * np.sqrt(LAM)))[None],
          jnp.asarray(add(sides[1], np.sqrt(LAM) / pi))[None])
      damped = np.asarray(big.to_dense(
          big.update(big.init(jnp.float64), shifted, 0.0)))
    want = np.linalg.solve(damped, flat)
    for out in (inverse, cached, inv_llt):
      np.testing.assert_allclose(_flat(out), want, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(_flat(llt), damped @ flat, rtol=1e-10,
                               atol=1e-12)


def test_the_option_and_its_default():
  """``side_block`` is None by default (whole sides within the limit); a
  side over ``max_dense_side`` stays diagonal whatever ``side_block``;
  ``side_block`` must be an int of at least 2 or None."""
  assert B.KroneckerDense((512, 512)).factor_shapes == ((1, 512, 512),
                                                        (1, 512, 512))
  both = B.KroneckerDense((2048, 600), has_bias=True, side_block=256)
  assert both.factor_shapes == ((1, 2049), (1, 3, 200, 200))
  assert B.KroneckerDense((512, 10), has_bias=True,
                          side_block=256).factor_shapes[0] == (1, 2, 257, 257)
  for bad in (1, 0, 2.5, True, "big"):
    with pytest.raises(ValueError, match="side_block"):
      B.KroneckerDense((4, 4), side_block=bad)


def _mlp_loss(params, batch):
  h = jnp.tanh(batch["x"] @ params[0]["w"] + params[0]["b"])
  logits = h @ params[1]["w"] + params[1]["b"]
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]).mean()


def _mlp(dtype):
  ks = jax.random.split(jax.random.PRNGKey(0), 3)
  params = [{"w": jax.random.normal(ks[0], (12, 9), dtype) / 3,
             "b": jnp.zeros(9, dtype)},
            {"w": jax.random.normal(ks[1], (9, 4), dtype) / 3,
             "b": jnp.zeros(4, dtype)}]
  batch = {"x": jax.random.normal(ks[2], (16, 12), dtype),
           "y": jnp.arange(16) % 4}
  return params, batch


def _brute_update(params, batch, side_block):
  """The first update of ``kfl.kfac(estimation="empirical")``: per layer
  ``(A_bd + da I)⁻¹ ⊗ (G_bd + dg I)⁻¹`` on the gradient, ``A`` from the
  inputs, ``G`` from per-example gradients of the pre-activations, both
  masked to their diagonal blocks; all in float64 numpy."""
  p64 = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
  x = np.asarray(batch["x"], np.float64)
  y = np.asarray(batch["y"])
  n = x.shape[0]
  s0 = x @ p64[0]["w"] + p64[0]["b"]
  h = np.tanh(s0)
  s1 = h @ p64[1]["w"] + p64[1]["b"]
  prob = np.exp(s1 - s1.max(1, keepdims=True))
  prob /= prob.sum(1, keepdims=True)
  d1 = (prob - np.eye(4)[y]) / n          # ∂L/∂s1, the mean loss's.
  d0 = (d1 @ p64[1]["w"].T) * (1 - h ** 2)
  out = []
  for inp, d, lay in ((x, d0, p64[0]), (h, d1, p64[1])):
    a_bar = np.concatenate([inp, np.ones((n, 1))], 1)
    big_a = a_bar.T @ a_bar / n
    big_g = (d * n).T @ (d * n) / n       # Σ_i c_i g_i g_iᵀ, g_i of ℓ_i.
    features, b = inp.shape[1], d.shape[1]
    big_a = partitioned(big_a, features, side_block)
    big_g = partitioned(big_g, b, side_block)
    grad = a_bar.T @ d
    pi = np.sqrt((np.trace(big_a) / len(big_a)) / (np.trace(big_g) / b))
    damped_a = big_a + pi * np.sqrt(LAM) * np.eye(len(big_a))
    damped_g = big_g + np.sqrt(LAM) / pi * np.eye(b)
    u = np.linalg.solve(damped_g, np.linalg.solve(damped_a, grad).T).T
    out.append((u[:-1], u[-1], np.linalg.cond(damped_a),
                np.linalg.cond(damped_g)))
  return out


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_kfac_with_partitioned_sides_matches_brute_force(dtype):
  """``kfl.kfac(blocks={"dense": {"side_block": 4}})``'s first update (no
  clip, π damping, the empirical Fisher) against ``_brute_update`` in
  float64: layer 0's sides 12 (+ bias) and 9 in 3 blocks each, layer 1's 9
  (+ bias) in 3 and 4 whole. float32's tolerance: rounding of the factors'
  sums and solves, ε·κ·n with κ the damped sides' condition numbers
  (about 2 here: a tolerance near 7e-5)."""
  with x64_mode(dtype == "float64"):
    params, batch = _mlp(jnp.dtype(dtype))
    tx = kfl.kfac(_mlp_loss, batch, damping=LAM, estimation="empirical",
                  norm_constraint=None, blocks={"dense": {"side_block": 4}})
    grads = jax.grad(_mlp_loss)(params, batch)
    updates, state = jax.jit(
        lambda p, g: tx.update(g, tx.init(p), p, batch=batch))(params, grads)
    shapes = sorted(tuple(f.cov.shape for f in b)
                    for b in state.blocks.values())
    assert shapes == [((1, 3, 4, 4), (1, 4, 4)),
                      ((1, 3, 5, 5), (1, 3, 3, 3))], shapes
    eps = float(jnp.finfo(jnp.dtype(dtype)).eps)
    for got, (w, b, cond_a, cond_g) in zip(
        updates, _brute_update(params, batch, 4)):
      tol = max(1e-12, 10 * eps * (cond_a + cond_g) * 13)
      for k, want in (("w", w), ("b", b)):
        err = np.linalg.norm(np.asarray(got[k], np.float64) - want) / (
            np.linalg.norm(want))
        assert err < tol, (k, err, tol)


def _describe_model():
  params, batch = _mlp(jnp.float32)
  return kfl.describe(_mlp_loss, params, batch,
                      blocks={"dense": {"side_block": 4}}), params, batch


def test_describe_says_and_prices_the_partitions():
  """``describe``'s note names each partitioned side, and the price counts
  the blocks: the preconditioning of layer 0 ``2·k·a·b`` per side (``k`` a
  block's side, ``a``, ``b`` the padded sides) instead of ``2·n·a·b``."""
  table, _, _ = _describe_model()
  text = str(table)
  assert "A partitioned: side 13 in 3 blocks of 5 (side_block=4)" in text
  assert "G partitioned: side 9 in 3 blocks of 3 (side_block=4)" in text
  row = next(r for r in table if r["factors"][0] == (1, 3, 5, 5))
  assert row["flops"].precondition == 2 * 5 * 15 * 9 + 2 * 3 * 15 * 9
  assert row["flops"].refresh == pytest.approx(2 * (3 * 5 ** 3 + 3 * 3 ** 3)
                                               / table.plan.inverse_every)


def test_eigen_adam_and_laplace_refuse_partitioned_sides():
  """``eigen_adam`` rotates by whole or diagonal sides and the Laplace
  posterior's spectrum needs them: both refuse a partitioned side, naming
  the layer and the option."""
  params, batch = _mlp(jnp.float32)
  tx = kfl.eigen_adam(_mlp_loss, batch, blocks={"dense": {"side_block": 4}})
  with pytest.raises(ValueError, match="partitioned.*side_block=4"):
    tx.init(params)
  with pytest.raises(ValueError, match="partitioned.*side_block=4"):
    kfl.laplace.fit(_mlp_loss, params, [batch], progress=False,
                    blocks={"dense": {"side_block": 4}})


def test_a_plan_over_its_budget_names_the_partition_that_fits():
  """A 300 -> 300 dense layer at batch 64: whole sides cost ``2·(301 +
  300)·301·300`` in the preconditioning against SGD's ``6·64·301·300``
  (floor 4.13x, over the budget 1.3); ``side_block=512`` and ``256`` leave
  the sides whole or in 2 blocks (floors 4.13x, ~2.6x), ``128`` splits
  them into 3 blocks of 101 and 100 (the input side padded to 303):
  ``2·(101 + 100)·303·300`` (floor ~2.06x), the lowest, so the plan line
  names it; a plan within its budget names nothing."""
  params = {"w": jnp.zeros((300, 300)), "b": jnp.zeros(300)}
  batch = {"x": jnp.ones((64, 300)), "y": jnp.zeros(64, jnp.int32)}

  def loss_fn(p, b):
    return optax.softmax_cross_entropy_with_integer_labels(
        b["x"] @ p["w"] + p["b"], b["y"]).mean()
  plan = kfl.describe(loss_fn, params, batch).plan
  sgd = 6 * 64 * 301 * 300
  assert plan.floor == pytest.approx(1 + 2 * 601 * 301 * 300 / sgd)
  side_block, kinds, floor = plan.partition
  assert (side_block, kinds) == (128, ("dense",))
  assert floor == pytest.approx(1 + 2 * 201 * 303 * 300 / sgd)
  assert ("blocks={'dense': {'side_block': 128}} partitions the factor "
          f"sides: floor {floor:.2f}x") in plan.line
  within = kfl.describe(loss_fn, params, batch, budget=10.0).plan
  assert within.met and within.partition is None
  assert "side_block" not in within.line
