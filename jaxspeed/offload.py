"""ZeRO-Offload as XLA memory kinds: state lives in `pinned_host` memory between steps.

A sharding with ``memory_kind="pinned_host"`` keeps the same per-device shards in host memory.
The jitted step moves such arrays to the device for the compute (`to_device`), and its
`out_shardings` put the new values back on the host, so the host copy is the only one that
survives a step. `run_on_host` runs a function on the host instead (ZeRO-Offload's CPU-Adam).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding

HOST = "pinned_host"
DEVICE = "device"


def with_memory_kind(shardings, kind: str):
    """The same shardings (a pytree of `NamedSharding`) in memory `kind`."""
    return jax.tree.map(lambda s: s.with_memory_kind(kind), shardings)


def on_host(sharding: NamedSharding | None) -> bool:
    """Whether a sharding keeps its shards in a host memory kind."""
    return sharding is not None and (sharding.memory_kind or DEVICE).endswith("host")


def to_device(tree, shardings):
    """Inside a jitted step: streams host-resident `tree` into device memory, same layout."""
    return jax.device_put(tree, with_memory_kind(shardings, DEVICE))


def to_host(tree, shardings):
    """Inside a jitted step: streams `tree` out to `pinned_host` memory, same layout."""
    return jax.device_put(tree, with_memory_kind(shardings, HOST))


def run_on_host(fn: Callable[..., Any], *args):
    """Runs `fn(*args)` as a host computation (XLA `compute_on("device_host")`).

    Every operand must already be in host memory. `compute_on` is a context manager in JAX
    0.10–0.11 and a decorator in later versions; a `contextlib` context manager is also a
    decorator, so wrapping `fn` covers both.
    """
    from jax.experimental.compute_on import compute_on

    return compute_on("device_host")(fn)(*args)


def memory_kinds(tree) -> set[str]:
    """The memory kinds of a pytree of arrays (for checks and tests)."""
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}
