"""What loading a config says: the flag an error comes from, a missing `load_from`, the
checkpoint's architecture as the default, and the sections a file leaves to the defaults."""

import json
import warnings

import pytest

import jaxspeed as js
from jaxspeed.checkpoint.params import FORMAT, RECORD, check_model, with_checkpoint_model
from jaxspeed.cli import main
from jaxspeed.cli.parser import build_parser, load_config_args
from jaxspeed.config import DefaultSectionsWarning, load_config
from jaxspeed.errors import ConfigError

TINY = {
    "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64, "max_seq_len": 32},
    "data": {"seq_len": 32, "max_bytes": 300000},
    "steps": 3,
}
#: the `model:` of a params checkpoint that differs from the defaults in every kind of key
SAVED = {"vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
         "d_ff": 48, "max_seq_len": 16, "mlp": "swiglu", "norm": "rmsnorm",
         "positions": "rotary", "tie_embeddings": False, "rope_theta": 500000.0,
         "rms_norm_eps": 1e-5}


def write(tmp_path, name, obj):
    path = tmp_path / name
    path.write_text(json.dumps(obj))
    return str(path)


def cli_error(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"jaxspeed {argv[0]}: error: ") and "Traceback" not in err, err
    assert err.count("\n") == 1, err  # one line
    return err


@pytest.mark.parametrize(
    "flags, named",
    [(["--set", "optimizer.params.lr=abc"], "invalid --set optimizer.params.lr=abc: "),
     (["--device-memory", "12XB"], "invalid --device-memory 12XB: "),
     (["--set", "zero_optimization.stage"], "invalid --set zero_optimization.stage: "),
     (["--set", "data.seq_len=64"], "invalid --set data.seq_len=64: ")],
    ids=["set", "device-memory", "no-value", "whole-config"],
)
def test_a_flag_error_names_the_flag_not_the_file(tmp_path, capsys, flags, named):
    config = write(tmp_path, "tiny.json", TINY)
    err = cli_error(capsys, ["train", config, *flags, "--output", str(tmp_path / "run")])
    assert named in err
    assert "invalid config in" not in err  # the file is fine


def test_file_and_flag_errors_in_one_line(tmp_path, capsys):
    config = write(tmp_path, "bad.json", {**TINY, "zero_optimization": {"stage": 7}})
    err = cli_error(capsys, ["plan", config, "--set", "optimizer.params.lr=abc"])
    assert f"invalid config in {config}: zero_optimization.stage" in err
    assert "invalid --set optimizer.params.lr=abc: optimizer.params.lr" in err


def test_every_error_of_a_config_in_one_message(tmp_path, capsys):
    """MoE options, the optimizer and a rule across sections, all broken in one file: one
    line names each, the cross-field rule although other sections did not validate."""
    bad = {**TINY, "model": {**TINY["model"], "moe": {"num_experts": 4, "k": 8,
                                                      "gate_noise": -1.0}},
           "optimizer": {"type": "Lamb", "params": {"lr": 0.01, "min_coeff": 2.0,
                                                    "max_coeff": 1.0}},
           "bf16": {"enabled": True}, "fp16": {"enabled": True}}
    err = cli_error(capsys, ["plan", write(tmp_path, "bad.json", bad)])
    for text in ("MoE.k must be <= num_experts=4, got k=8", "MoE.gate_noise must be >= 0",
                 "need 0 <= min_coeff <= max_coeff", "bf16.enabled and fp16.enabled are both"):
        assert text in err, err
    # a rule reading an invalid section is not run on its defaults: model.max_seq_len is
    # 32 in the file, the default 256 would let seq_len 64 pass
    bad["data"] = {**TINY["data"], "seq_len": 64}
    with pytest.raises(ConfigError) as raised:
        load_config(bad)
    assert "data.seq_len" not in str(raised.value)
    assert "bf16.enabled and fp16.enabled" in str(raised.value)

def test_every_untrainable_combination_in_one_message():
    """What `initialize` refuses of a valid config (`untrainable_errors`), all at once: a 1-bit
    optimizer under ZeRO-2 with fp16, and the same optimizer under a pipeline."""
    config = load_config(TINY, overrides=[
        "optimizer.type=OneBitAdam", "zero_optimization.stage=2", "fp16.enabled=true",
        "mesh.pipe=2", "mesh.data=4", "train_batch_size=8"])
    with pytest.raises(ConfigError) as raised:
        js.initialize(config)
    for text in ("cannot be used with zero_optimization.stage=2", "; fp16: dynamic loss",
                 "optimizer.type=OneBitAdam with pipeline parallelism (mesh.pipe=2)"):
        assert text in str(raised.value), str(raised.value)

def test_missing_load_from_says_it_does_not_exist(tmp_path, capsys):
    config = write(tmp_path, "tiny.json", TINY)
    missing = tmp_path / "no" / "such"
    err = cli_error(capsys, ["plan", config, "--set", f"checkpoint.load_from={missing}"])
    assert f"checkpoint.load_from={missing} does not exist" in err
    assert "not a params checkpoint" not in err


@pytest.mark.parametrize(
    "text, where",
    [("model:\n  d_model: [32, 64\nsteps: 3\n",
      "at line 3, column 6: expected ',' or ']', but got ':' (while parsing a flow sequence at "
      "line 2, column 12)"),
     ("steps: 3\nmodel: d_model: 32\n", "at line 2, column 15: mapping values are not allowed here"),
     ("model:\n\td_model: 32\n", "at line 2, column 1: found character '\\t' that cannot start any token"),
     ("steps: 3\nname: \"tiny\n", "at line 3, column 1: found unexpected end of stream (while "
      "scanning a quoted scalar at line 2, column 7)")],
    ids=["flow", "mapping", "tab", "quote"],
)
def test_a_yaml_syntax_error_is_one_line_with_its_line_and_column(tmp_path, capsys, text, where):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_config(str(path))
    assert str(error.value) == f"cannot parse config file {path} {where}"
    err = cli_error(capsys, ["plan", str(path)])
    assert err == f"jaxspeed plan: error: cannot parse config file {path} {where}\n"


def params_checkpoint(tmp_path, model=SAVED):
    """A params checkpoint's record (loading the config reads nothing else)."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / RECORD).write_text(json.dumps({"format": FORMAT, "model": model, "arrays": {}}))
    return folder


def test_the_checkpoint_model_is_the_default(tmp_path):
    ckpt = params_checkpoint(tmp_path)
    config = write(tmp_path, "run.json", {"model": {"n_layers": 2}, "steps": 3})
    args = build_parser().parse_args(["train", config, "--set", f"checkpoint.load_from={ckpt}"])
    cfg = load_config_args(args)
    for key, value in SAVED.items():
        assert getattr(cfg.model, key) == value, key
    assert cfg.data.seq_len == 16  # the default 256 does not fit the checkpoint's context
    assert with_checkpoint_model(cfg) == cfg  # nothing more to take
    # a key set to the checkpoint's value, or a rotary model's other context, is fine
    cfg = with_checkpoint_model(load_config(
        {"model": {"rope_theta": 5e5, "max_seq_len": 64}, "data": {"seq_len": 64},
         "checkpoint": {"load_from": str(ckpt)}}))
    assert (cfg.model.d_model, cfg.model.max_seq_len, cfg.data.seq_len) == (32, 64, 64)


def test_a_set_key_that_differs_from_the_checkpoint_is_an_error(tmp_path, capsys):
    ckpt = params_checkpoint(tmp_path)
    config = write(tmp_path, "run.json", {"model": {"rms_norm_eps": 1e-6}, "data": {"seq_len": 16}})
    err = cli_error(capsys, ["plan", config, "--set", f"checkpoint.load_from={ckpt}",
                             "--set", "model.rope_theta=10000", "--set", "model.d_ff=48"])
    assert f"checkpoint.load_from={ckpt}" in err
    assert "model.rope_theta: the config sets 10000.0, the checkpoint has 500000.0" in err
    assert "model.rms_norm_eps: the config sets 1e-06, the checkpoint has 1e-05" in err
    assert "d_ff" not in err  # set, but to the checkpoint's value


def test_load_from_warning_is_one_line_and_says_what_wins():
    run = load_config({"model": {**SAVED, "rope_theta": 10000.0}, "data": {"seq_len": 16}}).model
    with pytest.warns(UserWarning) as record:
        check_model(SAVED, run, source="ckpt")
    (message,) = [str(w.message) for w in record]
    assert "\n" not in message
    assert "model.rope_theta is 500000.0 in the checkpoint but 10000.0 in this run" in message
    assert "training with this run's value" in message


def test_a_file_without_model_or_data_says_what_it_trains(tmp_path):
    path = write(tmp_path, "ds_config.json", {"train_micro_batch_size_per_gpu": 2})
    with pytest.warns(DefaultSectionsWarning) as record:
        load_config(path)
    (message,) = [str(w.message) for w in record if w.category is DefaultSectionsWarning]
    assert "\n" not in message
    assert message.startswith("ds_config.json has no model: or data: section: training the "
                              "default model (gpt: d_model=256")
    assert "on the default data (the Python standard library's source files" in message
    path = write(tmp_path, "half.json", {"model": {"d_model": 64}})
    with pytest.warns(DefaultSectionsWarning, match="no data: section: training on the default"):
        load_config(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(write(tmp_path, "full.json", TINY))
        load_config(path, ["data.seq_len=64"])  # an override gives the section
        load_config({"steps": 3})  # a mapping is the caller's own
