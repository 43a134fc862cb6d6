"""The pure train and eval steps the engine jits: accumulation, precision, clipping, update."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import optax

from jaxspeed.ops import offload
from jaxspeed.ops import precision
from jaxspeed.ops.losses import LOGIT_MAX, mean_extras, sum_extras, zero_extras
from jaxspeed.sharding import LeafPlan, Plan


class TrainState(flax.struct.PyTreeNode):
    """Everything a step reads and writes (not flax's `train_state.TrainState`: the model and
    the optimizer live in the `Engine`, so there is no `apply_fn` or `tx` here).

    Attributes:
      step: number of steps taken (skipped fp16 steps included).
      params: fp32 master parameters.
      opt_state: the optax state.
      rng: a PRNG key, split once per step (for dropout and future stochastic layers).
      loss_scale: fp16 dynamic loss-scale state, or None without fp16.
      fp8_meta: the FP8 delayed recipe's scales and amax histories (replicated), or None.
        The step differentiates the loss with respect to them as well; their "gradient" is
        their next value (Flax's `_overwrite_with_gradient`), which replaces them.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    loss_scale: precision.LossScaleState | None = None
    fp8_meta: Any = None


class OffloadSpec(NamedTuple):
    """Where offloaded state is computed on (ZeRO-Offload).

    Attributes:
      params: device shardings of the params when they are stored on the host, else None.
      opt_state: device shardings of the optimizer state when it is stored on the host and
        updated on the device, else None.
      host_update: host shardings `(grads, params, scalar)` when the update runs on the host
        (ZeRO-Offload's CPU-Adam), else None.
      clip: with `host_update`, the max global norm the host clips to, with the norm the
        device computed (the host `tx` has `optax.identity()` in the clipping's place: optax's
        norm cannot run as a host computation); 0 = off.
      streamed: with `params`, a pytree of bools like the params: True where the model
        fetches the host-resident leaf itself, one layer at a time (`offload.fetch`), so the
        step passes it on as it is; those leaves' gradients come back in host memory.
    """

    params: Any = None
    opt_state: Any = None
    host_update: tuple[Any, Any, Any] | None = None
    clip: float = 0.0
    streamed: Any = None


def offload_spec(plan: Plan, *, update_on_host: bool, clip: float, streams: bool,
                 abstract_opt_state: Callable[[], Any]) -> OffloadSpec | None:
    """Device/host shardings the step moves `plan`'s offloaded state between (None: no
    offload). `update_on_host`: `offload_optimizer.update_on` is "host", clipping to `clip`;
    `streams`: the model fetches its scanned layer stack itself (`stream_layers`);
    `abstract_opt_state()`: the optimizer state's shapes, read only when it is offloaded."""
    if plan.param_memory == offload.DEVICE and plan.opt_memory == offload.DEVICE:
        return None
    params = plan.params_on_device if plan.param_memory != offload.DEVICE else None
    streamed = None
    if params is not None and streams:  # the model's scanned stack
        streamed = jax.tree.map(
            lambda leaf: leaf.logical[:1] == ("layers",), plan.leaves,
            is_leaf=lambda x: isinstance(x, LeafPlan),
        )
    if update_on_host:
        host_update = (
            offload.with_memory_kind(plan.grads, offload.HOST),
            offload.with_memory_kind(plan.params_on_device, offload.HOST),
            plan.replicated.with_memory_kind(offload.HOST),
        )
        return OffloadSpec(params=params, host_update=host_update, clip=clip, streamed=streamed)
    opt_state = None
    if plan.opt_memory != offload.DEVICE:
        opt_state = plan.opt_state_shardings(abstract_opt_state(), memory_kind=offload.DEVICE)
    return OffloadSpec(params=params, opt_state=opt_state, streamed=streamed)

#: `(params, batch, rng, train) -> (loss, extras)`: the scalar to minimise (auxiliary losses
#: included) and a dict of extra scalar metrics (e.g. `aux_loss`), both float32. A model with
#: FP8 meta (`TrainState.fp8_meta`) takes it as the keyword `fp8_meta`.
Objective = Callable[[Any, Any, jax.Array, bool], tuple[jax.Array, dict[str, jax.Array]]]


class StepSpec(NamedTuple):
    """What the step needs to know besides the state and the batch."""

    objective: Objective
    tx: optax.GradientTransformation
    schedule: Callable[[jax.Array], jax.Array]
    accumulation: int
    compute_dtype: Any
    grad_shardings: Any
    micro_sharding: Callable[[int], Any]
    fp16: Any = None
    offload: OffloadSpec | None = None
    #: ZeRO-3 with all params within `zero_optimization.max_live_parameters`: the shardings
    #: the compute params are gathered to once per step (else None: gathered layer by layer,
    #: as each use needs them).
    gathered_params: Any = None
    #: ZeRO-3 with explicit collectives: a `jaxspeed.zero.step.ZeroStep` that computes
    #: the loss and the sharded gradients from the stored params (else None: the sharding path).
    explicit_zero: Any = None


def split_microbatches(batch, accumulation: int, data_parallel: int, micro_sharding):
    """[global_batch, ...] → [accumulation, global_batch / accumulation, ...].

    Each device keeps its own rows: rows are grouped as [dp, accumulation, micro] before the
    swap, so no data moves between devices.
    """

    def split(x):
        dp_micro = x.shape[0] // accumulation
        y = x.reshape(data_parallel, accumulation, dp_micro // data_parallel, *x.shape[1:])
        y = jnp.swapaxes(y, 0, 1).reshape(accumulation, dp_micro, *x.shape[1:])
        return jax.lax.with_sharding_constraint(y, micro_sharding(y.ndim))

    return jax.tree.map(split, batch)


def _microbatch_loss(spec: StepSpec, compute_params, batch, rng, scale, train: bool = True,
                     fp8_meta=None):
    """`(scaled loss, (loss, extras))` of one microbatch."""
    meta = {} if fp8_meta is None else {"fp8_meta": fp8_meta}
    loss, extras = spec.objective(compute_params, batch, rng, train, **meta)
    loss = loss.astype(jnp.float32)
    return loss * scale, (loss, extras)


def _float32(tree):
    return jax.tree.map(lambda g: g.astype(jnp.float32), tree)


def _loss_and_grads(spec: StepSpec, compute_params, micro_batches, rng, scale, fp8_meta=None):
    """Mean loss, mean extras, fp32 gradients and the next FP8 meta over the microbatches (a
    scan, no Python loop).

    Gradients are taken w.r.t. the compute-dtype params and cast to fp32 before they are
    reduced across devices: the same values as differentiating through the cast. Microbatch
    i draws its randomness from `fold_in(rng, i)`. FP8 meta (or None) goes from microbatch to
    microbatch, each one's "gradient" being the next one's meta, as Transformer Engine updates
    its amax histories at every forward and backward pass.
    """
    # `(params, meta, batch, key) -> ((scaled loss, (loss, extras)), (grads, next meta))`; a
    # None meta is an empty pytree, whose gradient is None.
    grad_fn = jax.value_and_grad(
        lambda p, m, b, r: _microbatch_loss(spec, p, b, r, scale, fp8_meta=m),
        argnums=(0, 1), has_aux=True)

    def constrain(grads):  # streamed layers' gradients are already sharded, in host memory
        if spec.grad_shardings is None:  # inside shard_map (1-bit Adam): per-device grads
            return grads
        return jax.tree.map(
            lambda g, s: g if offload.in_host(g) else jax.lax.with_sharding_constraint(g, s),
            grads, spec.grad_shardings,
        )
    n = spec.accumulation
    if n == 1:  # one microbatch: no accumulator to carry
        first = jax.tree.map(lambda x: x[0], micro_batches)
        (_, (loss, extras)), (grads, meta) = grad_fn(
            compute_params, fp8_meta, first, jax.random.fold_in(rng, 0))
        return loss, extras, constrain(_divide(_float32(grads), scale)), meta

    def body(carry, indexed):
        i, batch = indexed
        grads_sum, loss_sum, extras_sum, meta = carry
        (_, (loss, extras)), (grads, meta) = grad_fn(
            compute_params, meta, batch, jax.random.fold_in(rng, i))
        # ZeRO-2/3: the running sum already lives in the gradient sharding (reduce-scattered).
        grads_sum = constrain(offload.map_where_it_lives(jnp.add, grads_sum, _float32(grads)))
        extras_sum = sum_extras(extras_sum, extras)
        return (grads_sum, loss_sum + loss, extras_sum, meta), None

    def zeros_like(p):  # in the memory the gradient will arrive in
        zeros = jnp.zeros(p.shape, jnp.float32)
        return jax.device_put(zeros, jax.memory.Space.Host) if offload.in_host(p) else zeros

    zeros = constrain(jax.tree.map(zeros_like, compute_params))
    first = jax.tree.map(lambda x: x[0], micro_batches)
    extras_shape = jax.eval_shape(
        lambda p, m, b: _microbatch_loss(spec, p, b, rng, scale, fp8_meta=m)[1][1],
        compute_params, fp8_meta, first)
    init = (zeros, jnp.zeros((), jnp.float32), zero_extras(extras_shape), fp8_meta)
    (grads, loss, extras, meta), _ = jax.lax.scan(body, init, (jnp.arange(n), micro_batches))
    mean = lambda x: x / n  # noqa: E731
    return mean(loss), mean_extras(extras, n), constrain(
        _divide(grads, n * scale)
    ), meta


def _divide(grads, divisor):
    """`grads / divisor` leaf by leaf, where each leaf lives."""
    def one(g):
        if not offload.in_host(g):
            return g / divisor
        return offload.run_on_host(jnp.divide, g, jax.device_put(divisor, jax.memory.Space.Host))

    return jax.tree.map(one, grads)


def _compute_params(spec: StepSpec, params):
    """The params the forward pass uses: cast to the compute dtype, in device memory.

    Offloaded params are cast on the host first (ZeRO-Offload: the fp32 masters stay on the
    host; only the bf16/fp16 copy travels and occupies device memory). Streamed leaves stay
    where they are: the model fetches them layer by layer.
    """
    cast = functools.partial(precision.cast_floating, dtype=spec.compute_dtype)
    off = spec.offload
    if spec.gathered_params is not None:  # cast first: the gather moves compute-dtype bytes
        return jax.lax.with_sharding_constraint(cast(params), spec.gathered_params)
    if off is None or off.params is None:
        return cast(params)
    if off.streamed is None:
        return offload.to_device(offload.run_on_host(cast, params), off.params)

    def fetch(param, streamed: bool, where):
        return param if streamed else offload.to_device(offload.run_on_host(cast, param), where)

    return jax.tree.map(fetch, params, off.streamed, off.params)


def _global_norm(grads):
    """`optax.tree.norm(grads)`, each leaf's sum of squares taken where the leaf lives."""
    if not any(offload.in_host(g) for g in jax.tree.leaves(grads)):
        return optax.tree.norm(grads)
    return jnp.sqrt(sum(offload.device_scalars(lambda g: jnp.sum(jnp.square(g)), grads)))


def _all_finite(grads):
    """`precision.all_finite(grads)`, each leaf checked where it lives."""
    return jnp.all(jnp.stack(offload.device_scalars(precision.all_finite, grads)))


def _apply_update(tx: optax.GradientTransformation, grads, opt_state, params, finite,
                  logit_max=None):
    """The optimizer update; with fp16 (`finite` given) a non-finite step keeps the old state.
    The model's attention logit maxima (QK-clip), when it records them, go to `tx` as the
    extra argument `attn_logit_max`."""
    extra = {} if logit_max is None else {LOGIT_MAX: logit_max}
    updates, new_opt_state = tx.update(grads, opt_state, params, **extra)
    new_params = optax.apply_updates(params, updates)
    if finite is None:
        return new_params, new_opt_state
    return (
        precision.select_tree(finite, new_params, params),
        precision.select_tree(finite, new_opt_state, opt_state),
    )


def _clip_and_update(tx, max_norm: float, grads, norm, opt_state, params, finite,
                     logit_max=None):
    """`clip_by_global_norm(max_norm)` with a norm computed elsewhere, then the update."""
    if max_norm > 0:
        trigger = norm < max_norm
        grads = jax.tree.map(lambda g: jax.lax.select(trigger, g, (g / norm) * max_norm), grads)
    return _apply_update(tx, grads, opt_state, params, finite, logit_max)


def _update(spec: StepSpec, grads, norm, opt_state, params, finite, logit_max=None):
    """`_apply_update` where the plan says: on the device, or on the host (CPU-Adam)."""
    off = spec.offload or OffloadSpec()
    if off.host_update is None:
        if off.opt_state is not None:
            opt_state = offload.to_device(opt_state, off.opt_state)
        if off.params is not None:
            params = offload.to_device(params, off.params)
        if off.streamed is not None:  # the streamed layers' gradients are in host memory
            grads = jax.device_put(grads, jax.memory.Space.Device)
        return _apply_update(spec.tx, grads, opt_state, params, finite, logit_max)
    grads_host, params_host, scalar_host = off.host_update
    to_host = lambda x, where: None if x is None else jax.device_put(x, where)  # noqa: E731
    update = functools.partial(_clip_and_update, spec.tx, off.clip)
    return offload.run_on_host(
        update,
        to_host(grads, grads_host),
        to_host(norm, scalar_host),
        opt_state,
        to_host(params, params_host),
        to_host(finite, scalar_host),
        to_host(logit_max, scalar_host),
    )


def train_step(spec: StepSpec, data_parallel: int, state: TrainState, batch):
    """One optimizer step on one global batch. Returns the new state and metrics.

    Offloaded params and optimizer state stream in from the host here; the jitted step's
    `out_shardings` stream the new values back out.
    """
    scale = state.loss_scale.scale if state.loss_scale is not None else jnp.float32(1)
    next_rng, step_rng = jax.random.split(state.rng)
    fp8_meta = state.fp8_meta
    if spec.explicit_zero is not None:  # with no FP8 meta (`zero.step._unsupported`)
        off = spec.offload or OffloadSpec()
        params = state.params
        if off.params is not None:
            params = jax.tree.map(lambda x, s, where: x if s else offload.to_device(x, where),
                                  params, off.streamed or jax.tree.map(lambda _: False, params),
                                  off.params)
        loss, extras, grads = spec.explicit_zero.loss_and_grads(
            spec, params, batch, step_rng, scale)
    else:
        micro = split_microbatches(batch, spec.accumulation, data_parallel, spec.micro_sharding)
        loss, extras, grads, fp8_meta = _loss_and_grads(
            spec, _compute_params(spec, state.params), micro, step_rng, scale, state.fp8_meta
        )
    norm = _global_norm(grads)
    loss_scale = state.loss_scale
    finite = _all_finite(grads) if loss_scale is not None else None
    extras = dict(extras)
    logit_max = extras.pop(LOGIT_MAX, None)
    params, opt_state = _update(spec, grads, norm, state.opt_state, state.params, finite,
                                logit_max)
    metrics = {
        "loss": loss,
        "grad_norm": norm,
        "lr": jnp.asarray(spec.schedule(state.step), jnp.float32),
        **extras,
    }
    if logit_max is not None:  # the step's largest attention logit
        metrics[LOGIT_MAX] = optax.tree.max(logit_max)
    if loss_scale is not None:
        loss_scale = precision.update_loss_scale(
            loss_scale, finite, **precision.loss_scale_options(spec.fp16)
        )
        metrics["loss_scale"] = loss_scale.scale
        metrics["skipped"] = jnp.logical_not(finite).astype(jnp.int32)
    new_state = state.replace(
        step=state.step + 1,
        params=params,
        opt_state=opt_state,
        rng=next_rng,
        loss_scale=loss_scale,
        fp8_meta=fp8_meta,
    )
    return new_state, metrics


def eval_step(spec: StepSpec, data_parallel: int, state: TrainState, batch):
    """Mean loss over one global batch, in microbatches, without gradients."""
    if spec.explicit_zero is not None:
        return {"loss": spec.explicit_zero.eval_loss(spec, state.params, batch, state.rng)}
    micro = split_microbatches(batch, spec.accumulation, data_parallel, spec.micro_sharding)
    params = _compute_params(spec, state.params)

    def body(total, b):
        loss = _microbatch_loss(spec, params, b, state.rng, 1.0, train=False,
                                fp8_meta=state.fp8_meta)
        return total + loss[1][0], None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), micro)
    return {"loss": total / spec.accumulation}
