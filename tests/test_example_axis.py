"""``example_axis=``: the examples on another axis than the batch's first
(issue 24, point 3).

A time-major recurrent LM (ids ``[T, B]``, a ``lax.scan`` over T) with
``example_axis=1`` has the statistics of its batch-major twin (ids
``[B, T]``, the same parameters), in float64 and for the deterministic
estimations (``"exact"``, ``"empirical"``, a fallback block included);
without it, ``describe`` says which axis it took when ``T = B`` leaves the
choice open (and when ``T ≠ B`` leaves the recurrent layers without the
batch's example axis), and how to say another. Bad values are errors at
build time.
"""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kfl
from kfac_jax_lite.optimizers import transform
from _helpers import x64_mode

V, D, H = 5, 3, 4


def _params(dtype=np.float64):
  rng = np.random.default_rng(0)
  p = lambda *s: jnp.asarray(0.5 * rng.standard_normal(s), dtype)
  return {"embed": p(V, D), "wx": p(D, H), "wh": p(H, H), "b": p(H),
          "wo": p(H, V), "bo": p(V), "temp": jnp.asarray(0.1, dtype)}


def _run(params, x):
  """Hidden states ``[T, B, H]`` from time-major embeddings ``[T, B, D]``."""
  def step(h, x):
    h = jnp.tanh(x @ params["wx"] + h @ params["wh"] + params["b"])
    return h, h
  h0 = jnp.zeros((x.shape[1], H), params["wx"].dtype)
  _, hs = jax.lax.scan(step, h0, x)
  return hs


def time_major_loss(params, batch):
  x = params["embed"][batch["ids"]]            # [T, B, D]
  hs = _run(params, x)                          # [T, B, H]
  logits = (hs @ params["wo"] + params["bo"]) * jnp.exp(params["temp"])
  return kfl.softmax_cross_entropy_with_integer_labels(
      logits, batch["labels"]).mean()


def batch_major_loss(params, batch):
  x = params["embed"][batch["ids"]]            # [B, T, D]
  hs = jnp.swapaxes(_run(params, jnp.swapaxes(x, 0, 1)), 0, 1)  # [B, T, H]
  logits = (hs @ params["wo"] + params["bo"]) * jnp.exp(params["temp"])
  return kfl.softmax_cross_entropy_with_integer_labels(
      logits, batch["labels"]).mean()


def _batch(t, b, seed=1):
  rng = np.random.default_rng(seed)
  return {"ids": jnp.asarray(rng.integers(0, V, (t, b)), jnp.int32),
          "labels": jnp.asarray(rng.integers(0, V, (t, b)), jnp.int32)}


def _transposed(batch):
  return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), batch)


@pytest.mark.parametrize("t,b", [(3, 4), (4, 4)])
@pytest.mark.parametrize("estimation", ["exact", "empirical"])
def test_time_major_with_example_axis_has_the_batch_major_statistics(
    t, b, estimation):
  with x64_mode(True):
    params, batch = _params(), _batch(t, b)
    tm = kfl.value_grad_and_stats(time_major_loss, params, batch,
                                  estimation=estimation, example_axis=1)
    bm = kfl.value_grad_and_stats(batch_major_loss, params,
                                  _transposed(batch), estimation=estimation)
    assert [l.row_uses for l in tm.tagged.layers] == [
        l.row_uses for l in bm.tagged.layers]
    assert not any(l.row_uses for l in tm.tagged.layers)
    assert any(l.is_fallback for l in tm.tagged.layers)  # temp
    key = jax.random.PRNGKey(0)
    # Jitted: one compile each instead of hundreds of eager operations'.
    got = jax.jit(tm)(params, batch, key)
    want = jax.jit(bm)(params, _transposed(batch), key)
    assert got.stats.keys() == want.stats.keys()
    np.testing.assert_allclose(got.loss, want.loss, rtol=1e-12)
    np.testing.assert_allclose(got.weights, want.weights, rtol=1e-12)
    for name in want.stats:
      jax.tree.map(lambda x, y: np.testing.assert_allclose(
          x, y, rtol=1e-10, atol=1e-13, err_msg=name),
                   got.stats[name], want.stats[name])


def test_kfac_and_kfac_optimizer_take_example_axis():
  """The same updates as the batch-major model's, through ``kfl.kfac``;
  ``kfl.kfac_optimizer`` passes it on."""
  with x64_mode(True):
    params, batch = _params(), _batch(3, 4)
    kw = dict(estimation="exact")
    tx_tm, layers_tm = transform.kfac_with_layers(
        time_major_loss, batch, example_axis=1, **kw)
    tx_bm = kfl.kfac(batch_major_loss, _transposed(batch), **kw)
    grads = jax.grad(time_major_loss)(params, batch)
    # Jitted: one compile each instead of hundreds of eager operations'.
    first = lambda tx: jax.jit(lambda g, p, b: tx.update(
        g, tx.init(p), p, batch=b)[0])
    u_tm = first(tx_tm)(grads, params, batch)
    u_bm = first(tx_bm)(grads, params, _transposed(batch))
    jax.tree.map(lambda x, y: np.testing.assert_allclose(
        x, y, rtol=1e-9, atol=1e-12), u_tm, u_bm)
    opt = kfl.kfac_optimizer(time_major_loss, batch, example_axis=1)
    updates = first(opt)(grads, params, batch)
    assert all(np.all(np.isfinite(u)) for u in jax.tree.leaves(updates))
    assert not any(l.row_uses for l in layers_tm(params).layers)


def test_describe_says_which_axis_it_took_when_t_equals_b():
  params, batch = _params(np.float32), _batch(4, 4)
  with pytest.warns(UserWarning):
    text = str(kfl.describe(time_major_loss, params, batch))
  assert "example axis ambiguous" in text
  assert "pass example_axis=1" in text
  told = str(kfl.describe(time_major_loss, params, batch, example_axis=1))
  assert "ambiguous" not in told and "example axis unknown" not in told
  assert "examples: axis 1 (N=4) of batch/ids, batch/labels" in told


def test_describe_hints_example_axis_for_time_major_data_with_t_not_b():
  params, batch = _params(np.float32), _batch(3, 5)
  with pytest.warns(UserWarning):
    text = str(kfl.describe(time_major_loss, params, batch))
  assert "every input row a use" in text  # the recurrent layers
  assert "pass example_axis=1" in text
  told = str(kfl.describe(time_major_loss, params, batch, example_axis=1))
  assert "every input row a use" not in told


def test_batch_major_data_gets_no_hint():
  params, batch = _params(np.float32), _transposed(_batch(3, 5))
  text = str(kfl.describe(batch_major_loss, params, batch))
  assert "example_axis" not in text


def test_example_axis_as_a_pytree_with_none():
  """A leaf that holds no examples (a scalar, a per-batch constant) is
  None in the pytree form; the int form skips leaves without axes."""
  params, batch = _params(np.float32), _batch(3, 4)

  def loss(p, bt):
    return time_major_loss(p, bt["data"]) * jnp.sum(bt["scale"])
  full = {"data": batch, "scale": jnp.ones((2,))}
  tagged = kfl.tagging.find_layers(
      loss, params, full,
      example_axis={"data": {"ids": 1, "labels": 1}, "scale": None})
  assert tagged.examples.size == 4
  assert tagged.examples.names == ("batch/data/ids", "batch/data/labels")
  assert not any(l.row_uses for l in tagged.layers)
  with_scalar = {"data": batch, "scale": jnp.ones(())}
  tagged = kfl.tagging.find_layers(loss, params, with_scalar, example_axis=1)
  assert tagged.examples.names == ("batch/data/ids", "batch/data/labels")


@pytest.mark.parametrize("example_axis,match", [
    (2, "no such axis"),
    (-3, "no such axis"),
    (True, "must be an int"),
    ("1", "must be an int"),
    (1.0, "must be an int"),
    ({"ids": 1}, "batch's structure"),
    ({"ids": 1, "labels": "x"}, "must be an int or None"),
    ({"ids": 1, "labels": 0}, "differ in size"),
    ({"ids": None, "labels": None}, "names no axis"),
])
def test_bad_example_axis_is_an_error_at_build_time(example_axis, match):
  params, batch = _params(np.float32), _batch(3, 4)
  for build in (
      lambda: kfl.kfac(time_major_loss, batch, example_axis=example_axis),
      lambda: kfl.kfac_optimizer(time_major_loss, batch,
                                 example_axis=example_axis),
      lambda: kfl.describe(time_major_loss, params, batch,
                           example_axis=example_axis),
      lambda: kfl.value_grad_and_stats(time_major_loss, params, batch,
                                       example_axis=example_axis)):
    with pytest.raises(ValueError, match=match):
      build()


def test_example_axis_with_stats_fraction_is_refused():
  batch = _batch(3, 8)
  with pytest.raises(ValueError, match="stats_fraction=1"):
    kfl.kfac(time_major_loss, batch, example_axis=1, stats_fraction=0.5)
  # Axis 0 said explicitly keeps stats_fraction.
  kfl.kfac(time_major_loss, batch, example_axis=0, stats_fraction=0.5)


def test_optax_chain_with_example_axis_trains():
  params, batch = _params(np.float32), _batch(3, 8)
  tx = optax.chain(kfl.kfac(time_major_loss, batch, example_axis=1),
                   optax.sgd(0.05))
  state = tx.init(params)
  first = time_major_loss(params, batch)

  @jax.jit
  def step(params, state):
    grads = jax.grad(time_major_loss)(params, batch)
    updates, state = tx.update(grads, state, params, batch=batch)
    return optax.apply_updates(params, updates), state
  for _ in range(20):
    params, state = step(params, state)
  assert time_major_loss(params, batch) < first
  assert kfl.health(state).ok, kfl.health(state)


def test_a_square_input_of_a_dense_layer_is_not_ambiguous():
  """``[N, N]`` features: the second axis is a feature axis, no hint."""
  w = jnp.ones((4, 2))
  x = {"x": jnp.ones((4, 4)), "y": jnp.zeros((4, 2))}
  loss = lambda p, b: kfl.squared_error(b["x"] @ p, b["y"]).mean()
  assert "example_axis" not in str(kfl.describe(loss, w, x))


@pytest.mark.parametrize("t,b", [(3, 4), (4, 4)])
def test_haiku_lstm_lm_time_major_equals_batch_major(t, b):
  """Issue 24's case: a Haiku LSTM LM on time-major ``[T, B]`` tokens
  (``hk.dynamic_unroll(..., time_major=True)``) with ``example_axis=1``
  has the statistics of the same parameters run batch-major."""
  hk = pytest.importorskip("haiku")

  def make(time_major):
    def f(ids):
      x = hk.Embed(V, 5)(ids)
      core = hk.LSTM(6)
      out, _ = hk.dynamic_unroll(
          core, x, core.initial_state(ids.shape[1 if time_major else 0]),
          time_major=time_major)
      return hk.Linear(V)(jax.nn.relu(hk.Linear(8)(out)))
    return hk.without_apply_rng(hk.transform(f))

  with x64_mode(True):
    tm, bm = make(True), make(False)
    batch = _batch(t, b)
    params = jax.tree.map(lambda x: x.astype(jnp.float64),
                          tm.init(jax.random.PRNGKey(0), batch["ids"]))
    loss = lambda model: lambda p, bt: (
        kfl.softmax_cross_entropy_with_integer_labels(
            model.apply(p, bt["ids"]), bt["labels"]).mean())
    got_fn = kfl.value_grad_and_stats(loss(tm), params, batch,
                                      estimation="exact", example_axis=1)
    want_fn = kfl.value_grad_and_stats(loss(bm), params, _transposed(batch),
                                       estimation="exact")
    assert not any(l.row_uses or l.is_fallback for l in got_fn.tagged.layers)
    key = jax.random.PRNGKey(0)
    got = jax.jit(got_fn)(params, batch, key)  # One compile, not eager ops.
    want = jax.jit(want_fn)(params, _transposed(batch), key)
    for name in want.stats:
      jax.tree.map(lambda x, y: np.testing.assert_allclose(
          x, y, rtol=1e-10, atol=1e-13, err_msg=name),
                   got.stats[name], want.stats[name])


def test_a_loss_tied_to_its_batch_size_says_the_axis_was_guessed():
  """The second trace (example axes one longer) fails: the layers' example
  axes are matched by size, and ``describe`` says so."""
  params, batch = _params(np.float32), _batch(3, 4)

  def tied(p, bt):
    ids = bt["ids"].reshape(3, 4)  # Fails for any other batch size.
    return time_major_loss(p, dict(bt, ids=ids))
  text = str(kfl.describe(tied, params, batch, example_axis=1))
  assert "example axis guessed" in text
  assert "every input row a use" not in text


@pytest.mark.parametrize("t,b", [(4, 4), (3, 5)])
def test_a_scan_over_the_axis_taken_as_examples_warns(t, b):
  """Time-major data without ``example_axis``: the axis taken as the
  examples is what the ``lax.scan`` runs over; building warns, and
  ``describe`` says so. Batch-major data, and ``example_axis=1``, do not."""
  params, batch = _params(np.float32), _batch(t, b)
  with pytest.warns(UserWarning, match="lax.scan runs over the axis taken"):
    text = str(kfl.describe(time_major_loss, params, batch))
  assert "the data look time-major" in text and "example_axis=1" in text
  with pytest.warns(UserWarning, match="example_axis=1"):
    kfl.kfac(time_major_loss, batch).init(params)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    kfl.describe(time_major_loss, params, batch, example_axis=1)
    kfl.describe(batch_major_loss, params, _transposed(batch))
