"""``kfl.eigen_adam``: Adam in the eigenbasis of the Kronecker factors (issue 26).

All in float64. The factors are given through ``stats=`` with
``cov_decay=0`` (the factor is then the last statistics exactly), so the
bases are known in advance:

* diagonal factors (their eigenbasis the standard one, up to the order and
  signs ``eigh`` gives: Adam is equivariant under signed permutations) make
  the transform ``optax.adam`` to 1e-12 on dense, conv, embedding and
  ``lax.scan``-stacked layers and on the leaves without a Kronecker block;
* factors ``Q Λ Qᵀ`` of random orthogonal ``Q`` make it a hand-written
  numpy rotate-Adam-rotate-back (``reference``), across refreshes to other
  bases with the stated moment rule (first moment rotated, second
  projected with the squared rotation, or kept), for both refresh
  methods; a refresh that only permutes the basis changes nothing under
  ``"project"`` and does under ``"keep"``;
* a stacked layer gives the updates of its slices unrolled (both bases);
* ``basis="shampoo"`` against the same reference fed SOAP's factors
  (EMAs of ``M Mᵀ``, ``Mᵀ M`` of the gradients);
* ``cov_every=k`` folds statistics only at the counts that are multiples
  of ``k`` (the factors then are those of a ``cov_every=1`` run fed only
  those statistics), its skipped steps compute none (on the program), and
  the one-pass style with ``kfl.stats_due`` follows the ``batch=`` style;
* under ``pmap`` on 8 devices (a subprocess, as ``test_distributed``) it
  equals one device, also with ``cov_every=2``; its state round-trips
  through ``flax.serialization``.
"""
import json
import os
import sys

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kfl
from kfac_jax_lite.optimizers import transform
from kfac_jax_lite import blocks as B

import _cpu_devices as cpu_devices
from _helpers import count_primitives, x64_mode

B1, B2, EPS = 0.9, 0.999, 1e-8
LR = 0.1


# --- models --------------------------------------------------------------------

def dense_loss(p, b):
  """A dense layer (kernel + bias) then a scale: one rotated layer, one not."""
  return kfl.squared_error((b["x"] @ p["w"] + p["b"]) * p["s"], b["t"]).mean()


def dense_problem(seed=0, n=8, d_in=2, d_out=3):
  rng = np.random.default_rng(seed)
  params = {"w": rng.standard_normal((d_in, d_out)),
            "b": rng.standard_normal(d_out), "s": 1 + 0.1 * rng.standard_normal(d_out)}
  batch = {"x": rng.standard_normal((n, d_in)), "t": rng.standard_normal((n, d_out))}
  return params, batch


def conv_loss(p, b):
  y = jax.lax.conv_general_dilated(b["x"], p["k"], (1, 1), "VALID",
                                   dimension_numbers=("NHWC", "HWIO", "NHWC"))
  return kfl.squared_error(y.reshape(y.shape[0], -1) @ p["w"], b["t"]).mean()


def conv_problem(seed=0, n=4):
  rng = np.random.default_rng(seed)
  params = {"k": 0.3 * rng.standard_normal((2, 2, 1, 2)),
            "w": 0.3 * rng.standard_normal((8, 2))}
  batch = {"x": rng.standard_normal((n, 3, 3, 1)), "t": rng.standard_normal((n, 2))}
  return params, batch


def embed_loss(p, b):
  return kfl.squared_error(p["e"][b["ids"]] @ p["w"], b["t"]).mean()


def embed_problem(seed=0, n=6):
  rng = np.random.default_rng(seed)
  params = {"e": rng.standard_normal((5, 3)), "w": rng.standard_normal((3, 2))}
  batch = {"ids": rng.integers(0, 5, n), "t": rng.standard_normal((n, 2))}
  return params, batch


def scan_loss(p, b):
  h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), b["x"], p["ws"])
  return kfl.squared_error(h @ p["w"], b["t"]).mean()


def scan_problem(seed=0, n=6):
  rng = np.random.default_rng(seed)
  params = {"ws": 0.5 * rng.standard_normal((3, 4, 4)),
            "w": rng.standard_normal((4, 2))}
  batch = {"x": rng.standard_normal((n, 4)), "t": rng.standard_normal((n, 2))}
  return params, batch


PROBLEMS = {"dense": (dense_loss, dense_problem), "conv": (conv_loss, conv_problem),
            "embedding": (embed_loss, embed_problem),
            "scan": (scan_loss, scan_problem)}


def steps_of(loss_fn, params, batch, tx, stats_fn, n):
  """``n`` steps of ``tx`` (``stats_fn(t)`` the ``stats=`` of step t, or
  None for ``batch=``); the lists of updates and of gradients, and the
  last params and state."""
  state = tx.init(params)

  @jax.jit
  def step(p, s, st):
    g = jax.grad(loss_fn)(p, batch)
    u, s = tx.update(g, s, p, **({"batch": batch} if st is None
                                 else {"stats": st}))
    return u, s, g
  updates, grads = [], []
  for t in range(n):
    u, state, g = step(params, state, None if stats_fn is None else stats_fn(t))
    updates.append(u)
    grads.append(g)
    params = optax.apply_updates(params, u)
  return updates, grads, params, state


def eigen_adam_layers(loss_fn, batch, params):
  """The layers ``eigen_adam`` uses: ``kfl.kfac``'s with "exact" damping."""
  return transform.kfac_with_layers(loss_fn, batch, damping_mode="exact"
                                    ).layers(params)


def diagonal_stats(tagged, dtype=np.float64):
  """Distinct diagonal factors for every rotated layer."""
  def diag(shape, diagonal):
    d = np.broadcast_to(1.0 + np.arange(shape[-1]),
                        shape if diagonal else shape[:-1]).astype(dtype)
    return jnp.asarray(d if diagonal else d[..., None] * np.eye(shape[-1]))
  out = {}
  for l in tagged.layers:
    inner = l.block.block if isinstance(l.block, B.Stacked) else l.block
    if not isinstance(inner, B.KroneckerBlock):
      continue
    fa, fg = l.block.factor_shapes
    out[l.name] = B.KroneckerState(a=diag(fa, inner.input_diagonal),
                                   g=diag(fg, False))
  return out


@pytest.mark.parametrize("refresh", ["eigh", "power"])
@pytest.mark.parametrize("model", sorted(PROBLEMS))
def test_identity_bases_give_optax_adam(model, refresh):
  loss_fn, problem = PROBLEMS[model]
  with x64_mode(True):
    params, batch = problem()
    ea = kfl.eigen_adam(loss_fn, batch, refresh=refresh, refresh_every=2,
                        cov_decay=0.0)
    stats = diagonal_stats(eigen_adam_layers(loss_fn, batch, params))
    assert stats  # At least one rotated layer.
    tx = optax.chain(ea, optax.scale_by_learning_rate(LR))
    got, _, _, _ = steps_of(loss_fn, params, batch, tx, lambda t: stats, 6)
    want, _, _, _ = steps_of(loss_fn, params, batch,
                          optax.adam(LR, B1, B2, EPS), lambda t: stats, 6)
  for u, v in zip(got, want):
    for x, y in zip(jax.tree.leaves(u), jax.tree.leaves(v)):
      np.testing.assert_allclose(x, y, rtol=0, atol=1e-12)


# --- the numpy reference ---------------------------------------------------------

def orthogonal(rng, n):
  q, r = np.linalg.qr(rng.standard_normal((n, n)))
  return q * np.sign(np.diag(r))


def power_step(c, q_old):
  """SOAP's warm start: ``qr(C Q_old)`` with Q_old's columns in decreasing
  order of ``diag(Q_oldᵀ C Q_old)``, ``diag(R) ≥ 0``, the order restored."""
  order = np.argsort(-np.einsum("ij,ik,kj->j", q_old, c, q_old))
  q, r = np.linalg.qr(c @ q_old[:, order])
  q = q * np.where(np.diag(r) < 0, -1.0, 1.0)
  return q[:, np.argsort(order)]


def reference(mats, factors, refresh_every, nu_rebase="project",
              refresh="eigh", eps=EPS):
  """Rotate-Adam-rotate-back on the ``[a, b]`` gradient matrices ``mats``,
  the basis of step t from ``factors[t] = (A, G)`` (refreshed at t = 0 and
  at multiples of ``refresh_every``); returns the updates (before ``-lr``)."""
  m = v = qa = qg = None
  out = []
  for t, (g, (a, gg)) in enumerate(zip(mats, factors)):
    if t % refresh_every == 0:
      if qa is None or refresh == "eigh":
        new_a, new_g = np.linalg.eigh(a)[1], np.linalg.eigh(gg)[1]
      else:
        new_a, new_g = power_step(a, qa), power_step(gg, qg)
      if qa is None:
        m = v = np.zeros_like(g)
      else:
        ra, rg = qa.T @ new_a, qg.T @ new_g
        m = ra.T @ m @ rg
        if nu_rebase == "project":
          v = (ra ** 2).T @ v @ rg ** 2
      qa, qg = new_a, new_g
    gt = qa.T @ g @ qg
    m = (1 - B1) * gt + B1 * m
    v = (1 - B2) * gt ** 2 + B2 * v
    mh, vh = m / (1 - B1 ** (t + 1)), v / (1 - B2 ** (t + 1))
    out.append(qa @ (mh / (np.sqrt(vh) + eps)) @ qg.T)
  return out


def spd(rng, n, eigvals=None):
  q = orthogonal(rng, n)
  lam = 1.0 + np.arange(n) if eigvals is None else np.asarray(eigvals)
  return (q * lam) @ q.T


def run_dense(stats_seq, steps, **options):
  """``eigen_adam`` on the dense problem with ``stats=`` from
  ``stats_seq[t] = (A, G)``; the updates' ``[a, b]`` matrices (before
  ``-lr``), the gradients' and the final state."""
  with x64_mode(True):
    params, batch = dense_problem()
    ea = kfl.eigen_adam(dense_loss, batch, cov_decay=0.0, **options)
    name = eigen_adam_layers(dense_loss, batch, params).layers[0].name
    stats = lambda t: {name: B.KroneckerState(
        a=jnp.asarray(stats_seq[t][0])[None], g=jnp.asarray(stats_seq[t][1])[None])}
    tx = optax.chain(ea, optax.scale_by_learning_rate(LR))
    updates, grads, _, state = steps_of(dense_loss, params, batch, tx, stats,
                                        steps)
  return [mat(u) / -LR for u in updates], [mat(g) for g in grads], state[0]


def mat(tree):
  """The dense layer's ``[a, b]`` matrix: the kernel's rows, then the bias."""
  return np.concatenate([np.asarray(tree["w"]), np.asarray(tree["b"])[None]])


# The reference is fed the transform's own gradients (the parameters follow
# the transform's trajectory), so it checks each step's algebra.

@pytest.mark.parametrize("refresh", ["eigh", "power"])
@pytest.mark.parametrize("nu_rebase", ["project", "keep"])
def test_known_bases_and_refreshes_follow_the_reference(refresh, nu_rebase):
  rng = np.random.default_rng(1)
  # Steps 0-2 in one basis, 3-5 in another, 6-7 in a third (refresh_every 3).
  seq = [(spd(rng, 3), spd(rng, 3)) for _ in range(3)]
  seq = [seq[0]] * 3 + [seq[1]] * 3 + [seq[2]] * 2
  got, grads, state = run_dense(seq, len(seq), refresh=refresh,
                                refresh_every=3, nu_rebase=nu_rebase)
  want = reference(grads, seq, 3, nu_rebase, refresh)
  for t, (x, y) in enumerate(zip(got, want)):
    np.testing.assert_allclose(x, y, rtol=0, atol=1e-10, err_msg=f"step {t}")
  steps = [int(f.cache.step) for f in jax.tree.leaves(
      state.blocks, is_leaf=lambda x: isinstance(x, kfl.FactorState))
      if isinstance(f, kfl.FactorState)]
  assert steps == [6, 6]


def test_a_permuting_refresh_changes_nothing_under_project_only():
  # C2 has C1's eigenvectors with its eigenvalues in reverse order: eigh
  # returns the basis with its columns reversed. "project" carries v to
  # the permuted columns (the run is that of a fixed basis); "keep" leaves
  # v where it was, against other directions.
  rng = np.random.default_rng(2)
  qa, qg = orthogonal(rng, 3), orthogonal(rng, 3)
  c1 = ((qa * [1., 2., 3.]) @ qa.T, (qg * [1., 2., 3.]) @ qg.T)
  c2 = ((qa * [3., 2., 1.]) @ qa.T, (qg * [3., 2., 1.]) @ qg.T)
  fixed, _, _ = run_dense([c1] * 6, 6, refresh_every=3)
  proj, _, _ = run_dense([c1] * 3 + [c2] * 3, 6, refresh_every=3,
                         nu_rebase="project")
  keep, _, _ = run_dense([c1] * 3 + [c2] * 3, 6, refresh_every=3,
                         nu_rebase="keep")
  for x, y in zip(proj, fixed):
    np.testing.assert_allclose(x, y, rtol=0, atol=1e-12)
  assert np.abs(keep[3] - fixed[3]).max() > 1e-2


def soap_reference(mats, decay, refresh_every, refresh="eigh", eps=EPS,
                   nu_rebase="keep"):
  """SOAP's order on the gradient matrices ``mats``: step ``k`` runs Adam
  (at ``t = k``) in the bases of the gradients before it, then folds its
  gradient into the EMAs of ``M Mᵀ``, ``Mᵀ M`` and, at ``k = 0`` (eigh)
  and at multiples of ``refresh_every``, refreshes the bases (``m``
  rotated, ``v`` by ``nu_rebase``); the first step only starts the bases
  (update 0)."""
  sa = sg = w = 0.0
  qa = qg = m = v = None
  out = []
  for k, g in enumerate(mats):
    if qa is None:
      out.append(np.zeros_like(g))
    else:
      gt = qa.T @ g @ qg
      m = (1 - B1) * gt + B1 * m
      v = (1 - B2) * gt ** 2 + B2 * v
      mh, vh = m / (1 - B1 ** k), v / (1 - B2 ** k)
      out.append(qa @ (mh / (np.sqrt(vh) + eps)) @ qg.T)
    sa = decay * sa + (1 - decay) * g @ g.T
    sg = decay * sg + (1 - decay) * g.T @ g
    w = decay * w + (1 - decay)
    a, gg = sa / w, sg / w
    if qa is None:
      qa, qg = np.linalg.eigh(a)[1], np.linalg.eigh(gg)[1]
      m = v = np.zeros_like(g)
    elif k % refresh_every == 0:
      if refresh == "eigh":
        new_a, new_g = np.linalg.eigh(a)[1], np.linalg.eigh(gg)[1]
      else:
        new_a, new_g = power_step(a, qa), power_step(gg, qg)
      ra, rg = qa.T @ new_a, qg.T @ new_g
      m = ra.T @ m @ rg
      if nu_rebase == "project":
        v = (ra ** 2).T @ v @ rg ** 2
      qa, qg = new_a, new_g
  return out


@pytest.mark.parametrize("refresh,nu_rebase", [("eigh", "keep"),
                                               ("power", "keep"),
                                               ("power", "project")])
def test_shampoo_basis_is_soap_reference(refresh, nu_rebase):
  # One batch throughout and a zero first step: step 1's gradient is step
  # 0's, whose own SVD the basis is, so the rotated gradient is diagonal and
  # its off-diagonal entries are rounding noise (~1e-17) that Adam divides
  # by eps. eps = 1e-4 keeps that noise at ~1e-13 in the update.
  decay, steps, eps = 0.9, 8, 1e-4
  with x64_mode(True):
    params, batch = dense_problem()
    ea = kfl.eigen_adam(dense_loss, batch, basis="shampoo", refresh=refresh,
                        refresh_every=3, cov_decay=decay, eps=eps,
                        nu_rebase=nu_rebase)
    tx = optax.chain(ea, optax.scale_by_learning_rate(LR))
    updates, grads, _, _ = steps_of(dense_loss, params, batch, tx, None, steps)
  got, mats = [mat(u) / -LR for u in updates], [mat(g) for g in grads]
  want = soap_reference(mats, decay, 3, refresh, eps, nu_rebase)
  for t, (x, y) in enumerate(zip(got, want)):
    np.testing.assert_allclose(x, y, rtol=0, atol=1e-10, err_msg=f"step {t}")
  # The scale leaf (no Kronecker block) gets plain Adam, also from step 1:
  # at t = 1 Adam's step is g / (|g| + eps).
  assert not np.any(np.asarray(updates[0]["s"]))
  g = np.asarray(grads[1]["s"])
  np.testing.assert_allclose(np.asarray(updates[1]["s"]) / -LR,
                             g / (np.abs(g) + eps), rtol=0, atol=1e-12)


def unrolled_loss(p, b):
  h = b["x"]
  for i in range(3):
    h = jnp.tanh(h @ p[f"w{i}"])
  return kfl.squared_error(h @ p["w"], b["t"]).mean()


@pytest.mark.parametrize("basis", ["kfac", "shampoo"])
def test_a_stacked_layer_is_its_slices_unrolled(basis):
  # One basis and one pair of moments per slice of a lax.scan layer: the
  # same updates as three separate dense layers (eps 1e-4: see the
  # Shampoo test).
  with x64_mode(True):
    params, batch = scan_problem()
    flat = {"w": params["w"], **{f"w{i}": params["ws"][i] for i in range(3)}}
    opts = dict(basis=basis, refresh_every=2, eps=1e-4, estimation="exact")
    runs = [steps_of(loss, p, batch, optax.chain(
        kfl.eigen_adam(loss, batch, **opts), optax.scale_by_learning_rate(LR)),
        None, 5)[0] for loss, p in ((scan_loss, params), (unrolled_loss, flat))]
  for stacked, unrolled in zip(*runs):
    np.testing.assert_allclose(stacked["w"], unrolled["w"], rtol=0, atol=1e-10)
    for i in range(3):
      np.testing.assert_allclose(stacked["ws"][i], unrolled[f"w{i}"], rtol=0,
                                 atol=1e-10)


def test_trains_with_batch_and_both_bases():
  with x64_mode(True):
    params, batch = dense_problem(n=16)
    for basis in ("kfac", "shampoo"):
      tx = optax.chain(kfl.eigen_adam(dense_loss, batch, basis=basis,
                                      estimation="exact"),
                       optax.scale_by_learning_rate(0.05))
      _, _, final, state = steps_of(dense_loss, params, batch, tx, None, 30)
      assert float(dense_loss(final, batch)) < 0.7 * float(dense_loss(params, batch))
      assert int(state[0].count) == 30


def test_batches_of_another_size_and_bad_batches():
  with x64_mode(True):
    params, batch = dense_problem(n=8)
    ea = kfl.eigen_adam(dense_loss, batch, estimation="exact")
    state = ea.init(params)
    small = jax.tree.map(lambda x: x[:5], batch)
    u, state = jax.jit(lambda g, s, p: ea.update(g, s, p, batch=small))(
        jax.grad(dense_loss)(params, small), state, params)  # One compile.
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(u))
    with pytest.raises(ValueError, match="structure"):
      ea.update(params, state, params, batch={"x": batch["x"]})


def test_checkpoint_round_trip_resumes_bit_for_bit():
  with x64_mode(True):
    params, batch = dense_problem()
    tx = optax.chain(kfl.eigen_adam(dense_loss, batch, refresh="power",
                                    refresh_every=2, estimation="exact"),
                     optax.scale_by_learning_rate(LR))
    step = jax.jit(lambda p, s: tx.update(jax.grad(dense_loss)(p, batch), s,
                                          p, batch=batch))

    def run(p, s, n):
      for _ in range(n):
        u, s = step(p, s)
        p = optax.apply_updates(p, u)
      return p, s

    start = (params, tx.init(params))
    full = run(*start, 6)
    half = run(*start, 3)
    restored = flax.serialization.from_bytes(
        start, flax.serialization.to_bytes(half))
    assert jax.tree.structure(restored) == jax.tree.structure(half)
    for a, b in zip(jax.tree.leaves(half), jax.tree.leaves(restored)):
      assert a.dtype == b.dtype
      np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(run(*restored, 3))):
      np.testing.assert_array_equal(a, b)


# --- cov_every: the statistics only on its counts ------------------------------

def _covs(state):
  return [np.asarray(kfl.factor.factor_value(f)) for f in jax.tree.leaves(
      state.blocks, is_leaf=lambda x: isinstance(x, kfl.factor.FactorState))]


@pytest.mark.parametrize("basis", ["kfac", "shampoo"])
def test_cov_every_folds_statistics_only_on_its_counts(basis):
  """With ``cov_every=3`` the factors after 7 updates are the EMA of the
  statistics of updates 0, 3 and 6 alone: those of a ``cov_every=1`` run
  fed only those (the Shampoo basis: of the gradients at those updates);
  between them they do not move, and ``kfl.stats_due`` says so."""
  with x64_mode(True):
    params, batch = dense_problem(n=8)
    tagged = eigen_adam_layers(dense_loss, batch, params)
    rng = np.random.default_rng(5)
    layer = [l for l in tagged.layers if l.name in diagonal_stats(tagged)][0]
    fa, fg = layer.block.factor_shapes
    stats_seq = [{layer.name: B.KroneckerState(
        a=jnp.broadcast_to(spd(rng, fa[-1]), fa),
        g=jnp.broadcast_to(spd(rng, fg[-1]), fg))}
        for _ in range(7)]
    options = dict(basis=basis, refresh_every=2, cov_decay=0.7)
    tx = kfl.eigen_adam(dense_loss, batch, cov_every=3, **options)
    state = tx.init(params)
    step = jax.jit(lambda g, s, p, st: tx.update(
        g, s, p, **({"stats": st} if basis == "kfac" else {})))
    p, due, covs, grads = params, [], [], []
    for t in range(7):
      due.append(bool(kfl.stats_due(state)))
      g = jax.grad(dense_loss)(p, batch)
      grads.append(g)
      u, state = step(g, state, p, stats_seq[t])
      covs.append(_covs(state))
      p = optax.apply_updates(p, jax.tree.map(lambda x: -0.05 * x, u))
    assert due == [True, False, False, True, False, False, True]
    for t in (1, 2, 4, 5):  # No fold: the factors stay as they were.
      for a, b in zip(covs[t], covs[t - 1]):
        np.testing.assert_array_equal(a, b)

    ref = kfl.eigen_adam(dense_loss, batch, cov_every=1, **options)
    rstate = ref.init(params)
    for t in (0, 3, 6):
      _, rstate = jax.jit(lambda g, s, p, st: ref.update(
          g, s, p, **({"stats": st} if basis == "kfac" else {})))(
              grads[t], rstate, params, stats_seq[t])
    for a, b in zip(covs[6], _covs(rstate)):
      np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13)
    assert any(np.abs(a).max() > 0 for a in covs[6])


def test_cov_every_skips_the_statistics_pass_in_the_program():
  """``batch=``: the sampled statistics pass sits in a ``lax.cond`` branch
  that the other counts take not (checked on the program); the one-pass
  style with ``with_stats=kfl.stats_due(state)`` gives the same run to
  float64 rounding."""
  with x64_mode(True):
    params, batch = dense_problem(n=8)
    grads = jax.grad(dense_loss)(params, batch)
    work = ("dot_general", "random_bits")
    tx = kfl.eigen_adam(dense_loss, batch, cov_every=2)
    state = tx.init(params)
    every = kfl.eigen_adam(dense_loss, batch)
    jx = jax.make_jaxpr(lambda g, s, p: tx.update(g, s, p, batch=batch))(
        grads, state, params).jaxpr
    folds = [e for e in jx.eqns if e.primitive.name == "cond"]
    assert len(folds) == 2  # The statistics' fold, then the refresh.
    skip, take = folds[0].params["branches"]
    assert not any(count_primitives(skip.jaxpr, work).values())
    inside = count_primitives(take.jaxpr, work)
    assert inside["random_bits"] > 0 and inside["dot_general"] > 0
    jx1 = jax.make_jaxpr(lambda g, s, p: every.update(g, s, p, batch=batch))(
        grads, every.init(params), params).jaxpr
    assert [e.primitive.name for e in jx1.eqns].count("cond") == 1
    # The cond's taken branch holds what cov_every=1 computes outside.
    outside = count_primitives(jx, work)
    assert outside["random_bits"] == count_primitives(jx1, work)["random_bits"]

    batches = [dense_problem(seed=s, n=8)[1] for s in range(5)]
    est_fn = kfl.value_grad_and_stats(dense_loss, params, batch)
    one = kfl.eigen_adam(dense_loss, batch, cov_every=2, refresh_every=2)
    two = kfl.eigen_adam(dense_loss, batch, cov_every=2, refresh_every=2)

    @jax.jit
    def one_pass(p, s, b):
      key = jax.random.split(s.key)[1]  # eigen_adam's own statistics key.
      est = est_fn(p, b, key, with_stats=kfl.stats_due(s))
      u, s = one.update(est.grads, s, p, stats=est.stats)
      return optax.apply_updates(p, jax.tree.map(lambda x: -0.05 * x, u)), s

    @jax.jit
    def batch_style(p, s, b):
      u, s = two.update(jax.grad(dense_loss)(p, b), s, p, batch=b)
      return optax.apply_updates(p, jax.tree.map(lambda x: -0.05 * x, u)), s

    p1, s1, p2, s2 = params, one.init(params), params, two.init(params)
    for b in batches:
      p1, s1 = one_pass(p1, s1, b)
      p2, s2 = batch_style(p2, s2, b)
    moved = max(float(np.abs(a - b).max()) for a, b in
                zip(jax.tree.leaves(p2), jax.tree.leaves(params)))
    assert moved > 1e-2
    # The health summaries differ by design: the one-pass style's
    # statistics carry the loss (issue 38), batch= has none to give.
    s1, s2 = s1._replace(health=None), s2._replace(health=None)
    for a, b in zip(jax.tree.leaves((p1, s1)), jax.tree.leaves((p2, s2))):
      np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_bad_arguments_are_refused():
  params, batch = jax.tree.map(lambda x: np.asarray(x, np.float32),
                               dense_problem())
  for kw in ({"basis": "adam"}, {"refresh": "qr"}, {"nu_rebase": "rotate"},
             {"refresh_every": 0}, {"cov_every": 0}, {"cov_every": 1.5}):
    with pytest.raises(ValueError, match=list(kw)[0]):
      kfl.eigen_adam(dense_loss, batch, **kw)
  ea = kfl.eigen_adam(dense_loss, batch)
  with pytest.raises(ValueError, match="batch="):
    ea.update(params, ea.init(params), params)


# --- pmap: a fresh interpreter with 8 CPU devices -------------------------------

def _pmap_worker():
  n_dev, steps = jax.device_count(), 5
  rng = np.random.default_rng(3)
  params, _ = dense_problem()
  batch = {"x": rng.standard_normal((32, 2)), "t": rng.standard_normal((32, 3))}
  out = {}
  for basis, cov_every in (("kfac", 1), ("shampoo", 1), ("kfac", 2),
                           ("shampoo", 2)):
    # eps=1e-4: Shampoo's first basis is the gradient's SVD, whose rounding
    # noise off the diagonal Adam divides by eps (see the Shampoo test).
    # cov_every=2: the statistics' collectives inside the fold's lax.cond.
    opts = dict(basis=basis, estimation="exact", refresh_every=2, eps=1e-4,
                cov_every=cov_every)
    lr = optax.scale_by_learning_rate(LR)
    tx = optax.chain(kfl.eigen_adam(dense_loss, batch, **opts), lr)
    _, _, one, _ = steps_of(dense_loss, params, batch, tx, None, steps)
    txp = optax.chain(kfl.eigen_adam(dense_loss, batch, axis_name="d", **opts),
                      lr)
    shard = jax.tree.map(lambda x: x.reshape((n_dev, -1) + x.shape[1:]), batch)

    def step(p, s, b):
      g = jax.lax.pmean(jax.grad(dense_loss)(p, b), "d")
      u, s = txp.update(g, s, p, batch=b)
      return optax.apply_updates(p, u), s
    pstep = jax.pmap(step, axis_name="d")
    rep = lambda x: jnp.broadcast_to(x, (n_dev,) + jnp.shape(x))
    p, s = jax.tree.map(rep, params), jax.tree.map(rep, txp.init(params))
    for _ in range(steps):
      p, s = pstep(p, s, shard)
    out[f"{basis} cov_every={cov_every}"] = {"one": {k: np.asarray(v).tolist() for k, v in one.items()},
                  "pmap": {k: np.asarray(v).tolist() for k, v in p.items()}}
  print("RESULT " + json.dumps(out), flush=True)


@pytest.mark.slow  # An 8-device worker (conftest.py: the slow tier).
def test_pmap_equals_one_device():
  env = dict(cpu_devices.env(8), JAX_ENABLE_X64="1")
  proc = cpu_devices.run([sys.executable, os.path.abspath(__file__), "pmap"],
                         env, timeout=300)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  assert lines, proc.stderr[-3000:]
  result = json.loads(lines[-1][len("RESULT "):])
  for basis, r in result.items():
    for k in r["one"]:
      # Each device holds all params (replicated): the same on every one.
      got = np.asarray(r["pmap"][k])
      np.testing.assert_array_equal(got, np.broadcast_to(got[0], got.shape))
      # Rounding of the 8-way mean against the whole-batch one, through
      # 5 Adam steps (updates of size ≤ lr·~1 each).
      np.testing.assert_allclose(got[0], r["one"][k], rtol=0, atol=1e-9,
                                 err_msg=f"{basis} {k}")


if __name__ == "__main__" and sys.argv[1:] == ["pmap"]:
  _pmap_worker()
