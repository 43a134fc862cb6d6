"""Shared pieces of the benchmarks: emulated devices, the result table, the JSON lines.

Import this module before JAX: `use_cpu_devices` must run before JAX creates its backend.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

#: The repository root (benchmarks/..), so configs resolve from any working directory.
ROOT = Path(__file__).resolve().parent.parent
DEVICES = 8


def use_cpu_devices(count: int = DEVICES) -> None:
    """Asks for `count` emulated CPU devices, then checks that JAX has exactly that many.

    Run directly (`python benchmarks/NAME.py`) the flags are set before JAX starts. Under
    `jaxspeed bench NAME` JAX may already be imported, or even running: then whatever devices
    exist are used, and anything other than `count` of them stops the benchmark with a message.
    """
    from jaxspeed.runtime.host_allocator import keep_freed_memory

    keep_freed_memory()  # jaxspeed's host allocator, before JAX starts: both sides run under it
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={count}"])
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        pass  # the backend already started (e.g. under `jaxspeed bench`): use what exists
    found = jax.device_count()
    if found != count:
        raise SystemExit(
            f"this benchmark needs {count} devices, JAX has {found} "
            f"({jax.devices()[0].platform}). Run it from the repository root as "
            f"`python benchmarks/{Path(sys.argv[0]).name}`, or start it with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={count} JAX_PLATFORMS=cpu "
            f"so JAX creates {count} CPU devices."
        )


def ratio(better: float, worse: float) -> float:
    """`better / worse`, rounded to 3 digits (how many times better)."""
    return round(better / worse, 3) if worse else float("nan")


def result(
    benchmark: str, *, case: str, jaxspeed: float, baseline: float, unit: str, ratio: float,
    **extra: Any,
) -> dict[str, Any]:
    """One result object with the keys every benchmark line carries, then `extra`."""
    return {
        "benchmark": benchmark,
        "case": case,
        "jaxspeed": round_figure(jaxspeed),
        "baseline": round_figure(baseline),
        "unit": unit,
        "ratio": ratio,
        **extra,
    }


def round_figure(x: float) -> float:
    """`x` to 5 significant digits (no decimals above 10,000)."""
    if not math.isfinite(x) or x == 0:
        return x
    digits = max(0, 4 - int(math.floor(math.log10(abs(x)))))
    return round(x, digits)


def print_json(obj: dict[str, Any]) -> None:
    """Prints one JSON object on one line (the last one printed is the headline)."""
    print(json.dumps(obj), flush=True)


def print_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Prints a plain fixed-width table: the first column left-aligned, the rest right."""
    cells = [[str(c) for c in header]] + [[_cell(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]

    def line(row):
        first = row[0].ljust(widths[0])
        return "  ".join([first, *(c.rjust(w) for c, w in zip(row[1:], widths[1:]))])

    print(line(cells[0]))
    print("  ".join("-" * w for w in widths))
    for row in cells[1:]:
        print(line(row))
    sys.stdout.flush()


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def mib(n: float) -> float:
    """Bytes → MiB."""
    return n / 2**20


def timed(fn, args, *, iters: int, rounds: int) -> float:
    """Median over `rounds` of the mean time of `iters` back-to-back calls, in ms."""
    import jax

    jax.block_until_ready(fn(*args))  # compile and warm up
    per_call = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - start) / iters)
    return statistics.median(per_call) * 1e3


def interleaved_seconds(
    calls: dict[str, Callable[[], Any]], repeats: int, *, settle: bool = True,
) -> dict[str, list[float]]:
    """Wall seconds of each call, `repeats` times, interleaved (A B, B A, A B, ...).

    With `settle` (the default) each timed call follows an untimed call of the same function,
    as in a training loop: the allocator is then as that function left it, not as the other
    one did (a step that frees hundreds of MiB would otherwise make the next, different step
    pay for the pages). `settle=False` times every call, for calls of seconds, where those
    pages are noise and the untimed calls would double the run.
    Results are waited for with `jax.block_until_ready`.
    """
    import jax

    order = list(calls)
    times: dict[str, list[float]] = {name: [] for name in order}
    for i in range(repeats):
        for name in order if i % 2 == 0 else order[::-1]:
            if settle:  # untimed: the allocator as the call left it
                jax.block_until_ready(calls[name]())
            start = time.perf_counter()
            jax.block_until_ready(calls[name]())
            times[name].append(time.perf_counter() - start)
    return times


def predict_deviceless(config, target: str, *, efficiency: float | None = None) -> dict:
    """The roofline prediction (`jaxspeed plan --target`'s `predicted_*` figures) of `config`'s
    train step, compiled by XLA:GPU for one `target` GPU without a GPU. Needs the gpu-compile
    extra (`jaxspeed.gpu.deviceless.missing()` says why not) and JAX on its CPU platform."""
    from jaxspeed.cli.plan import step_prediction
    from jaxspeed.gpu import deviceless
    from jaxspeed.runtime.mesh import make_mesh
    from jaxspeed.train.engine import initialize

    devices = deviceless.devices(target, 1)
    engine = initialize(config, mesh=make_mesh(config.mesh, devices=devices))
    analysis = engine.compile_train_step().memory_analysis()
    return {**step_prediction(engine, target, efficiency=efficiency),
            "device_bytes": analysis.argument_size_in_bytes + analysis.output_size_in_bytes
            - analysis.alias_size_in_bytes + analysis.temp_size_in_bytes}
