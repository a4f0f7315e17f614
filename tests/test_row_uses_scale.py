"""Row-mapped and row-use layers against invariances of the math, in
float64 (issue 38: two planted bugs that passed every test).

1. A layer whose rows are uses of its example (a cell reused at every step
of ``lax.scan``) is weighted as the loss weighs its examples.

For a loss that is a mean over examples, the curvature of the batch and of
the batch repeated twice are the same (each example's weight halves, there
are twice as many): ``exact`` statistics (no sampling) of every block,
the scanned RNN cell's among them, must agree to float64 rounding. A
layer's example weights summed instead of averaged (the cell's ``G``
then grows with the batch size) fails it; the earlier tests compared other
layers and the per-example gradients only.

2. Under ``weight_sharing="reduce"`` a graph's input is the mean over its
rows and their shared positions: copying each node to 3 positions (which
the model averages) changes no statistic.
"""
import jax
import jax.numpy as jnp
import numpy as np

import kfac_jax_lite as kfl
from _helpers import x64_mode
from test_tagging_shapes import _rnn_batch, _rnn_loss, _rnn_params


def test_every_block_of_a_scanned_rnn_is_batch_size_invariant():
  """The time-major RNN of ``test_tagging_shapes`` (its recurrent layers'
  rows are uses of their example), its batch axis (1) repeated twice."""
  with x64_mode(True):
    loss, params, batch = _rnn_loss, _rnn_params(jnp.float64), _rnn_batch(
        jnp.float64)
    twice = jax.tree.map(lambda x: jnp.concatenate([x, x], axis=1), batch)
    fn = kfl.value_grad_and_stats(loss, params, batch, estimation="exact")
    assert any(l.row_uses for l in fn.tagged.layers), fn.tagged.layers
    key = jax.random.PRNGKey(0)
    run = jax.jit(fn)  # One compile a batch shape, not eager operations.
    one, two = run(params, batch, key), run(params, twice, key)
    np.testing.assert_allclose(float(one.loss), float(two.loss), rtol=1e-12)
    names = [l.name for l in fn.tagged.layers]
    for name in names:
      for a, b in zip(jax.tree.leaves(one.stats[name]),
                      jax.tree.leaves(two.stats[name])):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype.kind == "f":
          np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13,
                                     err_msg=name)


def _positions_gnn(positions):
  """A graph network whose node layer is applied at ``positions`` shared
  positions per node (the same features copied), averaged, then pooled per
  graph with ``segment_sum``: the function does not depend on
  ``positions``."""
  def loss(p, b):
    x = b["nodes"]
    xp = jnp.broadcast_to(x[:, None, :], (x.shape[0], positions, x.shape[1]))
    hn = jnp.tanh(xp @ p["node"]["w"] + p["node"]["b"]).mean(1)
    g = jax.ops.segment_sum(hn, b["node_graph"], num_segments=3)
    return kfl.softmax_cross_entropy_with_integer_labels(
        g @ p["read"]["w"], b["y"]).mean()
  return loss


def test_reduce_over_a_graphs_rows_divides_by_rows_and_shared_positions():
  """Under ``weight_sharing="reduce"`` an example's input ``ã_i`` is the
  mean over its rows *and* their shared positions: copying each node's
  features to 3 positions (averaged by the model) leaves every block's
  exact statistics as they were with 1 (the earlier tests' row-mapped
  layers all had one shared position, so a mean over the rows alone
  passed them)."""
  with x64_mode(True):
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"node": {"w": jax.random.normal(k[0], (4, 5)),
                       "b": 0.1 * jnp.ones(5)},
              "read": {"w": jax.random.normal(k[1], (5, 3))}}
    batch = {"nodes": jax.random.normal(k[2], (7, 4)),
             "node_graph": jnp.array([0, 0, 1, 1, 1, 2, 2]),
             "y": jnp.array([0, 2, 1])}
    stats = []
    for positions in (1, 3):
      fn = kfl.value_grad_and_stats(_positions_gnn(positions), params, batch,
                                    estimation="exact",
                                    weight_sharing="reduce")
      assert [l.row_map for l in fn.tagged.layers if l.name == "node/w"] == [
          True], fn.tagged.layers
      stats.append(jax.jit(fn)(params, batch, jax.random.PRNGKey(0)).stats)
    for name in ("node/w", "read/w"):
      for a, b in zip(jax.tree.leaves(stats[0][name]),
                      jax.tree.leaves(stats[1][name])):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype.kind == "f":
          np.testing.assert_allclose(b, a, rtol=1e-10, atol=1e-13,
                                     err_msg=name)
