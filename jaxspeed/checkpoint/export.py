"""`jaxspeed export`: consolidated full-precision params from a checkpoint, for one device.

The equivalent of DeepSpeed's `zero_to_fp32`, without the offline conversion: the checkpoint is
restored onto a one-device mesh (Orbax gathers the shards) and the params are written with
Flax's msgpack serialization, loadable with `flax.serialization.msgpack_restore`.
"""

from __future__ import annotations

from pathlib import Path

import jax
from flax import serialization

from jaxspeed.checkpoint.state import Checkpointer, CheckpointError
from jaxspeed.config import load_config
from jaxspeed.train.engine import initialize
from jaxspeed.runtime.mesh import make_mesh

#: The saved run's batch and mesh do not matter for reading params: one row per replica...
_ONE_ROW = [
    "train_batch_size=null", "train_micro_batch_size_per_device=1", "gradient_accumulation_steps=1",
]
#: ... on one device,
_ONE_DEVICE = ["mesh.pipe=1", "mesh.data=1", "mesh.sequence=1", "mesh.expert=1", "mesh.tensor=1"]
#: ... or on several: no pipeline or sequence split, the rest of the devices on `data`.
_SEVERAL_DEVICES = ["mesh.pipe=1", "mesh.sequence=1", "mesh.data=-1"]


def export_params(checkpoint_dir: str | Path, out: str | Path, *, step: int | None = None) -> Path:
    """Writes the params of a `jaxspeed train` checkpoint as one msgpack file.

    Args:
      checkpoint_dir: the run's checkpoint directory (`OUTPUT/checkpoints`).
      out: the file to write (`.msgpack`); its folder is created.
      step: which checkpoint; default the newest complete one.

    Returns:
      The path written.
    """
    out = Path(out)
    if out.suffix != ".msgpack":
        raise CheckpointError(f"--out {out}: only .msgpack (Flax serialization) is supported")
    _, state = load_trained(checkpoint_dir, step=step, devices=jax.devices()[:1])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".msgpack.tmp")
    tmp.write_bytes(serialization.msgpack_serialize(jax.device_get(state.params)))
    tmp.replace(out)  # never leave a half-written file under the final name
    return out


def load_trained(checkpoint_dir: str | Path, *, step: int | None = None, devices=None,
                 overrides: list[str] | None = None):
    """The engine a checkpoint's saved config describes, on `devices`, and its state.

    The mesh is rebuilt for `devices` (default all): `pipe`, `sequence` and `data` are
    dropped to 1 and the rest of the devices fill `data`, unless `overrides` say otherwise
    (on one device, every axis is 1). Orbax reads each array straight into the new plan.
    """
    if not Path(checkpoint_dir).is_dir():
        raise CheckpointError(f"checkpoint directory {checkpoint_dir} does not exist")
    ckpt = Checkpointer(checkpoint_dir)
    if not ckpt.all_steps():
        raise CheckpointError(f"no complete checkpoint in {ckpt.directory}")
    meta = ckpt.read_meta(step)
    if "config" not in meta:
        raise CheckpointError(
            f"checkpoint in {ckpt.directory} has no saved config; restore it with the engine "
            "that wrote it (engine.restore)"
        )
    devices = list(devices) if devices is not None else jax.devices()
    mesh = _ONE_DEVICE if len(devices) == 1 else _SEVERAL_DEVICES
    config = load_config(meta["config"], overrides=[*mesh, *_ONE_ROW, *(overrides or [])])
    engine = initialize(config, mesh=make_mesh(config.mesh, devices=devices))
    state, _ = ckpt.restore(engine.abstract_state(), step=step)
    return engine, state
