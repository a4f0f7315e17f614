"""The one-pass style (``kfl.value_grad_and_stats`` → ``update(stats=)``)
against the ``batch=`` style, by value, and the structure of ``update``.

* ``stats_fraction``: the statistics of ``value_grad_and_stats(...,
  stats_fraction=f)`` at the key ``kfac`` draws its own from are those of
  ``kfac(..., stats_fraction=f)`` with ``batch=``, so both give the same
  factors and the same update (float32 and float64), while the loss and
  gradient are the whole batch's;
* ``update`` lowers to one conditional for the periodic refresh (plus one
  for ``cov_every > 1``), whatever the number of layers.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax_lite as kfl
from _helpers import (assert_rounding_close, block_stats, flat, kron_cond_bound,
                      x64_mode)

SIZES = (5, 7, 4)
N = 12


def init_params(dtype=jnp.float32):
  keys = jax.random.split(jax.random.PRNGKey(0), len(SIZES) - 1)
  return [{"w": (jax.random.normal(k, (i, o)) / np.sqrt(i)).astype(dtype),
           "b": jnp.full((o,), 0.1, dtype)}
          for k, i, o in zip(keys, SIZES[:-1], SIZES[1:])]


def make_batch(dtype=jnp.float32):
  kx, ky = jax.random.split(jax.random.PRNGKey(1))
  return {"x": jax.random.normal(kx, (N, SIZES[0])).astype(dtype),
          "y": jax.random.randint(ky, (N,), 0, SIZES[-1])}


def loss_fn(params, batch):
  h = batch["x"]
  for i, layer in enumerate(params):
    h = h @ layer["w"] + layer["b"]
    if i < len(params) - 1:
      h = jnp.tanh(h)
  loss = kfl.softmax_cross_entropy_with_integer_labels(h, batch["y"]).mean()
  return loss, {"logits": h}


def plain_loss(params, batch):
  return loss_fn(params, batch)[0]


@pytest.mark.parametrize("x64,estimation", [(False, "fisher"),
                                            (True, "fisher"),
                                            (True, "empirical")])
def test_stats_fraction_one_pass_equals_batch_path(x64, estimation):
  with x64_mode(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    params, batch = init_params(dtype), make_batch(dtype)
    fraction = 0.25  # 3 of 12 examples.
    options = dict(estimation=estimation, stats_fraction=fraction)
    tx = kfl.kfac(plain_loss, batch, damping=1e-2, inverse_every=1, seed=5,
                  norm_constraint=None, **options)
    est_fn = kfl.value_grad_and_stats(plain_loss, params, batch, **options)
    # kfac draws the statistics' key as the second half of split(state.key).
    key = jax.random.split(jax.random.PRNGKey(5))[1]
    est = jax.jit(est_fn)(params, batch, key)

    # The loss and gradient are the whole batch's.
    loss, grads = jax.value_and_grad(plain_loss)(params, batch)
    # Two programs computing one value: 2 layers forward and back and the
    # softmax (≤ 6 chained reductions), the mean over N examples the longest.
    close = functools.partial(assert_rounding_close, terms=N, depth=6)
    close(est.loss, loss)
    for g, want in zip(jax.tree.leaves(est.grads), jax.tree.leaves(grads)):
      close(g, want)
    assert est.loss.dtype == dtype and est.weights.shape == (3,)

    # The statistics are those of the first 3 examples alone.
    sliced = jax.tree.map(lambda x: x[:3], batch)
    alone = jax.jit(kfl.value_grad_and_stats(
        plain_loss, params, sliced, estimation=estimation))(params, sliced, key)
    for s, want in zip(jax.tree.leaves(block_stats(est.stats)),
                       jax.tree.leaves(block_stats(alone.stats))):
      close(s, want)
    # The run entry (health's loss without loss=) is the whole batch's.
    close(est.stats["~run"]["loss"], loss)
    full = jax.jit(kfl.value_grad_and_stats(
        plain_loss, params, batch, estimation=estimation))(params, batch, key)
    assert not np.allclose(flat(est.stats), flat(full.stats), rtol=1e-3)

    # Same statistics => same state and same update as batch=.
    update = jax.jit(tx.update)
    state = tx.init(params)
    u_batch, s_batch = update(grads, state, params, batch=batch)
    u_stats, s_stats = update(est.grads, state, params, stats=est.stats)
    for s, want in zip(jax.tree.leaves(s_stats.blocks),
                       jax.tree.leaves(s_batch.blocks)):
      close(s, want)
    # The updates solve with the damped curvature: κ amplifies the rest.
    kappa = kron_cond_bound(est.stats, 1e-2)
    for u, want in zip(jax.tree.leaves(u_stats), jax.tree.leaves(u_batch)):
      close(u, want, cond=kappa)
    assert all(x.dtype == dtype for x in jax.tree.leaves(u_stats))
    # And it is preconditioned: not the gradient.
    assert not np.allclose(flat(u_stats), flat(grads), rtol=1e-2)


def test_stats_fraction_with_aux_and_errors():
  params, batch = init_params(), make_batch()
  est_fn = kfl.value_grad_and_stats(loss_fn, params, batch, has_aux=True,
                                    stats_fraction=0.5)
  est = jax.jit(est_fn)(params, batch, jax.random.PRNGKey(0))  # One compile.
  (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
  np.testing.assert_allclose(est.loss, loss, rtol=1e-6)
  np.testing.assert_allclose(est.aux["logits"], aux["logits"], rtol=1e-6)
  assert est.aux["logits"].shape == (N, SIZES[-1])
  np.testing.assert_allclose(flat(est.grads), flat(grads), rtol=1e-5,
                             atol=1e-7)
  with pytest.raises(ValueError, match=r"stats_fraction must be in \(0, 1\]"):
    kfl.value_grad_and_stats(plain_loss, params, batch, stats_fraction=1.5)
  with pytest.raises(ValueError, match=r"stats_fraction=0.1 leaves 1 example"):
    kfl.value_grad_and_stats(plain_loss, params, batch, stats_fraction=0.1)
  small = jax.tree.map(lambda x: x[:2], batch)
  with pytest.raises(ValueError, match=r"leaves 1 example"):  # At call time.
    est_fn(params, small, jax.random.PRNGKey(0))


def test_stats_of_other_blocks_are_refused_naming_the_layer_and_fix():
  """An estimate made without the transform's ``blocks=`` (or ``exclude=``)
  has statistics of other shapes, or none for a layer: a ``ValueError``
  naming the layer and the fix, at the first update (not a factor's shape
  error, not a KeyError)."""
  params, batch = init_params(), make_batch()
  key = jax.random.PRNGKey(0)
  # Jitted: one compile each instead of hundreds of eager operations'.
  est = jax.jit(kfl.value_grad_and_stats(plain_loss, params, batch))(
      params, batch, key)
  fewer = jax.jit(kfl.value_grad_and_stats(plain_loss, params, batch,
                                           exclude=["1/*"]))(params, batch, key)
  for tx, stats, match in (
      (kfl.kfac(plain_loss, batch, blocks={"1/*": "diagonal"}), est.stats,
       r"statistics of layer '1[^']*' do not fit its block"),
      (kfl.kfac(plain_loss, batch), fewer.stats,
       r"no statistics for layer '1")):
    with pytest.raises(ValueError, match=match) as info:
      tx.update(est.grads, tx.init(params), params, stats=stats)
    assert "same blocks=" in str(info.value)


def dropout_loss(params, batch):
  """``loss_fn`` with dropout on the hidden layer, its key in the batch."""
  h = jnp.tanh(batch["x"] @ params[0]["w"] + params[0]["b"])
  keep = jax.random.bernoulli(batch["dropout_key"], 0.7, h.shape)
  h = jnp.where(keep, h / 0.7, 0.0)
  logits = h @ params[1]["w"] + params[1]["b"]
  return kfl.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]).mean()


def test_stats_fraction_keeps_a_dropout_key_in_the_batch():
  # The key is a batch leaf of leading size 2 that is not examples: the
  # statistics' pass takes the first half of x and y and the same key (the
  # model's mask is then drawn for 6 examples from it), as a batch cut by
  # hand does; before, every leaf was cut and the key refused.
  with x64_mode(True):
    params = init_params(jnp.float64)
    batch = {**make_batch(jnp.float64),
             "dropout_key": jax.random.PRNGKey(3)}
    half = {"x": batch["x"][:N // 2], "y": batch["y"][:N // 2],
            "dropout_key": batch["dropout_key"]}
    key = jax.random.split(jax.random.PRNGKey(5))[1]  # kfac's stats key.

    est = jax.jit(kfl.value_grad_and_stats(
        dropout_loss, params, batch, stats_fraction=0.5))(params, batch, key)
    alone = jax.jit(kfl.value_grad_and_stats(
        dropout_loss, params, half))(params, half, key)
    assert est.weights.shape == (N // 2,)
    for s, want in zip(jax.tree.leaves(block_stats(est.stats)),
                       jax.tree.leaves(block_stats(alone.stats))):
      np.testing.assert_allclose(s, want, rtol=1e-12, atol=1e-15)
    # The loss and gradient are the whole batch's, with the key.
    loss, grads = jax.value_and_grad(dropout_loss)(params, batch)
    np.testing.assert_allclose(est.loss, loss, rtol=1e-12)
    np.testing.assert_allclose(est.stats["~run"]["loss"], loss, rtol=1e-12)

    tx = kfl.kfac(dropout_loss, batch, stats_fraction=0.5, seed=5)
    tx_half = kfl.kfac(dropout_loss, half, seed=5)
    _, state = jax.jit(tx.update)(grads, tx.init(params), params, batch=batch)
    _, want = jax.jit(tx_half.update)(grads, tx_half.init(params), params,
                                      batch=half)
    for s, w in zip(jax.tree.leaves(state.blocks), jax.tree.leaves(want.blocks)):
      np.testing.assert_allclose(s, w, rtol=1e-12, atol=1e-15)
    full = kfl.kfac(dropout_loss, batch, seed=5)
    _, other = jax.jit(full.update)(grads, full.init(params), params,
                                    batch=batch)
    assert not np.allclose(flat(state.blocks), flat(other.blocks), rtol=1e-3)


def _conditionals(tx, params, batch):
  state = tx.init(params)
  grads = jax.grad(plain_loss)(params, batch)
  text = jax.jit(lambda g, s, p, b: tx.update(g, s, p, batch=b)).lower(
      grads, state, params, batch).as_text()
  return text.count("stablehlo.case") + text.count("stablehlo.if")


def test_update_has_one_conditional_for_all_refreshes():
  """One ``lax.cond`` gates every block's refresh (and returns only the
  caches); ``cov_every > 1`` adds the one of the statistics."""
  params, batch = init_params(), make_batch()
  deeper = init_params() + [{"w": jnp.eye(SIZES[-1]), "b": jnp.zeros(SIZES[-1])}]
  every = kfl.kfac(plain_loss, batch, cov_every=1)
  assert _conditionals(every, params, batch) == 1
  assert _conditionals(every, deeper, batch) == 1
  assert _conditionals(kfl.kfac(plain_loss, batch, cov_every=2),
                       params, batch) == 2
