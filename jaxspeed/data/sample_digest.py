"""A digest of the samples a run trained on, in order: two runs with equal digests saw the same
global batches, step by step, however many processes or devices they ran on.

Each step's global batch has a 64-bit fingerprint: the sum, modulo 2**64, over its rows of a
hash of the row's index in the global batch and its arrays' bytes. A sum does not depend on
which process holds which rows, so each process sums its own rows and the processes add their
sums. The digest chains the steps: `digest = H(digest, step, fingerprint)`, from `START`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np

#: The digest of a run before its first step (16 hex digits, as every digest).
START = "0" * 16
_MASK = (1 << 64) - 1


def _row_hash(global_index: int, row_arrays: list[np.ndarray]) -> int:
    """A row's 64-bit hash: its index in the global batch, then each array's bytes."""
    h = hashlib.blake2b(global_index.to_bytes(8, "little"), digest_size=8)
    for row in row_arrays:
        h.update(np.ascontiguousarray(row).tobytes())
    return int.from_bytes(h.digest(), "little")


def batch_fingerprint(batch: Mapping[str, np.ndarray], *, first_row: int) -> int:
    """This process's share of a global batch's fingerprint.

    Args:
      batch: this process's rows (`inputs`, `targets`, ...: arrays `[rows, seq_len]`).
      first_row: the index of its first row in the global batch.

    Returns:
      the sum of its rows' hashes, modulo 2**64; the processes' shares add up (modulo 2**64)
      to the global batch's fingerprint.
    """
    arrays = [np.asarray(batch[key]) for key in sorted(batch)]
    # the row's global index is hashed with it, so reordered rows change the fingerprint
    total = sum(_row_hash(first_row + i, [a[i] for a in arrays]) for i in range(len(arrays[0])))
    return total & _MASK


def chained(digest: str, step: int, fingerprint: int) -> str:
    """The digest after step `step` (1-based: steps done) whose global batch has `fingerprint`."""
    h = hashlib.blake2b(bytes.fromhex(digest), digest_size=8)
    h.update(step.to_bytes(8, "little"))
    h.update((fingerprint & _MASK).to_bytes(8, "little"))
    return h.hexdigest()
