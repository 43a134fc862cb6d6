"""Every memory figure says where it comes from: compiled (XLA), arrays (shardings) or model."""

import functools
from types import SimpleNamespace

import pytest

import jaxspeed as js
from jaxspeed.cost.memory import (
    HOST_NOTE, SOURCES, STREAM_NOTE, host_bytes, memory_report, sharded_bytes,
)
from jaxspeed.cost.plan_table import format_memory
from test_benchmarks import check_result, load_benchmark, quick_output, run_quick

TINY = [
    "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64",
    "model.max_seq_len=16", "data.seq_len=16", "data.max_bytes=200000", "train_batch_size=16",
    "mesh.data=8", "zero_optimization.stage=3",
]
OFFLOAD = [
    "zero_optimization.offload_optimizer.device=cpu", "zero_optimization.offload_param.device=cpu",
]


@functools.cache
def engine(offload: bool):
    return js.initialize(js.load_config(None, overrides=[*TINY, *(OFFLOAD if offload else [])]))


def reference(engine) -> dict[str, dict[str, int]]:
    """Each per-device figure as its source would give it, computed here from scratch."""
    analysis = engine.compile_train_step().memory_analysis()
    total = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes
             - analysis.alias_size_in_bytes + analysis.temp_size_in_bytes)
    host = (analysis.host_argument_size_in_bytes + analysis.host_output_size_in_bytes
            - analysis.host_alias_size_in_bytes + analysis.host_temp_size_in_bytes)
    state = engine.abstract_state()
    return {
        "compiled": {
            "temp": analysis.temp_size_in_bytes, "total": total, "device": total, "host": host,
        },
        "arrays": {
            "params": sharded_bytes(state.params), "grads": engine.plan.bytes_per_device("grad"),
            "opt_state": sharded_bytes(state.opt_state), "host": host_bytes(state),
        },
    }


def assert_figures_match_their_sources(engine, report):
    want = reference(engine)
    per, sources = report["per_device_bytes"], report["sources"]
    assert set(sources) == set(per) and set(sources.values()) <= set(SOURCES)
    for name, source in sources.items():
        if source != "model":
            assert per[name] == want[source][name], (name, source)
    if report["device_model"]:
        assert sum(row["bytes"] for row in report["device_model"]) == per["device"]
    for row in report["device_model"]:
        if row["source"] == "compiled":
            assert row["bytes"] == want["compiled"]["total"]


def test_offload_plan_on_cpu_labels_host_and_device_rows():
    report = engine(True).memory_report()
    assert report["sources"] == {
        "params": "arrays", "grads": "arrays", "opt_state": "arrays",
        "temp": "compiled", "total": "compiled", "device": "model", "host": "arrays",
    }
    assert_figures_match_their_sources(engine(True), report)
    terms = {row["term"]: (row["bytes"], row["source"]) for row in report["device_model"]}
    per = report["per_device_bytes"]
    assert terms["compiled_total"] == (per["total"], "compiled")
    assert terms["host_state"] == (-per["host"], "arrays")
    assert terms["streamed_grads"][0] < 0 and terms["fetched"][0] > 0
    assert {terms[t][1] for t in ("fetched", "update", "streamed_grads")} == {"model"}
    assert per["device"] < per["total"]  # the compiled total is kept, apart from the model
    assert report["notes"] == [HOST_NOTE, STREAM_NOTE]


def test_plain_plan_is_all_compiled_beside_the_array_estimates():
    report = engine(False).memory_report()
    assert report["sources"] == {
        "params": "arrays", "grads": "arrays", "opt_state": "arrays",
        "temp": "compiled", "total": "compiled", "device": "compiled", "host": "compiled",
    }
    assert_figures_match_their_sources(engine(False), report)
    assert report["device_model"] == [] and report["notes"] == []


class SeparateHost:
    """`engine`, but its compiled step reports the host-resident state apart (as XLA on GPU)."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def compile_train_step(self):
        analysis = self._engine.compile_train_step().memory_analysis()
        names = ("argument", "output", "alias", "temp", "generated_code")
        fields = {f"{n}_size_in_bytes": getattr(analysis, f"{n}_size_in_bytes") for n in names}
        host = host_bytes(self._engine.abstract_state())
        fields |= {f"host_{n}_size_in_bytes": host for n in ("argument", "output", "alias")}
        fields["host_temp_size_in_bytes"] = 0
        return SimpleNamespace(memory_analysis=lambda: SimpleNamespace(**fields))


def test_separate_host_memory_is_read_from_the_compiled_step_without_a_model():
    report = memory_report(SeparateHost(engine(True)))
    per = report["per_device_bytes"]
    assert report["sources"]["device"] == report["sources"]["host"] == "compiled"
    assert per["device"] == per["total"]
    assert per["host"] == host_bytes(engine(True).abstract_state())
    assert report["device_model"] == [] and report["notes"] == []


def row(lines, name):
    (line,) = [line for line in lines if line.startswith(name)]
    return line


def test_the_text_table_shows_each_rows_source():
    offload = format_memory(engine(True).memory_report())
    assert offload[0].split()[-1] == "source"
    assert row(offload, "  device memory needed").endswith("  model")
    assert row(offload, "  of which in host memory").endswith("  arrays")
    assert row(offload, "total").endswith("  compiled-cpu")
    assert row(offload, "    - streamed grads in host memory").endswith("  model")
    assert row(offload, "    = total").endswith("  compiled-cpu")
    plain = format_memory(engine(False).memory_report())
    assert row(plain, "  device memory needed").endswith("  compiled-cpu")
    assert not [line for line in plain if line.endswith("  model")]


@pytest.mark.parametrize(
    ("offload_source", "ratio_source"), [("compiled", "compiled"), ("model", "model")],
    ids=["separate-host-memory", "cpu"],
)
def test_offload_capacity_ratio_source(offload_source, ratio_source):
    log = [
        {"offload": False, "sources": {"device": "compiled"}},
        {"offload": True, "sources": {"device": offload_source}},
    ]
    source, lines = load_benchmark("offload_capacity").describe_sources(log)
    assert source == ratio_source
    assert f"ratio source: {ratio_source}" in "\n".join(lines)


@pytest.mark.slow
def test_offload_capacity_quick_json_names_its_sources():
    """`offload_capacity.py --quick` prints a well-formed result line (the suite's one run of
    it), whose every figure names its source."""
    (headline,) = run_quick("offload_capacity")
    check_result(headline, "offload_capacity")
    assert headline["sources"] == {
        "jaxspeed": "arrays", "baseline": "arrays", "ratio": "model",
        "device_bytes": {"offload": "model", "baseline": "compiled"},
        "host_bytes_offload": "arrays", "compiled_total_bytes": "compiled",
    }
    assert headline["compiled_total_bytes"]["offload"] > headline["device_bytes"]["offload"]
    stdout = quick_output("offload_capacity")
    assert "ratio source: model" in stdout and "(source: model)" in stdout
