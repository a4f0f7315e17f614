"""``kfl.eigen_adam``: Adam in the eigenbasis of K-FAC's Kronecker factors.

    tx = optax.chain(kfl.eigen_adam(loss_fn, example_batch),
                     optax.scale_by_learning_rate(lr))
    updates, state = tx.update(grads, state, params, batch=batch)

SOAP (Vyas et al. 2024) runs Adam in the eigenbasis of Shampoo's
preconditioner; EKFAC (George et al. 2018) rescales K-FAC's eigenbasis by
second moments measured there. This transform runs Adam in the second's
basis: for every layer with a Kronecker block (dense, conv, embedding), its
parameters as the block's ``[groups, a, b]`` matrices ``M`` (rows the inputs
and the bias, columns the outputs; ``blocks._layout``), with
``A = Q_A Λ_A Q_Aᵀ`` and ``G = Q_G Λ_G Q_Gᵀ`` the factors' eigenbases:

    g̃ = Q_Aᵀ M Q_G                                  (rotate in)
    m ← b1·m + (1−b1)·g̃,   v ← b2·v + (1−b2)·g̃²     (Adam's moments, there)
    u = Q_A (m̂ / (√(v̂ + eps_root) + eps)) Q_Gᵀ        (rotate back)

with ``m̂ = m/(1−b1ᵗ)``, ``v̂ = v/(1−b2ᵗ)`` as in ``optax.scale_by_adam``
(same order of operations: with identity bases this *is* ``optax.adam``'s
scaling). An embedding's input factor is diagonal: its basis is the
identity (only ``Q_G`` rotates). A layer stacked under ``lax.scan`` has
one basis and one pair of moments per slice. Every other parameter
(scale/shift, fallbacks, excluded leaves, blocks overridden to
non-Kronecker ones) gets plain Adam with the same ``b1``, ``b2``, ``eps``.

Bases (``basis``):

* ``"kfac"`` — ``A``, ``G`` are K-FAC's factors, estimated exactly as
  ``kfl.kfac`` does it (its tagging, its ``statistics`` and ``accumulate``
  stages: ``estimation``, ``stats_fraction``, ``cov_decay``); ``update``
  needs ``batch=`` or ``stats=`` like ``kfl.kfac``.
* ``"shampoo"`` — SOAP's: ``A`` the EMA of ``M Mᵀ`` and ``G`` the EMA of
  ``Mᵀ M`` of the mini-batch gradient matrix (same ``cov_decay``); no
  ``batch=`` is needed. (The loss is still traced once, at ``init``, to find
  the layers.) In SOAP's order: each step runs Adam in the bases of the
  *earlier* gradients, then folds its gradient into the factors and
  refreshes; the first step only starts the bases (its update is zero,
  and Adam's ``t`` counts from the second step). A gradient rotated into
  its own factors' basis is that matrix's SVD, diagonal up to rounding,
  whose noise Adam would blow up to steps of about ``±1`` (SOAP:
  "so that we never use the current gradients in the projection").

Refresh (``refresh_every``, ``refresh``): the bases are recomputed every
``refresh_every`` steps (counts ``refresh_every, 2·refresh_every, ...``),
and a layer without a basis yet gets one at the first update whose factors
have statistics (step 0); under ``"kfac"`` before that step's Adam (step 0
already runs in the basis of its own statistics, as ``kfl.kfac``
preconditions with them), under ``"shampoo"`` after it. ``refresh="eigh"`` decomposes each factor exactly;
``refresh="power"`` warm-starts from the previous basis as SOAP does: one
power-iteration step ``C Q_old`` and a QR (``Q_new = qr(C Q_old).Q``, the
columns taken in decreasing order of ``diag(Q_oldᵀ C Q_old)`` and put
back in their old order afterwards, their signs chosen so that
``diag(R) ≥ 0``: a basis that is already exact maps to itself). The
first basis of a layer is always an ``eigh``.
``benchmarks/eigenbasis_refresh.py`` measures how far ``"power"`` stays
from ``"eigh"`` over refreshes (on a digits autoencoder, 4-9% of K-FAC's
factors off the diagonal of ``QᵀCQ`` against 63% for a basis never
refreshed; 0.1-0.4% of Shampoo's).

Moments at a refresh (``R_A = Q_A,oldᵀ Q_A,new``, ``R_G`` likewise): the
first moment is a vector in the basis, so it is carried over exactly,
``m ← R_Aᵀ m R_G`` (SOAP does this too); the update it gives in parameter
space is unchanged. The second moment ``v`` is the diagonal of a second-
moment matrix ``(Q_A ⊗ Q_G) diag(v) (Q_A ⊗ Q_G)ᵀ`` whose off-diagonal part
Adam never kept, so no rotation maps it exactly. Two rules:

* ``nu_rebase="keep"`` (default; SOAP's): ``v`` stays where it is, column
  by column. ``eigh`` sorts the eigenvalues and ``"power"`` keeps each
  column's place, so column ``j`` stays the ``j``-th eigendirection by
  size and its ``v`` the second moment measured at that rank. The new
  basis diagonalises the *new* factors, and the factors are second
  moments of the gradient's pieces (K-FAC: ``E[g̃_ij²] ≈ λ_A,i λ_G,j`` in
  their eigenbasis), so the gradient's second moment is near diagonal in
  the new basis with values ordered like its eigenvalues: the old value at
  the same rank estimates it.
* ``nu_rebase="project"``: the diagonal in the new basis of the old
  matrix, ``v ← (R_A∘R_A)ᵀ v (R_G∘R_G)`` (elementwise squares of the
  rotations; the rule ``blocks.ekfac`` uses for its eigenvalues): linear
  (the bias correction stays valid), ``v ≥ 0``, ``Σ v`` kept, and exact
  for the old model: a refresh that only permutes or flips the columns
  changes nothing. It averages ``v`` over the old directions each new
  one draws on, the old diagonal model's view rather than the new basis's.

Measured (``benchmarks/eigenbasis_refresh.py --rules``: 300 steps of its
digits autoencoder, 3 seeds, lr 3e-3 and 1e-2, both refresh methods, K-FAC
basis; ``results/eigen_adam_rules.txt``): ``"keep"`` ended lower in loss
than ``"project"`` in every run (by 4-6% at lr 3e-3, 2% at 1e-2), hence
the default. Steps, not wall-clock: that comparison is not made yet.

State (``EigenAdamState``): the step count, whether the next update folds
in statistics (``kfl.stats_due`` reads it), the sampling key, per rotated
layer its Kronecker block state (``A``, ``G`` as ``FactorState``s whose
``"eigh"`` caches hold the bases: ``cache.eigvecs`` ``Q``, ``cache.step``
the step of their last refresh, ``-1`` before the first) and its moments
in the basis, and plain Adam's moments of the other leaves (rotated
leaves hold an empty array there). A plain pytree: it checkpoints and
restores like any other.

Cost per update, beyond Adam's: the rotations, ``4ab(a + b)`` FLOPs for a
layer's ``a x b`` matrix against ``6Nab`` for its share of the forward and
backward pass at batch ``N`` (``2(a + b)/(3N)`` of the step: 1.06x on the
MNIST autoencoder at batch 1000, negligible when ``N`` counts tokens); the
statistics (``"kfac"``: a sampled backward pass and ``Xᵀ X``, ``Gᵀ G``;
``"shampoo"``: ``M Mᵀ``, ``Mᵀ M``), paid once in ``cov_every`` updates; the
decompositions, once in ``refresh_every`` (measured:
``benchmarks/eigen_adam_step.py``).

Not done here: no damping (Adam's ``eps`` plays its role), no KL clipping.
Guarded as ``kfl.kfac`` (``_eigen_guard``): a non-finite gradient, loss or
update, or a label outside ``[0, classes)``, skips the update (moments and
factors kept) and is counted; ``kfl.health`` reads the state. Factor
statistics that are not finite are skipped as in ``kfl.kfac``, and a
decomposition that is not finite keeps the previous basis.
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
import functools
from typing import Any, Callable, NamedTuple

import chex

import jax
import jax.numpy as jnp
import optax

from kfac_jax_lite import blocks as B
from kfac_jax_lite import estimators
from kfac_jax_lite.factor import float_dtype
from kfac_jax_lite.optimizers import _eigen_guard
from kfac_jax_lite.optimizers import _eigen_step as S
from kfac_jax_lite.optimizers import _find
from kfac_jax_lite.optimizers import _memory
from kfac_jax_lite.optimizers import _pending
from kfac_jax_lite.optimizers import _planning
from kfac_jax_lite.optimizers import options as O
from kfac_jax_lite.optimizers import transform

BASES = ("kfac", "shampoo")
REFRESHES = ("eigh", "power")
NU_REBASES = ("project", "keep")


class EigenAdamState(NamedTuple):
  """The state of ``kfl.eigen_adam`` (a plain pytree; see the module
  docstring): the factors whose caches hold the bases, Adam's moments in
  the bases for the rotated layers and plainly for the other leaves."""

  count: Any  # int32: updates so far.
  stats_due: Any  # int32: 1 when the next update folds in statistics.
  key: Any  # PRNG key for the sampled estimators (basis="kfac", batch=).
  blocks: dict  # rotated layer -> KroneckerState; caches: bases Q.
  mu_basis: dict  # rotated layer -> first moment m [groups, a, b], in its basis.
  nu_basis: dict  # rotated layer -> second moment v [groups, a, b], in its basis.
  mu: tuple  # per parameter leaf: plain Adam's m (shape (1,) if rotated:
  # a placeholder; never zero-size, which orbax cannot save).
  nu: tuple  # per parameter leaf: plain Adam's v (shape (1,) if rotated).
  # The guard's counters and health summaries (``_eigen_guard``).
  num_bad_grads: Any = None  # int32: skipped for a non-finite gradient.
  num_bad_updates: Any = None  # int32: skipped for a non-finite update.
  num_nonfinite_params: Any = None  # int32: called with non-finite params.
  health: Any = None  # _health_state.HealthState, as in KfacState.
  # The stored batch/statistics slot (kfl.with_batch/with_stats; zeros of
  # the example batch's from init): _pending.Pending.
  pending: Any = None


def _check(name, value, allowed):
  if value not in allowed:
    raise ValueError(f"eigen_adam: {name} must be one of {allowed}, got "
                     f"{value!r}")


def eigen_adam(loss_fn: Callable, example_batch: chex.ArrayTree, *,
               b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
               eps_root: float = 0.0, basis: str = "kfac",
               refresh: str = "eigh", refresh_every: int | None = 10,
               nu_rebase: str = "keep", cov_decay: float = 0.95,
               cov_every: int | None = 1, budget: float | None = None,
               estimation: str = "fisher", num_samples: int = 1,
               stats_fraction: float = 1.0,
               blocks: Mapping[str, Any] | None = None,
               exclude: Sequence[str] = (), weight_sharing: str = "expand",
               axis_name: Hashable | None = None, has_aux: bool = False,
               seed: int = 0, example_axis: chex.ArrayTree | None = None
               ) -> optax.GradientTransformationExtraArgs:
  """Adam in the eigenbasis of each layer's Kronecker factors (module
  docstring); chain it with ``optax.scale_by_learning_rate(lr)``.

  Its price. With ``basis="kfac"`` a step does the work that
  ``kfl.describe(loss_fn, params, batch, optimizer="eigen_adam",
  cov_every=cov_every, inverse_every=refresh_every)`` prices (K-FAC's
  statistics, the gradient rotated into the eigenbases and back, an
  ``eigh`` of every factor per refresh): ~2.60x an SGD step on the MNIST
  autoencoder at ``cov_every=5, refresh_every=10``, where its median step
  was 2.93x SGD's (``benchmarks/results/autoencoder.txt``). Given
  ``cov_every=None`` or ``refresh_every=None`` it plans them as
  ``kfl.kfac`` does (``kfl.describe(..., optimizer="eigen_adam")`` prints
  the plan): the rotations are paid every step, like ``kfl.kfac``'s
  preconditioning, and the default ``budget`` is that floor plus 0.3 SGD
  steps for the statistics and the decompositions. The defaults
  (statistics every step, bases every 10) are not planned: the plan's
  bases every 20 steps on the autoencoder never reached Adam's loss in
  60 s where ``cov_every=5`` did (``docs/guide.md``). The Shampoo
  basis' statistics (the gradient's own products) are not priced, so
  ``basis="shampoo"`` takes its intervals as given.

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss`` (``(loss, aux)`` with
      ``has_aux``), traced at ``init`` to find the layers (as ``kfl.kfac``).
    example_batch: a batch (arrays or ``jax.ShapeDtypeStruct``s), only
      traced.
    b1: Adam's first-moment decay, as in ``optax.scale_by_adam``.
    b2: Adam's second-moment decay, as in ``optax.scale_by_adam``.
    eps: added to the root of the second moment, as in
      ``optax.scale_by_adam``.
    eps_root: added to the second moment inside the root, as in
      ``optax.scale_by_adam``.
    basis: ``"kfac"`` (eigenbases of K-FAC's ``A`` and ``G``) or
      ``"shampoo"`` (of the EMAs of ``M Mᵀ`` and ``Mᵀ M`` of the gradient
      matrix: SOAP).
    refresh: ``"eigh"`` (exact) or ``"power"`` (one warm-started power
      step and a QR from the previous basis).
    refresh_every: the bases are recomputed at the counts that are
      multiples of it (and a layer's first basis at its first statistics);
      None: planned within ``budget`` (``basis="kfac"``).
    nu_rebase: what happens to the second moment at a refresh:
      ``"keep"`` (SOAP's; it stays with its column) or ``"project"`` (the
      diagonal of its matrix in the new basis); the first moment is always
      rotated.
    estimation: ``kfl.CurvatureOptions.estimation`` (``basis="kfac"``).
    num_samples: ``kfl.CurvatureOptions.num_samples``.
    cov_decay: ``kfl.CurvatureOptions.cov_decay``.
    cov_every: ``kfl.CurvatureOptions.cov_every``; here it also spares
      ``"shampoo"``'s statistics, and with ``"kfac"`` the sampled pass and
      the factors' products are paid once in ``cov_every`` updates; None:
      planned within ``budget`` (``basis="kfac"``).
    budget: for an interval given as None, the planned mean step in SGD
      steps of the model's FLOPs; None: the rotations' floor plus 0.3
      (``kfl.describe(..., optimizer="eigen_adam")`` prints both).
    stats_fraction: ``kfl.CurvatureOptions.stats_fraction``.
    blocks: ``kfl.CurvatureOptions.blocks``; a layer whose block is not
      Kronecker gets plain Adam.
    exclude: ``kfl.CurvatureOptions.exclude``.
    weight_sharing: ``kfl.CurvatureOptions.weight_sharing``.
    axis_name: ``kfl.CurvatureOptions.axis_name``; with ``"shampoo"`` the
      gradients its statistics are formed from are averaged too.
    has_aux: ``kfl.CurvatureOptions.has_aux``.
    example_axis: ``kfl.CurvatureOptions.example_axis``.
    seed: ``kfl.CurvatureOptions.seed``.

  Returns:
    An ``optax.GradientTransformationExtraArgs``: ``init(params)`` and
    ``update(grads, state, params, *, batch=None, stats=None, loss=None)``
    (``basis="kfac"`` needs ``batch=`` or ``stats=``, an
    ``Estimate.stats`` of ``kfl.value_grad_and_stats``). The loss the
    guard and ``kfl.health`` read is ``loss=``, else the run entry of
    ``stats=``, else (with ``batch=``, on the statistics steps: every
    ``cov_every``) the loss on ``batch=``, whose labels are checked too
    (``"kfac"``: its statistics pass; ``"shampoo"``: a forward pass of its
    own); other keyword arguments are
    accepted and not used.

  References:
    George, T., Laurent, C., Bouthillier, X., Ballas, N. and Vincent, P.
      (2018). Fast approximate natural gradient descent in a Kronecker-factored
      eigenbasis. NeurIPS. arXiv:1806.03884.
    Vyas, N., Morwani, D., Zhao, R., Kwun, M., Shapira, I., Brandfonbrener,
      D., Janson, L. and Kakade, S. (2024). SOAP: Improving and stabilizing
      Shampoo using Adam. arXiv:2409.11321.
  """
  adam = AdamOptions(b1=b1, b2=b2, eps=eps, eps_root=eps_root, basis=basis,
                     refresh=refresh, refresh_every=refresh_every,
                     nu_rebase=nu_rebase)
  adam.check()
  if basis == "shampoo" and (cov_every is None or refresh_every is None):
    raise ValueError("eigen_adam(basis='shampoo'): cov_every and "
                     "refresh_every must be positive ints (the Shampoo "
                     "basis' statistics are not priced, so not planned), "
                     "got None")
  shared = O.CurvatureOptions(
      estimation=estimation, num_samples=num_samples, cov_decay=cov_decay,
      cov_every=cov_every, stats_fraction=stats_fraction, blocks=blocks,
      exclude=exclude, weight_sharing=weight_sharing,
      example_axis=example_axis, has_aux=has_aux, axis_name=axis_name,
      seed=seed)
  # kfl.kfac's tagging and block choice; "exact" damping gives Kronecker
  # blocks "eigh" caches, where the bases are kept. Its update is not used.
  # Its plan is kfl.kfac's with exact damping's pricing (K-FAC's
  # statistics, the rotations every step, an eigh per refresh), the bases'
  # refresh_every in the place of inverse_every.
  priced = O.PreconditionerOptions(damping_mode="exact", budget=budget,
                                   inverse_every=refresh_every)
  layers = transform.build(loss_fn, example_batch, shared, priced,
                           where="eigen_adam").layers  # (Options checked.)
  cfg = _EigenAdam(adam, shared, layers, example_batch,
                   _planning.plan_of(layers, example_batch, shared, priced))
  return optax.GradientTransformationExtraArgs(
      functools.partial(_init, cfg), functools.partial(_update, cfg))


class AdamOptions(NamedTuple):
  """``eigen_adam``'s own options (its Args): Adam's and the bases'."""

  b1: float
  b2: float
  eps: float
  eps_root: float
  basis: str
  refresh: str
  refresh_every: int | None  # None: planned (_planned)
  nu_rebase: str

  def check(self) -> None:
    """A ``ValueError`` for an option out of its range."""
    _check("basis", self.basis, BASES)
    _check("refresh", self.refresh, REFRESHES)
    _check("nu_rebase", self.nu_rebase, NU_REBASES)
    value = self.refresh_every
    if value is not None and not (isinstance(value, int)
                                  and not isinstance(value, bool)
                                  and value >= 1):
      raise ValueError(f"eigen_adam: refresh_every must be a positive int, "
                       f"got {value!r}")


class _EigenAdam(NamedTuple):
  """What one ``eigen_adam`` fixes when built."""

  adam: AdamOptions
  curvature: O.CurvatureOptions
  layers: Callable  # kfl.kfac's detection: (params, batch=None) -> tagged.
  example_batch: Any  # The stored batch slot's shapes (_pending.empty).
  plan: Callable  # params -> estimators.Plan (_planning.plan_of)


def _planned(cfg: _EigenAdam, params) -> _EigenAdam:
  """``cfg`` with ``cov_every`` and ``refresh_every`` as planned for
  ``params`` (those given kept)."""
  c, a = cfg.curvature, cfg.adam
  if c.cov_every is not None and a.refresh_every is not None:
    return cfg
  chosen = cfg.plan(params)
  return cfg._replace(curvature=c._replace(cov_every=chosen.cov_every),
                      adam=a._replace(refresh_every=chosen.inverse_every))


def _init(cfg: _EigenAdam, params) -> EigenAdamState:
  params = _find.unwrap(params)  # nnx.Optimizer inits on Variables.
  _find.check_unmasked(params, "kfl.eigen_adam")
  _find.check_not_in_multisteps("kfl.eigen_adam")
  tagged = cfg.layers(params)
  if cfg.adam.basis == "kfac":
    estimators.check_has_loss(tagged, cfg.curvature.estimation,
                              "kfl.eigen_adam")
  leaves = jax.tree.leaves(params)
  layers = S.rotated(tagged)
  # The factors, and Adam's two moments and the stored batch's slot.
  _memory.check_fits(layers, params, "kfl.eigen_adam",
                     extra=(params, params, cfg.example_batch))
  covered = {i for l in layers for i in l.leaves}
  states = {l.name: l.block.init(float_dtype(
      [leaves[i] for i in l.leaves])) for l in layers}

  def moment(l):
    lay = S.inner_block(l.block).layout
    stack = (l.block.n,) if isinstance(l.block, B.Stacked) else ()
    return jnp.zeros(stack + (lay.groups, lay.a, lay.b),
                     states[l.name].g.cov.dtype)
  plain = lambda: tuple(jnp.zeros((1,), x.dtype) if i in covered
                        else jnp.zeros_like(x) for i, x in enumerate(leaves))
  return EigenAdamState(
      count=jnp.zeros((), jnp.int32), stats_due=jnp.ones((), jnp.int32),
      key=jax.random.PRNGKey(cfg.curvature.seed),
      blocks=states, mu_basis={l.name: moment(l) for l in layers},
      nu_basis={l.name: moment(l) for l in layers}, mu=plain(), nu=plain(),
      **_eigen_guard.init(params),
      pending=_pending.empty(cfg.example_batch, float_dtype(leaves)))


def _update(cfg: _EigenAdam, updates, state, params=None, *, batch=None,
            stats=None, loss=None, **extra_args):
  """``update`` (``eigen_adam``'s Returns): ``"kfac"`` folds this step's
  statistics and refreshes the bases before Adam's step; ``"shampoo"``
  (SOAP) steps in the bases of the earlier gradients, then folds this one
  in (the first step only starts them)."""
  del extra_args
  grads = updates  # Their structure (flax wrappers included) comes back.
  params, updates = _find.unwrap_update(params, updates, "kfl.eigen_adam")
  out, state = _pending.stored(
      lambda state, batch, stats, loss: _given(
          cfg, updates, state, params, batch=batch, stats=stats, loss=loss),
      state, batch, stats, loss,
      needs="one" if cfg.adam.basis == "kfac" else None)
  return _find.rewrap(grads, out), state


def _given(cfg: _EigenAdam, updates, state, params, *, batch, stats, loss):
  """``update`` on the unwrapped gradients and params, with the batch or
  statistics given or stored (``_pending.stored``)."""
  cfg = _planned(cfg, params)
  stats, run = estimators.split_run(estimators.device_mean(stats))
  if loss is None and run is not None:
    loss = run["loss"]
  s = S.step_of(cfg, updates, state, params, batch, stats)
  treedef = jax.tree.structure(updates)
  count_inc = optax.safe_increment(state.count)
  if cfg.adam.basis == "kfac":  # This step's statistics, then its basis.
    folded, own = S.fold_due(cfg, s, state.blocks)
    states, mu_b, nu_b = S.refresh_due(cfg, s, folded, state.mu_basis,
                                      state.nu_basis)
    out, mu_b, nu_b, mu, nu = S.adam_step(cfg, s, state, states, mu_b, nu_b,
                                         count_inc)
  else:
    first = state.count == 0
    out, *moments = S.adam_step(cfg, s, state, state.blocks, state.mu_basis,
                               state.nu_basis, jnp.maximum(state.count, 1))
    out = [jnp.where(first, jnp.zeros_like(u), u) for u in out]
    mu_b, nu_b, mu, nu = jax.tree.map(
        lambda new, old: jnp.where(first, old, new), tuple(moments),
        (state.mu_basis, state.nu_basis, state.mu, state.nu))
    folded, own = S.fold_due(cfg, s, state.blocks)
    states, mu_b, nu_b = S.refresh_due(cfg, s, folded, mu_b, nu_b)
  new_state = EigenAdamState(
      count=count_inc,
      stats_due=(jnp.mod(count_inc, S.cov_every(cfg)) == 0
                 ).astype(jnp.int32),
      key=jax.random.split(state.key)[0], blocks=states, mu_basis=mu_b,
      nu_basis=nu_b, mu=tuple(mu), nu=tuple(nu), pending=state.pending)
  bad = None if run is None else run["bad_targets"]
  if cfg.curvature.axis_name is not None:  # One verdict on every device.
    loss, bad = jax.lax.pmean((loss, bad), cfg.curvature.axis_name)
  # The statistics' own pass on batch= (already averaged over the
  # devices): its loss and labels, on the steps it ran (else 0s, not seen).
  own_loss, own_bad, seen = own
  if loss is None:
    loss = own_loss
  else:
    seen = None  # loss= (or the stats' run entry): seen on every step.
  bad = own_bad if bad is None else bad + own_bad
  out, new_state = _eigen_guard.guarded(state, new_state, out, s.leaves,
                                        params, loss, bad, seen=seen)
  return jax.tree.unflatten(treedef, out), new_state


