"""``fit``: the curvature of influence functions, streamed over a dataset."""
from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kfac_jax_lite.blocks import ekfac as kfl_ekfac
from kfac_jax_lite import estimators
from kfac_jax_lite import tagging
from kfac_jax_lite.influence import _data

STRATEGIES = ("identity", "diagonal", "kfac", "ekfac")
"""The ``strategy`` choices of ``fit`` (kronfluence's names)."""


class InfluenceState(NamedTuple):
  """The fitted curvature of ``kfl.influence.fit``.

  Per layer name: ``eigvecs_a [G, a, a]`` (``Q_A``, the input factor's
  eigenvectors), ``eigvecs_g [G, b, b]`` (``Q_G``) and ``eigvals
  [G, a, b]`` (``s``, undamped), so that the layer's curvature is
  ``(Q_A ⊗ Q_G) diag(s) (Q_A ⊗ Q_G)ᵀ`` on its weight matrix ``W [a, b]``
  (the blocks' layout: the kernel's input axes as rows, a bias as the last
  row, one matrix per feature group G). ``"diagonal"`` has no
  eigenvectors (the identity basis, ``s`` the mean squared per-example
  gradient); ``"identity"`` has neither (no preconditioning).
  ``tagged``: the detection the scores reuse; ``num_examples``: N.
  """

  strategy: str
  estimation: str
  eigvecs_a: dict
  eigvecs_g: dict
  eigvals: dict
  num_examples: int
  tagged: Any


def fit(loss_fn, params, batches, *, strategy="ekfac", estimation="fisher",
        key=None, has_aux=False, exclude=(), progress=True) -> InfluenceState:
  """Fit the curvature ``Ĝ`` of influence functions on a training set.

  With per-example gradients ``∇ℓ_n`` (``kfl.influence``'s per-example
  loss; for a sampled ``"fisher"`` fit, with targets drawn from the model)
  of a dense or conv layer's weight matrix ``W [a, b]`` (per feature group)
  with inputs ``ā_nr`` (bias: a 1 appended) and output cotangents
  ``g_nr`` at positions ``r = 1..R``:

  * ``"kfac"`` — ``Ĝ = A ⊗ G`` with ``A = (1/NR) Σ_nr ā_nr ā_nrᵀ``,
    ``G = (1/NR) Σ_nr g_nr g_nrᵀ`` (kronfluence's normalisation: both
    factors are means over the N·R positions), stored as eigenvectors
    ``Q_A``, ``Q_G`` and eigenvalues ``s_ij = λ_A,i λ_G,j``;
  * ``"ekfac"`` — the same eigenvectors, eigenvalues corrected to
    ``s_ij = (1/N) Σ_n (Q_Aᵀ ∇_W ℓ_n Q_G)²_ij`` (George et al. 2018;
    Grosse et al. 2023), a second pass over ``batches``;
  * ``"diagonal"`` — ``s = (1/N) Σ_n (∇_W ℓ_n)²`` in the parameter basis;
  * ``"identity"`` — nothing is fitted (``batches`` is not read).

  The per-example gradients are used in factored form
  (``Σ_r ā_nr g_nrᵀ``), never as an ``N × P`` matrix; memory per batch of
  B examples is ``B·R·(a + b)`` floats per layer plus the factors
  ``a² + b² + a·b``; FLOPs per batch ``2·B·R·(a² + b²)`` for the factors
  and, for ``"ekfac"``, ``2·B·R·(a² + b²)`` for the rotations plus
  ``B·a·b`` (``R = 1``) or ``2·B·R·a·b`` for the squares.

  Sharding: give batches placed over a device mesh along their example
  axis (``jax.device_put(batch, NamedSharding(mesh, P("data")))``, the
  parameters replicated). Every per-batch step (and every score) is
  jitted, so XLA splits the batch's forward and backward passes and the
  factors' products across the devices and all-reduces the sums: the fit
  is that of one device, split (``tests/test_influence.py`` checks both).

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss`` with a registered or
      recognised loss (``kfl.softmax_cross_entropy`` ...), any reduction
      (mean, sum, masked): each example's loss ``ℓ_n`` is its share of it,
      which for these reductions is the sum of the example's unmasked loss
      elements (outputs, tokens; ``kfl.influence``).
    params: the trained parameters (a pytree of float arrays).
    batches: the training set as batches (pytrees of arrays sharing a
      leading example axis), streamed one at a time: a list, any
      re-iterable, or a function returning a fresh iterator (``"ekfac"``
      reads it twice, so a one-shot generator is refused there).
    strategy: one of ``STRATEGIES``.
    estimation: ``"fisher"`` (targets sampled from the model, kronfluence's
      default) or ``"empirical"`` (the data's targets; kronfluence's
      ``use_empirical_fisher=True``). Batch ``b`` draws from
      ``fold_in(key, b)`` in both passes.
    key: PRNG key of ``"fisher"`` (default ``PRNGKey(0)``).
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    exclude: parameter paths (or ``fnmatch`` patterns) left out, e.g.
      those of layer kinds other than dense and conv.
    progress: show a ``tqdm`` progress bar over the batches when tqdm is
      installed and the output is a terminal.

  Returns:
    An ``InfluenceState`` for ``pairwise_scores`` and ``self_scores``.
  """
  if strategy not in STRATEGIES:
    raise ValueError(f"strategy must be one of {STRATEGIES}, got "
                     f"{strategy!r}")
  if estimation not in _data.ESTIMATIONS:
    raise ValueError(f"estimation must be one of {_data.ESTIMATIONS}, got "
                     f"{estimation!r}")
  key = jax.random.PRNGKey(0) if key is None else key
  first, rest = _first(batches, "kfl.influence.fit")
  tagged = tagging.find_layers(loss_fn, params, first, has_aux=has_aux,
                               exclude=exclude).with_blocks(
                                   damping_mode="exact")
  _data.check_layers(tagged, "kfl.influence.fit")
  names = tuple(l.name for l in tagged.detected)
  state = InfluenceState(strategy, estimation, {}, {}, {}, 0, tagged)
  if strategy == "identity":
    return state
  if strategy == "diagonal":
    sums, n = _stream(_diag_step(tagged, estimation), params,
                      itertools.chain([first], rest), key, progress)
    return state._replace(eigvals={k: sums[k] / n for k in names},
                          num_examples=n)
  step = _factor_step(tagged, estimation)
  sums, n = _stream(step, params, itertools.chain([first], rest), key,
                    progress)
  qa, qg, s = {}, {}, {}
  for k in names:
    a, g, rows = sums[k]
    la, qa[k] = jnp.linalg.eigh(a / rows)
    lg, qg[k] = jnp.linalg.eigh(g / rows)
    s[k] = la[:, :, None] * lg[:, None, :]
  if strategy == "ekfac":
    again, _ = _first(batches, "kfl.influence.fit", again=True)
    sums, n2 = _stream(_ekfac_step(tagged, estimation), (params, qa, qg),
                       again, key, progress)
    if n2 != n:
      raise ValueError(f"kfl.influence.fit: the second pass over batches "
                       f"gave {n2} examples, the first {n}: batches must "
                       "give the same data each time it is iterated")
    s = {k: sums[k] / n for k in names}
  return state._replace(eigvecs_a=qa, eigvecs_g=qg, eigvals=s,
                        num_examples=n)


def _first(batches, where, again=False) -> tuple[Any, Any]:
  """``(first batch, the rest)``, or, ``again``, a fresh iterator."""
  it: Any = batches() if callable(batches) else iter(batches)
  if again:
    if it is batches:
      raise ValueError(f"{where}: strategy='ekfac' reads the batches twice; "
                       "pass a list or a function returning a fresh iterator, "
                       "not a one-shot generator")
    return it, None
  try:
    first = next(it)
  except StopIteration:
    raise ValueError(f"{where}: batches is empty") from None
  return first, it


def _stream(step, args, batches, key, progress):
  """Sum ``step(args, batch, key_b)`` over the batches: ``(sums, N)``."""
  step = jax.jit(step)
  total, n = None, 0
  for b, batch in enumerate(estimators.progress(batches, progress,
                                                  "kfl.influence.fit")):
    part, count = step(args, batch, jax.random.fold_in(key, b))
    total = part if total is None else jax.tree.map(jnp.add, total, part)
    n += int(count)
  if total is None:
    raise ValueError("kfl.influence.fit: batches is empty")
  return total, n


def _factor_step(tagged, estimation):
  """``(params, batch, key) -> ({name: (ΣāāᵀG, ΣggᵀG, N·R)}, N)``."""
  def step(params, batch, key):
    data, c_i, _ = _data.example_data(tagged, params, batch, key, estimation)
    out = {}
    for name, (a, g) in data.items():
      out[name] = (jnp.einsum("nrgi,nrgj->gij", a, a),
                   jnp.einsum("nrgi,nrgj->gij", g, g),
                   jnp.asarray(a.shape[0] * a.shape[1], a.dtype))
    return out, c_i.shape[0]
  return step


def _ekfac_step(tagged, estimation):
  """``((params, Q_A, Q_G), batch, key) -> ({name: Σ_n (Q_Aᵀ∇ℓ_nQ_G)²}, N)``."""
  def step(args, batch, key):
    params, qa, qg = args
    data, c_i, _ = _data.example_data(tagged, params, batch, key, estimation)
    out = {name: kfl_ekfac.projected_second_moments(
        a, g[None], jnp.ones(a.shape[:1], a.dtype), qa[name], qg[name])
        for name, (a, g) in data.items()}
    return out, c_i.shape[0]
  return step


def _diag_step(tagged, estimation):
  """``(params, batch, key) -> ({name: Σ_n (∇_W ℓ_n)²}, N)``."""
  def step(params, batch, key):
    data, c_i, _ = _data.example_data(tagged, params, batch, key, estimation)
    return {name: jnp.einsum("ngij->gij", jnp.square(
        jnp.einsum("nrgi,nrgj->ngij", a, g))) for name, (a, g) in
            data.items()}, c_i.shape[0]
  return step
