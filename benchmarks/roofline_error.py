"""The roofline step-time predictor (`jaxspeed plan --target`) against the steps measured on an
H200: `gpu_engine`'s 150M GPT in fp32 (194.91 ms/step) and `gpu_offload`'s 1.21B GPT in its
device mode (0.268 s/step), both from benchmarks/README.md.

Each step is compiled as its benchmark builds it, by XLA:GPU for one H200 without a GPU
(the gpu-compile extra; without it this says so in one line and exits 0), and priced at the
raw roofline (matmuls at 100% of peak) and at the calibrated one
(`jaxspeed.cost.roofline.MATMUL_EFFICIENCY`). Prints a table and one JSON line per case; the
last is the 1.21B step. ratio = measured / predicted (1.0: exact; above 1: the prediction is
too fast). Run from the repository root: `python benchmarks/roofline_error.py`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE)]
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import _common  # noqa: E402

NAME = "roofline_error"
TARGET = "h200"
#: (case, measured seconds per step on an H200, benchmarks/README.md)
MEASURED = {"gpu_engine overhead 150M fp32": 0.19491, "gpu_offload device 1.21B bf16": 0.268}


def configs() -> dict:
    """The two measured steps' configs, as their benchmarks build them."""
    import gpu_engine
    import gpu_offload
    import overhead

    return {"gpu_engine overhead 150M fp32": overhead.bench_config(gpu_engine.GPU_CASE["overhead"]),
            "gpu_offload device 1.21B bf16": gpu_offload.bench_config("device", gpu_offload.FULL_MODEL)}


def main() -> int:
    from jaxspeed.cost.roofline import MATMUL_EFFICIENCY
    from jaxspeed.gpu import deviceless

    if deviceless.missing():
        print(f"roofline_error: skipped: {deviceless.missing()}")
        return 0
    rows, results = [], []
    for case, config in configs().items():
        raw = _common.predict_deviceless(config, TARGET, efficiency=1.0)
        calibrated = _common.predict_deviceless(config, TARGET)
        measured = MEASURED[case]
        errors = {name: p["predicted_step_seconds"] / measured - 1
                  for name, p in (("raw", raw), ("calibrated", calibrated))}
        rows.append([case, raw["predicted_step_seconds"] * 1e3, f"{errors['raw']:+.1%}",
                     calibrated["predicted_step_seconds"] * 1e3, f"{errors['calibrated']:+.1%}",
                     measured * 1e3])
        results.append(_common.result(
            NAME, case=f"{case} on {TARGET}", jaxspeed=calibrated["predicted_step_seconds"] * 1e3,
            baseline=measured * 1e3, unit="ms/step predicted vs measured",
            ratio=_common.ratio(measured, calibrated["predicted_step_seconds"]),
            raw_ms=raw["predicted_step_seconds"] * 1e3, error_raw=round(errors["raw"], 4),
            error_calibrated=round(errors["calibrated"], 4), matmul_efficiency=MATMUL_EFFICIENCY,
            seconds_by_bound=calibrated["seconds_by_bound"]))
    _common.print_table(["case", "raw ms", "raw error", "calibrated ms", "calibrated error",
                         "measured ms"], rows)
    for r in results:
        _common.print_json(r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
