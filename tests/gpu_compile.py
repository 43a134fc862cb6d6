"""Compiling for an NVIDIA GPU on a machine without one, for tests of the GPU programs.

`compile_for_gpu` runs XLA:GPU down to a cubin for an abstract H100/H200/A100
(`jaxspeed.gpu.deviceless`), so shared-memory overflows, unsupported ops and Mosaic GPU /
Triton code generation fail here as they would on the GPU. It needs the `gpu-compile` extra;
`needs_gpu_compile` skips a test without it (`make test-gpu-compile` installs it).
"""

import jax
import pytest

from jaxspeed.gpu import deviceless

_SKIP = pytest.mark.skipif(not deviceless.available(), reason=deviceless.missing() or "")


def needs_gpu_compile(test):
    """Marks a test `gpu_compile` (what `gpu_suite.sh --dry-run` selects) and skips it where
    the plugin is missing."""
    return pytest.mark.gpu_compile(_SKIP(test))


def gpu_device(target: str = "h100"):
    """One abstract device of `target`."""
    return deviceless.devices(target, 1)[0]


def compile_for_gpu(fn, *args, target: str = "h100"):
    """`jax.jit(fn)` for `args` (arrays or `ShapeDtypeStruct`s), compiled for one `target` GPU.

    The device is the default device while tracing, so kernels that pick their backend from
    the device compiled for (`pallas_kernels.backend`) pick the GPU's.
    """
    with jax.default_device(gpu_device(target)):
        return jax.jit(fn).lower(*args).compile()
