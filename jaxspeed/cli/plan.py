"""`jaxspeed plan` and `jaxspeed calibrate`: the sharding plan, its memory, and the cluster files.

This module owns the planning commands: `plan` prints the plan and per-device memory of a
config (compiled for this machine's devices, or deviceless for a GPU named by `--target` /
`--cluster`), `plan --auto` ranks the plans of a cluster, and `calibrate` measures this
machine into the cluster file that `plan --cluster` reads. `compile_on_cpu_host` is the
platform choice `main` applies before JAX starts when a GPU is compiled for.
"""

from __future__ import annotations

import contextlib
import json

from jaxspeed.cli.parser import load_config_args


def compile_on_cpu_host() -> None:
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
        from jaxspeed.config.cluster import load_cluster

        cluster = load_cluster(args.cluster)
    target = args.target or (cluster.gpu if cluster is not None else None)
    if target is None:
        if cluster is not None:
            import jax

            if args.devices is None and jax.device_count() == cluster.devices:
                return None  # a cluster of this machine's devices (`calibrate`): compile here
            raise JaxspeedError(
                f"cluster {cluster.name} names no GPU (its `gpu:` key) and has {cluster.devices} "
                f"devices, this machine {jax.device_count()}: give --target h100|h200|a100, or "
                f"--cpu-devices {cluster.devices} to compile on emulated devices")
        if args.devices is not None:
            raise JaxspeedError("--devices goes with --target or --cluster")
        return None
    devices = args.devices or (cluster.devices if cluster is not None else 8)
    return target, devices, cluster


def plan_command(args) -> int:
    """`jaxspeed plan`: prints the sharding plan and per-device memory (`--auto`: ranked plans)."""
    from jaxspeed.errors import JaxspeedError

    if args.auto:
        return _auto_plan(args)
    if args.apply:
        raise JaxspeedError("--apply goes with --auto")
    from jaxspeed.train.engine import initialize
    from jaxspeed.cost.fit import device_memory
    from jaxspeed.train.fit_check import engine_verdict
    from jaxspeed.cost.plan_table import format_plan

    config = load_config_args(args)
    target = _gpu_target(args)
    mesh, cluster = None, None
    if args.cluster:
        from jaxspeed.config.cluster import load_cluster

        cluster = load_cluster(args.cluster)
    devices = None
    if target is not None or cluster is not None:
        import jax

        devices = jax.devices()
        if target is not None:
            from jaxspeed.gpu import deviceless, targets

            name, count, cluster = target
            devices = deviceless.devices(name, count)
        config = _hosts_of(config, cluster, len(devices))
    with _cluster_processes(config, cluster, devices):
        if devices is not None:
            from jaxspeed.runtime.mesh import make_mesh

            mesh = make_mesh(config.mesh, devices=devices)
        engine = initialize(config, mesh=mesh)
        report = {**engine.memory_report(), "profile": engine.profile()}
    if cluster is not None:
        from jaxspeed.autoplan.predict import predict

        report["predicted"] = predict(config, dict(engine.mesh.shape), cluster)
    budget = device_memory(config)
    if target is not None:
        spec = targets.load(name)
        if budget is None:
            budget = cluster.device_memory_bytes if cluster is not None else spec.memory_bytes
        report["target"] = {"gpu": spec.name, "device_kind": spec.device_kind, "devices": count,
                            "cluster": cluster.name if cluster is not None else None}
        report.update(step_prediction(engine, spec.name))
    verdict = engine_verdict(engine, budget) if budget is not None else None
    report["fit"] = verdict.to_dict() if verdict is not None else None
    if args.json:
        print(json.dumps(report))
    else:
        print(engine.plan.explain())
        print()
        print(format_plan(report))
        if cluster is not None:
            from jaxspeed.autoplan.predict import format_predicted

            print()
            print("\n".join(format_predicted(report["predicted"])))
        if target is not None:
            from jaxspeed.cost.plan_table import format_roofline

            print()
            print("\n".join(format_roofline(report)))
    return 0


def step_prediction(engine, target: str, *, efficiency: float | None = None) -> dict:
    """The roofline of `engine`'s compiled train step on the GPU `target`
    (`jaxspeed.cost.roofline.predict`): predicted step seconds, MFU and HFU per device, model
    FLOPs as `metrics.jsonl` counts them (`model_train_flops`). The engine's mesh must be that
    GPU's devices (deviceless or real)."""
    from jaxspeed.cost import roofline
    from jaxspeed.cost.flops import model_train_flops
    from jaxspeed.cost.peaks import gpu_peaks
    from jaxspeed.gpu import targets

    spec = targets.load(target)
    config = engine.config
    tokens = engine.batch_sizes.train_batch_size * config.data.seq_len
    model_flops = model_train_flops(config.model, tokens=tokens, seq_len=config.data.seq_len,
                                    param_count=engine.param_count)
    return roofline.predict(
        engine.compile_train_step().as_text(), peaks=gpu_peaks(spec.device_kind),
        hbm=spec.memory_bandwidth, model_flops=model_flops / engine.mesh.size,
        num_devices=engine.mesh.size,
        efficiency=roofline.MATMUL_EFFICIENCY if efficiency is None else efficiency)


def _hosts_of(config, cluster, devices: int):
    """`config` on `cluster`'s hosts: `mesh.hosts: auto` becomes the cluster's host count when
    that divides the total data-parallel degree (one process emulates the cluster's hosts, as
    `mesh.hosts` does), so the compiled step and the prediction place collectives on hosts."""
    from jaxspeed.config import load_config
    from jaxspeed.runtime.mesh import DATA, resolve_axis_sizes

    if cluster is None or cluster.hosts < 2 or config.mesh.hosts != "auto":
        return config
    data = resolve_axis_sizes(config.mesh.axis_sizes(), devices)[DATA]
    if data % cluster.hosts or devices != cluster.devices:
        return config
    return load_config(config, overrides=[f"mesh.hosts={cluster.hosts}"])


def _cluster_processes(config, cluster, devices):
    """Where `cluster`'s hosts split another axis than `data` (`_hosts_of` gave the mesh no
    `host` axis: the slow link's `mesh.expert=4, mesh.data=1`), or its collectives run over
    gloo, a context in which this process's `devices` stand for the cluster's processes, one a
    host, so the step compiles as each of them compiles it: its collectives over the hosts in
    two stages, the profile's "across hosts" counting them, and what `auto` picks over gloo
    (`shard_order`, `max_reduce_scatter_elements`). Else a context that does nothing."""
    import jax

    from jaxspeed.runtime.distributed import emulated_processes

    if (devices is None or cluster is None or cluster.hosts < 2
            or (config.mesh.hosts not in ("auto", 1) and cluster.collectives != "gloo")
            or jax.process_count() > 1 or len(devices) != cluster.devices):
        return contextlib.nullcontext()
    return emulated_processes(cluster.hosts, devices)


def _auto_plan(args) -> int:
    """`plan --auto`: prints the cluster's plans, ranked (`--apply`: writes the best)."""
    from jaxspeed.autoplan.plans_table import format_table, to_dict, write_config
    from jaxspeed.autoplan.search import search
    from jaxspeed.config.cluster import available_presets, load_cluster
    from jaxspeed.errors import JaxspeedError

    if args.cluster is None:
        raise JaxspeedError(f"plan --auto needs --cluster NAME|FILE (presets: {', '.join(available_presets())})")
    cluster = load_cluster(args.cluster)
    config = load_config_args(args)
    devices, note = _auto_devices(cluster, args.devices, args.target)
    ranked = search(config, cluster, top=args.top, verify=args.verify, devices=devices,
                    progress=not (args.no_progress or args.json))
    if args.apply:
        write_config(config, ranked[0], cluster, args.apply)
    from jaxspeed.autoplan.predict import onebit_alternatives
    from jaxspeed.autoplan.plans_table import format_alternatives

    alternatives = onebit_alternatives(config, ranked[0].plan, cluster)
    if args.json:
        print(json.dumps({"cluster": cluster.name, "compiled_on": note,
                          "plans": [to_dict(r) for r in ranked],
                          "onebit_alternatives": alternatives}))
    else:
        print(format_table(ranked, cluster))
        for line in format_alternatives(alternatives, config.optimizer.type):
            print(line)
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


def calibrate_command(args) -> int:
    """`jaxspeed calibrate`: measures this machine into a cluster YAML; prints it as JSON."""
    from jaxspeed.autoplan.calibrate import main as calibrate
    from jaxspeed.errors import ConfigError

    if args.overrides and args.config is None:
        raise ConfigError("calibrate: --set needs --config (the config it overrides)")
    model = load_config_args(args) if args.config is not None else None
    cluster = calibrate(args.out, name=args.name, repeats=args.repeats,
                        matmul_size=args.matmul_size, collective_mib=args.collective_mib,
                        model=model,
                        model_source=" --set ".join([args.config or "", *args.overrides]))
    import jax

    if jax.process_index() == 0:
        print(json.dumps({"out": args.out, **cluster.model_dump(mode="json")}))
    return 0
