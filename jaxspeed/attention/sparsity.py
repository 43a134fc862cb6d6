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

from jaxspeed.attention.layout_masks import (
    global_spans,
    random_blocks,
    sliding_window,
    windows,
)
from jaxspeed.attention.sparsity_checks import (
    check_attention,
    check_bool,
    check_int,
    fail,
    global_ranges,
    int_tuple,
    set_global_blocks,
)
from jaxspeed.errors import ConfigError, did_you_mean


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
        check_int(owner, "num_heads", self.num_heads, minimum=1)
        check_int(owner, "block", self.block, minimum=1)
        if hasattr(self, "different_layout_per_head"):
            check_bool(owner, "different_layout_per_head", self.different_layout_per_head)

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
        check_int(owner, "seq_len", seq_len, minimum=1)
        if seq_len % self.block:
            fail(owner, "seq_len", seq_len, f"it must be divisible by block={self.block}")
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
        check_int(owner, "num_local_blocks", self.num_local_blocks, minimum=1)
        check_int(owner, "num_global_blocks", self.num_global_blocks, minimum=1)
        if self.num_local_blocks % self.num_global_blocks:
            fail(
                owner, "num_global_blocks", self.num_global_blocks,
                f"it must divide num_local_blocks={self.num_local_blocks}",
            )
        check_attention(owner, self.attention)
        check_bool(owner, "horizontal_global_attention", self.horizontal_global_attention)
        if self.horizontal_global_attention and self.attention != "bidirectional":
            fail(
                owner, "horizontal_global_attention", True,
                "it is only supported with attention='bidirectional'",
            )
        patterns = self.num_different_global_patterns
        check_int(owner, "num_different_global_patterns", patterns, minimum=1)
        if patterns > 1 and not self.different_layout_per_head:
            fail(
                owner, "num_different_global_patterns", patterns,
                "more than 1 needs different_layout_per_head=True",
            )
        most = self.num_local_blocks // self.num_global_blocks
        if patterns > most:
            fail(
                owner, "num_different_global_patterns", patterns,
                f"at most num_local_blocks // num_global_blocks = "
                f"{self.num_local_blocks} // {self.num_global_blocks} = {most} are possible",
            )

    def _head_layout(self, head: int, num_blocks: int, rng: np.random.Generator) -> np.ndarray:
        local, size = self.num_local_blocks, self.num_global_blocks
        causal = self.attention == "unidirectional"
        mask = windows(np.arange(num_blocks) // local, causal=causal)
        offset = local - (1 + head % self.num_different_global_patterns) * size
        full_end = num_blocks - num_blocks % local  # end of the last complete window
        spans = [(i, i + size) for i in range(offset, full_end, local)]
        if full_end < num_blocks:  # a short last window keeps `size` global blocks in range
            start = min(full_end + offset, num_blocks - size)
            spans.append((start, start + size))
        return mask | global_spans(
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
        check_int(owner, "num_random_blocks", self.num_random_blocks, minimum=0)
        windows = int_tuple(owner, "local_window_blocks", self.local_window_blocks, minimum=1)
        if not windows:
            fail(owner, "local_window_blocks", [], "expected at least one window size")
        object.__setattr__(self, "local_window_blocks", windows)
        set_global_blocks(self)
        check_attention(owner, self.attention)
        check_bool(owner, "horizontal_global_attention", self.horizontal_global_attention)
        if self.horizontal_global_attention and self.attention != "bidirectional":
            fail(
                owner, "horizontal_global_attention", True,
                "it is only supported with attention='bidirectional'",
            )
        check_int(owner, "seed", self.seed, minimum=0)

    def _check_fits(self, num_blocks: int) -> None:
        if self.num_random_blocks > num_blocks:
            fail(
                type(self).__name__, "num_random_blocks", self.num_random_blocks,
                f"at most the {num_blocks} blocks of a row are possible at this seq_len",
            )

    def _head_layout(self, head: int, num_blocks: int, rng: np.random.Generator) -> np.ndarray:
        causal = self.attention == "unidirectional"
        mask = random_blocks(rng, num_blocks, self.num_random_blocks, causal=False)
        last = self.local_window_blocks[-1]
        ends = np.cumsum(self.local_window_blocks)  # window ends; the last size then repeats
        ends = np.concatenate([ends, np.arange(ends[-1] + last, num_blocks + last, last)])
        window_ids = np.searchsorted(ends, np.arange(num_blocks), side="right")
        mask |= windows(window_ids, causal=causal)
        spans = global_ranges(self, num_blocks)
        return mask | global_spans(
            num_blocks, spans, causal=causal, horizontal=self.horizontal_global_attention
        )


def _check_sliding_fits(config: SparsityConfig, num_blocks: int) -> None:
    if config.num_sliding_window_blocks > num_blocks:
        fail(
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
        check_int(owner, "num_random_blocks", self.num_random_blocks, minimum=0)
        check_int(owner, "num_sliding_window_blocks", self.num_sliding_window_blocks, minimum=0)
        check_int(owner, "num_global_blocks", self.num_global_blocks, minimum=0)
        check_attention(owner, self.attention)
        check_int(owner, "seed", self.seed, minimum=0)

    def _check_fits(self, num_blocks: int) -> None:
        owner = type(self).__name__
        for name in ("num_random_blocks", "num_sliding_window_blocks", "num_global_blocks"):
            if getattr(self, name) > num_blocks:
                fail(
                    owner, name, getattr(self, name),
                    f"at most the {num_blocks} blocks of a row are possible at this seq_len",
                )

    def _head_layout(self, head: int, num_blocks: int, rng: np.random.Generator) -> np.ndarray:
        causal = self.attention == "unidirectional"
        mask = random_blocks(rng, num_blocks, self.num_random_blocks, causal=causal)
        mask |= sliding_window(num_blocks, self.num_sliding_window_blocks // 2, causal=False)
        if self.num_global_blocks:
            spans = [(0, self.num_global_blocks)]
            mask |= global_spans(num_blocks, spans, causal=False, horizontal=True)
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
        check_int(owner, "num_sliding_window_blocks", self.num_sliding_window_blocks, minimum=0)
        set_global_blocks(self)
        check_attention(owner, self.attention)

    def _check_fits(self, num_blocks: int) -> None:
        _check_sliding_fits(self, num_blocks)

    def _head_layout(self, head: int, num_blocks: int, rng: np.random.Generator) -> np.ndarray:
        mask = sliding_window(num_blocks, self.num_sliding_window_blocks // 2, causal=False)
        spans = global_ranges(self, num_blocks)
        mask |= global_spans(num_blocks, spans, causal=False, horizontal=True)
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
        check_int(owner, "num_sliding_window_blocks", self.num_sliding_window_blocks, minimum=0)
        check_attention(owner, self.attention)

    def _check_fits(self, num_blocks: int) -> None:
        _check_sliding_fits(self, num_blocks)

    def _head_layout(self, head: int, num_blocks: int, rng: np.random.Generator) -> np.ndarray:
        causal = self.attention == "unidirectional"
        return sliding_window(num_blocks, self.num_sliding_window_blocks // 2, causal=causal)


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
