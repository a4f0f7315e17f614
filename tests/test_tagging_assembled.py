"""Kernels assembled from several parameters keep one Kronecker block each.

``jnp.concatenate`` of kernels along the output axis (Flax's
``OptimizedLSTMCell``: four gate kernels and biases joined before one
``jnp.dot``), along the input axis, and ``jnp.stack`` of gate kernels for
one ``DenseGeneral``-style einsum: each part is the dense layer of its
slice of the product. Joined along the output, part p's block is
``A ⊗ G_p`` (the shared input, the cotangent of its columns); along the
input, ``A_p ⊗ G`` (its input slice, the whole output's cotangent).

Checked three ways: no fallback in ``describe``; the captured data rebuild
the per-example gradients of ``jax.vmap(jax.grad(...))``; and, with one
example, the block's ``A ⊗ G`` is the outer product of that example's
gradient of the part (kernel and bias) — the Fisher of one example.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax_lite as kfl
from _helpers import (assert_paths_rounding_close, assert_rounding_close,
                      x64_mode)

N, D, H = 3, 4, 2


def _params(dtype):
  k = jax.random.split(jax.random.key(0), 8)
  r = lambda i, *s: jax.random.normal(k[i], s, dtype) / 2
  return {"a": r(0, D, H), "b": r(1, D, 3), "ba": r(2, H), "bb": r(3, 3),
          "c": r(4, 2, H), "d": r(5, 3, H), "e": r(6, D, H), "f": r(7, D, H),
          "bz": 0.1 * r(2, H)}


def joined(p, x):
  # Output axis (with joined biases), then input axis (the bias goes with
  # the first part), then stacked gates.
  y = x @ jnp.concatenate([p["a"], p["b"]], 1) + jnp.concatenate(
      [p["ba"], p["bb"]])
  z = jnp.tanh(y) @ jnp.concatenate([p["c"], p["d"]], 0) + p["bz"]
  g = jnp.einsum("nd,dgh->ngh", x, jnp.stack([p["e"], p["f"]], 1))
  return jnp.mean(jnp.sum(z ** 2, 1) + jnp.sum(jnp.tanh(g) ** 3, (1, 2)))


class _BiLSTM(nn.Module):
  """Flax's sst2 example's encoder: a bidirectional ``OptimizedLSTMCell``."""

  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    cell = lambda: nn.RNN(nn.OptimizedLSTMCell(3, param_dtype=self.dtype))
    h = nn.Bidirectional(cell(), cell())(x)
    return nn.Dense(2, param_dtype=self.dtype)(h.mean(1))


def _bilstm(dtype):
  m = _BiLSTM(dtype)
  x = jax.random.normal(jax.random.key(1), (N, 4, 2), dtype)
  p = m.init(jax.random.key(0), x)
  return (lambda p, x: jnp.mean(jnp.sum(m.apply(p, x) ** 2, -1))), p, x


def _setup(name, dtype):
  if name == "bilstm":
    return _bilstm(dtype)
  return joined, _params(dtype), jax.random.normal(jax.random.key(1), (N, D),
                                                   dtype)


def _probed(tl, p, batch, n):
  def f(pp, pr):
    l, _, caps = tl.apply(pp, batch, pr)
    return l, caps
  l, vjp, caps = jax.vjp(f, p, tl.zero_probes(p, batch), has_aux=True)
  _, cts = vjp(jnp.ones_like(l))
  return caps, {k: v * n for k, v in cts.items()}


@pytest.mark.parametrize("name,dtype", [("joined", "float32"),
                                        ("joined", "float64"),
                                        ("bilstm", "float64")])
def test_joined_kernels_rebuild_per_example_gradients(name, dtype):
  with x64_mode(dtype == "float64"):
    dt = jnp.dtype(dtype)
    loss, p, x = _setup(name, dt)
    rows = kfl.describe(loss, p, x)
    assert all(r.kind == "dense" for r in rows), str(rows)
    n_params = len(jax.tree.leaves(p))
    assert sum(len(r.params) for r in rows) == n_params
    if name == "bilstm":  # 2 cells × (4 h-kernels + biases, 4 i-kernels).
      assert len(rows) == 17, str(rows)
      assert sum("joined: one of 4 kernels" in r.notes for r in rows) == 16
    tl = kfl.tagging.find_layers(loss, p, x)

    @jax.jit
    def both(p, x):
      per_ex = tl.per_example_grads(*_probed(tl, p, x, N))
      ref = jax.vmap(lambda xi: jax.grad(loss)(p, xi[None]))(x)
      return per_ex, {kfl.tagging.path_name(k): v for k, v in
                      jax.tree_util.tree_flatten_with_path(ref)[0]}
    per_ex, ref = both(p, x)
    assert set(per_ex) == set(ref)
    for path, g in per_ex.items():
      assert g.dtype == dt, path
    # ≤ 3 layers forward and back (the LSTM's 4 steps: ≤ 12 chained
    # products each way), sums of ≤ 2·D terms.
    assert_paths_rounding_close(per_ex, ref, terms=2 * D,
                                depth=24 if name == "bilstm" else 8)


@pytest.mark.parametrize("name", ["joined", "bilstm"])
def test_one_example_block_is_its_gradient_outer_product(name):
  # One example, one use (the LSTM's steps are uses: one step): A ⊗ G of
  # each part is ∇ℓ ∇ℓᵀ of the part's (kernel, bias), the empirical Fisher.
  with x64_mode(True):
    if name == "bilstm":
      m = _BiLSTM(jnp.float64)
      x = jax.random.normal(jax.random.key(1), (1, 1, 2), jnp.float64)
      p = m.init(jax.random.key(0), x)
      loss = lambda p, x: jnp.mean(jnp.sum(m.apply(p, x) ** 2, -1))
    else:
      loss, p = joined, _params(jnp.float64)
      x = jax.random.normal(jax.random.key(1), (1, D), jnp.float64)
    tl = kfl.tagging.find_layers(loss, p, x).with_blocks()

    @jax.jit
    def stats(p, x):
      data = tl.layer_data(*_probed(tl, p, x, 1))
      return {l.name: l.block.layer_stats(data[l.name]) for l in tl.detected}
    got = stats(p, x)
    grads = {kfl.tagging.path_name(k): v for k, v in
             jax.tree_util.tree_flatten_with_path(jax.grad(loss)(p, x))[0]}
    checked = 0
    for layer in tl.detected:
      s = got[layer.name]
      g = np.concatenate([np.ravel(grads[q]) for q in layer.params])
      assert_rounding_close(np.kron(s.a[0], s.g[0]), np.outer(g, g),
                            terms=2 * D, depth=12, err_msg=layer.name)
      checked += 1
    assert checked == (17 if name == "bilstm" else 6)


def test_joined_with_a_non_parameter_falls_back_and_says_why():
  p = {"w": jnp.ones((D, H)) / D}

  def loss(p, x):
    k = jnp.concatenate([p["w"], jnp.zeros((D, 1))], 1)
    return jnp.mean((x @ k) ** 2)
  (row,) = kfl.describe(loss, p, jnp.ones((N, D)))
  assert row.kind == "fallback" and "concatenate" in row.notes, row


def test_joined_then_not_a_product_falls_back_and_says_why():
  p = {"u": jnp.ones((D,)), "v": jnp.ones((D,))}

  def loss(p, x):
    return jnp.mean((x * jnp.concatenate([p["u"], p["v"]])) ** 2)
  rows = kfl.describe(loss, p, jnp.ones((N, 2 * D)))
  assert [r.kind for r in rows] == ["fallback"] * 2, rows
  assert all("concatenated with other parameters before `mul`" in r.notes
             for r in rows), rows


# ------------------------------------- a kernel scaled by a stop-gradient scalar
# ``K = V / sg(‖V‖)``: the gradient of V is 1/s times the kernel's, so V's
# block is the dense (conv) block of the input x/s. Also a conv kernel, and
# the scaled kernel used inside a ``jax.jit`` and at every ``lax.scan`` step.
sg = jax.lax.stop_gradient


def scaled(p, x):
  k = p["v"] / sg(jnp.linalg.norm(p["v"]))
  h = jax.jit(lambda x, k: jnp.tanh(x @ k + p["bv"]))(x, k)
  r = p["r"] * sg(1.0 + jnp.sum(p["r"] ** 2))   # Multiplied, not divided.

  def step(c, _):
    return jnp.tanh(c @ r), None
  h, _ = jax.lax.scan(step, h, None, length=2)
  im = x.reshape(x.shape[0], 2, 2, 1)
  y = jax.lax.conv_general_dilated(
      im, p["c"] / sg(jnp.max(jnp.abs(p["c"]))), (1, 1), "SAME",
      dimension_numbers=("NHWC", "HWIO", "NHWC"))
  return jnp.mean(jnp.sum(h ** 2, 1) + jnp.sum(y ** 2, (1, 2, 3)))


def _scaled_params(dtype):
  k = jax.random.split(jax.random.key(3), 4)
  return {"v": jax.random.normal(k[0], (D, H), dtype),
          "bv": 0.1 * jnp.ones(H, dtype),
          "r": jax.random.normal(k[1], (H, H), dtype) / 2,
          "c": jax.random.normal(k[2], (2, 2, 1, 3), dtype)}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_stop_gradient_scaled_kernels_rebuild_per_example_gradients(dtype):
  with x64_mode(dtype == "float64"):
    dt = jnp.dtype(dtype)
    p = _scaled_params(dt)
    x = jax.random.normal(jax.random.key(4), (N, D), dt)
    rows = kfl.describe(scaled, p, x)
    assert sorted((r.name, r.kind, r.params) for r in rows) == [
        ("c", "conv", ("c",)), ("r", "dense", ("r",)),
        ("v", "dense", ("v", "bv"))], str(rows)
    tl = kfl.tagging.find_layers(scaled, p, x)

    @jax.jit
    def both(p, x):
      per_ex = tl.per_example_grads(*_probed(tl, p, x, N))
      ref = jax.vmap(lambda xi: jax.grad(scaled)(p, xi[None]))(x)
      return per_ex, ref
    per_ex, ref = both(p, x)
    for path in ("v", "bv", "c", "r"):
      assert per_ex[path].dtype == dt
      assert_rounding_close(per_ex[path], ref[path], terms=2 * D,
                            depth=12, err_msg=path)


def test_one_example_scaled_block_is_its_gradient_outer_product():
  with x64_mode(True):
    p = _scaled_params(jnp.float64)
    x = jax.random.normal(jax.random.key(4), (1, D), jnp.float64)
    tl = kfl.tagging.find_layers(scaled, p, x).with_blocks()
    data = jax.jit(lambda p, x: tl.layer_data(*_probed(tl, p, x, 1)))(p, x)
    grads = jax.grad(scaled)(p, x)
    s = tl.layer("v").block.layer_stats(data["v"])
    g = np.concatenate([np.ravel(grads["v"]), np.ravel(grads["bv"])])
    assert_rounding_close(np.kron(s.a[0], s.g[0]), np.outer(g, g),
                          terms=2 * D, depth=8)


def test_kernel_normalised_by_its_own_norm_falls_back_and_says_why():
  p = _scaled_params(jnp.float32)

  def weight_norm(p, x):  # g · v/‖v‖ per output column: ‖v‖ differentiated.
    k = p["v"] / jnp.linalg.norm(p["v"], axis=0) * p["bv"]
    return jnp.mean(jnp.sum(jnp.tanh(x @ k) ** 2, 1))
  rows = {r.name: r for r in kfl.describe(weight_norm, p, jnp.ones((N, D)))}
  assert rows["v"].kind == "fallback", rows
  assert "differentiable function of itself" in rows["v"].notes, rows
  assert "weight norm's g" in rows["bv"].notes, rows


def test_bilstm_kfac_step_preconditions_every_gate():
  # The K-FAC step of the Flax BiLSTM runs, stays finite, and changes every
  # gate's update (a block, not the gradient passed through).
  loss, p, x = _bilstm(jnp.float32)
  tx = kfl.kfac(loss, x, estimation="empirical")
  state = tx.init(p)
  g = jax.grad(loss)(p, x)
  u, _ = jax.jit(tx.update)(g, state, p, batch=x)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(u)[0],
                          jax.tree.leaves(g)):
    assert bool(jnp.isfinite(a).all()), path
    assert not np.allclose(np.asarray(a), -np.asarray(b)) and not np.allclose(
        np.asarray(a), np.asarray(b)), path


def test_stacked_vectors_contracted_away_fall_back_and_say_why():
  # Vectors stacked along the contracted axis: each piece is an output row
  # times one input feature, no input axis of its own (a scale, not dense).
  p = {"e": jnp.ones(3), "f": jnp.ones(3)}

  def loss(p, x):
    return jnp.mean(jnp.einsum("ng,gh->nh", x, jnp.stack([p["e"], p["f"]])) ** 2)
  rows = kfl.describe(loss, p, jnp.ones((N, 2)))
  assert [r.kind for r in rows] == ["fallback"] * 2, rows
  assert all("no input or no output axis" in r.notes for r in rows), rows


def test_equinox_spectral_norm_falls_back_and_says_why():
  # Equinox's SpectralNorm divides by σ = uᵀWv with only u, v held
  # constant: σ is differentiated, so W's gradient is projected.
  import equinox as eqx
  k = jax.random.key(5)
  sn, state = eqx.nn.make_with_state(eqx.nn.SpectralNorm)(
      eqx.nn.Linear(D, H, key=k), "weight", key=k)
  params, static = eqx.partition(sn, eqx.is_array)

  def loss(q, x):
    m = eqx.combine(q, static)
    y, _ = jax.vmap(lambda xi: m(xi, state), out_axes=(0, None))(x)
    return jnp.mean(jnp.sum(y ** 2, 1))
  rows = {r.name: r for r in kfl.describe(loss, params, jnp.ones((N, D)))}
  assert rows["layer/weight"].kind == "fallback", rows
  assert "not under stop_gradient" in rows["layer/weight"].notes, rows
