"""kfl.kfac_optimizer's step on the MNIST-autoencoder shape, against SGD and
K-FAC + SGD, with the Levenberg–Marquardt cadence and model_fraction moved
(issue 36). Interleaved steps in one process; median wall time per step.

    PYTHONPATH=src python benchmarks/model_fraction_step.py [BATCH] [REPS]

Random binary inputs of the autoencoder's shape (784-1000-500-250-30-250-
500-1000-784, tanh, sigmoid cross-entropy), batch 1000 by default, 10
timed steps per row after one compiling step. A quick check of ratios on
a shared machine, not the README's step_time.py row.
"""
import sys, time, functools
import os
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax, jax.numpy as jnp, numpy as np, optax
import kfac_jax_lite as kfl
import _models as M
B = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
dims = (784, 1000, 500, 250, 30, 250, 500, 1000, 784)
params = M.autoencoder_init(dims, jax.random.PRNGKey(0))
x = (jax.random.uniform(jax.random.PRNGKey(1), (B, 784)) > 0.7).astype(jnp.float32)
batch = {"x": x}
loss_fn = M.autoencoder_loss
est_fn = kfl.value_grad_and_stats(loss_fn, params, batch)
def make_sgd():
  tx = optax.sgd(1e-3, momentum=0.9)
  @jax.jit
  def step(p, s, b, k):
    l, g = jax.value_and_grad(loss_fn)(p, b); u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s
  return tx.init(params), step
def make_kfac():
  tx = optax.chain(kfl.kfac(loss_fn, batch), optax.sgd(1e-2, momentum=0.9))
  @jax.jit
  def step(p, s, b, k):
    est = est_fn(p, b, k); u, s = tx.update(est.grads, s, p, stats=est.stats, loss=est.loss)
    return optax.apply_updates(p, u), s
  return tx.init(params), step
def make_opt(**kw):
  opt = kfl.kfac_optimizer(loss_fn, batch, **kw)
  @jax.jit
  def step(p, s, b, k):
    est = est_fn(p, b, k, with_stats=kfl.stats_due(s))
    u, s = opt.update(est.grads, s, p, batch=b, stats=est.stats, loss=est.loss)
    return optax.apply_updates(p, u), s
  return opt.init(params), step
runs = {"sgd": make_sgd(), "kfac+sgd 1-pass": make_kfac(),
        "opt T1=5 (old cadence)": make_opt(damping_adaptation_interval=5),
        "opt defaults (T1=1)": make_opt(),
        "opt T1=1 model_fraction=1/4": make_opt(model_fraction=0.25),
        "opt T1=1 model_fraction=1/8": make_opt(model_fraction=0.125)}
state = {}
for name, (s, f) in runs.items():
  p, s = f(params, s, batch, jax.random.PRNGKey(0)); jax.block_until_ready(p); state[name] = (p, s)
times = {n: [] for n in runs}
R = int(sys.argv[2]) if len(sys.argv) > 2 else 10
for r in range(R):
  for name, (s0, f) in runs.items():
    p, s = state[name]
    t = time.perf_counter(); p, s = f(p, s, batch, jax.random.PRNGKey(r)); jax.block_until_ready(p)
    times[name].append(time.perf_counter() - t); state[name] = (p, s)
sgd = np.median(times["sgd"]); kf = np.median(times["kfac+sgd 1-pass"])
for n, t in times.items():
  m = np.median(t); print(f"{n:32s} {m*1e3:8.1f} ms  {m/sgd:5.2f}x SGD  {m/kf:5.2f}x K-FAC+SGD")
