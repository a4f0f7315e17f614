"""``LayerSpec``: the record of one layer kind, and what every kind provides.

A layer kind is one frozen dataclass, a subclass of ``LayerSpec``: its
fields are the configuration of one detected layer of that kind (a kernel's
shape and contracted axes, a convolution's window, ...), and its methods
are everything the library does differently per kind:

* ``recognise(walk, i, eqn, views, ctx)`` (classmethod) — the recogniser
  of the graph walk for the ``primitives`` it names: records a use of
  parameters at equation ``i`` (``walk._record``) and returns None, or
  returns why they are not a layer there, or ``NotImplemented`` (not this
  kind's: the next kind that handles the primitive is asked);
* ``group(uses, leaf_shapes, depth)`` (classmethod) — the spec of a group
  of compatible uses of the same parameters, or ``Unsupported(reason)``;
* ``param_shapes`` — the parameters of its block, in block order;
* ``output_size(use)`` — the size of one row (position) of a use's output
  (None for fallbacks; ``TaggedLoss.positions``);
* ``default_block(damping_mode=, weight_sharing=)`` and
  ``block_for(choice, default)`` / ``with_options(default, options)`` —
  the curvature block for a ``blocks=`` choice (see ``kfac_jax_lite._block_policy``);
* ``data(uses, captures, cotangents, stacked)`` — the captured layer
  inputs and output cotangents in the layout its blocks' ``compute_stats``
  reads (``LayerData.inputs``/``.cotangents``);
* ``per_example_grads(inputs, cotangents)`` — the per-example parameter
  gradients that data determines, and ``gradients(uses, captures,
  cotangents, stacked)`` those of the layer (for blocks that consume
  ``GRADIENTS``, and as a check of the detection).

Class attributes: ``name`` (the registry key, ``Layer.kind`` unless the
spec reports otherwise), ``patterns`` (the use patterns of the graph walk,
``Use.kind``, that a group of this kind may contain), ``primitives`` (the
jaxpr primitives its ``recognise`` handles), ``takes_scaled`` (whether a
parameter scaled by a stop-gradient scalar may reach them: dense and conv
kernels), ``takes_reshaped`` (whether concatenated, regrouped or sliced
views reach its ``recognise``: dense kernels).
"""
from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar, NamedTuple

import jax

from kfac_jax_lite import blocks as B


class Unsupported(Exception):
  """A group of uses that is not a layer of the kind; ``str`` is the reason."""


class Grouping(NamedTuple):
  """A detected layer: its spec and its parameter leaves in block order."""

  spec: "LayerSpec"
  leaves: tuple


class LayerSpec(abc.ABC):
  """One layer kind; see the module docstring."""

  name: ClassVar[str]
  patterns: ClassVar[frozenset] = frozenset()
  is_fallback: ClassVar[bool] = False
  primitives: ClassVar[tuple] = ()
  takes_scaled: ClassVar[bool] = False
  takes_reshaped: ClassVar[bool] = False

  @classmethod
  def recognise(cls, walk, i, eqn, views, ctx):
    """Records the use of parameters at equation ``eqn`` (index ``i``).

    ``walk``: the graph walk (``_analysis.Analysis``: ``_record`` a use, and
    the shared matchers of ``_matching.ViewMatching``); ``views``: per input
    of ``eqn`` the parameter view it carries (None: not a parameter);
    ``ctx``: the walk's context (the jaxpr, its variables' views and
    consumers, the equations already claimed). Returns None once a use is
    recorded, a reason string when the parameters are not a layer of this
    kind there, or ``NotImplemented`` to let another kind try.
    """
    del walk, i, eqn, views, ctx
    return NotImplemented

  @classmethod
  @abc.abstractmethod
  def group(cls, uses, leaf_shapes, depth) -> Grouping:
    """The layer made of ``uses`` (``_analysis.Use``s sharing parameters).

    ``leaf_shapes``: every parameter leaf's shape; ``depth``: the number of
    leading leaf axes sliced by enclosing scans (0 or 1). Raises
    ``Unsupported`` with the reason when the uses do not form one layer.
    """

  @property
  def kind(self) -> str:
    """The kind reported by ``describe`` and matched by ``blocks=``."""
    return self.name

  @property
  def reason(self):
    """Why the parameters fell back (None for a detected layer)."""
    return None

  def output_size(self, use: int) -> int | None:
    """The size of one row of use ``use``'s output (the elements one
    application of the parameters writes: a dense layer's output features,
    a convolution's output channels at one position); its output's other
    elements are rows (positions). None when unknown (fallbacks).
    ``TaggedLoss.positions`` counts the rows; ``describe`` prices them."""
    del use
    return None

  @property
  def notes(self) -> str:
    """A remark for ``describe`` (empty by default)."""
    return ""

  @property
  @abc.abstractmethod
  def param_shapes(self) -> tuple:
    """The block's parameter shapes (one slice of a stacked layer)."""

  @abc.abstractmethod
  def default_block(self, *, damping_mode, weight_sharing):
    """The block a layer of this kind gets without an override."""

  def block_for(self, choice, default):
    """The block for ``choice`` in ``"kronecker"`` (``default``),
    ``"diagonal"``, ``"full"``, ``"naive_diagonal"``; kinds with a
    structured diagonal or full block, or blocks of their own (dense and
    conv: ``"kronecker_vector"``), override this; another choice is a
    ``ValueError``."""
    if choice == "kronecker":
      return default
    if choice == "full":
      return B.Full(self.param_shapes)
    if choice in ("diagonal", "naive_diagonal"):
      return B.NaiveDiagonal(self.param_shapes)
    raise ValueError(f"block choice {choice!r} is not available for a layer "
                     f"of kind {self.kind!r}")

  def with_options(self, default, options):
    """``default`` with the keyword ``options`` of a ``blocks=`` dict."""
    allowed = [f.name for f in dataclasses.fields(default)]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
      raise ValueError(f"{type(default).__name__} takes no option "
                       f"{', '.join(map(repr, unknown))}; its options are "
                       f"{', '.join(allowed)}")
    return dataclasses.replace(default, **options)

  @abc.abstractmethod
  def data(self, uses, captures, cotangents, stacked) -> tuple:
    """``(inputs, cotangents)`` of the layer in its blocks' layout.

    ``uses``: the layer's uses in ``Layer.use_ids`` order; ``captures`` and
    ``cotangents`` are keyed by use id, the cotangents with a leading
    samples axis ``S``. With ``stacked`` both results have a leading axis
    of the stack, the cotangents ``[L, S, ...]``.
    """

  def example_weights(self, weights, inputs, stacked):
    """The loss weights ``c_i`` (None: 1/N) for ``data``'s ``inputs``:
    ``weights`` unless a kind lays its uses out as extra examples."""
    del inputs, stacked
    return weights

  @abc.abstractmethod
  def per_example_grads(self, inputs, cotangents) -> tuple:
    """Per parameter ``[S, N, *shape]``: gradients of ``<g_sn, y_n>``,
    from ``data``'s ``(inputs, cotangents)`` of one (unstacked) layer."""

  def gradients(self, uses, captures, cotangents, stacked) -> tuple:
    """Per parameter ``[L?, S, N, *shape]``: the per-example gradients of
    the layer (arguments as ``data``); ``per_example_grads`` of its data
    unless a kind knows better."""
    inputs, cots = self.data(uses, captures, cotangents, stacked)
    fn = self.per_example_grads
    return jax.vmap(fn)(inputs, cots) if stacked else fn(inputs, cots)
