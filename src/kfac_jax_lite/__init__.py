"""kfac_jax_lite: Kronecker-factored curvature for JAX, as pure functions.

The modules, each built on the ones before it (README.md gives the user's
view, ``docs/design.md`` the design brief: conventions and cost model):

* ``factor.py`` — the math core: ``FactorState`` and the pure functions on
  it (EMA covariances, damped powers, cached decompositions);
* ``blocks/`` — one curvature block per layer kind (Kronecker dense, conv,
  embedding; diagonal, full, ...), each owning its statistics;
* ``tagging/`` — finds the layers in a traced loss and rewrites it to
  expose their inputs and output cotangents;
* ``estimators.py`` — the loss, gradient and statistics from one forward
  pass (``value_grad_and_stats``);
* ``transform.py`` — ``kfac``, the preconditioner as an optax transform,
  and its named stages; ``optimizer.py`` — ``kfac_optimizer``, Martens &
  Grosse's optimizer with adaptive damping;
* ``laplace/`` — Laplace posteriors from the same curvature; ``health.py``
  — the health counters of a state.
"""
from kfac_jax_lite import blocks
from kfac_jax_lite.blocks import (
    DiagonalConv, DiagonalDense, Full, KroneckerConv, KroneckerDense,
    KroneckerEmbedding, KroneckerState, NaiveDiagonal, ScaleAndShift)
from kfac_jax_lite.distributions import PredictiveDistribution
from kfac_jax_lite.losses import (
    gaussian_nll, l2_loss, registered_loss, sigmoid_binary_cross_entropy,
    softmax_cross_entropy, softmax_cross_entropy_with_integer_labels,
    squared_error)
from kfac_jax_lite.estimators import ESTIMATIONS, Estimate, value_grad_and_stats
from kfac_jax_lite.optimizer import KfacOptimizerState, kfac_optimizer
from kfac_jax_lite.transform import KfacState, kfac
from kfac_jax_lite.tagging import Layer, TaggedLoss, describe, find_layers
from kfac_jax_lite.factor import (
    FactorCache, FactorState, damped_cholesky, damped_matpower, factor_value,
    init_factor, multiply, multiply_inverse, multiply_matpower, refresh_cache,
    update_cov)

__version__ = "0.1.0"

__all__ = [
    "DiagonalConv", "DiagonalDense", "FactorCache", "FactorState", "Full", "KroneckerConv",
    "KroneckerDense", "KroneckerEmbedding", "KroneckerState", "NaiveDiagonal",
    "ScaleAndShift", "blocks", "damped_cholesky", "damped_matpower",
    "factor_value", "init_factor", "multiply", "multiply_inverse",
    "multiply_matpower", "refresh_cache", "update_cov",
    "KfacOptimizerState", "kfac_optimizer", "KfacState", "kfac", "ESTIMATIONS", "Estimate", "value_grad_and_stats",
    "Layer", "TaggedLoss", "describe", "find_layers",
    "PredictiveDistribution", "gaussian_nll", "l2_loss", "registered_loss",
    "sigmoid_binary_cross_entropy", "softmax_cross_entropy",
    "softmax_cross_entropy_with_integer_labels", "squared_error",
]
from kfac_jax_lite.health import Health, health
__all__ += ["Health", "health"]
from kfac_jax_lite import laplace
