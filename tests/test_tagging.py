"""Tagging: the describe tables, and captured data vs per-example gradients."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _tagging_models as M
from _helpers import assert_paths_rounding_close, assert_rounding_close
from kfac_jax_lite.estimators import describe
from kfac_jax_lite.tagging import find_layers

D, C, E, S = "dense", "conv", "embedding", "scale_and_shift"
KD, KC, KE, SS = "KroneckerDense", "KroneckerConv", "KroneckerEmbedding", "ScaleAndShift"

# model -> [(name, kind, block, params, uses, stack)] (params as path suffixes)
EXPECTED = {
    "jax_mlp": [("l1/w", D, KD, ("l1/w", "l1/b"), 1, None),
                ("l2/w", D, KD, ("l2/w", "l2/b"), 1, None)],
    "jax_cnn": [("c1", C, KC, ("c1", "c1b"), 1, None), ("c2", C, KC, ("c2",), 1, None),
                ("c3", C, KC, ("c3",), 1, None), ("dense", D, KD, ("dense",), 1, None)],
    "jax_text": [("embed", E, KE, ("embed",), 1, None),
                 ("head/w", D, KD, ("head/w", "head/b"), 1, None)],
    "jax_transformer": [
        ("embed", E, KD, ("embed",), 2, None), ("k", D, KD, ("k",), 1, None),
        ("ln1/scale", S, SS, ("ln1/scale", "ln1/bias"), 1, None),
        ("ln2/scale", S, SS, ("ln2/scale", "ln2/bias"), 1, None),
        ("mlp1/w", D, KD, ("mlp1/w", "mlp1/b"), 1, None),
        ("mlp2/w", D, KD, ("mlp2/w", "mlp2/b"), 1, None),
        ("o", D, KD, ("o",), 1, None), ("pos", S, SS, ("pos",), 1, None),
        ("q", D, KD, ("q",), 1, None), ("v", D, KD, ("v",), 1, None)],
    "jax_scan": [("cell", D, KD, ("cell",), 1, None), ("head", D, KD, ("head",), 1, None),
                 ("inp", D, KD, ("inp",), 1, None), ("scale", S, SS, ("scale",), 1, None),
                 ("stack/w", D, KD, ("stack/w", "stack/b"), 1, 3)],
    "jax_cond": [("a", D, KD, ("a",), 1, None), ("b", D, KD, ("b",), 1, None)],
    "linen_mlp": [
        ("params/Dense_0/kernel", D, KD, ("params/Dense_0/kernel", "params/Dense_0/bias"), 1, None),
        ("params/Dense_1/kernel", D, KD, ("params/Dense_1/kernel",), 1, None),
        ("params/LayerNorm_0/scale", S, SS, ("params/LayerNorm_0/scale", "params/LayerNorm_0/bias"), 1, None)],
    "linen_cnn": [
        ("params/Conv_0/kernel", C, KC, ("params/Conv_0/kernel", "params/Conv_0/bias"), 1, None),
        ("params/Conv_1/kernel", C, KC, ("params/Conv_1/kernel", "params/Conv_1/bias"), 1, None),
        ("params/Conv_2/kernel", C, KC, ("params/Conv_2/kernel", "params/Conv_2/bias"), 1, None),
        ("params/Dense_0/kernel", D, KD, ("params/Dense_0/kernel", "params/Dense_0/bias"), 1, None)],
    "linen_transformer": [
        ("params/Dense_0/kernel", D, KD, ("params/Dense_0/kernel", "params/Dense_0/bias"), 1, None),
        ("params/Dense_1/kernel", D, KD, ("params/Dense_1/kernel", "params/Dense_1/bias"), 1, None),
        ("params/Embed_0/embedding", E, KD, ("params/Embed_0/embedding",), 2, None),
        ("params/LayerNorm_0/scale", S, SS, ("params/LayerNorm_0/scale", "params/LayerNorm_0/bias"), 1, None),
        ("params/LayerNorm_1/scale", S, SS, ("params/LayerNorm_1/scale", "params/LayerNorm_1/bias"), 1, None)] + [
        (f"params/SelfAttention_0/{n}/kernel", D, KD, (f"params/SelfAttention_0/{n}/kernel",
         f"params/SelfAttention_0/{n}/bias"), 1, None) for n in ("key", "out", "query", "value")],
    "linen_scan": [
        ("params/Dense_0/kernel", D, KD, ("params/Dense_0/kernel", "params/Dense_0/bias"), 1, None),
        ("params/ScanCell_0/Dense_0/kernel", D, KD, ("params/ScanCell_0/Dense_0/kernel",
         "params/ScanCell_0/Dense_0/bias"), 1, 3)],
    "nnx_mlp": [("l1/kernel", D, KD, ("l1/kernel", "l1/bias"), 1, None),
                ("l2/kernel", D, KD, ("l2/kernel", "l2/bias"), 1, None),
                ("norm/scale", S, SS, ("norm/scale",), 1, None)],
    "haiku_mlp": [(f"mlp/~/linear_{i}/w", D, KD, (f"mlp/~/linear_{i}/w", f"mlp/~/linear_{i}/b"), 1, None)
                  for i in range(2)],
    "haiku_text": [("embed/embeddings", E, KE, ("embed/embeddings",), 1, None),
                   ("layer_norm/scale", S, SS, ("layer_norm/scale", "layer_norm/offset"), 1, None),
                   ("linear/w", D, KD, ("linear/w", "linear/b"), 1, None)],
    "eqx_mlp": [(f"layers/{i}/weight", D, KD, (f"layers/{i}/weight", f"layers/{i}/bias"), 1, None)
                for i in range(3)],
    "eqx_cnn": [("0/weight", C, KC, ("0/weight", "0/bias"), 1, None),
                ("1/weight", C, KC, ("1/weight", "1/bias"), 1, None),
                ("2/weight", E, KE, ("2/weight",), 1, None),
                ("3/weight", S, SS, ("3/weight", "3/bias"), 1, None),
                ("4/weight", D, KD, ("4/weight", "4/bias"), 1, None)],
}
MODELS = sorted(EXPECTED)


@functools.lru_cache(maxsize=None)
def _model(name):
  return getattr(M, name)()


@functools.lru_cache(maxsize=None)
def _tagged(name):
  loss, params, batch = _model(name)
  return find_layers(loss, params, batch)


def _forward(tl, params, batch):
  """``(loss, vjp_fn, captures)`` of the rewritten loss, one forward pass;
  ``vjp_fn(ct)`` gives ``(param_grads, probe_cotangents)``."""
  def f(p, probes):
    loss, _, caps = tl.apply(p, batch, probes)
    return loss, caps
  return jax.vjp(f, params, tl.zero_probes(params, batch), has_aux=True)


@functools.lru_cache(maxsize=None)
def _probed(name):
  """``(loss, grads, captures, probe cotangents)`` of the rewritten loss
  (jitted: one compile costs less than the eager ops' many small ones)."""
  loss, params, batch = _model(name)

  def probed(params, batch):
    l, vjp, caps = _forward(_tagged(name), params, batch)
    grads, probe_cts = vjp(jnp.ones_like(l))
    return l, grads, caps, probe_cts
  return jax.jit(probed)(params, batch)


@pytest.mark.parametrize("name", MODELS)
def test_describe_table(name):
  loss, params, batch = _model(name)
  rows = describe(loss, params, batch)
  got = [(r.name, r.kind, r.block, r.params, r.uses, r.stack) for r in rows]
  assert got == EXPECTED[name], str(rows)
  assert all(r.kind != "fallback" for r in rows)
  assert all(r.bytes > 0 and r.factors for r in rows)
  assert "fallback" not in str(rows)


def _flat_paths(tree):
  from kfac_jax_lite.tagging import path_name
  return {path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("name", MODELS)
def test_captures_reproduce_per_example_grads(name):
  loss, params, batch = _model(name)
  tl = _tagged(name)
  n = jax.tree.leaves(batch)[0].shape[0]
  l, grads, caps, probe_cts = _probed(name)
  cts = {k: v * n for k, v in probe_cts.items()}   # mean loss: c_i = 1/N
  per_ex = jax.jit(tl.per_example_grads)(caps, cts)
  # The models here chain ≤ 16 reductions forward and back (≤ 8 layers),
  # none longer than 64 terms (a conv's 49 locations, its 36-entry window).
  close = functools.partial(assert_rounding_close, terms=64, depth=16)
  close(l, jax.jit(loss)(params, batch))
  ref = jax.jit(jax.vmap(lambda ex: jax.grad(loss)(
      params, jax.tree.map(lambda x: x[None], ex))))(batch)
  ref, g = _flat_paths(ref), _flat_paths(grads)
  gref = _flat_paths(jax.jit(jax.grad(loss))(params, batch))
  assert set(per_ex) == set(ref)   # every parameter is in a detected layer
  assert_paths_rounding_close(per_ex, ref, terms=64, depth=16)
  assert_paths_rounding_close(g, gref, terms=64, depth=16)


def test_per_example_grads_keep_the_samples_apart():
  # Two samples of the cotangents, g and 2g, give gradients γ and 2γ for
  # every parameter, the tied embedding's (lookups + transposed use) too.
  tl = _tagged("jax_transformer")
  _, _, caps, cts = _probed("jax_transformer")
  one = tl.per_example_grads(caps, cts)
  two = tl.per_example_grads(caps, {k: jnp.stack([v, 2 * v])
                                    for k, v in cts.items()})
  assert set(one) == set(two) and "embed" in one
  for path, g in one.items():   # Sums over ≤ N·T uses of the same products.
    assert_rounding_close(two[path], np.stack([g, 2 * g]), terms=64,
                          err_msg=path)


def _count(jaxpr, names):
  n = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in names:
      n += 1
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      n += _count(sub, names)
  return n


@pytest.mark.parametrize("name", ["jax_transformer", "jax_cnn", "jax_scan"])
def test_one_forward_pass_under_jit(name):
  """The stats+grad function has exactly the dots/convs of loss+grad."""
  loss, params, batch = _model(name)
  tl = _tagged(name)

  def both(params, batch):
    l, vjp, caps = _forward(tl, params, batch)
    return l, caps, vjp(jnp.ones_like(l))
  ops = {"dot_general", "conv_general_dilated"}
  ref = _count(jax.make_jaxpr(jax.jit(jax.value_and_grad(loss)))(params, batch).jaxpr, ops)
  got = _count(jax.make_jaxpr(jax.jit(both))(params, batch).jaxpr, ops)
  assert got == ref > 0


def test_other_batch_size_and_stable_names():
  loss, params, batch = _model("jax_transformer")
  tl = _tagged("jax_transformer")
  big = jax.tree.map(lambda x: jnp.concatenate([x, x]), batch)
  l, _, caps = tl.apply(params, big, tl.zero_probes(params, big))
  np.testing.assert_allclose(l, loss(params, big), rtol=1e-5)
  again = find_layers(loss, params, big)
  assert [x.name for x in again.layers] == [x.name for x in tl.layers]
  assert [x.spec for x in again.layers] == [x.spec for x in tl.layers]
  assert ([x.block for x in again.with_blocks().layers]
          == [x.block for x in tl.with_blocks().layers])


def test_with_blocks_leaves_the_detection_as_it_was():
  tl = _tagged("jax_transformer")
  layers = tl.layers
  pi = tl.with_blocks()
  exact = tl.with_blocks(damping_mode="exact")
  assert tl.layers is layers and all(l.block is None for l in tl.layers)
  assert all(l.block is not None for l in pi.layers + exact.layers)
  assert [l.block.damping_mode for l in pi.layers
          if hasattr(l.block, "damping_mode")] == [
              "pi"] * sum(hasattr(l.block, "damping_mode") for l in pi.layers)
  assert {l.block.damping_mode for l in exact.layers
          if hasattr(l.block, "damping_mode")} == {"exact"}
  assert pi.closed is tl.closed and pi.losses is tl.losses  # No re-trace.


def _per_example_flat(name, tl):
  """``{layer name: [N, P]}`` per-example gradients by ``vmap(grad)``,
  raveled in the layer's parameter order."""
  loss, params, batch = _model(name)
  ref = _flat_paths(jax.jit(jax.vmap(lambda ex: jax.grad(loss)(
      params, jax.tree.map(lambda x: x[None], ex))))(batch))
  n = jax.tree.leaves(batch)[0].shape[0]
  return {l.name: np.concatenate(
      [np.asarray(ref[p], np.float64).reshape(n, -1) for p in l.params], 1)
          for l in tl.layers}


def _stats(tl, name):
  """``{layer name: layer_stats(layer_data)}`` with the cotangents
  ``∂ℓ_i/∂y``, and again with a samples axis holding them times (1, 2)."""
  _, params, batch = _model(name)
  _, _, caps, cts = _probed(name)
  n = jax.tree.leaves(batch)[0].shape[0]
  cts = {k: v * n for k, v in cts.items()}  # A mean loss: c_i = 1/N.

  @jax.jit
  def stats(caps, c):
    data = tl.layer_data(caps, c)
    return {layer.name: layer.block.layer_stats(data[layer.name])
            for layer in tl.detected}
  return [stats(caps, c) for c in
          (cts, {k: jnp.stack([v, 2 * v]) for k, v in cts.items()})]


# The tied embedding (a lookup and a transposed product): with a samples
# axis its data folds the samples into the positions ("expand"), so the
# statistics are not a plain mean over samples; the diagonal block of it is
# checked against brute force in test_estimators (an xfail there).
TIED = "embed"


def test_layer_data_feeds_compute_stats():
  loss, params, batch = _model("jax_transformer")
  # Every block as a diagonal one (DiagonalDense, the tied embedding
  # included, and ScaleAndShift): Σ_i c_i γ_i² of the per-example
  # gradients γ_i, which vmap(grad) gives independently.
  tl = _tagged("jax_transformer").with_blocks({
      "dense": "diagonal", "embedding": "diagonal"})
  kinds = {type(l.block).__name__ for l in tl.layers}
  assert kinds == {"DiagonalDense", "ScaleAndShift"}, kinds
  want = _per_example_flat("jax_transformer", tl)
  stats, stats2 = _stats(tl, "jax_transformer")
  for layer in tl.detected:
    block = layer.block
    got = np.diag(block.to_dense(block.update(block.init(), stats[layer.name],
                                              0.5)))
    expected = (want[layer.name] ** 2).mean(0)
    # Squares of the per-example gradients (≤ 16 chained reductions of ≤ 64
    # terms each side, doubled by the square) averaged over N.
    assert_rounding_close(got, expected, terms=64, depth=2 * 16 + 1,
                          err_msg=layer.name)
    if layer.name == TIED:
      continue  # See below.
    # A samples axis averages: cotangents (g, 2g) give (1 + 4)/2 = 2.5 times.
    # The same products summed over twice the rows (≤ 2·N·T = 18).
    for a, b in zip(jax.tree.leaves(stats2[layer.name]),
                    jax.tree.leaves(stats[layer.name])):
      assert_rounding_close(a, 2.5 * np.asarray(b), terms=18, depth=2,
                            err_msg=layer.name)
  # The default Kronecker blocks take the same data: the input factor does
  # not see the cotangents, the output factor averages over samples.
  tl = _tagged("jax_transformer").with_blocks()
  stats, stats2 = _stats(tl, "jax_transformer")
  for layer in tl.detected:
    if layer.kind == "scale_and_shift" or layer.name == TIED:
      continue
    one, two = stats[layer.name], stats2[layer.name]
    assert_rounding_close(two.a, one.a, terms=18, depth=2, err_msg=layer.name)
    assert_rounding_close(two.g, 2.5 * np.asarray(one.g), terms=18, depth=2,
                          err_msg=layer.name)
    assert np.abs(one.g).max() > 0 and np.abs(one.a).max() > 0, layer.name


def test_block_policy_is_chosen_after_detection_without_retracing():
  loss, params, batch = _model("jax_mlp")
  traces = []

  def counted(p, b):
    traces.append(1)
    return loss(p, b)
  tl = find_layers(counted, params, batch)
  assert all(l.block is None for l in tl.layers)
  n = len(traces)
  pi = tl.with_blocks()
  exact = tl.with_blocks(damping_mode="exact", weight_sharing="reduce")
  assert len(traces) == n   # choosing blocks does not trace the loss again
  assert [l.block.damping_mode for l in pi.layers] == ["pi", "pi"]
  assert [(l.block.damping_mode, l.block.weight_sharing)
          for l in exact.layers] == [("exact", "reduce")] * 2
  assert [l.spec for l in exact.layers] == [l.spec for l in tl.layers]
