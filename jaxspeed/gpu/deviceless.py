"""Abstract GPU devices for compiling without a GPU ("deviceless compilation").

`devices("h100", 8)` returns 8 devices of an H100 topology. A mesh of them is an ordinary
`jax.sharding.Mesh`: `jax.jit(f).lower(...).compile()` under it runs XLA:GPU to PTX and a
cubin, and `memory_analysis()` reports the GPU program's bytes. Nothing runs: there is no
GPU, no autotuning (XLA takes the first config that compiles) and no timing.

It needs the CUDA plugin at jaxlib's exact version, `nvidia-cuda-nvcc` (ptxas) and
`nvidia-nvvm` (libdevice): the `gpu-compile` extra. The plugin registers only when JAX runs
with `JAX_PLATFORMS=cpu` (else it looks for CUDA's driver and gives up), which the CLI and the
tests set.
"""

from __future__ import annotations

import functools
import importlib.metadata

import jax

from jaxspeed.errors import JaxspeedError
from jaxspeed.gpu import targets

#: The plugin distribution whose version must equal jaxlib's.
PLUGIN = "jax-cuda13-plugin"
INSTALL_HINT = (
    "compiling for a GPU without one needs the CUDA plugin at jaxlib's version: "
    "pip install -e '.[gpu-compile]' (`make test-gpu-compile` makes .venv-gpu with it)"
)


def missing() -> str | None:
    """Why deviceless compilation cannot run here (one line), or None when it can."""
    try:
        plugin = importlib.metadata.version(PLUGIN)
    except importlib.metadata.PackageNotFoundError:
        return INSTALL_HINT
    jaxlib = importlib.metadata.version("jaxlib")
    if plugin != jaxlib:
        return f"{PLUGIN} {plugin} does not match jaxlib {jaxlib}; {INSTALL_HINT}"
    return None


def available() -> bool:
    """Whether `devices` can work in this environment."""
    return missing() is None


def _topology(count: int) -> str:
    """`slices x hosts x devices per host` for `count` devices: 8 GPUs a host, as in a DGX."""
    if count < 1:
        raise JaxspeedError(f"--devices must be >= 1, got {count}")
    if count <= 8:
        return f"1x1x{count}"
    if count % 8:
        raise JaxspeedError(f"--devices {count}: more than 8 GPUs must be whole hosts of 8")
    return f"1x{count // 8}x8"


@functools.cache
def devices(target: str, count: int = 1) -> tuple[jax.Device, ...]:
    """`count` abstract devices of the GPU `target` (`jaxspeed.gpu.targets`).

    Raises:
      JaxspeedError: the plugin is missing or JAX did not register it (one line: how to fix).
    """
    spec = targets.load(target)
    topology = _topology(count)
    reason = missing()
    if reason:
        raise JaxspeedError(reason)
    from jax.experimental import topologies

    try:
        desc = topologies.get_topology_desc(
            platform="cuda", target_config=spec.text, topology=topology
        )
    except Exception as err:  # noqa: BLE001 - the plugin's own errors name no fix
        raise JaxspeedError(
            f"could not make a {spec.device_kind} topology {topology} without a GPU ({err}); "
            f"run with JAX_PLATFORMS=cpu so that the CUDA plugin registers"
        ) from None
    return tuple(desc.devices)
