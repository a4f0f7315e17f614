"""Subprocess worker for ``tests/test_distributed.py``.

The main pytest process may already have initialised JAX with a single CPU
device, so every multi-device scenario runs here, in a fresh interpreter
whose device count is fixed (``--devices``, put into ``XLA_FLAGS`` before
JAX is imported). The worker prints one line ``RESULT <json>`` on stdout
(arrays as nested lists); the tests compare the numbers. Every scenario
runs in float64 (``JAX_ENABLE_X64``): the tests check the algebra of the
reductions, which float32 rounding would blur by its last bits' CPU
dependence.

    python tests/_distributed_worker.py --devices 8 pmap
    python tests/_distributed_worker.py --devices 2 multihost --port P --process-id I
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

import _cpu_devices as cpu_devices


def _setup(devices: int):
  """This interpreter as ``cpu_devices.env(devices)`` describes it (for a
  worker started by hand), float64, ``src/`` importable; before JAX starts."""
  os.environ.update(cpu_devices.env(devices))
  os.environ["JAX_ENABLE_X64"] = "1"
  if cpu_devices.SRC not in sys.path:
    sys.path.insert(0, cpu_devices.SRC)


def emit(result):
  print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------
# Model, data and training loops (imported lazily: JAX must see XLA_FLAGS).

SIZES = (6, 8, 8, 4)   # three dense layers (kernel + bias): three blocks
DEEP = (4,) * 11       # ten dense layers: ten blocks, more than 8 devices
N = 32                 # global batch: 4 examples per device on 8 devices


def init_params(sizes=SIZES):
  import jax
  import numpy as np
  keys = jax.random.split(jax.random.PRNGKey(0), len(sizes) - 1)
  return {f"dense{i}": {"w": jax.random.normal(k, (a, b)) / np.sqrt(a),
                        "b": 0.1 * jax.random.normal(jax.random.fold_in(k, 1),
                                                     (b,))}
          for i, (k, a, b) in enumerate(zip(keys, sizes[:-1], sizes[1:]))}


def _logits(params, batch, sizes):
  import jax.numpy as jnp
  h = batch["x"]
  for i in range(len(sizes) - 1):
    h = h @ params[f"dense{i}"]["w"] + params[f"dense{i}"]["b"]
    if i < len(sizes) - 2:
      h = jnp.tanh(h)
  return h


def make_loss(sizes=SIZES):
  import kfac_jax_lite as kfl

  def loss_fn(params, batch):
    return kfl.softmax_cross_entropy_with_integer_labels(
        _logits(params, batch, sizes), batch["y"]).mean()
  return loss_fn


def make_batch(seed, n=N, sizes=SIZES):
  import jax
  import jax.numpy as jnp
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  x = jax.random.normal(k1, (n, sizes[0]))
  y = (jnp.argmax(x[:, :sizes[-1]], -1)
       + jax.random.bernoulli(k2, 0.2, (n,))) % sizes[-1]  # some label noise
  return {"x": x, "y": y.astype(jnp.int32)}


def make_tx(loss_fn, batch, axis_name=None, estimation="exact", blocks=None,
            lr=0.1, **kw):
  import optax
  import kfac_jax_lite as kfl
  # inverse_every=2: refreshes at steps 0, 1 (young), 2, 4, ...; statistics
  # every step unless a scenario plans otherwise (cov_every=).
  kw.setdefault("cov_every", 1)
  kfac = kfl.kfac(loss_fn, batch, damping=1e-2, estimation=estimation,
                  cov_decay=0.9, inverse_every=2, axis_name=axis_name,
                  blocks=blocks, **kw)
  return optax.chain(kfac, optax.sgd(lr, momentum=0.9))


def tolist(tree):
  import jax
  import numpy as np
  return jax.tree.map(lambda x: np.asarray(x).tolist(), tree)


def caches(kstate):
  """The factors of every block: statistics and cached decompositions."""
  import jax
  import kfac_jax_lite as kfl
  out = {}
  for name, bstate in kstate.blocks.items():
    factors = jax.tree.leaves(bstate, is_leaf=lambda x: isinstance(
        x, kfl.FactorState))
    for j, f in enumerate(factors):
      for field in ("cov", "weight"):
        out[f"{name}/{j}/{field}"] = getattr(f, field)
      for field in f.cache._fields:
        out[f"{name}/{j}/{field}"] = getattr(f.cache, field)
  return out


def run_single(loss_fn, params, batches, tx, state=None):
  """Plain ``jit`` on one device (or on whatever sharding the inputs have)."""
  import jax
  import optax

  @jax.jit
  def step(params, state, batch):
    grads = jax.grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params, batch=batch)
    return optax.apply_updates(params, updates), state, updates

  state = tx.init(params) if state is None else state
  history = []
  for batch in batches:
    params, state, updates = step(params, state, batch)
    history.append(updates)
  return params, state, history


def pmap_step(loss_fn, tx, axis="i"):
  import jax
  import optax

  def step(params, state, batch):
    grads = jax.lax.pmean(jax.grad(loss_fn)(params, batch), axis)
    updates, state = tx.update(grads, state, params, batch=batch)
    return optax.apply_updates(params, updates), state, updates
  return jax.pmap(step, axis_name=axis)


def pmap_sharding(devices, axis="i"):
  """How ``pmap`` (built on ``jit`` over a 1-D mesh) lays out its outputs;
  inputs placed the same way do not trigger a second compilation."""
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  return NamedSharding(Mesh(np.array(devices), (axis,)), P(axis))


def run_pmap(loss_fn, params, batches, tx, devices=None):
  """``pmap`` over ``devices`` (default: all), each batch split evenly."""
  import jax
  devices = jax.local_devices() if devices is None else devices
  n = len(devices)
  step = pmap_step(loss_fn, tx)
  put = lambda t: jax.device_put(t, pmap_sharding(devices))
  split = lambda b: put(jax.tree.map(
      lambda x: x.reshape((n, x.shape[0] // n) + x.shape[1:]), b))
  state = put(replicate(tx.init(params), n))
  params = put(replicate(params, n))
  history = []
  for batch in batches:
    params, state, updates = step(params, state, split(batch))
    history.append(updates)
  return params, state, history


def replicate(tree, n):
  """``tree`` stacked ``n`` times along a new leading (device) axis."""
  import jax
  import numpy as np
  return jax.tree.map(lambda x: np.stack([np.asarray(x)] * n), tree)


def per_device_spread(tree):
  """Max |device k - device 0| over a pmapped tree (0 if replicated)."""
  import jax
  import numpy as np
  return max(float(np.max(np.abs(np.asarray(x, np.float64)
                                 - np.asarray(x, np.float64)[:1])))
             if np.size(x) else 0.0 for x in jax.tree.leaves(tree))


def first(tree):
  import jax
  return jax.tree.map(lambda x: x[0], tree)


# ---------------------------------------------------------------------------
# Scenarios.

STEPS = 5  # refreshes (inverse_every=2) at steps 0, 2 and 4


def scenario_pmap(args):
  """pmap (8 devices, axis_name) vs one device on the whole batch: exact
  (float32), and sampled Fisher (float64, ``_pmap_fisher64``)."""
  import jax
  loss_fn = make_loss()
  params = init_params()
  batches = [make_batch(s) for s in range(STEPS)]
  tx1 = make_tx(loss_fn, batches[0])
  txp = make_tx(loss_fn, batches[0], axis_name="i")
  p1, s1, h1 = run_single(loss_fn, params, batches, tx1)
  pp, sp, hp = run_pmap(loss_fn, params, batches, txp)
  result = {
      "devices": jax.device_count(),
      "single_updates": tolist(h1), "pmap_updates": tolist([first(u) for u in hp]),
      "single_params": tolist(p1), "pmap_params": tolist(first(pp)),
      "single_caches": tolist(caches(s1[0])),
      "pmap_caches": tolist(caches(first(sp[0]))),
      "pmap_spread": per_device_spread((pp, sp, hp)),
      "pmap_count": int(first(sp[0].count)),
  }
  result.update(_pmap_fisher64(loss_fn, batches))
  emit(result)


def _pmap_fisher64(loss_fn, batches):
  """``estimation="fisher"`` pmapped over the devices against one device,
  in float64. Device k draws the targets of its examples with
  ``fold_in(stats_key, k)``; the one-device run gives ``tx.update`` the
  mean over the k of ``kfl.value_grad_and_stats`` on the same examples
  with the same keys (``stats=``), its key advancing as the pmapped
  state's does. Returns both runs' updates, parameters and caches."""
  import jax
  import jax.numpy as jnp
  import optax
  import kfac_jax_lite as kfl
  with jax.enable_x64(True):
    to64 = lambda t: jax.tree.map(
        lambda x: x.astype(jnp.float64) if x.dtype.kind == "f" else x, t)
    params, batches = to64(init_params()), to64(batches)
    n = jax.device_count()
    txp = make_tx(loss_fn, batches[0], axis_name="i", estimation="fisher")
    pp, sp, hp = run_pmap(loss_fn, params, batches, txp)
    tx1 = make_tx(loss_fn, batches[0], estimation="fisher")
    est_fn = kfl.value_grad_and_stats(loss_fn, params, batches[0],
                                      estimation="fisher")

    @jax.jit
    def step(params, state, batch):
      grads = jax.grad(loss_fn)(params, batch)
      _, stats_key = jax.random.split(state[0].key)  # As kfl.kfac splits it.
      parts = jax.tree.map(lambda x: x.reshape((n, -1) + x.shape[1:]), batch)
      stats = jax.vmap(lambda part, k: est_fn(
          params, part, jax.random.fold_in(stats_key, k)).stats)(
              parts, jnp.arange(n))
      stats = jax.tree.map(lambda x: x.mean(0), stats)
      updates, state = tx1.update(grads, state, params, stats=stats)
      return optax.apply_updates(params, updates), state, updates

    state, history, p1 = tx1.init(params), [], params
    for batch in batches:
      p1, state, updates = step(p1, state, batch)
      history.append(updates)
    return {
        "fisher64_updates": tolist([first(u) for u in hp]),
        "fisher64_single_updates": tolist(history),
        "fisher64_params": tolist(first(pp)),
        "fisher64_single_params": tolist(p1),
        "fisher64_caches": tolist(caches(first(sp[0]))),
        "fisher64_single_caches": tolist(caches(state[0])),
        "fisher64_dtype": str(jax.tree.leaves(first(pp))[0].dtype),
        "fisher64_bad": [int(first(sp[0].num_bad_grads)),
                         int(first(sp[0].num_bad_updates))],
        "fisher64_spread": per_device_spread((pp, sp))}


def make_loss_with_fallback(sizes=SIZES):
  """``make_loss`` with the logits scaled by ``exp(params["temp"])``: a
  parameter no pattern matches, so it gets a fallback (``NaiveDiagonal``)
  block, whose statistics need per-example parameter gradients."""
  import jax.numpy as jnp
  import kfac_jax_lite as kfl

  def loss_fn(params, batch):
    h = _logits(params, batch, sizes) * jnp.exp(params["temp"])
    return kfl.softmax_cross_entropy_with_integer_labels(h, batch["y"]).mean()
  return loss_fn


def flat_stats(stats):
  """``{block/i: leaf}`` of an ``Estimate.stats`` (any block pytrees)."""
  import jax
  return {f"{name}/{i}": x for name, s in stats.items()
          for i, x in enumerate(jax.tree.leaves(s)) if name != "~run"}


def _per_device_grads(loss_fn, params, batch, axis, check_vma):
  """The device-mean gradient of the per-device losses. With
  ``check_vma=True``, ``jax.grad`` with respect to the replicated params
  is already the sum over the devices (the transpose of the ``pvary``
  that meets them with the sharded batch is a ``psum``), so the gradient
  is taken at params cast to device-varying: each device's own, as with
  ``check_vma=False``."""
  import jax
  if check_vma:
    params = jax.lax.pcast(params, axis, to="varying")
  return jax.lax.pmean(jax.grad(loss_fn)(params, batch), axis)


def _one_pass_under_vma(mapped, train, batches):
  """``kfl.value_grad_and_stats`` (exact estimation) on a model with a
  fallback block under ``shard_map(check_vma=True)``, and on one device on
  the whole batch."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P
  import kfac_jax_lite as kfl
  loss_fb = make_loss_with_fallback()
  params = dict(init_params(),
                temp=0.1 * jnp.arange(SIZES[-1], dtype=float))
  est_fn = kfl.value_grad_and_stats(loss_fb, params, batches[0],
                                    estimation="exact")
  key = jax.random.PRNGKey(0)
  single = jax.jit(est_fn)(params, batches[0], key)

  def one_pass(params, batch):
    est = est_fn(params, batch, key)
    return (jax.lax.pmean(est.loss, "data"), est.grads,
            jax.lax.pmean(est.stats, "data"))
  loss, grads, stats = mapped(one_pass, True, (P(), P("data")))(params,
                                                                batches[0])
  return dict(vgs_fallbacks=[l.name for l in est_fn.tagged.fallbacks],
              vgs_single_loss=float(single.loss), vgs_loss=float(loss),
              vgs_single_grads=tolist(single.grads), vgs_grads=tolist(grads),
              vgs_single_stats=tolist(flat_stats(single.stats)),
              vgs_stats=tolist(flat_stats(stats)))


def _optimizer_under_vma(mapped, train, batches):
  """``kfl.kfac_optimizer`` (exact estimation) under
  ``shard_map(check_vma=True)`` and on one device, ``STEPS`` steps (the
  5th adapts the damping)."""
  import kfac_jax_lite as kfl
  loss_fn = make_loss()
  kw = dict(estimation="exact", inverse_every=2)
  opt1 = kfl.kfac_optimizer(loss_fn, batches[0], **kw)
  opts = kfl.kfac_optimizer(loss_fn, batches[0], axis_name="data", **kw)
  _, s1, h1 = run_single(loss_fn, init_params(), batches, opt1)
  ss, hs = train(opts, True)
  return dict(opt_single_updates=tolist(h1), opt_updates=tolist(hs),
              opt_single_damping=[float(s1.damping), float(s1.rho)],
              opt_damping=[float(ss.damping), float(ss.rho)])


def scenario_shard_map(args):
  """The same step under ``jax.shard_map`` over a Mesh of 8 (axis "data").

  Run with ``check_vma=False``, then with the default ``check_vma=True``:
  its updates and caches if it runs, else its error (``vma_error``). Then,
  with ``check_vma=True`` only: the one-pass ``kfl.value_grad_and_stats``
  on a model with a fallback block (``vgs_*``), and ``kfl.kfac_optimizer``
  (``opt_*``), each against one device on the whole batch.
  """
  import jax
  import optax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  loss_fn = make_loss()
  params = init_params()
  batches = [make_batch(s) for s in range(STEPS)]
  tx1 = make_tx(loss_fn, batches[0])
  txs = make_tx(loss_fn, batches[0], axis_name="data")
  p1, s1, h1 = run_single(loss_fn, params, batches, tx1)
  mesh = Mesh(jax.devices(), ("data",))

  def mapped(fn, check_vma, in_specs=(P(), P(), P("data"))):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs,
                                 out_specs=P(), check_vma=check_vma))

  def train(tx, check_vma):
    def step(params, state, batch):
      grads = _per_device_grads(loss_fn, params, batch, "data", check_vma)
      updates, state = tx.update(grads, state, params, batch=batch)
      return optax.apply_updates(params, updates), state, updates
    run = mapped(step, check_vma)
    # Placed as the step returns them: the second step does not recompile.
    ps, state = jax.device_put((params, tx.init(params)),
                               NamedSharding(mesh, P()))
    hs = []
    for batch in batches:
      ps, state, updates = run(ps, state, batch)
      hs.append(updates)
    return state, hs

  state, hs = train(txs, False)
  result = {"single_updates": tolist(h1), "shard_map_updates": tolist(hs),
            "single_caches": tolist(caches(s1[0])),
            "shard_map_caches": tolist(caches(state[0]))}
  # The default check_vma=True: its results when it traces and runs, else
  # the error.
  try:
    vma_state, vma_hs = train(txs, True)
    result.update(vma_error=None, vma_updates=tolist(vma_hs),
                  vma_caches=tolist(caches(vma_state[0])))
  except Exception as e:  # noqa: BLE001
    result["vma_error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    emit(result)
    return

  # Each further check reports its own error (``vgs_error``, ``opt_error``).
  for label, check in (("vgs", _one_pass_under_vma),
                       ("opt", _optimizer_under_vma)):
    try:
      result.update(check(mapped, train, batches))
      result[f"{label}_error"] = None
    except Exception as e:  # noqa: BLE001
      result[f"{label}_error"] = (f"{type(e).__name__}: "
                                  f"{str(e).splitlines()[0]}")
  emit(result)


SPLIT_CONFIGS = {
    # The damped inverse (``matpower``, and the bookkeeping) is cached.
    "pi": dict(damping_mode="pi", precon_power=-1.0),
    # eigh of both factors, then the damped matrix power p = -1/2 from it:
    # only ``matpower`` is cached.
    "pi_sqrt": dict(damping_mode="pi", precon_power=-0.5),
}


def scenario_split_refresh(args):
  """One refresh step from the same state: split over 8 devices vs not.

  Both start from the single-device state after ``STEPS`` steps; the step
  is made a refresh-only step (count a multiple of ``inverse_every``, its
  statistics flag off), so both decompose identical factors and only the
  split (``lax.cond`` on the owner + ``psum`` of the caches) differs.
  """
  import jax
  import jax.numpy as jnp
  import kfac_jax_lite as kfl
  loss_fn = make_loss()
  params = init_params()
  batches = [make_batch(s) for s in range(STEPS)]
  n = jax.device_count()
  batch = make_batch(99)
  rep = lambda t: replicate(t, n)
  split = lambda b: jax.tree.map(lambda x: x.reshape((n, -1) + x.shape[1:]), b)
  # The factor statistics do not depend on the damping mode or power.
  p1, s1, _ = run_single(loss_fn, params, batches, make_tx(loss_fn, batches[0]))
  # No statistics at this step: the state's flag (kfl.stats_due) says so.
  kstate = s1[0]._replace(count=jnp.asarray(6, jnp.int32),
                          stats_due=jnp.zeros((), jnp.int32))
  grads = jax.grad(loss_fn)(p1, batch)
  result = {}
  for label, cfg in SPLIT_CONFIGS.items():
    # A damping other than the training's, so every cache really changes.
    kw = dict(damping=5e-2, estimation="exact", cov_every=7, inverse_every=3,
              **cfg)
    tx1 = kfl.kfac(loss_fn, batches[0], **kw)
    txp = kfl.kfac(loss_fn, batches[0], axis_name="i", **kw)
    u1, n1 = jax.jit(tx1.update)(grads, kstate, p1, batch=batch)
    up, npm = jax.pmap(lambda g, s, p, b: txp.update(g, s, p, batch=b),
                       axis_name="i")(rep(grads), rep(kstate), rep(p1),
                                      split(batch))
    result[label] = {
        "before": tolist(caches(kstate)), "single": tolist(caches(n1)),
        "split": tolist(caches(first(npm))),
        "single_updates": tolist(u1), "split_updates": tolist(first(up)),
        "spread": per_device_spread((up, npm))}
  emit(result)


def _counting_blocks(log_axis):
  """A ``blocks=`` override wrapping each dense block's ``refresh`` so that
  every execution calls back to the host with (device, block, step)."""
  import jax
  calls: list = []

  @dataclasses.dataclass(frozen=True)
  class Counting:
    inner: Any
    name: str

    def __getattr__(self, attr):
      return getattr(self.inner, attr)

    def refresh(self, state, damping, exp=-1.0, step=0, **kwargs):
      dev = jax.lax.axis_index(log_axis) if log_axis else 0
      jax.debug.callback(
          lambda d, s, name=self.name: calls.append((int(d), name, int(s))),
          dev, step)
      return self.inner.refresh(state, damping, exp, step, **kwargs)

  return {"dense": lambda info: Counting(info.block, info.name)}, calls


def scenario_count(args):
  """Refresh executions per device, counted at runtime with a callback.

  Three blocks (5 steps: refreshes at steps 0, 2, 4), pmapped and on one
  device; ten blocks (3 steps: refreshes at steps 0, 2), pmapped only.
  """
  import jax
  import kfac_jax_lite as kfl
  result = {"devices": jax.device_count()}
  for label, sizes, steps, single in (("three", SIZES, STEPS, True),
                                      ("ten", DEEP, 3, False)):
    loss_fn = make_loss(sizes)
    params = init_params(sizes)
    batches = [make_batch(s, sizes=sizes) for s in range(steps)]
    layer_names = [l.name for l in kfl.tagging.find_layers(
        loss_fn, params, batches[0]).layers]
    blocks, calls = _counting_blocks("i")
    run_pmap(loss_fn, params, batches,
             make_tx(loss_fn, batches[0], axis_name="i", blocks=blocks))
    jax.effects_barrier()
    result[label] = {"layers": layer_names, "steps": steps,
                     "pmap_calls": sorted(calls)}
    if single:
      blocks1, calls1 = _counting_blocks(None)
      run_single(loss_fn, params, batches,
                 make_tx(loss_fn, batches[0], blocks=blocks1))
      jax.effects_barrier()
      result[label]["single_calls"] = sorted(calls1)
  emit(result)


def scenario_jit_sharded(args):
  """``jit`` on a batch sharded over a Mesh of 8 (no axis_name) vs unsharded."""
  import jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  loss_fn = make_loss()
  params = init_params()
  batches = [make_batch(s) for s in range(STEPS)]
  tx = make_tx(loss_fn, batches[0])
  p1, s1, h1 = run_single(loss_fn, params, batches, tx)
  mesh = Mesh(jax.devices(), ("data",))
  data, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
  sharded = [jax.device_put(b, data) for b in batches]
  ps, ss, hs = run_single(loss_fn, jax.device_put(params, rep), sharded, tx,
                          state=jax.device_put(tx.init(params), rep))
  emit({"batch_sharding": str(sharded[0]["x"].sharding),
        "batch_devices": len(sharded[0]["x"].sharding.device_set),
        "shard_shape": list(sharded[0]["x"].addressable_shards[0].data.shape),
        "single_updates": tolist(h1), "sharded_updates": tolist(hs),
        "single_params": tolist(p1), "sharded_params": tolist(ps),
        "single_caches": tolist(caches(s1[0])),
        "sharded_caches": tolist(caches(ss[0]))})


MULTIHOST_STEPS = 20


def _multihost_batches():
  return [make_batch(s) for s in range(MULTIHOST_STEPS)]


def scenario_reference4(args):
  """The multi-host run's reference: one process, pmap over 4 devices."""
  import jax
  loss_fn = make_loss()
  batches = _multihost_batches()
  tx = make_tx(loss_fn, batches[0], axis_name="i", lr=0.05)
  pp, sp, _ = run_pmap(loss_fn, init_params(), batches, tx)
  tx1 = make_tx(loss_fn, batches[0], lr=0.05)
  p1, s1, _ = run_single(loss_fn, init_params(), batches, tx1)
  emit({"devices": jax.device_count(), "params": tolist(first(pp)),
        "single_device_params": tolist(p1),
        "single_device_caches": tolist(caches(s1[0])),
        "spread": per_device_spread(pp), "count": int(first(sp[0].count))})


def scenario_multihost(args):
  """One of several processes: pmap over all global devices, axis "i".

  Each process feeds its local devices their slice of the global batch
  (process p owns global rows [p·n_local·m, (p+1)·n_local·m) with m rows
  per device); statistics, gradients and caches are combined across
  processes by the collectives. Refreshes are counted per global device.
  """
  import jax
  try:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  except Exception as e:  # noqa: BLE001
    emit({"skip": f"gloo CPU collectives unavailable: {e!r}"})
    return
  try:
    jax.distributed.initialize(f"127.0.0.1:{args.port}",
                               num_processes=args.num_processes,
                               process_id=args.process_id,
                               initialization_timeout=args.init_timeout)
    jax.devices()  # Creates the CPU client and its gloo collectives.
  except Exception as e:  # noqa: BLE001
    if "gloo" not in str(e).lower():
      raise
    emit({"skip": f"gloo CPU collectives unavailable: {e!r}"})
    return
  import numpy as np
  n_local, n_global = jax.local_device_count(), jax.device_count()
  loss_fn = make_loss()
  batches = _multihost_batches()
  blocks, calls = _counting_blocks("i")
  tx = make_tx(loss_fn, batches[0], axis_name="i", lr=0.05, blocks=blocks)
  step = pmap_step(loss_fn, tx)
  m = N // n_global
  lo = jax.process_index() * n_local * m
  # Global arrays laid out as pmap lays out its outputs (no recompilation).
  sharding = pmap_sharding(jax.devices())
  put = lambda t: jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(sharding, x), t)

  def local(b):
    return put(jax.tree.map(lambda x: np.asarray(x)[lo:lo + n_local * m].reshape(
        (n_local, m) + x.shape[1:]), b))

  params = put(replicate(init_params(), n_local))
  state = put(replicate(tx.init(init_params()), n_local))
  for batch in batches:
    params, state, _ = step(params, state, local(batch))
  sharded = _multihost_sharded(loss_fn, batches, put, local, n_local)
  jax.effects_barrier()
  local_params = [jax.tree.map(lambda x: np.asarray(x.addressable_shards[k].data)[0],
                               params) for k in range(n_local)]
  local_count = jax.tree.map(lambda x: int(np.asarray(
      x.addressable_shards[0].data)[0]), state[0].count)
  spread = max(float(np.max(np.abs(a - b))) for p in local_params[1:]
               for a, b in zip(jax.tree.leaves(p),
                               jax.tree.leaves(local_params[0])))
  emit({"process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "local_devices": n_local, "global_devices": n_global,
        "local_device_ids": [d.id for d in jax.local_devices()],
        "params": tolist(local_params[0]), "spread": spread,
        "count": local_count, "calls": sorted(calls), **sharded})
  jax.distributed.shutdown()


def _multihost_sharded(loss_fn, batches, put, local, n_local):
  """The same 20 steps with ``layout="sharded"`` (init inside the pmap):
  this process's parameters and, gathered from both processes
  (``process_allgather``), every block's factors and caches."""
  import jax
  import numpy as np
  from jax.experimental import multihost_utils
  import kfac_jax_lite as kfl
  tx = make_tx(loss_fn, batches[0], axis_name="i", lr=0.05, layout="sharded")
  step = pmap_step(loss_fn, tx)
  params = put(replicate(init_params(), n_local))
  state = jax.pmap(tx.init, axis_name="i")(params)
  for batch in batches:
    params, state, _ = step(params, state, local(batch))
  blocks = state[0].blocks
  gathered = kfl.sharding.ShardedBlocks(
      [multihost_utils.process_allgather(b, tiled=True)
       for b in blocks.buffers], blocks.layout)
  return {"sharded_params": tolist(jax.tree.map(
              lambda x: np.asarray(x.addressable_shards[0].data)[0], params)),
          "sharded_caches": tolist(caches(state[0]._replace(
              blocks=kfl.sharding.unshard_blocks(gathered)))),
          "sharded_owners": kfl.sharding.owners(state)}


SCENARIOS = {
    "pmap": scenario_pmap, "shard_map": scenario_shard_map,
    "split_refresh": scenario_split_refresh, "count": scenario_count,
    "jit_sharded": scenario_jit_sharded, "reference4": scenario_reference4,
    "multihost": scenario_multihost,
}


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("scenario", choices=sorted(SCENARIOS))
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--port", type=int, default=0)
  parser.add_argument("--process-id", type=int, default=0)
  parser.add_argument("--num-processes", type=int, default=2)
  parser.add_argument("--init-timeout", type=int, default=60)
  args = parser.parse_args(argv)
  _setup(args.devices)
  SCENARIOS[args.scenario](args)


if __name__ == "__main__":
  main()
