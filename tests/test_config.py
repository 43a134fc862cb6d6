"""Tests for jaxspeed.config: schema, loading, overrides, DeepSpeed import, batch sizes."""

import json
import typing
import warnings

import pydantic
import pytest
import yaml

from jaxspeed.config import (
    BatchSizes,
    Config,
    DeepSpeedOptionWarning,
    apply_overrides,
    from_deepspeed,
    load_config,
    parse_bytes,
    resolve_batch,
)
from jaxspeed.errors import ConfigError

# DeepSpeed's documented example config, as a ds_config.json would hold it.
DEEPSPEED_JSON = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "fp16": {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 16,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "zero_optimization": {
        "stage": 2,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e8,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
    },
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 100},
    },
    "steps_per_print": 50,
    "wall_clock_breakdown": False,
}


def _sections(model_cls):
    yield model_cls
    for field in model_cls.model_fields.values():
        yield from _sections_in(field.annotation)


def _sections_in(annotation):
    """The sections in a field's type, through unions (`optimizer`'s models, `X | None`)."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        yield from _sections(annotation)
    for arg in typing.get_args(annotation):
        yield from _sections_in(arg)


def test_defaults():
    cfg = load_config()
    assert cfg == Config()
    assert cfg.mesh.data == -1 and cfg.mesh.pipe == 1
    assert cfg.zero_optimization.stage == 0
    assert cfg.zero_optimization.offload_optimizer.device == "none"
    assert cfg.optimizer.type == "AdamW" and cfg.scheduler.type == "constant"
    assert cfg.model.d_model == 256 and cfg.data.source == "stdlib"
    assert cfg.checkpoint.async_ is True and cfg.steps == 1000 and cfg.seed == 0


def test_every_section_forbids_unknown_keys():
    sections = list(_sections(Config))
    assert len(sections) >= 15
    for section in sections:
        assert section.model_config["extra"] == "forbid", section.__name__


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
def test_load_file(tmp_path, suffix):
    raw = {
        "mesh": {"data": 2, "tensor": 4},
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "adamw", "params": {"lr": 3e-4, "betas": [0.9, 0.95]}},
        "model": {"d_model": 64, "n_heads": 4, "moe": {"num_experts": 8}},
        "checkpoint": {"dir": "ckpt", "async": False},
    }
    path = tmp_path / f"cfg{suffix}"
    path.write_text(json.dumps(raw) if suffix == ".json" else yaml.safe_dump(raw))
    cfg = load_config(path)
    assert cfg.mesh.tensor == 4 and cfg.zero_optimization.stage == 3
    assert cfg.optimizer.type == "AdamW"  # canonical spelling
    assert (cfg.optimizer.params.lr, cfg.optimizer.params.betas) == (3e-4, (0.9, 0.95))
    assert cfg.model.moe.num_experts == 8 and cfg.model.moe.k == 1  # the MoE layer's default
    assert cfg.checkpoint.async_ is False
    assert load_config(str(path)) == cfg


def test_yaml_exponent_is_a_float(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("optimizer:\n  params: {lr: 3e-4, eps: 1E-8}\n")
    params = load_config(path).optimizer.params
    assert (params.lr, params.eps) == (3e-4, 1e-8)
    assert yaml.safe_load("x: 3e-4") == {"x": "3e-4"}  # the stock SafeLoader is untouched


def test_empty_yaml_file_is_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(path) == Config()


@pytest.mark.parametrize(
    "name, text, match",
    [
        ("missing.yaml", None, "not found.*missing.yaml"),
        ("bad.yaml", "a: [1,", "cannot parse.*bad.yaml"),
        ("bad.json", "{'a': 1}", "cannot parse.*bad.json"),
        ("list.yaml", "- 1\n- 2\n", "list.yaml must hold a mapping"),
        ("cfg.toml", "a = 1", r"cfg.toml must end in \.yaml, \.yml or \.json"),
    ],
)
def test_file_errors_name_the_path(tmp_path, name, text, match):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(path)


def test_validation_error_names_the_file(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("zero_optimization: {stag: 3}\n")
    with pytest.raises(ConfigError, match=r"typo.yaml(.|\n)*zero_optimization.stag"):
        load_config(path)


def test_overrides():
    cfg = load_config(
        {"zero_optimization": {"stage": 3}},
        overrides=[
            "zero_optimization.stage=2",
            "optimizer.params.betas=[0.9, 0.95]",
            "optimizer.params.lr=3e-4",
            "bf16.enabled=true",
            "data.max_bytes=null",
            "model.norm=layernorm",
            "checkpoint.async=false",
        ],
    )
    assert cfg.zero_optimization.stage == 2
    assert (cfg.optimizer.params.betas, cfg.optimizer.params.lr) == ((0.9, 0.95), 3e-4)
    assert cfg.bf16.enabled is True
    assert cfg.data.max_bytes is None
    assert cfg.model.norm == "layernorm"
    assert cfg.checkpoint.async_ is False


def test_apply_overrides_creates_intermediate_dicts_and_copies():
    raw = {"a": {"b": 1}}
    out = apply_overrides(raw, ["a.c.d=x", "e=[1, 2]", "a.b=  7"])
    assert out == {"a": {"b": 7, "c": {"d": "x"}}, "e": [1, 2]}
    assert raw == {"a": {"b": 1}}


@pytest.mark.parametrize(
    "override, match",
    [
        ("zero_optimization.stage", "must look like KEY.PATH=VALUE"),
        ("a..b=1", "empty part"),
        ("x=[1,", "cannot parse the value"),
        ("steps.x=1", "steps is 1000, not a mapping"),
    ],
)
def test_bad_overrides(override, match):
    with pytest.raises(ConfigError, match=match):
        apply_overrides({"steps": 1000}, [override])


def test_overrides_must_be_a_list():
    with pytest.raises(ConfigError, match="list of KEY.PATH=VALUE"):
        load_config(None, overrides="steps=3")


def test_unknown_top_level_key():
    with pytest.raises(ConfigError, match=r"train_batch_sise: unknown key.*'train_batch_size'"):
        load_config({"train_batch_sise": 8})


def test_unknown_nested_key_suggests_close_match():
    match = r"zero_optimization\.stag: unknown key.*did you mean 'stage'\?"
    with pytest.raises(ConfigError, match=match):
        load_config({"zero_optimization": {"stag": 3}})


def test_unknown_key_suggests_alias():
    with pytest.raises(ConfigError, match=r"checkpoint\.asyn: unknown key.*did you mean 'async'\?"):
        load_config({"checkpoint": {"asyn": False}})


def test_unknown_nested_key_lists_accepted_keys():
    with pytest.raises(ConfigError, match=r"fp16\.xyzzy: unknown key.*accepted keys: enabled, "):
        load_config({"fp16": {"xyzzy": 1}})


def test_every_error_listed_once():
    with pytest.raises(ConfigError) as info:
        load_config({"steps": 0, "model": {"norm": "batchnorm"}, "mesh": {"pipe": 0}})
    message = str(info.value)
    assert "steps: Input should be greater than or equal to 1 (got 0)" in message
    assert "model.norm: Input should be 'rmsnorm' or 'layernorm' (got 'batchnorm')" in message
    assert "mesh.pipe:" in message


def test_errors_in_three_sections_in_one_message():
    with pytest.raises(ConfigError) as info:
        load_config(
            {
                "optimizer": {"type": "AdamW", "params": {"lr": "fast"}},
                "scheduler": {"type": "WarmupCosine", "params": {"warmup_num_steps": 10}},
                "data": {"seq_len": 0},
            }
        )
    message = str(info.value)
    assert "optimizer.params.lr: Input should be a valid number (got 'fast')" in message
    assert "scheduler.params.total_num_steps is required for scheduler.type WarmupCosine" in message
    assert "data.seq_len: Input should be greater than or equal to 1 (got 0)" in message


@pytest.mark.parametrize("stage", ["three", 5, True, -1])
def test_bad_zero_stage(stage):
    with pytest.raises(ConfigError, match=r"zero_optimization\.stage: .*\(got "):
        load_config({"zero_optimization": {"stage": stage}})


@pytest.mark.parametrize(
    "raw, match",
    [
        ({"steps": True}, r"steps: Input should be a valid integer \(got True\)"),
        ({"bf16": {"enabled": "yes"}}, r"bf16\.enabled: Input should be a valid boolean"),
        ({"data": {"eval_fraction": 1.0}}, r"data\.eval_fraction: .*less than 1"),
        ({"gradient_clipping": -1.0}, r"gradient_clipping: .*greater than or equal to 0"),
        ({"mesh": {"data": -1, "tensor": -1}}, r"mesh: at most one axis may be -1.*data, tensor"),
        ({"mesh": {"expert": -2}}, r"mesh\.expert: mesh axis size must be >= 1, or -1"),
        ({"optimizer": {"type": "Adamm"}}, r"optimizer\.type: unknown optimizer .*AdamW, SGD"),
        ({"scheduler": {"type": "cosine"}}, r"scheduler\.type: unknown .*WarmupCosine"),
        ({"optimizer": {"params": {"max_grad_norm": 1.0}}},
         r"optimizer\.params\.max_grad_norm: unknown key \(got 1\.0\); use the top-level "
         r"gradient_clipping instead"),
        ({"optimizer": {"type": "SGD", "params": {"momentun": 0.9}}},
         r"optimizer\.params\.momentun: unknown key.*did you mean 'momentum'\?"),
        ({"optimizer": {"params": {"betas": 0.9}}}, r"optimizer\.params\.betas: .*\(got 0\.9\)"),
        ({"optimizer": {"type": "OneBitAdam", "params": {"freeze_step": -1}}},
         r"optimizer\.params\.freeze_step: freeze_step must be >= 0, got -1"),
        ({"scheduler": {"params": {"warmup_num_steps": 10}}},
         r"scheduler\.params\.warmup_num_steps: unknown key .*accepted keys: \(none\)"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}},
         r"scheduler\.params\.warmup_type: Input should be 'log' or 'linear' \(got 'cosine'\)"),
        ({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 2.5}}},
         r"scheduler\.params\.total_num_steps: Input should be a valid integer \(got 2\.5\)"),
        ({"zero_optimization": {"offload_param": {"device": "gpu"}}}, r"'none' or 'cpu'"),
        ({"activation_checkpointing": {"policy": "names"}}, r"non-empty list of names"),
        ({"activation_checkpointing": {"names": ["x"]}}, r"only used with policy 'names'"),
        ({"data": {"source": "path"}}, r"data: source is 'path' but no path"),
        ({"data": {"seq_len": 512}}, r"data\.seq_len=512 is longer than model\.max_seq_len=256"),
        ({"hardware": {"device_memory": "80 gigs"}}, r"hardware\.device_memory: cannot parse"),
        ({"zero_optimization": {"max_live_parameters": -1}},
         r"max_live_parameters: .*greater than or equal to 0"),
    ],
)
def test_invalid_values(raw, match):
    with pytest.raises(ConfigError, match=match):
        load_config(raw)


def test_type_names_are_case_insensitive():
    cfg = load_config(
        {
            "optimizer": {"type": "onebitadam"},
            "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10}},
        }
    )
    assert cfg.optimizer.type == "OneBitAdam"
    assert cfg.scheduler.type == "WarmupCosine"


def test_counts_accept_integral_floats():
    cfg = load_config(
        {
            "optimizer": {"type": "OneBitAdam", "params": {"freeze_step": 1e5}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 3e3}},
        }
    )
    assert cfg.optimizer.params.freeze_step == 100_000
    assert type(cfg.optimizer.params.freeze_step) is int
    assert cfg.scheduler.params.total_num_steps == 3000


def test_overrides_pick_the_scheduler_and_its_params():
    cfg = load_config(
        None, ["scheduler.type=warmupcosinelr", "scheduler.params.total_num_steps=300"]
    )
    assert cfg.scheduler.type == "WarmupCosine" and cfg.scheduler.params.total_num_steps == 300
    assert cfg.scheduler.params.warmup_num_steps == 1000  # the default, filled in


def test_bf16_and_fp16_both_enabled():
    with pytest.raises(ConfigError, match="bf16.enabled and fp16.enabled are both true"):
        load_config({"bf16": {"enabled": True}, "fp16": {"enabled": True}})


def test_d_model_must_divide_by_heads():
    with pytest.raises(ConfigError, match=r"model: d_model=100 is not divisible by n_heads=3"):
        load_config({"model": {"d_model": 100, "n_heads": 3}})


def test_data_path_switches_source():
    cfg = load_config(None, overrides=["data.path=corpus.txt"])
    assert cfg.data.source == "path" and cfg.data.path == "corpus.txt"
    assert load_config({"data": {"source": "stdlib", "path": "x"}}).data.source == "path"


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("16 GB") == 16 * 10**9
    assert parse_bytes("1.5g") == 3 * 2**29
    assert parse_bytes("512") == 512
    assert parse_bytes(4096) == 4096
    for bad in ("", "GiB", "80 gigs", "0GiB", -1, True, 1.5):
        with pytest.raises(ConfigError):
            parse_bytes(bad)
    hardware = load_config({"hardware": {"device_memory": "80GiB"}}).hardware
    assert hardware.device_memory == "80GiB"
    assert hardware.device_memory_bytes == 80 * 2**30


def test_micro_batch_alias():
    cfg = load_config({"train_micro_batch_size_per_gpu": 4})
    assert cfg.train_micro_batch_size_per_device == 4
    assert Config.model_validate({"train_micro_batch_size_per_gpu": 4}) == cfg
    assert "train_micro_batch_size_per_gpu" not in cfg.to_dict()


def test_micro_batch_alias_conflict():
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu=4 vs"):
        load_config({"train_micro_batch_size_per_gpu": 4, "train_micro_batch_size_per_device": 2})


def test_override_with_deepspeed_name_replaces_file_value():
    cfg = load_config(
        {"train_micro_batch_size_per_device": 8}, ["train_micro_batch_size_per_gpu=2"]
    )
    assert cfg.train_micro_batch_size_per_device == 2


@pytest.mark.parametrize(
    "sizes, dp, expected",
    [
        ((64, 8, 1), 8, (64, 8, 1)),  # all given and consistent
        ((64, 4, None), 8, (64, 4, 2)),  # accumulation derived
        ((64, None, 2), 8, (64, 4, 2)),  # micro derived
        ((None, 4, 2), 8, (64, 4, 2)),  # total derived
        ((64, None, None), 8, (64, 8, 1)),  # accumulation defaults to 1
        ((None, 4, None), 8, (32, 4, 1)),
        ((None, None, 3), 2, (6, 1, 3)),
        ((None, None, None), 8, (8, 1, 1)),
    ],
)
def test_resolve_batch(sizes, dp, expected):
    total, micro, accum = sizes
    cfg = Config(
        train_batch_size=total,
        train_micro_batch_size_per_device=micro,
        gradient_accumulation_steps=accum,
    )
    resolved = resolve_batch(cfg, dp)
    assert isinstance(resolved, BatchSizes)
    assert resolved == expected
    assert resolved.train_batch_size == (
        resolved.micro_batch_per_device * resolved.accumulation_steps * dp
    )


@pytest.mark.parametrize(
    "sizes, dp, match",
    [
        ((60, 8, None), 8, r"train_batch_size=60 is not divisible by micro 8 × data-parallel "),
        ((60, None, None), 8, r"train_batch_size=60 is not divisible by .*data-parallel size 8"),
        ((64, None, 3), 8, r"by gradient_accumulation_steps 3 × data-parallel size 8"),
        ((64, 8, 2), 8, r"train_batch_size=64 does not equal micro 8 × .* 2 × .* 8 = 128"),
    ],
)
def test_resolve_batch_errors(sizes, dp, match):
    total, micro, accum = sizes
    cfg = load_config(
        {
            "train_batch_size": total,
            "train_micro_batch_size_per_device": micro,
            "gradient_accumulation_steps": accum,
        }
    )
    with pytest.raises(ConfigError, match=match):
        resolve_batch(cfg, dp)


def test_deepspeed_json_loads_with_one_warning(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(DEEPSPEED_JSON))
    with pytest.warns(DeepSpeedOptionWarning) as record:
        cfg = load_config(path)
    record = [w for w in record if w.category is DeepSpeedOptionWarning]
    assert len(record) == 1
    message = str(record[0].message)
    for key in (
        "wall_clock_breakdown",
        "zero_optimization.overlap_comm",
        "zero_optimization.contiguous_gradients",
        "zero_optimization.reduce_bucket_size",
    ):
        assert key in message
    assert record[0].filename == __file__  # points at the caller, not at jaxspeed
    assert cfg.train_micro_batch_size_per_device == 4
    assert resolve_batch(cfg, 8) == (64, 4, 2)
    assert cfg.fp16.enabled and cfg.fp16.min_loss_scale == 1.0
    assert cfg.zero_optimization.stage == 2
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert cfg.optimizer.params.betas == (0.9, 0.999)
    assert cfg.scheduler.type == "WarmupLR"
    assert cfg.logging.every_n_steps == 50
    assert cfg.gradient_clipping == 1.0


def test_unsupported_deepspeed_options_in_one_error():
    raw = {
        "amp": {"enabled": True},
        "zero_optimization": {"offload_param": {"device": "nvme"}},
        "fp16": {"loss_scale": 128},
    }
    with pytest.raises(ConfigError, match="does not support") as info:
        load_config(raw)
    message = str(info.value)
    assert "amp" in message
    assert "zero_optimization.offload_param.device: 'nvme'" in message
    assert "fp16.loss_scale: 128" in message


def test_disabled_deepspeed_sections_and_default_values_are_dropped_silently():
    raw = {
        "amp": {"enabled": False},
        "flops_profiler": {"enabled": False},
        "prescale_gradients": False,
        "fp16": {"loss_scale": 0},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(raw) == Config()


def test_deepspeed_activation_checkpointing():
    with pytest.warns(DeepSpeedOptionWarning, match="activation_checkpointing.number_checkpoints"):
        cfg = load_config(
            {"activation_checkpointing": {"partition_activations": True, "number_checkpoints": 4}}
        )
    assert cfg.activation_checkpointing.policy == "full"
    cfg = load_config(
        {"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True}}
    )
    assert cfg.activation_checkpointing.policy == "offload_dots"
    cfg = load_config({"activation_checkpointing": {"partition_activations": False}})
    assert cfg.activation_checkpointing.policy == "none"


def test_deepspeed_max_live_parameters():
    cfg = load_config({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 3e7}})
    assert cfg.zero_optimization.max_live_parameters == 30_000_000
    assert load_config(None).zero_optimization.max_live_parameters == 1_000_000_000


def test_deepspeed_tensorboard_section():
    with pytest.warns(DeepSpeedOptionWarning, match="tensorboard.output_path"):
        cfg = load_config({"tensorboard": {"enabled": True, "output_path": "tb/"}})
    assert cfg.logging.tensorboard is True


def test_top_level_sparse_attention_moves_to_model():
    sparse = {"mode": "fixed", "block": 16, "num_local_blocks": 4}
    cfg = load_config({"sparse_attention": sparse})
    assert cfg.model.sparse_attention.model_dump(include=set(sparse)) == sparse
    moved = load_config(None, ["sparse_attention.mode=bigbird"]).model.sparse_attention
    assert moved.mode == "bigbird"


def test_from_deepspeed_leaves_input_alone_and_passes_jaxspeed_configs():
    raw = {"train_micro_batch_size_per_gpu": 2, "bfloat16": {"enabled": True}}
    out = from_deepspeed(raw)
    assert out == {"train_micro_batch_size_per_device": 2, "bf16": {"enabled": True}}
    assert raw == {"train_micro_batch_size_per_gpu": 2, "bfloat16": {"enabled": True}}
    full = Config().to_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert from_deepspeed(full) == full


def test_round_trip():
    cfg = load_config(
        {
            "mesh": {"data": 2, "expert": 2, "tensor": 2},
            "train_batch_size": 32,
            "train_micro_batch_size_per_gpu": 2,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
            "optimizer": {"type": "lion", "params": {"lr": 1e-4}},
            "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 300}},
            "activation_checkpointing": {"policy": "names", "names": ["attn_out"]},
            "model": {"mlp": "swiglu", "moe": {"num_experts": 4, "k": 2}},
            "data": {"path": "corpus.txt"},
            "checkpoint": {"dir": "out", "async": False},
            "hardware": {"device_memory": "80GiB"},
        }
    )
    assert load_config(cfg.model_dump(by_alias=True)) == cfg
    assert load_config(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert load_config(cfg) == cfg
