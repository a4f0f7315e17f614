"""Curvature blocks: one per layer kind, each a static config plus pure functions.

Layer 1. Owns the block types, their statistics and the Kronecker-factored
products they share (``_kron``), the size policy (``_size``). May import: ``factor``.

See ``kfac_jax_lite.blocks.base`` for the interface they share (``Block``)
and the data their statistics consume (``LayerData``).
"""
from kfac_jax_lite.blocks._kron import KroneckerState
from kfac_jax_lite.blocks.base import as_block  # noqa: F401 (not in __all__)
from kfac_jax_lite.blocks._size import MAX_DENSE_SIDE, state_bytes
from kfac_jax_lite.blocks.base import (
    ACTIVATIONS, GRADIENTS, Block, KroneckerBlock, LayerData, check_block)
from kfac_jax_lite.blocks.flat import FlatBlock
from kfac_jax_lite.blocks.conv import KroneckerConv
from kfac_jax_lite.blocks.dense import KroneckerDense
from kfac_jax_lite.blocks.diagonal import DiagonalConv, DiagonalDense
from kfac_jax_lite.blocks.ekfac import (
    EigenCorrected, EkfacConv, EkfacDense, EkfacState, eigen_corrected)
from kfac_jax_lite.blocks.embedding import KroneckerEmbedding
from kfac_jax_lite.blocks.full import Full, NaiveDiagonal
from kfac_jax_lite.blocks.kronecker_vector import (
    KroneckerVectorBlock, KroneckerVectorConv, KroneckerVectorDense)
from kfac_jax_lite.blocks.scale_shift import ScaleAndShift
from kfac_jax_lite.blocks.series import SeriesDense, SeriesState, series_block
from kfac_jax_lite.blocks.stacked import Stacked

__all__ = [
    "ACTIVATIONS", "Block", "DiagonalConv", "DiagonalDense", "EigenCorrected",
    "EkfacConv", "EkfacDense", "EkfacState", "FlatBlock",
    "Full", "GRADIENTS", "KroneckerBlock", "KroneckerConv", "KroneckerDense",
    "KroneckerEmbedding", "KroneckerState", "KroneckerVectorBlock",
    "KroneckerVectorConv", "KroneckerVectorDense", "LayerData",
    "MAX_DENSE_SIDE", "NaiveDiagonal",
    "ScaleAndShift", "SeriesDense", "SeriesState", "Stacked", "check_block",
    "eigen_corrected", "series_block", "state_bytes",
]
