"""Edges the rest of the suite let through (issue 48, point 10).

Each test pins one property of recent code by a brute-force count or an
invariance, and failed with one planted bug (named in its docstring) that
no other test caught:

* ``eigen_adam``'s guard: a finite gradient with a non-finite loss is a
  skipped step; non-finite params are counted;
* ``kfl.health``: the first bad step is the first, "recovered" counts the
  good updates after the last bad one, OUT OF SCALE reads the first loss by
  magnitude and the input factors debiased;
* the restore check compares the blocks' dtypes;
* ``kfac_optimizer``: a zero predicted change is no predicted reduction,
  and ω is raised to the adaptation interval;
* ``kfl.with_batch``/``with_stats``: explicit ``stats=`` win over a stored
  batch, the estimate's loss is stored;
* updates come back in the gradients' flax wrappers;
* Eva's vectors average the sampled targets and the positions;
* ``kfl.describe``'s price: EK-FAC's scaling and a stacked layer's slices;
* ``kfl.influence``: K-FAC factors are means over examples × positions,
  sampled cotangents are those of the per-example loss.

The model is a two-layer tanh MLP of a few units; the jitted steps are
module-level and shared (one compile per step style).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kfl
from kfac_jax_lite import blocks as B
from kfac_jax_lite.optimizers import health as health_mod
from kfac_jax_lite.optimizers import optimizer as opt_mod

import _brute
from _helpers import (assert_rounding_close, flat, two_layer_classifier_loss,
                      x64_mode)

CLASSES = 3
N = 16
EPS32 = float(np.finfo(np.float32).eps)


def _problem(dtype=np.float32):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((N, 5)).astype(dtype)
  y = rng.integers(0, CLASSES, N).astype(np.int32)
  params = {"l0": {"w": (rng.standard_normal((5, 6)) / 3).astype(dtype),
                   "b": np.zeros(6, dtype)},
            "l1": {"w": (rng.standard_normal((6, CLASSES)) / 3).astype(dtype),
                   "b": np.zeros(CLASSES, dtype)}}
  return (jax.tree.map(jnp.asarray, params),
          {"x": jnp.asarray(x), "y": jnp.asarray(y)})


loss_fn = two_layer_classifier_loss


PARAMS, BATCH = _problem()
NAN_BATCH = dict(BATCH, x=BATCH["x"].at[0, 0].set(jnp.nan))
TX = optax.chain(kfl.kfac(loss_fn, BATCH), optax.sgd(0.05))
EST = jax.jit(kfl.value_grad_and_stats(loss_fn, PARAMS, BATCH))
EA = optax.chain(kfl.eigen_adam(loss_fn, BATCH),
                 optax.scale_by_learning_rate(1e-2))


def _zero(tree):
  return all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(tree))


def _assert_trees_equal(new, old):
  for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@jax.jit
def batch_step(params, state, batch):
  grads = jax.grad(loss_fn)(params, batch)
  updates, state = TX.update(grads, state, params, batch=batch)
  return optax.apply_updates(params, updates), state


# ------------------------------------------------- eigen_adam's guard (1, 2)

@jax.jit
def ea_step(params, state, grads, stats, loss):
  u, state = EA.update(grads, state, params, stats=stats, loss=loss)
  return u, state


def test_eigen_adam_skips_a_finite_gradient_with_a_nonfinite_loss():
  """Planted bug 1 (the guard's verdict without the loss). A step whose
  loss is NaN while its gradient and statistics are finite (a label at
  ``classes``) is skipped: a zero update, Adam's moments and the factors
  exactly as before, counted as a bad loss and not as a bad gradient."""
  state = EA.init(PARAMS)
  est = EST(PARAMS, BATCH, jax.random.PRNGKey(0))
  u, state = ea_step(PARAMS, state, est.grads, est.stats, est.loss)
  params = optax.apply_updates(PARAMS, u)
  est = EST(params, BATCH, jax.random.PRNGKey(1))
  assert np.isfinite(flat(est.grads)).all() and np.isfinite(
      flat(est.stats)).all()
  u, after = ea_step(params, state, est.grads, est.stats,
                     jnp.float32(jnp.nan))
  assert _zero(u)
  old, new = state[0], after[0]
  for field in ("blocks", "mu_basis", "nu_basis", "mu", "nu"):
    _assert_trees_equal(getattr(new, field), getattr(old, field))
  h = kfl.health(after)
  assert h.bad_losses == 1 and h.bad_grads == 0 and not h.ok, str(h)
  assert (h.first_bad, h.last_bad) == (1, 1), str(h)


def test_eigen_adam_counts_nonfinite_params():
  """Planted bug 2 (``num_nonfinite_params`` not incremented). An update
  called with one non-finite parameter (its gradient, statistics and loss
  finite, from the good parameters) is counted in ``non-finite params``,
  which ``kfl.health`` reports, and the run is not ok."""
  state = EA.init(PARAMS)
  est = EST(PARAMS, BATCH, jax.random.PRNGKey(0))
  bad = jax.tree.map(lambda x: x, PARAMS)
  bad["l1"]["w"] = bad["l1"]["w"].at[2, 1].set(jnp.inf)
  _, state = ea_step(bad, state, est.grads, est.stats, est.loss)
  h = kfl.health(state)
  assert h.nonfinite_params == 1 and h.bad_grads == 0, str(h)
  assert not h.ok and "non-finite params 1" in str(h), str(h)


# ------------------------------------------- health: bad steps (3, 10, 12)

BAD_STEPS = (2, 4)
RUN_STEPS = BAD_STEPS[-1] + health_mod.RECOVERY_STEPS + 1


@functools.lru_cache(maxsize=None)
def _run_with_two_bad_batches():
  """The states after each of ``RUN_STEPS`` updates of ``TX`` on
  ``BATCH``, with a NaN input at the updates ``BAD_STEPS``."""
  params, state, states = PARAMS, TX.init(PARAMS), []
  for t in range(RUN_STEPS):
    params, state = batch_step(params, state,
                               NAN_BATCH if t in BAD_STEPS else BATCH)
    states.append(state)
  return states


def test_health_keeps_the_first_bad_step_and_the_last():
  """Planted bug 3 (``first_bad`` moved by every bad step). Two skipped
  updates at steps 2 and 4: the first bad step stays 2 while the last
  moves to 4, and the run recovered "at steps 2-4"."""
  states = _run_with_two_bad_batches()
  h = kfl.health(states[BAD_STEPS[0]])
  assert (h.first_bad, h.last_bad) == (2, 2), str(h)
  h = kfl.health(states[-1])
  assert (h.first_bad, h.last_bad) == BAD_STEPS, str(h)
  assert h.bad_grads == 2 and h.recovered, str(h)
  assert str(h).startswith("kfac: recovered after 2 bad batches at steps 2-4")


def test_recovered_needs_recovery_steps_good_updates_after_the_last_bad():
  """Planted bug 10 (``steps - last_bad``: one update early). A run is
  recovered once ``RECOVERY_STEPS`` good updates followed its last bad
  one, not before: counted here as the updates after it in the run."""
  states = _run_with_two_bad_batches()
  for count, state in enumerate(states, 1):
    h = kfl.health(state)
    if count <= BAD_STEPS[-1]:
      continue
    good_after = count - 1 - BAD_STEPS[-1]
    assert h.steps == count
    assert h.recovered == (good_after >= health_mod.RECOVERY_STEPS), (
        good_after, str(h))
    assert h.failing == (good_after < health_mod.RECOVERY_STEPS), str(h)


def test_input_scale_is_the_debiased_median_second_moment():
  """Planted bug 12 (OUT OF SCALE reading ``A``'s EMA without its
  zero-init debias). After one update (``cov_decay`` 0.95: the EMA holds
  5% of ``A``), ``kfl.health``'s ``input_scale`` is the smallest and
  largest over the layers of the median of ``A``'s diagonal, ``A`` the
  batch's second moment of ``[x, 1]``, formed here in float64."""
  state = _run_with_two_bad_batches()[0]
  x = np.asarray(BATCH["x"], np.float64)
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), PARAMS)
  h = np.tanh(x @ p["l0"]["w"] + p["l0"]["b"])
  medians = [np.median(np.append((inp ** 2).mean(0), 1.0)) for inp in (x, h)]
  # Computed from float32 factors: a mean of N squares of a forward
  # through 5 inputs.
  got = np.array(kfl.health(state).input_scale, np.float32)
  assert_rounding_close(got, np.array([min(medians), max(medians)]),
                        terms=N + 5, depth=3)


# --------------------------------------------- OUT OF SCALE's first loss (11)

def test_out_of_scale_reads_the_first_loss_by_magnitude():
  """Planted bug 11 (``LOSS_SCALE`` compared with the signed loss). A
  negative first loss (a Gaussian NLL, an ELBO) is judged by its
  magnitude: ``-v`` is out of scale exactly when ``v`` is, over values
  inside, at and outside both bounds; also through ``losses=``."""
  base = kfl.health(TX.init(PARAMS))
  lo, hi = health_mod.LOSS_SCALE
  for v in (lo * 0.5, lo, lo * 2, 0.3, 2.3, hi * 0.5, hi, hi * 2):
    pos = base._replace(loss_first=v).out_of_scale
    neg = base._replace(loss_first=-v).out_of_scale
    assert (pos is None) == (neg is None) == (lo <= v <= hi), (v, pos, neg)
  losses = [-2.3, -2.4, -2.5]
  assert kfl.health(TX.init(PARAMS), losses=losses).out_of_scale is None
  assert kfl.health(TX.init(PARAMS), losses=[-1e6, -1e6]).out_of_scale


# ----------------------------------------------------- restore check (4)

def test_a_float64_state_is_refused_by_a_float32_transform():
  """Planted bug 4 (blocks compared by shape only). A state whose blocks
  are float64 (made for float64 params, or restored from such a
  checkpoint) given to a transform updating float32 params is one
  ``ValueError`` naming the layer and the checkpoint, as another
  configuration's state is; and the other way round."""
  with x64_mode(True):
    tx = kfl.kfac(loss_fn, BATCH)
    params64 = jax.tree.map(lambda x: x.astype(jnp.float64), PARAMS)
    batch64 = dict(BATCH, x=BATCH["x"].astype(jnp.float64))

    def update(state, params, batch):
      grads = jax.grad(loss_fn)(params, batch)
      return tx.update(grads, state, params, batch=batch)
    # Traced only (jax.eval_shape): the check is made when update traces.
    for made_for, params, batch in ((params64, PARAMS, BATCH),
                                    (PARAMS, params64, batch64)):
      state = jax.eval_shape(tx.init, made_for)
      assert {x.dtype for x in jax.tree.leaves(state.blocks)
              if jnp.issubdtype(x.dtype, jnp.floating)} == {
                  jax.tree.leaves(made_for)[0].dtype}
      jax.eval_shape(update, jax.eval_shape(tx.init, params), params, batch)
      with pytest.raises(ValueError, match=r"(?s)'l0.*checkpoint"):
        jax.eval_shape(update, state, params, batch)


# --------------------------------------------- kfac_optimizer's rule (5, 6)

LSQ_X = jnp.asarray(np.random.default_rng(2).standard_normal((8, 3)),
                    jnp.float32)
LSQ_BATCH = {"x": LSQ_X, "t": LSQ_X @ jnp.ones((3, 2)) + 0.5}
LSQ_PARAMS = (0.1 * jnp.ones((3, 2)), jnp.zeros(2))
INTERVAL, DECAY = 2, 0.5


def least_squares(p, b):
  return kfl.squared_error(b["x"] @ p[0] + p[1], b["t"]).sum(-1).mean()


OPT = kfl.kfac_optimizer(least_squares, LSQ_BATCH, initial_damping=1.0,
                         damping_decay=DECAY,
                         damping_adaptation_interval=INTERVAL,
                         use_momentum=False)
OPT_UPDATE = jax.jit(lambda g, s, p: OPT.update(g, s, p, batch=LSQ_BATCH))


def _opt_steps(grads_of_step):
  """``kfac_optimizer``'s states over ``len(grads_of_step)`` updates, the
  gradient of each from ``grads_of_step[t](params)``."""
  params, state, states = LSQ_PARAMS, OPT.init(LSQ_PARAMS), []
  for grads_of in grads_of_step:
    step, state = OPT_UPDATE(grads_of(params), state, params)
    params = optax.apply_updates(params, step)
    states.append(state)
  return states


def _grads(params):
  return jax.grad(least_squares)(params, LSQ_BATCH)


def test_a_zero_predicted_change_is_no_predicted_reduction():
  """Planted bug 5 (``model_change <= 0`` counted as predicted). ``ρ`` for
  a model change of 0 is the value for any change ≥ 0, ``L − L_new``
  (finite), never a division by 0; in ``kfac_optimizer`` a step with a
  zero gradient (the model predicts no change) reports a finite ``ρ`` and
  leaves ``λ`` as it was."""
  with x64_mode(True):
    rr = lambda *a: float(opt_mod.reduction_ratio(*map(jnp.float64, a)))
    for new, old in ((1.5, 2.0), (2.0, 2.0), (2.5, 2.0)):
      at_zero, above = rr(new, old, 0.0), rr(new, old, 1e-3)
      assert np.isfinite(at_zero) and at_zero == above == old - new, (
          new, old, at_zero, above)
  zero = lambda p: jax.tree.map(jnp.zeros_like, p)
  states = _opt_steps([_grads, zero])  # Adapts on the 2nd (INTERVAL).
  rho = float(states[1].rho)
  # L_new − L: the same loss at the same params, by two passes (float32).
  loss = float(least_squares(LSQ_PARAMS, LSQ_BATCH))
  assert np.isfinite(rho), rho
  assert_rounding_close(rho, 0.0, terms=LSQ_X.size * 2, depth=2, scale=loss)
  assert float(states[1].damping) == float(states[0].damping) == 1.0


def test_damping_moves_by_decay_to_the_interval():
  """Planted bug 6 (ω = ``damping_decay``, not raised to ``T₁``). On
  least squares the quadratic model is the loss (``ρ = 1 > ¾``), so the
  adapting update multiplies ``λ`` by ``damping_decay^T₁`` (T₁ steps'
  worth); the updates between leave it."""
  states = _opt_steps([_grads] * (2 * INTERVAL))
  lams = [1.0] + [float(s.damping) for s in states]
  for t, s in enumerate(states, 1):
    if t % INTERVAL:
      assert lams[t] == lams[t - 1], lams
    else:
      assert float(s.rho) > 0.75, float(s.rho)  # The ω branch.
      np.testing.assert_allclose(lams[t] / lams[t - 1], DECAY ** INTERVAL,
                                 rtol=4 * EPS32, err_msg=str(lams))


# ---------------------------------------------- stored batch / stats (7, 8)

_stats_update = jax.jit(
    lambda g, s, p, stats: TX.update(g, s, p, stats=stats))


def test_explicit_stats_win_over_a_stored_batch():
  """Planted bug 7 (``stats=`` alone not counted as an explicit
  argument). ``update(..., stats=)`` on a state holding a batch stored by
  ``kfl.with_batch`` (another one: its factors would differ) gives the
  update and state it gives on a state with nothing stored, bit for bit
  (one compiled program), and trains."""
  est = EST(PARAMS, BATCH, jax.random.PRNGKey(0))
  fresh = TX.init(PARAMS)
  other = dict(BATCH, x=3 * BATCH["x"][::-1])
  stored = kfl.with_batch(fresh, other)
  u_stored, s_stored = _stats_update(est.grads, stored, PARAMS, est.stats)
  u_fresh, s_fresh = _stats_update(est.grads, fresh, PARAMS, est.stats)
  assert not _zero(u_fresh)
  _assert_trees_equal(u_stored, u_fresh)
  _assert_trees_equal(s_stored[0].blocks, s_fresh[0].blocks)
  assert kfl.health(s_stored).num_losses == 1  # The stats' run entry.


@jax.jit
def _stored_stats_step(state, params, est):
  state = kfl.with_stats(state, est)
  _, state = TX.update(est.grads, state, params)
  return state


def test_with_stats_stores_the_estimates_loss():
  """Planted bug 8 (``with_stats`` storing the statistics without the
  loss). An update that reads what ``kfl.with_stats`` stored gives
  ``kfl.health`` the estimate's loss (here one that differs from the
  statistics' own run entry, so that it is the estimate's)."""
  est = EST(PARAMS, BATCH, jax.random.PRNGKey(0))
  est = est._replace(loss=est.loss + 1)
  h = kfl.health(_stored_stats_step(TX.init(PARAMS), PARAMS, est))
  assert h.num_losses == 1, str(h)
  np.testing.assert_allclose(h.loss_first, float(est.loss), rtol=EPS32)


# ------------------------------------------------------ flax wrappers (9)

WRAPPED_TX = {
    "kfac": kfl.kfac(loss_fn, BATCH),
    "kfac_optimizer": kfl.kfac_optimizer(loss_fn, BATCH),
    "eigen_adam": kfl.eigen_adam(loss_fn, BATCH),
}


def _first_update(name, grads, params):
  tx = WRAPPED_TX[name]
  return tx.update(grads, tx.init(params), params, batch=BATCH)[0]


@pytest.mark.parametrize("name", sorted(WRAPPED_TX))
def test_updates_come_back_in_the_gradients_wrappers(name):
  """Planted bug 9 (the update returned unwrapped). Gradients and params
  as ``nnx.Param``s give updates of the gradients' structure, wrappers
  included, each leaf of its gradient's shape and dtype (traced only,
  ``jax.eval_shape``: the structure is fixed when ``update`` traces)."""
  nnx = pytest.importorskip("flax.nnx")
  wrap = lambda t: jax.tree.map(nnx.Param, t)
  grads = jax.grad(loss_fn)(PARAMS, BATCH)
  wrapped = jax.eval_shape(functools.partial(_first_update, name),
                           wrap(grads), wrap(PARAMS))
  assert jax.tree.structure(wrapped) == jax.tree.structure(wrap(grads))
  assert [(x.shape, x.dtype) for x in jax.tree.leaves(wrapped)] == [
      (x.shape, x.dtype) for x in jax.tree.leaves(grads)]
  plain = jax.eval_shape(functools.partial(_first_update, name), grads,
                         PARAMS)
  assert jax.tree.structure(plain) == jax.tree.structure(grads)


# ----------------------------------------------------- Eva's vectors (13, 14)

@pytest.mark.parametrize("samples,positions", [(3, 1), (1, 3), (2, 4)])
def test_eva_vector_is_the_mean_sampled_gradient_when_inputs_agree(
    samples, positions):
  """Planted bugs 13 (``ḡ`` summed over the S sampled targets) and 14
  (``ā`` summed over the R positions). When every example has the same
  input at every position, ``v = ā ⊗ ḡ`` is the layer's gradient of
  ``Σ_i c_i ⟨g_si, y_i⟩`` averaged over the samples, over ``√(Σc)``
  (``kronecker_vector``'s docstring): the block's ``F = v vᵀ`` against
  that gradient from ``jax.grad``, in float64."""
  n, d_in, d_out = 3, 4, 2
  with x64_mode(True):
    rng = np.random.default_rng(samples * 10 + positions)
    x = np.broadcast_to(rng.standard_normal(d_in), (n, positions, d_in))
    cots = rng.standard_normal((samples, n, positions, d_out))
    c = np.array([0.2, 0.5, 0.9])
    block = B.KroneckerVectorDense((d_in, d_out), has_bias=True)
    state = block.update(block.init(jnp.float64),
                         block.compute_stats(x, cots, weights=c), 0.0)
    got = np.asarray(block.to_dense(state))
    params = (rng.standard_normal((d_in, d_out)), rng.standard_normal(d_out))
    grads = _brute.per_example_grads(lambda p, xn: xn @ p[0] + p[1], params,
                                     jnp.asarray(x), jnp.asarray(cots))
    v = np.einsum("n,snp->p", c, grads) / samples / np.sqrt(c.sum())
    assert_rounding_close(got, np.outer(v, v),
                          terms=n * samples * positions * d_in, depth=3)


# ------------------------------------------------- describe's price (15, 16)

def _scan_loss(params, batch):
  def layer(h, p):
    return h + jnp.tanh(h @ p["w"] + p["b"]), None
  h = jnp.tanh(batch["x"] @ params["inp"])
  h, _ = jax.lax.scan(layer, h, params["stack"])
  return kfl.softmax_cross_entropy_with_integer_labels(
      h @ params["out"], batch["y"]).mean()


def _one_layer_loss(params, batch):
  h = jnp.tanh(batch["x"] @ params["inp"])
  h = h + jnp.tanh(h @ params["mid"]["w"] + params["mid"]["b"])
  return kfl.softmax_cross_entropy_with_integer_labels(
      h @ params["out"], batch["y"]).mean()


SLICES, WIDTH = 3, 4
DESCRIBE_BATCH = {"x": jnp.ones((6, 5)), "y": jnp.zeros(6, jnp.int32)}
PRICING = dict(inverse_method="cholesky", inverse_every=10, cov_every=1)


def _rows(loss, params, **options):
  table = kfl.describe(loss, params, DESCRIBE_BATCH, **PRICING, **options)
  return {r.name: r for r in table}, table


@pytest.mark.parametrize("blocks", [None, "ekfac", "kronecker_vector",
                                    "diagonal"])
def test_a_stacked_layer_costs_its_slices_each_applied_once(blocks):
  """Planted bug 16 (a stacked layer's refresh not times its slices). A
  layer stacked ``L`` times under ``lax.scan`` is ``L`` layers of its
  shape each applied once: every part of its price (SGD's share,
  statistics, preconditioning, refresh) is ``L`` times that of one such
  layer unstacked, for each block kind."""
  options = {} if blocks is None else dict(blocks={"dense": blocks})
  inp, out = jnp.ones((5, WIDTH)), jnp.ones((WIDTH, CLASSES))
  stacked, _ = _rows(_scan_loss, {
      "inp": inp, "out": out,
      "stack": {"w": jnp.ones((SLICES, WIDTH, WIDTH)),
                "b": jnp.zeros((SLICES, WIDTH))}}, **options)
  single, _ = _rows(_one_layer_loss, {
      "inp": inp, "out": out,
      "mid": {"w": jnp.ones((WIDTH, WIDTH)), "b": jnp.zeros(WIDTH)}},
                    **options)
  (s_name,) = [k for k in stacked if k.startswith("stack")]
  (o_name,) = [k for k in single if k.startswith("mid")]
  assert stacked[s_name].stack == SLICES and not single[o_name].stack
  for field, got, one in zip(stacked[s_name].flops._fields,
                             stacked[s_name].flops, single[o_name].flops):
    assert got == pytest.approx(SLICES * one, rel=1e-12), (field, got, one)


def test_ekfac_preconditioning_adds_its_scaling_to_the_eigenbasis_product():
  """Planted bug 15 (EK-FAC priced without its ``a·b`` scaling). EK-FAC
  preconditions as K-FAC kept in eigenbases (exact damping) does, rotating
  in and out (``2·2·(a²·b + a·b²)``), and scales each of the ``a·b``
  entries: its price is that one's plus ``a·b`` per layer, counted here by
  hand for the three layers (``a`` with the bias row where there is one),
  and the price line's preconditioning share is that sum over SGD's."""
  params = {"inp": jnp.ones((5, WIDTH)), "out": jnp.ones((WIDTH, CLASSES)),
            "mid": {"w": jnp.ones((WIDTH, WIDTH)), "b": jnp.zeros(WIDTH)}}
  ekfac, e_table = _rows(_one_layer_loss, params, blocks={"dense": "ekfac"})
  exact, x_table = _rows(_one_layer_loss, params, damping_mode="exact")
  sizes = {"inp": (5, WIDTH), "mid/w": (WIDTH + 1, WIDTH),
           "out": (WIDTH, CLASSES)}
  assert set(ekfac) == set(exact) == set(sizes), sorted(ekfac)
  for name, (a, b) in sizes.items():
    assert ekfac[name].block == "EkfacDense"
    rotations = 2 * 2 * (a * a * b + a * b * b)
    assert exact[name].flops.precondition == pytest.approx(rotations)
    assert ekfac[name].flops.precondition == pytest.approx(rotations + a * b)
  extra = sum(a * b for a, b in sizes.values())
  sgd = e_table.price.flops.sgd
  assert e_table.price.precondition - x_table.price.precondition == (
      pytest.approx(extra / sgd, rel=1e-12))
  line = next(l for l in str(e_table).splitlines()
              if l.startswith("step price:"))
  assert f"preconditioning {e_table.price.precondition:.2f}x" in line


# ------------------------------------------------------- influence (17, 18)

IN_N, IN_R, IN_D, IN_H = 12, 3, 3, 4


def _positions_logits(params, x):
  h = jnp.tanh(x @ params["w1"] + params["b1"])  # [N, R, H]
  return h.mean(-2) @ params["w2"] + params["b2"]


def _positions_loss(params, batch, reduce=jnp.mean):
  x, y = batch
  return reduce(kfl.softmax_cross_entropy_with_integer_labels(
      _positions_logits(params, x), y))


def _positions_problem():
  rng = np.random.default_rng(5)
  params = {"w1": rng.normal(size=(IN_D, IN_H)),
            "b1": rng.normal(size=IN_H) * .1,
            "w2": rng.normal(size=(IN_H, CLASSES)),
            "b2": rng.normal(size=CLASSES) * .1}
  x = rng.normal(size=(IN_N, IN_R, IN_D))
  y = rng.integers(0, CLASSES, IN_N)
  return (jax.tree.map(jnp.asarray, params),
          (jnp.asarray(x), jnp.asarray(y)))


def _fitted_curvature(state, name):
  """``(Q_A ⊗ Q_G) diag(s) (Q_A ⊗ Q_G)ᵀ`` of one layer (one group)."""
  qa = np.asarray(state.eigvecs_a[name], np.float64)[0]
  qg = np.asarray(state.eigvecs_g[name], np.float64)[0]
  s = np.asarray(state.eigvals[name], np.float64)[0]
  q = np.kron(qa, qg)
  return q @ np.diag(s.ravel()) @ q.T


def test_influence_kfac_factors_are_means_over_examples_and_positions():
  """Planted bug 17 (factors over N, not N·R). A dense layer applied at
  R positions per example: ``"kfac"``'s curvature is ``A ⊗ G`` with
  ``A = (1/NR) Σ_nr ā_nr ā_nrᵀ`` and ``G = (1/NR) Σ_nr g_nr g_nrᵀ``,
  ``g_nr = ∂ℓ_n/∂y_nr`` of each example's own loss (``jax.grad``),
  formed here densely in float64."""
  with x64_mode(True):
    params, (x, y) = _positions_problem()
    state = kfl.influence.fit(_positions_loss, params, [(x, y)],
                              strategy="kfac", estimation="empirical",
                              progress=False)

    def example_loss(pre, n):  # ℓ_n of the pre-activations y_n [R, H].
      logits = jnp.tanh(pre).mean(0) @ params["w2"] + params["b2"]
      return kfl.softmax_cross_entropy_with_integer_labels(
          logits[None], y[n][None])[0]
    pre = x @ params["w1"] + params["b1"]
    g = np.asarray(jax.vmap(jax.grad(example_loss))(pre, jnp.arange(IN_N)))
    a = np.concatenate([np.asarray(x), np.ones((IN_N, IN_R, 1))], -1)
    rows = IN_N * IN_R
    big_a = np.einsum("nri,nrj->ij", a, a) / rows
    big_g = np.einsum("nri,nrj->ij", g, g) / rows
    want = np.kron(big_a, big_g)
    (name,) = [k for k in state.eigvals if "w1" in k]
    assert_rounding_close(_fitted_curvature(state, name), want,
                          terms=rows + IN_D + IN_H, depth=4)


def test_influence_sampled_cotangents_are_the_per_example_losses():
  """Planted bug 18 (sampled cotangents weighted ``c_e``, not ``c_e/c̄``).
  The per-example loss ``ℓ_n`` of a mean and of a sum of the same
  cross-entropies is the same (``kfl.influence``'s unit ``c̄``), and the
  targets sampled from one key are the same: a ``"fisher"`` fit of
  either is the same curvature, layer by layer."""
  with x64_mode(True):
    params, batch = _positions_problem()
    fits = [kfl.influence.fit(
        functools.partial(_positions_loss, reduce=reduce), params, [batch],
        strategy="kfac", estimation="fisher", key=jax.random.PRNGKey(3),
        progress=False) for reduce in (jnp.mean, jnp.sum)]
    for name in fits[0].eigvals:
      mean_fit = _fitted_curvature(fits[0], name)
      assert np.abs(mean_fit).max() > 0
      assert_rounding_close(_fitted_curvature(fits[1], name), mean_fit,
                            terms=IN_N * IN_R + IN_D + IN_H, depth=4,
                            err_msg=name)
