"""The training loop behind `jaxspeed train`: data, steps, evaluation, metrics, checkpoints.

A run resumes from the newest complete checkpoint in its checkpoint directory when that was
saved with the same config (`jaxspeed.train.resume`); the data order and RNG continue exactly
as if it had never stopped (byte data: batches are a function of the step; token-file data:
the Grain iterator's state is saved in the checkpoint's JSON record). It saves at the end,
every `checkpoint.every_n_steps` steps and every `checkpoint.every_n_minutes` minutes.
SIGTERM or SIGINT (preemption, Ctrl-C) finishes the current step, saves, and stops; after
SIGTERM the exit code is 75, `REQUEUE_EXIT_CODE` (a SIGTERM during the start-up stops the run
after its first step, so a job requeued again and again still makes progress). The output
folder is created and locked against a second run before anything starts (`run_dir`).

Progress goes to stderr from process 0 (`jaxspeed.runtime.progress`): the start-up phases,
then a bar on a terminal or a plain line every `JAXSPEED_PROGRESS_SECONDS` elsewhere.
"""

from __future__ import annotations

import itertools
import math
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
from tqdm import tqdm

from jaxspeed.checkpoint.orbax_noise import orphaned_reads_quiet
from jaxspeed.checkpoint.params import with_checkpoint_model
from jaxspeed.config import Config
from jaxspeed.data.dataset import TokenDataset
from jaxspeed.train.engine import Engine, initialize
from jaxspeed.errors import REQUEUE_EXIT_CODE, ConfigError, JaxspeedError
from jaxspeed.cost.fit import DoesNotFit, device_memory
from jaxspeed.train.fit_check import engine_verdict
from jaxspeed.data.grain_loader import GrainTokenDataset, make_dataset
from jaxspeed.train.metrics_log import MetricsLog, Throughput, TrainRecord, last_record
from jaxspeed.train.resume import (
    check_config, check_steps, readable_meta, restore_readable, resume_point, say_elastic)
from jaxspeed.train.processes import (
    SampleOrder, agreed, peer_gone, save_failed, settle_save, shared_run_folder, stop_on_signals)
from jaxspeed.runtime.progress import Progress, phase


class TrainingInterrupted(JaxspeedError):
    """SIGTERM/SIGINT stopped the run after a checkpoint was saved.

    `exit_code` is the CLI's: `REQUEUE_EXIT_CODE` (75) after SIGTERM (preemption, a time
    limit: the job may be requeued and resumes), 128 + the signal's number after SIGINT.
    """

    def __init__(self, signum: int, step: int, directory: Path):
        self.signum = signum
        self.exit_code = REQUEUE_EXIT_CODE if signum == signal.SIGTERM else 128 + signum
        then = (f"exit code {REQUEUE_EXIT_CODE}: requeue the job, or run the same command, to "
                f"resume" if signum == signal.SIGTERM else "run the same command to resume")
        super().__init__(
            f"stopped by {signal.Signals(signum).name} after step {step}; checkpoint saved in "
            f"{directory} ({then})"
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


def _data_meta(engine: Engine, batches, done: int, order: SampleOrder) -> dict[str, Any]:
    """What a checkpoint's record says of the data and the layout: the data position, the
    samples' digest, the global batch and how it was split (the Grain iterator's state, when
    one)."""
    sizes = engine.batch_sizes
    meta: dict[str, Any] = {
        "data_position": done, "sample_digest": order.digest(),
        "global_batch": sizes.train_batch_size, "processes": jax.process_count(),
        "devices": engine.mesh.size, "micro_batch_per_device": sizes.micro_batch_per_device,
        "accumulation_steps": sizes.accumulation_steps,
    }
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
def _no_empty_folder(directory: Path):
    """Removes `directory` when this run created it and stopped before saving anything there."""
    existed = directory.exists()
    try:
        yield
    finally:
        if not existed and directory.is_dir() and not any(directory.iterdir()):
            directory.rmdir()


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


def _check_fits(engine: Engine, *, force: bool, show: bool) -> None:
    """Refuses a plan whose compiled step does not fit the device memory (unless `force`)."""
    budget = device_memory(engine.config)
    if budget is None:
        return
    with phase("checking that the plan fits the device memory", enabled=show):
        verdict = engine_verdict(engine, budget, suggest=not force)  # compiles the step
    if verdict.fit.fits:
        return
    if not force:
        raise DoesNotFit(f"{verdict.message()}\n(--force starts anyway)")
    print(f"jaxspeed train: warning: {verdict.fit.describe()}; starting anyway (--force)", file=sys.stderr)


def _restore_or_init(engine: Engine, config: Config, ckpt, latest: int | None, *,
                     by_hand: bool, show: bool):
    """The state to start from and its checkpoint's record: the checkpoint at `latest` (or,
    when it cannot be read, the newest older one that can: `restore_readable`),
    `checkpoint.load_from`'s params at step 0, or a fresh init."""
    if latest is not None:
        def check(step: int, meta) -> None:
            check_config(config, meta, global_batch=engine.batch_sizes.train_batch_size,
                         directory=ckpt.directory, step=step, warn=show)

        return restore_readable(ckpt, engine.abstract_state(), step=latest, by_hand=by_hand,
                                check=check, warn=show)
    if config.checkpoint.load_from is not None:
        from jaxspeed.checkpoint.params import start_from

        return start_from(engine, config.checkpoint.load_from, jax.random.key(config.seed)), {}
    return engine.init(jax.random.key(config.seed)), {}


def _finished_record(output_dir, step: int, directory: Path, *, show: bool) -> TrainRecord:
    """The record of a run whose checkpoint is already at `steps`, and a line saying so."""
    if show:
        print(f"jaxspeed train: checkpoint {directory / str(step)} is already at steps={step}; "
              f"nothing to train (raise --steps to continue)", file=sys.stderr)
    return last_record(output_dir, step=step) or TrainRecord(step=step)


def train(
    config: Config,
    *,
    output_dir: str | Path,
    steps: int | None = None,
    progress: bool | None = None,
    force: bool = False,
    resume_step: int | None = None,
) -> TrainRecord:
    """Trains the reference GPT described by `config` up to `steps` total steps.

    Writes `output_dir/metrics.jsonl` (and TensorBoard events when `logging.tensorboard`) and
    checkpoints in `checkpoint.dir` (default `output_dir/checkpoints`), resuming from the newest
    complete one (or, when there is none, starting from `checkpoint.load_from`'s params at step
    0). A checkpoint saved with another config is refused (`jaxspeed.train.resume`, unless
    `checkpoint.resume: force`); one past `steps` is an error (`NothingToTrain`); one at `steps`
    returns its record with a line on stderr saying there is nothing to train. A resumed run
    drops the records of the steps after its checkpoint from `metrics.jsonl` (it logs them
    again; `metrics_log.drop_records_after`).

    `output_dir` is created, or refused with a `ConfigError`, before anything starts, and
    process 0 holds its lock while the run lasts: a second run into it is refused with
    `RunFolderBusy` naming the holder's pid and host (`jaxspeed.train.run_dir`).

    When the device memory is known (`hardware.device_memory`, or reported by the
    accelerator), a plan whose compiled step does not fit is refused with `DoesNotFit`
    (naming the cheapest change that fits) unless `force`.

    A newest checkpoint that cannot be read is set aside and the run resumes the newest one
    that can, with a warning line; none readable is a `CheckpointError`.

    Args:
      resume_step: resume this checkpoint instead of the newest (`--resume-step`); the later
        ones are set aside, and one that cannot be read is an error.
      progress: False shows nothing on stderr; True or None (the default) shows the start-up
        phases and the progress of process 0 (a bar on a terminal, plain lines elsewhere).

    Returns:
      The last logged `TrainRecord`.
    """
    config = with_checkpoint_model(config)  # a load_from's model is the default (the CLI did it)
    steps = config.steps if steps is None else steps
    if steps < 1:
        raise ConfigError(f"steps must be >= 1, got {steps}")
    is_main = jax.process_index() == 0
    # SIGTERM from here on (a preemption during the start-up, a compile included) stops the
    # run at the first step boundary with a checkpoint: each requeue makes progress
    with shared_run_folder(Path(output_dir), writer=is_main), \
            stop_on_signals(signal.SIGTERM) as stop:  # before anything starts
        return _train(config, Path(output_dir), steps, is_main=is_main,
                      show=progress is not False and is_main, force=force,
                      resume_step=resume_step, stop=stop)


def _train(config: Config, output_dir: Path, steps: int, *, is_main: bool, show: bool,
           force: bool, resume_step: int | None, stop: dict[str, int | None]) -> TrainRecord:
    """`train` in its locked run folder; `stop` records a SIGTERM (and, during the steps,
    SIGINT)."""
    engine = initialize(config)  # quick (nothing compiles), and where config errors show
    ckpt_dir = Path(config.checkpoint.dir or Path(output_dir) / "checkpoints")
    # a refused plan leaves no checkpoint folder behind: open it here only when it exists
    latest = resume_point(ckpt_dir, engine.checkpointer, resume_step=resume_step)
    saved_meta: dict[str, Any] | None = None
    if latest is not None:  # an unreadable record: the restore below falls back
        ckpt = engine.checkpointer(ckpt_dir)
        saved_meta = readable_meta(ckpt, latest) if resume_step is None else ckpt.read_meta(latest)
    if saved_meta is not None:
        check_config(config, saved_meta, global_batch=engine.batch_sizes.train_batch_size,
                     directory=ckpt.directory, step=latest, warn=is_main)
        if not check_steps(latest, steps, directory=ckpt.directory):
            return _finished_record(output_dir, latest, ckpt.directory, show=is_main)
    dataset = make_dataset(config, progress=show)
    _check_vocab(config, dataset)
    _check_fits(engine, force=force, show=show)
    with _no_empty_folder(ckpt_dir):  # Ctrl-C or an error before the first save
        ckpt = engine.checkpointer(ckpt_dir)
        starting = f"restoring step {latest}" if latest is not None else "initializing the state"
        with phase(starting, enabled=show) as restoring:
            state, saved_meta = _restore_or_init(engine, config, ckpt, latest,
                                                 by_hand=resume_step is not None, show=is_main)
            start = int(jax.device_get(state.step))
            if latest is not None and start != latest:  # it fell back to an older one
                restoring.desc = f"restoring step {start}"
        if is_main:
            say_elastic(saved_meta, step=start, processes=jax.process_count(),
                        devices=engine.mesh.size, sizes=engine.batch_sizes)
        batches = _train_batches(engine, dataset, start, saved_meta.get("data_state"))
        local_rows = engine.batch_sizes.train_batch_size // jax.process_count()
        order = SampleOrder(saved_meta.get("sample_digest"), step=start,
                            first_row=jax.process_index() * local_rows)
        log = MetricsLog(output_dir, tensorboard=config.logging.tensorboard, enabled=is_main,
                         start_step=start)
        every = max(1, config.logging.every_n_steps)
        save_every = config.checkpoint.every_n_steps
        save_seconds = config.checkpoint.every_n_minutes * 60
        eval_every = config.logging.eval_every_n_steps
        with phase("counting the step's FLOPs", enabled=show):
            throughput = Throughput(engine, engine.batch_sizes.train_batch_size * config.data.seq_len)
        bar: Progress | None = None
        record: TrainRecord = TrainRecord(step=start)
        sampler = _sampler(engine) if config.logging.sample_every_n_steps else None
        first_time = last_time = time.perf_counter()
        last_step, last_save = start, time.monotonic()
        try:
            # before the loop, Ctrl-C quits; a failed save's orphaned writes print nothing
            with stop_on_signals(signal.SIGINT, received=stop), orphaned_reads_quiet():
                for step in range(start, steps):
                    batch = next(batches)
                    order.add(batch)
                    if bar is None:  # the first step compiles it: rates are timed from its end
                        first_time = time.perf_counter()
                        with phase("compiling the train step", enabled=show):
                            state, metrics = engine.train_step(state, batch)
                            jax.block_until_ready(metrics)
                        bar = Progress(steps, desc="train", unit="step", initial=step + 1, enabled=show)
                        last_time, last_step = time.perf_counter(), step + 1
                    else:
                        state, metrics = engine.train_step(state, batch)
                        bar.update(1)
                    done = step + 1
                    logging_now = done % every == 0 or done == steps
                    sampling_now = sampler is not None and done % config.logging.sample_every_n_steps == 0
                    failed = ckpt.failure()  # the last save's background part, here
                    stopping, clock_due, any_failed = agreed(
                        stop["signum"] is not None,
                        bool(save_seconds) and time.monotonic() - last_save >= save_seconds,
                        failed is not None,
                    )
                    if any_failed:
                        raise save_failed(ckpt, failed)
                    saving_now = (bool(save_every) and done % save_every == 0) or clock_due
                    final = done == steps or stopping
                    if not (logging_now or saving_now or sampling_now or final):
                        continue
                    values = {k: float(v) for k, v in jax.device_get(metrics).items()}
                    _check_finite(config, values, done, ckpt)
                    if logging_now:
                        now = time.perf_counter()
                        if done > last_step:
                            rates = throughput.record(done - last_step, now - last_time)
                        else:  # the first step alone: its compile is in its time
                            rates = throughput.record(1, now - first_time)
                        record = TrainRecord(step=done, **values, **rates,
                                             sample_digest=order.digest())
                        if eval_every and (done % eval_every == 0 or done == steps):
                            record["eval_loss"] = evaluate(
                                engine, state, dataset, batches=config.logging.eval_batches
                            )
                        log.write(record)
                        bar.set_postfix(loss=f"{values['loss']:.4f}",
                                        tokens_per_s=f"{record['tokens_per_second']:,.0f}")
                    if sampling_now:
                        text = sampler(state)  # every process decodes; the main one prints
                        if is_main:  # on stdout, as before; tqdm.write keeps a bar intact
                            tqdm.write(f"sample @ step {done}: {text!r}")
                    if saving_now or final:
                        meta = _data_meta(engine, batches, done, order)
                        settle_save(ckpt)  # Orbax's own wait blocks when another process failed
                        engine.save(state, directory=ckpt.directory, meta=meta)
                        last_save = time.monotonic()
                        if final:
                            settle_save(ckpt)
                    if logging_now:
                        last_time, last_step = time.perf_counter(), done
                    if stopping:
                        raise TrainingInterrupted(stop["signum"] or signal.SIGTERM, done, ckpt.directory)
        except jax.errors.JaxRuntimeError as err:
            if (gone := peer_gone(err)) is None:
                raise
            ckpt.abandon()  # a save in flight waits for the gone process
            raise gone from err
        finally:
            batches.close()  # a Grain iterator stops its read threads (a generator just ends)
            if bar is not None:
                bar.close()
            log.close()
            ckpt.wait()
        return record
