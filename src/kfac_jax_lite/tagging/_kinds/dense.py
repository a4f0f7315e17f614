"""Dense layers: a kernel contracted with the input by ``dot_general``.

``y = x ·_{in_axes} W (+ b)``: the kernel axes ``in_axes`` contract with
the input, the others are outputs, and a bias (if any) is shaped like the
outputs. Uses of one kernel are grouped into one layer when they contract
it the same way (role ``"normal"``) or along exactly the other axes
(``"swapped"``, e.g. ``x @ W`` next to ``z @ W.T``): a swapped use's output
cotangent is a row of the input factor and its input a row of the output
factor.

**A tied embedding is a dense layer with lookups.** A table ``E [vocab,
dim]`` that is looked up (``E[ids]``, role ``"lookup"``) and also used as a
dense kernel (``h @ Eᵀ``) is one ``DenseSpec`` over ``E`` with
``in_axes=(0,)``: a lookup is a dense use on the one-hot ids. Such a layer
is reported (``Layer.kind``, ``describe``, ``blocks={"embedding": ...}``)
as an ``"embedding"``; its default block is a ``KroneckerDense``. A table
that is only looked up is the embedding kind (``_kinds.embedding``).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax_lite import blocks as B
from kfac_jax_lite.tagging import _format as F
from kfac_jax_lite.tagging import _joined
from kfac_jax_lite.tagging._views import Regrouped, Sliced
from kfac_jax_lite.tagging._kinds.base import Grouping, LayerSpec, Unsupported


def _merge_slices(uses, roles, parts):
  """``(parts, roles)`` with the column blocks of one kernel applied to the
  same input merged: one use whose cotangent is the sum of theirs (each
  zero outside its columns), i.e. the layer ``x @ W`` of the whole kernel.
  Slices applied to different inputs stay separate uses (weight-sharing
  positions, as any kernel used twice)."""
  out, out_roles, seen = [], [], {}
  for u, r, (inp, cot) in zip(uses, roles, parts):
    src = u.config.get("source")
    if src is not None and src in seen:
      k = seen[src]
      out[k] = (out[k][0], out[k][1] + cot)
      continue
    if src is not None:
      seen[src] = len(out)
    out.append((inp, cot))
    out_roles.append(r)
  return out, tuple(out_roles)


@dataclasses.dataclass(frozen=True)
class DenseSpec(LayerSpec):
  """``kernel_shape`` (one slice if stacked), ``in_axes``, ``has_bias``;
  ``roles``: per use ``"normal"``, ``"swapped"`` or ``"lookup"``."""

  name = "dense"
  patterns = frozenset({"dense", "embedding"})
  primitives = ("dot_general",)
  takes_scaled = True
  takes_reshaped = True

  kernel_shape: tuple
  in_axes: tuple
  has_bias: bool
  roles: tuple
  slices: int = 0
  slice_inputs: int = 0
  joined: tuple = ()

  @property
  def kind(self):
    return "embedding" if "lookup" in self.roles else "dense"

  @property
  def notes(self):
    roles = self.roles
    if self.joined:
      n, axis = self.joined
      return (f"joined: one of {n} kernels concatenated along the {axis} "
              f"axis before one product, the block of its slice")
    if self.slices:
      return (f"fused: {self.slices} column blocks of the kernel on "
              f"{self.slice_inputs} input(s), one block over all of it")
    if "swapped" not in roles and "lookup" not in roles:
      return ""
    return (f"tied: {roles.count('lookup')} lookup(s), "
            f"{roles.count('normal')} direct and {roles.count('swapped')} "
            "transposed dense use(s)")

  @property
  def out_axes(self):
    return tuple(a for a in range(len(self.kernel_shape))
                 if a not in self.in_axes)

  def output_size(self, use):
    """Output features of one row: the kernel's output axes for a
    ``"normal"`` use or a ``"lookup"`` (a row of the table), its input
    axes for a ``"swapped"`` (transposed) one."""
    k = tuple(self.kernel_shape)
    axes = self.in_axes if self.roles[use] == "swapped" else self.out_axes
    return math.prod(k[a] for a in axes)

  @property
  def param_shapes(self):
    k = tuple(self.kernel_shape)
    out = tuple(k[a] for a in self.out_axes)
    return (k,) + ((out,) if self.has_bias else ())

  # ---------------------------------------------------------- recognising
  @classmethod
  def recognise(cls, walk, i, eqn, views, ctx):
    """A ``dot_general`` with one kernel operand: ``y = x ·_{in_axes} W``
    (a reshaped, concatenated or sliced kernel included), recorded with
    the bias added right after it (``walk._record_dense``)."""
    if views[0] is not None and views[1] is not None:
      return "multiplied (dot_general) by another parameter"
    k = 0 if views[0] is not None else 1
    kv = views[k]
    if isinstance(kv, Regrouped):
      return walk._dense_regrouped(i, eqn, k, kv, ctx)
    if isinstance(kv, _joined.Joined):
      return walk._dense_joined(i, eqn, k, kv, ctx)
    sliced = isinstance(kv, Sliced)
    if not kv.pure and not (sliced and None not in kv.dims):
      return "broadcast or reshaped before dot_general"
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    kc, xc = (lc, rc) if k == 0 else (rc, lc)
    kb, xb = (lb, rb) if k == 0 else (rb, lb)
    if kb:
      # Per-head kernels ``W [h, d, e]`` in ``"nhtd,hde->nhte"``: h
      # independent dense layers, a layer stacked along its leading axis.
      if len(kb) > 1 or sliced or kv.stacked or kv.dims[kb[0]] != 0:
        return ("a dot_general batch dimension on the kernel other than "
                "one leading axis (per-group weights)")
      kv = dataclasses.replace(kv, stacked=(("batch",) + ctx["prefix"]
                                            + (i,),))
      kc = tuple(kc)
    x = eqn.invars[1 - k]
    xnd, knd = len(x.aval.shape), len(kv.dims)
    in_labels, b = [], 0
    for d in range(xnd):
      if d in xc:
        in_labels.append(("k", kv.dims[kc[list(xc).index(d)]]))
      elif d in xb:
        in_labels.append(("L",))
      else:
        in_labels.append(("b", b))
        b += 1
    if b == 0:
      return "dot_general with an input that has no example axis"
    x_free = [("b", j) for j in range(b)]
    k_free = [("k", kv.dims[d]) for d in range(knd)
              if d not in kc and d not in kb]
    out_labels = [("L",)] * len(kb) + (
        k_free + x_free if k == 0 else x_free + k_free)
    if not k_free:
      return "a dot_general that contracts every kernel axis"
    base = len(kv.stacked)
    in_axes = tuple(sorted(kv.dims[d] - base for d in kc))
    config = dict(in_axes=in_axes, kernel_shape=tuple(kv.leaf_shape[base:]))
    if sliced:
      window = kv.window[base:]
      if any(window[a] != (0, config["kernel_shape"][a]) for a in in_axes):
        return "sliced along a contracted (input) axis before dot_general"
      config.update(window=window, source=walk._source(x, ctx))
    walk._record_dense(i, eqn, x, kv, in_labels, out_labels, k_free, ctx,
                       config)
    return None

  # ------------------------------------------------------------- grouping
  @classmethod
  def group(cls, uses, leaf_shapes, depth):
    mains = {(u.roles.get("kernel") or u.roles["table"]).leaf for u in uses}
    if len(mains) != 1:
      raise Unsupported("kernel and bias shared across different layers")
    main = mains.pop()
    biases = {u.roles["bias"].leaf if "bias" in u.roles else None
              for u in uses}
    if len(biases) != 1:
      raise Unsupported("a bias added after some of its uses only")
    bias = biases.pop()
    kshape = tuple(leaf_shapes[main][depth:])
    lookups = any(u.kind == "embedding" for u in uses)
    canon = (0,) if lookups else next(
        u.config["in_axes"] for u in uses if u.kind == "dense")
    comp = tuple(a for a in range(len(kshape)) if a not in canon)
    roles = []
    for u in uses:
      if u.kind == "embedding":
        roles.append("lookup")
      elif u.config["in_axes"] == canon:
        roles.append("normal")
      elif "virtual" in u.config:
        raise Unsupported("a reshaped kernel contracted along other axes "
                          "than its other uses")
      elif u.config["in_axes"] == comp:
        roles.append("swapped")
      else:
        raise Unsupported(
            "kernel contracted along different axes in different uses")
    if bias is not None and "swapped" in roles:
      raise Unsupported("a bias on a kernel also used transposed")
    slices = sum("window" in u.config for u in uses)
    if slices and set(roles) != {"normal"}:
      raise Unsupported("a kernel used in slices and also transposed or "
                        "looked up")
    spec = cls(kernel_shape=kshape, in_axes=canon, has_bias=bias is not None,
               roles=tuple(roles), slices=slices,
               slice_inputs=len({u.config["source"] for u in uses
                                 if "window" in u.config}),
               joined=next((u.config["joined"] for u in uses
                            if "joined" in u.config), ()))
    return Grouping(spec, (main,) + ((bias,) if bias is not None else ()))

  # --------------------------------------------------------------- blocks
  def default_block(self, *, damping_mode, weight_sharing):
    return B.KroneckerDense(self.kernel_shape, self.in_axes,
                            has_bias=self.has_bias, damping_mode=damping_mode,
                            weight_sharing=weight_sharing)

  def block_for(self, choice, default):
    if choice == "diagonal":
      return B.DiagonalDense(self.kernel_shape, self.in_axes,
                             has_bias=self.has_bias)
    if choice == "kronecker_vector":
      return B.KroneckerVectorDense(self.kernel_shape, self.in_axes,
                                    has_bias=self.has_bias)
    return super().block_for(choice, default)

  # ----------------------------------------------------------------- data
  def data(self, uses, captures, cotangents, stacked):
    """``(inputs [L?, N, *shared, *in], cots [L?, S, N, *shared, *out])``
    (with a transposed use and several samples, S is folded into the
    shared axis: see ``_combine``)."""
    base = 1 if stacked else 0
    parts = [self._use_data(u, r, captures[u.uid], cotangents[u.uid], base)
             for u, r in zip(uses, self.roles)]
    parts, roles = _merge_slices(uses, self.roles, parts)
    if len(parts) == 1 and roles[0] == "normal":
      return parts[0]
    if stacked:
      return jax.vmap(lambda p: self._combine(p, roles))(parts)
    return self._combine(parts, roles)

  def _use_data(self, use, role, cap, ct, base):
    """Canonical ``(inputs [L?, N, *sh, in], cots [L?, S, N, *sh, out])``."""
    canon = [a + base for a in self.in_axes]
    rest = [a + base for a in self.out_axes]
    if role == "lookup":
      ids = F.arranged(use, cap, out=False)[..., use.config["id_pos"]]
      cot = F.arranged(use, ct, rest, samples=True)
      return F.one_hot(ids, self.kernel_shape[0], cot.dtype), cot
    if role == "normal" and "virtual" in use.config:
      # A reshaped kernel: arranged over its reshaped axes, whose trailing
      # groups flatten to the kernel's own input / output axes.
      vin, vout = use.config["virtual"]
      k = self.kernel_shape
      inp = F.arranged(use, cap, vin, out=False)
      cot = F.arranged(use, ct, vout, samples=True)
      return (inp.reshape(inp.shape[:inp.ndim - len(vin)]
                          + tuple(k[a] for a in self.in_axes)),
              cot.reshape(cot.shape[:cot.ndim - len(vout)]
                          + tuple(k[a] for a in self.out_axes)))
    if role == "normal":
      cot = F.arranged(use, ct, rest, samples=True)
      if "window" in use.config:  # A column block: zeros elsewhere.
        window = [use.config["window"][a] for a in self.out_axes]
        pad = [(0, 0)] * (cot.ndim - len(window)) + [
            (lo, self.kernel_shape[a] - hi)
            for a, (lo, hi) in zip(self.out_axes, window)]
        cot = jnp.pad(cot, pad)
      return F.arranged(use, cap, canon, out=False), cot
    # Swapped: the output cotangent plays the input role and vice versa.
    return (F.arranged(use, ct, canon, samples=True),
            F.arranged(use, cap, rest, out=False))

  def _combine(self, parts, roles):
    """Concatenate per-use data along one shared axis (after the examples).

    ``parts``: per use ``(inputs [N, *sh, in], cots [S, N, *sh, out])`` in
    the canonical orientation (no stack axis; a swapped use has the
    samples axis on its inputs). When a transposed use puts a cotangent in
    the input role, the samples are folded into the shared axis
    ("expand"): the other side repeats over S and the cotangent side is
    scaled by 1/sqrt(S), so G still averages over S; the result has S = 1.
    """
    swapped = "swapped" in roles
    n_in, n_out = len(self.in_axes), len(self.out_axes)

    def flat(x, nfeat):  # [N, *sh, *feat] -> [N, R, *feat]
      return x.reshape(x.shape[:1] + (-1,) + x.shape[x.ndim - nfeat:])

    def tile(x, s):  # [N, ...] -> [N, S, ...]
      return jnp.broadcast_to(x[:, None], x.shape[:1] + (s,) + x.shape[1:])

    ins, outs = [], []
    for (inp, cot), role in zip(parts, roles):
      if not swapped:
        ins.append(flat(inp, n_in))
        outs.append(jax.vmap(lambda c: flat(c, n_out))(cot))
        continue
      if role == "swapped":
        s = inp.shape[0]
        inp, cot = jnp.moveaxis(inp, 0, 1), tile(cot, s)
      else:
        s = cot.shape[0]
        inp, cot = tile(inp, s), jnp.moveaxis(cot, 0, 1)
      ins.append(flat(inp, n_in))
      outs.append(flat(cot, n_out) / math.sqrt(s))
    if swapped:
      return jnp.concatenate(ins, axis=1), jnp.concatenate(outs, axis=1)[None]
    return jnp.concatenate(ins, axis=1), jnp.concatenate(outs, axis=2)

  def gradients(self, uses, captures, cotangents, stacked):
    """A layer with transposed uses sums each use's own gradients: its
    ``data`` folds the samples into the shared axis, which keeps the
    Kronecker factors but not the per-sample gradients."""
    if "swapped" not in self.roles:
      return super().gradients(uses, captures, cotangents, stacked)
    base = 1 if stacked else 0
    parts = [self._use_data(u, r, captures[u.uid], cotangents[u.uid], base)
             for u, r in zip(uses, self.roles)]

    def total(parts):  # Swapped uses have the samples on their "inputs".
      return sum(self._kernel_grads(*((a, g[None]) if r == "swapped"
                                      else (a[None], g)))
                 for (a, g), r in zip(parts, self.roles))
    return (jax.vmap(total)(parts) if stacked else total(parts),)

  def _kernel_grads(self, inputs, cotangents):
    """``[S, N, *kernel_shape]`` from ``inputs [S', N, *sh, *in]`` and
    ``cotangents [S'', N, *sh, *out]`` (S' or S'' may be 1: broadcast)."""
    k = tuple(self.kernel_shape)
    in_axes, out_axes = tuple(self.in_axes), self.out_axes
    n = inputs.shape[1]
    a = inputs.reshape(inputs.shape[:1] + (n, -1, math.prod(
        k[i] for i in in_axes)))
    g = cotangents.reshape(cotangents.shape[:1] + (n, a.shape[2], -1))
    s = max(a.shape[0], g.shape[0])
    a = jnp.broadcast_to(a, (s,) + a.shape[1:])
    g = jnp.broadcast_to(g, (s,) + g.shape[1:])
    w = jnp.einsum("snri,snro->snio", a, g)
    w = w.reshape(w.shape[:2] + tuple(k[i] for i in in_axes + out_axes))
    return jnp.transpose(w, (0, 1) + tuple(2 + int(p) for p in np.argsort(
        in_axes + out_axes)))

  def per_example_grads(self, inputs, cotangents):
    w = self._kernel_grads(inputs[None], cotangents)
    if not self.has_bias:
      return (w,)
    n = inputs.shape[0]
    g = cotangents.reshape(cotangents.shape[0], n, -1, math.prod(
        self.kernel_shape[i] for i in self.out_axes))
    return w, g.sum(2).reshape(w.shape[:2] + tuple(
        self.kernel_shape[i] for i in self.out_axes))
