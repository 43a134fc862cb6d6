"""Checkpoints: everything a run writes to disk and reads back.

Owns Orbax train-state checkpoints (`state`: save, resume, restore onto another mesh or ZeRO
stage), params-only checkpoints (`params`: one `.npy` per array, for `checkpoint.load_from`),
the raw file writer both use (`direct_io`), consolidated exports (`export`) and Hugging Face
Llama, Mistral and Qwen2 folders in and out (`hf`).

May import: `config`, `runtime`, `models`; `state`, `params` and `direct_io` import nothing above
`jaxspeed.errors`. Rebuilding a trained run's engine from its checkpoint is `train`'s
(`jaxspeed.train.trained.load_trained`).
"""

from jaxspeed.checkpoint.state import Checkpointer, CheckpointError

__all__ = ["CheckpointError", "Checkpointer"]
