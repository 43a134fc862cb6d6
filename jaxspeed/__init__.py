"""jaxspeed: JAX/XLA-native parallel training; every parallelism is a sharding XLA compiles."""

import importlib

from jaxspeed import _moved

_moved.install()

from jaxspeed import attention, moe, optim, pipeline, sharding  # noqa: E402
from jaxspeed.checkpoint import export  # noqa: E402
from jaxspeed.config import Config, load_config  # noqa: E402
from jaxspeed.errors import ConfigError, JaxspeedError  # noqa: E402
from jaxspeed.runtime import distributed  # noqa: E402
from jaxspeed.runtime.mesh import make_mesh  # noqa: E402
from jaxspeed.sharding import Plan, plan_sharding  # noqa: E402
from jaxspeed.train import Engine, TrainState, initialize  # noqa: E402


def __getattr__(name: str):
    """`js.mesh`, `js.engine`, ...: a moved module under its old name, for one release."""
    if f"jaxspeed.{name}" in _moved.MOVED:
        return importlib.import_module(f"jaxspeed.{name}")
    raise AttributeError(f"module 'jaxspeed' has no attribute {name!r}")


__all__ = [
    "Config",
    "ConfigError",
    "Engine",
    "JaxspeedError",
    "Plan",
    "TrainState",
    "attention",
    "distributed",
    "export",
    "initialize",
    "load_config",
    "make_mesh",
    "moe",
    "optim",
    "pipeline",
    "plan_sharding",
    "sharding",
]
