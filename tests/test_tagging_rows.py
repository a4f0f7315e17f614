"""Rows that are not examples, against brute force in float64.

A graph network (``_tagging_models.gnn``: an edge layer, messages summed
per node, a node layer and an embedding of node types, a readout pooled
per graph with ``jax.ops.segment_sum``) has one loss example per graph and
a row per node or edge; a position table looked up with
``jnp.arange(T)[None]`` (or ``jnp.broadcast_to``) has one row for the
whole batch. The references are written from the per-example Jacobians of
the model outputs in a perturbation of each layer output (``exact``
estimation, so ``G`` has no sampling error):

* "expand" — every row ``r`` a use of its example ``i(r)``:
  ``A = Σ_r ρ_r ā_r ā_rᵀ`` (``ρ_r ∝ c_i(r)``) and
  ``G = Σ_r c_i(r) J_rᵀ M J_r``;
* "reduce" — each example's rows summed first: ``ã_i`` their mean,
  ``G = Σ_i c_i (Σ_r J_r)ᵀ M (Σ_r J_r)``.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import _tagging_models as M
import kfac_jax_lite as kfl
from _helpers import x64_mode


def _fisher(logits):
  """``M`` per example of a softmax cross-entropy: diag(p) − p pᵀ."""
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("...i,ij->...ij", p, np.eye(p.shape[-1])) - \
      p[..., :, None] * p[..., None, :]


@functools.lru_cache(maxsize=None)
def _gnn_stats(mode, mask=None):
  with x64_mode(True):
    loss, p, batch = M.gnn(jnp.float64)
    if mask is not None:
      batch = dict(batch, mask=jnp.asarray(mask, jnp.float64))
    fn = kfl.value_grad_and_stats(loss, p, batch, estimation="exact",
                                  weight_sharing=mode)
    est = jax.jit(fn)(p, batch, jax.random.key(0))  # Not eager: one compile.
    rows = kfl.describe(loss, p, batch, weight_sharing=mode)
    return jax.tree.map(np.asarray, est.stats), rows, np.asarray(est.weights)


def _gnn_reference(mode, mask=None):
  with x64_mode(True):
    _, p, batch = M.gnn(jnp.float64)
    if mask is not None:
      batch = dict(batch, mask=jnp.asarray(mask, jnp.float64))
    # Jacobians of the logits [G, C] in each layer's output (perturbed).
    eps = M.gnn_eps(p, batch)
    logits = np.asarray(M.gnn_logits(p, batch, eps), np.float64)
    jac = jax.jacrev(lambda e: M.gnn_logits(p, batch, e))(eps)
    inputs = {k: np.asarray(v) for k, v in M.gnn_inputs(p, batch).items()}
  c = np.asarray(batch["mask"], np.float64)
  c = c / c.sum()
  mf = _fisher(logits)
  node_ex = np.asarray(batch["node_graph"])
  ex = {"edge": node_ex[np.asarray(batch["receivers"])], "node": node_ex,
        "type": node_ex}
  ex["node"] = np.where(ex["node"] < c.size, ex["node"], -1)
  ex["type"] = ex["node"]
  ref = {}
  for name in ("edge", "node", "type"):
    j = np.asarray(jac[name], np.float64)      # [G, C, R, H]
    e = ex[name]
    ok = e >= 0
    jr = np.where(ok[:, None, None], j[np.clip(e, 0, None), :,
                                        np.arange(e.size)], 0)  # [R, C, H]
    a = inputs[name]
    if name != "type":
      a = np.concatenate([a, np.ones((a.shape[0], 1))], 1)
    cr = np.where(ok, c[np.clip(e, 0, None)], 0)
    if mode == "expand" or name == "type":   # Embeddings: expand always.
      big_g = np.einsum("r,rci,rcd,rdj->ij", cr, jr, mf[np.clip(e, 0, None)],
                        jr)
      if name == "type":
        a_fac = np.zeros(M.GNN_TYPES)
        np.add.at(a_fac, a, cr / cr.sum())
      else:
        a_fac = np.einsum("r,ri,rj->ij", cr / cr.sum(), a, a)
    else:
      g_hat = np.zeros((c.size,) + jr.shape[1:])
      a_sum = np.zeros((c.size, a.shape[1]))
      count = np.zeros(c.size)
      np.add.at(g_hat, e[ok], jr[ok])
      np.add.at(a_sum, e[ok], a[ok])
      np.add.at(count, e[ok], 1)
      a_bar = a_sum / np.maximum(count, 1)[:, None]
      w = np.where(count > 0, c, 0)
      w = w / w.sum()
      big_g = np.einsum("n,nci,ncd,ndj->ij", c, g_hat, mf, g_hat)
      a_fac = np.einsum("n,ni,nj->ij", w, a_bar, a_bar)
    ref[name] = (a_fac, big_g)
  return ref


@pytest.mark.parametrize("mode", ["expand", "reduce"])
def test_graph_network_rows_against_brute_force(mode):
  stats, rows, weights = _gnn_stats(mode)
  names = {"edge": "edge/w", "node": "node/w", "type": "type"}
  by_name = {r.name: r for r in rows}
  assert all(r.kind != "fallback" for r in rows), str(rows)
  for key in ("edge", "node", "type"):
    assert by_name[names[key]].sharing == f"{mode} (rows)", str(rows)
  assert by_name["read/w"].sharing == mode
  ref = _gnn_reference(mode)
  for key, (a_ref, g_ref) in ref.items():
    st = stats[names[key]]
    np.testing.assert_allclose(st.a[0], a_ref, rtol=1e-10, atol=1e-12,
                               err_msg=key)
    np.testing.assert_allclose(st.g[0], g_ref, rtol=1e-10, atol=1e-12,
                               err_msg=key)
  # The masked graph weighs nothing; the weights are the loss's, per graph.
  assert weights.shape == (M.GNN_G,) and weights[-1] == 0


@pytest.mark.parametrize("mode", ["expand", "reduce"])
def test_a_dropped_segment_id_beside_a_weighted_graph(mode):
  """The last node's graph id (4) is out of range for ``num_segments=4``:
  ``segment_sum`` drops it, so its rows belong to no example. Here every
  graph weighs (the default fixture masks graph 3, the only neighbour a
  dropped row could be folded into, hiding that bug): the statistics still
  equal brute force, which gives the dropped rows no weight (issue 38)."""
  mask = (1.0, 0.5, 1.0, 2.0)
  stats, _, weights = _gnn_stats(mode, mask)
  assert np.all(weights > 0)
  names = {"edge": "edge/w", "node": "node/w", "type": "type"}
  for key, (a_ref, g_ref) in _gnn_reference(mode, mask).items():
    st = stats[names[key]]
    np.testing.assert_allclose(st.a[0], a_ref, rtol=1e-10, atol=1e-12,
                               err_msg=key)
    np.testing.assert_allclose(st.g[0], g_ref, rtol=1e-10, atol=1e-12,
                               err_msg=key)


def test_graph_network_trains_with_kfac():
  loss, p, batch = M.gnn()
  tx = optax.chain(kfl.kfac(loss, batch), optax.sgd(0.05))
  state = tx.init(p)

  @jax.jit
  def step(p, state):
    value, g = jax.value_and_grad(loss)(p, batch)
    u, state = tx.update(g, state, p, batch=batch)
    return optax.apply_updates(p, u), state, value
  values = []
  for _ in range(5):
    p, state, value = step(p, state)
    values.append(float(value))
  assert np.all(np.isfinite(values)) and values[-1] < values[0], values


def _pos_jac(form, mode):
  """Library and brute-force statistics of a broadcast position table."""
  with x64_mode(True):
    loss, p, batch = M.pos_lookup(form, jnp.float64)
    fn = kfl.value_grad_and_stats(loss, p, batch, estimation="exact",
                                  weight_sharing=mode)
    st = jax.tree.map(np.asarray, jax.jit(fn)(  # Jitted: one compile.
        p, batch, jax.random.key(0)).stats["wpe"])
    ids, _ = batch
    n, t = ids.shape
    eps = jnp.zeros((n, t, p["wpe"].shape[1]), jnp.float64)
    logits = np.asarray(M.pos_logits(p, ids, eps), np.float64)
    jac = np.asarray(jax.jacrev(lambda e: M.pos_logits(p, ids, e))(eps),
                     np.float64)   # [N, T, C, N, T, D]
  mf = _fisher(logits)               # [N, T, C, C]
  c = 1.0 / (n * t)                  # A mean over tokens.
  idx = np.arange(n)
  jj = jac[idx, :, :, idx]           # [N, T', C, T, D]: own example only
  if mode == "expand":
    g_ref = c * np.einsum("nectd,necf,neftj->dj", jj, mf, jj)
    a_ref = np.full(t, 1.0 / t)
  else:
    js = jj.sum(3)
    g_ref = c * np.einsum("necd,necf,nefj->dj", js, mf, js)
    a_ref = np.full(t, 1.0 / t ** 2)
  return st, a_ref, g_ref


@pytest.mark.parametrize("form", ["none", "broadcast_to"])
@pytest.mark.parametrize("mode", ["expand", "reduce"])
def test_broadcast_position_lookup_against_brute_force(form, mode):
  st, a_ref, g_ref = _pos_jac(form, mode)
  np.testing.assert_allclose(st.a[0], a_ref, rtol=1e-12, atol=1e-14)
  np.testing.assert_allclose(st.g[0], g_ref, rtol=1e-10, atol=1e-13)


def test_broadcast_position_lookup_trains_with_kfac():
  loss, p, batch = M.pos_lookup("none")
  rows = kfl.describe(loss, p, batch)
  assert {r.name: r.sharing for r in rows}["wpe"] == "expand", str(rows)
  tx = optax.chain(kfl.kfac(loss, batch), optax.sgd(0.05))
  state = tx.init(p)
  g = jax.grad(loss)(p, batch)
  u, state = jax.jit(lambda g, s, p: tx.update(g, s, p, batch=batch))(
      g, state, p)
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(u))
