"""`jaxspeed train | plan | calibrate | bench | export | import-hf | sample | tokenize | tokenizer | launch`: thin shells over the library.

This package owns the command line: `main` reads the flags (`parser.py`), applies the settings
that must precede any JAX computation, and hands the arguments to the command's module
(`run.py`: train, bench, launch; `plan.py`: plan, calibrate; `checkpoints.py`: export,
import-hf, sample; `data.py`: tokenize, tokenizer). JAX is imported only after the flags are
read, so `--cpu-devices` can still set the number of emulated CPU devices. Errors caused by
input are printed as one line, with exit code 2; warnings as one line each
(`warning_lines.py`), and so are the library's INFO log lines (logger `jaxspeed`); Ctrl-C outside the training steps (start-up, compiling, a search) as
one line, with exit code 130 (during the steps the training loop saves first and exits
75 after SIGTERM, for a scheduler to requeue the job, or 130 after SIGINT).
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from jaxspeed.cli import checkpoints, data, plan, run
from jaxspeed.cli.parser import build_parser
from jaxspeed.cli.warning_lines import one_line

INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process Ctrl-C stopped


def main(argv: list[str] | None = None) -> int:
    """Runs one `jaxspeed` command; returns its process exit code."""
    args = build_parser().parse_args(argv)
    _info_lines()
    with one_line(args.command):
        try:
            return _run(args)
        except KeyboardInterrupt:
            saved = " (nothing saved)" if args.command == "train" else ""
            print(f"jaxspeed {args.command}: interrupted{saved}", file=sys.stderr, flush=True)
            return INTERRUPTED


def _first_process(record: logging.LogRecord | None = None) -> bool:
    import jax

    return jax.process_index() == 0


def _info_lines() -> None:
    """The library's INFO log lines (such as MoE `parallelism: auto`'s choice) on stderr, one
    line each, from the first process only."""
    logger = logging.getLogger("jaxspeed")
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("jaxspeed: %(message)s"))
    handler.addFilter(_first_process)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # once, not again through a root handler someone else installed


def _run(args) -> int:
    """`main` after the flags are read: the command, its input errors as one line, exit 2."""
    from jaxspeed.errors import JaxspeedError
    from jaxspeed.runtime.host_allocator import keep_freed_memory

    try:
        keep_freed_memory()
    except JaxspeedError as err:
        print(f"jaxspeed {args.command}: error: {err}", file=sys.stderr)
        return 2
    try:
        if getattr(args, "cpu_devices", None) is not None:
            from jaxspeed.runtime.distributed import set_cpu_devices

            set_cpu_devices(args.cpu_devices)
        if args.command == "plan" and (args.target or args.cluster):
            plan.compile_on_cpu_host()
        if args.command in ("train", "plan", "calibrate"):
            from jaxspeed.runtime import distributed

            if getattr(args, "distributed", False) or distributed.launched():
                # before any JAX computation; --distributed asks for a cluster: none is an error
                distributed.initialize(require_cluster=True)
        handlers = {
            "train": run.train_command, "plan": plan.plan_command, "bench": run.bench_command,
            "launch": run.launch_command, "export": checkpoints.export_command,
            "import-hf": checkpoints.import_hf_command, "sample": checkpoints.sample_command,
            "tokenize": data.tokenize_command, "tokenizer": data.tokenizer_command,
            "calibrate": plan.calibrate_command,
        }
        return handlers[args.command](args)
    except JaxspeedError as err:
        saved = getattr(err, "exit_code", None)  # preempted: the checkpoint is saved
        if saved is None:
            print(f"jaxspeed {args.command}: error: {err}", file=sys.stderr)
            if getattr(err, "exit_now", False):  # threads left waiting: do not join them
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(2)
            return 2
        # srun stops the other ranks (SIGTERM) once one exits: that must not turn their exit
        # code, which says the checkpoint is saved, into 143 while JAX shuts down
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if _first_process():
            print(f"jaxspeed {args.command}: {err}", file=sys.stderr)
        return saved
