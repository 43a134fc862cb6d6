"""Pipeline schedules on CPU: activation memory and step time of GPipe, 1F1B and interleaved.

One training step (`jax.value_and_grad` of `spmd_pipeline(..., loss_fn=...)`: loss and the
gradients of the stage weights, the inputs and the loss head) on a mesh pipe=4 x data=2 of the
8 emulated CPU devices, the batch sharded over `data`. Each stage is two transformer-style MLP
blocks, `h + gelu(h @ w1) @ w2` with width D and hidden width H = 4 D (fp32), so the per-microbatch
vjp residuals (the `[rows, H]` intermediates of the tanh GELU) dominate memory. Every
microbatch has the same rows, so the batch (and the work) grows with M.

For S = 4 stages, each schedule (`gpipe`, `1f1b`, and `interleaved` with v = 2 virtual stages
of 1 block each per device: the same 8-block model, 2 blocks per device) and M microbatches:
  - temp: per-device `compiled.memory_analysis().temp_size_in_bytes` of the training step.
  - forward temp: the same for the loss alone (no gradients), which holds everything the
    schedule needs that is not kept for the backward (microbatch reshuffles, send/receive
    buffers); it is the same for gpipe and 1f1b (both run the same forward table).
  - activation bytes := temp - forward temp (same schedule, same M): the vjp residuals
    kept for the backward, plus the cotangent buffers and the gradient accumulators.
    This counts the gradient accumulators (the size of the stage weights, the same for every
    schedule) as activations, so the GPipe / 1F1B ratio is, if anything, understated.
  - residual bytes (ideal): what one device must hold for the backward at once. gpipe: M x
    the per-microbatch autodiff residuals of one stage (measured: the temp growth per
    iteration of `grad` through a plain `lax.scan` of the stage). 1f1b: its ring of S stage
    inputs (the execution plan's `res_slots`) plus one microbatch's residuals, those of the
    stage its backward recomputes. Measured on top: gpipe stacks residuals for all M + S - 1
    steps of its forward scan, and both hold gradient accumulators and the weights'
    transposes (stage-weight sized).
  - bubble: idle fraction of the schedule table (`bubble_fraction(schedule_table(...))`).
  - step ms: median wall time of the compiled step (noisy: the CPU cores are shared; the
    devices are emulated, so the bubble does not show as idle time).
Target: 1F1B activation bytes at M = 32 <= 1/4 of GPipe's.
Headline (last line): ratio = GPipe activation bytes / 1F1B activation bytes at S = 4, M = 32.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE)]

import _common  # noqa: E402

NAME = "pipeline"
STAGES, DATA = 4, 2
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))
FULL = {"microbatches": (4, 8, 16, 32), "width": 128, "rows": 64, "blocks": 2, "repeats": 5}
QUICK = {"microbatches": (8,), "width": 32, "rows": 8, "blocks": 2, "repeats": 1}


def block(w1, w2, h):
    """A transformer MLP block without norm: `h + gelu(h @ w1) @ w2`, h `[rows, D]`."""
    import jax

    return h + jax.nn.gelu(h @ w1) @ w2


def make_stage(blocks: int):
    """`stage(p, h)`: `blocks` MLP blocks.

    Weights `p["w1"]: [blocks, D, H]`, `p["w2"]: [blocks, H, D]`; `h: [rows, D]`.
    """

    def stage(p, h):
        for i in range(blocks):
            h = block(p["w1"][i], p["w2"][i], h)
        return h

    return stage


def loss_fn(head, y, targets):
    """Mean squared error of a linear head: `y [rows, D] @ head [D, 4]` against `targets`."""
    import jax.numpy as jnp

    return jnp.mean((y @ head - targets) ** 2)


def problem(case: dict, virtual_stages: int, microbatches: int, seed: int = 0):
    """Stage weights `[S*v, blocks/v, ...]`, inputs `[M*rows, D]`, head and targets.

    With v virtual stages each of the S*v stages holds blocks/v blocks, so every schedule runs
    the same model of S*blocks blocks. numpy RNG: nothing to compile.
    """
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    d, rows = case["width"], case["rows"]
    hidden, per_stage = 4 * d, case["blocks"] // virtual_stages
    n = STAGES * virtual_stages

    def normal(*shape, scale):
        return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)

    params = {
        "w1": normal(n, per_stage, d, hidden, scale=d**-0.5),
        "w2": normal(n, per_stage, hidden, d, scale=0.3 * hidden**-0.5),
    }
    x = normal(microbatches * rows, d, scale=1.0)
    return params, x, normal(d, 4, scale=d**-0.5), normal(microbatches * rows, 4, scale=1.0)


def compile_step(case: dict, schedule: str, v: int, microbatches: int, *, train: bool):
    """The compiled step (`(loss, grads)` if `train`, else the loss) and its arguments."""
    import jax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxspeed.pipeline import spmd_pipeline

    mesh = jax.make_mesh((STAGES, DATA), ("pipe", "data"), axis_types=(AxisType.Auto,) * 2)
    params, x, head, targets = problem(case, v, microbatches)
    stage = make_stage(case["blocks"] // v)

    def loss(params, x, head, targets):
        return spmd_pipeline(
            stage, params, x, num_microbatches=microbatches, schedule=schedule, mesh=mesh,
            virtual_stages=v, loss_fn=loss_fn, loss_params=head, loss_inputs=targets,
        )

    fn = jax.value_and_grad(loss, argnums=(0, 1, 2)) if train else loss
    staged, batch = NamedSharding(mesh, P("pipe")), NamedSharding(mesh, P("data"))
    shardings = ({"w1": staged, "w2": staged}, batch, NamedSharding(mesh, P()), batch)
    args = tuple(jax.device_put(a, s) for a, s in zip((params, x, head, targets), shardings))
    with jax.set_mesh(mesh):
        compiled = jax.jit(fn, in_shardings=shardings).lower(*args).compile()
    return compiled, args


@functools.cache
def residual_bytes_per_microbatch(case_items: tuple, v: int) -> int:
    """Bytes autodiff keeps per microbatch for one stage on one device (rows / data rows):
    the temp growth per iteration of `grad` through a plain `lax.scan` of the stage, the
    weights loop-invariant (measured, not read from JAX's internals)."""
    import jax
    import jax.numpy as jnp

    case = dict(case_items)
    stage = make_stage(case["blocks"] // v)
    params, _, _, _ = problem(case, v, 1)
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params)

    def temp(microbatches):
        def loss(p, xs):
            return jnp.sum(jax.lax.scan(lambda c, x: (c, stage(p, x)), None, xs)[1])

        xs = jax.ShapeDtypeStruct((microbatches, case["rows"] // DATA, case["width"]),
                                  jnp.float32)
        step = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(one, xs).compile()
        return step.memory_analysis().temp_size_in_bytes

    return (temp(8) - temp(4)) // 4


def ideal_residual_bytes(case_items: tuple, schedule: str, v: int, microbatches: int):
    """What one device must hold for the backward at once (None for interleaved)."""
    per_microbatch = residual_bytes_per_microbatch(case_items, v)
    if schedule == "gpipe":
        return microbatches * per_microbatch
    if schedule == "1f1b":
        case = dict(case_items)
        stage_input = case["rows"] // DATA * case["width"] * 4  # fp32
        return STAGES * stage_input + per_microbatch
    return None


def time_step(compiled, args, repeats: int) -> float:
    """Median wall time (ms) of `repeats` runs after one warm-up run."""
    import jax

    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


@functools.cache
def forward_temp_bytes(case_items: tuple, schedule: str, v: int, microbatches: int) -> int:
    """Temp bytes of the loss alone; gpipe and 1f1b share it (the same forward table)."""
    if schedule == "1f1b":
        return forward_temp_bytes(case_items, "gpipe", v, microbatches)
    forward, _ = compile_step(dict(case_items), schedule, v, microbatches, train=False)
    return forward.memory_analysis().temp_size_in_bytes


def run_case(case: dict, schedule: str, v: int, microbatches: int, repeats: int) -> dict:
    """All the figures of one (schedule, M) row."""
    from jaxspeed.pipeline import bubble_fraction, schedule_table

    compiled, args = compile_step(case, schedule, v, microbatches, train=True)
    temp = compiled.memory_analysis().temp_size_in_bytes
    case_items = tuple((k, v_) for k, v_ in case.items() if k != "microbatches")
    forward_temp = forward_temp_bytes(case_items, schedule, v, microbatches)
    table = schedule_table(schedule, STAGES, microbatches, virtual_stages=v)
    return {
        "schedule": schedule, "v": v, "microbatches": microbatches,
        "temp": temp, "forward_temp": forward_temp, "activation": temp - forward_temp,
        "ideal_residual": ideal_residual_bytes(case_items, schedule, v, microbatches),
        "bubble": bubble_fraction(table),
        "bubble_formula": (STAGES - 1) / (v * microbatches + STAGES - 1),
        "step_ms": time_step(compiled, args, repeats),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, M = 8 only (tests)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=None,
                        help="microbatch counts M (multiples of 4; the last is the headline)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps (median)")
    args = parser.parse_args(argv)
    _common.use_cpu_devices()

    case = dict(QUICK if args.quick else FULL)
    ms = tuple(args.microbatches or case["microbatches"])
    repeats = args.repeats or case["repeats"]
    bad = [m for m in ms if m < STAGES or m % STAGES]
    if bad:
        raise SystemExit(f"--microbatches: {bad} are not multiples of the {STAGES} stages "
                         "(1f1b needs M >= S, interleaved M divisible by S)")
    if repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {repeats}")

    d = case["width"]
    print(
        f"Pipeline training step (loss + grads) on CPU, mesh pipe={STAGES} x data={DATA}: "
        f"{STAGES} stages x {case['blocks']} MLP blocks (D={d}, H={4 * d}, tanh GELU, fp32), "
        f"{case['rows']} rows per microbatch (sharded over data); interleaved: v=2 "
        f"chunks of {case['blocks'] // 2} block(s); per-device bytes; median of {repeats} steps"
    )
    rows = [run_case(case, s, v, m, repeats) for m in ms for s, v in SCHEDULES]
    print()
    _common.print_table(
        ["schedule", "M", "temp MiB", "fwd temp MiB", "activation MiB", "ideal resid MiB",
         "bubble", "formula", "step ms"],
        [[r["schedule"] + (f" v={r['v']}" if r["v"] > 1 else ""), r["microbatches"],
          _common.mib(r["temp"]), _common.mib(r["forward_temp"]), _common.mib(r["activation"]),
          "-" if r["ideal_residual"] is None else _common.mib(r["ideal_residual"]),
          r["bubble"], r["bubble_formula"], r["step_ms"]] for r in rows],
    )
    print()
    by = {(r["schedule"], r["microbatches"]): r for r in rows}
    for m in ms:
        gpipe, ofob, inter = by[("gpipe", m)], by[("1f1b", m)], by[("interleaved", m)]
        _common.print_json(_common.result(
            NAME,
            case=(f"S={STAGES} M={m} mesh=pipe{STAGES}xdata{DATA} D={d} H={4 * d} "
                  f"rows={case['rows']} blocks/stage={case['blocks']} fp32"),
            jaxspeed=round(_common.mib(ofob["activation"]), 3),
            baseline=round(_common.mib(gpipe["activation"]), 3),
            unit="activation MiB/device (1f1b vs gpipe)",
            ratio=_common.ratio(gpipe["activation"], ofob["activation"]),
            target_ratio=4.0,
            temp_MiB={r["schedule"]: round(_common.mib(r["temp"]), 3)
                      for r in (gpipe, ofob, inter)},
            activation_MiB={r["schedule"]: round(_common.mib(r["activation"]), 3)
                            for r in (gpipe, ofob, inter)},
            ideal_residual_MiB={r["schedule"]: round(_common.mib(r["ideal_residual"]), 3)
                                for r in (gpipe, ofob)},
            temp_ratio=_common.ratio(gpipe["temp"], ofob["temp"]),
            bubble={r["schedule"]: round(r["bubble"], 4) for r in (gpipe, ofob, inter)},
            step_ms={r["schedule"]: round(r["step_ms"], 2) for r in (gpipe, ofob, inter)},
            virtual_stages=2, repeats=repeats,
        ))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
