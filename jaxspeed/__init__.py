"""jaxspeed: JAX/XLA-native parallel training; every parallelism is a sharding XLA compiles.

The public API is `__all__`, listed and described in the README's "Public API" section
(`tests/test_public_api.py` keeps the two equal). Everything else is an implementation detail.
Importing jaxspeed changes nothing global: the host allocator is the caller's choice
(`keep_freed_memory`).
"""

import importlib
import warnings

from jaxspeed import _moved

_moved.install()

#: Public name -> the module it lives in (a name that is itself a module maps to None). Resolved
#: on first use, so `import jaxspeed` (and the `jaxspeed` command before its flags are read, when
#: Ctrl-C must already be one clean line) does not import JAX.
_PUBLIC = {
    "Config": "jaxspeed.config", "load_config": "jaxspeed.config",
    "initialize": "jaxspeed.train", "Engine": "jaxspeed.train", "TrainState": "jaxspeed.train",
    "train_model": "jaxspeed.train.loop", "TrainRecord": "jaxspeed.train.metrics_log",
    "MemoryReport": "jaxspeed.cost.memory", "ProfileReport": "jaxspeed.cost.plan_table",
    "Checkpointer": "jaxspeed.checkpoint", "CheckpointError": "jaxspeed.checkpoint",
    "export_params": "jaxspeed.checkpoint.export",
    "export_hf": "jaxspeed.checkpoint.hf", "import_hf": "jaxspeed.checkpoint.hf",
    "GPT": "jaxspeed.models", "build_gpt": "jaxspeed.models",
    "Codec": "jaxspeed.models.sampling", "sample_text": "jaxspeed.models.sampling",
    "sample_tokens": "jaxspeed.models.sampling",
    "make_mesh": "jaxspeed.runtime.mesh", "plan_sharding": "jaxspeed.sharding", "Plan": "jaxspeed.sharding",
    "keep_freed_memory": "jaxspeed.runtime.host_allocator",
    "JaxspeedError": "jaxspeed.errors", "ConfigError": "jaxspeed.errors",
    "DoesNotFit": "jaxspeed.cost.fit",
    "NonFiniteLoss": "jaxspeed.train.loop", "TrainingInterrupted": "jaxspeed.train.loop",
    "distributed": None, "attention": None, "moe": None, "optim": None, "pipeline": None,
    "sharding": None,
}
_ALIASES = {"train_model": "train"}  # the loop's `train`: `jaxspeed.train` is the package

#: Public names that were modules before: `js.export` was `jaxspeed.checkpoint.export`.
_RENAMED = {"export": ("jaxspeed.checkpoint.export", "jaxspeed.export_params")}


def __getattr__(name: str):
    """The public names, imported on first use; `js.mesh`, `js.engine`, `js.export`, ...: a
    moved module under its old name, for one release, with a `DeprecationWarning`."""
    if name in _PUBLIC:
        module = _PUBLIC[name]
        if module is None:
            value = importlib.import_module("jaxspeed.runtime.distributed" if name == "distributed"
                                            else f"jaxspeed.{name}")
        else:
            value = getattr(importlib.import_module(module), _ALIASES.get(name, name))
        globals()[name] = value
        return value
    if name in _RENAMED:
        module, instead = _RENAMED[name]
        warnings.warn(f"jaxspeed.{name} is the module {module}; use {instead}, or import "
                      f"{module}. The old name goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(module)
    if f"jaxspeed.{name}" in _moved.MOVED:
        return importlib.import_module(f"jaxspeed.{name}")
    raise AttributeError(f"module 'jaxspeed' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    # configs and training
    "Config",
    "load_config",
    "initialize",
    "Engine",
    "TrainState",
    "train_model",
    "TrainRecord",
    "MemoryReport",
    "ProfileReport",
    # checkpoints and interchange
    "Checkpointer",
    "export_params",
    "export_hf",
    "import_hf",
    # the reference model and sampling
    "GPT",
    "build_gpt",
    "Codec",
    "sample_text",
    "sample_tokens",
    # sharding and devices
    "make_mesh",
    "plan_sharding",
    "Plan",
    "distributed",
    "keep_freed_memory",
    # building blocks, each a package of its own
    "attention",
    "moe",
    "optim",
    "pipeline",
    "sharding",
    # errors
    "JaxspeedError",
    "ConfigError",
    "CheckpointError",
    "DoesNotFit",
    "NonFiniteLoss",
    "TrainingInterrupted",
]
