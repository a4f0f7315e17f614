"""The estimators' scale, by Monte Carlo: E[empirical] and E[fisher] over
targets drawn from the model, each against ``"exact"``.

    PYTHONPATH=src python benchmarks/estimator_scale.py [--draws 300]

The convention (``kfl.estimators``, README "Conventions"): ``"empirical"``
is ``"fisher"`` with the data's targets in place of sampled ones, so its
average over targets drawn from the registered loss's own distribution is
the exact Fisher of the loss as written, whatever it reduces over. This
script measures that, in float64, for every registered loss and the
reductions a user writes: one loss element per example, per-token
cross-entropy over ``T`` tokens (with and without a mask), squared error
over ``C`` outputs (mean, and sum then mean over examples), ``l2_loss``
and a Gaussian NLL over outputs, sigmoid BCE over pixels.

The model: inputs ``[N, T, 2]``, a width-2 ``SAME`` convolution (bias) to
4 channels, tanh, then a dense layer with bias to ``K = 3`` outputs at
each of the ``T = 4`` positions (weight sharing: K-FAC ``"expand"`` and
``"reduce"``). Per loss, weight sharing and layer (the conv and the dense
block) the table gives the ratio ``r = ⟨Ḡ, G_exact⟩ / ⟨G_exact, G_exact⟩``
of the output factor ``G`` averaged over the draws (``D`` target draws for
``"empirical"``, ``D`` sampling keys for ``"fisher"``) to the exact one,
with its Monte Carlo standard error (the draws' standard deviation of the
per-draw ratio over ``√D``). ``k`` is the number of loss elements per
example. The input factors ``A`` do not depend on the mode.
"""
from __future__ import annotations

import argparse
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

import kfac_jax_lite as kfl

N, T, C_IN, H, K = 8, 4, 2, 4, 3
WEIGHT_SHARING = ("expand", "reduce")


def net(p, x):
  """``[N, T, C_IN]`` -> ``[N, T, K]``: conv (SAME, width 2), tanh, dense."""
  y = jax.lax.conv_general_dilated(
      x, p["conv"], (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"))
  h = jnp.tanh(y + p["conv_b"])
  return h @ p["dense"] + p["dense_b"]


def _gaussian_params(o):
  return o[..., 0], jax.nn.softplus(o[..., 1]) + 0.1


# name -> (loss(o, batch), draw(key, o, batch) -> batch with drawn targets,
#          elements per example k). The draws are written here, from the
# distributions' definitions, not with the library's samplers.
def _cat(key, logits):
  return jax.random.categorical(key, logits, axis=-1)


def _normal(key, mean, var):
  return mean + jnp.sqrt(var) * jax.random.normal(key, mean.shape, mean.dtype)


LOSSES = {
    "CE, one label per example": (
        lambda o, b: kfl.softmax_cross_entropy_with_integer_labels(
            o.mean(1), b["y"]).mean(),
        lambda k, o, b: dict(b, y=_cat(k, o.mean(1))), 1),
    "CE per token, mean over N·T": (
        lambda o, b: kfl.softmax_cross_entropy(
            o, jax.nn.one_hot(b["yt"], K, dtype=o.dtype)).mean(),
        lambda k, o, b: dict(b, yt=_cat(k, o)), T),
    "CE per token, masked mean": (
        lambda o, b: (kfl.softmax_cross_entropy_with_integer_labels(
            o, b["yt"]) * b["mask"]).sum() / b["mask"].sum(),
        lambda k, o, b: dict(b, yt=_cat(k, o)), T),
    "squared_error, mean over N·C": (
        lambda o, b: kfl.squared_error(o.mean(1), b["t"]).mean(),
        lambda k, o, b: dict(b, t=_normal(k, o.mean(1), 0.5)), K),
    "squared_error, sum over C, mean over N": (
        lambda o, b: kfl.squared_error(o.mean(1), b["t"]).sum(-1).mean(),
        lambda k, o, b: dict(b, t=_normal(k, o.mean(1), 0.5)), K),
    "l2_loss, sum over C, sum over N": (
        lambda o, b: kfl.l2_loss(o.mean(1), b["t"]).sum(),
        lambda k, o, b: dict(b, t=_normal(k, o.mean(1), 1.0)), K),
    "gaussian_nll per token, mean": (
        lambda o, b: kfl.gaussian_nll(*_gaussian_params(o), b["tt"]).mean(),
        lambda k, o, b: dict(b, tt=_normal(k, *_gaussian_params(o))), T),
    "sigmoid BCE over T·K pixels, mean": (
        lambda o, b: kfl.sigmoid_binary_cross_entropy(o, b["px"]).mean(),
        lambda k, o, b: dict(b, px=jax.random.bernoulli(
            k, jax.nn.sigmoid(o)).astype(o.dtype)), T * K),
}


def data(seed=0):
  """Parameters and a batch in float64 (call under ``jax_enable_x64``)."""
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.standard_normal(s))
  params = {"conv": 0.8 * f(2, C_IN, H), "conv_b": 0.3 * f(H),
            "dense": f(H, K), "dense_b": 0.3 * f(K)}
  mask = np.ones((N, T))
  mask[0] = 0  # A weightless example,
  mask[1, 2:] = 0  # and one with half its tokens masked.
  batch = {"x": f(N, T, C_IN), "y": jnp.asarray(rng.integers(0, K, N)),
           "yt": jnp.asarray(rng.integers(0, K, (N, T))),
           "mask": jnp.asarray(mask), "t": f(N, K), "tt": f(N, T),
           "px": jnp.asarray(rng.integers(0, 2, (N, T, K)), jnp.float64)}
  return params, batch


@functools.lru_cache(maxsize=None)
def draws_fn(name, weight_sharing, draws):
  """``fn(params, batch, key) -> {mode: {layer: G}}``: the exact ``G``
  ``[b, b]`` and the ``[D, b, b]`` per-draw ``G`` of ``"fisher"`` (one
  sampling key per draw) and ``"empirical"`` (one target draw per draw),
  in one jitted program."""
  loss, draw, _ = LOSSES[name]
  loss_fn = lambda p, b: loss(net(p, b["x"]), b)
  params, batch = data()
  est = {mode: kfl.value_grad_and_stats(loss_fn, params, batch,
                                        estimation=mode,
                                        weight_sharing=weight_sharing)
         for mode in ("exact", "fisher", "empirical")}

  def g_of(stats):
    return {k: v.g[0] for k, v in stats.items() if k in ("conv", "dense")}

  @jax.jit
  def fn(params, batch, key):
    k_fisher, k_targets = jax.random.split(key)
    exact = g_of(est["exact"](params, batch, key).stats)
    fisher = jax.vmap(lambda k: g_of(est["fisher"](params, batch, k).stats))(
        jax.random.split(k_fisher, draws))
    o = net(params, batch["x"])
    empirical = jax.vmap(lambda k: g_of(est["empirical"](
        params, draw(k, o, batch), k).stats))(jax.random.split(k_targets, draws))
    return {"exact": exact, "fisher": fisher, "empirical": empirical}
  return fn


def ratio(per_draw, exact):
  """``(r, se)``: the projection of the mean ``G`` on the exact one, and
  its Monte Carlo standard error from the draws."""
  per_draw, exact = np.asarray(per_draw), np.asarray(exact)
  r = np.einsum("dij,ij->d", per_draw, exact) / np.sum(exact * exact)
  return r.mean(), r.std(ddof=1) / math.sqrt(len(r))


def table(draws=300, seed=0, names=None):
  """Rows ``(loss, k, weight sharing, layer, mode, r, se)`` for the losses
  ``names`` (default: all of ``LOSSES``)."""
  rows = []
  with jax.enable_x64(True):
    params, batch = data()
    for name, (_, _, k) in LOSSES.items():
      if names is not None and name not in names:
        continue
      for ws in WEIGHT_SHARING:
        out = draws_fn(name, ws, draws)(params, batch,
                                         jax.random.PRNGKey(seed))
        for layer in ("conv", "dense"):
          for mode in ("empirical", "fisher"):
            r, se = ratio(out[mode][layer], out["exact"][layer])
            rows.append((name, k, ws, layer, mode, r, se))
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--draws", type=int, default=300)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  print(f"jax {jax.__version__}, {jax.devices()[0].platform}, float64; "
        f"N={N}, T={T}, K={K}; {args.draws} draws per mode; ratio of E[G] "
        "to exact G (± Monte Carlo standard error)")
  rows = table(args.draws, args.seed)
  head = (f"{'loss':<40} {'k':>2}  {'sharing':<7} "
          f"{'conv: empirical':>17} {'fisher':>17} "
          f"{'dense: empirical':>17} {'fisher':>17}")
  print(head)
  print("-" * len(head))
  by = {}
  for name, k, ws, layer, mode, r, se in rows:
    by.setdefault((name, k, ws), {})[(layer, mode)] = f"{r:.3f} ± {se:.3f}"
  for (name, k, ws), cells in by.items():
    print(f"{name:<40} {k:>2}  {ws:<7} " + " ".join(
        f"{cells[(layer, mode)]:>17}" for layer in ("conv", "dense")
        for mode in ("empirical", "fisher")))


if __name__ == "__main__":
  main()
