"""Pallas kernels for jaxspeed, importable on their own.

`interpret=None` everywhere means: interpreted when not compiling for a GPU, compiled on one:
Mosaic GPU on Hopper and newer, Triton on older GPUs (`_backend`, from the device compiled
for). The function names shadow their modules (`pallas_kernels.block_sparse_attention` is the function);
import helpers with `from pallas_kernels.block_sparse_attention import ...`.
"""

from pallas_kernels.block_sparse_attention import block_sparse_attention
from pallas_kernels.moe_kernels import moe_combine, moe_dispatch

__all__ = ["block_sparse_attention", "moe_combine", "moe_dispatch"]
