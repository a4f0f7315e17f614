"""Worker of ``tests/test_sharded.py``: ``kfl.kfac(layout="sharded")`` in
a fresh interpreter with 8 CPU devices (float64), printing its numbers as
JSON (``_distributed_worker``'s model, data, loops and ``RESULT`` line).

Model: the ten-block MLP ``DEEP`` (ten 4x4 dense layers, more blocks than
devices), batch 32, ``inverse_every=2``, 20 steps.

Every step is waited for (``block_until_ready``) before the next is
dispatched, so that programs over different device sets (meshes of 1, 2,
4 and 8 devices, pmap) are never in flight together: XLA:CPU runs the
devices' collectives on one thread pool of as many threads as devices
(on 2 cores), and twice (in full parallel runs of the suite) a rendezvous
of 8 devices timed out with 7 arrived; ``tests/_cpu_devices`` gives that
pool slack.
"""
from __future__ import annotations

import os
import re
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _distributed_worker as W  # noqa: E402

STEPS = 20
SIZES = W.DEEP
# A gentler step than the other workers' 0.1: over 20 steps at 0.1 the training
# itself amplifies rounding (the replicated layout on 8 devices ends 1e-12
# from one device), which would hide what the layout adds.
LR = 0.02


def _mesh(d):
  import jax
  import numpy as np
  from jax.sharding import Mesh
  return Mesh(np.array(jax.devices()[:d]), ("data",))


def _jit_run(tx, mesh, params, state, batches):
  """Plain ``jit`` on a batch sharded over ``mesh`` (``tx`` has ``mesh=``)."""
  import jax
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P
  loss_fn = W.make_loss(SIZES)

  @jax.jit
  def step(params, state, batch):
    grads = jax.grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params, batch=batch)
    return optax.apply_updates(params, updates), state
  for b in batches:
    params, state = jax.block_until_ready(step(
        params, state, jax.device_put(b, NamedSharding(mesh, P("data")))))
  return params, state, step


def _state_caches(kstate):
  import kfac_jax_lite as kfl
  return W.caches(kfl.sharding.unshard(kstate))


def _collectives(hlo, by_place=False):
  """``{kind: bytes}`` of the collectives in HLO text (result shapes); with
  ``by_place`` the kinds of those in the entry computation (every step)
  get the prefix ``"entry "``."""
  sizes = {"f64": 8, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s64": 8,
           "u64": 8, "bf16": 2, "f16": 2}
  out = {}
  entry = False
  for line in hlo.splitlines():
    if line and not line.startswith(" "):
      entry = line.startswith("ENTRY")
    m = re.search(r"=\s*(\(?[^=]*?\)?)\s+(all-reduce|reduce-scatter|"
                  r"all-gather)(-start)?\(", line)
    if not m:
      continue
    total = 0
    for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)):
      n = 1
      for x in filter(None, dims.split(",")):
        n *= int(x)
      total += n * sizes.get(dt, 4)
    kind = ("entry " if by_place and entry else "") + m.group(2)
    out[kind] = out.get(kind, 0) + total
  return out


def scenario_sharded(args):
  import jax
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P
  import kfac_jax_lite as kfl
  del args
  loss_fn = W.make_loss(SIZES)
  params = W.init_params(SIZES)
  batches = [W.make_batch(s, sizes=SIZES) for s in range(STEPS)]
  make = lambda **kw: W.make_tx(loss_fn, batches[0], lr=LR, **kw)
  result = {}

  # One device, the replicated layout: the reference.
  p1, s1, _ = W.run_single(loss_fn, params, batches, make())
  result.update(single_params=W.tolist(p1),
                single_caches=W.tolist(W.caches(s1[0])))

  # pmap over 8 devices, init inside the pmap.
  tx = make(axis_name="i", layout="sharded")
  devices = jax.local_devices()
  n = len(devices)
  put = lambda t: jax.device_put(t, W.pmap_sharding(devices))
  split = lambda b: put(jax.tree.map(
      lambda x: x.reshape((n, x.shape[0] // n) + x.shape[1:]), b))
  ps = put(W.replicate(params, n))
  state = jax.pmap(tx.init, axis_name="i")(ps)
  step = W.pmap_step(loss_fn, tx)
  for b in batches:
    ps, state, _ = jax.block_until_ready(step(ps, state, split(b)))
  k = state[0]
  result.update(pmap_params=W.tolist(W.first(ps)),
                pmap_caches=W.tolist(_state_caches(k)),
                pmap_spread=W.per_device_spread(ps),
                owners=kfl.sharding.owners(state),
                pmap_buffer_shapes=[list(b.shape) for b in k.blocks.buffers])

  # Plain jit with a Mesh of 1, 2, 4 and 8 devices, and the replicated
  # layout under the same mesh of 8.
  for d in (1, 2, 4, 8):
    mesh = _mesh(d)
    tx = make(axis_name="data", mesh=mesh)
    pm, sm, step = _jit_run(tx, mesh, params, tx.init(params), batches)
    blocks = sm[0].blocks
    per_device = {}
    for buf in blocks.buffers:
      for shard in buf.addressable_shards:
        per_device[shard.device.id] = (per_device.get(shard.device.id, 0)
                                       + shard.data.nbytes)
    total = sum(sum(x.nbytes for x in jax.tree.leaves(b))
                for b in kfl.sharding.unshard_blocks(blocks).values())
    largest = max(sum(x.nbytes for x in jax.tree.leaves(b))
                  for b in kfl.sharding.unshard_blocks(blocks).values())
    result[f"jit{d}"] = dict(
        params=W.tolist(pm), caches=W.tolist(_state_caches(sm[0])),
        layout=type(blocks).__name__, bytes_per_device=per_device,
        state_total=total, largest_block=largest,
        spec=str(blocks.buffers[0].sharding.spec))
    if d == 8:
      b = jax.device_put(batches[0], NamedSharding(mesh, P("data")))
      hlo = step.lower(params, sm, b).compile().as_text()
      result["hlo_sharded"] = _collectives(hlo)
      txr = make(axis_name="data", mesh=mesh, layout="replicated")
      pr, sr, stepr = _jit_run(txr, mesh, params, txr.init(params), batches)
      result["jit8_replicated"] = dict(
          params=W.tolist(pr), caches=W.tolist(W.caches(sr[0])))
      result["hlo_replicated"] = _collectives(
          stepr.lower(params, sr, b).compile().as_text())

  # Statistics every other step (a planned cov_every > 1) under the mesh:
  # the statistics' conditional inside the step's shard_map(check_vma=True).
  mesh = _mesh(8)
  p2, s2, _ = W.run_single(loss_fn, params, batches, make(cov_every=2))
  tx = make(axis_name="data", mesh=mesh, cov_every=2)
  pm, sm, _ = _jit_run(tx, mesh, params, tx.init(params), batches)
  result["jit8_cov2"] = dict(
      params=W.tolist(pm), caches=W.tolist(_state_caches(sm[0])),
      single_params=W.tolist(p2), single_caches=W.tolist(W.caches(s2[0])))

  # gather="inverses" (the caches gathered after refreshes), in π and in
  # exact damping mode; the sharded default in exact mode too.
  for mode in ("pi", "exact"):
    pe, se, _ = W.run_single(loss_fn, params, batches,
                             make(damping_mode=mode))
    result[f"single_{mode}"] = dict(params=W.tolist(pe),
                                    caches=W.tolist(W.caches(se[0])))
    for gather in ("inverses", "updates"):
      if (mode, gather) == ("pi", "updates"):
        continue  # jit8 above.
      tx = make(axis_name="data", mesh=mesh, gather=gather, damping_mode=mode)
      pg, sg, step = _jit_run(tx, mesh, params, tx.init(params), batches)
      result[f"{gather}_{mode}"] = dict(params=W.tolist(pg),
                                        caches=W.tolist(_state_caches(sg[0])))
      if (mode, gather) == ("pi", "inverses"):
        b = jax.device_put(batches[0], NamedSharding(mesh, P("data")))
        result["hlo_inverses"] = _collectives(
            step.lower(params, sg, b).compile().as_text(), by_place=True)
        result["inverses_bytes"] = kfl.sharding.bytes_per_device(sg[0].blocks)

  # Your own shard_map (check_vma=True), init outside with mesh=; the
  # specs of the state from kfl.sharding.specs.
  mesh = _mesh(8)
  tx = make(axis_name="data", mesh=mesh)
  state = tx.init(params)
  specs = kfl.sharding.specs(state)

  def body(params, state, batch):
    grads = W._per_device_grads(loss_fn, params, batch, "data", True)
    updates, state = tx.update(grads, state, params, batch=batch)
    return optax.apply_updates(params, updates), state
  run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), specs,
                                                         P("data")),
                              out_specs=(P(), specs)))
  pm = params
  for b in batches:
    pm, state = jax.block_until_ready(run(pm, state, b))
  result["shard_map"] = dict(params=W.tolist(pm),
                             caches=W.tolist(_state_caches(state[0])))

  # The one-pass style (stats= from value_grad_and_stats) with cov_every=2,
  # under pmap, against one device doing the same with batch=.
  kw = dict(cov_every=2)
  tx1 = make(**kw)
  q1, t1, _ = W.run_single(loss_fn, params, batches, tx1)
  tx = make(axis_name="i", layout="sharded", **kw)
  est_fn = kfl.value_grad_and_stats(loss_fn, params, batches[0],
                                    estimation="exact")

  def onepass(params, state, batch):
    est = est_fn(params, batch, jax.random.PRNGKey(0),
                 with_stats=kfl.stats_due(state))
    grads = jax.lax.pmean(est.grads, "i")
    updates, state = tx.update(grads, state, params, stats=est.stats)
    return optax.apply_updates(params, updates), state
  stepo = jax.pmap(onepass, axis_name="i")
  ps = put(W.replicate(params, n))
  state = jax.pmap(tx.init, axis_name="i")(ps)
  for b in batches:
    ps, state = jax.block_until_ready(stepo(ps, state, split(b)))
  result["onepass"] = dict(
      params=W.tolist(W.first(ps)), caches=W.tolist(_state_caches(state[0])),
      single_params=W.tolist(q1), single_caches=W.tolist(W.caches(t1[0])))

  # The checkpoint: 10 steps on 8 devices, saved in the replicated layout
  # (unshard), restored onto 4 devices (shard_like) and onto one device
  # (the replicated layout), 10 more steps each.
  half = STEPS // 2
  tx8 = make(axis_name="data", mesh=_mesh(8))
  p8, s8, _ = _jit_run(tx8, _mesh(8), params, tx8.init(params),
                       batches[:half])
  saved = jax.device_get(kfl.sharding.unshard(s8))
  tx4 = make(axis_name="data", mesh=_mesh(4))
  s4 = kfl.sharding.shard_like(saved, tx4.init(params))
  p8 = jax.device_get(p8)  # On the host: the next run picks its devices.
  p4, s4, _ = _jit_run(tx4, _mesh(4), p8, s4, batches[half:])
  tx1 = make()
  sone = kfl.sharding.shard_like(saved, tx1.init(params))
  pone, sone, _ = W.run_single(loss_fn, p8, batches[half:], tx1, state=sone)
  result["restored4"] = dict(params=W.tolist(p4),
                             caches=W.tolist(_state_caches(s4[0])),
                             devices=s4[0].blocks.layout.devices)
  result["restored1"] = dict(params=W.tolist(pone),
                             caches=W.tolist(W.caches(sone[0])))
  result["health"] = str(kfl.health(s4))

  # kfl.kfac_optimizer in the sharded layout under pmap (init inside the
  # pmap), 5 steps (the 5th adapts the damping), against one device.
  kw = dict(estimation="exact", inverse_every=2)
  q1, _, _ = W.run_single(loss_fn, params, batches[:5],
                          kfl.kfac_optimizer(loss_fn, batches[0], **kw))
  opt = kfl.kfac_optimizer(loss_fn, batches[0], axis_name="i",
                           layout="sharded", **kw)
  ps = put(W.replicate(params, n))
  state = jax.pmap(opt.init, axis_name="i")(ps)
  step = W.pmap_step(loss_fn, opt)
  for b in batches[:5]:
    ps, state, _ = jax.block_until_ready(step(ps, state, split(b)))
  result["optimizer"] = dict(params=W.tolist(W.first(ps)),
                             single_params=W.tolist(q1))

  # Refusals: a state of 8 devices in a step on 4; init outside any map
  # without a mesh; EKFAC.
  errors = {}
  try:
    _jit_run(tx4, _mesh(4), p8, s8, batches[:1])
  except ValueError as e:
    errors["devices"] = str(e)
  try:
    make(axis_name="i", layout="sharded").init(params)
  except ValueError as e:
    errors["no_mesh"] = str(e)
  try:
    make(axis_name="data", mesh=_mesh(8), blocks={"dense": "ekfac"}).init(
        params)
  except ValueError as e:
    errors["ekfac"] = str(e)
  try:
    make(layout="sharded")
  except ValueError as e:
    errors["no_axis"] = str(e)
  try:
    make(axis_name="data", mesh=mesh, gather="everything")
  except ValueError as e:
    errors["gather"] = str(e)
  result["errors"] = errors
  W.emit(result)


def _hlo_summary(compiled):
  """``{kind: {"every": bytes, "cond": bytes, ...}}`` of a compiled step's
  collectives (``benchmarks/_hlo``, as ``sharded_curvature.py`` counts)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  sys.path.insert(0, os.path.join(root, "benchmarks"))
  import _hlo
  return _hlo.summarize(_hlo.collectives(compiled.as_text(), 8))


def scenario_onepass(args):
  """The one-pass style under plain ``jit`` with a mesh of 8 devices
  (issue 36): ``value_grad_and_stats(..., axis_name=, mesh=)``'s
  per-device statistics into ``kfl.kfac(mesh=)`` in the sharded layout,
  the replicated layout, and a transform without a mesh; ``cov_every=2``
  with ``with_stats=kfl.stats_due(state)``; against one device's
  ``batch=`` style and the sharded ``batch=`` style on the mesh. Plus the
  estimate itself against the plain one, and the collectives of the
  sharded one-pass step with and without the estimator's mesh."""
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P
  import kfac_jax_lite as kfl
  del args
  steps = 6
  loss_fn = W.make_loss(SIZES)
  params = W.init_params(SIZES)
  batches = [W.make_batch(s, sizes=SIZES) for s in range(steps)]
  kw = dict(cov_every=2)
  make = lambda **k: W.make_tx(loss_fn, batches[0], lr=LR, **kw, **k)
  mesh = _mesh(8)
  data = NamedSharding(mesh, P("data"))
  key = jax.random.PRNGKey(0)
  result = {}

  p1, s1, _ = W.run_single(loss_fn, params, batches, make())
  result["single"] = dict(params=W.tolist(p1), caches=W.tolist(W.caches(s1[0])))
  tx = make(axis_name="data", mesh=mesh)
  pb, sb, _ = _jit_run(tx, mesh, params, tx.init(params), batches)
  result["batch"] = dict(params=W.tolist(pb), caches=W.tolist(_state_caches(sb[0])))

  plain = kfl.value_grad_and_stats(loss_fn, params, batches[0],
                                   estimation="exact")
  on_mesh = kfl.value_grad_and_stats(loss_fn, params, batches[0],
                                     estimation="exact", axis_name="data",
                                     mesh=mesh)

  # The estimate: per-device statistics whose device mean is the plain one.
  b0 = jax.device_put(batches[0], data)
  e1 = jax.jit(plain)(params, batches[0], key)
  e8 = jax.jit(on_mesh)(params, b0, key)
  st = {k: v for k, v in e8.stats.items() if k != kfl.estimators.DEVICE_ENTRY}
  result["estimate"] = dict(
      loss=[float(e8.loss), float(e1.loss)],
      grads=[W.tolist(e8.grads), W.tolist(e1.grads)],
      stats=[W.tolist(kfl.estimators.device_mean(e8.stats)),
             W.tolist(e1.stats)],
      weights=[W.tolist(e8.weights), W.tolist(e1.weights)],
      rows=sorted({int(x.shape[0]) for x in jax.tree.leaves(st)}),
      devices=W.tolist(e8.stats[kfl.estimators.DEVICE_ENTRY]),
      spec=str(jax.tree.leaves(st)[0].sharding.spec))

  def run_recording(name, tx, est_fn):
    """``run``, its warnings' messages kept under ``name``."""
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      out = run(tx, est_fn)
    result.setdefault("warnings", {})[name] = [str(w.message) for w in caught]
    return out

  def run(tx, est_fn):
    @jax.jit
    def step(params, state, batch):
      est = est_fn(params, batch, key, with_stats=kfl.stats_due(state))
      updates, state = tx.update(est.grads, state, params, stats=est.stats,
                                 loss=est.loss)
      return optax.apply_updates(params, updates), state
    p, s = params, tx.init(params)
    for b in batches:
      p, s = jax.block_until_ready(step(p, s, jax.device_put(b, data)))
    return p, s, step

  for name, tx in (("sharded", make(axis_name="data", mesh=mesh)),
                   ("replicated", make(axis_name="data", mesh=mesh,
                                       layout="replicated")),
                   ("no_mesh", make())):
    p, s, step = run_recording(name, tx, on_mesh)
    caches = (_state_caches(s[0]) if name == "sharded" else W.caches(s[0]))
    result[name] = dict(params=W.tolist(p), caches=W.tolist(caches))
    if name == "sharded":
      b = jax.device_put(batches[0], data)
      result["hlo_mesh"] = _hlo_summary(step.lower(params, s, b).compile())
      tx0 = make(axis_name="data", mesh=mesh)
      # The estimator unaware of the mesh.
      _, s0, step0 = run_recording("plain", tx0, plain)
      result["hlo_plain"] = _hlo_summary(step0.lower(params, s0, b).compile())
  shapes = jax.eval_shape(plain, params, batches[0], key)
  stats, _ = kfl.estimators.split_run(shapes.stats)
  result["grad_bytes"] = sum(x.size * x.dtype.itemsize
                             for x in jax.tree.leaves(shapes.grads))
  result["stats_bytes"] = sum(x.size * x.dtype.itemsize
                              for x in jax.tree.leaves(stats))
  del jnp
  W.emit(result)


def main(argv=None):
  import argparse
  parser = argparse.ArgumentParser()
  parser.add_argument("scenario", choices=["sharded", "onepass"])
  parser.add_argument("--devices", type=int, default=8)
  args = parser.parse_args(argv)
  W._setup(args.devices)
  (scenario_onepass if args.scenario == "onepass" else scenario_sharded)(args)


if __name__ == "__main__":
  main()
