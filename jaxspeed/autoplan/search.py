"""`plan --auto`: enumerate plans, prune with the analytic model, verify the best by compiling.

1. Every legal plan (`space.candidates`) is costed analytically (`estimate.estimate`); plans
   whose device memory exceeds the cluster's, or whose offloaded state exceeds host memory,
   are dropped.
2. `verify` of them are compiled, shapes only, as `jaxspeed plan` does: the analytically
   fastest of each (ZeRO stage, remat) pair first (`_to_verify`). A cluster larger
   than the devices at hand is compiled as a **proxy**: the same plan with `data` shrunk until
   it fits (the micro-batch per device is kept, so every per-device shape, FLOP and activation
   is the real plan's). What the shrink changes is put back analytically: the ZeRO-sharded
   state (divided by the real `data`, not the proxy's) and the collectives over `data`, whose
   per-device bytes are the same but whose group size and links are the real mesh's
   (`comm.step_comm_seconds(scale_axes=...)`). A plan whose other axes alone exceed the
   devices at hand keeps its analytic figures, is marked so, and ranks after the compiled
   ones (the two kinds of figure are not comparable).
3. Plans are ranked by predicted step time: the compiled step's instructions one after
   another, each at its own roofline (its matmul FLOPs at the cluster's peak x efficiency, or
   its memory traffic at the memory bandwidth, whichever is longer;
   `cost.flops.roofline_seconds`), plus the compiled step's collectives on their links, plus
   the analytic copies to and from host memory of offloaded state and activations over the
   `host_link` (no overlap: see `estimate`). A pipeline's bubble is already in the compiled
   figure: its loop runs every slot, an idle one as long as the costliest branch (on a real
   device the idle stage waits that long for its neighbours).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax

from jaxspeed.autoplan import comm
from jaxspeed.autoplan.estimate import Estimate, estimate
from jaxspeed.autoplan.space import OFFLOAD, ON_HOST, Candidate, candidates, why_no_plan
from jaxspeed.config import Config, load_config
from jaxspeed.errors import ConfigError, JaxspeedError
from jaxspeed.cost.memory import COMPILED_GPU
from jaxspeed.ops.precision import compute_dtype
from jaxspeed.runtime.progress import Progress, phase
from jaxspeed.cost.flops import model_train_flops, roofline_seconds
from jaxspeed.cost.hlo import collectives


@dataclasses.dataclass
class Ranked:
    """A plan with its predicted cost: the analytic estimate, and the compiled one if verified."""

    plan: Candidate
    analytic: Estimate
    device_bytes: int
    step_s: float
    flops: float  #: per device per step
    bound: str
    source: str  #: "compiled" (XLA:CPU), "compiled-gpu" (XLA:GPU), "... (proxy data=N)", "analytic"
    tokens_per_s: float = 0.0
    #: model FLOPs (`cost.flops.model_train_flops`: 6·N + causal attention per token, no
    #: recomputation) per device over the step time and the peak: what `metrics.jsonl` reports
    mfu: float = 0.0
    #: `flops` (what the step runs: remat's recomputation included) over the step and the peak
    hfu: float = 0.0


class NoPlanFits(JaxspeedError):
    """No legal plan fits the cluster's memory; the message names the closest one."""


def _tokens(config: Config, plan: Candidate) -> int:
    s = plan.sizes
    return plan.micro_batch * plan.accumulation * s["data"] * s["expert"] * config.data.seq_len


def _finish(config: Config, cluster: Any, ranked: Ranked) -> Ranked:
    tokens = _tokens(config, ranked.plan)
    ranked.tokens_per_s = tokens / ranked.step_s
    peak = cluster.peak_flops(compute_dtype(config).name)
    model_flops = model_train_flops(config.model, tokens=tokens, seq_len=config.data.seq_len,
                                    param_count=0) / math.prod(ranked.plan.sizes.values())
    ranked.mfu = model_flops / ranked.step_s / peak
    ranked.hfu = ranked.flops / ranked.step_s / peak
    return ranked


def proxy_sizes(sizes: dict[str, int], devices: int) -> dict[str, int] | None:
    """`sizes` with `data` shrunk to the largest divisor that fits `devices`, but not below 2
    where it is 2 or more (at 1 its collectives would leave the program); None if that does
    not fit."""
    rest = math.prod(n for a, n in sizes.items() if a != "data")
    least = min(2, sizes["data"])
    fitting = [d for d in range(least, sizes["data"] + 1) if sizes["data"] % d == 0 and d * rest <= devices]
    return {**sizes, "data": max(fitting)} if fitting else None


def proxy_plan(config: Config, plan: Candidate, devices: int) -> tuple[Config, dict[str, int]] | None:
    """The config to compile for `plan` on `devices` (see the module docstring)."""
    sizes = proxy_sizes(plan.sizes, devices)
    if sizes is None:
        return None
    # a proxy keeps one host (its shrunk data axis need not split over the real hosts); the
    # collectives are placed on the real hosts by device id (`comm`)
    shrunk = dataclasses.replace(plan, mesh=tuple((a, sizes[a]) for a, _ in plan.mesh),
                                 hosts=plan.hosts if sizes == plan.sizes else 1)
    batch = plan.micro_batch * plan.accumulation * sizes["data"] * sizes["expert"]
    return load_config(config, overrides=[*shrunk.overrides(), f"train_batch_size={batch}"]), sizes


def _unsharded_by_proxy(report: dict[str, Any], plan: Candidate, sizes: dict[str, int]) -> int:
    """Device bytes the proxy holds beyond the real mesh: its ZeRO-sharded state arguments are
    split over fewer devices (params at stage 3, optimizer state from stage 1).

    Sharded gradients (stage 2 and 3) are not subtracted: they live in the step's temporaries,
    where XLA keeps part of them at full size, so the proxy's figure is an upper bound (measured
    on the tiny llama, ZeRO-3: +6% at proxy data 4 for data 8, +15% at data 2).
    """
    sharded = [k for k, stage in (("opt_state", 1), ("params", 3))
               if plan.stage >= stage and k not in ON_HOST[plan.offload]]  # host: not on the device
    kept = sizes["data"] / plan.sizes["data"]
    return int(sum(report["estimate"][k] for k in sharded) * (1 - kept))


def compiled_cost(config: Config, plan: Candidate, cluster: Any, devices: Sequence[jax.Device]) -> Ranked | None:
    """The plan's cost read from its compiled step (on a proxy mesh when the cluster is larger
    than `devices`); None when it cannot be emulated here."""
    from jaxspeed.train.engine import initialize
    from jaxspeed.runtime.mesh import make_mesh

    built = proxy_plan(config, plan, len(devices))
    if built is None:
        return None
    proxy, sizes = built
    n = math.prod(sizes.values())
    engine = initialize(proxy, mesh=make_mesh(proxy.mesh, devices=list(devices)[:n]))
    report, profile = engine.memory_report(), engine.profile()
    real = estimate(config, plan, cluster)
    device_bytes = report["per_device_bytes"]["device"] - _unsharded_by_proxy(report, plan, sizes)
    flops = profile["flops_per_device"]
    text = engine.compile_train_step().as_text()
    speed = cluster.peak_flops(compute_dtype(config).name) * cluster.efficiency
    roof = roofline_seconds(text, flops_per_s=speed, bytes_per_s=cluster.memory_bandwidth_gbps * 1e9)
    # matmuls the HLO hides in library calls (cuBLAS on GPU) count from the jaxpr
    compute = roof["compute"] + max(0.0, flops - roof["flops"]) / speed
    algorithm = getattr(cluster, "collectives", "nccl")
    proxied = sizes["data"] != plan.sizes["data"]
    if algorithm == "gloo" and proxied:  # flat algorithms need the real mesh's rank order
        moved = {"total": real.comm_s}
    else:
        mesh_shape = dict(engine.mesh.shape)  # `host` split off `data` where the plan has hosts
        moved = comm.step_comm_seconds(
            collectives(text, num_devices=n), mesh_shape,
            devices_per_host=cluster.devices_per_host, intra=cluster.intra_host,
            inter=cluster.inter_host, algorithm=algorithm,
            scale_axes={"data": plan.sizes["data"]} if proxied else None,
        )
    # copies to and from host memory: analytic (on CPU both memories are the same RAM)
    step = compute + roof["memory"] + moved["total"] + real.host_s
    parts = {"compute": compute, "memory": roof["memory"], "network": moved["total"], "host": real.host_s,
             "bubble": (compute + roof["memory"]) * real.bubble}
    source = "compiled-gpu" if report["source"] == COMPILED_GPU else "compiled"  # GPU: deviceless
    if sizes != plan.sizes:
        source = f"{source} (proxy data={sizes['data']})"
    return _finish(config, cluster, Ranked(plan, real, device_bytes, step, flops,
                                           max(parts, key=parts.get), source))


def _fits(est: Estimate, cluster: Any) -> bool:
    host_per_device = cluster.host_memory_bytes / cluster.devices_per_host
    return est.device_bytes <= cluster.device_memory_bytes and est.host_bytes <= host_per_device


def _to_verify(fitting: list[tuple[Estimate, Candidate]], verify: int) -> list[tuple[Estimate, Candidate]]:
    """The `verify` plans to compile, round-robin over (ZeRO stage, remat) pairs in analytic
    order; within a pair, the best plan of each mesh before any mesh's second.

    The analytic model counts FLOPs and collectives, not memory traffic, which decides
    between stages, remat policies and meshes on memory-bound devices (there it ties plans
    that the compiled roofline tells apart); so every pair, and as many meshes as the budget
    allows, get compiled."""
    groups: dict[tuple[int, str], list[tuple[Estimate, Candidate]]] = {}
    for ep in fitting:
        groups.setdefault((ep[1].stage, ep[1].remat), []).append(ep)
    for key, group in groups.items():
        meshes: set = set()
        firsts = [ep for ep in group if ep[1].mesh not in meshes and not meshes.add(ep[1].mesh)]
        groups[key] = firsts + [ep for ep in group if ep not in firsts]
    order = []
    for rank in range(max(map(len, groups.values()), default=0)):
        order += [g[rank] for g in groups.values() if rank < len(g)]
        if len(order) >= verify:
            break
    return order[:verify]


def _compile_best(config: Config, cluster: Any, chosen: list[tuple[Estimate, Candidate]],
                  devices: list[jax.Device], *, progress: bool) -> list[Ranked]:
    """The compiled cost of each chosen plan that the engine builds and that fits the cluster.

    Each compile takes seconds to minutes: without a terminal a heartbeat line (`phase`) and
    the count so far, with the last plan compiled, show every `JAXSPEED_PROGRESS_SECONDS`."""
    compiled: list[Ranked] = []
    if not chosen:
        return compiled
    with phase(f"plan --auto: compiling the {len(chosen)} best plans", enabled=progress), \
            Progress(len(chosen), desc="plan --auto: compiled", unit="plan", enabled=progress) as bar:
        for _, plan in chosen:
            try:
                cost = compiled_cost(config, plan, cluster, devices)
            except ConfigError:  # a combination the engine refuses that the space let through
                cost = None
            if cost is not None and cost.device_bytes <= cluster.device_memory_bytes:
                compiled.append(cost)
            bar.set_postfix(last=plan.describe())
            bar.update()
    return compiled


def search(
    config: Config, cluster: Any, *, top: int = 5, verify: int = 8,
    devices: Sequence[jax.Device] | None = None, progress: bool = True,
) -> list[Ranked]:
    """The `top` plans for `config`'s model on `cluster`, fastest first.

    Args:
      config: the run config; its model, data, optimizer and `train_batch_size` are kept.
      cluster: a `jaxspeed.config.cluster.Cluster`.
      top: plans to return.
      verify: how many of the analytically fastest to compile (0: analytic only).
      devices: devices to compile on (default `jax.devices()`).
      progress: progress on stderr over the costing and the compiles (`runtime.progress`: a
        bar on a terminal, else a line every `JAXSPEED_PROGRESS_SECONDS`).

    Raises:
      NoPlanFits: no legal plan fits, naming the closest and its shortfall.
    """
    plans = list(candidates(config, cluster.devices, cluster.devices_per_host))
    if not plans:
        raise ConfigError(
            f"no legal plan for this model on {cluster.devices} devices ({cluster.devices_per_host} "
            f"per host): {why_no_plan(config, cluster.devices, cluster.devices_per_host)}"
        )
    with Progress(len(plans), desc="plan --auto: costing plans", unit="plan", enabled=progress) as bar:
        costed = []
        for p in plans:
            costed.append((estimate(config, p, cluster), p))
            bar.update()
    fitting = sorted(((e, p) for e, p in costed if _fits(e, cluster)), key=lambda ep: ep[0].step_s)
    # Offload buys room, not speed: offer it only where the same plan with less offloaded
    # (OFFLOAD's order) does not fit
    fits = {p for _, p in fitting}
    fitting = [(e, p) for e, p in fitting
               if not any(dataclasses.replace(p, offload=less) in fits
                          for less in OFFLOAD[:OFFLOAD.index(p.offload)])]
    if not fitting:
        est, plan = min(costed, key=lambda ep: ep[0].device_bytes - cluster.device_memory_bytes)
        raise NoPlanFits(
            f"no plan fits {cluster.name}: the closest, {plan.describe()}, needs "
            f"{est.device_bytes / 2**30:.1f} GiB per device of {cluster.device_memory_bytes / 2**30:.1f} GiB "
            f"(short by {(est.device_bytes - cluster.device_memory_bytes) / 2**30:.1f} GiB)"
        )
    devices = list(devices if devices is not None else jax.devices())
    compiled = _compile_best(config, cluster, _to_verify(fitting, verify), devices, progress=progress)
    # Compiled and analytic times are not comparable (only the compiled roofline sees memory
    # traffic), so compiled plans rank first; plans too large to emulate here follow them.
    analytic = [
        _finish(config, cluster, Ranked(plan, est, est.device_bytes, est.step_s, est.flops, est.bound, "analytic"))
        for est, plan in fitting[:top]
        if not compiled or proxy_sizes(plan.sizes, len(devices)) is None  # (verify=0: all)
    ]
    compiled.sort(key=lambda r: r.step_s)
    return (compiled + analytic)[:top]
