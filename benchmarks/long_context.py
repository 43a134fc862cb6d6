"""The longest sequence that trains in a per-device memory budget, with and without sequence split.

Dense reference attention with one whole sequence per device against blocked attention with the
sequence split over 8 devices (Ulysses, ring, and Ulysses with a block-sparse layout).

Shapes only for the lengths: each probe's train step is compiled (`engine.memory_report()`),
nothing is allocated. The same GPT in every probe: d_model 256, 2 layers, 8 heads of 32, d_ff
1024 (GELU), vocabulary 256, rotary positions, fp32 (no bf16: the step-time part runs on the
CPU, where bf16 is emulated), full rematerialisation of each layer, AdamW, ZeRO stage 1,
micro-batch 1, 8 emulated devices.

- baseline: `model.attention.impl: reference` (fp32 `[batch, heads, L, L]` scores), mesh
  data=8, sequence=1: every device holds one whole sequence (global batch 8);
- jaxspeed: `model.attention.impl: blocked` (FlashAttention in plain JAX, blocks 512 x 512)
  with mesh sequence=8, data=1 (global batch 1, split over the 8 devices),
  `model.sequence_parallel: {impl: ulysses}`; also `{impl: ring, load_balance: true}`;
- sparse: the jaxspeed setup (Ulysses) plus the block-sparse Fixed layout of Sparse
  Transformers (`model.sparse_attention: {mode: fixed, block: 64, num_local_blocks: 4,
  num_global_blocks: 1, attention: unidirectional, impl: blocked}`): only the layout's set
  blocks, one at a time with an online softmax, so memory stays O(L x block) although the
  layout's global columns make the set blocks grow as L^2 (the gather path, `impl: xla`, holds
  them all at once: about 3.1 bytes x L^2 per device here, 27k tokens in 2 GiB).

A probe fits when the compiled step's device bytes per device (`memory_report()`'s
`per_device_bytes.device`: arguments + outputs - aliased + temp of XLA's `memory_analysis()`;
nothing lives in host memory here, so it is the compiled total, source `compiled`) are within
the budget (2 GiB). Each length search doubles the length from `start` until a probe does not
fit (halves it from `start` while probes do not), then bisects between the longest length that
fits and the shortest that does not, in multiples of `granule` (64: a multiple of 2 x 8 for the
balanced layout and of the sparse block), up to `max_seq` (1,048,576).
Headline: ratio = the longest sequence with blocked attention and Ulysses over sequence 8 / the
baseline's longest (targets: >= 10x, DeepSpeed's claim, and >= 32x with the sparse layout,
`sparse_ratio`).

Second part (skip it with `--no-step-time`): the train step's wall time at seq 16384 on the 8
devices, blocked attention, three ways: Ulysses and ring over sequence=8 (global batch 1) and
`sequence: 1` (data=8, global batch 8). Each step is compiled ahead, run once to warm up, then
the three are timed interleaved (A B C, C B A, ...); medians. The steps differ in tokens, so
tokens/s compares them. Ulysses and ring train on the same sequence from the same parameters, so
their first losses agree. No target. It prints its JSON line before the headline.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE)]

import _common  # noqa: E402

NAME = "long_context"
LENGTH_TARGET, SPARSE_TARGET = 10.0, 32.0
SPARSE = {"mode": "fixed", "num_local_blocks": 4, "num_global_blocks": 1,
          "attention": "unidirectional", "impl": "blocked"}
#: The length searches: name -> (attention impl, mesh.sequence, sequence_parallel impl, sparse).
SEARCHES = {
    "baseline": ("reference", 1, None, False),
    "ulysses": ("blocked", 8, "ulysses", False),
    "ring": ("blocked", 8, "ring", False),
    "sparse": ("blocked", 8, "ulysses", True),
}
#: The step-time variants, all with blocked attention.
STEP_VARIANTS = {
    "ulysses": ("blocked", 8, "ulysses", False),
    "ring": ("blocked", 8, "ring", False),
    "sequence1": ("blocked", 1, None, False),
}
FULL = {
    "budget": "2GiB", "d_model": 256, "n_layers": 2, "n_heads": 8, "d_ff": 1024, "vocab": 256,
    "block": 512, "sparse_block": 64, "granule": 64, "start": 1024, "max_seq": 2**20,
    "step_seq": 16384, "repeats": 3,
}
QUICK = {
    "budget": "3MiB", "d_model": 64, "n_layers": 1, "n_heads": 8, "d_ff": 128, "vocab": 64,
    "block": 32, "sparse_block": 16, "granule": 128, "start": 256, "max_seq": 256,
    "step_seq": 256, "repeats": 1,
}


def bench_config(seq: int, variant: tuple, *, setup: dict):
    """The config of one probe: `variant` = (attention impl, mesh.sequence, SP impl, sparse)."""
    from jaxspeed.config import load_config

    impl, sequence, sp_impl, sparse = variant
    devices = _common.DEVICES
    model = {
        "type": "gpt", "vocab_size": setup["vocab"], "d_model": setup["d_model"],
        "n_layers": setup["n_layers"], "n_heads": setup["n_heads"], "d_ff": setup["d_ff"],
        "max_seq_len": seq,
        "attention": {"impl": impl, "block_q": setup["block"], "block_kv": setup["block"]},
    }
    if sp_impl is not None:
        model["sequence_parallel"] = {"impl": sp_impl, "load_balance": True}
    if sparse:
        model["sparse_attention"] = {**SPARSE, "block": setup["sparse_block"]}
    return load_config({
        "mesh": {"pipe": 1, "data": devices // sequence, "sequence": sequence, "expert": 1,
                 "tensor": 1},
        "train_micro_batch_size_per_device": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": False},
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
        "activation_checkpointing": {"policy": "full"},
        "model": model,
        "data": {"source": "stdlib", "seq_len": seq},
    })


def measure(seq: int, variant: tuple, *, setup: dict) -> dict:
    """One probe: the compiled step's per-device bytes at length `seq` (nothing allocated)."""
    from jaxspeed.train.engine import initialize
    from jaxspeed.cost.memory import COMPILED

    start = time.perf_counter()
    report = initialize(bench_config(seq, variant, setup=setup)).memory_report()
    per_device, sources = report["per_device_bytes"], report["sources"]
    if sources["device"] != COMPILED or per_device["host"]:
        raise SystemExit(f"expected compiled device bytes and no host state, got {sources}")
    return {
        "seq": seq,
        "device": per_device["device"],
        "temp": per_device["temp"],
        "state": per_device["params"] + per_device["opt_state"],
        "seconds": time.perf_counter() - start,
    }


def longest_fitting(name: str, budget: int, *, setup: dict, log: list) -> dict:
    """The longest multiple of `granule` up to `max_seq` whose probe fits `budget`.

    Doubles the length from `start` while probes fit (halves it while they do not), so the
    probes stay near the answer (a probe's compile grows with its length), then bisects
    between the longest length that fits and the shortest that does not.
    """
    granule, cap = setup["granule"], setup["max_seq"]

    def probe(seq: int) -> dict:
        row = measure(seq, SEARCHES[name], setup=setup)
        row |= {"search": name, "fits": row["device"] <= budget}
        log.append(row)
        return row

    best = failed = None
    seq = setup["start"]
    while True:
        row = probe(seq)
        if row["fits"]:
            best = row
            if failed is not None or seq >= cap:
                break
            seq = min(2 * seq, cap)
        else:
            failed = seq
            if best is not None:
                break
            if seq <= granule:
                raise SystemExit(f"{name}: not even seq {seq} fits {budget} bytes per device")
            seq = max(granule, seq // 2 // granule * granule)
    lo, hi = best["seq"] // granule + 1, (cap if failed is None else failed - granule) // granule
    while lo <= hi:
        units = (lo + hi) // 2
        row = probe(units * granule)
        if row["fits"]:
            best, lo = row, units + 1
        else:
            hi = units - 1
    return {**best, "capped": failed is None}


# -- step time ------------------------------------------------------------------------------

def step_times(setup: dict, repeats: int) -> dict:
    """Compiles the three steps at `step_seq`, warms each up once, times them interleaved."""
    import jax
    import numpy as np

    from jaxspeed.train.engine import initialize

    seq = setup["step_seq"]
    calls, tokens, compile_s, first_loss = {}, {}, {}, {}
    for name, variant in STEP_VARIANTS.items():
        engine = initialize(bench_config(seq, variant, setup=setup))
        start = time.perf_counter()
        step = engine.compile_train_step()
        compile_s[name] = round(time.perf_counter() - start, 2)
        rows = engine.batch_sizes.train_batch_size
        # the same first sequence for all three (and the same initial params): Ulysses' and
        # ring's warm-up losses are the same loss, computed two ways
        ids = np.random.default_rng(0).integers(0, setup["vocab"], (rows, seq + 1), np.int32)
        batch = engine.shard_batch({"inputs": ids[:, :-1], "targets": ids[:, 1:]})
        holder = {"state": engine.init(jax.random.key(0))}

        def call(step=step, holder=holder, batch=batch):
            holder["state"], metrics = step(holder["state"], batch)  # the state is donated
            return holder["state"], metrics

        _, metrics = jax.block_until_ready(call())  # warm-up
        first_loss[name] = float(metrics["loss"])
        calls[name], tokens[name] = call, rows * seq
    times = _common.interleaved_seconds(calls, repeats, settle=False)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return {
        "ms": ms,
        "min_ms": {name: min(t) * 1e3 for name, t in times.items()},
        "tokens": tokens,
        "tokens_per_s": {name: tokens[name] / ms[name] * 1e3 for name in ms},
        "compile_s": compile_s,
        "first_loss": first_loss,
    }


def report_step_times(setup: dict, repeats: int) -> None:
    r = step_times(setup, repeats)
    seq, tps = setup["step_seq"], r["tokens_per_s"]
    print(
        f"\nTrain step at seq {seq:,} on {_common.DEVICES} devices, blocked attention (blocks "
        f"{setup['block']}): Ulysses and ring over sequence=8 (global batch 1) against "
        f"sequence=1, data=8 (global batch 8); median of {repeats} interleaved steps after one "
        f"warm-up"
    )
    _common.print_table(
        ["variant", "tokens/step", "ms/step", "min ms", "tokens/s", f"ms per {seq:,}-token seq",
         "compile s", "first loss"],
        [[name, r["tokens"][name], r["ms"][name], r["min_ms"][name], tps[name],
          r["ms"][name] * seq / r["tokens"][name], r["compile_s"][name], r["first_loss"][name]]
         for name in STEP_VARIANTS],
    )
    fastest = max(tps, key=tps.get)
    print(f"fastest per token: {fastest}; tokens/s ulysses / sequence1 = "
          f"{_common.ratio(tps['ulysses'], tps['sequence1'])}, ring / sequence1 = "
          f"{_common.ratio(tps['ring'], tps['sequence1'])}")
    _common.print_json(_common.result(
        NAME,
        case=(f"step_time seq={seq} devices={_common.DEVICES} blocked d_model={setup['d_model']} "
              f"layers={setup['n_layers']} fp32 remat=full: ulysses vs sequence=1 (data=8)"),
        jaxspeed=tps["ulysses"],
        baseline=tps["sequence1"],
        unit="tokens/s",
        ratio=_common.ratio(tps["ulysses"], tps["sequence1"]),
        ring_ratio=_common.ratio(tps["ring"], tps["sequence1"]),
        fastest=fastest,
        tokens_per_s={k: _common.round_figure(v) for k, v in tps.items()},
        ms={k: round(v, 1) for k, v in r["ms"].items()},
        min_ms={k: round(v, 1) for k, v in r["min_ms"].items()},
        tokens_per_step=r["tokens"],
        first_loss=r["first_loss"],
        compile_s=r["compile_s"],
        repeats=repeats,
        target=None,
        sources={"ms": "measured (wall time, median)", "tokens_per_s": "measured"},
    ))


# -- main ------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny budget and model (for tests)")
    parser.add_argument("--budget", default=None, help="device memory per device (default 2GiB)")
    parser.add_argument("--max-seq", type=int, default=None,
                        help="the longest length probed (default 1,048,576)")
    parser.add_argument("--no-step-time", action="store_true", help="lengths only")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps of each (median)")
    args = parser.parse_args(argv)
    _common.use_cpu_devices(_common.DEVICES)
    from jaxspeed.config import parse_bytes
    from jaxspeed.cost.memory import COMPILED

    setup = dict(QUICK if args.quick else FULL)
    if args.max_seq is not None:
        if args.max_seq < setup["start"] or args.max_seq % setup["granule"]:
            raise SystemExit(f"--max-seq must be a multiple of {setup['granule']} >= "
                             f"{setup['start']}, got {args.max_seq}")
        setup["max_seq"] = args.max_seq
    repeats = setup["repeats"] if args.repeats is None else args.repeats
    if repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {repeats}")
    budget = parse_bytes(args.budget or setup["budget"])
    mib = _common.mib

    log: list[dict] = []
    best = {name: longest_fitting(name, budget, setup=setup, log=log) for name in SEARCHES}
    print(
        f"Longest sequence whose train step fits {mib(budget):,.0f} MiB per device (compiled): "
        f"GPT d_model {setup['d_model']}, {setup['n_layers']} layers, {setup['n_heads']} heads, "
        f"d_ff {setup['d_ff']}, fp32, AdamW, ZeRO-1, full remat, micro-batch 1, "
        f"{_common.DEVICES} devices. baseline: reference attention, data={_common.DEVICES}; "
        f"ulysses / ring: blocked attention (blocks {setup['block']}), sequence="
        f"{_common.DEVICES}; sparse: ulysses + Fixed layout (block {setup['sparse_block']}, "
        f"4 local, 1 global, unidirectional). Search: doubling (or halving) from "
        f"{setup['start']:,}, then bisection in multiples of {setup['granule']}, up to "
        f"{setup['max_seq']:,}."
    )
    print()
    _common.print_table(
        ["search", "seq", "device MiB", "temp MiB", "params+opt MiB", "KiB/token", "fits", "s"],
        [[r["search"], r["seq"], mib(r["device"]), mib(r["temp"]), mib(r["state"]),
          r["device"] / r["seq"] / 1024, r["fits"], r["seconds"]] for r in log],
    )
    seqs = {name: b["seq"] for name, b in best.items()}
    ratio = _common.ratio(seqs["ulysses"], seqs["baseline"])
    ring_ratio = _common.ratio(seqs["ring"], seqs["baseline"])
    sparse_ratio = _common.ratio(seqs["sparse"], seqs["baseline"])
    capped = [name for name, b in best.items() if b["capped"]]
    print()
    print("longest: " + ", ".join(f"{name} {seq:,}" for name, seq in seqs.items()) + " tokens")
    print(f"ratio (ulysses / baseline) = {ratio}x (target >= {LENGTH_TARGET:g}x); ring "
          f"{ring_ratio}x; sparse / baseline = {sparse_ratio}x (target >= {SPARSE_TARGET:g}x)")
    if capped:
        print(f"capped at --max-seq {setup['max_seq']:,} (a lower bound): {', '.join(capped)}")
    if not args.no_step_time:
        report_step_times(setup, repeats)
    _common.print_json(_common.result(
        NAME,
        case=(f"budget={mib(budget):.0f}MiB devices={_common.DEVICES} d_model={setup['d_model']} "
              f"layers={setup['n_layers']} fp32 remat=full: blocked+ulysses sequence=8 vs "
              f"reference data=8"),
        jaxspeed=seqs["ulysses"],
        baseline=seqs["baseline"],
        unit="tokens",
        ratio=ratio,
        target=LENGTH_TARGET,
        ring=seqs["ring"],
        ring_ratio=ring_ratio,
        sparse=seqs["sparse"],
        sparse_ratio=sparse_ratio,
        sparse_target=SPARSE_TARGET,
        capped=capped,
        budget_bytes=budget,
        device_bytes={name: b["device"] for name, b in best.items()},
        probes=len(log),
        search_s=round(sum(r["seconds"] for r in log), 1),
        sources={"jaxspeed": COMPILED, "baseline": COMPILED, "ring": COMPILED,
                 "sparse": COMPILED, "ratio": COMPILED, "device_bytes": COMPILED},
    ))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
