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
        assert obj["max_rel_diff"] <= 1e-4 and obj["native_norm_rel_diff"] <= 1e-3
        assert obj["peak_MiB"]["jaxspeed"] < obj["peak_MiB"]["einsum"]
        assert obj["native_kernel"].startswith("native CPU kernel")  # built here, in use
        assert obj["ratio_xla_dot"] == pytest.approx(
            obj["baseline"] / obj["jaxspeed_xla_dot_ms"], rel=1e-2)


@pytest.mark.slow
def test_moe_dropless_quick_run_prints_a_result_line():
    (headline,) = run_quick("moe_dropless")
    check_result(headline, "moe_dropless")
    assert headline["native_kernel"].startswith("native CPU kernel")
    assert headline["max_rel_diff_out"] <= 1e-4 and headline["norm_rel_diff_grads"] <= 1e-3


@pytest.mark.slow
def test_gpu_moe_cpu_check_prints_the_layer_line():
    results = run_quick("gpu_moe")
    for obj in results:
        check_result(obj, "gpu_moe")
    headline = results[-1]
    assert "interpreted" in headline["case"]
    assert all(v <= 5e-2 for v in headline["check_max_rel_diff"].values())
