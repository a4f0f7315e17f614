"""Curvature blocks: one per layer kind, each a static config plus pure functions.

See ``kfac_jax_lite.blocks.base`` for the interface they share.
"""
from kfac_jax_lite._kron import KroneckerState
from kfac_jax_lite.blocks.base import FlatBlock, KroneckerBlock, state_bytes
from kfac_jax_lite.blocks.conv import KroneckerConv
from kfac_jax_lite.blocks.dense import KroneckerDense
from kfac_jax_lite.blocks.diagonal import DiagonalConv, DiagonalDense
from kfac_jax_lite.blocks.embedding import KroneckerEmbedding
from kfac_jax_lite.blocks.full import Full, NaiveDiagonal
from kfac_jax_lite.blocks.scale_shift import ScaleAndShift

__all__ = [
    "DiagonalConv", "DiagonalDense", "FlatBlock", "Full", "KroneckerBlock",
    "KroneckerConv", "KroneckerDense", "KroneckerEmbedding", "KroneckerState",
    "NaiveDiagonal", "ScaleAndShift", "state_bytes",
]
