"""Attention that scales: blocked (FlashAttention) attention, and block-sparse attention with
DeepSpeed's sparsity layouts."""

from jaxspeed.attention.block_sparse import block_sparse_attention, dense_reference
from jaxspeed.attention.blocked import blocked_attention
from jaxspeed.attention.sparsity import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
    sparsity_config_from_dict,
)

__all__ = [
    "BSLongformerSparsityConfig",
    "BigBirdSparsityConfig",
    "DenseSparsityConfig",
    "FixedSparsityConfig",
    "LocalSlidingWindowSparsityConfig",
    "SparsityConfig",
    "VariableSparsityConfig",
    "block_sparse_attention",
    "blocked_attention",
    "dense_reference",
    "sparsity_config_from_dict",
]
