"""The FLOP price of a K-FAC step, per block, against SGD's (``describe``).

The design brief's performance model, per block kind. For a Kronecker
block on a dense layer (``a = d_in + 1`` with a bias, ``b = d_out``) at
batch ``M``, ``P`` rows per example (positions: 1 for a dense layer on
``[M, d_in]``, the output positions of a convolution, the steps of a scan),
statistics on ``m = round(M·f)`` examples every ``K = cov_every`` updates
and a refresh every ``T = inverse_every``::

    SGD share      6·M·P·a·b                forward 2·M·P·a·b + backward 4·M·P·a·b
    statistics     ( 2·m·P·a·b              sampled backward through the layer
                   + 2·m·P·(a² + b²)        covariances A and G
                   [+ 2·m·P·a·b] ) / K      the statistics' own forward (2-pass)
    precondition   2·(a²·b + a·b²)          A⁻¹ V G⁻¹
    refresh        c·(a³ + b³) / T          inverses of A and G

with ``c`` the FLOPs per ``n³`` of one inverse (``INVERSE_COSTS``). The
other kinds, with ``g`` groups (a grouped convolution's blocks) counted as
``g`` such blocks:

* A convolution: the same with ``a = kh·kw·c_in (+1)``, ``b = c_out`` and
  ``P`` its output positions. ``weight_sharing="reduce"`` sums the rows
  first (``M·P·(a + b)``) and then forms ``2·m·(a² + b²)``.
* An embedding (diagonal ``A``, ``a = vocab``, ``b = dim``): SGD share the
  scatter-add of the gradient ``M·P·b`` (the lookup itself is no FLOP);
  statistics no sampled backward through the layer (its inputs are ids),
  ``A`` the counts ``m·P``, ``G`` ``2·m·P·b²``; precondition
  ``a·b + 2·a·b²``; refresh ``a + c·b³``.
* A side over the size limit (``max_dense_side``) keeps its diagonal
  ``n``: statistics ``2·m·P·n`` (squares summed), precondition ``a·b``
  (a scaling), refresh ``n`` (reciprocals) instead of ``2·m·P·n²``,
  ``2·n·a·b`` and ``c·n³``.
* A side partitioned into ``p`` diagonal blocks of ``k`` (``side_block``;
  ``n = p·k`` with its padding): statistics ``2·m·P·n·k``, precondition
  ``2·k·a·b`` (``a``, ``b`` the padded sides), refresh ``c·p·k³``
  instead of ``2·m·P·n²``, ``2·n·a·b`` and ``c·n³``; the SGD share and
  the forward keep the layer's real sizes.
* More square factors (the series blocks' two pairs) are each priced as a
  covariance, a product with the gradient and an inverse; an EK-FAC
  block's scaling ``[a, b]`` adds ``2·m·P·(a² + b² + a·b)`` to the
  statistics (inputs and cotangents rotated into the eigenbases, the
  products squared) and ``a·b`` to the precondition. Eigenbasis blocks
  (EK-FAC, ``damping_mode="exact"``) refresh by ``eigh`` (``c = 10``) and
  precondition by rotating in and out: twice ``2·(a²·b + a·b²)``.
* A Kronecker-vector block (``"kronecker_vector"``, Eva): statistics the
  two weighted sums ``2·m·P·(a + b)`` (plus the sampled backward), no
  refresh work beyond copying ``a + b`` numbers, precondition ``4·a·b``
  (the bilinear form ``āᵀ V ḡ`` and the rank-one update).
* Flat blocks over ``n`` parameters (``"diagonal"``, ``"full"``,
  ``"naive_diagonal"``, scale-and-shift): per-example gradients
  ``2·m·P·n`` (plus the sampled backward ``2·m·P·n`` through a dense or
  convolution layer), then their squares ``2·m·n`` (diagonal) or outer
  products ``2·m·n²`` (full); precondition ``n`` or ``2·n²``; refresh ``n``
  (reciprocals) or ``c·n³``. SGD share ``6·M·P·n`` for a dense or
  convolution layer, ``3·M·P·n`` for an elementwise scale and shift,
  ``M·P·dim`` for an embedding. A fallback (no rows known) has SGD share 0
  and statistics of one gradient: ``2·n`` or ``2·n²``.

Not counted: the activations, the loss and every other non-layer operation
(in SGD's step as in K-FAC's), the EMA of the factors (``O(a² + b²)`` per
update), the KL clip and the damping's traces (``O(a·b)``), more than one
sampled draw (``num_samples``) and the extra backward passes of
``"curvature_prop"``/``"exact"``. ``estimation="empirical_shared"`` has no
sampled backward. A stacked layer's ``L`` slices: ``P`` counts every slice's
rows, precondition and refresh are times ``L``.
"""
from __future__ import annotations

import math
from typing import NamedTuple

# FLOPs per n³ of one damped inverse, per ``inverse_method`` (as
# ``kfl.factor.INVERSES`` describes them).
INVERSE_COSTS = {
    "gauss_jordan": 2.0,    # Blocked Gauss-Jordan: 2n³.
    "schur": 2.0,           # One Schur split, then Gauss-Jordan: 2n³.
    "cholesky": 7 / 3,      # n³/3 factorisation + 2n³ solve against I.
    "newton_schulz": 4.0,   # One step X + X(I - mX): 4n³ (warm, converged).
    "eigh": 10.0,           # A symmetric eigendecomposition with vectors.
}
EIGH_COST = INVERSE_COSTS["eigh"]


class Flops(NamedTuple):
  """FLOPs of one block per step (see the module docstring).

  Attributes:
    sgd: the layer's forward and backward: its share of SGD's step.
    statistics: the statistics, per update (over ``cov_every``).
    precondition: the preconditioned gradient, every update.
    refresh: the inverses, per update (over ``inverse_every``).
  """

  sgd: float
  statistics: float
  precondition: float
  refresh: float

  @property
  def kfac(self) -> float:
    """K-FAC's step: SGD's share and the three pieces."""
    return self.sgd + self.statistics + self.precondition + self.refresh


def kronecker(factors, m, *, positions=1.0, stats_m=None, slices=1, c=1.0,
              inverse_every: float = 10, cov_every=1, own_forward=False,
              backward=True, eigenbasis=False, reduce=False,
              embedding=False, sizes=None) -> Flops:
  """The price of a Kronecker-family block (module docstring).

  Args:
    factors: its factor shapes, one slice, each with the groups axis first:
      ``(g, a, a)`` or ``(g, a)`` (diagonal) first, then the output side
      (square or diagonal), further square ones, and an EK-FAC scaling
      ``(g, a, b)``; ``b`` is the last side's size.
    m: the batch size ``M`` (examples).
    positions: ``P``, rows per example (all slices and uses).
    stats_m: the examples of the statistics (``M`` if None).
    slices: the slices ``L`` of a stacked layer.
    c: FLOPs per ``n³`` of one inverse.
    inverse_every: ``T`` (``math.inf``: no refresh).
    cov_every: ``K``.
    own_forward: the statistics take their own forward pass (2-pass).
    backward: the statistics take the sampled backward through the layer.
    eigenbasis: kept as eigendecompositions (EK-FAC, exact damping).
    reduce: ``weight_sharing="reduce"``.
    embedding: an embedding (ids in: its diagonal ``A`` holds counts).
    sizes: the layer's real ``(a, b)`` for its SGD share and forward (a
      partitioned side's shape holds its padded length); None: from the
      shapes.
  """
  stats_m = m if stats_m is None else stats_m
  factors = [tuple(f) for f in factors]
  # EK-FAC: (A, G, scaling); the series blocks: two pairs; else (A, G).
  scaling = factors[2] if len(factors) == 3 else None
  sides = factors[:2] if scaling else factors
  g, a, b = factors[0][0], _side(factors[0])[0], _side(sides[-1])[0]
  real_a, real_b = (a, b) if sizes is None else sizes
  rows = stats_m * positions  # Rows the statistics see (all slices).
  c = EIGH_COST if eigenbasis else c
  if embedding:
    sgd, forward, through = m * positions * g * real_b, 0.0, 0.0
  else:
    sgd = 6 * m * positions * g * real_a * real_b
    forward = 2 * rows * g * real_a * real_b
    through = forward if backward else 0.0
  stats = precondition = refresh = 0.0
  for i, side in enumerate(sides):
    n, k = _side(side)  # k: a dense block's side (n unless partitioned).
    if len(side) == 2:  # A diagonal side: counts, or squares summed.
      if embedding and i == 0:
        stats += rows * g
      elif reduce:
        stats += stats_m * positions * g * n + 2 * stats_m * g * n
      else:
        stats += 2 * rows * g * n
      precondition += g * a * b
      refresh += g * n
      continue
    if reduce:  # Rows summed first, then one row per example.
      stats += stats_m * positions * g * n + 2 * stats_m * g * n * k
    else:
      stats += 2 * rows * g * n * k
    precondition += (2 if eigenbasis else 1) * 2 * g * k * a * b
    refresh += c * g * n * k ** 2
  if scaling is not None:
    stats += 2 * rows * g * (a * a + b * b + a * b)
    precondition += g * a * b
  stats += through + (forward if own_forward else 0.0)
  return Flops(sgd=sgd, statistics=stats / cov_every,
               precondition=slices * precondition,
               refresh=slices * refresh / inverse_every)


def _side(shape):
  """``(n, k)`` of a factor side's shape: ``(g, n)`` (diagonal) and ``(g,
  n, n)`` give ``(n, n)``, a partitioned ``(g, p, k, k)`` gives ``(p·k,
  k)``."""
  if len(shape) == 4:
    return shape[1] * shape[2], shape[2]
  return shape[1], shape[1]


def kronecker_vector(factors, m, *, positions=1.0, stats_m=None, slices=1,
                     c=1.0, inverse_every: float = 10, cov_every=1,
                     own_forward=False, backward=True) -> Flops:
  """The price of a Kronecker-vector block: ``factors`` ``((g, a), (g, b))``
  (its two vectors); the other arguments as ``kronecker`` (``c`` unused:
  nothing is inverted)."""
  del c
  stats_m = m if stats_m is None else stats_m
  (g, a), (_, b) = (tuple(f) for f in factors)
  rows = stats_m * positions
  sgd, forward = 6 * m * positions * g * a * b, 2 * rows * g * a * b
  stats = 2 * rows * g * (a + b) + (forward if backward else 0.0) + (
      forward if own_forward else 0.0)
  return Flops(sgd=sgd, statistics=stats / cov_every,
               precondition=slices * 4 * g * a * b,
               refresh=slices * g * (a + b) / inverse_every)


# The SGD share per parameter and row of a flat block, by layer kind.
_SGD_PER_PARAM = {"dense": 6.0, "conv": 6.0, "scale_and_shift": 3.0}


def flat(n, m, *, kind, diagonal, positions=None, output_size=None,
         stats_m=None, slices=1, c=1.0, inverse_every: float = 10, cov_every=1,
         own_forward=False, backward=True) -> Flops:
  """The price of a diagonal or full block over ``n`` parameters (one
  slice; module docstring). ``kind``: the layer kind (``"dense"``,
  ``"conv"``, ``"embedding"``, ``"scale_and_shift"``, ``"fallback"``);
  ``positions``: ``P`` (None: no rows known, a fallback);
  ``output_size``: an embedding's ``dim``; the others as ``kronecker``."""
  stats_m = m if stats_m is None else stats_m
  if positions is None:
    sgd = 0.0
    stats = 2.0 * n if diagonal else 2.0 * n * n
  else:
    if kind == "embedding":
      sgd = m * positions * (output_size or 0)
    else:
      sgd = _SGD_PER_PARAM.get(kind, 0.0) * m * positions * n
    rows = stats_m * positions
    stats = 2 * rows * n  # Per-example gradients (every slice's rows).
    if kind in ("dense", "conv") and backward:
      stats += 2 * rows * n
    stats += slices * (2 * stats_m * n if diagonal else 2 * stats_m * n * n)
    if own_forward:
      stats += sgd / 3 * stats_m / m
  precondition = n if diagonal else 2.0 * n * n
  refresh = n if diagonal else c * n ** 3
  return Flops(sgd=sgd, statistics=stats / cov_every,
               precondition=slices * precondition,
               refresh=slices * refresh / inverse_every)


def dense_layers(dims, m, *, fraction=1.0, inverse_every=math.inf, c=1.0,
                 two_pass=False):
  """The ``Flops`` of each dense layer (with a bias) of an MLP ``dims``
  at batch ``m``, statistics on ``f·m`` examples (the benchmarks' floor)."""
  return [kronecker(((1, d_in + 1, d_in + 1), (1, b, b)), m,
                    stats_m=fraction * m, c=c, inverse_every=inverse_every,
                    own_forward=two_pass)
          for d_in, b in zip(dims[:-1], dims[1:])]


QUADRATIC_MODEL_PASSES = 2.0
"""``kfl.kfac_optimizer``'s quadratic model per step, in SGD steps of the
share of the batch it sees (``quadratic_model``)."""


def quadratic_model(sgd: float, fraction: float = 1.0) -> float:
  """The FLOPs of ``kfl.kfac_optimizer``'s every-step work beyond the
  gradient and the preconditioning, for layers whose SGD share is ``sgd``
  and a quadratic model on the share ``fraction`` of the batch
  (``model_fraction``): a linearised forward pass (the primal, ``F``, and
  the two directions' tangents, ``2·2F``: each tangent of ``x·W`` is
  ``dx·W + x·dW``) and the loss at the new parameters (``F``, for ρ), with
  ``F = sgd/3`` the forward pass: ``6F = 2·sgd`` per unit of
  ``fraction``. The loss weights' forward pass repeats the linearised
  one's primal, which XLA computes once (common subexpressions). On the
  MNIST autoencoder (batch 1000) the step of ``fraction=1`` took 1.48
  SGD steps more than that of ``1/4`` per unit of ``fraction``
  (``benchmarks/model_fraction_step.py``), under the 2 priced here."""
  return QUADRATIC_MODEL_PASSES * fraction * sgd


def ratio(flops) -> float | None:
  """K-FAC's step over SGD's, summed over the blocks (None without an SGD
  share)."""
  sgd = sum(f.sgd for f in flops)
  return sum(f.kfac for f in flops) / sgd if sgd else None


class Price(NamedTuple):
  """The step's price summed over the blocks (``Table.price``).

  Attributes:
    flops: the summed ``Flops``.
    ratio: K-FAC's step over SGD's (None without an SGD share).
    statistics: the statistics over SGD's step (None likewise).
    precondition: the preconditioning over SGD's step.
    refresh: the refresh over SGD's step.
  """

  flops: Flops
  ratio: float | None
  statistics: float | None
  precondition: float | None
  refresh: float | None


def price(flops) -> Price:
  """The ``Price`` of the blocks' ``flops``."""
  total = Flops(*(sum(f[i] for f in flops) for i in range(len(Flops._fields))))
  share = (lambda x: x / total.sgd) if total.sgd else (lambda x: None)
  return Price(total, share(total.kfac), share(total.statistics),
               share(total.precondition), share(total.refresh))
