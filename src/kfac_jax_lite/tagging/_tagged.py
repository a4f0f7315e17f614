"""``find_layers``: trace, detect, and the rewritten loss."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax_lite import losses
from kfac_jax_lite.tagging import _analysis
from kfac_jax_lite.tagging import _format as F
from kfac_jax_lite.tagging import _interpret
from kfac_jax_lite.tagging import _layers
from kfac_jax_lite.tagging import _pergrad


def path_name(path):
  """``params/Dense_0/kernel`` from a key path."""
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts) if parts else "params"


def _abstract(x):
  return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))


def _check_params(params):
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  paths = []
  for path, leaf in leaves:
    name = path_name(path)
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
      raise TypeError(
          f"parameter {name!r} is a {type(leaf).__name__}, not an array; "
          "params must be a pytree of arrays (for Equinox, pass "
          "eqx.filter(model, eqx.is_array) and close over the rest)")
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
      raise TypeError(f"parameter {name!r} has dtype {leaf.dtype}; "
                      "K-FAC needs floating-point parameters")
    paths.append(name)
  if len(set(paths)) != len(paths):
    paths = [f"{p}#{i}" for i, p in enumerate(paths)]
  return treedef, tuple(paths), tuple(tuple(l.shape) for _, l in leaves)


def _batch_size(batch):
  sizes = {np.shape(x)[0] for x in jax.tree.leaves(batch) if np.ndim(x) > 0}
  return sizes.pop() if len(sizes) == 1 else None


@dataclasses.dataclass
class _Trace:
  closed: Any
  out_tree: Any
  uses: list
  opaque: list
  n_leaves: int
  losses: list


@dataclasses.dataclass(frozen=True)
class LossTag:
  """A registered loss found in the trace (``kfac_jax_lite.losses``).

  ``uid`` keys its probe (on the per-element values) and its capture (the
  model outputs followed by the targets) in ``apply``.
  """

  uid: int
  key: tuple
  distribution: Any
  num_outputs: int
  values_shape: tuple
  values_dtype: Any


def find_loss_tags(jaxpr, prefix=(), where=""):
  """``[(key, eqn)]`` of every loss tag, through call-like nested jaxprs."""
  found = []
  for i, eqn in enumerate(jaxpr.eqns):
    key = prefix + (i,)
    if eqn.primitive is losses.loss_tag_p:
      if where:
        raise ValueError(f"a registered loss inside `{where}` is not "
                         "supported; compute the loss outside it")
      found.append((key, eqn))
      continue
    inner = _analysis._inner(eqn)
    if inner is not None:
      found += find_loss_tags(inner[0], key + (0,), where)
    else:
      for sub in _sub_jaxprs(eqn):
        found += find_loss_tags(sub, key + (0,), eqn.primitive.name)
  return found


def _sub_jaxprs(eqn):
  for v in eqn.params.values():
    for j in (v if isinstance(v, (tuple, list)) else (v,)):
      if hasattr(j, "eqns"):
        yield j
      elif hasattr(j, "jaxpr") and hasattr(j.jaxpr, "eqns"):
        yield j.jaxpr


def _signature(u):
  return (u.kind, tuple(sorted((r, v.leaf, v.stacked) for r, v in
                               u.roles.items())),
          u.in_labels, u.out_labels, len(u.levels), u.where,
          tuple(sorted((k, repr(v)) for k, v in u.config.items())))


class TaggedLoss:
  """The layers of ``loss_fn`` and its rewritten, probe-taking version.

  ``layers``: one ``Layer`` per block (fallbacks included). The rewritten
  loss is ``apply(params, batch, probes) -> (loss, aux, captures)``;
  ``probes = zero_probes(params, batch)``; the gradient of the loss with
  respect to ``probes`` is, per probe, ``c_i ∂ℓ_i/∂y`` at that layer
  output. ``layer_data`` turns captures and probe cotangents into each
  block's ``compute_stats`` arguments. Both gradients (params and probes)
  come from one ``jax.vjp`` of ``apply``: one forward pass.
  """

  def __init__(self, loss_fn, params, batch, *, has_aux=False, blocks=None,
               exclude=(), weight_sharing="expand", damping_mode="pi"):
    self.loss_fn = loss_fn
    self.has_aux = has_aux
    self.param_treedef, self.paths, self.leaf_shapes = _check_params(params)
    self.batch_treedef = jax.tree.structure(batch)
    self._options = dict(weight_sharing=weight_sharing,
                         damping_mode=damping_mode)
    tr = self._trace(params, batch)
    self._uses = tr.uses
    self.layers, self.excluded = _layers.build_layers(
        tr.uses, tr.opaque, self.paths, self.leaf_shapes, _batch_size(batch),
        blocks or {}, tuple(exclude), self._options)
    self.losses = tuple(tr.losses)
    self._active = sorted(u for l in self.layers for u in l.use_ids)
    self._signatures = {i: _signature(tr.uses[i]) for i in self._active}

  @property
  def detected(self):
    return tuple(l for l in self.layers if l.kind != "fallback")

  def layer(self, name):
    for l in self.layers:
      if l.name == name or name in l.params:
        return l
    raise KeyError(name)

  # ----------------------------------------------------------------- tracing
  def _trace(self, params, batch):
    treedef = jax.tree.structure(batch)
    if treedef != self.batch_treedef:
      raise ValueError(f"batch structure {treedef} differs from the traced "
                       f"example batch structure {self.batch_treedef}")
    ptree = jax.tree.structure(params)
    if ptree != self.param_treedef:
      raise ValueError(f"params structure {ptree} differs from the traced "
                       f"params structure {self.param_treedef}")
    fn = self.loss_fn
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(
        jax.tree.map(_abstract, params), jax.tree.map(_abstract, batch))
    if self.has_aux:
      if not (isinstance(out_shape, (tuple, list)) and len(out_shape) == 2):
        raise ValueError("has_aux=True: loss_fn must return (loss, aux)")
      loss_shape = out_shape[0]
    else:
      loss_shape = out_shape
    if not isinstance(loss_shape, jax.ShapeDtypeStruct) or loss_shape.shape:
      got = getattr(loss_shape, "shape", type(loss_shape).__name__)
      hint = (" (use has_aux=True for (loss, aux))"
              if isinstance(loss_shape, (tuple, list)) else "")
      raise ValueError(f"loss_fn must return a scalar loss, got {got}{hint}")
    n = len(self.paths)
    uses, opaque = _analysis.analyse(
        closed.jaxpr, n, self.leaf_shapes, list(range(n)))
    tags = [LossTag(-1 - j, key, eqn.params["distribution"],
                    eqn.params["num_outputs"], tuple(eqn.outvars[0].aval.shape),
                    eqn.outvars[0].aval.dtype)
            for j, (key, eqn) in enumerate(find_loss_tags(closed.jaxpr))]
    return _Trace(closed, jax.tree.structure(out_shape), uses, opaque, n, tags)

  def _checked_trace(self, params, batch):
    tr = self._trace(params, batch)
    same_losses = [(t.key, t.distribution) for t in tr.losses] == [
        (t.key, t.distribution) for t in self.losses]
    for i in self._active if same_losses else [-1]:
      if i < 0 or i >= len(tr.uses) or _signature(tr.uses[i]) != self._signatures[i]:
        raise RuntimeError(
            "layer detection differs from the one at construction (the "
            "loss traces differently for this batch); re-create the "
            "TaggedLoss for this batch layout")
    return tr

  # ------------------------------------------------------------ rewriting
  def zero_probes(self, params, batch):
    tr = self._checked_trace(params, batch)
    probes = {i: jnp.zeros(F.stacked_shape(tr.uses[i], tr.uses[i].probe_aval),
                           tr.uses[i].probe_aval.dtype) for i in self._active}
    for t in tr.losses:
      probes[t.uid] = jnp.zeros(t.values_shape, t.values_dtype)
    return probes

  def apply(self, params, batch, probes):
    """``(loss, aux, captures)``: the loss with ``probes`` added to the
    layer outputs; ``captures[uid]`` the layer inputs, and for each
    registered loss ``t`` in ``losses``, ``captures[t.uid]`` its model
    outputs followed by its targets (``aux`` None
    without ``has_aux``)."""
    tr = self._checked_trace(params, batch)
    plan = _interpret.Plan([tr.uses[i] for i in self._active],
                           [(t.uid, t.key) for t in tr.losses])
    args = jax.tree.leaves((params, batch))
    caps = {}
    outs = _interpret.run(plan, tr.closed.jaxpr, tr.closed.consts, args, (),
                          probes, caps)
    out = jax.tree.unflatten(tr.out_tree, outs)
    loss, aux = out if self.has_aux else (out, None)
    return loss, aux, caps

  def value_and_stats_inputs(self, params, batch):
    """``(loss, aux, layer inputs, vjp_fn)``, one forward pass.

    ``vjp_fn(ct_loss)`` returns ``(param_grads, probe_cotangents)``."""
    probes = self.zero_probes(params, batch)

    def f(p, pr):
      loss, aux, caps = self.apply(p, batch, pr)
      return loss, (aux, caps)
    loss, vjp_fn, (aux, caps) = jax.vjp(f, params, probes, has_aux=True)
    return loss, aux, caps, vjp_fn

  def layer_data(self, captures, cotangents):
    """``{layer name: compute_stats data}`` for every detected layer.

    For Kronecker, diagonal and scale/shift blocks the data is
    ``(inputs, cotangents)`` (ids for an embedding block, zero inputs for a
    shift-only block); for a ``Full``/``NaiveDiagonal`` override of a
    detected layer it is ``(per_example_grads,)`` with ``[N, *shape]``
    gradients (``[S*N, ...]`` with a samples axis). Fallback layers need
    the gradients and are left out. ``cotangents`` are ``∂ℓ_i/∂y``
    (divide the probe cotangents by ``c_i``), optionally with a leading
    samples axis."""
    out = {}
    for l in self.detected:
      data = _layers.layer_data(l, self._uses, captures, cotangents)
      if type(l.block).__name__ in ("Full", "NaiveDiagonal"):
        g = _pergrad.per_example_grads(l, data)
        data = (tuple(x.reshape((-1,) + x.shape[x.ndim - len(s):])
                      for x, s in zip(g, l.block.param_shapes)),)
      out[l.name] = data
    return out

  def per_example_grads(self, captures, cotangents):
    """``{path: [S?, N, *leaf_shape]}``, rebuilt from the layer data (a
    check of the detection; K-FAC itself never materialises these)."""
    out = {}
    for l in self.detected:
      data = _layers.layer_data(l, self._uses, captures, cotangents)
      grads = _pergrad.per_example_grads(l, data)
      for path, g, shape in zip(l.params, grads, l.leaf_shapes):
        out[path] = g.reshape(g.shape[:g.ndim - len(
            _pergrad.block_shapes(l)[l.params.index(path)])] + shape)
    return out


def find_layers(loss_fn: Callable, params, batch, *, has_aux=False,
                blocks=None, exclude=(), weight_sharing="expand",
                damping_mode="pi") -> TaggedLoss:
  """Trace ``loss_fn(params, batch)`` and find every layer; see
  ``TaggedLoss`` and the package docstring."""
  return TaggedLoss(loss_fn, params, batch, has_aux=has_aux, blocks=blocks,
                    exclude=exclude, weight_sharing=weight_sharing,
                    damping_mode=damping_mode)
