"""The 1-bit optimizers' train step: a `shard_map` over the data-parallel axes that keeps
gradients local.

Inside the map each data-parallel worker computes the gradient of its own rows; no gradient
all-reduce is inserted by XLA. The optimizer then communicates what it needs: `onebit_adam` and
`onebit_lamb` a full-precision `pmean` of the gradients during warm-up, and after `freeze_step`
only their 1-bit compressed all-reduce of the momentum; `zero_one_adam` a `pmean` at its
variance steps, the 1-bit all-reduce at its gradient and sync steps, and nothing at its local
steps (where each worker's gradient is taken at its own `worker_params`). The engine compiles
one step per phase (`factory.onebit_phases`) and picks it from the step count, so no program
carries another's collectives.

Only the data-parallel axes are manual: the `tensor` axis stays automatic, so tensor
parallelism inside a data shard works as in the ordinary step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxspeed.ops import precision
from jaxspeed.optim.factory import onebit_phases
from jaxspeed.sharding.rules import without_axes
from jaxspeed.optim.onebit import PHASE_ARG, onebit_state_specs
from jaxspeed.optim.zero_one_adam import worker_params
from jaxspeed.train.step import StepSpec, TrainState, _loss_and_grads


def state_specs(abstract_state: TrainState, axes: tuple[str, ...]) -> TrainState:
    """shard_map specs of the train state: error buffers split over `axes`, the rest whole."""
    return TrainState(
        step=P(),
        params=jax.tree.map(lambda _: P(), abstract_state.params),
        opt_state=onebit_state_specs(abstract_state.opt_state, axis_name=axes),
        rng=P(),
        loss_scale=None,
    )


def onebit_train_step(
    spec: StepSpec, state: TrainState, batch: Any, *, mesh, axes: tuple[str, ...], rules,
    phase: str, specs: TrainState,
):
    """One step of the 1-bit phase `phase` (jit it with the state's shardings)."""
    local_spec = spec._replace(grad_shardings=None)
    local_rules = without_axes(rules, axes)

    def local(state: TrainState, batch):
        with nn.logical_axis_rules(local_rules):
            micro = jax.tree.map(lambda x: x.reshape(spec.accumulation, -1, *x.shape[1:]), batch)
            # Varying params: their gradient stays this worker's own (differentiating w.r.t. a
            # replicated input would make shard_map's transpose all-reduce it).
            varying = jax.tree.map(lambda p: jax.lax.pcast(p, axes, to="varying"), state.params)
            # 0/1 Adam's local steps: each worker's own params, the synchronised ones + drift
            varying = worker_params(varying, state.opt_state)
            compute = precision.cast_floating(varying, spec.compute_dtype)
            next_rng, step_rng = jax.random.split(state.rng)
            # each worker its own draws (gate noise, dropout): its tokens are its own
            step_rng = jax.random.fold_in(step_rng, jax.lax.axis_index(axes))
            loss, extras, grads, _ = _loss_and_grads(  # no FP8 meta (the config refuses it)
                local_spec, compute, micro, step_rng, jnp.float32(1)
            )
        updates, opt_state = spec.tx.update(
            grads, state.opt_state, state.params, **{PHASE_ARG: phase}
        )
        metrics = {
            "loss": jax.lax.pmean(loss, axes),
            # the mean of the workers' local gradient norms (no gradient all-reduce)
            "grad_norm": jax.lax.pmean(optax.tree.norm(grads), axes),
            "lr": jnp.asarray(spec.schedule(state.step), jnp.float32),
            **jax.tree.map(lambda x: jax.lax.pmean(x, axes), extras),
        }
        new_state = state.replace(
            step=state.step + 1,
            params=optax.apply_updates(state.params, updates),
            opt_state=opt_state,
            rng=next_rng,
        )
        return new_state, metrics

    batch_specs = jax.tree.map(lambda _: P(axes), batch)
    return jax.shard_map(
        local, mesh=mesh, in_specs=(specs, batch_specs), out_specs=(specs, P()),
        axis_names=set(axes),
    )(state, batch)


def onebit_train_steps(spec: StepSpec, optimizer_config, abstract_state: TrainState, *, mesh,
                       axes: tuple[str, ...], rules, jit: Callable[[Callable], Callable]):
    """One step per phase of the 1-bit optimizer `optimizer_config`, each wrapped in `jit`
    (with the state's shardings): `({phase: step}, phases, phase_of)`, `phase_of(step)` naming
    the phase to run at a step count (`jaxspeed.optim.factory.onebit_phases`)."""
    phases, phase_of = onebit_phases(optimizer_config)
    specs = state_specs(abstract_state, axes)
    steps = {
        phase: jit(functools.partial(onebit_train_step, spec, mesh=mesh, axes=axes, rules=rules,
                                     phase=phase, specs=specs))
        for phase in phases
    }
    return steps, phases, phase_of
