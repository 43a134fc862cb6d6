"""Train the reference GPT at seq 4096 with block-sparse attention, against dense attention.

Both models come from `configs/gpt_sparse.yaml` at a longer sequence: one keeps its
`model.sparse_attention` block (Sparse Transformers' Fixed pattern, causal), the other sets it to
null (dense causal attention). They start from the same parameters and see the same batches. The
script prints each step's loss, then a table of the compiled train step's per-device memory
(XLA's `memory_analysis()`: `temp` = activations, gradients and scratch; `total` = state, batch
and temp) and of the median step time.

    python examples/long_context_sparse.py                  # seq 4096, one CPU device
    python examples/long_context_sparse.py --seq-len 8192 --steps 3
    python examples/long_context_sparse.py --cpu-devices 8  # 8 emulated devices, 8 sequences
    python examples/long_context_sparse.py --cpu-devices 0  # real accelerators (Pallas on GPU)
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxspeed as js
from jaxspeed.data import TokenDataset

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "gpt_sparse.yaml"
MODES = ("sparse", "dense")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(CONFIG), help="YAML or JSON config")
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per model")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--d-ff", type=int, default=512)
    parser.add_argument("--block", type=int, default=64, help="sparse layout block size")
    parser.add_argument(
        "--num-local-blocks", type=int, default=4,
        help="Fixed layout window, in blocks (4 x 64 = 256 tokens)",
    )
    parser.add_argument(
        "--cpu-devices", type=int, default=1,
        help="emulate N CPU devices, one sequence each (0 = use the machine's accelerators)",
    )
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override another config key, e.g. --set optimizer.params.lr=1e-3 (repeatable)",
    )
    args = parser.parse_args()
    for name in ("seq_len", "steps", "d_model", "n_layers", "n_heads", "d_ff", "block"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def overrides(args, mode: str) -> list[str]:
    """`--set`-style overrides turning the config into this run's sparse or dense model."""
    sizes = [
        f"data.seq_len={args.seq_len}", f"model.max_seq_len={args.seq_len}",
        f"model.d_model={args.d_model}", f"model.n_layers={args.n_layers}",
        f"model.n_heads={args.n_heads}", f"model.d_ff={args.d_ff}",
        "train_micro_batch_size_per_device=1",
        "logging.eval_every_n_steps=0",
    ]
    if mode == "dense":
        attention = ["model.sparse_attention=null"]
    else:
        attention = [
            f"model.sparse_attention.block={args.block}",
            f"model.sparse_attention.num_local_blocks={args.num_local_blocks}",
        ]
    return [*sizes, *attention, *args.overrides]


def density(config) -> float:
    """Fraction of the `[nb, nb]` blocks the sparse model computes (layout and causal mask)."""
    sparsity = config.model.sparse_attention.sparsity(config.model.n_heads)
    layout = sparsity.make_layout(config.data.seq_len).astype(bool)  # [heads, nb, nb]
    return float((layout & np.tril(np.ones(layout.shape[1:], bool))).mean())


def step_memory(engine) -> dict[str, int]:
    """Per-device bytes of the compiled train step (XLA's `memory_analysis()`)."""
    per_device = engine.memory_report()["per_device_bytes"]
    return {"temp": per_device["temp"], "total": per_device["total"]}


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def main():
    args = parse_args()
    if args.cpu_devices:  # before any JAX computation: the device count is fixed at start-up
        js.distributed.set_cpu_devices(args.cpu_devices)
    configs = {m: js.load_config(args.config, overrides=overrides(args, m)) for m in MODES}
    dataset = TokenDataset.from_config(configs["sparse"].data, seed=configs["sparse"].seed)

    engines, compiled, compile_s = {}, {}, {}
    for mode in MODES:
        engines[mode] = js.initialize(configs[mode])
        start = time.perf_counter()
        compiled[mode] = engines[mode].compile_train_step()  # compiled once, run below
        compile_s[mode] = time.perf_counter() - start
    memory = {mode: step_memory(engines[mode]) for mode in MODES}

    # The same initial parameters for both (sparse attention adds none): `init` once, copy.
    first = engines["sparse"].init(jax.random.key(configs["sparse"].seed))
    states = {"sparse": first, "dense": jax.tree.map(jnp.copy, first)}
    global_batch = engines["sparse"].batch_sizes.train_batch_size
    times = {mode: [] for mode in MODES}
    losses = {mode: [] for mode in MODES}
    for step in range(args.steps + 1):  # step 0 warms up (buffers, thread pools): not timed
        batch = dataset.batch(step, global_batch=global_batch)
        for mode in MODES if step % 2 else MODES[::-1]:  # alternate who goes first
            engine = engines[mode]
            start = time.perf_counter()
            states[mode], metrics = compiled[mode](states[mode], engine.shard_batch(batch))
            losses[mode].append(float(metrics["loss"]))  # waits for the step
            if step:
                times[mode].append(time.perf_counter() - start)
        print(
            f"step {step + 1:3d}  sparse loss {losses['sparse'][-1]:.4f}  "
            f"dense loss {losses['dense'][-1]:.4f}",
            flush=True,
        )

    med = {mode: statistics.median(times[mode]) for mode in MODES}
    frac = density(configs["sparse"])
    sparse_cfg = configs["sparse"].model.sparse_attention
    print()
    print(
        f"seq {args.seq_len}, {engines['sparse'].mesh.size} device(s), global batch "
        f"{global_batch}; Fixed layout: block {sparse_cfg.block}, "
        f"{sparse_cfg.num_local_blocks} local blocks, {frac:.1%} of the blocks computed"
    )
    print(f"{'':<26}{'sparse':>12}{'dense':>12}{'dense/sparse':>14}")
    rows = [
        ("step time (median)", med["sparse"], med["dense"], lambda s: f"{s:.3f} s"),
        ("temp bytes per device", memory["sparse"]["temp"], memory["dense"]["temp"], gib),
        ("total bytes per device", memory["sparse"]["total"], memory["dense"]["total"], gib),
        ("compile time", compile_s["sparse"], compile_s["dense"], lambda s: f"{s:.1f} s"),
    ]
    for label, sparse, dense, fmt in rows:
        print(f"{label:<26}{fmt(sparse):>12}{fmt(dense):>12}{dense / sparse:>13.2f}x")
    print(f"{'loss, first -> last':<26}", "  ".join(
        f"{mode} {losses[mode][0]:.3f} -> {losses[mode][-1]:.3f}" for mode in MODES
    ))
    summary = {
        "seq_len": args.seq_len, "devices": engines["sparse"].mesh.size, "density": frac,
        **{mode: {"step_s": med[mode], **{f"{k}_bytes": v for k, v in memory[mode].items()},
                  "losses": losses[mode]} for mode in MODES},
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
