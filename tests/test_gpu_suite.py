"""`benchmarks/gpu_suite.sh --dry-run`: the GPU suite checks itself on the CPU.

The dry run lowers every Pallas kernel for cuda (and compiles them with the gpu-compile
extra), lists the kernel tests the GPU run selects, and runs each GPU benchmark at tiny sizes
(kernels interpreted) with the options the GPU run uses. It runs once, in its own process;
the tests read its output folder. No speed is checked.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from numerics import mixed_rtol, program_rtol
from test_benchmarks import check_result

from jaxspeed.gpu import deviceless

ROOT = Path(__file__).resolve().parent.parent
#: The suite's benchmark parts, and the benchmark names their JSON lines carry.
PARTS = {"gpu_mfu": "gpu_mfu", "gpu_engine": "gpu_engine", "gpu_sparse_attention": "gpu_sparse_attention",
         "gpu_moe": "gpu_moe", "gpu_offload": "gpu_offload", "gpu_attention": "blocked_attention"}
#: gpu_mfu's dry run compiles for an H100 without a GPU; without the gpu-compile extra it says
#: so and prints no result line
BENCHMARKS = tuple(b for b in PARTS.values() if b != "gpu_mfu" or deviceless.available())
#: Units whose smaller figure is the better one: there ratio = baseline / jaxspeed.
LOWER_IS_BETTER = ("ms", "MiB")

#: the dry run: 35 s on 2 idle cores, nearly 2.5 minutes under load; `make test-jax-min` runs it
#: on the JAX the GPU machine has, `make test` leaves it out
pytestmark = [pytest.mark.slow, pytest.mark.gpu_dry_run]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """Runs the dry run; returns its output folder and stdout."""
    out = tmp_path_factory.mktemp("gpu_suite")
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_suite.sh", "--dry-run"], cwd=ROOT, capture_output=True,
        text=True, timeout=1800, check=False,
        env={**os.environ, "OUT": str(out), "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, f"dry run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-3000:]}"
    return out, proc.stdout


@pytest.fixture(scope="module")
def results(dry_run):
    """`results.jsonl`, grouped by benchmark, in the order printed (the headline last)."""
    out, _ = dry_run
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    grouped = {}
    for obj in lines:
        grouped.setdefault(obj["benchmark"], []).append(obj)
    return grouped


def test_every_part_ran(dry_run):
    _, stdout = dry_run
    for part in ("lowering", "compiles", "kernels", *PARTS):
        assert f"== {part}: ok" in stdout, stdout


def test_a_line_per_benchmark_whose_ratio_divides_its_two_figures(results):
    assert sorted(results) == sorted(BENCHMARKS)
    for name, objs in results.items():
        for obj in objs:
            check_result(obj, name)
            jaxspeed, baseline = obj["jaxspeed"], obj["baseline"]
            lower_is_better = obj["unit"].startswith(LOWER_IS_BETTER)
            want = baseline / jaxspeed if lower_is_better else jaxspeed / baseline
            # Both figures carry 5 significant digits, the ratio at least 3 decimals.
            assert abs(obj["ratio"] - want) <= 5e-4 + 1e-3 * want, obj


def test_kernel_tests_cover_both_kernels_in_fp32_and_bf16_with_gradients(dry_run):
    """The tests the GPU run selects (listed by the dry run) compare outputs and gradients
    (every test of `check_against_reference` and of test_moe_dispatch's `check` does)."""
    out, _ = dry_run
    ids = [line for line in (out / "kernels.log").read_text().splitlines() if "::" in line]
    attention = [i for i in ids if i.startswith("tests/test_block_sparse_attention.py::")]
    moe = [i for i in ids if i.startswith("tests/test_moe_dispatch.py::")]
    for dtype in ("fp32", "bf16"):
        assert any(f"test_pallas_matches_dense_reference_{dtype}" in i for i in attention), ids
        assert any(f"[pallas-{dtype}]" in i for i in moe), ids
    assert not any("lowers" in i for i in ids)  # the dry run's own part


def test_gpu_moe_checks_the_kernels_and_measures_against_a_copy(results):
    *bandwidth, headline = results["gpu_moe"]
    assert "interpreted" in headline["case"]
    assert [obj["case"].split()[0] for obj in bandwidth] == ["dispatch", "combine"]
    for obj in bandwidth:
        assert obj["unit"] == "TB/s" and obj["copy_ms"] > 0
    # The layers' forward chains 6 reductions (gate matmul, softmax, top-k renormalisation, two
    # expert matmuls, combine over k), 3x with the backward; the widest sums are over the
    # check's T = 2 x 32 tokens (the gate kernel's gradient). fp32: the sums' orders only.
    # bf16: each side also rounds values to bf16 on the way: the einsum layer's combine
    # weights, the hidden activations, the expert and layer outputs, and in the backward d y,
    # d h, the expert buffers' and the gate's d x, their sum, the weight gradients: 10
    # roundings at most on one chain (tests/numerics.py, point 4). A routing or slot bug moves
    # values by O(1) relative; the fp32 check, in the same run, is the tight one.
    depth = 3 * 6
    rtol = {"float32": program_rtol(width=2 * 32, depth=depth),
            "bfloat16": mixed_rtol(width=2 * 32, depth=depth, casts=10, dtype="bfloat16")}
    for key, value in headline["check_max_rel_diff"].items():
        assert value <= rtol[key.split()[0]], (key, value)


def test_gpu_engine_reports_mfu_against_a_measured_matmul(results):
    throughput, overhead = results["gpu_engine"]
    assert throughput["case"].startswith("throughput") and overhead["case"].startswith("overhead")
    assert throughput["unit"] == "TFLOP/s"
    assert throughput["mfu_vs_spec"] is None  # a CPU has no spec peak in the table
    # Full remat recomputes the forward: the hardware FLOPs exceed the model FLOPs.
    assert throughput["hardware_flops_per_step"] > throughput["model_flops_per_step"]
    assert throughput["hfu_vs_measured"] > throughput["ratio"]


def test_gpu_mfu_dry_run_predicts_bf16_and_fp8(results):
    if "gpu_mfu" not in BENCHMARKS:
        pytest.skip(deviceless.missing())
    bf16, fp8, speedup = results["gpu_mfu"]
    assert bf16["case"].startswith("bf16") and fp8["case"].startswith("fp8")
    for line in (bf16, fp8):
        assert 0 < line["predicted_mfu"] < 1 and line["predicted_step_seconds"] > 0
    assert speedup["target_ratio"] == 1.3


def test_gpu_offload_compares_each_mode_with_the_device_mode(results):
    device, all_host = results["gpu_offload"]
    assert device["case"].startswith("mode=device") and device["ratio"] == 1.0
    assert all_host["case"].startswith("mode=all_host")
    assert device["memory_source"] == all_host["memory_source"]
    assert all_host["ratio"] > 1  # offloaded params and optimizer state leave the device


def test_attention_part_times_fused_blocked_and_reference_in_bf16(results):
    (line,) = results["blocked_attention"]
    assert set(line["ms"]) == {"fused", "blocked", "reference"}
    assert "bfloat16" in line["case"]
    assert set(line["max_rel_grad_diff"]) == {"fused", "blocked"}
