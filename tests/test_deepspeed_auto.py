"""Hugging Face Trainer-style ds_config.json files: every "auto" filled in, in one go."""

import json
import warnings

import pytest

from jaxspeed.config import (
    DeepSpeedAutoWarning,
    DeepSpeedOptionWarning,
    load_config,
    resolve_batch,
)
from jaxspeed.errors import ConfigError

# As the Trainer's documentation writes them (zero2 / zero3 examples), every value it fills "auto".
ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW",
                  "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR",
                  "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                             "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8,
                          "overlap_comm": True, "reduce_scatter": True,
                          "reduce_bucket_size": "auto", "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
ZERO3 = {
    **ZERO2,
    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                             "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
        "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}


def load(tmp_path, raw, overrides=()):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(raw))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(path, list(overrides))
    by_type = {}
    for w in caught:
        by_type.setdefault(w.category, []).append(str(w.message))
    return cfg, by_type


@pytest.mark.parametrize("raw", [ZERO2, ZERO3], ids=["zero2", "zero3"])
def test_trainer_config_loads_in_one_go(tmp_path, raw):
    cfg, warned = load(tmp_path, raw)
    assert cfg.zero_optimization.stage == raw["zero_optimization"]["stage"]
    assert (cfg.fp16.enabled, cfg.bf16.enabled) == (False, False)
    assert cfg.gradient_clipping == 1.0  # the Trainer's max_grad_norm
    params = cfg.optimizer.params
    assert (params.lr, params.betas, params.eps, params.weight_decay) == (1e-3, (0.9, 0.999), 1e-8, 0.0)
    assert cfg.scheduler.params.warmup_min_lr == 0.0
    assert cfg.scheduler.params.warmup_max_lr is None  # the optimizer's lr
    assert resolve_batch(cfg, 8) == (8, 1, 1)
    if raw is ZERO3:
        assert cfg.scheduler.params.total_num_steps == cfg.steps == 1000
    (line,) = warned[DeepSpeedAutoWarning]
    assert "\n" not in line
    for key in ("train_batch_size=1 x data-parallel size", "gradient_accumulation_steps=1",
                "gradient_clipping=1.0", "fp16.enabled=False", "bf16.enabled=False",
                "optimizer.params.lr=0.001", "optimizer.params.betas=[0.9, 0.999]",
                "scheduler.params.warmup_max_lr=0.001", "scheduler.params.warmup_num_steps=1"):
        assert key in line, key
    # ZeRO's auto bucket sizes go with the other bucket knobs, named in one warning
    (ignored,) = warned[DeepSpeedOptionWarning]
    assert "zero_optimization.reduce_bucket_size" in ignored and "\n" not in ignored


def test_auto_follows_the_rest_of_the_config(tmp_path):
    raw = {**ZERO3, "train_batch_size": 32, "gradient_accumulation_steps": 2,
           "scheduler": {"type": "WarmupDecayLR",
                         "params": {"warmup_max_lr": 3e-4, "warmup_num_steps": "auto",
                                    "total_num_steps": "auto"}}}
    cfg, warned = load(tmp_path, raw, ["steps=50", "bf16.enabled=true"])
    assert cfg.optimizer.params.lr == 3e-4  # the scheduler's peak
    assert cfg.scheduler.params.total_num_steps == 50  # the run's steps, after --set
    assert cfg.scheduler.params.warmup_num_steps == 1  # the Trainer's default: no warmup
    assert cfg.bf16.enabled and not cfg.fp16.enabled
    assert resolve_batch(cfg, 8) == (32, 2, 2)
    (line,) = warned[DeepSpeedAutoWarning]
    assert "train_micro_batch_size_per_device=32 / (2 x data-parallel size)" in line
    assert "bf16.enabled" not in line  # set by the override, not "auto"


def test_three_bad_keys_in_one_error(tmp_path):
    raw = {**ZERO2, "zero_optimization": {**ZERO2["zero_optimization"], "stage": 4},
           "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betaz": [0.9, 0.95]}},
           "amp": {"enabled": True}}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"invalid config in {path}: ")
    assert "zero_optimization.stage: Input should be 0, 1, 2 or 3 (got 4)" in message
    assert "optimizer.params.betaz: unknown key" in message and "did you mean 'betas'" in message
    assert "amp is a DeepSpeed option that jaxspeed does not support" in message


def test_steps_flag_sets_the_auto_total(tmp_path):
    from jaxspeed.cli.parser import build_parser, load_config_args

    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ZERO3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = load_config_args(build_parser().parse_args(["train", str(path), "--steps", "40"]))
    assert (cfg.steps, cfg.scheduler.params.total_num_steps) == (40, 40)
    assert cfg.scheduler.params.warmup_num_steps == 1
