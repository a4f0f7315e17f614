"""float64 end to end (``jax_enable_x64``): the public API keeps float64.

Every test runs inside ``x64_mode(True)`` with float64 parameters and data.
The whole ``kfl.kfac`` transform is compared with a brute-force K-FAC built
from per-example Jacobians (``jax.jacfwd``) in numpy float64, to 1e-10
relative: any float32 rounding on the way (factors, damping, loss weights
``c_i``, ``√(c_e/c_i)``, the distributions' square roots) would show up as
~1e-7.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import kfac_jax_lite as kfl
from _brute import partitioned
from _helpers import block_stats, x64_mode
from kfac_jax_lite.losses import distributions as dists

SIZES = (4, 5, 3)
N = 6
LAM = 0.1
RTOL = 1e-10


def params64(dtype=jnp.float64):
  keys = jax.random.split(jax.random.PRNGKey(0), len(SIZES) - 1)
  return [{"w": jax.random.normal(k, (a, b), dtype) / np.sqrt(a),
           "b": 0.1 * jnp.ones(b, dtype)}
          for k, a, b in zip(keys, SIZES[:-1], SIZES[1:])]


def batch64(dtype=jnp.float64):
  x = jax.random.normal(jax.random.PRNGKey(1), (N, SIZES[0]), dtype)
  return {"x": x, "y": jnp.argmax(x[:, :SIZES[-1]], -1),
          "t": jnp.sin(x[:, :SIZES[-1]])}


def net(params, x):
  """Logits and the pre-activations ``s_l`` and inputs ``h_l`` of each layer."""
  hs, ss, h = [], [], x
  for i, p in enumerate(params):
    hs.append(h)
    s = h @ p["w"] + p["b"]
    ss.append(s)
    h = jnp.tanh(s) if i < len(params) - 1 else s
  return h, hs, ss


def classifier_loss(params, batch):
  return kfl.softmax_cross_entropy_with_integer_labels(
      net(params, batch["x"])[0], batch["y"]).mean()


def registered_mse(params, batch):
  return kfl.squared_error(net(params, batch["x"])[0], batch["t"]).mean()


def handwritten_mse(params, batch):  # Recognised as registered_mse (#23).
  return jnp.mean((net(params, batch["x"])[0] - batch["t"]) ** 2)


def opaque_mse(params, batch):
  """The same loss computed in a lax.scan step, which the recognition does
  not enter: no elements to see."""
  step = lambda c, _: (c, handwritten_mse(params, batch))
  return jax.lax.scan(step, 0.0, None, length=1)[1][0]


def rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.linalg.norm(got - want) / np.linalg.norm(want)


def brute_factors(params, batch, mode):
  """Per layer ``(A, G)`` from per-example Jacobians ``∂logits/∂s_l``.

  ``exact``: ``G = Σ_i c_i J_iᵀ M_i J_i`` with the softmax Fisher ``M_i``;
  ``per_example``: ``G = Σ_i c_i ∇_{s}ℓ_i ∇_{s}ℓ_iᵀ`` of the per-example mean
  squared error ``ℓ_i = mean_k (o_ik - t_ik)²`` (what ``"empirical"`` gives
  a loss it cannot see the elements of); ``empirical``: the registered
  (or recognised) loss's, ``G = Σ_i c_i h_i h_iᵀ`` with ``h_i = Σ_k √(c_ik/c_i) ∇_{s}ℓ_ik``
  over the C elements ``ℓ_ik = (o_ik - t_ik)²`` of weight ``c_ik = 1/(NC)``
  ("fisher" with the data's targets). ``c_i = 1/N``.
  """
  logits, hs, ss = net(params, batch["x"])
  out = []
  for l, (h, s) in enumerate(zip(hs, ss)):
    def rest(s_i, l=l):  # The network from layer l's pre-activation on.
      o = s_i
      for j in range(l + 1, len(params)):
        o = jnp.tanh(o) @ params[j]["w"] + params[j]["b"]
      return o
    jac = np.asarray(jax.jit(jax.vmap(jax.jacfwd(rest)))(s), np.float64)  # [N, C, b]
    a = np.concatenate([np.asarray(h), np.ones((N, 1))], 1)
    big_a = a.T @ a / N
    if mode == "exact":
      p = np.asarray(jax.nn.softmax(logits), np.float64)
      m = np.stack([np.diag(q) - np.outer(q, q) for q in p])
      big_g = np.einsum("nci,ncd,ndj->ij", jac, m, jac) / N
    else:
      c = logits.shape[1]
      r = 2 * (np.asarray(logits) - np.asarray(batch["t"]))  # ∇_o ℓ_ik
      r = r / c if mode == "per_example" else r / np.sqrt(c)
      grad_s = np.einsum("nc,nci->ni", r, jac)  # ∇_s ℓ_i, or h_i
      big_g = grad_s.T @ grad_s / N
    out.append((big_a, big_g))
  return out


def brute_update(params, grads, batch, mode, damping_mode,
                 max_dense_side=None, side_block=None):
  """The K-FAC update from ``brute_factors``; a side larger than
  ``max_dense_side`` keeps only its diagonal (the size policy; the input
  side counted without the bias's row), one larger than ``side_block``
  only its diagonal blocks (``_brute.partitioned``)."""
  updates = []
  for (big_a, big_g), g in zip(brute_factors(params, batch, mode), grads):
    v = np.concatenate([np.asarray(g["w"]), np.asarray(g["b"])[None]], 0)
    a, b = v.shape
    if max_dense_side is not None:
      big_a = np.diag(np.diag(big_a)) if a - 1 > max_dense_side else big_a
      big_g = np.diag(np.diag(big_g)) if b > max_dense_side else big_g
    if side_block is not None:
      big_a = partitioned(big_a, a - 1, side_block)
      big_g = partitioned(big_g, b, side_block)
    if damping_mode == "exact":
      curv = np.kron(big_a, big_g) + LAM * np.eye(a * b)
    else:
      pi = np.sqrt((np.trace(big_a) / a) / (np.trace(big_g) / b))
      curv = np.kron(big_a + pi * np.sqrt(LAM) * np.eye(a),
                     big_g + np.sqrt(LAM) / pi * np.eye(b))
    u = np.linalg.solve(curv, v.ravel()).reshape(a, b)
    updates.append({"w": u[:-1], "b": u[-1]})
  return updates


@functools.lru_cache(maxsize=None)
def _update_fn(loss_name, estimation, damping_mode, max_dense_side=None,
               side_block=None):
  loss_fn = {"classifier": classifier_loss, "registered_mse": registered_mse,
             "handwritten_mse": handwritten_mse,
             "opaque_mse": opaque_mse}[loss_name]
  options = {k: v for k, v in (("max_dense_side", max_dense_side),
                               ("side_block", side_block)) if v is not None}
  blocks = {"dense": options} if options else None
  tx = kfl.kfac(loss_fn, batch64(), damping=LAM, estimation=estimation,
                damping_mode=damping_mode, norm_constraint=None,
                blocks=blocks)

  def first_update(params, batch):
    grads = jax.grad(loss_fn)(params, batch)
    return tx.update(grads, tx.init(params), params, batch=batch)
  return loss_fn, jax.jit(first_update)


@pytest.mark.parametrize("loss_name,estimation,damping_mode", [
    ("classifier", "exact", "pi"),
    ("classifier", "exact_ggn", "exact"),
    ("registered_mse", "empirical", "pi"),
    ("opaque_mse", "empirical", "exact"),
])
def test_kfac_update_matches_brute_force_in_float64(loss_name, estimation,
                                                   damping_mode):
  with x64_mode(True):
    params, batch = params64(), batch64()
    loss_fn, update = _update_fn(loss_name, estimation, damping_mode)
    grads = jax.grad(loss_fn)(params, batch)
    updates, state = update(params, batch)
    assert all(x.dtype == jnp.float64 for x in jax.tree.leaves(updates))
    floats = [x for x in jax.tree.leaves(state.blocks)
              if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and all(x.dtype == jnp.float64 for x in floats)
    mode = {"classifier": "exact", "registered_mse": "empirical",
            "opaque_mse": "per_example"}[loss_name]
    want = brute_update(params, grads, batch, mode, damping_mode)
    for got_layer, want_layer in zip(updates, want):
      for k in ("w", "b"):
        assert rel_err(got_layer[k], want_layer[k]) < RTOL, (k, rel_err(
            got_layer[k], want_layer[k]))


@pytest.mark.parametrize("options,shapes", [
    ({"max_dense_side": 4}, [((1, 5, 5), (1, 5)), ((1, 6), (1, 3, 3))]),
    ({"side_block": 2}, [((1, 2, 3, 3), (1, 3, 2, 2)),
                         ((1, 3, 2, 2), (1, 2, 2, 2))]),
], ids=["size_policy", "partitioned"])
@pytest.mark.parametrize("damping_mode", ["pi", "exact"])
def test_block_policies_update_matches_brute_force_in_float64(
    options, shapes, damping_mode):
  """The size policy and partitioned sides through ``kfl.kfac``, in both
  damping modes; the update is the brute-force damped inverse built from
  per-example Jacobians with the same sides. ``max_dense_side=4``: layer
  0's output side of 5 and layer 1's input side (5 inputs and the bias)
  keep only their diagonals, while layer 0's input side (4 inputs and the
  bias: the bias's row is not counted) and layer 1's output side of 3 stay
  dense (``A ⊗ diag(G)`` and ``diag(A) ⊗ G``). ``side_block=2``: layer 0's
  input side (4 inputs and the bias) in 2 blocks of 3 (one padded row),
  its output side of 5 in 3 blocks of 2 (one padded); layer 1's input side
  (5 and the bias) in 3 blocks of 2, its output side of 3 in 2 blocks of
  2: the block-diagonal parts of ``A`` and ``G``, the π trace over the
  real rows."""
  with x64_mode(True):
    params, batch = params64(), batch64()
    loss_fn, update = _update_fn("classifier", "exact", damping_mode,
                                 **options)
    grads = jax.grad(loss_fn)(params, batch)
    updates, state = update(params, batch)
    got_shapes = [tuple(s.cov.shape for s in b)
                  for b in state.blocks.values()]
    assert sorted(got_shapes) == shapes, got_shapes
    want = brute_update(params, grads, batch, "exact", damping_mode,
                        **options)
    for got_layer, want_layer in zip(updates, want):
      for k in ("w", "b"):
        assert rel_err(got_layer[k], want_layer[k]) < RTOL, (k, rel_err(
            got_layer[k], want_layer[k]))


def test_empirical_fisher_of_a_registered_loss_and_of_one_written_by_hand():
  """``kfl.squared_error(o, t).mean()`` over C outputs: the registered
  loss's elements are seen, so "empirical" is "fisher" at the data
  targets; ``jnp.mean((o - t) ** 2)`` is recognised as that loss (issue
  23) and gets the same; the same loss where no elements can be seen (in a
  scan step) gets the per-example-gradient statistics, 1/C of them; the
  input factors are the same (also in float32)."""
  for enabled in (False, True):
    with x64_mode(enabled):
      dtype = jnp.float64 if enabled else jnp.float32
      params, batch = params64(dtype), batch64(dtype)
      fns = [kfl.value_grad_and_stats(fn, params, batch, estimation="empirical")
             for fn in (registered_mse, handwritten_mse, opaque_mse)]
      stats = jax.jit(lambda p, b, k: [fn(p, b, k).stats for fn in fns])(
          params, batch, jax.random.PRNGKey(0))  # One compile for all.
      tol = 1e-12 if enabled else 1e-5
      for name in block_stats(stats[0]):  # Not the run entry (the loss).
        reg, hand, opaque = (s[name] for s in stats)
        assert reg.g.dtype == hand.g.dtype == opaque.g.dtype == dtype
        assert rel_err(reg.a, opaque.a) < tol, name
        assert rel_err(reg.g, SIZES[-1] * opaque.g) < tol, name
        assert rel_err(reg.a, hand.a) < tol, name
        assert rel_err(reg.g, hand.g) < tol, name
      # And both equal their brute force.
      if enabled:
        for mode, got in (("empirical", stats[0]), ("per_example", stats[2])):
          for (big_a, big_g), name in zip(brute_factors(params, batch, mode),
                                          sorted(got)):
            assert rel_err(got[name].g[0], big_g) < RTOL, (mode, name)
            assert rel_err(got[name].a[0], big_a) < RTOL, (mode, name)


LOSSES = {
    "softmax_cross_entropy": lambda o, b: kfl.softmax_cross_entropy(
        o, jax.nn.one_hot(b["y"], o.shape[-1], dtype=o.dtype)),
    "integer_labels": lambda o, b: kfl.softmax_cross_entropy_with_integer_labels(
        o, b["y"]),
    "sigmoid_binary_cross_entropy": lambda o, b: kfl.sigmoid_binary_cross_entropy(
        o, (b["t"] > 0).astype(o.dtype)),
    "squared_error": lambda o, b: kfl.squared_error(o, b["t"]),
    "l2_loss": lambda o, b: kfl.l2_loss(o, b["t"]),
    "gaussian_nll": lambda o, b: kfl.gaussian_nll(
        o, jax.nn.softplus(o) + 0.5, b["t"]),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_every_loss_and_estimation_keeps_float64(name):
  """Every registered loss (and so every distribution's ``sample``,
  ``fisher_sqrt`` and ``ggn_sqrt``) in every estimation mode: float64
  statistics, and one-layer ``exact_ggn`` statistics equal to the
  brute-force ``G = Σ_i c_i J_iᵀ H_i⁺ J_i`` (``H_i`` the output Hessian)."""
  with x64_mode(True):
    params = params64()[:1]
    batch = batch64()
    batch = dict(batch, y=batch["y"] % SIZES[1], t=jnp.concatenate(
        [batch["t"], batch["t"][:, :2]], 1)[:, :SIZES[1]])

    def loss_fn(p, b):
      return LOSSES[name](b["x"] @ p[0]["w"] + p[0]["b"], b).mean()

    fns = {e: kfl.value_grad_and_stats(loss_fn, params, batch, estimation=e)
           for e in kfl.ESTIMATIONS}
    # Every mode in one compiled program: one compile per loss, not six.
    ests = jax.jit(lambda p, b, k: {e: fn(p, b, k) for e, fn in fns.items()})(
        params, batch, jax.random.PRNGKey(2))
    for estimation, est in ests.items():
      leaves = jax.tree.leaves((est.stats, est.grads, est.loss, est.weights))
      assert all(x.dtype == jnp.float64 for x in leaves), estimation
      assert all(np.all(np.isfinite(x)) for x in leaves), estimation
    got = ests["exact_ggn"].stats[next(iter(ests["exact_ggn"].stats))].g[0]
    # Brute force: per example, the PSD part of the Hessian of L w.r.t. the
    # layer output s_i (one layer: the model output o is s, or (s,
    # softplus(s)+½) for gaussian_nll, whose GGN is Jᵀ H⁺ J with J of the
    # head), summed over the examples; L = Σ_i c_i ℓ_i so c_i is inside.
    s = batch["x"] @ params[0]["w"] + params[0]["b"]

    def loss_of_outputs(o, i):  # Example i's outputs o, the others fixed.
      if name == "gaussian_nll":
        return jnp.sum(kfl.gaussian_nll(
            o[0], o[1], batch["t"][i]) / (N * SIZES[1]))
      return LOSSES[name](s.at[i].set(o), batch).mean()
    hessian = jax.jit(jax.hessian(loss_of_outputs))  # One compile, N calls.
    want = 0.0
    for i in range(N):
      if name == "gaussian_nll":
        o = (s[i], jax.nn.softplus(s[i]) + 0.5)
        h = hessian(o, i)
        hm = np.block([[np.asarray(h[r][c]) for c in range(2)] for r in range(2)])
        jac = np.concatenate([np.eye(SIZES[1]), np.diag(np.asarray(
            jax.nn.sigmoid(s[i])))], 0)
      else:
        hm = np.asarray(hessian(s[i], i))
        jac = np.eye(SIZES[1])
      w, q = np.linalg.eigh((hm + hm.T) / 2)
      hplus = (q * np.maximum(w, 0)) @ q.T
      want = want + jac.T @ hplus @ jac
    # G = Σ_i c_i G_i where L's per-example Hessians already carry c_i.
    assert rel_err(got, want) < RTOL


def test_kfac_optimizer_keeps_float64_and_solves_its_model_exactly():
  """One step: α = -gᵀΔ / Δᵀ(GGN + λ)Δ against a dense float64 GGN, 1e-9."""
  with x64_mode(True):
    params, batch = params64(), batch64()
    tx = kfl.kfac_optimizer(classifier_loss, batch, initial_damping=LAM)
    state = tx.init(params)
    grads = jax.grad(classifier_loss)(params, batch)
    step, state = jax.jit(tx.update)(grads, state, params, batch=batch)
    leaves = [x for x in jax.tree.leaves((step, state))
              if jnp.issubdtype(x.dtype, jnp.floating)]
    assert all(x.dtype == jnp.float64 for x in leaves)
    flat, unravel = ravel_pytree(params)
    jac = jax.jacfwd(lambda f: net(unravel(f), batch["x"])[0])(flat)  # [N, C, P]
    root = dists.Categorical(True).fisher_sqrt((net(params, batch["x"])[0],))[0]
    m = jnp.einsum("nck,ndk->ncd", root, root)
    ggn = np.asarray(jnp.einsum("ncp,ncd,ndq->pq", jac, m, jac) / N)
    g = np.asarray(ravel_pytree(grads)[0])
    s = np.asarray(ravel_pytree(step)[0])
    alpha = float(state.learning_rate)
    delta = s / alpha
    want = -(g @ delta) / (delta @ (ggn + LAM * np.eye(len(g))) @ delta)
    assert abs(alpha - want) < 1e-9 * abs(want)


def test_pmap_path_keeps_float64():
  """``axis_name`` under ``pmap`` (one CPU device): pmean of the statistics,
  owner-split refresh and psum of the caches, all in float64, equal to the
  brute-force update (and so to the unmapped one, checked above)."""
  with x64_mode(True):
    params, batch = params64(), batch64()
    txp = kfl.kfac(classifier_loss, batch, damping=LAM, estimation="exact",
                   norm_constraint=None, axis_name="i")
    grads = jax.grad(classifier_loss)(params, batch)
    want = brute_update(params, grads, batch, "exact", "pi")
    rep = lambda t: jax.tree.map(lambda x: x[None], t)
    got, state = jax.pmap(lambda g, s, p, b: txp.update(g, s, p, batch=b),
                          axis_name="i")(rep(grads), rep(txp.init(params)),
                                         rep(params), rep(batch))
    assert all(x.dtype == jnp.float64 for x in jax.tree.leaves(got))
    for got_layer, want_layer in zip(got, want):
      for k in ("w", "b"):
        assert rel_err(got_layer[k][0], want_layer[k]) < RTOL, k
    assert kfl.health(state).ok
