"""ZeRO-3's two paths on one host: tokens/s of the explicit collectives against the sharding.

`throughput.py`'s headline configuration (fsdp8: `configs/bench_tiny_llama.yaml`, ZeRO-3 over
data 8, bf16, full remat, 8 emulated CPU devices), trained by `jaxspeed.train.loop.train` with
`zero_optimization.collectives` set to `explicit` (the collectives written in the step,
`jaxspeed.zero.step`) and to `compiler` (the sharding XLA partitions: the baseline). The
two run alternately, `--rounds` times each, each a fresh training of `--steps` steps, and each
run's tokens/s is `throughput.aggregate`'s (total tokens / total time after `--skip` steps).
A path's figure is its best run (a shared machine only slows a run down); the ratio is
explicit / compiler. Target (issue 58): >= 1.0.

Beside the figure, each path's compiled step is counted op by op (`census`): its transposes,
copies, collectives and dots, where an extra layout change would show.

    python benchmarks/zero_paths.py              # 20 steps, 3 rounds (~8 min on 2 cores)
    python benchmarks/zero_paths.py --quick      # 4 steps of 64 tokens, 1 round (tests)
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE)]

import _common  # noqa: E402
import throughput  # noqa: E402

NAME = "zero_paths"
#: (path, its role); the baseline second.
PATHS = ("explicit", "compiler")
#: The HLO ops counted in each compiled step.
COUNTED = ("transpose", "copy", "all-gather", "reduce-scatter", "all-reduce", "all-to-all", "dot",
           "fusion")
_OP = re.compile(r"= (?:\([^)]*\)|[^ (]+) ([a-z\-]+)\(")  # a tuple's type has spaces


def census(hlo_text: str) -> dict[str, int]:
    """How many of each `COUNTED` op the optimized HLO has (async pairs counted once)."""
    ops = Counter(m.group(1).removesuffix("-start") for m in _OP.finditer(hlo_text))
    return {op: ops.get(op, 0) for op in COUNTED}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 steps of 64 tokens, 1 round")
    parser.add_argument("--rounds", type=int, default=None, help="runs of each path (default 3)")
    parser.add_argument("--steps", type=int, default=None, help="steps a run (default 20)")
    parser.add_argument("--skip", type=int, default=None,
                        help="first steps left out of a run's tokens/s (default 5)")
    args = parser.parse_args(argv)
    case = throughput.QUICK if args.quick else throughput.FULL
    steps = args.steps or case["steps"]
    skip = case["skip"] if args.skip is None else args.skip
    rounds = args.rounds or (1 if args.quick else 3)
    if not 0 <= skip < steps or rounds < 1:
        raise SystemExit(f"need 0 <= --skip < --steps and --rounds >= 1 (got {skip}, {steps}, {rounds})")
    _common.use_cpu_devices()

    from jaxspeed.config import load_config
    from jaxspeed.runtime.host_allocator import keep_freed_memory
    from jaxspeed.train.engine import initialize

    keep_freed_memory()  # as the `jaxspeed` command does
    configs = {path: load_config(throughput.CONFIG, overrides=[
        "logging.every_n_steps=1", *case["overrides"],
        f"zero_optimization.collectives={path}"]) for path in PATHS}
    config = configs[PATHS[0]]
    tokens_per_step = initialize(config).batch_sizes.train_batch_size * config.data.seq_len
    runs: dict[str, list[float]] = {path: [] for path in PATHS}
    for r in range(rounds):
        for path in PATHS if r % 2 == 0 else PATHS[::-1]:
            print(f"round {r + 1}/{rounds}: {path}", file=sys.stderr, flush=True)
            records = throughput.train_jaxspeed(configs[path], steps=steps)
            runs[path].append(throughput.aggregate(records, tokens_per_step=tokens_per_step,
                                                   skip=skip)[0])
    ops = {path: census(initialize(configs[path]).compile_train_step().as_text())
           for path in PATHS}
    best = {path: max(v) for path, v in runs.items()}
    ratio = _common.ratio(best["explicit"], best["compiler"])

    m = config.model
    print(f"ZeRO-3's two paths, fsdp8 ({throughput.CONFIG.relative_to(_common.ROOT)}: d_model "
          f"{m.d_model}, {m.n_layers} layers, seq {config.data.seq_len}, bf16, full remat; "
          f"8 emulated devices, one host): tokens/s over steps {skip}-{steps - 1}, best of "
          f"{rounds} alternating run(s) a path. Target: explicit >= 1.0x compiler.")
    _common.print_table(["path", "tokens/s", "runs", *COUNTED],
                        [[path, round(best[path], 1), " ".join(f"{v:.0f}" for v in runs[path]),
                          *ops[path].values()] for path in PATHS])
    _common.print_json(_common.result(
        NAME, case=f"fsdp8 seq={config.data.seq_len} steps={steps} rounds={rounds}",
        jaxspeed=best["explicit"], baseline=best["compiler"], unit="tokens/s", ratio=ratio,
        runs={path: [round(v, 1) for v in vs] for path, vs in runs.items()}, ops=ops,
        baseline_source="the same config with zero_optimization.collectives=compiler, "
                        "run alternately"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
