"""Replaying a jaxpr with layer inputs captured and output probes added.

``run`` evaluates a jaxpr equation by equation. At a use's capture key it
records the layer input; at its probe key it adds ``probes[uid]`` (zeros,
shaped like the layer output) to the equation's output, so the gradient
with respect to the probe is the output cotangent. Nested jaxprs holding no
active use are bound unchanged; the others are replayed: ``jit`` and
custom-derivative calls inline (a custom rule around a layer is replaced by
autodiff of its primal), ``checkpoint`` stays a ``jax.checkpoint``, ``scan``
threads probes in as extra ``xs`` and captures out as extra ``ys``, ``cond``
becomes a ``lax.switch`` whose branches return zeros for the captures of
the other branches.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kfac_jax_lite.tagging import _analysis
from kfac_jax_lite.tagging import _scaled
from kfac_jax_lite.tagging import _vma


class Plan:
  """Where to capture and probe, for the active uses of one trace."""

  def __init__(self, uses, losses=()):
    self.uses = {u.uid: u for u in uses}
    self.captures, self.probes, self.inside = {}, {}, {}
    # Stop-gradient scales of kernels (``_scaled``): read where multiplied.
    self.saves, self.saved = {}, {}
    # Registered losses: the tag's annotations are captured and its output
    # (the per-element loss values) is probed, under a negative uid.
    self.losses = {}
    for uid, key in losses:
      self.losses[key] = uid
      for n in range(1, len(key), 2):
        self.inside.setdefault(key[:n], set()).add(uid)
    for u in uses:
      if u.capture is not None and u.capture[0] == "scaled":
        for key, idx, _ in u.capture[2]:
          self.saves[key] = idx
          for n in range(1, len(key), 2):
            self.inside.setdefault(key[:n], set()).add(u.uid)
      if u.capture_key is not None:
        self.captures.setdefault(u.capture_key, []).append(u.uid)
      self.probes.setdefault(u.probe_key, []).append(u.uid)
      keys = [u.probe_key] + ([u.capture_key] if u.capture_key else [])
      for key in keys:
        for n in range(1, len(key), 2):
          self.inside.setdefault(key[:n], set()).add(u.uid)

  @property
  def captures_uids(self):
    return {u for us in self.captures.values() for u in us}

  def uids_under(self, key):
    return sorted(self.inside.get(key, ()))

  def zero_capture(self, uid, key):
    """Zeros shaped like ``uid``'s capture as seen at scope ``key``."""
    u = self.uses[uid]
    shape = tuple(n for lk, n in u.levels if lk[:len(key)] == key
                  and len(lk) > len(key)) + tuple(u.capture_aval.shape)
    return _vma.zeros(shape, u.capture_aval.dtype, u.capture_aval)


def _read_capture(spec, read, saved):
  if spec[0] == "iota":  # Ids ``lo, lo + 1, ...`` along ``axis`` of ``shape``.
    _, lo, shape, axis = spec
    return lo + lax.broadcasted_iota(jnp.int32, shape, axis)
  if spec[0] == "slice":  # An input slice (a kernel joined along its input).
    _, v, axis, lo, hi = spec
    return lax.slice_in_dim(read(v), lo, hi, axis=axis)
  if spec[0] == "scaled":
    return _scaled.read_scaled(read(spec[1]), spec[2], saved)
  if spec[0] == "var":
    x = read(spec[1])
    return jnp.broadcast_to(x, spec[2]) if len(spec) > 2 else x
  _, a, b, shape = spec
  return jnp.broadcast_to(read(a) * read(b), shape)


def bind_equation(eqn, invals):
  """The outputs (a list) of ``eqn``'s primitive applied to ``invals``."""
  got = eqn.primitive.get_bind_params(eqn.params)
  subfuns, params = got if isinstance(got, tuple) else ((), got)
  with eqn.ctx.manager:
    ans = eqn.primitive.bind(*subfuns, *invals, **params)
  return list(ans) if eqn.primitive.multiple_results else [ans]


def run(plan, jaxpr, consts, args, prefix, probes, caps):
  env = {}

  def read(v):
    return v.val if hasattr(v, "val") else env[v]

  for v, x in zip(jaxpr.constvars, consts):
    env[v] = x
  for v, x in zip(jaxpr.invars, args):
    env[v] = x
  for i, eqn in enumerate(jaxpr.eqns):
    key = prefix + (i,)
    for uid in plan.captures.get(key, ()):
      caps[uid] = _read_capture(plan.uses[uid].capture, read, plan.saved)
    invals = [read(v) for v in eqn.invars]
    if key in plan.saves:
      plan.saved[key] = invals[plan.saves[key]]
    if key in plan.inside:
      outs = _nested(plan, eqn, invals, key, probes, caps)
    else:
      outs = bind_equation(eqn, invals)
    for uid in plan.probes.get(key, ()):
      pad = plan.uses[uid].config.get("probe_pad")
      pr = probes[uid].astype(outs[0].dtype)
      outs[0] = outs[0] + (pr if pad is None else jnp.pad(pr, pad))
    if key in plan.losses:
      uid = plan.losses[key]
      caps[uid] = tuple(invals[1:])  # The model outputs, then the targets.
      outs[0] = outs[0] + probes[uid].astype(outs[0].dtype)
    for v, x in zip(eqn.outvars, outs):
      env[v] = x
  return [read(v) for v in jaxpr.outvars]


def _nested(plan, eqn, invals, key, probes, caps):
  name = eqn.primitive.name
  uids = plan.uids_under(key)
  sub_probes = {u: probes[u] for u in uids}
  inner = _analysis.inner_jaxpr(eqn)
  if inner is not None and name in ("remat2", "checkpoint", "remat"):
    jaxpr, consts = inner

    def body(args, pr):
      c = {}
      outs = run(plan, jaxpr, consts, args, key + (0,), pr, c)
      return outs, c
    outs, c = jax.checkpoint(
        body, prevent_cse=eqn.params.get("prevent_cse", True),
        policy=eqn.params.get("policy"))(invals, sub_probes)
    caps.update(c)
    return outs
  if inner is not None:
    jaxpr, consts = inner
    return run(plan, jaxpr, consts, invals, key + (0,), probes, caps)
  if name == "scan":
    p = eqn.params
    nc, nk = p["num_consts"], p["num_carry"]
    consts, init, xs = invals[:nc], invals[nc:nc + nk], invals[nc + nk:]
    closed = p["jaxpr"]

    def step(carry, x):
      xs_t, pr = x
      c = {}
      outs = run(plan, closed.jaxpr, closed.consts, list(consts) + list(carry)
                 + list(xs_t), key + (0,), pr, c)
      return outs[:nk], (outs[nk:], c)
    carry, (ys, c) = lax.scan(step, list(init), (list(xs), sub_probes),
                              length=p["length"], reverse=p["reverse"],
                              unroll=p["unroll"])
    caps.update(c)
    return list(carry) + list(ys)
  if name == "cond":
    branches = eqn.params["branches"]

    def make(b, br):
      def f(ops, pr):
        c = {}
        outs = run(plan, br.jaxpr, br.consts, ops, key + (b,), pr, c)
        for u in uids:
          if u not in c and u in plan.captures_uids:
            c[u] = plan.zero_capture(u, key)
        return outs, c
      return f
    outs, c = lax.switch(invals[0], [make(b, br) for b, br in
                                     enumerate(branches)],
                         list(invals[1:]), sub_probes)
    caps.update(c)
    return list(outs)
  raise NotImplementedError(f"cannot replay layers inside `{name}`")
