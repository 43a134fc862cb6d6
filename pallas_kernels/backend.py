"""Which device a call is compiled for: the one place jaxspeed and its kernels ask "a GPU?"
or "a CPU?".

`jax.default_backend()` names the machine JAX runs on, not the program being traced: a step
compiled for an H100 on a machine without one (`jaxspeed.gpu.deviceless`) runs its trace on a
CPU host. So the kernels ask for the target of the trace instead, in this order:
  1. the device of `jax.default_device(...)`, when one is set;
  2. the abstract device of the current mesh (`jax.set_mesh`, `use_abstract_mesh`);
  3. the first device of the default backend.

From it, `kernel_backend()` picks how a Pallas kernel runs: Mosaic GPU on Hopper (sm_90) and
newer, Triton on older NVIDIA GPUs (A100) and on AMD, the Pallas interpreter elsewhere.
"""

from __future__ import annotations

import warnings

import jax

#: `jax.default_backend()` / `Device.platform` names of GPU backends (NVIDIA and AMD).
GPU_BACKENDS = ("gpu", "cuda", "rocm")
MOSAIC_GPU, TRITON, INTERPRET = "mosaic_gpu", "triton", "interpret"
#: Compute capability by device kind, for abstract devices that carry only a kind. Longer
#: names first, so "GH200" is not read as "H200".
_KIND_CAPABILITY = (
    ("GB200", (10, 0)), ("B200", (10, 0)), ("B100", (10, 0)), ("GH200", (9, 0)),
    ("H200", (9, 0)), ("H100", (9, 0)), ("H800", (9, 0)), ("H20", (9, 0)), ("L40", (8, 9)),
    ("L4", (8, 9)), ("A100", (8, 0)), ("A800", (8, 0)), ("A10", (8, 6)), ("V100", (7, 0)),
)

# JAX 0.12 deprecates its Pallas Triton backend, and warns at every lowering. jaxspeed lowers
# through it only on GPUs older than Hopper, where Mosaic GPU does not run; the warning is for
# the users of that backend, not of jaxspeed, so jaxspeed's users do not see it.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")


def target_device():
    """The device (or abstract device) the current trace compiles for; see the module doc."""
    default = jax.config.jax_default_device
    if default is not None and not isinstance(default, str):
        return default
    mesh = jax.sharding.get_abstract_mesh()
    device = getattr(mesh, "abstract_device", None)
    if device is not None:
        return device
    return jax.devices(default)[0] if isinstance(default, str) else jax.devices()[0]


def is_gpu(device=None) -> bool:
    """Whether `device` (default: the target of the current trace) is a GPU."""
    device = target_device() if device is None else device
    return device.platform in GPU_BACKENDS


def is_cpu(device=None) -> bool:
    """Whether `device` (default: the target of the current trace) is a CPU."""
    device = target_device() if device is None else device
    return device.platform == "cpu"


def compute_capability(device=None) -> tuple[int, int] | None:
    """`(major, minor)` of an NVIDIA GPU (real or abstract), None for other devices."""
    device = target_device() if device is None else device
    if not is_gpu(device):
        return None
    reported = getattr(device, "compute_capability", None)
    if reported:  # a real or topology device: "9.0"
        major, _, minor = str(reported).partition(".")
        return int(major), int(minor or 0)
    kind = device.device_kind.upper()
    return next((cap for name, cap in _KIND_CAPABILITY if name in kind), None)


def kernel_backend(device=None) -> str:
    """How a Pallas kernel runs on `device` (default: the current trace's target).

    `MOSAIC_GPU` on NVIDIA sm_90 and newer, `TRITON` on older or unknown GPUs, `INTERPRET`
    on anything else (the Pallas interpreter on the host).
    """
    device = target_device() if device is None else device
    if not is_gpu(device):
        return INTERPRET
    capability = compute_capability(device)
    return MOSAIC_GPU if capability is not None and capability >= (9, 0) else TRITON


def resolve(backend: str | None, interpret) -> tuple[str, object]:
    """Which kernel family runs a call, and the `interpret=` value to give it.

    Args:
      backend: `MOSAIC_GPU`, `TRITON`, or None for the trace's target (`kernel_backend`); on
        a CPU target the Triton-form kernels run in Pallas' interpreter.
      interpret: None (interpret exactly when the target is not a GPU), a bool, or a
        `plgpu.InterpretGPUParams` (Mosaic GPU kernels in GPU interpret mode, which simulates
        shared memory, TMA, barriers and threads, and can detect races).

    Returns:
      `(family, interpret)`: for `MOSAIC_GPU`, None (compiled) or an `InterpretGPUParams`;
      for `TRITON`, a bool.
    """
    target = kernel_backend()
    family = (TRITON if target == INTERPRET else target) if backend is None else backend
    if family not in (MOSAIC_GPU, TRITON):
        raise ValueError(f"backend must be {MOSAIC_GPU!r}, {TRITON!r} or None, got {backend!r}")
    if interpret is None:
        interpret = target == INTERPRET
    if family == TRITON:
        if not isinstance(interpret, bool):
            raise ValueError(f"the Triton kernels take interpret=True/False, got {interpret!r}")
        return family, interpret
    if isinstance(interpret, bool):
        from jax.experimental.pallas import mosaic_gpu as plgpu

        interpret = plgpu.InterpretGPUParams() if interpret else None
    return family, interpret


def on_gpu() -> bool:
    """Whether the current trace compiles for a GPU (compiled kernels; interpret mode elsewhere)."""
    return is_gpu()
