"""Orbax checkpoints of every K-FAC state (issue 37): ``ocp.
StandardCheckpointer`` saves params and the optax state of ``kfl.kfac``,
``kfl.kfac_optimizer`` and ``kfl.eigen_adam`` (no zero-size arrays in any
state: orbax refuses those), and a run restored in a fresh process
(``_checkpoint_worker.py``) continues bit-identically for 20 float32 steps.
"""
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import _checkpoint_worker as W

ocp = pytest.importorskip("orbax.checkpoint")


def test_no_state_holds_a_zero_size_array():
  params = W.init_params()
  for name, tx in W.TXS.items():
    empty = [jax.tree_util.keystr(p) for p, x in
             jax.tree_util.tree_flatten_with_path(tx().init(params))[0]
             if np.size(x) == 0]
    assert not empty, (name, empty)


@pytest.mark.slow  # A fresh process (conftest.py: the slow tier).
def test_orbax_restore_in_a_fresh_process_is_bit_identical(tmp_path):
  expected = {}
  for name, make in W.TXS.items():
    tx = make()
    step = W.stepper(tx)
    params, opt_state = W.run(step, W.init_params(), tx.init(W.init_params()),
                              5)
    with ocp.StandardCheckpointer() as ckpt:
      ckpt.save(os.path.join(tmp_path, name),
                {"params": params, "opt_state": opt_state})
    expected[name], _ = W.run(step, params, opt_state, W.CONTINUE)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [os.path.dirname(W.__file__)] + sys.path))
  subprocess.run([sys.executable, W.__file__, str(tmp_path)], check=True,
                 env=env, timeout=300)
  for name, want in expected.items():
    got = np.load(os.path.join(tmp_path, name + ".npz"))
    for k, v in want.items():
      np.testing.assert_array_equal(got[k], np.asarray(v), err_msg=name)
    # The run moved after the restore (a comparison that cannot fail
    # otherwise would pass on a restore that lost the state's effect).
    assert not np.array_equal(got["w1"], np.asarray(W.init_params()["w1"]))
