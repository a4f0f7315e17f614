"""Tagging of broadcast parameters and of layers without an example axis.

* A position embedding looked up with ``jnp.arange(T)`` and added to every
  example is an embedding layer (its ids broadcast over the batch); biases
  and scales over ``[T, D]`` are scale/shift layers over their own shape.
* A layer whose input has no axis that is the batch's example axis (a
  time-major ``lax.scan``, ``h.reshape(-1, d)`` merging batch and time)
  gets its Kronecker block under the expand convention: every input row a
  use of one pseudo-example whose weight is the examples' mean.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import kfac_jax_lite as kfl
import _helpers
from _helpers import assert_paths_rounding_close, x64_mode
from kfac_jax_lite.estimators import describe
from kfac_jax_lite.tagging import find_layers
from kfac_jax_lite.tagging._paths import named_leaves

N, T, D, V, H = 3, 4, 5, 7, 6


def _flat(tree):
  return dict(named_leaves(tree))  # The layers' naming (no wrapper .value).


def _probed(loss, params, batch):
  tl = find_layers(loss, params, batch)

  # One compile: cheaper than the eager ops' many small ones.
  return (tl,) + jax.jit(lambda p, b: _helpers.probe(tl, p, b))(params, batch)


# ------------------------------------------------------ broadcast parameters
def _pos_params(dtype):
  k = jax.random.split(jax.random.key(2), 4)
  return {"pos": jax.random.normal(k[0], (V, D), dtype),
          "scale": 1 + 0.1 * jax.random.normal(k[1], (T, D), dtype),
          "bias": 0.1 * jax.random.normal(k[2], (T, D), dtype),
          "w": jax.random.normal(k[3], (D, 2), dtype) / 2}


def _pos_direct(p, x):
  h = x + p["pos"][jnp.arange(x.shape[1])]
  return jnp.tanh(h * p["scale"] + p["bias"]) @ p["w"]


def _pos_take(p, x):   # The lookup inside a jit (jnp.take), added outside.
  h = x + jnp.take(p["pos"], jnp.arange(x.shape[1]), axis=0)[None]
  return jnp.tanh(h * p["scale"] + p["bias"]) @ p["w"]


POS_MODELS = {"direct": _pos_direct, "take": _pos_take}


def _pos_loss(net):
  def loss(p, x):
    return 0.5 * jnp.mean(jnp.sum(net(p, x) ** 2, (1, 2)))
  return loss


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("model", sorted(POS_MODELS))
def test_position_embedding_and_sequence_shaped_parameters(model, dtype):
  with x64_mode(dtype == "float64"):
    p = _pos_params(jnp.dtype(dtype))
    x = jax.random.normal(jax.random.key(3), (N, T, D), jnp.dtype(dtype))
    loss = _pos_loss(POS_MODELS[model])
    rows = describe(loss, p, x)
    got = {r.name: (r.kind, r.block, r.params) for r in rows}
    assert got == {
        "pos": ("embedding", "KroneckerEmbedding", ("pos",)),
        "scale": ("scale_and_shift", "ScaleAndShift", ("scale", "bias")),
        "w": ("dense", "KroneckerDense", ("w",))}, str(rows)
    _check_per_example(loss, p, x)


def _check_per_example(loss, p, x):
  tl, l, grads, caps, cts = _probed(loss, p, x)
  per_ex = jax.jit(tl.per_example_grads)(
      caps, {k: v * N for k, v in cts.items()})
  ref = _flat(jax.jit(jax.vmap(lambda ex: jax.grad(loss)(p, ex[None])))(x))
  # ≤ 3 layers forward and back, then the sums over the T uses and the N
  # examples: ≤ 8 chained reductions, none longer than D·T terms.
  assert_paths_rounding_close(per_ex, ref, terms=D * T, depth=8)
  assert_paths_rounding_close(_flat(grads), _flat(jax.jit(jax.grad(loss))(
      p, x)), terms=D * T, depth=8)


def test_nnx_position_embedding():
  from flax import nnx

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.pos = nnx.Embed(V, D, rngs=rngs)
      self.out = nnx.Linear(D, 2, rngs=rngs)

    def __call__(self, x):
      return self.out(jnp.tanh(x + self.pos(jnp.arange(x.shape[1]))))
  graphdef, state = nnx.split(Model(nnx.Rngs(0)))
  loss = _pos_loss(lambda s, x: nnx.merge(graphdef, s)(x))
  x = jax.random.normal(jax.random.key(3), (N, T, D))
  rows = describe(loss, state, x)
  assert [r.kind for r in rows] == ["dense", "embedding"], str(rows)
  _check_per_example(loss, state, x)


# ------------------------------------------------- no example axis: expand
def _rnn_params(dtype=jnp.float32):
  k = jax.random.split(jax.random.key(4), 4)
  return {"wi": jax.random.normal(k[0], (D, H), dtype) / 2,
          "wh": jax.random.normal(k[1], (H, H), dtype) / 3,
          "wo": jax.random.normal(k[2], (H, 2), dtype) / 2,
          "bo": jnp.zeros(2, dtype)}


def _rnn_loss(p, batch):
  """A time-major RNN (``[T, N, D]`` inputs) whose output layer sees time
  and batch merged by ``reshape(-1, H)``."""
  x, y = batch
  def step(h, xt):
    h = jnp.tanh(xt @ p["wi"] + h @ p["wh"])
    return h, h
  _, hs = lax.scan(step, jnp.zeros((x.shape[1], H), x.dtype), x)
  out = hs.reshape(-1, H) @ p["wo"] + p["bo"]
  return kfl.softmax_cross_entropy_with_integer_labels(
      out, y.reshape(-1)).mean()


def _rnn_batch(dtype=jnp.float32):
  k = jax.random.split(jax.random.key(5), 2)
  return (jax.random.normal(k[0], (T, N, D), dtype),
          jax.random.randint(k[1], (T, N), 0, 2))


@functools.lru_cache(maxsize=None)
def _rnn_tagged():
  return find_layers(_rnn_loss, _rnn_params(), _rnn_batch())


def test_time_major_scan_and_merged_axes_get_kronecker_blocks():
  rows = describe(_rnn_loss, _rnn_params(), _rnn_batch())
  assert [(r.name, r.kind, r.block, r.params) for r in rows] == [
      ("wo", "dense", "KroneckerDense", ("wo", "bo")),
      ("wh", "dense", "KroneckerDense", ("wh",)),
      ("wi", "dense", "KroneckerDense", ("wi",))], str(rows)
  # The loss's examples are its T·N tokens: the output layer's rows are
  # they; the recurrent layers' inputs [N, ·] inside the scan are not.
  rows_layers = [r.name != "wo" for r in rows]
  assert [("every input row a use (expand)" in r.notes) for r in rows] == \
      rows_layers
  assert [r.sharing == "expand (rows)" for r in rows] == rows_layers
  assert [l.row_uses for l in _rnn_tagged().layers] == rows_layers


def test_haiku_dynamic_unroll_time_major():
  import haiku as hk

  def f(x):
    core = hk.VanillaRNN(H)
    out, _ = hk.dynamic_unroll(core, x, core.initial_state(x.shape[1]))
    return hk.Linear(2)(out)
  model = hk.without_apply_rng(hk.transform(f))
  x, y = _rnn_batch()
  params = model.init(jax.random.key(0), x)

  def loss(p, b):
    return kfl.softmax_cross_entropy_with_integer_labels(
        model.apply(p, b[0]), b[1]).mean()
  rows = describe(loss, params, (x, y))
  assert [r.kind for r in rows] == ["dense"] * 3, str(rows)
  # The output layer's leading axis (time) is the batch's leading axis;
  # the recurrent core's input is [N, ·] inside the scan: expand.
  assert [("expand" in r.notes) for r in rows] == [False, True, True]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_row_uses_statistics_against_brute_force(dtype):
  # ``empirical`` through the public estimator: the output layer's input
  # factor is the mean over the T·N rows of [h, 1][h, 1]ᵀ and its output
  # factor mean(c)·Σ_rows g gᵀ with g = ∇_o ℓ (softmax − one-hot); the
  # pseudo-example's gradient is the sum of the per-example gradients.
  with x64_mode(dtype == "float64"):
    dt = jnp.dtype(dtype)
    p, batch = _rnn_params(dt), _rnn_batch(dt)
    fn = kfl.value_grad_and_stats(_rnn_loss, p, batch, estimation="empirical")
    est = jax.jit(fn)(p, batch, jax.random.PRNGKey(0))
    x, y = batch

    def hidden(p):
      def step(h, xt):
        h = jnp.tanh(xt @ p["wi"] + h @ p["wh"])
        return h, h
      return lax.scan(step, jnp.zeros((N, H), dt), x)[1].reshape(-1, H)
    h = np.asarray(hidden(p), np.float64)
    a = np.concatenate([h, np.ones((T * N, 1))], 1)
    logits = h @ np.asarray(p["wo"], np.float64) + np.asarray(p["bo"], np.float64)
    prob = np.exp(logits - logits.max(1, keepdims=True))
    prob /= prob.sum(1, keepdims=True)
    g = prob - np.eye(2)[np.asarray(y).reshape(-1)]
    c = 1.0 / (T * N)
    stats = est.stats["wo"]
    tol = 1e-5 if dtype == "float32" else 1e-12
    assert stats.a.dtype == dt
    np.testing.assert_allclose(stats.a[0], a.T @ a / (T * N), rtol=tol * 10,
                               atol=tol)
    np.testing.assert_allclose(stats.g[0], c * g.T @ g, rtol=tol * 10, atol=tol)
    np.testing.assert_allclose(est.grads["wo"],
                               jax.grad(_rnn_loss)(p, batch)["wo"],
                               rtol=tol * 10, atol=tol)

  tl, l, grads, caps, cts = _probed(_rnn_loss, _rnn_params(), _rnn_batch())
  per_ex = jax.jit(tl.per_example_grads)(
      caps, {k: v * T for k, v in cts.items()})
  full = _flat(jax.grad(_rnn_loss)(_rnn_params(), _rnn_batch()))
  for path, gr in per_ex.items():   # Summed over examples: T·∇L.
    # Rows of no example axis: one pseudo-example (N = 1); the output
    # layer's rows are the loss's T·N examples.
    assert gr.shape[0] == (T * N if path in ("wo", "bo") else 1), path
    np.testing.assert_allclose(gr.sum(0), T * full[path], rtol=1e-4,
                               atol=1e-6, err_msg=path)


def test_kfac_trains_time_major_rnn():
  import optax
  p, batch = _rnn_params(), _rnn_batch()
  tx = optax.chain(kfl.kfac(_rnn_loss, batch), optax.sgd(0.05, momentum=0.9))
  state = tx.init(p)

  @jax.jit
  def step(p, state):
    l, g = jax.value_and_grad(_rnn_loss)(p, batch)
    u, state = tx.update(g, state, p, batch=batch)
    return optax.apply_updates(p, u), state, l
  first = _rnn_loss(p, batch)
  for _ in range(10):
    p, state, _ = step(p, state)
  assert _rnn_loss(p, batch) < first


def test_describe_shows_the_weight_sharing_of_every_block():
  # Dense and conv blocks follow ``weight_sharing`` (a convolution's
  # locations are its shared axis); a scale-and-shift has none.
  p = {"k": jnp.ones((3, 3, 2, 4)) / 9, "w": jnp.ones((4, 2)) / 4,
       "s": jnp.ones(2)}

  def loss(p, x):
    h = lax.conv_general_dilated(x, p["k"], (1, 1), "VALID",
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jnp.mean(((h @ p["w"]) * p["s"]) ** 2)
  x = jnp.ones((2, 5, 5, 2))
  for mode in ("expand", "reduce"):
    rows = describe(loss, p, x, weight_sharing=mode)
    assert {r.name: r.sharing for r in rows} == {
        "k": mode, "w": mode, "s": "-"}, str(rows)
    assert "sharing" in str(rows).splitlines()[0]


def test_per_example_embedding_broadcast_over_positions_keeps_its_examples():
  # ``emb[ids][:, None]`` added over positions: its ids have the example
  # axis already; the positions are a weight-sharing axis, not examples.
  k = jax.random.split(jax.random.key(6), 3)
  p = {"e": jax.random.normal(k[0], (V, D)), "w": jax.random.normal(k[1], (D, 2))}
  ids = jnp.array([1, 4, 4])

  def loss(p, x):
    h = jnp.tanh(x + p["e"][ids][:, None])
    return 0.5 * jnp.mean(jnp.sum((h @ p["w"]) ** 2, (1, 2)))
  x = jax.random.normal(k[2], (N, T, D))
  rows = describe(loss, p, x)
  assert [(r.name, r.kind) for r in rows] == [("e", "embedding"),
                                               ("w", "dense")], str(rows)
  tl = find_layers(loss, p, x)
  (use,) = [tl._uses[i] for i in tl.layer("e").use_ids]
  assert use.examples == N
