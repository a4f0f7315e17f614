"""Before/after of the update's "rest" (finiteness checks, clipping, guard)
and of ``accumulate``, interleaved in one process on the MNIST
autoencoder's shapes (batch 1000): the 5c05fb3 versions of
``all_finite``, ``clip`` and ``guard`` are restated here verbatim.

    python benchmarks/update_rest_before_after.py [--quick] [--reps N]
"""
import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _models as M  # noqa: E402
import _timing as T  # noqa: E402
from _harness import kfl  # noqa: E402
from kfac_jax_lite.blocks import _kron  # noqa: E402
from kfac_jax_lite import factor as fac  # noqa: E402
from kfac_jax_lite.optimizers import transform  # noqa: E402

loss_fn = M.autoencoder_loss  # The autoencoder's loss, as step_time.py's.


def old_all_finite(tree):
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def old_clip(updates, grad_leaves, norm_constraint, dtype):
  inner = sum(jnp.vdot(u.astype(dtype), g.astype(dtype))
              for u, g in zip(updates, grad_leaves))
  scale = jnp.where(inner > 0, jnp.sqrt(norm_constraint / jnp.where(
      inner > 0, inner, 1)), 1.0)
  scale = jnp.minimum(1.0, scale)
  return [(u * scale).astype(u.dtype) for u in updates]


def old_guard(updates, grad_leaves, damping_ok):
  grads_ok = old_all_finite(grad_leaves)
  update_ok = old_all_finite(updates)
  good = grads_ok & damping_ok
  out = [jnp.where(good, jnp.where(update_ok, u, g), jnp.zeros_like(g))
         for u, g in zip(updates, grad_leaves)]
  return out, grads_ok, update_ok


def old_rest(u, g, p):
  out, a, b = old_guard(old_clip(u, g, 1.0, jnp.float32), g, jnp.asarray(True))
  return out, a, b, old_all_finite(p)


def new_rest(u, g, p):
  out, a, b = transform.guard(u, g, jnp.asarray(True),
                              transform.clip(u, g, 1.0, jnp.float32))
  return out, a, b, fac.all_finite(p)


def accumulate_with(check):
  def acc(states, stats):
    out = {}
    for name, st in states.items():
      ok = check(stats[name])
      out[name] = _kron.KroneckerState(
          a=fac.update_cov_if(st.a, stats[name].a, 0.95, 1.0, ok),
          g=fac.update_cov_if(st.g, stats[name].g, 0.95, 1.0, ok))
    return out
  return acc


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--quick", action="store_true")
  p.add_argument("--reps", type=int, default=15)
  args = p.parse_args()
  dims = M.AUTOENCODER_SMALL if args.quick else M.AUTOENCODER
  params, batch = M.random_problem(dims, 1000)
  est = jax.jit(kfl.value_grad_and_stats(loss_fn, params, batch))(
      params, batch, jax.random.PRNGKey(0))
  kfac = kfl.kfac(loss_fn, batch)
  states = kfac.init(params).blocks
  g = jax.tree.leaves(est.grads)
  u = [1.5 * x for x in g]
  pl = jax.tree.leaves(params)
  cases = [("rest (clip, guard, all_finite(params)) before", old_rest, (u, g, pl)),
           ("rest (clip, guard, all_finite(params)) after", new_rest, (u, g, pl)),
           ("accumulate before", accumulate_with(old_all_finite), (states, est.stats)),
           ("accumulate after", accumulate_with(fac.all_finite), (states, est.stats))]
  comp = []
  for name, fn, a in cases:
    jax.clear_caches()  # Each case compiles as in a fresh process.
    t0 = time.perf_counter()
    c = jax.jit(fn).lower(*a).compile()
    comp.append((c, a, time.perf_counter() - t0, c.as_text().count(" fusion(")))
  medians = T.median_times([(name, c, a) for (name, _, _), (c, a, _, _) in
                          zip(cases, comp)], args.reps)
  print(f"model {'-'.join(map(str, dims))}, batch 1000; median of {args.reps}, round-robin")
  print(f"  {'piece':<48}{'ms':>8}{'fusions':>9}{'XLA s':>8}")
  for (name, _, _), t, (_, _, xla, nf) in zip(cases, medians, comp):
    print(f"  {name:<48}{1e3 * t:>8.2f}{nf:>9}{xla:>8.2f}")


if __name__ == "__main__":
  main()
