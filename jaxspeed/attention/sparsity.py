"""Block-sparse attention layouts with DeepSpeed's sparsity configs, names and semantics.

Each config is a frozen dataclass taking the parameter names and defaults of
`deepspeed.ops.sparse_attention.sparsity_config` and `make_layout(seq_len)` returns an integer
array `[num_heads, num_blocks, num_blocks]`: `layout[h, i, j] == 1` when the queries of block `i`
attend to the keys of block `j` in head `h`. Without random blocks the layouts equal DeepSpeed's
for the same arguments; random blocks come from `numpy.random.default_rng(seed)`, so every
process builds the same layout (`dataclasses.replace(config, seed=layer)` draws another one,
e.g. per layer, as DeepSpeed's per-layer draws from Python's global `random`).

Deliberate differences from DeepSpeed (each was a crash or an undetected misuse there):
- Every validation raises `jaxspeed.errors.ConfigError` (a `ValueError`), also for an unknown
  `attention` kind, and arguments are type- and range-checked (e.g. `num_global_blocks=0`).
- Global block indices must be non-negative (DeepSpeed would wrap them around).
- Unidirectional BigBird rows with fewer past blocks than `num_random_blocks` take all of
  them (DeepSpeed's `random.sample` raises there).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any, ClassVar

import numpy as np

from jaxspeed.errors import ConfigError, did_you_mean

ATTENTION_KINDS: tuple[str, ...] = ("bidirectional", "unidirectional")


def _fail(owner: str, name: str, value: Any, accepted: str) -> None:
    raise ConfigError(f"{owner}: {name}={value!r} is invalid; {accepted}")


def _check_int(owner: str, name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        _fail(owner, name, value, f"expected an integer >= {minimum}")


def _check_bool(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, (bool, np.bool_)):
        _fail(owner, name, value, "expected true or false")


def _check_attention(owner: str, attention: Any) -> None:
    if attention not in ATTENTION_KINDS:
        _fail(owner, "attention", attention, f"accepted values are {list(ATTENTION_KINDS)}")


def _int_tuple(owner: str, name: str, value: Any, *, minimum: int) -> tuple[int, ...]:
    """Checks a list of integers >= `minimum` and returns it as a tuple (hashable, frozen)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        _fail(owner, name, value, f"expected a list of integers >= {minimum}")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, (int, np.integer)) or item < minimum:
            _fail(owner, name, list(value), f"expected a list of integers >= {minimum}")
    return tuple(int(item) for item in value)


def _set_global_blocks(config: Any) -> None:
    """Checks `global_block_indices` / `global_block_end_indices` and stores them as tuples."""
    owner = type(config).__name__
    starts = _int_tuple(owner, "global_block_indices", config.global_block_indices, minimum=0)
    object.__setattr__(config, "global_block_indices", starts)
    if config.global_block_end_indices is None:
        return
    ends = _int_tuple(owner, "global_block_end_indices", config.global_block_end_indices, minimum=1)
    object.__setattr__(config, "global_block_end_indices", ends)
    if len(starts) != len(ends):
        _fail(
            owner, "global_block_end_indices", list(ends),
            f"it must have as many entries as global_block_indices={list(starts)} "
            f"({len(starts)}), one end (exclusive) per start",
        )
    for start, end in zip(starts, ends):
        if start >= end:
            _fail(
                owner, "global_block_end_indices", list(ends),
                f"each end must be larger than its start in global_block_indices, "
                f"but start {start} >= end {end}",
            )


def _global_ranges(config: Any, num_blocks: int) -> list[tuple[int, int]]:
    """The `(start, stop)` global ranges that start inside the sequence, as DeepSpeed."""
    starts = config.global_block_indices
    ends = config.global_block_end_indices or [i + 1 for i in starts]
    return [(start, stop) for start, stop in zip(starts, ends) if start < num_blocks]


# ---- pure layout pieces: each returns a bool mask [num_blocks, num_blocks] -------------------


def _grid(num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column block indices, broadcastable to `[num_blocks, num_blocks]`."""
    idx = np.arange(num_blocks)
    return idx[:, None], idx[None, :]


def _windows(window_ids: np.ndarray, *, causal: bool) -> np.ndarray:
    """Block-diagonal local attention: blocks attend within their window (and to the past)."""
    rows, cols = _grid(len(window_ids))
    mask = window_ids[:, None] == window_ids[None, :]
    return mask & (cols <= rows) if causal else mask


def _sliding_window(num_blocks: int, half_width: int, *, causal: bool) -> np.ndarray:
    """Row `i` attends to blocks `i - half_width .. i + half_width` (`.. i` when causal)."""
    rows, cols = _grid(num_blocks)
    mask = np.abs(rows - cols) <= half_width
    return mask & (cols <= rows) if causal else mask


def _global_spans(
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
    rows, _ = _grid(num_blocks)
    return (rows >= first_row[None, :]) | global_rows[:, None]


def _random_blocks(
    rng: np.random.Generator, num_blocks: int, count: int, *, causal: bool
) -> np.ndarray:
    """Each row attends to `count` distinct uniformly drawn blocks (past ones when causal)."""
    if count == 0:
        return np.zeros((num_blocks, num_blocks), dtype=bool)
    rows, cols = _grid(num_blocks)
    keys = rng.random((num_blocks, num_blocks))
    if causal:
        keys = np.where(cols <= rows, keys, np.inf)
    # The `count` smallest uniform keys of a row are a uniform sample without replacement.
    chosen = np.argpartition(keys, count - 1, axis=1)[:, :count]
    mask = np.zeros((num_blocks, num_blocks), dtype=bool)
    np.put_along_axis(mask, chosen, True, axis=1)
    return mask & (cols <= rows) if causal else mask


# ---- configs ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SparsityConfig:
    """Base of the block-sparse layouts (DeepSpeed's `SparsityConfig`).

    Attributes:
      num_heads: attention heads of the layer.
      block: block size; the layout has one entry per `block x block` tile.
    """

    mode: ClassVar[str] = ""

    num_heads: int
    _: KW_ONLY
    block: int = 16

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _check_int(owner, "num_heads", self.num_heads, minimum=1)
        _check_int(owner, "block", self.block, minimum=1)
        if hasattr(self, "different_layout_per_head"):
            _check_bool(owner, "different_layout_per_head", self.different_layout_per_head)

    def make_layout(self, seq_len: int) -> np.ndarray:
        """Builds the layout for a sequence length.

        Args:
          seq_len: tokens per sequence; a multiple of `block`.

        Returns:
          `np.int32` array `[num_heads, seq_len // block, seq_len // block]` of 0/1.

        Raises:
          ConfigError: `seq_len` is not a positive multiple of `block`, or the layout's
            windows, global or random blocks do not fit in `seq_len // block` blocks.
        """
        owner = type(self).__name__
        _check_int(owner, "seq_len", seq_len, minimum=1)
        if seq_len % self.block:
            _fail(owner, "seq_len", seq_len, f"it must be divisible by block={self.block}")
        num_blocks = seq_len // self.block
        self._check_fits(num_blocks)
        per_head = getattr(self, "different_layout_per_head", False)
        rng = np.random.default_rng(getattr(self, "seed", 0))
        built = self.num_heads if per_head else 1
        heads = [self._head_layout(h, num_blocks, rng) for h in range(built)]
        if not per_head:  # DeepSpeed builds head 0 and copies it (one random draw for all)
            heads = heads * self.num_heads
        return np.stack(heads).astype(np.int32)

    def _check_fits(self, num_blocks: int) -> None:
        """Raises where DeepSpeed rejects a layout that does not fit in `num_blocks`."""

    def _head_layout(self, head: int, num_blocks: int, rng: np.random.Generator) -> np.ndarray:
        """Bool mask `[num_blocks, num_blocks]` of one head."""
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class DenseSparsityConfig(SparsityConfig):
    """Every block is attended: dense attention in the block-sparse format (for comparison)."""

    mode: ClassVar[str] = "dense"
    different_layout_per_head: bool = False

    def _head_layout(self, head: int, num_blocks: int, rng: np.random.Generator) -> np.ndarray:
        return np.ones((num_blocks, num_blocks), dtype=bool)


@dataclass(frozen=True, kw_only=True)
class FixedSparsityConfig(SparsityConfig):
    """`Fixed` pattern of Sparse Transformers (Child et al. 2019, arXiv:1904.10509), as DeepSpeed.

    Blocks attend within windows of `num_local_blocks`; the `num_global_blocks` blocks at the end
    of each window (earlier for heads `h` with `h % num_different_global_patterns > 0`) are
    attended by all rows (unidirectional: by rows from the global block on), and with
    `horizontal_global_attention` they attend to all blocks too.
    """

    mode: ClassVar[str] = "fixed"
    different_layout_per_head: bool = False
    num_local_blocks: int = 4
    num_global_blocks: int = 1
    attention: str = "bidirectional"
    horizontal_global_attention: bool = False
    num_different_global_patterns: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        _check_int(owner, "num_local_blocks", self.num_local_blocks, minimum=1)
        _check_int(owner, "num_global_blocks", self.num_global_blocks, minimum=1)
        if self.num_local_blocks % self.num_global_blocks:
            _fail(
                owner, "num_global_blocks", self.num_global_blocks,
                f"it must divide num_local_blocks={self.num_local_blocks}",
            )
        _check_attention(owner, self.attention)
        _check_bool(owner, "horizontal_global_attention", self.horizontal_global_attention)
        if self.horizontal_global_attention and self.attention != "bidirectional":
            _fail(
                owner, "horizontal_global_attention", True,
                "it is only supported with attention='bidirectional'",
            )
        patterns = self.num_different_global_patterns
        _check_int(owner, "num_different_global_patterns", patterns, minimum=1)
        if patterns > 1 and not self.different_layout_per_head:
            _fail(
                owner, "num_different_global_patterns", patterns,
                "more than 1 needs different_layout_per_head=True",
            )
        most = self.num_local_blocks // self.num_global_blocks
        if patterns > most:
            _fail(
                owner, "num_different_global_patterns", patterns,
                f"at most num_local_blocks // num_global_blocks = "
                f"{self.num_local_blocks} // {self.num_global_blocks} = {most} are possible",
            )

    def _head_layout(self, head: int, num_blocks: int, rng: np.random.Generator) -> np.ndarray:
        local, size = self.num_local_blocks, self.num_global_blocks
        causal = self.attention == "unidirectional"
        mask = _windows(np.arange(num_blocks) // local, causal=causal)
        offset = local - (1 + head % self.num_different_global_patterns) * size
        full_end = num_blocks - num_blocks % local  # end of the last complete window
        spans = [(i, i + size) for i in range(offset, full_end, local)]
        if full_end < num_blocks:  # a short last window keeps `size` global blocks in range
            start = min(full_end + offset, num_blocks - size)
            spans.append((start, start + size))
        return mask | _global_spans(
            num_blocks, spans, causal=causal, horizontal=self.horizontal_global_attention
        )


@dataclass(frozen=True, kw_only=True)
class VariableSparsityConfig(SparsityConfig):
    """DeepSpeed's `Variable` pattern: Fixed with random blocks, a list of local window sizes and
    explicit global blocks.

    Windows take the sizes of `local_window_blocks` in order, the last size repeating to the end.
    Global blocks are `global_block_indices`, or the ranges `[global_block_indices[i],
    global_block_end_indices[i])`. Each row's `num_random_blocks` are drawn from all blocks (as
    DeepSpeed, also when unidirectional) with `numpy.random.default_rng(seed)`.
    """

    mode: ClassVar[str] = "variable"
    different_layout_per_head: bool = False
    num_random_blocks: int = 0
    local_window_blocks: Sequence[int] = (4,)
    global_block_indices: Sequence[int] = (0,)
    global_block_end_indices: Sequence[int] | None = None
    attention: str = "bidirectional"
    horizontal_global_attention: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        _check_int(owner, "num_random_blocks", self.num_random_blocks, minimum=0)
        windows = _int_tuple(owner, "local_window_blocks", self.local_window_blocks, minimum=1)
        if not windows:
            _fail(owner, "local_window_blocks", [], "expected at least one window size")
        object.__setattr__(self, "local_window_blocks", windows)
        _set_global_blocks(self)
        _check_attention(owner, self.attention)
        _check_bool(owner, "horizontal_global_attention", self.horizontal_global_attention)
        if self.horizontal_global_attention and self.attention != "bidirectional":
            _fail(
                owner, "horizontal_global_attention", True,
                "it is only supported with attention='bidirectional'",
            )
        _check_int(owner, "seed", self.seed, minimum=0)

    def _check_fits(self, num_blocks: int) -> None:
        if self.num_random_blocks > num_blocks:
            _fail(
                type(self).__name__, "num_random_blocks", self.num_random_blocks,
                f"at most the {num_blocks} blocks of a row are possible at this seq_len",
            )

    def _head_layout(self, head: int, num_blocks: int, rng: np.random.Generator) -> np.ndarray:
        causal = self.attention == "unidirectional"
        mask = _random_blocks(rng, num_blocks, self.num_random_blocks, causal=False)
        last = self.local_window_blocks[-1]
        ends = np.cumsum(self.local_window_blocks)  # window ends; the last size then repeats
        ends = np.concatenate([ends, np.arange(ends[-1] + last, num_blocks + last, last)])
        window_ids = np.searchsorted(ends, np.arange(num_blocks), side="right")
        mask |= _windows(window_ids, causal=causal)
        spans = _global_ranges(self, num_blocks)
        return mask | _global_spans(
            num_blocks, spans, causal=causal, horizontal=self.horizontal_global_attention
        )


def _check_sliding_fits(config: SparsityConfig, num_blocks: int) -> None:
    if config.num_sliding_window_blocks > num_blocks:
        _fail(
            type(config).__name__, "num_sliding_window_blocks", config.num_sliding_window_blocks,
            f"at most the {num_blocks} blocks of a row are possible at this seq_len",
        )


@dataclass(frozen=True, kw_only=True)
class BigBirdSparsityConfig(SparsityConfig):
    """BigBird (Zaheer et al. 2020, arXiv:2007.14062), as DeepSpeed: a sliding window of
    `num_sliding_window_blocks`, the first `num_global_blocks` blocks global both ways, and
    `num_random_blocks` per row from `numpy.random.default_rng(seed)`. Unidirectional keeps the
    lower block triangle of all of it.
    """

    mode: ClassVar[str] = "bigbird"
    different_layout_per_head: bool = False
    num_random_blocks: int = 1
    num_sliding_window_blocks: int = 3
    num_global_blocks: int = 1
    attention: str = "bidirectional"
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        _check_int(owner, "num_random_blocks", self.num_random_blocks, minimum=0)
        _check_int(owner, "num_sliding_window_blocks", self.num_sliding_window_blocks, minimum=0)
        _check_int(owner, "num_global_blocks", self.num_global_blocks, minimum=0)
        _check_attention(owner, self.attention)
        _check_int(owner, "seed", self.seed, minimum=0)

    def _check_fits(self, num_blocks: int) -> None:
        owner = type(self).__name__
        for name in ("num_random_blocks", "num_sliding_window_blocks", "num_global_blocks"):
            if getattr(self, name) > num_blocks:
                _fail(
                    owner, name, getattr(self, name),
                    f"at most the {num_blocks} blocks of a row are possible at this seq_len",
                )

    def _head_layout(self, head: int, num_blocks: int, rng: np.random.Generator) -> np.ndarray:
        causal = self.attention == "unidirectional"
        mask = _random_blocks(rng, num_blocks, self.num_random_blocks, causal=causal)
        mask |= _sliding_window(num_blocks, self.num_sliding_window_blocks // 2, causal=False)
        if self.num_global_blocks:
            spans = [(0, self.num_global_blocks)]
            mask |= _global_spans(num_blocks, spans, causal=False, horizontal=True)
        return np.tril(mask) if causal else mask


@dataclass(frozen=True, kw_only=True)
class BSLongformerSparsityConfig(SparsityConfig):
    """Block-sparse Longformer (Beltagy et al. 2020, arXiv:2004.05150), as DeepSpeed: a sliding
    window plus global blocks (`global_block_indices`, or ranges up to `global_block_end_indices`,
    exclusive) that attend and are attended both ways. Unidirectional keeps the lower triangle.
    """

    mode: ClassVar[str] = "bslongformer"
    different_layout_per_head: bool = False
    num_sliding_window_blocks: int = 3
    global_block_indices: Sequence[int] = (0,)
    global_block_end_indices: Sequence[int] | None = None
    attention: str = "bidirectional"

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        _check_int(owner, "num_sliding_window_blocks", self.num_sliding_window_blocks, minimum=0)
        _set_global_blocks(self)
        _check_attention(owner, self.attention)

    def _check_fits(self, num_blocks: int) -> None:
        _check_sliding_fits(self, num_blocks)

    def _head_layout(self, head: int, num_blocks: int, rng: np.random.Generator) -> np.ndarray:
        mask = _sliding_window(num_blocks, self.num_sliding_window_blocks // 2, causal=False)
        spans = _global_ranges(self, num_blocks)
        mask |= _global_spans(num_blocks, spans, causal=False, horizontal=True)
        return np.tril(mask) if self.attention == "unidirectional" else mask


@dataclass(frozen=True, kw_only=True)
class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """Purely local attention: block `i` attends to `i - w .. i` (unidirectional, the default)
    or `i - w .. i + w` (bidirectional), with `w = num_sliding_window_blocks // 2`.
    """

    mode: ClassVar[str] = "local"
    num_sliding_window_blocks: int = 3
    attention: str = "unidirectional"

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        _check_int(owner, "num_sliding_window_blocks", self.num_sliding_window_blocks, minimum=0)
        _check_attention(owner, self.attention)

    def _check_fits(self, num_blocks: int) -> None:
        _check_sliding_fits(self, num_blocks)

    def _head_layout(self, head: int, num_blocks: int, rng: np.random.Generator) -> np.ndarray:
        causal = self.attention == "unidirectional"
        return _sliding_window(num_blocks, self.num_sliding_window_blocks // 2, causal=causal)


#: Config class per DeepSpeed `sparse_attention.mode` (plus "local" for the sliding window).
SPARSITY_MODES: dict[str, type[SparsityConfig]] = {
    cls.mode: cls
    for cls in (
        DenseSparsityConfig,
        FixedSparsityConfig,
        VariableSparsityConfig,
        BigBirdSparsityConfig,
        BSLongformerSparsityConfig,
        LocalSlidingWindowSparsityConfig,
    )
}
DEFAULT_MODE = "fixed"  # DeepSpeed's default when `mode` is absent


def config_keys(mode: str) -> tuple[str, ...]:
    """Keys that `sparse_attention` accepts for a mode, besides `mode` itself."""
    return tuple(f.name for f in dataclasses.fields(SPARSITY_MODES[mode]) if f.name != "num_heads")


def sparsity_config_from_dict(
    d: Mapping[str, Any], *, num_heads: int, path: str = "sparse_attention"
) -> SparsityConfig:
    """Builds a config from DeepSpeed's `"sparse_attention": {"mode": "fixed", "block": 16, ...}`.

    Args:
      d: the block's contents; `mode` defaults to "fixed" (DeepSpeed's default); other keys are
        the config class's parameter names (plus `seed` for the random blocks).
      num_heads: attention heads of the model. A `num_heads` key in `d` must agree with it.
      path: where the block sits in the config, for error messages.

    Returns:
      The `SparsityConfig` subclass of the mode.

    Raises:
      ConfigError: unknown mode or key (the accepted ones are listed), or a bad value.
    """
    if not isinstance(d, Mapping):
        raise ConfigError(
            f"{path}: expected a mapping such as {{mode: fixed, block: 16}}, got {d!r}"
        )
    params = dict(d)
    mode = params.pop("mode", DEFAULT_MODE)
    if mode not in SPARSITY_MODES:
        raise ConfigError(f"{path}.mode: got {mode!r}; accepted values are {list(SPARSITY_MODES)}")
    if "num_heads" in params and params.pop("num_heads") != num_heads:
        raise ConfigError(
            f"{path}.num_heads: got {d['num_heads']!r}, but the model has {num_heads} heads; "
            f"leave it out or set it to {num_heads}"
        )
    accepted = config_keys(mode)
    for key in params:
        if key not in accepted:
            raise ConfigError(
                f"{path}.{key}: unknown key for mode {mode!r}{did_you_mean(key, accepted)}; "
                f"accepted keys are {['mode', *accepted]}"
            )
    try:
        return SPARSITY_MODES[mode](num_heads, **params)
    except ConfigError as err:
        raise ConfigError(f"{path} (mode {mode!r}): {err}") from None
