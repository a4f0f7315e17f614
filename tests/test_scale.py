"""Scale: which scale each knob assumes, and health flags a run outside it
(issue 38, goal 4).

``damping`` is absolute in the factors' units and ``norm_constraint``
bounds ``⟨u, g⟩``: the defaults assume a loss of order 1 and layer inputs
of order 1 (``kfl.optimizers.health``'s ``LOSS_SCALE``/``INPUT_SCALE``
comment gives the math). K-FAC + SGD at the recommended settings is not
invariant to inputs x 1e±6 or a loss x 1e±8 (π-damping's share of ``A``
moves by 1/c, the KL bound by s), so the trajectory departs from the
unscaled one; health flags every such run OUT OF SCALE (before issue 38 it
said ``ok`` to inputs x 1e±6), and the unscaled run is not flagged. One
compiled program serves every scale (the scales are arguments).
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kfl
from kfac_jax_lite.optimizers import health as health_mod

STEPS = 100
rng = np.random.default_rng(0)
X = jnp.asarray(rng.standard_normal((16, 5)), jnp.float32)
Y = jnp.asarray(rng.integers(0, 3, 16), jnp.int32)
PARAMS = {"l0": {"w": jnp.asarray(rng.standard_normal((5, 6)) / 3,
                                  jnp.float32), "b": jnp.zeros(6)},
          "l1": {"w": jnp.asarray(rng.standard_normal((6, 3)) / 3,
                                  jnp.float32), "b": jnp.zeros(3)}}
BATCH = {"x": X, "y": Y, "xs": jnp.float32(1), "ls": jnp.float32(1)}


def loss_fn(p, b):
  h = jnp.tanh((b["x"] * b["xs"]) @ p["l0"]["w"] + p["l0"]["b"])
  return b["ls"] * optax.softmax_cross_entropy_with_integer_labels(
      h @ p["l1"]["w"] + p["l1"]["b"], b["y"]).mean()


TX = optax.chain(kfl.kfac(loss_fn, BATCH), optax.sgd(0.05, momentum=0.9))
EST = kfl.value_grad_and_stats(loss_fn, PARAMS, BATCH)


@jax.jit
def run(xs, ls):
  batch = dict(BATCH, xs=xs, ls=ls)

  def step(carry, key):
    p, s = carry
    e = EST(p, batch, key)
    u, s = TX.update(e.grads, s, p, stats=e.stats)  # No loss=: carried.
    return (optax.apply_updates(p, u), s), e.loss / ls
  keys = jax.random.split(jax.random.PRNGKey(0), STEPS)
  return jax.lax.scan(step, (PARAMS, TX.init(PARAMS)), keys)


def test_the_unscaled_run_trains_and_is_in_scale():
  (_, state), losses = run(jnp.float32(1), jnp.float32(1))
  h = kfl.health(state)
  assert h.out_of_scale is None, str(h)
  assert float(losses[-1]) < 0.1 * float(losses[0])


@pytest.mark.parametrize("xs,ls,what", [
    (1e-6, 1.0, "layer inputs"), (1e6, 1.0, "layer inputs"),
    (1.0, 1e8, "first loss"), (1.0, 1e-8, "first loss")])
def test_a_run_out_of_scale_departs_and_health_flags_it(xs, ls, what):
  (_, state), losses = run(jnp.float32(xs), jnp.float32(ls))
  (_, _), unscaled = run(jnp.float32(1), jnp.float32(1))
  # Not invariant: the losses (unscaled back) depart from the unscaled run.
  assert not np.allclose(np.asarray(losses), np.asarray(unscaled), rtol=0.1)
  h = kfl.health(state)
  assert h.out_of_scale and what in h.out_of_scale and not h.ok, str(h)
  assert "OUT OF SCALE" in str(h)


def test_the_scale_bounds_are_their_values():
  """A first loss just inside ``LOSS_SCALE`` is not flagged, just outside
  is; the same for an input factor's median second moment."""
  base = kfl.health(TX.init(PARAMS))
  lo, hi = health_mod.LOSS_SCALE
  for inside, outside in ((lo * 1.01, lo * 0.99), (hi * 0.99, hi * 1.01)):
    assert base._replace(loss_first=inside).out_of_scale is None
    assert base._replace(loss_first=-outside).out_of_scale
  lo, hi = health_mod.INPUT_SCALE
  assert base._replace(input_scale=(lo * 1.01, hi * 0.99)).out_of_scale is None
  assert base._replace(input_scale=(lo * 0.99, 1.0)).out_of_scale
  assert base._replace(input_scale=(1.0, hi * 1.01)).out_of_scale
