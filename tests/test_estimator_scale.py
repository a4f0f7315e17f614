"""The estimators' scale, pinned by a property (Monte Carlo, float64).

For targets drawn from the registered loss's own distribution, the
average of ``"empirical"`` (the drawn targets given as the batch's) and of
``"fisher"`` (its own sampled targets, one key per draw) equals
``"exact"``, whatever the loss reduces over: one label per example,
per-token cross-entropy over T > 1 tokens (with and without a mask),
squared error over C outputs (mean, and sum), sigmoid BCE over pixels.
Every statistic of every block is checked entrywise: a conv and a dense
layer shared over T positions (K-FAC ``"expand"`` and ``"reduce"``, and
EKFAC's scalings), and a fallback parameter (whose ``"empirical"`` and
``"exact"`` statistics come from per-example gradients). The tolerance
is 5 Monte Carlo standard errors, estimated from the draws.

The targets are drawn here from the distributions' definitions, not with
the library's samplers.
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax_lite as kfl

from _helpers import x64_mode

N, T, C_IN, H, K = 6, 4, 2, 4, 3
DRAWS = 200
MODES = ("exact", "fisher", "empirical")


def net(p, x):
  """``[N, T, C_IN]`` -> ``[N, T, K]``: a conv (SAME, width 2, bias), tanh,
  a fallback shift ``sin(odd)``, a dense layer (bias) at every position."""
  y = jax.lax.conv_general_dilated(
      x, p["conv"], (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"))
  h = jnp.tanh(y + p["conv_b"]) + jnp.sin(p["odd"])
  return h @ p["dense"] + p["dense_b"]


def _categorical(key, logits):
  return jax.random.categorical(key, logits, axis=-1)


def _normal_half(key, mean):  # squared_error: a Normal of variance 1/2.
  return mean + math.sqrt(0.5) * jax.random.normal(key, mean.shape, mean.dtype)


# name -> (loss(outputs, batch), draw(key, outputs, batch) -> batch).
LOSSES = {
    "classification": (
        lambda o, b: kfl.softmax_cross_entropy_with_integer_labels(
            o.mean(1), b["y"]).mean(),
        lambda k, o, b: dict(b, y=_categorical(k, o.mean(1)))),
    "tokens": (
        lambda o, b: kfl.softmax_cross_entropy_with_integer_labels(
            o, b["yt"]).mean(),
        lambda k, o, b: dict(b, yt=_categorical(k, o))),
    "masked_tokens": (
        lambda o, b: (kfl.softmax_cross_entropy_with_integer_labels(
            o, b["yt"]) * b["mask"]).sum() / b["mask"].sum(),
        lambda k, o, b: dict(b, yt=_categorical(k, o))),
    "squared_mean": (
        lambda o, b: kfl.squared_error(o.mean(1), b["t"]).mean(),
        lambda k, o, b: dict(b, t=_normal_half(k, o.mean(1)))),
    "squared_sum": (
        lambda o, b: kfl.squared_error(o.mean(1), b["t"]).sum(),
        lambda k, o, b: dict(b, t=_normal_half(k, o.mean(1)))),
    "bce_pixels": (
        lambda o, b: kfl.sigmoid_binary_cross_entropy(o, b["px"]).mean(),
        lambda k, o, b: dict(b, px=jax.random.bernoulli(
            k, jax.nn.sigmoid(o)).astype(o.dtype))),
}


def _data():
  rng = np.random.default_rng(0)
  f = lambda *s: jnp.asarray(rng.standard_normal(s))
  params = {"conv": 0.8 * f(2, C_IN, H), "conv_b": 0.3 * f(H),
            "odd": f(H), "dense": f(H, K), "dense_b": 0.3 * f(K)}
  mask = np.ones((N, T))
  mask[0] = 0  # A weightless example,
  mask[1, 2:] = 0  # and one with half its tokens.
  batch = {"x": f(N, T, C_IN), "y": jnp.asarray(rng.integers(0, K, N)),
           "yt": jnp.asarray(rng.integers(0, K, (N, T))),
           "mask": jnp.asarray(mask), "t": f(N, K),
           "px": jnp.asarray(rng.integers(0, 2, (N, T, K)), jnp.float64)}
  return params, batch


def _ekfac_states(fn, params, batch):
  """A state per block with an eigenbasis (EKFAC's scalings are measured
  in it): the exact statistics, accumulated and refreshed."""
  layers = fn.tagged.layers
  states = {l.name: l.block.init(jnp.float64) for l in layers}
  stats = jax.jit(fn)(params, batch, jax.random.PRNGKey(0), states).stats
  return {l.name: l.block.refresh(
      l.block.update(states[l.name], stats[l.name], 0.0), 1e-3)
          for l in layers}


@functools.lru_cache(maxsize=None)
def _run(loss_name, weight_sharing, ekfac):
  """Every block's statistics: ``"exact"``'s, and ``DRAWS`` draws of
  ``"fisher"`` and ``"empirical"``'s (leading axis), from one jitted
  program (float64; call inside ``x64_mode(True)``)."""
  loss, draw = LOSSES[loss_name]
  loss_fn = lambda p, b: loss(net(p, b["x"]), b)
  params, batch = _data()
  blocks = {"dense": "ekfac", "conv": "ekfac"} if ekfac else None
  fns = {m: kfl.value_grad_and_stats(loss_fn, params, batch, estimation=m,
                                     weight_sharing=weight_sharing,
                                     blocks=blocks) for m in MODES}
  kinds = sorted(l.kind for l in fns["exact"].tagged.layers)
  assert kinds == ["conv", "dense", "fallback"], kinds
  states = _ekfac_states(fns["exact"], params, batch) if ekfac else None

  @jax.jit
  def run(params, batch, states, key):
    k_fisher, k_targets = jax.random.split(key)
    exact = fns["exact"](params, batch, key, states).stats
    fisher = jax.vmap(lambda k: fns["fisher"](params, batch, k, states).stats)(
        jax.random.split(k_fisher, DRAWS))
    o = net(params, batch["x"])
    empirical = jax.vmap(lambda k: fns["empirical"](
        params, draw(k, o, batch), k, states).stats)(
            jax.random.split(k_targets, DRAWS))
    return exact, {"fisher": fisher, "empirical": empirical}
  return jax.tree.map(np.asarray, run(params, batch, states,
                                      jax.random.PRNGKey(1)))


CASES = [(name, ws, False) for name in LOSSES for ws in ("expand", "reduce")]
CASES += [("masked_tokens", ws, True) for ws in ("expand", "reduce")]


@pytest.mark.parametrize("loss_name,weight_sharing,ekfac", CASES)
def test_mean_of_empirical_and_fisher_over_model_targets_is_exact(
    loss_name, weight_sharing, ekfac):
  with x64_mode(True):
    exact, drawn = _run(loss_name, weight_sharing, ekfac)
  exact = kfl.estimators.split_run(exact)[0]  # The loss is no statistic.
  for mode, stats in drawn.items():
    for name in exact:
      for want, draws in zip(jax.tree.leaves(exact[name]),
                             jax.tree.leaves(stats[name])):
        if want.dtype.kind != "f":
          continue  # Counters and cache bookkeeping.
        mean = draws.mean(0)
        se = draws.std(0, ddof=1) / math.sqrt(DRAWS)
        # float64 rounding of the statistics' sums (~10³ terms × 2.2e-16),
        # with margin: where a statistic does not depend on the targets
        # (the input factors) se is 0.
        floor = 1e-11 * max(np.abs(want).max(), 1e-300)
        z = np.abs(mean - want) / (se + floor)
        assert z.max() < 5, (mode, name, float(z.max()),
                             float(np.sum(mean * want) / np.sum(want * want)))
