"""EKFAC (eigenvalue-corrected K-FAC) against brute force and against K-FAC.

The corrected eigenvalues must be the second moments of ``jax.vmap(jax.grad)``
per-example gradients projected into the block's Kronecker eigenbasis; the
refresh rules (the first refresh starts from K-FAC, later ones project) are
pinned against dense formulas; with one example EKFAC's damped inverse is
at least as close to the exact one as K-FAC's; and ``blocks={"dense":
"ekfac"}`` trains a small model, stacked layers under ``lax.scan`` included.
The generic algebra (``to_dense``, products, powers, Cholesky factors) is in
``test_blocks.py``'s cases ``ekfac_*``.

Run as a script, prints the Frobenius comparison with K-FAC on one small model.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import kfac_jax_lite as kfl
from kfac_jax_lite import blocks as B

import _brute
from _helpers import x64_mode


def rand(key, shape):
  return np.asarray(jax.random.normal(jax.random.PRNGKey(key), shape), np.float64)


@functools.lru_cache(maxsize=None)
def _with_basis_program(block, dtype, decay):
  def run(data):
    state = block.init(dtype)
    state = block.update(state, block.compute_stats(*data, state=state), decay)
    state = block.refresh(state, 0.0, step=0)
    state = block.update(state, block.compute_stats(*data, state=state), decay)
    return state, block.compute_stats(*data, state=state)
  return jax.jit(run)


def with_basis(block, data, dtype, decay=0.5):
  """A state refreshed once (its basis), then updated with ``data``, and
  the statistics of ``data`` measured in that basis (one jitted program)."""
  return _with_basis_program(block, dtype, decay)(
      tuple(jnp.asarray(x, dtype) for x in data))


def projected(grads, block, state, c):
  """Brute force: ``Σ_n c_n mean_s (Q_Aᵀ M_sn Q_G)²`` from flat per-example
  gradients ``[S, N, P]`` (``M`` the layout's ``[G, a, b]`` matrices)."""
  shapes = block.param_shapes
  sizes = np.cumsum([int(np.prod(s)) for s in shapes])[:-1]
  def to_mat(flat_grad):
    parts = np.split(flat_grad, sizes)
    with x64_mode(True):
      return np.asarray(block.layout.to_mat(
          tuple(jnp.asarray(p.reshape(s)) for p, s in zip(parts, shapes))),
          np.float64)
  qa = np.asarray(state.a.cache.eigvecs, np.float64)
  qg = np.asarray(state.g.cache.eigvecs, np.float64)
  s, n = grads.shape[:2]
  out = 0
  for i in range(s):
    for j in range(n):
      m = to_mat(grads[i, j])
      out = out + c[j] * (np.swapaxes(qa, -1, -2) @ m @ qg) ** 2
  return out / s


def dense_problem(seed, r, bias, transposed, s=2, n=4, d_in=3, d_out=2):
  shape = (d_out, d_in) if transposed else (d_in, d_out)
  params = (rand(seed, shape),) + ((rand(seed + 1, (d_out,)),) if bias else ())

  def fn(p, x):
    y = x @ (p[0].T if transposed else p[0])
    return y + p[1] if bias else y

  xs, cots = rand(seed + 2, (n, r, d_in)), rand(seed + 3, (s, n, r, d_out))
  return fn, params, xs, cots, dict(kernel_shape=shape, has_bias=bias,
                                    in_axes=(1,) if transposed else (0,))


def conv_problem(seed, bias, s=2, n=3):
  dims = lax.conv_dimension_numbers((1, 5, 5, 4), (3, 3, 2, 6),
                                    ("NHWC", "HWIO", "NHWC"))
  kw = dict(window_strides=(2, 1), padding=((1, 1), (0, 1)),
            feature_group_count=2)
  params = (rand(seed, (3, 3, 2, 6)),) + ((rand(seed + 1, (6,)),) if bias else ())

  def fn(p, x):  # One example; the output's [T, O] view.
    y = lax.conv_general_dilated(x[None], p[0], dimension_numbers=dims, **kw)[0]
    return (y + p[1] if bias else y).reshape(-1, 6)

  xs = rand(seed + 2, (n, 5, 5, 4))
  out = jax.eval_shape(fn, params, xs[0]).shape  # [T, 6]
  cots = rand(seed + 3, (s, n) + out)
  conv_cots = cots.reshape((s, n, 3, 4, 6))  # The conv output's own layout.
  block_kw = dict(kernel_shape=(3, 3, 2, 6), dimension_numbers=(
      "NHWC", "HWIO", "NHWC"), has_bias=bias, **kw)
  return fn, params, xs, cots, conv_cots, block_kw


CASES = ["dense", "dense_shared_expand", "dense_shared_reduce",
         "dense_transposed_nobias", "conv"]


@functools.lru_cache(maxsize=None)
def case_data(name, seed=0):
  """``(block, kronecker block, data, per-example grads [S, N, P], c)``;
  the brute force in float64 whatever the test's precision."""
  with x64_mode(True):
    return _case_data(name, seed)


def _case_data(name, seed):
  c = np.abs(rand(seed + 9, (4 if name != "conv" else 3,))) + 0.2
  if name == "conv":
    fn, params, xs, cots, conv_cots, kw = conv_problem(seed, True)
    return (B.EkfacConv(**kw), B.KroneckerConv(damping_mode="exact", **kw),
            (xs, conv_cots, c), _brute.per_example_grads(fn, params, xs, cots), c)
  r = 3 if name.startswith("dense_shared") else 1
  fn, params, xs, cots, kw = dense_problem(
      seed, r, bias=name != "dense_transposed_nobias",
      transposed=name == "dense_transposed_nobias")
  sharing = "reduce" if name == "dense_shared_reduce" else "expand"
  data = (xs if r > 1 else xs[:, 0], cots if r > 1 else cots[:, :, 0], c)
  return (B.EkfacDense(weight_sharing=sharing, **kw),
          B.KroneckerDense(weight_sharing=sharing, damping_mode="exact", **kw),
          data, _brute.per_example_grads(fn, params, xs, cots), c)


@pytest.mark.parametrize("name,x64", [(n, True) for n in CASES] + [
    ("dense", False), ("conv", False)])  # float32: both ways of forming s.
def test_scalings_are_projected_per_example_gradients(name, x64):
  """s = Σ_n c_n mean_s (Q_Aᵀ ∇ℓ_sn Q_G)², the basis that of A and G."""
  with x64_mode(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    block, kron, data, grads, c = case_data(name)
    data = tuple(np.asarray(x, dtype) for x in data)
    state, stats = with_basis(block, data, dtype)
    expected = projected(grads, block, state, c)
    tol = 1e-10 if x64 else 2e-5
    np.testing.assert_allclose(stats.scale, expected, rtol=tol,
                               atol=tol * np.abs(expected).max())
    # A and G are the Kronecker block's; the basis diagonalises them.
    kstats = kron.compute_stats(*data)
    np.testing.assert_allclose(stats.a, kstats.a, rtol=tol, atol=tol)
    np.testing.assert_allclose(stats.g, kstats.g, rtol=tol, atol=tol)
    for f in (state.a, state.g):
      q = np.asarray(f.cache.eigvecs, np.float64)
      d = np.swapaxes(q, -1, -2) @ np.asarray(kfl.factor.factor_value(f), np.float64) @ q
      off = d - np.vectorize(np.diag, signature="(n)->(n,n)")(
          np.diagonal(d, axis1=-2, axis2=-1))
      assert np.abs(off).max() <= 1e3 * tol * np.abs(d).max()


def test_update_and_refresh_rules():
  """Before a basis the block reads as zero; the first refresh starts from
  K-FAC's eigenvalues (EKFAC = K-FAC with exact damping); updates are the
  debiased EMA of s; a later refresh projects s into the new basis
  (``rebase="project"``) or restarts at K-FAC's (``"kfac"``)."""
  with x64_mode(True):
    block, kron, data, _, _ = case_data("dense_shared_reduce")
    other = case_data("dense_shared_reduce", seed=5)[2]
    f64 = jnp.float64
    # The block's methods jitted (one program each, not one per operation).
    update, to_dense = jax.jit(block.update), jax.jit(block.to_dense)
    refresh = jax.jit(block.refresh)
    compute_stats = jax.jit(lambda d, st: block.compute_stats(*d, state=st))
    data, other = (tuple(jnp.asarray(x) for x in d) for d in (data, other))
    state = block.init(f64)
    first = compute_stats(data, state)
    np.testing.assert_array_equal(first.scale, 0)  # No basis to measure in.
    state = update(state, first, 0.9)
    np.testing.assert_array_equal(to_dense(state), 0)
    state = refresh(state, 0.0, step=0)
    kron_dense = jax.jit(lambda d: kron.to_dense(kron.update(
        kron.init(f64), kron.compute_stats(*d), 0.9)))(data)
    np.testing.assert_allclose(to_dense(state), kron_dense, atol=1e-12)
    assert int(state.scale.cache.step) == 0
    # Update: s <- (d W s + (1-d) X) / (d W + 1 - d), W = 0.1 so far.
    s0 = np.asarray(state.scale.cache.eigvals)
    x = compute_stats(other, state)
    state = update(state, x, 0.9)
    np.testing.assert_allclose(
        state.scale.cache.eigvals,
        (0.9 * 0.1 * s0 + 0.1 * np.asarray(x.scale)) / (0.9 * 0.1 + 0.1),
        rtol=1e-12)
    # A refresh with new factors: the old F's diagonal in the new basis.
    old_dense = np.asarray(to_dense(state))
    new = refresh(state, 0.0, step=5)
    for before, after in zip(state, new):  # Caches only (as kfac shares them).
      for field in ("cov", "weight", "num_skipped"):
        np.testing.assert_array_equal(getattr(after, field),
                                      getattr(before, field))
    qa, qg = new.a.cache.eigvecs[0], new.g.cache.eigvecs[0]
    q_params = np.stack([  # Basis vectors q_A,i q_G,jᵀ in parameter order.
        np.concatenate([np.ravel(p) for p in block.layout.from_mat(
            jnp.outer(qa[:, i], qg[:, j])[None])])
        for i in range(qa.shape[0]) for j in range(qg.shape[0])], axis=1)
    np.testing.assert_allclose(
        np.asarray(new.scale.cache.eigvals).ravel(),
        np.diag(q_params.T @ old_dense @ q_params), rtol=1e-10, atol=1e-12)
    assert np.abs(q_params.T @ old_dense @ q_params
                  - np.diag(np.diag(q_params.T @ old_dense @ q_params))
                  ).max() > 1e-6  # The basis did move.
    restart = jax.jit(B.EkfacDense(**{**vars(block), "rebase": "kfac"}).refresh)(
        state, 0.0, step=5)
    np.testing.assert_allclose(
        restart.scale.cache.eigvals,
        restart.a.cache.eigvals[..., :, None] * restart.g.cache.eigvals[..., None, :],
        rtol=1e-12)


def one_example_blocks(name, seed):
  """``(exact, EKFAC, K-FAC)`` dense blocks for one example, one sample."""
  block, kron, data, grads, c = case_data(name, seed)
  data = (data[0][:1], data[1][:1, :1], c[:1])
  state, _ = with_basis(block, data, jnp.float64, decay=0.0)

  @jax.jit  # One program, not one per operation.
  def dense(state, data):
    kstate = kron.update(kron.init(jnp.float64), kron.compute_stats(*data),
                         0.0)
    return block.to_dense(state), kron.to_dense(kstate)
  grad = grads[0, 0]
  ekfac, kfac = dense(state, tuple(jnp.asarray(x) for x in data))
  return (c[0] * np.outer(grad, grad), np.asarray(ekfac, np.float64),
          np.asarray(kfac, np.float64))


def frobenius_errors(exact, approx, damping):
  """Frobenius errors of ``approx``'s damped inverse and of itself."""
  eye = np.eye(len(exact))
  inv = lambda m: np.linalg.inv(m + damping * eye)
  return (np.linalg.norm(inv(approx) - inv(exact)),
          np.linalg.norm(approx - exact))


@pytest.mark.parametrize("name", CASES)
def test_one_example_ekfac_versus_kfac(name):
  """One example, one sample, against the exact block ``c g gᵀ``.

  Matrices: EKFAC's ``s`` is the Frobenius-closest diagonal in K-FAC's
  basis, so EKFAC is at least as close as K-FAC (always). Damped inverses:
  both exact for a layer used once; EKFAC at least as close under
  ``"expand"`` sharing and for convolutions (measured on these draws, not a
  theorem). Under ``"reduce"`` sharing K-FAC's damped inverse is the closer
  one for λ ≤ 1 (K-FAC-reduce is rank one like the exact block, EKFAC
  spreads curvature over more directions), so it is not asserted there.
  """
  with x64_mode(True):
    for seed in range(2 if name == "conv" else 3):
      exact, ekfac, kfac = one_example_blocks(name, seed)
      for damping in (1e-3, 1e-1, 1.0):
        e_inv, e_mat = frobenius_errors(exact, ekfac, damping)
        k_inv, k_mat = frobenius_errors(exact, kfac, damping)
        assert e_mat <= k_mat * (1 + 1e-9) + 1e-12, (seed, e_mat, k_mat)
        if name in ("dense", "dense_transposed_nobias"):  # Both exact.
          assert max(e_inv, k_inv) <= 1e-8 / damping, (e_inv, k_inv)
        elif name != "dense_shared_reduce":
          assert e_inv <= k_inv * (1 + 1e-9), (seed, damping, e_inv, k_inv)


def test_stacked_ekfac_is_one_block_per_slice():
  """``Stacked`` maps the state-dependent statistics over the slices."""
  block = case_data("dense")[0]
  stacked = B.Stacked(block, 2)
  c = np.abs(rand(3, (5,))) + 0.1
  data = B.LayerData(inputs=jnp.asarray(rand(1, (2, 5, 3)), jnp.float32),
                     cotangents=jnp.asarray(rand(2, (2, 5, 2)), jnp.float32),
                     weights=jnp.asarray(c, jnp.float32))
  v = (jnp.asarray(rand(4, (2, 3, 2)), jnp.float32),
       jnp.asarray(rand(5, (2, 2)), jnp.float32))

  def two_steps(b, d):
    state = b.init()
    for step in range(2):
      state = b.update(state, b.layer_stats(d, state), 0.9)
      state = b.refresh(state, 0.1, step=step)
    return state

  @jax.jit
  def run(data, v):
    state = two_steps(stacked, data)
    slices = [two_steps(block, jax.tree.map(lambda x: x[l], data._replace(
        weights=None))._replace(weights=data.weights)) for l in range(2)]
    return (state, stacked.multiply_inverse(state, v, 0.1, use_cache=True),
            slices, [block.multiply_inverse(one, (v[0][l], v[1][l]), 0.1)
                     for l, one in enumerate(slices)])

  state, out, slices, expected = run(data, v)
  for l in range(2):
    np.testing.assert_allclose(state.scale.cache.eigvals[l],
                               slices[l].scale.cache.eigvals, rtol=1e-5,
                               atol=1e-7)
    for got, want in zip(out, expected[l]):
      np.testing.assert_allclose(got[l], want, rtol=1e-4, atol=1e-6)


def scan_loss(params, batch):
  """A dense input layer, three residual layers stacked along lax.scan and
  a dense output layer."""
  def layer(h, p):
    return h + jnp.tanh(h @ p["w"] + p["b"]), None
  h = jnp.tanh(batch["x"] @ params["inp"])
  h, _ = lax.scan(layer, h, params["stack"])
  return kfl.softmax_cross_entropy_with_integer_labels(
      h @ params["out"], batch["y"]).mean()


def mlp_loss(params, batch):
  h = jnp.tanh(batch["x"] @ params["inp"])
  return kfl.softmax_cross_entropy_with_integer_labels(
      h @ params["out"], batch["y"]).mean()


def scan_params(dtype=jnp.float32):
  key = jax.random.PRNGKey(0)
  k = jax.random.split(key, 3)
  return jax.tree.map(lambda x: x.astype(dtype), {
      "inp": jax.random.normal(k[0], (5, 4)) / 2,
      "stack": {"w": jax.random.normal(k[1], (3, 4, 4)) / 4,
                "b": jnp.zeros((3, 4))},
      "out": jax.random.normal(k[2], (4, 3)) / 2})


def scan_batch(dtype=jnp.float32, n=32):
  x = jax.random.normal(jax.random.PRNGKey(1), (n, 5))
  y = (x[:, 0] > 0).astype(jnp.int32) + (x[:, 1] > 0.5).astype(jnp.int32)
  return {"x": x.astype(dtype), "y": y}


def test_kfac_with_ekfac_blocks_trains_a_scan_model():
  params, batch = scan_params(), scan_batch()
  blocks = {"dense": "ekfac"}
  table = kfl.describe(scan_loss, params, batch, blocks=blocks)
  assert {r.name: (r.block, r.stack) for r in table} == {
      "inp": ("EkfacDense", None), "stack/w": ("EkfacDense", 3),
      "out": ("EkfacDense", None)}, str(table)
  tx = optax.chain(kfl.kfac(scan_loss, batch, blocks=blocks, damping=1e-2),
                   optax.sgd(0.05, momentum=0.9))
  state = tx.init(params)

  @jax.jit
  def step(p, state):
    loss, grads = jax.value_and_grad(scan_loss)(p, batch)
    updates, state = tx.update(grads, state, p, batch=batch)
    return optax.apply_updates(p, updates), state, loss

  losses = []
  for _ in range(25):
    params, state, loss = step(params, state)
    losses.append(float(loss))
  assert losses[-1] < 0.6 * losses[0], losses
  assert kfl.health(state).ok, kfl.health(state)
  stack = state[0].blocks["stack/w"]
  assert isinstance(stack, B.EkfacState)
  assert stack.scale.cache.eigvals.shape == (3, 1, 5, 4)
  assert np.all(np.asarray(stack.scale.cache.step) >= 0)


def test_public_api_statistics_match_per_example_gradients():
  """Through ``kfl.kfac`` and ``kfl.value_grad_and_stats`` (float64; the
  training test above is the float32 run): the scalings of a dense layer
  are the projected squared gradients of each example's own loss
  (``"empirical"``, a mean loss: ``c_n = 1/N``)."""
  x64 = True
  with x64_mode(x64):
    dtype = jnp.float64
    params, batch = scan_params(dtype), scan_batch(dtype, n=6)
    del params["stack"]
    blocks = {"dense": "ekfac"}
    tx = kfl.kfac(mlp_loss, batch, blocks=blocks, estimation="empirical")
    fn = kfl.value_grad_and_stats(mlp_loss, params, batch, blocks=blocks,
                                  estimation="empirical")
    key = jax.random.PRNGKey(0)
    with pytest.raises(ValueError, match="states="):
      jax.eval_shape(fn, params, batch, key)

    @jax.jit
    def stats_after_one_update(params):
      state = tx.init(params)
      _, state = tx.update(jax.grad(mlp_loss)(params, batch), state, params,
                           batch=batch)
      return state, fn(params, batch, key, states=state.blocks).stats
    state, stats = stats_after_one_update(params)

    def one(x, y):
      return jax.grad(mlp_loss)(params, {"x": x[None], "y": y[None]})
    per = jax.vmap(one)(batch["x"], batch["y"])  # ℓ_n's gradients.
    tol = 1e-10 if x64 else 1e-4
    for name, grad_of in (("inp", lambda g: g["inp"]),
                          ("out", lambda g: g["out"])):
      st = state.blocks[name]
      qa = np.asarray(st.a.cache.eigvecs[0], np.float64)
      qg = np.asarray(st.g.cache.eigvecs[0], np.float64)
      m = np.asarray(grad_of(per), np.float64)  # [N, in, out]
      expected = np.mean((qa.T @ m @ qg) ** 2, axis=0)
      np.testing.assert_allclose(stats[name].scale[0], expected, rtol=tol,
                                 atol=tol * expected.max())


def test_bad_choices_and_missing_state_are_clear_errors():
  block = B.EkfacDense((3, 2))
  with pytest.raises(ValueError, match="EkfacDense.*state"):
    block.compute_stats(np.ones((4, 3)), np.ones((4, 2)))
  with pytest.raises(ValueError, match="rebase"):
    B.EkfacDense((3, 2), rebase="reset")
  with pytest.raises(ValueError, match="weight_sharing"):
    B.EkfacDense((3, 2), weight_sharing="mean")

  def emb_loss(params, batch):
    h = params["emb"][batch["ids"]].mean(1)
    return kfl.softmax_cross_entropy_with_integer_labels(
        h @ params["w"], batch["y"]).mean()
  params = {"emb": jnp.ones((7, 4)), "w": jnp.ones((4, 3))}
  batch = {"ids": jnp.zeros((2, 3), jnp.int32), "y": jnp.zeros(2, jnp.int32)}
  with pytest.raises(ValueError, match="'ekfac' is for dense and conv.*KroneckerEmbedding"):
    kfl.describe(emb_loss, params, batch, blocks={"embedding": "ekfac"})
  table = kfl.describe(emb_loss, params, batch, blocks={"w": "ekfac"})
  assert {r.name: r.block for r in table} == {
      "emb": "KroneckerEmbedding", "w": "EkfacDense"}, str(table)


def frobenius_table():
  """EKFAC vs K-FAC (both with exact damping) on the scan model's dense
  layers: relative Frobenius errors against the exact Fisher block (one
  batch of 16, ``"exact"`` estimation), of the matrices and of the damped
  inverses."""
  with x64_mode(True):
    params, batch = scan_params(jnp.float64), scan_batch(jnp.float64, n=16)
    grads = jax.grad(scan_loss)(params, batch)
    dense = {}
    for choice in ("ekfac", "kronecker"):
      blocks = {"dense": choice}
      tx = kfl.kfac(scan_loss, batch, blocks=blocks, estimation="exact",
                    damping_mode="exact", cov_decay=0.0)
      state = tx.init(params)
      for _ in range(2):  # EKFAC: a basis, then s measured in it.
        _, state = tx.update(grads, state, params, batch=batch)
      tagged = kfl.value_grad_and_stats(scan_loss, params, batch, blocks=blocks,
                                        damping_mode="exact").tagged
      for l in tagged.layers:
        if l.name in ("inp", "out"):
          dense[choice, l.name] = np.asarray(l.block.to_dense(state.blocks[l.name]))
    print("layer  damping  |F-EKFAC|/|F|  |F-KFAC|/|F|  inverse: EKFAC   K-FAC")
    for name in ("inp", "out"):
      exact = exact_fisher_block(params, batch, name)
      eye = np.eye(len(exact))
      rel = lambda m: np.linalg.norm(m - exact) / np.linalg.norm(exact)
      for damping in (1e-3, 1e-2, 1e-1):
        inv = lambda m: np.linalg.inv(m + damping * eye)
        irel = lambda m: (np.linalg.norm(inv(m) - inv(exact))
                          / np.linalg.norm(inv(exact)))
        e, k = dense["ekfac", name], dense["kronecker", name]
        print(f"{name:6s} {damping:7.0e}  {rel(e):13.4f}  {rel(k):12.4f}  "
              f"{irel(e):14.4f}  {irel(k):6.4f}")


def exact_fisher_block(params, batch, name):
  """The exact Fisher block of one dense parameter of ``scan_loss``."""
  def logits(w, x):
    p = {**params, name: w}
    h = jnp.tanh(x[None] @ p["inp"])
    def layer(h, q):
      return h + jnp.tanh(h @ q["w"] + q["b"]), None
    h, _ = lax.scan(layer, h, p["stack"])
    return (h @ p["out"])[0]
  w = params[name]
  jac = jax.vmap(jax.jacrev(logits), in_axes=(None, 0))(w, batch["x"])
  jac = np.asarray(jac.reshape(jac.shape[0], jac.shape[1], -1), np.float64)
  z = np.asarray(jax.vmap(lambda x: logits(w, x))(batch["x"]), np.float64)
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  h = np.vectorize(np.diag, signature="(k)->(k,k)")(p) - p[:, :, None] * p[:, None, :]
  return np.einsum("nkp,nkl,nlq->pq", jac, h, jac) / len(z)


def training_table(steps=40):
  """Loss of the scan model after ``steps`` steps of kfac + SGD-momentum."""
  params, batch = scan_params(), scan_batch()
  configs = {"kfac pi": dict(), "kfac exact": dict(damping_mode="exact"),
             "ekfac project": dict(blocks={"dense": "ekfac"}),
             "ekfac kfac-rebase": dict(blocks={"dense": lambda l: B.EkfacDense(
                 **{**vars(B.eigen_corrected(l.block)), "rebase": "kfac"})})}
  print(f"{'config':18s} " + " ".join(f"step {s:3d}" for s in (10, 20, steps)))
  for name, kw in configs.items():
    tx = optax.chain(kfl.kfac(scan_loss, batch, damping=1e-2, **kw),
                     optax.sgd(0.05, momentum=0.9))

    @jax.jit
    def step(p, state, tx=tx):
      loss, grads = jax.value_and_grad(scan_loss)(p, batch)
      updates, state = tx.update(grads, state, p, batch=batch)
      return optax.apply_updates(p, updates), state, loss

    p, state, losses = params, tx.init(params), []
    for _ in range(steps + 1):
      p, state, loss = step(p, state)
      losses.append(float(loss))
    print(f"{name:18s} " + " ".join(f"{losses[s]:8.4f}" for s in (10, 20, steps)))


if __name__ == "__main__":
  frobenius_table()
  training_table()
