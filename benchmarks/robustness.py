"""Do the defaults train? ``kfl.kfac`` + SGD-momentum and ``kfl.kfac_optimizer``
with default settings on small models of every supported framework.

    python benchmarks/robustness.py            # 10 models, lr 0.01/0.03/0.1, 300 steps
    python benchmarks/robustness.py --quick    # 3 models, lr 0.1, 30 steps (smoke run)
    python benchmarks/robustness.py --recipe   # the README recipe: norm_constraint=(0.01/lr)**2 above lr 0.01
    python benchmarks/robustness.py --kfac norm_constraint=None --kfac damping=1e-3
    python benchmarks/robustness.py --standardise --batch 32   # standardised inputs, small batches

scikit-learn's digits (1797 8x8 images, 10 classes), random batches of 128
(the same sequence for every optimizer), jitted (one ``lax.scan`` over the
steps, compiled once per model and optimizer: the learning rate is an
argument). The table gives the full-data loss after the last step for

* ``kfac lr=…``: ``optax.chain(kfl.kfac(loss_fn, batch), optax.sgd(lr,
  momentum=0.9))`` with the library's defaults (``--kfac KEY=VALUE``
  overrides one, for measuring an alternative);
* ``adam best``: the best final loss of ``optax.adam`` at lr 1e-3, 3e-3 and
  1e-2 (the lr in brackets);
* ``kfac_opt``: ``kfl.kfac_optimizer(loss_fn, batch)`` with its defaults.

A cell is marked ``!`` when the run is not finite or its final loss is not
below its target (it did not train): half the initial loss, or for the
language model the entropy of its targets' character frequencies. The models (plain JAX, Flax
linen, Flax nnx, Haiku, Equinox): an MLP, conv nets with and without
normalisation, an attention block, an LSTM, a ViT as Equinox's documentation
writes it, and a character LSTM language model as Haiku's RNN example writes
it (time-major, with the example's own loss); see ``MODELS``.
"""
from __future__ import annotations

import argparse
import ast
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import kfac_jax_lite as kfl

ADAM_LRS = (1e-3, 3e-3, 1e-2)


def digits():
  from sklearn.datasets import load_digits
  x, y = load_digits(return_X_y=True)
  return jnp.asarray(x / 16.0, jnp.float32), jnp.asarray(y, jnp.int32)


# --- models: build(key) -> (params, apply(params, x [N, 64]) -> logits) -----

def jax_mlp(key):
  sizes = (64, 128, 128, 10)
  keys = jax.random.split(key, len(sizes) - 1)
  params = [(jax.random.normal(k, (i, o)) / np.sqrt(i), jnp.zeros(o))
            for k, i, o in zip(keys, sizes[:-1], sizes[1:])]

  def apply(params, x):
    for i, (w, b) in enumerate(params):
      x = x @ w + b
      x = jnp.tanh(x) if i < len(params) - 1 else x
    return x
  return params, apply


def _image(x):
  return x.reshape(-1, 8, 8, 1)


def linen_cnn_layernorm(key):
  import flax.linen as nn

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.LayerNorm()(nn.Conv(16, (3, 3))(_image(x))))
      x = nn.relu(nn.LayerNorm()(nn.Conv(32, (3, 3), strides=2)(x)))
      return nn.Dense(10)(x.reshape(x.shape[0], -1))
  net = Net()
  return net.init(key, jnp.zeros((1, 64))), net.apply


def haiku_cnn(key):
  import haiku as hk

  def net(x):
    x = jax.nn.relu(hk.Conv2D(16, 3)(_image(x)))
    x = jax.nn.relu(hk.Conv2D(32, 3, stride=2)(x))
    return hk.Linear(10)(hk.Flatten()(x))
  fn = hk.without_apply_rng(hk.transform(net))
  return fn.init(key, jnp.zeros((1, 64))), fn.apply


def haiku_lstm(key):
  import haiku as hk

  def net(x):
    seq = jnp.swapaxes(x.reshape(-1, 8, 8), 0, 1)  # 8 rows as time steps.
    lstm = hk.LSTM(32)
    out, _ = hk.dynamic_unroll(lstm, seq, lstm.initial_state(x.shape[0]))
    return hk.Linear(10)(out[-1])
  fn = hk.without_apply_rng(hk.transform(net))
  return fn.init(key, jnp.zeros((1, 64))), fn.apply


def _equinox(model):
  import equinox as eqx
  params, static = eqx.partition(model, eqx.is_inexact_array)

  def apply(params, x):
    return jax.vmap(eqx.combine(params, static))(x)
  return params, apply


def equinox_mlp(key):
  import equinox as eqx
  return _equinox(eqx.nn.MLP(64, 10, 128, 2, activation=jax.nn.tanh, key=key))


def equinox_cnn_groupnorm(key):
  import equinox as eqx
  k1, k2, k3 = jax.random.split(key, 3)
  model = eqx.nn.Sequential([
      eqx.nn.Lambda(lambda x: x.reshape(1, 8, 8)),
      eqx.nn.Conv2d(1, 16, 3, padding=1, key=k1),
      eqx.nn.GroupNorm(4, 16), eqx.nn.Lambda(jax.nn.relu),
      eqx.nn.Conv2d(16, 32, 3, stride=2, padding=1, key=k2),
      eqx.nn.GroupNorm(4, 32), eqx.nn.Lambda(jax.nn.relu),
      eqx.nn.Lambda(jnp.ravel), eqx.nn.Linear(32 * 16, 10, key=k3)])
  return _equinox(model)


def nnx_attention(key):
  from flax import nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Linear(8, 32, rngs=rngs)
      self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (8, 32)))
      self.attn = nnx.MultiHeadAttention(num_heads=4, in_features=32,
                                         decode=False, rngs=rngs)
      self.norm1 = nnx.LayerNorm(32, rngs=rngs)
      self.mlp1 = nnx.Linear(32, 64, rngs=rngs)
      self.mlp2 = nnx.Linear(64, 32, rngs=rngs)
      self.norm2 = nnx.LayerNorm(32, rngs=rngs)
      self.head = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
      h = self.embed(x.reshape(-1, 8, 8)) + self.pos[...]
      h = self.norm1(h + self.attn(h))
      h = self.norm2(h + self.mlp2(jax.nn.gelu(self.mlp1(h))))
      return self.head(h.mean(axis=1))

  graphdef, params = nnx.split(Net(nnx.Rngs(int(jax.random.randint(
      key, (), 0, 2 ** 30)))))

  def apply(params, x):
    return nnx.merge(graphdef, params)(x)
  return params, apply


def equinox_vit(key):
  """The Vision Transformer of Equinox's documentation example (patch
  embedding by a ``Linear`` on flattened patches, a class token and a
  learned position embedding concatenated and added, pre-norm attention
  blocks of ``eqx.nn.MultiheadAttention`` and a GELU MLP, the head on the
  class token), at digits' size: 2x2 patches of the 8x8 image, width 32,
  2 blocks of 4 heads. Dropout is in inference mode (the batch carries no
  key)."""
  import equinox as eqx
  patch, width, heads, blocks = 2, 32, 4, 2
  n = (8 // patch) ** 2

  class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, key):
      k1, k2, k3 = jax.random.split(key, 3)
      self.norm1 = eqx.nn.LayerNorm(width)
      self.attn = eqx.nn.MultiheadAttention(heads, width, key=k1)
      self.norm2 = eqx.nn.LayerNorm(width)
      self.fc1 = eqx.nn.Linear(width, 2 * width, key=k2)
      self.fc2 = eqx.nn.Linear(2 * width, width, key=k3)

    def __call__(self, x):
      y = jax.vmap(self.norm1)(x)
      x = x + self.attn(y, y, y)
      y = jax.vmap(self.norm2)(x)
      return x + jax.vmap(self.fc2)(jax.nn.gelu(jax.vmap(self.fc1)(y)))

  class ViT(eqx.Module):
    embed: eqx.nn.Linear
    cls_token: jax.Array
    position: jax.Array
    blocks: list
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key):
      ks = jax.random.split(key, blocks + 4)
      self.embed = eqx.nn.Linear(patch * patch, width, key=ks[0])
      self.cls_token = jax.random.normal(ks[1], (1, width))
      self.position = jax.random.normal(ks[2], (n + 1, width))
      self.blocks = [Block(k) for k in ks[4:]]
      self.norm = eqx.nn.LayerNorm(width)
      self.head = eqx.nn.Linear(width, 10, key=ks[3])

    def __call__(self, x):                        # x: [64], one image
      p = x.reshape(8 // patch, patch, 8 // patch, patch)
      p = p.transpose(0, 2, 1, 3).reshape(n, patch * patch)
      x = jax.vmap(self.embed)(p)
      x = jnp.concatenate((self.cls_token, x), axis=0)
      x = x + self.position[:x.shape[0]]
      for block in self.blocks:
        x = block(x)
      return self.head(self.norm(x[0]))
  return _equinox(ViT(key))


def haiku_lstm_lm(key):
  """A character language model written as Haiku's RNN example writes it:
  a time-major batch ``[T, B]`` of character ids, one-hot inputs, an
  ``hk.DeepRNN`` of two LSTMs and an MLP, ``hk.dynamic_unroll``, and the
  example's own loss, ``-jnp.sum(one_hot(targets) * log_softmax(logits)) /
  (T * B)`` (recognised as the integer-label cross-entropy)."""
  import haiku as hk
  vocab = len(_chars().vocab)

  def net(tokens):                                 # [T, B] ids
    core = hk.DeepRNN([lambda t: jax.nn.one_hot(t, vocab), hk.LSTM(64),
                       jax.nn.relu, hk.LSTM(64), hk.nets.MLP([64, vocab])])
    logits, _ = hk.dynamic_unroll(core, tokens,
                                  core.initial_state(tokens.shape[1]))
    return logits
  fn = hk.without_apply_rng(hk.transform(net))
  return fn.init(key, jnp.zeros((LM_CONTEXT, 1), jnp.int32)), fn.apply


def _haiku_lm_loss(logits, targets):
  t, b = targets.shape
  log_probs = jax.nn.log_softmax(logits)
  one_hot = jax.nn.one_hot(targets, logits.shape[-1])
  return -jnp.sum(one_hot * log_probs) / (t * b)


LM_CONTEXT = 32


@functools.lru_cache(maxsize=1)
def _chars():
  import os
  import sys
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import _data
  return _data.load_text(200_000)


def char_windows():
  """Every ``LM_CONTEXT + 1``-character window of the corpus's first 200 000
  characters at a stride of 16: inputs and next-character targets."""
  ids = np.asarray(_chars().train)
  starts = np.arange(0, len(ids) - LM_CONTEXT - 1, 16)
  win = np.stack([ids[s:s + LM_CONTEXT + 1] for s in starts])
  return jnp.asarray(win[:, :-1], jnp.int32), jnp.asarray(win[:, 1:], jnp.int32)


MODELS = {
    "jax mlp": jax_mlp,
    "linen cnn+layernorm": linen_cnn_layernorm,
    "haiku cnn": haiku_cnn,
    "haiku lstm": haiku_lstm,
    "equinox mlp": equinox_mlp,
    "equinox cnn+groupnorm": equinox_cnn_groupnorm,
    "nnx attention": nnx_attention,
    # Issue 24: weight decay written into the loss (an L2 term the K-FAC
    # curvature does not model) on the Haiku conv net.
    "haiku cnn+wd": haiku_cnn,
    "equinox vit": equinox_vit,
    "haiku lstm lm": haiku_lstm_lm,
}
# Models whose loss adds ``WEIGHT_DECAY[name] / 2 · ‖θ‖²``.
WEIGHT_DECAY = {"haiku cnn+wd": 1e-3}
# Models trained on another task than digits' classification, with the
# loss their authors wrote (``loss(outputs, targets)``) and a time-major
# batch: ``(data, loss, time_major)``.
TASKS = {"haiku lstm lm": (char_windows, _haiku_lm_loss, True)}
QUICK_MODELS = ("jax mlp", "linen cnn+layernorm", "haiku cnn")


# --- training ----------------------------------------------------------------

def make_runner(kind, loss_fn, example, x_all, y_all, steps, batch_size,
                kfac_options, opt_options, time_major=False):
  """``run(params, lr, key, x_all, y_all) -> (final params, state)``, jitted,
  one scan of ``steps``. The data are arguments: closed over, XLA
  constant-folds the dataset's gathers for minutes."""
  if kind == "kfac":
    tx = optax.chain(kfl.kfac(loss_fn, example, **kfac_options),
                     optax.trace(decay=0.9))  # sgd(lr, momentum) = this · -lr.
  elif kind == "adam":
    tx = optax.with_extra_args_support(optax.scale_by_adam())
  else:
    tx = kfl.kfac_optimizer(loss_fn, example, **opt_options)

  @jax.jit
  def run(params, lr, key, x_all, y_all):
    def step(carry, k):
      params, state = carry
      idx = jax.random.choice(k, x_all.shape[0], (batch_size,), replace=False)
      batch = _batch(x_all[idx], y_all[idx], time_major)
      grads = jax.grad(loss_fn)(params, batch)
      updates, state = tx.update(grads, state, params, batch=batch)
      if kind != "kfac_opt":
        updates = jax.tree.map(lambda u: -lr * u, updates)
      return (optax.apply_updates(params, updates), state), None
    (params, state), _ = jax.lax.scan(step, (params, tx.init(params)),
                                      jax.random.split(key, steps))
    return params, state
  return run


def _batch(x, y, time_major):
  return {"x": x.T, "y": y.T} if time_major else {"x": x, "y": y}


def recipe_options(kfac_options, lr):
  """The README's recipe at learning rate ``lr``: the defaults at lr 0.01 and
  below, and above it ``norm_constraint=(0.01 / lr)**2`` (the lr 0.01 bound
  on the step's KL kept), unless ``kfac_options`` sets it."""
  if lr <= 0.01 or "norm_constraint" in kfac_options:
    return kfac_options
  return {**kfac_options, "norm_constraint": (0.01 / lr) ** 2}


def study(names, lrs, steps, batch_size, kfac_options, opt_options=None,
          seed=0, log=print, kinds=("kfac", "adam", "kfac_opt"), recipe=False,
          standardise=False):
  rows = []
  for name in names:
    params, apply = MODELS[name](jax.random.PRNGKey(seed))
    data, loss, time_major = TASKS.get(name, (digits, None, False))
    x_all, y_all = data()
    if standardise and data is digits:  # (x - mean) / (std + 1e-3) per pixel.
      x_all = (x_all - x_all.mean(0)) / (x_all.std(0) + 1e-3)
    if loss is None:
      loss = lambda z, y: kfl.softmax_cross_entropy_with_integer_labels(
          z, y).mean()
    wd = WEIGHT_DECAY.get(name, 0.0)

    def loss_fn(params, batch, apply=apply, wd=wd, loss=loss):
      loss = loss(apply(params, batch["x"]), batch["y"])
      if wd:
        loss = loss + 0.5 * wd * sum(
            jnp.vdot(p, p) for p in jax.tree.leaves(params))
      return loss

    full_jit = jax.jit(loss_fn)
    # The full data set's loss (at most its first 2048 examples).
    evaluation = _batch(x_all[:2048], y_all[:2048], time_major)
    full = lambda p, e=evaluation: full_jit(p, e)
    example = _batch(x_all[:batch_size], y_all[:batch_size], time_major)
    key = jax.random.PRNGKey(seed + 1)
    row = {"model": name, "initial": float(full(params))}
    # Trained: below half the initial loss, or for a language model below
    # the entropy of its targets' character frequencies (what a model that
    # learned nothing but those frequencies reaches).
    row["target"] = (_unigram_entropy(y_all) if name in TASKS
                     else 0.5 * row["initial"])
    t0 = time.perf_counter()
    for kind, kind_lrs in (("kfac", lrs), ("adam", ADAM_LRS), ("kfac_opt", (0.0,))):
      if kind not in kinds:
        continue
      runners = {}
      for lr in kind_lrs:
        options = (recipe_options(kfac_options, lr) if recipe and kind == "kfac"
                   else kfac_options)
        signature = repr(sorted(options.items()))
        if signature not in runners:
          runners[signature] = make_runner(
              kind, loss_fn, example, x_all, y_all, steps, batch_size,
              options, opt_options or {}, time_major)
        final, state = runners[signature](params, jnp.float32(lr), key,
                                          x_all, y_all)
        row[(kind, lr)] = float(full(final))
        if kind != "adam":
          row[(kind, lr, "health")] = str(kfl.health(state))
    row["seconds"] = time.perf_counter() - t0
    rows.append(row)
    log(f"  {name}: done in {row['seconds']:.0f}s; " + " ".join(
        f"{k[0]}@{k[1]:g}={v:.4f}" for k, v in row.items()
        if isinstance(k, tuple) and len(k) == 2), flush=True)
  return rows


def _unigram_entropy(targets):
  counts = np.bincount(np.asarray(targets).ravel())
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log(p)).sum())


def trained(row, value):
  return np.isfinite(value) and value < row["target"]


def print_table(rows, lrs, steps, show_health=False):
  cols = [f"kfac lr={lr:g}" for lr in lrs] + ["adam best", "kfac_opt"]
  print(f"\nfull-data loss after {steps} steps ('!': not finite or not below "
        "the target: half the initial loss, or for a language model the "
        "entropy of its targets' character frequencies)")
  print(f"{'model':<24}{'initial':>9}{'target':>9}"
        + "".join(f"{c:>16}" for c in cols))
  failures = 0
  for row in rows:
    cells = []
    for lr in lrs + [None, 0.0]:
      if (("adam", ADAM_LRS[0]) if lr is None else ("kfac" if lr else "kfac_opt", lr)) not in row:
        cells.append("-".rjust(16))
        continue
      if lr is None:
        best = min(ADAM_LRS, key=lambda a: np.nan_to_num(row[("adam", a)], nan=np.inf))
        value, text = row[("adam", best)], f"({best:g})"
      else:
        kind = "kfac" if lr else "kfac_opt"
        value, text = row[(kind, lr)], ""
        failures += not trained(row, value)
      mark = "" if trained(row, value) else "!"
      cells.append(f"{text}{value:.4f}{mark}".rjust(16))
    print(f"{row['model']:<24}{row['initial']:>9.4f}{row['target']:>9.4f}"
          + "".join(cells))
  if show_health:
    for row in rows:
      for key, value in row.items():
        if isinstance(key, tuple) and len(key) == 3:
          print(f"  {row['model']}, {key[0]} lr={key[1]:g}: {value}")
  return failures


def _parse_option(text):
  key, _, value = text.partition("=")
  try:
    value = ast.literal_eval(value)
  except (ValueError, SyntaxError):
    pass
  return key, value


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true",
                 help="3 models, lr 0.1, 30 steps: a smoke run")
  p.add_argument("--steps", type=int, help="default 300 (30 with --quick)")
  p.add_argument("--batch", type=int, default=128)
  p.add_argument("--lrs", type=float, nargs="+",
                 help="SGD learning rates after kfac (default 0.01 0.03 0.1)")
  p.add_argument("--models", nargs="+", choices=sorted(MODELS),
                 metavar="MODEL", help=f"any of {sorted(MODELS)}")
  p.add_argument("--kfac", action="append", default=[], metavar="KEY=VALUE",
                 help="override a kfl.kfac default, e.g. damping=1e-3")
  p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                 help="override a kfl.kfac_optimizer default")
  p.add_argument("--health", action="store_true",
                 help="also print kfl.health of every K-FAC run")
  p.add_argument("--recipe", action="store_true",
                 help="kfac at the README's recipe: the defaults at lr 0.01, "
                 "norm_constraint=(0.01/lr)**2 above it")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--standardise", action="store_true",
                 help="digits as (x - mean) / (std + 1e-3) per pixel (a rare "
                 "pixel becomes an input of ~20; the language model's "
                 "characters are left as they are)")
  p.add_argument("--kinds", nargs="+", default=["kfac", "adam", "kfac_opt"],
                 choices=["kfac", "adam", "kfac_opt"],
                 help="which optimizers to run (default all)")
  args = p.parse_args(argv)
  steps = args.steps or (30 if args.quick else 300)
  lrs = args.lrs or ([0.1] if args.quick else [0.01, 0.03, 0.1])
  names = args.models or (QUICK_MODELS if args.quick else tuple(MODELS))
  options = dict(_parse_option(o) for o in args.kfac)
  opt_options = dict(_parse_option(o) for o in args.opt)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; digits, batch "
        f"{args.batch}, {steps} steps, seed {args.seed}; kfac overrides: "
        f"{options or 'none (defaults)'}"
        f"{'; README recipe: norm_constraint=(0.01/lr)**2 above lr 0.01' if args.recipe else ''}"
        f"{'; digits standardised' if args.standardise else ''}"
        f"; kfac_optimizer overrides: "
        f"{opt_options or 'none (defaults)'}")
  rows = study(names, lrs, steps, args.batch, options, opt_options,
               seed=args.seed, kinds=args.kinds, recipe=args.recipe,
               standardise=args.standardise)
  failures = print_table(rows, lrs, steps, args.health)
  print(f"{failures} K-FAC run(s) did not train")
  return failures


if __name__ == "__main__":
  main()
