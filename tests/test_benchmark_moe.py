"""The MoE benchmarks run (`--quick`) and print well-formed result lines; no speed target is checked.

`benchmarks/moe_layer.py --quick`, `benchmarks/moe_dropless.py --quick` and
`benchmarks/gpu_moe.py --quick` (its CPU check: tiny sizes, kernels interpreted) each run in
their own process from the repository root.
"""

import pytest
from numerics import mixed_rtol, program_rtol
from test_benchmarks import check_result, run_quick

#: `max_rel_diff` is max |got - want| / max |want| per output or gradient: the model's atol
#: (tests/numerics.py). The layers' forward chains 6 reductions (gate matmul, softmax, top-k
#: renormalisation, two expert matmuls, combine over k), 3x with the backward; the widest sums
#: are over the tokens (the gate kernel's gradient): T = 2 x 64 in the quick moe_layer and
#: moe_dropless runs, 2 x 32 in gpu_moe's check (M and the hidden sizes are no wider).
DEPTH = 3 * 6


@pytest.mark.slow
def test_moe_layer_quick_run_prints_result_lines():
    results = run_quick("moe_layer")
    for obj in results:
        check_result(obj, "moe_layer")
    headline = results[-1]
    assert headline["case"].startswith("E=8 ")  # the quick run's largest expert count
    assert headline["ratio"] == pytest.approx(headline["baseline"] / headline["jaxspeed"],
                                              rel=1e-2)
    for obj in results:  # the layers agreed before timing; memory is deterministic
        assert obj["max_rel_diff"] <= program_rtol(width=2 * 64, depth=DEPTH)
        assert obj["peak_MiB"]["jaxspeed"] < obj["peak_MiB"]["einsum"]
        assert obj["target_ratio"] == 10.0


@pytest.mark.slow
def test_moe_dropless_quick_run_prints_a_result_line():
    (headline,) = run_quick("moe_dropless")
    check_result(headline, "moe_dropless")
    assert headline["ratio"] == pytest.approx(headline["baseline"] / headline["jaxspeed"],
                                              rel=1e-2)
    # checked equal to ragged_dot before timing
    assert headline["max_rel_diff"] <= program_rtol(width=2 * 64, depth=DEPTH)
    # The busiest expert fits one of the static block sizes, none of which is below it.
    assert headline["block_rows"] >= headline["busiest_expert_rows"]


@pytest.mark.slow
def test_gpu_moe_cpu_check_prints_the_layer_line():
    results = run_quick("gpu_moe")
    for obj in results:
        check_result(obj, "gpu_moe")
    headline = results[-1]
    assert "interpreted" in headline["case"]
    # fp32: the sums' orders only. bf16: each side also rounds values to bf16 on the way: the
    # einsum layer's combine weights, the hidden activations, the expert and layer outputs, and
    # in the backward d y, d h, the expert buffers' and the gate's d x, their sum, the weight
    # gradients: 10 roundings at most on one chain (point 4). A routing or slot bug moves
    # values by O(1) relative; the fp32 check, in the same run, is the tight one.
    rtol = {"float32": program_rtol(width=2 * 32, depth=DEPTH),
            "bfloat16": mixed_rtol(width=2 * 32, depth=DEPTH, casts=10, dtype="bfloat16")}
    for key, value in headline["check_max_rel_diff"].items():
        assert value <= rtol[key.split()[0]], (key, value)
