"""DeepSpeed import: translates a ``ds_config.json`` into jaxspeed's keys before validation.

Keys use DeepSpeed's names wherever the concept is the same. `from_deepspeed` runs on every input
before validation (a jaxspeed config passes unchanged) and

* moves keys that jaxspeed names or places differently (`DEEPSPEED_RENAMED`, `DEEPSPEED_FLAGS`);
* drops performance knobs that XLA makes moot, with one warning (`DEEPSPEED_IGNORED`);
* collects every DeepSpeed feature jaxspeed does not implement into one `ConfigError`
  (`DEEPSPEED_UNSUPPORTED`, `DEEPSPEED_UNSUPPORTED_VALUES`, `DEEPSPEED_DEFAULT_ONLY`);
  `load_config` lists them with the config's other errors, in one message.

Hugging Face's `"auto"` values are filled in after the translation (`deepspeed_auto`).

A DeepSpeed section that says ``enabled: false`` is dropped silently, whatever table it is in.
Keys in the tables are dotted paths from the config root.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from jaxspeed.config.key_paths import _MISSING, Problem, _insert, _lookup, _plain, _remove
from jaxspeed.errors import ConfigError

#: DeepSpeed key → jaxspeed key with the same meaning (a whole subtree moves).
DEEPSPEED_RENAMED: Mapping[str, str] = types.MappingProxyType(
    {
        "train_micro_batch_size_per_gpu": "train_micro_batch_size_per_device",
        "steps_per_print": "logging.every_n_steps",
        "bfloat16": "bf16",
        "sparse_attention": "model.sparse_attention",
        "tensorboard.enabled": "logging.tensorboard",
        "zero_optimization.stage3_max_live_parameters": "zero_optimization.max_live_parameters",
    }
)
#: DeepSpeed flag → (jaxspeed key, value set when the flag is true). A key already set (by the
#: config or by an earlier flag in this table) is kept; a false flag is dropped.
DEEPSPEED_FLAGS: Mapping[str, tuple[str, Any]] = types.MappingProxyType(
    {
        "activation_checkpointing.cpu_checkpointing":
            ("activation_checkpointing.policy", "offload_dots"),
        "activation_checkpointing.partition_activations":
            ("activation_checkpointing.policy", "full"),
        "zero_optimization.cpu_offload":
            ("zero_optimization.offload_optimizer.device", "cpu"),
        "zero_optimization.cpu_offload_params":
            ("zero_optimization.offload_param.device", "cpu"),
    }
)  # fmt: skip
_OFFLOAD_KNOBS = ("buffer_count", "buffer_size", "max_in_cpu", "pipeline_read", "pipeline_write",
                  "fast_init", "nvme_path")  # fmt: skip
#: Performance and diagnostics knobs that XLA makes moot: dropped with one warning.
DEEPSPEED_IGNORED: frozenset[str] = frozenset(
    {
        "wall_clock_breakdown", "memory_breakdown", "dump_state", "flops_profiler",
        "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "disable_allgather",
        "fp16.auto_cast", "bf16.immediate_grad_accumulation", "optimizer.legacy_fusion",
        "tensorboard.output_path", "tensorboard.job_name",
        "checkpoint.tag_validation", "checkpoint.load_universal",
        "checkpoint.use_node_local_storage", "checkpoint.parallel_write",
        "activation_checkpointing.contiguous_memory_optimization",
        "activation_checkpointing.number_checkpoints",
        "activation_checkpointing.synchronize_checkpoint_boundary",
        "activation_checkpointing.profile",
        *(f"zero_optimization.{key}" for key in (
            "overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size",
            "reduce_scatter", "allgather_partitions", "stage3_prefetch_bucket_size",
            "stage3_param_persistence_threshold",
            "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
            "stage3_gather_fp16_weights_on_model_save", "stage3_module_granularity_threshold",
            "sub_group_size", "round_robin_gradients", "elastic_checkpoint",
            "ignore_unused_parameters", "load_from_fp32_weights", "memory_efficient_linear",
            "use_multi_rank_bucket_allreduce", "log_trace_cache_warnings",
        )),
        *(f"zero_optimization.{part}.{key}"
          for part in ("offload_optimizer", "offload_param") for key in _OFFLOAD_KNOBS),
    }
)  # fmt: skip
#: DeepSpeed features jaxspeed does not implement (an error unless the section is disabled).
DEEPSPEED_UNSUPPORTED: frozenset[str] = frozenset(
    {
        "amp", "compression_training", "curriculum_learning", "data_efficiency", "elasticity",
        "autotuning", "nebula", "aio", "comms_logger", "wandb", "csv_monitor", "comet",
        "quantize_training", "weight_quantization", "eigenvalue", "progressive_layer_drop",
        "hybrid_engine",
    }
)  # fmt: skip
#: Values of kept keys that name a DeepSpeed feature jaxspeed does not implement.
DEEPSPEED_UNSUPPORTED_VALUES: Mapping[str, tuple[Any, ...]] = types.MappingProxyType(
    {
        "zero_optimization.offload_optimizer.device": ("nvme",),
        "zero_optimization.offload_param.device": ("nvme",),
    }
)
#: DeepSpeed options supported only at the value that is jaxspeed's behaviour (then dropped
#: silently); any other value is unsupported.
DEEPSPEED_DEFAULT_ONLY: Mapping[str, tuple[Any, ...]] = types.MappingProxyType(
    {
        "fp16.loss_scale": (0,),  # 0 = dynamic loss scaling; a static scale is not implemented
        "fp16.fp16_master_weights_and_grads": (False,),
        "prescale_gradients": (False,),
        "gradient_predivide_factor": (1,),
        "sparse_gradients": (False,),
        "communication_data_type": (None,),
        "zero_optimization.mics_shard_size": (-1,),
        "zero_optimization.offload_optimizer.ratio": (1,),
    }
)


class DeepSpeedOptionWarning(UserWarning):
    """DeepSpeed options that have no effect in jaxspeed were dropped."""


def from_deepspeed(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Translates DeepSpeed key names into jaxspeed's; a jaxspeed config passes unchanged.

    Args:
      raw: config as loaded from YAML/JSON (not modified).

    Returns:
      a new dict ready for validation.

    Raises:
      ConfigError: listing every DeepSpeed option jaxspeed does not support and every DeepSpeed
        key that contradicts its jaxspeed counterpart.
    Warns:
      DeepSpeedOptionWarning: once, naming every option that was dropped as moot.
    """
    tree, dropped, problems = _translate_deepspeed(raw)
    if problems:
        raise ConfigError("; ".join(problem.text for problem in problems))
    _warn_dropped(dropped, stacklevel=3)
    return tree


def _translate_deepspeed(raw: Mapping[str, Any]) -> tuple[dict[str, Any], list[str], list[Problem]]:
    """`from_deepspeed` without the warning and the error: the new tree (without the
    unsupported options), the dropped keys and the problems found."""
    tree, conflicts = _rename_deepspeed(raw)
    problems = _find_unsupported(tree) + conflicts
    dropped = []
    for key in sorted(DEEPSPEED_IGNORED):
        value = _lookup(tree, key)
        if value is not _MISSING:
            _remove(tree, key)
            if not _is_disabled(value):
                dropped.append(key)
    return tree, dropped, problems


def _rename_deepspeed(raw: Mapping[str, Any]) -> tuple[dict[str, Any], list[Problem]]:
    """A copy of `raw` with the renamed keys and the flags moved; the contradictions found."""
    tree = _plain(raw)
    conflicts = _move_renamed(tree)
    _apply_flags(tree)
    return tree, conflicts


def _move_renamed(tree: dict[str, Any]) -> list[Problem]:
    """Moves `DEEPSPEED_RENAMED` keys in place; returns the contradictions found (the jaxspeed
    key's value is kept)."""
    conflicts = []
    for ds_key, js_key in DEEPSPEED_RENAMED.items():
        value = _lookup(tree, ds_key)
        if value is _MISSING:
            continue
        _remove(tree, ds_key)
        existing = _lookup(tree, js_key)
        if existing is not _MISSING and existing != value:
            conflicts.append(Problem(js_key, (
                f"{ds_key}={value!r} vs {js_key}={existing!r}: DeepSpeed's name and "
                "jaxspeed's contradict (give only one)")))
        else:
            _insert(tree, js_key.split("."), value, what=ds_key)
    return conflicts


def _apply_flags(tree: dict[str, Any]) -> None:
    """Replaces `DEEPSPEED_FLAGS` in place by the jaxspeed values they stand for."""
    for flag, (js_key, js_value) in DEEPSPEED_FLAGS.items():
        value = _lookup(tree, flag)
        if value is _MISSING:
            continue
        _remove(tree, flag)
        if value and _lookup(tree, js_key) is _MISSING:
            _insert(tree, js_key.split("."), js_value, what=flag)


def _find_unsupported(tree: dict[str, Any]) -> list[Problem]:
    """Removes and lists the unsupported DeepSpeed options; drops disabled sections and
    default-only keys at their supported value."""
    found = []
    unsupported = "is a DeepSpeed option that jaxspeed does not support (remove it"
    for key in sorted(DEEPSPEED_UNSUPPORTED):
        value = _lookup(tree, key)
        if value is not _MISSING:
            _remove(tree, key)
            if not _is_disabled(value):
                found.append(Problem(key, f"{key} {unsupported} or set {key}.enabled: false)"))
    for key, bad in DEEPSPEED_UNSUPPORTED_VALUES.items():
        value = _lookup(tree, key)
        if isinstance(value, str) and value in bad:
            _remove(tree, key)
            found.append(Problem(key, f"{key}: {value!r} {unsupported})"))
    for key, fine in DEEPSPEED_DEFAULT_ONLY.items():
        value = _lookup(tree, key)
        if value is _MISSING:
            continue
        _remove(tree, key)
        if value not in fine:
            accepted = " or ".join(map(repr, fine))
            found.append(Problem(key, (
                f"{key}: {value!r} {unsupported}; only {accepted}, jaxspeed's behaviour, "
                "is supported)")))
    return found


def _warn_dropped(dropped: Sequence[str], *, stacklevel: int) -> None:
    if dropped:
        warnings.warn(
            "ignoring DeepSpeed options that have no effect in jaxspeed (XLA schedules "
            f"communication and memory itself): {', '.join(dropped)}",
            DeepSpeedOptionWarning,
            stacklevel=stacklevel,
        )


def _is_disabled(value: Any) -> bool:
    """A section that says `enabled: false`."""
    return isinstance(value, Mapping) and value.get("enabled") is False
