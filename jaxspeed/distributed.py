"""Process-level setup: emulated CPU devices and `jax.distributed` for multi-process runs.

Both must run before JAX creates its backend (the first `jax.devices()` call).
"""

from __future__ import annotations

import os

import jax


def set_cpu_devices(count: int) -> None:
    """Runs on the CPU platform with `count` emulated devices (tests, laptops, CI)."""
    if count < 1:
        raise ValueError(f"--cpu-devices must be >= 1, got {count}")
    jax.config.update("jax_platforms", "cpu")
    flag = f"--xla_force_host_platform_device_count={count}"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, flag])
    jax.config.update("jax_num_cpu_devices", count)


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids=None,
    cpu_collectives: str = "gloo",
    initialization_timeout: int = 300,
) -> None:
    """Starts JAX's distributed runtime; a thin wrapper over `jax.distributed.initialize`.

    With no arguments, JAX auto-detects the cluster (SLURM, Open MPI, Kubernetes, TPU pods).
    On CPU, cross-process collectives use `cpu_collectives` (gloo), which JAX needs to be told
    before the backend starts.

    Args:
      coordinator_address: "host:port" of process 0.
      num_processes: total number of processes.
      process_id: this process's rank.
      local_device_ids: devices this process drives (default: all visible).
      cpu_collectives: `jax_cpu_collectives_implementation` for CPU runs.
      initialization_timeout: seconds to wait for every process at start-up.
    """
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
        initialization_timeout=initialization_timeout,
    )
