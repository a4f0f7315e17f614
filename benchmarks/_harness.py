"""Shared machinery of the time-to-target benchmarks.

A benchmark is a list of :class:`Candidate` runs (an optimizer family at
one grid point), each trained for the same wall-clock budget on batches
from one stream, with evaluations at regular points of its training clock.

* **Clock.** The training clock of a run sums the time of its steps, each
  blocked on (``jax.block_until_ready``), and nothing else: evaluations
  and the host-side batch bookkeeping are outside it. The first step's
  time (building the optimizer, tracing, compiling and running once) is
  on it, as on a user's clock (issue 46), and also reported as ``first
  step s``.
* **Best of a grid.** Per family, the run with the best final value of
  the primary metric (a run whose loss turned non-finite ranks last).
* **Target.** The reference family's best final value of each metric
  (Adam's or AdamW's loss at the budget). A run's time to a target is the
  training clock at its first evaluation at or past the target (resolution
  ``budget / evals``); ``ref/ours`` divides the reference's time by it.
* **Step time.** The median of a run's step times; ``x SGD`` divides it by
  the median of the best SGD-momentum run of the same process.

The runs go one after another (not interleaved), so on a shared machine
their step times drift with the load: compare ratios within one run.
"""
from __future__ import annotations

import itertools
import math
import statistics
import sys
import time
from typing import Any, Callable, NamedTuple

import numpy as np
import optax

import _timing
# The command line and the environment live in ``_cli`` (re-exported here
# for the benchmarks that reach them as ``H.<name>``).
from _cli import (  # noqa: F401
    RESULTS, add_common_args, add_image_args, blas_pools, environment,
    finish_args, load_images, print_grids)
from _kfl import kfl


class Metric(NamedTuple):
  key: str  # Key in the evaluation dict.
  label: str  # Column title.
  goal: str  # "min" or "max".


class Candidate(NamedTuple):
  family: str  # Row name, e.g. "Adam".
  settings: dict  # This grid point, printed and saved.
  style: str  # How a step computes the update (see ``_timing.make_step``).
  build: Callable[[], Any]  # -> a stepper: ``.step(batch) -> loss``, ``.params()``.


# ------------------------------------------------------------- steppers

def cov_style(style, cov_every):
  """The step style of a one-pass candidate with ``cov_every``: ``"cov"``
  (``with_stats=kfl.stats_due(state)``, so the statistics are computed only
  where the transform folds them; ``"cov+batch="`` for ``"1-pass+batch="``)
  when ``cov_every`` is not 1 (None: the plan chooses it), else
  ``style``."""
  if cov_every == 1 or style not in ("1-pass", "1-pass+batch="):
    return style
  return "cov" if style == "1-pass" else "cov+batch="


def optax_candidate(family, settings, style, make_tx, loss_fn, params,
                    example_batch, seed=0, est_options=None):
  """A :class:`Candidate` training ``make_tx()`` with ``_timing.Stepper``
  (``style``: ``"grad"``, ``"batch="``, ``"1-pass"`` or ``"cov"``, see
  ``_timing.make_step``; ``est_options``: the ``kfl.value_grad_and_stats``
  options of the one-pass styles, which must match the transform's)."""
  def build():
    est_fn = None
    if style not in ("grad", "batch="):
      est_fn = kfl.value_grad_and_stats(loss_fn, params, example_batch,
                                        **(est_options or {}))
    return _timing.Stepper(loss_fn, params, make_tx(), style, example_batch,
                           seed, est_fn=est_fn)
  return Candidate(family, settings, style, build)


# Issue 25's amortisation presets, one setting moved from the defaults at
# a time: statistics every k steps (cov_decay kept at 0.95: the EMA's
# horizon stays 20 statistics steps), on a share of the batch, a longer
# inverse period, the empirical statistics of the gradient's own backward
# pass, and two combinations.
EVA_BLOCKS = {"dense": "kronecker_vector", "conv": "kronecker_vector"}
AMORTISED = {
    "defaults": {},
    "cov2": {"cov_every": 2},
    "cov5": {"cov_every": 5},
    "cov10": {"cov_every": 10},
    "frac4": {"stats_fraction": 0.25},
    "frac8": {"stats_fraction": 0.125},
    "inv20": {"inverse_every": 20},
    "inv50": {"inverse_every": 50},
    "shared": {"estimation": "empirical_shared"},
    "cov5_inv20": {"cov_every": 5, "inverse_every": 20},
    "frac8_inv20": {"stats_fraction": 0.125, "inverse_every": 20},
    # Issue 36: the winner on the conv net and the char LM, amortised.
    "shared_cov2": {"estimation": "empirical_shared", "cov_every": 2},
    "shared_inv20": {"estimation": "empirical_shared", "inverse_every": 20},
    "shared_frac4": {"estimation": "empirical_shared", "stats_fraction": 0.25},
    # Issue 36: a tighter KL clip for the char LM's winner.
    "shared_nc0.3": {"estimation": "empirical_shared", "norm_constraint": 0.3},
    "shared_nc0.1": {"estimation": "empirical_shared", "norm_constraint": 0.1},
    "shared_nc0.3_frac4": {"estimation": "empirical_shared",
                           "norm_constraint": 0.3, "stats_fraction": 0.25},
    "shared_nc0.3_cov2": {"estimation": "empirical_shared",
                          "norm_constraint": 0.3, "cov_every": 2},
    # Issue 36's lever 3: Eva's rank-one Kronecker vectors for the dense
    # and conv layers (the others keep their blocks), at Eva's damping
    # 0.03, the vectors refreshed every step (inverse_every=1: a copy of
    # a + b numbers for them) or every 10th.
    "eva": {"estimation": "empirical_shared", "damping": 0.03,
            "blocks": EVA_BLOCKS, "inverse_every": 1},
    "eva_inv10": {"estimation": "empirical_shared", "damping": 0.03,
                  "blocks": EVA_BLOCKS},
    # Eva's own running average: the newest vectors weigh 0.95 (every
    # block's statistics here, the non-dense ones too).
    "eva_fresh": {"estimation": "empirical_shared", "damping": 0.03,
                  "blocks": EVA_BLOCKS, "cov_decay": 0.05,
                  "inverse_every": 1},
}


def amortised_family(loss_fn, params, example, lr, style, seed, configs=None,
                     weight_decay=None):
  """The family ``kfac_amortised``: ``optax.chain(kfl.kfac(loss_fn, batch,
  **AMORTISED[config]), optax.sgd(lr, momentum=0.9))`` over ``configs``
  (default: all presets), stepped in ``style``; with ``"1-pass"`` a preset
  with ``cov_every > 1`` is stepped with ``with_stats=kfl.stats_due(state)``
  (the ``"cov"`` style: the statistics only on the steps that use them),
  the others as the README's quickstart (statistics on every step, no
  conditional, which on XLA:CPU costs a conv net 1.9x its step: see
  ``kfl.value_grad_and_stats``)."""
  import optax

  def make(settings):
    options = AMORTISED[settings["config"]]
    est = {k: v for k, v in options.items() if k in ESTIMATOR_OPTIONS}
    step_style = cov_style(style, options.get("cov_every"))

    def make_tx():
      parts = [kfl.kfac(loss_fn, example, **options)]
      if weight_decay:
        parts.append(optax.add_decayed_weights(weight_decay))
      return optax.chain(*parts, optax.sgd(settings["lr"], momentum=0.9))
    return optax_candidate("K-FAC+SGD amortised", settings, step_style,
                           make_tx, loss_fn, params, example, seed, est)
  return Family("kfac_amortised", "K-FAC+SGD amortised",
                {"config": list(configs or AMORTISED), "lr": [lr]}, make,
                "kfl.kfac(loss_fn, batch, **preset) + sgd(lr, 0.9); presets: "
                + "; ".join(f"{k}={v}" for k, v in AMORTISED.items()))


def optax_families(loss_fn, params, example_batch, seed=0):
  """A script's ``optax_family(fid, name, grid, make_tx, style="grad",
  note="", est_options=())``: the :class:`Family` whose candidate at
  ``settings`` trains ``make_tx(**settings)`` on ``loss_fn`` from ``params``
  in ``style`` (:func:`cov_style` of it and the settings' ``cov_every``);
  the settings named in ``est_options`` also build the one-pass styles'
  estimator (``kfl.value_grad_and_stats``), which must match the
  transform's."""
  def optax_family(fid, name, grid, make_tx, style="grad", note="",
                   est_options=()):
    def candidate(s):
      est = {k: v for k, v in s.items() if k in est_options}
      # Unset, cov_every is the transform's default: kfl.kfac's None (the
      # plan), kfl.kfac_optimizer's ("1-pass+batch=") 1.
      every = s.get("cov_every", 1 if style == "1-pass+batch=" else None)
      return optax_candidate(name, s, cov_style(style, every),
                             lambda: make_tx(**s), loss_fn, params,
                             example_batch, seed, est)
    return Family(fid, name, grid, candidate, note)
  return optax_family


# kfac_optimizer's options that its one-pass estimator must share.
ESTIMATOR_OPTIONS = ("estimation", "num_samples", "stats_fraction",
                     "exclude", "blocks", "weight_sharing", "example_axis")


def kfac_families(optax_family, loss_fn, example, lrs, dampings, tuned_lrs,
                  style):
  """The K-FAC families of every time-to-target script.

  ``optax.chain(kfl.kfac(loss_fn, example), optax.sgd(lr, momentum=0.9))``
  at the library's defaults (or with the options ``--set kfac.KEY=...``
  gives, the estimator built with the same estimation options) over
  ``lrs``; the same tuned over ``dampings``
  x ``tuned_lrs`` (the defaults' runs compete with it); both stepped in
  ``style``; and ``kfl.kfac_optimizer(loss_fn, example)`` at its defaults
  (or the options ``--set kfac_opt.KEY=...`` gives), its statistics from
  the one-pass estimate and ``batch=`` for its quadratic model
  (``"1-pass+batch="``; the estimator built with the same estimation
  options). ``optax_family``: from :func:`optax_families`.
  """
  return [
      optax_family("kfac", "K-FAC+SGD defaults", {"lr": list(lrs)},
                   lambda lr, **options: optax.chain(
                       kfl.kfac(loss_fn, example, **options),
                       optax.sgd(lr, momentum=0.9)),
                   style=style, est_options=ESTIMATOR_OPTIONS,
                   note="kfl.kfac(loss_fn, batch) defaults (or the options "
                   "--set kfac.KEY=... gives) + sgd(lr, 0.9)"),
      optax_family("kfac_tuned", "K-FAC+SGD tuned",
                   {"damping": list(dampings), "lr": list(tuned_lrs)},
                   lambda damping, lr: optax.chain(
                       kfl.kfac(loss_fn, example, damping=damping),
                       optax.sgd(lr, momentum=0.9)),
                   style=style,
                   note="other kfl.kfac settings at their defaults; the "
                   "defaults' runs compete"),
      optax_family("kfac_opt", "kfl.kfac_optimizer", {},
                   lambda **options: kfl.kfac_optimizer(loss_fn, example,
                                                        **options),
                   style="1-pass+batch=", est_options=ESTIMATOR_OPTIONS,
                   note="defaults unless --set kfac_opt.KEY=...; one-pass "
                   "statistics (the estimator given the same estimation "
                   "options), batch= for the quadratic model")]


def grid(**values) -> list[dict]:
  """The cartesian product of the given lists, as a list of dicts."""
  keys = list(values)
  return [dict(zip(keys, combo)) for combo in itertools.product(
      *(values[k] for k in keys))]


def eigen_adam_families(optax_family, loss_fn, example, lrs, style,
                        weight_decay=None):
  """Issue 26's two families for a benchmark: ``kfl.eigen_adam`` in K-FAC's
  basis (``style``: the script's K-FAC step style, ``"cov"`` at a
  ``cov_every > 1``: :func:`cov_style`) and in Shampoo's (SOAP), each
  chained with ``scale_by_learning_rate(lr)`` over ``lrs`` (and
  ``add_decayed_weights(weight_decay)`` before it, as AdamW, if given).
  Both grids also hold ``cov_every`` and ``refresh_every`` (the defaults,
  1 and 10; ``--set eigen_adam.cov_every=5`` moves them).
  ``optax_family(fid, name, grid, make_tx, style=, note=)``: the script's."""
  import optax
  import kfac_jax_lite as kfl

  def make(**options):
    def make_tx(lr, cov_every=1, refresh_every=10):
      parts = [kfl.eigen_adam(loss_fn, example, cov_every=cov_every,
                              refresh_every=refresh_every, **options)]
      if weight_decay:
        parts.append(optax.add_decayed_weights(weight_decay))
      return optax.chain(*parts, optax.scale_by_learning_rate(lr))
    return make_tx
  wd = (f" + weight decay {weight_decay:g} (as AdamW)" if weight_decay
        else "")
  amortised = {"cov_every": [1], "refresh_every": [10]}
  return [
      optax_family("eigen_adam", "EigenAdam K-FAC",
                   {"lr": list(lrs), **amortised}, make(),
                   style=style, note="kfl.eigen_adam(loss_fn, batch) "
                   "(eigh every refresh_every steps)" + wd),
      optax_family("soap", "EigenAdam SOAP", {"lr": list(lrs), **amortised},
                   make(basis="shampoo"),
                   note="kfl.eigen_adam(..., basis='shampoo')" + wd)]


def muon_families(optax_family, lrs, adam_lr, note, dims=None):
  """``[Muon]``: ``optax.contrib.muon(lr, adam_learning_rate=adam_lr)``
  over ``lrs`` (with ``muon_weight_dimension_numbers=dims`` if given, a
  function of the parameters), or ``[]`` with a line saying why when this
  optax has no Muon (or, with ``dims``, no ``MuonDimensionNumbers``)."""
  muon = muon_or_none()
  if muon is None or (dims is not None and not hasattr(
      optax.contrib, "MuonDimensionNumbers")):
    print(f"Muon: skipped (optax {optax.__version__} lacks optax.contrib.muon"
          + (" or MuonDimensionNumbers)" if dims is not None else ")"))
    return []
  extra = {} if dims is None else {"muon_weight_dimension_numbers": dims}
  return [optax_family(
      "muon", "Muon", {"lr": list(lrs), "adam_lr": [adam_lr]},
      lambda lr, adam_lr: muon(lr, adam_learning_rate=adam_lr, **extra),
      note=note)]


def muon_or_none():
  """``optax.contrib.muon``, or None when this optax has none."""
  contrib = getattr(optax, "contrib", None)
  return getattr(contrib, "muon", None)


# ------------------------------------------------------------ training

def _progress(label, budget, enabled):
  if not enabled or not sys.stderr.isatty():  # No bars in logs.
    return None
  try:
    from tqdm.auto import tqdm
  except ImportError:
    return None
  return tqdm(total=round(budget, 1), desc=label, unit="s", leave=False,
              bar_format="{desc}: {bar} {n:.0f}/{total:.0f}s{postfix}")


def train(candidate: Candidate, batches, evaluate, budget, evals, *,
          max_steps=None, progress=True, primary="loss"):
  """Trains one candidate for ``budget`` seconds of its clock; its record."""
  label = f"{candidate.family} {fmt_settings(candidate.settings)}"
  t0 = time.perf_counter()
  stepper = candidate.build()
  setup_s = time.perf_counter() - t0
  curve = [dict(step=0, time=0.0, **evaluate(stepper.params()))]
  t0 = time.perf_counter()
  loss = float(stepper.step(next(batches)))
  first_s = setup_s + time.perf_counter() - t0
  steps, clock, times, losses = 1, first_s, [], [loss]
  every = budget / max(1, evals)
  next_eval = every
  bar = _progress(label, budget, progress)
  diverged = not math.isfinite(loss)
  while (not diverged and clock < budget
         and (max_steps is None or steps < max_steps)):
    batch = next(batches)
    t = time.perf_counter()
    loss = float(stepper.step(batch))
    dt = time.perf_counter() - t
    clock, steps = clock + dt, steps + 1
    times.append(dt)
    losses.append(loss)
    diverged = not math.isfinite(loss)
    if bar is not None:
      bar.update(dt)
      if steps % 10 == 0:
        bar.set_postfix_str(f" step {steps}, batch {primary} {loss:.4g}")
    if next_eval <= clock < budget:
      curve.append(dict(step=steps, time=clock, **evaluate(stepper.params())))
      next_eval += every
  if bar is not None:
    bar.close()
  curve.append(dict(step=steps, time=clock, **evaluate(stepper.params())))
  final = curve[-1]
  bad = diverged or not all(math.isfinite(v) for v in final.values())
  record = dict(
      family=candidate.family, settings=candidate.settings,
      style=candidate.style, steps=steps, clock_s=clock, setup_s=setup_s,
      first_step_s=first_s,
      median_step_s=statistics.median(times) if times else float("nan"),
      diverged=bad, final=final, curve=curve,
      train_losses=_thin(losses, 500))
  print(f"  {label:<46} {steps:>6} steps in {clock:5.1f} s, final "
        f"{primary} {final[primary]:.4g}{' (diverged)' if bad else ''}; "
        f"first step {first_s:.1f} s, median {1e3 * record['median_step_s']:.1f}"
        " ms", flush=True)
  return record


def _thin(values, n):
  if len(values) <= n:
    return values
  idx = np.linspace(0, len(values) - 1, n).round().astype(int)
  return [values[i] for i in idx]


def float_dict(evaluate):
  """``evaluate(params) -> dict of arrays`` as a dict of Python floats."""
  return lambda params: {k: float(v) for k, v in evaluate(params).items()}


def batch_stream(make_batch, num_examples, batch_size, seed):
  """Yields ``make_batch(indices)`` over seeded epoch permutations."""
  rng = np.random.default_rng(seed)
  while True:
    perm = rng.permutation(num_examples)
    for i in range(0, num_examples - batch_size + 1, batch_size):
      yield make_batch(perm[i:i + batch_size].astype(np.int32))


def run_all(candidates, batches_fn, evaluate, args, primary):
  """Trains every candidate, each on a fresh, identically seeded stream.

  A candidate that raises is recorded as failed (and the others still run)
  unless ``args.strict``.
  """
  records = []
  print(f"Training {len(candidates)} runs for {args.budget:g} s each "
        f"(training clock; max steps {args.max_steps}), {args.evals} "
        "evaluations per run:", flush=True)
  for c in candidates:
    try:
      records.append(train(c, batches_fn(), float_dict(evaluate), args.budget,
                           args.evals, max_steps=args.max_steps,
                           progress=args.progress, primary=primary))
    except Exception as e:  # pylint: disable=broad-except
      if args.strict:
        raise
      why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
      print(f"  {c.family} {fmt_settings(c.settings)}: FAILED: {why}",
            flush=True)
      records.append(dict(family=c.family, settings=c.settings, style=c.style,
                          failed=why, diverged=True))
  return records


# ------------------------------------------------------------ families

class Family(NamedTuple):
  """An optimizer with its grid; ``make(settings) -> Candidate``."""

  id: str  # Short name for --only / --set.
  name: str
  grid: dict  # Setting -> list of values.
  make: Callable[[dict], Candidate]
  note: str = ""


def _parse_value(text):
  if text.lower() == "none":
    return None
  for cast in (int, float):
    try:
      return cast(text)
    except ValueError:
      pass
  return text


def candidates(families, args):
  """The candidates of the chosen families, grids overridden by --set."""
  by_id = {f.id: f for f in families}
  grids = {f.id: dict(f.grid) for f in families}
  for item in args.set or ():
    try:
      lhs, values = item.split("=", 1)
      fam, key = lhs.split(".", 1)
    except ValueError:
      raise SystemExit(f"--set {item!r}: expected FAMILY.KEY=V1,V2,...")
    if fam not in by_id:
      raise SystemExit(f"--set {item!r}: unknown family {fam!r}; one of "
                       f"{sorted(by_id)}")
    grids[fam][key] = [_parse_value(v) for v in values.split(",")]
  chosen = [f for f in families if args.only is None or f.id in args.only]
  unknown = set(args.only or ()) - set(by_id)
  if unknown:
    raise SystemExit(f"--only: unknown families {sorted(unknown)}; one of "
                     f"{sorted(by_id)}")
  out = []
  for f in chosen:
    for settings in grid(**grids[f.id]):
      out.append(f.make(settings))
  return out, {f.name: grids[f.id] for f in chosen}


def fmt_settings(settings):
  return " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                  for k, v in settings.items()) or "defaults"

