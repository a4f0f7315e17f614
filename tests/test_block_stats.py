"""Every block's statistics against brute force from per-example Jacobians."""
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import kfac_jax_lite as kfl
from kfac_jax_lite import blocks as B

import _brute
from _helpers import rand, x64_mode


def fresh(block, *args, **kwargs):
  return block.update(block.init(jnp.float64), block.compute_stats(*args, **kwargs), 0.5)


# Jitted (as the library runs): one compile per block and shapes, where
# eager mode compiles every primitive for them.
dense_of = jax.jit(lambda block, *args: block.to_dense(fresh(block, *args)),
                   static_argnums=0)


@hypothesis.settings(max_examples=6, deadline=None)
@hypothesis.given(d_in=st.integers(1, 4), d_out=st.integers(1, 4),
                  n=st.integers(1, 4), r=st.integers(1, 3), s=st.integers(1, 2),
                  bias=st.booleans(), mode=st.sampled_from(["expand", "reduce"]),
                  transposed=st.booleans(), seed=st.integers(0, 1000))
def test_dense_block_equals_jacobian_formula(d_in, d_out, n, r, s, bias, mode,
                                             transposed, seed):
  shape = (d_out, d_in) if transposed else (d_in, d_out)
  params = (rand(seed, shape),) + ((rand(seed + 1, (d_out,)),) if bias else ())
  xs, cots = rand(seed + 2, (n, r, d_in)), rand(seed + 3, (s, n, r, d_out))
  c = np.abs(rand(seed + 4, (n,))) + 0.1

  def fn(p, x):
    y = x @ (p[0].T if transposed else p[0])
    return y + p[1] if bias else y

  block = B.KroneckerDense(shape, in_axes=(1,) if transposed else (0,),
                             has_bias=bias, weight_sharing=mode)
  diag = B.DiagonalDense(shape, in_axes=block.in_axes, has_bias=bias)
  with x64_mode(True):
    got = dense_of(block, xs, cots, c)
    expected = _brute.kronecker_curvature(
        _brute.jacobians(fn, params, xs), cots, c, mode)
    np.testing.assert_allclose(got, expected, atol=1e-10)
    if r == 1 and s == 1 and n == 1:  # One example: the exact curvature.
      grad = _brute.per_example_grads(fn, params, xs, cots)[0, 0]
      np.testing.assert_allclose(got, c[0] * np.outer(grad, grad), atol=1e-10)
    np.testing.assert_allclose(
        dense_of(diag, xs, cots, c),
        np.diag(_brute.sum_of_squares(
            _brute.per_example_grads(fn, params, xs, cots), c)), atol=1e-10)


def test_einsum_kernel_with_several_input_and_output_axes():
  # y[n, t, h, e] = Σ_d x[n, t, d] W[d, h, e]  (an attention projection).
  params = (rand(0, (3, 2, 2)), rand(1, (2, 2)))
  xs, cots = rand(2, (2, 4, 3)), rand(3, (2, 4, 2, 2))
  fn = lambda p, x: (jnp.einsum("td,dhe->the", x, p[0]) + p[1]).reshape(4, 4)
  block = B.KroneckerDense((3, 2, 2), in_axes=(0,), has_bias=True)
  with x64_mode(True):
    expected = _brute.kronecker_curvature(
        _brute.jacobians(fn, params, xs), cots.reshape(1, 2, 4, 4))
    np.testing.assert_allclose(dense_of(block, xs, cots), expected, atol=1e-10)


CONV_CASES = [
    # (input shape per example, kernel shape, dimension numbers, kwargs)
    ((5, 5, 4), (3, 3, 2, 6), ("NHWC", "HWIO", "NHWC"),
     dict(window_strides=(2, 1), padding=((1, 1), (0, 1)), rhs_dilation=(1, 2),
          feature_group_count=2)),
    ((3, 6, 6), (4, 3, 2, 2), ("NCHW", "OIHW", "NCHW"),
     dict(window_strides=(1, 1), padding=((1, 2), (0, 1)), lhs_dilation=(2, 1))),
    ((7, 3), (3, 1, 6), ("NWC", "WIO", "NWC"),  # Depthwise 1D, multiplier 2.
     dict(window_strides=(2,), padding="SAME", feature_group_count=3)),
    ((4, 4, 3, 2), (2, 2, 2, 2, 3), ("NHWDC", "HWDIO", "NHWDC"),  # 3D.
     dict(window_strides=(1, 2, 1), padding="VALID")),
]


@pytest.mark.parametrize("case", range(len(CONV_CASES)))
@pytest.mark.parametrize("bias", [False, True])
def test_conv_blocks_equal_jacobian_formula(case, bias):
  x_shape, k_shape, dn, kw = CONV_CASES[case]
  n, s = 2, 2
  xs = rand(case, (n,) + x_shape)
  params = (rand(case + 10, k_shape),)
  dims = lax.conv_dimension_numbers((1,) + x_shape, k_shape, dn)
  out_features = k_shape[dims.rhs_spec[0]]
  if bias:
    params += (rand(case + 20, (out_features,)),)

  def conv(p, x):
    y = lax.conv_general_dilated(x[None], p[0], dimension_numbers=dims, **kw)[0]
    if bias:
      shape = [1] * y.ndim
      shape[dims.out_spec[1] - 1] = out_features
      y = y + p[1].reshape(shape)
    return y

  def fn(p, x):  # [T, O] view for the brute force.
    y = conv(p, x)
    spec = [i - 1 for i in dims.out_spec[2:]] + [dims.out_spec[1] - 1]
    return jnp.transpose(y, spec).reshape(-1, out_features)

  out_shape = jax.eval_shape(conv, params, xs[0]).shape
  cots = rand(case + 30, (s, n) + out_shape)
  spec = [i + 1 for i in dims.out_spec[2:]] + [dims.out_spec[1] + 1]
  cots_to = np.transpose(cots, [0, 1] + spec).reshape(s, n, -1, out_features)
  c = np.array([0.3, 1.2])
  common = dict(kernel_shape=k_shape, dimension_numbers=dn, has_bias=bias, **kw)
  block = B.KroneckerConv(**common)
  with x64_mode(True):
    expected = _brute.kronecker_curvature(
        _brute.jacobians(fn, params, xs), cots_to, c,
        out_groups=kw.get("feature_group_count", 1))
    np.testing.assert_allclose(dense_of(block, xs, cots, c), expected, atol=1e-9)
    diag = B.DiagonalConv(**common)
    grads = _brute.per_example_grads(conv, params, xs, cots)
    np.testing.assert_allclose(dense_of(diag, xs, cots, c),
                               np.diag(_brute.sum_of_squares(grads, c)),
                               atol=1e-9)


@pytest.mark.parametrize("bias", [False, True])
def test_conv_with_one_output_location_is_the_dense_block(bias):
  xs, cots = rand(0, (3, 3, 2, 4)), rand(1, (3, 1, 1, 5))
  conv = B.KroneckerConv((3, 2, 4, 5), dimension_numbers=("NHWC", "HWIO", "NHWC"),
                           has_bias=bias)
  dense = B.KroneckerDense((3, 2, 4, 5), in_axes=(0, 1, 2), has_bias=bias)
  with x64_mode(True):
    np.testing.assert_allclose(
        dense_of(conv, xs, cots),
        dense_of(dense, xs, cots.reshape(3, 5)), atol=1e-12)


@pytest.mark.parametrize("mode", ["expand", "reduce"])
@pytest.mark.parametrize("r", [1, 3])
def test_embedding_is_dense_on_one_hot_inputs(mode, r):
  vocab, dim, n = 5, 3, 4
  ids = np.array(jax.random.randint(jax.random.PRNGKey(r), (n, r), 0, vocab))
  ids[0, :] = 2  # Repeated ids in one example.
  cots = rand(7, (n, r, dim))
  c = np.array([0.3, 0.6, 0.9, 1.2])  # Σc = 3: w = c/Σc and c differ.
  emb = B.KroneckerEmbedding(vocab, dim, weight_sharing=mode)
  dense = B.KroneckerDense((vocab, dim), weight_sharing=mode)

  @jax.jit  # One compile for both blocks' statistics and dense forms.
  def states(ids, cots, c):
    e_state = fresh(emb, ids, cots, c)
    d_state = fresh(dense, jax.nn.one_hot(ids, vocab, dtype=jnp.float64), cots, c)
    value = kfl.factor.factor_value
    return (value(e_state.g), value(d_state.g), value(e_state.a)[0],
            value(d_state.a)[0], emb.to_dense(e_state), dense.to_dense(d_state))

  with x64_mode(True):
    e_g, d_g, e_a, a_dense, e_dense, d_dense = states(ids, cots, c)
    np.testing.assert_allclose(e_g, d_g, atol=1e-12)
    if mode == "expand" or r == 1:  # Exact: the one-hot factor is diagonal.
      np.testing.assert_allclose(np.diag(np.diag(a_dense)), a_dense, atol=1e-12)
      np.testing.assert_allclose(e_dense, d_dense, atol=1e-12)
    else:  # reduce keeps the diagonal of Σ w ã ãᵀ.
      np.testing.assert_allclose(e_a, np.diag(a_dense), atol=1e-12)
    params = (rand(9, (vocab, dim)),)
    fn = lambda p, i: p[0][i]
    expected = _brute.kronecker_curvature(
        _brute.jacobians(fn, params, ids), cots[None], c, mode)
    if mode == "expand" or r == 1:
      np.testing.assert_allclose(e_dense, expected, atol=1e-12)


@pytest.mark.parametrize("mode", ["expand", "reduce"])
def test_embedding_loss_weights_scale_g_and_leave_a_unchanged(mode):
  # Scaling the loss coefficients c by k (a sum instead of a mean, say)
  # scales G = Σ c_i G_i by k and leaves A = Σ (c_i/Σc) A_i as it was; and
  # A is the w-weighted share of lookups of each id.
  ids = np.array([[2, 2, 0], [1, 3, 1], [4, 0, 0]])
  cots = rand(8, (2, 3, 3, 2))
  c = np.array([0.2, 0.5, 0.9])  # Σc = 1.6.
  emb = B.KroneckerEmbedding(5, 2, weight_sharing=mode)
  with x64_mode(True):
    stats_of = jax.jit(emb.compute_stats)  # One compile for both calls.
    base, scaled = (stats_of(ids, cots, k * c) for k in (1.0, 2.5))
    np.testing.assert_allclose(scaled.a, base.a, rtol=1e-12)
    np.testing.assert_allclose(scaled.g, 2.5 * np.asarray(base.g), rtol=1e-12)
    counts = np.stack([np.bincount(row, minlength=5) for row in ids]) / 3
    share = counts if mode == "expand" else counts ** 2
    np.testing.assert_allclose(base.a[0], c / c.sum() @ share, rtol=1e-12)


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("which", [(True, True), (True, False), (False, True)])
def test_scale_and_shift_equals_per_example_gradients(full, which):
  has_scale, has_shift = which
  xs, cots = rand(0, (3, 4, 5)), rand(1, (2, 3, 4, 5))
  params = tuple(rand(2 + i, (5,)) for i in range(has_scale + has_shift))

  def fn(p, x):
    y = x * p[0] if has_scale else x
    return y + p[-1] if has_shift else y

  block = B.ScaleAndShift((5,), has_scale=has_scale, has_shift=has_shift,
                            full=full)
  c = np.array([0.5, 0.25, 0.25])
  with x64_mode(True):
    grads = _brute.per_example_grads(fn, params, xs, cots)
    expected = np.einsum("n,snp,snq->pq", c, grads, grads) / 2
    if not full:
      expected = np.diag(np.diag(expected))
    np.testing.assert_allclose(dense_of(block, xs, cots, c), expected,
                               atol=1e-12)


def test_scale_broadcast_over_channels_of_an_image():
  # BatchNorm-style: a [C] scale on NCHW inputs is shaped [C, 1, 1].
  xs, cots = rand(0, (2, 3, 2, 2)), rand(1, (2, 3, 2, 2))
  params = (rand(2, (3, 1, 1)), rand(3, (3, 1, 1)))
  fn = lambda p, x: x * p[0] + p[1]
  block = B.ScaleAndShift((3, 1, 1), full=True)
  with x64_mode(True):
    grads = _brute.per_example_grads(fn, params, xs, cots[None])
    np.testing.assert_allclose(
        dense_of(block, xs, cots),
        np.einsum("snp,snq->pq", grads, grads) / 2, atol=1e-12)


@pytest.mark.parametrize("cls", [B.Full, B.NaiveDiagonal])
def test_full_and_naive_blocks(cls):
  grads = (rand(0, (4, 2, 3)), rand(1, (4, 3)))
  alpha = np.array([1.0, 2.0, 3.0, 4.0])
  block = cls(((2, 3), (3,)))
  u = np.concatenate([grads[0].reshape(4, -1), grads[1]], 1)
  expected = np.einsum("k,kp,kq->pq", alpha, u, u)
  default = np.einsum("kp,kq->pq", u, u) / 4  # The mean over samples.
  if cls is B.NaiveDiagonal:
    expected, default = np.diag(np.diag(expected)), np.diag(np.diag(default))
  with x64_mode(True):
    np.testing.assert_allclose(dense_of(block, grads, alpha), expected,
                               atol=1e-12)
    np.testing.assert_allclose(dense_of(block, grads), default, atol=1e-12)


def test_bf16_activations_give_float32_statistics():
  block = B.KroneckerDense((3, 2), has_bias=True)

  @jax.jit  # One compile instead of one per operation.
  def run(x, y, v):
    stats = block.compute_stats(x, y)
    state = block.update(block.init(), stats, 0.9)
    return stats, state, block.multiply_inverse(state, v, 0.1)

  stats, state, out = run(np.ones((4, 3), jnp.bfloat16),
                          np.ones((4, 2), jnp.bfloat16),
                          (np.ones((3, 2), jnp.bfloat16),
                           np.ones((2,), jnp.bfloat16)))
  assert stats.a.dtype == jnp.float32 and stats.g.dtype == jnp.float32
  assert state.a.cov.dtype == jnp.float32
  assert all(o.dtype == jnp.bfloat16 for o in out)


def test_gradient_blocks_layer_stats_weight_each_example_and_sample():
  # LayerData.grads [S, N, *shape]: Σ_i c_i (1/S) Σ_s γ_si γ_siᵀ.
  grads = (rand(0, (2, 3, 2, 3)), rand(1, (2, 3, 3)))
  c = np.array([0.5, 1.0, 3.0])
  u = np.concatenate([grads[0].reshape(2, 3, -1), grads[1]], -1)
  expected = np.einsum("n,snp,snq->pq", c, u, u) / 2
  with x64_mode(True):
    for cls in (B.Full, B.NaiveDiagonal):
      block = cls(((2, 3), (3,)))
      got = jax.jit(block.layer_stats)(B.LayerData(grads=grads, weights=c))
      want = expected if cls is B.Full else np.diag(expected)
      np.testing.assert_allclose(got, want, atol=1e-12)


def test_stacked_block_is_block_diagonal_over_its_slices():
  n, m, r, s = 3, 4, 2, 2
  inner = B.KroneckerDense((3, 2), has_bias=True, damping_mode="exact")
  block = B.Stacked(inner, n)
  xs, cots = rand(0, (n, m, r, 3)), rand(1, (s, n, m, r, 2))
  cots = np.moveaxis(cots, 0, 1)  # [n, S, N, R, out]
  c = np.abs(rand(2, (m,))) + 0.1
  assert block.param_shapes == ((n, 3, 2), (n, 2))
  v = (rand(3, (n, 3, 2)), rand(4, (n, 2)))

  @jax.jit  # One compile instead of one per operation.
  def run(xs, cots, c, v):
    stats = block.layer_stats(B.LayerData(xs, cots, c))
    state = block.update(block.init(jnp.float64), stats, 0.5)
    slices = [inner.to_dense(fresh(inner, xs[l], cots[l], c)) for l in range(n)]
    return block.to_dense(state), slices, block.multiply_inverse(state, v, 0.1)

  with x64_mode(True):
    dense, slices, out = run(xs, cots, c, v)
    # Flat order: the kernels [n, 3, 2] raveled, then the biases [n, 2].
    index = [np.concatenate([l * 6 + np.arange(6), n * 6 + l * 2 + np.arange(2)])
             for l in range(n)]
    expected = np.zeros((n * 8, n * 8))
    for l in range(n):
      expected[np.ix_(index[l], index[l])] = slices[l]
    dense = np.asarray(dense)
    np.testing.assert_allclose(dense, expected, atol=1e-12)
    flat = np.concatenate([x.ravel() for x in v])
    np.testing.assert_allclose(
        np.concatenate([np.ravel(x) for x in out]),
        np.linalg.solve(dense + 0.1 * np.eye(n * 8), flat), rtol=1e-8)
