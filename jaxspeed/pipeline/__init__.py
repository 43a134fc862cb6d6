"""Pipeline parallelism over the `pipe` mesh axis: GPipe, 1F1B and interleaved, one SPMD program."""

from jaxspeed.pipeline.schedules import bubble_fraction, schedule_table
from jaxspeed.pipeline.spmd import spmd_pipeline

__all__ = ["bubble_fraction", "schedule_table", "spmd_pipeline"]
