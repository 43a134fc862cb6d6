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
TIMEOUT_S = 1200  # generous: most quick runs take seconds, auto_plan about 2 minutes on a 2-core AVX2 VM


@functools.cache
def quick_output(name: str) -> str:
    """Runs `benchmarks/NAME.py --quick` once (per test process); returns what it printed."""
    proc = subprocess.run(
        [sys.executable, f"benchmarks/{name}.py", "--quick"],
        cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@functools.cache
def run_quick(name: str) -> tuple[dict, ...]:
    """`benchmarks/NAME.py --quick`'s JSON lines (the last is the headline), from one run."""
    lines = quick_output(name).strip().splitlines()
    assert lines, f"{name} printed nothing"
    headline = json.loads(lines[-1])
    earlier = [json.loads(line) for line in lines[:-1] if line.startswith("{")]
    return (*earlier, headline)


def check_result(obj: dict, name: str) -> None:
    missing = [k for k in KEYS if k not in obj]
    assert not missing, f"missing keys {missing} in {obj}"
    assert obj["benchmark"] == name
    assert isinstance(obj["unit"], str) and obj["unit"]
    if obj["unit"] == "spearman":
        # rank correlations are negative when the order is reversed, as a quick run's few,
        # short plans on busy cores can be; the ratio of the predicted one to the
        # measurement's own is null when the measurement does not order the plans at all
        assert -1 <= obj["jaxspeed"] <= 1 and -1 <= obj["baseline"] <= 1, obj
        assert (obj["ratio"] is None) == (obj["baseline"] <= 0), obj
        assert obj["ratio"] is None or math.isfinite(obj["ratio"]), obj
        return
    for key in ("jaxspeed", "baseline", "ratio"):
        value = obj[key]
        assert isinstance(value, (int, float)) and math.isfinite(value), (key, value)
    assert all(obj[key] > 0 for key in ("jaxspeed", "baseline", "ratio")), obj


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    # Each quick run is run once in the suite: offload_capacity's lines are checked by
    # test_memory_sources.py (with its sources), onebit_comm's by test_benchmark_onebit_comm.py.
    [
        "zero_memory", "overhead", "sparse_attention", "onebit_convergence", "input_pipeline",
        "auto_plan", "fp8_convergence", "zero_paths",
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
    by_stage = {int(obj["case"].split()[0].removeprefix("stage=")): obj for obj in results
                if obj["case"].startswith("stage=")}
    assert sorted(by_stage) == [0, 1, 2, 3]
    state = {s: obj["bytes"]["model_state"] for s, obj in by_stage.items()}
    devices = by_stage[3]["devices"]
    assert state[3] <= state[0] / devices * 1.02
    assert state[0] > state[1] > state[2] > state[3]
    # jaxspeed's widths: fp32 params + fp32 grads + Adam m, v = 16 bytes per parameter.
    assert by_stage[0]["bytes_per_param_per_device"] == pytest.approx(16.0, rel=1e-3)
    assert results[-1]["case"].startswith("stage=3")
    source = by_stage[3]["source"]
    assert (source["params"], source["opt_state"], source["grads"]) == ("arrays", "arrays", "model")
    assert source["step_peak"] == "compiled"


@pytest.mark.slow
def test_zero_memory_compares_zero3s_two_paths_on_one_and_two_hosts():
    paths = [obj for obj in run_quick("zero_memory") if obj["case"].startswith("paths ")]
    # --quick: across 2 emulated hosts, layer by layer (the full run adds 1 host and once per step)
    assert [(obj["hosts"], obj["gather"]) for obj in paths] == [(2, "layer by layer")]
    for obj in paths:  # explicit (jaxspeed) against the sharding path (baseline), both compiled
        assert obj["jaxspeed"] > 0 and obj["baseline"] > 0
        assert obj["ratio"] == pytest.approx(obj["baseline"] / obj["jaxspeed"], rel=1e-2)


@pytest.mark.slow
def test_zero_memory_stage3_gathered_once_holds_more_than_layer_by_layer():
    """The same state; the step that gathers the whole model once peaks higher."""
    rows = {obj["stage3_gather"]: obj for obj in run_quick("zero_memory")
            if obj["stage3_gather"]}
    once, per_layer = rows["once per step"], rows["layer by layer"]
    assert once["bytes"]["model_state"] == per_layer["bytes"]["model_state"]
    assert once["bytes"]["step_peak"] > per_layer["bytes"]["step_peak"]
    assert run_quick("zero_memory")[-1] is once  # the headline


@pytest.mark.slow
def test_zero_memory_step_peak_holds_the_model_state():
    """The compiled step's peak (state, new state, scratch with the grads) ≥ the model state,
    and its arguments are the measured params and optimizer state (+ batch, step, rng)."""
    for obj in run_quick("zero_memory"):
        if not obj["case"].startswith("stage="):
            continue  # the paths' lines: compiled step peaks alone
        nbytes, compiled = obj["bytes"], obj["compiled"]
        peak = compiled["argument"] + compiled["output"] - compiled["alias"] + compiled["temp"]
        assert nbytes["step_peak"] == peak
        assert nbytes["step_peak"] >= nbytes["model_state"], obj["case"]
        not_state = compiled["argument"] - nbytes["params"] - nbytes["opt_state"]
        assert 0 <= not_state <= 0.01 * compiled["argument"], obj["case"]


def test_zero_memory_shard_bytes_counts_one_devices_shards():
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    shard_bytes = load_benchmark("zero_memory").shard_bytes
    devices = jax.devices()
    mesh = jax.make_mesh((8,), ("data",))
    upper = jax.make_mesh((4,), ("data",), devices=devices[4:])

    def put(shape, dtype, mesh, spec):
        return jax.device_put(jnp.zeros(shape, dtype), NamedSharding(mesh, spec))

    tree = {
        "split": put((16, 4), jnp.float32, mesh, P("data")),  # [2, 4] per device: 32 bytes
        "replicated": put((3,), jnp.float32, mesh, P()),  # 12 bytes
        "bf16": put((8, 8), jnp.bfloat16, mesh, P(None, "data")),  # [8, 1]: 16 bytes
        "upper": put((8,), jnp.float32, upper, P("data")),  # [2] on devices 4-7 only: 8 bytes
    }
    assert shard_bytes(tree, devices[0]) == 32 + 12 + 16
    assert shard_bytes(tree, devices[4]) == 32 + 12 + 16 + 8


def load_benchmark(name: str):
    """Imports `benchmarks/NAME.py` as a module (its pure helpers need no devices)."""
    path = ROOT / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
