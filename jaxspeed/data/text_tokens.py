"""Local text → token file, with a Hugging Face `tokenizers` tokenizer; and byte-level BPE training.

Documents: a `.txt` file is one document, a `.jsonl` line is one (its `text_key` field), a
`.parquet` row is one (its `text_key` column; needs `pyarrow`). A folder stands for its files
with those suffixes, in sorted order. Documents are batch-encoded (the Rust encoder runs the
batch on all cores) and each is followed by the EOS token.

Text files are read as UTF-8: a byte that is not UTF-8 stops the reading with a
`NotUtf8Error` naming the file, the byte and its offset, unless `errors="replace"` reads it as
U+FFFD. A corpus without a single character is refused rather than turned into EOS tokens
or a vocabulary of bytes alone.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence

import numpy as np

from jaxspeed.errors import ConfigError, JaxspeedError
from jaxspeed.data.token_files import token_dtype, write_token_file
from jaxspeed.runtime.progress import Progress

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
#: EOS spellings looked up in a tokenizer's vocabulary, in this order.
EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
_BATCH_CHARS = 4_000_000  # text per encode_batch call: big enough to keep every core busy
#: how bytes that are not UTF-8 are read: `strict` stops at the first, `replace` reads U+FFFD
TEXT_ERRORS = ("strict", "replace")


class NotUtf8Error(JaxspeedError, ValueError):
    """A text file holds a byte that is not UTF-8; the message names the file, byte and offset."""

    def __init__(self, path: str, *, offset: int, byte: int, reason: str, line: int | None = None):
        at = f"offset {offset}" + (f" (line {line})" if line is not None else "")
        super().__init__(f"{path}: not UTF-8: byte 0x{byte:02x} at {at}: {reason}")
        self.path, self.offset, self.byte = path, offset, byte


def decode_text(data: bytes, *, path: str, errors: str = "strict", offset: int = 0,
                line: int | None = None) -> str:
    """`data`, the bytes of `path` from byte `offset` on (its `line`, if one), as UTF-8 text.

    Raises:
      NotUtf8Error: with `errors="strict"`, at the first byte that is not UTF-8.
    """
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as err:
        raise NotUtf8Error(path, offset=offset + err.start, byte=data[err.start], reason=err.reason,
                           line=line) from None


def expand_files(paths: Sequence[str], *, suffixes: Sequence[str], key: str = "data.files") -> list[str]:
    """Files named by `paths`; a folder stands for its files with `suffixes`, sorted.

    Raises:
      JaxspeedError: for a missing path, or when nothing is found.
      ConfigError: for a file with another suffix.
    """
    if isinstance(paths, str):
        paths = [paths]
    files: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(
                os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(tuple(suffixes))
            )
            if not found:
                raise JaxspeedError(f"{key}: folder {path!r} has no {'/'.join(suffixes)} files")
            files += found
        elif not os.path.exists(path):
            raise JaxspeedError(f"{key}: {path!r} does not exist")
        elif not path.endswith(tuple(suffixes)):
            raise ConfigError(f"{key}: {path!r} has an unsupported suffix; accepted {list(suffixes)}")
        else:
            files.append(path)
    if not files:
        raise ConfigError(f"{key}: no files given")
    return files


def load_tokenizer(path: str):
    """Loads a `tokenizer.json` (a file, or a folder holding one)."""
    from tokenizers import Tokenizer

    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise JaxspeedError(f"data.tokenizer: {path!r} does not exist")
    try:
        return Tokenizer.from_file(path)
    except Exception as err:  # noqa: BLE001 - the Rust side raises plain Exception
        raise JaxspeedError(f"data.tokenizer: cannot load {path!r}: {err}") from err


def find_eos(tokenizer, eos_id: int | None = None) -> int:
    """The EOS id: `eos_id` if given, else the first of `EOS_TOKENS` in the vocabulary."""
    if eos_id is not None:
        return int(eos_id)
    for token in EOS_TOKENS:
        found = tokenizer.token_to_id(token)
        if found is not None:
            return int(found)
    raise ConfigError(f"data.eos_id: the tokenizer has none of {list(EOS_TOKENS)}; set data.eos_id")


def check_vocab(tokenizer, model_vocab_size: int) -> int:
    """The tokenizer's vocabulary size; a `ConfigError` when it exceeds `model.vocab_size`."""
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > model_vocab_size:
        raise ConfigError(
            f"model.vocab_size={model_vocab_size} is smaller than the tokenizer's vocabulary "
            f"({size}); set model.vocab_size >= {size}"
        )
    return size


def _check_errors(errors: str) -> None:
    if errors not in TEXT_ERRORS:
        raise ConfigError(f"errors: got {errors!r}; accepted {list(TEXT_ERRORS)}")


def read_documents(path: str, *, text_key: str = "text", errors: str = "strict") -> Iterator[str]:
    """The documents of one `.txt` / `.jsonl` / `.parquet` file, in order.

    Args:
      errors: `strict` raises `NotUtf8Error` at a byte that is not UTF-8; `replace` reads it
        as U+FFFD. (Parquet strings are UTF-8 already: Arrow checks them.)
    """
    _check_errors(errors)
    if path.endswith(".txt"):
        with open(path, "rb") as f:
            yield decode_text(f.read(), path=path, errors=errors)
    elif path.endswith(".jsonl"):
        with open(path, "rb") as f:
            offset = 0
            for number, raw in enumerate(f, 1):
                line = decode_text(raw, path=path, errors=errors, offset=offset, line=number)
                offset += len(raw)
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise JaxspeedError(f"{path}:{number}: not JSON: {err}") from err
                if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
                    raise JaxspeedError(f"{path}:{number}: no string field {text_key!r} (data.text_key)")
                yield record[text_key]
    elif path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError as err:
            raise JaxspeedError("reading .parquet needs pyarrow: pip install 'jaxspeed[parquet]'") from err
        table = pq.ParquetFile(path)
        if text_key not in table.schema_arrow.names:
            raise JaxspeedError(f"{path}: no column {text_key!r} (data.text_key); has {table.schema_arrow.names}")
        for batch in table.iter_batches(columns=[text_key]):
            yield from (t for t in batch.column(0).to_pylist() if t is not None)
    else:
        raise ConfigError(f"{path!r}: unsupported suffix; accepted {list(TEXT_SUFFIXES)}")


def _no_text(files: Sequence[str], what: str) -> JaxspeedError:
    named = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    return JaxspeedError(f"files: no text in {named}: nothing to {what}")


def _batches(files: Sequence[str], text_key: str, bar, errors: str) -> Iterator[list[str]]:
    batch, size, total = [], 0, 0
    for path in files:
        for text in read_documents(path, text_key=text_key, errors=errors):
            batch.append(text)
            size += len(text)
            if size >= _BATCH_CHARS:
                yield batch
                bar.update(size)
                total += size
                batch, size = [], 0
    if total + size == 0:  # else an empty corpus becomes one EOS token per empty document
        raise _no_text(files, "tokenize")
    if batch:
        yield batch
        bar.update(size)


def encode_files(
    files: Sequence[str], tokenizer, *, eos_id: int, text_key: str = "text", progress: bool = False,
    errors: str = "strict",
) -> Iterator[np.ndarray]:
    """Token chunks of `files`: each document's ids then `eos_id` (batch-encoded, in parallel).

    `progress` counts the characters read on stderr: a bar on a terminal, else a line every
    `JAXSPEED_PROGRESS_SECONDS` (`jaxspeed.runtime.progress`). `errors`: as `read_documents`.

    Raises:
      NotUtf8Error: see `read_documents`.
      JaxspeedError: when the files hold no text at all.
    """
    with Progress(None, desc="tokenize", unit="char", unit_scale=True, enabled=progress) as bar:
        for texts in _batches(files, text_key, bar, errors):
            encodings = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
            ids = [np.asarray(e.ids, dtype=np.int64) for e in encodings]
            eos = np.array([eos_id], dtype=np.int64)
            yield np.concatenate([piece for doc in ids for piece in (doc, eos)])


def tokenize_files(
    files: Sequence[str], *, tokenizer_path: str, out: str, text_key: str = "text",
    eos_id: int | None = None, progress: bool = False, errors: str = "strict",
) -> dict:
    """Tokenizes `files` into one token file `out` (`.npy`, or raw `.bin`).

    Args:
      errors: `strict` or `replace`, for bytes that are not UTF-8 (`read_documents`).

    Returns:
      `{"out", "tokens", "dtype", "eos_id", "vocab_size"}`.

    Raises:
      NotUtf8Error: with `errors="strict"`, naming the first such byte; `out` is not written.
      JaxspeedError: when the files hold no text; `out` is not written.
    """
    _check_errors(errors)
    files = expand_files(files, suffixes=TEXT_SUFFIXES, key="files")
    tokenizer = load_tokenizer(tokenizer_path)
    eos = find_eos(tokenizer, eos_id)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = token_dtype(vocab)
    chunks = encode_files(files, tokenizer, eos_id=eos, text_key=text_key, progress=progress,
                          errors=errors)
    total = write_token_file(out, chunks, dtype=dtype)
    return {"out": out, "tokens": total, "dtype": dtype.name, "eos_id": eos, "vocab_size": vocab}


def cache_path(files: Sequence[str], *, tokenizer_path: str, text_key: str, eos_id: int, cache_dir: str) -> str:
    """Where the token file of (files, tokenizer, text_key, eos_id) is cached.

    The key hashes the tokenizer file and each text file's absolute path, size and mtime, so an
    edited file is tokenized again.
    """
    if os.path.isdir(tokenizer_path):
        tokenizer_path = os.path.join(tokenizer_path, "tokenizer.json")
    digest = hashlib.sha256()
    with open(tokenizer_path, "rb") as f:
        digest.update(f.read())
    digest.update(json.dumps([text_key, eos_id]).encode())
    for path in files:
        stat = os.stat(path)
        digest.update(json.dumps([os.path.abspath(path), stat.st_size, stat.st_mtime_ns]).encode())
    return os.path.join(cache_dir, f"tokens-{digest.hexdigest()[:20]}.npy")


def default_cache_dir() -> str:
    """`$XDG_CACHE_HOME/jaxspeed/tokens` (default `~/.cache/jaxspeed/tokens`)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "jaxspeed", "tokens")


def train_bpe(files: Sequence[str], *, vocab_size: int, out_dir: str, text_key: str = "text",
              eos_token: str = "<|endoftext|>", progress: bool = False, errors: str = "strict") -> str:
    """Trains a byte-level BPE tokenizer (GPT-2 style) on local files.

    Args:
      files: `.txt` / `.jsonl` / `.parquet` files or folders.
      vocab_size: final vocabulary, including the 256 byte tokens and `eos_token`.
      out_dir: folder for `tokenizer.json`.
      errors: `strict` or `replace`, for bytes that are not UTF-8 (`read_documents`).

    Returns:
      the path of the written `tokenizer.json`.

    Raises:
      NotUtf8Error: with `errors="strict"`, naming the first such byte.
      JaxspeedError: when the files hold no text (nothing is written).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ConfigError(f"--vocab-size: got {vocab_size}; a byte-level BPE needs >= 257 (256 bytes + EOS)")
    _check_errors(errors)
    files = expand_files(files, suffixes=TEXT_SUFFIXES, key="files")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[eos_token], show_progress=progress,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    chars = 0

    def texts() -> Iterator[str]:
        nonlocal chars
        for path in files:
            for text in read_documents(path, text_key=text_key, errors=errors):
                chars += len(text)
                yield text

    tokenizer.train_from_iterator(texts(), trainer)
    if chars == 0:  # else the vocabulary is the 256 bytes and EOS, merging nothing
        raise _no_text(files, "train a tokenizer on")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "tokenizer.json")
    tokenizer.save(path)
    return path
