"""Real sizes (issue 47.3): a ResNet-50-shaped Flax conv net at the defaults.

The model: a ResNet v1.5 with bottleneck blocks (stages of 3, 4, 6 and 3
blocks; 1x1, 3x3 and 1x1 convolutions without bias, each followed by a
BatchNorm in training mode; a 7x7 stem and a max pool; a projection on the
residual where the shape changes; global mean pool; a 1000-way dense
head), the architecture of Flax's ImageNet example, 25.6M parameters. Its
loss is that example's: softmax cross-entropy of one-hot labels plus
``1e-4 · ½‖w‖²`` over the kernels, with the BatchNorm statistics passed in
the batch and returned as aux (``has_aux=True``). Inputs are batch 8 at
224x224, standardised Gaussian images and uniform labels: nothing here
learns ImageNet; the script measures sizes and times.

Printed, for K-FAC + SGD at the defaults (the README's one-pass step),
SGD with momentum (lr 0.1, the ResNet recipe's) and AdamW (lr 1e-3):

* the parameters' bytes and the K-FAC state's (``jax.eval_shape`` of
  ``tx.init``: nothing allocated), also with the size policy off
  (``max_dense_side=None``: what it was before issue 47);
* ``kfl.describe``'s time and its plan;
* the first step (init, trace, compile, run once) and the median and mean
  step after it over ``--steps`` steps;
* the training loss after them (the last five steps' mean: random labels,
  so only a check that nothing diverged).

Usage: ``python benchmarks/resnet.py [--steps 20] [--no-train] [--quick]``
(``--quick``: one bottleneck block per stage at width 16, 64x64 inputs,
10 classes).
"""
from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

from _kfl import kfl
from _sizes import (describe_and_state, footer, gib, nbytes, policy,
                    timed_run)

WEIGHT_DECAY = 1e-4


class Bottleneck(nn.Module):
  """1x1 (``width``), 3x3 (``width``, ``stride``), 1x1 (``4·width``), each
  with a BatchNorm; the residual projected (1x1 conv + BatchNorm) when its
  shape changes; ReLU after the sum."""
  width: int
  stride: int = 1

  @nn.compact
  def __call__(self, x):
    norm = functools.partial(nn.BatchNorm, use_running_average=False,
                             momentum=0.9, epsilon=1e-5)
    conv = functools.partial(nn.Conv, use_bias=False)
    y = nn.relu(norm()(conv(self.width, (1, 1))(x)))
    y = nn.relu(norm()(conv(self.width, (3, 3), self.stride)(y)))
    y = norm(scale_init=nn.initializers.zeros)(conv(4 * self.width,
                                                     (1, 1))(y))
    if x.shape != y.shape:
      x = norm(name="proj_norm")(conv(4 * self.width, (1, 1), self.stride,
                                      name="proj_conv")(x))
    return nn.relu(x + y)


class ResNet(nn.Module):
  stages: tuple
  width: int
  classes: int

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(self.width, (7, 7), 2, padding=[(3, 3), (3, 3)],
                use_bias=False)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9,
                             epsilon=1e-5)(x))
    x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    for i, blocks in enumerate(self.stages):
      for j in range(blocks):
        x = Bottleneck(self.width * 2 ** i,
                       stride=2 if i > 0 and j == 0 else 1)(x)
    return nn.Dense(self.classes)(jnp.mean(x, axis=(1, 2)))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--steps", type=int, default=20)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--no-train", action="store_true",
                  help="only the state's bytes and describe's time")
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--side-block", type=int, default=None,
                  help="partition the factor sides over this into equal "
                  "diagonal blocks (a Kronecker block's side_block; "
                  "default: whole sides)")
  ap.add_argument("--max-dense-side", type=int, default=None,
                  help="the size policy's limit for the conv and dense "
                  "layers (default: kfl.blocks.MAX_DENSE_SIDE)")
  args = ap.parse_args(argv)
  blocks = policy(("conv", "dense"), args.max_dense_side,
                  args.side_block)
  stages, width, classes, side = (((1, 1, 1, 1), 16, 10, 64) if args.quick
                                  else ((3, 4, 6, 3), 64, 1000, 224))
  model = ResNet(stages, width, classes)
  rng = np.random.default_rng(0)

  def make_batch():
    x = rng.standard_normal((args.batch, side, side, 3)).astype(np.float32)
    y = rng.integers(0, classes, args.batch).astype(np.int32)
    return jnp.asarray(x), jnp.asarray(y)

  x0, y0 = make_batch()
  variables = jax.jit(model.init)(jax.random.PRNGKey(0), x0)
  params, batch_stats = variables["params"], variables["batch_stats"]

  def loss_fn(params, batch):
    logits, updates = model.apply(
        {"params": params, "batch_stats": batch["batch_stats"]}, batch["x"],
        mutable=["batch_stats"])
    ce = optax.softmax_cross_entropy(
        logits, jax.nn.one_hot(batch["y"], classes)).mean()
    l2 = sum(jnp.sum(w ** 2) for w in jax.tree.leaves(params) if w.ndim > 1)
    return ce + WEIGHT_DECAY * 0.5 * l2, updates["batch_stats"]

  example = {"x": x0, "y": y0, "batch_stats": batch_stats}
  pbytes = nbytes(params)
  print(f"model: ResNet stages {stages}, width {width}, {classes} classes, "
        f"{side}x{side} inputs, batch {args.batch}; "
        f"{sum(x.size for x in jax.tree.leaves(params)) / 1e6:.1f}M params, "
        f"{gib(pbytes)}; JAX {jax.__version__}, "
        f"{jax.devices()[0].platform}; max_dense_side "
        f"{args.max_dense_side or kfl.blocks.MAX_DENSE_SIDE}", flush=True)
  t_describe, sizes = describe_and_state(loss_fn, params, example,
                                         ("conv", "dense"), blocks,
                                         has_aux=True)

  if args.no_train:
    return

  def run(label, make_tx, one_pass):
    tx = make_tx()
    p = jax.tree.map(jnp.copy, params)
    stats = jax.tree.map(jnp.copy, batch_stats)
    t0 = time.perf_counter()
    state = tx.init(p)
    if one_pass:
      est_fn = kfl.value_grad_and_stats(loss_fn, p, example, has_aux=True,
                                        blocks=blocks)

      @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
      def step(p, state, stats, x, y, key):
        batch = {"x": x, "y": y, "batch_stats": stats}
        est = est_fn(p, batch, key, with_stats=kfl.stats_due(state))
        u, state = tx.update(est.grads, state, p, stats=est.stats,
                             loss=est.loss)
        return optax.apply_updates(p, u), state, est.aux, est.loss
    else:
      @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
      def step(p, state, stats, x, y, key):
        del key
        batch = {"x": x, "y": y, "batch_stats": stats}
        (loss, stats), g = jax.value_and_grad(loss_fn, has_aux=True)(
            p, batch)
        u, state = tx.update(g, state, p)
        return optax.apply_updates(p, u), state, stats, loss
    carry = [p, state, stats]

    def one_step(i):
      x, y = make_batch()
      p, state, stats, loss = jax.block_until_ready(
          step(*carry, x, y, jax.random.PRNGKey(i)))
      carry[:] = [p, state, stats]
      return loss, state
    return timed_run(label, args.steps, t0, one_step)

  runs = [run("sgd momentum lr 0.1", lambda: optax.sgd(0.1, momentum=0.9),
              False),
          run("adamw lr 1e-3", lambda: optax.adamw(1e-3), False),
          run("kfac + sgd lr 0.01 (defaults)",
              lambda: optax.chain(kfl.kfac(loss_fn, example, has_aux=True,
                                           blocks=blocks),
                                  optax.sgd(0.01, momentum=0.9)), True)]
  sgd, adamw = runs[0], runs[1]
  print()
  print("| run | first step | x SGD | x AdamW | mean step | x SGD | x AdamW "
        f"| loss after {args.steps} steps (last 5) |")
  print("|---|---|---|---|---|---|---|---|")
  for r in runs:
    print(f"| {r['label']} | {r['first']:.1f} s | "
          f"{r['first'] / sgd['first']:.2f}x | "
          f"{r['first'] / adamw['first']:.2f}x | {r['mean']:.3f} s | "
          f"{r['mean'] / sgd['mean']:.2f}x | "
          f"{r['mean'] / adamw['mean']:.2f}x | {r['loss']:.4f} |")
  footer(sizes, pbytes, t_describe, runs[2]["state"])


if __name__ == "__main__":
  main()
