"""kfl.influence against kronfluence 1.0.1: same weights, same data, same scores.

    /work/torchvenv/bin/python benchmarks/kronfluence_compare.py          # full
    /work/torchvenv/bin/python benchmarks/kronfluence_compare.py --quick  # smaller

torch is not a dependency of this library: run it from a virtualenv with
``pip install kronfluence`` (which pulls torch) plus ``jax``/``optax`` and
this library (``PYTHONPATH=src:benchmarks`` or ``pip install -e .
--no-deps``). Without kronfluence the script says so and exits.

Three parts, each printed as a table:

1. **Agreement** (float64 on both sides). A 64-32-10 tanh MLP and a small
   conv net (3x3 conv, 1->4 channels, tanh, then dense 144->10) on
   scikit-learn's 8x8 digits, trained briefly in JAX; the same weights are
   copied into PyTorch twins. ``"kfac"`` and ``"ekfac"``, the empirical
   Fisher on both sides (kronfluence's ``use_empirical_fisher=True``:
   sampled targets are random draws that no two frameworks share),
   damping kronfluence's heuristic (``damping_factor=None``: 0.1 x each
   module's mean eigenvalue; ours ``damping=None, damping_fraction=0.1``)
   and absolute (1e-3 both sides). Pairwise scores of 50 test queries
   against the training set and self-influence of the training set:
   max relative error ``max|ours - theirs| / max|theirs|`` and, per query,
   whether kronfluence's top-100 training examples come out in the same
   order from ours (Spearman's rho on them, its minimum over queries).
2. **Leave-some-out retraining** (the linear datamodeling score, LDS).
   The digits MLP with 10% of its labels flipped is retrained from the
   same initialisation on M random halves of the training set (full-batch
   Adam, vmapped over the halves); per test query, Spearman's rho between
   its actual loss after each retraining and the prediction
   ``-Σ_{t in half} s(q, t)``; the mean over queries, for our EK-FAC
   scores and kronfluence's (float64).
3. **Speed** (float32, each library's defaults otherwise). The MNIST MLP
   784-256-10 (tanh), fit (``"ekfac"``, sampled Fisher) plus pairwise
   scores for 10k training examples x 100 queries, batch 500 both sides,
   wall-clock in one process on the same CPU, ours with compilation
   included (first call) and again after it. ``--digits`` (or no MNIST)
   uses digits instead.

Conventions and the options that match them (also in the
``kfl.influence`` module docstring):

==========================  ==============================  ==============================
convention                  kronfluence                     kfl.influence
==========================  ==============================  ==============================
per-example loss            ``compute_train_loss`` summed    any reduction; ``ℓ_t`` the
                            over the batch                  example's summed elements
                                                            (the same ``ℓ_t``)
A, G                        means over N·R positions        the same
EK-FAC eigenvalues          mean over N examples            the same
Fisher                      sampled (default) /             ``estimation="fisher"`` /
                            ``use_empirical_fisher=True``   ``"empirical"``
damping                     ``damping_factor=None``:        ``damping=None``,
                            0.1·mean eigenvalue per module  ``damping_fraction=0.1``
                            ``damping_factor=x``            ``damping=x``
                            (default 1e-8)                  
score sign                  ``∇f_qᵀ (Ĝ+λI)⁻¹ ∇ℓ_t``         the same
==========================  ==============================  ==============================
"""
from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time

import numpy as np

try:
  import torch
  import torch.nn.functional as F
  from kronfluence.analyzer import Analyzer, prepare_model
  from kronfluence.arguments import FactorArguments, ScoreArguments
  from kronfluence.task import Task
  MISSING = None
except ImportError as e:  # torch is not this library's dependency.
  torch = F = Analyzer = prepare_model = FactorArguments = ScoreArguments = None
  Task = object
  MISSING = str(e)

import jax
import jax.numpy as jnp
import optax
from scipy.stats import spearmanr

import kfac_jax_lite as kfl
import _data


# ---------------------------------------------------------------- models

def mlp(p, x):
  h = jnp.tanh(x.reshape(x.shape[0], -1) @ p["w1"] + p["b1"])
  return h @ p["w2"] + p["b2"]


def convnet(p, x):
  h = jax.lax.conv_general_dilated(x[..., None], p["k"], (1, 1), "VALID",
                                   dimension_numbers=("NHWC", "HWIO", "NHWC"))
  h = jnp.tanh(h + p["c"]).transpose(0, 3, 1, 2)  # torch's flatten order
  return h.reshape(x.shape[0], -1) @ p["w"] + p["b"]


def loss_of(model):
  def loss_fn(p, batch):
    return jnp.mean(kfl.softmax_cross_entropy_with_integer_labels(
        model(p, batch[0]), batch[1]))
  return loss_fn


def init_mlp(key, d_in, hidden, dtype):
  k1, k2 = jax.random.split(key)
  return {"w1": jax.random.normal(k1, (d_in, hidden), dtype) / np.sqrt(d_in),
          "b1": jnp.zeros(hidden, dtype),
          "w2": jax.random.normal(k2, (hidden, 10), dtype) / np.sqrt(hidden),
          "b2": jnp.zeros(10, dtype)}


def init_convnet(key, dtype):
  k1, k2 = jax.random.split(key)
  return {"k": jax.random.normal(k1, (3, 3, 1, 4), dtype) / 3,
          "c": jnp.zeros(4, dtype),
          "w": jax.random.normal(k2, (144, 10), dtype) / 12,
          "b": jnp.zeros(10, dtype)}


def train(loss_fn, params, batch, steps, lr=1e-2):
  """Full-batch Adam on ``loss_fn(params, batch)``."""
  opt = optax.adam(lr)

  def body(c, _):
    p, s = c
    u, s = opt.update(jax.grad(loss_fn)(p, batch), s, p)
    return (optax.apply_updates(p, u), s), None
  return jax.lax.scan(body, (params, opt.init(params)), None, steps)[0][0]


def masked_mlp_loss(mask):
  """The MLP's mean cross-entropy over the examples with ``mask`` 1."""
  def loss_fn(p, batch):
    per = kfl.softmax_cross_entropy_with_integer_labels(
        mlp(p, batch[0]), batch[1])
    return jnp.sum(per * mask) / jnp.sum(mask)
  return loss_fn


if torch is not None:  # The PyTorch twins.
  class TorchMLP(torch.nn.Module):
    def __init__(self, p):
      super().__init__()
      d_in, hidden = p["w1"].shape
      dt = _torch_dtype(p["w1"])
      self.fc1 = torch.nn.Linear(d_in, hidden, dtype=dt)
      self.fc2 = torch.nn.Linear(hidden, 10, dtype=dt)
      _copy(self.fc1, p["w1"], p["b1"])
      _copy(self.fc2, p["w2"], p["b2"])

    def forward(self, x):
      return self.fc2(torch.tanh(self.fc1(x.flatten(1))))


  class TorchConv(torch.nn.Module):
    def __init__(self, p):
      super().__init__()
      dt = _torch_dtype(p["k"])
      self.conv = torch.nn.Conv2d(1, 4, 3, dtype=dt)
      self.fc = torch.nn.Linear(144, 10, dtype=dt)
      with torch.no_grad():
        self.conv.weight.copy_(torch.from_numpy(
            np.asarray(p["k"]).transpose(3, 2, 0, 1).copy()))
        self.conv.bias.copy_(torch.from_numpy(np.asarray(p["c"])))
      _copy(self.fc, p["w"], p["b"])

    def forward(self, x):
      return self.fc(torch.tanh(self.conv(x[:, None])).flatten(1))


def _torch_dtype(x):
  """The torch dtype of a JAX array (the twin holds the weights exactly)."""
  return torch.float64 if x.dtype == jnp.float64 else torch.float32


def _copy(linear, w, b):
  with torch.no_grad():
    linear.weight.copy_(torch.from_numpy(np.asarray(w).T.copy()))
    linear.bias.copy_(torch.from_numpy(np.asarray(b)))


class ClassificationTask(Task):
  """Cross-entropy summed over the batch (kronfluence's convention)."""

  def compute_train_loss(self, batch, model, sample=False):
    x, y = batch
    logits = model(x)
    if sample:
      with torch.no_grad():
        y = torch.multinomial(torch.softmax(logits.detach(), -1), 1).flatten()
    return F.cross_entropy(logits, y, reduction="sum")

  def compute_measurement(self, batch, model):
    return self.compute_train_loss(batch, model)


# ------------------------------------------------------------ kronfluence

def kronfluence_scores(model, train_xy, query_xy, strategy, damping,
                       batch_size, dtype, empirical=True, self_scores=True):
  """``(pairwise [Q, N], self [N] or None, fit seconds, score seconds)``."""
  tdtype = torch.float64 if dtype == np.float64 else torch.float32
  model = model.to(tdtype).eval()
  task = ClassificationTask()
  model = prepare_model(model, task)
  ds = lambda xy: torch.utils.data.TensorDataset(
      torch.from_numpy(np.asarray(xy[0], dtype)),
      torch.from_numpy(np.asarray(xy[1], np.int64)))
  with tempfile.TemporaryDirectory() as out:
    analyzer = Analyzer("compare", model, task, cpu=True, disable_tqdm=True,
                        output_dir=out)
    kw = {}
    if dtype == np.float64:
      kw = {k: torch.float64 for k in (
          "activation_covariance_dtype", "gradient_covariance_dtype",
          "per_sample_gradient_dtype", "lambda_dtype")}
    fargs = FactorArguments(strategy=strategy, use_empirical_fisher=empirical,
                            **kw)
    t0 = time.perf_counter()
    analyzer.fit_all_factors("f", ds(train_xy), per_device_batch_size=batch_size,
                             factor_args=fargs, overwrite_output_dir=True)
    t1 = time.perf_counter()
    skw = {}
    if dtype == np.float64:
      skw = {k: torch.float64 for k in (
          "per_sample_gradient_dtype", "precondition_dtype", "score_dtype")}
    sargs = ScoreArguments(damping_factor=damping, **skw)
    analyzer.compute_pairwise_scores(
        "p", "f", ds(query_xy), ds(train_xy),
        per_device_query_batch_size=len(query_xy[0]),
        per_device_train_batch_size=batch_size, score_args=sargs,
        overwrite_output_dir=True)
    pair = analyzer.load_pairwise_scores("p")["all_modules"].numpy()
    t2 = time.perf_counter()
    own = None
    if self_scores:
      analyzer.compute_self_scores("s", "f", ds(train_xy),
                                   per_device_train_batch_size=batch_size,
                                   score_args=sargs, overwrite_output_dir=True)
      own = analyzer.load_self_scores("s")["all_modules"].numpy()
  return pair, own, t1 - t0, t2 - t1


def ours(loss_fn, params, train_xy, query_xy, strategy, damping, batch_size,
         estimation="empirical", self_scores=True):
  batches = [(train_xy[0][i:i + batch_size], train_xy[1][i:i + batch_size])
             for i in range(0, len(train_xy[0]), batch_size)]
  t0 = time.perf_counter()
  state = kfl.influence.fit(loss_fn, params, batches, strategy=strategy,
                            estimation=estimation, progress=False)
  t1 = time.perf_counter()
  pair = np.asarray(kfl.influence.pairwise_scores(
      state, params, query_xy, batches, damping=damping, progress=False))
  t2 = time.perf_counter()
  own = (np.asarray(kfl.influence.self_scores(
      state, params, batches, damping=damping, progress=False))
         if self_scores else None)
  return pair, own, t1 - t0, t2 - t1


# ------------------------------------------------------------ the parts

def rel(a, b):
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def top_rank(a, b, k=100):
  """min over queries of Spearman's rho on ``b``'s top-k, and whether
  every query's top-k set is the same."""
  rhos, same = [], True
  for qa, qb in zip(a, b):
    top = np.argsort(-qb)[:k]
    rhos.append(spearmanr(qa[top], qb[top])[0])
    same &= set(np.argsort(-qa)[:k]) == set(top)
  return float(np.min(rhos)), same


def agreement(digits, quick):
  print("\n== 1. agreement, float64 (digits, empirical Fisher) ==")
  n = 400 if quick else len(digits.train_x)
  train_xy = (digits.train_x[:n].astype(np.float64), digits.train_y[:n])
  query_xy = (digits.test_x[:50].astype(np.float64), digits.test_y[:50])
  print(f"{'model':8} {'strategy':8} {'damping':>10} {'pairwise rel':>13} "
        f"{'self rel':>10} {'top100 rho':>10} {'same top100':>11}")
  with jax.enable_x64(True):
    key = jax.random.PRNGKey(0)
    tx = (jnp.asarray(train_xy[0]), jnp.asarray(train_xy[1]))
    for name, model, init, twin in [
        ("mlp", mlp, init_mlp(key, 64, 32, jnp.float64), TorchMLP),
        ("conv", convnet, init_convnet(key, jnp.float64), TorchConv)]:
      loss_fn = loss_of(model)
      params = jax.jit(lambda p: train(loss_fn, p, tx, 200))(init)
      for strategy in ("kfac", "ekfac"):
        for damping in (None, 1e-3):
          p_o, s_o, _, _ = ours(loss_fn, params, tx, query_xy, strategy,
                                damping, 128)
          p_k, s_k, _, _ = kronfluence_scores(
              twin(params), train_xy, query_xy, strategy, damping, 128,
              np.float64)
          rho, same = top_rank(p_o, p_k)
          print(f"{name:8} {strategy:8} {str(damping):>10} "
                f"{rel(p_o, p_k):13.2e} {rel(s_o, s_k):10.2e} {rho:10.6f} "
                f"{str(same):>11}")


def lds(digits, quick, halves):
  print(f"\n== 2. leave-some-out retraining (LDS), digits MLP, 10% labels "
        f"flipped, {halves} random halves ==")
  x = digits.train_x.reshape(len(digits.train_x), -1).astype(np.float64)
  y = digits.train_y.copy()
  rng = np.random.default_rng(0)
  flip = rng.choice(len(y), len(y) // 10, replace=False)
  y[flip] = (y[flip] + rng.integers(1, 10, len(flip))) % 10
  qx = digits.test_x[:50].reshape(50, -1).astype(np.float64)
  qy = digits.test_y[:50]
  steps = 100 if quick else 300
  with jax.enable_x64(True):
    loss_fn = loss_of(mlp)
    init = init_mlp(jax.random.PRNGKey(1), 64, 32, jnp.float64)
    batch = (jnp.asarray(x), jnp.asarray(y))
    params = jax.jit(lambda p: train(loss_fn, p, batch, steps))(init)
    masks = jnp.asarray(rng.random((halves, len(y))) < 0.5, jnp.float64)

    def retrained_loss(mask):
      p = train(masked_mlp_loss(mask), init, batch, steps)
      return kfl.softmax_cross_entropy_with_integer_labels(
          mlp(p, jnp.asarray(qx)), jnp.asarray(qy))
    actual = np.asarray(jax.jit(jax.vmap(retrained_loss))(masks))  # [M, Q]
    p_o, _, _, _ = ours(loss_fn, params, batch, (qx, qy), "ekfac", None,
                        128, self_scores=False)
    p_k, _, _, _ = kronfluence_scores(TorchMLP(params), (x, y), (qx, qy),
                                      "ekfac", None, 128, np.float64,
                                      self_scores=False)
  m = np.asarray(masks)
  for name, scores in (("kfl.influence ekfac", p_o),
                       ("kronfluence ekfac", p_k)):
    pred = -(m @ scores.T)  # [M, Q]
    rho = np.nanmean([spearmanr(pred[:, q], actual[:, q])[0]
                      for q in range(len(qy))])
    print(f"{name:22} LDS (mean Spearman over 50 queries) {rho:.4f}")


def speed(images, n_train, n_query):
  print(f"\n== 3. speed: fit (ekfac, sampled Fisher) + pairwise scores, "
        f"{n_train} train x {n_query} queries, float32, batch 500 ==")
  print(f"data: {images.source}")
  d_in = int(np.prod(images.train_x.shape[1:]))
  x = images.train_x[:n_train].reshape(n_train, -1).astype(np.float32)
  y = images.train_y[:n_train]
  qx = images.test_x[:n_query].reshape(n_query, -1).astype(np.float32)
  qy = images.test_y[:n_query]
  loss_fn = loss_of(mlp)
  init = init_mlp(jax.random.PRNGKey(0), d_in, 256, jnp.float32)
  batch = (jnp.asarray(x), jnp.asarray(y))
  params = jax.jit(lambda p: train(loss_fn, p, batch, 100, 1e-3))(init)
  rows = []
  for run in ("first call", "second call"):
    _, _, fit_s, score_s = ours(loss_fn, params, batch, (qx, qy), "ekfac",
                                None, 500, estimation="fisher",
                                self_scores=False)
    rows.append((f"kfl.influence ({run})", fit_s, score_s))
  torch.set_num_threads(os.cpu_count() or 1)
  _, _, fit_s, score_s = kronfluence_scores(
      TorchMLP(params), (x, y), (qx, qy), "ekfac", None, 500, np.float32,
      empirical=False, self_scores=False)
  rows.append(("kronfluence", fit_s, score_s))
  print(f"{'':28} {'fit s':>8} {'scores s':>9} {'total s':>8}")
  for name, f, s in rows:
    print(f"{name:28} {f:8.2f} {s:9.2f} {f + s:8.2f}")


def main(argv=None):
  if MISSING is not None:
    print(f"kronfluence (or torch) is not importable ({MISSING}); install "
          "it in a separate virtualenv: pip install kronfluence")
    return None
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--digits", action="store_true",
                  help="speed on digits instead of MNIST")
  ap.add_argument("--mnist", default=None, help="a local mnist .pkl.gz/wheel")
  ap.add_argument("--halves", type=int, default=64)
  ap.add_argument("--skip", default="", help="parts to skip, e.g. 2,3")
  args = ap.parse_args(argv)
  print(f"kronfluence compare: jax {jax.__version__}, torch "
        f"{torch.__version__}, kronfluence "
        f"{__import__('kronfluence').__version__}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}")
  digits = _data.load_digits()
  skip = set(args.skip.split(","))
  if "1" not in skip:
    agreement(digits, args.quick)
  if "2" not in skip:
    lds(digits, args.quick, 16 if args.quick else args.halves)
  if "3" not in skip:
    images = digits
    if not args.digits:
      try:
        images = _data.load_mnist(args.mnist)
      except Exception as e:  # noqa: BLE001 (any failure: say it, use digits)
        print(f"MNIST unavailable ({e}); speed on digits")
    n = min(len(images.train_x), 2000 if args.quick else 10_000)
    speed(images, n, 100)


if __name__ == "__main__":
  main()
