"""`benchmarks/onebit_comm.py --quick`: its figures are the compiled steps' collective bytes."""

import pytest
from test_benchmarks import check_result, load_benchmark, run_quick

import jaxspeed as js
from jaxspeed.models.gpt import count_params
from jaxspeed.cost.hlo import COLLECTIVES, collective_bytes

STEPS = ("adam", "warmup", "compressed")


def adam_engine(bench):
    return js.initialize(
        bench.bench_config({"type": "Adam", "params": {"lr": 1e-3}}, bench.QUICK_MODEL)
    )


@pytest.fixture(scope="module")
def headline():
    result = run_quick("onebit_comm")[-1]
    check_result(result, "onebit_comm")
    return result


@pytest.mark.slow
def test_ratio_is_adam_collective_bytes_over_compressed_onebit_bytes(headline):
    """Compiles the two steps again, here, and sums the profiler's bytes of every collective."""
    bench = load_benchmark("onebit_comm")
    adam = adam_engine(bench)
    onebit = js.initialize(bench.bench_config(
        {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": bench.FREEZE_STEP}},
        bench.QUICK_MODEL,
    ))
    adam_bytes = collective_bytes(adam.compile_train_step().as_text(), num_devices=8)["total"]
    compressed = onebit.compile_train_step(step=bench.FREEZE_STEP)
    onebit_bytes = collective_bytes(compressed.as_text(), num_devices=8)["total"]
    assert (headline["baseline"], headline["jaxspeed"]) == (adam_bytes, onebit_bytes)
    assert headline["ratio"] == round(adam_bytes / onebit_bytes, 3)


@pytest.mark.slow
def test_breakdown_sums_to_the_totals(headline):
    for step in STEPS:
        totals = headline["collective_bytes"][step]
        by_kind = headline["collectives"][step]
        ops = headline["collective_ops"][step]
        assert set(by_kind) <= set(COLLECTIVES) and by_kind, step
        assert totals["total"] == sum(totals[k] for k in COLLECTIVES)
        for kind in COLLECTIVES:
            of_kind = [op for op in ops if op["kind"] == kind]
            row = by_kind.get(kind, {"count": 0, "bytes": 0})
            assert row["bytes"] == totals[kind] == sum(op["bytes"] for op in of_kind), (step, kind)
            assert row["count"] == sum(op["count"] for op in of_kind) >= (1 if of_kind else 0)
    assert headline["baseline"] == headline["collective_bytes"]["adam"]["total"]
    assert headline["jaxspeed"] == headline["collective_bytes"]["compressed"]["total"]


@pytest.mark.slow
def test_secondary_figures_follow_from_the_measured_bytes(headline):
    total = {step: headline["collective_bytes"][step]["total"] for step in STEPS}
    assert headline["gradient_allreduce_ratio"] == round(total["warmup"] / total["compressed"], 3)
    f = headline["warmup_fraction"]
    per_step = f * total["warmup"] + (1 - f) * total["compressed"]
    assert headline["whole_run_ratio"] == pytest.approx(total["adam"] / per_step, abs=1e-3)
    assert set(headline["step_ms"]) == {"adam", "compressed"}
    assert set(headline["sources"]) >= {"ratio", "whole_run_ratio", "step_ms"}


@pytest.mark.slow
def test_compressed_step_moves_about_one_bit_per_parameter(headline):
    bench = load_benchmark("onebit_comm")
    params = count_params(adam_engine(bench).abstract_state().params)
    warmup, compressed = (headline["collective_bytes"][s] for s in ("warmup", "compressed"))
    # Warm-up: the fp32 gradients in one all-reduce (plus the loss and grad-norm scalars).
    assert 4 * params <= warmup["all-reduce"] <= 4 * params + 64
    # After the freeze: sign bits (+ one fp32 scale per leaf and chunk) to and from every peer.
    for kind in ("all-to-all", "all-gather"):
        assert params / 8 <= compressed[kind] <= params / 8 * 1.05, kind
    assert compressed["all-reduce"] <= 16 and compressed["reduce-scatter"] == 0
