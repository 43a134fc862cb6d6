"""Train a 16k-token GPT with its sequence split over 8 devices, against no sequence split.

`configs/gpt_long.yaml` splits one sequence over `mesh.sequence: 8` (DeepSpeed-Ulysses, blocked
attention). The script trains it for a few steps, printing each step's loss, then compiles the
same model without sequence parallelism (8 devices of data parallelism, one whole sequence per
device) with blocked and with the dense reference attention, and prints each compiled train
step's per-device memory (XLA's `memory_analysis()`; nothing of the baselines is allocated).

    python examples/long_context.py                        # 8 emulated CPU devices
    python examples/long_context.py --seq-len 32768 --steps 2
    python examples/long_context.py --set model.sequence_parallel.impl=ring
"""

import argparse
import json
import time
from pathlib import Path

import jax

import jaxspeed as js
from jaxspeed.data import TokenDataset

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "gpt_long.yaml"
#: The comparisons: overrides on top of the config (the first one is trained).
VARIANTS = {
    "sequence 8": [],
    "data 8, blocked": ["mesh.sequence=1", "mesh.data=8"],
    "data 8, reference": ["mesh.sequence=1", "mesh.data=8", "model.attention.impl=reference"],
}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(CONFIG), help="YAML or JSON config")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=3, help="train steps")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config key, e.g. --set model.sequence_parallel.impl=ring (repeatable)",
    )
    args = parser.parse_args()
    if args.steps < 1 or (args.seq_len is not None and args.seq_len < 1):
        parser.error("--steps and --seq-len must be >= 1")
    return args


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def main():
    args = parse_args()
    js.distributed.set_cpu_devices(8)  # before any JAX computation
    sizes = [] if args.seq_len is None else [
        f"data.seq_len={args.seq_len}", f"model.max_seq_len={args.seq_len}"]
    configs = {
        name: js.load_config(args.config, overrides=[*sizes, *args.overrides, *extra])
        for name, extra in VARIANTS.items()
    }
    trained = next(iter(VARIANTS))
    engine = js.initialize(configs[trained])
    dataset = TokenDataset.from_config(configs[trained].data, seed=configs[trained].seed)
    state = engine.init(jax.random.key(configs[trained].seed))
    global_batch = engine.batch_sizes.train_batch_size
    losses = []
    for step in range(args.steps):
        start = time.perf_counter()
        state, metrics = engine.train_step(state, dataset.batch(step, global_batch=global_batch))
        losses.append(float(metrics["loss"]))
        print(f"step {step + 1:3d}  loss {losses[-1]:.4f}  {time.perf_counter() - start:.1f} s",
              flush=True)

    memory = {}
    for name, cfg in configs.items():
        other = engine if name == trained else js.initialize(cfg)
        memory[name] = other.memory_report()["per_device_bytes"]
    seq = configs[trained].data.seq_len
    print()
    print(f"seq {seq}, {engine.mesh.size} devices; per-device bytes of the compiled train step")
    print(f"{'':<22}{'temp':>12}{'total':>12}{'total / sequence 8':>20}")
    for name, per_device in memory.items():
        ratio = per_device["total"] / memory[trained]["total"]
        print(f"{name:<22}{gib(per_device['temp']):>12}{gib(per_device['total']):>12}"
              f"{ratio:>19.1f}x")
    print(json.dumps({
        "seq_len": seq, "devices": engine.mesh.size, "losses": losses,
        "sequence_parallel": configs[trained].model.sequence_parallel.model_dump(),
        "per_device_bytes": {name: {k: m[k] for k in ("temp", "total")}
                             for name, m in memory.items()},
    }))


if __name__ == "__main__":
    main()
