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
import math
from collections.abc import Callable, Iterator

from jaxspeed.config import Config, load_config
from jaxspeed.config.optimizer import ONEBIT_TYPES
from jaxspeed.config.sizes import resolve_batch
from jaxspeed.errors import ConfigError
from jaxspeed.runtime.mesh import CONFIG_AXES

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

    #: (axis, size) in `CONFIG_AXES` order: config keys, `data` the total degree
    mesh: tuple[tuple[str, int], ...]
    stage: int
    remat: str
    micro_batch: int  #: rows per data-parallel replica per micro-step
    accumulation: int
    schedule: str | None = None  #: pipeline schedule, when `pipe` > 1
    offload: str = "none"
    #: ZeRO++ (stage 3 across hosts): qwZ, qgZ, hpZ (`zero_optimization.zero_*`)
    quantized_weights: bool = False
    quantized_gradients: bool = False
    hpz: bool = False
    #: hosts the plan's `data` axis is split over (hpZ's partition is `data / hosts`)
    hosts: int = 1

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
        zeropp = [n for n, on in (("qwZ", self.quantized_weights), ("qgZ", self.quantized_gradients),
                                  ("hpZ", self.hpz)) if on]
        if zeropp:
            parts.append("+".join(zeropp))
        return " ".join(parts)

    def overrides(self) -> list[str]:
        """The config keys this plan sets, as `KEY.PATH=VALUE` (`--set` / `load_config`)."""
        out = [f"mesh.{axis}={size}" for axis, size in self.mesh]
        if self.hosts > 1 and self.sizes["data"] % self.hosts == 0:
            out.append(f"mesh.hosts={self.hosts}")  # one process compiles the hosts' mesh
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
        hosts = self.hosts if self.hpz else 1
        out += [
            f"zero_optimization.zero_quantized_weights={str(self.quantized_weights).lower()}",
            f"zero_optimization.zero_quantized_gradients={str(self.quantized_gradients).lower()}",
            f"zero_optimization.zero_hpz_partition_size={self.sizes['data'] // hosts if self.hpz else 1}",
        ]
        return out


def from_config(config: Config, mesh_shape: dict[str, int]) -> Candidate:
    """The plan `config` runs as given, on a mesh of `mesh_shape` (mesh axes, `host` included)."""
    from jaxspeed.zero.step import switches_of

    zero, hosts = config.zero_optimization, int(mesh_shape.get("host", 1))
    mesh = tuple((a, int(mesh_shape.get(a, 1)) * (hosts if a == "data" else 1)) for a in CONFIG_AXES)
    sw = switches_of(config.zero_optimization)
    offload = ("params" if zero.offload_param.device != "none"
               else "optimizer" if zero.offload_optimizer.device != "none" else "none")
    pipe, sizes = dict(mesh)["pipe"], dict(mesh)
    batch = resolve_batch(config, sizes["data"] * sizes["expert"])
    return Candidate(
        mesh, zero.stage, config.activation_checkpointing.policy,
        batch.micro_batch_per_device, batch.accumulation_steps,
        config.pipeline.schedule if pipe > 1 else None, offload,
        sw.quantized_weights, sw.gradient_bits is not None, sw.hpz, hosts,
    )


def apply(config: Config, candidate: Candidate) -> Config:
    """`config` with the plan's choices; everything else (model, data, optimizer) kept."""
    return load_config(config, overrides=candidate.overrides())


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


_Mesh = dict[str, int]


def _rules(config: Config, devices_per_host: int) -> list[tuple[str, Callable[[_Mesh], bool], str]]:
    """The rules a legal mesh keeps (see the module docstring), in the order `meshes` applies
    them: each as (its words, its test, the quantity it constrains)."""
    model = config.model
    heads, kv = model.n_heads, model.n_kv_heads or model.n_heads
    experts = model.moe.num_experts if model.moe else 1
    seq_len, batch = config.data.seq_len, config.train_batch_size
    onebit = config.optimizer.type in ONEBIT_TYPES

    def inner(m: _Mesh) -> int:
        return m["tensor"] * m["expert"] * m["sequence"]

    def sequence_ok(m: _Mesh) -> bool:
        return m["sequence"] == 1 or not (model.moe or onebit or seq_len % m["sequence"]
                                          or heads // m["tensor"] % m["sequence"])

    rules = [
        (f"tensor x expert x sequence must divide the {devices_per_host} devices per host",
         lambda m: devices_per_host % inner(m) == 0, "tensor x expert x sequence"),
        (f"tensor must divide n_heads={heads}, n_kv_heads={kv} and d_ff={model.d_ff}",
         lambda m: not (heads % m["tensor"] or kv % m["tensor"] or model.d_ff % m["tensor"]), "tensor"),
        (f"expert must divide moe.num_experts={experts}", lambda m: experts % m["expert"] == 0, "expert"),
        (f"sequence > 1 needs a dense model, no 1-bit Adam, and a sequence degree dividing "
         f"data.seq_len={seq_len} and n_heads / tensor", sequence_ok, "sequence"),
        (f"pipe must divide n_layers={model.n_layers}", lambda m: model.n_layers % m["pipe"] == 0, "pipe"),
        ("sequence and pipe cannot both be > 1", lambda m: m["sequence"] == 1 or m["pipe"] == 1, "sequence x pipe"),
    ]
    if batch is not None:
        rules.append((f"data x expert must divide train_batch_size={batch}",
                      lambda m: batch % (m["data"] * m["expert"]) == 0, "data x expert"))
    return rules


def _quantity(name: str, mesh: _Mesh) -> int:
    """`"data x expert"` of a mesh: the product of the named axes."""
    return math.prod(mesh[axis] for axis in name.split(" x "))


def _factorisations(config: Config, devices: int, devices_per_host: int) -> Iterator[_Mesh]:
    """Every mesh of `devices` whose inner axes each divide the devices per host (a dense model:
    `expert` = 1); `_rules` decides which are legal."""
    inners = _divisors(devices_per_host)
    for tensor, expert, sequence in itertools.product(inners, inners if config.model.moe else (1,), inners):
        inner = tensor * expert * sequence
        if devices % inner:
            continue
        for pipe in _divisors(devices // inner):
            data = devices // inner // pipe
            yield {"pipe": pipe, "data": data, "sequence": sequence, "expert": expert, "tensor": tensor}


def meshes(config: Config, devices: int, devices_per_host: int) -> Iterator[_Mesh]:
    """Every legal mesh for the model on `devices` (see the module docstring)."""
    rules = _rules(config, devices_per_host)
    for mesh in _factorisations(config, devices, devices_per_host):
        if all(ok(mesh) for _, ok, _ in rules):
            yield mesh


def why_no_plan(config: Config, devices: int, devices_per_host: int) -> str:
    """Why `candidates` yields nothing: the rule that removes the last meshes, what the meshes
    the other rules allow have instead, and which single rules, relaxed, would leave a plan."""
    rules = _rules(config, devices_per_host)
    left = list(_factorisations(config, devices, devices_per_host))
    for i, (words, ok, quantity) in enumerate(rules):
        kept = [m for m in left if ok(m)]
        if kept:
            left = kept
            continue
        values = sorted({_quantity(quantity, m) for m in left})
        relaxed = [w for j, (w, _, _) in enumerate(rules[:i]) if any(
            all(o(m) for k, (_, o, _) in enumerate(rules) if k != j)
            for m in _factorisations(config, devices, devices_per_host))]
        hint = f"; relaxing one of these would leave a mesh: {'; '.join(relaxed)}" if relaxed else ""
        return f"{words}, but every mesh the other rules allow has {quantity} in {values}{hint}"
    pipes = sorted({m["pipe"] for m in left})
    return (f"every legal mesh is a pipeline (pipe in {pipes}), and a pipeline needs at least as many "
            f"microbatches as stages: train_batch_size={config.train_batch_size} / (data x expert) "
            "must be >= pipe")


def candidates(config: Config, devices: int, devices_per_host: int) -> Iterator[Candidate]:
    """Every legal plan: each mesh x ZeRO stage x remat x batch split x schedule x offload."""
    if config.train_batch_size is None:
        raise ConfigError("plan --auto holds the global batch fixed: set train_batch_size")
    hosts = devices // devices_per_host
    for sizes in meshes(config, devices, devices_per_host):
        mesh = tuple((a, sizes[a]) for a in CONFIG_AXES)
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
                for qw, qg, hpz in zeropp_switches(sizes, hosts, stage, offload):
                    yield Candidate(mesh, stage, remat, micro, accumulation, schedule, offload,
                                    qw, qg, hpz, hosts)


def zeropp_switches(sizes: dict[str, int], hosts: int, stage: int,
                    offload: str) -> list[tuple[bool, bool, bool]]:
    """ZeRO++'s (qwZ, qgZ, hpZ) combinations worth searching: all of them for ZeRO-3 across
    hosts without offload (hpZ only where a host holds more than one of the data-parallel
    group), else none on."""
    if stage != 3 or offload != "none" or hosts < 2 or sizes["data"] % hosts:
        return [(False, False, False)]
    hpz = (False, True) if sizes["data"] // hosts > 1 else (False,)
    return list(itertools.product((False, True), (False, True), hpz))
