"""Memory, communication and refresh FLOPs of K-FAC's curvature across devices.

    python benchmarks/sharded_curvature.py                       # 3 models, D = 1, 2, 4, 8
    python benchmarks/sharded_curvature.py --models mlp --devices 1,8

Runs on 8 CPU devices of one process: the script sets ``XLA_FLAGS=
--xla_force_host_platform_device_count=8`` (unless ``XLA_FLAGS`` already
names a device count) and ``JAX_PLATFORMS=cpu`` (unless set) before it
imports JAX. Nothing is timed: the numbers are bytes and FLOPs, so the
data is random (of the models' shapes and dtypes).

Models (``_models``, except the MLP, which is defined here):

* ``mlp``: dense 256-1024-256-1024-256-10, tanh after every hidden layer,
  ``kfl.softmax_cross_entropy_with_integer_labels`` averaged over a batch
  of 64 (``N(0, 1)`` inputs, uniform labels);
* ``autoencoder``: the MNIST autoencoder 784-1000-500-250-30-250-500-1000-
  784 at ``autoencoder.py``'s batch of 1000 (uniform inputs);
* ``charlm``: the char LM at ``charlm.py``'s sizes (``charlm.FULL``: 2
  layers, width 128, 4 heads, context 128, batch 32) with the vocabulary of
  its corpus (``_data.load_text``), uniform random tokens.

Per model, per device count ``D`` (a ``Mesh(devices[:D], ("data",))``) and
per layout:

* ``gspmd`` (today's way): ``optax.chain(kfl.kfac(loss_fn, batch),
  optax.sgd(1e-2, momentum=0.9))`` with no ``axis_name``; parameters and
  optimizer state replicated (``NamedSharding(mesh, P())``, also the
  step's ``out_shardings``), the batch sharded over ``"data"``; the step
  ``grads = jax.grad(loss_fn)(params, batch); tx.update(grads, state,
  params, batch=batch)`` under ``jax.jit``; XLA's SPMD partitioner decides
  the rest.
* ``replicated`` and ``sharded``: ``kfl.kfac(loss_fn, batch,
  axis_name="data", mesh=mesh, layout=...)``, the same step under
  ``jax.jit`` (``update`` runs its own ``shard_map``), ``tx.init(params)``
  placing the curvature on the mesh; ``sharded+inv``: ``layout="sharded",
  gather="inverses"`` (the caches gathered after refreshes, no per-step
  gather); ``onepass``: the sharded layout in the one-pass style, ``est =
  kfl.value_grad_and_stats(loss_fn, params, batch, axis_name="data",
  mesh=mesh)(params, batch, key)`` then ``tx.update(est.grads, state,
  params, stats=est.stats)`` (the statistics come per device and are
  reduce-scattered to their owners).
  State leaves that ``init`` leaves off the mesh (the SGD momentum, ...) are
  replicated on it.

Columns (all after compiling the step and running it once):

a. ``state/dev``: bytes of the ``KfacState`` (found in the optax state by
   type) held on each device: per device the sum of ``shard.data.nbytes``
   over the leaves' ``addressable_shards`` on it; the max over the ``D``
   devices. ``state total``: its logical bytes (sum of ``leaf.nbytes``;
   under ``sharded`` the ``[D, L]`` buffers, so the padding of every row
   to the longest ``L`` counts).
b. ``args``, ``out``, ``temp``: ``compiled.memory_analysis()`` of the step
   (argument, output and temporary buffers of the per-device program:
   params, optimizer state and batch shard in; params and state out).
c. collectives: from ``compiled.as_text()`` (``_hlo``): per kind
   (all-reduce ``AR``, reduce-scatter ``RS``, all-gather ``AG``,
   collective-permute ``CP``, all-to-all ``A2A``) the bytes of the
   instructions' results in the per-device program, split into those that
   run on every step and those only inside a ``conditional``'s branches
   (the refresh's and the statistics' ``lax.cond``; anything a branch calls
   included). ``ring/dev``: the bytes one device sends on a ring of ``g``
   devices: all-reduce ``2(g-1)/g·size``, reduce-scatter ``(g-1)/g·input``,
   all-gather and all-to-all ``(g-1)/g·output``, a permute its buffer. A
   collective in a ``while`` body counts once. A ``shard_map`` keeps its
   collectives at ``D = 1`` (over one device): they count in the bytes
   columns and send nothing.
d. refresh FLOPs (analytic): ``c·n³`` per dense factor ``[..., n, n]`` (its
   ``FactorState.cov``; times the leading stack size), ``c = 2``, the
   Gauss-Jordan sweep that ``inverse_method="auto"`` picks on CPU
   (``_cost_model.DECOMP_COSTS``; an eigh would be about 10), ``n`` per
   diagonal factor; a block costs the sum over its factors. Per device the
   sum over the blocks it refreshes: under ``gspmd`` every device runs every
   refresh (the computation is replicated); ``replicated`` refreshes block
   ``i`` (the order of ``KfacState.blocks``) on device ``i mod D``;
   ``sharded`` on its owner (``KfacState.blocks``, a
   ``kfl.sharding.ShardedBlocks``: ``layout.owners[i]`` owns
   ``layout.names[i]``). ``max/dev`` against ``total/D`` and their ratio
   (1 = perfectly balanced; ``D`` = every device does everything).

The printout goes to ``results/sharded_curvature.txt`` only when the
layouts exist (``--out`` another path, ``--no-save`` none).
"""
from __future__ import annotations

import os
import re

if not re.search(r"--xla_force_host_platform_device_count=",
                 os.environ.get("XLA_FLAGS", "")):
  os.environ["XLA_FLAGS"] = " ".join(
      os.environ.get("XLA_FLAGS", "").split()
      + ["--xla_force_host_platform_device_count=8"])
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import datetime  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import _cost_model  # noqa: E402
import _data  # noqa: E402
import _hlo  # noqa: E402
import _models as M  # noqa: E402
from _harness import RESULTS, kfl  # noqa: E402

LAYOUTS = ("gspmd", "replicated", "sharded", "sharded+inv", "onepass")
DEVICES = (1, 2, 4, 8)
MLP_DIMS = (256, 1024, 256, 1024, 256, 10)
MLP_BATCH = 64
AUTOENCODER_BATCH = 1000  # autoencoder.py's default --batch.
# FLOPs per n³ of one dense factor's refresh: the Gauss-Jordan inverse
# ("auto" on CPU), from the cost model's table.
REFRESH_C = dict((name.split()[1], c) for name, c in _cost_model.DECOMP_COSTS)[
    "gauss-jordan"]


# ---------------------------------------------------------------- models

def mlp_logits(params, x):
  """Dense layers, tanh after each but the last (logits)."""
  h = x
  for i, layer in enumerate(params):
    h = h @ layer["w"] + layer["b"]
    if i < len(params) - 1:
      h = jnp.tanh(h)
  return h


def mlp_loss(params, batch):
  out = mlp_logits(params, batch["x"])
  return kfl.softmax_cross_entropy_with_integer_labels(out, batch["y"]).mean()


def make_model(name, seed=0):
  """``(loss_fn, params, batch, description)`` with random data."""
  k_params, k_x, k_y = jax.random.split(jax.random.PRNGKey(seed), 3)
  if name == "mlp":
    params = M.autoencoder_init(MLP_DIMS, k_params)  # Dense N(0, 1/fan_in).
    batch = {"x": jax.random.normal(k_x, (MLP_BATCH, MLP_DIMS[0])),
             "y": jax.random.randint(k_y, (MLP_BATCH,), 0, MLP_DIMS[-1])}
    desc = (f"MLP {'-'.join(map(str, MLP_DIMS))} (tanh), softmax "
            f"cross-entropy, batch {MLP_BATCH} of N(0,1) inputs")
    return mlp_loss, params, batch, desc
  if name == "autoencoder":
    params, batch = M.random_problem(M.AUTOENCODER, AUTOENCODER_BATCH, seed)
    desc = (f"MNIST autoencoder {'-'.join(map(str, M.AUTOENCODER))} (tanh, "
            f"linear code), sigmoid cross-entropy, batch {AUTOENCODER_BATCH} "
            "of uniform inputs")
    return M.autoencoder_loss, params, batch, desc
  if name == "charlm":
    import charlm
    s = charlm.FULL
    vocab = len(_data.load_text().vocab)
    params = M.charlm_init(vocab, s["layers"], s["width"], s["context"],
                           k_params)
    tokens = jax.random.randint(k_x, (s["batch"], s["context"] + 1), 0, vocab)
    batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
    desc = (f"char LM: {s['layers']} layers, width {s['width']}, "
            f"{s['heads']} heads, context {s['context']}, vocab {vocab}, "
            f"batch {s['batch']} windows of random tokens")
    return M.make_charlm_loss(s["heads"]), params, batch, desc
  raise ValueError(f"unknown model {name!r}")


# ------------------------------------------------------------ measuring

def kfac_state(opt_state):
  """The ``KfacState`` inside an optax state."""
  is_kfac = lambda x: isinstance(x, kfl.KfacState)
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_kfac)
           if is_kfac(x)]
  if len(found) != 1:
    raise ValueError(f"expected one KfacState in the optax state, found "
                     f"{len(found)}")
  return found[0]


def state_bytes(tree, devices):
  """``(max bytes on one of devices, logical bytes)`` of the array leaves."""
  per_device = {d: 0 for d in devices}
  total = 0
  for leaf in jax.tree.leaves(tree):
    if not isinstance(leaf, jax.Array):
      continue
    total += leaf.nbytes
    for shard in leaf.addressable_shards:
      per_device[shard.device] = (per_device.get(shard.device, 0)
                                  + shard.data.nbytes)
  return max(per_device.values()), total


def block_refresh_flops(blocks):
  """``{layer name: refresh FLOPs}`` of a ``{name: block state}`` dict:
  ``REFRESH_C·n³`` per dense factor, ``n`` per diagonal one (module doc)."""
  is_factor = lambda x: isinstance(x, kfl.FactorState)
  out = {}
  for name, st in blocks.items():
    flops = 0.0
    for f in jax.tree.leaves(st, is_leaf=is_factor):
      if not is_factor(f):
        continue
      shape = tuple(f.cov.shape)
      if len(shape) >= 2 and shape[-1] == shape[-2]:
        flops += REFRESH_C * shape[-1] ** 3 * math.prod(shape[:-2])
      else:
        flops += shape[-1] * math.prod(shape[:-1]) if shape else 0
    out[name] = flops
  return out


def owners_of(layout, blocks, names, n):
  """``{layer name: device index}`` refreshing it, or None: every device."""
  if layout == "gspmd":
    return None
  lay = getattr(blocks, "layout", None)  # kfl.sharding.ShardedBlocks
  owners = getattr(lay, "owners", None)
  if owners is not None:  # Per layout.names, or a {name: device} dict.
    pairs = (owners.items() if isinstance(owners, dict)
             else zip(lay.names, owners))
    return {k: int(v) for k, v in pairs}
  order = list(blocks) if isinstance(blocks, dict) else names
  return {k: i % n for i, k in enumerate(order)}


def memory(compiled):
  m = compiled.memory_analysis()
  if m is None:
    return None
  return dict(args=getattr(m, "argument_size_in_bytes", None),
              out=getattr(m, "output_size_in_bytes", None),
              temp=getattr(m, "temp_size_in_bytes", None))


def measure(model, layout, n):
  """One row: compile the step for ``layout`` on ``n`` devices, run it
  once, and measure (module docstring)."""
  loss_fn, params, batch, _ = model
  devices = jax.devices()[:n]
  mesh = Mesh(np.array(devices), ("data",))
  rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  if layout == "gspmd":
    kf = kfl.kfac(loss_fn, batch)
  else:
    kw = (dict(layout="sharded", gather="inverses") if layout == "sharded+inv"
          else dict(layout="sharded") if layout == "onepass"
          else dict(layout=layout))
    kf = kfl.kfac(loss_fn, batch, axis_name="data", mesh=mesh, **kw)
  tx = optax.chain(kf, optax.sgd(1e-2, momentum=0.9))
  params = jax.device_put(params, rep)
  batch = jax.device_put(batch, data)

  def on_mesh(x):
    s = getattr(x, "sharding", None)
    if isinstance(s, NamedSharding) and s.mesh == mesh:
      return x
    return jax.device_put(x, rep)

  if layout == "gspmd":
    state = jax.device_put(tx.init(params), rep)
  else:  # The curvature is placed by init; the rest replicated.
    state = jax.tree.map(on_mesh, tx.init(params))

  def step(params, state, batch):
    grads = jax.grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params, batch=batch)
    return optax.apply_updates(params, updates), state

  if layout == "onepass":
    est_fn = kfl.value_grad_and_stats(loss_fn, params, batch,
                                      axis_name="data", mesh=mesh)

    def step(params, state, batch):  # noqa: F811  (the one-pass style)
      est = est_fn(params, batch, jax.random.PRNGKey(0))
      updates, state = tx.update(est.grads, state, params, stats=est.stats)
      return optax.apply_updates(params, updates), state

  if layout == "gspmd":
    jitted = jax.jit(step, in_shardings=(rep, rep, data),
                     out_shardings=(rep, rep))
  else:
    jitted = jax.jit(step)
  compiled = jitted.lower(params, state, batch).compile()
  params, state = compiled(params, state, batch)
  jax.block_until_ready(state)

  ks = kfac_state(state)
  per_dev, total = state_bytes(ks, devices)
  colls = _hlo.summarize(_hlo.collectives(compiled.as_text(), n))
  return dict(state_dev=per_dev, state_total=total, mem=memory(compiled),
              colls=colls, blocks=ks.blocks)


def flops_row(layout, blocks, block_flops, n):
  """``(max per device, total / n)`` of the refresh FLOPs."""
  total = sum(block_flops.values())
  owners = owners_of(layout, blocks, list(block_flops), n)
  if owners is None:
    return total, total / n
  missing = sorted(set(block_flops) - set(owners))
  if missing:  # Not in layout.owners: counted on device i mod D.
    print(f"  (refresh FLOPs: no owner for {missing}; block i counted on "
          "device i mod D)")
  per = [0.0] * n
  for i, (name, f) in enumerate(block_flops.items()):
    per[owners.get(name, i) % n] += f
  return max(per), total / n


# ------------------------------------------------------------- printing

def fmt_bytes(b):
  if b is None:
    return "-"
  b = float(b)
  for unit, scale in (("G", 2 ** 30), ("M", 2 ** 20), ("K", 2 ** 10)):
    if b >= scale:
      return f"{b / scale:.3g}{unit}"
  return f"{b:.0f}"


def fmt_flops(f):
  return f"{f / 1e9:.3g}G" if f >= 1e7 else f"{f / 1e6:.3g}M"


MEM_HEAD = (f"  {'layout':<11}{'D':>2}  {'state/dev':>10}{'state total':>12}"
            f"{'args':>9}{'out':>9}{'temp':>9}  {'refresh FLOP max/dev':>21}"
            f"{'total/D':>9}{'ratio':>7}")
KIND_ABBR = {"all-reduce": "AR", "reduce-scatter": "RS", "all-gather": "AG",
             "collective-permute": "CP", "all-to-all": "A2A"}
COLL_HEAD = (f"  {'layout':<11}{'D':>2}  " + "".join(
    f"{a + ' every':>10}{a + ' cond':>10}" for a in KIND_ABBR.values())
    + f"{'ring/dev every':>16}{'ring/dev cond':>15}")


def mem_line(layout, n, r, flops):
  mem = r["mem"] or {}
  mx, avg = flops
  return (f"  {layout:<11}{n:>2}  {fmt_bytes(r['state_dev']):>10}"
          f"{fmt_bytes(r['state_total']):>12}{fmt_bytes(mem.get('args')):>9}"
          f"{fmt_bytes(mem.get('out')):>9}{fmt_bytes(mem.get('temp')):>9}  "
          f"{fmt_flops(mx):>21}{fmt_flops(avg):>9}"
          f"{(mx / avg if avg else float('nan')):>7.2f}")


def coll_line(layout, n, r):
  c = r["colls"]
  cells = "".join(f"{fmt_bytes(c[k]['every']):>10}{fmt_bytes(c[k]['cond']):>10}"
                  for k in KIND_ABBR)
  ring_e = sum(c[k]["ring_every"] for k in c)
  ring_c = sum(c[k]["ring_cond"] for k in c)
  return (f"  {layout:<11}{n:>2}  {cells}{fmt_bytes(ring_e):>16}"
          f"{fmt_bytes(ring_c):>15}")


def source_revision():
  """``git describe --always --dirty`` of this checkout, or "unknown"."""
  try:
    out = subprocess.run(["git", "describe", "--always", "--dirty"],
                         cwd=os.path.dirname(os.path.abspath(__file__)),
                         capture_output=True, text=True, timeout=10)
    return out.stdout.strip() or "unknown"
  except (OSError, subprocess.SubprocessError):
    return "unknown"


def header(args):
  import jaxlib.version
  now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
  return [
      f"{now}  sharded_curvature.py {' '.join(args.argv)}".rstrip()
      + f"  (source {source_revision()})",
      f"host {platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}"
      f"; jax {jax.__version__} (jaxlib {jaxlib.version.__version__}), optax "
      f"{optax.__version__}, kfac_jax_lite {kfl.__version__}; backend "
      f"{jax.default_backend()}, {len(jax.devices())} devices",
      "Per model, two tables; D = devices in the mesh (axis 'data'); "
      "bytes in KiB/MiB/GiB (K/M/G).",
      "  gspmd: kfl.kfac with no axis_name, params+state replicated, batch "
      "sharded, jit (XLA's partitioner); replicated/sharded: "
      "kfl.kfac(axis_name='data', mesh=, layout=), jit; sharded+inv: "
      "layout='sharded', gather='inverses'; onepass: sharded, stats= from "
      "value_grad_and_stats(axis_name='data', mesh=).",
      "  state/dev: KfacState bytes on the fullest device after one step "
      "(sum of addressable shards' nbytes per device); state total: its "
      "logical bytes (sharded: the [D, L] buffers, padding to the longest "
      "row L included).",
      "  args/out/temp: compiled.memory_analysis() of the step, per device.",
      "  refresh FLOP: analytic, 2n^3 per dense factor [..., n, n] "
      "(Gauss-Jordan, inverse_method='auto' on CPU; an eigh is ~10n^3), n per "
      "diagonal one; max/dev over the blocks each device refreshes "
      "(gspmd: all; replicated: block i on device i mod D; sharded: "
      "layout.owners), total/D, ratio = max/dev / (total/D).",
      "  collectives: result bytes of each kind in the compiled per-device "
      "HLO, on every step ('every') or only inside a conditional's branches "
      "('cond': refresh, statistics gating); AR all-reduce, RS "
      "reduce-scatter, AG all-gather, CP collective-permute, A2A all-to-all.",
      "  ring/dev: bytes one device sends on a ring: AR 2(g-1)/g*size, RS "
      "(g-1)/g*input, AG and A2A (g-1)/g*output, CP its buffer (a "
      "collective over one device, which a shard_map at D=1 keeps, counts "
      "in the bytes columns but sends nothing).",
  ]


# ------------------------------------------------------------------ main

def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--models", type=lambda s: s.split(","),
                 default=["mlp", "autoencoder", "charlm"],
                 help="comma-separated: mlp, autoencoder, charlm")
  p.add_argument("--devices", type=lambda s: [int(v) for v in s.split(",")],
                 default=list(DEVICES), help="comma-separated device counts")
  p.add_argument("--layouts", type=lambda s: s.split(","),
                 default=list(LAYOUTS), help="comma-separated: " +
                 ", ".join(LAYOUTS))
  p.add_argument("--out", default=os.path.join(RESULTS,
                                               "sharded_curvature.txt"))
  p.add_argument("--no-save", action="store_true")
  p.add_argument("--strict", action="store_true",
                 help="raise on a failed row instead of printing it")
  args = p.parse_args(argv)
  args.argv = list(sys.argv[1:] if argv is None else argv)
  for m in args.models:
    if m not in ("mlp", "autoencoder", "charlm"):
      p.error(f"unknown model {m!r}")
  for lay in args.layouts:
    if lay not in LAYOUTS:
      p.error(f"unknown layout {lay!r}")

  lines = []

  def out(line=""):
    print(line, flush=True)
    lines.append(line)

  for line in header(args):
    out(line)
  available = len(jax.devices())
  results = {}
  for name in args.models:
    model = make_model(name)
    loss_fn, params, batch, desc = model
    ref = jax.eval_shape(kfl.kfac(loss_fn, batch).init, params)
    block_flops = block_refresh_flops(ref.blocks)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    out()
    out(f"== {name}: {desc}; {n_params} parameters, {len(block_flops)} "
        f"curvature blocks, refresh {fmt_flops(sum(block_flops.values()))}"
        "FLOP in all ==")
    rows = []
    for lay in args.layouts:
      for n in args.devices:
        if n > available:
          rows.append((lay, n, f"skipped: {available} devices here"))
        else:
          try:
            r = measure(model, lay, n)
            rows.append((lay, n, r, flops_row(lay, r["blocks"], block_flops,
                                              n)))
          except Exception as e:  # noqa: BLE001  (printed as the row)
            if args.strict:
              raise
            traceback.print_exc()
            rows.append((lay, n, f"error: {type(e).__name__}: "
                         f"{str(e).splitlines()[0][:160] if str(e) else ''}"))
    results[name] = rows
    out(" memory and refresh FLOPs")
    out(MEM_HEAD)
    for row in rows:
      out(mem_line(row[0], row[1], row[2], row[3]) if len(row) == 4 else
          f"  {row[0]:<11}{row[1]:>2}  {row[2]}")
    out(" collective bytes per step (per-device program)")
    out(COLL_HEAD)
    for row in rows:
      out(coll_line(row[0], row[1], row[2]) if len(row) == 4 else
          f"  {row[0]:<11}{row[1]:>2}  {row[2]}")

  if not args.no_save:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      f.write("\n".join(lines) + "\n")
    print(f"\nwritten to {args.out}")
  return results


if __name__ == "__main__":
  main()
