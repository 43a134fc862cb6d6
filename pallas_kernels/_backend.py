"""Which backend JAX runs on: the one place jaxspeed and its kernels ask "is this a GPU?"."""

from __future__ import annotations

import jax

#: `jax.default_backend()` names of GPU backends (NVIDIA and AMD).
GPU_BACKENDS = ("gpu", "cuda", "rocm")


def on_gpu() -> bool:
    """Whether JAX's default backend is a GPU (compiled kernels; interpret mode elsewhere)."""
    return jax.default_backend() in GPU_BACKENDS
