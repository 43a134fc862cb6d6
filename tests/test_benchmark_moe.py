"""The MoE benchmarks run (`--quick`) and print well-formed result lines; no speed target is checked.

`benchmarks/moe_layer.py --quick`, `benchmarks/moe_dropless.py --quick` and
`benchmarks/gpu_moe.py --quick` (its CPU check: tiny sizes, kernels interpreted) each run in
their own process from the repository root.
"""

import pytest
from test_benchmarks import check_result, run_quick


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
        assert obj["max_rel_diff"] <= 1e-4
        assert obj["peak_MiB"]["jaxspeed"] < obj["peak_MiB"]["einsum"]
        assert obj["target_ratio"] == 10.0


@pytest.mark.slow
def test_moe_dropless_quick_run_prints_a_result_line():
    (headline,) = run_quick("moe_dropless")
    check_result(headline, "moe_dropless")
    assert headline["ratio"] == pytest.approx(headline["baseline"] / headline["jaxspeed"],
                                              rel=1e-2)
    assert headline["max_rel_diff"] <= 1e-4  # checked equal to ragged_dot before timing
    # The busiest expert fits one of the static block sizes, none of which is below it.
    assert headline["block_rows"] >= headline["busiest_expert_rows"]


@pytest.mark.slow
def test_gpu_moe_cpu_check_prints_the_layer_line():
    results = run_quick("gpu_moe")
    for obj in results:
        check_result(obj, "gpu_moe")
    headline = results[-1]
    assert "interpreted" in headline["case"]
    assert all(v <= 5e-2 for v in headline["check_max_rel_diff"].values())
