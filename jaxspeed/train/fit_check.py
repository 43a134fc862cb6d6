"""Will an engine's plan fit? `cost.fit.check_fit` with the compiles it needs: the engine's own
step, and each suggested change's, built through `initialize` on the engine's mesh."""

from __future__ import annotations

from jaxspeed.config import Config
from jaxspeed.cost.fit import Verdict, check_fit
from jaxspeed.cost.memory import MemoryReport
from jaxspeed.train.engine import Engine, initialize


def _device_bytes(report: MemoryReport) -> tuple[int, str]:
    return report["per_device_bytes"]["device"], report["sources"]["device"]


def compiled_device_bytes(config: Config, *, mesh=None) -> int:
    """Per-device device bytes of the reference GPT's compiled train step under `config`."""
    return _device_bytes(initialize(config, mesh=mesh).memory_report())[0]


def engine_verdict(engine: Engine, budget: int, *, suggest: bool = True) -> Verdict:
    """`check_fit` for an engine of the reference GPT; suggestions compile on its mesh."""
    report = engine.memory_report()

    def device_bytes(config: Config) -> tuple[int, str]:
        if config is engine.config:
            return _device_bytes(report)
        return _device_bytes(initialize(config, mesh=engine.mesh).memory_report())

    return check_fit(
        engine.config, budget, batch=engine.batch_sizes, device_bytes=device_bytes, suggest=suggest
    )
