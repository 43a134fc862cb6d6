"""Where a ZeRO-3 train step's time goes, op by op: the sharding path against the explicit step.

    python tools/zero3_profile.py [--config configs/bench_tiny_llama.yaml] [--set KEY=VALUE]
        [--collectives compiler explicit] [--profile] [--dump DIR]

For each `zero_optimization.collectives` value it compiles the train step on 8 emulated CPU
devices (as `benchmarks/throughput.py` does; its fsdp8 is the default config) and prints, from
the optimized HLO (`compiled.as_text()`): the scheduled ops by kind (fusions by kind, the
collectives and the bytes they write), the transposes and copies inside fusions, and every
transpose or copy with the jax source (`op_name`) it comes from, side by side.

With `--profile` it also runs each step a few times under `jax.profiler` and ranks XLA:CPU's
thunks (one per fusion, collective, loop) by their 10th-percentile time times their count per
device and step: on a busy machine the low percentile is the one least inflated by other
processes. A collective's time includes its wait for the slowest device (skew).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2,
          "u16": 2, "s16": 2, "s8": 1, "u8": 1, "pred": 1}
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\(.*?\)|\S+) ([a-z][\w\-]*)\(")


def nbytes(shape: str) -> int:
    """Bytes of an HLO shape (tuples summed)."""
    total = 0
    for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape):
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        total += count * _BYTES.get(dtype, 4)
    return total


def parse(text: str) -> dict[str, list[str]]:
    """{computation name: its instruction lines}."""
    comps, current = {}, None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head:
            current = comps.setdefault(head.group(1), [])
        elif current is not None and line.startswith("  "):
            current.append(line)
    return comps


def source(line: str) -> str:
    found = re.search(r'op_name="([^"]+)"', line)
    return found.group(1).replace("jit(train_step)/", "") if found else "-"


def same_source(name: str) -> str:
    """`name` as both steps spell it: without the explicit step's `shard_map/` and with a
    `jit(...)/op` tail cut to `jit` (the two programs name the same slice differently)."""
    return re.sub(r"/jit(\([^)]*\)/\w+)?$", "/jit", name.replace("shard_map/", ""))


def census(text: str):
    """(scheduled op counts, their output bytes, op counts inside fusions, transposes and copies
    inside fusions keyed by (op, shape, source))."""
    comps = parse(text)
    fused = {m.group(1) for lines in comps.values() for line in lines if " fusion(" in line
             for m in [re.search(r"calls=%?([\w.\-]+)", line)] if m}
    top, top_bytes, inner, moves = (collections.Counter() for _ in range(4))
    for name, lines in comps.items():
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            _, shape, op = m.groups()
            if name in fused:
                inner[op] += 1
                if op in ("transpose", "copy"):
                    moves[(op, shape.split("{")[0], same_source(source(line)))] += 1
                continue
            if op == "fusion":
                kind = re.search(r"kind=(\w+)", line)
                op = f"fusion:{kind.group(1) if kind else '?'}"
            top[op] += 1
            top_bytes[op] += nbytes(shape)
    return top, top_bytes, inner, moves


def profile(compiled, state, batch, out: str, steps: int = 3) -> dict[str, list[float]]:
    """{thunk name: its durations in ms} over `steps` runs of `compiled` under jax.profiler."""
    import jax

    for _ in range(2):
        state, _ = compiled(state, batch)
    jax.block_until_ready(state)
    jax.profiler.start_trace(out, create_perfetto_trace=True)
    for _ in range(steps):
        state, _ = compiled(state, batch)
    jax.block_until_ready(state)
    jax.profiler.stop_trace()
    trace = glob.glob(f"{out}/**/perfetto_trace.json.gz", recursive=True)[0]
    times = collections.defaultdict(list)
    for event in json.load(gzip.open(trace))["traceEvents"]:
        if event.get("ph") == "X":
            times[event["name"]].append(event.get("dur", 0) / 1e3)
    return times


def thunk_kinds(text: str) -> dict[str, tuple[str, str]]:
    """{instruction name: (kind, source)}: a fusion with a dot is `dot`, other fusions are named
    by the data-moving ops they hold."""
    comps = parse(text)
    kinds = {}
    for lines in comps.values():
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            name, _, op = m.groups()
            if op == "fusion":
                body = " ".join(comps.get(re.search(r"calls=%?([\w.\-]+)", line).group(1), []))
                held = [k for k in ("dot", "transpose", "copy", "concatenate",
                                    "dynamic-update-slice", "reduce") if f" {k}(" in body]
                op = "dot" if "dot" in held else "loop(" + ("+".join(held) or "elementwise") + ")"
            kinds[name] = (op, source(line))
    return kinds


def rank(times, kinds, *, devices: int, steps: int, top: int):
    by_kind, rows = collections.Counter(), []
    for name, ds in times.items():
        if name not in kinds or kinds[name][0] in ("while", "call", "conditional"):
            continue
        ds = sorted(ds)
        ms = ds[len(ds) // 10] * len(ds) / (devices * steps)
        by_kind[kinds[name][0]] += ms
        rows.append((ms, name, *kinds[name]))
    print(f"  per device and step (ms, p10 x count), total {sum(by_kind.values()):.1f}:")
    for kind, ms in by_kind.most_common():
        print(f"    {ms:8.2f}  {kind}")
    for ms, name, kind, src in sorted(rows, reverse=True)[:top]:
        print(f"    {ms:8.2f}  {name:30s} {kind:26s} {src[:90]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "bench_tiny_llama.yaml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--collectives", nargs="+", default=["compiler", "explicit"])
    parser.add_argument("--profile", action="store_true", help="also time each thunk")
    parser.add_argument("--top", type=int, default=15, help="thunks listed per step")
    parser.add_argument("--dump", default=None, help="write each step's HLO here")
    args = parser.parse_args(argv)

    import _common
    _common.use_cpu_devices()
    import jax
    import numpy as np

    from jaxspeed.config import load_config
    from jaxspeed.train.engine import initialize

    found = {}
    for mode in args.collectives:
        config = load_config(args.config, overrides=[
            *args.overrides, f"zero_optimization.collectives={mode}"])
        engine = initialize(config)
        compiled = engine.compile_train_step()
        text = compiled.as_text()
        if args.dump:
            Path(args.dump).mkdir(parents=True, exist_ok=True)
            (Path(args.dump) / f"{mode}.hlo").write_text(text)
        top, top_bytes, inner, moves = census(text)
        found[mode] = moves
        print(f"== collectives={mode}: temp "
              f"{compiled.memory_analysis().temp_size_in_bytes / 2**20:.1f} MiB a device")
        print("  scheduled ops: " + ", ".join(
            f"{op} {n} ({top_bytes[op] / 2**20:.1f} MiB)" for op, n in top.most_common()
            if op not in ("parameter", "get-tuple-element", "constant", "tuple", "bitcast")))
        print("  inside fusions: " + ", ".join(
            f"{op} {inner[op]}" for op in ("dot", "transpose", "copy", "convert", "concatenate",
                                           "dynamic-slice", "dynamic-update-slice", "reduce")))
        if args.profile:
            rows = engine.batch_sizes.train_batch_size
            rng = np.random.default_rng(0)
            vocab, seq = config.model.vocab_size, config.data.seq_len
            batch = engine.shard_batch({k: rng.integers(0, vocab, (rows, seq), dtype=np.int32)
                                        for k in ("inputs", "targets")})
            with tempfile.TemporaryDirectory() as out:
                times = profile(compiled, engine.init(jax.random.key(0)), batch, out)
            rank(times, thunk_kinds(text), devices=jax.device_count(), steps=3, top=args.top)
    if len(found) == 2:
        (a, moves_a), (b, moves_b) = found.items()
        print(f"\n== transposes and copies inside fusions: {a} | {b} | shape | source")
        for key in sorted(set(moves_a) | set(moves_b), key=lambda k: (k[2], k[0], k[1])):
            if moves_a[key] != moves_b[key]:
                op, shape, src = key
                print(f"  {moves_a[key]:3d} | {moves_b[key]:3d} | {op} {shape} | {src[:100]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
