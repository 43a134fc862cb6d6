"""GPUs that are not here: their published specifications, and XLA:GPU compiling for them.

`targets` reads the package's GPU descriptions (`targets/*.textproto`, each value with its
source); `deviceless` turns one into abstract devices that `jax.jit(...).lower().compile()`
compiles for, down to a cubin, on a machine without a GPU (the CUDA plugin must be installed:
the `gpu-compile` extra). This package imports only JAX and `jaxspeed.errors`.
"""
