"""Argument checks of the sparsity configs (DeepSpeed's names; every failure a `ConfigError`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxspeed.errors import ConfigError

ATTENTION_KINDS: tuple[str, ...] = ("bidirectional", "unidirectional")


def fail(owner: str, name: str, value: Any, accepted: str) -> None:
    raise ConfigError(f"{owner}: {name}={value!r} is invalid; {accepted}")


def check_int(owner: str, name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        fail(owner, name, value, f"expected an integer >= {minimum}")


def check_bool(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, (bool, np.bool_)):
        fail(owner, name, value, "expected true or false")


def check_attention(owner: str, attention: Any) -> None:
    if attention not in ATTENTION_KINDS:
        fail(owner, "attention", attention, f"accepted values are {list(ATTENTION_KINDS)}")


def int_tuple(owner: str, name: str, value: Any, *, minimum: int) -> tuple[int, ...]:
    """Checks a list of integers >= `minimum` and returns it as a tuple (hashable, frozen)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        fail(owner, name, value, f"expected a list of integers >= {minimum}")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, (int, np.integer)) or item < minimum:
            fail(owner, name, list(value), f"expected a list of integers >= {minimum}")
    return tuple(int(item) for item in value)


def set_global_blocks(config: Any) -> None:
    """Checks `global_block_indices` / `global_block_end_indices` and stores them as tuples."""
    owner = type(config).__name__
    starts = int_tuple(owner, "global_block_indices", config.global_block_indices, minimum=0)
    object.__setattr__(config, "global_block_indices", starts)
    if config.global_block_end_indices is None:
        return
    ends = int_tuple(owner, "global_block_end_indices", config.global_block_end_indices, minimum=1)
    object.__setattr__(config, "global_block_end_indices", ends)
    if len(starts) != len(ends):
        fail(
            owner, "global_block_end_indices", list(ends),
            f"it must have as many entries as global_block_indices={list(starts)} "
            f"({len(starts)}), one end (exclusive) per start",
        )
    for start, end in zip(starts, ends):
        if start >= end:
            fail(
                owner, "global_block_end_indices", list(ends),
                f"each end must be larger than its start in global_block_indices, "
                f"but start {start} >= end {end}",
            )


def global_ranges(config: Any, num_blocks: int) -> list[tuple[int, int]]:
    """The `(start, stop)` global ranges that start inside the sequence, as DeepSpeed."""
    starts = config.global_block_indices
    ends = config.global_block_end_indices or [i + 1 for i in starts]
    return [(start, stop) for start, stop in zip(starts, ends) if start < num_blocks]
