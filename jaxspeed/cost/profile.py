"""`Engine.profile()`: what an engine's compiled train step computes and moves."""

from __future__ import annotations

from jaxspeed.cost.flops import step_profile
from jaxspeed.cost.plan_table import ProfileReport
from jaxspeed.runtime.mesh import host_of_devices


def profile(engine) -> ProfileReport:
    """FLOPs (`Engine.step_flops`), the device's peak and the collective bytes per device of
    `engine`'s compiled train step (`step_profile`)."""
    device = engine.mesh.devices.flat[0]
    return step_profile(
        engine.compile_train_step(), flops=engine.step_flops(), num_devices=engine.mesh.size,
        device_kind=device.device_kind, peak_tflops=engine.config.hardware.peak_tflops,
        host_of=host_of_devices(engine.mesh),
    )
