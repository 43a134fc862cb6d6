"""The largest GPT whose per-device *device* memory fits a budget, with and without ZeRO-Offload.

Shapes only: each candidate model is initialised abstractly (`jax.eval_shape`) and its train step
compiled; nothing is allocated, so 16 GiB budgets are measured on a laptop. ZeRO stage 3 on 8
emulated devices (mesh data=8), bf16 compute with fp32 masters, AdamW, full rematerialisation,
micro-batch 1 × seq 1024 per device.

- baseline: everything on the device (fp32 params, grads, Adam m and v: 16 bytes/param / N);
- offload: `offload_param: cpu` + `offload_optimizer: {device: cpu, update_on: host}`, i.e.
  ZeRO-Offload: fp32 masters and Adam state stay in pinned host memory and are updated there.
  The GPT streams its layers (ZeRO-Infinity style): each scanned layer fetches its own param
  shard to the device as it runs, and its gradient shard goes back to the host as the backward
  pass makes it.

Device bytes are `memory_report()["per_device_bytes"]["device"]`, with its source
(`memory_report()["sources"]["device"]`). Where XLA separates host from device memory (GPU:
memory kinds `device` and `pinned_host` are apart in `memory_analysis()`), every probe's device
bytes are compiled, and so is the ratio. On CPU, where XLA counts host and device memory
together, the baseline's are still compiled but the offload probes' are modelled (see
`jaxspeed.cost.memory`): the host-resident state (from the arrays) and the streamed layers'
gradients (all but one layer's) are subtracted from the compiled total, and one layer's
fetched params are added back. That credit assumes the peak comes when the gradients are done;
if it comes at the start of the backward pass instead, the saved layer inputs (full remat: one
residual stream per layer) are still live. So modelled probes add `(n_layers - 1) x seq x
d_model x 2` bytes (bf16) to stay an upper bound, and the ratio's source is then `model`. The
JSON line names each field's source (`sources`) and keeps the compiled totals
(`compiled_total_bytes`, host and device together on CPU). The model family scales the width
(head dim 128, d_ff = 4·d_model) at fixed depth; a binary search finds the widest model that
fits. Headline: ratio = largest params with offload / largest params without.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE)]

import _common  # noqa: E402

NAME = "offload_capacity"
OFFLOAD = {
    "offload_param": {"device": "cpu"},
    "offload_optimizer": {"device": "cpu", "update_on": "host"},
}
FULL = {"budget": "16GiB", "n_layers": 24, "seq_len": 1024, "head_dim": 128, "max_units": 128}
#: --quick: two widths (32, 64), each search probes both; the baseline's wider one does not fit
#: (894 KiB), the offloaded one does (577 KiB modelled): offload fits the wider model.
QUICK = {"budget": "768KiB", "n_layers": 2, "seq_len": 32, "head_dim": 32, "max_units": 2}


def bench_config(width: int, *, setup: dict, offload: bool):
    from jaxspeed.config import load_config

    zero = {"stage": 3, **(OFFLOAD if offload else {})}
    return load_config({
        "mesh": {"pipe": 1, "data": -1, "expert": 1, "tensor": 1},
        "train_micro_batch_size_per_device": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
        "activation_checkpointing": {"policy": "full"},
        "model": {
            "type": "gpt", "vocab_size": 256, "d_model": width, "n_layers": setup["n_layers"],
            "n_heads": width // setup["head_dim"], "d_ff": 4 * width,
            "max_seq_len": setup["seq_len"],
        },
        "data": {"source": "stdlib", "seq_len": setup["seq_len"]},
    })


def measure(width: int, *, setup: dict, offload: bool) -> dict:
    from jaxspeed.train.engine import initialize
    from jaxspeed.cost.memory import MODEL
    from jaxspeed.models.gpt import count_params

    start = time.perf_counter()
    engine = initialize(bench_config(width, setup=setup, offload=offload))
    report = engine.memory_report()
    per_device, sources = report["per_device_bytes"], report["sources"]
    modelled = sources["device"] == MODEL
    margin = (setup["n_layers"] - 1) * setup["seq_len"] * width * 2 if modelled else 0
    return {
        "width": width,
        "n_params": count_params(engine.abstract_state().params),
        "device": per_device["device"] + margin,
        "host": per_device["host"],
        "temp": per_device["temp"],
        "total": per_device["total"],
        "sources": {name: sources[name] for name in ("device", "host", "temp", "total")},
        "seconds": time.perf_counter() - start,
    }


def largest_fitting(budget: int, *, setup: dict, offload: bool, log: list) -> dict:
    """Binary search over width = head_dim × units for the widest model within `budget`."""
    lo, hi, best = 1, setup["max_units"], None
    while lo <= hi:
        units = (lo + hi) // 2
        row = measure(units * setup["head_dim"], setup=setup, offload=offload)
        log.append({**row, "offload": offload, "fits": row["device"] <= budget})
        if row["device"] <= budget:
            best, lo = row, units + 1
        else:
            hi = units - 1
    if best is None:
        raise SystemExit(f"no model fits {budget} bytes per device, even at the smallest width")
    return best


def describe_sources(log: list[dict]) -> tuple[str, list[str]]:
    """The ratio's source (`compiled` only if every probe's device bytes are) and the lines
    saying which device figures are modelled."""
    from jaxspeed.cost.memory import COMPILED, MODEL

    by_probe = {
        probe: {r["sources"]["device"] for r in log if r["offload"] == (probe == "offload")}
        for probe in ("baseline", "offload")
    }
    if all(s == {COMPILED} for s in by_probe.values()):
        return COMPILED, [
            "device MiB: compiled for every probe (XLA's memory_analysis() of the step, host "
            "memory apart); ratio source: compiled"
        ]
    lines = [
        f"device MiB of {probe} probes: {', '.join(sorted(s))}" for probe, s in by_probe.items()
    ]
    lines.append(
        "modelled = this backend's memory_analysis() counts host and device memory together: "
        "compiled total - host-resident state (arrays) + one streamed layer's fetched params "
        "- all but one layer's streamed gradients + the remat margin (jaxspeed.cost.memory); host "
        "MiB is summed from the arrays' memory kinds"
    )
    lines.append("ratio source: model (the offload search is decided by modelled device bytes)")
    return MODEL, lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny budget and models (for tests)")
    parser.add_argument("--budget", default=None, help="device memory per device (default 16GiB)")
    parser.add_argument(
        "--devices", type=int, default=_common.DEVICES,
        help="devices to plan for (default 8 emulated CPU devices; with JAX_PLATFORMS=cuda, "
        "that many GPUs, whose compiled figures separate host memory)",
    )
    args = parser.parse_args(argv)
    _common.use_cpu_devices(args.devices)
    from jaxspeed.config import parse_bytes
    from jaxspeed.cost.memory import ARRAYS, COMPILED

    setup = dict(QUICK if args.quick else FULL)
    budget = parse_bytes(args.budget or setup["budget"])
    log: list[dict] = []
    base = largest_fitting(budget, setup=setup, offload=False, log=log)
    off = largest_fitting(budget, setup=setup, offload=True, log=log)
    mib = _common.mib
    print(
        f"Largest reference GPT within {mib(budget):,.0f} MiB of device memory per device: "
        f"ZeRO-3 on {args.devices} devices, {setup['n_layers']} layers, seq "
        f"{setup['seq_len']}, micro 1, bf16 + fp32 masters, AdamW, full remat."
    )
    print()
    _common.print_table(
        ["probe", "d_model", "params", "device MiB", "source", "host MiB", "source",
         "compiled total MiB", "temp MiB", "fits", "s"],
        [
            ["offload" if r["offload"] else "baseline", r["width"], r["n_params"],
             mib(r["device"]), r["sources"]["device"], mib(r["host"]), r["sources"]["host"],
             mib(r["total"]), mib(r["temp"]), r["fits"], r["seconds"]]
            for r in log
        ],
    )
    ratio_source, source_lines = describe_sources(log)
    ratio = _common.ratio(off["n_params"], base["n_params"])
    print()
    for line in source_lines:
        print(line)
    print(
        f"largest: {base['n_params']:,} params without offload (d_model {base['width']}), "
        f"{off['n_params']:,} with offload (d_model {off['width']}): {ratio}x "
        f"(source: {ratio_source})"
    )
    _common.print_json(_common.result(
        NAME,
        case=f"budget={mib(budget):.0f}MiB devices={args.devices} stage=3 bf16 remat=full",
        jaxspeed=off["n_params"],
        baseline=base["n_params"],
        unit="params",
        ratio=ratio,
        budget_bytes=budget,
        device_bytes={"offload": off["device"], "baseline": base["device"]},
        host_bytes_offload=off["host"],
        compiled_total_bytes={"offload": off["total"], "baseline": base["total"]},
        d_model={"offload": off["width"], "baseline": base["width"]},
        sources={
            "jaxspeed": ARRAYS,
            "baseline": ARRAYS,
            "ratio": ratio_source,
            "device_bytes": {
                "offload": off["sources"]["device"], "baseline": base["sources"]["device"],
            },
            "host_bytes_offload": off["sources"]["host"],
            "compiled_total_bytes": COMPILED,
        },
    ))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
