"""The interface every curvature block implements, and the Kronecker family
(the flat family: ``flat.FlatBlock``).

A block is a frozen (hashable) dataclass holding static configuration only;
its state is a pytree of ``FactorState``s and every method is a pure
function of its arguments, so blocks go through ``jit`` as static data and
states go through it as arrays. Parameter "vectors" ``v`` are tuples of
arrays shaped like the block's ``param_shapes``; ``to_dense`` indexes its
rows and columns like the concatenation of those arrays, raveled.

The interface (``Block``; ``damping`` λ, ``exp`` p, ``F`` the block's
curvature):

* ``param_shapes`` — the shapes of the parameters the block covers;
  ``factor_shapes`` — the shapes of its factors (for ``describe``).
* ``consumes`` — which captured data its statistics are computed from
  (``ACTIVATIONS`` or ``GRADIENTS``, see ``LayerData``).
* ``layer_stats(data, state=None)`` — fresh statistics from one layer's
  captured ``LayerData`` (and, for blocks whose statistics depend on it,
  such as an eigenvalue-corrected block, the current state). It calls
  ``compute_stats``, the block's kind-specific function of plain arrays
  (documented on each block). The statistics are a pytree shaped like the
  factors, so they can be ``pmean``-ed across devices before ``update``.
* ``init(dtype)`` — a state with no statistics.
* ``update(state, stats, decay, weight=1.0)`` — zero-debiased EMA; if any
  statistic is non-finite no factor changes (their ``num_skipped`` count it).
* ``refresh(state, damping, exp=-1.0, step=0, method="auto")`` — cache
  decompositions; damped inverses by ``method`` (``factor.INVERSE_METHODS``).
* ``multiply(state, v)`` — ``F v``.
* ``multiply_matpower(state, v, damping, exp, use_cache=False)`` —
  ``(F + λI)^p v`` under the block's damping approximation.
* ``multiply_inverse(state, v, damping, use_cache=False)`` — ``p = -1``.
* ``multiply_cholesky(state, v, damping, transpose=False)`` and
  ``multiply_cholesky_inverse(...)`` — ``L v``, ``Lᵀ v``, ``L⁻¹ v``,
  ``L⁻ᵀ v`` for a square-root factor ``L Lᵀ`` of the damped block.
* ``to_dense(state)`` — ``F`` as an explicit matrix.

``Block`` also gives the state bookkeeping the optimizer reads, from the
factors of a state (``FactorState``): ``caches(state)`` /
``with_caches(state, caches)`` (the ``FactorCache``s alone, which a refresh
replaces), ``has_statistics(state)``, ``is_ready(state)`` (a cached
decomposition of real statistics), ``refresh_caches(...)`` (``refresh``'s
caches, kept while there are no statistics), ``precondition(state, v,
damping, exp)`` (``multiply_matpower`` from the cache; ``v`` itself while
not ready) and ``one_slice`` (the block of one slice of a stacked layer).

``Stacked(block, n)`` (``blocks.stacked``) is the same interface for ``n``
independent copies of a block (a layer stacked along ``lax.scan``).
"""
from __future__ import annotations

import abc
from typing import Any, Callable, ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from kfac_jax_lite.factor import float_dtype
from kfac_jax_lite.blocks import _kron
from kfac_jax_lite import factor as fac
from kfac_jax_lite.blocks import _layout
from kfac_jax_lite.blocks._size import (
    beyond_limit, block_side, check_max_dense_side, check_side_block,
    partitions, state_bytes)

ACTIVATIONS = "activations"
"""``Block.consumes`` of a block that reads the layer's inputs and output
cotangents (``LayerData``)."""
GRADIENTS = "gradients"
"""``Block.consumes`` of a block that reads per-parameter gradients."""

class LayerData(NamedTuple):
  """What was captured for one layer, in the form its block consumes.

  ``weights``: the examples' loss coefficients ``c_i`` ``[N]`` (None: 1/N).
  A block that consumes ``ACTIVATIONS`` reads ``inputs`` (the layer's input
  in its kind's layout: ``[N, *shared, *in_dims]`` for a dense layer, the
  input in its own layout for a convolution, integer ids ``[N, *shared]``
  for an embedding, ``x [N, *y]`` for a scale/shift) and ``cotangents``
  ``[S, ...]`` (``∂ℓ_i/∂y`` of the layer output for S sampled targets).
  A block that consumes ``GRADIENTS`` reads ``grads``: per parameter,
  ``[S, N, *param_shape]`` gradients of each example's ``ℓ_i`` (for a
  fallback, one "example" of weight 1 whose S gradients are those of the
  whole loss). Fields a block does not consume may be None. For a
  ``Stacked`` block every field but ``weights`` has a leading stack axis.
  """

  inputs: Any = None
  cotangents: Any = None
  weights: Any = None
  grads: Any = None


def normalized_weights(weights, n, dtype, where="", hint=""):
  """``(c, w)``: loss coefficients ``c_i`` (default 1/N) and ``w = c / Σc``.

  ``where`` prefixes an error (the block), ``hint`` ends it.
  """
  c = jnp.full((n,), 1.0 / n, dtype) if weights is None else jnp.asarray(
      weights, dtype)
  if c.shape != (n,):
    raise ValueError(f"{where + ': ' if where else ''}weights of shape "
                     f"{c.shape} do not match a batch of {n}{hint}")
  total = jnp.sum(c)
  return c, c / jnp.where(total != 0, total, 1)


def gram(x, y):
  """``Σ_rows xᵀ y`` [k, k] over all leading axes of ``x, y [..., k]``.

  Formed as one 2-D product (``"ni,nj->ij"`` on the flattened rows):
  contracted over several axes at once (``"snri,snrj->ij"``), XLA:CPU
  first transposes an operand into a copy, a kernel of its own that also
  takes in the elementwise work feeding it. In 2-D both operands are read
  as they are (the measurement: ``benchmarks/README.md``,
  ``profile_step.py``).
  """
  return jnp.einsum("ni,nj->ij", x.reshape(-1, x.shape[-1]),
                    y.reshape(-1, y.shape[-1]))


def stats_dtype(*arrays):
  """Statistics are at least float32 (bf16/fp16 activations included)."""
  return float_dtype(arrays)


def split_samples(cotangents, expected_ndim, where):
  """``cotangents`` as ``[S, ...]``: a leading samples axis is optional."""
  if cotangents.ndim == expected_ndim:
    return cotangents[None]
  if cotangents.ndim == expected_ndim + 1:
    return cotangents
  raise ValueError(f"{where}: cotangents of shape {cotangents.shape} should "
                   f"have {expected_ndim} axes (or one more for samples)")


def check_block(block, where):
  """ValueError unless ``block`` implements the ``Block`` interface."""
  missing = [name for name in Block.INTERFACE if not hasattr(block, name)]
  if missing:
    raise ValueError(f"{where}: {block!r} is not a curvature block (it has "
                     f"no {', '.join(missing)}; see kfac_jax_lite.blocks.Block)")
  if block.consumes not in (ACTIVATIONS, GRADIENTS):
    raise ValueError(f"{where}: {block!r} consumes {block.consumes!r}; "
                     f"expected {ACTIVATIONS!r} or {GRADIENTS!r}")


class Block(abc.ABC):
  """The interface of a curvature block; see the module docstring."""

  INTERFACE: ClassVar[tuple] = (
      "param_shapes", "factor_shapes", "consumes", "layer_stats", "init",
      "update", "refresh", "multiply", "multiply_matpower",
      "multiply_inverse", "multiply_cholesky", "multiply_cholesky_inverse",
      "to_dense")
  consumes: ClassVar[str] = ACTIVATIONS
  # Whether ``layer_stats`` reads the block's current state (EKFAC's
  # scalings are measured in its eigenbasis): such a block's statistics can
  # only be computed where its state is (not in ``kfl.sharding``'s layout).
  stats_use_state: ClassVar[bool] = False
  # Whether every square statistic ``[..., n, n]`` of ``compute_stats`` is
  # symmetric (a covariance), so that its upper triangle says all of it
  # (``kfl.sharding`` sends only that between devices).
  symmetric_stats: ClassVar[bool] = False
  # Provided by each subclass (a dataclass field, a property or a method).
  param_shapes: tuple[tuple[int, ...], ...]
  factor_shapes: tuple
  refresh: Callable[..., Any]
  multiply_matpower: Callable[..., Any]

  @abc.abstractmethod
  def compute_stats(self, *args, weights=None):
    """Fresh statistics from plain arrays (see each block)."""

  def layer_stats(self, data: LayerData, state=None):
    """Statistics from a layer's captured data: by default
    ``compute_stats(data.inputs, data.cotangents, weights=data.weights)``.
    ``state`` is the block's current state; blocks whose statistics do not
    depend on it ignore it."""
    del state
    return self.compute_stats(data.inputs, data.cotangents,
                              weights=data.weights)

  @abc.abstractmethod
  def init(self, dtype=jnp.float32):
    """A state with no statistics."""

  def state_bytes(self):
    return state_bytes(self)

  @property
  def one_slice(self):
    """The block of one slice of a scan-stacked layer: the block itself
    (``Stacked``: the block it maps over its stack)."""
    return self

  # The state's bookkeeping (one block; ``Stacked`` maps it over its stack).
  def caches(self, state):
    """The ``FactorCache``s of ``state``, in its structure (``caches``)."""
    return caches(state)

  def with_caches(self, state, caches):
    """``state`` with its factors' caches replaced by ``caches`` (the
    structure ``caches`` gives)."""
    return jax.tree.map(
        lambda f, c: f._replace(cache=c) if _is_factor(f) else f, state,
        caches, is_leaf=_is_factor)

  def has_statistics(self, state):
    """Whether every factor has received statistics (``FactorState.weight
    > 0``): before that a factor reads as zero."""
    return has_statistics(state)

  def is_ready(self, state):
    """Whether every factor has a cached decomposition of real statistics
    (``FactorState.cache.step >= 0``); a block that is not ready passes its
    gradient through unpreconditioned (``precondition``)."""
    return is_ready(state)

  def refresh_caches(self, state, damping, exp=-1.0, step=0, method="auto"):
    """The caches after ``refresh(state, damping, exp, step, method)``; a
    block whose factors have no statistics yet keeps its caches (it stays
    not ready) rather than cache a decomposition of the damping alone."""
    new = self.caches(self.refresh(state, damping, exp, step=step,
                                   method=method))
    old = self.caches(state)
    ok = self.has_statistics(state)
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)

  def precondition(self, state, vectors, damping, exp):
    """``(F + λI)^exp v`` from the cache; ``vectors`` as they are while the
    block is not ready (``is_ready``)."""
    u = self.multiply_matpower(state, vectors, damping, exp, use_cache=True)
    ready = self.is_ready(state)
    return tuple(jnp.where(ready, x, y.astype(x.dtype))
                 for x, y in zip(u, vectors))


def as_block(block):
  """``block`` as a ``Block``: itself, or, for an object that implements
  the interface (``check_block``) without subclassing ``Block``, an
  adapter whose bookkeeping methods (``is_ready``, ``refresh_caches``,
  ``precondition``, ...) call that object's own ``refresh`` and
  ``multiply_matpower``; its ``one_slice`` is the object."""
  return block if isinstance(block, Block) else _Adapted(block)


class _Adapted(Block):
  """A ``Block`` view of a duck-typed block (see ``as_block``)."""

  def __init__(self, wrapped):
    self.wrapped = wrapped

  def __getattr__(self, attr):
    return getattr(self.__dict__["wrapped"], attr)

  @property
  def consumes(self):
    return self.wrapped.consumes

  @property
  def one_slice(self):
    return self.wrapped

  def compute_stats(self, *args, weights=None):
    return self.wrapped.compute_stats(*args, weights=weights)

  def layer_stats(self, data, state=None):
    return self.wrapped.layer_stats(data, state)

  def init(self, dtype=jnp.float32):
    return self.wrapped.init(dtype)


def _is_factor(x):
  return isinstance(x, fac.FactorState)


def _factors(state):
  return [f for f in jax.tree.leaves(state, is_leaf=_is_factor)
          if _is_factor(f)]


def caches(state):
  """A block state's ``FactorCache``s, in its structure (its other leaves
  as they are)."""
  return jax.tree.map(lambda f: f.cache if _is_factor(f) else f, state,
                      is_leaf=_is_factor)


def has_statistics(state):
  """Whether every factor of one (unstacked) block state has received
  statistics (``FactorState.weight > 0``)."""
  return jnp.all(jnp.stack([f.weight > 0 for f in _factors(state)]))


def is_ready(state):
  """Whether every factor of one (unstacked) block state has a cached
  decomposition of real statistics (``FactorState.cache.step >= 0``)."""
  return jnp.all(jnp.stack([f.cache.step >= 0 for f in _factors(state)]))


def on_layout_matrix(block, v, fn):
  """``fn(V)`` on the parameters ``v`` in ``block.layout``'s ``[groups, a,
  b]`` matrix form (at least float32), returned as parameters in ``v``'s
  dtypes; ``v`` is checked against ``block.param_shapes``."""
  _layout.check_params(block, v, block.param_shapes)
  dtypes = [jnp.asarray(x).dtype for x in v]
  m = block.layout.to_mat(tuple(v))
  out = fn(m.astype(float_dtype(m)))
  return tuple(x.astype(d) for x, d in zip(block.layout.from_mat(out), dtypes))


def from_canonical(block, canon):
  """``to_dense``'s matrix from ``canon``, the block's matrix in the
  layout's order (``[groups·a·b]²``, row-major per group): rows and columns
  moved to the order of the concatenated, raveled parameters."""
  idx = block.layout.to_mat(_layout.param_index(block.param_shapes)).ravel()
  return jnp.zeros_like(canon).at[idx[:, None], idx[None, :]].set(canon)


class KroneckerBlock(Block):
  """``F = c · blockdiag_g(A_g ⊗ G_g)`` over the layout's ``[g, a, b]`` view.

  Subclasses provide ``layout``, ``damping_mode``, ``renorm_coeff``,
  ``max_dense_side``, ``side_block`` and ``compute_stats``;
  ``input_diagonal`` and ``output_diagonal`` say a factor keeps only its
  diagonal: a side larger than ``max_dense_side`` does
  (``MAX_DENSE_SIDE``), so that ``F ≈ c · diag(A) ⊗ G`` (or ``A ⊗
  diag(G)``, ``diag(A) ⊗ diag(G)``). ``input_parts`` and ``output_parts``
  say a dense side within the limit but larger than ``side_block`` is
  partitioned (Shampoo's blocks): ``A ≈ blockdiag(A_1, ..., A_p)``, the
  dense ``A``'s diagonal blocks of ``⌈a / p⌉`` rows each (a factor ``[g,
  p, k, k]``); its statistics ``2·m·a·k`` instead of ``2·m·a²``, its
  preconditioning ``2·a·b·k`` instead of ``2·a²·b``, its refresh
  ``p·k³`` instead of ``a³``.
  """

  symmetric_stats: ClassVar[bool] = True  # A and G: covariances.
  # Provided by each subclass (dataclass fields or properties).
  layout: _layout.Layout
  damping_mode: str
  renorm_coeff: float
  max_dense_side: int | None
  side_block: int | None = None  # A subclass without the field: whole sides.

  @property
  def input_diagonal(self) -> bool:
    """Whether the input factor ``A`` keeps only its diagonal: its input
    features, the bias's row not counted, are over the limit (so that a
    1024-wide layer with a bias, ``A`` of side 1025, stays dense at 1024)."""
    return beyond_limit(self.layout.a - int(self.layout.has_bias),
                        self.max_dense_side)

  @property
  def output_diagonal(self) -> bool:
    """Whether the output factor ``G`` keeps only its diagonal."""
    return beyond_limit(self.layout.b, self.max_dense_side)

  @property
  def input_parts(self) -> int:
    """How many diagonal blocks the input factor ``A`` is partitioned
    into (1: whole or diagonal); its input features counted without the
    bias's row, as the limit counts them."""
    if self.input_diagonal:
      return 1
    return partitions(self.layout.a - int(self.layout.has_bias),
                      self.side_block)

  @property
  def output_parts(self) -> int:
    """How many diagonal blocks the output factor ``G`` is partitioned
    into (1: whole or diagonal)."""
    return 1 if self.output_diagonal else partitions(self.layout.b,
                                                     self.side_block)

  @property
  def param_shapes(self):
    return self.layout.param_shapes

  @property
  def factor_shapes(self):
    """Shapes of the input and output factors (leading axis: groups; a
    partitioned side ``(g, p, k, k)``)."""
    g = self.layout.groups
    return tuple(_side_shape(g, n, diagonal, parts)
                 for n, diagonal, parts in self._sides())

  def _sides(self):
    """``(n, diagonal, parts)`` of the input and the output side."""
    lay = self.layout
    return ((lay.a, self.input_diagonal, self.input_parts),
            (lay.b, self.output_diagonal, self.output_parts))

  def init(self, dtype=jnp.float32) -> _kron.KroneckerState:
    g = self.layout.groups
    cache = _kron.cache_kind(self.damping_mode)
    a, b = (fac.init_factor(block_side(n, parts), diagonal=diagonal,
                            batch_shape=(g,) if parts == 1 else (g, parts),
                            dtype=dtype, cache=cache)
            for n, diagonal, parts in self._sides())
    return _kron.KroneckerState(a=a, g=b)

  def update(self, state, stats, decay, weight=1.0):
    ok = fac.all_finite(stats)
    return _kron.KroneckerState(
        a=fac.update_cov_if(state.a, stats.a, decay, weight, ok),
        g=fac.update_cov_if(state.g, stats.g, decay, weight, ok))

  def refresh(self, state, damping, exp=-1.0, step=0, method="auto"):
    return _kron.refresh(state, damping, exp, self.damping_mode,
                         self.renorm_coeff, step, method,
                         sizes=(self.layout.a, self.layout.b))

  def _apply(self, v, fn):
    return on_layout_matrix(self, v, fn)

  def multiply(self, state, v):
    return self._apply(v, lambda m: _kron.multiply(state, m, self.renorm_coeff))

  def multiply_matpower(self, state, v, damping, exp, use_cache=False):
    return self._apply(v, lambda m: _kron.matpower(
        state, m, damping, exp, self.damping_mode, self.renorm_coeff, use_cache))

  def multiply_inverse(self, state, v, damping, use_cache=False):
    return self.multiply_matpower(state, v, damping, -1.0, use_cache)

  def multiply_cholesky(self, state, v, damping, transpose=False):
    return self._apply(v, lambda m: _kron.cholesky(
        state, m, damping, self.damping_mode, self.renorm_coeff,
        transpose=transpose))

  def multiply_cholesky_inverse(self, state, v, damping, transpose=False):
    return self._apply(v, lambda m: _kron.cholesky(
        state, m, damping, self.damping_mode, self.renorm_coeff,
        inverse=True, transpose=transpose))

  def to_dense(self, state):
    return from_canonical(self, _kron.to_dense(
        state, self.renorm_coeff, sizes=(self.layout.a, self.layout.b)))

  def check_options(self):
    """``ValueError`` for a bad ``damping_mode``, ``renorm_coeff`` or
    ``max_dense_side`` (each subclass's ``__post_init__``)."""
    check_max_dense_side(self.max_dense_side, type(self).__name__)
    check_side_block(self.side_block, type(self).__name__)
    _kron.check_damping_mode(self.damping_mode, type(self).__name__)
    if not self.renorm_coeff > 0:
      raise ValueError(f"{type(self).__name__}: renorm_coeff must be > 0, "
                       f"got {self.renorm_coeff}")


def _side_shape(groups, n, diagonal, parts):
  """A factor side's shape: ``(g, n)`` diagonal, ``(g, n, n)`` dense,
  ``(g, p, k, k)`` partitioned into ``p`` blocks of ``k = ⌈n/p⌉``."""
  if diagonal:
    return (groups, n)
  if parts == 1:
    return (groups, n, n)
  k = block_side(n, parts)
  return (groups, parts, k, k)
