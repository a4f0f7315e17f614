"""The FLOP cost model of a K-FAC step against SGD's.

The model is the design brief's "Performance model", written out in
``step_time.py``'s docstring (per dense layer ``a = d_in + 1``, ``b =
d_out``: SGD ``6·M·a·b``; K-FAC adds the sampled backward ``f·2·M·a·b``,
the covariances ``f·2·M·(a² + b²)``, the preconditioning ``2·(a²·b +
a·b²)`` and the inverses ``c·(a³ + b³) / T``; the 2-pass style another
``f·2·M·a·b``), which prints these floors next to its timings.
"""
from __future__ import annotations

# c of c·n³ per factor inverse.
DECOMP_COSTS = (("c=1 potrf+potri", 1.0), ("c=2 gauss-jordan", 2.0),
                ("c=7/3 chol+solve(I)", 7 / 3), ("c=10 eigh", 10.0))


def floor_ratio(dims, m, *, fraction=1.0, interval=float("inf"), c=1.0,
                two_pass=False):
  """K-FAC/SGD FLOP ratio of the cost model (module docstring) for
  the dense layers ``dims`` at batch ``m``."""
  sgd = kfac = 0.0
  for d_in, b in zip(dims[:-1], dims[1:]):
    a = d_in + 1
    sgd += 6 * m * a * b
    kfac += (6 * m * a * b + fraction * 2 * m * a * b
             + fraction * 2 * m * (a * a + b * b) + 2 * (a * a * b + a * b * b)
             + c * (a ** 3 + b ** 3) / interval)
    if two_pass:
      kfac += fraction * 2 * m * a * b
  return kfac / sgd


def model_flops(dims, m):
  """Per-piece FLOPs of the cost model, summed over the layers."""
  out = dict(sgd=0.0, forward=0.0, sampled_backward=0.0, covariances=0.0,
             precondition=0.0, cube=0.0)
  for d_in, b in zip(dims[:-1], dims[1:]):
    a = d_in + 1
    out["sgd"] += 6 * m * a * b
    out["forward"] += 2 * m * a * b
    out["sampled_backward"] += 2 * m * a * b
    out["covariances"] += 2 * m * (a * a + b * b)
    out["precondition"] += 2 * (a * a * b + a * b * b)
    out["cube"] += a ** 3 + b ** 3
  return out


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
