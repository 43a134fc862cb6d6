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
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspeed.autoplan.step_probe import probe_config, step_efficiency, step_probe
from jaxspeed.autoplan.update_cost import COMPRESSED_PROBE, PLAIN_PROBE, update_probe
from jaxspeed.config import Config
from jaxspeed.config.cluster import Cluster, save_cluster
from jaxspeed.errors import JaxspeedError
from jaxspeed.runtime.distributed import over_gloo

_AXIS = "devices"
_TINY = "_tiny"  #: the suffix of a latency probe's name (`_interleaved_medians`)
#: Tiny all-gathers one after another in an overhead probe (`_gather_probe`'s `burst`).
BURST = 16
#: Between hosts, the large all-gather goes in pieces of at most this many floats a device
#: (1 MiB), one after another: the messages a step sends there (`_pieces`).
PIECE = 2**18
_HOSTS, _LOCAL = "hosts", "local"  # the 2-D mesh of several hosts: across them, inside one
#: Layers of the MLP whose training step gives `efficiency`.
_LAYERS = 4

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
    model: Config | None = None,
) -> Cluster:
    """Measures `devices` (default: all) and returns them as a `Cluster`.

    Every figure below is the median of `repeats` rounds, each of which times every
    measurement once, after one untimed round (`_interleaved_medians`).

    * `peak_tflops`: one jitted batch of `[n, n] @ [n, n]` matmuls, one per device, sharded
      over all devices; FLOPs / median time / devices, for float32 and bfloat16.
    * links: an all-gather of `collective_mib` MiB over all devices, and of one float per
      device. The tiny one gives the latency; the ring formula
      `time = (g-1) * latency + (g-1)/g * bytes / bandwidth` gives the bandwidth. On one
      host, `intra_host` and `inter_host` both get that figure. On several hosts (processes:
      a host is one process's devices, as the two-level mesh has it), the devices form a
      `[hosts, per host]` mesh and the link between hosts is measured by all-gathers across
      hosts, every device in one at once (so the figure is per device, each host's network
      shared by its devices; in pieces of at most `PIECE` floats a device, one after
      another), and `intra_host` by all-gathers inside each host; `collectives` is then
      `gloo` on CPU (the flat algorithms XLA:CPU runs between processes). Each link's
      `overhead_us`: a burst of `BURST` one-float all-gathers, each on the last one's
      result, per gather (median of the rounds), less the fastest lone one: what a
      collective costs in a sequence of them beyond its hops (on CPU devices sharing a core,
      the threads' hand-over: 2-4 ms a collective, measured, where the fastest lone round
      took 0.4-1.7 ms).
    * `device_memory`: the device's allocator limit where it reports one (GPU, TPU); CPU
      devices share host RAM, so there it is RAM / local devices.
    * `host_memory`: physical RAM from `os.sysconf`.
    * `host_link`: an array of `collective_mib` MiB per device copied to the host's memory
      (`pinned_host`) and back, on every device at once, and of one float per device (the
      latency); on CPU both memories are the same RAM, so this is a copy's rate.
    * `memory_bandwidth_gbps`: a fused elementwise pass over `collective_mib` MiB per device
      on every device at once, read plus written.
    * `update_bandwidth`: XLA's bytes of an optimizer update of `collective_mib` MiB of params
      per device, on this host's devices at once, over its time: AdamW's (`plain_gbps`) and
      1-bit Adam's compressed one (`compressed_gbps`; `jaxspeed.autoplan.update_cost`).
    * `efficiency`: the FLOP rate of a training step's matmuls over the bare matmul's: the
      forward and backward pass of a 4-layer MLP of `[n, n]` layers (float32), on every
      device at once, divided by the float32 figure above (at most 1). With `model`, a
      training step of that config's model instead, on each host's own devices at once
      (`step_probe`): the share of the peak that the planner's compute term needs to equal it.

    Args:
      devices: at least 2 devices, the same number on each host.
      name: the cluster's name.
      matmul_size: `n` of the matmuls.
      collective_mib: bytes of the large all-gather's result, in MiB.
      repeats: timed rounds after the warm-up round; each figure is its median.
      model: a config whose model's step gives `efficiency` (default: the MLP's).

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
    devices = sorted(devices, key=lambda d: d.process_index)  # host-major
    mesh = jax.make_mesh(
        (len(devices),), (_AXIS,), axis_types=(AxisType.Explicit,), devices=devices
    )
    g, n = len(devices), matmul_size
    per_host = g // hosts
    floats = max(1, round(collective_mib * 2**20 / 4))  # per device
    shard = max(1, round(floats / g))  # the all-gather's input per device
    levels = {}  # with several hosts: all-gathers across them and inside them, apart
    if hosts > 1:
        two = jax.make_mesh((hosts, per_host), (_HOSTS, _LOCAL),
                            axis_types=(AxisType.Explicit,) * 2, devices=devices)
        levels = {f"{axis}_{size}": _gather_probe(two, count, axis=axis, burst=burst)
                  for axis, peers in ((_HOSTS, hosts), (_LOCAL, per_host)) if peers > 1
                  for size, count, burst in (("large", *_pieces(floats, peers)),
                                             ("tiny", 1, 1), ("burst", 1, BURST))}
    here = [d for d in devices if d.process_index == jax.process_index()]
    updates = {name: update_probe(probe, here, floats)
               for name, probe in (("update_plain", PLAIN_PROBE),
                                   ("update_compressed", COMPRESSED_PROBE))}
    levels.update({name: (call, ()) for name, (call, _) in updates.items()})
    probed = None
    if model is not None:  # on this host's devices, every host at once
        probed = probe_config(model, devices=g, local=per_host)
        levels["model_step"] = (step_probe(probed, here), ())
    seconds = _interleaved_medians(
        {
            **levels,
            "matmul_fp32": _matmul_probe(mesh, n, jnp.float32),
            "matmul_bf16": _matmul_probe(mesh, n, jnp.bfloat16),
            "training": _training_probe(mesh, n),
            "stream": _stream_probe(mesh, floats),
            "gather": _gather_probe(mesh, shard),
            "gather_tiny": _gather_probe(mesh, 1),
            "gather_burst": _gather_probe(mesh, 1, burst=BURST),
            "host": _host_probe(mesh, floats),
            "host_tiny": _host_probe(mesh, 1),
        },
        repeats,
    )
    gathered = 4 * g * shard
    link = {
        "bandwidth_gbps": (g - 1) / g * gathered / _bare(seconds["gather"], seconds["gather_tiny"]) / 1e9,
        "latency_us": seconds["gather_tiny"] / (g - 1) * 1e6,
        "overhead_us": _overhead(seconds["gather_burst"], seconds["gather_tiny"]) * 1e6,
    }
    intra, inter = link, link
    if hosts > 1:
        inter = _link(seconds, _HOSTS, hosts, floats)
        intra = _link(seconds, _LOCAL, per_host, floats) if per_host > 1 else inter
    host_link = {  # there and back
        "bandwidth_gbps": 2 * 4 * floats / _bare(seconds["host"], seconds["host_tiny"]) / 1e9,
        "latency_us": seconds["host_tiny"] / 2 * 1e6,
    }
    fp32 = 2 * n**3 / seconds["matmul_fp32"]
    host_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cluster = Cluster(
        name=name,
        hosts=hosts,
        devices_per_host=g // hosts,
        device_memory=_device_memory(next(d for d in devices if d.process_index == jax.process_index()), host_memory),
        peak_tflops={"bf16": 2 * n**3 / seconds["matmul_bf16"] / 1e12, "fp32": fp32 / 1e12},
        efficiency=min(1.0, _training_flops(n) / seconds["training"] / fp32),
        memory_bandwidth_gbps=2 * 4 * floats / seconds["stream"] / 1e9,
        update_bandwidth={f"{name.removeprefix('update_')}_gbps": nbytes / seconds[name] / 1e9
                          for name, (_, nbytes) in updates.items()},
        intra_host=intra,
        inter_host=inter,
        host_link=host_link,
        host_memory=host_memory,
        collectives="gloo" if over_gloo(devices) else "nccl",
    )
    if probed is None:
        return cluster
    return cluster.model_copy(update={"efficiency": step_efficiency(probed, seconds["model_step"], cluster)})


def _pieces(floats: int, peers: int) -> tuple[int, int]:
    """(floats a device sends in each piece, pieces) of a `floats`-float all-gather over
    `peers` between hosts: pieces of at most `PIECE`. Gloo sends a device's share as one
    message; over a 100 Mbit/s tbf link one of 8 MiB gave 5.85, 5.86 and 4.90 MB/s a device
    in three calibrations (one TCP stream: 6.04), and a message past about a MiB can lose
    throughput there (`jaxspeed.network.gloo`), while a step's messages are at most that."""
    share = max(1, round(floats / peers))
    pieces = -(-share // PIECE)
    return -(-share // pieces), pieces


def _link(seconds: Mapping[str, float], axis: str, peers: int, floats: int) -> dict[str, float]:
    """A link from the all-gathers over `axis` (every group at once): the ring formula, on
    the large gather's pieces, each less a tiny gather's time in a burst."""
    piece, pieces = _pieces(floats, peers)
    gathered = 4 * peers * piece * pieces
    bare = _bare(seconds[f"{axis}_large"], pieces * seconds[f"{axis}_burst"] / BURST)
    return {"bandwidth_gbps": (peers - 1) / peers * gathered / bare / 1e9,
            "latency_us": seconds[f"{axis}_tiny"] / (peers - 1) * 1e6,
            "overhead_us": _overhead(seconds[f"{axis}_burst"], seconds[f"{axis}_tiny"]) * 1e6}


def _overhead(burst_s: float, tiny_s: float) -> float:
    """Seconds a collective costs in a burst beyond the fastest lone one (at least 0)."""
    return max(0.0, burst_s / BURST - tiny_s)


def main(out: str | os.PathLike, *, model_source: str | None = None, **options: Any) -> Cluster:
    """Calibrates this machine and saves it to `out` as YAML (see `save_cluster`); with
    several processes every process measures and the first one writes.

    Args:
      out: the file to write.
      model_source: where `options["model"]` came from (a config's path), for the file's header.
      **options: keyword arguments of `calibrate`.

    Returns:
      the measured cluster.
    """
    cluster = calibrate(**options)
    if jax.process_index() != 0:  # one file, from the first process
        return cluster
    devices = options.get("devices") or jax.devices()
    sizes = {key: value for key, value in options.items() if key not in ("devices", "model")}
    efficiency = ("a training step of the model of " + (model_source or "the given config")
                  if options.get("model") is not None else "a 4-layer MLP's training step")
    comment = (
        f"Measured by jaxspeed calibrate on {len(devices)} {devices[0].platform} devices, "
        f"jax {jax.__version__}, options {sizes or 'default'}.\n"
        f"efficiency: {efficiency}.\n"
        f"Load with jaxspeed.config.cluster.load_cluster."
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


#: A timed call: a jitted function and its arguments.
_Probe = tuple[Callable[..., Any], tuple[Any, ...]]


def _matmul_probe(mesh: jax.sharding.Mesh, n: int, dtype: Any) -> _Probe:
    """Every device runs one `[n, n] @ [n, n]` matmul: `2 n^3` FLOPs per device."""
    a = jax.device_put(np.ones((mesh.size, n, n), dtype), NamedSharding(mesh, P(_AXIS)))
    return jax.jit(lambda x, y: jnp.einsum("bij,bjk->bik", x, y)), (a, a)


def _training_probe(mesh: jax.sharding.Mesh, n: int) -> _Probe:
    """Every device runs the forward and backward pass of its own MLP of `_LAYERS`
    `[n, n]` layers (tanh between them) on `n` rows, in float32."""
    sharding = NamedSharding(mesh, P(_AXIS))
    w = jax.device_put(np.full((mesh.size, _LAYERS, n, n), 1.0 / n, np.float32), sharding)
    x = jax.device_put(np.ones((mesh.size, n, n), np.float32), sharding)

    def loss(w, x):
        for i in range(_LAYERS):
            x = jnp.tanh(jnp.einsum("bij,bjk->bik", x, w[:, i]))
        return jnp.sum(x)

    return jax.jit(jax.grad(loss)), (w, x)


def _training_flops(n: int) -> float:
    """FLOPs per device of `_training_probe`: a matmul a layer forward, two backward, but no
    input gradient for the first layer."""
    return (3 * _LAYERS - 1) * 2 * n**3


def _stream_probe(mesh: jax.sharding.Mesh, per_device: int) -> _Probe:
    """Every device streams `per_device` floats through one fused elementwise loop (what most
    of a step's non-matmul time is): `8 * per_device` bytes read plus written."""
    x = jax.device_put(np.ones((mesh.size, per_device), np.float32), NamedSharding(mesh, P(_AXIS)))
    return jax.jit(lambda a: a * 1.5 + 1.0), (x,)


def _host_probe(mesh: jax.sharding.Mesh, per_device: int) -> _Probe:
    """Every device copies `per_device` floats to host memory (`pinned_host`) and back."""
    device = NamedSharding(mesh, P(_AXIS))
    to_host = jax.jit(lambda a: a, out_shardings=device.with_memory_kind("pinned_host"))
    to_device = jax.jit(lambda a: a, out_shardings=device)
    x = jax.device_put(np.ones((mesh.size, per_device), np.float32), device)
    return (lambda a: to_device(to_host(a))), (x,)


def _gather_probe(mesh: jax.sharding.Mesh, per_device: int, axis: str = _AXIS,
                  burst: int = 1) -> _Probe:
    """An all-gather over `axis` of `per_device` floats each (`4 peers per_device` bytes of
    result per device); on a 2-D mesh every group along `axis` runs at once. With `burst`,
    that many, each gathering a slice of the last one's result (so none can start early or
    be merged with another)."""
    spec = P(mesh.axis_names)  # one shard per device

    def gathers(shard):
        for _ in range(burst):
            gathered = jax.lax.all_gather(shard, axis, tiled=True)
            shard = gathered[: shard.shape[0]]
        return gathered

    gather = jax.jit(
        jax.shard_map(
            gathers, mesh=mesh, in_specs=spec,
            out_specs=P(tuple(a for a in mesh.axis_names if a != axis)), check_vma=False,
        )
    )  # fmt: skip
    x = jax.device_put(np.ones((mesh.size * per_device,), np.float32), NamedSharding(mesh, spec))
    return gather, (x,)


def _bare(large_s: float, tiny_s: float) -> float:
    """Seconds a large transfer spends moving its bytes: its time less the tiny one's.

    Timing noise can make the large transfer no slower than the tiny one when both are small;
    then its whole time is taken as transfer, which underestimates the bandwidth."""
    return large_s - tiny_s if large_s > tiny_s else large_s


def _interleaved_medians(probes: Mapping[str, _Probe], repeats: int) -> dict[str, float]:
    """Median wall seconds of each probe over `repeats` rounds that time every probe once.

    A latency probe (a name ending in `_TINY`) keeps its fastest round instead: a one-float
    message's time is the link's latency plus whatever stalls it, which only adds. Across a
    tbf-shaped link the median of 5 rounds gave 1.1, 2.0, 7.8, 17 and 330 ms in five runs.

    Each probe first runs once to compile, then one whole round runs untimed, so the first
    timed round does not pay for cold caches, pages and threads (measured: the first
    all-gather after start-up moved 0.6-0.9 GB/s where the next moved 2-3). Taking every figure
    in each round means a slow spell of a shared machine falls on all of them alike, so their
    ratios, which rank plans, hold even while the machine's speed drifts.
    """
    for fn, args in probes.values():
        jax.block_until_ready(fn(*args))
    times: dict[str, list[float]] = {name: [] for name in probes}
    for _ in range(repeats + 1):
        for name, (fn, args) in probes.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return {name: (min if name.endswith(_TINY) else statistics.median)(samples[1:])
            for name, samples in times.items()}


def _device_memory(device: jax.Device, host_memory: int) -> int:
    stats = device.memory_stats()  # None on CPU
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return host_memory // jax.local_device_count()
