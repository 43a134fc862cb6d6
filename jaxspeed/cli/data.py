"""`jaxspeed tokenize | tokenizer train`: local text files to token files, and tokenizers.

This module owns the data commands: `tokenize` turns local .txt/.jsonl/.parquet files into
one token file with a `tokenizer.json`, and `tokenizer train` trains a byte-level BPE
tokenizer on such files. Both read UTF-8 and stop at the first byte that is not, naming it
and the flag that reads it as U+FFFD instead (`--errors replace`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

from jaxspeed.errors import JaxspeedError


@contextlib.contextmanager
def _errors_flag_hint() -> Iterator[None]:
    """A `NotUtf8Error`, with the flag that reads such bytes, as one `JaxspeedError` line."""
    from jaxspeed.data.text_tokens import NotUtf8Error

    try:
        yield
    except NotUtf8Error as err:
        raise JaxspeedError(f"{err}; --errors replace reads such bytes as U+FFFD") from err


def tokenize_command(args) -> int:
    """`jaxspeed tokenize`: tokenizes text files into one token file; prints a JSON summary."""
    from jaxspeed.data.text_tokens import tokenize_files

    with _errors_flag_hint():
        result = tokenize_files(
            args.files, tokenizer_path=args.tokenizer, out=args.out, text_key=args.text_key,
            eos_id=args.eos_id, progress=not args.no_progress, errors=args.errors,
        )
    print(json.dumps(result))
    return 0


def tokenizer_command(args) -> int:
    """`jaxspeed tokenizer train`: trains a byte-level BPE; writes its tokenizer.json."""
    from jaxspeed.data.text_tokens import train_bpe

    with _errors_flag_hint():
        path = train_bpe(args.files, vocab_size=args.vocab_size, out_dir=args.out,
                         text_key=args.text_key, errors=args.errors)
    print(f"wrote {path}")
    return 0
