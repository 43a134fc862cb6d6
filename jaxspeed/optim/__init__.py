"""Optimizers: factories from config, 1-bit Adam, 0/1 Adam and 1-bit LAMB with their compressed
all-reduce, LAMB, and Muon with QK-clip."""

from jaxspeed.optim.compressed import compressed_allreduce
from jaxspeed.optim.factory import build_optimizer, make_optimizer, make_schedule
from jaxspeed.optim.lamb import lamb
from jaxspeed.optim.muon import muon
from jaxspeed.optim.onebit import OneBitAdamState, onebit_adam
from jaxspeed.optim.onebit_lamb import OneBitLambState, onebit_lamb
from jaxspeed.optim.qk_clip import qk_clip
from jaxspeed.optim.zero_one_adam import ZeroOneAdamState, worker_params, zero_one_adam

__all__ = [
    "OneBitAdamState",
    "OneBitLambState",
    "ZeroOneAdamState",
    "build_optimizer",
    "compressed_allreduce",
    "lamb",
    "make_optimizer",
    "make_schedule",
    "muon",
    "onebit_adam",
    "onebit_lamb",
    "qk_clip",
    "worker_params",
    "zero_one_adam",
]
