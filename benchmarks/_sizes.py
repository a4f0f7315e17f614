"""What ``sizes.py`` and ``resnet.py`` (issue 47's real sizes) share: the
state's bytes with and without the size policy, ``describe``'s time, and
a timed run of a jitted step with its first step (init, trace, compile)
on the clock."""
from __future__ import annotations

import statistics
import time

import jax
import numpy as np

from _kfl import kfl


def nbytes(tree):
  """Bytes of a pytree's leaves (arrays or ``ShapeDtypeStruct``s)."""
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def gib(n):
  return f"{n / 2**30:.2f} GiB"


def policy(kinds, max_dense_side, side_block=None):
  """``blocks=`` moving the size policy's limit for the layer ``kinds``
  and partitioning their sides by ``side_block`` (None where both are
  None: the defaults)."""
  options = {k: v for k, v in (("max_dense_side", max_dense_side),
                               ("side_block", side_block)) if v is not None}
  return {k: dict(options) for k in kinds} if options else None


def describe_and_state(loss_fn, params, example, kinds, blocks=None,
                       **options):
  """Prints ``kfl.describe``'s time, its bytes, price and plan lines, and
  the K-FAC state's bytes (``jax.eval_shape(tx.init)``: nothing allocated)
  at the size policy of ``blocks`` (None: the default limit) and with it
  off for the layer ``kinds`` (``max_dense_side=None``); a state
  ``tx.init`` refuses is said so. Returns ``(describe seconds, {policy
  name: bytes})``; the first policy is named ``"policy (default)"`` even
  where ``blocks`` moves the limit (the header says which)."""
  pbytes = nbytes(params)
  t = time.perf_counter()
  table = kfl.describe(loss_fn, params, example, blocks=blocks, **options)
  t_describe = time.perf_counter() - t
  print(f"describe: {t_describe:.1f} s")
  print("\n".join(l for l in str(table).splitlines()
                  if "blocks," in l or l.startswith(("step price", "plan"))))
  sizes = {}
  for name, chosen in (("policy (default)", blocks),
                       ("no policy", {k: {"max_dense_side": None}
                                      for k in kinds})):
    tx = kfl.kfac(loss_fn, example, blocks=chosen, **options)
    try:
      sizes[name] = nbytes(jax.eval_shape(tx.init, params))
      print(f"K-FAC state, {name}: {gib(sizes[name])} = "
            f"{sizes[name] / pbytes:.2f}x the parameters", flush=True)
    except ValueError as e:
      print(f"K-FAC state, {name}: tx.init refuses: {str(e)[:160]}...")
  return t_describe, sizes


def timed_run(label, steps, start, one_step):
  """Times ``one_step(i)`` (runs step ``i``, blocks on it, returns its loss
  and the optimizer state) for ``i < steps``; the first step's time counts
  from ``start`` (before ``tx.init``: a user's first step). Prints and
  returns the first, median and mean step (after the first) and the last
  five losses' mean."""
  times, losses, state = [], [], None
  for i in range(steps):
    t = time.perf_counter()
    loss, state = one_step(i)
    times.append(time.perf_counter() - t + (t - start if i == 0 else 0.0))
    losses.append(float(loss))
  rest = times[1:] or times
  out = dict(label=label, first=times[0], median=statistics.median(rest),
             mean=statistics.fmean(rest), loss=float(np.mean(losses[-5:])),
             state=state)
  print(f"{label:<30} first step {out['first']:6.1f} s  median "
        f"{out['median']:.3f} s  mean {out['mean']:.3f} s  loss (last 5) "
        f"{out['loss']:.4f}", flush=True)
  return out


def footer(sizes, pbytes, t_describe, kfac_state):
  """The summary line (the default policy's state, describe's time) and
  ``kfl.health`` of the K-FAC run's state."""
  state = sizes.get("policy (default)", 0)
  print(f"\nstate: {gib(state)} ({state / pbytes:.2f}x params); "
        f"describe {t_describe:.1f} s")
  print(kfl.health(kfac_state))
