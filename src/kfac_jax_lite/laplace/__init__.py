"""The curvature as a Laplace posterior (MacKay 1992; Ritter et al. 2018;
Daxberger et al. 2021, laplace-torch's conventions).

Layer 4, beside the optimizers. Owns the posterior (``_posterior``), its
fit (``_fit``), linear algebra, evidence and predictive. May import:
``factor``, ``blocks``, ``losses``, ``tagging``, ``estimators``.

Around the MAP ``θ*`` of ``Σ_n ℓ_n(θ)`` (the data's negative
log-likelihood) with a prior ``N(0, diag(τ)⁻¹)``, the posterior is
approximated by ``N(θ*, P⁻¹)`` with the precision

    P = H + diag(τ),    H = Σ_n ∇²_θ ℓ_n  (GGN / Fisher, summed over the data)

with ``ℓ_n`` the sum of example n's loss elements (its outputs, tokens,
pixels; masked ones left out) whatever the loss reduces with: never
divided by their number (``fit``). ``τ`` is the *prior precision*: a
scalar, or one value per layer (a layer is one block of ``kfl.describe``:
a kernel with its bias, a norm's scale with its shift, a fallback group;
``post.layer_names`` gives their order).
``H`` has one of three structures: ``"kron"`` (K-FAC's ``A ⊗ G`` blocks),
``"diag"`` or ``"full"`` (one dense matrix, cross-layer terms included).

    post = kfl.laplace.fit(loss_fn, params, batches, structure="kron")
    tau = kfl.laplace.optimize_prior_precision(post)
    kfl.laplace.log_marginal_likelihood(post, tau)
    probs = kfl.laplace.predictive(post, apply_fn, x_test, tau)   # GLM, probit
    thetas = kfl.laplace.sample(post, key, tau, 100)

Parameters are indexed like ``jax.flatten_util.ravel_pytree(params)``
wherever a flat vector or matrix appears (``dense_precision``).

References:
  MacKay, D. J. C. (1992). A practical Bayesian framework for
    backpropagation networks. Neural Computation 4(3).
  Ritter, H., Botev, A. and Barber, D. (2018). A scalable Laplace
    approximation for neural networks. ICLR.
  Daxberger, E., Kristiadi, A., Immer, A., Eschenhagen, R., Bauer, M. and
    Hennig, P. (2021). Laplace redux: effortless Bayesian deep learning.
    NeurIPS. arXiv:2106.14806.
"""
from kfac_jax_lite.laplace._evidence import (
    log_marginal_likelihood, optimize_prior_precision)
from kfac_jax_lite.laplace._fit import STRUCTURES, fit
from kfac_jax_lite.laplace._linalg import dense_precision, logdet, sample
from kfac_jax_lite.laplace._posterior import Posterior
from kfac_jax_lite.laplace._predictive import glm_moments, predictive

__all__ = [
    "Posterior", "STRUCTURES", "dense_precision", "fit", "glm_moments",
    "log_marginal_likelihood", "logdet", "optimize_prior_precision",
    "predictive", "sample",
]
