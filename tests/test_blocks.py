"""Block algebra against each block's own dense matrix, for every block kind.

``multiply`` is ``to_dense() @ v``; ``multiply_inverse`` is a solve with the
damped dense matrix (exactly in ``"exact"`` mode and for flat blocks, with
the π-adjusted damped factors in ``"pi"`` mode); powers invert each other;
the Cholesky products are square roots of the damped matrix.
"""
import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax_lite as kfl
from kfac_jax_lite import blocks as B
from kfac_jax_lite import factor as fac

from _helpers import assert_rounding_close, flat, rand, sym_power, x64_mode


def dense_case(mode, bias=True, shape=(3, 4), in_axes=(0,), n=5, seed=0):
  block = B.KroneckerDense(shape, in_axes=in_axes, has_bias=bias,
                             damping_mode=mode, renorm_coeff=1.5)
  d_in = int(np.prod([shape[i] for i in block.layout.in_axes]))
  xs = rand(seed, (n, d_in)).reshape((n,) + block.layout.in_dims)
  return block, (xs, rand(seed + 1, (n,) + block.layout.out_dims))


def conv_case(mode):
  block = B.KroneckerConv((3, 3, 2, 4), window_strides=(2, 2),
                            padding=((1, 1), (1, 1)),
                            dimension_numbers=("NHWC", "HWIO", "NHWC"),
                            feature_group_count=2, has_bias=True,
                            damping_mode=mode)
  return block, (rand(2, (3, 4, 4, 4)), rand(3, (3, 2, 2, 4)))


def embedding_case(mode):
  block = B.KroneckerEmbedding(6, 3, damping_mode=mode)
  ids = np.array([[0, 1], [1, 1], [3, 5]])
  return block, (ids, rand(4, (3, 2, 3)))


CASES = {
    "dense_pi": lambda: dense_case("pi"),
    "dense_exact": lambda: dense_case("exact"),
    "dense_einsum_transposed": lambda: dense_case("exact", False, (2, 3, 2), (1,)),
    "conv_pi": lambda: conv_case("pi"),
    "conv_exact": lambda: conv_case("exact"),
    "embedding_pi": lambda: embedding_case("pi"),
    "embedding_exact": lambda: embedding_case("exact"),
    "diagonal_dense": lambda: (B.DiagonalDense((3, 2), has_bias=True),
                               (rand(5, (4, 3)), rand(6, (4, 2)))),
    "diagonal_conv": lambda: (B.DiagonalConv((2, 1, 6), dimension_numbers=(
        "NWC", "WIO", "NWC"), feature_group_count=3, has_bias=True),
        (rand(7, (2, 5, 3)), rand(8, (2, 4, 6)))),
    "scale_shift_diag": lambda: (B.ScaleAndShift((3,)),
                                 (rand(9, (4, 2, 3)), rand(10, (4, 2, 3)))),
    "scale_shift_full": lambda: (B.ScaleAndShift((3,), full=True),
                                 (rand(11, (4, 2, 3)), rand(12, (4, 2, 3)))),
    "full": lambda: (B.Full(((2, 2), (3,))),
                     ((rand(13, (9, 2, 2)), rand(14, (9, 3))),)),
    "naive_diagonal": lambda: (B.NaiveDiagonal(((2, 2), (3,))),
                               ((rand(15, (3, 2, 2)), rand(16, (3, 3))),)),
    "ekfac_dense": lambda: (B.eigen_corrected(dense_case("pi")[0]),
                            dense_case("pi")[1]),
    "ekfac_conv": lambda: (B.eigen_corrected(conv_case("pi")[0]),
                           conv_case("pi")[1]),
    # Rank one: weights sharing positions (R = 2) and two sampled targets.
    "kronecker_vector": lambda: (
        B.KroneckerVectorDense((3, 4), has_bias=True),
        (rand(17, (5, 2, 3)), rand(18, (2, 5, 2, 4)))),
    "kronecker_vector_conv": lambda: (
        B.KroneckerVectorConv((3, 3, 2, 4), window_strides=(2, 2),
                              padding=((1, 1), (1, 1)),
                              dimension_numbers=("NHWC", "HWIO", "NHWC"),
                              feature_group_count=2, has_bias=True),
        (rand(21, (3, 4, 4, 4)), rand(22, (3, 2, 2, 4)))),
    "kronecker_vector_einsum_transposed": lambda: (
        B.KroneckerVectorDense((2, 3, 2), in_axes=(1,)),
        (rand(19, (4, 3)), rand(20, (4, 2, 2)))),
}


def stats_of(block, data, state):
  """Fresh statistics; an EKFAC block measures them in its state's basis."""
  if isinstance(block, B.EigenCorrected):
    return block.compute_stats(*data, state=state)
  return block.compute_stats(*data)


def make(name, dtype):
  block, data = CASES[name]()
  return block, _filled(block, data, dtype)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _filled(block, data, dtype):
  """The block's state after one update with ``data``'s statistics
  (jitted: one compile per case, where eager mode compiles each primitive)."""
  state = block.init(dtype)
  state = block.update(state, stats_of(block, data, state), 0.9)
  if isinstance(block, B.EigenCorrected):
    # An eigenbasis (refresh), then scalings measured in it.
    state = block.refresh(state, 0.0, step=0)
    state = block.update(state, stats_of(block, data, state), 0.9)
  return state


def random_v(block, seed, dtype):
  return tuple(rand(seed + i, s, dtype) for i, s in enumerate(block.param_shapes))


# Jitted helpers: one compile per shape (eager mode compiles each primitive).
_to_dense = jax.jit(lambda block, state: block.to_dense(state), static_argnums=0)
_factor_values = jax.jit(lambda state: tuple(fac.factor_value(f) for f in state))
_with_factors = jax.jit(lambda state, a, g: state._replace(
    a=kfl.update_cov(state.a, a, 0.0), g=kfl.update_cov(state.g, g, 0.0)))


def damped_dense(block, state, damping):
  """The damped block the approximation inverts, built independently."""
  dense = np.asarray(_to_dense(block, state), np.float64)
  if not isinstance(block, B.KroneckerBlock) or block.damping_mode == "exact":
    return dense + damping * np.eye(len(dense))
  # π-adjusted: c (A + π√(λ/c) I) ⊗ (G + √(λ/c)/π I), π per group.
  a, g = (np.asarray(f, np.float64) for f in _factor_values(state))
  a_diag = a if a.ndim == 2 else np.diagonal(a, axis1=1, axis2=2)
  pi = np.sqrt(a_diag.mean(-1) / np.diagonal(g, axis1=1, axis2=2).mean(-1))
  root = np.sqrt(damping / block.renorm_coeff)
  a_damped = (a + (pi * root)[:, None] if a.ndim == 2
              else a + (pi * root)[:, None, None] * np.eye(a.shape[-1]))
  g_damped = g + (root / pi)[:, None, None] * np.eye(g.shape[-1])
  damped = _with_factors(state, a_damped, g_damped)
  return np.asarray(_to_dense(block, damped), np.float64)


LAM = 0.3
REFRESHES = ((-1.0, "gauss_jordan"), (-1.0, "cholesky"), (-1.0, "newton_schulz"),
             (-1.0, "eigh"), (-0.5, "auto"))


@functools.partial(jax.jit, static_argnums=0)
def _algebra(block, state, v):
  """Every product ``test_block_algebra`` checks, jitted as the library
  runs (one compile per case, where eager mode compiles each primitive)."""
  out = {"dense": block.to_dense(state), "multiply": block.multiply(state, v),
         "inverse": block.multiply_inverse(state, v, LAM)}
  for exp in (-0.5, 0.5, 2.0):
    out[f"power {exp}"] = block.multiply_matpower(state, v, LAM, exp)
  there = block.multiply_matpower(state, v, LAM, -0.5)
  out["there and back"] = block.multiply_matpower(state, there, LAM, 0.5)
  lt_v = block.multiply_cholesky(state, v, LAM, transpose=True)
  out["L Lt v"] = block.multiply_cholesky(state, lt_v, LAM)
  out["Linv L v"] = block.multiply_cholesky_inverse(
      state, block.multiply_cholesky(state, v, LAM), LAM)
  out["Ltinv Lt v"] = block.multiply_cholesky_inverse(state, lt_v, LAM,
                                                      transpose=True)
  for exp, method in REFRESHES:
    cached = block.refresh(state, LAM, exp, step=3, method=method)
    out[f"cached {method}"] = block.multiply_matpower(cached, v, LAM, exp,
                                                      use_cache=True)
  return out


@pytest.mark.parametrize("x64", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_block_algebra(name, x64):
  with x64_mode(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    rtol = 1e-9 if x64 else 2e-3
    block, state = make(name, dtype)
    v = random_v(block, 100, np.float64 if x64 else np.float32)
    got = _algebra(block, state, v)
    dense = np.asarray(got["dense"], np.float64)
    n = sum(int(np.prod(s)) for s in block.param_shapes)
    assert dense.shape == (n, n)
    # Symmetric up to the rounding of its covariances' sums over ≤ 12 rows
    # (the conv's 3 images × 4 locations).
    assert_rounding_close(got["dense"], dense.T, terms=12)

    def close(key, expected):
      np.testing.assert_allclose(flat(got[key]), expected, rtol=rtol,
                                 atol=rtol * np.abs(expected).max(), err_msg=key)

    close("multiply", dense @ flat(v))
    damped = damped_dense(block, state, LAM)
    close("inverse", np.linalg.solve(damped, flat(v)))
    for exp in (-0.5, 0.5, 2.0):
      close(f"power {exp}", sym_power(damped, exp) @ flat(v))
    close("there and back", flat(v))
    # Square-root factors: L Lᵀ = damped; L⁻¹ and L⁻ᵀ invert L and Lᵀ.
    close("L Lt v", damped @ flat(v))
    close("Linv L v", flat(v))
    close("Ltinv Lt v", flat(v))
    # The refreshed cache gives the same products as a fresh decomposition,
    # whichever method computes the inverses.
    for exp, method in REFRESHES:
      close(f"cached {method}", sym_power(damped, exp) @ flat(v))


def test_pi_cholesky_factor_is_lower_triangular_in_kronecker_order():
  block, state = make("dense_pi", jnp.float32)
  a, b = block.layout.a, block.layout.b
  eye = np.eye(a * b, dtype=np.float32)
  cols = [block.layout.to_mat(block.multiply_cholesky(
      state, block.layout.from_mat(e.reshape(1, a, b)), 0.3))[0].ravel()
          for e in eye]
  chol = np.stack(cols, axis=1)
  np.testing.assert_allclose(np.triu(chol, 1), 0, atol=1e-6)


@hypothesis.settings(max_examples=10, deadline=None)
@hypothesis.given(d_in=st.integers(1, 4), d_out=st.integers(1, 4),
                  bias=st.booleans(), mode=st.sampled_from(["pi", "exact"]),
                  damping=st.floats(1e-3, 10.0),
                  exp=st.sampled_from([-1.0, -0.5, -0.25, 1.0]),
                  seed=st.integers(0, 1000))
def test_dense_block_powers_over_shapes(d_in, d_out, bias, mode, damping, exp,
                                        seed):
  with x64_mode(True):
    block, data = dense_case(mode, bias, (d_in, d_out), seed=seed)
    v = random_v(block, seed + 7, np.float64)
    state, got, back = _power_and_back(block, data, v, damping, exp)
    expected = sym_power(damped_dense(block, state, damping), exp) @ flat(v)
    np.testing.assert_allclose(flat(got), expected, rtol=1e-7,
                               atol=1e-9 * np.abs(expected).max())
    np.testing.assert_allclose(flat(back), flat(v), rtol=1e-6, atol=1e-8)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _power_and_back(block, data, v, damping, exp):
  """``(state, P^exp v, P^-exp P^exp v)`` for the block's statistics of
  ``data``, jitted as the library runs (one compile per drawn shape; eager
  mode compiles every primitive for it)."""
  state = block.update(block.init(jnp.float64), block.compute_stats(*data), 0.5)
  got = block.multiply_matpower(state, v, damping, exp)
  return state, got, block.multiply_matpower(state, got, damping, -exp)


@pytest.mark.parametrize("name", sorted(CASES))
def test_non_finite_statistics_leave_block_state_unchanged(name):
  block, state = make(name, jnp.float32)
  stats = stats_of(block, CASES[name]()[1], state)
  leaves, treedef = jax.tree.flatten(stats)
  leaves[-1] = leaves[-1].at[(0,) * leaves[-1].ndim].set(jnp.nan)
  after = block.update(state, jax.tree.unflatten(treedef, leaves), 0.9)
  factors = (state,) if isinstance(state, kfl.FactorState) else tuple(state)
  after_factors = (after,) if isinstance(after, kfl.FactorState) else tuple(after)
  for old, new in zip(factors, after_factors):
    for field in old._fields:
      if field != "num_skipped":
        jax.tree.map(np.testing.assert_array_equal, getattr(new, field),
                     getattr(old, field))
    assert int(new.num_skipped) == int(old.num_skipped) + 1


def test_bad_shapes_name_the_block_and_both_shapes():
  block = B.KroneckerDense((3, 4), has_bias=True)
  state = block.init()
  with pytest.raises(ValueError, match=r"KroneckerDense.*\(\(3, 4\), \(4,\)\).*\(\(4, 3\), \(4,\)\)"):
    block.multiply(state, (jnp.ones((4, 3)), jnp.ones(4)))
  with pytest.raises(ValueError, match=r"KroneckerDense.*\(5, 2\).*\(3,\)"):
    block.compute_stats(jnp.ones((5, 2)), jnp.ones((5, 4)))
  with pytest.raises(ValueError, match=r"KroneckerDense.*\(5, 3\).*\(5, 4\)"):
    block.compute_stats(jnp.ones((5, 3)), jnp.ones((5, 3)))
  with pytest.raises(ValueError, match=r"KroneckerDense.*weights of shape "
                     r"\(4,\) do not match a batch of 5$"):
    block.compute_stats(jnp.ones((5, 3)), jnp.ones((5, 4)), weights=jnp.ones(4))
  conv = B.KroneckerConv((3, 3, 2, 4), dimension_numbers=("NHWC", "HWIO", "NHWC"))
  with pytest.raises(ValueError, match=r"KroneckerConv.*\(1, 5, 5, 3\).*3 channels.*2"):
    conv.compute_stats(jnp.ones((1, 5, 5, 3)), jnp.ones((1, 3, 3, 4)))
  # A kernel applied twice per example (siamese) in a block built without
  # repeats: the weights are per example, the applications twice as many.
  with pytest.raises(ValueError, match=r"KroneckerConv.*weights of shape "
                     r"\(3,\).*batch of 6.*repeats=2"):
    conv.compute_stats(jnp.ones((6, 5, 5, 2)), jnp.ones((6, 3, 3, 4)),
                       weights=jnp.ones(3))
  emb = B.KroneckerEmbedding(5, 2)
  with pytest.raises(ValueError, match=r"KroneckerEmbedding.*integers"):
    emb.compute_stats(jnp.ones((3,)), jnp.ones((3, 2)))
  with pytest.raises(ValueError, match=r"KroneckerEmbedding.*\(3, 4\)"):
    emb.compute_stats(jnp.ones((3,), jnp.int32), jnp.ones((3, 4)))
  ss = B.ScaleAndShift((3,))
  with pytest.raises(ValueError, match=r"ScaleAndShift.*\(3,\).*\(4,\)"):
    ss.compute_stats(jnp.ones((2, 4)), jnp.ones((2, 4)))
  with pytest.raises(ValueError, match="damping_mode"):
    B.KroneckerDense((3, 4), damping_mode="tikhonov")
  with pytest.raises(ValueError, match="weight_sharing"):
    B.KroneckerDense((3, 4), weight_sharing="mean")
  with pytest.raises(ValueError, match="in_axes"):
    B.KroneckerDense((3, 4), in_axes=(0, 1))
  with pytest.raises(ValueError, match="update_cov.*\\(1, 5, 5\\).*\\(1, 4, 4\\)"):
    block.update(state, B.KroneckerState(a=jnp.ones((1, 5, 5)),
                                           g=jnp.ones((1, 4, 4))), 0.9)


def test_blocks_are_static_and_jit_friendly():
  block, data = CASES["conv_pi"]()
  assert hash(block) == hash(CASES["conv_pi"]()[0])

  @jax.jit
  def step(state, x, g, v):
    state = block.update(state, block.compute_stats(x, g), 0.95)
    state = block.refresh(state, 0.1, -1.0, step=1)
    return state, block.multiply_inverse(state, v, 0.1, use_cache=True)

  v = random_v(block, 0, np.float32)
  state, out = step(block.init(), *[np.float32(x) for x in data], v)
  np.testing.assert_allclose(
      flat(out), flat(block.multiply_inverse(state, v, 0.1)), rtol=1e-4,
      atol=1e-5)
  assert int(state.a.cache.step) == 1
  assert block.state_bytes() == sum(x.nbytes for x in jax.tree.leaves(state))
  assert fac.is_diagonal(state.a) is False


@pytest.mark.parametrize("name", sorted(CASES))
def test_state_keeps_one_cached_matrix_per_factor(name):
  """π damping keeps the covariance and its damped power (two n×n arrays a
  dense factor), exact damping the covariance and its eigendecomposition."""
  block, _ = CASES[name]()
  state = block.init()
  factors = (state,) if isinstance(state, kfl.FactorState) else tuple(state)
  exact = getattr(block, "damping_mode", "pi") == "exact"
  for f in factors:
    kept = [x.size for x in (f.cache.eigvals, f.cache.eigvecs, f.cache.matpower)]
    n, cov = f.cov.shape[-1], f.cov.size
    diagonal = fac.is_diagonal(f)
    groups = cov // (n if diagonal else n * n)
    # What a kind does not keep is a one-element placeholder per group
    # (never zero-size: orbax cannot save those).
    if exact:
      assert kept == [groups * n, groups if diagonal else cov, groups], name
    else:
      assert kept == [groups, groups, cov], name


@pytest.mark.parametrize("mode", ["pi", "exact"])
def test_describe_total_is_the_curvature_state_bytes(mode):
  """``describe``'s total line counts exactly the bytes ``kfac`` keeps."""
  def loss_fn(params, batch):
    h = jnp.tanh(batch["x"] @ params["w0"] + params["b0"])
    return kfl.softmax_cross_entropy_with_integer_labels(
        h @ params["w1"], batch["y"]).mean()

  params = {"w0": jnp.ones((5, 4)), "b0": jnp.zeros(4), "w1": jnp.ones((4, 3))}
  batch = {"x": jnp.ones((6, 5)), "y": jnp.zeros(6, jnp.int32)}
  table = kfl.describe(loss_fn, params, batch, damping_mode=mode)
  state = kfl.kfac(loss_fn, batch, damping_mode=mode).init(params)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state.blocks))
  assert table.total_bytes == nbytes
  # The totals, the step's price, the plan, then the loss line.
  assert str(table).splitlines()[-4].startswith(
      f"{len(table)} blocks, {nbytes} bytes of state (")
  assert str(table).splitlines()[-3].startswith("step price: ~")
  assert str(table).splitlines()[-2].startswith("plan: statistics every ")
  assert str(table).splitlines()[-1] == (
      "loss: Categorical (registered), per-element values [6]; outputs of w1")
  # π damping: per dense factor its covariance and one cached n×n matrix.
  n2 = (6 * 6 + 4 * 4) + (4 * 4 + 3 * 3)
  # Plus, per factor, one-element placeholders for what its cache kind
  # does not keep (π: eigvals and eigvecs; exact: matpower) and 4 scalars.
  placeholders = 4 * 4 * (2 if mode == "pi" else 1)
  assert nbytes - 4 * 2 * n2 == (0 if mode == "pi" else 4 * (6 + 4 + 4 + 3)) + 4 * 4 * 4 + placeholders


def test_describe_says_when_no_registered_loss_was_found():
  """Issue 23: describe reports (it does not raise) that a loss_fn has no
  registered or recognised loss, what that leaves for each estimation, the
  term it saw, and which batch leaves the empirical estimation takes as
  examples; given an estimation that needs a loss, it refuses."""
  def loss_fn(params, batch):
    return jnp.mean(jnp.abs(batch["x"] @ params["w"] - batch["t"]))

  params = {"w": jnp.ones((5, 3))}
  batch = {"x": jnp.ones((6, 5)), "t": jnp.zeros((6, 3))}
  lines = str(kfl.describe(loss_fn, params, batch)).splitlines()
  assert lines[-3].startswith("loss: none registered or recognised — "
                              "estimation='empirical' only"), lines[-3]
  assert "kfl.softmax_cross_entropy_with_integer_labels" in lines[-3]
  assert lines[-2] == (
      "loss terms not recognised (no curvature from them): a scalar term "
      "from `div` (reaches `abs` without a loss head)"), lines[-2]
  assert lines[-1] == ("examples: the leading axis (N=6) of batch/t, batch/x "
                       "(the batch's arrays)"), lines[-1]
  kfl.describe(loss_fn, params, batch, estimation="empirical")
  with pytest.raises(ValueError, match="kfl.describe: estimation='fisher' "
                     "needs a registered or recognised loss"):
    kfl.describe(loss_fn, params, batch, estimation="fisher")
