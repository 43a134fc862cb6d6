"""What `initialize` assembles from a config before it builds an `Engine`.

The combinations of config keys that exist but do not work together, refused with one
`ConfigError` that names the key (never faked); the reference GPT that `config.model`
describes; the step's objective and the model parts it applies; and the axes 1-bit Adam
communicates over.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxspeed.attention.sequence_parallel import check_length
from jaxspeed.config import Config
from jaxspeed.config.cross_field import untrainable_errors
from jaxspeed.config.optimizer import ONEBIT_TYPES, clips_logits
from jaxspeed.errors import ConfigError
from jaxspeed.ops import precision
from jaxspeed.ops.fp8 import Fp8Recipe
from jaxspeed.pipeline.gpt_stages import pipelined_lm_objective
from jaxspeed.runtime.mesh import DATA_PARALLEL_AXES, PIPE, SEQUENCE, TENSOR
from jaxspeed.train.adapters import ModelFns, linen_apply, token_features


def _refuse(combinations, parallelism: str, fix: str) -> None:
    """One error for the first `(config key, used)` pair in use with `parallelism`."""
    for name, used in combinations:
        if used:
            raise ConfigError(
                f"{name} with {parallelism} is not available in this version of jaxspeed; {fix}")


def check_trainable(config: Config, mesh: Mesh, *, reference_model: bool) -> None:
    """That `config` trains as a whole on `mesh`: the combinations whose keys exist but which
    do not train together, every one in one error
    (`jaxspeed.config.cross_field.untrainable_errors`); then that `mesh` agrees with the
    config's pipeline and has what a sequence split needs."""
    errors = untrainable_errors(config)
    if errors:
        raise ConfigError("; ".join(errors))
    if mesh.shape.get(PIPE, 1) != config.mesh.pipe:  # the batch triple follows the config
        raise ConfigError(
            f"the mesh has {PIPE}={mesh.shape.get(PIPE, 1)} but the config has "
            f"mesh.pipe={config.mesh.pipe}; make them agree"
        )
    _check_sequence(config, mesh, reference_model=reference_model)


def _check_sequence(config: Config, mesh: Mesh, *, reference_model: bool) -> None:
    """What a sequence split (`mesh.sequence > 1`) needs: one line naming the key otherwise."""
    shards = mesh.shape.get(SEQUENCE, 1)
    if shards == 1:
        return
    _refuse(((f"mesh.pipe={mesh.shape.get(PIPE, 1)}", mesh.shape.get(PIPE, 1) > 1),
             ("model.moe", config.model.moe is not None),
             (f"optimizer.type={config.optimizer.type}", config.optimizer.type in ONEBIT_TYPES)),
            f"sequence parallelism (mesh.sequence={shards})", "use mesh.sequence=1")
    rows = np.moveaxis(mesh.devices, mesh.axis_names.index(SEQUENCE), -1).reshape(-1, shards)
    if any(len({d.process_index for d in row}) > 1 for row in rows):
        raise ConfigError(
            f"mesh.sequence={shards} spans processes; each process loads whole sequences, so "
            f"keep the sequence axis inside one process (fewer sequence devices, more data)"
        )
    if not reference_model:
        return
    sp = config.model.sequence_parallel
    check_length(config.data.seq_len, shards, sp.load_balance and sp.impl == "ring")
    heads, tensor = config.model.n_heads, mesh.shape.get(TENSOR, 1)
    local = heads // tensor if heads % tensor == 0 else heads
    if sp.impl == "ulysses" and local % shards:
        raise ConfigError(
            f"model.sequence_parallel.impl=ulysses splits the {local} heads per tensor shard "
            f"(model.n_heads={heads}, mesh.tensor={tensor}) over mesh.sequence={shards}, which "
            f"does not divide them; use model.sequence_parallel.impl: ring (any head count)"
        )


def _streams_layers(config: Config) -> bool:
    """Whether the reference GPT streams its layers' params from the host (`offload_param`).

    A pipeline (`mesh.pipe > 1`) fetches each stage's params for the whole step instead.
    """
    return config.zero_optimization.offload_param.device == "cpu" and config.mesh.pipe == 1


def reference_gpt(config: Config):
    """The reference GPT that `config.model` describes, with the config's remat policy, and
    streaming its layers' params from the host under `offload_param` (`_streams_layers`)."""
    from jaxspeed.models import build_gpt

    fp8, remat = fp8_recipe(config), config.activation_checkpointing
    streams = _streams_layers(config)
    stream = precision.compute_dtype(config) if streams else None
    return build_gpt(
        config.model, remat_policy=remat.policy, remat_names=remat.names, stream_layers=stream,
        fp8=fp8, record_logit_max=clips_logits(config.optimizer),
    )


def fp8_recipe(config: Config) -> Fp8Recipe | None:
    """The model's FP8 recipe from `config.fp8`, or None when FP8 is off."""
    fp8 = config.fp8
    if not fp8.enabled:
        return None
    return Fp8Recipe(fp8.recipe, fp8.amax_history_length, tuple(fp8.skip))


def step_objective(config: Config, mesh: Mesh, fns: ModelFns, model, loss_fn):
    """The step's `(params, batch, rng, train) -> (loss, extras)` (see `train_step.Objective`).

    The model's loss plus the auxiliary losses it records (logged as `aux_loss`, beside the
    step metrics it records); with
    `mesh.pipe > 1`, the reference GPT's layers run as a pipeline over `pipe`.
    """
    if mesh.shape.get(PIPE, 1) > 1:
        pipe = config.pipeline
        pipelined = pipelined_lm_objective(
            model, loss_fn, mesh=mesh, num_microbatches=pipe.num_microbatches,
            schedule=pipe.schedule, partition=pipe.partition, virtual_stages=pipe.virtual_stages,
        )
        def pipelined_objective(params, batch, rng, train):
            if token_features(batch):
                raise ConfigError(
                    f"packed sequences ({', '.join(token_features(batch))} in the batch) with "
                    f"pipeline parallelism are not available; use mesh.pipe=1")
            return pipelined(params, batch), {}

        return pipelined_objective

    def objective(params, batch, rng, train, **fp8_meta):
        outputs, aux, metrics = fns.apply(params, batch["inputs"], rng, train, **fp8_meta,
                                          **token_features(batch))
        loss = loss_fn(outputs, batch).astype(jnp.float32)
        if aux is None:
            return loss, metrics
        return loss + aux, {"aux_loss": aux, **metrics}

    return objective


def objective_parts(fns: ModelFns, model, explicit_zero):
    """`fns` and `model` as the step's objective uses them: with the explicit ZeRO-3 step
    (`jaxspeed.zero.step.ZeroStep`, or None), the model with its per-layer gather where it has
    one (a pipeline's stages run its `layer_stack`, so they gather their own layers)."""
    if explicit_zero is None or explicit_zero.model is None:
        return fns, model
    return fns._replace(apply=linen_apply(explicit_zero.model)), explicit_zero.model


def onebit_axes(config: Config, mesh: Mesh) -> tuple[str, ...] | None:
    """The data-parallel axes a 1-bit optimizer communicates over (None for the others)."""
    if config.optimizer.type not in ONEBIT_TYPES:
        return None
    return tuple(axis for axis in DATA_PARALLEL_AXES if axis in mesh.axis_names)
