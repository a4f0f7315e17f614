"""Per-example parameter gradients rebuilt from a layer's statistics data.

Used for ``Full``/``NaiveDiagonal`` overrides of detected layers and by the
tests as a check that captured inputs and cotangents are complete. Results
are ``[S?, N, *param_shape]`` per block parameter (with the stack axis of a
scan-stacked layer inside the parameter shape).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kfac_jax_lite.tagging import _format as F


def block_shapes(layer):
  """The block's parameter shapes, with the stack axis when stacked."""
  spec = layer.spec
  if spec["kind"] == "dense":
    k = tuple(spec["kernel_shape"])
    out = tuple(k[a] for a in range(len(k)) if a not in spec["in_axes"])
    shapes = (k,) + ((out,) if spec["has_bias"] else ())
  elif spec["kind"] == "embedding":
    shapes = ((spec["vocab_size"], spec["dim"]),)
  elif spec["kind"] == "conv":
    c = spec["conv"]
    k = tuple(c["kernel_shape"])
    shapes = (k,) + (((k[c["dimension_numbers"].rhs_spec[0]],),)
                     if spec["has_bias"] else ())
  else:
    shapes = (tuple(spec["param_shape"]),) * (
        int(spec["has_scale"]) + int(spec["has_shift"]))
  if layer.stack:
    shapes = tuple((layer.stack,) + s for s in shapes)
  return shapes


def _split(cot, nd):
  return (cot, True) if cot.ndim == nd + 1 else (cot[None], False)


def _dense(spec, inputs, cot):
  k = tuple(spec["kernel_shape"])
  in_axes = tuple(spec["in_axes"])
  out_axes = tuple(a for a in range(len(k)) if a not in in_axes)
  n_in = len(in_axes)
  g, has_s = _split(cot, inputs.ndim - n_in + len(out_axes))
  n = inputs.shape[0]
  a = inputs.reshape(n, -1, math.prod(k[i] for i in in_axes))
  gg = g.reshape(g.shape[0], n, a.shape[1], -1)
  w = jnp.einsum("nri,snro->snio", a, gg)
  w = w.reshape(w.shape[:2] + tuple(k[i] for i in in_axes + out_axes))
  w = jnp.transpose(w, (0, 1) + tuple(2 + int(p) for p in np.argsort(
      in_axes + out_axes)))
  out = [w]
  if spec["has_bias"]:
    out.append(gg.sum(2).reshape(w.shape[:2] + tuple(k[i] for i in out_axes)))
  return tuple(x if has_s else x[0] for x in out)


def _embedding(spec, ids, cot):
  g, has_s = _split(cot, ids.ndim + 1)
  n = ids.shape[0]
  oh = F.one_hot(ids.reshape(n, -1), spec["vocab_size"], g.dtype)
  w = jnp.einsum("nrv,snrd->snvd", oh, g.reshape(g.shape[0], n, -1,
                                                   spec["dim"]))
  return (w if has_s else w[0],)


def _conv(spec, lhs, cot):
  c = spec["conv"]
  dn = c["dimension_numbers"]
  g, has_s = _split(cot, lhs.ndim)
  kernel = jnp.zeros(c["kernel_shape"], lhs.dtype)

  def one(x, gy):  # one example, batch axis kept with size 1
    f = lambda k: lax.conv_general_dilated(
        x, k, c["window_strides"], c["padding"], c["lhs_dilation"],
        c["rhs_dilation"], dn, c["feature_group_count"])
    return jax.vjp(f, kernel)[1](gy)[0]
  b_in, b_out = dn.lhs_spec[0], dn.out_spec[0]
  per = jax.vmap(jax.vmap(one, (b_in, b_out)), (None, 0))(
      jnp.expand_dims(lhs, b_in + 1),
      jnp.expand_dims(g, 2 + b_out))
  out = [per]
  if spec["has_bias"]:
    axes = tuple(1 + a for a in range(g.ndim - 1)
                 if a not in (b_out, dn.out_spec[1]))
    bias = g.sum(axes)
    if dn.out_spec[1] < b_out:
      bias = jnp.swapaxes(bias, 1, 2)
    out.append(bias)
  return tuple(x if has_s else x[0] for x in out)


def _scale_shift(spec, inputs, cot):
  nf = len(spec["param_shape"])
  nd = inputs.ndim
  g, has_s = _split(cot, nd)
  axes = tuple(range(2, g.ndim - nf))
  out = []
  if spec["has_scale"]:
    out.append((inputs[None] * g).sum(axes))
  if spec["has_shift"]:
    out.append(g.sum(axes))
  return tuple(x if has_s else x[0] for x in out)


_FNS = {"dense": _dense, "embedding": _embedding, "conv": _conv,
        "scale_and_shift": _scale_shift}


def per_example_grads(layer, data):
  """Per-example gradients ``[S?, N, *block_shape]`` of a detected layer."""
  fn = _FNS[layer.spec["kind"]]
  spec = layer.spec
  if not layer.stack:
    return fn(spec, *data)
  grads = jax.vmap(lambda *d: fn(spec, *d))(*data)
  return tuple(jnp.moveaxis(g, 0, g.ndim - len(s))
               for g, s in zip(grads, block_shapes(layer)))
