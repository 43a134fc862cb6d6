"""The MoE all-to-all, flat or in two stages (Tutel's 2D hierarchical all-to-all).

Inside `shard_map`, over a mesh axis of `n = hosts x per_host` devices numbered host-major
(device `h * per_host + l`), `jax.lax.all_to_all(x, axis, split, concat, tiled=True)` sends
chunk `j` of `x` (split `n` ways along `split`) to device `j` and concatenates what arrives in
source order along `concat`. Between hosts that is `per_host` messages per device pair of hosts.

`hierarchical_all_to_all` gives the same result in two stages:

1. inside each host: device `(h, l)` sends device `(h, l')` the chunks bound for local index
   `l'` on every host (`hosts` chunks in one message), `per_host - 1` exchanges;
2. across hosts: device `(h, l)` sends device `(h', l)` everything its host holds for
   `(h', l)`: the chunks of all `per_host` sources in one message, `hosts - 1` exchanges.

So the slow link carries `hosts - 1` messages per device, each `per_host` times larger, instead
of `(hosts - 1) * per_host`, with the same bytes. Each exchange is a `ppermute` (its transpose is
the reverse `ppermute`, so gradients are the same two stages backwards).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

#: `MoE.all_to_all` values.
ALGORITHMS = ("flat", "hierarchical")


def spanned_hosts(mesh, axis: str, processes: int | None = None) -> int:
    """The processes the devices along `axis` belong to, for a mesh over all devices laid out
    host-major, as `jaxspeed.runtime.mesh.make_mesh` lays them out (each process's devices one
    contiguous block of the flattened mesh). Works on an abstract mesh, inside `jit`.

    Args:
      mesh: a `Mesh` or `AbstractMesh`.
      processes: the processes the mesh's devices are split over (default
        `jax.process_count()`).
    """
    if mesh.empty or axis not in mesh.axis_names:
        return 1
    processes = jax.process_count() if processes is None else processes
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    names = list(mesh.axis_names)
    stride = math.prod(sizes[a] for a in names[names.index(axis) + 1:])
    per_process = max(1, mesh.size // processes)
    return len({i * stride // per_process for i in range(sizes[axis])})


def _shift(x, axis: str, pairs: list[tuple[int, int]]):
    return x if all(a == b for a, b in pairs) else jax.lax.ppermute(x, axis, pairs)


def hierarchical_all_to_all(x, axis: str, split_axis: int, concat_axis: int, *, hosts: int):
    """`jax.lax.all_to_all(x, axis, split_axis, concat_axis, tiled=True)` in two stages,
    inside each host and then across hosts (see the module docstring).

    Args:
      x: this device's array; `x.shape[split_axis]` divisible by the axis size `n`.
      axis: a manual mesh axis of `hosts * per_host` devices, host-major.
      hosts: the hosts the axis spans (`n % hosts == 0`); 1 is the flat all-to-all.
    """
    n = jax.lax.axis_size(axis)
    if hosts <= 1 or hosts == n:
        return jax.lax.all_to_all(x, axis, split_axis, concat_axis, tiled=True)
    if n % hosts:
        raise ValueError(f"hosts={hosts} must divide the size {n} of mesh axis {axis!r}")
    per_host = n // hosts
    me = jax.lax.axis_index(axis)
    h, l = me // per_host, me % per_host
    # [H (destination host), L (destination local), chunk...], split_axis moved first
    chunks = jnp.moveaxis(x, split_axis, 0)
    chunk_shape = (chunks.shape[0] // n, *chunks.shape[1:])
    dest = chunks.reshape(hosts, per_host, *chunk_shape)

    # Stage 1: at local shift d, send local index (l + d) % L its chunks for every host; what
    # arrives comes from local (l - d) % L. held[j]: from local source j, [H_dest, chunk...].
    arrived = []
    for d in range(per_host):
        pairs = [(g * per_host + i, g * per_host + (i + d) % per_host)
                 for g in range(hosts) for i in range(per_host)]
        arrived.append(_shift(jnp.take(dest, (l + d) % per_host, axis=1), axis, pairs))
    held = jnp.take(jnp.stack(arrived), (l - jnp.arange(per_host)) % per_host, axis=0)

    # Stage 2: at host shift e, send host (h + e) % H every local source's chunk for it; what
    # arrives comes from host (h - e) % H. got[j]: from host j, [L_src, chunk...].
    arrived = []
    for e in range(hosts):
        pairs = [(g * per_host + i, ((g + e) % hosts) * per_host + i)
                 for g in range(hosts) for i in range(per_host)]
        arrived.append(_shift(jnp.take(held, (h + e) % hosts, axis=1), axis, pairs))
    got = jnp.take(jnp.stack(arrived), (h - jnp.arange(hosts)) % hosts, axis=0)
    got = got.reshape(n, *chunk_shape)  # source s = h_s * L + l_s, in order

    # concatenate the n sources' chunks along concat_axis, as the flat all-to-all does
    blocks = jnp.moveaxis(got, 1, split_axis + 1)  # [n, *x.shape with split_axis cut n-fold]
    stacked = jnp.moveaxis(blocks, 0, concat_axis)  # the sources just before concat_axis
    shape = stacked.shape
    return stacked.reshape(*shape[:concat_axis], shape[concat_axis] * shape[concat_axis + 1],
                           *shape[concat_axis + 2:])
