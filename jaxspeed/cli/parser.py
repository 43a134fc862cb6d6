"""The `jaxspeed` argument parser, and the config flags `train` and `plan` share.

This module owns every subcommand's flags and help text (`build_parser`), and turns the
shared config flags (`config`, `--set`, `--device-memory`) into a validated config
(`load_config_args`). It imports no JAX: the flags are read before JAX starts
(`load_config_args`, which may read a `checkpoint.load_from` record, runs inside a command,
after the settings that must precede JAX).
"""

from __future__ import annotations

import argparse

DESCRIPTION = (
    "`jaxspeed train | plan | calibrate | bench | export | import-hf | sample | tokenize | "
    "tokenizer | launch`: thin shells over the library."
)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML or JSON config (jaxspeed or DeepSpeed keys)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config key, e.g. --set zero_optimization.stage=3 (repeatable; VALUE "
        "is read as YAML; DeepSpeed's key names work too)",
    )
    parser.add_argument(
        "--cpu-devices", type=int, default=None, metavar="N",
        help="emulate N CPU devices (sets the host platform device count before JAX starts)",
    )
    parser.add_argument(
        "--device-memory", default=None, metavar="BYTES",
        help="memory of one device, e.g. 80GiB (same as --set hardware.device_memory=...): "
        "plan gives a fits / does-not-fit verdict, train refuses a plan that does not fit",
    )
    parser.add_argument(
        "--distributed", action="store_true",
        help="call jax.distributed.initialize() first, auto-detecting the cluster (SLURM, "
        "Open MPI, Kubernetes, TPU pods); implied under `jaxspeed launch`",
    )


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: it reports its own unknown arguments, with its own usage.

    argparse hands a subparser's leftovers back to the top-level parser, whose error shows
    `jaxspeed [-h] {train,plan,...}` instead of the command's flags. Nested subcommands
    (`tokenizer train`) take this class too (`add_subparsers` defaults to the parent's class),
    so the innermost command reports.
    """

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def _text_errors(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--errors", choices=("strict", "replace"), default="strict",
        help="bytes that are not UTF-8 (a Latin-1 file, binary data): strict (default) stops "
        "at the first, naming the file, the byte and its offset; replace reads each as U+FFFD",
    )


def build_parser() -> argparse.ArgumentParser:
    """The `jaxspeed` parser: one subparser per command, its name in `args.command`."""
    parser = argparse.ArgumentParser(prog="jaxspeed", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_CommandParser)

    train = sub.add_parser("train", help="train the reference GPT described by a config")
    _common(train)
    train.add_argument("--steps", type=int, default=None,
                       help="total steps (same as --set steps=N; default: the config's steps)")
    train.add_argument("--output", default="runs/latest", help="run directory (metrics.jsonl)")
    train.add_argument("--no-progress", action="store_true",
                       help="no progress output (bar, plain lines or start-up phases)")
    train.add_argument(
        "--force", action="store_true", help="start even if the plan does not fit device memory"
    )
    train.add_argument(
        "--resume-step", type=int, default=None, metavar="N",
        help="resume the checkpoint of step N (default: the newest that can be read; an "
        "unreadable newest one is set aside as STEP.corrupt); later ones are set aside as "
        "STEP.superseded")

    plan = sub.add_parser("plan", help="show the sharding plan and per-device memory")
    _common(plan)
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.add_argument(
        "--auto", action="store_true",
        help="search meshes, ZeRO stages, remat, micro-batches, schedules and offload for "
        "--cluster and rank them by predicted step time (the config's model and "
        "train_batch_size are kept)",
    )
    plan.add_argument("--cluster", default=None, metavar="NAME|FILE",
                      help="a preset (jaxspeed/config/clusters/) or a cluster YAML (`jaxspeed "
                      "calibrate` writes one for this machine); a preset that names its GPU "
                      "implies --target and --devices")
    plan.add_argument(
        "--target", default=None, metavar="GPU",
        help="compile the train step for this GPU without one (h100, h200, a100; needs the "
        "gpu-compile extra): memory from XLA:GPU, no timing, no autotuning",
    )
    plan.add_argument("--devices", type=int, default=None, metavar="N",
                      help="with --target: GPUs to compile for (default 8, or the cluster's)")
    plan.add_argument("--top", type=int, default=5, metavar="N", help="with --auto: plans to show")
    plan.add_argument("--verify", type=int, default=40, metavar="K",
                      help="with --auto: compile the K analytically best plans (0: analytic only)")
    plan.add_argument("--apply", default=None, metavar="OUT.yaml",
                      help="with --auto: write the best plan as a config for `jaxspeed train`")
    plan.add_argument("--no-progress", action="store_true", help="with --auto: no progress output")

    calibrate = sub.add_parser(
        "calibrate", help="measure this machine's matmul rate and collective bandwidth into a cluster file"
    )
    calibrate.add_argument("--out", required=True, metavar="FILE", help="cluster YAML to write")
    calibrate.add_argument("--name", default="calibrated", help="the cluster's name in the file")
    calibrate.add_argument("--cpu-devices", type=int, default=None, metavar="N",
                           help="emulate N CPU devices")
    calibrate.add_argument("--repeats", type=int, default=5, metavar="R",
                           help="timed rounds, each timing every figure once; each figure is its "
                                "median (default 5)")
    calibrate.add_argument("--matmul-size", type=int, default=2048, metavar="N",
                           help="n of the [n, n] matmuls timed (default 2048; smaller is quicker "
                                "and rougher)")
    calibrate.add_argument("--collective-mib", type=float, default=16, metavar="MIB",
                           help="MiB of the large all-gather, copy and elementwise pass (default 16)")
    calibrate.add_argument("--config", default=None, metavar="CONFIG",
                           help="time a training step of this config's model for `efficiency` "
                                "(the share of the matmul peak the planner prices its compute "
                                "at), instead of a matmul-only MLP's: what makes `plan "
                                "--cluster` predict that model's step time")
    calibrate.add_argument("--set", dest="overrides", action="append", default=[],
                           metavar="KEY=VALUE", help="with --config: override a config key")
    calibrate.set_defaults(device_memory=None)  # `load_config_args` reads it

    bench = sub.add_parser("bench", help="run a benchmark from benchmarks/")
    bench.add_argument("name", help="benchmark name, e.g. zero_memory")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark")

    export = sub.add_parser(
        "export", help="write a checkpoint's params, consolidated, for one device (zero_to_fp32)"
    )
    export.add_argument("checkpoint", help="a run's folder (runs/x) or its checkpoint directory")
    export.add_argument(
        "--out", required=True,
        help="output file (.msgpack, Flax serialization), or folder with --format hf "
        "(it must not exist, or be empty)",
    )
    export.add_argument("--step", type=int, default=None, help="default: the newest complete one")
    export.add_argument(
        "--format", choices=("msgpack", "hf"), default="msgpack",
        help="msgpack: Flax serialization (default); hf: a Hugging Face Llama, Mistral or Qwen2 folder "
        "(config.json + safetensors) for transformers' from_pretrained",
    )
    export.add_argument(
        "--dtype", default=None, choices=("float32", "bfloat16", "float16"),
        help="with --format hf: the saved dtype (default: the checkpoint's)",
    )

    import_hf = sub.add_parser(
        "import-hf",
        help="convert a Hugging Face Llama, Mistral or Qwen2 folder to a checkpoint (checkpoint.load_from)",
    )
    import_hf.add_argument("folder", help="config.json + *.safetensors (sharded with an index, or not)")
    import_hf.add_argument("--out", required=True, help="the checkpoint folder to write")
    import_hf.add_argument(
        "--dtype", default=None, choices=("float32", "bfloat16", "float16"),
        help="cast the weights (default: keep the files' dtype)",
    )

    tokenize = sub.add_parser(
        "tokenize", help="tokenize local .txt/.jsonl/.parquet files into one token file"
    )
    tokenize.add_argument("files", nargs="+", help="text files or folders")
    tokenize.add_argument("--tokenizer", required=True, help="tokenizer.json (or its folder)")
    tokenize.add_argument("--out", required=True, help="token file to write (.npy, or raw .bin)")
    tokenize.add_argument("--text-key", default="text", help="jsonl field / parquet column (default text)")
    tokenize.add_argument("--eos-id", type=int, default=None, help="default: the tokenizer's EOS token")
    tokenize.add_argument("--no-progress", action="store_true", help="no progress output")
    _text_errors(tokenize)

    tokenizer = sub.add_parser("tokenizer", help="tokenizer tools")
    tokenizer_sub = tokenizer.add_subparsers(dest="tokenizer_command", required=True)
    bpe = tokenizer_sub.add_parser("train", help="train a byte-level BPE on local text files")
    bpe.add_argument("files", nargs="+", help=".txt/.jsonl/.parquet files or folders")
    bpe.add_argument("--vocab-size", type=int, required=True, metavar="N", help="vocabulary size")
    bpe.add_argument("--out", required=True, metavar="DIR", help="folder for tokenizer.json")
    bpe.add_argument("--text-key", default="text", help="jsonl field / parquet column (default text)")
    _text_errors(bpe)

    sample = sub.add_parser(
        "sample", help="continue a prompt with a trained checkpoint (key/value cache)"
    )
    sample.add_argument("checkpoint",
                        help="a run's folder (runs/x), its checkpoints/, or an import-hf folder")
    sample.add_argument("--prompt", required=True, help="the text to continue")
    sample.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    sample.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    sample.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    sample.add_argument("--seed", type=int, default=0)
    sample.add_argument("--tokenizer", default=None,
                        help="tokenizer.json (default: the run's data.tokenizer, else the imported "
                        "folder's tokenizer.json, else bytes)")
    sample.add_argument("--step", type=int, default=None, help="default: the newest complete one")
    sample.add_argument("--cpu-devices", type=int, default=None, metavar="N",
                        help="run on N emulated CPU devices")

    launch = sub.add_parser(
        "launch", help="run N processes of a command on this machine, wired for jax.distributed",
        usage="jaxspeed launch --nproc N [--cpu-devices K] [--timeout S] -- COMMAND ...",
    )
    launch.add_argument("--nproc", type=int, required=True, metavar="N", help="processes to start")
    launch.add_argument(
        "--cpu-devices", dest="child_cpu_devices", type=int, default=None, metavar="K",
        help="emulated CPU devices per process (N*K in all), with gloo collectives",
    )
    launch.add_argument(
        "--timeout", type=float, default=None, metavar="S",
        help="stop every process after S seconds and exit 124 (default: no limit)",
    )
    launch.add_argument(
        "--init-timeout", type=int, default=None, metavar="S",
        help="seconds the processes wait for each other at start-up (default 120)",
    )
    launch.add_argument(
        "--grace", type=float, default=None, metavar="S",
        help="seconds between SIGTERM and SIGKILL when stopping processes (default 10)",
    )
    launch.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                        help="the command each process runs")
    return parser


def load_config_args(args):
    """The config named by `args.config`, with `--set`, `--device-memory` and `--steps` applied,
    and the model of its `checkpoint.load_from` where its `model:` leaves keys out.

    An error names the flag that caused it (`invalid --set optimizer.params.lr=abc: ...`), else
    the config file.
    """
    from jaxspeed.config import load_config

    overrides = [(text, f"--set {text}") for text in args.overrides]
    if args.device_memory is not None:
        overrides.append((f"hardware.device_memory={args.device_memory}",
                          f"--device-memory {args.device_memory}"))
    if (getattr(args, "steps", None) or 0) >= 1:  # so "auto" total_num_steps follows it
        overrides.append((f"steps={args.steps}", f"--steps {args.steps}"))
    config = load_config(args.config, overrides=[text for text, _ in overrides],
                         override_names=[name for _, name in overrides])
    if config.checkpoint.load_from is None:
        return config
    from jaxspeed.checkpoint.params import with_checkpoint_model

    return with_checkpoint_model(config)  # reads the record only: before anything compiles
