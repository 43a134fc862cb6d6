"""`load_trained`: a trained run's engine and state, rebuilt from its checkpoint on any devices.

The checkpoint's saved config describes the engine; the batch and the mesh it trained with do
not matter for reading the state back, so the mesh is rebuilt for the devices at hand.
"""

from __future__ import annotations

from pathlib import Path

import jax

from jaxspeed.checkpoint.export import checkpoint_directory, train_checkpoint
from jaxspeed.checkpoint.state import CheckpointError
from jaxspeed.config import load_config
from jaxspeed.runtime.mesh import make_mesh
from jaxspeed.train.engine import Engine, TrainState, initialize

#: The saved run's batch and mesh do not matter for reading its state: one row per replica...
ONE_ROW = [
    "train_batch_size=null", "train_micro_batch_size_per_device=1", "gradient_accumulation_steps=1",
]
#: ... on one device,
ONE_DEVICE = ["mesh.pipe=1", "mesh.data=1", "mesh.sequence=1", "mesh.expert=1", "mesh.tensor=1",
              "mesh.hosts=auto"]
#: ... or on several: no pipeline or sequence split, the rest of the devices on `data`.
SEVERAL_DEVICES = ["mesh.pipe=1", "mesh.sequence=1", "mesh.data=-1", "mesh.hosts=auto"]


def load_trained(checkpoint_dir: str | Path, *, step: int | None = None, devices=None,
                 overrides: list[str] | None = None) -> tuple[Engine, TrainState]:
    """The engine a checkpoint's saved config describes, on `devices`, and its state.

    The mesh is rebuilt for `devices` (default all): `pipe`, `sequence` and `data` are
    dropped to 1 and the rest of the devices fill `data`, unless `overrides` say otherwise
    (on one device, every axis is 1). Orbax reads each array straight into the new plan.
    For the params alone, `jaxspeed.checkpoint.export.read_params` reads less and builds no
    engine.

    Raises:
      CheckpointError: no complete checkpoint, or one saved without its config.
    """
    ckpt = train_checkpoint(checkpoint_directory(checkpoint_dir))
    meta = ckpt.read_meta(step)
    if "config" not in meta:
        raise CheckpointError(
            f"checkpoint in {ckpt.directory} has no saved config; restore it with the engine "
            "that wrote it (engine.restore)"
        )
    devices = list(devices) if devices is not None else jax.devices()
    mesh = ONE_DEVICE if len(devices) == 1 else SEVERAL_DEVICES
    config = load_config(meta["config"], overrides=[*mesh, *ONE_ROW, *(overrides or [])])
    engine = initialize(config, mesh=make_mesh(config.mesh, devices=devices))
    state, _ = ckpt.restore(engine.abstract_state(), step=step)
    return engine, state
