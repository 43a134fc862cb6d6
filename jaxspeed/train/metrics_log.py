"""Where a run's metrics go: `metrics.jsonl` (one JSON object per logged step, a
`TrainRecord`) and TensorBoard."""

import json
import math
from pathlib import Path
from typing import Any, NotRequired, Required, TypedDict


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
    #: mean held-out loss (every `logging.eval_every_n_steps`)
    eval_loss: NotRequired[float]
    #: fp16: the dynamic loss scale, and 1 when the step was skipped (non-finite gradients)
    loss_scale: NotRequired[float]
    skipped: NotRequired[int]


class MetricsLog:
    """Appends metrics to `DIR/metrics.jsonl` and, if asked, TensorBoard events in `DIR/tb`.

    Only process 0 writes. Non-finite floats are written as strings ("nan", "inf") so each
    line stays valid JSON.
    """

    def __init__(self, out_dir: str | Path, *, tensorboard: bool = False, enabled: bool = True):
        self.enabled = enabled
        self.path = Path(out_dir) / "metrics.jsonl"
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(Path(out_dir) / "tb"))

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
