"""Checkpoints: everything a run writes to disk and reads back.

Owns Orbax train-state checkpoints (`state`: save, resume, restore onto another mesh or ZeRO
stage), params-only checkpoints (`params`: one `.npy` per array, for `checkpoint.load_from`),
the raw file writer both use (`direct_io`), consolidated exports (`export`) and Hugging Face
Llama, Mistral and Qwen2 folders in and out (`hf`).

May import: `config`, `runtime`, `models`, and (`export.load_trained`, which rebuilds a trained
run's engine) `train`. `state`, `params` and `direct_io` import nothing above `jaxspeed.errors`.
"""

from jaxspeed.checkpoint.state import Checkpointer, CheckpointError

__all__ = ["CheckpointError", "Checkpointer"]
