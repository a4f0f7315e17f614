"""``fit``: the curvature of a model at its MAP, summed over a dataset."""
from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax_lite.factor import float_dtype
from kfac_jax_lite import blocks as kfl_blocks
from kfac_jax_lite import estimators
from kfac_jax_lite import factor
from kfac_jax_lite import tagging
from kfac_jax_lite.laplace import _columns
from kfac_jax_lite.laplace import _posterior as P

# Block choices per layer kind (``blocks=`` of ``kfl.tagging.find_layers``) of
# each blockwise structure; "full" is one dense matrix over all parameters. A
# new blockwise structure (e.g. "ekfac": {"dense": "ekfac", "conv": "ekfac"}) is
# an entry here, plus a case in ``_spectrum`` (its eigenvalues) and, if its
# statistics are not all sums over examples, in ``blockwise_step``; its
# block's ``multiply_matpower`` must apply the damping exactly.
BLOCKWISE = {
    "kron": {"fallback": "naive_diagonal"},
    "diag": {"dense": "diagonal", "conv": "diagonal", "embedding": "diagonal",
             "scale_and_shift": "diagonal", "fallback": "naive_diagonal"},
}
STRUCTURES = tuple(BLOCKWISE) + ("full",)
"""The ``structure`` choices of ``fit``: ``"kron"``, ``"diag"``, ``"full"``."""

_add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))


def fit(loss_fn, params, batches, *, structure="kron", estimation="exact_ggn",
        num_samples=1, has_aux=False, blocks=None, key=None,
        progress=True) -> P.Posterior:
  """The Laplace posterior of ``loss_fn`` at ``params`` (the MAP).

  Precision ``P = H + τ I`` (``τ`` given later, to ``logdet`` etc.) with

      H = Σ_n ∇²_θ ℓ_n   (GGN, Fisher or empirical Fisher by ``estimation``)

  summed over every example of ``batches``, ``ℓ_n = Σ_{e∈n} ℓ_e`` the sum
  of the negative log-likelihoods of example n's loss elements (outputs,
  tokens, pixels), never divided by their number. The loss of a batch is
  read as ``L = Σ_e c_e ℓ_e`` (``c_e`` from its backward pass, as the
  estimators do) and its elements' weights are rescaled to average 1 over
  the elements with ``c_e > 0`` (``_columns``): a mean, a sum, a sum over
  outputs then a mean over examples and a masked mean all give
  ``Σ_n ℓ_n``, the masked elements left out, and so does ``post.loss``.
  With several registered losses one rescaling serves them all: their
  relative weights stay as written. For ``"kron"`` each Kronecker block is
  ``A ⊗ G`` with ``A`` the example-weighted *mean* of the batches' input
  factors and ``G`` the *sum* of their output factors, so ``A ⊗ G =
  N·E[āāᵀ] ⊗ E[ggᵀ]`` (laplace-torch's KFAC convention; exact for one
  example). Fallback parameters (no layer pattern matched) get the exact
  diagonal of their curvature from per-example gradients.

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss`` (``(loss, aux)`` with
      ``has_aux``), the data term only (no weight decay: that is the prior),
      with a registered loss (``kfl.softmax_cross_entropy`` ...) or one
      recognised in the jaxpr (optax's, or written out) unless
      ``estimation="empirical"``, in which case a loss without one is read
      as a mean over the batch.
    params: the MAP parameters, a pytree of float arrays.
    batches: an iterable of batches (pytrees of arrays sharing a leading
      example axis; wrap a single batch in a list); traced at the first. ``"full"`` and fallback
      parameters process examples one at a time, so the loss must accept a
      batch of one.
    structure: ``"kron"`` (the K-FAC blocks, damped exactly),
      ``"diag"`` (the diagonal) or ``"full"`` (one dense matrix over all
      parameters, cross-layer terms included; small models only).
    estimation: one of ``kfl.ESTIMATIONS``; ``"exact_ggn"`` (the default)
      is the exact GGN, ``"exact"`` the exact Fisher.
    num_samples: samples per example for the sampled estimations.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    blocks: extra block choices per path or kind for the blockwise
      structures (see ``kfl.tagging.find_layers``), e.g.
      ``{"*/scale": "full"}``.
    key: PRNG key of the sampled estimations (default ``PRNGKey(0)``).
    progress: show a ``tqdm`` progress bar over the batches when tqdm is
      installed and the output is a terminal.

  Returns:
    A ``Posterior``.
  """
  if structure not in STRUCTURES:
    raise ValueError(f"structure must be one of {STRUCTURES}, got "
                     f"{structure!r}")
  estimators.check_estimation(estimation, num_samples)
  if estimation == "empirical_shared":
    raise ValueError("kfl.laplace.fit: estimation='empirical_shared' saves "
                     "a training step's backward pass; a posterior has no "
                     "step to share: use estimation='empirical' (the same "
                     "statistics for a mean, sum or masked loss)")
  if blocks is not None and structure == "full":
    raise ValueError("blocks= applies to the blockwise structures "
                     f"{tuple(BLOCKWISE)}, not to 'full'")
  iterator = iter(batches)
  try:
    first = next(iterator)
  except StopIteration:
    raise ValueError("kfl.laplace.fit: batches is empty") from None
  key = jax.random.PRNGKey(0) if key is None else key

  if structure == "full":
    tagged = tagging.find_layers(loss_fn, params, first, has_aux=has_aux)
    estimate = None
  else:
    estimate = estimators.value_grad_and_stats(
        loss_fn, params, first, estimation=estimation,
        num_samples=num_samples, has_aux=has_aux,
        blocks={**BLOCKWISE[structure], **(blocks or {})},
        damping_mode="exact")
    tagged = estimate.tagged
    for layer in tagged.layers:
      _check_block(layer.name, kfl_blocks.as_block(layer.block).one_slice)
  estimators.check_has_loss(tagged, estimation, "kfl.laplace.fit")
  meta = _meta(tagged, structure, estimation)
  step = jax.jit(_batch_step(tagged, estimate, meta, estimation, num_samples))

  total = None
  batches = itertools.chain([first], iterator)
  for b, batch in enumerate(estimators.progress(batches, progress,
                                                  "kfl.laplace.fit")):
    part = step(params, batch, jax.random.fold_in(key, b))
    total = part if total is None else _add(total, part)
  assert total is not None  # batches starts with first.
  curvature, loss, count = total
  if int(count) == 0:
    raise ValueError("kfl.laplace.fit: no example had a positive weight in "
                     "the loss")
  _check_finite(curvature)
  curvature, spectrum = _finalize(meta, curvature, count)
  return P.Posterior(mean=params, curvature=curvature, spectrum=spectrum,
                     num_examples=count, loss=loss, meta=meta)


def _check_block(name, block):
  if isinstance(block, kfl_blocks.KroneckerBlock):
    if block.damping_mode != "exact":
      raise ValueError(f"kfl.laplace: layer {name!r} has a Kronecker block "
                       f"with damping_mode={block.damping_mode!r}; the "
                       "posterior needs 'exact'")
    if block.input_parts > 1 or block.output_parts > 1:
      raise ValueError(f"kfl.laplace: layer {name!r} has a partitioned "
                       f"factor side (side_block={block.side_block}); the "
                       "posterior's spectrum takes whole or diagonal sides")
  elif not isinstance(block, kfl_blocks.FlatBlock):
    raise ValueError(f"kfl.laplace: layer {name!r} has a block of type "
                     f"{type(block).__name__}, which the posterior does not "
                     "support")


def _meta(tagged, structure, estimation):
  shapes = tuple(tuple(s) for s in tagged.leaf_shapes)
  layers = tuple(
      P.LayerSlot(name=l.name, kind=l.kind,
                  block=(None if structure == "full" else
                         kfl_blocks.as_block(l.block).one_slice),
                  leaves=tuple(l.leaves), stack=l.stack,
                  index=P.layer_index(shapes, l.leaves, l.stack))
      for l in tagged.layers)
  covered = np.sort(np.concatenate([l.index.ravel() for l in layers]))
  size = sum(int(np.prod(s)) for s in shapes)
  if not np.array_equal(covered, np.arange(size)):
    raise ValueError("kfl.laplace: the layers do not cover every parameter "
                     "exactly once")
  return P.Meta(structure=structure, estimation=estimation, layers=layers,
                treedef=tagged.param_treedef, leaf_shapes=shapes,
                distributions=tuple(t.distribution for t in tagged.losses))


def _batch_step(tagged, estimate, meta, estimation, num_samples):
  """``step(params, batch, key) -> (curvature sums, loss sum, count)``."""
  fallbacks = [l for l in meta.layers if l.kind == "fallback"]

  def weights(params, batch):
    if tagged.losses:
      return _columns.element_weights(tagged, params, batch)
    _, n = _columns.batch_axes(batch)
    out = tagged.loss_fn(params, batch)
    loss = out[0] if tagged.has_aux else out
    return loss, [], jnp.full((n,), 1.0 / n, float_dtype(loss))

  def columns(params, batch, key, leaves, c_elems, cbar):
    cols = _columns.example_columns(
        tagged, params, batch, key, estimation=estimation,
        num_samples=num_samples, leaves=leaves, c_elems=c_elems, cbar=cbar)
    return cols.reshape(-1, cols.shape[-1])  # [N·C, P_sel]

  def full_step(params, batch, key):
    loss, c_elems, c_i = weights(params, batch)
    cbar, count = _columns.mean_weight(c_elems, c_i)
    leaves = tuple(range(len(meta.leaf_shapes)))
    g = columns(params, batch, key, leaves, c_elems, cbar)
    return g.T @ g, loss / cbar, count

  def blockwise_step(params, batch, key):
    k_est, k_cols = jax.random.split(key)
    est = estimate(params, batch, k_est)
    _, c_elems, _ = weights(params, batch)  # The elements' weights.
    cbar, count = _columns.mean_weight(c_elems, est.weights)
    stats = {}
    for l in meta.layers:
      s = est.stats[l.name]
      if isinstance(s, kfl_blocks.KroneckerState):  # A: mean; G: sum.
        s = kfl_blocks.KroneckerState(a=s.a * count, g=s.g / cbar)
      else:
        s = jax.tree.map(lambda x: x / cbar, s)
      stats[l.name] = s
    if fallbacks:  # Per-example gradients: the estimator's mix examples.
      leaves = tuple(k for l in fallbacks for k in l.leaves)
      g = columns(params, batch, k_cols, leaves, c_elems, cbar)
      start = 0
      for l in fallbacks:
        shapes = l.block.param_shapes
        parts = []
        for s in shapes:
          size = int(np.prod(s))
          parts.append(g[:, start:start + size].reshape((-1,) + tuple(s)))
          start += size
        stats[l.name] = l.block.compute_stats(
            tuple(parts), weights=jnp.ones((g.shape[0],), g.dtype))
    return stats, est.loss / cbar, count

  return full_step if meta.structure == "full" else blockwise_step


@functools.partial(jax.jit, static_argnums=0)
def _finalize(meta, curvature, count):
  """Block states (or the dense matrix) and their spectra."""
  if meta.structure == "full":
    h = (curvature + curvature.T) / 2
    return h, jnp.maximum(jnp.linalg.eigvalsh(h), 0)
  states, spectra = {}, {}
  for l in meta.layers:
    stats = curvature[l.name]
    if isinstance(stats, kfl_blocks.KroneckerState):
      stats = stats._replace(a=stats.a / count)
    dtype = jax.tree.leaves(stats)[0].dtype
    block = l.block

    def build(s, block=block):
      state = block.update(block.init(dtype), s, 0.0)
      return state, _spectrum(block, state)
    build = jax.vmap(build) if l.stack else build
    states[l.name], spectra[l.name] = build(stats)
  return states, spectra


def _spectrum(block, state):
  """Eigenvalues ``s`` of a block's curvature: ``Σ log(s + τ)`` is its
  ``log det(H + τI)``, as the block's exact damping applies it."""
  if isinstance(state, kfl_blocks.KroneckerState):
    la, lg = _eigvals(state.a, 2), _eigvals(state.g, 2)
    return block.renorm_coeff * la[..., :, None] * lg[..., None, :]
  return _eigvals(state, 1)


def _eigvals(state, diagonal_ndim):
  """Eigenvalues of a factor (clipped at 0, as the blocks clip them)."""
  value = factor.factor_value(state)
  if value.ndim == diagonal_ndim:
    return jnp.maximum(value, 0)
  return jnp.maximum(jnp.linalg.eigvalsh(value), 0)


def _check_finite(curvature):
  parts = curvature.items() if isinstance(curvature, dict) else [
      ("full", curvature)]
  bad = [name for name, x in parts
         if not all(np.all(np.isfinite(np.asarray(v)))
                    for v in jax.tree.leaves(x))]
  if bad:
    raise ValueError(f"kfl.laplace.fit: the curvature of {bad} is not finite "
                     "(a batch gave non-finite statistics; check the loss and "
                     "the parameters at the MAP)")
