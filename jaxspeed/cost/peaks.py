"""Accelerator peaks and FLOPs utilisation: the dense peaks of each known GPU by precision and
its NVLink rate (`GPU_PEAKS`), the dense bf16 peak of each known device kind (`PEAK_FLOPS`), a
device's peak (`peak_flops`), and MFU or HFU (`mfu`)."""

from __future__ import annotations

from typing import NamedTuple


class GpuPeaks(NamedTuple):
    """Dense (no 2:4 sparsity) tensor-core FLOP/s of one GPU by operand type, and its NVLink rate.

    The datasheets print the sparse figures; the dense ones are half of them. HBM bandwidth is
    the target's `memory_bandwidth` (`jaxspeed/gpu/targets/*.textproto`), not repeated here.
    """

    bf16: float  #: bf16/fp16 operands, fp32 accumulation
    fp8: float | None  #: e4m3/e5m2 operands (Hopper on); None where the GPU has no FP8 cores
    tf32: float  #: fp32 operands at XLA's default precision (TF32 tensor cores)
    link: float  #: NVLink bytes/s one GPU sends in one direction


#: Sources: NVIDIA H100 Tensor Core GPU datasheet, SXM5 column (BF16 1,979, FP8 3,958, TF32 989
#: TFLOP/s with sparsity; NVLink 900 GB/s, both directions); NVIDIA H200 datasheet (the same
#: FLOP/s and NVLink as H100 SXM); NVIDIA A100 datasheet, SXM4 (BF16 312 and TF32 156 TFLOP/s
#: dense, no FP8; NVLink 3 600 GB/s, both directions).
GPU_PEAKS: dict[str, GpuPeaks] = {
    "H200": GpuPeaks(bf16=989.4e12, fp8=1978.9e12, tf32=494.7e12, link=450e9),
    "H100": GpuPeaks(bf16=989.4e12, fp8=1978.9e12, tf32=494.7e12, link=450e9),  # SXM
    "A100": GpuPeaks(bf16=312e12, fp8=None, tf32=156e12, link=300e9),
}

#: Dense bf16 peak FLOP/s per device (no sparsity), by `device_kind` substring. The H100 is the
#: SXM card; the PCIe card is lower, set hardware.peak_tflops for it.
PEAK_FLOPS: dict[str, float] = {
    **{name: peaks.bf16 for name, peaks in GPU_PEAKS.items()},
    "L4": 121e12,
    "TPU v4": 275e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
}


def _lookup(table: dict, device_kind: str):
    for name, value in table.items():
        if name.lower() in device_kind.lower():
            return value
    return None


def gpu_peaks(device_kind: str) -> GpuPeaks | None:
    """The `GPU_PEAKS` row of a device kind ("NVIDIA H100 80GB HBM3"), None when not known."""
    return _lookup(GPU_PEAKS, device_kind)


def peak_flops(device_kind: str, override_tflops: float | None = None) -> float | None:
    """Peak FLOP/s of one device: `override_tflops` (config) or the `PEAK_FLOPS` table."""
    if override_tflops:
        return override_tflops * 1e12
    return _lookup(PEAK_FLOPS, device_kind)


def mfu(flops_per_device: float, step_seconds: float, peak: float | None) -> float | None:
    """FLOPs utilisation: achieved FLOP/s per device over the device's peak (None: unknown).

    Model FLOPs utilisation (MFU) with the FLOPs the model needs
    (`jaxspeed.cost.flops.model_train_flops`); hardware FLOPs utilisation (HFU) with the FLOPs
    the compiled step runs, rematerialised forward passes included.
    """
    if not peak or step_seconds <= 0:
        return None
    return flops_per_device / step_seconds / peak
