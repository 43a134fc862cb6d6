"""The planner's byte model (`autoplan.traffic`), gloo's flat algorithms on hosts
(`gloo.link_load`), the predicted step of `plan --cluster` and the ZeRO++ / 1-bit ranking."""

import collections
import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest

from jaxspeed.autoplan import traffic
from jaxspeed.autoplan.estimate import estimate, param_counts
from jaxspeed.autoplan.predict import PREDICTED_KEYS, onebit_alternatives
from jaxspeed.autoplan.space import from_config
from jaxspeed.config import load_config
from jaxspeed.config.cluster import Cluster, load_cluster, save_cluster
from jaxspeed.network import gloo, placement
from jaxspeed.network.links import collective_seconds
from jaxspeed.zero.step import GLOO_BUCKET

TINY = ["model.n_layers=2", "model.d_model=64", "model.d_ff=256", "data.seq_len=32",
        "model.max_seq_len=32", "train_batch_size=8"]


def _config(*overrides, data=8):
    return load_config("configs/gpt_tiny.yaml", overrides=[f"mesh.data={data}", *TINY, *overrides])


def _slow(hosts=2, per_host=2, collectives="gloo"):
    """Two hosts on a 100 Mbit/s link (12.5 MB/s per host), each device a slow CPU core."""
    return Cluster(
        name="slow", hosts=hosts, devices_per_host=per_host, device_memory="8GiB",
        peak_tflops={"bf16": 0.05, "fp32": 0.05}, efficiency=0.5, memory_bandwidth_gbps=5.0,
        intra_host={"bandwidth_gbps": 1.0, "latency_us": 50.0},
        inter_host={"bandwidth_gbps": 0.0125 / per_host, "latency_us": 200.0},
        host_link={"bandwidth_gbps": 5.0, "latency_us": 10.0}, host_memory="16GiB",
        collectives=collectives,
    )


# -- gloo's flat algorithms, by hand -----------------------------------------------------------

B = 1200.0


@pytest.mark.parametrize("kind, order, cross, intra, rounds", [
    # host-major ring 0-1-2-3: one edge per direction crosses, 2(g-1)/g B on it
    ("all-reduce", [0, 1, 2, 3], 1.5 * B, 1.5 * B, 6),
    # data-major ring 0-2-1-3: every edge crosses, two leave each host
    ("all-gather", [0, 2, 1, 3], 2 * 0.75 * B, 0.0, 3),
    ("all-gather", [0, 1, 2, 3], 0.75 * B, 0.75 * B, 3),
    # recursive halving: B/2 to rank^1 (same host), then B/4 to rank^2 (the other host),
    # twice; then ranks 1 and 2 swap their blocks (B/4), across hosts
    ("reduce-scatter", [0, 1, 2, 3], 2 * B / 4 + B / 4, B / 2, 3),
    ("reduce-scatter", [0, 2, 1, 3], 2 * B / 2 + B / 4, B / 4, 3),
    # two ranks: one halving step, no block to move
    ("reduce-scatter", [0, 2], B / 2, 0.0, 1),
    # direct: each device sends B/4 to each of the other host's two devices
    ("all-to-all", [0, 1, 2, 3], 4 * B / 4, B / 4, 3),
])
def test_link_load_by_hand(kind, order, cross, intra, rounds):
    load = gloo.link_load(kind, B, [order], devices_per_host=2)
    assert load == gloo.LinkLoad(pytest.approx(cross), pytest.approx(intra), rounds, True)


def test_ordered_groups_follow_the_axes_order():
    shape = {"host": 2, "data": 2}
    assert placement.ordered_groups(("host", "data"), shape) == [[0, 1, 2, 3]]
    assert placement.ordered_groups(("data", "host"), shape) == [[0, 2, 1, 3]]
    assert placement.ordered_groups(("host",), shape) == [[0, 2], [1, 3]]


def test_flat_seconds_is_the_busiest_link_plus_a_latency_a_round():
    cluster = _slow()
    load = gloo.link_load("all-reduce", 12.5e6, [[0, 1, 2, 3]], devices_per_host=2)
    seconds = gloo.flat_seconds(load, devices_per_host=2, intra=cluster.intra_host,
                                inter=cluster.inter_host)
    assert seconds == pytest.approx(1.5 + 6 * 200e-6)  # 1.5 x 12.5 MB over 12.5 MB/s
    # a calibrated link's fixed cost a collective, once, whatever the rounds
    inter = cluster.inter_host.model_copy(update={"overhead_us": 3000.0})
    with_overhead = gloo.flat_seconds(load, devices_per_host=2, intra=cluster.intra_host,
                                      inter=inter)
    assert with_overhead == pytest.approx(seconds + 3e-3)
    assert collective_seconds("all-gather", 1e6, 4, inter) == pytest.approx(
        collective_seconds("all-gather", 1e6, 4, cluster.inter_host) + 3e-3)


# -- the byte model against hand counts and the compiled step ------------------------------------


def _params(config):
    c = param_counts(config)
    return config.model.n_layers * (c["layer_matmul"] + c["layer_norm"]), c["embed"] + c["final_norm"]


def _sum(transfers, **match):
    return sum(t.nbytes * t.count for t in transfers
               if all(getattr(t, k) == v for k, v in match.items()))


def test_zero0_and_onebit_bytes_by_hand():
    config = _config(data=4)
    plan = from_config(config, {"host": 2, "data": 2})
    layers, other = _params(config)
    moved = traffic.step_transfers(config, plan, hosts=2)
    assert _sum(moved, kind="all-reduce", axes=("host", "data")) == 4 * (layers + other)
    onebit = _config("optimizer.type=OneBitAdam", "optimizer.params.freeze_step=2", "steps=10", data=4)
    moved = traffic.step_transfers(onebit, plan, hosts=2)
    assert {t.kind for t in moved} == {"all-to-all", "all-gather"}
    leaves = config.model.n_layers * traffic.LAYER_LEAVES + traffic.OTHER_LEAVES
    padded = math.ceil((layers + other) / leaves / 32) * 32 * leaves  # 8 x 4 workers
    assert _sum(moved, kind="all-gather") == padded / 8 + 4 * leaves * 4


def test_zeropp_bytes_by_hand():
    config = _config("zero_optimization.stage=3", data=8)
    plan = from_config(config, {"host": 2, "data": 4})
    layers, other = _params(config)
    params = layers + other
    plain = traffic.step_transfers(config, plan, hosts=2)
    assert _sum(plain, kind="all-gather", axes=("data", "host")) == pytest.approx(4 * params)
    assert _sum(plain, kind="reduce-scatter", axes=("data", "host")) == pytest.approx(4 * params)
    hpz = traffic.step_transfers(config, dataclasses.replace(plan, hpz=True), hosts=2)
    # the host stage gathers 2 of the 8 shards: a quarter of the params
    assert _sum(hpz, kind="all-gather", axes=("host",)) == pytest.approx(4 * params / 4)
    assert _sum(hpz, kind="reduce-scatter", axes=("host",)) == pytest.approx(4 * params / 4)
    qw = traffic.step_transfers(config, dataclasses.replace(plan, quantized_weights=True), hosts=2)
    # int8 and a scale a block of 256, each leaf padded to whole blocks (< 3% here)
    assert _sum(qw, kind="all-gather") == pytest.approx(params * (1 + 4 / 256), rel=0.03)
    qg = traffic.step_transfers(config, dataclasses.replace(plan, quantized_gradients=True), hosts=2)
    # int4 inside the host over the whole gradient, then over hosts a quarter of it
    assert _sum(qg, kind="all-to-all", axes=("data",)) == pytest.approx(params / 2 * (1 + 8 / 256), rel=0.03)
    # across hosts: each leaf's quarter in int4, whole blocks of 256 (128 bytes + a 4-byte scale)
    by_leaf = [(layers / 8 / 4, 8), (other / 2 / 4, 2)]
    assert _sum(qg, kind="all-to-all", axes=("host",)) == sum(
        math.ceil(n / 256) * 132 * leaves for n, leaves in by_leaf)


def test_gloo_reduce_scatters_in_pieces_and_quantized_collectives_in_pairs():
    """Over gloo `max_reduce_scatter_elements: auto` cuts a leaf's reduce-scatter into pieces
    (the same bytes in more collectives, each paying its latency); a quantized gather or
    all-to-all is two collectives, the values and the scales."""
    # the tiny GPT as configured (no compile here): leaves of ~0.6M elements
    config = load_config("configs/gpt_tiny.yaml",
                         overrides=["mesh.data=4", "zero_optimization.stage=3"])
    plan = from_config(config, {"host": 2, "data": 2})
    whole = traffic.step_transfers(config, plan, hosts=2)
    cut = traffic.step_transfers(config, plan, hosts=2, gloo=True)
    n = [t for t in whole if t.kind == "reduce-scatter"]
    pieces = [t for t in cut if t.kind == "reduce-scatter"]
    assert _sum(pieces) == pytest.approx(_sum(n))
    assert sum(t.count for t in pieces) > sum(t.count for t in n)
    assert max(t.nbytes for t in pieces) <= 4 * GLOO_BUCKET < max(t.nbytes for t in n)
    fixed = _config("zero_optimization.stage=3",
                    "zero_optimization.max_reduce_scatter_elements=1000", data=4)
    assert all(t.nbytes <= 4000 for t in traffic.step_transfers(fixed, plan, hosts=2)
               if t.kind == "reduce-scatter")
    zeropp = dataclasses.replace(plan, quantized_weights=True, quantized_gradients=True)
    moved = traffic.step_transfers(config, zeropp, hosts=2)
    values = [t for t in moved if t.name.endswith(".values")]
    scales = [t for t in moved if t.name.endswith(".scales")]
    assert len(values) == len(scales) == len(moved) / 2
    for v, sc in zip(values, scales):
        assert (v.kind, v.axes, v.count) == (sc.kind, sc.axes, sc.count)
        assert sc.nbytes < v.nbytes


def test_zero0_bytes_match_the_compiled_step_on_two_emulated_hosts():
    from jaxspeed.network.placement import group_axes
    from jaxspeed.cost.hlo import collectives
    from jaxspeed.train.engine import initialize

    config = _config("mesh.hosts=2")
    engine = initialize(config)
    shape = dict(engine.mesh.shape)
    assert shape["host"] == 2 and shape["data"] == 4
    compiled = collections.Counter()
    for op in collectives(engine.compile_train_step().as_text(), num_devices=8):
        if op.executions > 1:  # the backward loop's per-layer reductions
            compiled[op.kind, group_axes(op.groups, shape)] += op.bytes * op.executions
    moved = traffic.step_transfers(config, from_config(config, shape), hosts=2)
    layer = next(t for t in moved if t.name == "grad_all_reduce.layers")
    assert compiled == {("all-reduce", ("host", "data")): layer.nbytes * layer.count}


def test_zero_one_adam_syncs_every_kth_step_after_its_freeze():
    config = _config("optimizer.type=AdamW", data=4)
    fake = config.model_copy(update={"steps": 40})
    params = dict(var_freeze_step=8, var_update_scaler=2, local_step_scaler=4, local_step_clipper=4)
    fake = fake.model_copy(update={"optimizer": _Opt("ZeroOneAdam", params)})
    full, onebit = traffic.zero_one_fractions(fake, 40)
    # steps 9..40: intervals 1 x4 (steps 9-12), 2 x4 (13-16), then 4: 4 + 2 + 6 = 12 syncs of 32
    assert (full, onebit) == (0.0, pytest.approx(12 / 32))
    # a run of 40 steps is priced over its second half, where throughput is measured: steps
    # 21..40 sync at 24, 28, 32, 36 and 40
    assert traffic.exchange_fractions(fake, "ZeroOneAdam") == (0.0, pytest.approx(5 / 20))
    full, onebit = traffic.zero_one_fractions(fake, 8)
    # before the freeze: variance updates at steps 1, 2 (interval 1), 4, 6, 8 (interval 2)
    assert (full, onebit) == (pytest.approx(5 / 8), pytest.approx(3 / 8))


@dataclasses.dataclass
class _Opt:
    type: str
    params_: dict

    @property
    def params(self):
        return type("P", (), self.params_)


# -- ranking on a slow link -----------------------------------------------------------------------


def test_zeropp_switches_rank_on_a_slow_link():
    config = _config("zero_optimization.stage=3", data=4)
    cluster = _slow()
    base = from_config(config, {"host": 2, "data": 2})
    times = {}
    for qw in (False, True):
        for qg in (False, True):
            for hpz in (False, True):
                plan = dataclasses.replace(base, quantized_weights=qw, quantized_gradients=qg, hpz=hpz)
                times[qw, qg, hpz] = estimate(config, plan, cluster).step_s
    assert min(times, key=times.get) == (True, True, True)
    assert max(times, key=times.get) == (False, False, False)
    for one in [(True, False, False), (False, True, False), (False, False, True)]:
        assert times[True, True, True] < times[one] < times[False, False, False]


def test_onebit_alternatives_are_reported_not_applied():
    config = _config("optimizer.type=AdamW", data=4)
    plan = from_config(config, {"host": 2, "data": 2})
    alternatives = onebit_alternatives(config, plan, _slow())
    assert [a["optimizer"] for a in alternatives] == ["OneBitAdam", "ZeroOneAdam"]
    assert all(a["speedup"] > 3 for a in alternatives)
    assert config.optimizer.type == "AdamW"
    already = _config("optimizer.type=OneBitAdam", data=4)
    assert onebit_alternatives(already, plan, _slow()) == []


def test_plan_json_has_the_predicted_step(tmp_path, capsys):
    from jaxspeed.cli import main

    path = save_cluster(_slow(per_host=4), tmp_path / "slow.yaml")
    args = [f"--set={s}" for s in TINY]
    assert main(["plan", "configs/gpt_tiny.yaml", "--cluster", str(path), "--json",
                 "--set", "mesh.data=8", *args]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    predicted = report["predicted"]
    assert set(PREDICTED_KEYS) <= set(predicted)
    assert predicted["step_seconds"] == pytest.approx(
        predicted["compute_seconds"] + predicted["comm_seconds"])
    assert predicted["tokens_per_second"] == pytest.approx(8 * 32 / predicted["step_seconds"])
    assert predicted["cross_host_bytes"] > 0
    assert report["profile"]["cross_host_bytes"]["total"] > 0  # the cluster's hosts, emulated


# -- calibrate across two processes --------------------------------------------------------------


def test_calibrate_across_two_processes_measures_the_link_between_hosts(tmp_path):
    out = tmp_path / "two.yaml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.getcwd(), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "jaxspeed.cli", "launch", "--nproc", "2", "--cpu-devices", "2",
           "--timeout", "240", "--", sys.executable, "-m", "jaxspeed.cli", "calibrate",
           "--out", str(out), "--repeats", "1", "--matmul-size", "64", "--collective-mib", "0.25"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    cluster = load_cluster(out)
    assert (cluster.hosts, cluster.devices_per_host, cluster.collectives) == (2, 2, "gloo")
    assert cluster.inter_host.bandwidth_gbps > 0 and cluster.inter_host.latency_us > 0
    assert cluster.intra_host != cluster.inter_host  # measured apart


def test_fp8_all_gather_moves_the_layers_in_one_byte_by_hand():
    """The planner prices `fp8_all_gather`: the layers gathered at each use, one byte a weight
    (their norms priced so too), the rest as gathered without it."""
    per_use = _config("zero_optimization.stage=3", "zero_optimization.max_live_parameters=0",
                      "bf16.enabled=true")
    fp8 = _config("zero_optimization.stage=3", "bf16.enabled=true", "fp8.enabled=true",
                  "zero_optimization.fp8_all_gather=true")
    plan = from_config(per_use, {"host": 2, "data": 4})

    def gathers(config):
        moved = traffic.step_transfers(config, plan, hosts=2)
        layers = sum(t.nbytes * t.count for t in moved
                     if t.kind == "all-gather" and t.name.endswith(".layers"))
        return layers, _sum(moved, kind="all-gather") - layers

    (bf16_layers, bf16_rest), (fp8_layers, fp8_rest) = gathers(per_use), gathers(fp8)
    assert bf16_layers > 0 and fp8_layers == pytest.approx(bf16_layers / 2)
    assert fp8_rest == pytest.approx(bf16_rest)
