"""The training loop behind `jaxspeed train`: data, steps, evaluation, metrics, progress."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import jax
from tqdm import tqdm

from jaxspeed.config import Config
from jaxspeed.data import TokenDataset
from jaxspeed.engine import Engine, initialize
from jaxspeed.errors import ConfigError
from jaxspeed.metrics_log import MetricsLog


def _check_vocab(config: Config, dataset: TokenDataset) -> None:
    if config.model.vocab_size < dataset.vocab_size:
        raise ConfigError(
            f"model.vocab_size={config.model.vocab_size} is smaller than the data's byte "
            f"vocabulary ({dataset.vocab_size}); set model.vocab_size >= {dataset.vocab_size}"
        )


def evaluate(engine: Engine, state, dataset: TokenDataset, *, batches: int) -> float:
    """Mean held-out loss over `batches` global batches (the same batches every time)."""
    losses = [
        float(engine.eval_step(state, _local_batch(engine, dataset, i, split="eval"))["loss"])
        for i in range(batches)
    ]
    return sum(losses) / len(losses)


def _local_batch(engine: Engine, dataset: TokenDataset, step: int, *, split: str = "train"):
    return dataset.batch(
        step,
        global_batch=engine.batch_sizes.train_batch_size,
        split=split,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )


def train(
    config: Config,
    *,
    output_dir: str | Path,
    steps: int | None = None,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Trains the reference GPT described by `config` on its data for `steps` steps.

    Writes `output_dir/metrics.jsonl` (and TensorBoard events when `logging.tensorboard`).
    Returns the last logged record.
    """
    steps = config.steps if steps is None else steps
    if steps < 1:
        raise ConfigError(f"steps must be >= 1, got {steps}")
    dataset = TokenDataset.from_config(config.data, seed=config.seed)
    _check_vocab(config, dataset)
    engine = initialize(config)
    state = engine.init(jax.random.key(config.seed))
    is_main = jax.process_index() == 0
    log = MetricsLog(output_dir, tensorboard=config.logging.tensorboard, enabled=is_main)
    every = max(1, config.logging.every_n_steps)
    eval_every = config.logging.eval_every_n_steps
    tokens_per_step = engine.batch_sizes.train_batch_size * config.data.seq_len
    show = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(total=steps, desc="train", unit="step", disable=not (show and is_main))
    record: dict[str, Any] = {}
    last_time, last_step = time.perf_counter(), 0
    try:
        for step in range(steps):
            state, metrics = engine.train_step(state, _local_batch(engine, dataset, step))
            bar.update(1)
            done = step + 1
            if done % every and done != steps:
                continue
            metrics = jax.device_get(metrics)  # waits for the step: timing is honest
            now = time.perf_counter()
            record = {
                "step": done,
                **{k: float(v) for k, v in metrics.items()},
                "tokens_per_second": tokens_per_step * (done - last_step) / (now - last_time),
            }
            if eval_every and (done % eval_every == 0 or done == steps):
                record["eval_loss"] = evaluate(
                    engine, state, dataset, batches=config.logging.eval_batches
                )
            log.write(record)
            bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_second']:.0f}")
            last_time, last_step = time.perf_counter(), done
    finally:
        bar.close()
        log.close()
    return record
