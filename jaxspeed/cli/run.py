"""`jaxspeed train | bench | launch`: the commands that run something.

This module owns the commands that start a run: `train` trains the reference GPT of a
config, `bench` runs a script of `benchmarks/` with the arguments given (the benchmarks are
not part of the package: they need the source checkout, `pip install -e .`), and
`launch` starts N processes of a command on this machine, wired for `jax.distributed`; its
exit code is theirs.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

from jaxspeed.cli.parser import load_config_args

#: The source checkout's benchmarks (beside the `jaxspeed` package in an editable install).
BENCHMARKS = Path(__file__).resolve().parent.parent.parent / "benchmarks"


def train_command(args) -> int:
    """`jaxspeed train`: trains the config's model; prints the run's last record as JSON."""
    from jaxspeed.train.loop import train

    record = train(
        load_config_args(args), output_dir=args.output, steps=args.steps,
        progress=False if args.no_progress else None, force=args.force,
        resume_step=args.resume_step,
    )
    import jax

    if jax.process_index() == 0:  # one record for the run, as its metrics and progress
        print(json.dumps({"output": str(args.output), **record}))
    return 0


def bench_command(args) -> int:
    """`jaxspeed bench NAME ARGS...`: runs `benchmarks/NAME.py` with ARGS as its argv."""
    from jaxspeed.errors import JaxspeedError

    if not BENCHMARKS.is_dir():
        package = Path(__file__).resolve().parent.parent
        raise JaxspeedError(
            f"jaxspeed bench runs the scripts of benchmarks/ in jaxspeed's source checkout, and "
            f"this jaxspeed ({package}) is installed without them: clone the repository and "
            f"`pip install -e .` it, or run `python benchmarks/{args.name}.py` there")
    script = BENCHMARKS / f"{args.name}.py"
    if args.name.startswith("_") or not script.is_file():
        names = sorted(p.stem for p in BENCHMARKS.glob("[!_]*.py"))
        raise JaxspeedError(f"unknown benchmark {args.name!r}; available: {names}")
    sys.argv = [str(script), *args.args]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def launch_command(args) -> int:
    """`jaxspeed launch`: runs `--nproc` processes of the command; returns their exit code."""
    from jaxspeed.runtime.launch import DEFAULT_GRACE, DEFAULT_INIT_TIMEOUT, launch

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    return launch(
        command, nproc=args.nproc, cpu_devices=args.child_cpu_devices, timeout=args.timeout,
        init_timeout=DEFAULT_INIT_TIMEOUT if args.init_timeout is None else args.init_timeout,
        grace=DEFAULT_GRACE if args.grace is None else args.grace,
    )
