"""``kfl.kfac`` as an optax transformation on one device."""
import functools

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kfl

import _helpers

SIZES = (5, 8, 3)
N = 16


def init_params(dtype=jnp.float32):
  keys = jax.random.split(jax.random.PRNGKey(0), len(SIZES) - 1)
  return {f"dense{i}": {"w": (jax.random.normal(k, (a, b)) / np.sqrt(a)).astype(dtype),
                        "b": jnp.zeros(b, dtype)}
          for i, (k, a, b) in enumerate(zip(keys, SIZES[:-1], SIZES[1:]))}


def loss_fn(params, batch):
  h = batch["x"].astype(params["dense0"]["w"].dtype)
  for i in range(len(SIZES) - 1):
    layer = params[f"dense{i}"]
    h = h @ layer["w"] + layer["b"]
    if i < len(SIZES) - 2:
      h = jnp.tanh(h)
  return kfl.softmax_cross_entropy_with_integer_labels(
      h.astype(jnp.float32), batch["y"]).mean()


def make_batch(seed, n=N):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  x = jax.random.normal(k1, (n, SIZES[0]))
  return {"x": x, "y": jnp.argmax(x[:, :SIZES[-1]], -1)}


BATCH = make_batch(0)


def train_step(tx, params, state, batch):
  """One step of ``tx`` on ``loss_fn``: ``(params, state)`` after it."""
  grads = jax.grad(loss_fn)(params, batch)
  updates, state = tx.update(grads, state, params, batch=batch)
  return optax.apply_updates(params, updates), state


def train(tx, steps, params=None, batches=None, state=None):
  params = init_params() if params is None else params
  state = tx.init(params) if state is None else state

  @jax.jit
  def step(params, state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params, batch=batch)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  for i in range(steps):
    batch = BATCH if batches is None else batches[i]
    params, state, loss = step(params, state, batch)
    losses.append(float(loss))
  return params, state, losses


def _hand_composed(name, kfac):
  """``(init, update)`` of the chain written by hand around ``kfac``
  (without KL clipping, so linear in the gradient it is given): clipping
  to global norm 0.1 (``"clip"``) as a factor on K-FAC's update of the raw
  gradient, then SGD with momentum 0.9 at lr 0.1 (``"sgd"``, ``"clip"``)
  or Adam at 3e-2 (b1 0.9, b2 0.999, eps 1e-8, bias-corrected)."""
  def init(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return kfac.init(params), zeros, zeros, jnp.zeros([], jnp.int32)

  def update(grads, state, params, batch):
    kstate, m, v, t = state
    u, kstate = kfac.update(grads, kstate, params, batch=batch)
    if name == "clip":
      norm = jnp.sqrt(sum(jnp.sum(g ** 2) for g in jax.tree.leaves(grads)))
      u = jax.tree.map(lambda x: x * jnp.minimum(1.0, 0.1 / norm), u)
    t = t + 1
    if name == "adam":
      m = jax.tree.map(lambda m, u: 0.9 * m + 0.1 * u, m, u)
      v = jax.tree.map(lambda v, u: 0.999 * v + 0.001 * u ** 2, v, u)
      step = jax.tree.map(lambda m, v: -3e-2 * (m / (1 - 0.9 ** t)) / (
          jnp.sqrt(v / (1 - 0.999 ** t)) + 1e-8), m, v)
    else:
      m = jax.tree.map(lambda m, u: u + 0.9 * m, m, u)
      step = jax.tree.map(lambda m: -0.1 * m, m)
    return step, (kstate, m, v, t), norm if name == "clip" else jnp.inf
  return init, update


@pytest.mark.parametrize("name", ["sgd", "adam", "clip"])
def test_chains_with_optax_as_composed_by_hand_and_trains(name):
  # The chain's update against the same composition written by hand, from
  # the same parameters at each of 30 steps (refreshes at 0, 1, 2, 3, 6...).
  kfac = kfl.kfac(loss_fn, BATCH, damping=1e-2, inverse_every=3,
                  norm_constraint=None)
  tx = {"sgd": optax.chain(kfac, optax.sgd(0.1, momentum=0.9)),
        "adam": optax.chain(kfac, optax.adam(3e-2)),
        "clip": optax.chain(optax.clip_by_global_norm(0.1), kfac,
                            optax.sgd(0.1, momentum=0.9))}[name]
  hand_init, hand_update = _hand_composed(name, kfac)

  @jax.jit
  def step(params, state, hand, batch):
    grads = jax.grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params, batch=batch)
    want, hand, norm = hand_update(grads, hand, params, batch)
    return (optax.apply_updates(params, updates), state, hand, updates, want,
            norm)

  params = init_params()
  state, hand = tx.init(params), hand_init(params)
  losses = []
  for i in range(30):
    losses.append(float(loss_fn(params, BATCH)))
    params, state, hand, got, want, norm = step(params, state, hand, BATCH)
    if i < 5:
      assert float(norm) > 0.1  # The clipping is active (or not "clip").
    # Two programs rounding the same float32 chain: the gradient, K-FAC's
    # products with the cached inverses (sums of ≤ 40 terms), the
    # optimizer's few operations per entry: 3 reductions of ≤ 40 terms,
    # at the update's scale (4.6e-7 of it measured).
    scale = max(float(jnp.abs(x).max()) for x in jax.tree.leaves(want))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      _helpers.assert_rounding_close(a, b, terms=40, depth=3, scale=scale,
                                     err_msg=f"{name} step {i}")
  assert losses[-1] < 0.5 * losses[0], losses
  kstate = state[1] if name == "clip" else state[0]
  assert int(kstate.count) == 30 and int(kstate.num_bad_grads) == 0


def layers_of(params):
  return [(params[f"dense{i}"]["w"], params[f"dense{i}"]["b"])
          for i in range(len(SIZES) - 1)]


def brute_update(params, batch, grads, damping, mode="exact", power=-1.0):
  """``{"dense{l}": (F̂_l + λ)^p g_l}`` over ``concat(w.ravel(), b)``, with
  the K-FAC factors of F̂_l formed by brute force on ``batch`` (a mean
  loss: c_i = 1/n) and damped per ``mode`` (``_helpers.damped_kron``)."""
  n = len(batch["x"])
  factors = _helpers.mlp_kfac_factors(layers_of(params), batch["x"],
                                      np.full(n, 1 / n))
  out = {}
  for i, (a, g) in enumerate(factors):
    name = f"dense{i}"
    v = np.concatenate([np.ravel(grads[name]["w"]), np.ravel(grads[name]["b"])])
    u = _helpers.sym_power(_helpers.damped_kron(a, g, damping, mode), power) @ v
    out[name] = u
  return out


def assert_update(updates, want, **tol):
  for name, u in want.items():
    got = np.concatenate([np.ravel(updates[name]["w"]),
                          np.ravel(updates[name]["b"])])
    np.testing.assert_allclose(got, u, err_msg=name, **tol)


@functools.lru_cache(maxsize=None)
def compiled(**options):
  """``(tx, jit(tx.update))`` for ``kfl.kfac(loss_fn, BATCH, **options)``,
  compiled once per configuration for the whole module. Without KL
  clipping unless ``norm_constraint`` is given: the values are compared
  with the unclipped brute-force update."""
  tx = kfl.kfac(loss_fn, BATCH, **{"norm_constraint": None, **options})
  return tx, jax.jit(tx.update)


# Exact statistics and exact damping: the first update is (F̂ + λ)⁻¹ g with
# F̂ = A ⊗ G per layer, exactly.
EXACT = dict(damping=0.1, estimation="exact", damping_mode="exact",
             cov_decay=0.5, cov_every=1, inverse_every=10, norm_constraint=None)


def test_first_update_is_the_natural_gradient_of_the_exact_blocks():
  tx, update = compiled(**EXACT)
  params = init_params()
  grads = jax.grad(loss_fn)(params, BATCH)
  updates, state = update(grads, tx.init(params), params, batch=BATCH)
  assert_update(updates, brute_update(params, BATCH, grads, 0.1),
                rtol=2e-3, atol=1e-5)


# The refreshed steps of 0..40, written out: every inverse_every-th step
# from 0, and while the statistics are young (below inverse_every) the
# powers of two.
REFRESHES = {
    1: set(range(41)),
    2: {0, 1} | set(range(0, 41, 2)),
    10: {0, 1, 2, 4, 8, 10, 20, 30, 40},
}


@pytest.mark.parametrize("inverse_every", sorted(REFRESHES))
def test_refresh_schedule_is_every_period_and_early_powers_of_two(
    inverse_every):
  due = np.asarray(kfl.optimizers.transform.is_refresh_step(jnp.arange(41),
                                                 inverse_every))
  assert set(np.flatnonzero(due)) == REFRESHES[inverse_every]
  if inverse_every != 10:
    return
  # Through kfl.kfac: the steps whose update left caches stamped with
  # their own step (every factor of every block is refreshed together).
  tx, update = compiled(**EXACT)
  params = init_params()
  grads = jax.grad(loss_fn)(params, BATCH)
  state, refreshed = tx.init(params), set()
  for step in range(41):
    _, state = update(grads, state, params, batch=BATCH)
    stamps = {int(f.cache.step) for f in jax.tree.leaves(
        state.blocks, is_leaf=lambda x: isinstance(x, kfl.FactorState))
        if isinstance(f, kfl.FactorState)}
    assert len(stamps) == 1, (step, stamps)
    if stamps == {step}:
      refreshed.add(step)
  assert refreshed == REFRESHES[10]


def test_state_round_trips_and_training_resumes_bit_for_bit():
  # A checkpoint after 5 of 10 steps (sampled Fisher: the state's PRNG key
  # matters too) restores exactly, and resuming from it reproduces the
  # uninterrupted run bit for bit; resuming the same parameters with a
  # fresh optimizer state, or with only the K-FAC part fresh, does not
  # (so the checkpointed state is what the equality rests on).
  tx = optax.chain(kfl.kfac(loss_fn, BATCH, damping=1e-2, inverse_every=4),
                   optax.sgd(0.1, momentum=0.9))
  batches = [make_batch(i) for i in range(10)]
  step = jax.jit(lambda p, st, b: train_step(tx, p, st, b))

  def run(params, state, batches):
    for batch in batches:
      params, state = step(params, state, batch)
    return params, state

  start = (init_params(), tx.init(init_params()))
  full = run(*start, batches)
  half = run(*start, batches[:5])
  restored = flax.serialization.from_bytes(
      start, flax.serialization.to_bytes(half))
  assert jax.tree.structure(restored) == jax.tree.structure(half)
  for a, b in zip(jax.tree.leaves(half), jax.tree.leaves(restored)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)
  params, state = restored
  for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(
      run(params, state, batches[5:]))):
    np.testing.assert_array_equal(a, b)
  fresh_kfac = (start[1][0],) + tuple(state[1:])
  for other in (start[1], fresh_kfac):
    got, _ = run(params, other, batches[5:])
    diff = max(float(jnp.abs(a - b).max()) for a, b in zip(
        jax.tree.leaves(got), jax.tree.leaves(full[0])))
    assert diff > 1e-3, diff


def test_nan_batch_is_survived_and_counted():
  # Statistics every step, so the bad batch's are refused (and counted).
  tx = optax.chain(kfl.kfac(loss_fn, BATCH, damping=1e-2, inverse_every=2,
                            cov_every=1), optax.sgd(0.1, momentum=0.9))
  bad = dict(BATCH, x=BATCH["x"].at[0, 0].set(jnp.nan))
  batches = [BATCH] * 3 + [bad] + [BATCH] * 6
  params, state, losses = train(tx, 10, batches=batches)
  assert int(state[0].num_bad_grads) == 1
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves((params, state)))
  assert losses[-1] < losses[0]
  skipped = [int(f.num_skipped) for f in jax.tree.leaves(
      state[0].blocks, is_leaf=lambda x: isinstance(x, kfl.FactorState))
      if isinstance(f, kfl.FactorState)]
  assert skipped and all(s == 1 for s in skipped)


def test_bf16_parameters_train_with_float32_factors():
  tx = optax.chain(kfl.kfac(loss_fn, BATCH, damping=1e-2),
                   optax.sgd(0.1, momentum=0.9))
  params, state, losses = train(tx, 20, params=init_params(jnp.bfloat16))
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
  factors = jax.tree.leaves(state[0].blocks)
  assert all(x.dtype in (jnp.float32, jnp.int32) for x in factors)
  assert losses[-1] < 0.7 * losses[0], losses


def test_precomputed_stats_share_the_forward_pass():
  params = init_params()
  tx = kfl.kfac(loss_fn, BATCH, damping=1e-2)
  fn = kfl.value_grad_and_stats(loss_fn, params, BATCH)
  key = jax.random.PRNGKey(3)
  # Jitted: one compile each costs less than the eager ops' many small ones.
  est = jax.jit(fn)(params, BATCH, key)
  state = tx.init(params)
  u1, _ = jax.jit(tx.update)(est.grads, state, params, stats=est.stats)
  # Same statistics computed inside update (its own key) differ only by sampling;
  # with the exact estimator they agree.
  tx_exact = kfl.kfac(loss_fn, BATCH, damping=1e-2, estimation="exact")
  fn_exact = kfl.value_grad_and_stats(loss_fn, params, BATCH, estimation="exact")
  est = jax.jit(fn_exact)(params, BATCH, key)
  update = jax.jit(tx_exact.update)
  a, _ = update(est.grads, tx_exact.init(params), params, stats=est.stats)
  b, _ = update(est.grads, tx_exact.init(params), params, batch=BATCH)
  # Two computations of the statistics (sums over N examples), then the
  # solve with the damped curvature, which amplifies their rounding by κ.
  kappa = _helpers.kron_cond_bound(est.stats, 1e-2)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    _helpers.assert_rounding_close(x, y, terms=N, cond=kappa)
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(u1))


def test_norm_constraint_scales_the_update_to_the_kl_bound():
  params = init_params()
  grads = jax.grad(loss_fn)(params, BATCH)
  tx, update = compiled(**EXACT)
  full, _ = update(grads, tx.init(params), params, batch=BATCH)
  tx, update = compiled(**dict(EXACT, norm_constraint=1e-6))
  clipped, _ = update(grads, tx.init(params), params, batch=BATCH)
  dot = lambda a: sum(jnp.vdot(u, g) for u, g in zip(jax.tree.leaves(a),
                                                     jax.tree.leaves(grads)))
  # The clipped update s·u has s²⟨u, g⟩ = s² uᵀFu = the constraint.
  scale = dot(clipped) / dot(full)
  np.testing.assert_allclose(scale ** 2 * dot(full), 1e-6, rtol=1e-3)
  for c, f in zip(jax.tree.leaves(clipped), jax.tree.leaves(full)):
    np.testing.assert_allclose(c, scale * f, rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("mode", ["exact", "pi"])
def test_precon_power_half_is_the_inverse_square_root_of_the_damped_blocks(mode):
  params = init_params()
  grads = jax.grad(loss_fn)(params, BATCH)
  tx, update = compiled(**dict(EXACT, damping=0.05, damping_mode=mode,
                                precon_power=-0.5))
  half, _ = update(grads, tx.init(params), params, batch=BATCH)
  want = brute_update(params, BATCH, grads, 0.05, mode, power=-0.5)
  assert_update(half, want, rtol=2e-3, atol=1e-5)
  # And it is not the natural gradient (p = -1).
  natural = brute_update(params, BATCH, grads, 0.05, mode, power=-1.0)
  assert all(np.linalg.norm(natural[k] - want[k]) > 0.1 * np.linalg.norm(
      want[k]) for k in want)


@pytest.mark.parametrize("mode", ["exact", "pi"])
def test_damping_given_to_update_reaches_the_preconditioner(mode):
  # update(..., damping=λ) on a transform configured with another damping
  # gives the brute-force (F̂ + λ)⁻¹ g under the damping mode, and (exact
  # mode) equals the update of a transform built with damping=λ.
  params = init_params()
  grads = jax.grad(loss_fn)(params, BATCH)
  tx, update = compiled(**dict(EXACT, damping_mode=mode))
  given, _ = update(grads, tx.init(params), params, batch=BATCH, damping=0.03)
  want = brute_update(params, BATCH, grads, 0.03, mode)
  assert_update(given, want, rtol=2e-3, atol=1e-5)
  configured = brute_update(params, BATCH, grads, 0.1, mode)
  assert all(np.linalg.norm(configured[k] - want[k]) > 0.2 * np.linalg.norm(
      want[k]) for k in want)
  if mode == "exact":
    built, update = compiled(**dict(EXACT, damping=0.03))
    same, _ = update(grads, built.init(params), params, batch=BATCH)
    for a, b in zip(jax.tree.leaves(given), jax.tree.leaves(same)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)


def test_damping_schedule_and_stats_fraction_values():
  # λ_t = 0.1^t (an optax schedule of the step); statistics from the first
  # quarter of the batch (4 of 16 examples); refreshed every step. With the
  # same params and batch each step the EMA of the statistics is constant, so
  # update t is (F̂[:4] + λ_t)⁻¹ g exactly.
  params = init_params()
  grads = jax.grad(loss_fn)(params, BATCH)
  schedule = optax.exponential_decay(1.0, 1, 0.1)
  tx, update = compiled(damping=schedule, stats_fraction=0.25, inverse_every=1,
                        estimation="exact", damping_mode="exact",
                        cov_decay=0.9)
  state = tx.init(params)
  quarter = jax.tree.map(lambda x: x[:4], BATCH)
  for step in range(3):
    updates, state = update(grads, state, params, batch=BATCH)
    lam = 0.1 ** step
    want = brute_update(params, quarter, grads, lam)
    assert_update(updates, want, rtol=2e-3, atol=1e-5 * lam ** -0.5)
  whole = brute_update(params, BATCH, grads, lam)
  assert all(np.linalg.norm(whole[k] - want[k]) > 0.05 * np.linalg.norm(
      want[k]) for k in want)


def test_broken_cache_falls_back_to_the_gradient_and_is_counted():
  # After one good step (statistics and a refresh), poison every factor
  # array of the block states (factors and cached decompositions; the
  # scalar bookkeeping stays) and take a step that does not refresh: the
  # update (F̂ + λ)⁻¹ g is NaN although g is finite, so the raw gradient is
  # used and num_bad_updates counts it; num_bad_grads does not.
  params = init_params()
  grads = jax.grad(loss_fn)(params, BATCH)
  tx, update = compiled(**EXACT)  # Refreshes at step 0 only (of 0..9).
  _, state = update(grads, tx.init(params), params, batch=BATCH)
  assert int(state.count) == 1 and int(state.num_bad_updates) == 0
  poison = lambda x: (jnp.full_like(x, jnp.nan) if jnp.ndim(x) and
                      jnp.issubdtype(x.dtype, jnp.floating) else x)
  state = state._replace(blocks=jax.tree.map(poison, state.blocks))
  updates, new = update(grads, state, params, batch=BATCH)
  for u, g in zip(jax.tree.leaves(updates), jax.tree.leaves(grads)):
    np.testing.assert_array_equal(u, g)
  assert int(new.num_bad_updates) == 1 and int(new.num_bad_grads) == 0
  # A non-finite gradient is a skipped step (zero update) instead.
  bad = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), grads)
  updates, new = update(bad, new, params, batch=BATCH)
  assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
  assert int(new.num_bad_updates) == 1 and int(new.num_bad_grads) == 1


def test_bad_arguments_are_named():
  with pytest.raises(ValueError, match="stats_fraction"):
    kfl.kfac(loss_fn, BATCH, stats_fraction=0.0)
  with pytest.raises(ValueError, match="inverse_every"):
    kfl.kfac(loss_fn, BATCH, inverse_every=0)
  tx = kfl.kfac(loss_fn, BATCH)
  params = init_params()
  state = tx.init(params)
  with pytest.raises(ValueError, match="batch="):
    tx.update(jax.grad(loss_fn)(params, BATCH), state, params)
  with pytest.raises(ValueError, match="batch structure"):
    tx.update(jax.grad(loss_fn)(params, BATCH), state, params,
              batch=(BATCH["x"], BATCH["y"]))


def test_shard_map_without_axis_name_is_named():
  """Under ``shard_map(check_vma=True)`` a sharded batch with replicated
  parameters needs ``axis_name`` (else every device keeps its own
  curvature): a clear error, for ``batch=`` and ``stats=``; none with it."""
  from jax.sharding import Mesh, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  params = init_params()
  est_fn = kfl.value_grad_and_stats(loss_fn, params, BATCH)

  def trace(axis_name, one_pass):
    tx = kfl.kfac(loss_fn, BATCH, axis_name=axis_name)

    def step(params, state, batch):
      if one_pass:
        est = est_fn(params, batch, jax.random.PRNGKey(0))
        return tx.update(est.grads, state, params, stats=est.stats)
      return tx.update(jax.grad(loss_fn)(params, batch), state, params,
                       batch=batch)

    mapped = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data")),
                           out_specs=(P(), P()), check_vma=True)
    return jax.eval_shape(mapped, params, tx.init(params), BATCH)

  for one_pass in (False, True):
    with pytest.raises(ValueError, match="no axis_name.*axis_name='data'"):
      trace(None, one_pass)
    trace("data", one_pass)


def test_stacked_scan_layers_and_a_flax_model_train():
  import flax.linen as nn

  # Three residual layers stacked along lax.scan: one block per slice.
  def scan_loss(params, batch):
    def layer(h, p):
      return h + jnp.tanh(h @ p["w"] + p["b"]), None
    h = batch["x"] @ params["inp"]
    h, _ = jax.lax.scan(layer, h, params["stack"])
    return kfl.softmax_cross_entropy_with_integer_labels(
        h @ params["out"], batch["y"]).mean()

  key = jax.random.PRNGKey(0)
  params = {"inp": jax.random.normal(key, (5, 4)) / 3,
            "stack": {"w": jax.random.normal(key, (3, 4, 4)) / 4,
                      "b": jnp.zeros((3, 4))},
            "out": jax.random.normal(key, (4, 3)) / 2}
  names = {l.name: (l.kind, l.stack) for l in kfl.tagging.find_layers(
      scan_loss, params, BATCH).layers}
  assert names["stack/w"] == ("dense", 3)

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.LayerNorm()(nn.tanh(nn.Dense(8)(x)))
      return nn.Dense(3)(x)

  model = Model()
  flax_params = model.init(key, BATCH["x"])
  flax_loss = lambda p, b: kfl.softmax_cross_entropy_with_integer_labels(
      model.apply(p, b["x"]), b["y"]).mean()
  for fn, p in ((scan_loss, params), (flax_loss, flax_params)):
    tx = optax.chain(kfl.kfac(fn, BATCH, damping=1e-2),
                     optax.sgd(0.05, momentum=0.9))
    state = tx.init(p)

    @jax.jit
    def step(p, state):
      loss, grads = jax.value_and_grad(fn)(p, BATCH)
      updates, state = tx.update(grads, state, p, batch=BATCH)
      return optax.apply_updates(p, updates), state, loss

    losses = []
    for _ in range(25):
      p, state, loss = step(p, state)
      losses.append(float(loss))
    assert losses[-1] < 0.6 * losses[0], losses


def test_state_can_be_donated():
  # Every leaf of the state has a buffer of its own, so a training step can
  # donate the state (``donate_argnums``; one array held twice makes XLA
  # refuse: "Attempt to donate the same buffer twice").
  params = init_params()
  for tx in (kfl.kfac(loss_fn, BATCH), kfl.kfac_optimizer(loss_fn, BATCH)):
    leaves = jax.tree.leaves(tx.init(params))
    pointers = {x.unsafe_buffer_pointer() for x in leaves}
    assert len(pointers) == len(leaves)
  tx = optax.chain(kfl.kfac(loss_fn, BATCH), optax.sgd(0.1, momentum=0.9))

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state):
    grads = jax.grad(loss_fn)(params, BATCH)
    updates, state = tx.update(grads, state, params, batch=BATCH)
    return optax.apply_updates(params, updates), state
  params = jax.tree.map(jnp.copy, params)
  state = tx.init(params)
  for _ in range(2):
    params, state = step(params, state)
  assert int(state[0].count) == 2
