"""`jaxspeed train | plan | calibrate | bench | export | import-hf | sample | tokenize | tokenizer | launch`: thin shells over the library.

JAX is imported only after the flags are read, so `--cpu-devices` can still set the number of
emulated CPU devices. Errors caused by input are printed as one line, with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML or JSON config (jaxspeed or DeepSpeed keys)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config key, e.g. --set zero_optimization.stage=3 (repeatable)",
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxspeed", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train the reference GPT described by a config")
    _common(train)
    train.add_argument("--steps", type=int, default=None, help="total steps (default: config steps)")
    train.add_argument("--output", default="runs/latest", help="run directory (metrics.jsonl)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument(
        "--force", action="store_true", help="start even if the plan does not fit device memory"
    )

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
                      help="a preset in configs/clusters/ or a cluster YAML (`jaxspeed "
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
    plan.add_argument("--no-progress", action="store_true", help="with --auto: no progress bar")

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

    bench = sub.add_parser("bench", help="run a benchmark from benchmarks/")
    bench.add_argument("name", help="benchmark name, e.g. zero_memory")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark")

    export = sub.add_parser(
        "export", help="write a checkpoint's params, consolidated, for one device (zero_to_fp32)"
    )
    export.add_argument("checkpoint", help="checkpoint directory, e.g. runs/x/checkpoints")
    export.add_argument(
        "--out", required=True,
        help="output file (.msgpack, Flax serialization), or folder with --format hf",
    )
    export.add_argument("--step", type=int, default=None, help="default: the newest complete one")
    export.add_argument(
        "--format", choices=("msgpack", "hf"), default="msgpack",
        help="msgpack: Flax serialization (default); hf: a Hugging Face Llama folder "
        "(config.json + safetensors) for transformers' from_pretrained",
    )
    export.add_argument(
        "--dtype", default=None, choices=("float32", "bfloat16", "float16"),
        help="with --format hf: the saved dtype (default: the checkpoint's)",
    )

    import_hf = sub.add_parser(
        "import-hf", help="convert a Hugging Face Llama folder to a checkpoint (checkpoint.load_from)"
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
    tokenize.add_argument("--no-progress", action="store_true", help="no progress bar")

    tokenizer = sub.add_parser("tokenizer", help="tokenizer tools")
    tokenizer_sub = tokenizer.add_subparsers(dest="tokenizer_command", required=True)
    bpe = tokenizer_sub.add_parser("train", help="train a byte-level BPE on local text files")
    bpe.add_argument("files", nargs="+", help=".txt/.jsonl/.parquet files or folders")
    bpe.add_argument("--vocab-size", type=int, required=True, metavar="N", help="vocabulary size")
    bpe.add_argument("--out", required=True, metavar="DIR", help="folder for tokenizer.json")
    bpe.add_argument("--text-key", default="text", help="jsonl field / parquet column (default text)")

    sample = sub.add_parser(
        "sample", help="continue a prompt with a trained checkpoint (key/value cache)"
    )
    sample.add_argument("checkpoint",
                        help="a run's checkpoints (runs/x/checkpoints) or an import-hf folder")
    sample.add_argument("--prompt", required=True, help="the text to continue")
    sample.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    sample.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    sample.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    sample.add_argument("--seed", type=int, default=0)
    sample.add_argument("--tokenizer", default=None,
                        help="tokenizer.json (default: bytes, token = byte value)")
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
            _compile_on_cpu_host()
        if args.command in ("train", "plan"):
            from jaxspeed.runtime import distributed

            if args.distributed or distributed.launched():
                distributed.initialize()  # before any JAX computation
        handlers = {
            "train": _train, "plan": _plan, "bench": _bench, "launch": _launch, "export": _export,
            "import-hf": _import_hf, "sample": _sample,
            "tokenize": _tokenize, "tokenizer": _tokenizer, "calibrate": _calibrate,
        }
        return handlers[args.command](args)
    except JaxspeedError as err:
        signum = getattr(err, "signum", None)  # preempted: the checkpoint is saved
        print(f"jaxspeed {args.command}: {'' if signum else 'error: '}{err}", file=sys.stderr)
        return 128 + signum if signum else 2


def _load(args):
    from jaxspeed.config import load_config

    overrides = list(args.overrides)
    if args.device_memory is not None:
        overrides.append(f"hardware.device_memory={args.device_memory}")
    return load_config(args.config, overrides=overrides)


def _train(args) -> int:
    from jaxspeed.train.loop import train

    record = train(
        _load(args), output_dir=args.output, steps=args.steps,
        progress=False if args.no_progress else None, force=args.force,
    )
    print(json.dumps({"output": str(args.output), **record}))
    return 0


def _compile_on_cpu_host() -> None:
    """Deviceless GPU compilation needs JAX on its CPU platform (the CUDA plugin registers its
    compiler only then); unless the user chose platforms, choose the CPU."""
    import os

    import jax

    if not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")
    # a cached GPU executable cannot be loaded back without a GPU client (XLA warns and
    # compiles again), so the compilation cache only costs disk here
    jax.config.update("jax_enable_compilation_cache", False)


def _gpu_target(args):
    """`(target name, device count, cluster)` for `plan --target/--cluster`, or None."""
    from jaxspeed.errors import JaxspeedError

    cluster = None
    if args.cluster:
        from jaxspeed.autoplan.cluster import load_cluster

        cluster = load_cluster(args.cluster)
    target = args.target or (cluster.gpu if cluster is not None else None)
    if target is None:
        if cluster is not None:
            raise JaxspeedError(
                f"cluster {cluster.name} names no GPU (its `gpu:` key): give --target h100|h200|a100")
        if args.devices is not None:
            raise JaxspeedError("--devices goes with --target or --cluster")
        return None
    devices = args.devices or (cluster.devices if cluster is not None else 8)
    return target, devices, cluster


def _plan(args) -> int:
    from jaxspeed.errors import JaxspeedError

    if args.auto:
        return _auto_plan(args)
    if args.apply:
        raise JaxspeedError("--apply goes with --auto")
    from jaxspeed.train.engine import initialize
    from jaxspeed.cost.fit import device_memory, engine_verdict
    from jaxspeed.cost.report import format_plan

    config = _load(args)
    target = _gpu_target(args)
    mesh = None
    if target is not None:
        from jaxspeed.gpu import deviceless, targets
        from jaxspeed.runtime.mesh import make_mesh

        name, count, cluster = target
        mesh = make_mesh(config.mesh, devices=deviceless.devices(name, count))
    engine = initialize(config, mesh=mesh)
    report = {**engine.memory_report(), "profile": engine.profile()}
    budget = device_memory(config)
    if target is not None:
        spec = targets.load(name)
        if budget is None:
            budget = cluster.device_memory_bytes if cluster is not None else spec.memory_bytes
        report["target"] = {"gpu": spec.name, "device_kind": spec.device_kind, "devices": count,
                            "cluster": cluster.name if cluster is not None else None}
    verdict = engine_verdict(engine, budget) if budget is not None else None
    report["fit"] = verdict.to_dict() if verdict is not None else None
    if args.json:
        print(json.dumps(report))
    else:
        print(engine.plan.explain())
        print()
        print(format_plan(report))
    return 0


def _auto_plan(args) -> int:
    from jaxspeed.autoplan.cluster import load_cluster
    from jaxspeed.autoplan.report import format_table, to_dict, write_config
    from jaxspeed.autoplan.search import search
    from jaxspeed.errors import JaxspeedError

    if args.cluster is None:
        raise JaxspeedError("plan --auto needs --cluster NAME|FILE (see configs/clusters/)")
    cluster = load_cluster(args.cluster)
    config = _load(args)
    devices, note = _auto_devices(cluster, args.devices, args.target)
    ranked = search(config, cluster, top=args.top, verify=args.verify, devices=devices,
                    progress=not (args.no_progress or args.json))
    if args.apply:
        write_config(config, ranked[0], cluster, args.apply)
    if args.json:
        print(json.dumps({"cluster": cluster.name, "compiled_on": note,
                          "plans": [to_dict(r) for r in ranked]}))
    else:
        print(format_table(ranked, cluster))
        print(f"memory checked on: {note}")
        if args.apply:
            print(f"wrote {args.apply}: {ranked[0].plan.describe()}")
    return 0


def _auto_devices(cluster, devices: int | None, target: str | None):
    """The devices `plan --auto` compiles its plans on, and a line saying which: the cluster's
    own GPUs, deviceless, when it names one and the CUDA plugin is installed; else this
    machine's devices, with the larger meshes compiled as proxies."""
    from jaxspeed.errors import JaxspeedError
    from jaxspeed.gpu import deviceless

    if devices is not None or target is not None:
        raise JaxspeedError(
            "--devices and --target do not go with --auto: the cluster gives the count and "
            "its `gpu:` key the target")
    if cluster.gpu is None:
        return None, "this machine's devices (the cluster names no GPU to compile for)"
    reason = deviceless.missing()
    if reason is not None:
        return None, f"this machine's devices, as proxies ({reason})"
    found = deviceless.devices(cluster.gpu, cluster.devices)
    return found, f"{len(found)} x {found[0].device_kind}, compiled by XLA:GPU without a GPU"


def _calibrate(args) -> int:
    from jaxspeed.autoplan.calibrate import main as calibrate

    cluster = calibrate(args.out, name=args.name, repeats=args.repeats,
                        matmul_size=args.matmul_size, collective_mib=args.collective_mib)
    print(json.dumps({"out": args.out, **cluster.model_dump(mode="json")}))
    return 0


def _bench(args) -> int:
    from jaxspeed.errors import JaxspeedError

    script = BENCHMARKS / f"{args.name}.py"
    if args.name.startswith("_") or not script.is_file():
        names = sorted(p.stem for p in BENCHMARKS.glob("[!_]*.py")) if BENCHMARKS.is_dir() else []
        raise JaxspeedError(f"unknown benchmark {args.name!r}; available: {names}")
    sys.argv = [str(script), *args.args]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def _export(args) -> int:
    from jaxspeed.errors import JaxspeedError
    from jaxspeed.checkpoint.export import export_params

    if args.format == "hf":
        from jaxspeed.checkpoint.hf import export_hf

        out = export_hf(args.checkpoint, args.out, step=args.step, dtype=args.dtype)
    elif args.dtype is not None:
        raise JaxspeedError("--dtype is only for --format hf (msgpack keeps the checkpoint's dtype)")
    else:
        out = export_params(args.checkpoint, args.out, step=args.step)
    print(f"wrote {out}")
    return 0


def _import_hf(args) -> int:
    from jaxspeed.checkpoint.hf import import_hf

    out = import_hf(args.folder, args.out, dtype=args.dtype)
    print(f"wrote {out}")
    return 0


def _tokenize(args) -> int:
    from jaxspeed.data.text_tokens import tokenize_files

    result = tokenize_files(
        args.files, tokenizer_path=args.tokenizer, out=args.out, text_key=args.text_key,
        eos_id=args.eos_id, progress=not args.no_progress and sys.stderr.isatty(),
    )
    print(json.dumps(result))
    return 0


def _tokenizer(args) -> int:
    from jaxspeed.data.text_tokens import train_bpe

    path = train_bpe(args.files, vocab_size=args.vocab_size, out_dir=args.out, text_key=args.text_key)
    print(f"wrote {path}")
    return 0


def _launch(args) -> int:
    from jaxspeed.runtime.launch import DEFAULT_GRACE, DEFAULT_INIT_TIMEOUT, launch

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    return launch(
        command, nproc=args.nproc, cpu_devices=args.child_cpu_devices, timeout=args.timeout,
        init_timeout=DEFAULT_INIT_TIMEOUT if args.init_timeout is None else args.init_timeout,
        grace=DEFAULT_GRACE if args.grace is None else args.grace,
    )


def _sample(args) -> int:
    import jax

    from jaxspeed.config import load_config
    from jaxspeed.train.engine import initialize
    from jaxspeed.checkpoint.export import load_trained
    from jaxspeed.checkpoint.params import is_params_checkpoint, read_record, start_from
    from jaxspeed.models.sampling import Codec, sample_text

    codec = Codec(args.tokenizer)
    if is_params_checkpoint(args.checkpoint):  # straight from `jaxspeed import-hf`
        model = read_record(args.checkpoint)["model"]
        engine = initialize(load_config({
            "model": model, "data": {"seq_len": model["max_seq_len"]},
            "train_micro_batch_size_per_device": 1}))
        params = start_from(engine, args.checkpoint, jax.random.key(0)).params
    else:
        engine, state = load_trained(args.checkpoint, step=args.step)
        params = state.params
    text = sample_text(
        engine, params, args.prompt, codec, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_p=args.top_p, key=jax.random.key(args.seed),
    )
    print(args.prompt + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

