"""Step time with the real input pipeline (Grain over a token file) against synthetic batches.

Same tiny llama-style model and engine, same batch shapes. The baseline feeds one fixed host
batch (inputs, targets, segment_ids, positions) every step; the pipeline case reads a
memory-mapped token file through `GrainTokenDataset` (global shuffle, packing on, 2 read
threads) exactly as `jaxspeed train` does. Steps are dispatched back to back and synchronised
once per round (as a training loop runs), rounds interleaved A B B A so machine noise hits both
alike; the median per-step time of each is reported. Headline: ratio = synthetic step time /
pipeline step time (1.0 = the pipeline adds nothing); `added_pct` is the time it adds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE)]

import _common  # noqa: E402

NAME = "input_pipeline"
FULL = {
    "model": {"vocab_size": 512, "d_model": 256, "n_layers": 4, "n_heads": 4, "d_ff": 1024,
              "max_seq_len": 256},
    "seq_len": 256, "micro": 2, "tokens": 4_000_000, "rounds": 6, "steps_per_round": 10,
}
QUICK = {
    "model": {"vocab_size": 512, "d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64,
              "max_seq_len": 32},
    "seq_len": 32, "micro": 1, "tokens": 50_000, "rounds": 2, "steps_per_round": 3,
}
WORKERS = 2


def write_corpus(path: Path, *, tokens: int, vocab: int, eos_id: int = 0) -> None:
    """A token file of random documents (mean length 200) joined by `eos_id`."""
    import numpy as np

    rng = np.random.default_rng(0)
    ids = rng.integers(1, vocab, size=tokens).astype(np.uint16)
    ids[rng.random(tokens) < 1 / 200] = eos_id
    np.save(path, ids)


def bench_config(case: dict, token_file: Path):
    """Llama-style (RMSNorm, SwiGLU, rotary), 8 devices data-parallel, fp32, packing on."""
    from jaxspeed.config import load_config

    return load_config({
        "mesh": {"pipe": 1, "data": -1, "expert": 1, "tensor": 1},
        "train_micro_batch_size_per_device": case["micro"],
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
        "scheduler": {"type": "constant"},
        "model": {"type": "gpt", "norm": "rmsnorm", "mlp": "swiglu", "positions": "rotary",
                  "tie_embeddings": False, **case["model"]},
        "data": {"source": "tokens", "files": [str(token_file)], "seq_len": case["seq_len"],
                 "packing": True, "eos_id": 0, "workers": WORKERS},
    })


def host_time(dataset, rows: int, batches: int = 50) -> float:
    """Host time to build one batch (ms): a fresh iterator drained with no training."""
    it = dataset.iterator(global_batch=rows)
    next(it)
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    return (time.perf_counter() - start) / batches * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, few steps (tests)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds of each (median)")
    args = parser.parse_args(argv)
    _common.use_cpu_devices()

    import jax

    from jaxspeed.train.engine import initialize
    from jaxspeed.data.grain_loader import make_dataset

    case = QUICK if args.quick else FULL
    rounds = args.rounds or case["rounds"]
    if rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {rounds}")
    per_round = case["steps_per_round"]
    with tempfile.TemporaryDirectory() as tmp:
        token_file = Path(tmp) / "tokens.npy"
        write_corpus(token_file, tokens=case["tokens"], vocab=case["model"]["vocab_size"])
        config = bench_config(case, token_file)
        engine = initialize(config)
        dataset = make_dataset(config)
        rows = engine.batch_sizes.train_batch_size
        batches = dataset.iterator(global_batch=rows)
        synthetic = dataset.batch(10**6, global_batch=rows)  # a fixed host batch, same keys
        holder = {"state": engine.init(jax.random.key(0))}

        def run(feed) -> float:
            start = time.perf_counter()
            for _ in range(per_round):
                holder["state"], metrics = engine.train_step(holder["state"], feed())
            jax.block_until_ready((holder["state"], metrics))
            return (time.perf_counter() - start) / per_round * 1e3

        host_ms = host_time(dataset, rows)
        cases = {"synthetic": lambda: synthetic, "pipeline": lambda: next(batches)}
        for feed in cases.values():
            run(feed)  # compile and warm up (and fill the prefetch buffer)
        times: dict[str, list[float]] = {name: [] for name in cases}
        for r in range(rounds):
            order = list(cases) if r % 2 == 0 else list(cases)[::-1]
            for name in order:
                times[name].append(run(cases[name]))
    synth, pipe = statistics.median(times["synthetic"]), statistics.median(times["pipeline"])
    added = (pipe - synth) / synth * 100
    tokens_per_step = rows * case["seq_len"]
    _common.print_table(
        ["feed", "step ms", "tokens/s"],
        [["synthetic batch", synth, tokens_per_step / synth * 1e3],
         [f"Grain, packing, {WORKERS} threads", pipe, tokens_per_step / pipe * 1e3]],
    )
    print(f"pipeline adds {added:+.2f}% per step (target < 3%); building one batch alone takes "
          f"{host_ms:.3f} ms on the host ({host_ms / synth * 100:.2f}% of a step)")
    _common.print_json(_common.result(
        NAME, case=f"tokens seq={case['seq_len']} rows={rows} packing workers={WORKERS}",
        jaxspeed=pipe, baseline=synth, unit="ms/step", ratio=_common.ratio(synth, pipe),
        added_pct=round(added, 2), host_ms_per_batch=_common.round_figure(host_ms), rounds=rounds, steps_per_round=per_round,
        platform=jax.devices()[0].platform,
    ))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
