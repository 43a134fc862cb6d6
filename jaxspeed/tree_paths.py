"""Readable names for pytree key paths, shared by the planner, adapters and checkpoints."""

from __future__ import annotations


def key_names(path) -> tuple[str, ...]:
    """`(DictKey('layers'), GetAttrKey('mu'), SequenceKey(0))` → `('layers', 'mu', '0')`."""
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
