"""``kfl.describe``'s step price (issue 36, lever 4) against hand counts.

Each expected number is written out as the FLOPs of the cost model
(``estimators._cost``'s docstring: SGD ``6·M·P·a·b``, statistics
``2·m·P·a·b + 2·m·P·(a² + b²)`` (+ ``2·m·P·a·b`` in their own pass) over
``cov_every``, precondition ``2·(a²·b + a·b²)``, refresh ``c·(a³ + b³)/T``)
with the sizes counted by hand, not read from the code.
"""
from __future__ import annotations

import inspect
import os
import re
import sys

import jax
import jax.numpy as jnp
import pytest

import kfac_jax_lite as kfl
from kfac_jax_lite.estimators import _describe
from kfac_jax_lite.optimizers import options

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
C_CHOLESKY = 7 / 3  # n³/3 factorisation + 2n³ solve against I.


def _dense_loss(params, batch):
  out = batch["x"] @ params["w"] + params["b"]
  return kfl.squared_error(out, batch["y"]).mean()


def _dense_problem():
  """One dense layer 5 -> 3 with a bias, batch 7."""
  params = {"w": jnp.ones((5, 3)) * 0.1, "b": jnp.zeros(3)}
  batch = {"x": jnp.ones((7, 5)), "y": jnp.zeros((7, 3))}
  return params, batch


def test_dense_layer_against_a_hand_count():
  params, batch = _dense_problem()
  table = kfl.describe(_dense_loss, params, batch, inverse_method="cholesky",
                       inverse_every=10, cov_every=1)
  (row,) = table
  # a = 5 inputs + 1 bias = 6, b = 3, M = 7, one row per example.
  assert row.positions == 1
  f = row.flops
  assert f.sgd == pytest.approx(6 * 7 * 6 * 3)                    # 756
  assert f.statistics == pytest.approx(2 * 7 * 6 * 3              # backward
                                       + 2 * 7 * (6 * 6 + 3 * 3))  # A and G
  assert f.precondition == pytest.approx(2 * (6 * 6 * 3 + 6 * 3 * 3))
  assert f.refresh == pytest.approx(C_CHOLESKY * (6 ** 3 + 3 ** 3) / 10)
  total = 756 + 252 + 630 + 324 + C_CHOLESKY * 243 / 10
  assert table.price.ratio == pytest.approx(total / 756)
  assert table.price.statistics == pytest.approx((252 + 630) / 756)


def test_dense_layer_with_a_statistics_share_and_cov_every():
  """``stats_fraction=2/7``: the statistics see 2 of the 7 examples in a
  pass of their own (its forward counted), every other update."""
  params, batch = _dense_problem()
  (row,) = kfl.describe(_dense_loss, params, batch, stats_fraction=2 / 7,
                        cov_every=2, inverse_every=5,
                        inverse_method="gauss_jordan")
  f = row.flops
  assert f.sgd == pytest.approx(6 * 7 * 6 * 3)
  assert f.statistics == pytest.approx(
      (2 * 2 * 6 * 3 + 2 * 2 * (36 + 9) + 2 * 2 * 6 * 3) / 2)
  assert f.refresh == pytest.approx(2 * (6 ** 3 + 3 ** 3) / 5)
  # The 2-pass style at f = 1 adds the forward over all 7 examples.
  (two,) = kfl.describe(_dense_loss, params, batch, style="2-pass",
                        cov_every=1)
  (one,) = kfl.describe(_dense_loss, params, batch, style="1-pass",
                        cov_every=1)
  assert two.flops.statistics - one.flops.statistics == pytest.approx(
      2 * 7 * 6 * 3)


def _conv_loss(padding):
  def loss(params, batch):
    h = jax.lax.conv_general_dilated(
        batch["x"], params["w"], (1, 1), padding,
        dimension_numbers=("NHWC", "HWIO", "NHWC")) + params["b"]
    return kfl.squared_error(h.reshape(h.shape[0], -1),
                             batch["y"]).mean()
  return loss


@pytest.mark.parametrize("padding,side", [("VALID", 6 - 3 + 1), ("SAME", 6)])
def test_conv_layer_against_a_hand_count(padding, side):
  """3x3 conv, 2 -> 4 channels, 6x6 input, batch 2: VALID writes 4x4
  output positions per example, SAME 6x6."""
  params = {"w": jnp.ones((3, 3, 2, 4)) * 0.1, "b": jnp.zeros(4)}
  batch = {"x": jnp.ones((2, 6, 6, 2)),
           "y": jnp.zeros((2, side * side * 4))}
  (row,) = kfl.describe(_conv_loss(padding), params, batch,
                        inverse_method="cholesky", inverse_every=10,
                        cov_every=1)
  p = side * side                      # 16 or 36 positions
  a, b, m = 3 * 3 * 2 + 1, 4, 2        # a = 19 with the bias
  assert row.positions == p
  f = row.flops
  assert f.sgd == pytest.approx(6 * m * p * a * b)
  assert f.statistics == pytest.approx(2 * m * p * a * b
                                       + 2 * m * p * (a * a + b * b))
  assert f.precondition == pytest.approx(2 * (a * a * b + a * b * b))
  assert f.refresh == pytest.approx(C_CHOLESKY * (19 ** 3 + 4 ** 3) / 10)


def test_diagonal_block_and_scan_steps_against_a_hand_count():
  """A dense 3 -> 4 (no bias) applied at each of 5 ``lax.scan`` steps
  writes 5 rows per example; as a diagonal block over its 12 weights:
  per-example gradients and the sampled backward ``2·M·P·n`` each, their
  squares ``2·M·n``, precondition ``n``, refresh ``n / T``."""
  def loss(params, batch):
    def step(h, x):
      return h + x @ params["w"], None
    h, _ = jax.lax.scan(step, jnp.zeros((4, 4)), batch["x"].swapaxes(0, 1))
    return kfl.squared_error(h, batch["y"]).mean()
  params = {"w": jnp.ones((3, 4)) * 0.1}
  batch = {"x": jnp.ones((4, 5, 3)), "y": jnp.zeros((4, 4))}
  (row,) = kfl.describe(loss, params, batch, blocks={"dense": "diagonal"},
                        inverse_every=10, cov_every=1)
  m, p, n = 4, 5, 12
  assert row.positions == p
  assert row.factors == ((n,),)
  f = row.flops
  assert f.sgd == pytest.approx(6 * m * p * n)
  assert f.statistics == pytest.approx(2 * m * p * n + 2 * m * p * n
                                       + 2 * m * n)
  assert f.precondition == pytest.approx(n)
  assert f.refresh == pytest.approx(n / 10)


def _mlp_loss(params, batch):
  h = batch["x"]
  for i, layer in enumerate(params):
    h = h @ layer["w"] + layer["b"]
    if i < len(params) - 1:
      h = jnp.tanh(h)
  return kfl.squared_error(h, batch["y"]).mean()


@pytest.mark.parametrize("style,fraction", [("1-pass", 1.0),
                                            ("2-pass", 1.0),
                                            ("2-pass", 0.5)])
def test_mlp_price_is_the_benchmarks_floor(style, fraction):
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  try:
    import _cost_model  # pylint: disable=import-outside-toplevel
  finally:
    sys.path.pop(0)
  dims, m = (6, 5, 4, 3), 8
  keys = jax.random.split(jax.random.PRNGKey(0), len(dims) - 1)
  params = [{"w": jax.random.normal(k, (i, o)) * 0.3, "b": jnp.zeros(o)}
            for k, i, o in zip(keys, dims[:-1], dims[1:])]
  batch = {"x": jnp.ones((m, dims[0])), "y": jnp.zeros((m, dims[-1]))}
  table = kfl.describe(_mlp_loss, params, batch, inverse_method="cholesky",
                       inverse_every=10, cov_every=1,
                       stats_fraction=fraction, style=style)
  floor = _cost_model.floor_ratio(dims, m, fraction=fraction, interval=10,
                                  c=C_CHOLESKY, two_pass=style == "2-pass")
  assert table.price.ratio == pytest.approx(floor, rel=1e-12)
  # And against the hand-summed model for the 1-pass style at f = 1.
  if style == "1-pass":
    sgd = kfac = 0.0
    for d_in, b in zip(dims[:-1], dims[1:]):
      a = d_in + 1
      sgd += 6 * m * a * b
      kfac += (6 * m * a * b + 2 * m * a * b + 2 * m * (a * a + b * b)
               + 2 * (a * a * b + a * b * b)
               + C_CHOLESKY * (a ** 3 + b ** 3) / 10)
    assert table.price.ratio == pytest.approx(kfac / sgd, rel=1e-12)


def test_printed_table_has_the_price_line():
  params, batch = _dense_problem()
  table = kfl.describe(_dense_loss, params, batch, inverse_method="cholesky",
                       inverse_every=10, cov_every=1)
  text = str(table)
  line = next(l for l in text.splitlines() if l.startswith("step price:"))
  p = table.price
  assert f"~{p.ratio:.2f}x an SGD step" in line
  assert f"statistics {p.statistics:.2f}x" in line
  assert f"preconditioning {p.precondition:.2f}x" in line
  assert f"refresh {p.refresh:.2f}x per step at inverse_every=10" in line
  assert "inverse_method='cholesky'" in line


def test_style_is_checked():
  params, batch = _dense_problem()
  with pytest.raises(ValueError, match="style"):
    kfl.describe(_dense_loss, params, batch, style="3-pass")


def test_price_defaults_are_kfacs():
  """describe (estimators) cannot import the optimizers' defaults: its
  copies must stay equal to them."""
  curv, pre = options.CurvatureOptions(), options.PreconditionerOptions()
  assert _describe.INVERSE_EVERY == pre.inverse_every
  assert _describe.INVERSE_METHOD == pre.inverse_method
  assert _describe.STATS_FRACTION == curv.stats_fraction
  assert _describe.COV_EVERY == curv.cov_every
  kfac = inspect.signature(kfl.kfac).parameters
  desc = inspect.signature(kfl.describe).parameters
  assert _describe._plan.DEFAULT_BUDGET == pre.budget
  for name in ("inverse_every", "inverse_method", "stats_fraction",
               "cov_every", "damping_mode", "weight_sharing"):
    assert desc[name].default == kfac[name].default, name
  # describe's budget None is the default of the optimizer it prices:
  # kfl.kfac's, or (model_fraction given) kfl.kfac_optimizer's None.
  assert desc["budget"].default is None
  assert inspect.signature(kfl.kfac_optimizer).parameters[
      "budget"].default is None
  params, batch = _dense_problem()
  plan = kfl.describe(_dense_loss, params, batch).plan
  assert plan.budget == kfac["budget"].default


def test_guide_explains_the_price_line():
  with open(os.path.join(ROOT, "docs", "guide.md"), encoding="utf-8") as f:
    text = f.read()
  paragraphs = [p for p in text.split("\n\n") if "step price:" in p]
  assert len(paragraphs) == 1, "one paragraph of the guide on the price"
  para = paragraphs[0]
  assert "kfl.describe" in para
  sentences = [s for s in re.split(r"(?<=[.!?])\s+", para.strip()) if s]
  assert 2 <= len(sentences) <= 4, sentences
