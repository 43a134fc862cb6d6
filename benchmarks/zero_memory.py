"""Per-device model-state memory of ZeRO stages 0–3 against ZeRO's ideal (Rajbhandari 2020).

The reference GPT at ~100M parameters (GPT-2 small's shape with a 20,480-token tied vocabulary)
on 8 emulated CPU devices, mesh data=8, AdamW. Each stage's state is built for real
(`engine.init`), measured, and deleted before the next stage's. Stage 0 is the largest: its
params and Adam m, v (12 bytes/param) are replicated on all 8 devices, 9.7 GB; with the init's
scratch the process peaked at 10.2 GiB, inside the 24 GiB these machines have (a 50M model would
halve that; 100M keeps the case of earlier runs). The step is compiled, never run.

Where each number comes from (the `source` of every JSON line):
- `arrays`: params and optimizer state, the bytes of device 0's shards of the initialized state.
- `model`: gradients, from the plan's arithmetic. They are not state: they exist only inside
  the step, as scratch (in the compiled `temp`, which does not itemise them). The step
  constrains them to the plan's gradient shardings (`plan.grads`, fp32), so their bytes per
  device are `plan.bytes_per_device("grad")`.
- `compiled`: the train step's `memory_analysis()`; the step's peak is argument + output −
  alias + temp (state, batch, new state not donated over the old, and scratch: gradients,
  gathered stage-3 params, activations).
- `formula`: ZeRO's ideal. With Ψ parameters on N data-parallel devices and K bytes of optimizer
  state per parameter, DeepSpeed's mixed-precision Adam keeps 2Ψ fp16 params, 2Ψ fp16 grads and
  KΨ = 12Ψ (fp32 master, m, v), and

    stage 0: (2+2+K)Ψ   stage 1: (2+2)Ψ + KΨ/N   stage 2: 2Ψ + (2+K)Ψ/N   stage 3: (2+2+K)Ψ/N

  jaxspeed keeps fp32 params (they are the masters), fp32 grads and Adam's m, v: 4 + 4 + 8
  bytes, also 16 per parameter. The ideal here is ZeRO's formula with jaxspeed's widths (4, 4, 8).

Stage 3 runs twice: gathering each layer's params at each use (`max_live_parameters: 0`), and
gathering the whole model once per step (the default for a model within
`zero_optimization.max_live_parameters`). The model state is the same; the step peaks differ.

ZeRO-3 runs on two paths (`zero_optimization.collectives`): the sharding XLA partitions, and the
collectives written in the step (the path across hosts). Their compiled step peaks are compared
per device, gathered layer by layer and once per step, on one host and on 2 hosts emulated on
the 8 devices (`mesh.hosts`); the target is explicit <= 1.05x the sharding path.

Headline: stage 3 (gathered once), ratio = ideal / measured model state (1.0 = every byte of
state sharded 8 ways).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE)]

import _common  # noqa: E402

NAME = "zero_memory"
#: (stage, stage 3 gathering layer by layer): stage 3 twice, the headline (the whole model
#: gathered once per step, as `zero_optimization.max_live_parameters` allows) last.
STAGES = ((0, False), (1, False), (2, False), (3, True), (3, False))
#: (param bytes, grad bytes, optimizer-state bytes K) per parameter.
JAXSPEED_WIDTHS = (4, 4, 8)
DEEPSPEED_WIDTHS = (2, 2, 12)
SOURCES = {
    "params": "arrays", "opt_state": "arrays", "grads": "model", "model_state": "arrays+model",
    "step_peak": "compiled", "ideal": "formula",
}

FULL_MODEL = {
    "vocab_size": 20480, "d_model": 768, "n_layers": 12, "n_heads": 12, "d_ff": 3072,
    "max_seq_len": 128, "tie_embeddings": True,
}
QUICK_MODEL = {
    "vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 256,
    "max_seq_len": 32, "tie_embeddings": True,
}


def ideal_bytes(stage: int, params: int, devices: int, widths: tuple[int, int, int]) -> float:
    """ZeRO's per-device model-state bytes for `stage` (paper §3, Figure 1)."""
    p, g, k = widths
    n = devices
    return {
        0: (p + g + k) * params,
        1: (p + g) * params + k * params / n,
        2: p * params + (g + k) * params / n,
        3: (p + g + k) * params / n,
    }[stage] * 1.0


def shard_bytes(tree, device) -> int:
    """Bytes `device` holds of the arrays in `tree`: the sum of its shards' buffers."""
    import jax

    return sum(
        shard.data.nbytes
        for x in jax.tree.leaves(tree)
        for shard in x.addressable_shards
        if shard.device == device
    )


def bench_config(model: dict, *, stage: int, seq_len: int, layer_by_layer: bool = False,
                 collectives: str = "auto", hosts: int = 1):
    """The benchmark's config: mesh data=8, micro 1, AdamW, bf16 compute, ZeRO `stage`;
    `layer_by_layer`: stage 3 gathers each layer at each use (`max_live_parameters: 0`);
    `collectives` and `hosts` (emulated on the 8 devices) pick stage 3's path."""
    from jaxspeed.config import load_config

    return load_config({
        "mesh": {"pipe": 1, "data": -1, "expert": 1, "tensor": 1, "hosts": hosts},
        "train_micro_batch_size_per_device": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage, "collectives": collectives,
                              **({"max_live_parameters": 0} if layer_by_layer else {})},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
        "model": {"type": "gpt", **model},
        "data": {"source": "stdlib", "seq_len": seq_len},
    })


def measure(stage: int, model: dict, *, seq_len: int, layer_by_layer: bool = False) -> dict:
    """Per-device bytes of one stage: real state shards, the plan's grads, the compiled step."""
    import jax

    from jaxspeed.train.engine import initialize
    from jaxspeed.cost.memory import compiled_stats, step_peak
    from jaxspeed.models.gpt import count_params

    engine = initialize(bench_config(model, stage=stage, seq_len=seq_len,
                                     layer_by_layer=layer_by_layer))
    start = time.perf_counter()
    compiled = compiled_stats(engine.compile_train_step())  # before the state takes its memory
    compile_s = time.perf_counter() - start
    state = engine.init(jax.random.key(0))
    device = jax.devices()[0]
    row = {
        "stage": stage,
        "gather": None if stage < 3 else "layer by layer" if layer_by_layer else "once per step",
        "n_params": count_params(state.params),
        "devices": jax.device_count(),
        "params": shard_bytes(state.params, device),
        "opt_state": shard_bytes(state.opt_state, device),
        "grads": engine.plan.bytes_per_device("grad"),
        "compiled": {k: compiled[k] for k in ("argument", "output", "alias", "temp")},
        "compile_s": compile_s,
    }
    for x in jax.tree.leaves(state):  # free this stage's state before the next one is built
        x.delete()
    row["model_state"] = row["params"] + row["opt_state"] + row["grads"]
    row["step_peak"] = step_peak(row["compiled"])
    return row


#: ZeRO-3's two paths (`zero_optimization.collectives`): the sharding XLA partitions, and the
#: collectives written in the step.
PATHS = ("compiler", "explicit")


def path_peaks(model: dict, *, seq_len: int, quick: bool = False) -> list[dict]:
    """ZeRO-3's compiled step peak on each path, gathered layer by layer and once per step, on
    one host and on 2 emulated hosts: one row per case, with both paths' bytes. `quick`: the
    case across hosts, layer by layer, alone (two compiles, for the tests)."""
    from jaxspeed.train.engine import initialize
    from jaxspeed.cost.memory import compiled_stats, step_peak

    rows = []
    for hosts in (2,) if quick else (1, 2):
        for layer_by_layer in (True,) if quick else (True, False):
            peaks = {}
            for path in PATHS:
                config = bench_config(model, stage=3, seq_len=seq_len,
                                      layer_by_layer=layer_by_layer, collectives=path, hosts=hosts)
                peaks[path] = step_peak(compiled_stats(initialize(config).compile_train_step()))
            rows.append({"hosts": hosts, "gather": "layer by layer" if layer_by_layer else "once per step",
                         "peaks": peaks})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model (seconds, for tests)")
    args = parser.parse_args(argv)
    _common.use_cpu_devices()

    model = QUICK_MODEL if args.quick else FULL_MODEL
    seq_len = model["max_seq_len"]
    start = time.perf_counter()
    rows = [measure(s, model, seq_len=seq_len, layer_by_layer=lbl) for s, lbl in STAGES]
    paths = path_peaks(model, seq_len=seq_len, quick=args.quick)
    wall_s = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    psi, n = rows[0]["n_params"], rows[0]["devices"]
    mib = _common.mib
    print(
        f"ZeRO model-state memory per device: reference GPT, {psi:,} params (Ψ), "
        f"d_model {model['d_model']}, {model['n_layers']} layers, vocab {model['vocab_size']} "
        f"tied; N={n} devices (mesh data={n}); AdamW; micro 1 x seq {seq_len}; bf16 compute"
    )
    print(
        "jaxspeed keeps fp32 params (= masters) + fp32 grads + Adam m, v: 4+4+8 bytes/param; "
        "DeepSpeed mixed precision: 2+2+12. ideal = ZeRO's formula with jaxspeed's widths."
    )
    print()
    table = [["(source)", "arrays", "arrays", "model", "arrays+model", "", "formula", "",
              "formula", "compiled", "compiled", "compiled", "compiled"]]
    for r in rows:
        s, c = r["stage"], r["compiled"]
        r["ideal"] = ideal_bytes(s, psi, n, JAXSPEED_WIDTHS)
        r["deepspeed"] = ideal_bytes(s, psi, n, DEEPSPEED_WIDTHS)
        r["ratio"] = _common.ratio(r["ideal"], r["model_state"])
        table.append([
            f"stage {s}" + (f" ({r['gather']})" if r["gather"] else ""), mib(r["params"]), mib(r["opt_state"]), mib(r["grads"]),
            mib(r["model_state"]), r["model_state"] / psi, mib(r["ideal"]), r["ratio"],
            mib(r["deepspeed"]), mib(c["argument"]), mib(c["output"] - c["alias"]),
            mib(c["temp"]), mib(r["step_peak"]),
        ])
    _common.print_table(
        ["per device (MiB)", "params", "opt", "grads", "state", "B/param", "ideal", "ideal/state",
         "DeepSpeed", "args", "out-alias", "temp", "step peak"],
        table,
    )
    print()
    print(
        "arrays = bytes of device 0's shards of the state built by engine.init; model = the "
        "plan's arithmetic: fp32 grads in the shardings the step constrains them to (grads are "
        "scratch, inside temp); compiled = the train step's memory_analysis(), step peak = "
        "args + out-alias + temp; formula = ZeRO's, with jaxspeed's widths (ideal) or DeepSpeed's."
    )
    print("Stage 3 twice: its params gathered layer by layer at each use, and (the headline) the "
          "whole model gathered once per step, as zero_optimization.max_live_parameters allows.")
    print()
    print("ZeRO-3's two paths, compiled step peak per device (MiB): the sharding XLA partitions "
          "(collectives: compiler) and the collectives written in the step (explicit); hosts "
          "emulated on the 8 devices (mesh.hosts). Target: explicit <= 1.05x.")
    _common.print_table(
        ["hosts", "stage 3 gathers", "sharding path", "explicit", "explicit / sharding"],
        [[r["hosts"], r["gather"], mib(r["peaks"]["compiler"]), mib(r["peaks"]["explicit"]),
          r["peaks"]["explicit"] / r["peaks"]["compiler"]] for r in paths],
    )
    print(f"{wall_s:.1f} s for {len(rows)} runs and {2 * len(paths)} compiles; "
          f"process peak RSS {rss / 2**30:.2f} GiB.")
    for r in paths:
        _common.print_json(_common.result(
            NAME, case=(f"paths hosts={r['hosts']} gather={r['gather'].replace(' ', '_')} "
                        f"params={psi} devices={n}"),
            jaxspeed=mib(r["peaks"]["explicit"]), baseline=mib(r["peaks"]["compiler"]),
            unit="MiB/device (step peak)", ratio=_common.ratio(r["peaks"]["compiler"], r["peaks"]["explicit"]),
            stage3_gather=None, hosts=r["hosts"], gather=r["gather"], source={"step_peak": "compiled"},
        ))
    for r in rows:
        _common.print_json(_result(r, psi, n, model, rss))
    return 0


def _result(r: dict, psi: int, n: int, model: dict, rss: int) -> dict:
    return _common.result(
        NAME,
        case=(f"stage={r['stage']} params={psi} devices={n} d_model={model['d_model']}"
              + (f" gather={r['gather'].replace(' ', '_')}" if r["gather"] else "")),
        jaxspeed=_common.mib(r["model_state"]),
        baseline=_common.mib(r["ideal"]),
        unit="MiB/device",
        ratio=r["ratio"],
        n_params=psi,
        devices=n,
        bytes_per_param_per_device=round(r["model_state"] / psi, 4),
        stage3_gather=r["gather"],
        bytes={k: r[k] for k in ("params", "opt_state", "grads", "model_state", "step_peak")},
        ideal_bytes=r["ideal"],
        deepspeed_mixed_precision_bytes=r["deepspeed"],
        source=SOURCES,
        compiled={**r["compiled"], "compile_s": round(r["compile_s"], 2)},
        process_peak_rss_bytes=rss,
    )


if __name__ == "__main__":
    raise SystemExit(main())
