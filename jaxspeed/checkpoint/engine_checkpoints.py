"""An engine's checkpoints (`Engine.save`, `restore`, `checkpointer`): one `Checkpointer` per
directory, saves that record the config, restores into the engine's shardings."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

from jaxspeed.checkpoint.state import Checkpointer
from jaxspeed.errors import ConfigError

if TYPE_CHECKING:
    from jaxspeed.config import Config


class EngineCheckpoints:
    """Checkpoints of one engine's train state.

    Args:
      config: the engine's config (`checkpoint.dir`, `keep`, `async`; saved in each record).
      abstract_state: the engine's state as `ShapeDtypeStruct`s with their shardings, which a
        restore reads each array into (so a checkpoint from another mesh, ZeRO stage or
        tensor-parallel degree restores in one call).
    """

    def __init__(self, config: Config, abstract_state: Callable[[], Any]):
        self._config = config
        self._abstract_state = abstract_state
        # one per directory: a save's background part is waited for by the one that started it
        self._open: dict[str, Checkpointer] = {}

    def checkpointer(self, directory: str | Path | None = None) -> Checkpointer:
        """The `Checkpointer` for `directory` (default `checkpoint.dir` of the config)."""
        directory = directory if directory is not None else self._config.checkpoint.dir
        if directory is None:
            raise ConfigError("no checkpoint directory: set checkpoint.dir or pass directory=")
        key = str(Path(directory).absolute())
        if key not in self._open:
            ckpt = self._config.checkpoint
            self._open[key] = Checkpointer(key, keep=ckpt.keep, async_save=ckpt.async_)
        return self._open[key]

    def save(self, state, *, directory=None, meta: dict | None = None) -> int:
        """Saves `state` with Orbax (atomic; async when `checkpoint.async`), recording its step,
        the config and `meta`. Returns the step."""
        meta = {"step": int(jax.device_get(state.step)), "config": self._config.to_dict(),
                **(meta or {})}
        return self.checkpointer(directory).save(state, meta=meta)

    def restore(self, *, directory=None, step: int | None = None):
        """The newest (or `step`) checkpoint, read into the engine's shardings."""
        state, _ = self.checkpointer(directory).restore(self._abstract_state(), step=step)
        return state
