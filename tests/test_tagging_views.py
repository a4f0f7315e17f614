"""Kernels reshaped before use keep a Kronecker block over their own axes;
a position table sliced shorter (``x + pos[:t]``) is an embedding.

``W.reshape(d, heads, head_dim)`` in an einsum (an output axis split),
``conv_kernel.reshape(-1, c_out)`` (input axes merged): the block is the
dense block of the kernel as stored, with the data arranged over the
reshaped axes and regrouped. The per-example gradients rebuilt from the
captures are those of ``jax.vmap(jax.grad(...))``, and a convolution with
one output location preconditions exactly like the dense layer written
with its reshaped kernel.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import kfac_jax_lite as kfl
import _helpers
from _helpers import x64_mode
from kfac_jax_lite.estimators import describe
from kfac_jax_lite.tagging import find_layers

N, T, D, HEADS, E = 3, 4, 6, 2, 3


def _params(dtype):
  k = jax.random.split(jax.random.key(0), 4)
  return {"wq": jax.random.normal(k[0], (D, HEADS * E), dtype) / 2,
          "wo": jax.random.normal(k[1], (HEADS * E, 2), dtype) / 2,
          "kc": jax.random.normal(k[2], (2, 2, 3, 4), dtype) / 3,
          "bc": 0.1 * jnp.ones(4, dtype)}


def _net(p, x, im):
  q = jnp.einsum("ntd,dhe->nthe", x, p["wq"].reshape(D, HEADS, E))
  o = jnp.einsum("nthe,hej->ntj", jnp.tanh(q), p["wo"].reshape(HEADS, E, 2))
  z = im.reshape(im.shape[0], -1) @ p["kc"].reshape(-1, 4) + p["bc"]
  return o, z


def _loss(p, batch):
  o, z = _net(p, *batch)
  return 0.5 * jnp.mean(jnp.sum(o ** 2, (1, 2)) + jnp.sum(z ** 2, 1))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_reshaped_kernels_rebuild_per_example_gradients(dtype):
  with x64_mode(dtype == "float64"):
    dt = jnp.dtype(dtype)
    p = _params(dt)
    k = jax.random.split(jax.random.key(1), 2)
    batch = (jax.random.normal(k[0], (N, T, D), dt),
             jax.random.normal(k[1], (N, 2, 2, 3), dt))
    rows = describe(_loss, p, batch)
    assert [(r.name, r.kind, r.block, r.params, r.factors) for r in rows] == [
        ("kc", "dense", "KroneckerDense", ("kc", "bc"), ((1, 13, 13), (1, 4, 4))),
        ("wo", "dense", "KroneckerDense", ("wo",), ((1, 6, 6), (1, 2, 2))),
        ("wq", "dense", "KroneckerDense", ("wq",), ((1, 6, 6), (1, 6, 6)))], str(rows)
    tl = find_layers(_loss, p, batch)
    per_ex, ref = _helpers.per_example_and_reference(tl, _loss, p, batch)
    for path, g in per_ex.items():
      assert g.dtype == dt
    # ≤ 2 layers forward and back, then the sum over the T uses: ≤ 6
    # chained reductions, none longer than the conv's 2·2·3 = 12 inputs.
    _helpers.assert_paths_rounding_close(per_ex, ref, terms=12, depth=6)


def test_reshape_that_mixes_groups_falls_back():
  # Contracting one of the axes a reshape split off is not a dense layer of
  # the stored kernel.
  p = {"w": jnp.ones((6, 4)) / 6}

  def loss(p, x):
    return jnp.mean(jnp.einsum("nh,hed->ned", x, p["w"].reshape(2, 3, 4)) ** 2)
  (row,) = describe(loss, p, jnp.ones((3, 2)))
  assert row.kind == "fallback" and "part of a reshaped axis" in row.notes


def test_one_location_conv_equals_dense_with_reshaped_kernel():
  # DESIGN: a conv whose output is one location is the same block as the
  # equivalent dense layer, also when that dense layer's kernel is the conv
  # kernel reshaped. Same statistics, same K-FAC update.
  k = jax.random.split(jax.random.key(2), 4)
  p = {"k": jax.random.normal(k[0], (2, 2, 3, 4)) / 3, "b": 0.1 * jnp.ones(4)}
  im = jax.random.normal(k[1], (8, 2, 2, 3))
  t = jax.random.normal(k[2], (8, 4))

  def conv_loss(p, batch):
    im, t = batch
    y = lax.conv_general_dilated(im, p["k"], (1, 1), "VALID",
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return kfl.squared_error((y + p["b"]).reshape(-1, 4), t).mean()

  def dense_loss(p, batch):
    im, t = batch
    y = im.reshape(im.shape[0], -1) @ p["k"].reshape(-1, 4) + p["b"]
    return kfl.squared_error(y, t).mean()
  for loss, kind in ((conv_loss, "conv"), (dense_loss, "dense")):
    rows = describe(loss, p, (im, t))
    assert [(r.kind, r.params) for r in rows] == [(kind, ("k", "b"))], rows
  updates = []
  for loss in (conv_loss, dense_loss):
    tx = kfl.kfac(loss, (im, t), estimation="exact", damping=1e-2,
                  norm_constraint=None)
    state = tx.init(p)
    g = jax.jit(jax.grad(loss))(p, (im, t))
    u, state = jax.jit(tx.update)(g, state, p, batch=(im, t))
    updates.append(u)
  for name in ("k", "b"):
    np.testing.assert_allclose(updates[0][name], updates[1][name], rtol=1e-4,
                               atol=1e-6, err_msg=name)
    assert np.abs(updates[0][name] - jax.grad(dense_loss)(p, (im, t))[name]
                  ).max() > 1e-3   # Preconditioned, not the gradient.


# ------------------------------------------- a position table sliced shorter
# GPT-style ``x + pos[:t]`` with a table of MAX_LEN > t rows (and an offset
# window ``pos[2:t+2]``, and the slice taken inside a ``jit``): an embedding
# over the whole table whose ids are the positions, broadcast over the
# batch; the rows outside the window get zero statistics.
MAX_LEN = 7


def _slice_net(lo, in_jit=False):
  def rows(pos, t):
    return pos[lo:lo + t]
  rows = jax.jit(rows, static_argnums=1) if in_jit else rows

  def loss(p, x):
    h = jnp.tanh(x + rows(p["pos"], x.shape[1])) @ p["w"]
    return 0.5 * jnp.mean(jnp.sum(h ** 2, (1, 2)))
  return loss


@pytest.mark.parametrize("lo,in_jit,dtype", [(0, False, "float32"),
                                             (2, True, "float64")])
def test_sliced_position_table_is_an_embedding_of_the_whole_table(
    lo, in_jit, dtype):
  with x64_mode(dtype == "float64"):
    dt = jnp.dtype(dtype)
    k = jax.random.split(jax.random.key(5), 3)
    p = {"pos": jax.random.normal(k[0], (MAX_LEN, D), dt),
         "w": jax.random.normal(k[1], (D, 2), dt) / 2}
    x = jax.random.normal(k[2], (N, T, D), dt)
    loss = _slice_net(lo, in_jit)
    rows = describe(loss, p, x)
    assert [(r.name, r.kind, r.block, r.params) for r in rows] == [
        ("pos", "embedding", "KroneckerEmbedding", ("pos",)),
        ("w", "dense", "KroneckerDense", ("w",))], str(rows)
    tl = find_layers(loss, p, x)
    probes = tl.zero_probes(p, x)

    def f(pp, pr):
      l, _, caps = tl.apply(pp, x, pr)
      return l, caps
    @jax.jit
    def rebuilt(p, probes):
      l, vjp, caps = jax.vjp(f, p, probes, has_aux=True)
      _, cts = vjp(jnp.ones_like(l))
      return tl.per_example_grads(caps, {u: v * N for u, v in cts.items()})
    per_ex = rebuilt(p, probes)
    ref = jax.jit(jax.vmap(lambda xi: jax.grad(loss)(p, xi[None])))(x)
    for path in ("pos", "w"):
      assert per_ex[path].dtype == dt
    # ≤ 2 layers forward and back and the sum over the T uses (≤ D terms).
    _helpers.assert_paths_rounding_close(per_ex, ref, terms=D, depth=5)
    # The input factor (the ids' diagonal second moment) of the statistics:
    # 1/T on each of the T looked-up rows, zero on the others.
    est_fn = kfl.value_grad_and_stats(loss, p, x, estimation="empirical")
    est = jax.jit(est_fn)(p, x, jax.random.PRNGKey(0))
    diag = np.zeros(MAX_LEN)
    diag[lo:lo + T] = 1 / T
    # A mean of N·T ones: N·T terms.
    _helpers.assert_rounding_close(
        jax.tree.leaves(est.stats["pos"])[0].ravel(), diag, terms=N * T)


# ------------------------------- a vmapped 1x1 conv with one output channel
# Per-example code (``jax.vmap`` over ``conv(x[None], k)[0] + b``) moves the
# output's unit channel axis around before the bias: the bias is the conv's
# own (this crashed at the first step: the cotangents lost the channel).
def _conv1(p, xi):  # One example [16, 8, 8], OIHW kernel (1, 16, 1, 1).
  y = lax.conv_general_dilated(xi[None], p["k"], (1, 1), "VALID")
  return y[0] + p["b"][:, None, None]


def _conv1_loss(p, x):
  y = jax.vmap(lambda xi: _conv1(p, xi))(x)
  return 0.5 * jnp.mean(jnp.sum((y - 1.0) ** 2, (1, 2, 3)))


def _conv1_dense(p, x):  # The same layer written as a dense one per pixel.
  h = jnp.transpose(x, (0, 2, 3, 1)) @ p["w"] + p["b"]
  return 0.5 * jnp.mean(jnp.sum((h - 1.0) ** 2, (1, 2, 3)))


def test_vmapped_one_channel_conv_is_a_conv_with_its_bias():
  with x64_mode(True):
    k = jax.random.split(jax.random.key(7), 2)
    p = {"k": jax.random.normal(k[0], (1, 16, 1, 1), jnp.float64) / 4,
         "b": 0.1 * jnp.ones(1, jnp.float64)}
    x = jax.random.normal(k[1], (4, 16, 8, 8), jnp.float64)
    rows = describe(_conv1_loss, p, x)
    assert [(r.kind, r.block, r.params) for r in rows] == [
        ("conv", "KroneckerConv", ("k", "b"))], str(rows)
    tl = find_layers(_conv1_loss, p, x)
    per_ex, ref = _helpers.per_example_and_reference(tl, _conv1_loss, p, x)
    # A sum over 64 locations of 16-term products, one layer each way.
    _helpers.assert_paths_rounding_close(per_ex, ref, terms=64 * 16, depth=3)
    # Its statistics are those of the dense layer applied at every pixel.
    stats = []
    dense = {"w": p["k"].reshape(1, 16).T, "b": p["b"]}
    for loss, q, name in ((_conv1_loss, p, "k"), (_conv1_dense, dense, "w")):
      est = kfl.value_grad_and_stats(loss, q, x, estimation="empirical")
      stats.append(jax.jit(est)(q, x, jax.random.PRNGKey(0)).stats[name])
    for a, b in zip(jax.tree.leaves(stats[0]), jax.tree.leaves(stats[1])):
      _helpers.assert_rounding_close(a, b, terms=4 * 64, depth=3)
    # And a K-FAC step runs (it raised at the first one) and stays finite.
    tx = kfl.kfac(_conv1_loss, x)
    state = tx.init(p)
    u, _ = jax.jit(tx.update)(jax.grad(_conv1_loss)(p, x), state, p, batch=x)
    assert all(bool(jnp.isfinite(v).all()) for v in jax.tree.leaves(u))
