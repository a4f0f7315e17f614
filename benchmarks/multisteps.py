"""Gradient accumulation with K-FAC (issue 37): ``optax.MultiSteps``
around ``optax.chain(kfl.kfac(...), optax.sgd(...))`` against the
accumulation pattern of the README (the micro-batches' gradients summed in
one ``lax.scan``, then one K-FAC update on the last micro-batch).

``optax.MultiSteps`` runs its inner update, statistics pass and refresh
included, on every micro-step and keeps its result only on the last
(``jnp.where`` over the inner state): k K-FAC steps of work for one. Since
issue 48.6 every K-FAC entry refuses it at ``init`` (the line says so); the
4.3-5.8x it cost before is in ``results/multisteps.txt``.
Reported: the time of k micro-steps of each, against k SGD micro-steps
(MultiSteps around SGD) and one K-FAC step, on an MLP 64-256-256-10,
micro-batch 128, k = 4, CPU.

    PYTHONPATH=src python benchmarks/multisteps.py [--quick]
"""
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import kfac_jax_lite as kfl


def _setup(width, batch, k):
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  sizes = (64, width, width, 10)
  params = {f"w{i}": jax.random.normal(keys[i], (a, b)) / np.sqrt(a)
            for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))}
  x = jax.random.normal(keys[3], (k, batch, 64))
  y = jnp.argmax(x[..., :10], -1)

  def loss_fn(p, b):
    h = b[0]
    for i in range(3):
      h = h @ p[f"w{i}"]
      h = jnp.tanh(h) if i < 2 else h
    return optax.softmax_cross_entropy_with_integer_labels(h, b[1]).mean()
  return params, (x, y), loss_fn


def _timed(fn, reps):
  fn()  # Compile.
  out = []
  for _ in range(reps):
    t = time.perf_counter()
    fn()
    out.append(time.perf_counter() - t)
  return float(np.median(out))


def main(argv=()):
  quick = "--quick" in argv
  width, batch, k, reps = (16, 8, 2, 2) if quick else (256, 128, 4, 20)
  params, (xs, ys), loss_fn = _setup(width, batch, k)
  micro = [(xs[i], ys[i]) for i in range(k)]
  kfac = lambda: kfl.kfac(loss_fn, micro[0])
  sgd = lambda: optax.sgd(0.01, momentum=0.9)

  def multisteps(inner, pass_batch):
    tx = optax.MultiSteps(inner, every_k_schedule=k)
    state = tx.init(params)
    kw = (lambda b: {"batch": b}) if pass_batch else (lambda b: {})
    step = jax.jit(lambda p, s, b: tx.update(jax.grad(loss_fn)(p, b), s, p,
                                             **kw(b)))

    def run():
      s = state
      for b in micro:
        u, s = step(params, s, b)
      jax.block_until_ready(u)
    return run

  try:
    t_multi_kfac = _timed(multisteps(optax.chain(kfac(), sgd()), True), reps)
  except ValueError as e:  # Refused at init (issue 48.6).
    t_multi_kfac = None
    refused = str(e).split(" would ")[0]
  t_multi_sgd = _timed(multisteps(sgd(), False), reps)

  tx = optax.chain(kfac(), sgd())
  state = tx.init(params)

  @jax.jit
  def accumulate(p, s, xs, ys):  # The README's pattern.
    def one(acc, b):
      return jax.tree.map(jnp.add, acc, jax.grad(loss_fn)(p, b)), None
    grads, _ = jax.lax.scan(one, jax.tree.map(jnp.zeros_like, p), (xs, ys))
    grads = jax.tree.map(lambda g: g / k, grads)
    s = kfl.with_batch(s, (xs[-1], ys[-1]))
    return tx.update(grads, s, p)
  t_acc = _timed(lambda: jax.block_until_ready(
      accumulate(params, state, xs, ys)[0]), reps)
  one_kfac = jax.jit(lambda p, s, b: tx.update(jax.grad(loss_fn)(p, b), s, p,
                                               batch=b))
  t_one = _timed(lambda: jax.block_until_ready(
      one_kfac(params, state, micro[0])[0]), reps)
  floor = t_multi_sgd + t_one
  lines = [
      f"k={k} micro-steps, micro-batch {batch}, MLP 64-{width}-{width}-10, "
      f"{jax.devices()[0].platform}, median of {reps}",
      f"MultiSteps(sgd):                 {1e3 * t_multi_sgd:8.2f} ms",
      f"one K-FAC step:                  {1e3 * t_one:8.2f} ms",
      (f"MultiSteps(kfac+sgd):            refused: {refused}"
       if t_multi_kfac is None else
       f"MultiSteps(kfac+sgd):            {1e3 * t_multi_kfac:8.2f} ms "
       f"({t_multi_kfac / floor:.2f}x of MultiSteps(sgd) + one K-FAC step)"),
      f"accumulation pattern (README):   {1e3 * t_acc:8.2f} ms "
      f"({t_acc / floor:.2f}x)",
  ]
  print("\n".join(lines))
  return lines


if __name__ == "__main__":
  main(sys.argv[1:])
