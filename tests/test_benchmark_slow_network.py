"""benchmarks/slow_network.py: the refusal line, argument errors, the link's cleanup (mocked, and
for real where root is), the 2-process runner, and the report, with the link and the jobs
faked. No training here: CI trains across the real link in `make bench-slow-network-quick`."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import _link_jobs  # noqa: E402
import _slow_link  # noqa: E402
import slow_network  # noqa: E402


def test_without_root_one_line_and_exit_0(monkeypatch, capsys):
    monkeypatch.setattr(slow_network, "unavailable", lambda: "not root: network namespaces and tc need root")
    assert slow_network.main(["--quick"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["slow_network: cannot build a slow link here (not root: network namespaces "
                   "and tc need root); no ratio measured"]


def test_unavailable_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(_slow_link.os, "geteuid", lambda: 1000)
    assert "not root" in _slow_link.unavailable()
    monkeypatch.setattr(_slow_link.os, "geteuid", lambda: 0)
    monkeypatch.setattr(_slow_link.shutil, "which", lambda tool: None if tool == "tc" else "/bin/x")
    assert _slow_link.unavailable() == "missing tc (iproute2 / util-linux)"


@pytest.mark.parametrize("argv,message", [
    (["--configs", "adamw,nope"], "unknown configuration ['nope']"),
    (["--configs", ","], "unknown configuration ','"),
    (["--steps", "3"], "--steps must be >= 4"),
    (["--rate", "-1"], "--rate must be >= 0"),
    (["--timeout", "0"], "--timeout must be > 0"),
    (["--config", "configs/no_such.yaml"], "--config: no such file: configs/no_such.yaml"),
])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        slow_network.parse_args(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_an_out_dir_with_runs_of_these_configurations_is_refused(tmp_path, capsys):
    (tmp_path / "moe_flat").mkdir()  # the baseline of moe_auto: it would resume there
    with pytest.raises(SystemExit):
        slow_network.parse_args(["--configs", "moe_auto", "--out", str(tmp_path)])
    assert f"--out {tmp_path} already holds runs of moe_flat" in capsys.readouterr().err
    assert slow_network.parse_args(["--configs", "adamw", "--out", str(tmp_path)]).names == [
        "adamw"]


def test_each_baseline_runs_just_before_its_rivals():
    assert slow_network.parse_args(["--configs", "onebit_lamb,zeropp"]).names == [
        "zero3", "zeropp", "lamb", "onebit_lamb"]
    quick = slow_network.parse_args(["--quick"])
    assert (quick.names, quick.steps) == (["adamw", "onebit_adam"], slow_network.QUICK_STEPS)
    assert slow_network.overrides("onebit_adam", slow_network.parse_args(["--set", "seed=1"])) == [
        "optimizer.type=OneBitAdam", "optimizer.params.freeze_step=7", "seed=1"]


def test_moe_auto_prices_on_the_calibrated_cluster_once_there_is_one():
    """`{cluster}` is null until calibrate has written its file, then that file; the MoE
    strategies each run beside the flat all-to-all."""
    args = slow_network.parse_args(["--configs", "moe_auto"])
    assert args.names == ["moe_flat", "moe_auto"]
    assert "model.moe.cluster=null" in slow_network.overrides("moe_auto", args)
    args.cluster = "/runs/cluster.rank0.yaml"
    assert "model.moe.cluster=/runs/cluster.rank0.yaml" in slow_network.overrides("moe_auto", args)
    assert {slow_network.CONFIGS[n].baseline
            for n in ("moe_data", "moe_expert_data", "moe_flat_compiler")} == {"moe_flat"}
    assert slow_network.refusal("moe_auto", args) == (None, False)


class _Commands:
    """Stands in for `ip`/`tc`: records each command, fails the one starting with `fail`."""

    def __init__(self, fail=(), stderr="RTNETLINK answers: Operation not permitted"):
        self.calls, self.deleted, self.fail, self.stderr = [], [], tuple(fail), stderr

    def run(self, *cmd):
        self.calls.append(cmd)
        if self.fail and cmd[:len(self.fail)] == self.fail:
            raise subprocess.CalledProcessError(2, cmd, stderr=self.stderr)

    def close_run(self, *cmd):
        self.deleted.append(list(cmd))


def _mocked(monkeypatch, tmp_path, **kwargs):
    commands = _Commands(**kwargs)
    monkeypatch.setattr(_slow_link, "_run", commands.run)
    monkeypatch.setattr(_slow_link, "_run_unchecked", commands.close_run)
    monkeypatch.setattr(_slow_link, "NETNS_ETC", str(tmp_path))
    return commands


def test_link_builds_and_removes_what_it_made(monkeypatch, tmp_path):
    commands = _mocked(monkeypatch, tmp_path)
    with _slow_link.SlowLink(100) as link:
        for ns, address in zip(link.namespaces, link.addresses):
            assert (tmp_path / ns / "hosts").read_text().splitlines()[1].split()[0] == address
        tbf = [c for c in commands.calls if "tbf" in c]
        assert [c[c.index("dev") + 1] for c in tbf] == list(link.veths)
        assert all(c[c.index("rate") + 1] == "100mbit" for c in tbf)
    assert sorted(commands.deleted) == sorted(["ip", "netns", "del", ns] for ns in link.namespaces)
    assert list(tmp_path.iterdir()) == []
    assert len({*link.namespaces, *link.veths}) == 4 and all(len(v) <= 15 for v in link.veths)


def test_unshaped_link_has_no_tbf(monkeypatch, tmp_path):
    commands = _mocked(monkeypatch, tmp_path)
    with _slow_link.SlowLink(0):
        pass
    assert not [c for c in commands.calls if "tc" in c]


def test_failed_build_removes_what_it_made(monkeypatch, tmp_path):
    commands = _mocked(monkeypatch, tmp_path, fail=("ip", "-n"))
    link = _slow_link.SlowLink(100)
    with pytest.raises(subprocess.CalledProcessError):
        with link:
            pytest.fail("entered a link whose build failed")
    assert [c[:3] for c in commands.calls[:2]] == [("ip", "netns", "add")] * 2
    assert sorted(commands.deleted) == sorted(["ip", "netns", "del", ns] for ns in link.namespaces)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fail,why", [
    (("ip", "netns", "add"), "ip netns add failed: RTNETLINK answers: Operation not permitted"),
    (("ip", "netns", "exec"), "tc tbf failed: RTNETLINK answers: Operation not permitted"),
])
def test_no_namespaces_or_no_tbf_is_unavailable(monkeypatch, tmp_path, fail, why):
    commands = _mocked(monkeypatch, tmp_path, fail=fail)
    with pytest.raises(_slow_link.LinkUnavailable, match="^" + why + "$"):
        with _slow_link.SlowLink(100):
            pass
    made = [c[3] for c in commands.calls if c[:3] == ("ip", "netns", "add")]
    if fail == ("ip", "netns", "add"):
        made = []  # the first command failed: nothing was made
    assert sorted(commands.deleted) == sorted(["ip", "netns", "del", ns] for ns in made)


def test_sigterm_inside_the_link_removes_it(monkeypatch, tmp_path):
    commands = _mocked(monkeypatch, tmp_path)
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)
    with pytest.raises(KeyboardInterrupt, match=f"signal {int(signal.SIGTERM)}"):
        with _slow_link.SlowLink(100) as link:
            os.kill(os.getpid(), signal.SIGTERM)
            pytest.fail("SIGTERM did not end the block")
    assert sorted(commands.deleted) == sorted(["ip", "netns", "del", ns] for ns in link.namespaces)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)) == before


def test_main_says_one_line_when_tbf_is_missing(monkeypatch, tmp_path, capsys):
    _mocked(monkeypatch, tmp_path, fail=("ip", "netns", "exec"))
    monkeypatch.setattr(slow_network, "unavailable", lambda: None)
    assert slow_network.main(["--quick", "--out", str(tmp_path / "runs")]) == 0
    assert capsys.readouterr().out.strip().splitlines() == [
        "slow_network: cannot build a slow link here (tc tbf failed: RTNETLINK answers: "
        "Operation not permitted); no ratio measured"]


class _LocalLink:
    """A link whose "namespaces" are this machine: `popen` runs `script[index]` instead."""

    addresses = ("127.0.0.1", "127.0.0.1")

    def __init__(self, scripts):
        self.scripts = scripts

    def popen(self, index, cmd, *, core=None, env=None, **kwargs):
        return subprocess.Popen([sys.executable, "-c", self.scripts[index]], **kwargs)


def test_run_pair_kills_the_partner_of_a_failed_process(monkeypatch, tmp_path):
    monkeypatch.setattr(_link_jobs, "_GRACE", 0.5)
    link = _LocalLink(["print('fails'); raise SystemExit(3)", "import time; time.sleep(60)"])
    codes = _link_jobs.run_pair(link, ["train"], logs=tmp_path / "job", port=1, timeout=30)
    assert codes == [3, "killed"]
    assert _link_jobs.last_line(tmp_path / "job.rank0.log") == "fails"


def test_run_pair_times_out(tmp_path):
    link = _LocalLink(["import time; time.sleep(60)"] * 2)
    assert _link_jobs.run_pair(link, ["x"], logs=tmp_path / "job", port=1, timeout=0.5) == [
        "timeout", "timeout"]


def test_throughput_is_the_last_halfs_tokens_over_its_time(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": i, "loss": 5.0 - i, "tokens_per_second": t}
            for i, t in enumerate([10, 20, 1000, 300, 100, 200], 1)]
    metrics.write_text("\n".join(json.dumps(r) for r in rows))
    # equal tokens a step: 3 steps over 1/300 + 1/100 + 1/200 seconds a token (the median,
    # 200, would hide the slow step, as it hid 0/1 Adam's syncs between its local steps)
    rate = pytest.approx(3 / (1 / 300 + 1 / 100 + 1 / 200))
    assert _link_jobs.throughput(metrics) == _link_jobs.Throughput(rate, -1.0, 6, 3, 4)
    rows[-1]["eval_loss"] = 1.5  # the held-out loss at the end, where the run logs one
    metrics.write_text("\n".join(json.dumps(r) for r in rows) + '\n{"step": 6, "eval_loss": 1}\n')
    assert _link_jobs.throughput(metrics) == _link_jobs.Throughput(rate, 1.0, 6, 3, 4)


def test_refusal_tells_a_missing_feature_from_a_wrong_name(monkeypatch):
    args = slow_network.parse_args([])
    monkeypatch.setitem(slow_network.CONFIGS, "missing", slow_network.Case(
        "adamw", ("optimizer.type=NoSuchOptimizer",)))
    monkeypatch.setitem(slow_network.CONFIGS, "misnamed", slow_network.Case(
        "adamw", ("optimizer.type=OneBitAdam",), ("optimizer.params.no_such_step={freeze}",)))
    why, broken = slow_network.refusal("missing", args)
    assert why.startswith("not in this build: ") and "NoSuchOptimizer" in why and not broken
    why, broken = slow_network.refusal("misnamed", args)
    assert why.startswith("refused: ") and "no_such_step" in why and broken
    assert slow_network.refusal("onebit_adam", args) == (None, False)


class _FakeLink:
    addresses = ("10.0.0.1", "10.0.0.2")

    def __init__(self, rate):
        self.rate = rate

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def tcp_megabytes_per_second(self):
        return 11.9


def _name(overrides):
    """The configuration a faked job was given, from its first override."""
    first = overrides[0] if overrides else ""
    return {"": "adamw", "zero_optimization.stage=3": "zero3",
            "optimizer.type=OneBitAdam": "onebit_adam",
            "optimizer.type=ZeroOneAdam": "zero_one_adam"}[first]


def _fake_jobs(monkeypatch, tmp_path, *, hosts=2, fail=None, predicted=None):
    """slow_network with the link and the jobs faked: tokens/s and predictions per config."""
    measured = {"zero3": 400.0, "zeropp": 1000.0, "adamw": 500.0, "onebit_adam": 1500.0,
                "zero_one_adam": 1800.0}
    predicted = predicted or {"zero3": 380.0, "zeropp": 1100.0, "adamw": 520.0,
                              "onebit_adam": 1400.0, "zero_one_adam": 1300.0}
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("hosts: 2\n")
    monkeypatch.setattr(slow_network, "unavailable", lambda: None)
    monkeypatch.setattr(slow_network, "SlowLink", _FakeLink)
    monkeypatch.setattr(slow_network, "refusal", lambda name, args: (
        ("not in this build: zero_quantized_weights", False) if name == "zeropp" else (None, False)))
    monkeypatch.setattr(_link_jobs, "calibrate", lambda link, **kw: _link_jobs.Calibration(
        cluster, hosts, 0.0118, 250.0))

    def predict(config, overrides, **kw):
        return predicted[_name(overrides)], None

    def train(link, config, overrides, **kw):
        name = _name(overrides)
        if name == fail:
            return None, "exit [1, 'killed']: Traceback"
        return _link_jobs.Throughput(measured[name], 3.0 if name == "adamw" else 3.2, 8, 4, 5), None

    monkeypatch.setattr(_link_jobs, "predict", predict)
    monkeypatch.setattr(_link_jobs, "train", train)


def test_report_with_predictions(monkeypatch, tmp_path, capsys):
    _fake_jobs(monkeypatch, tmp_path)
    argv = ["--configs", "zeropp,onebit_adam,zero_one_adam", "--steps", "8",
            "--out", str(tmp_path / "r")]
    assert slow_network.main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "zeropp: not in this build: zero_quantized_weights"
    assert "one TCP stream moved 11.90 MB/s" in lines[1]
    assert "[1/4] zero3: training 8 steps across the link ..." in lines
    assert "[3/4] onebit_adam: 1,500.0 tokens/s over steps 5-8, loss 3.2000 (0 s)" in lines
    table = lines[lines.index(next(l for l in lines if l.startswith("config "))):]
    assert table[2].split()[:3] == ["zeropp", "n/a", "n/a"]
    assert table[4].split()[:10] == ["onebit_adam", "1,500.0", "1,400.0", "0.93", "adamw",
                                     "3.00x", "3.200", "3.000", "+6.7%", "(over"]
    assert table[5].split()[:6] == ["zero_one_adam", "1,800.0", "1,300.0", "0.72", "adamw", "3.60x"]
    assert "zero_one_adam vs onebit_adam: 1.20x" in table
    assert table[-2] == ("ranking: measured zero_one_adam > onebit_adam > adamw > zero3; planner "
                         "onebit_adam > zero_one_adam > adamw > zero3: differs (predicted, not "
                         "measured: onebit_adam > zero_one_adam); predictions within 5% are ties")
    last = json.loads(table[-1])
    assert (last["case"], last["ratio"], last["tcp_MBps"]) == ("onebit_adam vs adamw", 3.0, 11.9)
    pairs = {(s["config"], s["baseline"]): s for s in last["summary"]}
    assert pairs["zeropp", "zero3"]["ratio"] is None
    assert pairs["onebit_adam", "adamw"]["loss_within"] is False
    assert pairs["zero_one_adam", "onebit_adam"]["ratio"] == 1.2
    assert last["ranking"]["matches"] is False
    assert last["ranking"]["disagreements"] == ["onebit_adam > zero_one_adam"]


def test_predictions_within_the_tie_rank_either_way():
    def row(name, measured, predicted):
        return slow_network.Row(name, None, [], tokens_per_second=measured,
                                predicted_tokens_per_second=predicted)

    rows = {r.config: r for r in (row("adamw", 354.3, 294.9), row("lamb", 357.1, 294.9),
                                  row("zero3", 244.8, 255.3))}
    ranking = slow_network.rankings(rows)
    assert ranking["measured"] == ["lamb", "adamw", "zero3"]
    assert ranking["matches"] is True and ranking["disagreements"] == []
    rows["zero3"] = row("zero3", 400.0, 255.3)  # measured faster than both: not a tie
    ranking = slow_network.rankings(rows)
    assert ranking["matches"] is False
    assert ranking["disagreements"] == ["adamw > zero3", "lamb > zero3"]


def test_report_without_a_calibrated_link_and_a_broken_run(monkeypatch, tmp_path, capsys):
    _fake_jobs(monkeypatch, tmp_path, hosts=1, fail="onebit_adam")
    assert slow_network.main(["--quick", "--out", str(tmp_path / "r")]) == 1  # a broken run
    lines = capsys.readouterr().out.strip().splitlines()
    assert "calibrate: calibrate did not cross the link (its cluster file says hosts: 1)" in lines
    assert "[2/2] onebit_adam: FAILED: exit [1, 'killed']: Traceback (0 s)" in lines
    assert ("no prediction for adamw: calibrate did not cross the link (its cluster file says "
            "hosts: 1)") in lines
    assert lines[-2].startswith("ranking: n/a")
    assert json.loads(lines[-1])["ratio"] is None


needs_root = pytest.mark.skipif(_slow_link.unavailable() is not None,
                                reason=f"{_slow_link.unavailable()}")


@needs_root
def test_real_link_is_shaped_and_removed_on_sigterm(tmp_path):
    """Builds a real link in a child process, checks it, SIGTERMs the child: nothing is left."""
    script = (
        "import sys, time; sys.path.insert(0, 'benchmarks'); from _slow_link import SlowLink\n"
        "with SlowLink(100) as link:\n"
        "    print(' '.join(link.namespaces), flush=True)\n"
        "    print(link.tcp_megabytes_per_second(seconds=1.0), flush=True)\n"
        "    time.sleep(60)\n")
    root = Path(__file__).resolve().parent.parent
    child = subprocess.Popen([sys.executable, "-c", script], cwd=root, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        namespaces = child.stdout.readline().split()
        assert len(namespaces) == 2, child.stderr.read()
        qdisc = subprocess.run(["ip", "netns", "exec", namespaces[1], "tc", "qdisc"],
                               capture_output=True, text=True, check=True).stdout
        assert "tbf" in qdisc and "rate 100Mbit" in qdisc
        assert 0 < float(child.stdout.readline()) <= 12.5 * 1.3  # tbf holds it to the rate
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=30) != 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in namespaces)
    assert not any(os.path.exists(f"/etc/netns/{ns}") for ns in namespaces)
    assert shutil.which("ip")


def test_the_loss_bar_is_on_ending_above_the_baseline():
    """A compressed run may end lower than its baseline (within); 3% above is not."""
    def row(name, baseline, loss):
        return slow_network.Row(name, baseline, [], tokens_per_second=100.0, last_loss=loss)
    rows = {"lamb": row("lamb", None, 4.0), "onebit_lamb": row("onebit_lamb", "lamb", 3.8),
            "adamw": row("adamw", None, 2.0), "onebit_adam": row("onebit_adam", "adamw", 2.1)}
    within = {s["config"]: s["loss_within"] for s in slow_network.summarize(rows, 0.03)}
    assert within == {"onebit_lamb": True, "onebit_adam": False}
