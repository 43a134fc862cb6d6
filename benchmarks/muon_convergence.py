"""Muon against AdamW: the tiny GPT's held-out loss against tokens, each optimizer at its best lr.

Each run is `jaxspeed train configs/gpt_tiny.yaml` (fp32, the config's schedule, data and seed)
in a process of its own, with `optimizer.type` AdamW or Muon and one lr of a small grid, and the
held-out loss (`--eval-batches` batches) every `--eval-every` steps. Each optimizer's lr is the
grid's best by final held-out loss; the script prints every run, so the grid is on record.

The figure: the fraction of AdamW's steps Muon needs to reach AdamW's final held-out loss (the
first evaluation at or below it, linearly interpolated between evaluations). Target (issue 59):
<= 0.8. Muon's update RMS is matched to AdamW's (`rms_scale` 0.2), so the grids are the same.

    python benchmarks/muon_convergence.py              # 300 steps, lr 1e-3 and 3e-3 (~4 x 5 min)
    python benchmarks/muon_convergence.py --quick      # 4 steps of 2 layers, to check the script
    python benchmarks/muon_convergence.py --adamw-lrs 5e-4 1e-3 --muon-lrs 3e-3 6e-3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE)]

import _common  # noqa: E402

NAME = "muon_convergence"
TARGET = 0.8
#: --quick's model: 2 of the tiny GPT's 6 layers
QUICK = ["model.n_layers=2"]


def curve(optimizer: str, lr: float, overrides: list[str], *, steps: int, every: int,
          eval_batches: int) -> list[tuple[int, float]]:
    """`(step, held-out loss)` of one `jaxspeed train` run."""
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable, "-m", "jaxspeed.cli", "train", "configs/gpt_tiny.yaml",
            "--steps", str(steps), "--output", out, "--no-progress", "--cpu-devices", "1",
            "--set", f"optimizer.type={optimizer}", "--set", f"optimizer.params.lr={lr}",
            "--set", f"logging.eval_batches={eval_batches}",
            "--set", f"logging.eval_every_n_steps={every}",
            "--set", f"scheduler.params.total_num_steps={steps}",
            *[arg for o in overrides for arg in ("--set", o)],
        ]
        run = subprocess.run(command, cwd=_HERE.parent, capture_output=True, text=True)
        if run.returncode:
            raise SystemExit(f"{' '.join(command)} failed:\n{run.stderr[-2000:]}")
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]


def steps_to_reach(points: list[tuple[int, float]], loss: float) -> float | None:
    """The first step the curve reaches `loss`, interpolated between evaluations (None: never)."""
    before = None
    for step, value in points:
        if value <= loss:
            if before is None:
                return float(step)
            (s0, v0) = before
            return s0 + (step - s0) * (v0 - loss) / (v0 - value)
        before = (step, value)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3],
                        help="the lr grid of both optimizers")
    parser.add_argument("--adamw-lrs", type=float, nargs="+", default=None, help="AdamW's own")
    parser.add_argument("--muon-lrs", type=float, nargs="+", default=None, help="Muon's own")
    parser.add_argument("--quick", action="store_true", help="4 steps of 2 layers, one lr")
    args = parser.parse_args(argv)
    steps, every, batches = (4, 2, 1) if args.quick else (args.steps, args.eval_every,
                                                          args.eval_batches)
    grids = {"AdamW": args.adamw_lrs or args.lrs, "Muon": args.muon_lrs or args.lrs}
    if args.quick:
        grids = {opt: lrs[:1] for opt, lrs in grids.items()}
    model = QUICK if args.quick else []

    runs = {(opt, lr): curve(opt, lr, model, steps=steps, every=every, eval_batches=batches)
            for opt, lrs in grids.items() for lr in lrs}
    rows = [[opt, f"{lr:g}", *(f"{loss:.4f}" for _, loss in points)]
            for (opt, lr), points in runs.items()]
    evals = [step for step, _ in next(iter(runs.values()))]
    _common.print_table(["optimizer", "lr", *(f"step {s}" for s in evals)], rows)

    best = {opt: min((lr for o, lr in runs if o == opt), key=lambda lr: runs[opt, lr][-1][1])
            for opt in ("AdamW", "Muon")}
    adamw, muon = runs["AdamW", best["AdamW"]], runs["Muon", best["Muon"]]
    reached = steps_to_reach(muon, adamw[-1][1])
    fraction = None if reached is None else reached / adamw[-1][0]
    print(json.dumps({
        "benchmark": NAME, "case": f"tiny GPT, {steps} steps, lr grids {grids}",
        "jaxspeed": None if reached is None else round(reached, 1), "baseline": adamw[-1][0],
        "unit": "steps to AdamW's final held-out loss", "ratio": fraction and round(fraction, 3),
        "target": TARGET, "best_lr": best,
        "final": {"AdamW": round(adamw[-1][1], 4), "Muon": round(muon[-1][1], 4)},
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
