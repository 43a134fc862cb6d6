"""The sharding planner: logical axes + ZeRO stage → a `NamedSharding` for every piece of state."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspeed.runtime.mesh import SEQUENCE, ZERO_AXES, data_parallel_size
from jaxspeed.ops.offload import DEVICE, HOST
from jaxspeed.sharding.explain import explain_plan
from jaxspeed.sharding.leaves import LeafPlan, Logical, flatten_leaf_plans, leaf_bytes
from jaxspeed.sharding.rules import ACTIVATION_ONLY_AXES, DEFAULT_RULES, Rules, logical_to_spec
from jaxspeed.sharding.zero import HOST_MAJOR_AXES, zero_spec
from jaxspeed.tree_paths import key_names


def _is_logical_leaf(x) -> bool:
    return x is None or isinstance(x, (tuple, P))


def path_str(path) -> str:
    """'layers/mlp/wi' for a key path; NNX's trailing `.value` is dropped."""
    if len(path) > 1 and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
        path = path[:-1]
    return jax.tree_util.keystr(path, simple=True, separator="/")


@dataclasses.dataclass(frozen=True)
class Plan:
    """Shardings for params, gradients and optimizer state under one ZeRO stage.

    `leaves` is a pytree with the structure of the params and a `LeafPlan` at each leaf.
    `param_memory` / `opt_memory` are the memory kinds the stored params and optimizer state
    live in between steps: "device", or "pinned_host" when offloaded (ZeRO-Offload).
    """

    mesh: Mesh
    stage: int
    rules: Rules
    leaves: Any
    param_memory: str = DEVICE
    opt_memory: str = DEVICE

    def _shardings(self, field: str, memory_kind: str = DEVICE):
        return jax.tree.map(
            lambda leaf: NamedSharding(self.mesh, getattr(leaf, field), memory_kind=memory_kind),
            self.leaves,
            is_leaf=lambda x: isinstance(x, LeafPlan),
        )

    @property
    def params(self):
        """Pytree of `NamedSharding` for the stored (master) parameters, in `param_memory`."""
        return self._shardings("param", self.param_memory)

    @property
    def params_on_device(self):
        """The stored params' shardings in device memory: where the step computes with them."""
        return self._shardings("param")

    @property
    def params_gathered(self):
        """The params' shardings in device memory with ZeRO's partition undone (`gathered`)."""
        return self._shardings("gathered")

    @property
    def grads(self):
        """Pytree of `NamedSharding` the gradients are constrained to."""
        return self._shardings("grad")

    @property
    def opt(self):
        """Pytree of `NamedSharding` for one param-shaped copy of optimizer state, on device."""
        return self._shardings("opt")

    @property
    def param_count(self) -> int:
        """The number of parameters the plan places."""
        return sum(math.prod(leaf.shape) for _, leaf in flatten_leaf_plans(self.leaves))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def batch_sharding(self, ndim: int = 2) -> NamedSharding:
        """Sharding of a batch array: rows over the data-parallel axes and, for `[batch,
        length, ...]` arrays, positions over the sequence axis (each device gets its slice)."""
        logical = ("batch", "length", *(None,) * (ndim - 2))[:ndim]
        shape = (self.data_parallel_size, self.sequence_size) + (1,) * (ndim - 2)
        spec, _ = logical_to_spec(logical, shape[:ndim], self.mesh.shape, self.rules)
        return NamedSharding(self.mesh, spec)

    def micro_batch_sharding(self, ndim: int) -> NamedSharding:
        """Sharding of a batch array of rank `ndim` split into micro-batches (leading axis):
        each micro-batch as `batch_sharding`."""
        return NamedSharding(self.mesh, P(None, *self.batch_sharding(ndim - 1).spec))

    @property
    def sequence_size(self) -> int:
        return self.mesh.shape.get(SEQUENCE, 1)

    @property
    def data_parallel_size(self) -> int:
        return data_parallel_size(self.mesh)

    def opt_state_shardings(self, opt_state, *, memory_kind: str | None = None):
        """Shardings for an optimizer state (arrays or `ShapeDtypeStruct`s).

        They are in `opt_memory` (where the state is stored), or in `memory_kind` when given.

        A state leaf whose key path ends with a parameter's path and has its shape (Adam's
        `mu`/`nu`, momentum, ...) gets that parameter's optimizer-state spec. Any other array
        (factored second moments, counters) gets the ZeRO spec its own shape allows.
        """
        by_path = {key_names(path): leaf for path, leaf in flatten_leaf_plans(self.leaves)}
        kind = memory_kind or self.opt_memory

        def choose(path, x):
            keys = key_names(path)
            for start in range(len(keys)):
                leaf = by_path.get(keys[start:])
                if leaf is not None and tuple(x.shape) == leaf.shape:
                    return NamedSharding(self.mesh, leaf.opt, memory_kind=kind)
            spec = P()
            if self.stage > 0 and x.shape:
                spec, _ = zero_spec(P(), x.shape, self.mesh.shape)
            return NamedSharding(self.mesh, spec, memory_kind=kind)

        return jax.tree.map_with_path(choose, opt_state)

    def bytes_per_device(self, field: str) -> int:
        """Per-device bytes of one param-shaped tree stored with the `field` spec."""
        return sum(leaf_bytes(self.mesh, leaf, field) for _, leaf in flatten_leaf_plans(self.leaves))

    def explain(self) -> str:
        """A table: each parameter, its shape, specs for params / grads / opt state, bytes/device."""
        return explain_plan(self)


def plan_sharding(
    abstract_params,
    logical_axes,
    mesh: Mesh,
    *,
    stage: int = 0,
    rules: Rules = DEFAULT_RULES,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    explicit_zero3: bool = False,
    host_major: bool = False,
) -> Plan:
    """Plans the sharding of params, gradients and optimizer state.

    Args:
      abstract_params: pytree of arrays or `ShapeDtypeStruct`s.
      logical_axes: pytree with the params' structure holding, per leaf, a tuple of logical
        axis names (or a `PartitionSpec` of them, or None), or a function
        `(path, leaf) -> names` for plain pytrees.
      mesh: the device mesh.
      stage: ZeRO stage 0–3.
      rules: ordered logical-axis rules.
      offload_optimizer: keep the optimizer state in `pinned_host` memory between steps.
      offload_params: keep the (stage-3 sharded) params in `pinned_host` memory too.
      explicit_zero3: the explicit ZeRO-3 step runs (`jaxspeed.zero.step`): ZeRO keeps
        off the dimensions a model axis splits (`zero_spec`'s `beside`).
      host_major: ZeRO's shards host-major (`HOST_MAJOR_AXES`), else data-major.

    Returns:
      A `Plan`.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    if offload_params and stage != 3:
        raise ValueError(
            f"offload_params needs ZeRO stage 3 (params sharded before they leave the device), "
            f"got stage {stage}"
        )
    flat, treedef = jax.tree.flatten_with_path(abstract_params)
    if callable(logical_axes):
        names = [logical_axes(path, leaf) for path, leaf in flat]
    else:
        names = treedef.flatten_up_to(logical_axes) if logical_axes is not None else [None] * len(flat)
    leaves = [
        _plan_leaf(path, leaf, _as_names(name), mesh, stage, rules, explicit_zero3,
                   host_major)
        for (path, leaf), name in zip(flat, names)
    ]
    return Plan(
        mesh=mesh,
        stage=stage,
        rules=tuple(rules),
        leaves=treedef.unflatten(leaves),
        param_memory=HOST if offload_params else DEVICE,
        opt_memory=HOST if offload_optimizer else DEVICE,
    )


def _as_names(logical) -> Logical:
    if logical is None:
        return None
    return tuple(logical)


def _plan_leaf(path, leaf, logical: Logical, mesh: Mesh, stage: int, rules: Rules,
               explicit_zero3: bool, host_major: bool) -> LeafPlan:
    shape = tuple(leaf.shape)
    param_axes = {**mesh.shape, **{axis: 1 for axis in ACTIVATION_ONLY_AXES}}
    base, notes = logical_to_spec(logical, shape, param_axes, rules)
    sharded, note = zero_spec(base, shape, mesh.shape, logical=logical,
                              dp_axes=HOST_MAJOR_AXES if host_major else ZERO_AXES,
                              beside=not explicit_zero3)
    if note and stage > 0:
        notes.append(note)
    return LeafPlan(
        path=path_str(path),
        shape=shape,
        dtype=np.dtype(leaf.dtype),
        logical=logical,
        param=sharded if stage >= 3 else base,
        grad=sharded if stage >= 2 else base,
        opt=sharded if stage >= 1 else base,
        notes=tuple(notes),
        gathered=base,
    )

