"""Compile time against depth for unscanned transformers (issue 47.4).

    python benchmarks/compile_depth.py                 # depths 6, 12, 24
    python benchmarks/compile_depth.py --depths 2,6

Lowers and compiles (``jax.jit(step).lower(...).compile()``, nothing run)
the step of AdamW and the README's one-pass K-FAC + SGD step
(``with_stats=kfl.stats_due(state)``) for ``sizes.py``'s Flax linen
decoder with its blocks unscanned (a Python loop: every block its own
layers, as most models are written), at width 128, 4 heads, vocabulary
512, context 32, batch 4, at each depth. Prints the seconds of tracing
and lowering and of XLA's compile, K-FAC's compile against AdamW's at
the same depth and against K-FAC's at the first depth (issue 47.4's goal:
the 24-block model's compile at most 1.2x the 6-block one's), and the
compiled program's size. Compile times vary from run to run by ~10%.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _kfl import kfl  # noqa: E402


def problem(depth):
  """``(loss_fn, params, batch)`` of the unscanned decoder."""
  import jax
  import optax
  from sizes import Decoder
  model = Decoder(512, 128, depth, 4, 32)
  ids = jax.random.randint(jax.random.PRNGKey(0), (4, 33), 0, 512)
  batch = {"ids": ids[:, :-1], "y": ids[:, 1:]}
  params = jax.jit(model.init)(jax.random.PRNGKey(1), batch["ids"])

  def loss_fn(p, b):
    return optax.softmax_cross_entropy_with_integer_labels(
        model.apply(p, b["ids"]), b["y"]).mean()
  return loss_fn, params, batch


def compile_time(loss_fn, params, batch, which):
  """``(seconds to trace and lower, seconds to compile, HLO characters)``
  of ``which`` (``"adamw"`` or ``"kfac"``)'s step."""
  import jax
  import optax
  key = jax.random.PRNGKey(2)
  if which == "adamw":
    tx = optax.adamw(1e-3)

    def step(p, s, b, k):
      g = jax.grad(loss_fn)(p, b)
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s
  else:
    est = kfl.value_grad_and_stats(loss_fn, params, batch)
    tx = optax.chain(kfl.kfac(loss_fn, batch), optax.sgd(0.01, momentum=0.9))

    def step(p, s, b, k):
      e = est(p, b, k, with_stats=kfl.stats_due(s))
      u, s = tx.update(e.grads, s, p, stats=e.stats)
      return optax.apply_updates(p, u), s
  args = (params, tx.init(params), batch, key)
  t0 = time.perf_counter()
  lowered = jax.jit(step).lower(*args)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  return t1 - t0, t2 - t1, len(compiled.as_text())


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--depths", default="6,12,24",
                 help="comma-separated block counts (default 6,12,24)")
  args = p.parse_args(argv)
  import jax
  depths = [int(d) for d in args.depths.split(",")]
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; unscanned "
        f"Flax linen decoder, width 128, 4 heads, vocabulary 512, context "
        f"32, batch 4")
  print(f"{'depth':>5s} {'step':8s} {'trace+lower s':>13s} {'compile s':>10s} "
        f"{'x AdamW':>8s} {'x first depth':>14s} {'HLO kchars':>11s}")
  first = None
  for depth in depths:
    prob = problem(depth)
    adamw = None
    for which in ("adamw", "kfac"):
      lower, comp, chars = compile_time(*prob, which)
      if which == "adamw":
        adamw = comp
        vs_adamw, vs_first = "-", "-"
      else:
        first = first or comp
        vs_adamw, vs_first = f"{comp / adamw:.1f}x", f"{comp / first:.2f}x"
      print(f"{depth:5d} {which:8s} {lower:13.1f} {comp:10.1f} "
            f"{vs_adamw:>8s} {vs_first:>14s} {chars / 1e3:11.0f}",
            flush=True)


if __name__ == "__main__":
  main()
