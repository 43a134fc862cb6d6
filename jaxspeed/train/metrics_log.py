"""Where a run's metrics go: `metrics.jsonl` (one JSON object per logged step, a
`TrainRecord`) and TensorBoard; the rates a record carries (`Throughput`)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, Required, TypedDict

from jaxspeed.cost.flops import model_train_flops
from jaxspeed.cost.peaks import mfu, peak_flops

if TYPE_CHECKING:
    from jaxspeed.train.engine import Engine


class TrainRecord(TypedDict, total=False):
    """One logged step of `jaxspeed train` (a line of `metrics.jsonl`; `train()` returns the last).

    FLOP rates count matmul FLOPs. *Model* FLOPs are what the model needs per token, whatever the
    implementation (`jaxspeed.cost.flops.model_train_flops`: 6·N plus causal attention); the
    *hardware* FLOPs are what the compiled step runs, rematerialised forward passes included
    (`Engine.step_flops`).

    Besides these keys, a record holds the objective's extra metrics (e.g. `aux_loss` of a MoE).
    """

    #: optimizer steps done
    step: Required[int]
    #: mean train loss of the step's global batch
    loss: float
    #: learning rate used by the step
    lr: float
    #: global gradient norm (before clipping)
    grad_norm: float
    #: train tokens per second since the previous record (all devices)
    tokens_per_second: float
    #: achieved *model* TFLOP/s per device (so `mfu = tflops_per_device / peak`)
    tflops_per_device: float
    #: model FLOPs utilisation: model FLOP/s per device over the device's peak (peak known only)
    mfu: NotRequired[float]
    #: hardware FLOPs utilisation: the compiled step's FLOP/s per device over the peak; above
    #: `mfu` by the recomputed forward under remat
    hfu: NotRequired[float]
    #: the largest attention logit of the step (`optimizer.params.qk_clip` set: QK-clip's
    #: statistic, before the clip)
    attn_logit_max: NotRequired[float]
    #: the digest of every global batch trained on up to this step, in order (16 hex digits,
    #: `jaxspeed.data.sample_digest`): equal in runs that trained on the same samples in the same
    #: order, on any number of processes, and across a resume
    sample_digest: str
    #: mean held-out loss (every `logging.eval_every_n_steps`)
    eval_loss: NotRequired[float]
    #: fp16: the dynamic loss scale, and 1 when the step was skipped (non-finite gradients)
    loss_scale: NotRequired[float]
    skipped: NotRequired[int]


class MetricsLog:
    """Appends metrics to `DIR/metrics.jsonl` and, if asked, TensorBoard events in `DIR/tb`.

    Only process 0 writes. Non-finite floats are written as strings ("nan", "inf") so each
    line stays valid JSON.

    Args:
      start_step: the step the run starts from (its checkpoint's; 0 for a fresh start). The
        records of later steps, logged by an earlier run that stopped before it saved them,
        are dropped (`drop_records_after`) and hidden from TensorBoard (`purge_step`), because
        this run logs those steps again.
    """

    def __init__(self, out_dir: str | Path, *, tensorboard: bool = False, enabled: bool = True,
                 start_step: int = 0):
        self.enabled = enabled
        self.path = Path(out_dir) / "metrics.jsonl"
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        drop_records_after(self.path, start_step)
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(Path(out_dir) / "tb"), purge_step=start_step + 1)

    def write(self, record: TrainRecord | dict[str, Any]) -> None:
        if not self.enabled:
            return
        line = {k: _jsonable(v) for k, v in record.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")
        if self._tb is not None:
            step = int(record["step"])
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def _jsonable(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def drop_records_after(path: Path, step: int) -> int:
    """Rewrites the metrics file `path` without the records of steps after `step`, and without
    lines cut short by a crash; returns how many lines it dropped.

    A run that crashed after its last checkpoint logged steps that its resume trains and logs
    again. Dropping them, rather than appending a resume marker, keeps `metrics.jsonl` one
    record per step in step order, as if the run had never stopped: what a plot of it, a
    `grep`, `last_record` and the benchmarks that read it (`benchmarks/throughput.py`,
    `gpu_mfu.py`, `_link_jobs.py`) expect, none of which would know to skip a marker's
    duplicates. What is lost is only the first attempt's figures for steps whose results the
    crash lost too; the resumed run recomputes the same losses (bit-for-bit on CPU).

    The file is replaced atomically (a temporary file renamed over it), so a crash here leaves
    the old file or the new one, never a half-written one.
    """
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if _kept(line, step)]
    if len(kept) == len(lines):
        return 0
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(lines) - len(kept)


def _kept(line: str, step: int) -> bool:
    """Whether a line of metrics.jsonl stays when a run resumes at `step`."""
    if not line.endswith("\n"):  # the last line, cut short by a crash
        return False
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return False
    logged = record.get("step") if isinstance(record, dict) else None
    return not (isinstance(logged, int) and logged > step)


def last_record(out_dir: str | Path, *, step: int | None = None) -> TrainRecord | None:
    """The last record of `DIR/metrics.jsonl` (the last one at `step`, when given), or None."""
    path = Path(out_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    for line in reversed(path.read_text().splitlines()):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a crash
            continue
        if isinstance(record, dict) and (step is None or record.get("step") == step):
            return record
    return None


class Throughput:
    """tokens/s, model TFLOP/s per device, and MFU and HFU when the device's peak is known.

    Model FLOPs: `model_train_flops` of the reference GPT (`train` always runs it);
    hardware FLOPs: the step's traced matmuls, remat's recomputed forward included.
    """

    def __init__(self, engine: Engine, tokens_per_step: int):
        config = engine.config
        self.tokens_per_step = tokens_per_step
        model_flops = model_train_flops(config.model, tokens=tokens_per_step,
                                        seq_len=config.data.seq_len, param_count=engine.param_count)
        self.model_flops_per_device = model_flops / engine.mesh.size
        self.hardware_flops_per_device = engine.step_flops() / engine.mesh.size
        device = engine.mesh.devices.flat[0]
        self.peak = peak_flops(device.device_kind, config.hardware.peak_tflops)

    def record(self, steps: int, seconds: float) -> dict[str, float]:
        out = {
            "tokens_per_second": self.tokens_per_step * steps / seconds,
            "tflops_per_device": self.model_flops_per_device * steps / seconds / 1e12,
        }
        pairs = (("mfu", self.model_flops_per_device), ("hfu", self.hardware_flops_per_device))
        for key, flops in pairs:
            utilisation = mfu(flops * steps, seconds, self.peak)
            if utilisation is not None:
                out[key] = utilisation
        return out
