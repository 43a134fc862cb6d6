"""Cluster descriptions: the presets, one-line errors, YAML round trips, and `calibrate`."""

import math

import jax
import pytest
import yaml

from jaxspeed.autoplan import calibrate as calibrate_module
from jaxspeed.autoplan.calibrate import QUICK, calibrate, main
from jaxspeed.config.cluster import (
    PRESETS,
    Cluster,
    available_presets,
    load_cluster,
    save_cluster,
)
from jaxspeed.errors import ConfigError, JaxspeedError

DEVICES = {"8xh100-nvlink": 8, "dgx-h100-ib-x16": 128, "v100-32g-x800": 800, "8xa100-10gbe-x8": 64}


def _preset_dict(name: str) -> dict:
    return yaml.safe_load((PRESETS / f"{name}.yaml").read_text())


def test_available_presets():
    assert available_presets() == sorted(DEVICES)


@pytest.mark.parametrize("name", sorted(DEVICES))
def test_preset_loads_with_its_device_count(name):
    cluster = load_cluster(name)
    assert cluster.name == name
    assert cluster.devices == DEVICES[name]
    assert cluster.device_memory_bytes >= 32 * 2**30
    assert cluster.host_memory_bytes > cluster.device_memory_bytes
    assert cluster.peak_flops("bf16") > cluster.peak_flops("fp32") > 0
    assert cluster.intra_host.bandwidth_gbps > cluster.inter_host.bandwidth_gbps > 0


def test_preset_figures():
    v100 = load_cluster("v100-32g-x800")
    assert (v100.hosts, v100.devices_per_host) == (50, 16)
    assert v100.peak_flops("float16") == v100.peak_flops("bfloat16") == 125e12
    assert v100.inter_host.bandwidth_gbps == 800 / 8 / 16  # 8 x 100 Gb/s per 16-GPU node
    slow = load_cluster("8xa100-10gbe-x8")
    assert slow.inter_host.bandwidth_gbps == pytest.approx(1.25 / 8)  # one 10 GbE NIC, 8 GPUs
    assert slow.peak_flops("float32") == 156e12
    assert load_cluster("8xh100-nvlink").device_memory_bytes == 80 * 2**30
    # PCIe to the host, shared by two GPUs per switch: Gen3 x16 (16 GB/s) on a DGX-2
    assert v100.host_link.bandwidth_gbps == 16 / 2
    assert all(load_cluster(n).host_link.bandwidth_gbps < load_cluster(n).intra_host.bandwidth_gbps
               for n in available_presets())


def test_load_by_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text((PRESETS / "8xh100-nvlink.yaml").read_text())
    assert load_cluster(path) == load_cluster(str(path)) == load_cluster("8xh100-nvlink")


def test_unknown_preset_is_one_line_naming_the_presets():
    with pytest.raises(ConfigError) as info:
        load_cluster("8xh100")
    message = str(info.value)
    assert "\n" not in message
    assert "did you mean '8xh100-nvlink'" in message
    assert all(name in message for name in DEVICES)


def test_zero_bandwidth_is_one_line_naming_the_key(tmp_path):
    raw = _preset_dict("8xa100-10gbe-x8")
    raw["inter_host"]["bandwidth_gbps"] = 0
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    message = str(info.value)
    assert "\n" not in message
    assert message == f"cluster {path}: inter_host.bandwidth_gbps must be > 0, got 0"


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        (("intra_host", "bandwith_gbps"), 1.0, "intra_host.bandwith_gbps is not a key (did you "
                                               "mean 'bandwidth_gbps'?)"),
        (("efficiency",), 1.5, "efficiency must be <= 1, got 1.5"),
        (("hosts",), "2", "hosts: Input should be a valid integer, got '2'"),
        (("device_memory",), "80 parsecs", "device_memory: cannot parse byte size '80 parsecs'"),
        (("peak_tflops", "fp32"), -1, "peak_tflops.fp32 must be > 0, got -1"),
    ],
)  # fmt: skip
def test_bad_value_names_key_and_value(tmp_path, key, value, expected):
    raw = _preset_dict("8xh100-nvlink")
    section = raw
    for part in key[:-1]:
        section = section[part]
    section[key[-1]] = value
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="^cluster ") as info:
        load_cluster(path)
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("key", ["inter_host", "host_link"])
def test_missing_key_is_named(tmp_path, key):
    raw = _preset_dict("8xh100-nvlink")
    del raw[key]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=f"{key} is required"):
        load_cluster(path)


def test_peak_flops_rejects_unknown_dtype():
    with pytest.raises(ConfigError, match="'int8'.*accepted: bf16"):
        load_cluster("8xh100-nvlink").peak_flops("int8")


@pytest.mark.parametrize("name", sorted(DEVICES))
def test_save_load_round_trip(tmp_path, name):
    cluster = load_cluster(name)
    path = save_cluster(cluster, tmp_path / "sub" / f"{name}.yaml", comment="a\nb")
    assert path.read_text().startswith("# a\n# b\n")
    assert load_cluster(path) == cluster


def test_calibrate_measures_the_cpu_devices(tmp_path):
    cluster = main(tmp_path / "here.yaml", **QUICK)
    assert isinstance(cluster, Cluster)
    assert (cluster.hosts, cluster.devices_per_host) == (1, 8)
    figures = [
        cluster.peak_flops("bf16"),
        cluster.peak_flops("fp32"),
        cluster.intra_host.bandwidth_gbps,
        cluster.intra_host.latency_us,
        cluster.device_memory_bytes,
        cluster.host_memory_bytes,
        cluster.memory_bandwidth_gbps,
        cluster.host_link.bandwidth_gbps,
        cluster.update_bandwidth.plain_gbps,
        cluster.update_bandwidth.compressed_gbps,
    ]
    assert all(math.isfinite(value) and value > 0 for value in figures), figures
    assert math.isfinite(cluster.intra_host.overhead_us) and cluster.intra_host.overhead_us >= 0
    assert 0 < cluster.efficiency <= 1
    assert cluster.inter_host == cluster.intra_host
    assert cluster.device_memory_bytes * 8 <= cluster.host_memory_bytes
    assert load_cluster(tmp_path / "here.yaml") == cluster


def test_overhead_probe_is_a_chain_of_separate_gathers():
    """The overhead probe runs `BURST` all-gathers one after another (none merged away), and
    a collective's overhead is its share of the burst beyond the fastest lone one."""
    from jaxspeed.cost.hlo import collectives

    mesh = jax.make_mesh((8,), ("devices",), axis_types=(jax.sharding.AxisType.Explicit,))
    fn, args = calibrate_module._gather_probe(mesh, 1, burst=calibrate_module.BURST)
    ops = collectives(fn.lower(*args).compile().as_text(), num_devices=8)
    assert [op.kind for op in ops] == ["all-gather"] * calibrate_module.BURST
    burst = calibrate_module.BURST
    assert calibrate_module._overhead(burst * 3e-3, 1e-3) == pytest.approx(2e-3)
    assert calibrate_module._overhead(burst * 1e-3, 2e-3) == 0.0  # never negative


def test_large_gathers_between_hosts_go_in_pieces_of_at_most_a_mib():
    piece, pieces = calibrate_module._pieces(2**22, 2)  # 16 MiB of floats over 2 hosts
    assert (piece, pieces) == (calibrate_module.PIECE, 8)
    assert calibrate_module._pieces(1000, 2) == (500, 1)
    piece, pieces = calibrate_module._pieces(3 * calibrate_module.PIECE + 1, 1)
    assert pieces == 4 and piece * pieces >= 3 * calibrate_module.PIECE + 1
    assert piece <= calibrate_module.PIECE


def test_calibrate_needs_two_devices():
    with pytest.raises(JaxspeedError, match="at least 2 devices"):
        calibrate(jax.devices()[:1], **QUICK)


def test_calibrate_rejects_bad_sizes():
    with pytest.raises(JaxspeedError, match="repeats must be a positive number, got 0"):
        calibrate(repeats=0)


def test_calibrate_times_every_figure_once_a_round_after_a_warm_up_round(monkeypatch):
    calls = []
    clock = iter(range(1000))
    monkeypatch.setattr(calibrate_module.time, "perf_counter", lambda: next(clock) ** 2)

    def probe(name):
        return (lambda: calls.append(name)), ()

    medians = calibrate_module._interleaved_medians({"a": probe("a"), "b": probe("b")}, 3)
    # one compiling call each, an untimed round, then 3 rounds, each timing a and b once
    assert calls == ["a", "b"] + ["a", "b"] * 4
    # round r times a over perf_counter ticks 4r, 4r+1 and b over 4r+2, 4r+3 (squared, so
    # later rounds take longer); the untimed round 0 is left out of the medians
    a = [(4 * r + 1) ** 2 - (4 * r) ** 2 for r in (1, 2, 3)]
    b = [(4 * r + 3) ** 2 - (4 * r + 2) ** 2 for r in (1, 2, 3)]
    assert medians == {"a": a[1], "b": b[1]}
    # a latency probe keeps its fastest round: stalls only add to a tiny message's time
    clock = iter(range(1000))
    medians = calibrate_module._interleaved_medians({"a": probe("a"), "b_tiny": probe("b")}, 3)
    assert medians == {"a": a[1], "b_tiny": b[0]}
