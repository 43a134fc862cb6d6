"""Block-sparse attention: DeepSpeed's sparsity layouts and the kernels that use them."""

from jaxspeed.attention.block_sparse import block_sparse_attention, dense_reference
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
    "dense_reference",
    "sparsity_config_from_dict",
]
