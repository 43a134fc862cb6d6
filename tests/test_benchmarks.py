"""The benchmarks run (`--quick`) and print their result lines; no performance target is checked.

Each benchmark runs in its own process (it sets its emulated devices before JAX starts) from the
repository root, as `python benchmarks/NAME.py --quick`.
"""

import functools
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KEYS = ("benchmark", "case", "jaxspeed", "baseline", "unit", "ratio")
TIMEOUT_S = 600  # generous: the quick runs take seconds, but the CI cores are shared


@functools.cache
def run_quick(name: str) -> tuple[dict, ...]:
    """Runs `benchmarks/NAME.py --quick` once; returns its JSON lines (the last is the headline)."""
    proc = subprocess.run(
        [sys.executable, f"benchmarks/{name}.py", "--quick"],
        cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    lines = proc.stdout.strip().splitlines()
    assert lines, f"{name} printed nothing"
    headline = json.loads(lines[-1])
    earlier = [json.loads(line) for line in lines[:-1] if line.startswith("{")]
    return (*earlier, headline)


def check_result(obj: dict, name: str) -> None:
    missing = [k for k in KEYS if k not in obj]
    assert not missing, f"missing keys {missing} in {obj}"
    assert obj["benchmark"] == name
    assert isinstance(obj["unit"], str) and obj["unit"]
    for key in ("jaxspeed", "baseline", "ratio"):
        value = obj[key]
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (key, value)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "zero_memory", "overhead", "throughput", "offload_capacity", "sparse_attention",
        "onebit_comm", "onebit_convergence",
    ],
)
def test_quick_run_prints_a_result_line(name):
    results = run_quick(name)
    for obj in results:
        check_result(obj, name)


@pytest.mark.slow
def test_zero_memory_stage3_shards_all_model_state():
    """Memory is deterministic (shapes and shardings), so its structure can be checked."""
    results = run_quick("zero_memory")
    by_stage = {int(obj["case"].split()[0].removeprefix("stage=")): obj for obj in results}
    assert sorted(by_stage) == [0, 1, 2, 3]
    state = {s: obj["bytes"]["model_state"] for s, obj in by_stage.items()}
    devices = by_stage[3]["devices"]
    assert state[3] <= state[0] / devices * 1.02
    assert state[0] > state[1] > state[2] > state[3]
    # jaxspeed's widths: fp32 params + fp32 grads + Adam m, v = 16 bytes per parameter.
    assert by_stage[0]["bytes_per_param_per_device"] == pytest.approx(16.0, rel=1e-3)
    assert results[-1]["case"].startswith("stage=3")


def load_benchmark(name: str):
    """Imports `benchmarks/NAME.py` as a module (its pure helpers need no devices)."""
    path = ROOT / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_throughput_aggregates_total_tokens_over_total_time():
    aggregate = load_benchmark("throughput").aggregate
    records = [
        {"step": 1, "tokens_per_second": 10.0},  # compile: skipped
        {"step": 2, "tokens_per_second": 100.0},  # 1 s
        {"step": 4, "tokens_per_second": 50.0},  # 2 steps in 4 s
    ]
    tokens_per_s, steps = aggregate(records, tokens_per_step=100, skip=1)
    assert steps == 3
    assert tokens_per_s == pytest.approx(300 / 5)  # not the mean of the rates (75)


def test_throughput_roofline_divides_the_matmul_peak_by_flops_per_token():
    roofline = load_benchmark("throughput").roofline
    roof = roofline(flops_per_token=40e6, peak_gflops=120.0, tokens_per_s=1500.0)
    assert roof["ceiling_tokens_per_s"] == pytest.approx(3000.0)
    assert roof["achieved_gflops"] == pytest.approx(60.0)
    assert roof["baseline_needs_gflops"] == pytest.approx(5100 * 40e6 / 1e9)


@pytest.mark.slow
def test_throughput_quick_run_reports_the_machine_ceiling():
    headline = run_quick("throughput")[-1]
    peaks = headline["matmul_peak_gflops_by_library"]
    assert set(peaks) == {"xla", "openblas"} and min(peaks.values()) > 0
    assert headline["matmul_peak_gflops"] == max(peaks.values())
    # Model matmuls alone are 6 x 4.33M params per token; attention and remat add to that.
    assert headline["flops_per_token"] > 6 * 4_325_376
    expected = headline["matmul_peak_gflops"] * 1e9 / headline["flops_per_token"]
    assert headline["ceiling_tokens_per_s"] == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize(
    "stage, expected", [(0, 16_000), (1, 4_000 + 1_500), (2, 2_000 + 1_750), (3, 2_000)]
)
def test_zero_ideal_bytes_follow_the_zero_paper(stage, expected):
    ideal_bytes = load_benchmark("zero_memory").ideal_bytes
    # DeepSpeed mixed-precision Adam: 2 + 2 + K=12 bytes, Ψ = 1000, N = 8.
    assert ideal_bytes(stage, 1000, 8, (2, 2, 12)) == expected


@pytest.mark.slow
def test_checkpoint_quick_run_reports_stalls_and_throughputs():
    results = run_quick("checkpoint")
    headline = results[-1]
    check_result(headline, "checkpoint")
    assert headline["unit"] == "ms stall"
    for key in ("save_MBps", "restore_MBps"):
        value = headline[key]
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (key, value)
    assert headline["ratio"] == pytest.approx(headline["baseline"] / headline["jaxspeed"], rel=1e-2)
    assert all(run["restored_equal"] for runs in headline["runs"].values() for run in runs)
