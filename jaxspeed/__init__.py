"""jaxspeed: JAX/XLA-native parallel training; every parallelism is a sharding XLA compiles."""

from jaxspeed import attention, distributed, export, moe, optim, pipeline, sharding
from jaxspeed.config import Config, load_config
from jaxspeed.engine import Engine, initialize
from jaxspeed.errors import ConfigError, JaxspeedError
from jaxspeed.mesh import make_mesh
from jaxspeed.sharding import Plan, plan_sharding
from jaxspeed.train_step import TrainState

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
