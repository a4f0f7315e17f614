"""Tables, JSON and plots of the time-to-target benchmarks (see ``_harness``).

    python benchmarks/_report.py results/autoencoder.json [--png FILE]

prints a saved run's tables again (and redraws its plot).
"""
from __future__ import annotations

import argparse
import json
import math
import os

import numpy as np

from _harness import RESULTS, Metric, fmt_settings, run_all


# ----------------------------------------------------------- reporting

def _score(record, metric):
  if record.get("failed") or record["diverged"]:
    return math.inf
  v = record["final"][metric.key]
  return v if metric.goal == "min" else -v


def best_runs(records, metric, compete=None):
  """``{family: best record}`` in order of first appearance."""
  compete = compete or {}
  best = {}
  for fam in dict.fromkeys(r["family"] for r in records):
    pool = [r for r in records if r["family"] == fam
            or r["family"] in compete.get(fam, ())]
    best[fam] = min(pool, key=lambda r: _score(r, metric))
  return best


def time_to(record, metric, target):
  """``(seconds, step)`` of the first evaluation at or past ``target``."""
  if record.get("failed") or target is None or not math.isfinite(target):
    return None
  for point in record["curve"]:
    v = point[metric.key]
    if (v <= target) if metric.goal == "min" else (v >= target):
      return point["time"], point["step"]
  return None


def _at_edge(record, grids):
  """The settings of ``record`` that sit at an end of a grid of 2+ values."""
  g = grids.get(record["family"], {})
  numbers = lambda values: [x for x in values if isinstance(x, (int, float))]
  return [k for k, v in record["settings"].items()
          if len(numbers(g.get(k, ()))) > 1 and isinstance(v, (int, float))
          and v in (min(numbers(g[k])), max(numbers(g[k])))]


def report(records, metrics, reference, grids, compete=None,
           sgd="SGD-momentum"):
  """Prints the grid and the best-per-family tables; returns the summary.

  ``grids`` (family -> setting -> values) marks a best setting at an end
  of its grid with ``*``: the optimum may lie outside the grid.
  """
  best = best_runs(records, metrics[0], compete)
  ref = best.get(reference)
  targets = {}
  for m in metrics:
    if ref is None or ref.get("failed") or ref["diverged"]:
      targets[m.key] = None
    else:
      targets[m.key] = ref["final"][m.key]
  print()
  print("All runs (final values at the budget; t->tgt: training clock to "
        f"{reference}'s best final {metrics[0].label}):")
  width = max(len(f"{r['family']} {fmt_settings(r['settings'])}")
              for r in records)
  for r in records:
    label = f"{r['family']} {fmt_settings(r['settings'])}"
    if r.get("failed"):
      print(f"  {label:<{width}}  FAILED: {r['failed']}")
      continue
    vals = "  ".join(f"{m.label} {r['final'][m.key]:.4g}" for m in metrics)
    hit = time_to(r, metrics[0], targets[metrics[0].key])
    reach = (f"t->tgt {hit[0]:5.1f} s at step {hit[1]}" if hit else
             "t->tgt never" if targets[metrics[0].key] is not None else "")
    print(f"  {label:<{width}}  {r['steps']:>6} steps  "
          f"{1e3 * r['median_step_s']:7.1f} ms/step  {vals}  {reach}"
          f"{'  (diverged)' if r['diverged'] else ''}")
  sgd_step = best[sgd]["median_step_s"] if sgd in best and not best[sgd].get(
      "failed") else None
  print()
  print(f"Best run per optimizer (by final {metrics[0].label}); targets = "
        f"{reference}'s final values: " + ", ".join(
            f"{m.label} {targets[m.key]:.4g}" if targets[m.key] is not None
            else f"{m.label} n/a" for m in metrics))
  head = (f"  {'optimizer':<22}{'style':<9}{'settings':<26}{'ms/step':>8}"
          f"{'x SGD':>7}{'first s':>8}{'steps':>7}")
  for m in metrics:
    head += f"{m.label:>11}{'t->tgt s':>9}{'steps':>6}{'ref/ours':>9}"
  print(head)
  rows = []
  for fam, r in best.items():
    edge = _at_edge(r, grids)
    settings = fmt_settings(r["settings"]) + ("*" if edge else "")
    if r.get("failed"):
      print(f"  {fam:<22}{r['style']:<9}{settings:<26}  FAILED: {r['failed']}")
      rows.append(dict(family=fam, settings=r["settings"], style=r["style"],
                       failed=r["failed"]))
      continue
    index = next(i for i, x in enumerate(records) if x is r)
    ratio = r["median_step_s"] / sgd_step if sgd_step else float("nan")
    line = (f"  {fam:<22}{r['style']:<9}{settings:<26}"
            f"{1e3 * r['median_step_s']:>8.1f}"
            + (f"{ratio:>6.2f}x" if math.isfinite(ratio) else f"{'-':>7}")
            + f"{r['first_step_s']:>8.1f}{r['steps']:>7}")
    row = dict(family=fam, run=index, settings=r["settings"], style=r["style"],
               median_step_ms=1e3 * r["median_step_s"], x_sgd=ratio,
               first_step_s=r["first_step_s"], steps=r["steps"],
               diverged=r["diverged"], at_grid_edge=edge)
    for m in metrics:
      hit = time_to(r, m, targets[m.key])
      ref_hit = time_to(ref, m, targets[m.key]) if ref else None
      speedup = (ref_hit[0] / hit[0] if hit and ref_hit and hit[0] > 0
                 else None)
      line += (f"{r['final'][m.key]:>11.4g}"
               + (f"{hit[0]:>9.1f}{hit[1]:>6}" if hit else f"{'never':>9}{'':>6}")
               + (f"{speedup:>8.2f}x" if speedup else f"{'-':>9}"))
      row[m.key] = dict(final=r["final"][m.key],
                        time_to_target_s=hit[0] if hit else None,
                        steps_to_target=hit[1] if hit else None,
                        ref_time_over_ours=speedup)
    print(line + ("  (diverged)" if r["diverged"] else ""))
    rows.append(row)
  print("  style: grad = value_and_grad + tx.update(g, s, p); 1-pass = "
        "kfl.value_grad_and_stats + tx.update(..., stats=); batch= = "
        "value_and_grad + tx.update(..., batch=)")
  print("  *: the best value of a setting is at an end of its grid")
  print(f"  x SGD: median step over {sgd}'s in this process; first s: building"
        " the optimizer + tracing + compiling + the first step; t->tgt, steps:"
        " training clock and steps at the first evaluation reaching the target; "
        f"ref/ours: {reference}'s time to the target over this row's")
  return dict(targets=targets, reference=reference, rows=rows,
              compete=compete or {})


# --------------------------------------------------------------- output

def save(name, args, env, grids, metrics, summary, records):
  """Writes ``<out>/<name>.json`` and, with matplotlib, ``<name>.png``."""
  out = RESULTS if args.out is None else args.out
  if out.lower() == "none":
    return None
  os.makedirs(out, exist_ok=True)
  stem = os.path.join(out, name + ("_quick" if args.quick else ""))
  settings = {k: v for k, v in vars(args).items() if not k.startswith("_")}
  doc = dict(benchmark=name, environment=env, settings=settings, grids=grids,
             metrics=[m._asdict() for m in metrics], summary=summary,
             runs=records)
  with open(stem + ".json", "w") as f:
    json.dump(_rounded(doc), f, indent=1, default=_json_default)
  print(f"wrote {stem}.json", end="")
  if args.plot and plot(stem + ".png", name, metrics, summary, records):
    print(f" and {stem}.png", end="")
  print()
  return stem


def run_and_report(name, candidates, batches_fn, evaluate, args, env, grids,
                   metrics, reference):
  """A time-to-target script's end: trains the candidates
  (``_harness.run_all``, primary metric ``metrics[0]``), prints the
  tables with ``reference``'s final values as the targets (the tuned
  K-FAC family competing with its defaults' runs), writes
  ``<name>.json``/``.png`` and returns the summary."""
  records = run_all(candidates, batches_fn, evaluate, args, metrics[0].key)
  summary = report(records, metrics, reference, grids,
                   compete={"K-FAC+SGD tuned": ["K-FAC+SGD defaults"]})
  save(name, args, env, grids, metrics, summary, records)
  return summary


def _rounded(obj, digits=6):
  """``obj`` with every float rounded to ``digits`` significant digits."""
  if isinstance(obj, float):
    return float(f"{obj:.{digits}g}") if math.isfinite(obj) else obj
  if isinstance(obj, dict):
    return {k: _rounded(v, digits) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [_rounded(v, digits) for v in obj]
  return obj


def _json_default(x):
  if isinstance(x, (np.floating, np.integer)):
    return x.item()
  return str(x)


def plot(path, title, metrics, summary, records):
  """Each metric of the best runs against steps and seconds; False if no
  matplotlib."""
  try:
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print(" (no matplotlib: no PNG)", end="")
    return False
  best = {row["family"]: records[row["run"]] for row in summary["rows"]
          if not row.get("failed")}
  fig, axes = plt.subplots(len(metrics), 2, figsize=(12, 4.2 * len(metrics)),
                           squeeze=False)
  for i, m in enumerate(metrics):
    for j, x in enumerate(("step", "time")):
      ax = axes[i, j]
      for fam, r in best.items():
        xs = [p[x] for p in r["curve"]]
        ys = [p[m.key] for p in r["curve"]]
        label = f"{fam} ({fmt_settings(r['settings'])})"
        ax.plot(xs, ys, marker=".", ms=3,
                label=label + (" diverged" if r["diverged"] else ""))
      target = summary["targets"].get(m.key)
      if target is not None:
        ax.axhline(target, color="gray", ls="--", lw=1, label="target")
      if m.goal == "min":  # Up to 1.5x the initial value: divergence is off.
        values = [p[m.key] for r in best.values() for p in r["curve"]
                  if math.isfinite(p[m.key])]
        start = max(r["curve"][0][m.key] for r in best.values())
        if values and math.isfinite(start) and start > 0 and min(values) > 0:
          ax.set_ylim(0.9 * min(values), 1.5 * start)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
      ax.set_xlabel("steps" if x == "step" else "training seconds")
      ax.set_ylabel(m.label)
      ax.grid(alpha=0.3)
      if i == 0 and j == 0:
        ax.legend(fontsize=7)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)
  return True


def main(argv=None):
  p = argparse.ArgumentParser(description="Reprint a saved benchmark's tables.")
  p.add_argument("json")
  p.add_argument("--png", default=None, help="also redraw the plot here")
  args = p.parse_args(argv)
  with open(args.json) as f:
    doc = json.load(f)
  env = doc["environment"]
  print(f"{env['date']}  {env['command']}")
  print(f"jax {env['jax']}, kfac_jax_lite {env['kfac_jax_lite']}, kfac_jax "
        f"{env['kfac_jax']}; {env['devices']} on {env['host']}")
  print(f"data: {env['data']}\nmodel: {env['model']}")
  metrics = [Metric(**m) for m in doc["metrics"]]
  old = doc["summary"]
  compete = old.get("compete", {"K-FAC+SGD tuned": ["K-FAC+SGD defaults"]})
  summary = report(doc["runs"], metrics, old["reference"], doc["grids"],
                   compete)
  if args.png:
    plot(args.png, doc["benchmark"], metrics, summary, doc["runs"])
  return summary


if __name__ == "__main__":
  main()
