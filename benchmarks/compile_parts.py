"""Where the K-FAC step's compile time goes (issue 36's goal: at most 2x Adam's).

    python benchmarks/compile_parts.py             # the MNIST autoencoder, batch 1000
    python benchmarks/compile_parts.py --quick     # a small autoencoder
    python benchmarks/compile_parts.py --model lm  # a scanned Flax transformer
    python benchmarks/compile_parts.py --dims 512-500-520-512 --batch 256

Lowers and compiles (``jax.jit(step).lower(...).compile()``, nothing run)
the one-pass step of ``_models``' autoencoder (``--estimation``, default
``empirical_shared``) for SGD, Adam, the estimator alone with SGD, and
``optax.chain(kfl.kfac(...), optax.sgd(...))``, the latter both as the
README writes it (``with_stats=kfl.stats_due(state)``: the statistics
under a ``lax.cond``) and with statistics on every step; then the latter again
with its stages replaced one after the other by the identity (the refresh,
then the preconditioning, then the accumulation of the statistics: the
names ``kfac_jax_lite.optimizers.transform`` calls them by), so the
differences price each stage's program. Last, the factor inversions of
the refresh alone (damped inverses by ``"gauss_jordan"`` of factors of the
autoencoder's sizes), one call per factor against all of them through
``kfl.factor.batched_inverses`` (stacked by padded size, as the refresh
computes them). Prints
seconds of tracing and lowering, of XLA's compile, and the compiled
program's text size and its fusions (XLA:CPU compiles one kernel for
identical fusions; a guide to the program's size, not a price: distinct
shapes cost more than more fusions, see the benchmarks README); compile
times vary from run to run by ~10%.

``--model lm`` compiles the same four steps (SGD, Adam, the estimator
with SGD, K-FAC + SGD) for a pre-norm decoder-only transformer written
in Flax linen with its blocks under ``nn.scan`` (``--depth`` layers, width
128, 4 heads, context 64, batch 32, 96 symbols; softmax cross-entropy):
the scanned layers' curvature is one stacked block per layer kind, so its
program does not grow with the depth.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _models as M  # noqa: E402
from _kfl import kfl  # noqa: E402

FULL = (784, 1000, 500, 250, 30, 250, 500, 1000, 784)
QUICK = (64, 32, 16, 32, 64)


def compile_time(fn, *args):
  """``(seconds to trace and lower, seconds to compile, HLO characters)``."""
  import jax
  t0 = time.perf_counter()
  lowered = jax.jit(fn).lower(*args)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  text = compiled.as_text()
  return t1 - t0, t2 - t1, len(text), len(re.findall(r" fusion\(", text))


def autoencoder_problem(dims, batch_size):
  """``(loss_fn, params, batch)`` of ``_models``' autoencoder."""
  import jax
  loss_fn = M.make_autoencoder_loss()
  params = M.autoencoder_init(dims, jax.random.PRNGKey(0))
  batch = {"x": jax.random.uniform(jax.random.PRNGKey(1),
                                   (batch_size, dims[0]))}
  return loss_fn, params, batch


def steps(problem, estimation):
  """``[(name, fn, args)]``: the steps whose programs are compared, for
  ``problem = (loss_fn, params, batch)``."""
  import jax
  import optax
  loss_fn, params, batch = problem
  key = jax.random.PRNGKey(2)
  est_fn = kfl.value_grad_and_stats(loss_fn, params, batch,
                                    estimation=estimation)

  def plain(tx):
    def step(p, s, b):
      g = jax.grad(loss_fn)(p, b)
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s
    return step, (params, tx.init(params), batch)

  sgd = optax.sgd(0.01, momentum=0.9)

  def estimator_only(p, s, b, k):
    e = est_fn(p, b, k)
    u, s = sgd.update(e.grads, s, p)
    return optax.apply_updates(p, u), s, e.stats

  def kfac_step(when_due=False):
    tx = optax.chain(kfl.kfac(loss_fn, batch, estimation=estimation),
                     optax.sgd(0.01, momentum=0.9))

    def step(p, s, b, k):
      extra = {"with_stats": kfl.stats_due(s)} if when_due else {}
      e = est_fn(p, b, k, **extra)
      u, s = tx.update(e.grads, s, p, stats=e.stats)
      return optax.apply_updates(p, u), s
    return step, (params, tx.init(params), batch, key)

  return [("SGD", *plain(sgd)), ("Adam", *plain(optax.adam(1e-3))),
          ("estimator + SGD", estimator_only,
           (params, sgd.init(params), batch, key)),
          ("K-FAC + SGD, statistics when due", *kfac_step(True)),
          ("K-FAC + SGD", *kfac_step())], kfac_step


LM_SIZES = dict(width=128, heads=4, context=64, batch=32, vocab=96)


def lm_problem(depth):
  """``(loss_fn, params, batch)``: a Flax linen decoder-only transformer whose
  ``depth`` blocks run under ``nn.scan`` (one set of stacked parameters)."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import optax
  w, heads, t, b, v = (LM_SIZES[k] for k in ("width", "heads", "context", "batch",
                                        "vocab"))

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      h = nn.LayerNorm()(x)
      mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
      x = x + nn.MultiHeadDotProductAttention(num_heads=heads)(h, h, mask=mask)
      h = nn.Dense(w)(nn.gelu(nn.Dense(4 * w)(nn.LayerNorm()(x))))
      return x + h, None

  class Transformer(nn.Module):
    @nn.compact
    def __call__(self, ids):
      x = nn.Embed(v, w)(ids) + self.param(
          "pos", nn.initializers.normal(0.02), (t, w))
      x, _ = nn.scan(Block, variable_axes={"params": 0},
                     split_rngs={"params": True}, length=depth)()(x, None)
      return nn.Dense(v)(nn.LayerNorm()(x))

  model = Transformer()
  ids = jax.random.randint(jax.random.PRNGKey(0), (b, t + 1), 0, v)
  batch = {"x": ids[:, :-1], "y": ids[:, 1:]}
  params = model.init(jax.random.PRNGKey(1), batch["x"])

  def loss_fn(p, batch):
    logits = model.apply(p, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["y"]).mean()
  return loss_fn, params, batch


def stage_rows(kfac_step):
  """The K-FAC step with its stages replaced by the identity, cumulatively:
  ``[(name, measure)]``, ``measure()`` tracing and compiling under the
  replacements (they are undone after each)."""
  from kfac_jax_lite.optimizers import transform as T
  stubs = [("refresh", lambda layers, states, *a, **k: states),
           ("precondition", lambda layers, states, leaves, lam, power:
            list(leaves)),
           ("accumulate", lambda layers, states, stats, decay: states)]
  names = ["  without the refresh", "  ... and the preconditioning",
           "  ... and the accumulation"]

  def measure(upto):
    saved = {}
    try:
      for attr, stub in stubs[:upto]:
        if not callable(getattr(T, attr, None)):  # Renamed: no silent row.
          raise SystemExit(f"kfac_jax_lite.optimizers.transform has no "
                           f"{attr}")
        saved[attr] = getattr(T, attr)
        setattr(T, attr, stub)
      fn, args = kfac_step()
      return compile_time(fn, *args)
    finally:
      for attr, fn in saved.items():
        setattr(T, attr, fn)
  return [(name, lambda k=k: measure(k)) for k, name in enumerate(names, 1)]


def inversion_rows(dims):
  """The refresh's inversions alone: one call per factor, and all of them
  through ``kfl.factor.batched_inverses`` (stacked by padded size, as the
  refresh computes them)."""
  import jax.numpy as jnp
  sizes = [d + 1 for d in dims[:-1]] + list(dims[1:])  # A (with bias), G.
  fac = kfl.factor
  states = [fac.update_cov(fac.init_factor(n), 2.0 * jnp.eye(n), 0.9)
            for n in sizes]
  block = 64
  padded = lambda n: max(1, -(-n // block)) * block

  def inverses(method):
    return [fac.damped_matpower(s, 0.1, -1.0, method=method) for s in states]

  def separate(_):
    return inverses("gauss_jordan")

  def together(_):
    return fac.batched_inverses(inverses, "gauss_jordan")
  return [(f"{len(sizes)} inversions, one call each", separate, (0.0,)),
          (f"  together ({len({padded(n) for n in sizes})} padded sizes)",
           together, (0.0,))]


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", choices=("autoencoder", "lm"),
                 default="autoencoder")
  p.add_argument("--depth", type=int, default=6,
                 help="--model lm: the scanned blocks (default 6)")
  p.add_argument("--quick", action="store_true", help="a small autoencoder")
  p.add_argument("--dims", default=None,
                 help="the autoencoder's widths, e.g. 512-500-520-512 "
                      "(default 784-1000-500-250-30-250-500-1000-784)")
  p.add_argument("--batch", type=int, default=None,
                 help="default 1000 (quick: 64)")
  p.add_argument("--estimation", default="empirical_shared",
                 choices=("fisher", "empirical_shared", "empirical", "exact"))
  args = p.parse_args(argv)
  import jax
  platform = f"jax {jax.__version__} on {jax.devices()[0].platform}"
  if args.model == "lm":
    problem = lm_problem(args.depth)
    print(f"{platform}; Flax linen transformer, {args.depth} blocks under "
          f"nn.scan, " + ", ".join(f"{k} {v}" for k, v in LM_SIZES.items())
          + f", one-pass estimation={args.estimation}")
  else:
    dims = (tuple(int(d) for d in args.dims.split("-")) if args.dims
            else QUICK if args.quick else FULL)
    batch = args.batch or (64 if args.quick else 1000)
    problem = autoencoder_problem(dims, batch)
    print(f"{platform}; autoencoder {'-'.join(map(str, dims))}, batch "
          f"{batch}, one-pass estimation={args.estimation}")
  base, kfac_step = steps(problem, args.estimation)
  measured = lambda fn, fargs: lambda: compile_time(fn, *fargs)
  rows = [(name, measured(fn, fargs)) for name, fn, fargs in base]
  rows += stage_rows(kfac_step)
  if args.model == "autoencoder":
    rows += [(name, measured(fn, fargs))
             for name, fn, fargs in inversion_rows(dims)]
  adam = None
  print(f"{'program':44s} {'trace+lower s':>13s} {'compile s':>10s} "
        f"{'x Adam':>7s} {'HLO kchars':>11s} {'fusions':>8s}")
  for name, measure in rows:
    lower, comp, chars, fusions = measure()
    adam = comp if name == "Adam" else adam
    ratio = f"{comp / adam:6.1f}x" if adam else "      -"
    print(f"{name:44s} {lower:13.2f} {comp:10.2f} {ratio:>7s} "
          f"{chars / 1e3:11.0f} {fusions:8d}", flush=True)


if __name__ == "__main__":
  main()
