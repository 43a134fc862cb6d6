"""The training loop behind `jaxspeed train`: data, steps, evaluation, metrics, checkpoints.

A run resumes from the newest complete checkpoint in its checkpoint directory; the data order
and RNG continue exactly as if it had never stopped (byte data: batches are a function of the
step; token-file data: the Grain iterator's state is saved in the checkpoint's JSON record).
SIGTERM or SIGINT (preemption, Ctrl-C) finishes the current step, saves, and stops.
"""

from __future__ import annotations

import itertools
import math
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from jaxspeed.config import Config
from jaxspeed.data.dataset import TokenDataset
from jaxspeed.train.engine import Engine, initialize
from jaxspeed.errors import ConfigError, JaxspeedError
from jaxspeed.cost.fit import DoesNotFit, device_memory, engine_verdict
from jaxspeed.data.grain_loader import GrainTokenDataset, make_dataset
from jaxspeed.train.metrics_log import MetricsLog
from jaxspeed.cost.peaks import mfu, peak_flops


class TrainingInterrupted(JaxspeedError):
    """SIGTERM/SIGINT stopped the run after a checkpoint was saved."""

    def __init__(self, signum: int, step: int, directory: Path):
        self.signum = signum
        super().__init__(
            f"stopped by {signal.Signals(signum).name} after step {step}; checkpoint saved in "
            f"{directory} (run the same command to resume)"
        )


class NonFiniteLoss(JaxspeedError):
    """The loss or gradient norm became inf/NaN in bf16/fp32 training."""


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


def _train_batches(engine: Engine, dataset, start: int, saved_state: dict | None):
    """This process's train batches from step `start`: a Grain iterator (restored from its
    saved state) for token-file data, else batches computed from the step."""
    if isinstance(dataset, GrainTokenDataset):
        state = saved_state if saved_state is not None else {"next_index": start}
        return dataset.iterator(global_batch=engine.batch_sizes.train_batch_size, state=state)
    return (_local_batch(engine, dataset, step) for step in itertools.count(start))


def _data_meta(batches, done: int) -> dict[str, Any]:
    """The data position saved with a checkpoint (and the Grain iterator state, when one)."""
    meta: dict[str, Any] = {"data_position": done}
    if hasattr(batches, "get_state"):
        meta["data_state"] = batches.get_state()
    return meta


def _sampler(engine: Engine):
    """`state -> text`: a greedy continuation of `logging.sample_prompt`."""
    from jaxspeed.models.sampling import Codec, sample_text

    config = engine.config
    codec = Codec(config.data.tokenizer)
    prompt = config.logging.sample_prompt
    room = config.model.max_seq_len - len(codec.encode(prompt))
    new = min(config.logging.sample_tokens, room)
    return lambda state: prompt + sample_text(
        engine, state.params, prompt, codec, max_new_tokens=new, temperature=0)


@contextmanager
def _stop_on_signals():
    """Records SIGTERM/SIGINT instead of dying, so the loop can save first."""
    received: dict[str, int | None] = {"signum": None}
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum, frame):
        received["signum"] = signum

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield received
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _agreed(flag: bool) -> bool:
    """True on every process if any process saw a signal, so all of them save the same step."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(multihost_utils.process_allgather(np.array(flag)).any())


def _check_finite(config: Config, metrics: dict[str, float], step: int, ckpt) -> None:
    """bf16/fp32: a non-finite loss stops the run before anything non-finite is saved."""
    if config.fp16.enabled:  # fp16 skips such steps through loss scaling instead
        return
    bad = {k: metrics[k] for k in ("loss", "grad_norm") if not math.isfinite(metrics[k])}
    if bad:
        last = ckpt.latest_step()
        where = f"the newest good checkpoint is step {last} in {ckpt.directory}" if last is not None else "no checkpoint was saved"
        raise NonFiniteLoss(
            f"non-finite {', '.join(f'{k}={v}' for k, v in bad.items())} at step {step}; "
            f"stopping without saving ({where}). Lower optimizer.params.lr or raise gradient_clipping."
        )


def _check_fits(engine: Engine, *, force: bool) -> None:
    """Refuses a plan whose compiled step does not fit the device memory (unless `force`)."""
    budget = device_memory(engine.config)
    if budget is None:
        return
    verdict = engine_verdict(engine, budget, suggest=not force)
    if verdict.fit.fits:
        return
    if not force:
        raise DoesNotFit(f"{verdict.message()}\n(--force starts anyway)")
    print(f"jaxspeed train: warning: {verdict.fit.describe()}; starting anyway (--force)", file=sys.stderr)


class _Throughput:
    """tokens/s, and model TFLOP/s per device and MFU (when the device's peak is known)."""

    def __init__(self, engine: Engine, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self.flops_per_device = engine.step_flops() / engine.mesh.size
        device = engine.mesh.devices.flat[0]
        self.peak = peak_flops(device.device_kind, engine.config.hardware.peak_tflops)

    def record(self, steps: int, seconds: float) -> dict[str, float]:
        flops_per_second = self.flops_per_device * steps / seconds
        out = {
            "tokens_per_second": self.tokens_per_step * steps / seconds,
            "tflops_per_device": flops_per_second / 1e12,
        }
        utilisation = mfu(self.flops_per_device * steps, seconds, self.peak)
        if utilisation is not None:
            out["mfu"] = utilisation
        return out


def train(
    config: Config,
    *,
    output_dir: str | Path,
    steps: int | None = None,
    progress: bool | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Trains the reference GPT described by `config` up to `steps` total steps.

    Writes `output_dir/metrics.jsonl` (and TensorBoard events when `logging.tensorboard`) and
    checkpoints in `checkpoint.dir` (default `output_dir/checkpoints`), resuming from the newest
    complete one (or, when there is none, starting from `checkpoint.load_from`'s params at step
    0). Returns the last logged record.

    When the device memory is known (`hardware.device_memory`, or reported by the
    accelerator), a plan whose compiled step does not fit is refused with `DoesNotFit`
    (naming the cheapest change that fits) unless `force`.
    """
    steps = config.steps if steps is None else steps
    if steps < 1:
        raise ConfigError(f"steps must be >= 1, got {steps}")
    dataset = make_dataset(config, progress=sys.stderr.isatty() if progress is None else progress)
    _check_vocab(config, dataset)
    engine = initialize(config)
    _check_fits(engine, force=force)
    ckpt = engine.checkpointer(config.checkpoint.dir or Path(output_dir) / "checkpoints")
    saved_meta: dict[str, Any] = {}
    if ckpt.latest_step() is not None:
        state = engine.restore(directory=ckpt.directory)
        saved_meta = ckpt.read_meta(int(jax.device_get(state.step)))
    elif config.checkpoint.load_from is not None:
        from jaxspeed.checkpoint.params import start_from

        state = start_from(engine, config.checkpoint.load_from, jax.random.key(config.seed))
    else:
        state = engine.init(jax.random.key(config.seed))
    start = int(jax.device_get(state.step))
    batches = _train_batches(engine, dataset, start, saved_meta.get("data_state"))
    is_main = jax.process_index() == 0
    log = MetricsLog(output_dir, tensorboard=config.logging.tensorboard, enabled=is_main)
    every = max(1, config.logging.every_n_steps)
    save_every = config.checkpoint.every_n_steps
    eval_every = config.logging.eval_every_n_steps
    throughput = _Throughput(engine, engine.batch_sizes.train_batch_size * config.data.seq_len)
    show = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(total=steps, initial=start, desc="train", unit="step", disable=not (show and is_main))
    record: dict[str, Any] = {}
    sampler = _sampler(engine) if config.logging.sample_every_n_steps else None
    last_time, last_step = time.perf_counter(), start
    try:
        with _stop_on_signals() as stop:
            for step in range(start, steps):
                state, metrics = engine.train_step(state, next(batches))
                bar.update(1)
                done = step + 1
                logging_now = done % every == 0 or done == steps
                saving_now = bool(save_every) and done % save_every == 0
                sampling_now = sampler is not None and done % config.logging.sample_every_n_steps == 0
                stopping = _agreed(stop["signum"] is not None)
                final = done == steps or stopping
                if not (logging_now or saving_now or sampling_now or final):
                    continue
                values = {k: float(v) for k, v in jax.device_get(metrics).items()}
                _check_finite(config, values, done, ckpt)
                if logging_now:
                    now = time.perf_counter()
                    record = {"step": done, **values, **throughput.record(done - last_step, now - last_time)}
                    if eval_every and (done % eval_every == 0 or done == steps):
                        record["eval_loss"] = evaluate(
                            engine, state, dataset, batches=config.logging.eval_batches
                        )
                    log.write(record)
                    bar.set_postfix(loss=f"{values['loss']:.4f}")
                if sampling_now:
                    text = sampler(state)  # every process decodes; the main one prints
                    if is_main:
                        bar.write(f"sample @ step {done}: {text!r}")
                if saving_now or final:
                    engine.save(state, directory=ckpt.directory, meta=_data_meta(batches, done))
                if logging_now:
                    last_time, last_step = time.perf_counter(), done
                if stopping:
                    raise TrainingInterrupted(stop["signum"] or signal.SIGTERM, done, ckpt.directory)
    finally:
        batches.close()  # a Grain iterator stops its read threads (a generator just ends)
        bar.close()
        log.close()
        ckpt.wait()
    return record
