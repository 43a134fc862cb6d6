"""`jaxspeed train` reports: progress without a terminal, model vs hardware FLOPs (MFU, HFU)."""

import pytest

import jaxspeed as js
from jaxspeed.cost.flops import model_train_flops
from jaxspeed.train.loop import train
from jaxspeed.train.metrics_log import TrainRecord

TINY = [
    "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64",
    "model.max_seq_len=16", "data.seq_len=16", "data.max_bytes=200000", "train_batch_size=8",
    "logging.every_n_steps=1",
]


def config(*overrides):
    return js.load_config(None, overrides=[*TINY, *overrides])


def test_plain_progress_lines_without_a_terminal(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("JAXSPEED_PROGRESS_SECONDS", "0.001")
    record = train(config(), output_dir=tmp_path / "shown", steps=4)
    out, err = capsys.readouterr()
    assert out == ""  # stdout is the CLI's JSON
    assert "\r" not in err
    lines = err.splitlines()
    for start in ("initializing the state ...", "compiling the train step ..."):
        assert start in lines, err
    steps = [line for line in lines if line.startswith("train: ")]
    assert steps and steps[-1].startswith("train: 4/4 (100%)"), err
    assert all("loss=" in line and "tokens_per_s=" in line for line in steps), err
    assert record["step"] == 4 and set(TrainRecord.__required_keys__) <= set(record)

    train(config(), output_dir=tmp_path / "quiet", steps=1, progress=False)
    assert capsys.readouterr().err == ""


def test_hfu_counts_the_recompute_that_mfu_does_not(tmp_path):
    record = train(config("activation_checkpointing.policy=full", "hardware.peak_tflops=0.5"),
                   output_dir=tmp_path, steps=1, progress=False)
    assert record["hfu"] > 1.2 * record["mfu"]
    assert record["mfu"] == pytest.approx(record["tflops_per_device"] / 0.5)


@pytest.mark.parametrize("overrides, per_token", [
    # N = 2 layers x (4·32² attention + 2·32·64 FFN) + 32·256 head = 24576;
    # attention 12·L·d·(T/2) = 12·2·32·8 = 6144
    ([], 6 * 24576 + 6144),
    # 4 heads of 8, 2 kv heads: attention 2·32² + 2·32·16 = 3072; SwiGLU 3·32·64 = 6144;
    # N = 2·9216 + 8192 = 26624
    (["model.n_heads=4", "model.n_kv_heads=2", "model.mlp=swiglu"], 6 * 26624 + 6144),
])
def test_model_flops_match_a_hand_count(overrides, per_token):
    cfg = config(*overrides)
    flops = model_train_flops(cfg.model, tokens=8 * 16, seq_len=16, param_count=0)
    assert flops == per_token * 8 * 16
    assert model_train_flops(None, tokens=10, seq_len=16, param_count=1000) == 6 * 1000 * 10
