"""Typed jaxspeed config: schema, YAML/JSON loading, dotted overrides, DeepSpeed import.

Every section is a pydantic model with ``extra="forbid"``, so a misspelt key is an error that
names its key path and suggests the closest accepted key. Keys use DeepSpeed's names wherever
the concept is the same, and a DeepSpeed ``ds_config.json`` loads (see `from_deepspeed`).

Modules:

* `fields`: the strict field types and the base class of every section;
* `model`: `model:`, the reference GPT's architecture described once (`ModelConfig`), with
  `moe` and `sparse_attention` typed by the layers that use them;
* `optimizer`: `optimizer:` and `scheduler:`, one typed model per `type` (tagged unions);
* `precision`: `bf16:`, `fp16:` and `fp8:`, and the FP8 combinations that do not go together;
* `schema`: the other section models and `Config`;
* `units`: `parse_bytes` (`"80GiB"` → bytes);
* `sizes`: `resolve_batch` (the batch sizes a config and a data-parallel size imply);
* `deepspeed`: the DeepSpeed key tables and `from_deepspeed`;
* `deepspeed_auto`: DeepSpeed's (Hugging Face Trainer's) `"auto"` values, filled in;
* `loading`: `load_config`, `apply_overrides`, and the one-`ConfigError` error messages;
* `key_paths`: dotted key paths into nested dicts (used by `deepspeed` and `loading`);
* `cluster`: the cluster a plan is searched for and Muon and MoE price with (`Cluster`,
  `load_cluster`; the presets in `clusters/`), imported on its own, not from here.

`model` imports the attention and MoE modules whose options it types (to check them with
the layers' own rules); nothing in this package imports `models`, `train` or anything above.
"""

from jaxspeed.config.deepspeed import (
    DEEPSPEED_DEFAULT_ONLY,
    DEEPSPEED_FLAGS,
    DEEPSPEED_IGNORED,
    DEEPSPEED_RENAMED,
    DEEPSPEED_UNSUPPORTED,
    DEEPSPEED_UNSUPPORTED_VALUES,
    DeepSpeedOptionWarning,
    from_deepspeed,
)
from jaxspeed.config.deepspeed_auto import DEEPSPEED_AUTO_MEANS_UNSET, DeepSpeedAutoWarning
from jaxspeed.config.loading import DefaultSectionsWarning, apply_overrides, load_config
from jaxspeed.config.model import (
    AttentionConfig,
    ModelConfig,
    MoeConfig,
    RopeScalingConfig,
    SequenceParallelConfig,
    architecture_keys,
)
from jaxspeed.config.optimizer import (
    OPTIMIZER_TYPES,
    SCHEDULER_ALIASES,
    SCHEDULER_TYPES,
    OptimizerConfig,
    SchedulerConfig,
)
from jaxspeed.config.schema import (
    ActivationCheckpointingConfig,
    Bf16Config,
    CheckpointConfig,
    Config,
    DataConfig,
    Fp16Config,
    Fp8Config,
    HardwareConfig,
    LoggingConfig,
    MeshConfig,
    OffloadConfig,
    PipelineConfig,
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
    "DeepSpeedAutoWarning",
    "DeepSpeedOptionWarning",
    "DefaultSectionsWarning",
    "Fp16Config",
    "Fp8Config",
    "HardwareConfig",
    "LoggingConfig",
    "MeshConfig",
    "ModelConfig",
    "MoeConfig",
    "architecture_keys",
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
