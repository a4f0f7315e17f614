"""The optimizers: the optax transforms built on the curvature, their states
and their safeguards, and the layouts of their state across devices.

Owns ``kfl.kfac`` (``transform``: the preconditioner; its stages, KL clip,
finiteness guard, detection cache and health summaries), ``kfl.kfac_optimizer``
(``optimizer``: Martens & Grosse's adaptive damping and quadratic-model
step), ``kfl.eigen_adam`` (``eigen_adam``: Adam in the factors' eigenbasis),
``kfl.stats_due`` (``onepass``), ``kfl.with_batch``/``kfl.with_stats``
(``pending``: the next update's inputs carried in the state, for loops
that pass no extra arguments), the sharded layout of a ``kfl.kfac`` state
(``sharding``, also ``kfl.sharding``) and ``kfl.health`` (``health``).

May import: ``factor``, ``blocks``, ``losses``, ``tagging``, ``estimators``
(the layers below); nothing above it (``laplace`` and the package root
import it, never the reverse).
"""
