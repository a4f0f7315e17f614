"""K-FAC in the training loops people write (issue 37): each framework's
loop as its documentation writes it, with the README's K-FAC usage and at
most the one line the README shows for that framework, a few steps on one
tiny MLP and one fixed batch; the loss must fall.

* flax linen ``TrainState.apply_gradients`` (no extra arguments):
  ``kfl.with_batch``/``kfl.with_stats`` put the batch (or one-pass
  statistics) in the optax state, for ``kfac``, ``kfac_optimizer`` and
  ``eigen_adam``; an update with nothing pending names the fix;
* flax nnx ``nnx.Optimizer(model, tx, wrt=nnx.Param)``: init on
  ``Variable``s, update on arrays, the same layers (``_find.unwrap``);
  ``kfl.stats_due``/``kfl.health`` read its ``OptArray`` state;
* Equinox ``filter_value_and_grad``/``filter_jit`` with a
  partition/combine loss;
* Haiku ``transform_with_state`` with the state in the batch;
* ``optax.multi_transform`` freezing a layer: K-FAC outside with
  ``exclude=``; inside, a clear refusal;
* ``optax.MultiSteps`` refused at ``init`` (the accumulation pattern
  named), and the finder of ``stats_due``/``health`` through every
  combinator.

Orbax checkpoints: ``tests/test_checkpoints.py``.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kfl

X = jax.random.normal(jax.random.PRNGKey(0), (32, 5))
Y = jnp.argmax(X[:, :3] + 0.3 * X[:, 3:4], -1)
BATCH = (X, Y)
STEPS = 6


def _falls(losses):
  # A loss that cannot fall from its start fails: the first is the
  # untrained model's, the last after STEPS updates.
  assert all(jnp.isfinite(jnp.asarray(losses))), losses
  assert losses[-1] < 0.9 * losses[0], losses


# ------------------------------------------------------------ flax linen


def _linen():
  import flax.linen as nn

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(3)(jnp.tanh(nn.Dense(8)(x)))
  model = MLP()
  params = model.init(jax.random.PRNGKey(1), X)

  def loss_fn(params, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(
        model.apply(params, x), y).mean()
  return model, params, loss_fn


LINEN_TX = {
    "kfac": lambda loss_fn: optax.chain(kfl.kfac(loss_fn, BATCH),
                                        optax.sgd(0.1, momentum=0.9)),
    "kfac_optimizer": lambda loss_fn: kfl.kfac_optimizer(loss_fn, BATCH),
    "eigen_adam": lambda loss_fn: optax.chain(kfl.eigen_adam(loss_fn, BATCH),
                                              optax.scale(-0.03)),
}


@pytest.mark.parametrize("name", sorted(LINEN_TX))
def test_linen_train_state_with_batch(name):
  from flax.training import train_state
  model, params, loss_fn = _linen()
  state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=LINEN_TX[name](loss_fn))
  state, losses = _train_state_losses(state, loss_fn, STEPS)
  _falls(losses)
  assert kfl.health(state.opt_state).steps == STEPS


def _train_state_losses(state, loss_fn, steps):
  """``steps`` of flax's TrainState loop on ``BATCH`` with the README's one
  added line: ``(state, losses)``."""
  @jax.jit
  def train_step(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
    # The one added line: the batch for the K-FAC update, in the state.
    state = state.replace(opt_state=kfl.with_batch(state.opt_state, batch))
    return state.apply_gradients(grads=grads), loss

  losses = []
  for _ in range(steps):
    state, loss = train_step(state, BATCH)
    losses.append(float(loss))
  return state, losses


def test_linen_train_state_with_stats_one_pass():
  from flax.training import train_state
  model, params, loss_fn = _linen()
  tx = optax.chain(kfl.kfac(loss_fn, BATCH, cov_every=2),
                   optax.sgd(0.1, momentum=0.9))
  state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=tx)
  est_fn = kfl.value_grad_and_stats(loss_fn, params, BATCH)

  @jax.jit
  def train_step(state, batch, key):
    est = est_fn(state.params, batch, key,
                 with_stats=kfl.stats_due(state.opt_state))
    state = state.replace(opt_state=kfl.with_stats(state.opt_state, est))
    return state.apply_gradients(grads=est.grads), est.loss

  losses = []
  for i in range(STEPS):
    state, loss = train_step(state, BATCH, jax.random.PRNGKey(i))
    losses.append(float(loss))
  _falls(losses)
  assert kfl.health(state.opt_state).num_losses == STEPS


@pytest.mark.parametrize("style", ["with_batch", "with_stats"])
@pytest.mark.parametrize("name", sorted(LINEN_TX))
def test_train_state_step_compiles_once(name, style):
  """The README's TrainState step compiles once (issue 48, point 3): the
  stored batch (or statistics) slot is in the state from ``init``, with the
  structure and shapes the step stores, so the second call finds the jit's
  cache (it used to hold None until the first step, which then compiled
  again). A batch of another size works: it compiles for the new shapes
  (a stored batch's twice: the slot still has the old ones at the first
  call), then not."""
  from flax.training import train_state
  model, params, loss_fn = _linen()
  state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=LINEN_TX[name](loss_fn))
  est_fn = kfl.value_grad_and_stats(loss_fn, params, BATCH)
  traces = []

  @jax.jit
  def train_step(state, batch, key):
    traces.append(1)  # Runs once per trace (compile), not per call.
    if style == "with_batch":
      loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
      opt_state = kfl.with_batch(state.opt_state, batch)
    else:
      est = est_fn(state.params, batch, key,
                   with_stats=kfl.stats_due(state.opt_state))
      loss, grads = est.loss, est.grads
      # kfac_optimizer's quadratic model needs the batch too.
      opt_state = kfl.with_stats(
          state.opt_state, est, batch if name == "kfac_optimizer" else None)
    return state.replace(opt_state=opt_state).apply_gradients(
        grads=grads), loss

  for i in range(3):
    state, _ = train_step(state, BATCH, jax.random.PRNGKey(i))
  # Traces, not jit's _cache_size(): TrainState.create's step is a Python
  # int, whose call has a dispatch cache entry of its own (same program).
  assert len(traces) == 1
  assert kfl.health(state.opt_state).steps == 3
  if name == "kfac":  # Another batch size.
    half = jax.tree.map(lambda x: x[:16], BATCH)
    seen = []
    for i in range(3):
      state, loss = train_step(state, half, jax.random.PRNGKey(i))
      seen.append(len(traces))
    # A stored batch of the new shapes is in the second call's input too;
    # the statistics (kfac's one-pass style stores no batch) are not.
    assert seen == ([2, 3, 3] if style == "with_batch" else [2, 2, 2])
    assert jnp.isfinite(loss)
    assert kfl.health(state.opt_state).steps == 6


def test_stored_batch_read_at_run_time():
  """Where the update gets the state as an argument of the trace, with no
  ``with_batch`` in it (a jitted update taking the state as an argument),
  what is stored is only known at run
  time: both paths are compiled, the stored one runs, and an update with
  nothing stored is skipped and counted, ``kfl.health`` naming the fix."""
  _, params, loss_fn = _linen()
  tx = optax.chain(kfl.kfac(loss_fn, BATCH), optax.sgd(0.1))
  grads = jax.grad(loss_fn)(params, BATCH)
  traces = []

  @jax.jit
  def update(grads, state, params):
    traces.append(1)
    return tx.update(grads, state, params)

  u, state = update(grads, tx.init(params), params)  # Nothing stored.
  h = kfl.health(state)
  assert not any(jnp.any(x) for x in jax.tree.leaves(u))
  assert h.steps == 0 and h.missing == 1 and not h.ok
  assert "NOTHING STORED for 1 updates" in str(h), str(h)
  u, state = update(grads, kfl.with_batch(state, BATCH), params)
  want, _ = tx.update(grads, tx.init(params), params, batch=BATCH)
  for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  assert kfl.health(state).steps == 1 and len(traces) == 1
  # None drops the slot (a checkpoint without it, as earlier versions').
  dropped = kfl.with_batch(state, None)
  assert dropped[0].pending is None
  with pytest.raises(ValueError, match=r"kfl\.with_batch\(state\.opt_state"):
    tx.update(grads, dropped, params)



def _slot(opt_state):
  """The stored batch/statistics slot of a ``LINEN_TX`` state."""
  return getattr(opt_state, "pending", None) or opt_state[0].pending


def _nbytes(tree):
  return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("name", sorted(LINEN_TX))
def test_stored_stats_are_used_once_and_not_kept(name):
  """Statistics stored by ``kfl.with_stats`` are used by the next update
  and dropped (issue 47: the slot kept zeros of the statistics, the
  factors' size, from ``init`` on). ``init``'s slot is the example batch's
  zeros and three scalars; statistics stored outside a jitted update give
  the update the keyword arguments give, and the state comes out without
  them: the structure and bytes of ``init``'s state."""
  _, params, loss_fn = _linen()
  tx = LINEN_TX[name](loss_fn)
  state = tx.init(params)
  assert _slot(state).stats is None
  # The batch, the loss, the kind and the missing count: nothing else.
  assert _nbytes(_slot(state)) == _nbytes(BATCH) + 12
  est = jax.jit(kfl.value_grad_and_stats(loss_fn, params, BATCH))(
      params, BATCH, jax.random.PRNGKey(0))  # One compile, not eager ops.
  batch = BATCH if name == "kfac_optimizer" else None  # Its model's.
  stored = kfl.with_stats(state, est, batch)
  assert _nbytes(stored) == _nbytes(state) + _nbytes(est.stats)
  u, new = jax.jit(tx.update)(est.grads, stored, params)
  want, _ = jax.jit(lambda g, s, p, st, l: tx.update(
      g, s, p, stats=st, loss=l, **({} if batch is None else
                                    {"batch": batch})))(
          est.grads, state, params, est.stats, est.loss)
  assert any(jnp.any(x != 0) for x in jax.tree.leaves(u))
  for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  assert _slot(new).stats is None
  assert jax.tree.structure(new) == jax.tree.structure(state)
  assert _nbytes(new) == _nbytes(state)
  assert kfl.health(new).steps == 1

def test_train_state_without_batch_names_the_fix():
  from flax.training import train_state
  model, params, loss_fn = _linen()
  for tx in (optax.chain(kfl.kfac(loss_fn, BATCH), optax.sgd(0.1)),
             kfl.kfac_optimizer(loss_fn, BATCH), kfl.eigen_adam(loss_fn, BATCH)):
    state = train_state.TrainState.create(apply_fn=model.apply,
                                          params=params, tx=tx)
    grads = jax.grad(loss_fn)(params, BATCH)
    with pytest.raises(ValueError, match=r"kfl\.with_batch\(state\.opt_state"):
      state.apply_gradients(grads=grads)


def test_with_batch_refuses_a_state_without_kfac():
  with pytest.raises(ValueError, match="no kfl.kfac"):
    kfl.with_batch(optax.sgd(0.1).init({"w": jnp.zeros(2)}), BATCH)


# -------------------------------------------------------------- flax nnx


def _nnx_mlp():
  """``(model, loss_fn)``: a 5-8-3 nnx MLP and K-FAC's loss of its
  parameters (merged with the model's graph)."""
  from flax import nnx

  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.Linear(5, 8, rngs=rngs)
      self.l2 = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
      return self.l2(jnp.tanh(self.l1(x)))

  model = MLP(nnx.Rngs(0))
  graphdef, _ = nnx.split(model)

  def loss_fn(params, batch):  # K-FAC's loss: of the pure parameters.
    x, y = batch
    logits = nnx.merge(graphdef, params)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  return model, loss_fn


def test_nnx_optimizer_as_documented():
  from flax import nnx
  model, loss_fn = _nnx_mlp()
  tx = optax.chain(kfl.kfac(loss_fn, BATCH), optax.sgd(0.1, momentum=0.9))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, batch):
    def loss(model):
      x, y = batch
      return optax.softmax_cross_entropy_with_integer_labels(
          model(x), y).mean()
    value, grads = nnx.value_and_grad(loss)(model)
    optimizer.update(model, grads, batch=batch)
    return value

  losses = [float(train_step(model, optimizer, BATCH)) for _ in range(STEPS)]
  _falls(losses)
  # The same layers whichever wrapper: named as the pure parameters.
  state = optimizer.opt_state
  assert sorted(kfl.health(state).__class__._fields)  # reads OptArrays
  assert kfl.health(state).steps == STEPS
  # Read through the OptArrays: due on the plan's statistics steps.
  plan = kfl.describe(loss_fn, nnx.state(model, nnx.Param), BATCH).plan
  assert bool(kfl.stats_due(state)) == (STEPS % plan.cov_every == 0)
  kstate = [s for s in jax.tree.leaves(
      state, is_leaf=lambda x: isinstance(x, kfl.KfacState))
            if isinstance(s, kfl.KfacState)][0]
  assert sorted(kstate.blocks) == ["l1/kernel", "l2/kernel"]


def test_nnx_optimizer_one_pass_step():
  """The README's one-pass step in nnx.Optimizer's loop (issue 48, point
  2): the estimate given ``nnx.state(model, nnx.Param)`` returns its
  gradients as ``nnx.Param``s, which ``optimizer.update`` keeps; given
  ``nnx.as_pure(...)`` its plain gradients would be dropped by the
  optimizer's ``wrt`` filter, which K-FAC refuses naming the fix."""
  from flax import nnx
  model, loss_fn = _nnx_mlp()
  tx = optax.chain(kfl.kfac(loss_fn, BATCH), optax.sgd(0.1, momentum=0.9))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  est_fn = kfl.value_grad_and_stats(loss_fn, nnx.state(model, nnx.Param),
                                    BATCH)

  @nnx.jit
  def train_step(model, optimizer, batch, key):
    est = est_fn(nnx.state(model, nnx.Param), batch, key,
                 with_stats=kfl.stats_due(optimizer.opt_state))
    optimizer.update(model, est.grads, stats=est.stats, loss=est.loss)
    return est.loss

  losses = [float(train_step(model, optimizer, BATCH, jax.random.PRNGKey(i)))
            for i in range(STEPS)]
  _falls(losses)
  assert kfl.health(optimizer.opt_state).num_losses == STEPS
  pure = nnx.as_pure(nnx.state(model, nnx.Param))
  pure_fn = kfl.value_grad_and_stats(loss_fn, pure, BATCH)
  est = pure_fn(pure, BATCH, jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match=r"nnx\.state\(model, nnx\.Param\)"):
    optimizer.update(model, est.grads, stats=est.stats)


def _nnx_split_with_batchnorm():
  """nnx's functional pattern: ``nnx.split(model, nnx.Param,
  nnx.BatchStat)``, the BatchNorm statistics in the batch and returned as
  aux. The parameters are a ``State`` of ``nnx.Param``s, whose paths carry
  a ``.value`` element that K-FAC's names must not (issue 48, point 1)."""
  from flax import nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.fc1 = nnx.Linear(5, 8, rngs=rngs)
      self.bn1 = nnx.BatchNorm(8, rngs=rngs)
      self.fc2 = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
      return self.fc2(jax.nn.relu(self.bn1(self.fc1(x),
                                           use_running_average=False)))

  graphdef, params, stats = nnx.split(Net(nnx.Rngs(0)), nnx.Param,
                                      nnx.BatchStat)

  def loss_fn(params, batch):
    net = nnx.merge(graphdef, params, batch["stats"], copy=True)
    loss = optax.softmax_cross_entropy_with_integer_labels(
        net(batch["x"]), batch["y"]).mean()
    return loss, nnx.state(net, nnx.BatchStat)
  return params, {"x": X, "y": Y, "stats": stats}, loss_fn


NNX_SPLIT_TX = {
    "kfac": lambda f, b: optax.chain(kfl.kfac(f, b, has_aux=True),
                                     optax.sgd(0.1, momentum=0.9)),
    "kfac_optimizer": lambda f, b: kfl.kfac_optimizer(f, b, has_aux=True),
    "eigen_adam": lambda f, b: optax.chain(kfl.eigen_adam(f, b, has_aux=True),
                                           optax.scale(-0.03)),
}


@pytest.mark.parametrize("style", ["batch", "one_pass"])
@pytest.mark.parametrize("name", sorted(NNX_SPLIT_TX))
def test_nnx_split_with_batchnorm_every_entry(name, style):
  params, batch, loss_fn = _nnx_split_with_batchnorm()
  names = {r["name"] for r in kfl.describe(loss_fn, params, batch,
                                           has_aux=True)}
  assert {"fc1/kernel", "fc2/kernel"} <= names, names
  assert not any(n.endswith("/value") for n in names), names
  tx = NNX_SPLIT_TX[name](loss_fn, batch)
  state = tx.init(params)
  est_fn = kfl.value_grad_and_stats(loss_fn, params, batch, has_aux=True)
  assert {l.name for l in est_fn.tagged.layers} == names

  @jax.jit
  def step(params, state, batch, key):
    if style == "one_pass":
      est = est_fn(params, batch, key)
      loss, grads, bn = est.loss, est.grads, est.aux
      updates, state = tx.update(grads, state, params, batch=batch,
                                 stats=est.stats, loss=loss)
    else:
      (loss, bn), grads = jax.value_and_grad(loss_fn, has_aux=True)(
          params, batch)
      updates, state = tx.update(grads, state, params, batch=batch)
    return optax.apply_updates(params, updates), state, loss, bn

  losses = []
  for i in range(STEPS):
    params, state, loss, bn = step(params, state, batch, jax.random.PRNGKey(i))
    batch = dict(batch, stats=bn)
    losses.append(float(loss))
  _falls(losses)
  health = kfl.health(state)
  assert health.steps == STEPS and health.bad_events == 0, health


# -------------------------------------------------------------- Equinox


def test_equinox_filter_loop():
  import equinox as eqx
  model = eqx.nn.MLP(5, 3, 8, depth=1, activation=jnp.tanh,
                     key=jax.random.PRNGKey(2))

  def loss(model, batch):  # Equinox's loss, of the model.
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(
        jax.vmap(model)(x), y).mean()

  params, static = eqx.partition(model, eqx.is_array)
  # The one added line: K-FAC's loss takes the arrays (non-array leaves
  # such as the activation are None there) and combines them back.
  loss_fn = lambda p, batch: loss(eqx.combine(p, static), batch)
  tx = optax.chain(kfl.kfac(loss_fn, BATCH), optax.sgd(0.1, momentum=0.9))
  opt_state = tx.init(eqx.filter(model, eqx.is_array))

  @eqx.filter_jit
  def make_step(model, opt_state, batch):
    value, grads = eqx.filter_value_and_grad(loss)(model, batch)
    updates, opt_state = tx.update(grads, opt_state,
                                   eqx.filter(model, eqx.is_array),
                                   batch=batch)
    return eqx.apply_updates(model, updates), opt_state, value

  losses = []
  for _ in range(STEPS):
    model, opt_state, value = make_step(model, opt_state, BATCH)
    losses.append(float(value))
  _falls(losses)


def test_equinox_loss_of_the_model_gets_an_error_naming_the_fix():
  """Equinox's own loss, ``loss(model, batch)``, handed to K-FAC as it is:
  with the filtered arrays as params the loss calls the activation, which
  is None there, inside the trace ('NoneType' object is not callable); with
  the whole model as params the signature check met the activation
  ('Cannot determine dtype of <custom_jvp ...>'). Both now name the fix,
  at ``init``."""
  import equinox as eqx
  model = eqx.nn.MLP(5, 3, 8, depth=1, activation=jax.nn.relu,
                     key=jax.random.PRNGKey(2))

  def loss(model, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(
        jax.vmap(model)(x), y).mean()
  tx = kfl.kfac(loss, BATCH)
  with pytest.raises(TypeError, match=r"hold None in 2 place.*eqx\.combine"):
    tx.init(eqx.filter(model, eqx.is_array))
  with pytest.raises(TypeError, match="'activation' is a custom_jvp, not an "
                     "array.*eqx.filter"):
    tx.init(model)


# ---------------------------------------------------------------- Haiku


def test_haiku_transform_with_state():
  import haiku as hk

  def forward(x):
    h = jnp.tanh(hk.Linear(8)(x))
    h = h + hk.get_state("shift", (), init=jnp.zeros)
    return hk.Linear(3)(h)
  net = hk.transform_with_state(forward)
  params, net_state = net.init(jax.random.PRNGKey(3), X)

  def loss_fn(params, batch):  # The state rides in the batch (README).
    (x, y), net_state = batch
    logits, _ = net.apply(params, net_state, None, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  tx = optax.chain(kfl.kfac(loss_fn, (BATCH, net_state)),
                   optax.sgd(0.1, momentum=0.9))
  opt_state = tx.init(params)

  @jax.jit
  def update(params, net_state, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, (batch, net_state))
    updates, opt_state = tx.update(grads, opt_state, params,
                                   batch=(batch, net_state))
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for _ in range(STEPS):
    params, opt_state, loss = update(params, net_state, opt_state, BATCH)
    losses.append(float(loss))
  _falls(losses)


# ------------------------------------------- masked and partitioned params


def _frozen_labels(params):
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "frozen" if "Dense_0" in jax.tree_util.keystr(path)
      else "train", params)


def test_multi_transform_freezing_a_layer():
  _, params, loss_fn = _linen()
  labels = _frozen_labels(params)
  # K-FAC on the full tree, the frozen layer excluded; the partition after.
  tx = optax.chain(
      kfl.kfac(loss_fn, BATCH, exclude=["params/Dense_0/*"]),
      optax.multi_transform({"train": optax.sgd(0.3, momentum=0.9),
                             "frozen": optax.set_to_zero()}, labels))
  state = tx.init(params)
  step = jax.jit(lambda p, s: _plain_step(tx, loss_fn, p, s))
  losses, p = [], params
  for _ in range(STEPS):
    p, state, loss = step(p, state)
    losses.append(float(loss))
  _falls(losses)
  frozen = params["params"]["Dense_0"]
  assert all(jax.tree.leaves(jax.tree.map(
      lambda a, b: bool(jnp.array_equal(a, b)), frozen, p["params"]["Dense_0"])))


def _plain_step(tx, loss_fn, params, state):
  loss, grads = jax.value_and_grad(loss_fn)(params, BATCH)
  updates, state = tx.update(grads, state, params, batch=BATCH)
  return optax.apply_updates(params, updates), state, loss


@pytest.mark.parametrize("wrap", ["masked", "multi_transform"])
def test_kfac_inside_a_mask_is_refused_naming_exclude(wrap):
  _, params, loss_fn = _linen()
  labels = _frozen_labels(params)
  inner = optax.chain(kfl.kfac(loss_fn, BATCH), optax.sgd(0.1))
  tx = (optax.masked(inner, jax.tree.map(lambda l: l == "train", labels))
        if wrap == "masked" else
        optax.multi_transform({"train": inner, "frozen": optax.set_to_zero()},
                              labels))
  with pytest.raises(ValueError, match="MaskedNode.*exclude="):
    tx.init(params)


# ------------------------------------------------------------ MultiSteps


@pytest.mark.parametrize("entry", ["kfac", "kfac_optimizer", "eigen_adam"])
def test_multisteps_is_refused_at_init_naming_the_accumulation(entry):
  """``optax.MultiSteps`` runs its inner update on every micro-step and
  keeps one in k: every K-FAC entry refuses it at ``init`` (from a
  TrainState too), naming the accumulation pattern, instead of paying its
  statistics, refresh and preconditioning k times (issue 48.6)."""
  from flax.training import train_state
  model, params, loss_fn = _linen()
  inner = getattr(kfl, entry)(loss_fn, BATCH)
  tx = optax.MultiSteps(inner if entry == "kfac_optimizer" else
                        optax.chain(inner, optax.sgd(0.1)), every_k_schedule=2)
  with pytest.raises(ValueError, match="inside optax.MultiSteps.*Accumulate "
                     "the gradient"):
    train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  with pytest.raises(ValueError, match=r"Gradient accumulation"):
    tx.init(params)
  inner.init(params)  # The same transform outside MultiSteps is fine.


def test_finders_through_combinators():
  _, params, loss_fn = _linen()
  # One finder for every combinator that holds the state.
  for wrapped in (optax.apply_if_finite(optax.chain(kfl.kfac(loss_fn, BATCH)),
                                        3),
                  optax.named_chain(("k", kfl.kfac(loss_fn, BATCH)),
                                    ("s", optax.sgd(0.1))),
                  kfl.inject_hyperparams(kfl.kfac)(loss_fn, BATCH),
                  optax.masked(kfl.kfac(loss_fn, BATCH),
                               jax.tree.map(lambda _: True, params))):
    s = wrapped.init(params)
    assert kfl.health(s).steps == 0 and bool(kfl.stats_due(s))
    pending = kfl.with_batch(s, BATCH)
    assert [x.pending.batch for x in jax.tree.leaves(
        pending, is_leaf=lambda x: isinstance(x, kfl.KfacState))
            if isinstance(x, kfl.KfacState)] == [BATCH]


def test_inject_hyperparams_schedules_damping_and_the_bound():
  _, params, loss_fn = _linen()
  # Ints and strings (num_samples, inverse_every, ...) are static; the
  # damping and the KL bound are injected (a schedule, or set by hand).
  tx = optax.chain(
      kfl.inject_hyperparams(kfl.kfac)(
          loss_fn, BATCH, damping=optax.linear_schedule(1e-2, 1e-3, 10),
          norm_constraint=1.0),
      optax.sgd(0.1, momentum=0.9))
  state = tx.init(params)
  step = jax.jit(lambda p, s: _plain_step(tx, loss_fn, p, s))
  losses, p = [], params
  for _ in range(STEPS):
    p, state, loss = step(p, state)
    losses.append(float(loss))
  _falls(losses)
  assert kfl.health(state).steps == STEPS
  np_damping = float(state[0].hyperparams["damping"])
  assert abs(np_damping - (1e-2 - 9e-3 * (STEPS - 1) / 10)) < 1e-6
  with pytest.raises(ValueError, match="not arguments"):
    kfl.inject_hyperparams(kfl.kfac, injected=("lr",))


def test_health_reads_eigen_adam():
  _, params, loss_fn = _linen()
  tx = kfl.eigen_adam(loss_fn, BATCH)
  s = tx.init(params)
  h = kfl.health(s)
  assert h.steps == 0 and h.unready_blocks == 2
  grads = jax.grad(loss_fn)(params, BATCH)
  _, s = jax.jit(functools.partial(tx.update, batch=BATCH))(grads, s, params)
  h = kfl.health(s)
  assert h.steps == 1 and h.unready_blocks == 0 and h.ok
