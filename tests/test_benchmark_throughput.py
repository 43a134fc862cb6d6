"""benchmarks/throughput.py and its MaxText peer (benchmarks/maxtext_peer.py).

MaxText itself is not installed for the tests (it is ~2.5 GB, `make maxtext`); a stand-in
"python" that prints MaxText's step lines checks that `--maxtext` times it, and that the ratio
divides the two measured figures.
"""

from __future__ import annotations

import functools
import json
import stat
import subprocess
import sys

import jax.numpy as jnp
import pytest

from jaxspeed.ops.matmul import widens_bf16
from test_benchmarks import ROOT, load_benchmark

#: A stand-in for a MaxText venv's python: a config path for `-c`, one step line per step for
#: `-m`, each step taking STEP_S seconds.
STEP_S = 0.5
FAKE_MAXTEXT = f"""#!/bin/sh
case "$1" in
-c) echo /nonexistent/base.yml ;;
-m) steps=$(printf '%s\\n' "$@" | sed -n 's/^steps=//p')
    i=0; while [ "$i" -lt "$steps" ]; do
      echo "I1201 metric_logger.py:265] completed step: $i, seconds: {STEP_S}, loss: 6.7"
      i=$((i+1)); done ;;
esac
"""


@functools.cache
def quick_lines(maxtext: str | None) -> tuple[dict, ...]:
    argv = [sys.executable, "benchmarks/throughput.py", "--quick"]
    argv += ["--maxtext", maxtext] if maxtext else []
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tuple(json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))


@pytest.fixture(scope="module")
def fake_maxtext(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("maxtext") / "python"
    path.write_text(FAKE_MAXTEXT)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_aggregates_total_tokens_over_total_time():
    aggregate = load_benchmark("throughput").aggregate
    records = [
        {"step": 1, "tokens_per_second": 10.0},  # compile: skipped
        {"step": 2, "tokens_per_second": 100.0},  # 1 s
        {"step": 4, "tokens_per_second": 50.0},  # 2 steps in 4 s
    ]
    tokens_per_s, steps = aggregate(records, tokens_per_step=100, skip=1)
    assert steps == 3
    assert tokens_per_s == pytest.approx(300 / 5)  # not the mean of the rates (75)


def test_maxtext_steps_aggregate_like_jaxspeed_steps():
    bench = load_benchmark("throughput")
    # MaxText numbers steps from 0; the first two are skipped like jaxspeed's first two.
    seconds = {0: 9.0, 1: 3.0, 2: 1.0, 3: 3.0}
    records = bench.maxtext_records(seconds, tokens_per_step=100)
    tokens_per_s, steps = bench.aggregate(records, tokens_per_step=100, skip=2)
    assert steps == 2
    assert tokens_per_s == pytest.approx(200 / 4)


def test_step_lines_are_read_from_maxtexts_log():
    peer = load_benchmark("maxtext_peer")
    log = ("I1201 13:19:21.6 metric_logger.py:265] completed step: 0, seconds: 0.990, TFLOP/s\n"
           "unrelated line, seconds: 5\n"
           "I1201 13:19:23.8 metric_logger.py:265] completed step: 1, seconds: 0.979, loss: 6\n")
    assert peer.step_seconds(log) == {0: 0.990, 1: 0.979}


def test_roofline_divides_the_matmul_peak_by_flops_per_token():
    roof = load_benchmark("throughput").roofline(
        flops_per_token=40e6, peak_gflops=120.0, tokens_per_s=1500.0)
    assert roof["ceiling_tokens_per_s"] == pytest.approx(3000.0)
    assert roof["achieved_gflops"] == pytest.approx(60.0)
    assert roof["peak_fraction"] == pytest.approx(0.5)


@pytest.mark.parametrize("name, expected", [
    ("fsdp8", {"ici_fsdp_parallelism": "8", "ici_data_parallelism": "1",
               "ici_tensor_parallelism": "1", "shard_optimizer_over_data": "false",
               "dtype": "bfloat16", "remat_policy": "full"}),
    ("data8_zero1", {"ici_fsdp_parallelism": "1", "ici_data_parallelism": "8",
                     "ici_tensor_parallelism": "1", "shard_optimizer_over_data": "true",
                     "dtype": "float32", "remat_policy": "none"}),
    ("fsdp4_tensor2", {"ici_fsdp_parallelism": "4", "ici_data_parallelism": "1",
                       "ici_tensor_parallelism": "2", "shard_optimizer_over_data": "false",
                       "dtype": "bfloat16", "remat_policy": "full"}),
])
def test_each_configuration_maps_to_maxtexts_options(name, expected):
    from jaxspeed.config import load_config

    bench, peer = load_benchmark("throughput"), load_benchmark("maxtext_peer")
    config = load_config(bench.CONFIG, overrides=bench.CONFIGS[name][1])
    opts = peer.options(config)
    assert {k: opts[k] for k in expected} == expected
    # The same model: llama shape of bench_tiny_llama.yaml, one sequence of 256 per device.
    assert (opts["base_emb_dim"], opts["base_num_decoder_layers"], opts["base_mlp_dim"],
            opts["head_dim"], opts["max_target_length"], opts["per_device_batch_size"],
            opts["weight_dtype"]) == ("256", "4", "1024", "64", "256", "1", "float32")


def test_a_config_maxtext_cannot_run_is_refused():
    from jaxspeed.config import load_config

    bench, peer = load_benchmark("throughput"), load_benchmark("maxtext_peer")
    config = load_config(bench.CONFIG, overrides=["model.mlp=gelu", "mesh.pipe=2"])
    with pytest.raises(ValueError, match="pipe.*model"):
        peer.options(config)


def test_the_peak_is_each_librarys_best_timing():
    best_of = load_benchmark("throughput").best_of
    samples = [{"xla": 300.0, "xla_bf16": 700.0}, {"xla": 450.0, "xla_bf16": 650.0},
               {"xla": 400.0, "openblas": 250.0, "xla_bf16": 600.0}]
    assert best_of(samples) == {"xla": 450.0, "openblas": 250.0, "xla_bf16": 700.0}


def test_a_python_without_maxtext_is_a_clear_error():
    peer = load_benchmark("maxtext_peer")
    with pytest.raises(RuntimeError, match="cannot import maxtext.*make maxtext"):
        peer.run(sys.executable, {}, steps=1)


def test_a_python_that_cannot_run_is_a_clear_error(tmp_path):
    peer = load_benchmark("maxtext_peer")
    with pytest.raises(RuntimeError, match="cannot run .*missing.*make maxtext"):
        peer.base_config(tmp_path / "missing" / "python")


@pytest.mark.parametrize("python", ["missing", sys.executable], ids=["missing", "no-maxtext"])
def test_a_bad_maxtext_python_stops_before_any_training(tmp_path, capsys, monkeypatch, python):
    bench = load_benchmark("throughput")
    trained = []
    monkeypatch.setattr(bench, "train_jaxspeed", lambda *a, **k: trained.append(a))
    python = str(tmp_path / python) if python == "missing" else python
    with pytest.raises(SystemExit) as stop:
        bench.main(["--quick", "--maxtext", python])
    assert stop.value.code == 2 and not trained
    err = capsys.readouterr().err
    assert "--maxtext: " in err and python in err and "make maxtext" in err


@pytest.mark.slow
def test_without_maxtext_nothing_is_compared():
    (line,) = quick_lines(None)
    assert "ratio" not in line and "baseline" not in line
    assert line["jaxspeed"] > 0 and line["case"].startswith("fsdp8:")
    peaks = line["matmul_peak_gflops_by_library"]
    assert set(peaks) == {"xla", "openblas", "xla_bf16"} and min(peaks.values()) > 0
    assert line["matmul_peak_gflops"] == max(peaks["xla"], peaks["openblas"])
    # XLA's rate timed after the one jaxspeed run and again at the end; the best is kept
    samples = line["matmul_peak_gflops_xla_samples"]
    assert len(samples) == 2 and peaks["xla"] == max(samples)
    # Model matmuls alone are 6 x 4.33M params per token; attention and remat add to that.
    assert line["flops_per_token"] > 6 * 4_325_376
    expected = line["matmul_peak_gflops"] * 1e9 / line["flops_per_token"]
    assert line["ceiling_tokens_per_s"] == pytest.approx(expected, rel=1e-3)
    achieved = line["jaxspeed"] * line["flops_per_token"] / 1e9
    assert line["peak_fraction"] == pytest.approx(achieved / line["matmul_peak_gflops"],
                                                  rel=1e-2)
    assert line["peak_fraction_bf16"] == pytest.approx(achieved / peaks["xla_bf16"], rel=1e-2)
    # The step's own dots, replayed alone, and the share of their rate the step reaches.
    assert line["dots_alone_fraction"] == pytest.approx(
        line["dots_alone_gflops"] / line["matmul_peak_gflops"], rel=1e-2)
    assert line["of_dots_alone"] == pytest.approx(achieved / line["dots_alone_gflops"], rel=1e-2)
    # The benchmark runs in its own process: it says how its bf16 dots ran on this CPU.
    assert line["bf16_dot_operands"] == ("fp32 (widened)" if widens_bf16() else "bf16")


@pytest.mark.slow
def test_maxtext_is_timed_beside_jaxspeed(fake_maxtext):
    (line,) = quick_lines(fake_maxtext)
    # The stand-in's steps take STEP_S each: its tokens/s is measured from its log, not assumed.
    assert line["baseline"] == pytest.approx(line["tokens_per_step"] / STEP_S)
    assert line["runs"]["maxtext"] == [pytest.approx(line["baseline"])]
    # `ratio` is rounded to 3 decimals (0.0005 at most; below 1 that is more than 1e-3 of it),
    # the two figures to 5 significant digits.
    assert line["ratio"] == pytest.approx(line["jaxspeed"] / line["baseline"], rel=1e-3, abs=5e-4)
    assert line["maxtext_options"]["ici_fsdp_parallelism"] == "8"
    assert fake_maxtext in line["baseline_source"]


def test_the_dots_alone_program_runs_each_dot_of_the_step_as_often():
    import jax
    from jax.sharding import AxisType

    from jaxspeed.cost.hlo import Dot, dots

    replay = load_benchmark("_step_dots")
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2)
    matmul = (((1,), (0,)), ((), ()))
    step = [
        Dot((16, 32), (32, 64), ("f32", "f32", "f32"), matmul, executions=3),
        Dot((2, 8, 4), (2, 4, 8), ("f32", "f32", "f32"), (((2,), (1,)), ((0,), (0,))), 2),
        Dot((16, 32), (32, 64), ("f32", "f32", "f32"), matmul, executions=1),  # the same again
    ]
    fn, operands = replay._program(step, mesh)
    replayed = dots(fn.lower(operands).compile().as_text())

    def runs(found):
        total = {}
        for d in found:
            key = (d.lhs, d.rhs, d.dtypes, d.dimension_numbers)
            total[key] = total.get(key, 0) + d.executions
        return total

    assert runs(replayed) == runs(step)  # nothing merged, hoisted or left out
    text = jax.jit(lambda a, b: a @ b).lower(jnp.ones((64, 64)), jnp.ones((64, 64))).compile().as_text()
    result = replay.rate(text, mesh, repeats=2)
    assert result["flops_per_device"] == 2 * 64**3 and result["dots_per_device"] == 1
    assert result["gflops"] == pytest.approx(8 * 2 * 64**3 / result["seconds"] / 1e9)
