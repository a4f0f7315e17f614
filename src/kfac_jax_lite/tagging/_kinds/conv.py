"""Convolutions: a ``conv_general_dilated`` with a parameter kernel.

Any rank, dimension numbers, strides, padding, dilation and feature
groups, with the bias added to its output in the conv's own output
layout. The data is the conv input and the output cotangent, both in the
conv's own layout; the block (KFC) extracts the patches itself.

The default block is ``KroneckerConv`` with the ``weight_sharing`` of
``kfl.kfac`` (``"expand"``: KFC; ``"reduce"``: K-FAC-reduce over the
output locations).

**A kernel used more than once** (a siamese conv applied to two inputs, a
conv reused at every step of ``lax.scan``) is one layer whose uses are
weight-sharing positions, as for a dense kernel: the R applications (uses
× scan steps) of each example are stacked along the conv's batch axis,
``[R·N, ...]`` in chunks of N, with the N examples' loss weights, and the
blocks (``repeats=R``) treat the R·T locations of an example as the
locations of one layer. Under KFC's normalisation that is
``A = Σ_i w_i (1/(R·T)) Σ_{r,t} ā ā ᵀ`` and ``G = Σ_i c_i Σ_{r,t} g gᵀ``
(``"reduce"`` aggregates over all R·T). Per-example gradients sum the R
chunks.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from kfac_jax_lite import blocks as B
from kfac_jax_lite.tagging import _format as F
from kfac_jax_lite.tagging import _scaled
from kfac_jax_lite.tagging._kinds.base import Grouping, LayerSpec, Unsupported


@dataclasses.dataclass(frozen=True)
class ConvSpec(LayerSpec):
  """The arguments of ``lax.conv_general_dilated`` and ``has_bias``."""

  name = "conv"
  patterns = frozenset({"conv"})
  primitives = ("conv_general_dilated",)
  takes_scaled = True

  kernel_shape: tuple
  window_strides: tuple
  padding: tuple
  lhs_dilation: tuple
  rhs_dilation: tuple
  dimension_numbers: lax.ConvDimensionNumbers
  feature_group_count: int
  has_bias: bool
  repeats: int = 1

  @property
  def notes(self):
    return (f"conv applied {self.repeats} times per example (uses × scan "
            "steps): weight-sharing positions" if self.repeats > 1 else "")

  def output_size(self, use):
    """Output channels (one output position of the convolution)."""
    del use
    return self.kernel_shape[self.dimension_numbers.rhs_spec[0]]

  @property
  def param_shapes(self):
    k = tuple(self.kernel_shape)
    bias = ((k[self.dimension_numbers.rhs_spec[0]],),) if self.has_bias else ()
    return (k,) + bias

  @property
  def _window(self):
    """The ``ConvConfig`` of the layer (its window, bias and repeats)."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

  @classmethod
  def recognise(cls, walk, i, eqn, views, ctx):
    """A ``conv_general_dilated`` with a parameter kernel (the rhs), with
    the bias added to its output in the conv's own output layout."""
    if views[0] is not None:
      return "the parameter is the input (lhs) of a convolution"
    kv = views[1]
    base = len(kv.stacked)
    if kv.dims != tuple(range(base, len(kv.leaf_shape))):
      return "a transposed or broadcast convolution kernel"
    p = eqn.params
    if p.get("batch_group_count", 1) != 1:
      return "a convolution with batch_group_count > 1"
    lhs, out = eqn.invars[0], eqn.outvars[0]
    dn = p["dimension_numbers"]
    nd = len(lhs.aval.shape)
    in_labels = [("c", q) for q in range(nd)]
    out_labels = [("c", q) for q in range(nd)]
    roles = {"kernel": kv}
    probe_i, probe_aval, labels = i, out.aval, out_labels
    found = walk._bias_add(out, tuple(out_labels), ctx, {("c", dn.out_spec[1])})
    if found is not None and (tuple(ctx["jaxpr"].eqns[found[0]].outvars[
        0].aval.shape) != tuple(out.aval.shape) or any(
            l != m and not (l == ("u",) and n == 1) for l, m, n in
            zip(found[2], out_labels, out.aval.shape))):
      # The conv block reads cotangents in the conv's output layout: a bias
      # added after a reshape or slice stays a block of its own (a shift).
      found = None
    elif found is not None:  # Unit axes moved (one output channel, vmap).
      found = found[:2] + (out_labels,)
    if found is not None:
      j, bview, labels = found
      ctx["claimed"].add(j)
      roles["bias"] = bview
      probe_i, probe_aval = j, ctx["jaxpr"].eqns[j].outvars[0].aval
    padding = p["padding"]
    if isinstance(padding, str):
      return "a convolution with string padding"
    config = dict(
        kernel_shape=tuple(kv.leaf_shape[base:]),
        window_strides=tuple(p["window_strides"]),
        padding=tuple(tuple(int(x) for x in pr) for pr in padding),
        lhs_dilation=tuple(p["lhs_dilation"]),
        rhs_dilation=tuple(p["rhs_dilation"]),
        dimension_numbers=lax.ConvDimensionNumbers(
            tuple(dn.lhs_spec), tuple(dn.rhs_spec), tuple(dn.out_spec)),
        feature_group_count=p["feature_group_count"],
        precision=p.get("precision"))
    walk._record("conv", roles, ctx, i, _scaled.capture(lhs, kv), lhs.aval,
                 probe_i,
                 probe_aval, in_labels, labels, config,
                 examples=lhs.aval.shape[dn.lhs_spec[0]])
    return None

  @classmethod
  def group(cls, uses, leaf_shapes, depth):
    del leaf_shapes, depth
    u = uses[0]
    for v in uses[1:]:
      if v.config != u.config:
        raise Unsupported("a convolution kernel used with different windows "
                          "(strides, padding, dilation or layout)")
      if ("bias" in v.roles) != ("bias" in u.roles):
        raise Unsupported("a bias added after some of its uses only")
      if tuple(v.capture_aval.shape) != tuple(u.capture_aval.shape):
        raise Unsupported("a convolution kernel applied to inputs of "
                          "different shapes")
    repeats = sum(math.prod(n for l, (_, n) in zip(F.level_labels(v),
                                                   v.levels) if l[0] == "t")
                  for v in uses)
    c = u.config
    spec = cls(kernel_shape=c["kernel_shape"],
               window_strides=c["window_strides"], padding=c["padding"],
               lhs_dilation=c["lhs_dilation"], rhs_dilation=c["rhs_dilation"],
               dimension_numbers=c["dimension_numbers"],
               feature_group_count=c["feature_group_count"],
               has_bias="bias" in u.roles, repeats=repeats)
    return Grouping(spec, tuple(v.leaf for v in u.roles.values()))

  def default_block(self, *, damping_mode, weight_sharing):
    return B.KroneckerConv(**self._window, damping_mode=damping_mode,
                           weight_sharing=weight_sharing)

  def block_for(self, choice, default):
    if choice == "diagonal":
      return B.DiagonalConv(**self._window)
    if choice == "kronecker_vector":
      return B.KroneckerVectorConv(**self._window)
    return super().block_for(choice, default)

  def data(self, uses, captures, cotangents, stacked):
    """``(conv input, output cotangents [S, ...])``, both in the conv's
    own layout (with a leading stack axis when ``stacked``); the R
    applications of a shared kernel stacked along the batch axis."""
    base = 1 if stacked else 0
    dn = self.dimension_numbers
    ins, cots = [], []
    for u in uses:
      nt = sum(l[0] == "t" for l in F.level_labels(u))
      ins.append(_fold(F.arranged(u, captures[u.uid], out=False), base, nt,
                       dn.lhs_spec[0]))
      cots.append(_fold(F.arranged(u, cotangents[u.uid], samples=True),
                        base + 1, nt, dn.out_spec[0]))
    if len(uses) == 1:
      return ins[0], cots[0]
    return (jnp.concatenate(ins, base + dn.lhs_spec[0]),
            jnp.concatenate(cots, base + 1 + dn.out_spec[0]))

  def gradients(self, uses, captures, cotangents, stacked):
    """The per-example gradients of a shared kernel sum its R chunks."""
    grads = super().gradients(uses, captures, cotangents, stacked)
    if self.repeats == 1:
      return grads
    axis = 2 if stacked else 1
    return tuple(g.reshape(g.shape[:axis] + (self.repeats, -1)
                           + g.shape[axis + 1:]).sum(axis) for g in grads)

  def per_example_grads(self, inputs, cotangents):
    dn = self.dimension_numbers
    kernel = jnp.zeros(self.kernel_shape, inputs.dtype)

    def one(x, gy):  # one example, its batch axis kept with size 1
      f = lambda k: lax.conv_general_dilated(
          x, k, self.window_strides, self.padding, self.lhs_dilation,
          self.rhs_dilation, dn, self.feature_group_count)
      return jax.vjp(f, kernel)[1](gy)[0]
    b_in, b_out = dn.lhs_spec[0], dn.out_spec[0]
    per = jax.vmap(jax.vmap(one, (b_in, b_out)), (None, 0))(
        jnp.expand_dims(inputs, b_in + 1),
        jnp.expand_dims(cotangents, 2 + b_out))
    if not self.has_bias:
      return (per,)
    g = cotangents
    axes = tuple(1 + a for a in range(g.ndim - 1)
                 if a not in (b_out, dn.out_spec[1]))
    bias = g.sum(axes)
    if dn.out_spec[1] < b_out:
      bias = jnp.swapaxes(bias, 1, 2)
    return per, bias


def _fold(x, lead, nt, batch_axis):
  """``x`` with ``lead`` leading axes, then ``nt`` scan-step axes, then the
  conv layout: the step axes merged into the batch axis (step-major)."""
  if nt == 0:
    return x
  steps = list(range(lead, lead + nt))
  x = jnp.moveaxis(x, steps, list(range(lead + batch_axis,
                                        lead + batch_axis + nt)))
  b = lead + batch_axis
  return x.reshape(x.shape[:b] + (-1,) + x.shape[b + nt + 1:])
