"""Where a run's metrics go: `metrics.jsonl` (one JSON object per logged step) and TensorBoard."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


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

    def write(self, record: dict[str, Any]) -> None:
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
