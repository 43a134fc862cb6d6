"""Lowering for an NVIDIA GPU on a machine without one, for tests that check the GPU program.

The Pallas Triton lowering reads the target GPU's compute capability from the device; with no
GPU present (jax 0.11.2 and 0.12) it takes it from the abstract device of the current abstract
mesh, and without one raises "No supported GPU devices found". A mesh with no axes carries the
device and nothing else, so the traced program's shardings are unchanged.
"""

import jax
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

#: The GPU lowered for: the lent machine's (compute capability 9.0).
DEVICE_KIND = "NVIDIA H200"


def lower_for_cuda(fn, *args, device_kind: str = DEVICE_KIND) -> str:
    """StableHLO text of `jax.jit(fn)` traced on `args` and lowered for CUDA on `device_kind`.

    Args:
      fn: the function to jit.
      *args: its arguments, arrays or `jax.ShapeDtypeStruct`s.
      device_kind: an NVIDIA device kind JAX knows, e.g. "NVIDIA H100".

    Returns:
      The lowered module as text (`Lowered.as_text()`); compiling it would need the GPU.
    """
    device = AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
    with use_abstract_mesh(AbstractMesh((), (), abstract_device=device)):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
