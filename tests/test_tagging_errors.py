"""Tagging: clear errors on bad input, fallbacks with reasons, overrides."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import kfac_jax_lite as kfl
from kfac_jax_lite import blocks as B
from kfac_jax_lite.estimators import describe
from kfac_jax_lite.tagging import find_layers

P = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
X = jnp.ones((4, 3))


def loss(p, x):
  return jnp.mean((x @ p["w"] + p["b"]) ** 2)


def test_non_scalar_loss():
  with pytest.raises(ValueError, match="scalar loss"):
    find_layers(lambda p, x: x @ p["w"], P, X)


def test_a_loss_that_uses_a_params_hole_names_the_filtered_model():
  """Params holding None where the loss expects a function (a filtered
  Equinox model): the trace's TypeError gets the reason and the fix; a
  TypeError of a loss whose params hold no None is left as it is."""
  holed = {"w": P["w"], "b": P["b"], "act": None}
  uses_hole = lambda p, x: jnp.mean(p["act"](x @ p["w"] + p["b"]) ** 2)
  with pytest.raises(TypeError, match=r"hold None in 1 place.*eqx\.combine"):
    find_layers(uses_hole, holed, X)
  broken = lambda p, x: None(x)  # noqa: E731  (its own TypeError)
  with pytest.raises(TypeError, match="not callable") as info:
    find_layers(broken, P, X)
  assert "eqx" not in str(info.value)


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
  assert row.notes == "used as dense and scale_and_shift (incompatible layer kinds)"


def test_overrides_and_exclude():
  tl = find_layers(loss, P, X)
  blocks = lambda o: [l.block for l in tl.with_blocks(o).layers]
  assert isinstance(blocks({"w": "diagonal"})[0], B.DiagonalDense)
  assert isinstance(blocks({"dense": "full"})[0], B.Full)
  assert blocks({"dense": {"weight_sharing": "reduce"}})[0].weight_sharing == "reduce"
  with pytest.raises(ValueError, match="no option 'bogus'.*weight_sharing"):
    blocks({"dense": {"bogus": 1}})
  with pytest.raises(ValueError, match="unknown block choice 'kfac'"):
    blocks({"dense": "kfac"})
  tl_ex = find_layers(loss, P, X, exclude=("b",))
  assert tl_ex.excluded == ("b",)
  assert [(l.kind, l.params) for l in tl_ex.layers] == [("fallback", ("w",))]
  # A fallback only has parameter gradients: a block that needs layer
  # inputs is refused with the reason.
  with pytest.raises(ValueError, match="consumes activations.*gradients"):
    tl_ex.with_blocks({"fallback": B.KroneckerDense((3, 2))})


def test_an_override_that_matches_nothing_is_an_error():
  """A ``blocks=`` key must name a layer kind or match a parameter path of
  a detected layer: ``{"l0": ...}`` for the parameters ``l0/w``, ``l0/b``
  used to be ignored without a word. The error names the key, the paths
  and the pattern that would match; a kind with no layer of its own in
  this model (a conv override on an MLP) stays allowed."""
  params = {"l0": P}
  nested = lambda p, x: loss(p["l0"], x)
  tl = find_layers(nested, params, X)
  with pytest.raises(ValueError, match=r"blocks= key 'l0' .*l0/w.*'l0/\*'"):
    tl.with_blocks({"l0": "diagonal"})
  assert isinstance(tl.with_blocks({"l0/*": "diagonal"}).layers[0].block,
                    B.DiagonalDense)
  assert isinstance(tl.with_blocks({"conv": "diagonal"}).layers[0].block,
                    B.KroneckerDense)
  excluded = find_layers(nested, params, X, exclude=("l0/b",))
  with pytest.raises(ValueError, match="excluded parameters have no block"):
    excluded.with_blocks({"l0/b": "full"})


def _mlp(n):
  """``n`` dense layers ``l0 .. l{n-1}`` (``lk/w``, ``lk/b``) on ``X``."""
  params = {f"l{k}": {"w": jnp.ones((3, 3)), "b": jnp.zeros(3)}
            for k in range(n)}

  def f(p, x):
    for k in range(n):
      x = jnp.tanh(x @ p[f"l{k}"]["w"] + p[f"l{k}"]["b"])
    return jnp.mean(x ** 2)
  return f, params


def test_an_exclude_pattern_that_matches_nothing_is_an_error():
  """Issue 48.4: ``exclude=["l9"]`` on ``l0/w, l0/b, l1/w, l1/b`` was
  accepted and excluded nothing. Every entry that takes ``exclude=``
  traces through ``find_layers``, which refuses it naming the pattern and
  the nearest paths (under a prefix, with the pattern that takes them); a
  pattern that matches still excludes."""
  f, params = _mlp(2)
  with pytest.raises(ValueError, match=r"exclude= pattern 'l9' matches no "
                     r"parameter.*nearest of its 4 paths: .*l0/w"):
    find_layers(f, params, X, exclude=["l9"])
  with pytest.raises(ValueError, match=r"'l0' matches no.*l0/b, l0/w.*"
                     r"'l0/\*'"):
    find_layers(f, params, X, exclude=["l1/w", "l0"])
  entries = {
      "describe": lambda ex: kfl.describe(f, params, X, exclude=ex),
      "value_grad_and_stats": lambda ex: kfl.value_grad_and_stats(
          f, params, X, exclude=ex),
      "kfac": lambda ex: kfl.kfac(f, X, exclude=ex).init(params),
      "kfac_optimizer": lambda ex: kfl.kfac_optimizer(
          f, X, exclude=ex).init(params),
      "eigen_adam": lambda ex: kfl.eigen_adam(f, X, exclude=ex).init(params),
      "influence.fit": lambda ex: kfl.influence.fit(
          f, params, [X], exclude=ex, progress=False),
  }
  for entry in entries.values():
    with pytest.raises(ValueError, match="exclude= pattern 'l9'"):
      entry(["l9"])
  assert find_layers(f, params, X, exclude=["l0/*"]).excluded == (
      "l0/b", "l0/w")


def test_a_blocks_key_that_matches_nothing_names_the_nearest_paths():
  """A mistyped ``blocks=`` key on a model of many layers names the paths
  it is nearest to, not the model's first twelve."""
  f, params = _mlp(8)
  tl = find_layers(f, params, X)
  with pytest.raises(ValueError, match=r"blocks= key 'l7/W' .*nearest of "
                     r"its 16 paths: l7/w"):
    tl.with_blocks({"l7/W": "diagonal"})


def test_full_override_gets_per_example_gradients():
  c = jnp.array([0.1, 0.2, 0.3, 0.4])   # loss weights c_i (not summing to 1)
  tl = find_layers(loss, P, X).with_blocks({"w": "full"})
  probes = tl.zero_probes(P, X)
  caps = tl.apply(P, X, probes)[2]
  cts = jax.grad(lambda pr: tl.apply(P, X, pr)[0])(probes)
  data = tl.layer_data(caps, {k: v * 4 for k, v in cts.items()}, c)["w"]
  assert data.inputs is None and data.cotangents is None
  ref = jax.vmap(lambda x: jax.grad(loss)(P, x[None]))(X)
  np.testing.assert_allclose(data.grads[0][0], ref["w"], rtol=1e-5)
  np.testing.assert_allclose(data.grads[1][0], ref["b"], rtol=1e-5)
  flat = np.concatenate([ref["w"].reshape(4, -1), ref["b"]], 1)
  np.testing.assert_allclose(tl.layers[0].block.layer_stats(data),
                             np.einsum("n,ni,nj->ij", c, flat, flat),
                             rtol=1e-5)


def test_while_loop_layer_is_reported():
  p = {"w": jnp.ones((3, 3))}

  def f(p, x):
    y = lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] @ p["w"]),
                       (0, x))[1]
    return jnp.mean(lax.stop_gradient(y))
  (row,) = describe(f, p, X)
  assert row.kind == "fallback" and "while_loop" in row.notes


def test_full_override_of_a_scan_stacked_layer():
  # One Full block per slice of the stack: Σ_i c_i γ_il γ_ilᵀ for slice l.
  import _tagging_models as M
  import kfac_jax_lite as kfl
  loss_fn, params, batch = M.jax_scan()
  fn = kfl.value_grad_and_stats(loss_fn, params, batch, estimation="empirical",
                                blocks={"stack/*": "full"})
  layer = fn.tagged.layer("stack/w")
  assert isinstance(layer.block, B.Stacked) and layer.block.n == 3
  assert isinstance(layer.block.block, B.Full)
  stats = jax.jit(fn)(params, batch, jax.random.PRNGKey(0)).stats["stack/w"]
  per_ex = jax.vmap(lambda ex: jax.grad(loss_fn)(
      params, jax.tree.map(lambda x: x[None], ex)))(batch)["stack"]
  u = np.concatenate([per_ex["w"].reshape(3, 3, -1), per_ex["b"]], -1)
  # The loss, ½·mean_n Σ_k (o_nk - y_nk)² over 2 outputs, is recognised as a
  # squared error (issue 23): "empirical" is "fisher" at the data targets,
  # 2 times the per-example gradients' outer product (kfl.estimators).
  np.testing.assert_allclose(stats, 2 * np.einsum("nlp,nlq->lpq", u, u) / 3,
                             rtol=1e-4, atol=1e-7)


def test_kfac_hands_each_block_its_state_for_its_statistics():
  # A block whose statistics depend on its state (EKFAC's eigenbasis) gets
  # the current state in layer_stats.
  import dataclasses
  from typing import Any
  import kfac_jax_lite as kfl
  seen = []

  @dataclasses.dataclass(frozen=True)
  class Stateful:
    inner: Any

    def __getattr__(self, attr):
      return getattr(self.inner, attr)

    def layer_stats(self, data, state=None):
      seen.append(jax.tree.structure(state))
      return self.inner.layer_stats(data, state)

  tx = kfl.kfac(loss, X, estimation="empirical", damping=0.1,
                blocks={"dense": lambda layer: Stateful(layer.block)})
  state = tx.init(P)
  tx.update(jax.grad(loss)(P, X), state, P, batch=X)
  # (tx.init traces one statistics pass too: the first step's refusals.)
  assert seen and set(seen) == {
      jax.tree.structure(B.KroneckerDense((3, 2), has_bias=True).init())}


def test_an_exclude_string_is_refused_naming_the_list():
  """``exclude="l0/b"`` would be read one character a pattern: refused."""
  params = {"l0": {"w": jnp.ones((3, 4)), "b": jnp.zeros(4)}}
  batch = (jnp.ones((4, 3)), jnp.zeros(4, jnp.int32))

  def loss(p, b):
    out = b[0] @ p["l0"]["w"] + p["l0"]["b"]
    return kfl.softmax_cross_entropy_with_integer_labels(out, b[1]).mean()
  with pytest.raises(TypeError, match=r"exclude=\['l0/b'\]"):
    kfl.describe(loss, params, batch, exclude="l0/b")
