"""Influence functions on Kronecker-factored curvature (EK-FAC, K-FAC).

Layer 4 (beside ``optimizers`` and ``laplace``). Owns the fit of the
influence curvature (``_fit``), the per-example training gradients in
factored form (``_data``) and the scores (``_scores``). May import:
``factor``, ``blocks``, ``losses``, ``tagging``, ``estimators``.

Which training examples made the model say that (Koh & Liang 2017; Grosse
et al. 2023, "Studying Large Language Model Generalization with Influence
Functions"; kronfluence's API in JAX)::

    state = kfl.influence.fit(loss_fn, params, train_batches,
                              strategy="ekfac")
    scores = kfl.influence.pairwise_scores(state, params, queries,
                                           train_batches)   # [Q, N]
    self_inf = kfl.influence.self_scores(state, params, train_batches)

The layers are found in the traced loss (``kfl.tagging``: Flax, Haiku,
Equinox or plain JAX, no annotations); dense and conv layers are scored.
The conventions, and how they meet kronfluence's (benchmarks/
kronfluence_compare.py checks the agreement):

* per-example loss ``ℓ_t``: example ``t``'s share of the loss as written,
  in units of the batch's mean element weight, ``ℓ_t = Σ_{e∈t} (c_e/c̄)
  ℓ_e`` (``_data``; ``L = Σ_e c_e ℓ_e`` as in ``kfl.estimators``): for a
  mean, a sum, a sum over outputs then a mean over examples, a per-token
  mean and a masked mean, the sum of the example's unmasked loss elements
  (its outputs, its tokens; never divided by their number, as
  ``kfl.laplace``'s ``ℓ_n``). kronfluence asks for a summed loss, whose
  terms are the same ``ℓ_t``; scores, gradients and the curvature are
  those of ``ℓ_t`` (``s(t) = |∇ℓ_t|²`` for ``"identity"``);
* factors ``A`` and ``G`` are means over all ``N·R`` positions, as
  kronfluence's covariances; EK-FAC's eigenvalues a mean over the N
  examples of the squared rotated per-example gradients, as their lambda
  matrices;
* ``estimation="fisher"`` draws one target per example from the model
  (kronfluence's default, random on both sides, so not comparable draw
  for draw); ``"empirical"`` is their ``use_empirical_fisher=True``;
* damping: ``damping=`` absolute (kronfluence's ``damping_factor=x``), or
  ``damping_fraction · mean eigenvalue`` per layer when ``damping`` is
  None (their ``damping_factor=None``; fraction 0.1);
* sign: ``s(q, t) = ∇f_qᵀ (Ĝ + λI)⁻¹ ∇ℓ_t``, positive when training on
  ``t`` lowers ``f_q``.

References:
  Koh, P. W. and Liang, P. (2017). Understanding black-box predictions via
    influence functions. ICML. arXiv:1703.04730.
  George, T. et al. (2018). Fast approximate natural gradient descent in a
    Kronecker-factored eigenbasis. NeurIPS. arXiv:1806.03884.
  Grosse, R. et al. (2023). Studying large language model generalization
    with influence functions. arXiv:2308.03296.
"""
from kfac_jax_lite.influence._data import ESTIMATIONS as ESTIMATIONS
from kfac_jax_lite.influence._fit import STRATEGIES as STRATEGIES
from kfac_jax_lite.influence._fit import InfluenceState as InfluenceState
from kfac_jax_lite.influence._fit import fit as fit
from kfac_jax_lite.influence._scores import layer_damping as layer_damping
from kfac_jax_lite.influence._scores import (
    pairwise_scores as pairwise_scores)
from kfac_jax_lite.influence._scores import precondition as precondition
from kfac_jax_lite.influence._scores import self_scores as self_scores

__all__ = ["ESTIMATIONS", "InfluenceState", "STRATEGIES", "fit",
           "layer_damping", "pairwise_scores", "precondition", "self_scores"]
