"""``benchmarks/_hlo.py`` reads the collectives of a compiled program.

The parser is a pure function of the HLO text: a handwritten module checks
the corner cases (tuples, asynchronous start/done pairs, the iota and empty
replica groups, ``true_computation=``/``false_computation=``, a branch that
calls a further computation, a ``while`` body); one subprocess with 4 CPU
devices (the main pytest process has one, and one device's program keeps no
collectives) compiles a ``shard_map`` with a known ``psum``,
``psum_scatter``, ``all_gather``, ``ppermute`` and a ``psum`` inside a
``lax.cond``, and the parser must find exactly those.
"""
import importlib
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BENCH = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCH)

_hlo = importlib.import_module("_hlo")

HANDWRITTEN = """\
HloModule jit_step, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%inner (p: f32[16,16]) -> f32[16,16] {
  %p = f32[16,16]{1,0} parameter(0)
  ROOT %ag = f32[16,16]{1,0} all-gather(f32[2,16]{1,0} %p), channel_id=3, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true
}

%yes (t: (f32[16,16])) -> (f32[16,16]) {
  %t = (f32[16,16]{1,0}) parameter(0)
  %g = f32[16,16]{1,0} get-tuple-element(%t), index=0
  %c = f32[16,16]{1,0} call(%g), to_apply=%inner
  %ar = (f32[16,16]{1,0}, bf16[4]{0}) all-reduce(%c, %c), channel_id=4, replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add, metadata={op_name="all-reduce(x) conditional(y)"}
  ROOT %r = (f32[16,16]{1,0}) tuple(%c)
}

%no (t: (f32[16,16])) -> (f32[16,16]) {
  ROOT %t = (f32[16,16]{1,0}) parameter(0)
}

%body (w: f32[8]) -> f32[8] {
  %w = f32[8]{0} parameter(0)
  ROOT %a2a = f32[8]{0} all-to-all(%w), channel_id=5, replica_groups={}, dimensions={0}
}

%cnd (w: f32[8]) -> pred[] {
  %w = f32[8]{0} parameter(0)
  ROOT %k = pred[] constant(true)
}

%dead (w: f32[8]) -> f32[8] {
  %w = f32[8]{0} parameter(0)
  ROOT %x = f32[8]{0} all-reduce(%w), replica_groups={}, to_apply=%add
}

ENTRY %main (x: f32[16,16], pr: pred[], v: f32[8]) -> f32[16,16] {
  %x = f32[16,16]{1,0} parameter(0), sharding={replicated}
  %pr = pred[] parameter(1)
  %v = f32[8]{0} parameter(2)
  %st = f32[16,16]{1,0} all-reduce-start(%x), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %dn = f32[16,16]{1,0} all-reduce-done(%st)
  %rs = f32[2,16]{1,0} reduce-scatter(%dn), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
  %cps = (f32[2,16]{1,0}, f32[2,16]{1,0}, u32[], u32[]) collective-permute-start(%rs), source_target_pairs={{0,1},{1,0}}
  %cpd = f32[2,16]{1,0} collective-permute-done(%cps)
  %wl = f32[8]{0} while(%v), condition=%cnd, body=%body
  %tp = (f32[16,16]{1,0}) tuple(%dn)
  %cd = (f32[16,16]{1,0}) conditional(%pr, %tp, %tp), true_computation=%yes, false_computation=%no
  ROOT %out = f32[16,16]{1,0} get-tuple-element(%cd), index=0
}
"""


def test_handwritten_module():
  colls = {c.name: c for c in _hlo.collectives(HANDWRITTEN)}
  assert sorted(colls) == ["a2a", "ag", "ar", "cpd", "dn", "rs"]
  dn, rs, cpd = colls["dn"], colls["rs"], colls["cpd"]
  assert (dn.kind, dn.nbytes, dn.group, dn.conditional) == (
      "all-reduce", 1024, 8, False)
  assert (rs.kind, rs.nbytes, rs.group) == ("reduce-scatter", 128, 8)
  assert (cpd.kind, cpd.nbytes, cpd.group) == ("collective-permute", 128, None)
  a2a = colls["a2a"]  # replica_groups={} -> num_partitions; in a while body.
  assert (a2a.group, a2a.loops, a2a.conditional) == (8, True, False)
  ar, ag = colls["ar"], colls["ag"]  # In the true branch, and called from it.
  assert (ar.nbytes, ar.group, ar.conditional) == (1024 + 8, 4, True)
  assert (ag.nbytes, ag.group, ag.conditional) == (1024, 8, True)

  s = _hlo.summarize(colls.values())
  assert s["all-reduce"]["every"] == 1024 and s["all-reduce"]["cond"] == 1032
  assert s["all-reduce"]["ring_every"] == pytest.approx(2 * 7 / 8 * 1024)
  assert s["reduce-scatter"]["ring_every"] == pytest.approx(7 / 8 * 8 * 128)
  assert s["all-gather"]["ring_cond"] == pytest.approx(7 / 8 * 1024)
  assert s["collective-permute"]["ring_every"] == 128


def test_shape_bytes():
  assert _hlo.shape_bytes("f32[8,16]{1,0}") == 512
  assert _hlo.shape_bytes("(f32[2]{0}, s8[3], pred[], token[])") == 12
  assert _hlo.shape_bytes("bf16[4,4]{1,0:T(8,128)(2,1)}") == 32


WORKER = r"""
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
sys.path.insert(0, sys.argv[1])
import _hlo
mesh = Mesh(np.array(jax.devices()), ("data",))

def f(x, y):
  a = jax.lax.psum(x, "data")                              # f32[8,16] 512 B
  b = jax.lax.psum_scatter(x, "data", tiled=True)          # f32[2,16] 128 B
  c = jax.lax.all_gather(y, "data", tiled=True)            # f32[8,16] 512 B
  d = jax.lax.cond(x[0, 0] > 0, lambda v: jax.lax.psum(v, "data"),
                   lambda v: v, y)                         # f32[2,16] 128 B
  e = jax.lax.ppermute(y, "data", [(i, (i + 1) % 4) for i in range(4)])
  return a, b, c, d, e

g = jax.jit(jax.shard_map(
    f, mesh=mesh, in_specs=(P(), P("data")),
    out_specs=(P(), P("data"), P(), P("data"), P("data")), check_vma=False))
text = g.lower(jnp.ones((8, 16)), jnp.ones((8, 16))).compile().as_text()
print("RESULT " + json.dumps(_hlo.summarize(_hlo.collectives(text))))
"""


def test_shard_map_program_on_four_devices():
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run([sys.executable, "-c", WORKER, BENCH], env=env,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
  s = json.loads(line[len("RESULT "):])
  got = {k: (v["every"], v["cond"]) for k, v in s.items()}
  assert got == {"all-reduce": (512, 128), "reduce-scatter": (128, 0),
                 "all-gather": (512, 0), "collective-permute": (128, 0),
                 "all-to-all": (0, 0)}
  assert s["all-reduce"]["ring_every"] == pytest.approx(2 * 3 / 4 * 512)
  assert s["reduce-scatter"]["ring_every"] == pytest.approx(3 / 4 * 512)
  assert s["all-gather"]["ring_every"] == pytest.approx(3 / 4 * 512)
