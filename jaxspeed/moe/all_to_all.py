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
the reverse `ppermute`, so gradients are the same two stages backwards). Where a device's tokens
are fewer bytes than the slots it sends one host, the MoE layer sends the tokens across instead
(`jaxspeed.moe.host_tokens`) and uses `within_host_all_to_all` for the rest.

`a2a_chunk_count` says in how many chunks the capacity buffer goes out (`MoE.a2a_chunks`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspeed.errors import ConfigError
from jaxspeed.sharding.two_level import host_shift, local_shift, shift



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
        pairs = local_shift(hosts, per_host, d)
        arrived.append(shift(jnp.take(dest, (l + d) % per_host, axis=1), axis, pairs))
    held = jnp.take(jnp.stack(arrived), (l - jnp.arange(per_host)) % per_host, axis=0)

    # Stage 2: at host shift e, send host (h + e) % H every local source's chunk for it; what
    # arrives comes from host (h - e) % H. got[j]: from host j, [L_src, chunk...].
    arrived = []
    for e in range(hosts):
        pairs = host_shift(hosts, per_host, e)
        arrived.append(shift(jnp.take(held, (h + e) % hosts, axis=1), axis, pairs))
    got = jnp.take(jnp.stack(arrived), (h - jnp.arange(hosts)) % hosts, axis=0)
    got = got.reshape(n, *chunk_shape)  # source s = h_s * L + l_s, in order
    return _concatenate_sources(got, split_axis, concat_axis)


def _concatenate_sources(got, split_axis: int, concat_axis: int):
    """`got [sources, *chunk]` (each chunk `x`'s shape with `split_axis` cut, moved first)
    concatenated along `concat_axis` in source order, as `all_to_all` delivers them."""
    blocks = jnp.moveaxis(got, 1, split_axis + 1)  # [n, *x.shape with split_axis cut n-fold]
    stacked = jnp.moveaxis(blocks, 0, concat_axis)  # the sources just before concat_axis
    shape = stacked.shape
    return stacked.reshape(*shape[:concat_axis], shape[concat_axis] * shape[concat_axis + 1],
                           *shape[concat_axis + 2:])


def within_host_all_to_all(x, axis: str, split_axis: int, concat_axis: int, *, hosts: int):
    """The tiled all-to-all among the devices of each host only: device `(h, l)` sends chunk
    `l'` of `x` (split `per_host` ways) to `(h, l')`; nothing crosses a host.

    Args:
      x: this device's array; `x.shape[split_axis]` divisible by `per_host = n / hosts`.
      axis: a manual mesh axis of `hosts * per_host` devices, host-major.
      hosts: the hosts the axis spans; 1 is the all-to-all over the whole axis.
    """
    n = jax.lax.axis_size(axis)
    per_host = n // hosts
    if per_host == 1:
        return x
    if hosts == 1:
        return jax.lax.all_to_all(x, axis, split_axis, concat_axis, tiled=True)
    local = jax.lax.axis_index(axis) % per_host
    chunks = jnp.moveaxis(x, split_axis, 0)
    chunks = chunks.reshape(per_host, chunks.shape[0] // per_host, *chunks.shape[1:])
    arrived = []  # at shift d: to local (l + d) % L, from local (l - d) % L
    for d in range(per_host):
        pairs = local_shift(hosts, per_host, d)
        arrived.append(shift(jnp.take(chunks, (local + d) % per_host, axis=0), axis, pairs))
    got = jnp.take(jnp.stack(arrived), (local - jnp.arange(per_host)) % per_host, axis=0)
    return _concatenate_sources(got, split_axis, concat_axis)


def collectives_overlap(mesh=None) -> bool:
    """Whether the devices of `mesh` (default: the current one) can run a collective beside
    their compute: not CPU devices, where XLA runs each collective in line with the rest of
    the device's program (in one process or over gloo)."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    device = getattr(mesh, "abstract_device", None)
    return device is None or device.platform != "cpu"


def a2a_chunk_count(chunks: int | str, slots: int, row_bytes: int, ep: int, *,
                    overlap: bool = True) -> int:
    """The chunks the capacity buffer `[E, slots, M]` goes out in (`slots = G_l * C`).

    `"auto"`: 1 without expert parallelism or without `overlap` (`collectives_overlap`), else
    the most chunks, up to `MAX_AUTO_CHUNKS`, that divide `slots` and leave each chunk's
    all-to-all at least `MIN_CHUNK_BYTES` (`row_bytes` = `E * M * itemsize` per slot): below
    that a message pays more in latency than its overlap hides. An int must divide `slots`.
    """
    if chunks == "auto":
        if ep == 1 or not overlap:
            return 1
        fits = [n for n in range(1, MAX_AUTO_CHUNKS + 1)
                if slots % n == 0 and slots // n * row_bytes >= MIN_CHUNK_BYTES]
        return max(fits, default=1)
    if slots % chunks:
        raise ConfigError(
            f"a2a_chunks={chunks} must divide the capacity buffer's {slots} slots per device "
            f"(local groups x capacity); use a divisor of {slots} or 'auto'")
    return chunks


#: `a2a_chunks: auto`: at most this many chunks, each at least this many bytes.
MAX_AUTO_CHUNKS, MIN_CHUNK_BYTES = 4, 256 * 1024
