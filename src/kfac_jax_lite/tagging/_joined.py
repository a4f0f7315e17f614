"""Kernels assembled from several parameters (``jnp.concatenate``/``stack``).

Flax's ``OptimizedLSTMCell`` concatenates its four gate kernels (and
biases) along the output axis before one ``jnp.dot``; gates stacked for one
``DenseGeneral`` do the same along a new axis; a kernel concatenated along
its input axis is a sum of products of input slices. Each part ``W_p`` is a
dense layer of its own slice of that product:

* joined along an *output* axis, ``y[..., lo:hi] = x @ W_p (+ b_p)``: the
  part's block is ``A ⊗ G_p``, A of the shared input, ``G_p`` of the
  cotangent restricted to its columns. The use probes only its window of
  the output (``config["probe_pad"]``: the probe is zero-padded to the
  whole output, so its cotangent is the window's).
* joined along an *input* (contracted) axis, ``y = Σ_p x[..., lo:hi] @
  W_p``: the part's block is ``A_p ⊗ G``, ``A_p`` of its input slice (the
  capture ``("slice", x, axis, lo, hi)``) and G of the whole output. A bias
  added to the product goes with the first part.

``Joined`` is the view of the concatenated value; ``JoinedMatching`` the
walk's mixin that matches it in a ``dot_general``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from kfac_jax_lite.tagging import _views
from kfac_jax_lite.tagging._views import View


@dataclasses.dataclass(frozen=True)
class Joined:
  """A concatenation of parameter views along operand axis ``axis``.

  ``parts``: per piece its ``View`` (axes of the concatenate's operands);
  ``sizes``: per piece its size along ``axis``; ``dims``: per axis of the
  variable, the operand axis it is (None: inserted by a later layout op).
  """

  parts: tuple
  axis: int
  sizes: tuple
  dims: tuple
  how: str = "concatenated with other parameters"

  @property
  def leaf(self):
    return self.parts[0].leaf

  leaves = property(lambda self: tuple(p.leaf for p in self.parts))
  stacked = ()
  pure = False

  def bounds(self):
    ends = np.cumsum(self.sizes)
    return [(int(e - n), int(e)) for e, n in zip(ends, self.sizes)]

  def leaf_axis(self, p, a):
    """The leaf axis of part ``p`` that variable axis ``a`` carries."""
    m = self.dims[a]
    return None if m is None else self.parts[p].dims[m]


def join(views, eqn):
  """The ``Joined`` view of a ``concatenate`` of parameter views, or None
  when one operand is not a plain view of a parameter."""
  name = eqn.primitive.name
  if name not in ("concatenate", "stack") or any(
      type(v) is not View for v in views):
    return None
  if name == "stack":  # A new unit axis on every piece, then concatenated.
    axis = eqn.params["axis"]
    views = [dataclasses.replace(v, dims=v.dims[:axis] + (None,)
                                 + v.dims[axis:]) for v in views]
    sizes = (1,) * len(views)
  else:
    axis = eqn.params["dimension"]
    sizes = tuple(int(v.aval.shape[axis]) for v in eqn.invars)
  return Joined(tuple(views), axis, sizes,
                tuple(range(len(eqn.outvars[0].aval.shape))))


def apply_layout(view, eqn):
  """``view`` after a layout op (None when the op is unsupported)."""
  mapping = _views.layout_map(eqn)
  if mapping is None or (eqn.primitive.name == "broadcast_in_dim" and
                         view.axis not in [m for m in mapping if m is not None]):
    return None
  return dataclasses.replace(
      view, dims=tuple(None if m is None else view.dims[m] for m in mapping))


class JoinedMatching:
  """Mixin of ``_analysis.Analysis``: a ``Joined`` kernel's dense uses."""

  # Provided by _analysis.Analysis and _matching.ViewMatching.
  _record: Callable[..., None]
  _bias_add: Callable[..., Any]
  _follow: Callable[..., list]
  _single_consumer: Callable[..., Any]

  def _dense_joined(self, i, eqn, k, jv, ctx):
    """The dense uses of a kernel joined from pieces (``jv``, a concatenated
    view) by ``dot_general`` ``eqn``, or the reason (a string) it is not a
    dense layer of each piece. Over 60 lines for a reason: each early return
    is one case the match refuses, and they read in order as its
    specification."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    kc, xc = (tuple(lc), tuple(rc)) if k == 0 else (tuple(rc), tuple(lc))
    if lb or rb:
      return "concatenated, then a dot_general with batch dimensions"
    if jv.axis not in jv.dims:
      return "concatenated, then the joined axis broadcast or dropped"
    ja = jv.dims.index(jv.axis)
    nk = len(jv.dims)
    x = eqn.invars[1 - k]
    for p, part in enumerate(jv.parts):
      got = [jv.leaf_axis(p, a) for a in range(nk)]
      own = [d for d in got if d is not None]
      need = [d for d in part.remaining]
      if (sorted(own) != need or any(d is None and a != ja for a, d in
                                     enumerate(got))):
        return "concatenated with a broadcast or re-laid-out piece"
      if not {got[a] for a in kc} - {None} or all(
          got[a] is None for a in range(nk) if a not in kc):
        return ("stacked, then a piece has no input or no output axis of "
                "its own in the product")
    free = [a for a in range(nk) if a not in kc]
    if not free:
      return "concatenated, then every kernel axis contracted"
    b = len(x.aval.shape) - len(xc)
    if b == 0:
      return "dot_general with an input that has no example axis"
    out = eqn.outvars[0]
    # The output axis of the joined one (output-joined) or None.
    oj = None if ja in kc else (free.index(ja) if k == 0
                                else b + free.index(ja))
    labels = self._joined_labels(jv, 0, x, kc, xc, free, k, ja)[1]
    bias = None if oj is None else self._joined_bias(out, labels, oj, jv, ctx)
    for p, part in enumerate(jv.parts):
      lo, hi = jv.bounds()[p]
      in_labels, out_labels = self._joined_labels(jv, p, x, kc, xc, free,
                                                  k, ja)
      base = len(part.stacked)
      in_axes = tuple(sorted(jv.leaf_axis(p, a) - base for a in kc
                             if jv.leaf_axis(p, a) is not None))
      config: dict[str, Any] = dict(in_axes=in_axes, kernel_shape=tuple(
          part.leaf_shape[base:]), joined=(
              len(jv.parts), "output" if oj is not None else "input"))
      roles = {"kernel": part}
      capture, cap_aval = ("var", x), x.aval
      probe_i, probe_aval = i, out.aval
      if oj is None:  # Joined along the input: the part reads its slice.
        d = xc[kc.index(ja)]
        capture = ("slice", x, d, lo, hi)
        shape = list(x.aval.shape)
        shape[d] = hi - lo
        cap_aval = x.aval.update(shape=tuple(shape))
        found = self._bias_add(out, tuple(out_labels), ctx, {
            l for l in out_labels if l[0] == "k"}) if p == 0 else None
        if found is not None:
          j, bview, out_labels = found
          ctx["claimed"].add(j)
          roles["bias"] = bview
          probe_i, probe_aval = j, ctx["jaxpr"].eqns[j].outvars[0].aval
      else:
        if bias is not None:
          j, bjv, blabels, ob = bias
          roles["bias"] = bjv.parts[p]
          probe_i, probe_aval, o = j, ctx["jaxpr"].eqns[j].outvars[0].aval, ob
          out_labels = tuple(out_labels[oj] if l == ("j",) else l
                             for l in blabels)
        else:
          o = oj
        shape = list(probe_aval.shape)
        pad = [(0, 0)] * len(shape)
        pad[o] = (lo, shape[o] - hi)
        shape[o] = hi - lo
        probe_aval = probe_aval.update(shape=tuple(shape))
        config["probe_pad"] = tuple(pad)
      self._record("dense", roles, ctx, i, capture, cap_aval, probe_i,
                   probe_aval, in_labels, out_labels, config)
    if bias is not None:
      ctx["claimed"].add(bias[0])
    return None

  @staticmethod
  def _joined_labels(jv, p, x, kc, xc, free, k, ja):
    """``(in_labels, out_labels)`` of part ``p``'s use; the joined axis is
    ``("k", leaf axis)``, or ``("u",)`` for a stacked (unit) piece."""
    lab = lambda a: ("u",) if jv.leaf_axis(p, a) is None else (
        "k", jv.leaf_axis(p, a))
    in_labels, b = [], 0
    for d in range(len(x.aval.shape)):
      if d in xc:
        in_labels.append(lab(kc[xc.index(d)]))
      else:
        in_labels.append(("b", b))
        b += 1
    k_free = [lab(a) for a in free]
    x_free = [("b", j) for j in range(b)]
    out = k_free + x_free if k == 0 else x_free + k_free
    return tuple(in_labels), tuple(out)

  def _joined_bias(self, var, labels, oj, jv, ctx):
    """``(add index, bias Joined, add labels, its joined axis)`` of the
    parts' biases concatenated like the kernels and added to ``var``."""
    labels = tuple(("j",) if q == oj else l for q, l in enumerate(labels))
    for v, labs, _ in [(var, labels, None)] + self._follow(var, labels, ctx):
      j = self._single_consumer(v, ctx)
      if j is None or ("j",) not in labs:
        continue
      eqn = ctx["jaxpr"].eqns[j]
      other = [w for w in eqn.invars if w is not v]
      if (eqn.primitive.name != "add" or j in ctx["claimed"]
          or len(other) != 1 or hasattr(other[0], "val")):
        continue
      bjv = ctx["env"].get(other[0])
      shape = tuple(eqn.outvars[0].aval.shape)
      if (not isinstance(bjv, Joined) or shape != tuple(v.aval.shape)
          or bjv.sizes != jv.sizes or len(bjv.dims) != len(shape)):
        continue
      ob = labs.index(("j",))
      if bjv.dims[ob] != bjv.axis or any(
          n > 1 for q, n in enumerate(other[0].aval.shape)
          if q != ob and labs[q][0] != "k"):
        continue
      if any(part.stacked or len(part.remaining) != 1 for part in bjv.parts):
        continue
      return j, bjv, labs, ob
    return None
