"""Accelerator peaks and FLOPs utilisation: the dense bf16 peak of each known device kind
(`PEAK_FLOPS`), a device's peak (`peak_flops`), and MFU or HFU (`mfu`)."""

from __future__ import annotations

#: Dense bf16 peak FLOP/s per device (no sparsity), by `device_kind` substring.
PEAK_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H100": 989e12,  # SXM; the PCIe card is lower, set hardware.peak_tflops for it
    "A100": 312e12,
    "L4": 121e12,
    "TPU v4": 275e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
}


def peak_flops(device_kind: str, override_tflops: float | None = None) -> float | None:
    """Peak FLOP/s of one device: `override_tflops` (config) or the `PEAK_FLOPS` table."""
    if override_tflops:
        return override_tflops * 1e12
    for name, peak in PEAK_FLOPS.items():
        if name.lower() in device_kind.lower():
            return peak
    return None


def mfu(flops_per_device: float, step_seconds: float, peak: float | None) -> float | None:
    """FLOPs utilisation: achieved FLOP/s per device over the device's peak (None: unknown).

    Model FLOPs utilisation (MFU) with the FLOPs the model needs
    (`jaxspeed.cost.flops.model_train_flops`); hardware FLOPs utilisation (HFU) with the FLOPs
    the compiled step runs, rematerialised forward passes included.
    """
    if not peak or step_seconds <= 0:
        return None
    return flops_per_device / step_seconds / peak

