"""The FLOP cost model of a K-FAC step against SGD's, for the benchmarks.

The model is the design brief's "Performance model", written out in
``step_time.py``'s docstring (per dense layer ``a = d_in + 1``, ``b =
d_out``: SGD ``6·M·a·b``; K-FAC adds the sampled backward ``f·2·M·a·b``,
the covariances ``f·2·M·(a² + b²)``, the preconditioning ``2·(a²·b +
a·b²)`` and the inverses ``c·(a³ + b³) / T``; the 2-pass style another
``f·2·M·a·b``), which prints these floors next to its timings. The
arithmetic is the library's (``kfac_jax_lite.estimators._cost``, which
``kfl.describe`` prices its rows with); this module only tabulates it.
"""
from __future__ import annotations

import math

from kfac_jax_lite.estimators import _cost

# c of c·n³ per factor inverse.
DECOMP_COSTS = (("c=1 potrf+potri", 1.0), ("c=2 gauss-jordan", 2.0),
                ("c=7/3 chol+solve(I)", 7 / 3), ("c=10 eigh", 10.0))


def floor_ratio(dims, m, *, fraction=1.0, interval=math.inf, c=1.0,
                two_pass=False):
  """K-FAC/SGD FLOP ratio of the cost model (module docstring) for
  the dense layers ``dims`` at batch ``m``."""
  return _cost.ratio(_cost.dense_layers(dims, m, fraction=fraction,
                                        inverse_every=interval, c=c,
                                        two_pass=two_pass))


def model_flops(dims, m):
  """Per-piece FLOPs of the cost model, summed over the layers."""
  layers = _cost.dense_layers(dims, m, c=1.0, inverse_every=1)
  sgd = sum(f.sgd for f in layers)
  return dict(sgd=sgd, forward=sgd / 3, sampled_backward=sgd / 3,
              covariances=sum(f.statistics for f in layers) - sgd / 3,
              precondition=sum(f.precondition for f in layers),
              cube=sum(f.refresh for f in layers))


def print_floors(dims, m):
  inf = float("inf")
  print(f"Cost-model floor of the K-FAC/SGD step-time ratio ({'-'.join(map(str, dims))}, "
        f"M={m}); c = FLOPs per n³ of one factor inverse")
  rows = [("T=10, f=1", 1.0, 10), ("T=100, f=1", 1.0, 100),
          ("T->inf, f=1", 1.0, inf), ("T=10, f=1/8", 1 / 8, 10),
          ("T->inf, f=1/8", 1 / 8, inf)]
  head = f"  {'':<16}" + "".join(f"{name:>21}" for name, _ in DECOMP_COSTS)
  print(head + f"{'2-pass, c=1':>14}")
  for name, f, t in rows:
    cells = "".join(f"{floor_ratio(dims, m, fraction=f, interval=t, c=c):>20.3f}x"
                    for _, c in DECOMP_COSTS)
    two = floor_ratio(dims, m, fraction=f, interval=t, c=1.0, two_pass=True)
    print(f"  {name:<16}{cells}{two:>13.3f}x")
  print("  (design brief: 2.66x for T=10, 2.62x for T->inf, about 1.6x with "
        "1/8 statistics)")
