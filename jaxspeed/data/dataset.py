"""Byte-level token datasets from local text, loaded per process.

Tokens are bytes (vocab 256), so nothing needs a tokenizer or a download. The default corpus is
the Python standard library's own source. A batch is a pure function of (seed, split, step):
every process computes the same global batch and keeps its own rows, and a run resumed at step
s sees exactly the batches it would have seen.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from jaxspeed.errors import ConfigError, JaxspeedError

SOURCES = ("stdlib", "path")
SPLITS = ("train", "eval")
VOCAB_SIZE = 256
_SKIP_STDLIB_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)
_SEPARATOR = b"\n"


def _walk_sorted(root: str, *, skip_dir) -> Iterator[str]:
    """File paths under `root` in a deterministic (sorted, depth-first) order."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not skip_dir(d))
        for filename in sorted(filenames):
            yield os.path.join(dirpath, filename)


def _concat(chunks: Iterator[bytes], max_bytes: int | None) -> bytes:
    """Joins chunks with newlines, stopping once `max_bytes` is reached (then truncating)."""
    parts: list[bytes] = []
    total = 0
    for chunk in chunks:
        if parts:
            parts.append(_SEPARATOR)
            total += len(_SEPARATOR)
        parts.append(chunk)
        total += len(chunk)
        if max_bytes is not None and total >= max_bytes:
            break
    blob = b"".join(parts)
    return blob if max_bytes is None else blob[:max_bytes]


def _stdlib_chunks() -> Iterator[bytes]:
    root = sysconfig.get_paths()["stdlib"]
    for path in _walk_sorted(root, skip_dir=lambda d: d in _SKIP_STDLIB_DIRS):
        if path.endswith(".py"):
            with open(path, "rb") as f:
                yield f.read()


def _text_file_chunks(root: str) -> Iterator[bytes]:
    """Text files under a folder (hidden folders and `__pycache__` skipped; NUL byte = binary)."""
    skip = lambda d: d.startswith(".") or d == "__pycache__"  # noqa: E731
    for path in _walk_sorted(root, skip_dir=skip):
        if not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            data = f.read()
        if data and b"\0" not in data:
            yield data


def load_text_bytes(
    *, source: str = "stdlib", path: str | None = None, max_bytes: int | None = 16_000_000
) -> np.ndarray:
    """Loads a byte corpus, deterministic for a given interpreter / folder.

    Args:
      source: "stdlib" (the `.py` files of the running interpreter's standard library, without
        site-packages and test folders) or "path" (a text file, or every text file under a
        folder; binaries are recognised by a NUL byte and skipped).
      path: the file or folder, for `source="path"`.
      max_bytes: stop after this many bytes (None = no limit).

    Returns:
      uint8 `[num_bytes]`, files in sorted path order separated by a newline.

    Raises:
      ConfigError: for an unknown source, a missing `path`, or a non-positive `max_bytes`.
      JaxspeedError: when the path does not exist or holds no text.
    """
    if max_bytes is not None and max_bytes < 1:
        raise ConfigError(f"data.max_bytes: must be positive or null, got {max_bytes}")
    if source == "stdlib":
        blob = _concat(_stdlib_chunks(), max_bytes)
        where = f"the standard library at {sysconfig.get_paths()['stdlib']}"
    elif source == "path":
        if not path:
            raise ConfigError("data.path: required when data.source is 'path'")
        if not os.path.exists(path):
            raise JaxspeedError(f"data.path: {path!r} does not exist")
        if os.path.isdir(path):
            blob = _concat(_text_file_chunks(path), max_bytes)
        else:
            with open(path, "rb") as f:
                blob = f.read() if max_bytes is None else f.read(max_bytes)
        where = f"data.path {path!r}"
    else:
        raise ConfigError(f"data.source: got {source!r}; accepted values are {list(SOURCES)}")
    if not blob:
        raise JaxspeedError(f"no text found in {where}")
    return np.frombuffer(blob, dtype=np.uint8).copy()


class TokenDataset:
    """Train / held-out eval splits of a byte corpus, with deterministic random windows.

    The eval split is the last `eval_fraction` of the bytes (so it never overlaps training).
    """

    def __init__(
        self, tokens: np.ndarray, *, seq_len: int, eval_fraction: float = 0.05, seed: int = 0
    ):
        """Splits `tokens` (uint8/int `[num_tokens]`) into train and eval.

        Raises:
          ConfigError: for a bad `seq_len` / `eval_fraction`, or a split shorter than
            `seq_len + 1` tokens.
        """
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ConfigError(f"TokenDataset expects a 1-D token array, got shape {tokens.shape}")
        if seq_len < 1:
            raise ConfigError(f"data.seq_len: must be a positive integer, got {seq_len}")
        if not 0.0 <= eval_fraction < 1.0:
            raise ConfigError(f"data.eval_fraction: must be in [0, 1), got {eval_fraction}")
        if seed < 0:
            raise ConfigError(f"seed: must be ≥ 0, got {seed}")
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        num_eval = int(round(len(tokens) * eval_fraction))
        cut = len(tokens) - num_eval
        self._splits = {"train": tokens[:cut], "eval": tokens[cut:]}
        for split, data in self._splits.items():
            if split == "eval" and eval_fraction == 0.0:
                continue
            if len(data) < self.seq_len + 1:
                raise ConfigError(
                    f"data: the {split} split has {len(data)} tokens, fewer than "
                    f"seq_len + 1 = {self.seq_len + 1} (corpus of {len(tokens)} bytes, "
                    f"eval_fraction={eval_fraction}); use more data or a shorter data.seq_len"
                )

    @classmethod
    def from_config(cls, data_cfg: Any, *, seed: int) -> TokenDataset:
        """Loads the corpus named by a data config (`jaxspeed.config.DataConfig`: its `source`,
        `path`, `max_bytes`, `seq_len` and `eval_fraction`; the defaults are the config's)."""
        tokens = load_text_bytes(
            source=data_cfg.source, path=data_cfg.path, max_bytes=data_cfg.max_bytes
        )
        return cls(tokens, seq_len=data_cfg.seq_len, eval_fraction=data_cfg.eval_fraction,
                   seed=seed)

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    def num_tokens(self, split: str = "train") -> int:
        """Number of tokens in a split."""
        if split not in SPLITS:
            raise ValueError(f"split: got {split!r}; accepted values are {list(SPLITS)}")
        return len(self._splits[split])

    def _split(self, split: str) -> np.ndarray:
        if split not in SPLITS:
            raise ValueError(f"split: got {split!r}; accepted values are {list(SPLITS)}")
        data = self._splits[split]
        if len(data) < self.seq_len + 1:
            raise ConfigError(f"data: no {split} split (data.eval_fraction is 0)")
        return data

    def batch(
        self,
        step: int,
        *,
        global_batch: int,
        split: str = "train",
        process_index: int = 0,
        process_count: int = 1,
    ) -> dict[str, np.ndarray]:
        """This process's rows of the global batch for `step`.

        The global batch depends only on (seed, split, step): window offsets come from
        `np.random.default_rng([seed, split_id, step])`.

        Args:
          step: training step (≥ 0).
          global_batch: sequences in the global batch, divisible by `process_count`.
          split: "train" or "eval".
          process_index: this process (`jax.process_index()`).
          process_count: number of processes (`jax.process_count()`).

        Returns:
          `inputs` and `targets`, int32 `[global_batch // process_count, seq_len]`, rows
          `[process_index * local, (process_index + 1) * local)` of the global batch;
          `targets` is `inputs` shifted left by one token.
        """
        data = self._split(split)
        if step < 0:
            raise ValueError(f"step: must be ≥ 0, got {step}")
        if global_batch < 1 or process_count < 1:
            raise ValueError(
                f"global_batch ({global_batch}) and process_count ({process_count}) "
                "must be positive"
            )
        if global_batch % process_count:
            raise ValueError(
                f"global_batch={global_batch} is not divisible by process_count={process_count}"
            )
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index={process_index} not in [0, {process_count})")
        local = global_batch // process_count
        rng = np.random.default_rng([self.seed, SPLITS.index(split), step])
        starts = rng.integers(0, len(data) - self.seq_len, size=global_batch)
        starts = starts[process_index * local : (process_index + 1) * local]
        windows = data[starts[:, None] + np.arange(self.seq_len + 1)].astype(np.int32)
        return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


def make_global_batch(
    local_batch: Mapping[str, np.ndarray],
    sharding: jax.sharding.Sharding | Callable[[int], jax.sharding.Sharding],
    global_batch: int,
) -> dict[str, jax.Array]:
    """Assembles each process's rows into global arrays.

    Args:
      local_batch: name → `[global_batch // process_count, ...]` rows of this process.
      sharding: sharding of the global arrays (batch dimension first), or a function from
        an array's rank to its sharding, for batches whose entries differ in rank.
      global_batch: rows of the global batch.

    Returns:
      name → `jax.Array` of shape `[global_batch, ...]` with `sharding`.
    """
    sharding_for = sharding if callable(sharding) else lambda ndim: sharding
    return {
        name: jax.make_array_from_process_local_data(
            sharding_for(np.ndim(local)), np.asarray(local), (global_batch, *np.shape(local)[1:])
        )
        for name, local in local_batch.items()
    }
