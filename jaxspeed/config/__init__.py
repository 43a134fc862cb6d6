"""Typed jaxspeed config: schema, YAML/JSON loading, dotted overrides, DeepSpeed import.

Every section is a pydantic model with ``extra="forbid"``, so a misspelt key is an error that
names its key path and suggests the closest accepted key. Keys use DeepSpeed's names wherever
the concept is the same, and a DeepSpeed ``ds_config.json`` loads (see `from_deepspeed`).

Modules:

* `schema`: the section models and `Config`, the optimizer/scheduler type names;
* `units`: `parse_bytes` (`"80GiB"` → bytes);
* `sizes`: `resolve_batch` (the batch sizes a config and a data-parallel size imply);
* `deepspeed`: the DeepSpeed key tables and `from_deepspeed`;
* `loading`: `load_config`, `apply_overrides`, and the one-`ConfigError` error messages;
* `key_paths`: dotted key paths into nested dicts (used by `deepspeed` and `loading`).

This package imports neither jax nor flax.
"""

from jaxspeed.config.deepspeed import (
    DEEPSPEED_AUTO_MEANS_UNSET,
    DEEPSPEED_DEFAULT_ONLY,
    DEEPSPEED_FLAGS,
    DEEPSPEED_IGNORED,
    DEEPSPEED_RENAMED,
    DEEPSPEED_UNSUPPORTED,
    DEEPSPEED_UNSUPPORTED_VALUES,
    DeepSpeedOptionWarning,
    from_deepspeed,
)
from jaxspeed.config.loading import apply_overrides, load_config
from jaxspeed.config.schema import (
    OPTIMIZER_TYPES,
    SCHEDULER_ALIASES,
    SCHEDULER_TYPES,
    ActivationCheckpointingConfig,
    AttentionConfig,
    SequenceParallelConfig,
    RopeScalingConfig,
    Bf16Config,
    CheckpointConfig,
    Config,
    DataConfig,
    Fp16Config,
    HardwareConfig,
    LoggingConfig,
    MeshConfig,
    ModelConfig,
    OffloadConfig,
    OptimizerConfig,
    PipelineConfig,
    SchedulerConfig,
    ZeroConfig,
)
from jaxspeed.config.sizes import BatchSizes, resolve_batch
from jaxspeed.config.units import parse_bytes

__all__ = [
    "DEEPSPEED_AUTO_MEANS_UNSET",
    "DEEPSPEED_DEFAULT_ONLY",
    "DEEPSPEED_FLAGS",
    "DEEPSPEED_IGNORED",
    "DEEPSPEED_RENAMED",
    "DEEPSPEED_UNSUPPORTED",
    "DEEPSPEED_UNSUPPORTED_VALUES",
    "OPTIMIZER_TYPES",
    "SCHEDULER_ALIASES",
    "SCHEDULER_TYPES",
    "ActivationCheckpointingConfig",
    "AttentionConfig",
    "SequenceParallelConfig",
    "RopeScalingConfig",
    "BatchSizes",
    "Bf16Config",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "DeepSpeedOptionWarning",
    "Fp16Config",
    "HardwareConfig",
    "LoggingConfig",
    "MeshConfig",
    "ModelConfig",
    "OffloadConfig",
    "OptimizerConfig",
    "PipelineConfig",
    "SchedulerConfig",
    "ZeroConfig",
    "apply_overrides",
    "from_deepspeed",
    "load_config",
    "parse_bytes",
    "resolve_batch",
]
