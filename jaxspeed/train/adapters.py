"""One functional view of a model: Flax Linen, Flax NNX, or a plain apply function + pytree.

The engine only sees `ModelFns`: how to make params, how to apply them, and the logical axis
names of each parameter (from Flax's partitioning metadata).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import flax.core
from flax import nnx

from jaxspeed.errors import JaxspeedError
from jaxspeed.ops.fp8 import META
from jaxspeed.ops.losses import (AUX_LOSS, LOGIT_MAX, STEP_METRICS, logit_maxima, step_metrics,
                                 total_aux_loss)
from jaxspeed.tree_paths import key_names


#: Per-token batch entries `[batch, length]` passed to the model as keyword arguments:
#: packed sequences' document ids (attention stays within a document) and positions.
TOKEN_FEATURES = ("segment_ids", "positions")


def token_features(batch) -> dict[str, Any]:
    """The `TOKEN_FEATURES` a batch has."""
    return {name: batch[name] for name in TOKEN_FEATURES if name in batch}


class ModelFns(NamedTuple):
    """A model as pure functions.

    Attributes:
      abstract_params: pytree of `ShapeDtypeStruct`, the parameter structure.
      logical_axes: pytree like the params of logical-name tuples (or None), or a function
        `(path, leaf) -> names`.
      apply: `(params, inputs, rng, train, **features) -> (outputs, aux_loss, metrics)`;
        `features` are the batch's per-token `TOKEN_FEATURES` when it has them (packed
        sequences), passed to the model as keyword arguments; `aux_loss` is the sum of the
        auxiliary losses the model recorded (Linen: `sow`n into the `aux_loss` collection),
        or None when it records none; `metrics`: name → float32 scalar the model recorded
        for this step (Linen: the `step_metrics` collection, `step_metrics`), logged; and
        under `LOGIT_MAX`, when the model records them (QK-clip), its attention heads'
        largest logits (`jaxspeed.ops.losses.logit_maxima`), which go to the optimizer.
      init: `(rng) -> params`, traceable (jitted with the plan's shardings), or None when
        the params already exist (`initial_params`).
      initial_params: concrete params (NNX instances, plain pytrees), else None.
      init_fp8_meta: `(rng) -> meta`, the FP8 delayed recipe's scales and amax histories
        (Linen's `_overwrite_with_gradient` collection), or None when the model has none.
        With it, `apply` takes `fp8_meta=`, and the gradient with respect to the meta is its
        next value (`jaxspeed.ops.fp8`).
    """

    abstract_params: Any
    logical_axes: Any
    apply: Callable[[Any, Any], Any]
    init: Callable[[jax.Array], Any] | None
    initial_params: Any
    init_fp8_meta: Callable[[jax.Array], Any] | None = None


#: What `init` keeps: every collection but the sown losses, metrics and intermediates.
_INIT_COLLECTIONS = flax.core.DenyList((AUX_LOSS, STEP_METRICS, LOGIT_MAX, "intermediates"))


def _rngs(rng: jax.Array, *, params: bool = False) -> dict[str, jax.Array]:
    """The rng streams a Linen model gets: `params` (init only: the key itself), `gating`
    (MoE noise and token order) and `dropout`."""
    streams = {"gating": jax.random.fold_in(rng, 0), "dropout": jax.random.fold_in(rng, 1)}
    return {"params": rng, **streams} if params else streams


def _takes_deterministic(module: nn.Module) -> bool:
    try:
        return "deterministic" in inspect.signature(module.__call__).parameters
    except (TypeError, ValueError):
        return False


def linen_apply(module: nn.Module):
    """`ModelFns.apply` of a Linen module (see `linen_fns`)."""
    flag = _takes_deterministic(module)

    def apply(params, inputs, rng, train, fp8_meta=None, **features):
        rngs = _rngs(rng)
        kwargs = {"deterministic": not train} if flag else {}
        variables = {"params": params} if fp8_meta is None else {"params": params, META: fp8_meta}
        outputs, state = module.apply(
            variables, inputs, rngs=rngs, mutable=[AUX_LOSS, STEP_METRICS, LOGIT_MAX], **kwargs,
            **features)
        metrics, maxima = step_metrics(state), logit_maxima(state)
        return outputs, total_aux_loss(state), {**metrics, LOGIT_MAX: maxima} if maxima else metrics

    return apply


def linen_fns(module: nn.Module, sample_inputs) -> ModelFns:
    """Linen: params come from `module.init`, logical axes from `nn.with_logical_partitioning`.

    The apply passes the `gating` and `dropout` rngs, `deterministic=not train` when the
    module's `__call__` takes it (the Flax convention), and collects the `aux_loss` and
    `step_metrics` collections.
    """
    def variables(rng):
        return module.init(_rngs(rng, params=True), sample_inputs, mutable=_INIT_COLLECTIONS)

    def init(rng):
        return nn.unbox(variables(rng)["params"])

    def init_fp8_meta(rng):
        return nn.unbox(variables(rng)[META])

    apply = linen_apply(module)

    boxed = jax.eval_shape(
        lambda rng: module.init(_rngs(rng, params=True), sample_inputs, mutable=_INIT_COLLECTIONS),
        jax.random.key(0),
    )
    _only_params(boxed)
    logical = nn.get_partition_spec(boxed)["params"]
    logical = jax.tree.map(
        lambda spec: tuple(spec) if len(tuple(spec)) else None,
        logical,
        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
    )
    return ModelFns(
        abstract_params=nn.unbox(boxed["params"]),
        logical_axes=logical,
        apply=apply,
        init=init,
        initial_params=None,
        init_fp8_meta=init_fp8_meta if META in boxed else None,
    )


def _only_params(variables) -> None:
    extra = sorted(set(variables) - {"params", META})
    if extra:
        raise JaxspeedError(
            f"model has variable collections {extra} besides 'params'; jaxspeed trains "
            "stateless models (no batch statistics or caches in train mode)"
        )


def nnx_fns(model: nnx.Module) -> ModelFns:
    """NNX: the module's `nnx.Param`s are trained; other state is held fixed.

    Logical axes come from `nnx.with_partitioning(init, names)`. Build the module with
    `nnx.use_eager_sharding(False)` (or under a mesh) so Flax does not shard it eagerly.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    names = {
        tuple(map(str, path)): _nnx_names(var) for path, var in nnx.to_flat_state(params)
    }

    def logical_axes(path, leaf):
        keys = key_names(path)
        return names.get(keys[:-1] if keys and keys[-1] == "value" else keys)

    return ModelFns(
        abstract_params=jax.eval_shape(lambda: params),
        logical_axes=logical_axes,
        apply=lambda p, inputs, rng, train, **features: (
            nnx.merge(graphdef, p, rest)(inputs, **features), None, {}),
        init=None,
        initial_params=params,
    )


def _nnx_names(var):
    meta = var.get_metadata()
    names = meta.get("out_sharding") or meta.get("sharding") or meta.get("sharding_names")
    return tuple(names) if names else None


def pytree_fns(apply: Callable, params, param_axes=None) -> ModelFns:
    """A plain apply function over a params pytree, with logical names from `param_axes`.

    `param_axes` is a pytree of name tuples like `params`, or `(path, leaf) -> names`, or None
    (no tensor-parallel sharding; ZeRO still applies).
    """
    return ModelFns(
        abstract_params=jax.eval_shape(lambda: params),
        logical_axes=param_axes,
        apply=lambda p, inputs, rng, train, **features: (
            apply(p, inputs, **features), None, {}),
        init=None,
        initial_params=params,
    )


def model_fns(model, *, sample_inputs=None, params=None, param_axes=None) -> ModelFns:
    """Dispatches on the kind of `model`: Linen module, NNX module, or apply function."""
    if isinstance(model, nn.Module):
        if sample_inputs is None:
            raise JaxspeedError("a Linen model needs sample_batch (its 'inputs' set the shapes)")
        return linen_fns(model, sample_inputs)
    if isinstance(model, nnx.Module):
        return nnx_fns(model)
    if callable(model):
        if params is None:
            raise JaxspeedError("a plain apply function needs params= (a pytree of arrays)")
        return pytree_fns(model, params, param_axes)
    raise JaxspeedError(
        f"model must be a flax.linen.Module, a flax.nnx.Module or an apply function, "
        f"got {type(model).__name__}"
    )
