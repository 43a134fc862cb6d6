"""jaxspeed's native XLA:CPU kernels (C++ through XLA's FFI), with XLA fallbacks."""

from jaxspeed.native.grouped import grouped_matmul
from jaxspeed.native.matmul import batched_matmul
from jaxspeed.native.policy import use_native

__all__ = ["batched_matmul", "grouped_matmul", "use_native"]
