"""FP8 against bf16: the tiny GPT trained 300 steps with each FP8 recipe and in bf16, same run.

Each case is `jaxspeed train configs/gpt_tiny.yaml` with bf16 compute (`bf16.enabled=true`), the
same data, seed and schedule, in a process of its own; the FP8 cases add `fp8.enabled=true` and
their `fp8.recipe`. The figure is the held-out loss at the end (`eval_loss` over
`--eval-batches` held-out batches). Target (issue 56): every recipe within 1.5% of bf16's.
`ratio` is bf16's held-out loss / the recipe's (>= 0.985 passes; > 1 means FP8 ended lower).

    python benchmarks/fp8_convergence.py               # 300 steps, every recipe (~4 x 5 min on 2 cores)
    python benchmarks/fp8_convergence.py --quick       # 2 steps of 2 layers, one recipe, to check the script
    python benchmarks/fp8_convergence.py --recipes tensorwise rowwise
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

NAME = "fp8_convergence"
RECIPES = ("tensorwise", "rowwise", "delayed")
TOLERANCE = 0.015


#: --quick's model: 2 of the tiny GPT's 6 layers (an FP8 step takes seconds on a CPU)
QUICK = ["model.n_layers=2"]


def held_out_loss(overrides: list[str], *, steps: int, eval_batches: int) -> dict:
    """The final JSON line of `jaxspeed train` on the tiny GPT with `overrides`."""
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable, "-m", "jaxspeed.cli", "train", "configs/gpt_tiny.yaml",
            "--steps", str(steps), "--output", out, "--no-progress", "--cpu-devices", "1",
            "--set", "bf16.enabled=true", "--set", f"logging.eval_batches={eval_batches}",
            "--set", f"logging.eval_every_n_steps={steps}",
            "--set", f"scheduler.params.total_num_steps={steps}",
            *[arg for o in overrides for arg in ("--set", o)],
        ]
        run = subprocess.run(command, cwd=_HERE.parent, capture_output=True, text=True)
        if run.returncode:
            raise SystemExit(f"{' '.join(command)} failed:\n{run.stderr[-2000:]}")
        return json.loads(run.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=None,
                        help="default: all (with --quick: the first)")
    parser.add_argument("--quick", action="store_true",
                        help="2 steps of 2 layers, 1 eval batch, one recipe unless --recipes")
    args = parser.parse_args(argv)
    # quick: the second step is the first with a learning rate above 0 (warm-up from 0); an
    # FP8 step takes about 2 s of CPU
    steps, eval_batches = (2, 1) if args.quick else (args.steps, args.eval_batches)
    recipes = args.recipes or list(RECIPES[:1] if args.quick else RECIPES)
    model = QUICK if args.quick else []

    base = held_out_loss(model, steps=steps, eval_batches=eval_batches)
    rows, results = [], []
    for recipe in recipes:
        got = held_out_loss([*model, "fp8.enabled=true", f"fp8.recipe={recipe}"], steps=steps,
                            eval_batches=eval_batches)
        ratio = base["eval_loss"] / got["eval_loss"]
        rows.append([recipe, f"{got['eval_loss']:.4f}", f"{base['eval_loss']:.4f}",
                     f"{ratio:.4f}", "yes" if ratio >= 1 - TOLERANCE else "NO",
                     f"{got['tokens_per_second']:.0f}", f"{base['tokens_per_second']:.0f}"])
        results.append({"benchmark": NAME, "case": f"{recipe}, {steps} steps",
                        "jaxspeed": round(got["eval_loss"], 5),
                        "baseline": round(base["eval_loss"], 5), "unit": "held-out loss",
                        "ratio": round(ratio, 4)})
    _common.print_table(
        ["recipe", "held-out loss", "bf16", "ratio", "within 1.5%", "tokens/s", "bf16 tokens/s"],
        rows)
    for line in results:
        print(json.dumps(line))
    worst = min(results, key=lambda r: r["ratio"])
    print(json.dumps({**worst, "case": f"worst recipe: {worst['case']}"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
