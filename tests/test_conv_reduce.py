"""K-FAC-reduce for convolutions (Eschenhagen et al. 2023).

``weight_sharing="reduce"`` aggregates over a conv's output locations per
example before the outer products: ``A = Σ_n w_n ã_n ã_nᵀ`` with ``ã_n`` the
mean over locations of the unfolded patches (a 1 for the bias) and
``G = Σ_n c_n E[ĝ_n ĝ_nᵀ]`` with ``ĝ_n`` the sum over locations of the output
cotangents. Pinned here against brute force that never calls the library's
conv code: patches are rows of the conv's Jacobian in its kernel
(``jax.jacrev``), per-location cotangents are ``jax.vmap(jax.grad)`` of each
example's loss in a perturbation of the conv output, and the exact GGN of a
linear model with a Gaussian output, summed over locations, is formed from
per-example Jacobians (reduce is exact there, expand is not).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import kfac_jax_lite as kfl
from kfac_jax_lite.optimizers import transform
from kfac_jax_lite import blocks as B

from _helpers import assert_rounding_close, x64_mode

DN = ("NHWC", "HWIO", "NHWC")
# 5x5x4 input, 3x3 window, 2 feature groups of 2 in / 2 out channels,
# stride (2, 1), SAME padding: 3x5 = 15 output locations.
KERNEL = (3, 3, 2, 4)
WINDOW = dict(window_strides=(2, 1), padding="SAME", feature_group_count=2)
N, S = 3, 2
C = np.array([0.3, 1.2, 0.5])  # loss weights c_n (Σc ≠ 1: w = c/Σc ≠ c)


def _rand(key, shape, dtype):
  return jax.random.normal(jax.random.PRNGKey(key), shape, dtype)


def _conv(kernel, bias, x):  # one example [H, W, C] -> [H', W', O]
  y = lax.conv_general_dilated(x[None], kernel, dimension_numbers=DN,
                               **WINDOW)[0]
  return y + bias


def _setup(dtype):
  """Kernel, bias, inputs ``[N, 5, 5, 4]`` and the per-example,
  per-location cotangents ``[S, N, 3, 5, 4]`` of S targets."""
  kernel, bias = _rand(0, KERNEL, dtype), _rand(1, (4,), dtype)
  xs, targets = _rand(2, (N, 5, 5, 4), dtype), _rand(3, (S, N, 3, 5, 4), dtype)
  return (kernel, bias, xs) + (_cotangents(kernel, bias, xs, targets),)


@jax.jit
def _cotangents(kernel, bias, xs, targets):
  def example_loss(d, x, t):  # ℓ_n as a function of a perturbation d of y_n
    return 0.5 * jnp.sum((jnp.tanh(_conv(kernel, bias, x) + d) - t) ** 2)
  grad = jax.vmap(jax.grad(example_loss), in_axes=(None, 0, 0))
  zeros = jnp.zeros((3, 5, 4), xs.dtype)
  return jax.vmap(lambda t: grad(zeros, xs, t))(targets)


@jax.jit
def _kernel_jacobian(kernel, bias, xs):  # [N, 3, 5, O, 3, 3, 2, O]
  return jax.vmap(jax.jacrev(lambda k, x: _conv(k, bias, x)),
                  in_axes=(None, 0))(kernel, xs)


def _patches(kernel, bias, xs):
  """``[N, T, groups, 3·3·2 + 1]``: ∂y_nto/∂W[..., o] for one o per group
  (the unfolded patch, rows ordered like the kernel's (h, w, i)), and 1."""
  jac = np.asarray(_kernel_jacobian(kernel, bias, xs), np.float64)
  jac = jac.reshape(N, 15, 4, 18, 4)
  per_group = np.stack([jac[:, :, o, :, o] for o in (0, 2)], axis=2)
  return np.concatenate([per_group, np.ones((N, 15, 2, 1))], axis=-1)


def _brute_reduce(patches, cots, c):
  """Reduce factors ``(A [groups, a, a], G [groups, b, b])``, float64."""
  w = c / c.sum()
  a_mean = patches.mean(1)  # [N, groups, a]
  big_a = np.einsum("n,nki,nkj->kij", w, a_mean, a_mean)
  g_sum = np.asarray(cots, np.float64).reshape(S, N, 15, 2, 2).sum(2)
  big_g = np.einsum("n,snki,snkj->kij", c, g_sum, g_sum) / S
  return big_a, big_g


def _block(mode):
  return B.KroneckerConv(KERNEL, dimension_numbers=DN, has_bias=True,
                         weight_sharing=mode, **WINDOW)


@pytest.mark.parametrize("x64", [False, True])
def test_reduce_factors_equal_brute_force_from_patches_and_cotangents(x64):
  with x64_mode(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    kernel, bias, xs, cots = _setup(dtype)
    reduce = jax.jit(_block("reduce").compute_stats)(xs, cots, C)
    expand = jax.jit(_block("expand").compute_stats)(xs, cots, C)
    assert reduce.a.dtype == dtype
    want_a, want_g = _brute_reduce(_patches(kernel, bias, xs), cots, C)
    reduce, expand = jax.tree.map(np.asarray, (reduce, expand))
  tol = dict(rtol=1e-10, atol=1e-12) if x64 else dict(rtol=2e-4, atol=1e-5)
  np.testing.assert_allclose(reduce.a, want_a, **tol)
  np.testing.assert_allclose(reduce.g, want_g, **tol)
  # With 15 locations reduce is not expand (the test above can fail).
  for r, e in ((reduce.a, expand.a), (reduce.g, expand.g)):
    assert np.abs(r - e).max() > 0.1 * np.abs(e).max()


@pytest.mark.parametrize("x64", [False, True])
def test_one_output_location_expand_equals_reduce_equals_dense(x64):
  with x64_mode(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    xs, cots = _rand(0, (3, 3, 2, 4), dtype), _rand(1, (2, 3, 1, 1, 5), dtype)
    c = jnp.asarray(C, dtype)

    @jax.jit  # One compile instead of one per operation.
    def all_stats(xs, cots, c):
      stats = [B.KroneckerConv((3, 2, 4, 5), dimension_numbers=DN,
                               has_bias=True,
                               weight_sharing=m).compute_stats(xs, cots, c)
               for m in ("expand", "reduce")]
      stats.append(B.KroneckerDense((3, 2, 4, 5), in_axes=(0, 1, 2),
                                    has_bias=True).compute_stats(
                                        xs, cots.reshape(2, 3, 5), c))
      return stats

    stats = all_stats(xs, cots, c)
  for s in stats[1:]:  # Sums over the 3 examples (and 2 samples) of
    # products of the window's 3·2·4 = 24 inputs or of 5 outputs.
    assert_rounding_close(s.a, stats[0].a, terms=24, depth=2)
    assert_rounding_close(s.g, stats[0].g, terms=24, depth=2)


def _pooled(p, x1, x2):
  """A linear conv model summed over its output locations; siamese when
  ``x2`` is given (the same kernel applied to two inputs)."""
  def conv(x):
    y = lax.conv_general_dilated(x, p["k"], dimension_numbers=DN, **WINDOW)
    return (y + p["b"]).sum((1, 2))
  return conv(x1) if x2 is None else conv(x1) + conv(x2)


@functools.partial(jax.jit, static_argnums=0)
def _dense_of(block, stats):
  """``to_dense`` after one update of a fresh float64 state (jitted: one
  compile per block and shapes, not one per operation)."""
  return block.to_dense(block.update(block.init(jnp.float64), stats, 0.5))


@pytest.mark.parametrize("siamese", [False, True])
def test_linear_gaussian_model_reduce_is_the_exact_ggn(siamese):
  """``ŷ_n = Σ_t (W ā_nt)`` under ``l2_loss``: the GGN is
  ``Σ_n c_n (Σ_t ā_nt)(Σ_t ā_nt)ᵀ ⊗ I``, which reduce's ``A ⊗ G`` is exactly
  (the output Hessian is constant), also for a kernel applied twice per
  example (both applications' locations are the example's); expand is not.
  The diagonal block is the GGN's diagonal there too."""
  with x64_mode(True):
    p = {"k": _rand(0, KERNEL, jnp.float64), "b": _rand(1, (4,), jnp.float64)}
    b = {"x1": _rand(2, (N, 5, 5, 4), jnp.float64),
         "x2": _rand(3, (N, 5, 5, 4), jnp.float64) if siamese else None,
         "y": _rand(4, (N, 4), jnp.float64)}
    loss = lambda p, b: kfl.l2_loss(_pooled(p, b["x1"], b["x2"]),
                                    b["y"]).sum(-1).mean()
    jac = jax.jit(lambda p, b: jax.jacrev(  # One compile, not one per op.
        lambda q: _pooled(q, b["x1"], b["x2"]))(p))(p, b)  # [N, 4, ...]
    jac = np.concatenate([np.asarray(jac[k]).reshape(N, 4, -1)
                          for k in ("k", "b")], -1)
    ggn = np.einsum("noi,noj->ij", jac, jac) / N
    got = {}
    # Each case checks reduce and one contrast: expand, which differs from
    # the GGN, or (siamese) the diagonal block, which is its diagonal.
    other = "diagonal" if siamese else "kronecker"
    for mode, choice in (("reduce", "kronecker"), ("expand", other)):
      fn = kfl.value_grad_and_stats(loss, p, b, estimation="exact_ggn",
                                    weight_sharing=mode,
                                    blocks={"conv": choice})
      (layer,) = fn.tagged.layers
      assert layer.kind == "conv" and layer.params == ("k", "b")
      assert layer.block.repeats == (2 if siamese else 1)
      est = jax.jit(fn)(p, b, jax.random.PRNGKey(0))
      got[mode] = np.asarray(_dense_of(layer.block, est.stats[layer.name]))
  np.testing.assert_allclose(got["reduce"], ggn, rtol=1e-9,
                             atol=1e-9 * np.abs(ggn).max())
  if siamese:
    np.testing.assert_allclose(np.diag(got["expand"]), np.diag(ggn),
                               rtol=1e-9)
  else:
    assert np.abs(got["expand"] - ggn).max() > 0.1 * np.abs(ggn).max()


def _net(p, b):
  h = lax.conv_general_dilated(b["x"], p["conv"]["k"], (1, 1), "SAME",
                               dimension_numbers=DN) + p["conv"]["b"]
  h = jax.nn.relu(h).mean((1, 2))
  logits = h @ p["head"]["w"] + p["head"]["b"]
  return kfl.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()


@jax.jit  # One compile instead of one per operation.
def _net_setup():
  p = {"conv": {"k": 0.5 * _rand(0, (3, 3, 2, 3), jnp.float32),
                "b": jnp.zeros(3)},
       "head": {"w": _rand(1, (3, 4), jnp.float32), "b": jnp.zeros(4)}}
  b = {"x": _rand(2, (8, 6, 6, 2), jnp.float32),
       "y": jnp.arange(8) % 4}
  return p, b


def test_kfac_with_reduce_takes_a_step_with_reduce_conv_blocks():
  p, b = _net_setup()
  k, layers_of = transform.kfac_with_layers(_net, b, weight_sharing="reduce")
  tx = optax.chain(k, optax.sgd(0.05))
  state = jax.jit(tx.init)(p)  # Jitted: one compile, not one per operation.
  loss_and_grad = jax.jit(jax.value_and_grad(_net))
  loss, grads = loss_and_grad(p, b)
  updates, state = jax.jit(lambda g, s, p: tx.update(g, s, p, batch=b))(
      grads, state, p)
  new = jax.jit(optax.apply_updates)(p, updates)
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(updates))
  assert float(loss_and_grad(new, b)[0]) < float(loss)
  layers = {l.name: l.block for l in layers_of(p).layers}
  assert {type(v).__name__: v.weight_sharing for v in layers.values()} == {
      "KroneckerConv": "reduce", "KroneckerDense": "reduce"}
  # After one step the (zero-debiased) input factor is this batch's reduce A:
  # the mean over examples of the outer product of each example's mean patch.
  conv = next(n for n, v in layers.items() if isinstance(v, B.KroneckerConv))
  a = np.asarray(jax.jit(kfl.factor.factor_value)(state[0].blocks[conv].a))[0]
  patches = jax.jit(lambda x: lax.conv_general_dilated_patches(  # One compile.
      jnp.moveaxis(x, -1, 1), (3, 3), (1, 1), "SAME"))(b["x"])  # [N, C·9, 6, 6]
  mean = np.asarray(patches, np.float64).reshape(8, 2, 9, 36).mean(-1)
  mean = np.concatenate([mean.transpose(0, 2, 1).reshape(8, 18),
                         np.ones((8, 1))], 1)  # rows (h, w, c), then bias
  # Means over 36 locations, then over 8 examples, of products.
  assert_rounding_close(a, mean.T @ mean / 8, terms=36 + 8, depth=2)


def test_overrides_and_describe_show_each_blocks_weight_sharing():
  p, b = _net_setup()
  table = lambda **kw: {r.name: r for r in kfl.describe(_net, p, b, **kw)}
  default = table()
  assert {r.sharing for r in default.values()} == {"expand"}
  by_kind = table(blocks={"conv": {"weight_sharing": "reduce"}})
  by_path = table(blocks={"conv/*": {"weight_sharing": "reduce"}})
  for t in (by_kind, by_path):
    assert {r.block: r.sharing for r in t.values()} == {
        "KroneckerConv": "reduce", "KroneckerDense": "expand"}
  everywhere = table(weight_sharing="reduce",
                     blocks={"conv": "ekfac", "dense": "diagonal"})
  assert {r.block: r.sharing for r in everywhere.values()} == {
      "EkfacConv": "reduce", "DiagonalDense": "-"}


def _all_kinds(p, b):
  h = lax.conv_general_dilated(b["x"], p["k"], (1, 1), "VALID",
                               dimension_numbers=DN).reshape(2, 2)
  h = h * p["scale"] + p["shift"] + p["emb"][b["ids"]]
  return jnp.sum((h @ p["w"]) ** 2) * jnp.max(p["u"])


@pytest.mark.parametrize("kind, layer, allowed", [
    ("conv", "k", "damping_mode, weight_sharing, renorm_coeff"),
    ("dense", "w", "damping_mode, weight_sharing, renorm_coeff"),
    ("embedding", "emb", "damping_mode, weight_sharing, renorm_coeff"),
    ("scale_and_shift", "scale", "full"),
    ("fallback", "u", "none"),
])
def test_unknown_override_option_names_the_layer_key_and_options(
    kind, layer, allowed):
  p = {"k": jnp.ones((1, 1, 3, 2)), "scale": jnp.ones(2), "shift": jnp.ones(2),
       "emb": jnp.ones((5, 2)), "w": jnp.ones((2, 3)), "u": jnp.ones(3)}
  b = {"x": jnp.ones((2, 1, 1, 3)), "ids": jnp.array([1, 4])}
  kinds = {r.kind for r in kfl.describe(_all_kinds, p, b)}
  assert kinds == {"conv", "dense", "embedding", "scale_and_shift", "fallback"}
  with pytest.raises(ValueError) as err:
    kfl.describe(_all_kinds, p, b, blocks={kind: {"foo": 1}})
  msg = str(err.value)
  assert f"{layer!r}" in msg and "'foo'" in msg, msg
  assert f"options are {allowed}" in msg, msg
  # A known option with a bad value also names the layer.
  if kind in ("conv", "dense", "embedding"):
    with pytest.raises(ValueError, match=f"{layer!r}.*weight_sharing.*'mean'"):
      kfl.describe(_all_kinds, p, b, blocks={kind: {"weight_sharing": "mean"}})


@pytest.mark.parametrize("window,strides,padding,dilation,lhs", [
    ((3, 3), (1, 1), "SAME", (1, 1), None),
    ((3, 3), (2, 2), "SAME", (1, 1), None),
    ((3, 2), (1, 2), "VALID", (2, 1), None),
    ((3, 3), (1, 1), ((1, 2), (0, 1)), (1, 1), None),
    ((3, 3), (1, 1), ((-1, 1), (2, 0)), (1, 1), None),
    ((5,), (2,), "SAME", (2,), None),
    ((2, 3, 2), (1, 2, 1), "VALID", (1, 1, 2), None),
    ((3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), (2, 2)),  # transposed
])
def test_conv_patches_by_slicing_equal_jax_patches(window, strides, padding,
                                                   dilation, lhs):
  """The conv block's patches (strided slices of the padded input: no
  arithmetic) are ``lax.conv_general_dilated_patches``' exactly, in float64,
  in every padding, stride and dilation; with input dilation they are
  JAX's own."""
  from jax import lax
  from kfac_jax_lite.blocks import conv

  @jax.jit  # One compile for both, instead of one per operation.
  def both(x):
    return (lax.conv_general_dilated_patches(
        x, window, strides, padding, lhs_dilation=lhs,
        rhs_dilation=dilation, precision=lax.Precision.HIGHEST),
            conv._patches(x, window, strides, padding, lhs, dilation))

  with x64_mode(True):
    x = jnp.asarray(np.random.default_rng(0).normal(
        size=(2, 3) + (9,) * len(window)))
    want, got = both(x)
    assert got.shape == want.shape and got.dtype == jnp.float64
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
