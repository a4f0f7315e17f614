"""Tagging: clear errors on bad input, fallbacks with reasons, overrides."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from kfac_jax_lite import blocks as B
from kfac_jax_lite.tagging import describe, find_layers

P = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
X = jnp.ones((4, 3))


def loss(p, x):
  return jnp.mean((x @ p["w"] + p["b"]) ** 2)


def test_non_scalar_loss():
  with pytest.raises(ValueError, match="scalar loss"):
    find_layers(lambda p, x: x @ p["w"], P, X)


def test_aux_needs_has_aux():
  with pytest.raises(ValueError, match="has_aux"):
    find_layers(lambda p, x: (loss(p, x), 0.0), P, X)
  tl = find_layers(lambda p, x: (loss(p, x), x.sum()), P, X, has_aux=True)
  l, aux, _ = tl.apply(P, X, tl.zero_probes(P, X))
  np.testing.assert_allclose(aux, X.sum())


def test_batch_structure_differs():
  tl = find_layers(loss, P, X)
  with pytest.raises(ValueError, match="batch structure"):
    tl.apply(P, (X, X), {})


def test_params_not_arrays():
  with pytest.raises(TypeError, match="'w' is a str"):
    find_layers(loss, {"w": "oops", "b": P["b"]}, X)
  with pytest.raises(TypeError, match="floating-point"):
    find_layers(loss, {"w": jnp.ones((3, 2), jnp.int32), "b": P["b"]}, X)


def test_fallbacks_have_reasons():
  p = {"w": jnp.ones((3, 3)), "m": jnp.ones((2, 3)), "u": jnp.ones(2)}

  def f(p, x):
    h = x @ p["w"] + jnp.sum(p["w"] ** 2)                       # regulariser
    h = h @ p["m"].reshape(3, 2)                                # merging reshape
    return jnp.mean(h ** 2)
  rows = describe(f, p, X)
  kinds = {r.name: (r.kind, r.block, r.notes) for r in rows}
  assert kinds["w"][:2] == ("fallback", "NaiveDiagonal")
  assert "integer_pow" in kinds["w"][2]
  assert kinds["m"][0] == "fallback" and "reshape" in kinds["m"][2]
  assert kinds["u"] == ("fallback", "NaiveDiagonal", "no layer pattern uses it")
  assert "no layer pattern" in str(rows)


def test_incompatible_kinds_fallback():
  p = {"w": jnp.ones((3, 3))}   # a dense kernel also used as an elementwise scale

  def f(p, x):
    return jnp.mean((x @ p["w"]) ** 2) + jnp.mean((x[:, :, None] * p["w"]) ** 2)
  (row,) = describe(f, p, X)
  assert row.kind == "fallback", row
  assert row.notes == "used as dense and scale/shift (incompatible layer kinds)"


def test_overrides_and_exclude():
  tl = find_layers(loss, P, X, blocks={"w": "diagonal"})
  assert type(tl.layers[0].block).__name__ == "DiagonalDense"
  tl = find_layers(loss, P, X, blocks={"dense": "full"})
  assert isinstance(tl.layers[0].block, B.Full)
  tl = find_layers(loss, P, X, blocks={"dense": {"weight_sharing": "reduce"}})
  assert tl.layers[0].block.weight_sharing == "reduce"
  tl = find_layers(loss, P, X, exclude=("b",))
  assert tl.excluded == ("b",)
  assert [(l.kind, l.params) for l in tl.layers] == [("fallback", ("w",))]
  # A Full override gets per-example gradients as its data.
  tl = find_layers(loss, P, X, blocks={"w": "full"})
  l, _, caps, vjp = tl.value_and_stats_inputs(P, X)
  _, cts = vjp(jnp.ones_like(l))
  (grads,) = tl.layer_data(caps, {k: v * 4 for k, v in cts.items()})["w"]
  ref = jax.vmap(lambda x: jax.grad(loss)(P, x[None]))(X)
  np.testing.assert_allclose(grads[0], ref["w"], rtol=1e-5)
  # Its statistics: the mean over examples of γ_i γ_iᵀ.
  gamma = np.concatenate([np.asarray(ref[k], np.float64).reshape(4, -1)
                          for k in tl.layers[0].params], 1)
  assert gamma.shape[1] == sum(np.size(P[k]) for k in tl.layers[0].params)
  np.testing.assert_allclose(tl.layers[0].block.compute_stats(grads),
                             gamma.T @ gamma / 4, rtol=1e-5, atol=1e-7)


def test_while_loop_layer_is_reported():
  p = {"w": jnp.ones((3, 3))}

  def f(p, x):
    y = lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] @ p["w"]),
                       (0, x))[1]
    return jnp.mean(lax.stop_gradient(y))
  (row,) = describe(f, p, X)
  assert row.kind == "fallback" and "while_loop" in row.notes
