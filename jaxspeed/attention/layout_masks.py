"""Pure pieces of block-sparse layouts: each returns a bool mask `[num_blocks, num_blocks]`
(`mask[i, j]`: the queries of block `i` attend to the keys of block `j`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def grid(num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column block indices, broadcastable to `[num_blocks, num_blocks]`."""
    idx = np.arange(num_blocks)
    return idx[:, None], idx[None, :]


def windows(window_ids: np.ndarray, *, causal: bool) -> np.ndarray:
    """Block-diagonal local attention: blocks attend within their window (and to the past)."""
    rows, cols = grid(len(window_ids))
    mask = window_ids[:, None] == window_ids[None, :]
    return mask & (cols <= rows) if causal else mask


def sliding_window(num_blocks: int, half_width: int, *, causal: bool) -> np.ndarray:
    """Row `i` attends to blocks `i - half_width .. i + half_width` (`.. i` when causal)."""
    rows, cols = grid(num_blocks)
    mask = np.abs(rows - cols) <= half_width
    return mask & (cols <= rows) if causal else mask


def global_spans(
    num_blocks: int, spans: Sequence[tuple[int, int]], *, causal: bool, horizontal: bool
) -> np.ndarray:
    """Global blocks: every row attends to the span's columns, and with `horizontal` the span's
    rows attend to every column.

    `causal` here is DeepSpeed's unidirectional global column: it starts at the span's first row,
    so rows inside the span see the whole span. Spans follow Python slice rules, as DeepSpeed's.
    """
    first_row = np.full(num_blocks, num_blocks)  # per column: first row that attends to it
    global_rows = np.zeros(num_blocks, dtype=bool)
    for start, stop in spans:
        col_start, col_stop, _ = slice(start, stop).indices(num_blocks)
        row_start = slice(start, None).indices(num_blocks)[0] if causal else 0
        first_row[col_start:col_stop] = np.minimum(first_row[col_start:col_stop], row_start)
        if horizontal:
            global_rows[start:stop] = True
    rows, _ = grid(num_blocks)
    return (rows >= first_row[None, :]) | global_rows[:, None]


def random_blocks(
    rng: np.random.Generator, num_blocks: int, count: int, *, causal: bool
) -> np.ndarray:
    """Each row attends to `count` distinct uniformly drawn blocks (past ones when causal)."""
    if count == 0:
        return np.zeros((num_blocks, num_blocks), dtype=bool)
    rows, cols = grid(num_blocks)
    keys = rng.random((num_blocks, num_blocks))
    if causal:
        keys = np.where(cols <= rows, keys, np.inf)
    # The `count` smallest uniform keys of a row are a uniform sample without replacement.
    chosen = np.argpartition(keys, count - 1, axis=1)[:, :count]
    mask = np.zeros((num_blocks, num_blocks), dtype=bool)
    np.put_along_axis(mask, chosen, True, axis=1)
    return mask & (cols <= rows) if causal else mask
