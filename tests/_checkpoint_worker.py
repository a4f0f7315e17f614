"""The run ``test_checkpoints.py`` checkpoints with orbax: one tiny MLP,
one fixed batch, each K-FAC entry point. ``python _checkpoint_worker.py
DIR`` restores every entry's checkpoint from ``DIR`` in this fresh process,
continues it ``CONTINUE`` steps and saves the parameters to
``DIR/<name>.npz`` for the test to compare bit for bit."""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import kfac_jax_lite as kfl

CONTINUE = 20
X = jax.random.normal(jax.random.PRNGKey(0), (16, 4))
Y = jnp.argmax(X[:, :3], -1)
BATCH = (X, Y)


def init_params():
  k1, k2 = jax.random.split(jax.random.PRNGKey(1))
  return {"w0": 0.5 * jax.random.normal(k1, (4, 6)), "b0": jnp.zeros(6),
          "w1": 0.5 * jax.random.normal(k2, (6, 3))}


def loss_fn(params, batch):
  x, y = batch
  logits = jnp.tanh(x @ params["w0"] + params["b0"]) @ params["w1"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


TXS = {
    "kfac": lambda: optax.chain(kfl.kfac(loss_fn, BATCH, inverse_every=3),
                                optax.sgd(0.1, momentum=0.9)),
    "kfac_optimizer": lambda: kfl.kfac_optimizer(loss_fn, BATCH),
    "eigen_adam": lambda: optax.chain(kfl.eigen_adam(loss_fn, BATCH),
                                      optax.scale(-0.01)),
}


def stepper(tx):
  @jax.jit
  def step(params, opt_state):
    grads = jax.grad(loss_fn)(params, BATCH)
    updates, opt_state = tx.update(grads, opt_state, params, batch=BATCH)
    return optax.apply_updates(params, updates), opt_state
  return step


def run(step, params, opt_state, n):
  for _ in range(n):
    params, opt_state = step(params, opt_state)
  return params, opt_state


def restore_and_continue(directory, name):
  tx = TXS[name]()
  params = init_params()
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                        {"params": params, "opt_state": tx.init(params)})
  with ocp.StandardCheckpointer() as ckpt:
    restored = ckpt.restore(os.path.join(directory, name), target)
  params, _ = run(stepper(tx), restored["params"], restored["opt_state"],
                  CONTINUE)
  np.savez(os.path.join(directory, name + ".npz"),
           **{k: np.asarray(v) for k, v in params.items()})


if __name__ == "__main__":
  for n in TXS:
    restore_and_continue(sys.argv[1], n)
