"""Pairwise and self-influence scores on a fitted ``InfluenceState``.

Scores (Koh & Liang 2017; Grosse et al. 2023, kronfluence's definitions):

    s(q, t) = ∇f_q(θ)ᵀ (Ĝ + λI)⁻¹ ∇ℓ_t(θ),     s(t) = ∇ℓ_tᵀ (Ĝ + λI)⁻¹ ∇ℓ_t,

``f_q`` the query's measurement (default its own loss ``ℓ_q``, read from
the query batch as the training examples' are), ``ℓ_t`` training example
``t``'s loss (data targets; the sum of its unmasked loss elements for a
mean, sum or masked mean: ``kfl.influence``), ``Ĝ`` block diagonal over
the layers (``fit``), ``λ`` per layer: an absolute ``damping``, or
kronfluence's heuristic ``damping_fraction · mean(s)`` (their
``damping_factor=None``: 0.1 × the layer's mean eigenvalue). Per layer,
with the eigenvectors ``Q_A``, ``Q_G`` and eigenvalues ``s``,

    (Ĝ + λI)⁻¹ V = Q_A [(Q_Aᵀ V Q_G) ⊘ (s + λ)] Q_Gᵀ,

the query gradients ``V_q`` are preconditioned once (``Q·P`` floats), and
each training example's gradient enters in factored form: ``s(q, t) = Σ_r
ā_trᵀ Ṽ_q g_tr`` per layer, never an ``N × P`` matrix.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kfac_jax_lite import estimators
from kfac_jax_lite.influence import _data
from kfac_jax_lite.influence import _fit


def layer_damping(state, damping=None, damping_fraction=0.1):
  """``{name: λ}``: ``damping`` for every layer when given, else
  ``damping_fraction`` times the mean of the layer's eigenvalues
  (kronfluence's heuristic); 0 for ``"identity"``."""
  if state.strategy == "identity":
    return {l.name: 0.0 for l in state.tagged.detected}
  if damping is not None:
    if damping < 0:
      raise ValueError(f"damping must be >= 0, got {damping}")
    return {k: damping for k in state.eigvals}
  if damping_fraction is None or damping_fraction < 0:
    raise ValueError("give damping (absolute) or damping_fraction >= 0 (a "
                     f"fraction of the mean eigenvalue), got "
                     f"{damping_fraction!r}")
  return {k: damping_fraction * jnp.mean(s) for k, s in state.eigvals.items()}


def _precondition_mats(state, mats, lam):
  """``{name: (Ĝ + λI)⁻¹ V}`` for ``mats {name: V [..., G, a, b]}``."""
  if state.strategy == "identity":
    return mats
  out = {}
  for k, v in mats.items():
    s = state.eigvals[k] + lam[k]
    if state.strategy == "diagonal":
      out[k] = v / s
      continue
    qa, qg = state.eigvecs_a[k], state.eigvecs_g[k]
    r = jnp.einsum("gia,...gij,gjb->...gab", qa, v, qg) / s
    out[k] = jnp.einsum("gai,...gij,gbj->...gab", qa, r, qg)
  return out


def _arrays(state):
  """The fitted arrays of ``state`` (jit arguments, not constants)."""
  return state.eigvecs_a, state.eigvecs_g, state.eigvals


def _with_arrays(state, arrays):
  a, g, s = arrays
  return state._replace(eigvecs_a=a, eigvecs_g=g, eigvals=s)


def precondition(state: _fit.InfluenceState, grads, *, damping=None,
                 damping_fraction=0.1):
  """``(Ĝ + λI)⁻¹ v`` for a params-shaped ``grads`` (one vector), the
  inverse-Hessian-vector product of the influence scores.

  Args:
    state: from ``fit``.
    grads: a pytree shaped like the parameters (parameters of no scored
      layer are returned as zeros).
    damping: absolute ``λ`` for every layer; None: the heuristic.
    damping_fraction: ``λ = damping_fraction · mean(s)`` per layer when
      ``damping`` is None (kronfluence's ``damping_factor=None``: 0.1).
  """
  tagged = state.tagged
  lam = layer_damping(state, damping, damping_fraction)
  out = _precondition_mats(state, _data.layer_params(tagged, grads), lam)
  return _data.unflatten_params(tagged, out, grads)


def _query_mats(state, params, queries, measurement):
  """``{name: V_q [Q, G, a, b]}``: the queries' measurement gradients."""
  tagged = state.tagged
  if measurement is None:
    data, _, _ = _data.example_data(tagged, params, queries, None,
                                    "empirical")
    return {k: jnp.einsum("qrgi,qrgj->qgij", a, g)
            for k, (a, g) in data.items()}
  jac = jax.jacrev(measurement)(params, queries)
  first = jax.tree.leaves(jac)[0]
  if first.ndim != jax.tree.leaves(params)[0].ndim + 1:
    raise ValueError("measurement(params, queries) must return one value "
                     "per query, shape [Q]")
  return jax.vmap(lambda j: _data.layer_params(tagged, j))(jac)


def pairwise_scores(state: _fit.InfluenceState, params, queries,
                    train_batches, *, measurement=None, damping=None,
                    damping_fraction=0.1, progress=True):
  """``[Q, N]`` influence scores ``s(q, t) = ∇f_qᵀ (Ĝ + λI)⁻¹ ∇ℓ_t``.

  A positive score: a gradient step on training example ``t`` decreases
  ``f_q`` (for the default measurement, the query's loss: ``t`` helped).

  Cost: the ``Q`` query gradients are formed and preconditioned once
  (``Q·P`` floats; ``2·Q·G·(a²b + ab²)`` FLOPs per layer in the
  eigenbasis); each training batch of B examples is one forward and one
  backward pass to the layer outputs, its gradients kept factored
  (``B·R·(a + b)`` floats per layer) and contracted as ``Σ_r ā_trᵀ Ṽ_q
  g_tr`` (``≈ 2·Q·B·R·a·b`` FLOPs, the einsum's cheapest order): memory
  never holds more than one batch's factored gradients and the ``[Q, B]``
  scores beside the ``Q·P`` preconditioned queries.

  Args:
    state: from ``fit``.
    params: the parameters it was fitted at.
    queries: one batch of query examples (Q of them).
    train_batches: the training examples to score, an iterable of batches
      (as ``fit``'s; the columns come in their order).
    measurement: ``measurement(params, queries) -> [Q]``, one value per
      query (a logit margin, a token's log-probability ...); None: each
      query's own loss ``ℓ_q`` under ``state``'s loss function (the sum of
      its unmasked loss elements, as for the training examples).
    damping: absolute ``λ`` for every layer; None: the heuristic.
    damping_fraction: the heuristic's fraction of the mean eigenvalue.
    progress: a ``tqdm`` bar over the training batches.
  """
  tagged = state.tagged
  lam = layer_damping(state, damping, damping_fraction)

  @jax.jit
  def preconditioned(p, q, lam, arrays):
    st = _with_arrays(state, arrays)
    return _precondition_mats(st, _query_mats(st, p, q, measurement), lam)
  pre = preconditioned(params, queries, lam, _arrays(state))

  @jax.jit
  def score(p, batch, pre):
    data, _, _ = _data.example_data(tagged, p, batch, None, "empirical")
    return sum(jnp.einsum("nrgi,qgij,nrgj->qn", a, pre[k], g,
                          optimize="optimal")
               for k, (a, g) in data.items())
  cols = [score(params, b, pre) for b in estimators.progress(
      train_batches, progress, "kfl.influence.fit")]
  return jnp.concatenate(cols, axis=1)


def _squared_norms(a, g):
  """``[N]`` ``Σ_g |∇_W ℓ_n|²_F`` of one layer, the identity strategy's
  self-scores, from the factors ``ā [N, R, G, a]``, ``g [N, R, G, b]``.

  For ``R = 1``, ``|ā gᵀ|²_F = Σ_ij ā_i² g_j² = |ā|² |g|²`` (``B·(a + b)``
  FLOPs); otherwise ``|Σ_r ā_r g_rᵀ|²_F`` from the per-example gradients.
  No weight array of ones: XLA:CPU (jaxlib 0.10.2) miscompiles a dot whose
  operand is a scalar broadcast (``jnp.ones``, ``jnp.full``) built inside
  the jitted function, at a batch of ~160 and more (garbage or NaN, issue
  48).
  """
  if a.shape[1] == 1:
    return jnp.sum(jnp.sum(a[:, 0] ** 2, -1) * jnp.sum(g[:, 0] ** 2, -1), -1)
  return jnp.sum(jnp.einsum("nrgi,nrgj->ngij", a, g) ** 2, axis=(1, 2, 3))


def self_scores(state: _fit.InfluenceState, params, train_batches, *,
                damping=None, damping_fraction=0.1, progress=True):
  """``[N]`` self-influence ``s(t) = ∇ℓ_tᵀ (Ĝ + λI)⁻¹ ∇ℓ_t``.

  Per layer ``Σ_ij (Q_Aᵀ ∇_W ℓ_t Q_G)²_ij / (s_ij + λ)``: for ``R = 1``
  from the rotated factors alone, ``Σ_ij (Q_Aᵀā)²_i (Q_Gᵀg)²_j / (s+λ)_ij``
  (``2·B·(a² + b²) + B·a·b`` FLOPs a batch of B, no ``a × b`` per
  example); otherwise from the rotated per-example gradients (``B·a·b``
  floats). Arguments as ``pairwise_scores``'.
  """
  tagged = state.tagged
  lam = layer_damping(state, damping, damping_fraction)

  @jax.jit
  def score(p, batch, lam, arrays):
    st = _with_arrays(state, arrays)
    data, _, _ = _data.example_data(tagged, p, batch, None, "empirical")
    total = 0.0
    for k, (a, g) in data.items():
      if state.strategy in ("kfac", "ekfac"):
        a = jnp.einsum("nrgi,gij->nrgj", a, st.eigvecs_a[k])
        g = jnp.einsum("nrgi,gij->nrgj", g, st.eigvecs_g[k])
      if state.strategy == "identity":
        total = total + _squared_norms(a, g)
        continue
      inv = 1 / (st.eigvals[k] + lam[k])  # [G, a, b]
      if a.shape[1] == 1:
        total = total + jnp.einsum("ngi,gij,ngj->n", a[:, 0] ** 2, inv,
                                   g[:, 0] ** 2)
      else:
        per = jnp.einsum("nrgi,nrgj->ngij", a, g)
        total = total + jnp.einsum("ngij,gij->n", per ** 2, inv)
    return total
  arrays = _arrays(state)
  return jnp.concatenate([score(params, b, lam, arrays) for b in
                          estimators.progress(train_batches, progress,
                                              "kfl.influence.fit")])
