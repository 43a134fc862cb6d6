"""Measures this machine as a `Cluster`: matmul FLOP/s, collective bandwidth and latency, memory.

Every figure is taken with all devices busy at once, as a training step runs them: a matmul
batch sharded over every device, an all-gather over every device. On emulated CPU devices the
devices share the host's cores, so each device's figure is the machine's divided among them.
"""

from __future__ import annotations

import collections
import os
import statistics
import time
import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspeed.autoplan.cluster import Cluster, save_cluster
from jaxspeed.errors import JaxspeedError

_AXIS = "devices"

#: Sizes that calibrate in a few seconds (`calibrate(**QUICK)`), for tests and smoke runs;
#: the figures are rougher than the defaults'.
QUICK: Mapping[str, int] = types.MappingProxyType(
    {"matmul_size": 256, "collective_mib": 1, "repeats": 3}
)


def calibrate(
    devices: Sequence[jax.Device] | None = None,
    *,
    name: str = "calibrated",
    matmul_size: int = 2048,
    collective_mib: float = 16,
    repeats: int = 5,
) -> Cluster:
    """Measures `devices` (default: all) and returns them as a `Cluster`.

    * `peak_tflops`: one jitted batch of `[n, n] @ [n, n]` matmuls, one per device, sharded
      over all devices; FLOPs / median time / devices, for float32 and bfloat16.
    * links: an all-gather of `collective_mib` MiB over all devices, and of one float per
      device. The tiny one gives the latency; the ring formula
      `time = (g-1) * latency + (g-1)/g * bytes / bandwidth` gives the bandwidth. One
      all-gather over every device sees the slowest link, so `intra_host` and `inter_host`
      both get that figure (on several hosts `intra_host` is thus an underestimate).
    * `device_memory`: the device's allocator limit where it reports one (GPU, TPU); CPU
      devices share host RAM, so there it is RAM / local devices.
    * `host_memory`: physical RAM from `os.sysconf`.
    * `host_link`: an array of `collective_mib` MiB per device copied to the host's memory
      (`pinned_host`) and back, on every device at once, and of one float per device (the
      latency); on CPU both memories are the same RAM, so this is a copy's rate.
    * `memory_bandwidth_gbps`: a fused elementwise pass over `collective_mib` MiB per device
      on every device at once, read plus written.
    * `efficiency`: the FLOP rate of a training step's matmuls over the bare matmul's: the
      forward and backward pass of a 4-layer MLP of `[n, n]` layers (float32), on every
      device at once, divided by the float32 figure above (at most 1).

    Args:
      devices: at least 2 devices, the same number on each host.
      name: the cluster's name.
      matmul_size: `n` of the matmuls.
      collective_mib: bytes of the large all-gather's result, in MiB.
      repeats: timed runs after one warm-up run; the median counts.

    Raises:
      JaxspeedError: fewer than 2 devices (there is no link to measure), an uneven number
        of devices per host, or a size that is not positive.
    """
    if not isinstance(name, str) or not name:
        raise JaxspeedError(f"calibrate: name must be a non-empty string, got {name!r}")
    _check_sizes(matmul_size=matmul_size, collective_mib=collective_mib, repeats=repeats)
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < 2:
        raise JaxspeedError(
            f"calibrate needs at least 2 devices to measure a link, got {len(devices)}"
        )
    per_host = collections.Counter(device.process_index for device in devices)
    hosts = len(per_host)
    if len(set(per_host.values())) > 1:
        raise JaxspeedError(
            f"calibrate needs the same number of devices on each host, got {dict(per_host)} "
            f"(process index: devices)"
        )
    mesh = jax.make_mesh(
        (len(devices),), (_AXIS,), axis_types=(AxisType.Explicit,), devices=devices
    )
    latency_s, bandwidth = _link(mesh, collective_mib * 2**20, repeats)
    memory = _memory_bandwidth(mesh, collective_mib * 2**20, repeats)
    host_latency_s, host_bandwidth = _host_link(mesh, collective_mib * 2**20, repeats)
    host_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    link = {"bandwidth_gbps": bandwidth / 1e9, "latency_us": latency_s * 1e6}
    fp32 = _matmul_flops(mesh, matmul_size, jnp.float32, repeats)
    return Cluster(
        name=name,
        hosts=hosts,
        devices_per_host=len(devices) // hosts,
        device_memory=_device_memory(devices[0], host_memory),
        peak_tflops={
            "bf16": _matmul_flops(mesh, matmul_size, jnp.bfloat16, repeats) / 1e12,
            "fp32": fp32 / 1e12,
        },
        efficiency=min(1.0, _training_flops(mesh, matmul_size, repeats) / fp32),
        memory_bandwidth_gbps=memory / 1e9,
        intra_host=link,
        inter_host=link,
        host_link={"bandwidth_gbps": host_bandwidth / 1e9, "latency_us": host_latency_s * 1e6},
        host_memory=host_memory,
    )


def main(out: str | os.PathLike, **options: Any) -> Cluster:
    """Calibrates this machine and saves it to `out` as YAML (see `save_cluster`).

    Args:
      out: the file to write.
      **options: keyword arguments of `calibrate`.

    Returns:
      the measured cluster.
    """
    cluster = calibrate(**options)
    devices = options.get("devices") or jax.devices()
    sizes = {key: value for key, value in options.items() if key != "devices"}
    comment = (
        f"Measured by jaxspeed calibrate on {len(devices)} {devices[0].platform} devices, "
        f"jax {jax.__version__}, options {sizes or 'default'}.\n"
        f"Load with jaxspeed.autoplan.cluster.load_cluster."
    )
    save_cluster(cluster, Path(out), comment=comment)
    return cluster


def _check_sizes(**sizes: float) -> None:
    for key, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise JaxspeedError(f"calibrate: {key} must be a positive number, got {value!r}")
    for key in ("matmul_size", "repeats"):
        if not isinstance(sizes[key], int):
            raise JaxspeedError(f"calibrate: {key} must be an int, got {sizes[key]!r}")


def _matmul_flops(mesh: jax.sharding.Mesh, n: int, dtype: Any, repeats: int) -> float:
    """FLOP/s of one device while every device runs one `[n, n] @ [n, n]` matmul."""
    count = mesh.size
    sharding = NamedSharding(mesh, P(_AXIS))
    a = jax.device_put(jnp.ones((count, n, n), dtype), sharding)
    matmuls = jax.jit(lambda x, y: jnp.einsum("bij,bjk->bik", x, y))
    return 2 * n**3 / _median_seconds(matmuls, a, a, repeats=repeats)


def _training_flops(mesh: jax.sharding.Mesh, n: int, repeats: int, layers: int = 4) -> float:
    """FLOP/s of one device running the forward and backward pass of an MLP of `layers`
    `[n, n]` layers (tanh between them) on `n` rows, while every device runs its own."""
    sharding = NamedSharding(mesh, P(_AXIS))
    w = jax.device_put(jnp.full((mesh.size, layers, n, n), 1.0 / n, jnp.float32), sharding)
    x = jax.device_put(jnp.ones((mesh.size, n, n), jnp.float32), sharding)

    def loss(w, x):
        for i in range(layers):
            x = jnp.tanh(jnp.einsum("bij,bjk->bik", x, w[:, i]))
        return jnp.sum(x)

    step = jax.jit(jax.grad(loss))
    # forward: one matmul a layer; backward: two, but no input gradient for the first layer
    return (3 * layers - 1) * 2 * n**3 / _median_seconds(step, w, x, repeats=repeats)


def _memory_bandwidth(mesh: jax.sharding.Mesh, nbytes: float, repeats: int) -> float:
    """Bytes/s one device reads plus writes while every device streams an array of `nbytes`
    through one fused elementwise loop (what most of a step's non-matmul time is)."""
    per_device = max(1, round(nbytes / 4))
    x = jax.device_put(jnp.ones((mesh.size, per_device), jnp.float32), NamedSharding(mesh, P(_AXIS)))
    stream = jax.jit(lambda a: a * 1.5 + 1.0)
    return 2 * 4 * per_device / _median_seconds(stream, x, repeats=repeats)


def _host_link(mesh: jax.sharding.Mesh, nbytes: float, repeats: int) -> tuple[float, float]:
    """(latency in s, bandwidth in bytes/s) of one device's copies to host memory and back,
    with every device copying at once."""
    device = NamedSharding(mesh, P(_AXIS))
    host = device.with_memory_kind("pinned_host")
    to_host = jax.jit(lambda a: a, out_shardings=host)
    to_device = jax.jit(lambda a: a, out_shardings=device)

    def there_and_back(a):
        return to_device(to_host(a))

    per_device = max(1, round(nbytes / 4))
    large = jax.device_put(jnp.ones((mesh.size, per_device), jnp.float32), device)
    tiny = jax.device_put(jnp.ones((mesh.size, 1), jnp.float32), device)
    tiny_s, transfer_s = _split_latency(there_and_back, large, tiny, repeats)
    return tiny_s / 2, 2 * 4 * per_device / transfer_s


def _link(mesh: jax.sharding.Mesh, nbytes: float, repeats: int) -> tuple[float, float]:
    """(latency in s, bandwidth in bytes/s) of one device's link, from two all-gathers."""
    g = mesh.size
    gather = jax.jit(
        jax.shard_map(
            lambda shard: jax.lax.all_gather(shard, _AXIS, tiled=True),
            mesh=mesh, in_specs=P(_AXIS), out_specs=P(_AXIS),
        )
    )  # fmt: skip
    sharding = NamedSharding(mesh, P(_AXIS))
    per_device = max(1, round(nbytes / 4 / g))
    large = jax.device_put(jnp.ones((g * per_device,), jnp.float32), sharding)
    tiny = jax.device_put(jnp.ones((g,), jnp.float32), sharding)
    tiny_s, transfer_s = _split_latency(gather, large, tiny, repeats)
    total_bytes = 4 * g * per_device
    return tiny_s / (g - 1), (g - 1) / g * total_bytes / transfer_s


def _split_latency(fn: Callable[..., Any], large: Any, tiny: Any, repeats: int) -> tuple[float, float]:
    """(seconds of `fn(tiny)`, the latency; seconds `fn(large)` spends moving its bytes)."""
    large_s = _median_seconds(fn, large, repeats=repeats)
    tiny_s = _median_seconds(fn, tiny, repeats=repeats)
    # Timing noise can make the large transfer no slower than the tiny one when both are
    # small; then its whole time is taken as transfer, which underestimates the bandwidth.
    return tiny_s, large_s - tiny_s if large_s > tiny_s else large_s


def _device_memory(device: jax.Device, host_memory: int) -> int:
    stats = device.memory_stats()  # None on CPU
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return host_memory // jax.local_device_count()


def _median_seconds(fn: Callable[..., Any], *args: Any, repeats: int) -> float:
    """Median wall time of `fn(*args)` over `repeats` runs, after one run that compiles it."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)
