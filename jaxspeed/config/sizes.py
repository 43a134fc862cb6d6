"""The batch-size triple (`resolve_batch`)."""

from __future__ import annotations

from typing import NamedTuple

from jaxspeed.config.schema import Config
from jaxspeed.errors import ConfigError


class BatchSizes(NamedTuple):
    """Resolved batch sizes: `train_batch_size == micro_batch_per_device × accumulation × dp`."""

    train_batch_size: int
    micro_batch_per_device: int
    accumulation_steps: int


def resolve_batch(config: Config, dp_size: int) -> BatchSizes:
    """Checks the batch-size triple against the data-parallel size and fills in what is missing.

    Missing members are derived from the given ones; when two or three are missing, accumulation
    defaults to 1 and then the micro batch to 1. With pipeline parallelism (`mesh.pipe > 1`)
    the pipeline's microbatches are the accumulation steps (as in DeepSpeed's pipeline
    engine): `gradient_accumulation_steps` defaults to `pipeline.num_microbatches` and must
    equal it when both are given.

    Args:
      config: the run config.
      dp_size: data-parallel replicas (the `data` × `expert` mesh axes).

    Returns:
      `BatchSizes(train_batch_size, micro_batch_per_device, accumulation_steps)`.

    Raises:
      ConfigError: the sizes do not fit together, with the numbers.
    """
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ConfigError(f"data-parallel size must be a positive int, got {dp_size!r}")
    total = config.train_batch_size
    micro = config.train_micro_batch_size_per_device
    accum = config.gradient_accumulation_steps
    if config.mesh.pipe > 1:
        stages_micro = config.pipeline.num_microbatches
        if accum is not None and accum != stages_micro:
            raise ConfigError(
                f"gradient_accumulation_steps={accum} differs from pipeline.num_microbatches="
                f"{stages_micro}; with mesh.pipe > 1 the pipeline's microbatches are the "
                f"accumulation steps: leave gradient_accumulation_steps out or make them equal"
            )
        accum = stages_micro
    if total is None:
        micro, accum = micro or 1, accum or 1
        return BatchSizes(micro * accum * dp_size, micro, accum)
    if micro is None and accum is None:
        accum = 1
    if micro is None:
        micro = _divide(total, accum * dp_size, f"gradient_accumulation_steps {accum}", dp_size)
    elif accum is None:
        accum = _divide(total, micro * dp_size, f"micro {micro}", dp_size)
    elif total != micro * accum * dp_size:
        raise ConfigError(
            f"train_batch_size={total} does not equal micro {micro} × gradient_accumulation_steps "
            f"{accum} × data-parallel size {dp_size} = {micro * accum * dp_size}"
        )
    return BatchSizes(total, micro, accum)


def _divide(total: int, divisor: int, factor: str, dp_size: int) -> int:
    if total % divisor:
        raise ConfigError(
            f"train_batch_size={total} is not divisible by {factor} × data-parallel size "
            f"{dp_size} (= {divisor}); make train_batch_size a multiple of {divisor}"
        )
    return total // divisor
