"""``kfl.eigen_adam``'s step, stage by stage: the checks of ``update``'s
arguments (``step_of``), this step's statistics folded into the factors
(``fold_due``), the bases refreshed where due with Adam's moments carried
into them (``refresh_due``) and Adam's step in the bases (``adam_step``).

Each stage takes the transform's configuration ``cfg`` (``eigen_adam``'s
``_EigenAdam``: ``cfg.adam``, its ``AdamOptions``; ``cfg.curvature``, a
``kfl.CurvatureOptions``; ``cfg.layers``, the detection) and a ``Step``.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from kfac_jax_lite import blocks as B
from kfac_jax_lite import estimators
from kfac_jax_lite.factor import float_dtype
from kfac_jax_lite.optimizers._eigenbasis import (
    basis_of, from_basis, is_factor, rebase_moments, refresh_factor,
    shampoo_stats, to_basis)
from kfac_jax_lite.optimizers import _pending
from kfac_jax_lite.optimizers import transform


def inner_block(block) -> Any:
  """The block of one slice: ``block.block`` for a ``Stacked`` one
  (``Block.one_slice``); a rotated layer's is a ``KroneckerBlock``, with
  its ``layout``."""
  return B.as_block(block).one_slice


def per_slice(layer, fn: Callable) -> Callable:
  """``fn`` on each slice of a stacked layer's arrays (``jax.vmap`` over
  their leading axis), or ``fn`` itself for a layer that is not stacked."""
  return jax.vmap(fn) if isinstance(layer.block, B.Stacked) else fn


def is_rotated(layer) -> bool:
  """Whether ``layer`` runs Adam in an eigenbasis: its block (or, stacked
  under ``lax.scan``, each slice's) is a Kronecker block (dense, conv,
  embedding)."""
  return isinstance(inner_block(layer.block), B.KroneckerBlock)


class Step(NamedTuple):
  """What one update works on: the detection, its rotated layers, the
  gradient's leaves (and, per rotated layer, its matrices), the inputs."""

  tagged: Any
  layers: list
  leaves: list
  vectors: dict
  params: Any
  batch: Any
  stats: Any
  stats_key: Any
  count: Any


def rotated(tagged):
  """The layers of ``tagged`` (a detection) that run Adam in a basis;
  ``ValueError`` for one whose block partitions a side (``side_block``:
  the eigenbasis rotations here take whole or diagonal sides)."""
  layers = [l for l in tagged.layers if is_rotated(l)]
  for l in layers:
    block = inner_block(l.block)
    if block.input_parts > 1 or block.output_parts > 1:
      raise ValueError(
          f"eigen_adam: layer {l.name!r} has a partitioned factor side "
          f"(side_block={block.side_block}); eigen_adam rotates by whole "
          "or diagonal sides: leave side_block out of its blocks= (or use "
          "max_dense_side)")
  return layers


def adam(a, g, m, v, count_inc):
  """One Adam step on ``g`` with moments ``m``, ``v`` at count ``count_inc``:
  ``(direction, m, v)``."""
  m = (1 - a.b1) * g + a.b1 * m
  v = (1 - a.b2) * g ** 2 + a.b2 * v
  m_hat = m / (1 - a.b1 ** count_inc).astype(m.dtype)
  v_hat = v / (1 - a.b2 ** count_inc).astype(v.dtype)
  return m_hat / (jnp.sqrt(v_hat + a.eps_root) + a.eps), m, v


def step_of(cfg, updates, state, params, batch, stats) -> Step:
  """The checks of ``update``'s arguments and its ``_Step``."""
  a, c = cfg.adam, cfg.curvature
  if params is None:
    raise ValueError("eigen_adam needs params: tx.update(grads, state, "
                     "params, batch=batch)")
  if a.basis == "kfac" and stats is None and batch is None:
    raise ValueError(_pending.missing("eigen_adam(basis='kfac').update"))
  tagged = cfg.layers(params)
  layers = rotated(tagged)
  leaves = jax.tree.leaves(updates)  # The gradients.
  vectors = {l.name: tuple(leaves[i].reshape(s) for i, s in zip(
      l.leaves, l.block.param_shapes)) for l in layers}
  _, stats_key = jax.random.split(state.key)
  if c.axis_name is not None and a.basis == "kfac" and stats is None:
    # Independent samples on every device.
    stats_key = jax.random.fold_in(stats_key, jax.lax.axis_index(c.axis_name))
  if a.basis == "kfac" and stats is None:
    if jax.tree.structure(batch) != tagged.batch_treedef:
      raise ValueError(f"batch structure {jax.tree.structure(batch)} "
                       f"differs from the example batch's "
                       f"{tagged.batch_treedef}")
    # This batch's own trace (another batch size), checked to give the
    # example batch's layers, as kfl.kfac does.
    tagged = cfg.layers(params, batch)
    estimators.stats_batch_size(batch, c.stats_fraction, "eigen_adam.update",
                                tagged.examples)
  return Step(tagged, layers, leaves, vectors, params, batch, stats,
               stats_key, state.count)


def _fold(cfg, s: Step, blocks):
  """This step's statistics into the factors: ``(blocks, (loss, bad
  targets, ran))``, the last three from the statistics' own pass on
  ``batch=`` (zeros and False without one)."""
  c = cfg.curvature
  own = _no_pass(float_dtype(s.params))
  if cfg.adam.basis == "shampoo":
    new = {l.name: per_slice(l, lambda v, b=inner_block(l.block):
                             shampoo_stats(b, v))(s.vectors[l.name])
           for l in s.layers}
    if c.axis_name is not None:
      new = jax.lax.pmean(new, c.axis_name)
    if s.batch is not None:  # Its loss and labels, as "kfac"'s pass has.
      loss, bad = estimators.checked_loss(s.tagged, s.params, s.batch)
      if c.axis_name is not None:
        loss, bad = jax.lax.pmean((loss, bad), c.axis_name)
      dtype = float_dtype(s.params)
      own = (jnp.asarray(loss, dtype), jnp.asarray(bad, dtype),
             jnp.ones((), bool))
  elif s.stats is not None:  # Given, or deferred to this branch.
    new = estimators.resolve(s.stats, _all_states(s, blocks),
                             every_step=cov_every(cfg) == 1)
    new = jax.lax.pmean(new, c.axis_name) if c.axis_name else new
  else:
    dtype = float_dtype(s.params)
    all_states = _all_states(s, blocks)
    new, loss = transform.statistics(
        s.tagged, s.params, s.batch, s.stats_key, all_states,
        estimation=c.estimation, num_samples=c.num_samples,
        stats_fraction=c.stats_fraction, axis_name=c.axis_name)
    new, run = estimators.split_run(new)
    bad = jnp.zeros((), dtype) if run is None else run["bad_targets"]
    own = (jnp.asarray(loss, dtype), jnp.asarray(bad, dtype),
           jnp.ones((), bool))
  return transform.accumulate(s.layers, blocks, new, c.cov_decay), own


def _all_states(s: Step, blocks):
  """``{layer name: block state}`` of every tagged layer (a fresh one for
  the layers without a rotated block), for the statistics' pass."""
  dtype = float_dtype(s.params)
  return {l.name: (blocks[l.name] if l.name in blocks
                   else l.block.init(dtype)) for l in s.tagged.layers}


def _no_pass(dtype):
  """``_fold``'s ``(loss, bad targets, ran)`` of a step without its own
  statistics pass."""
  return jnp.zeros((), dtype), jnp.zeros((), dtype), jnp.zeros((), bool)


def cov_every(cfg) -> int:
  """``cov_every``, an int here (``eigen_adam``'s update plans a None
  first)."""
  every = cfg.curvature.cov_every
  assert every is not None
  return every


def fold_due(cfg, s: Step, blocks):
  """``_fold`` on the counts that are multiples of ``cov_every`` (else the
  blocks as they were, and no pass)."""
  every = cov_every(cfg)
  if every == 1:
    return _fold(cfg, s, blocks)
  idle = lambda b: (b, _no_pass(float_dtype(s.params)))
  return jax.lax.cond(s.count % every == 0, functools.partial(_fold, cfg, s),
                      idle, blocks)


def refresh_due(cfg, s: Step, states, mu_b, nu_b):
  """New bases where due, the moments carried into them."""
  a = cfg.adam
  due = (s.count % a.refresh_every == 0) & (s.count > 0)
  needs = {l.name: B.as_block(l.block).has_statistics(states[l.name])
           & (due | ~B.as_block(l.block).is_ready(states[l.name]))
           for l in s.layers}

  def run(args):
    states, mu_b, nu_b = args
    out = ({}, {}, {})
    for l in s.layers:
      old = states[l.name]
      fresh = per_slice(l, lambda st: jax.tree.map(
          lambda f: refresh_factor(f, s.count, a.refresh), st,
          is_leaf=is_factor))(old)
      m, v = per_slice(l, lambda m, v, o, n: rebase_moments(
          m, v, o, n, a.nu_rebase))(mu_b[l.name], nu_b[l.name], old, fresh)
      need = needs[l.name]
      pick = lambda n, o: jax.tree.map(
          lambda x, y: jnp.where(need, x, y), n, o)
      out[0][l.name] = pick(fresh, old)
      out[1][l.name] = pick(m, mu_b[l.name])
      out[2][l.name] = pick(v, nu_b[l.name])
    return out

  if not s.layers:
    return states, mu_b, nu_b
  return jax.lax.cond(jnp.any(jnp.stack(list(needs.values()))), run,
                      lambda x: x, (states, mu_b, nu_b))


def adam_step(cfg, s: Step, state, states, mu_b, nu_b, t):
  """Adam at step ``t``: in the bases for the rotated layers, plainly
  for the rest; ``(updates, mu_b, nu_b, mu, nu)``."""
  leaves = s.leaves
  out, mu, nu = list(leaves), list(state.mu), list(state.nu)
  mu_b, nu_b = dict(mu_b), dict(nu_b)
  for l in s.layers:
    lay, dtype = inner_block(l.block).layout, mu_b[l.name].dtype
    g = per_slice(l, lambda st, v: to_basis(
        lay.to_mat(v).astype(dtype), basis_of(st.a), basis_of(st.g)))(
            states[l.name], s.vectors[l.name])
    u, mu_b[l.name], nu_b[l.name] = adam(cfg.adam, g, mu_b[l.name],
                                          nu_b[l.name], t)
    u = per_slice(l, lambda st, u: lay.from_mat(from_basis(
        u, basis_of(st.a), basis_of(st.g))))(states[l.name], u)
    for i, x in zip(l.leaves, u):
      out[i] = x.reshape(leaves[i].shape).astype(leaves[i].dtype)
  covered = {i for l in s.layers for i in l.leaves}
  for i, g in enumerate(leaves):
    if i not in covered:
      out[i], mu[i], nu[i] = adam(cfg.adam, g, mu[i], nu[i], t)
  return out, mu_b, nu_b, tuple(mu), tuple(nu)
