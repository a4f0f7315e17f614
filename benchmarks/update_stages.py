"""Where a K-FAC step's time and compiled code go, stage by stage.

    python benchmarks/update_stages.py            # the MNIST autoencoder, batch 1000
    python benchmarks/update_stages.py --quick    # 784-256-64-256-784

Each stage of ``kfl.kfac``'s ``update`` (``transform``: ``statistics``
via ``kfl.value_grad_and_stats``, ``accumulate``, ``precondition``,
``clip``, ``guard``, the counters' ``all_finite(params)``) and the whole
update (stats given, a step without a refresh) and one-pass step are
jitted on their own; per stage the table gives the optimised program's
fusion count (XLA:CPU compiles one kernel per distinct fusion), its XLA
compile seconds and its median run time (round-robin, ``--reps``). The
last lines count the copies in the whole update's optimised HLO, the
n×n ones (the curvature state moved, not computed) listed by shape.
Random data: step time does not depend on the values.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _models as M  # noqa: E402
import _timing as T  # noqa: E402
from _harness import kfl  # noqa: E402
from kfac_jax_lite import factor as fac  # noqa: E402
from kfac_jax_lite.optimizers import transform  # noqa: E402

loss_fn = M.autoencoder_loss  # The autoencoder's loss, as step_time.py's.


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--quick", action="store_true")
  p.add_argument("--batch", type=int, default=1000)
  p.add_argument("--reps", type=int, default=7,
                 help="timed runs per stage (0: fusion counts only)")
  p.add_argument("--dump", default=None,
                 help="a folder to write each stage's optimised HLO to")
  p.add_argument("--only", default=None,
                 help="run only the stages whose name contains this")
  args = p.parse_args(argv)
  dims = M.AUTOENCODER_SMALL if args.quick else M.AUTOENCODER
  params, batch = M.random_problem(dims, args.batch)
  key = jax.random.PRNGKey(0)
  est_fn = kfl.value_grad_and_stats(loss_fn, params, batch)
  kfac, layers_of = transform.kfac_with_layers(loss_fn, batch, damping=1.0,
                                              inverse_every=10)
  tx = optax.chain(kfac, optax.sgd(0.01, momentum=0.9))
  layers = layers_of(params).layers
  est = jax.jit(est_fn)(params, batch, key)
  state = tx.init(params)
  state = jax.jit(lambda g, s, p, st: tx.update(g, s, p, stats=st))(
      est.grads, state, params, est.stats)[1]
  kstate = state[0]._replace(count=jnp.asarray(5, jnp.int32))  # No refresh.
  state = (kstate,) + tuple(state[1:])
  blocks = kstate.blocks
  leaves = jax.tree.leaves(est.grads)
  lam = jnp.float32(1.0)
  pre = transform.precondition(layers, blocks, leaves, lam, -1.0)
  ok = jnp.asarray(True)

  def clip(u, g):
    return transform.clip(u, g, 1.0, jnp.float32)

  def guard(u, g):
    return transform.guard(u, g, ok, clip(u, g))[0]

  def one_pass(p, s, k, b):
    e = est_fn(p, b, k)
    u, s = tx.update(e.grads, s, p, stats=e.stats)
    return optax.apply_updates(p, u), s

  stages = [
      ("value_grad_and_stats", lambda p, b, k: est_fn(p, b, k)._replace(
          aux=None, weights=None), (params, batch, key)),
      ("  .stats only", lambda p, b, k: est_fn(p, b, k).stats,
       (params, batch, key)),
      ("  .grads only (value_and_grad)", jax.value_and_grad(loss_fn),
       (params, batch)),
      ("accumulate (all blocks)", lambda st, s: transform.accumulate(
          layers, st, s, 0.95), (blocks, est.stats)),
      ("precondition", lambda st, g: transform.precondition(
          layers, st, g, lam, -1.0), (blocks, leaves)),
      ("clip", clip, (pre, leaves)),
      ("clip + guard", guard, (pre, leaves)),
      ("all_finite(params)", fac.all_finite, (params,)),
      ("kfac update, stats given", lambda g, s, p, st: tx.update(
          g, s, p, stats=st), (est.grads, state, params, est.stats)),
      ("one-pass step", one_pass, (params, state, key, batch)),
  ]
  if args.only:
    stages = [s for s in stages if args.only in s[0]]
  compiled, rows = [], []
  for name, fn, a in stages:
    jax.clear_caches()  # Each stage compiles as in a fresh process.
    t0 = time.perf_counter()
    c = jax.jit(fn).lower(*a).compile()
    xla = time.perf_counter() - t0
    text = c.as_text()
    compiled.append((c, a))
    rows.append([name, text.count(" fusion("), xla, text])
    if args.dump:
      os.makedirs(args.dump, exist_ok=True)
      fname = re.sub(r"\W+", "_", name.strip()).strip("_") + ".hlo.txt"
      with open(os.path.join(args.dump, fname), "w") as f:
        f.write(text)
  medians = (T.median_times([(row[0], c, a) for row, (c, a) in
                           zip(rows, compiled)], args.reps)
             if args.reps else [None] * len(rows))
  print(f"model {'-'.join(map(str, dims))}, batch {args.batch}, jax {jax.__version__}")
  print(f"  {'stage':<34}{'fusions':>8}{'compile s':>10}{'ms':>9}")
  for (name, nf, xla, _), t in zip(rows, medians):
    ms = f"{1e3 * t:>9.2f}" if t is not None else f"{'-':>9}"
    print(f"  {name:<34}{nf:>8}{xla:>10.2f}{ms}")
  for name, _, _, text in rows[-2:]:
    copies = re.findall(r"= (\w+\[[\d,]*\])\S* copy\(", text)
    big = [s for s in copies if re.match(r"\w+\[(?:\d+,)*(\d+),\1\]", s)]
    sel = re.findall(r"= (\w+\[[\d,]*\])\S* select\(", text)
    print(f"{name}: {len(copies)} copies ({len(big)} n×n: {sorted(set(big))}); "
          f"{text.count(' conditional(')} conditionals; "
          f"{len(sel)} unfused selects")


if __name__ == "__main__":
  main()
