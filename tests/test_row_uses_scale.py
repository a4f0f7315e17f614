"""A layer whose rows are uses of its example (a cell reused at every step
of ``lax.scan``) is weighted as the loss weighs its examples (issue 38).

For a loss that is a mean over examples, the curvature of the batch and of
the batch repeated twice are the same (each example's weight halves, there
are twice as many): ``exact`` statistics (no sampling) of every block,
the scanned RNN cell's among them, must agree to float64 rounding. A
layer's example weights summed instead of averaged (the cell's ``G``
then grows with the batch size) fails it; the earlier tests compared other
layers and the per-example gradients only.
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
    one, two = fn(params, batch, key), fn(params, twice, key)
    np.testing.assert_allclose(float(one.loss), float(two.loss), rtol=1e-12)
    names = [l.name for l in fn.tagged.layers]
    for name in names:
      for a, b in zip(jax.tree.leaves(one.stats[name]),
                      jax.tree.leaves(two.stats[name])):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype.kind == "f":
          np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13,
                                     err_msg=name)
