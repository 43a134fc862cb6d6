"""`benchmarks/long_context.py`: its length search, and `--quick` prints well-formed result lines
(no target checked)."""

import pytest
from numerics import gpt_rtol
from test_benchmarks import check_result, load_benchmark, run_quick

SETUP = {"granule": 64, "start": 1024, "max_seq": 2**20}


def search(monkeypatch, bytes_of, budget, **setup):
    """`longest_fitting` with a probe whose device bytes are `bytes_of(seq)`; (result, log)."""
    bench = load_benchmark("long_context")
    monkeypatch.setattr(bench, "measure", lambda seq, variant, *, setup: {
        "seq": seq, "device": bytes_of(seq), "temp": 0, "state": 0, "seconds": 0.0})
    log = []
    best = bench.longest_fitting("ulysses", budget, setup={**SETUP, **setup}, log=log)
    return best, log


@pytest.mark.parametrize("bytes_of, budget, want", [
    (lambda seq: 1000 * seq, 1000 * 300_000, 299_968),  # linear: doubles up, then bisects
    (lambda seq: 32 * seq * seq, 32 * 3_900**2, 3_840),  # quadratic
    (lambda seq: 1000 * seq, 1000 * 200, 192),  # halves down from start
    (lambda seq: 1000 * seq, 1000 * 1024, 1024),  # exactly the start
])
def test_search_finds_the_longest_fitting_multiple_of_the_granule(
        monkeypatch, bytes_of, budget, want):
    best, log = search(monkeypatch, bytes_of, budget)
    assert best["seq"] == want and not best["capped"]
    assert all(row["seq"] % SETUP["granule"] == 0 for row in log)
    assert all(row["fits"] == (row["seq"] <= want) for row in log)
    assert want + SETUP["granule"] in {row["seq"] for row in log}  # the next length was probed
    assert len(log) <= 2 * (want // SETUP["granule"]).bit_length() + 2


def test_search_stops_at_max_seq_and_says_so(monkeypatch):
    best, log = search(monkeypatch, lambda seq: seq, 2**40, max_seq=5 * 1024)
    assert best["seq"] == 5 * 1024 and best["capped"]
    assert [row["seq"] for row in log] == [1024, 2048, 4096, 5 * 1024]


def test_search_stops_when_nothing_fits(monkeypatch):
    with pytest.raises(SystemExit, match="not even seq 64"):
        search(monkeypatch, lambda seq: seq, 10)


@pytest.mark.slow
def test_quick_run_prints_lengths_and_step_times():
    *earlier, headline = run_quick("long_context")
    for obj in (*earlier, headline):
        check_result(obj, "long_context")
    assert headline["unit"] == "tokens"
    assert headline["jaxspeed"] > headline["baseline"]
    assert headline["ratio"] == round(headline["jaxspeed"] / headline["baseline"], 3)
    assert headline["sparse_ratio"] == round(headline["sparse"] / headline["baseline"], 3)
    assert headline["ring_ratio"] == round(headline["ring"] / headline["baseline"], 3)
    assert set(headline["device_bytes"]) == {"baseline", "ulysses", "ring", "sparse"}
    assert all(b <= headline["budget_bytes"] for b in headline["device_bytes"].values())
    (step,) = earlier
    assert step["unit"] == "tokens/s" and step["case"].startswith("step_time ")
    assert set(step["tokens_per_s"]) == {"ulysses", "ring", "sequence1"}
    # one sequence per step over sequence=8; one per device with sequence=1 (data=8)
    tokens = step["tokens_per_step"]
    assert tokens["sequence1"] == 8 * tokens["ulysses"] == 8 * tokens["ring"]
    # the same sequence and initial params: one loss, computed by Ulysses and by ring
    quick = load_benchmark("long_context").QUICK
    rtol = gpt_rtol(tokens=tokens["ulysses"], d_model=quick["d_model"], d_ff=quick["d_ff"],
                    n_layers=quick["n_layers"], vocab=quick["vocab"])
    loss = step["first_loss"]
    assert loss["ring"] == pytest.approx(loss["ulysses"], rel=rtol)
