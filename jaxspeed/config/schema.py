"""The config schema: one pydantic model per section, and `Config`, the whole run.

Every section has ``extra="forbid"``, so a misspelt key is an error (`load_config` turns it into
one `ConfigError` that names the key path and suggests the closest accepted key). Ints and bools
are strict: `true` is not 1 and "3" is not 3.

Data source rule: ``data.path`` given while ``data.source`` is missing or ``"stdlib"`` means
``source: path`` (so ``--set data.path=corpus.txt`` just works); ``source: path`` without a path
is an error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BeforeValidator,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from jaxspeed.config.fields import Bool as _Bool
from jaxspeed.config.fields import Int as _Int
from jaxspeed.config.fields import MeshSize as _MeshSize
from jaxspeed.config.fields import NonNegativeInt as _NonNegativeInt
from jaxspeed.config.fields import PositiveInt as _PositiveInt
from jaxspeed.config.fields import Section as _Section
from jaxspeed.config.fields import not_bool as _not_bool
from jaxspeed.config.fields import whole_number as _whole_number
from jaxspeed.config.cross_field import cross_field_errors
from jaxspeed.config.model import ModelConfig
from jaxspeed.config.optimizer import (
    AdamWConfig,
    ConstantConfig,
    OptimizerConfig,
    SchedulerConfig,
)
from jaxspeed.config.units import parse_bytes
from jaxspeed.config.precision import Bf16Config, Fp8Config, Fp16Config

#: Validation context key: False skips `Config`'s cross-field rules (`load_config` runs them
#: itself over the valid sections of an invalid config).
CROSS_FIELD = "cross_field"


def _hosts(value: Any) -> Any:
    if value == "auto" or (type(value) is int and value >= 1):
        return value
    raise ValueError(f"expected 'auto' or an int >= 1, got {value!r}")


class MeshConfig(_Section):
    """Device mesh axis sizes; `-1` (at most one axis) is filled from the device count."""

    #: hosts the `data` degree is split over (the mesh's outermost `host` axis gets `hosts`,
    #: its `data` axis `data // hosts`); `auto` = the process count when > 1 and it divides
    #: `data`, else 1. An int > 1 on one process emulates hosts on its devices.
    hosts: Annotated[Literal["auto"] | int, BeforeValidator(_hosts)] = "auto"
    pipe: _MeshSize = 1
    #: the TOTAL data-parallel degree, across hosts and within them
    data: _MeshSize = -1
    #: splits activations along the sequence (`model.sequence_parallel` says how attention
    #: crosses it); ZeRO shards state over it too
    sequence: _MeshSize = 1
    expert: _MeshSize = 1
    tensor: _MeshSize = 1

    @model_validator(mode="after")
    def _one_fill(self) -> MeshConfig:
        fill = [axis for axis, size in self.axis_sizes().items() if size == -1]
        if len(fill) > 1:
            raise ValueError(
                f"at most one axis may be -1 (filled from the device count), "
                f"got -1 for {', '.join(fill)}"
            )
        if self.hosts != "auto" and self.data != -1 and self.data % self.hosts:
            raise ValueError(
                f"hosts={self.hosts} must divide data={self.data} (the total data-parallel "
                f"degree); use a divisor of {self.data} or 'auto'"
            )
        return self

    def axis_sizes(self) -> dict[str, int]:
        """The axis sizes as written (`data` the total degree), without `hosts`."""
        return self.model_dump(exclude={"hosts"})


class OffloadConfig(_Section):
    """Where a ZeRO-sharded state lives between steps: `cpu` is XLA's `pinned_host` memory."""

    device: Literal["none", "cpu"] = "none"
    pin_memory: _Bool = True

    @field_validator("device", mode="before")
    @classmethod
    def _null_is_none(cls, value: Any) -> Any:
        return "none" if value is None else value


class OptimizerOffloadConfig(OffloadConfig):
    """Optimizer-state offload; `update_on: host` also runs the update on the host (CPU-Adam)."""

    update_on: Literal["device", "host"] = "device"

    @model_validator(mode="after")
    def _host_update_needs_offload(self) -> OptimizerOffloadConfig:
        if self.update_on == "host" and self.device != "cpu":
            raise ValueError("update_on 'host' needs device 'cpu' (the state must live on the host)")
        return self


class ZeroConfig(_Section):
    """ZeRO stage (0 = replicated, 1 = optimizer state, 2 = + grads, 3 = + params) and offload."""

    stage: Annotated[Literal[0, 1, 2, 3], BeforeValidator(_not_bool)] = 0
    #: Stage 3: when the model has at most this many parameters, the step gathers them all
    #: once (in the compute dtype) and keeps them for the forward pass, the recompute and the
    #: backward pass, instead of gathering each layer for each use. DeepSpeed's
    #: `stage3_max_live_parameters`, with its default. 0 = always gather layer by layer.
    max_live_parameters: Annotated[
        int, Field(strict=True, ge=0), BeforeValidator(_not_bool), BeforeValidator(_whole_number)
    ] = 1_000_000_000
    offload_optimizer: OptimizerOffloadConfig = Field(default_factory=OptimizerOffloadConfig)
    offload_param: OffloadConfig = Field(default_factory=OffloadConfig)
    #: How stage 3 gathers params and reduces gradients: `explicit` = `all_gather` /
    #: reduce-scatter written in the step (`jaxspeed.zero.collectives`), `compiler`
    #: = a sharding XLA partitions (on CPU: all-reduce + slice), `auto` = explicit where the
    #: mesh spans hosts or a ZeRO++ switch is on and it is supported (mesh.sequence 1),
    #: else compiler (`jaxspeed.zero.step.runs_explicit`).
    collectives: Literal["auto", "explicit", "compiler"] = "auto"
    #: ZeRO++ qwZ: weight all-gathers move int8 block-quantized values (dequantized after).
    zero_quantized_weights: _Bool = False
    #: ZeRO++ qgZ: gradients reduce-scatter as all-to-alls of block-quantized values
    #: (`quantized_gradient_bits`), inside the host first, then across hosts; summed in fp32.
    zero_quantized_gradients: _Bool = False
    #: ZeRO++ hpZ: 1 = off; else the ZeRO group within a host (mesh.data / mesh.hosts): a
    #: secondary copy of the params sharded within the host, gathered once per step.
    zero_hpz_partition_size: _PositiveInt = 1
    #: qgZ's bits per gradient value: 4 (packed two to a byte, ZeRO++'s choice) or 8.
    quantized_gradient_bits: Annotated[Literal[4, 8], BeforeValidator(_not_bool)] = 4
    #: Stage 3 with `fp8.enabled` (recipe tensorwise): the layers' weights are gathered at
    #: each use, already cast to FP8 (torchtitan's float8 all-gather): half bf16's bytes.
    fp8_all_gather: _Bool = False
    #: Elements per fp32 scale in qwZ / qgZ's block quantization (even).
    quantization_block_size: _PositiveInt = 256
    #: Stage 3 with explicit collectives: the most elements one full-precision gather or
    #: gradient reduce-scatter moves. The leaves gathered together (a layer's, or every leaf
    #: once a step) move in runs of whole leaves of at most this many elements, one buffer a
    #: run (a larger leaf alone, its reduce-scatter in pieces), so the step never holds a
    #: second copy of every gathered weight or every fp32 gradient at once. `auto`: 2**18
    #: (1 MiB of fp32) where the collectives run over gloo (CPU devices in several
    #: processes), whose reduce-scatter sends each peer its share as one message that a slow
    #: TCP link moves below its rate past about a MiB (`jaxspeed.network.gloo`); else 2**22
    #: (`jaxspeed.zero.step.RUN_BUCKET`).
    max_reduce_scatter_elements: _PositiveInt | Literal["auto"] = "auto"
    #: Stage 3 with explicit collectives: the order of ZeRO's shards over the hosts and the
    #: devices inside them. `data`: data-major (shard `d * hosts + h`); `host`: host-major,
    #: so a ring collective's neighbours are inside one host but at two edges. `auto`: host
    #: where the collectives run over gloo (whose rings follow the group's order), else data
    #: (NCCL picks its own rings) (`jaxspeed.zero.step.shard_order_is_host`).
    shard_order: Literal["auto", "data", "host"] = "auto"

    @model_validator(mode="after")
    def _param_offload_needs_stage3(self) -> ZeroConfig:
        if self.offload_param.device != "none" and self.stage != 3:
            raise ValueError(
                f"offload_param.device={self.offload_param.device!r} needs stage 3 (as in "
                f"DeepSpeed: only sharded params are offloaded), got stage {self.stage}"
            )
        return self

    @model_validator(mode="after")
    def _zeropp_needs_explicit_stage3(self) -> ZeroConfig:
        on = [key for key, value in (("zero_quantized_weights", self.zero_quantized_weights),
                                     ("zero_quantized_gradients", self.zero_quantized_gradients),
                                     ("zero_hpz_partition_size", self.zero_hpz_partition_size > 1))
              if value]
        if on and (self.stage != 3 or self.collectives == "compiler"):
            raise ValueError(
                f"{on[0]} (ZeRO++) needs stage 3 with collectives auto or explicit, got stage "
                f"{self.stage}, collectives {self.collectives!r}"
            )
        if self.quantization_block_size % 2:
            raise ValueError(
                f"quantization_block_size must be even, got {self.quantization_block_size}")
        return self


class ActivationCheckpointingConfig(_Section):
    """Rematerialisation policy (`jax.checkpoint_policies`); `names` goes with policy `names`."""

    policy: Literal[
        "none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable", "offload_dots", "names"
    ] = "none"
    names: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _names_match_policy(self) -> ActivationCheckpointingConfig:
        if self.policy == "names" and not self.names:
            raise ValueError("policy 'names' needs a non-empty list of names")
        if self.policy != "names" and self.names:
            raise ValueError(
                f"names are only used with policy 'names', but policy is {self.policy!r}"
            )
        return self


class PipelineConfig(_Section):
    """Pipeline schedule over the `pipe` mesh axis."""

    num_microbatches: _PositiveInt = 1
    schedule: Literal["gpipe", "1f1b", "interleaved"] = "1f1b"
    partition: Literal["uniform", "balanced"] = "uniform"
    #: stages per device with `schedule: interleaved` (ignored by the other schedules)
    virtual_stages: _PositiveInt = 2


def _one_or_many(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


class DataConfig(_Section):
    """Token data: the standard library's source bytes, or a local file/folder at `path`;
    or (through Grain) pre-tokenized token files (`source: tokens`) or local text tokenized
    with a `tokenizer.json` (`source: text`), both read from `files` (or `path`)."""

    source: Literal["stdlib", "path", "tokens", "text"] = "stdlib"
    path: str | None = None
    seq_len: _PositiveInt = 256
    eval_fraction: Annotated[float, Field(strict=True, gt=0, lt=1)] = 0.05
    max_bytes: _PositiveInt | None = 16_000_000
    #: tokens: `.npy` / `.bin` token files; text: `.txt` / `.jsonl` / `.parquet` (folders expand)
    files: Annotated[list[str], BeforeValidator(_one_or_many)] | None = None
    #: element type of raw `.bin` token files
    dtype: Literal["uint16", "uint32"] | None = None
    #: `tokenizer.json` (or its folder) for `source: text`
    tokenizer: str | None = None
    #: the text field of `.jsonl` records / the `.parquet` column
    text_key: str = "text"
    #: also yield per-token `segment_ids` and `positions` (documents split at EOS)
    packing: _Bool = False
    #: the EOS token joining documents (text: default the tokenizer's `<|endoftext|>` or `</s>`)
    eos_id: _NonNegativeInt | None = None
    #: where `source: text` caches its token file (default `~/.cache/jaxspeed/tokens`)
    cache_dir: str | None = None
    #: Grain read threads that prefetch batches
    workers: _PositiveInt = 2

    @model_validator(mode="before")
    @classmethod
    def _path_means_source_path(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and data.get("path") is not None:
            if data.get("source", "stdlib") == "stdlib":
                return {**data, "source": "path"}
        return data

    @model_validator(mode="after")
    def _path_given(self) -> DataConfig:
        if self.source == "path" and not self.path:
            raise ValueError("source is 'path' but no path is given")
        grain_source = self.source in ("tokens", "text")
        if grain_source and not (self.files or self.path):
            raise ValueError(f"source is {self.source!r} but neither files nor path is given")
        if self.source == "text" and not self.tokenizer:
            raise ValueError("source is 'text' but no tokenizer (a tokenizer.json) is given")
        if self.packing and not grain_source:
            raise ValueError(f"packing needs source 'tokens' or 'text', got {self.source!r}")
        if self.packing and self.source == "tokens" and self.eos_id is None:
            raise ValueError("packing with source 'tokens' needs eos_id (the token joining documents)")
        raw = [f for f in (self.files or [self.path or ""]) if f.endswith(".bin")]
        if self.source == "tokens" and raw and self.dtype is None:
            raise ValueError(f"raw token file {raw[0]!r} needs dtype: uint16 or uint32")
        return self


class CheckpointConfig(_Section):
    """Orbax checkpoints: directory, cadence, how many to keep, and when a run may resume.

    A run saves at its end, every `every_n_steps` steps (0 = not by steps) and every
    `every_n_minutes` minutes of training (0 = not by time), so a crash loses at most that much.
    """

    dir: str | None = None
    every_n_steps: _NonNegativeInt = 0
    #: wall-clock cadence; every process saves the same step (the first process due decides)
    every_n_minutes: Annotated[float, Field(strict=True, ge=0)] = 30.0
    #: `auto`: resume the checkpoints in `dir` only when they were saved with this config
    #: (apart from the keys a resume may change, `jaxspeed.train.resume.RESUMABLE`);
    #: `force`: resume whenever the shapes fit
    resume: Literal["auto", "force"] = "auto"
    keep: _PositiveInt = 3
    async_: _Bool = Field(True, alias="async")
    #: a params checkpoint (`jaxspeed import-hf`) to start from at step 0 with a fresh
    #: optimizer, when `dir` has no checkpoint yet
    load_from: str | None = None


class LoggingConfig(_Section):
    """Metric logging cadence (`eval_every_n_steps` 0 = no evaluation), TensorBoard, and
    samples of the model's text (`sample_every_n_steps`)."""

    every_n_steps: _PositiveInt = 10
    eval_every_n_steps: _NonNegativeInt = 0
    eval_batches: _PositiveInt = 2
    tensorboard: _Bool = False
    #: print a greedy continuation of `sample_prompt` every N steps (0 = never); text through
    #: `data.tokenizer`, else bytes
    sample_every_n_steps: _NonNegativeInt = 0
    sample_prompt: str = "def "
    sample_tokens: _PositiveInt = 48


class HardwareConfig(_Section):
    """Facts about the accelerator; `device_memory` is kept as given (see `parse_bytes`).

    `peak_tflops` is one device's peak (dense, compute dtype) for MFU; default: a table of
    known accelerators (`jaxspeed.cost.peaks.PEAK_FLOPS`).
    """

    device_memory: str | int | None = None
    peak_tflops: Annotated[float, Field(strict=True, gt=0)] | None = None

    @field_validator("device_memory", mode="before")
    @classmethod
    def _check_bytes(cls, value: Any) -> Any:
        if value is not None:
            parse_bytes(value)
        return value

    @property
    def device_memory_bytes(self) -> int | None:
        """`device_memory` in bytes, or None when not given."""
        return None if self.device_memory is None else parse_bytes(self.device_memory)


class Config(_Section):
    """A whole jaxspeed run. Load with `load_config`; save with `to_dict`."""

    mesh: MeshConfig = Field(default_factory=MeshConfig)
    train_batch_size: _PositiveInt | None = None
    train_micro_batch_size_per_device: _PositiveInt | None = Field(
        None,
        validation_alias=AliasChoices(
            "train_micro_batch_size_per_device", "train_micro_batch_size_per_gpu"
        ),
    )
    gradient_accumulation_steps: _PositiveInt | None = None
    gradient_clipping: Annotated[float, Field(strict=True, ge=0)] = 0.0
    bf16: Bf16Config = Field(default_factory=Bf16Config)
    fp16: Fp16Config = Field(default_factory=Fp16Config)
    fp8: Fp8Config = Field(default_factory=Fp8Config)
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    optimizer: OptimizerConfig = Field(default_factory=AdamWConfig)
    scheduler: SchedulerConfig = Field(default_factory=ConstantConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig
    )
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    hardware: HardwareConfig = Field(default_factory=HardwareConfig)
    steps: _PositiveInt = 1000
    seed: _Int = 0

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> Config:
        if not (info.context or {}).get(CROSS_FIELD, True):
            return self
        errors = cross_field_errors(self)
        if errors:
            raise ValueError("; ".join(errors))
        return self

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict with the config's own key names; `load_config` of it is equal."""
        return self.model_dump(by_alias=True, mode="json")
