"""ZeRO-Offload as XLA memory kinds: state lives in `pinned_host` memory between steps.

A sharding with ``memory_kind="pinned_host"`` keeps the same per-device shards in host memory.
The jitted step moves such arrays to the device for the compute (`to_device`), and its
`out_shardings` put the new values back on the host, so the host copy is the only one that
survives a step. `run_on_host` runs a function on the host instead (ZeRO-Offload's CPU-Adam).

Layer streaming (ZeRO-Infinity's parameter offload): a scanned layer calls `fetch` on its own
slice of the host-resident params, so one layer's params at a time occupy device memory.
Autodiff transposes the move, so that layer's gradient goes back to host memory as the
backward pass produces it. JAX types carry the memory space (`in_host`) and refuse device math
on host arrays; `map_where_it_lives` runs a per-leaf function where each leaf is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.experimental.compute_on import compute_on
from jax.sharding import NamedSharding

from jaxspeed.ops.precision import cast_floating

HOST = "pinned_host"
DEVICE = "device"


def with_memory_kind(shardings, kind: str):
    """The same shardings (a pytree of `NamedSharding`) in memory `kind`."""
    return jax.tree.map(lambda s: s.with_memory_kind(kind), shardings)


def on_host(sharding: NamedSharding | None) -> bool:
    """Whether a sharding keeps its shards in a host memory kind."""
    return sharding is not None and (sharding.memory_kind or DEVICE).endswith("host")


def to_device(tree, shardings):
    """Inside a jitted step: streams host-resident `tree` into device memory, same layout.

    The move names the memory space, so the values' types say device memory; a sharding's
    memory kind alone leaves them typed as host memory, which XLA:CPU (whose types carry no
    memory space) accepts but a step traced for a GPU refuses at the first device op.
    """
    moved = jax.device_put(tree, jax.memory.Space.Device)
    return jax.lax.with_sharding_constraint(moved, with_memory_kind(shardings, DEVICE))


def to_host(tree, shardings):
    """Inside a jitted step: streams `tree` out to `pinned_host` memory, same layout."""
    return jax.device_put(tree, with_memory_kind(shardings, HOST))


def run_on_host(fn: Callable[..., Any], *args):
    """Runs `fn(*args)` as a host computation (ZeRO-Offload's CPU-Adam).

    Every operand must already be in host memory, and every output stays there
    (`out_memory_spaces`, a prefix of the outputs' pytree): callers move what the device
    needs with `to_device` or `jax.device_put`.
    """
    host_fn = compute_on(fn, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
    return host_fn(*args)


def in_host(x) -> bool:
    """Whether a (traced) array lives in host memory (JAX's types carry the memory space)."""
    return jax.typeof(x).memory_space == jax.memory.Space.Host


def on_device(x):
    """Inside a jitted step: `x` in device memory, moved there when it lives on the host (an
    `offload_param` shard); its transpose moves the gradient back to where `x` lives."""
    return jax.device_put(x, jax.memory.Space.Device) if in_host(x) else x


def fetch(tree, dtype):
    """Inside a jitted step: host-resident arrays into device memory, floating ones cast to
    `dtype` there. Its transpose moves the gradient back to the host."""
    return cast_floating(jax.device_put(tree, jax.memory.Space.Device), dtype)


def map_where_it_lives(fn: Callable[..., Any], *trees):
    """`jax.tree.map(fn, *trees)`, each leaf's call a host computation when the first tree's
    leaf is in host memory (the other trees' leaves must be there too)."""
    return jax.tree.map(lambda x, *rest: run_on_host(fn, x, *rest) if in_host(x) else fn(x, *rest),
                        *trees)


def device_scalars(fn: Callable[[Any], Any], tree) -> list:
    """`fn(leaf)` for every leaf, computed where the leaf lives, each result in device memory."""
    out = jax.tree.leaves(map_where_it_lives(fn, tree))
    return [jax.device_put(x, jax.memory.Space.Device) if in_host(x) else x for x in out]


def memory_kinds(tree) -> set[str]:
    """The memory kinds of a pytree of arrays (for checks and tests)."""
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}
