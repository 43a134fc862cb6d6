"""Training over a real slow link: 2 "hosts" x 2 emulated devices, each baseline in the same run.

    sudo .venv/bin/python benchmarks/slow_network.py [--rate 100] [--steps 30] [--configs a,b]
    .venv/bin/python benchmarks/slow_network.py --quick        (CI: two configurations, 6 steps)

Builds two network namespaces joined by a veth pair limited with tbf to `--rate` Mbit/s in each
direction (`_slow_link.py`), measures one TCP stream across it, then runs `jaxspeed train` once
per configuration: one process per namespace, each pinned to its own core with 2 emulated CPU
devices, `mesh.data=4`, so the mesh is host=2 x data=2 and gloo carries every cross-host
collective over the shaped link. tokens/s is the median over the last half of the logged steps
(1-bit optimizers freeze at a quarter of the run, so those steps are compressed).

Configurations, each beside its baseline: ZeRO-3 against ZeRO++ (qwZ + qgZ + hpZ); AdamW
against OneBitAdam and ZeroOneAdam; Lamb against OneBitLamb. A configuration this build does
not support (its config is refused) is reported in one line and the rest still run. Each
result is one JSON line (`benchmark: slow_network`), then a summary of the ratios.

Without root, `ip`, `tc` or `taskset` it says so in one line and exits 0 with no ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _slow_link import SlowLink, unavailable  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
#: name → (baseline name or None, --set overrides). `{freeze}` is a quarter of the steps.
CONFIGS: dict[str, tuple[str | None, list[str]]] = {
    "zero3": (None, ["zero_optimization.stage=3"]),
    "zeropp": ("zero3", ["zero_optimization.stage=3",
                         "zero_optimization.zero_quantized_weights=true",
                         "zero_optimization.zero_quantized_gradients=true",
                         "zero_optimization.zero_hpz_partition_size=2"]),
    "adamw": (None, []),
    "onebit_adam": ("adamw", ["optimizer.type=OneBitAdam", "optimizer.params.freeze_step={freeze}"]),
    "zero_one_adam": ("adamw", ["optimizer.type=ZeroOneAdam",
                                "optimizer.params.var_freeze_step={freeze}"]),
    "lamb": (None, ["optimizer.type=Lamb"]),
    "onebit_lamb": ("lamb", ["optimizer.type=OneBitLamb", "optimizer.params.freeze_step={freeze}"]),
}
QUICK = ("adamw", "onebit_adam")
DEVICES_PER_HOST = 2


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=100.0, help="Mbit/s each way; 0 = unshaped")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--config", default="configs/gpt_tiny.yaml")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated subset of {', '.join(CONFIGS)}")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra overrides for every configuration")
    parser.add_argument("--quick", action="store_true",
                        help=f"CI size: {', '.join(QUICK)}, 6 steps")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per configuration")
    parser.add_argument("--out", default=None, help="keep the runs here (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.quick:
        args.configs, args.steps = ",".join(QUICK), 6
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration {unknown}; choose from {', '.join(CONFIGS)}")
    if args.steps < 4:
        parser.error(f"--steps must be >= 4 (the median is over the last half), got {args.steps}")
    if args.rate < 0:
        parser.error(f"--rate must be >= 0, got {args.rate}")
    args.names = names
    return args


def median_tokens_per_second(metrics: Path) -> tuple[float, float | None, int]:
    """(median tokens/s over the last half of the logged steps, last loss, steps logged)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "tokens_per_second" in r]
    if not rows:
        raise RuntimeError(f"{metrics} has no logged step")
    half = rows[len(rows) // 2:]
    return statistics.median(r["tokens_per_second"] for r in half), rows[-1].get("loss"), len(rows)


def run_config(link: SlowLink, name: str, args, out: Path) -> dict:
    """Trains one configuration across the link; its result line (or its one-line error)."""
    freeze = max(1, args.steps // 4)
    overrides = [s.format(freeze=freeze) for s in CONFIGS[name][1]] + args.set
    run = out / name
    sets = [f"mesh.data={2 * DEVICES_PER_HOST}", "logging.every_n_steps=1",
            "checkpoint.every_n_minutes=0", *overrides]
    cmd = [sys.executable, "-m", "jaxspeed.cli", "train", args.config, "--steps", str(args.steps),
           "--cpu-devices", str(DEVICES_PER_HOST), "--output", str(run), "--no-progress"]
    for s in sets:
        cmd += ["--set", s]
    base_env = {"JAXSPEED_COORDINATOR": f"{link.addresses[0]}:7471",
                "JAXSPEED_NUM_PROCESSES": "2", "JAX_PLATFORMS": "cpu",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    logs = [open(out / f"{name}.rank{r}.log", "w") for r in (0, 1)]
    start = time.perf_counter()
    procs = [link.popen(r, cmd, core=r % os.cpu_count(), cwd=ROOT, stdout=logs[r],
                        stderr=subprocess.STDOUT, env={**base_env, "JAXSPEED_PROCESS_ID": r})
             for r in (0, 1)]
    try:
        codes = [p.wait(timeout=args.timeout) for p in procs]
    except subprocess.TimeoutExpired:
        codes = ["timeout"]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    row = {"benchmark": "slow_network", "config": name, "rate_mbit": args.rate,
           "hosts": 2, "devices_per_host": DEVICES_PER_HOST, "steps": args.steps,
           "overrides": overrides, "wall_s": round(time.perf_counter() - start, 1)}
    if codes != [0, 0]:
        tail = ((out / f"{name}.rank0.log").read_text().strip().splitlines() or [""])[-1]
        # a config this build refuses is reported, not a broken run
        return {**row, "error": f"exit {codes}: {tail[:300]}",
                "unsupported": "invalid --set" in tail}
    tps, loss, logged = median_tokens_per_second(run / "metrics.jsonl")
    return {**row, "tokens_per_second": round(tps, 1), "last_loss": loss, "steps_logged": logged}


def summarize(rows: dict[str, dict]) -> list[dict]:
    """Each configuration against its baseline, where both ran."""
    out = []
    for name, row in rows.items():
        base = CONFIGS[name][0]
        if base is None or base not in rows:
            continue
        a, b = row.get("tokens_per_second"), rows[base].get("tokens_per_second")
        out.append({"config": name, "baseline": base,
                    "ratio": round(a / b, 3) if a and b else None,
                    "loss": row.get("last_loss"), "baseline_loss": rows[base].get("last_loss")})
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    why = unavailable()
    if why:
        print(f"slow_network: cannot build a slow link here ({why}); no ratio measured")
        return 0
    names = list(dict.fromkeys(
        [b for n in args.names if (b := CONFIGS[n][0]) is not None] + args.names))
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="slow_network."))
    out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict] = {}
    with SlowLink(args.rate) as link:
        mbps = link.tcp_megabytes_per_second()
        print(f"link: {args.rate:g} Mbit/s tbf each way; one TCP stream moved {mbps:.1f} MB/s",
              flush=True)
        for i, name in enumerate(names, 1):
            print(f"[{i}/{len(names)}] {name}: training {args.steps} steps across the link ...",
                  flush=True)
            rows[name] = run_config(link, name, args, out)
            rows[name]["tcp_MBps"] = round(mbps, 2)
            print(json.dumps(rows[name]), flush=True)
    summary = summarize(rows)
    print(json.dumps({"benchmark": "slow_network", "summary": summary, "runs": str(out)}))
    for s in summary:
        ratio = f"{s['ratio']:.2f}x" if s["ratio"] else "n/a"
        print(f"{s['config']:>14} vs {s['baseline']:<6} {ratio:>7}   loss {s['loss']} vs "
              f"{s['baseline_loss']}")
    broken = [n for n, r in rows.items() if "error" in r and not r["unsupported"]]
    return 1 if broken else 0


if __name__ == "__main__":
    raise SystemExit(main())
