"""A layer kind written outside the library, as one plug-in.

The toy kind ``diag_scale`` (``y = x ⊙ w``, ``x [N, d]``, ``w [d]``) is
defined entirely in this file: its recogniser (``DiagScaleSpec.recognise``
for the ``mul`` primitive), its grouping, its default block, its data
layout and its per-example gradients. A new kind touches **no library
file**: it is one ``LayerSpec`` subclass and one call,
``kfac_jax_lite.tagging._kinds.register(cls)`` (``unregister(name)``
removes it; the fixture below does, so other tests see the built-in kinds
only). Registered after the built-in kinds, it is asked first for the
primitives it shares with them (here ``mul``, the scale-and-shift kind's),
and ``NotImplemented`` hands an equation it does not take back to them.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kfl
from _helpers import x64_mode
from kfac_jax_lite import blocks as B
from kfac_jax_lite.tagging import _kinds
from kfac_jax_lite.tagging._kinds.base import Grouping, LayerSpec, Unsupported
from kfac_jax_lite.tagging._views import View


@dataclasses.dataclass(frozen=True)
class DiagScaleSpec(LayerSpec):
  """``y = x ⊙ w``: a vector ``w [dim]`` scaling the last axis of ``x``."""

  name = "diag_scale"
  patterns = frozenset({"diag_scale"})
  primitives = ("mul",)

  dim: int

  @classmethod
  def recognise(cls, walk, i, eqn, views, ctx):
    """``x * w`` with ``x [N, dim]`` and ``w`` a whole 1-D leaf; any
    other ``mul`` is left to the built-in kinds."""
    if sum(v is not None for v in views) != 1:
      return NotImplemented
    k = 0 if views[0] is not None else 1
    w, x, out = views[k], eqn.invars[1 - k], eqn.outvars[0]
    shape = tuple(out.aval.shape)
    if (type(w) is not View or w.stacked
        or len(w.leaf_shape) != 1 or len(shape) != 2
        or tuple(x.aval.shape) != shape or w.nonunit(shape) != (None, 0)):
      return NotImplemented
    labels = (("b", 0), ("k", 0))
    walk._record("diag_scale", {"scale": w}, ctx, i, ("var", x), x.aval, i,
                 out.aval, labels, labels, {})
    return None

  @classmethod
  def group(cls, uses, leaf_shapes, depth):
    if len(uses) != 1 or depth:
      raise Unsupported("a diag_scale vector used more than once")
    leaf = uses[0].roles["scale"].leaf
    return Grouping(cls(dim=leaf_shapes[leaf][0]), (leaf,))

  @property
  def param_shapes(self):
    return ((self.dim,),)

  def default_block(self, *, damping_mode, weight_sharing):
    del damping_mode, weight_sharing
    return B.ScaleAndShift((self.dim,), has_scale=True, has_shift=False,
                           full=True)

  def data(self, uses, captures, cotangents, stacked):
    """``(x [N, dim], g [S, N, dim])``: the scale's input and cotangent."""
    (u,) = uses
    return captures[u.uid], cotangents[u.uid]

  def per_example_grads(self, inputs, cotangents):
    return (inputs[None] * cotangents,)


@pytest.fixture
def diag_scale():
  _kinds.register(DiagScaleSpec)
  try:
    yield DiagScaleSpec
  finally:
    _kinds.unregister(DiagScaleSpec.name)


def loss_fn(p, batch):
  h = batch["x"] * p["scale"]
  out = jnp.tanh(h @ p["w1"]) @ p["w2"]
  return kfl.squared_error(out, batch["t"]).sum(-1).mean()


def make(dtype=jnp.float32, n=6, d=3):
  k = jax.random.split(jax.random.PRNGKey(0), 5)
  params = {"scale": 1 + 0.3 * jax.random.normal(k[0], (d,), dtype),
            "w1": jax.random.normal(k[1], (d, 4), dtype) / 2,
            "w2": jax.random.normal(k[2], (4, 2), dtype) / 2}
  batch = {"x": jax.random.normal(k[3], (n, d), dtype),
           "t": jax.random.normal(k[4], (n, 2), dtype)}
  return params, batch


def test_registered_kind_is_detected_and_described(diag_scale):
  params, batch = make()
  tl = kfl.tagging.find_layers(loss_fn, params, batch)
  kinds = {l.name: l.kind for l in tl.layers}
  assert kinds == {"scale": "diag_scale", "w1": "dense", "w2": "dense"}
  rows = {r.name: r for r in kfl.describe(loss_fn, params, batch)}
  assert rows["scale"].kind == "diag_scale"
  assert rows["scale"].block.startswith("ScaleAndShift"), rows["scale"]


def test_without_registration_the_scale_is_scale_and_shift():
  params, batch = make()
  tl = kfl.tagging.find_layers(loss_fn, params, batch)
  assert {l.name: l.kind for l in tl.layers}["scale"] == "scale_and_shift"
  assert "diag_scale" not in _kinds.REGISTRY


def test_kfac_trains_with_the_registered_kind(diag_scale):
  params, batch = make()
  tx = optax.chain(kfl.kfac(loss_fn, batch, damping=1e-2, inverse_every=1),
                   optax.sgd(0.1))
  state = tx.init(params)
  grad = jax.grad(loss_fn)
  first = float(loss_fn(params, batch))

  @jax.jit
  def step(p, s):
    updates, s = tx.update(grad(p, batch), s, p, batch=batch)
    return optax.apply_updates(p, updates), s
  for _ in range(20):
    params, state = step(params, state)
  last = float(loss_fn(params, batch))
  assert np.isfinite(last) and last < 0.7 * first, (first, last)


def test_its_block_equals_brute_force_in_float64(diag_scale):
  with x64_mode(True):
    params, batch = make(jnp.float64)
    n = batch["x"].shape[0]
    tl = kfl.tagging.find_layers(loss_fn, params, batch).with_blocks()
    (layer,) = [l for l in tl.layers if l.kind == "diag_scale"]

    def forward(p, probes):
      loss, _, caps = tl.apply(p, batch, probes)
      return loss, caps
    _, vjp, caps = jax.vjp(forward, params, tl.zero_probes(params, batch),
                           has_aux=True)
    _, cts = vjp(jnp.ones(()))
    cts = {k: v * n for k, v in cts.items()}  # A mean loss: c_i = 1/N.
    data = tl.layer_data(caps, cts)
    block = layer.block
    got = block.to_dense(block.update(block.init(jnp.float64),
                                      block.layer_stats(data[layer.name]),
                                      0.5))
    # Brute force: F = (1/N) Σ_n γ_n γ_nᵀ, γ_n = ∂ℓ_n/∂w by vmap(grad).
    per_example = jax.vmap(lambda ex: jax.grad(loss_fn)(
        params, jax.tree.map(lambda x: x[None], ex))["scale"])(batch)
    want = np.einsum("ni,nj->ij", per_example, per_example) / n
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-10,
                               atol=1e-12 * np.abs(want).max())
    assert np.abs(want - np.diag(np.diag(want))).max() > 1e-3  # Not diagonal.


def test_register_refuses_a_taken_name():
  with pytest.raises(ValueError, match="already registered"):
    _kinds.register(type("Dense2", (DiagScaleSpec,), {"name": "dense"}))
