"""`jaxspeed tokenize | tokenizer train`: local text files to token files, and tokenizers.

This module owns the data commands: `tokenize` turns local .txt/.jsonl/.parquet files into
one token file with a `tokenizer.json`, and `tokenizer train` trains a byte-level BPE
tokenizer on such files.
"""

from __future__ import annotations

import json


def tokenize_command(args) -> int:
    """`jaxspeed tokenize`: tokenizes text files into one token file; prints a JSON summary."""
    from jaxspeed.data.text_tokens import tokenize_files

    result = tokenize_files(
        args.files, tokenizer_path=args.tokenizer, out=args.out, text_key=args.text_key,
        eos_id=args.eos_id, progress=not args.no_progress,
    )
    print(json.dumps(result))
    return 0


def tokenizer_command(args) -> int:
    """`jaxspeed tokenizer train`: trains a byte-level BPE; writes its tokenizer.json."""
    from jaxspeed.data.text_tokens import train_bpe

    path = train_bpe(args.files, vocab_size=args.vocab_size, out_dir=args.out, text_key=args.text_key)
    print(f"wrote {path}")
    return 0
