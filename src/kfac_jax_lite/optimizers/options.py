"""The options records of the optimizers, each documented once here.

``CurvatureOptions``: how the curvature is estimated and kept (estimation,
sampling, EMA, amortisation, blocks, example axis, distribution), shared by
``kfl.kfac``, ``kfl.kfac_optimizer`` and ``kfl.eigen_adam``.
``PreconditionerOptions``: how ``kfl.kfac`` turns the factors into a
preconditioned update (damping, refresh, power, KL clip, layout), shared by
``kfl.kfac`` and ``kfl.kfac_optimizer``.

The public functions keep explicit, typed keyword arguments; each builds
its records from them and checks them (``check``) before any tracing.
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any, NamedTuple

import chex
import jax
import optax

from kfac_jax_lite import estimators
from kfac_jax_lite import factor as fac

# The defaults of ``kfl.kfac`` (README "Defaults" says why each one).
DEFAULT_DAMPING = 1e-3
"""``kfl.kfac``'s ``damping``: ``λ`` of ``(F + λI)⁻¹``."""
DEFAULT_NORM_CONSTRAINT = 1.0
"""``kfl.kfac``'s ``norm_constraint``: the KL clip's bound on ``⟨u, g⟩``."""


def _positive_int(value) -> bool:
  return (isinstance(value, int) and not isinstance(value, bool)
          and value >= 1)


class CurvatureOptions(NamedTuple):
  """How the curvature is estimated and kept: the options ``kfl.kfac``,
  ``kfl.kfac_optimizer`` and ``kfl.eigen_adam`` share (each takes them as
  keyword arguments of the same names and defaults).

  Attributes:
    estimation: where the statistics' output cotangents come from:
      ``"fisher"`` (targets sampled from the model: the true Fisher),
      ``"empirical"`` (``"fisher"`` at the data targets; any loss works),
      ``"empirical_shared"`` (``"empirical"`` from the gradient's own
      backward pass: no second backward pass; equal to ``"empirical"`` for
      a mean, sum or masked loss), ``"curvature_prop"`` (Rademacher
      projections of the output Fisher's square root), ``"exact"`` (all
      its columns), and ``"curvature_prop_ggn"``/``"exact_ggn"`` (the
      output Hessian's: the GGN); see ``kfl.estimators``. Every mode but
      the empirical ones needs a registered or recognised loss.
    num_samples: sampled targets (or projections) per example for the
      sampled modes; the statistics average them.
    cov_decay: ``β`` of the zero-debiased EMA ``C ← β C + (1-β) X`` of the
      factors.
    cov_every: statistics are computed and folded into the factors every
      ``cov_every`` updates (from update 0). With ``stats=`` they are used
      only on those updates: compute them only then with ``est_fn(...,
      with_stats=kfl.stats_due(state))``. None (``kfl.kfac``'s default):
      planned from the cost model within ``budget``
      (``PreconditionerOptions.budget``; ``kfl.describe`` prints the plan).
    stats_fraction: the share ``f`` in ``(0, 1]`` of each ``batch=`` the
      statistics are computed on (its first ``round(N·f)`` examples, at
      least 2; Martens & Grosse use 1/8). ``stats=`` are used as given: ask
      ``kfl.value_grad_and_stats(..., stats_fraction=f)`` for them.
    blocks: overrides of the curvature block per parameter path, pattern
      or layer kind (``"kronecker"``, ``"diagonal"``, ``"full"``,
      ``"naive_diagonal"``, ``"ekfac"``, ``"series1"``, ``"series2"``,
      ``"kron_indep"``, a dict of the default block's options, a block, or
      a callable ``f(layer) -> block``; see ``kfl.tagging.find_layers``).
    exclude: parameter paths (or patterns) left out of the curvature; their
      gradient passes through unchanged. A pattern that matches no
      parameter path is a ``ValueError`` naming the nearest paths.
    weight_sharing: for a layer applied over extra axes (sequence
      positions of a dense layer, output locations of a convolution):
      ``"expand"`` (the positions are examples; KFC for convolutions) or
      ``"reduce"`` (inputs averaged and cotangents summed over them first),
      as in Eschenhagen et al. 2023. ``kfl.describe`` shows each block's.
    example_axis: the batch leaves' example axis: None the leading one
      (``kfl.describe`` says when that is a guess), an int, or a pytree of
      the batch's structure with an int or None per leaf; 1 for time-major
      ``[T, B]`` data; needs ``stats_fraction=1`` unless 0.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    axis_name: the ``pmap``/``shard_map`` axis (or ``mesh`` axis) to
      average the statistics over and split the refreshes across; None
      outside such a map.
    seed: the seed of the PRNG key (in the state) of the sampled estimators
      under ``batch=``.
  """

  estimation: str = "fisher"
  num_samples: int = 1
  cov_decay: float = 0.95
  cov_every: int | None = None
  stats_fraction: float = 1.0
  blocks: Mapping[str, Any] | None = None
  exclude: Sequence[str] = ()
  weight_sharing: str = "expand"
  example_axis: chex.ArrayTree | None = None
  has_aux: bool = False
  axis_name: Hashable | None = None
  seed: int = 0

  def check(self, example_batch, where: str) -> None:
    """Raises a ``ValueError`` naming ``where`` (``"kfac"``, ...) for an
    option out of its range or one that does not fit ``example_batch``."""
    estimators.check_estimation(self.estimation, self.num_samples)
    estimators.check_stats_fraction(self.stats_fraction)
    if self.cov_every is not None and not _positive_int(self.cov_every):
      raise ValueError(f"{where}: cov_every must be a positive int (or None: "
                       f"planned), got {self.cov_every!r}")
    if not 0 <= self.cov_decay < 1:
      raise ValueError(f"{where}: cov_decay must be in [0, 1), got "
                       f"{self.cov_decay!r}")
    estimators.stats_batch_size(example_batch, self.stats_fraction,
                                f"{where}(example_batch)")
    estimators.check_example_axis(self.example_axis, example_batch,
                                  self.stats_fraction, where)


class PreconditionerOptions(NamedTuple):
  """How ``kfl.kfac`` turns the factors into a preconditioned update
  (``kfl.kfac_optimizer`` takes the same, but adapts ``damping`` itself and
  has no KL clip by default).

  Attributes:
    damping: ``λ`` of ``(F + λI)^p``, a positive float or an optax schedule
      of the step count; ``update(..., damping=λ)`` overrides it for that
      call. In π mode (and for diagonal blocks) ``λ`` is baked into the
      cached inverses at each refresh, so a new per-call or scheduled ``λ``
      reaches the preconditioner at the next refresh; ``damping_mode=
      "exact"`` uses the ``λ`` of every call.
    inverse_every: the caches are refreshed every ``inverse_every`` steps,
      and at steps 1, 2, 4, 8, ... below it. None (``kfl.kfac``'s default):
      planned from the cost model within ``budget``.
    budget: what ``kfl.kfac`` may spend, as its mean step over a refresh
      period in SGD steps of the model's FLOPs (``kfl.estimators``'
      ``_cost``), when it plans ``cov_every`` and ``inverse_every`` (those
      left None): the smallest refresh interval of (10, 20, 50, 100), then
      the most frequent statistics, whose predicted price fits
      (``kfl.describe``'s plan line gives the choice, the price, the
      every-step price and the floor: the preconditioning, paid every step).
      A larger budget buys statistics every step back; given intervals win.
      None (``kfl.kfac_optimizer``'s default): the floor plus 0.3, the
      statistics and the refresh priced on top of the work paid every step
      (for ``kfac_optimizer``, its quadratic model too).
    damping_mode: ``"pi"`` (factored Tikhonov: ``A + π√λ I`` and
      ``G + √λ/π I``, ``π = √((tr A/dim A)/(tr G/dim G))``; the cache holds
      the damped inverses) or ``"exact"`` (``(A⊗G + λI)^p`` through the
      eigendecompositions of ``A`` and ``G``; the cache holds them).
    precon_power: ``p``: -1 the natural gradient, -0.5 a square-root
      preconditioner; other powers than -1 use eigendecompositions.
    norm_constraint: KL clipping: the update ``u`` is scaled by
      ``min(1, √(norm_constraint / ⟨u, g⟩))``; None turns it off.
    inverse_method: how a refresh computes the π-damped inverses
      ``(C + d·I)⁻¹`` (``precon_power=-1``): ``"auto"`` (``"gauss_jordan"``
      on CPU, ``"cholesky"`` elsewhere: ``kfl.factor.AUTO_METHODS``) or a
      name of ``kfl.factor.INVERSES``. Other powers and
      ``damping_mode="exact"`` use eigendecompositions.
    layout: where the curvature lives across the devices of ``axis_name``:
      ``"replicated"`` (every device keeps every block; statistics
      all-reduced, refreshes split and their caches all-reduced) or
      ``"sharded"`` (``kfl.sharding``: each block kept by one owner device,
      statistics reduce-scattered to it, the owners' preconditioned
      gradients all-gathered; state bytes per device about ``1/D``). None:
      ``"sharded"`` with a ``mesh``, else ``"replicated"``. ``"sharded"``
      needs ``axis_name``; its ``init`` runs inside the ``pmap``/
      ``shard_map`` (or anywhere with a ``mesh``).
    mesh: a ``jax.sharding.Mesh`` with the axis ``axis_name``, for use
      under plain ``jax.jit``: ``update`` (called outside any map) runs its
      work in a ``shard_map`` over that axis (batch leaves split along
      their example axis; gradients, params and ``stats=`` taken as the
      same on every device) and ``init`` places the sharded curvature on
      the mesh. Inside your own ``shard_map`` the mesh is not used.
    gather: in the sharded layout, what crosses the devices after the
      owners' work: ``"updates"`` (each owner preconditions its blocks'
      gradient and the pieces are all-gathered every step: bytes of the
      parameters) or ``"inverses"`` (after a refresh the owners' caches are
      all-gathered and kept on every device, which preconditions every
      block itself: no per-step traffic beyond the statistics, at the
      memory of all caches on every device).
  """

  damping: float | optax.Schedule = DEFAULT_DAMPING
  inverse_every: int | None = None
  budget: float | None = estimators.DEFAULT_BUDGET
  damping_mode: str = "pi"
  precon_power: float = -1.0
  norm_constraint: float | None = DEFAULT_NORM_CONSTRAINT
  inverse_method: str = "auto"
  layout: str | None = None
  mesh: Any = None
  gather: str = "updates"

  def check(self) -> None:
    """Raises a ``ValueError`` for an option out of its range."""
    fac.check_inverse_method(self.inverse_method)
    if self.inverse_every is not None and not _positive_int(
        self.inverse_every):
      raise ValueError(f"inverse_every must be a positive int (or None: "
                       f"planned), got {self.inverse_every!r}")
    if self.budget is not None and not (
        isinstance(self.budget, (int, float))
        and not isinstance(self.budget, bool) and 1 < self.budget < 1e9):
      raise ValueError(f"budget must be a number above 1 (the planned step "
                       f"in SGD steps) or None, got {self.budget!r}")
    if (self.norm_constraint is not None
        and not isinstance(self.norm_constraint, jax.Array)
        and not self.norm_constraint > 0):  # An array: kfl.inject_hyperparams.
      raise ValueError(f"norm_constraint must be positive (or None), got "
                       f"{self.norm_constraint!r}")
    check_damping(self.damping)


def check_damping(damping, where="kfac"):
  """A constant damping must be a positive finite number; a schedule is
  checked at step 0 when it can be evaluated there (a traced value at run
  time: the update is then skipped and counted)."""
  value: Any = damping  # A number, an array or a tracer: float() decides.
  if callable(damping):
    try:
      value = damping(0)
    except Exception:  # A schedule that cannot run eagerly: checked at run time.
      return
  try:
    value = float(value)
  except (TypeError, jax.errors.ConcretizationTypeError):
    return  # Traced: checked at run time (the update is skipped and counted).
  if not (value > 0 and value < float("inf")):
    at_zero = " (the schedule at step 0)" if callable(damping) else ""
    raise ValueError(f"{where}: damping must be positive and finite, got "
                     f"{value!r}{at_zero}")


def split(options: Mapping[str, Any], where: str
          ) -> tuple[CurvatureOptions, PreconditionerOptions]:
  """``{option: value}`` (keyword arguments of ``kfl.kfac``) as the two
  records, the defaults elsewhere; a ``TypeError`` naming ``where`` for a
  name that is neither's field."""
  unknown = sorted(set(options) - set(CurvatureOptions._fields)
                   - set(PreconditionerOptions._fields))
  if unknown:
    raise TypeError(f"{where}() got unexpected keyword arguments {unknown}")
  return (CurvatureOptions(**{k: v for k, v in options.items()
                              if k in CurvatureOptions._fields}),
          PreconditionerOptions(**{k: v for k, v in options.items()
                                   if k in PreconditionerOptions._fields}))
