"""The plans `plan --auto` chooses from: meshes, ZeRO stages, remat, batch split, schedules, offload.

A plan is legal when the engine would run it and it respects the cluster's shape:
- the mesh axes multiply to the cluster's device count;
- `tensor`, `expert` and `sequence` stay inside a host: their product divides the devices per
  host (the mesh is row-major with those axes innermost, so their groups are neighbours);
  `pipe` and `data` take the rest, across hosts;
- the model splits evenly: heads and key/value heads over `tensor` (and, for Ulysses, over
  `tensor` x `sequence`), layers over `pipe` (x virtual stages when interleaved), the sequence
  over `sequence`, experts over `expert` (a dense model keeps `expert` = 1, where it would
  only be a second name for `data`);
- the global batch is held fixed: micro-batch x accumulation x (data x expert) = the config's
  `train_batch_size`, and a pipeline's microbatches are its accumulation steps;
- the sequence axis is not combined with a pipeline, MoE or 1-bit Adam (the engine refuses
  them); optimizer offload needs ZeRO 1-3, parameter offload ZeRO-3.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

from jaxspeed.config import Config, load_config
from jaxspeed.errors import ConfigError
from jaxspeed.runtime.mesh import AXES

#: Remat policies searched (`jaxspeed.ops.remat`), least device memory last; `offload_dots` keeps
#: the projections' outputs in host memory.
REMAT = ("none", "dots_saveable", "dots_with_no_batch_dims_saveable", "offload_dots", "full")
SCHEDULES = ("1f1b", "interleaved", "gpipe")
#: What lives in host memory: nothing, the optimizer state (ZeRO-Offload), or the optimizer
#: state and the fp32 params (ZeRO-Infinity's CPU offload; ZeRO-3 only).
OFFLOAD = ("none", "optimizer", "params")
#: The state each `OFFLOAD` value puts in host memory (the engine's `opt_state` / `params`).
ON_HOST = {"none": (), "optimizer": ("opt_state",), "params": ("opt_state", "params")}


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One plan: the choices `plan --auto` makes, applied to a base config by `apply`."""

    mesh: tuple[tuple[str, int], ...]  #: (axis, size) in `AXES` order
    stage: int
    remat: str
    micro_batch: int  #: rows per data-parallel replica per micro-step
    accumulation: int
    schedule: str | None = None  #: pipeline schedule, when `pipe` > 1
    offload: str = "none"

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.mesh)

    def describe(self) -> str:
        mesh = " ".join(f"{a}{n}" for a, n in self.mesh if n > 1) or "1 device"
        parts = [mesh, f"zero{self.stage}", f"remat={self.remat}",
                 f"mb={self.micro_batch}x{self.accumulation}"]
        if self.schedule:
            parts.append(self.schedule)
        if self.offload != "none":
            parts.append(f"offload={self.offload}")
        return " ".join(parts)

    def overrides(self) -> list[str]:
        """The config keys this plan sets, as `KEY.PATH=VALUE` (`--set` / `load_config`)."""
        out = [f"mesh.{axis}={size}" for axis, size in self.mesh]
        out += [
            f"zero_optimization.stage={self.stage}",
            "zero_optimization.offload_optimizer.device="
            + ("cpu" if "opt_state" in ON_HOST[self.offload] else "none"),
            "zero_optimization.offload_param.device="
            + ("cpu" if "params" in ON_HOST[self.offload] else "none"),
            f"activation_checkpointing.policy={self.remat}",
            f"train_micro_batch_size_per_device={self.micro_batch}",
            f"gradient_accumulation_steps={self.accumulation}",
        ]
        if self.schedule:
            out += [f"pipeline.schedule={self.schedule}", f"pipeline.num_microbatches={self.accumulation}"]
        return out


def apply(config: Config, candidate: Candidate) -> Config:
    """`config` with the plan's choices; everything else (model, data, optimizer) kept."""
    return load_config(config, overrides=candidate.overrides())


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(config: Config, devices: int, devices_per_host: int) -> Iterator[dict[str, int]]:
    """Every legal mesh for the model on `devices` (see the module docstring)."""
    model = config.model
    heads, kv = model.n_heads, model.n_kv_heads or model.n_heads
    experts = model.moe.num_experts if model.moe else 1
    batch = config.train_batch_size
    onebit = config.optimizer.type == "OneBitAdam"
    for tensor, expert, sequence in itertools.product(_divisors(devices_per_host), repeat=3):
        inner = tensor * expert * sequence
        if devices_per_host % inner or devices % inner:
            continue
        if heads % tensor or kv % tensor or model.d_ff % tensor or experts % expert:
            continue
        if sequence > 1 and (model.moe or onebit or config.data.seq_len % sequence
                             or heads // tensor % sequence):
            continue
        for pipe in _divisors(devices // inner):
            data = devices // inner // pipe
            if model.n_layers % pipe or (sequence > 1 and pipe > 1):
                continue
            if batch is not None and batch % (data * expert):
                continue
            yield {"pipe": pipe, "data": data, "sequence": sequence, "expert": expert, "tensor": tensor}


def candidates(config: Config, devices: int, devices_per_host: int) -> Iterator[Candidate]:
    """Every legal plan: each mesh x ZeRO stage x remat x batch split x schedule x offload."""
    if config.train_batch_size is None:
        raise ConfigError("plan --auto holds the global batch fixed: set train_batch_size")
    for sizes in meshes(config, devices, devices_per_host):
        mesh = tuple((a, sizes[a]) for a in AXES)
        rows = config.train_batch_size // (sizes["data"] * sizes["expert"])
        for micro in _divisors(rows):
            accumulation = rows // micro
            schedules: tuple[str | None, ...] = (None,)
            if sizes["pipe"] > 1:
                if accumulation < sizes["pipe"]:
                    continue  # fewer microbatches than stages: most of the pipeline idles
                schedules = tuple(
                    s for s in SCHEDULES
                    if s != "interleaved" or (
                        config.model.n_layers % (sizes["pipe"] * config.pipeline.virtual_stages) == 0
                        and accumulation % sizes["pipe"] == 0)
                )
            for stage, remat, schedule, offload in itertools.product(range(4), REMAT, schedules, OFFLOAD):
                if offload == "optimizer" and stage == 0:
                    continue  # ZeRO-Offload partitions the state it moves (DeepSpeed: stage >= 1)
                if offload == "params" and stage != 3:
                    continue  # only sharded params are offloaded (DeepSpeed: stage 3)
                yield Candidate(mesh, stage, remat, micro, accumulation, schedule, offload)
