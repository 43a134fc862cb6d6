"""Collectives over one mesh axis whose devices span several hosts, in two stages: inside each
host, then across hosts, so the slow link carries each byte once.

A mesh axis of `n = hosts x per_host` devices numbered host-major (device `h * per_host + l`,
as `jaxspeed.runtime.mesh.make_mesh` lays out processes) has no sub-axis to name the hosts by,
so a plain collective over it runs flat over all `n`: gloo's ring all-gather of `n` shards
sends `(n - 1) / n` of the result over each edge, including the host-crossing ones. In two
stages, a device sends only its own shard across (`hosts - 1` times):

- `all_gather`: across hosts first (the devices of one local index swap their shards), then
  inside the host (each device shares what it gathered);
- `reduce_scatter`, its transpose: inside the host first (each device sums its host's rows
  for every host's device of its local index), then across hosts (the partial sums meet).

Each exchange is a `ppermute` of one message per device; inside `shard_map` manual over the
axis. The MoE layer's hierarchical all-to-all, its `expert_data` strategy
(`jaxspeed.moe.all_to_all`) and its token exchange (`jaxspeed.moe.host_tokens`) use the same
shifts.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxspeed.runtime.distributed import process_total


def spanned_hosts(mesh, axis: str, processes: int | None = None) -> int:
    """The processes the devices along `axis` belong to, for a mesh over all devices laid out
    host-major, as `jaxspeed.runtime.mesh.make_mesh` lays them out (each process's devices one
    contiguous block of the flattened mesh). Works on an abstract mesh, inside `jit`.

    Args:
      mesh: a `Mesh` or `AbstractMesh`.
      processes: the processes the mesh's devices are split over (default
        `jax.process_count()`, or the emulated count: `runtime.distributed.process_total`).
    """
    if mesh.empty or axis not in mesh.axis_names:
        return 1
    processes = process_total() if processes is None else processes
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    names = list(mesh.axis_names)
    stride = math.prod(sizes[a] for a in names[names.index(axis) + 1:])
    per_process = max(1, mesh.size // processes)
    return len({i * stride // per_process for i in range(sizes[axis])})


def local_shift(hosts: int, per_host: int, d: int) -> list[tuple[int, int]]:
    """`ppermute` pairs sending each device to local index `(l + d) % per_host` on its host."""
    return [(g * per_host + i, g * per_host + (i + d) % per_host)
            for g in range(hosts) for i in range(per_host)]


def host_shift(hosts: int, per_host: int, e: int) -> list[tuple[int, int]]:
    """`ppermute` pairs sending each device to its local index on host `(h + e) % hosts`."""
    return [(g * per_host + i, ((g + e) % hosts) * per_host + i)
            for g in range(hosts) for i in range(per_host)]


def shift(x, axis: str, pairs: list[tuple[int, int]]):
    """`ppermute(x, axis, pairs)`, or `x` where every pair stays put."""
    return x if all(a == b for a, b in pairs) else jax.lax.ppermute(x, axis, pairs)


def host_coordinates(axis: str, hosts: int):
    """`(per_host, this device's host, its local index)` on a manual mesh axis of
    `hosts * per_host` devices, host-major."""
    per_host = jax.lax.axis_size(axis) // hosts
    me = jax.lax.axis_index(axis)
    return per_host, me // per_host, me % per_host


def gather_across_hosts(x, axis: str, *, hosts: int):
    """`x [k, ...]` of the devices with this device's local index on every host, in host
    order: `[hosts * k, ...]` (an all-gather over the host part of `axis`; its gradient sends
    each host's share back and sums it, a reduce-scatter).

    Args:
      x: this device's array.
      axis: a manual mesh axis of `hosts * per_host` devices, host-major.
      hosts: the hosts the axis spans (dividing its size).
    """
    if hosts == 1:
        return x
    got = stack_across_hosts(x, axis, hosts=hosts)
    return got.reshape(hosts * x.shape[0], *x.shape[1:])


def stack_across_hosts(x, axis: str, *, hosts: int):
    """`[hosts, *x.shape]`: `x` of this local index's device on every host, in host order
    (its transpose is `sum_across_hosts`)."""
    per_host, host, _ = host_coordinates(axis, hosts)
    arrived = []  # at shift e: from host (h - e) % H
    for e in range(hosts):
        arrived.append(shift(x, axis, host_shift(hosts, per_host, e)))
    return jnp.take(jnp.stack(arrived), (host - jnp.arange(hosts)) % hosts, axis=0)


def all_gather(x, axis: str, *, hosts: int):
    """`[n, *x.shape]`: every device's `x` in device order, as
    `jax.lax.all_gather(x, axis)`, gathered across hosts and then inside the host.

    Args:
      x: this device's array.
      axis: a manual mesh axis of `n = hosts * per_host` devices, host-major.
      hosts: the hosts the axis spans (dividing `n`).
    """
    per_host, _, local = host_coordinates(axis, hosts)
    across = stack_across_hosts(x, axis, hosts=hosts)  # [H, ...] of this local index
    arrived = []  # at shift d: from local (l - d) % L
    for d in range(per_host):
        arrived.append(shift(across, axis, local_shift(hosts, per_host, d)))
    held = jnp.take(jnp.stack(arrived), (local - jnp.arange(per_host)) % per_host, axis=0)
    return held.swapaxes(0, 1).reshape(hosts * per_host, *x.shape)  # [L, H] -> device order


def reduce_scatter(rows, axis: str, *, hosts: int):
    """The sum over all devices of their row for this device: `rows [n, ...]` (row `p` for
    device `p`) → `[...]`, as `psum_scatter(rows, axis, scatter_dimension=0)`, summed inside
    the host first and then across hosts (`all_gather`'s transpose).

    Args:
      rows: this device's contributions, one row per device of the axis.
      axis: a manual mesh axis of `n = hosts * per_host` devices, host-major.
      hosts: the hosts the axis spans (dividing `n`).
    """
    per_host, _, local = host_coordinates(axis, hosts)
    by_device = rows.reshape(hosts, per_host, *rows.shape[1:])
    partial = None  # [H, ...]: this host's rows for every host's device of this local index
    for d in range(per_host):
        out = jnp.take(by_device, (local + d) % per_host, axis=1)
        got = shift(out, axis, local_shift(hosts, per_host, d))
        partial = got if partial is None else partial + got
    return sum_across_hosts(partial, axis, hosts=hosts)


def sum_across_hosts(rows, axis: str, *, hosts: int):
    """The sum over the devices of this local index on every host of their row for this
    device's host: `rows [hosts, ...]` (row `g` for the device on host `g`) → `[...]`, each row
    sent to its host in one message (`stack_across_hosts`' transpose).

    Args:
      rows: this device's contributions, one row per host.
      axis: a manual mesh axis of `hosts * per_host` devices, host-major.
      hosts: the hosts the axis spans (dividing its size).
    """
    per_host, host, _ = host_coordinates(axis, hosts)
    total = None
    for e in range(hosts):
        got = shift(jnp.take(rows, (host + e) % hosts, axis=0), axis,
                    host_shift(hosts, per_host, e))
        total = got if total is None else total + got
    return total
