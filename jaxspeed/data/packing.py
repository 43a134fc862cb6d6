"""Sequence packing: rows cut from an EOS-joined token stream, with per-token document info.

Documents are joined with an EOS token and the stream is cut into rows of `seq_len` (no
padding, nothing dropped). An EOS belongs to the document it ends; the next token starts a new
document. A row's first token starts a segment even when its document began in an earlier row.
"""

from __future__ import annotations

import numpy as np


def segment_ids_and_positions(inputs: np.ndarray, *, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Document ids and in-document positions of each input token.

    Args:
      inputs: int `[rows, seq_len]` tokens.
      eos_id: the token that ends a document.

    Returns:
      `(segment_ids, positions)`, int32 `[rows, seq_len]`: segment ids count documents within
      a row from 1 (0 is kept for padding, which packing never produces); positions restart at
      0 at the row start and after each EOS.
    """
    inputs = np.asarray(inputs)
    rows, seq_len = inputs.shape
    starts = np.zeros((rows, seq_len), dtype=bool)
    starts[:, 0] = True
    starts[:, 1:] = inputs[:, :-1] == eos_id
    segment_ids = np.cumsum(starts, axis=1, dtype=np.int32)
    index = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (rows, seq_len))
    last_start = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    return segment_ids, (index - last_start).astype(np.int32)


def make_example(rows: np.ndarray, *, eos_id: int | None, packing: bool) -> dict[str, np.ndarray]:
    """Model inputs from windows of `seq_len + 1` tokens.

    Args:
      rows: int `[rows, seq_len + 1]` windows.
      eos_id: the EOS token (needed when `packing`).
      packing: also return `segment_ids` and `positions`.

    Returns:
      `inputs` and `targets` (`targets` = `inputs` shifted left by one), and with `packing`
      `segment_ids` and `positions`; all int32 `[rows, seq_len]`.
    """
    rows = np.asarray(rows, dtype=np.int32)
    out = {"inputs": rows[:, :-1], "targets": rows[:, 1:]}
    if packing:
        if eos_id is None:
            raise ValueError("packing needs an eos_id")
        out["segment_ids"], out["positions"] = segment_ids_and_positions(out["inputs"], eos_id=eos_id)
    return out
