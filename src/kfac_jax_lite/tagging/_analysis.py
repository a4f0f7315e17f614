"""The graph walk: find every use of a parameter leaf in a traced jaxpr.

``analyse(jaxpr, leaf_shapes)`` walks the jaxpr (descending into
nested jaxprs) and returns the layer *uses* it recognised and the *opaque*
uses (a parameter consumed by anything that is not a layer pattern). A use
knows where to capture its input and where to add its output probe, as a key
path of equation indices through the nested jaxprs; ``_interpret`` replays
the jaxpr with those keys. The walk follows parameter views through layout
ops, slices, concatenations and nested jaxprs; an equation that consumes
one is recognised by the registered layer kinds that handle its primitive
(``_kinds.recognisers``, each kind's ``LayerSpec.recognise``), which record
its use with ``Analysis._record`` and the shared matchers of
``_matching``/``_joined``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from kfac_jax_lite.tagging import _joined
from kfac_jax_lite.tagging import _kinds
from kfac_jax_lite.tagging import _matching
from kfac_jax_lite.tagging import _penalties
from kfac_jax_lite.tagging import _scaled
from kfac_jax_lite.tagging import _views
from kfac_jax_lite.tagging._penalties import Penalty, Tail
from kfac_jax_lite.tagging._views import Regrouped, Sliced, View

CALL_PRIMS = {  # primitive name -> param holding the (closed) jaxpr
    "jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
    "remat2": "jaxpr", "checkpoint": "jaxpr", "remat": "jaxpr"}


@dataclasses.dataclass
class Use:
  """One application of a layer pattern to parameter leaves."""
  uid: int
  kind: str                 # a kind's pattern (``LayerSpec.patterns``)
  roles: dict               # role name -> View (kernel, bias, table, scale, shift)
  capture_key: tuple | None  # equation key where the input is read
  # How the input is read: ("var", v) | ("mul", a, b) | ("iota", lo, shape, axis)
  capture: tuple | None
  capture_aval: Any
  probe_key: tuple          # equation whose first output gets the probe
  probe_aval: Any
  in_labels: tuple          # per axis of the captured input
  out_labels: tuple         # per axis of the probed output
  levels: tuple             # enclosing scans: ((level_key, length), ...)
  config: dict
  where: str
  examples: int | None      # size of the example axis (None: not found)
  in_while: bool = False


@dataclasses.dataclass
class Opaque:
  leaf: int
  reason: str


def _is_var(v):
  return not hasattr(v, "val")  # Literals carry .val


def inner_jaxpr(eqn):
  """``(jaxpr, consts)`` of a call-like equation, or None."""
  name = CALL_PRIMS.get(eqn.primitive.name)
  if name is None or name not in eqn.params:
    return None
  j = eqn.params[name]
  if hasattr(j, "jaxpr") and hasattr(j, "consts"):
    return j.jaxpr, j.consts
  return j, ()


class Analysis(_penalties.PenaltyWalk, _matching.ViewMatching,
               _joined.JoinedMatching):

  def __init__(self):
    self.uses: list[Use] = []
    self.opaque: list[Opaque] = []
    self.penalties: list[Penalty] = []

  # --------------------------------------------------------------- helpers
  def _opaque(self, view, reason, where):
    """Record an unmatched use of ``view``'s leaf (a ``Tail``: of the
    leaves of its penalties; a ``Joined``: of its parts)."""
    if isinstance(view, _joined.Joined):
      for part in view.parts:
        self._opaque(part, reason, where)
      return
    if isinstance(view, Tail):
      for pid, _ in view.terms:
        self._opaque(self.penalties[pid], reason, where)
      return
    self.opaque.append(Opaque(view.leaf, f"{reason} (in {where})"
                              if where else reason))

  def _new_use(self, **kw):
    use = Use(uid=len(self.uses), **kw)
    self.uses.append(use)
    return use

  # ------------------------------------------------------------------ walk
  def walk(self, jaxpr, in_views, prefix=(), levels=(), where="",
           in_while=False, parent=None):
    """One pass over ``jaxpr``'s equations, each dispatched on its primitive
    (a layer use, a view of a parameter, a nested jaxpr to descend into, or
    an equation the parameters' views do not reach), ``in_views`` the views
    of its inputs. Over 60 lines for a reason: the loop's state (the views
    by variable, each variable's consumers, the uses still pending) is
    shared by every branch, and one reading of the loop is the clearest
    statement of the order in which they are matched."""
    env = {}
    for v, view in zip(jaxpr.invars, in_views):
      if view is not None:
        env[v] = view
    consumers = {}
    for i, eqn in enumerate(jaxpr.eqns):
      for v in eqn.invars:
        if _is_var(v):
          consumers.setdefault(v, []).append(i)
    outset = {v for v in jaxpr.outvars if _is_var(v)}
    ctx = dict(env=env, consumers=consumers, outset=outset, jaxpr=jaxpr,
               prefix=prefix, levels=levels, where=where, in_while=in_while,
               claimed=set(), parent=parent)
    pending = []
    for i, eqn in enumerate(jaxpr.eqns):
      views = [env.get(v) if _is_var(v) else None for v in eqn.invars]
      if all(v is None for v in views):
        continue
      name = eqn.primitive.name
      key = prefix + (i,)
      tracked = any(_penalties.is_tracked(v) for v in views)
      if (name in _views.IDENTITY_PRIMS or name in _views.LAYOUT_PRIMS) and (
          len(eqn.invars) == 1 or all(v is None for v in views[1:])):
        if tracked:
          new = _penalties.layout(views[0], eqn)
          if new is None:
            self._opaque(views[0], "a penalty broadcast into the model", where)
        elif isinstance(views[0], _joined.Joined):
          new = _joined.apply_layout(views[0], eqn)
          if new is None:
            self._opaque(views[0], f"concatenated, then `{name}`", where)
        elif isinstance(views[0], Regrouped):
          new = views[0] if name in _views.IDENTITY_PRIMS else (
              _penalties.as_derived(views[0], views[0].how))
        else:
          new = _views.apply_layout(views[0], eqn)
          if new is None:  # A dense kernel's regrouped axes, or a penalty's.
            new = _views.regroup(views[0], eqn) or _penalties.as_derived(
                views[0], f"reshaped by `{name}`")
        if new is not None:
          env[eqn.outvars[0]] = new
      elif (name in ("slice", "split") and isinstance(views[0], View)
            and all(v is None for v in views[1:])
            and (sliced := _views.slice_views(views[0], eqn)) is not None):
        # A block of a kernel (a fused QKV kernel's ``W[:, :d]``): a dense
        # use of the slice is a column block of the whole kernel's layer.
        for ov, view in zip(eqn.outvars, sliced):
          env[ov] = view
      elif (scaled := _scaled.scaled_view(eqn, views, key, jaxpr)) is not None:
        env[eqn.outvars[0]] = scaled
      elif (joined := _joined.join(views, eqn)) is not None:  # Concatenated.
        env[eqn.outvars[0]] = joined
      elif (found := inner_jaxpr(eqn)) is not None:
        inner, _ = found
        if len(inner.invars) != len(eqn.invars):
          for v in views:
            if v is not None:
              self._opaque(v, f"passed to `{name}`", where)
          continue
        sub = f"{where}/{name}" if where else name
        outs = self.walk(inner, views, key + (0,), levels, sub, in_while,
                         parent=(ctx, i))
        for ov, view in zip(eqn.outvars, outs):
          if view is not None:
            env[ov] = view
      elif name in ("scan", "cond", "while"):
        views = [self._untracked(v, name, where) for v in views]
        if all(v is None for v in views):
          continue
        if name == "scan":
          self._scan(eqn, views, key, ctx)
        elif name == "while":
          self._while(eqn, views, key, ctx)
        else:
          sub = f"{where}/cond" if where else "cond"
          for b, br in enumerate(eqn.params["branches"]):
            self.walk(br.jaxpr, views[1:], key + (b,), levels, sub, in_while)
      elif tracked or _penalties.starts(eqn, views):
        self._tracked(eqn, views, ctx)
        out = env.get(eqn.outvars[0])
        # Weight norm.
        if out is not None and _scaled.normalised_by_itself(eqn, views, out):
          env[eqn.outvars[0]] = dataclasses.replace(
              out, how=_scaled.FUNCTION_OF_ITSELF)
      else:
        pending.append(i)
    for i in pending:
      if i not in ctx["claimed"]:
        self._classify(i, ctx)
    outs = [env.get(v) if _is_var(v) else None for v in jaxpr.outvars]
    if not prefix and outs and isinstance(outs[0], Tail):
      self._loss_scales(outs[0])
    if prefix and parent is None:
      # A scan/cond/while body: its outputs are not followed, so a penalty
      # value leaving it might feed the model.
      for v in outs:
        if _penalties.is_tracked(v):
          self._opaque(v, "a penalty carried out of a loop or branch", where)
    return outs

  def _scan(self, eqn, views, key, ctx):
    p = eqn.params
    nc, nk = p["num_consts"], p["num_carry"]
    where = f"{ctx['where']}/scan" if ctx["where"] else "scan"
    inner = []
    for j, view in enumerate(views):
      if view is None or j < nc:
        inner.append(view)
      elif j < nc + nk:
        self._opaque(view, "carried through lax.scan", ctx["where"])
        inner.append(None)
      elif view.dims and view.dims[0] == len(view.stacked) and view.pure:
        inner.append(dataclasses.replace(
            view, dims=view.dims[1:], stacked=view.stacked + (key,)))
      else:
        self._opaque(view, "scanned over a non-leading axis", ctx["where"])
        inner.append(None)
    self.walk(p["jaxpr"].jaxpr, inner, key + (0,),
              ctx["levels"] + ((key, p["length"]),), where, ctx["in_while"])

  def _while(self, eqn, views, key, ctx):
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    where = f"{ctx['where']}/while" if ctx["where"] else "while"
    for view in views[cn + bn:]:
      if view is not None:
        self._opaque(view, "carried through lax.while_loop", ctx["where"])
    carry = [None] * (len(views) - cn - bn)
    self.walk(p["cond_jaxpr"].jaxpr, views[:cn] + carry, key + (0,),
              ctx["levels"], where, True)
    self.walk(p["body_jaxpr"].jaxpr, views[cn:cn + bn] + carry, key + (1,),
              ctx["levels"], where, True)

  # --------------------------------------------------------- classification
  def _classify(self, i, ctx):
    eqn = ctx["jaxpr"].eqns[i]
    env = ctx["env"]
    views = [env.get(v) if _is_var(v) else None for v in eqn.invars]
    name = eqn.primitive.name
    kinds = _kinds.recognisers(name)
    if any(getattr(v, "scales", ()) for v in views) and not any(
        k.takes_scaled for k in kinds):
      fn = lambda *_: ("scaled by a stop-gradient scalar before "
                       f"`{name}` (only dense and conv kernels take it)")
    elif name in ("mul", "div") and _scaled.scaled_by_scalar(eqn, views):
      fn = lambda *_: _scaled.NOT_STOPPED
    elif any(k.takes_reshaped for k in kinds):
      fn = None
    elif any(isinstance(v, _joined.Joined) for v in views):
      fn = lambda *_: f"concatenated with other parameters before `{name}`"
    elif any(isinstance(v, Regrouped) for v in views):
      fn = lambda *_: f"reshaped by `reshape` before `{name}`"
    elif any(isinstance(v, Sliced) for v in views):
      fn = self._sliced_rows  # ``x + pos[:t]``, else the reason.
    else:
      fn = None
    reason = fn(i, eqn, views, ctx) if fn else self._recognise(
        kinds, i, eqn, views, ctx)
    if reason:
      for v in views:
        if v is not None:
          self._opaque(v, reason, ctx["where"])

  def _recognise(self, kinds, i, eqn, views, ctx):
    """The first of ``kinds`` (``_kinds.recognisers``: the registered
    kinds that handle the primitive, the latest registered first) whose
    ``recognise`` takes equation ``i``: None once one recorded its use,
    else the reason the parameters there are not a layer (the first kind's
    that gave one; "used by `name`" when none handles the primitive)."""
    reason = None
    for kind in kinds:
      got = kind.recognise(self, i, eqn, views, ctx)
      if got is NotImplemented:
        continue
      if not got:
        return None
      reason = reason or got
    return reason or f"used by `{eqn.primitive.name}`"

  def _record(self, kind, roles, ctx, cap_i, capture, cap_aval, probe_i,
              probe_aval, in_labels, out_labels, config, examples=None):
    """A new use; ``examples`` defaults to the size of the output axis
    labelled ``("b", 0)`` (the first non-parameter axis)."""
    where = ctx["where"] or "top level"
    if examples is None:
      examples = next((n for l, n in zip(out_labels, probe_aval.shape)
                       if l == ("b", 0)), None)
    return self._new_use(
        kind=kind, roles=roles, capture_key=None if cap_i is None
        else ctx["prefix"] + (cap_i,), capture=capture, capture_aval=cap_aval,
        probe_key=probe_i if isinstance(probe_i, tuple)
        else ctx["prefix"] + (probe_i,), probe_aval=probe_aval,
        in_labels=tuple(in_labels), out_labels=tuple(out_labels),
        levels=ctx["levels"], config=config, where=where,
        examples=examples, in_while=ctx["in_while"])

def analyse(jaxpr, leaf_shapes):
  """``(uses, opaque, penalties)`` of ``jaxpr`` (a core.Jaxpr) whose first invars are
  the parameter leaves, of shapes ``leaf_shapes``."""
  an = Analysis()
  in_views: list[View | None] = [None] * len(jaxpr.invars)
  for k, shape in enumerate(leaf_shapes):
    in_views[k] = View(k, tuple(range(len(shape))), tuple(shape))
  an.walk(jaxpr, in_views)
  return an.uses, an.opaque, an.penalties
