"""Real sizes (issue 47): a GPT-2-small-shaped decoder at the defaults.

The model: a Flax linen decoder with 12 unscanned pre-LayerNorm blocks,
width 768, 12 heads, context 128, learned positions, vocabulary 50257 and
an untied output head (162M parameters), trained on byte ids of real text
(this repository's Markdown and Python files) as tokens, batch 4 x 128,
with ``optax.softmax_cross_entropy_with_integer_labels``. ``--small`` is
the same at width 384, 6 blocks, vocabulary 8192 (17M parameters).

Printed, for K-FAC + SGD at the defaults (the README's one-pass step) and
AdamW (lr 1e-3 and 3e-4):

* the parameters' bytes and the K-FAC state's (``jax.eval_shape`` of
  ``tx.init``: nothing allocated), also with the size policy off
  (``max_dense_side=None``: what the state was before issue 47);
* ``kfl.describe``'s time;
* the first step (build, trace, compile, run once) and the median and
  mean step after it over ``--steps`` steps (a refresh period at the plan);
* the loss at equal steps.

Usage: ``python benchmarks/sizes.py [--small] [--steps 30] [--no-train]``.
"""
from __future__ import annotations

import argparse
import functools
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

from _kfl import kfl
from _sizes import (describe_and_state, footer, gib, nbytes, policy,
                    timed_run)


class Block(nn.Module):
  width: int
  heads: int

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    h = nn.SelfAttention(num_heads=self.heads, qkv_features=self.width,
                         deterministic=True)(
        h, mask=nn.make_causal_mask(jnp.ones(x.shape[:2])))
    x = x + h
    h = nn.LayerNorm()(x)
    h = nn.Dense(4 * self.width)(h)
    h = nn.Dense(self.width)(nn.gelu(h))
    return x + h


class Decoder(nn.Module):
  vocab: int
  width: int
  depth: int
  heads: int
  context: int

  @nn.compact
  def __call__(self, ids):
    x = nn.Embed(self.vocab, self.width)(ids)
    pos = nn.Embed(self.context, self.width)(jnp.arange(ids.shape[1]))
    x = x + pos[None]
    for _ in range(self.depth):
      x = Block(self.width, self.heads)(x)
    return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def text_batches(batch, context, seed=0):
  """Byte ids of this repository's text files, as ``[batch, context + 1]``
  windows at random offsets."""
  root = pathlib.Path(__file__).resolve().parents[1]
  data = b"".join(p.read_bytes() for p in sorted(root.rglob("*"))
                  if p.suffix in (".md", ".py") and ".git" not in p.parts)
  ids = np.frombuffer(data, np.uint8).astype(np.int32)
  rng = np.random.default_rng(seed)
  while True:
    at = rng.integers(0, len(ids) - context - 1, batch)
    yield np.stack([ids[i:i + context + 1] for i in at])


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--small", action="store_true")
  ap.add_argument("--steps", type=int, default=30)
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--no-train", action="store_true",
                  help="only the state's bytes and describe's time")
  ap.add_argument("--side-block", type=int, default=None,
                  help="partition the factor sides over this into equal "
                  "diagonal blocks (a Kronecker block's side_block; "
                  "default: whole sides)")
  ap.add_argument("--max-dense-side", type=int, default=None,
                  help="the size policy's limit for the dense and "
                  "embedding layers (default: kfl.blocks.MAX_DENSE_SIDE)")
  ap.add_argument("--kfac-lrs", default="0.01,0.03",
                  help="K-FAC + SGD learning rates (comma-separated)")
  ap.add_argument("--adamw-lrs", default="1e-3,3e-4",
                  help="AdamW learning rates (comma-separated)")
  ap.add_argument("--kfac-only", action="store_true",
                  help="train only the K-FAC runs (no AdamW reference)")
  args = ap.parse_args()
  blocks = policy(("dense", "embedding"), args.max_dense_side,
                  args.side_block)
  vocab, width, depth, heads = ((8192, 384, 6, 6) if args.small
                                else (50257, 768, 12, 12))
  context = 128
  model = Decoder(vocab, width, depth, heads, context)
  stream = text_batches(args.batch, context)
  first = next(stream)
  example = {"ids": jnp.asarray(first[:, :-1]), "y": jnp.asarray(first[:, 1:])}
  params = jax.jit(model.init)(jax.random.PRNGKey(0), example["ids"])

  def loss_fn(params, batch):
    logits = model.apply(params, batch["ids"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["y"]).mean()

  pbytes = nbytes(params)
  print(f"model: vocab {vocab}, width {width}, depth {depth}, heads {heads}, "
        f"context {context}, batch {args.batch}; "
        f"{sum(x.size for x in jax.tree.leaves(params)) / 1e6:.1f}M params, "
        f"{gib(pbytes)}; JAX {jax.__version__}, {jax.devices()[0].platform}; "
        f"max_dense_side {args.max_dense_side or kfl.blocks.MAX_DENSE_SIDE}, "
        f"side_block {args.side_block}")
  t_describe, sizes = describe_and_state(loss_fn, params, example,
                                         ("dense", "embedding"), blocks)

  if args.no_train:
    return

  def run(label, make_tx, one_pass):
    tx = make_tx()
    p = jax.tree.map(jnp.copy, params)
    t0 = time.perf_counter()
    state = tx.init(p)
    if one_pass:
      est_fn = kfl.value_grad_and_stats(loss_fn, p, example, blocks=blocks)

      @functools.partial(jax.jit, donate_argnums=(0, 1))
      def step(p, state, batch, key):
        est = est_fn(p, batch, key, with_stats=kfl.stats_due(state))
        u, state = tx.update(est.grads, state, p, stats=est.stats,
                             loss=est.loss)
        return optax.apply_updates(p, u), state, est.loss
    else:
      @functools.partial(jax.jit, donate_argnums=(0, 1))
      def step(p, state, batch, key):
        del key
        loss, g = jax.value_and_grad(loss_fn)(p, batch)
        u, state = tx.update(g, state, p)
        return optax.apply_updates(p, u), state, loss
    stream = text_batches(args.batch, context)
    carry = [p, state]

    def one_step(i):
      b = next(stream)
      batch = {"ids": jnp.asarray(b[:, :-1]), "y": jnp.asarray(b[:, 1:])}
      p, state, loss = jax.block_until_ready(
          step(*carry, batch, jax.random.PRNGKey(i)))
      carry[:] = [p, state]
      return loss, state
    return timed_run(label, args.steps, t0, one_step)

  kfac = lambda lr: lambda: optax.chain(
      kfl.kfac(loss_fn, example, blocks=blocks), optax.sgd(lr, momentum=0.9))
  runs = [] if args.kfac_only else [
      run(f"adamw lr {lr}", lambda lr=lr: optax.adamw(float(lr)), False)
      for lr in args.adamw_lrs.split(",")]
  runs += [run(f"kfac + sgd lr {lr} (defaults)", kfac(float(lr)), True)
           for lr in args.kfac_lrs.split(",")]
  ref = runs[0]  # AdamW lr 1e-3, or the first K-FAC run with --kfac-only.
  print()
  print(f"| run | first step | x {ref['label']} | mean step | x "
        f"{ref['label']} | loss at {args.steps} steps (last 5) |")
  print("|---|---|---|---|---|---|")
  for r in runs:
    print(f"| {r['label']} | {r['first']:.1f} s | "
          f"{r['first'] / ref['first']:.2f}x | {r['mean']:.3f} s | "
          f"{r['mean'] / ref['mean']:.2f}x | {r['loss']:.4f} |")
  footer(sizes, pbytes, t_describe,
         next(r for r in runs if r["label"].startswith("kfac"))["state"])


if __name__ == "__main__":
  main()
