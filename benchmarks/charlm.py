"""Time to a target validation loss of a small GPT-style character model.

    python benchmarks/charlm.py            # 2 layers, width 128, context 128, batch 32, 100 s per run
    python benchmarks/charlm.py --quick    # 1 layer, width 32, context 32: a smoke run

The corpus is the Python documentation shipped with CPython in
``pydoc_data.topics`` (``_data.load_text``: ~465 000 characters of English
prose and code on Python 3.11, 94 symbols; the first 90% trains, the last
10% validates). The model is a pre-norm decoder-only transformer in plain
JAX: token and learned position embeddings, ``layers`` blocks of causal
multi-head self-attention (one fused ``qkv`` dense layer, an output
projection) and a 4x-wide GELU MLP, each behind a layer norm with a
learned scale and shift, a final layer norm and an untied dense read-out
(437 342 parameters at the default sizes); softmax cross-entropy of
the next character, averaged over all positions.

Training batches are windows at seeded random offsets; the evaluation
loss is the mean over 64 fixed, evenly spaced validation windows. As in
``autoencoder.py`` (see ``_harness``) every optimizer gets the same
training-clock budget at its best learning rate from a stated grid:
AdamW (optax's default weight decay 1e-4), Muon (Newton-Schulz on the
blocks' matrices; AdamW at ``adam_lr`` on the embeddings, read-out, norms
and biases, as modded-nanogpt does), SGD-momentum (for the step-time
ratio), ``kfl.kfac`` + SGD at the defaults and tuned,
``kfl.kfac_optimizer``, and ``kfl.eigen_adam`` with K-FAC's and with
Shampoo's basis (SOAP), with AdamW's weight decay, on its lr grid. The
target is AdamW's final validation loss.
Writes ``results/charlm.json`` and ``.png``.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import _data  # noqa: E402
import _harness as H  # noqa: E402
import _models as M  # noqa: E402
import _report  # noqa: E402

FULL = dict(layers=2, width=128, heads=4, context=128, batch=32)
QUICK = dict(layers=1, width=32, heads=2, context=32, batch=8)


def families(loss_fn, params, example, args):
  optax_family = H.optax_families(loss_fn, params, example, args.seed)

  q = args.quick
  out = [
      optax_family("adamw", "AdamW", {"lr": [3e-3] if q else [1e-3, 3e-3, 1e-2]},
                   lambda lr: optax.adamw(lr), note="weight decay 1e-4"),
      optax_family("sgd", "SGD-momentum", {"lr": [0.3] if q else [0.1, 0.3, 1.0]},
                   lambda lr: optax.sgd(lr, momentum=0.9), note="momentum 0.9"),
  ]
  out += H.muon_families(
      optax_family, [0.02] if q else [0.01, 0.03, 0.1], 3e-3,
      "Newton-Schulz on the blocks' matrices, AdamW(adam_lr) on the rest",
      dims=M.charlm_muon_dims)
  out += [
      *H.kfac_families(optax_family, loss_fn, example,
                       [0.03] if q else [0.01, 0.03, 0.1],
                       [0.1] if q else [1e-2, 1e-1, 1.0],
                       [0.1] if q else [0.03, 0.1], args.kfac_style),
      # Issue 26: Adam in the factors' eigenbasis, K-FAC's and Shampoo's
      # (SOAP); Adam's lr grid (README Results: where it pays).
      *H.eigen_adam_families(optax_family, loss_fn, example,
                             [3e-3] if q else [1e-3, 3e-3, 1e-2],
                             args.kfac_style,
                             weight_decay=1e-4),
  ]
  # Issue 25: the amortisation presets at the defaults' best lr (README
  # Results), one setting moved at a time.
  out.append(H.amortised_family(loss_fn, params, example, 3e-2,
                                args.kfac_style, args.seed))
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  H.add_common_args(p)
  for name, value in FULL.items():
    p.add_argument(f"--{name}", type=int, default=None,
                   help=f"default {value} (quick: {QUICK[name]})")
  p.add_argument("--max-chars", type=int, default=None,
                 help="use only the corpus's first characters (quick: 20000)")
  p.add_argument("--kfac-style", choices=("1-pass", "batch="), default="1-pass")
  args = H.finish_args(p.parse_args(argv))
  sizes = {k: getattr(args, k) or (QUICK if args.quick else FULL)[k]
           for k in FULL}
  if sizes["width"] % sizes["heads"]:
    raise SystemExit("--width must be a multiple of --heads")
  text = _data.load_text(args.max_chars or (20000 if args.quick else None))
  t = sizes["context"]
  if len(text.valid) < t + 1:
    raise SystemExit(f"the validation split ({len(text.valid)} chars) is "
                     f"shorter than one window of {t + 1}")
  train_ids = jnp.asarray(text.train)
  starts = np.linspace(0, len(text.valid) - t - 1, 64).astype(np.int32)
  valid = np.stack([text.valid[s:s + t + 1] for s in starts])
  valid = {"x": jnp.asarray(valid[:, :-1]), "y": jnp.asarray(valid[:, 1:])}
  params = M.charlm_init(len(text.vocab), sizes["layers"], sizes["width"], t,
                       jax.random.PRNGKey(args.seed))
  n_params = sum(x.size for x in jax.tree.leaves(params))
  loss_fn = M.make_charlm_loss(sizes["heads"])
  env = H.environment(
      args, text.source,
      f"GPT-style char LM: {sizes['layers']} layers, width {sizes['width']}, "
      f"{sizes['heads']} heads, context {t}, vocab {len(text.vocab)} "
      f"({n_params} parameters), batch {sizes['batch']} windows; validation "
      f"loss on {len(starts)} fixed windows")

  @jax.jit
  def take(ids, offsets):
    w = jax.vmap(lambda s: jax.lax.dynamic_slice(ids, (s,), (t + 1,)))(offsets)
    return {"x": w[:, :-1], "y": w[:, 1:]}

  def batches():
    rng = np.random.default_rng(args.seed + 1)
    while True:
      yield take(train_ids, rng.integers(0, len(text.train) - t - 1,
                                         sizes["batch"]).astype(np.int32))

  example = next(batches())
  fams = families(loss_fn, params, example, args)
  cands, grids = H.candidates(fams, args)
  H.print_grids(grids, fams)

  @jax.jit
  def evaluate(params):
    return {"loss": loss_fn(params, valid)}

  metrics = [H.Metric("loss", "val loss", "min")]
  return _report.run_and_report("charlm", cands, batches, evaluate, args,
                                env, grids, metrics, "AdamW")


if __name__ == "__main__":
  main()
