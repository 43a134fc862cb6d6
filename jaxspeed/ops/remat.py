"""Activation-checkpointing policies by name (`activation_checkpointing.policy`).

| policy | saved for the backward pass |
|---|---|
| `none` | everything (no `jax.checkpoint`) |
| `full` | nothing: the whole layer is recomputed |
| `dots_saveable` | every matmul output |
| `dots_with_no_batch_dims_saveable` | matmul outputs without dot batch dims (projections, not attention scores) |
| `offload_dots` | the same matmuls, moved to `pinned_host` memory and back for the backward pass |
| `names` | only the `checkpoint_name`-tagged values listed in `activation_checkpointing.names` |
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from jaxspeed.errors import ConfigError
from jaxspeed.ops.offload import DEVICE, HOST

POLICIES = (
    "none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable", "offload_dots", "names"
)


def checkpoint_policy(
    name: str, names: Sequence[str] = (), *, known_names: Sequence[str] | None = None
) -> Any:
    """The `jax.checkpoint` policy for a policy name (`full` → None: save nothing).

    Args:
      name: one of `POLICIES` other than "none".
      names: for `names`, the `jax.ad_checkpoint.checkpoint_name` tags to save.
      known_names: the tags the model defines; `names` outside it are an error.
    """
    policies = jax.checkpoint_policies
    if name == "full":
        return None
    if name == "dots_saveable":
        return policies.dots_saveable
    if name == "dots_with_no_batch_dims_saveable":
        return policies.dots_with_no_batch_dims_saveable
    if name == "offload_dots":
        return policies.offload_dot_with_no_batch_dims(DEVICE, HOST)
    if name == "names":
        unknown = sorted(set(names) - set(known_names)) if known_names is not None else []
        if not names or unknown:
            raise ConfigError(
                f"activation_checkpointing.names: got {list(names)}; accepted names are "
                f"{list(known_names or [])} (at least one)"
            )
        return policies.save_only_these_names(*names)
    raise ConfigError(
        f"activation_checkpointing.policy: got {name!r}; accepted values are {list(POLICIES)}"
    )
