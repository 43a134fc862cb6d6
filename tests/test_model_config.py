"""`model:` is described once (`jaxspeed.config.ModelConfig`); the rest derives from it."""

import dataclasses

import pytest

import jaxspeed as js
from jaxspeed.attention.sparsity import SPARSITY_MODES
from jaxspeed.checkpoint import params as params_checkpoint
from jaxspeed.checkpoint.hf import config as hf_config
from jaxspeed.config import ModelConfig, MoeConfig, architecture_keys
from jaxspeed.config.model import CONTEXT, FUNCTION, SHAPES, SPARSE_ATTENTION_MODES
from jaxspeed.errors import ConfigError
from jaxspeed.models import GPT, build_gpt
from jaxspeed.moe import MoE

#: `ModelConfig` keys `GPT` holds under another name or form.
TRANSLATED = {"rms_norm_eps": "norm_eps"}


def test_roles_split_the_architecture():
    shapes, context, function = (architecture_keys(role) for role in (SHAPES, CONTEXT, FUNCTION))
    assert set(shapes) | set(context) | set(function) == set(architecture_keys())
    assert not set(shapes) & set(function)
    assert {"d_model", "n_layers", "vocab_size", "tie_embeddings"} <= set(shapes)
    assert context == ("max_seq_len",)


def test_checkpoint_and_hf_keys_are_the_configs():
    assert params_checkpoint.SHAPE_KEYS == architecture_keys(SHAPES)
    assert hf_config.MODEL_KEYS == architecture_keys()


def test_every_architecture_key_is_a_gpt_attribute_with_the_configs_default():
    gpt_fields = {f.name: f.default for f in dataclasses.fields(GPT)}
    defaults = ModelConfig()
    for key in architecture_keys():
        name = TRANSLATED.get(key, key)
        assert name in gpt_fields, key
        if key != "rope_scaling":  # a RopeScalingConfig in the config, a tuple in GPT
            assert gpt_fields[name] == getattr(defaults, key), key


def test_gpt_of_the_default_config_is_the_default_gpt():
    built = build_gpt(ModelConfig())
    plain = GPT()
    for key in architecture_keys():
        name = TRANSLATED.get(key, key)
        assert getattr(built, name) == getattr(plain, name), key


def test_moe_config_has_the_layers_options_and_defaults():
    layer = {f.name: f.default for f in dataclasses.fields(MoE)
             if f.name not in ("expert_axis", "param_dtype", "dtype", "fp8", "parent", "name")}
    config = MoeConfig.model_fields
    # `bias_update_rate` is the optimizer's (the sign rule's step), not the layer's
    assert set(config) == set(layer) | {"every_n_layers", "bias_update_rate"}
    for name, default in layer.items():
        if name not in ("num_experts", "d_ff", "activation"):  # required / the model's
            assert config[name].default == default, name


@pytest.mark.parametrize("mode", sorted(SPARSITY_MODES))
def test_sparse_attention_modes_have_the_layout_classes_keys(mode):
    layout = {f.name: f.default for f in dataclasses.fields(SPARSITY_MODES[mode])}
    config = SPARSE_ATTENTION_MODES[mode].model_fields
    assert set(config) == set(layout) | {"mode", "impl"}
    for name, default in layout.items():
        if name != "num_heads":
            assert config[name].default == default, (mode, name)


def test_sparse_attention_block_builds_the_layout_class():
    model = js.load_config(None, overrides=[
        "model.sparse_attention={mode: bigbird, block: 16, num_random_blocks: 2}"]).model
    layout = model.sparse_attention.sparsity(model.n_heads)
    assert type(layout) is SPARSITY_MODES["bigbird"]
    assert (layout.num_heads, layout.block, layout.num_random_blocks) == (model.n_heads, 16, 2)
    assert js.load_config(None, overrides=["model.sparse_attention={block: 32}"]
                          ).model.sparse_attention.mode == "fixed"  # DeepSpeed's default


def test_errors_in_three_model_blocks_come_in_one_message():
    with pytest.raises(ConfigError) as err:
        js.load_config({"model": {
            "n_heads": 4, "d_model": 64,
            "moe": {"num_experts": 2, "k": 3},
            "sparse_attention": {"mode": "fixed", "num_local_blocks": 3, "num_global_blocks": 2},
            "attention": {"impl": "flash"},
        }})
    message = str(err.value)
    assert "model.moe: MoE.k must be <= num_experts=2" in message
    assert "model.sparse_attention: FixedSparsityConfig: num_global_blocks=2" in message
    assert "model.attention.impl:" in message and "'flash'" in message


def test_moe_every_n_layers_must_divide_the_layers():
    with pytest.raises(ConfigError, match=r"model\.moe: every_n_layers=3 must divide n_layers=4"):
        js.load_config({"model": {"n_layers": 4, "moe": {"num_experts": 4, "every_n_layers": 3}}})


def test_config_round_trips_with_typed_blocks():
    config = js.load_config(None, overrides=[
        "model.moe={num_experts: 4, k: 2}", "model.sparse_attention={mode: dense, block: 16}"])
    assert js.load_config(config.to_dict()) == config
