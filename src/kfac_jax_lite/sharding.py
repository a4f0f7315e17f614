"""``kfl.sharding``: the sharded layout of a ``kfl.kfac`` state (every block
kept by one device) and its checkpoint conversions.

The public face of ``kfac_jax_lite.optimizers.sharding``, where the layout
lives beside the transform that uses it (its docstring gives the algorithm
and the costs); ``import kfac_jax_lite.sharding`` and ``kfl.sharding.X``
reach the same objects.
"""
from kfac_jax_lite.optimizers.sharding import GATHERS as GATHERS
from kfac_jax_lite.optimizers.sharding import Layout as Layout
from kfac_jax_lite.optimizers.sharding import ShardedBlocks as ShardedBlocks
from kfac_jax_lite.optimizers.sharding import (
    bytes_per_device as bytes_per_device)
from kfac_jax_lite.optimizers.sharding import owners as owners
from kfac_jax_lite.optimizers.sharding import plan as plan
from kfac_jax_lite.optimizers.sharding import shard_like as shard_like
from kfac_jax_lite.optimizers.sharding import specs as specs
from kfac_jax_lite.optimizers.sharding import unshard as unshard
from kfac_jax_lite.optimizers.sharding import unshard_blocks as unshard_blocks

__all__ = ["GATHERS", "Layout", "ShardedBlocks", "bytes_per_device",
           "owners", "plan", "shard_like", "specs", "unshard",
           "unshard_blocks"]
