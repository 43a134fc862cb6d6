"""jaxspeed's native XLA:CPU kernels (C++ through XLA's FFI), with XLA fallbacks."""

from jaxspeed.native.matmul import batched_matmul, use_native

__all__ = ["batched_matmul", "use_native"]
