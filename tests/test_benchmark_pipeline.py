"""`benchmarks/pipeline.py --quick` runs and prints well-formed result lines (no target checked)."""

import pytest
from test_benchmarks import check_result, run_quick


@pytest.mark.slow
def test_pipeline_quick_run_prints_result_lines():
    results = run_quick("pipeline")
    for obj in results:
        check_result(obj, "pipeline")
    headline = results[-1]
    assert headline["case"].startswith("S=4 ")
    assert set(headline["bubble"]) == {"gpipe", "1f1b", "interleaved"}
    assert headline["bubble"]["gpipe"] == pytest.approx(3 / (8 + 3), abs=1e-4)  # M = 8
    assert headline["ratio"] == pytest.approx(headline["baseline"] / headline["jaxspeed"], rel=2e-2)
