"""``kfl.inject_hyperparams``: ``optax.inject_hyperparams`` for the K-FAC
transforms, with the options that must be static listed for the user.

``optax.inject_hyperparams(f)`` binds every argument of ``f`` (defaults
included) and turns each numeric one into an array in the optax state,
re-building the transform with them (traced, under ``jit``) at every
update, and calls each callable one as a schedule of the step. For
``kfl.kfac`` that takes ``loss_fn`` for a schedule and makes ``num_samples``,
``cov_every``, ``inverse_every``, ... traced arrays, which shape the
computation and must be Python ints. So only the floats a user schedules
are injected (``INJECTABLE``: the damping and the KL clip's bound, which
``kfl.kfac`` accepts traced); every other argument is static.
"""
from __future__ import annotations

import inspect
from typing import Callable

import optax

INJECTABLE = ("damping", "norm_constraint")
"""The options ``kfl.inject_hyperparams`` injects (when ``factory`` has
them): floats that may be traced values or schedules."""


def inject_hyperparams(factory: Callable, injected=INJECTABLE
                       ) -> Callable[..., optax.GradientTransformationExtraArgs]:
  """``optax.inject_hyperparams(factory, static_args=...)`` with every
  argument of ``factory`` but ``injected`` static.

      tx = kfl.inject_hyperparams(kfl.kfac)(loss_fn, batch, damping=1e-3)
      opt_state.hyperparams["damping"]  # set it, or pass a schedule

  Args:
    factory: ``kfl.kfac`` or ``kfl.kfac_optimizer`` (any function returning
      an optax transform).
    injected: the names kept in ``opt_state.hyperparams`` (those of
      ``INJECTABLE`` by default; ``factory``'s arguments only).

  Returns:
    The factory that ``optax.inject_hyperparams`` returns: call it with
    ``factory``'s arguments; its state's ``hyperparams`` holds the injected
    ones (a schedule given for one is evaluated at each step).
  """
  names = list(inspect.signature(factory).parameters)
  unknown = sorted(set(injected) - set(names))
  if unknown:
    raise ValueError(f"kfl.inject_hyperparams: {unknown} are not arguments "
                     f"of {getattr(factory, '__name__', factory)!r}")
  static = tuple(n for n in names if n not in injected)
  return optax.inject_hyperparams(factory, static_args=static)
