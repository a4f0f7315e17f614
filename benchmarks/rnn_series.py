"""Steps to a target loss of a character LSTM with the RNN series blocks.

    python benchmarks/rnn_series.py            # hidden 64, context 32, batch 32, 300 steps
    python benchmarks/rnn_series.py --quick    # hidden 16, context 12, batch 8, 30 steps

Evidence for issue 11 §1 (not a test): how the three curvature blocks of
Martens, Ba & Johnson (2018) for the LSTM's recurrent dense layers train
per step. The corpus is the Python documentation shipped with CPython
(``_data.load_text``: ``pydoc_data.topics``; the first 90% trains, the
last 10% validates). The model: a character embedding, one LSTM layer in
plain JAX (``lax.scan`` over time; the gates ``x_t W_x + h_{t-1} W_h + b``,
``W_x`` and ``W_h`` scan constants, so each is one dense layer applied at
every step) and a dense read-out of every step; softmax cross-entropy of
the next character, averaged over all positions.

Runs (same batches, same initial parameters, same learning rate for the
three K-FAC runs): ``kfl.kfac(loss_fn, batch, blocks={"lstm/w*": option},
damping=...)`` chained with ``optax.sgd(lr, momentum=0.9)`` for option in
``kron_indep`` (the steps independent: the default block), ``series1``
and ``series2``; and Adam at ``--adam-lr`` for reference. The other layers
keep their default blocks. The runs are stepped round-robin in one process
so that their step times see the same machine load.

Printed: per run, the steps to the target validation loss (evaluated every
``--eval-every`` steps on fixed windows; the target defaults to Adam's
final loss), the final validation loss, and the median step time (the
first, compiling step left out) with its ratio to ``kron_indep``'s.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
try:
  import kfac_jax_lite as kfl
except ImportError:  # Run from a checkout without installing.
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                  "..", "src"))
  import kfac_jax_lite as kfl

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import _data  # noqa: E402

FULL = dict(hidden=64, embed=16, context=32, batch=32, steps=300)
QUICK = dict(hidden=16, embed=8, context=12, batch=8, steps=30)
OPTIONS = ("kron_indep", "series1", "series2")


def init_params(vocab, embed, hidden, key):
  k = jax.random.split(key, 4)
  g = 4 * hidden
  return {
      "embed": jax.random.normal(k[0], (vocab, embed)) * 0.3,
      "lstm": {"wx": jax.random.normal(k[1], (embed, g)) / np.sqrt(embed),
               "wh": jax.random.normal(k[2], (hidden, g)) / np.sqrt(hidden),
               # Forget-gate bias 1 (Jozefowicz et al. 2015).
               "b": jnp.zeros((g,)).at[hidden:2 * hidden].set(1.0)},
      "out": {"w": jax.random.normal(k[3], (hidden, vocab)) / np.sqrt(hidden),
              "b": jnp.zeros((vocab,))},
  }


def logits(params, tokens):
  """``tokens [B, T]`` -> ``[B, T, vocab]``."""
  x = params["embed"][tokens]
  p = params["lstm"]
  hidden = p["wh"].shape[0]

  def cell(carry, x_t):
    h, c = carry
    z = x_t @ p["wx"] + h @ p["wh"] + p["b"]
    i, f, o, u = jnp.split(z, 4, axis=-1)
    c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(u)
    h = jax.nn.sigmoid(o) * jnp.tanh(c)
    return (h, c), h

  zeros = jnp.zeros((tokens.shape[0], hidden), x.dtype)
  _, hs = jax.lax.scan(cell, (zeros, zeros), jnp.swapaxes(x, 0, 1))
  return jnp.swapaxes(hs, 0, 1) @ params["out"]["w"] + params["out"]["b"]


def loss_fn(params, batch):
  out = logits(params, batch["x"])
  return kfl.softmax_cross_entropy_with_integer_labels(out, batch["y"]).mean()


def make_step(tx):
  @jax.jit
  def step(params, state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params, batch=batch)
    return optax.apply_updates(params, updates), state, loss
  return step


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--quick", action="store_true")
  for name, value in FULL.items():
    p.add_argument(f"--{name}", type=int, default=None,
                   help=f"default {value} (quick: {QUICK[name]})")
  p.add_argument("--lr", type=float, default=0.1,
                 help="SGD-momentum learning rate of the K-FAC runs")
  p.add_argument("--damping", type=float, default=1e-2)
  p.add_argument("--adam-lr", type=float, default=1e-2)
  p.add_argument("--target", type=float, default=None,
                 help="target validation loss (default: Adam's final)")
  p.add_argument("--eval-every", type=int, default=None,
                 help="default steps // 30 (at least 1)")
  p.add_argument("--max-chars", type=int, default=None,
                 help="first characters of the corpus (quick: 20000)")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  sizes = {k: getattr(args, k) or (QUICK if args.quick else FULL)[k]
           for k in FULL}
  every = args.eval_every or max(1, sizes["steps"] // 30)
  text = _data.load_text(args.max_chars or (20000 if args.quick else None))
  t, n = sizes["context"], sizes["batch"]
  starts = np.linspace(0, len(text.valid) - t - 1, 64).astype(np.int64)
  valid = np.stack([text.valid[s:s + t + 1] for s in starts])
  valid = {"x": jnp.asarray(valid[:, :-1]), "y": jnp.asarray(valid[:, 1:])}
  rng = np.random.default_rng(args.seed + 1)

  def batch():
    s = rng.integers(0, len(text.train) - t - 1, n)
    w = np.stack([text.train[i:i + t + 1] for i in s])
    return {"x": jnp.asarray(w[:, :-1]), "y": jnp.asarray(w[:, 1:])}

  params = init_params(len(text.vocab), sizes["embed"], sizes["hidden"],
                       jax.random.PRNGKey(args.seed))
  example = batch()
  print(f"data: {text.source}")
  print(f"model: char LSTM, embed {sizes['embed']}, hidden {sizes['hidden']}, "
        f"context {t}, vocab {len(text.vocab)} "
        f"({sum(x.size for x in jax.tree.leaves(params))} parameters); "
        f"batch {n}, {sizes['steps']} steps; jax {jax.__version__} on "
        f"{jax.default_backend()}")
  print(f"K-FAC runs: kfl.kfac(damping={args.damping}, blocks={{'lstm/w*': "
        f"option}}) + sgd({args.lr}, momentum=0.9); Adam lr {args.adam_lr}")
  runs = {o: optax.chain(kfl.kfac(loss_fn, example, damping=args.damping,
                                  blocks={"lstm/w*": o}),
                         optax.sgd(args.lr, momentum=0.9)) for o in OPTIONS}
  runs["adam"] = optax.adam(args.adam_lr)
  print(kfl.describe(loss_fn, params, example,
                     blocks={"lstm/w*": "series2"}))
  evaluate = jax.jit(lambda p: loss_fn(p, valid))
  steps = {k: make_step(tx) for k, tx in runs.items()}
  state = {k: (params, tx.init(params)) for k, tx in runs.items()}
  times = {k: [] for k in runs}
  curves = {k: [] for k in runs}
  for i in range(sizes["steps"]):
    b = batch()
    for k in runs:  # Round-robin: the same load for every run.
      start = time.perf_counter()
      out = jax.block_until_ready(steps[k](*state[k], b))
      times[k].append(time.perf_counter() - start)
      state[k] = out[:2]
      if (i + 1) % every == 0 or i + 1 == sizes["steps"]:
        curves[k].append((i + 1, float(evaluate(out[0]))))
  target = args.target if args.target is not None else curves["adam"][-1][1]
  base = statistics.median(times["kron_indep"][1:])
  print(f"\ntarget validation loss {target:.4f}"
        f"{' (Adam final)' if args.target is None else ''}; evaluated every "
        f"{every} steps")
  print(f"{'run':<12} {'steps to target':>15} {'final val loss':>14} "
        f"{'median step ms':>14} {'x kron_indep':>12}")
  for k in runs:
    reached = next((s for s, v in curves[k] if v <= target), None)
    med = statistics.median(times[k][1:])
    print(f"{k:<12} {reached if reached else '-':>15} "
          f"{curves[k][-1][1]:>14.4f} {1e3 * med:>14.2f} {med / base:>12.2f}")
  health = {k: str(kfl.health(state[k][1])) for k in OPTIONS}
  for k, h in health.items():
    print(f"{k}: {h}")
  return curves, times


if __name__ == "__main__":
  main()
