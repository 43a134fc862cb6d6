"""Optimizers: factories from config (and, later, 1-bit Adam and compressed collectives)."""

from jaxspeed.optim.factory import build_optimizer, make_optimizer, make_schedule

__all__ = ["build_optimizer", "make_optimizer", "make_schedule"]
