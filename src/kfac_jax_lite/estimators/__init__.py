"""Curvature estimators: the loss, its gradient and every block's statistics
from one forward pass.

Layer 3. Owns the estimate (``_estimate``), the argument checks of the
estimation modes (``_checks``), the statistics share (``_fraction``), the
one-pass entry point ``value_grad_and_stats`` (``_onepass``), the first-step
check (``_first_step``), ``describe`` (``_describe``) with its step price
(``_cost``: the FLOP model of a K-FAC step), the progress bar of the
streamed fits (``_progress``) and the per-device statistics of
``value_grad_and_stats(mesh=)`` (``_devices``). May import:
``factor``, ``blocks``, ``losses``, ``tagging``.

Scale (one definition for every estimator, loss and reduction). For
``L = Σ_e c_e ℓ_e`` over the loss elements ``e`` of the registered losses
(and of those recognised in the jaxpr, which carry the same tag:
``kfl.tagging``) (an element is one value of the loss's output: an example, a token, an
output unit, a pixel; ``c_e`` is read from the backward pass to those
values), example ``i`` has weight ``c_i = Σ_{e ∈ i} c_e``. The statistics
are

    A = Σ_i w_i ā_i ā_iᵀ  (w_i = c_i / Σ_j c_j),
    G = Σ_i c_i E[h_i h_iᵀ] = Σ_e c_e J_eᵀ M_e J_e  (in expectation),

``J_e`` the Jacobian of element ``e``'s model outputs in the layer output,
``M_e`` the element's output Fisher (GGN for the ``_ggn`` modes), for a
layer used once per example (a shared layer's block sums or aggregates
over its positions, ``blocks.dense``). So
``A ⊗ G`` is the curvature of ``L`` as written: a mean over ``N``
examples has ``c_e = 1/N``, a sum ``c_e = 1``, a mean over ``N·T``
tokens (or pixels) ``c_e = 1/(N·T)``, a sum over ``C`` outputs then a mean
over examples ``c_e = 1/N``, a masked mean ``c_e = m_e / Σ m`` (masked
elements weigh 0; an example with none left is weightless). ``"fisher"``,
``"curvature_prop"`` and ``"exact"`` have that scale (the sampled ones in
expectation over their draws); ``"empirical"`` has it in expectation over
targets drawn from the registered loss's own distribution.

The cotangents ``h_i`` of the layer output are the backward pass of a
cotangent ``d_e`` put on the model outputs of each element:

    d_e = √(c_e / c_i) · u_e,   E[u_e u_eᵀ] = M_e,

with ``u_e`` by estimation mode:

* ``"fisher"`` — ``u = ∇_o ℓ(o, t̃)`` with ``t̃`` sampled from the model
  (``num_samples`` draws); ``M`` = the output Fisher. The elements of an
  example share one backward pass: their draws are independent and their
  scores zero-mean, so the cross terms vanish in expectation.
* ``"empirical"`` — ``"fisher"`` with the data's targets ``t`` in place of
  sampled ones: ``u = ∇_o ℓ(o, t)``. For one element per example this is
  the textbook empirical Fisher ``Σ_i c_i ∇ℓ_i ∇ℓ_iᵀ``; for ``k`` elements
  of equal weight per example it is ``k`` times that of the per-example
  mean ``ℓ_i = (1/k) Σ_{e∈i} ℓ_e``, which keeps the expectation above (the
  per-example gradient's outer product would be ``1/k`` of the Fisher).
  Without a registered or recognised loss there are no elements to see:
  the layer cotangents of ``L`` itself are used, assuming ``L`` is a mean
  over the batch (``c_i = 1/N``, ``h_i = N ∂L/∂y_i``, the gradient of
  example i's share of ``L`` times N; ``N`` the leading size of the batch
  leaves that hold examples, ``TaggedLoss.examples``), the per-example
  empirical Fisher: equal to a registered loss's for one element per
  example, ``1/k`` of it for ``k`` elements of equal weight. Fallback
  blocks then see ``√N ∇L`` (no per-example gradients: exact for one
  example).
* ``"empirical_shared"`` — ``"empirical"`` without its backward pass: the
  layer cotangents ``g_i`` of ``L`` itself, which the gradient's backward
  pass computes anyway, rescaled per example,

      h_i = g_i / √(Σ_{e∈i} c_e²),

  where ``g_i = Σ_{e∈i} c_e J_eᵀ ∇_o ℓ_e`` (its rows of ``∂L/∂y``). When
  the nonzero ``c_e`` of an example are equal (a mean, a sum, a binary
  mask: every standard reduction) this is ``"empirical"``'s
  ``Σ_e √(c_e/c_i) J_eᵀ ∇_o ℓ_e`` exactly, so the statistics are equal; with
  unequal weights within an example (a weighted per-token loss) ``G`` is
  ``Σ_i c_i/(Σ_{e∈i} c_e²) g_i g_iᵀ`` instead. It costs no backward pass
  beyond the gradient's, only the blocks' products (Kunstner et al. 2019:
  the empirical Fisher is biased away from the Fisher where the model fits
  the data poorly; measure before preferring it). A layer whose rows are
  not mapped to examples (``Layer.spread``) is scaled by the mean over the
  examples, exact when the examples weigh the same. Without a loss it is
  ``"empirical"``'s loss-free rule below, which is the same rule with
  ``c_i = 1/N``. Fallback blocks see ``√N ∇L``, as without a loss.
* ``"curvature_prop"`` — ``u = B r`` with ``B Bᵀ = M`` and Rademacher ``r``
  (Martens et al. 2012).
* ``"exact"`` — every column of ``B`` (one batched backward pass over the
  columns, ``vmap``-ed), so ``G`` is exact: ``Σ_k b_k b_kᵀ = M``.
* ``"curvature_prop_ggn"``, ``"exact_ggn"`` — the same with ``B`` a square
  root of the output Hessian (the generalized Gauss-Newton); it differs
  from the Fisher only for losses not in natural parameters.

Both backward passes (the gradient's and the statistics') reuse the
residuals of the single forward pass (one ``jax.vjp``). Fallback blocks
need parameter gradients rather than layer data (only when there are
fallbacks):

* in the sampled modes (``"fisher"``, ``"curvature_prop"``, and their
  ``_ggn`` variants) the parameter gradient of ``Σ_e √c_e u_e`` per sample
  (one more backward pass each): the examples' draws are independent and
  zero-mean, so its expected outer product is the curvature of ``L``;
* in ``"exact"``, ``"exact_ggn"`` and ``"empirical"`` (``PER_EXAMPLE_
  FALLBACKS``) the directions are not random, and one batch gradient's
  outer product would add cross-example terms ``J_iᵀ b_i b_jᵀ J_j``: each
  example's own gradient of its ``d`` is taken instead (``N`` backward
  passes per column or sample, ``vmap``-ed), so the block has the scale
  above over a batch.

Every quantity keeps the parameters' precision: ``c``, the square roots
and the cotangents are at least float32 and stay float64 under
``jax_enable_x64``.

References:
  Martens, J. and Grosse, R. (2015). Optimizing neural networks with
    Kronecker-factored approximate curvature. ICML. arXiv:1503.05671.
  Martens, J., Sutskever, I. and Swersky, K. (2012). Estimating the
    Hessian by back-propagating curvature. ICML. arXiv:1206.6464.
  Kunstner, F., Balles, L. and Hennig, P. (2019). Limitations of the
    empirical Fisher approximation for natural gradient descent. NeurIPS.
    arXiv:1905.12558.
  Eschenhagen, R., Immer, A., Turner, R. E., Schneider, F. and Hennig, P.
    (2023). Kronecker-factored approximate curvature for modern neural
    network architectures. NeurIPS. arXiv:2311.00636.
"""
from kfac_jax_lite.estimators._checks import ESTIMATIONS as ESTIMATIONS
from kfac_jax_lite.estimators._checks import (
    PER_EXAMPLE_FALLBACKS as PER_EXAMPLE_FALLBACKS)
from kfac_jax_lite.estimators._checks import (
    check_estimation as check_estimation)
from kfac_jax_lite.estimators._checks import (
    check_example_axis as check_example_axis)
from kfac_jax_lite.estimators._checks import check_has_loss as check_has_loss
from kfac_jax_lite.estimators._estimate import Estimate as Estimate
from kfac_jax_lite.estimators._estimate import estimate as estimate
from kfac_jax_lite.estimators._estimate import RUN_ENTRY as RUN_ENTRY
from kfac_jax_lite.estimators._estimate import split_run as split_run
from kfac_jax_lite.estimators._estimate import checked_loss as checked_loss
from kfac_jax_lite.estimators._estimate import (
    linearized_outputs as linearized_outputs)
from kfac_jax_lite.estimators._deferred import (
    DEFERRED_ENTRY as DEFERRED_ENTRY)
from kfac_jax_lite.estimators._deferred import Deferred as Deferred
from kfac_jax_lite.estimators._deferred import is_deferred as is_deferred
from kfac_jax_lite.estimators._deferred import materialise as materialise
from kfac_jax_lite.estimators._deferred import resolve as resolve
from kfac_jax_lite.estimators._fraction import (
    check_stats_fraction as check_stats_fraction)
from kfac_jax_lite.estimators._fraction import (
    stats_batch_size as stats_batch_size)
from kfac_jax_lite.estimators._fraction import stats_slice as stats_slice
from kfac_jax_lite.estimators._progress import progress as progress
# The per-device statistics (``value_grad_and_stats(mesh=)``), for kfl.kfac.
from kfac_jax_lite.estimators._devices import DEVICE_ENTRY as DEVICE_ENTRY
from kfac_jax_lite.estimators._devices import axis_is_bound as axis_is_bound
from kfac_jax_lite.estimators._devices import batch_specs as batch_specs
from kfac_jax_lite.estimators._devices import device_mean as device_mean
from kfac_jax_lite.estimators._devices import is_per_device as is_per_device
from kfac_jax_lite.estimators._devices import local as local_stats
from kfac_jax_lite.estimators._onepass import (
    value_grad_and_stats as value_grad_and_stats)
from kfac_jax_lite.estimators._first_step import (
    refusal as first_step_refusal)
from kfac_jax_lite.estimators._describe import Row as Row
from kfac_jax_lite.estimators._describe import Table as Table
from kfac_jax_lite.estimators._describe import describe as describe
# Bytes for a reader, shared with tx.init's memory check.
from kfac_jax_lite.estimators._describe import human_bytes as human_bytes
from kfac_jax_lite.estimators._describe import plan_for as plan_for
from kfac_jax_lite.estimators._plan import DEFAULT_BUDGET as DEFAULT_BUDGET
from kfac_jax_lite.estimators._plan import Plan as Plan

__all__ = ["ESTIMATIONS", "Estimate", "Row", "Table", "describe", "estimate",
           "linearized_outputs", "value_grad_and_stats"]
