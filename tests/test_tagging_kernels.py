"""Kernels used in pieces or several times keep one Kronecker layer.

* A kernel sliced before use (a fused QKV kernel ``W[:, :d]``, ``W[:, d:2d]``,
  ..., or ``jnp.split(W, 3, -1)``, with the matching bias slices) is one
  dense block over the whole stored kernel: the slices are column blocks of
  ``x @ W``, so A is the input's and G is over the full output. Its
  statistics equal those of the same model written ``jnp.split(x @ W, 3)``.
  Slices applied to different inputs are weight-sharing uses.
* Per-head kernels ``W [h, d, e]`` in ``einsum("nhtd,hde->nhte")`` (a
  ``dot_general`` batch axis on the kernel) are h independent dense layers:
  a ``Stacked`` Kronecker block whose slices equal the blocks of the same
  model written with one kernel per head.
* A conv kernel applied twice (siamese) or at every ``lax.scan`` step is
  one KFC layer: A averages and G sums the two uses' statistics.

Every case: no fallback in ``describe``, and the captured data rebuild the
per-example gradients of ``jax.vmap(jax.grad(...))`` (float32 and float64).
"""
import jax
import jax.numpy as jnp
import pytest
from jax import lax

import kfac_jax_lite as kfl
from _helpers import (assert_paths_rounding_close, assert_rounding_close,
                      x64_mode)

N, T, D, H, E = 3, 4, 4, 2, 3


def _attend(q, k, v):
  a = jax.nn.softmax(jnp.einsum("ntd,nsd->nts", q, k), -1)
  return jnp.einsum("nts,nsd->ntd", a, v)


def _sq(y):
  return jnp.mean(jnp.sum(y.reshape(y.shape[0], -1) ** 2, -1))


# --------------------------------------------------------------- models
def fused_slices(p, x):
  w, b = p["qkv"]["w"], p["qkv"]["b"]
  q = x @ w[:, :D] + b[:D]
  k = x @ w[:, D:2 * D] + b[D:2 * D]
  v = x @ w[:, 2 * D:] + b[2 * D:]
  return _sq(_attend(q, k, v) @ p["o"])


def fused_split(p, x):
  ws, bs = jnp.split(p["qkv"]["w"], 3, -1), jnp.split(p["qkv"]["b"], 3)
  q, k, v = [x @ w + b for w, b in zip(ws, bs)]
  return _sq(_attend(q, k, v) @ p["o"])


def fused_output(p, x):  # The same model, the output split instead.
  q, k, v = jnp.split(x @ p["qkv"]["w"] + p["qkv"]["b"], 3, -1)
  return _sq(_attend(q, k, v) @ p["o"])


def fused_two_inputs(p, x):  # Cross-attention style: q from x, kv from m.
  w = p["qkv"]["w"]
  kv = jnp.tanh(x[:, ::-1]) @ w[:, D:]
  return _sq(_attend(x @ w[:, :D], kv[..., :D], kv[..., D:]) @ p["o"])


def heads(p, x):  # x [N, H, T, D]
  y = jnp.einsum("nhtd,hde->nhte", x, p["w"]) + p["b"][None, :, None, :]
  return _sq(jnp.einsum("nhte,hef->ntf", jnp.tanh(y), p["o"]))


def heads_apart(p, x):  # The same, one kernel per head.
  y = jnp.stack([x[:, h] @ p[f"w{h}"] + p[f"b{h}"] for h in range(H)], 1)
  return _sq(jnp.einsum("nhte,hef->ntf", jnp.tanh(y), p["o"]))


def _conv(x, k):
  return lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                  dimension_numbers=("NHWC", "HWIO", "NHWC"))


def siamese(p, b):
  x1, x2 = b
  h1 = jnp.tanh(_conv(x1, p["k"]) + p["b"])
  h2 = jnp.tanh(_conv(x2, p["k"]) + p["b"])

  def step(h, _):  # NCHW, the same kernel at every step.
    return jnp.tanh(lax.conv_general_dilated(h, p["r"], (1, 1), "SAME")), None
  h3, _ = lax.scan(step, jnp.transpose(h1, (0, 3, 1, 2)), None, length=2)
  return jnp.mean(jnp.sum((h1 - h2) ** 2, (1, 2, 3))) + _sq(h3)


def siamese_apart(p, b):  # Two kernels (equal values), one use each.
  x1, x2 = b
  h1 = jnp.tanh(_conv(x1, p["k1"]) + p["b1"])
  h2 = jnp.tanh(_conv(x2, p["k2"]) + p["b2"])
  return jnp.mean(jnp.sum((h1 - h2) ** 2, (1, 2, 3)))


def _setup(name, dtype):
  k = jax.random.split(jax.random.key(0), 6)
  r = lambda i, *s: jax.random.normal(k[i], s, dtype)
  if name.startswith("fused"):
    p = {"qkv": {"w": r(0, D, 3 * D) / 2, "b": 0.1 * r(1, 3 * D)},
         "o": r(2, D, 2) / 2}
    if name == "fused_two_inputs":
      del p["qkv"]["b"]
    return p, r(3, N, T, D)
  if name == "heads":
    return ({"w": r(0, H, D, E) / 2, "b": 0.1 * r(1, H, E),
             "o": r(2, H, E, 2) / 2}, r(3, N, H, T, D))
  return ({"k": r(0, 3, 3, 2, 4) / 3, "b": 0.1 * r(1, 4),
           "r": r(2, 4, 4, 3, 3) / 6}, (r(3, N, 5, 5, 2), r(4, N, 5, 5, 2)))


MODELS = {"fused_slices": fused_slices, "fused_split": fused_split,
          "fused_two_inputs": fused_two_inputs, "heads": heads,
          "siamese": siamese}
# name -> [(layer, kind, block, params, factors, stack, notes contain)]
EXPECTED = {
    "fused_slices": [("o", "dense", "KroneckerDense", ("o",), None, ""),
                     ("qkv/w", "dense", "KroneckerDense", ("qkv/w", "qkv/b"),
                      None, "3 column blocks of the kernel on 1 input")],
    "fused_two_inputs": [("o", "dense", "KroneckerDense", ("o",), None, ""),
                         ("qkv/w", "dense", "KroneckerDense", ("qkv/w",), None,
                          "2 column blocks of the kernel on 2 input")],
    "heads": [("w", "dense", "KroneckerDense", ("w", "b"), 2, ""),
              ("o", "dense", "KroneckerDense", ("o",), None, "")],
    "siamese": [("k", "conv", "KroneckerConv", ("k", "b"), None,
                 "applied 2 times"),
                ("r", "conv", "KroneckerConv", ("r",), None,
                 "applied 2 times")],
}
EXPECTED["fused_split"] = EXPECTED["fused_slices"]


def _probed(tl, p, batch):
  """``(captures, ∂ℓ_i/∂y)`` of the rewritten loss (c_i = 1/N)."""
  def f(pp, pr):
    l, _, caps = tl.apply(pp, batch, pr)
    return l, caps
  l, vjp, caps = jax.vjp(f, p, tl.zero_probes(p, batch), has_aux=True)
  _, cts = vjp(jnp.ones_like(l))
  return caps, {k: v * N for k, v in cts.items()}


def _per_example(loss, p, batch):
  """``(rebuilt, vmap(grad))`` per-example gradients by path, one jit."""
  tl = kfl.tagging.find_layers(loss, p, batch)

  @jax.jit
  def both(p, batch):
    per_ex = tl.per_example_grads(*_probed(tl, p, batch))
    ref = jax.vmap(lambda ex: jax.grad(loss)(
        p, jax.tree.map(lambda x: x[None], ex)))(batch)
    return per_ex, {kfl.tagging.path_name(k): v for k, v in
                    jax.tree_util.tree_flatten_with_path(ref)[0]}
  return both(p, batch)


def _stats(loss, p, batch):
  tl = kfl.tagging.find_layers(loss, p, batch).with_blocks()

  @jax.jit
  def stats(p, batch):
    data = tl.layer_data(*_probed(tl, p, batch))
    return {l.name: l.block.layer_stats(data[l.name]) for l in tl.detected}
  return stats(p, batch)


# float64 where cheap (fused_split slices as fused_slices does).
CASES = [(name, "float32") for name in sorted(MODELS)] + [
    (name, "float64") for name in ("fused_split", "fused_two_inputs",
                                   "heads")]


@pytest.mark.parametrize("name,dtype", CASES)
def test_rebuilds_per_example_gradients(name, dtype):
  with x64_mode(dtype == "float64"):
    loss = MODELS[name]
    p, batch = _setup(name, jnp.dtype(dtype))
    rows = kfl.describe(loss, p, batch)
    got = [(r.name, r.kind, r.block, r.params, r.stack) for r in rows]
    assert got == [e[:5] for e in EXPECTED[name]], str(rows)
    for r, e in zip(rows, EXPECTED[name]):
      assert e[5] in r.notes, str(rows)
    per_ex, ref = _per_example(loss, p, batch)
    assert set(per_ex) == set(ref)
    for path, g in per_ex.items():
      assert g.dtype == jnp.dtype(dtype), path
    # Both sides chain ≤ 12 reductions (5 forward, 5 backward, the sum over
    # the uses; the siamese one's scan 2 more), none longer than the
    # siamese gradient's 2·25 uses (the attention's are ≤ 2·T).
    assert_paths_rounding_close(per_ex, ref, terms=50 if name == "siamese"
                                else 2 * T, depth=12)


def _close(a, b, rows):
  # Two computations of one statistic (the algebra, so in float64): a sum
  # over ``rows`` of products of cotangents that each went through about as
  # long a chain of products again (the head, the attention, the window).
  assert_rounding_close(a, b, terms=rows, depth=2)


def test_fused_kernel_statistics_are_the_whole_layers():
  with x64_mode(True):
    p, x = _setup("fused_slices", jnp.float64)
    want = _stats(fused_output, p, x)["qkv/w"]
    for loss in (fused_slices, fused_split):
      got = _stats(loss, p, x)["qkv/w"]
      _close(got.a, want.a, N * T)
      _close(got.g, want.g, N * T)
      assert want.g.shape == (1, 3 * D, 3 * D)


def test_sliced_kernel_bias_of_other_columns_is_not_its_bias():
  # ``x @ W[:, :2] + b[2:]`` is a shift of its own, not the kernel's bias.
  p = {"w": jnp.ones((3, 4)) / 3, "b": jnp.ones(4) / 4}

  def loss(p, x):
    return _sq(jnp.tanh(x @ p["w"][:, :2] + p["b"][2:])) + _sq(x @ p["w"][:, 2:])
  rows = kfl.describe(loss, p, jnp.ones((N, 3)))
  assert [(r.name, r.kind) for r in rows] == [("b", "fallback"),
                                              ("w", "dense")], str(rows)
  assert "sliced before `add`" in rows[0].notes


def test_kernel_sliced_along_its_input_axis_falls_back():
  p = {"w": jnp.ones((4, 3)) / 3}

  def loss(p, x):
    return _sq(x[:, :2] @ p["w"][:2] + x[:, 2:] @ p["w"][2:])
  (row,) = kfl.describe(loss, p, jnp.ones((N, 4)))
  assert row.kind == "fallback" and "contracted (input) axis" in row.notes


def test_per_head_kernels_are_one_block_per_head():
  with x64_mode(True):
    p, x = _setup("heads", jnp.float64)
    apart = {"o": p["o"], **{f"w{h}": p["w"][h] for h in range(H)},
             **{f"b{h}": p["b"][h] for h in range(H)}}
    got, want = _stats(heads, p, x)["w"], _stats(heads_apart, apart, x)
    for h in range(H):
      _close(got.a[h], want[f"w{h}"].a, N * T)
      _close(got.g[h], want[f"w{h}"].g, N * T)


def test_conv_used_twice_averages_inputs_and_sums_outputs():
  with x64_mode(True):
    p, b = _setup("siamese", jnp.float64)
    apart = {"k1": p["k"], "k2": p["k"], "b1": p["b"], "b2": p["b"]}
    shared = {"k": p["k"], "b": p["b"]}
    loss = lambda q, b: siamese_apart({"k1": q["k"], "k2": q["k"],
                                       "b1": q["b"], "b2": q["b"]}, b)
    got, want = _stats(loss, shared, b)["k"], _stats(siamese_apart, apart, b)
    rows = 2 * N * 5 * 5  # Two uses of N 5x5 images.
    _close(got.a, (want["k1"].a + want["k2"].a) / 2, rows)
    _close(got.g, want["k1"].g + want["k2"].g, rows)
