"""Tagging: find the layers of a traced loss, and rewrite it to expose them.

Layer 2. Owns the jaxpr analysis, the layer kinds (``_kinds``), the loss
recognition and the block policy (``_block_policy``: the block of every
detected layer). May import: ``factor``, ``blocks``, ``losses``.

Algorithm
---------
1. ``jax.make_jaxpr(loss_fn)(params, batch)``; every parameter leaf is a
   jaxpr input named by its pytree path (``params/Dense_0/kernel``).
2. A graph walk (``_analysis``) follows each leaf through layout-only
   operations (casts, transposes, unit reshapes, ``broadcast_in_dim``) and
   into nested jaxprs (``jit``/``pjit``, ``custom_jvp_call``,
   ``custom_vjp_call``, ``checkpoint``/``remat``, ``scan``, ``cond``;
   ``while`` bodies are searched but cannot be differentiated). A leaf that
   ``scan`` slices from its ``xs`` is a *stacked* layer (one layer per step,
   ``Layer.stack``); a leaf that enters as a scan constant is reused at
   every step (the step is a weight-sharing axis). Patterns:

   * dense — ``dot_general`` with a leaf as either operand, any contraction
     layout (``x @ W``, ``x @ W.T``, ``W @ x`` under ``vmap``, einsums with
     extra batch/sequence axes); a bias is an ``add`` of a leaf broadcast
     over the kernel's output axes, found through layout ops after the dot;
   * conv — ``conv_general_dilated`` with a leaf kernel (any dimension
     numbers, strides, padding, dilation, feature groups) and its bias;
   * embedding — a ``gather`` of rows of a 2-D leaf with integer indices
     (``jnp.take``, ``table[ids]``, Flax/Haiku/Equinox embeddings);
   * scale/shift — a leaf multiplied / added with broadcasting, including
     the ``(x - μ) · (rsqrt(σ²+ε) · scale) + bias`` form of Flax and Haiku
     norms (the scale's input is then ``(x - μ) · rsqrt(σ²+ε)``).

   A function of one leaf alone that is added to the loss as a scalar
   (weight decay ``c·Σ‖w‖²``, ``optax.l2_loss``, ``jnp.vdot(w, w)``, an L1
   term) is a *penalty* (``_penalties``), not a use: the leaf keeps its
   layer block and ``describe`` reports the penalty (with the curvature
   ``2c·I`` of a quadratic one, left out of the block). Any other use of a
   leaf (an unmatched primitive, a reshape that merges axes, a scan carry,
   a penalty added into activations, ...) is recorded with its reason.
3. Uses are grouped by the leaves they share (``_layers``). One group is one
   layer of the kind that takes its uses: each kind is one record,
   ``_kinds/<kind>.py`` (its recogniser, grouping, default block, data
   layout and per-example gradient); incompatible groups become a
   fallback layer whose reason ``describe`` shows. Nothing is dropped.
   Detection stops here: the block policy (``kfac_jax_lite._block_policy``:
   ``make_blocks``, ``with_blocks``) then chooses each layer's curvature
   block (``blocks=`` overrides, ``damping_mode``, ``weight_sharing``),
   without re-tracing.
4. The rewritten loss (``_interpret``) replays the jaxpr: at each layer
   use it records the input and adds a zero *probe* to the output. One
   ``jax.vjp`` of ``apply(params, batch, probes)`` then gives the parameter
   gradient and, w.r.t. the probes, every layer's output cotangents from
   the same forward pass; no per-example parameter gradient is formed.

Example axes and broadcast parameters
-------------------------------------
A layer's example axis is the first non-feature axis of its input; the
examples are the loss's (the leading axis of its values). Rows that reach
the loss through ``jax.ops.segment_sum`` (a graph network's nodes and
edges) get their examples from the segment ids (``_rows``,
``Layer.row_map``); rows that are the batch's examples of a loss over
their flattened tokens keep them (``Layer.spread``); other rows (a
time-major ``lax.scan`` over ``[T, B, D]``, ``h.reshape(-1, d)`` merging
batch and time) keep the Kronecker block under the expand convention:
every row of its input is a use of one pseudo-example whose loss weight
is the examples' mean (``Layer.row_uses``, noted in ``describe``).
Time-major data says so with ``example_axis=`` (``find_layers``): the
loss is traced again with the batch's example axes one longer, and the
activation axis of each use (and the values' axis of each loss) whose
size changed is its example axis, relabelled first; without it,
``describe`` says when the leading axis was a guess
(``_examples.guess_hints``), and detection warns when a ``lax.scan`` runs
over it (one more trace, with that axis one longer). Rows
of a table looked up without an example axis (a position embedding
``pos[jnp.arange(T)]``, ``pos[jnp.arange(T)[None]]``) and added to every example
are an embedding whose ids are broadcast over the batch: the probe goes on
the sum, where each example has its own cotangent (through a ``jit``
boundary too).

Shared and tied parameters
--------------------------
Every use of a parameter feeds one block. Uses are weight-sharing
positions: their data is concatenated along one shared axis after the
example axis (``[N, R_1 + R_2 + ..., features]``), so ``"expand"`` averages
the input factor and sums the output factor over all positions of all
uses, and ``"reduce"`` first averages inputs / sums cotangents over them
(Eschenhagen et al. 2023). A use that contracts the kernel's *other* axes
(``x @ W.T`` next to ``x @ W``; ``x @ Eᵀ`` next to the lookup ``E[ids]``)
has the roles of the factors swapped: its output cotangent is a row of the
input factor and its input a row of the output factor. A tied embedding is
therefore one ``KroneckerDense`` over the table ``[vocab, dim]`` with
``in_axes=(0,)`` whose inputs are the one-hot ids of the lookups and the
output cotangents of the ``x @ Eᵀ`` uses. With a samples axis on the
cotangents and a transposed use, the samples are folded into the shared
axis (inputs repeated, cotangents scaled by ``1/sqrt(S)``), which keeps
``"expand"`` exact; ``"reduce"`` is then an approximation. (Per-example
gradients, for ``Full``/``NaiveDiagonal`` overrides, sum each use's own
and keep the samples apart.) All of this is the dense kind's
(``_kinds/dense.py``).

Kernel views and repeated kernels
---------------------------------
* A kernel **reshaped** by splitting or merging axes (``W.reshape(d, h,
  e)``, ``conv_kernel.reshape(-1, c_out)``) is a dense layer of the stored
  kernel (``_views.Regrouped``).
* A kernel **sliced** along its output axes before use (a fused QKV
  kernel: ``W[:, :d]``, ``W[:, d:2d]``, ``jnp.split(W, 3, -1)``, with the
  matching bias slices; ``_views.Sliced``) is ONE dense layer over the
  whole stored kernel: the slices are column blocks of ``x @ W``. Slices
  applied to the same input sum their cotangents, each zero outside its
  columns, so A is the input's and G is over the full output (exact);
  slices applied to different inputs are weight-sharing uses of it.
* **Per-head kernels** with a ``dot_general`` batch axis (``"nhtd,hde->
  nhte"`` with ``W [h, d, e]``, its leading axis) are h independent dense
  layers: a layer stacked along that axis (``Stacked`` block), like a
  scan-stacked one, with a per-head bias ``[h, e]``.
* A **conv kernel used more than once** (siamese) or at every step of a
  ``lax.scan`` is one KFC layer whose applications are weight-sharing
  positions ("expand", ``_kinds/conv.py``).
The matching of these views to the equations around them is
``_matching``.

Losses written by hand
----------------------
Before the graph walk, ``_losses.recognise`` looks for the standard losses
in the traced loss (optax's, or written out: softmax cross-entropy,
sigmoid binary cross-entropy, a Gaussian of fixed variance) and marks each
with the ``loss_tag`` its registered twin would bind, so everything
downstream treats it as that twin. From the loss output it follows the
operations linear in the per-element values (sums, means, masks, weights);
a value there is a loss head when, evaluated at random model outputs and
targets, it equals ``a·ℓ(O, T) + d(T)`` for the distribution's own ``ℓ``
(``_loss_heads``, ``_loss_kinds``, on the flat graph of ``_loss_graph``).
``TaggedLoss.losses`` holds registered and recognised losses alike (a
recognised one has ``recognised`` set), ``TaggedLoss.unrecognised`` the
terms of the loss no head was found in, and ``TaggedLoss.examples`` which
batch leaves hold the examples (``_examples``: what the empirical
estimation without a loss reads ``N`` from).

Unsupported (fallback with the reason)
--------------------------------------
* a kernel sliced along a contracted (input) axis, a slice used by
  anything but a dense layer and its bias, ``dot_general`` batch axes on
  a kernel other than one leading axis, kernels transposed-then-reshaped
  before use, a reshaped kernel contracted over part of a split axis,
  products of two parameters, parameters in a scan carry, layers inside
  ``while_loop``, parameters stacked over two nested scans;
* a bias added after only some uses, an embedding gathered along its
  second axis, a convolution whose batch axis is not the batch's, conv
  uses with different windows or input shapes;
* ``shard_map``/``pmap`` and other primitives with inner jaxprs.

A custom_jvp/custom_vjp function that contains a layer is replaced by
autodiff of its primal implementation in the rewritten loss.
"""
from kfac_jax_lite.tagging import _block_policy
from kfac_jax_lite.tagging._layers import Layer
from kfac_jax_lite.tagging._loss_tags import LossTag, find_loss_tags
from kfac_jax_lite.tagging._tagged import (
    TaggedLoss, batch_size, find_layers, path_name)
from kfac_jax_lite.tagging._vma import tree_vma as varying_axes
# For the layers above (estimation, the optimizers); not in ``__all__``.
from kfac_jax_lite.tagging._paths import is_wrapper as is_wrapper
from kfac_jax_lite.tagging._examples import (
    resolve as resolve_example_axis)
from kfac_jax_lite.tagging._losses import output_layers as output_layers
from kfac_jax_lite.tagging._vma import abstract as abstract_value
from kfac_jax_lite.tagging._vma import zeros as varying_zeros



def make_blocks(layers, overrides=None, *, damping_mode="pi",
                weight_sharing="expand"):
  """The curvature block of each of ``layers`` (a tuple in their order).

  The block policy (``_block_policy``) chooses them; ``TaggedLoss.with_blocks``
  gives a detection with them. ``overrides``: the ``blocks=`` mapping of
  ``kfl.kfac`` (a parameter path, ``fnmatch`` pattern or layer kind to
  ``"kronecker"``, ``"diagonal"``, ``"full"``, ``"naive_diagonal"``,
  ``"ekfac"``, ``"series1"``, ``"series2"``, ``"kron_indep"``, a dict of
  the default block's options, a block, or a callable ``f(layer) ->
  block``); ``damping_mode`` (``"pi"`` or ``"exact"``) and
  ``weight_sharing`` (``"expand"`` or ``"reduce"``) configure the default
  Kronecker blocks.
  """
  return _block_policy.make_blocks(layers, overrides,
                                   damping_mode=damping_mode,
                                   weight_sharing=weight_sharing)


__all__ = ["Layer", "LossTag", "TaggedLoss", "batch_size", "find_layers", "find_loss_tags", "make_blocks",
           "path_name", "varying_axes"]
