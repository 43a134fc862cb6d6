"""Optimizers: factories from config, and 1-bit Adam with its compressed all-reduce."""

from jaxspeed.optim.compressed import compressed_allreduce
from jaxspeed.optim.factory import build_optimizer, make_optimizer, make_schedule
from jaxspeed.optim.onebit import OneBitAdamState, onebit_adam

__all__ = [
    "OneBitAdamState",
    "build_optimizer",
    "compressed_allreduce",
    "make_optimizer",
    "make_schedule",
    "onebit_adam",
]
