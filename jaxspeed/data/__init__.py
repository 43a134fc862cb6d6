"""Token data: where the training batches come from.

Owns the byte-level datasets (`dataset`: the standard library's source, or local text), token
files (`token_files`), tokenizing text with a `tokenizer.json` (`text_tokens`), packing
documents into rows (`packing`) and the Grain pipeline over them (`grain_loader`).

May import: `jaxspeed.errors`, `jaxspeed.runtime.progress`. Nothing here knows about meshes, models or the train step.
"""

from jaxspeed.data.dataset import SOURCES, SPLITS, VOCAB_SIZE, TokenDataset, load_text_bytes, make_global_batch

__all__ = ["SOURCES", "SPLITS", "VOCAB_SIZE", "TokenDataset", "load_text_bytes", "make_global_batch"]
