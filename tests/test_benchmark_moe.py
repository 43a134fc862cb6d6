"""The MoE benchmarks run (`--quick`) and print well-formed result lines; no speed target is checked.

`benchmarks/moe_layer.py --quick` and `benchmarks/moe_dropless.py --quick` each run in their own
process from the repository root. `benchmarks/gpu_moe.py`'s CPU check runs in the GPU suite's
dry run (tests/test_gpu_suite.py).
"""

import pytest
from numerics import program_rtol
from test_benchmarks import check_result, run_quick

#: `max_rel_diff` is max |got - want| / max |want| per output or gradient: the model's atol
#: (tests/numerics.py). The layers' forward chains 6 reductions (gate matmul, softmax, top-k
#: renormalisation, two expert matmuls, combine over k), 3x with the backward; the widest sums
#: are over the tokens (the gate kernel's gradient): T = 2 x 64 in the quick moe_layer and
#: moe_dropless runs (M and the hidden sizes are no wider).
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

