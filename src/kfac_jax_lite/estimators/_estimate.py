"""The estimate: the loss, its gradient and every block's statistics from
one forward pass of a tagged loss (the math: the ``kfl.estimators`` module
docstring)."""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kfac_jax_lite.factor import float_dtype
from kfac_jax_lite import tagging
from kfac_jax_lite.estimators._checks import (
    PER_EXAMPLE_FALLBACKS, check_estimation, check_has_loss)


# The reserved entry of ``Estimate.stats`` that carries the run's own
# numbers next to the blocks' statistics (no layer is named so):
# ``{"loss": the loss, "bad_targets": int32 count of targets outside their
# distribution's support}``. ``kfl.kfac`` reads it, so that
# ``tx.update(est.grads, state, params, stats=est.stats)`` sees the loss
# (for ``kfl.health``) and skips a step on bad labels without ``loss=``.
RUN_ENTRY = "~run"


def split_run(stats):
  """``(block statistics, run entry or None)`` of an ``Estimate.stats``
  (``RUN_ENTRY``); ``stats`` None gives ``(None, None)``."""
  if stats is None or RUN_ENTRY not in stats:
    return stats, None
  return ({k: v for k, v in stats.items() if k != RUN_ENTRY},
          stats[RUN_ENTRY])


def checked_loss(tagged, params, batch):
  """``(loss, bad targets)`` of one forward pass of the tagged loss on
  ``batch`` (no gradient, no statistics): what the run entry of an
  ``Estimate`` holds, for an update that has a batch but no pass of its
  own over it (``kfl.eigen_adam(basis="shampoo")`` with ``batch=``)."""
  loss, _, caps = tagged.apply(params, batch, tagged.zero_probes(params, batch))
  return loss, bad_targets(tagged, caps).astype(float_dtype(loss.dtype))


def bad_targets(tagged, caps):
  """int32: the targets of every registered loss outside its
  distribution's support (``PredictiveDistribution.bad_targets``)."""
  total = jnp.zeros((), jnp.int32)
  for t in tagged.losses:
    outs, targets = t.split(caps)
    total = total + t.distribution.bad_targets(outs, targets)
  return total


class Estimate(NamedTuple):
  """What one pass gives: ``stats`` maps each block name to its statistics,
  plus the entry ``RUN_ENTRY`` (``"~run"``: the loss and the count of
  targets outside their distribution's support, which ``kfl.kfac``'s
  ``update(stats=)`` reads for its guards and ``kfl.health``; ``split_run``
  separates them); ``weights`` are the examples' ``c_i``. Statistics left
  to the update (a traced ``with_stats``: ``_deferred``) are the run entry
  and ``DEFERRED_ENTRY`` instead of the blocks', with ``weights`` None."""

  loss: Any
  aux: Any
  grads: Any
  stats: dict
  weights: Any

def _per_example(c_elem, n, axis=0):
  """``c_i``: a loss's element weights summed over all but the batch axis
  (``axis``: ``LossTag.example_axis``)."""
  if not c_elem.ndim:
    return jnp.broadcast_to(c_elem, (n,))
  return jnp.moveaxis(c_elem, axis, 0).reshape(n, -1).sum(-1)


def _along(v, axis, ndim):
  """``v [N]`` shaped to broadcast along ``axis`` of ``ndim`` axes."""
  return v.reshape((1,) * axis + (-1,) + (1,) * (ndim - axis - 1))


def _directions(tag, outs, targets, values_shape, mode, key, num_samples):
  """``(u, S)`` for one loss: ``u`` a tuple over its outputs of
  ``[S, *output.shape]``, S the samples (or, exactly, the columns)."""
  dist = tag.distribution
  if mode in ("fisher", "empirical"):
    def grad_at(k):
      t = dist.sample(k, outs) if mode == "fisher" else targets
      return jax.grad(lambda o: jnp.sum(dist.loss(o, t)))(outs)
    return jax.vmap(grad_at)(jax.random.split(key, num_samples)), num_samples
  roots = (dist.ggn_sqrt(outs, targets) if mode.endswith("_ggn")
           else dist.fisher_sqrt(outs))
  if mode.startswith("exact"):
    return _columns(roots, values_shape, tag.example_axis)
  def project(k):
    r = jax.random.rademacher(k, values_shape + (roots[0].shape[-1],),
                              roots[0].dtype)
    return tuple(jnp.einsum("...k,...k->...", b, _broadcast_r(r, b)) for b in roots)
  return jax.vmap(project)(jax.random.split(key, num_samples)), num_samples


def _columns(roots, values_shape, axis=0):
  """All columns of ``B``, one loss element of each example at a time.

  Elements of one example are independent (their cross terms vanish in
  the Fisher), so each column touches one element position: ``E·K``
  columns for ``E`` elements per example and ``K`` columns per element
  (``axis``: the values' example axis).
  """
  within = values_shape[:axis] + values_shape[axis + 1:]
  e, k = math.prod(within), roots[0].shape[-1]
  mask = jnp.expand_dims(jnp.eye(e, dtype=roots[0].dtype).reshape(
      (e,) + within), 1 + axis).reshape((e, 1) + values_shape[:axis] + (1,)
                                        + values_shape[axis + 1:])
  cols = []
  for b in roots:  # [*values, *event, K]
    bk = jnp.moveaxis(b, -1, 0)  # [K, *values, *event]
    m = mask.reshape(mask.shape + (1,) * (bk.ndim - 1 - len(values_shape)))
    cols.append((m * bk[None]).reshape((e * k,) + bk.shape[1:]))
  return tuple(cols), e * k


def _broadcast_r(r, b):
  """Rademacher draws per element ``[*values, K]`` against ``B [..., K]``."""
  extra = b.ndim - r.ndim
  return r.reshape(r.shape[:-1] + (1,) * extra + r.shape[-1:])


def _output_cotangents(tagged, caps, c_elems, c_i, mode, key, num_samples,
                       scale_by_example):
  """``[S, ...]`` cotangents on every registered loss's model outputs."""
  per_loss, counts = [], []
  keys = jax.random.split(key, len(tagged.losses))
  for tag, c_elem, k in zip(tagged.losses, c_elems, keys):
    outs, targets = tag.split(caps)
    u, count = _directions(tag, outs, targets, tuple(c_elem.shape), mode, k,
                           num_samples)
    w = jnp.maximum(c_elem, 0)
    if scale_by_example:  # √(c_e / c_i), zero for weightless examples.
      ci = _along(c_i, tag.example_axis, c_elem.ndim)
      root = jnp.sqrt(jnp.where(ci > 0, w / jnp.where(ci > 0, ci, 1), 0))
    else:
      root = jnp.sqrt(w)
    per_loss.append(tuple(  # x: [S, *values, *event]; root: [*values].
        (x * root.reshape(root.shape + (1,) * (x.ndim - 1 - root.ndim))
         ).astype(o.dtype)  # The VJP wants each output's own dtype.
        for x, o in zip(u, outs)))
    counts.append(count)
  if not mode.startswith("exact"):
    return tuple(per_loss), num_samples
  # Exact: the columns of all losses, each loss's beside zeros for the
  # others, scaled by √S so that the blocks' mean over S is the sum.
  total = sum(counts)
  stacked = []
  for j, (d, count) in enumerate(zip(per_loss, counts)):
    stacked.append([
        tuple(x * math.sqrt(total) for x in d) if i == j else
        tuple(jnp.zeros((count,) + x.shape[1:], x.dtype) for x in other)
        for i, other in enumerate(per_loss)])
  joined = tuple(
      tuple(jnp.concatenate([stacked[j][i][o] for j in range(len(counts))])
            for o in range(len(per_loss[i])))
      for i in range(len(per_loss)))
  return joined, total


def _state_of(states, layer):
  return None if states is None else states[layer.name]


def _samples_of(layer, data):
  """The samples axis of a layer's cotangents ``[L?, S, ...]`` (None for
  a block that consumes per-example gradients)."""
  if data.cotangents is None:
    return None
  return data.cotangents.shape[1 if layer.stack else 0]


def _rescaled(data, scales, stacked):
  """``data`` with its cotangents (or per-example gradients) times
  ``scales``, the per-example factors laid out as ``data``'s rows (the
  ``weights`` of ``layer_data`` called with them in place of ``c_i``)."""
  if scales is None:
    return data
  axis = 2 if stacked else 1  # [L?, S, N, ...]

  def times(x):
    r = jnp.asarray(scales)
    if r.ndim != 1 or x.ndim <= axis or x.shape[axis] != r.shape[0]:
      r = jnp.mean(r)  # Rows not laid out by example: the mean factor.
      return x * r.astype(x.dtype)
    return x * _along(r, axis, x.ndim).astype(x.dtype)
  if data.cotangents is not None:
    data = data._replace(cotangents=times(data.cotangents))
  if data.grads is not None:
    data = data._replace(grads=tuple(times(g) for g in data.grads))
  return data


def _layer_data(tagged, caps, cots, c_i, row_scale):
  """``tagged.layer_data`` with each example's cotangents times
  ``row_scale[i]`` (None: unscaled)."""
  data = tagged.layer_data(caps, cots, c_i)
  if row_scale is None:
    return data
  scales = tagged.layer_data(caps, cots, row_scale)
  return {l.name: _rescaled(data[l.name], scales[l.name].weights,
                            bool(l.stack))
          for l in tagged.detected}


def _layer_stats(tagged, caps, cots, c_i, states, row_scale=None):
  """Every detected layer's statistics from its captured data.

  ``cots``: ``{probe uid: [S, ...]}``. A layer whose data no longer has the
  S samples apart (a tied embedding: its transposed use folds them into
  the positions, exact for Kronecker factors only) gets the mean over the
  samples of its statistics from one sample at a time: every block's
  statistics are a mean over samples of one sample's, but a sum of squares
  (a diagonal block) of folded samples would square their sum.
  """
  data = _layer_data(tagged, caps, cots, c_i, row_scale)
  num_samples = next(iter(cots.values())).shape[0] if cots else 1
  folded = [l for l in tagged.detected
            if _samples_of(l, data[l.name]) not in (None, num_samples)]
  folded_names = {l.name for l in folded}
  stats = {l.name: l.block.layer_stats(data[l.name], _state_of(states, l))
           for l in tagged.detected if l.name not in folded_names}
  if folded:
    def one_sample(cot):
      one = _layer_data(tagged, caps, {u: x[None] for u, x in cot.items()},
                        c_i, row_scale)
      return {l.name: l.block.layer_stats(one[l.name], _state_of(states, l))
              for l in folded}

    def add(total, cot):
      return jax.tree.map(jnp.add, total, one_sample(cot)), None
    # A scan, not a vmap: one sample's statistics in memory at a time.
    total, _ = jax.lax.scan(add, one_sample(jax.tree.map(lambda x: x[0], cots)),
                            jax.tree.map(lambda x: x[1:], cots))
    stats.update(jax.tree.map(lambda x: x / num_samples, total))
  return stats


def _split_by_example(directions, c_i, axes=()):
  """Output cotangents ``[S, N, ...]`` split by example: ``[N·S, N, ...]``,
  row ``(j, s)`` example ``j``'s part of sample ``s`` (zero elsewhere)
  times ``√(N c_j)``.

  From directions whose example ``i`` part is ``d_e = √(c_e/c_i) u_e``,
  the parameter gradients of the rows are ``√(N c_j) γ_j`` per sample
  (``γ_j = Σ_{e∈j} J_eᵀ d_e``): their mean outer product over the ``N·S``
  rows is ``Σ_j c_j (1/S) Σ_s γ_js γ_jsᵀ``, the layer blocks' scale, with
  no cross-example terms.
  """
  n = c_i.shape[0]
  scale = jnp.sqrt(n * jnp.maximum(c_i, 0))
  if n == 1:  # One example (or a loss without an example axis).
    return jax.tree.map(lambda x: x * scale[0].astype(x.dtype), directions)

  def split(x, axis):  # [S, ..., N (at 1 + axis), ...] -> [N·S, ...]
    mask = jnp.eye(n, dtype=x.dtype) * scale.astype(x.dtype)[:, None]
    shape = [n] + [1] * x.ndim
    shape[2 + axis] = n
    rows = x[None] * mask.reshape(shape)
    return rows.reshape((n * x.shape[0],) + x.shape[1:])
  axes = tuple(axes) or (0,) * len(directions)
  return tuple(jax.tree.map(lambda x, a=a: split(x, a), d)
               for d, a in zip(directions, axes))


def _fallback_stats(tagged, param_grads, states):
  """Fallback layers' statistics from ``[S, ...]`` parameter gradients."""
  data = tagged.fallback_data(param_grads)
  return {l.name: l.block.layer_stats(data[l.name], _state_of(states, l))
          for l in tagged.fallbacks}


class Pass(NamedTuple):
  """One forward pass of a tagged loss and the gradient's backward pass
  (``forward_pass``): what the statistics are formed from."""
  probes: Any  # {probe uid: zeros}: the layers' output probes
  loss: Any
  aux: Any
  caps: Any  # the captured layer inputs and loss outputs/targets
  vjp_fn: Any  # the forward pass's pullback (its residuals)
  local_grads: Any  # this device's parameter gradients
  probe_ct: Any  # {probe uid: the loss's cotangent at that output}
  grads: Any  # the parameter gradients (summed over the devices)


def forward_pass(tagged: tagging.TaggedLoss, params, batch) -> Pass:
  """The forward pass of ``tagged``'s loss on ``batch`` and the gradient's
  backward pass, keeping what the statistics need."""
  probes = tagged.zero_probes(params, batch)

  def f(p, pr):
    loss, aux, caps = tagged.apply(p, batch, pr)
    outs = tuple(t.split(caps)[0] for t in tagged.losses)
    return (loss, outs), (aux, caps)

  # Each device's own parameter gradients under shard_map(check_vma=True):
  # a fallback block needs them per example, not summed over the devices.
  local = tagged.per_device_params(params, batch)
  (loss, outs), vjp_fn, (aux, caps) = jax.vjp(f, local, probes, has_aux=True)
  zero_outs = jax.tree.map(jnp.zeros_like, outs)
  local_grads, probe_ct = vjp_fn((jnp.ones_like(loss), zero_outs))
  grads = tagged.summed_over_devices(local_grads, params)
  return Pass(probes, loss, aux, caps, vjp_fn, local_grads, probe_ct, grads)


def run_entry(tagged, fp: Pass):
  """``Estimate.stats``' ``RUN_ENTRY`` of the pass ``fp``."""
  return {"loss": fp.loss, "bad_targets": bad_targets(
      tagged, fp.caps).astype(float_dtype(fp.loss.dtype))}


def pass_statistics(tagged, fp: Pass, batch, key, estimation, num_samples,
                    states):
  """``(stats, c_i)``: every block's statistics (no run entry) and the
  examples' weights, from the pass ``fp`` on ``batch``."""
  return _statistics(tagged, fp.probes, fp.loss, fp.caps, fp.vjp_fn,
                     fp.local_grads, fp.probe_ct, batch, key, estimation,
                     num_samples, states)


def when(flag, fn):
  """``fn()`` under a ``lax.cond`` on the traced ``flag``; zeros of its
  shapes where ``flag`` is False."""
  shapes = jax.eval_shape(fn)
  return jax.lax.cond(flag, fn, lambda: jax.tree.map(
      lambda s: jnp.zeros(s.shape, s.dtype), shapes))


def estimate(tagged: tagging.TaggedLoss, params, batch, key, *,
             estimation="fisher", num_samples=1, states=None,
             with_stats=True) -> Estimate:
  """One forward pass: loss, gradient and statistics; see the module doc.

  ``tagged``: the layers with their blocks (``TaggedLoss.with_blocks``);
  ``states``: ``{layer name: block state}``, given to the blocks whose
  statistics depend on their state (None: no such blocks);
  ``with_stats``: True, or a traced boolean: the statistics (and the
  weights) are then computed under a ``lax.cond`` and are zero where it is
  False. The forward pass and the gradient's backward pass stay outside
  the conditional: on XLA:CPU a convolution's gradient inside a
  conditional branch misses the fast kernels (a conv net's
  ``value_and_grad`` took 9x as long there, 560 ms against 63), so only
  the statistics' own work is gated (``value_grad_and_stats`` does so on a
  mesh; elsewhere it defers them to the update, ``_deferred``)."""
  check_estimation(estimation, num_samples)
  fp = forward_pass(tagged, params, batch)

  def statistics():
    return pass_statistics(tagged, fp, batch, key, estimation, num_samples,
                           states)
  stats, c_i = (statistics() if with_stats is True
                else when(with_stats, statistics))
  stats = dict(stats)
  stats[RUN_ENTRY] = run_entry(tagged, fp)
  return Estimate(fp.loss, fp.aux, fp.grads, stats, c_i)


def _statistics(tagged, probes, loss, caps, vjp_fn, local_grads, probe_ct,
                batch, key, estimation, num_samples, states):
  """``(stats, c_i)`` of ``estimate``, from its forward pass (``caps``,
  ``vjp_fn``) and the gradient's backward pass (``local_grads``,
  ``probe_ct``)."""
  layer_uids = [u for u in probes if u >= 0]
  has_fallbacks = bool(tagged.fallbacks)

  if not tagged.losses:
    check_has_loss(tagged, estimation, "value_grad_and_stats")
    n = _batch_size(tagged, batch)
    c_i = jnp.full((n,), 1.0 / n, float_dtype(loss.dtype))
    cots = {u: probe_ct[u][None] * n for u in layer_uids}
    stats = _layer_stats(tagged, caps, cots, c_i, states)
    if has_fallbacks:
      stats.update(_fallback_stats(
          tagged, jax.tree.map(lambda g: g[None] * math.sqrt(n), local_grads),
          states))
    return stats, c_i

  c_elems = [probe_ct[t.uid].astype(float_dtype(probe_ct[t.uid].dtype))
             for t in tagged.losses]
  first = tagged.losses[0]
  n = c_elems[0].shape[first.example_axis] if c_elems[0].ndim else 1
  if n == 0:
    raise ValueError("the batch is empty: its registered loss has no examples")
  c_i = sum(_per_example(c, n, t.example_axis)
            for c, t in zip(c_elems, tagged.losses))
  if estimation == "empirical_shared":  # The gradient's own cotangents.
    squares = sum(_per_example(jnp.square(jnp.maximum(c, 0)), n,
                               t.example_axis)
                  for c, t in zip(c_elems, tagged.losses))
    row_scale = jnp.where(squares > 0, jax.lax.rsqrt(
        jnp.where(squares > 0, squares, 1)), 0)
    stats = _layer_stats(tagged, caps, {u: probe_ct[u][None]
                                        for u in layer_uids},
                         c_i, states, row_scale)
    if has_fallbacks:
      stats.update(_fallback_stats(
          tagged, jax.tree.map(lambda g: g[None] * math.sqrt(n), local_grads),
          states))
    return stats, c_i
  k_layers, k_fallback = jax.random.split(key)
  d, _ = _output_cotangents(tagged, caps, c_elems, c_i, estimation,
                            k_layers, num_samples, True)
  zero_loss = jnp.zeros_like(loss)
  back = jax.vmap(lambda dd: vjp_fn((zero_loss, dd)))
  _, h = back(d)
  stats = _layer_stats(tagged, caps, {u: h[u] for u in layer_uids}, c_i,
                       states)
  if has_fallbacks and estimation in PER_EXAMPLE_FALLBACKS:
    # Exact directions: one backward pass per example and sample.
    fb_grads, _ = back(_split_by_example(
        d, c_i, [t.example_axis for t in tagged.losses]))
    stats.update(_fallback_stats(tagged, fb_grads, states))
  elif has_fallbacks:  # Sampled: cross-example terms vanish in expectation.
    d_fb, _ = _output_cotangents(tagged, caps, c_elems, c_i, estimation,
                                 k_fallback, num_samples, False)
    fb_grads, _ = back(d_fb)
    stats.update(_fallback_stats(tagged, fb_grads, states))
  return stats, c_i


def linearized_outputs(tagged: tagging.TaggedLoss, params, batch):
  """The registered losses' model outputs, linear in the parameters.

  Two passes of ``tagged``'s rewritten loss: a backward one from the loss
  to the losses' per-element values (their weights ``c_e``) and a
  linearized forward one. Returns ``(loss, weights, outputs, targets,
  jvp_fn)``, per registered loss (tuples in ``tagged.losses`` order) its
  element weights ``c_e``, its model outputs and its targets; ``jvp_fn(v)``
  is ``J v``, the outputs' derivative along a params-shaped ``v``.
  """
  probes = tagged.zero_probes(params, batch)

  def outputs(p):
    _, _, caps = tagged.apply(p, batch, probes)
    return tuple(t.split(caps)[0] for t in tagged.losses), caps

  def loss_of_probes(pr):
    return tagged.apply(params, batch, pr)[0]

  loss, c = jax.value_and_grad(loss_of_probes)(probes)
  outs, jvp_fn, caps = jax.linearize(outputs, params, has_aux=True)
  return (loss, tuple(c[t.uid] for t in tagged.losses), outs,
          tuple(t.split(caps)[1] for t in tagged.losses), jvp_fn)


def _batch_size(tagged, batch):
  """N for the empirical statistics without a loss: the leading size of
  the batch leaves the detection took as examples (``tagged.examples``,
  which ``describe`` names)."""
  if tagged.examples.size is None:
    raise ValueError("estimation='empirical' without a registered or "
                     "recognised loss needs a batch with an example axis: no "
                     "batch leaf has a leading axis")
  n = tagged.examples.count(batch)
  if n == 0:
    raise ValueError("the batch is empty (its arrays have a leading batch "
                     "size of 0)")
  return n
