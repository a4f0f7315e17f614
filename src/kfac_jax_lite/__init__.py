"""kfac_jax_lite: Kronecker-factored curvature for JAX, as pure functions.

The layers, each a folder that imports only the ones listed before it
(``tests/test_imports.py`` pins this; README.md gives the user's view,
``docs/design.md`` the design brief: conventions and cost model):

* ``factor/`` — the math core: ``FactorState`` and the pure functions on
  it (EMA covariances, damped powers, cached decompositions);
* ``blocks/`` — one curvature block per layer kind (Kronecker dense, conv,
  embedding; diagonal, full, EKFAC, series, ...), each owning its statistics;
  ``losses/`` — the registered losses and their predictive distributions;
* ``tagging/`` — finds the layers (and the loss) in a traced loss and
  rewrites it to expose their inputs and output cotangents; the block policy;
* ``estimators/`` — the loss, gradient and statistics from one forward pass
  (``value_grad_and_stats``), the argument checks, ``describe``;
* ``optimizers/`` — ``kfac`` (the preconditioner as an optax transform, its
  stages and safeguards), ``kfac_optimizer`` (Martens & Grosse's adaptive
  damping), ``eigen_adam`` (Adam in the factors' eigenbasis), ``stats_due``,
  the sharded layout (``kfl.sharding``, re-exported by ``sharding.py``) and
  ``health``; ``laplace/`` — Laplace posteriors from the same curvature.

The top level holds the user API only (``__all__``, pinned by a test). The
rest lives in the module that owns it: the factor functions in
``kfl.factor`` (``init_factor``, ``refresh_cache``, ...), the block types in
``kfl.blocks`` (``KroneckerDense``, ``Full``, ...), the detection results in
``kfl.tagging`` (``find_layers``, ``Layer``, ``TaggedLoss``).
"""
# Submodules users reach for (``kfl.factor.init_factor``, ``kfl.blocks.Full``).
from kfac_jax_lite import blocks as blocks
from kfac_jax_lite import estimators as estimators
from kfac_jax_lite import factor as factor
from kfac_jax_lite import influence as influence
from kfac_jax_lite import laplace as laplace
from kfac_jax_lite import losses as losses
from kfac_jax_lite import tagging as tagging
from kfac_jax_lite import sharding as sharding

# The user API.
from kfac_jax_lite.optimizers.transform import KfacState as KfacState
from kfac_jax_lite.optimizers.transform import kfac as kfac
from kfac_jax_lite.optimizers.options import (
    CurvatureOptions as CurvatureOptions)
from kfac_jax_lite.optimizers.options import (
    PreconditionerOptions as PreconditionerOptions)
from kfac_jax_lite.optimizers.eigen_adam import EigenAdamState as EigenAdamState
from kfac_jax_lite.optimizers.eigen_adam import eigen_adam as eigen_adam
from kfac_jax_lite.optimizers.optimizer import (
    KfacOptimizerState as KfacOptimizerState)
from kfac_jax_lite.optimizers.optimizer import kfac_optimizer as kfac_optimizer
from kfac_jax_lite.estimators import ESTIMATIONS as ESTIMATIONS
from kfac_jax_lite.estimators import Estimate as Estimate
from kfac_jax_lite.optimizers.onepass import stats_due as stats_due
from kfac_jax_lite.optimizers.pending import with_batch as with_batch
from kfac_jax_lite.optimizers.hyperparams import (
    inject_hyperparams as inject_hyperparams)
from kfac_jax_lite.optimizers.pending import with_stats as with_stats
from kfac_jax_lite.estimators import (
    value_grad_and_stats as value_grad_and_stats)
from kfac_jax_lite.estimators import describe as describe
from kfac_jax_lite.optimizers.health import Health as Health
from kfac_jax_lite.optimizers.health import health as health
from kfac_jax_lite.losses.distributions import (
    PredictiveDistribution as PredictiveDistribution)
from kfac_jax_lite.losses import gaussian_nll as gaussian_nll
from kfac_jax_lite.losses import l2_loss as l2_loss
from kfac_jax_lite.losses import registered_loss as registered_loss
from kfac_jax_lite.losses import (
    sigmoid_binary_cross_entropy as sigmoid_binary_cross_entropy)
from kfac_jax_lite.losses import softmax_cross_entropy as softmax_cross_entropy
from kfac_jax_lite.losses import (
    softmax_cross_entropy_with_integer_labels as
    softmax_cross_entropy_with_integer_labels)
from kfac_jax_lite.losses import squared_error as squared_error

# Low level, importable from the top package (docs/design.md).
from kfac_jax_lite.factor import FactorState as FactorState
from kfac_jax_lite.factor import damped_matpower as damped_matpower
from kfac_jax_lite.factor import multiply_inverse as multiply_inverse
from kfac_jax_lite.factor import update_cov as update_cov

__version__ = "0.1.0"

__all__ = [
    # optax transforms and their states
    "kfac", "KfacState", "kfac_optimizer", "KfacOptimizerState",
    "eigen_adam", "EigenAdamState",
    # the options they share, documented once
    "CurvatureOptions", "PreconditionerOptions",
    # one pass: loss, gradient and curvature statistics
    "value_grad_and_stats", "stats_due", "Estimate", "ESTIMATIONS",
    # training loops that pass no extra arguments (flax TrainState)
    "with_batch", "with_stats", "inject_hyperparams",
    # inspection
    "describe", "health", "Health",
    # registered losses
    "PredictiveDistribution", "gaussian_nll", "l2_loss", "registered_loss",
    "sigmoid_binary_cross_entropy", "softmax_cross_entropy",
    "softmax_cross_entropy_with_integer_labels", "squared_error",
    # low level (docs/design.md)
    "FactorState", "update_cov", "damped_matpower", "multiply_inverse",
    # submodules
    "blocks", "estimators", "factor", "influence", "laplace", "losses",
    "sharding", "tagging",
]
