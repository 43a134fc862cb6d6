"""Dotted key paths (``"zero_optimization.offload_param.device"``) into nested config dicts."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from jaxspeed.errors import ConfigError

#: What `_lookup` returns for a path that is not in the tree (None is a value a key can hold).
_MISSING = object()


class Problem(NamedTuple):
    """One thing wrong with a config: where (a dotted key path, "" for the whole config) and
    a message that names it."""

    path: str
    text: str


def _plain(tree: Any) -> Any:
    """Deep copy with every mapping turned into a dict."""
    if isinstance(tree, Mapping):
        return {key: _plain(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_plain(value) for value in tree]
    return copy.deepcopy(tree)


def _lookup(tree: dict[str, Any], path: str) -> Any:
    node: Any = tree
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return _MISSING
        node = node[key]
    return node


def _remove(tree: dict[str, Any], path: str) -> None:
    """Deletes `path`, and the parents that the deletion leaves empty."""
    keys = path.split(".")
    parents = [tree]
    for key in keys[:-1]:
        parents.append(parents[-1][key])
    del parents[-1][keys[-1]]
    for depth in range(len(keys) - 1, 0, -1):
        if parents[depth]:
            break
        del parents[depth - 1][keys[depth - 1]]


def _insert(tree: dict[str, Any], keys: Sequence[str], value: Any, *, what: str) -> None:
    node = tree
    for depth, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            where = ".".join(keys[: depth + 1])
            raise ConfigError(
                f"{what}: cannot set {'.'.join(keys)} because {where} is {child!r}, not a mapping"
            )
        node = child
    node[keys[-1]] = value
