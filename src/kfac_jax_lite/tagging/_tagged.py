"""``find_layers``: trace, detect, and the rewritten loss."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax_lite import blocks as B
from kfac_jax_lite.tagging import _analysis
from kfac_jax_lite.tagging import _block_policy
from kfac_jax_lite.tagging import _examples
from kfac_jax_lite.tagging import _format as F
from kfac_jax_lite.tagging import _interpret
from kfac_jax_lite.tagging import _layers
from kfac_jax_lite.tagging import _loss_heads
from kfac_jax_lite.tagging import _rows
from kfac_jax_lite.tagging import _losses
from kfac_jax_lite.tagging import _vma
from kfac_jax_lite.tagging._paths import named_leaves
from kfac_jax_lite.tagging._paths import path_name as path_name
from kfac_jax_lite.tagging._loss_tags import LossTag, find_loss_tags


# The most model-output elements a loss head is evaluated at when the
# recognition verifies it (``TaggedLoss._recognise``): 4 MiB of float32.
VERIFY_LIMIT = 1 << 20


# The fix for an Equinox loss written for the whole model (both errors).
_EQUINOX_FIX = ("params, static = eqx.partition(model, eqx.is_array) and "
                "loss_fn = lambda p, b: loss(eqx.combine(p, static), b)")


def _check_params(params):
  leaves = named_leaves(params)
  treedef = jax.tree.structure(params)
  paths = []
  for name, leaf in leaves:
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
      raise TypeError(
          f"parameter {name!r} is a {type(leaf).__name__}, not an array; "
          "params must be a pytree of arrays (for Equinox, pass "
          "eqx.filter(model, eqx.is_array) and close over the rest: "
          f"{_EQUINOX_FIX})")
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
      raise TypeError(f"parameter {name!r} has dtype {leaf.dtype}; "
                      "K-FAC needs floating-point parameters")
    paths.append(name)
  if len(set(paths)) != len(paths):
    paths = [f"{p}#{i}" for i, p in enumerate(paths)]
  return treedef, tuple(paths), tuple(tuple(l.shape) for _, l in leaves)


def batch_size(batch):
  """The leading size shared by every array of ``batch`` (None if they
  disagree or there is none)."""
  sizes = {np.shape(x)[0] for x in jax.tree.leaves(batch) if np.ndim(x) > 0}
  return sizes.pop() if len(sizes) == 1 else None


@dataclasses.dataclass
class _Trace:
  closed: Any
  out_tree: Any
  uses: list
  opaque: list
  losses: list
  penalties: list
  unrecognised: list


class TaggedLoss:
  """The layers of ``loss_fn`` and its rewritten, probe-taking version.

  ``layers``: one ``Layer`` per layer (fallbacks included), without blocks
  (``Layer.block`` None) as ``find_layers`` returns it; ``with_blocks``
  gives the same detection with every layer's curvature block chosen. The
  rewritten loss is ``apply(params, batch, probes) -> (loss, aux,
  captures)``; ``probes = zero_probes(params, batch)``; the gradient of the
  loss with respect to ``probes`` is, per probe, ``c_i ∂ℓ_i/∂y`` at that
  layer output. ``layer_data`` turns captures and probe cotangents into
  each block's ``LayerData``. Both gradients (params and probes) come from
  one ``jax.vjp`` of ``apply``: one forward pass.
  """

  def __init__(self, loss_fn, params, batch, *, has_aux=False, exclude=(),
               example_axis=None):
    self.loss_fn = loss_fn
    self.has_aux = has_aux
    self.param_treedef, self.paths, self.leaf_shapes = _check_params(params)
    self.batch_treedef = jax.tree.structure(batch)
    # ``_losses.recognise``'s verified heads, across re-traces.
    self._heads_memo = _loss_heads.Memo()
    # ``example_axis=``: per use uid, its labels renamed so that the
    # examples' axis is ``("b", 0)``; per loss index, its values' example
    # axis (``_examples.located``; applied to every trace).
    self._relabels, self._loss_axes = {}, {}
    axes = (None if example_axis is None
            else _examples.resolve(batch, example_axis))
    tr = self._trace(params, batch)
    #: Which batch leaves hold the examples (``_examples``): the empirical
    #: estimation without a loss reads N from them.
    if axes is None:
      self.examples = _examples.guess_hints(_examples.find(batch, tr.uses),
                                            batch, tr.uses)
      if self.examples.hints:
        self.examples = _examples.scanned(self._trace, tr, self.examples,
                                          params, batch)
    else:
      self.examples = _examples.given(batch, axes)
      if any(a not in (None, 0) for a in axes):
        self.examples, self._relabels, self._loss_axes = _examples.located(
            self._trace, tr, self.examples, params, batch, axes)
        tr = self._trace(params, batch)
    self._uses = tr.uses
    # The examples are the loss's when it has them (a graph network's loss
    # has one per graph, its layers a row per node or edge); a layer whose
    # rows are not examples finds its segment ids (``_rows``).
    # With ``example_axis=`` the examples are the axes given (the losses'
    # values keep their own layout until relabelled).
    n = self.examples.size
    if axes is None and tr.losses and tr.losses[0].values_shape:
      n = tr.losses[0].values_shape[0]
    self._row_steps = {}
    for u in tr.uses:
      if u.examples is not None and u.examples != n and n is not None:
        steps = _rows.find(tr.closed.jaxpr, u.probe_key, n)
        if steps and u.out_labels[:1] == (("b", 0),) and not u.levels:
          self._row_steps[u.uid] = steps
    self.layers, self.excluded = _layers.build_layers(
        tr.uses, tr.opaque, self.paths, self.leaf_shapes, n,
        exclude, tr.penalties, self._row_steps, self.examples.size)
    self.losses = tuple(tr.losses)
    #: The loss's terms no loss was recognised in (``describe``'s notes).
    self.unrecognised = tuple(tr.unrecognised)
    self.closed = tr.closed
    self._active = sorted(u for l in self.layers for u in l.use_ids)
    self._signatures = {i: _examples.signature(tr.uses[i]) for i in self._active}

  def with_blocks(self, overrides=None, *, damping_mode="pi",
                  weight_sharing="expand") -> "TaggedLoss":
    """The same detection (no re-trace) with every layer's block chosen by
    the block policy (``_block_policy.with_blocks``)."""
    return _block_policy.with_blocks(self, overrides,
                                     damping_mode=damping_mode,
                                     weight_sharing=weight_sharing)

  def replace(self, **changes) -> "TaggedLoss":
    """A new ``TaggedLoss`` with the attributes ``changes`` (e.g.
    ``layers``) and this one's others; this one is left as it is."""
    unknown = sorted(set(changes) - set(vars(self)))
    if unknown:
      raise TypeError(f"TaggedLoss has no attribute {unknown}")
    new = object.__new__(type(self))
    new.__dict__.update(vars(self), **changes)
    return new

  @property
  def detected(self):
    """The layers a pattern matched (no fallbacks)."""
    return tuple(l for l in self.layers if not l.is_fallback)

  @property
  def fallbacks(self):
    return tuple(l for l in self.layers if l.is_fallback)

  @property
  def layer_outputs(self):
    """``{equation key: layer name}`` of the equations whose output each
    layer use probes (its output), in ``closed``'s keys."""
    return {self._uses[u].probe_key: l.name
            for l in self.layers for u in l.use_ids}

  def positions(self, layer):
    """Per example, how many rows ``layer``'s parameters write (for
    ``describe``'s price): each use's output elements over the batch
    (the steps of the scans that apply it and the slices of a stacked
    layer included), divided by the number of examples and by the size of
    one row (``LayerSpec.output_size``: a dense layer's output features, a
    convolution's output channels), summed over the uses. A dense layer
    once per example: 1; a 3x3 VALID convolution on 6x6: 16; a dense layer
    inside a ``lax.scan`` of 5 steps: 5. None for a fallback."""
    n = self.examples.size
    total = 0.0
    for k, i in enumerate(layer.use_ids):
      u, size = self._uses[i], layer.spec.output_size(k)
      if size is None:
        return None
      total += (math.prod(F.stacked_shape(u, u.probe_aval))
                / ((n or u.examples) * size))
    return total if layer.use_ids else None

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
    try:
      closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(
          jax.tree.map(_vma.abstract, params),
          jax.tree.map(_vma.abstract, batch))
    except TypeError as e:
      _raise_if_filtered(e, params)
      raise
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
    # Hand-written losses get their registered twin's tag (``_losses``).
    closed, records, unrecognised = self._recognise(closed, params, batch)
    uses, opaque, penalties = _analysis.analyse(closed.jaxpr,
                                                self.leaf_shapes)
    tags = [LossTag(-1 - j, key, eqn.params["distribution"],
                    eqn.params["num_outputs"], tuple(eqn.outvars[0].aval.shape),
                    eqn.outvars[0].aval.dtype,
                    _vma.aval_vma(eqn.outvars[0].aval), records.get(id(eqn)),
                    self._loss_axes.get(j, 0))
            for j, (key, eqn) in enumerate(find_loss_tags(closed.jaxpr))]
    for u in uses:
      _examples.relabel(u, self._relabels.get(u.uid))
    return _Trace(closed, jax.tree.structure(out_shape), uses, opaque, tags,
                  penalties, unrecognised)

  def _recognise(self, closed, params, batch):
    """``_losses.recognise`` of the traced ``closed``. A head too large to
    evaluate at this batch (more than ``VERIFY_LIMIT`` output elements: an
    LM's ``[B, T, vocab]`` logits) is verified on a trace of the loss at 2
    examples, which fills the memo by position; whatever that misses is
    then verified at full size."""
    memo, n = self._heads_memo, len(self.leaf_shapes)
    memo.limit = VERIFY_LIMIT
    try:
      return _losses.recognise(closed, n, memo)
    except _loss_heads.TooLarge:
      pass
    memo.limit = None
    small = _examples.shrunk(batch)
    if small is not None:
      try:
        little = jax.make_jaxpr(self.loss_fn)(
            jax.tree.map(_vma.abstract, params),
            jax.tree.map(_vma.abstract, small))
        _losses.recognise(little, n, memo)
      except Exception:  # The loss needs its batch size: verify at it.
        pass
    return _losses.recognise(closed, n, memo)

  def _checked_trace(self, params, batch):
    tr = self._trace(params, batch)
    # A loss tag is compared by its depth, not its equation index: under
    # shard_map(check_vma=True) the `pvary` casts shift the indices (``_vma``).
    same = lambda t: (len(t.key), t.distribution, t.num_outputs)
    same_losses = list(map(same, tr.losses)) == list(map(same, self.losses))
    for i in self._active if same_losses else [-1]:
      if i < 0 or i >= len(tr.uses) or _examples.signature(tr.uses[i]) != self._signatures[i]:
        raise RuntimeError(
            "layer detection differs from the one at construction (the "
            "loss traces differently for this batch); re-create the "
            "TaggedLoss for this batch layout")
    return tr

  # ------------------------------------------------------------ rewriting
  def zero_probes(self, params, batch):
    tr = self._checked_trace(params, batch)
    # Each probe varies over the mesh axes its output does (``_vma``).
    probes = {i: _vma.zeros(F.stacked_shape(tr.uses[i], tr.uses[i].probe_aval),
                            tr.uses[i].probe_aval.dtype, tr.uses[i].probe_aval)
              for i in self._active}
    for t in tr.losses:
      probes[t.uid] = _vma.cast(jnp.zeros(t.values_shape, t.values_dtype),
                                t.values_vma)
    return probes

  @staticmethod
  def per_device_params(params, batch):
    """``params`` cast to vary over the mesh axes ``batch`` varies over.

    Inside ``shard_map(check_vma=True)`` the gradient with respect to
    replicated (invariant) params is summed over the devices, since the
    transpose of the ``pvary`` that meets them with the batch is a
    ``psum``; with respect to these it is each device's own, as under
    ``pmap`` or ``check_vma=False`` (where this returns ``params``
    unchanged). ``summed_over_devices`` turns such gradients back into
    ``jax.grad``'s."""
    axes = frozenset().union(*map(_vma.vma, jax.tree.leaves(batch)))
    return jax.tree.map(lambda p: _vma.cast(p, axes), params)

  @staticmethod
  def summed_over_devices(grads, params):
    """Gradients with respect to ``per_device_params(params, ...)`` made
    ``jax.grad``'s with respect to ``params``: ``psum``-ed over the mesh
    axes they vary over and ``params`` does not (none outside
    ``shard_map(check_vma=True)``)."""
    def total(g, p):
      axes = tuple(sorted(_vma.vma(g) - _vma.vma(p), key=str))
      return jax.lax.psum(g, axes) if axes else g
    return jax.tree.map(total, grads, params)

  def apply(self, params, batch, probes):
    """``(loss, aux, captures)``: the loss with ``probes`` added to the
    layer outputs; ``captures[uid]`` the layer inputs, and for each
    registered loss ``t`` in ``losses``, ``captures[t.uid]`` its model
    outputs followed by its targets (``aux`` None
    without ``has_aux``)."""
    tr = self._checked_trace(params, batch)
    rows = {l.use_ids[0]: self._row_steps[l.use_ids[0]]
            for l in self.layers if l.row_map}
    plan = _interpret.Plan([tr.uses[i] for i in self._active],
                           [(t.uid, t.key) for t in tr.losses], rows)
    args = jax.tree.leaves((params, batch))
    caps = {}
    outs = _interpret.run(plan, tr.closed.jaxpr, tr.closed.consts, args, (),
                          probes, caps)
    out = jax.tree.unflatten(tr.out_tree, outs)
    loss, aux = out if self.has_aux else (out, None)
    return loss, aux, caps

  def _cotangents(self, layer, cotangents):
    """The layer's probe cotangents with a leading samples axis, and
    whether they had one."""
    uses = [self._uses[i] for i in layer.use_ids]
    u = uses[0]
    has_samples = cotangents[u.uid].ndim == len(
        F.stacked_shape(u, u.probe_aval)) + 1
    cots = {v.uid: cotangents[v.uid] if has_samples else cotangents[v.uid][None]
            for v in uses}
    return uses, cots, has_samples

  def _data(self, layer, captures, cotangents):
    uses, cots, _ = self._cotangents(layer, cotangents)
    inputs, cots = layer.spec.data(uses, captures, cots, bool(layer.stack))
    if layer.row_uses:  # One pseudo-example whose rows are the uses.
      base = 1 if layer.stack else 0
      inputs = jnp.expand_dims(inputs, base)
      cots = jnp.expand_dims(cots, base + 1)
    return inputs, cots

  def _gradients(self, layer, captures, cotangents):
    """``[L?, S, N, *shape]`` per block parameter (N = 1 for a layer of
    ``row_uses``: the sum over its rows)."""
    uses, cots, _ = self._cotangents(layer, cotangents)
    grads = layer.spec.gradients(uses, captures, cots, bool(layer.stack))
    if layer.row_map:  # Each example's rows summed: its own gradient.
      axis = 2 if layer.stack else 1
      ex, n = self._row_examples(layer, captures, grads[0].shape[axis])
      return tuple(jnp.moveaxis(_rows.per_example(
          jnp.moveaxis(g, axis, 0), ex, n)[0], 0, axis) for g in grads)
    if layer.row_uses:
      axis = 2 if layer.stack else 1
      grads = tuple(g.sum(axis, keepdims=True) for g in grads)
    return grads

  def layer_data(self, captures, cotangents, weights=None):
    """``{layer name: LayerData}`` for every detected layer, in the form
    its block consumes (the layers need their blocks: ``with_blocks``).

    ``captures`` from ``apply``; ``cotangents`` the probe cotangents
    divided by ``c_i`` (``∂ℓ_i/∂y``), optionally with a leading samples
    axis; ``weights`` the examples' ``c_i`` (None: 1/N). A block that
    consumes ``ACTIVATIONS`` gets the layer's inputs (ids for an
    embedding, zeros for a shift alone) and cotangents ``[S, ...]``; one
    that consumes ``GRADIENTS`` (a ``Full``/``NaiveDiagonal`` override)
    gets per-example gradients ``[S, N, *shape]``. Fallback layers, which
    need parameter gradients, are left out (``fallback_data``)."""
    out = {}
    for l in self.detected:
      if l.block is None:
        raise ValueError(f"layer {l.name!r} has no block: call layer_data "
                         "on tagged.with_blocks(...)")
      w = weights
      if l.row_map and l.block.consumes != B.GRADIENTS:
        out[l.name] = self._mapped_data(l, captures, cotangents, weights)
        continue
      if l.row_uses and weights is not None and not l.row_map:  # Evenly.
        w = jnp.mean(weights, keepdims=True)
      if l.block.consumes == B.GRADIENTS:
        grads = self._gradients(l, captures, cotangents)
        if l.spread and weights is not None:
          w = jnp.full(grads[0].shape[2 if l.stack else 1:][:1],
                       jnp.mean(weights))
        out[l.name] = B.LayerData(weights=w, grads=grads)
      else:
        inputs, cots = self._data(l, captures, cotangents)
        if l.spread and weights is not None:
          w = jnp.full(inputs.shape[1 if l.stack else 0:][:1],
                       jnp.mean(weights))
        w = l.spec.example_weights(w, inputs, bool(l.stack))
        out[l.name] = B.LayerData(inputs=inputs, cotangents=cots, weights=w)
    return out

  def _row_examples(self, layer, captures, rows):
    """``(ex [rows], n)``: the example of each row of a ``row_map`` layer
    (-1: none) and the number of examples."""
    uid = layer.use_ids[0]
    steps = self._row_steps[uid]
    return _rows.examples(steps, uid, captures, rows), steps[-1].size

  def _mapped_data(self, layer, captures, cotangents, weights):
    """``LayerData`` of a ``row_map`` layer (``_rows.mapped_data``)."""
    uses, cots, _ = self._cotangents(layer, cotangents)
    inputs, cts = layer.spec.data(uses, captures, cots, bool(layer.stack))
    uid = layer.use_ids[0]
    return _rows.mapped_data(layer, self._row_steps[uid], uid, captures,
                             inputs, cts, weights)

  def fallback_data(self, param_grads):
    """``{layer name: LayerData}`` of every fallback layer, from
    ``param_grads``: the params pytree with a leading samples axis S of
    gradients of the whole loss (one "example" of weight 1)."""
    leaves = dict(zip(self.paths, jax.tree.leaves(param_grads)))
    out = {}
    for l in self.fallbacks:
      grads = tuple(leaves[p].reshape((leaves[p].shape[0], 1) + tuple(s))
                    for p, s in zip(l.params, l.spec.param_shapes))
      out[l.name] = B.LayerData(
          weights=jnp.ones((1,), grads[0].dtype), grads=grads)
    return out

  def per_example_grads(self, captures, cotangents):
    """``{path: [S?, N, *leaf_shape]}``, rebuilt from the layer data (a
    check of the detection; K-FAC itself never materialises these)."""
    out = {}
    for l in self.detected:
      _, _, has_samples = self._cotangents(l, cotangents)
      grads = self._gradients(l, captures, cotangents)
      for path, g, shape in zip(l.params, grads, l.leaf_shapes):
        if l.stack:  # [L, S, N, *s] -> [S, N, L, *s]
          g = jnp.moveaxis(g, 0, 2)
        g = g.reshape(g.shape[:2] + shape)
        out[path] = g if has_samples else g[0]
    # A layer of ``row_uses`` gives one pseudo-example: the sum over the
    # batch of the per-example gradients, ``[S?, 1, *shape]``.
    return out


def _raise_if_filtered(error: TypeError, params):
  """A clear ``TypeError`` for a loss that used a field its params hold as
  None: Equinox's ``eqx.filter(model, eqx.is_array)`` (and any filtered
  pytree) keeps the model's functions as None, and the loss, written for
  the whole model, then calls None inside the trace."""
  holes = [x for x in jax.tree.leaves(params, is_leaf=lambda x: x is None)
           if x is None]
  if holes and "NoneType" in str(error):
    raise TypeError(
        f"loss_fn raised {type(error).__name__}: {error} while traced with "
        f"params that hold None in {len(holes)} place(s), as a filtered "
        "model does (eqx.filter(model, eqx.is_array)). The curvature is "
        "traced from loss_fn(params, batch) with the params given: pass a "
        f"loss of the arrays alone, e.g. {_EQUINOX_FIX}") from error


def find_layers(loss_fn: Callable, params, batch, *, has_aux=False,
                exclude=(), example_axis=None) -> TaggedLoss:
  """Trace ``loss_fn(params, batch)`` and find every layer.

  ``has_aux``: ``loss_fn`` returns ``(loss, aux)``; ``exclude``: parameter
  paths (or ``fnmatch`` patterns, as ``blocks=`` keys) to leave out of the
  curvature, one that matches no path a ``ValueError`` naming the nearest;
  ``example_axis``: which axis of the batch's leaves holds the examples,
  an int for every leaf with axes or a pytree of the batch's structure
  with an int or None (no examples) per leaf; None: the leading axis
  (``_examples``; ``describe`` says when that was a guess). Time-major
  data ``[T, B, ...]`` needs ``example_axis=1``: each layer's and loss's
  example axis is then the one that follows the batch's, and the
  statistics are those of the batch-major model. Returns the detection (a
  ``TaggedLoss``, see the package docstring); its blocks are chosen by
  ``with_blocks`` (``make_blocks``)."""
  return TaggedLoss(loss_fn, params, batch, has_aux=has_aux, exclude=exclude,
                    example_axis=example_axis)
