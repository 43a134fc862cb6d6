"""Old import paths of modules that moved into packages, kept working for one release.

`import jaxspeed.engine` (or `from jaxspeed.engine import initialize`) still works: it warns
with a `DeprecationWarning` naming the new path and binds the old name to the new module
itself, so patching either name patches the same object.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

#: old module → where it lives now (0.x; the old names go in the next release).
MOVED: dict[str, str] = {
    "jaxspeed.adapters": "jaxspeed.train.adapters",
    "jaxspeed.engine": "jaxspeed.train.engine",
    "jaxspeed.train_step": "jaxspeed.train.step",
    "jaxspeed.train_loop": "jaxspeed.train.loop",
    "jaxspeed.onebit_step": "jaxspeed.train.onebit_step",
    "jaxspeed.metrics_log": "jaxspeed.train.metrics_log",
    "jaxspeed.matmul": "jaxspeed.ops.matmul",
    "jaxspeed.precision": "jaxspeed.ops.precision",
    "jaxspeed.offload": "jaxspeed.ops.offload",
    "jaxspeed.remat": "jaxspeed.ops.remat",
    "jaxspeed.losses": "jaxspeed.ops.losses",
    "jaxspeed.mesh": "jaxspeed.runtime.mesh",
    "jaxspeed.distributed": "jaxspeed.runtime.distributed",
    "jaxspeed.launch": "jaxspeed.runtime.launch",
    "jaxspeed.host_allocator": "jaxspeed.runtime.host_allocator",
    "jaxspeed.grain_data": "jaxspeed.data.grain_loader",
    "jaxspeed.token_files": "jaxspeed.data.token_files",
    "jaxspeed.text_tokens": "jaxspeed.data.text_tokens",
    "jaxspeed.packing": "jaxspeed.data.packing",
    "jaxspeed.params_checkpoint": "jaxspeed.checkpoint.params",
    "jaxspeed.export": "jaxspeed.checkpoint.export",
    "jaxspeed.direct_io": "jaxspeed.checkpoint.direct_io",
    "jaxspeed.hf": "jaxspeed.checkpoint.hf",
    "jaxspeed.profiler": "jaxspeed.cost",  # its names, from cost.hlo, .flops and .peaks
    "jaxspeed.memory": "jaxspeed.cost.memory",
    "jaxspeed.fit": "jaxspeed.cost.fit",
    "jaxspeed.plan_report": "jaxspeed.cost.report",
    "jaxspeed.sampling": "jaxspeed.models.sampling",
    "jaxspeed.autoplan.cluster": "jaxspeed.config.cluster",
    # the link model, below autoplan now so that moe.strategies prices with it downward
    "jaxspeed.autoplan.gloo": "jaxspeed.network.gloo",
    "jaxspeed.autoplan.placement": "jaxspeed.network.placement",
    # a ZeRO package: the explicit ZeRO-3 step and its collectives (issue 60's names)
    "jaxspeed.sharding.zero_collectives": "jaxspeed.zero.collectives",
    "jaxspeed.sharding.zero_comm": "jaxspeed.zero.comm",
    "jaxspeed.sharding.zero_layout": "jaxspeed.zero.layout",
    "jaxspeed.train.zero_step": "jaxspeed.zero.step",
    # names that say what the module holds
    "jaxspeed.pipeline.model": "jaxspeed.pipeline.gpt_stages",
    "jaxspeed.autoplan.report": "jaxspeed.autoplan.plans_table",
    "jaxspeed.cost.report": "jaxspeed.cost.plan_table",
    # the kernels' backend check, public now (it was private, but five jaxspeed packages used it)
    "pallas_kernels._backend": "pallas_kernels.backend",
}


def new_name(old: str) -> str | None:
    """Where module `old` lives now (also for submodules of a moved package), or None."""
    for before, after in MOVED.items():
        if old == before or old.startswith(before + "."):
            return after + old[len(before):]
    return None


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old names; loading one imports the new module and returns it as is."""

    def find_spec(self, fullname, path=None, target=None):
        if new_name(fullname) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec) -> types.ModuleType:
        new = new_name(spec.name)
        warnings.warn(
            f"{spec.name} moved to {new}; the old path goes in the next release",
            DeprecationWarning, stacklevel=3,
        )
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        pass  # the new module ran when it was imported


def install() -> None:
    """Adds the alias finder to `sys.meta_path` (once)."""
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Alias())  # before the path finder, which would load copies
