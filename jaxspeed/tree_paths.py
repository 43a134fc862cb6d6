"""Readable names for pytree key paths, shared by the planner, adapters and checkpoints."""

from __future__ import annotations

from jax.tree_util import keystr


def key_names(path) -> tuple[str, ...]:
    """`(DictKey('layers'), GetAttrKey('mu'), SequenceKey(0))` → `('layers', 'mu', '0')`: each
    key as `jax.tree_util.keystr` writes it alone, for lookups by name or suffix. A path as one
    string is `keystr(path, simple=True, separator=...)` itself."""
    return tuple(keystr((key,), simple=True) for key in path)
