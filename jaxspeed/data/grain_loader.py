"""Token-file datasets loaded by Grain: global shuffle, per-process rows, checkpointable order.

The global order does not depend on the number of processes. Rows (windows of the token
stream, see `TokenRows`) are shuffled globally by seed, epoch after epoch; global batch `s` is
rows `[s * B, (s + 1) * B)` of that order. Each process takes its own `B / P` consecutive rows
of each global batch, so it reads only those, and together the processes read exactly the rows
one process would. The iterator's Grain state, `{"next_index": s}`, counts global batches, so
it is the same on every process and resumes under another process count.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxspeed.data import text_tokens
from jaxspeed.errors import ConfigError, JaxspeedError
from jaxspeed.data.packing import make_example
from jaxspeed.data.token_files import TokenRows, open_token_file
from jaxspeed.runtime.progress import Progress

if TYPE_CHECKING:  # imported where used: byte-corpus runs never load Grain
    import grain

SPLITS = ("train", "eval")
_MAX_SCAN = 1 << 26  # tokens per chunk when scanning a token file for its largest id


def _largest_id(files: Sequence[np.ndarray], *, progress: bool = False) -> int:
    """The largest token id in `files`, read through once (minutes for billions of tokens:
    `progress` reports the tokens read, see `jaxspeed.runtime.progress`)."""
    largest = 0
    with Progress(sum(len(f) for f in files), desc="checking token ids", unit="token",
                  unit_scale=True, enabled=progress) as bar:
        for f in files:
            for i in range(0, len(f), _MAX_SCAN):
                chunk = f[i : i + _MAX_SCAN]
                largest = max(largest, int(chunk.max()))
                bar.update(len(chunk))
    return largest


class GrainTokenDataset:
    """Train / held-out eval rows of a token stream, served through Grain.

    The eval split is the last `eval_fraction` of the stream's tokens.
    """

    def __init__(
        self, files: Sequence[np.ndarray], *, seq_len: int, vocab_size: int, eos_id: int | None = None,
        packing: bool = False, eval_fraction: float = 0.05, seed: int = 0, workers: int = 2,
    ):
        """Rows of `seq_len + 1` tokens over the concatenation of `files` (1-D int arrays).

        Raises:
          ConfigError: for a bad argument, or a split with no whole row.
        """
        if seq_len < 1:
            raise ConfigError(f"data.seq_len: must be a positive integer, got {seq_len}")
        if not 0.0 <= eval_fraction < 1.0:
            raise ConfigError(f"data.eval_fraction: must be in [0, 1), got {eval_fraction}")
        if packing and eos_id is None:
            raise ConfigError("data.eos_id: packing needs the EOS token id")
        if not 0 <= seed < 2**32:
            raise ConfigError(f"seed: must be in [0, 2**32), got {seed}")
        self.seq_len, self.seed, self.eos_id, self.packing = int(seq_len), int(seed), eos_id, bool(packing)
        self.workers = int(workers)
        self._vocab_size = int(vocab_size)
        total = sum(len(f) for f in files)
        cut = total - int(round(total * eval_fraction))
        self._rows = {
            "train": TokenRows(files, seq_len=seq_len, stop=cut),
            "eval": TokenRows(files, seq_len=seq_len, start=cut),
        }
        for split, rows in self._rows.items():
            if len(rows) == 0 and not (split == "eval" and eval_fraction == 0.0):
                raise ConfigError(
                    f"data: the {split} split has fewer than seq_len + 1 = {seq_len + 1} tokens "
                    f"(stream of {total} tokens, eval_fraction={eval_fraction}); use more data or "
                    "a shorter data.seq_len"
                )

    @classmethod
    def from_config(cls, data_cfg: Any, *, seed: int, model_vocab_size: int, progress: bool = False):
        """The dataset of a `data` config with `source: tokens` or `source: text`.

        `text` files are tokenized once into `data.cache_dir` (default
        `~/.cache/jaxspeed/tokens`) and read from there afterwards.

        Raises:
          ConfigError / JaxspeedError: for missing files, a token file whose size does not
            divide by its dtype, or a vocabulary larger than `model_vocab_size`.
        """
        paths = data_cfg.files or ([data_cfg.path] if data_cfg.path else [])
        eos_id = data_cfg.eos_id
        if data_cfg.source == "tokens":
            names = text_tokens.expand_files(paths, suffixes=(".npy", ".bin"))
            files = [open_token_file(p, dtype=data_cfg.dtype) for p in names]
            vocab = _largest_id(files, progress=progress) + 1
            if vocab > model_vocab_size:
                raise ConfigError(
                    f"model.vocab_size={model_vocab_size} is too small for the token files "
                    f"(largest id {vocab - 1}); set model.vocab_size >= {vocab}"
                )
        elif data_cfg.source == "text":
            if not data_cfg.tokenizer:
                raise ConfigError("data.tokenizer: required when data.source is 'text'")
            names = text_tokens.expand_files(paths, suffixes=text_tokens.TEXT_SUFFIXES)
            tokenizer = text_tokens.load_tokenizer(data_cfg.tokenizer)
            vocab = text_tokens.check_vocab(tokenizer, model_vocab_size)
            eos_id = text_tokens.find_eos(tokenizer, eos_id)
            cached = text_tokens.cache_path(
                names, tokenizer_path=data_cfg.tokenizer, text_key=data_cfg.text_key, eos_id=eos_id,
                cache_dir=data_cfg.cache_dir or text_tokens.default_cache_dir(),
            )
            try:
                files = [open_token_file(cached)]
            except JaxspeedError:  # not cached yet
                text_tokens.tokenize_files(
                    names, tokenizer_path=data_cfg.tokenizer, out=cached, text_key=data_cfg.text_key,
                    eos_id=eos_id, progress=progress,
                )
                files = [open_token_file(cached)]
        else:
            raise ConfigError(f"data.source: {data_cfg.source!r} is not a Grain source; use tokens or text")
        return cls(
            files, seq_len=data_cfg.seq_len, vocab_size=vocab, eos_id=eos_id, packing=data_cfg.packing,
            eval_fraction=data_cfg.eval_fraction, seed=seed, workers=data_cfg.workers,
        )

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def num_rows(self, split: str = "train") -> int:
        """Rows (sequences) in one epoch of a split."""
        return len(self._rows[_check_split(split)])

    def local_batches(
        self, *, global_batch: int, split: str = "train", shard: grain.sharding.ShardOptions | None = None
    ) -> grain.MapDataset:
        """This process's rows of every global batch, as a Grain `MapDataset` (index = step).

        Args:
          global_batch: rows per global batch, divisible by `shard.shard_count`.
          split: "train" or "eval".
          shard: this process and the process count; default `grain.sharding.ShardByJaxProcess()`.

        Returns:
          infinite dataset whose element `s` is a dict of int32 `[global_batch // shard_count,
          seq_len]` arrays (`inputs`, `targets`, and with packing `segment_ids`, `positions`).
        """
        import grain

        shard = grain.sharding.ShardByJaxProcess() if shard is None else shard
        count, index = shard.shard_count, shard.shard_index
        if global_batch < 1 or global_batch % count:
            raise ValueError(f"global_batch={global_batch} is not a positive multiple of process_count={count}")
        if not 0 <= index < count:
            raise ValueError(f"process_index={index} not in [0, {count})")
        rows = self._rows[_check_split(split)]
        if len(rows) == 0:
            raise ConfigError(f"data: no {split} split (data.eval_fraction is 0)")
        local = global_batch // count
        # shuffle → repeat reshuffles each epoch; batch(local)[index::count] is this process's
        # slice of each global batch (global batch s = local batches s*count ... s*count+count-1).
        ds = grain.MapDataset.source(rows).shuffle(seed=self.seed).repeat()
        ds = ds.batch(local, drop_remainder=True)[index::count]
        return ds.map(functools.partial(make_example, eos_id=self.eos_id, packing=self.packing))

    def batch(
        self, step: int, *, global_batch: int, split: str = "train", process_index: int = 0,
        process_count: int = 1,
    ) -> dict[str, np.ndarray]:
        """This process's rows of global batch `step` (random access; same as the iterator's)."""
        if step < 0:
            raise ValueError(f"step: must be ≥ 0, got {step}")
        import grain

        shard = grain.sharding.ShardOptions(shard_index=process_index, shard_count=process_count)
        return self.local_batches(global_batch=global_batch, split=split, shard=shard)[step]

    def iterator(
        self, *, global_batch: int, shard: grain.sharding.ShardOptions | None = None,
        state: dict | None = None,
    ) -> grain.DatasetIterator:
        """A checkpointable iterator over this process's train batches, prefetched in threads.

        Args:
          global_batch: rows per global batch.
          shard: as in `local_batches`.
          state: `iterator.get_state()` saved earlier (by this or another process count).

        Returns:
          a Grain `DatasetIterator`; `get_state()` is JSON (`{"next_index": steps_taken}`).
        """
        import grain

        ds = self.local_batches(global_batch=global_batch, shard=shard)
        threads = max(1, self.workers)
        options = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=2 * threads)
        it = iter(ds.to_iter_dataset(options))
        if state is not None:
            it.set_state(state)
        return it


def _check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"split: got {split!r}; accepted values are {list(SPLITS)}")
    return split


def make_dataset(config: Any, *, progress: bool = False):
    """The dataset a run config names: `TokenDataset` (stdlib/path) or `GrainTokenDataset`."""
    if config.data.source in ("tokens", "text"):
        return GrainTokenDataset.from_config(
            config.data, seed=config.seed, model_vocab_size=config.model.vocab_size, progress=progress
        )
    from jaxspeed.data.dataset import TokenDataset

    return TokenDataset.from_config(config.data, seed=config.seed)
