"""Step time of `engine.train_step` against a hand-written `jax.jit` data-parallel step.

Same reference GPT, same initial parameters, same batch, 8 emulated CPU devices, ZeRO stage 0,
fp32, AdamW with global-norm clipping 1.0. The baseline is what one would write by hand:
`jax.jit` with params and optimizer state replicated and the batch sharded over the 8 devices,
`jax.value_and_grad` of `lm_loss(model.apply(...))`, an optax chain of `clip_by_global_norm` and
`adamw`, the state donated. Both are warmed up, then timed interleaved (A B, B A, ...) so CPU
noise hits both alike; the median of each is reported. Headline: ratio = baseline step time /
jaxspeed step time (1.0 = no overhead).
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

NAME = "overhead"
FULL = {
    "model": {"vocab_size": 256, "d_model": 256, "n_layers": 4, "n_heads": 4, "d_ff": 1024,
              "max_seq_len": 128},
    "seq_len": 128, "micro": 2, "steps": 30, "warmup": 3,
}
QUICK = {
    "model": {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 256,
              "max_seq_len": 32},
    "seq_len": 32, "micro": 1, "steps": 5, "warmup": 1,
}
OPTIMIZER = {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
CLIP = 1.0


def bench_config(case: dict):
    """The jaxspeed side: mesh data=8, ZeRO 0, fp32, AdamW + clipping, constant lr, no remat."""
    from jaxspeed.config import load_config

    return load_config({
        "mesh": {"pipe": 1, "data": -1, "expert": 1, "tensor": 1},
        "train_micro_batch_size_per_device": case["micro"],
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "bf16": {"enabled": False},
        "zero_optimization": {"stage": 0},
        "optimizer": {"type": "AdamW", "params": OPTIMIZER},
        "scheduler": {"type": "constant"},
        "activation_checkpointing": {"policy": "none"},
        "model": {"type": "gpt", **case["model"]},
        "data": {"source": "stdlib", "seq_len": case["seq_len"]},
    })


def baseline_step(model):
    """The hand-written data-parallel step and its optimizer.

    Returns:
      `(tx, step)` with `step(params, opt_state, batch) -> (params, opt_state, loss)`.
    """
    import jax
    import optax

    from jaxspeed.ops.losses import lm_loss

    b1, b2 = OPTIMIZER["betas"]
    tx = optax.chain(
        optax.clip_by_global_norm(CLIP),
        optax.adamw(OPTIMIZER["lr"], b1=b1, b2=b2, eps=OPTIMIZER["eps"],
                    weight_decay=OPTIMIZER["weight_decay"]),
    )

    def step(params, opt_state, batch):
        def loss_fn(p):
            return lm_loss(model.apply({"params": p}, batch["inputs"]), batch)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return tx, step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, few steps (tests)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps of each (median)")
    args = parser.parse_args(argv)
    _common.use_cpu_devices()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxspeed.train.engine import initialize
    from jaxspeed.models import build_gpt
    from jaxspeed.models.gpt import count_params

    case = QUICK if args.quick else FULL
    steps = args.steps or case["steps"]
    if steps < 1:
        raise SystemExit(f"--steps must be >= 1, got {steps}")
    config = bench_config(case)
    engine = initialize(config)
    mesh, n = engine.mesh, jax.device_count()
    replicated = NamedSharding(mesh, P())
    batch_sharding = NamedSharding(mesh, P("data"))  # rows over the 8 devices (mesh data=8)
    rows = engine.batch_sizes.train_batch_size
    vocab, seq_len = case["model"]["vocab_size"], case["seq_len"]
    tokens = np.random.default_rng(0).integers(0, vocab, (rows, seq_len + 1))
    batch = {
        "inputs": jax.device_put(tokens[:, :-1].astype(np.int32), batch_sharding),
        "targets": jax.device_put(tokens[:, 1:].astype(np.int32), batch_sharding),
    }

    state = engine.init(jax.random.key(0))
    model = build_gpt(config.model)
    tx, step = baseline_step(model)
    copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=replicated)
    base_params = copy(state.params)  # the same initial parameters, in their own buffers
    base_opt = jax.jit(tx.init, out_shardings=replicated)(base_params)
    base = jax.jit(
        step,
        in_shardings=(replicated, replicated, batch_sharding),
        out_shardings=(replicated, replicated, replicated),
        donate_argnums=(0, 1),
    )
    n_params = count_params(state.params)

    holder = {"js": state, "base": (base_params, base_opt)}
    losses = {"js": [], "base": []}

    def run_jaxspeed():
        holder["js"], metrics = engine.train_step(holder["js"], batch)
        jax.block_until_ready((holder["js"], metrics))
        losses["js"].append(metrics["loss"])

    def run_baseline():
        params, opt_state = holder["base"]
        params, opt_state, loss = base(params, opt_state, batch)
        holder["base"] = (params, opt_state)
        jax.block_until_ready((params, opt_state, loss))
        losses["base"].append(loss)

    compile_s = {}
    for key, fn in (("js", run_jaxspeed), ("base", run_baseline)):
        start = time.perf_counter()
        fn()  # compile + first step
        compile_s[key] = time.perf_counter() - start
    first_loss = {k: float(v[0]) for k, v in losses.items()}
    for _ in range(case["warmup"]):
        run_jaxspeed()
        run_baseline()

    times = {"js": [], "base": []}
    for i in range(steps):
        order = (("js", run_jaxspeed), ("base", run_baseline))
        for key, fn in order if i % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)

    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    lo = {k: min(v) * 1e3 for k, v in times.items()}
    r = _common.ratio(med["base"], med["js"])
    print(
        f"Train-step overhead: reference GPT {n_params:,} params "
        f"(d_model {case['model']['d_model']}, "
        f"{case['model']['n_layers']} layers), {n} devices, ZeRO 0, fp32, AdamW + clip {CLIP}, "
        f"batch {rows} x {case['seq_len']} ({case['micro']} per device)"
    )
    print(
        f"first-step loss (same params, same batch): jaxspeed {first_loss['js']:.6f}, "
        f"hand-written {first_loss['base']:.6f}; {steps} interleaved timed steps each after "
        f"{case['warmup']} warm-up"
    )
    print()
    _common.print_table(
        ["step time (ms)", "median", "min", "compile+first s"],
        [
            ["jaxspeed engine.train_step", med["js"], lo["js"], compile_s["js"]],
            ["hand-written jax.jit step", med["base"], lo["base"], compile_s["base"]],
            ["ratio (baseline / jaxspeed)", r, _common.ratio(lo["base"], lo["js"]), ""],
        ],
    )
    print()
    _common.print_json(_common.result(
        NAME,
        case=(f"gpt d_model={case['model']['d_model']} layers={case['model']['n_layers']} "
              f"seq={case['seq_len']} micro={case['micro']} devices={n} zero=0 fp32"),
        jaxspeed=med["js"], baseline=med["base"], unit="ms/step (median)", ratio=r,
        steps=steps, min_ms={"jaxspeed": round(lo["js"], 3), "baseline": round(lo["base"], 3)},
        first_loss=first_loss, n_params=n_params,
    ))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
