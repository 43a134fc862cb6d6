"""`initialize()` and `Engine`: a model, a config and a mesh become jitted, sharded steps."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxspeed.ops import precision
from jaxspeed.train.adapters import ModelFns, model_fns
from jaxspeed.train.assembly import (
    check_trainable, objective_parts, onebit_axes, reference_gpt, step_objective,
)
from jaxspeed.checkpoint.engine_checkpoints import EngineCheckpoints
from jaxspeed.checkpoint.state import Checkpointer
from jaxspeed.config import Config, load_config, resolve_batch
from jaxspeed.cost.flops import jaxpr_flops
from jaxspeed.cost.memory import MemoryReport, memory_report
from jaxspeed.cost.profile import profile
from jaxspeed.cost.plan_table import ProfileReport
from jaxspeed.data.dataset import make_global_batch
from jaxspeed.ops.losses import lm_loss
from jaxspeed.runtime.mesh import PIPE, data_parallel_size, make_mesh
from jaxspeed.optim import build_optimizer
from jaxspeed.sharding import Plan, plan_sharding
from jaxspeed.sharding.rules import DEFAULT_RULES
from jaxspeed.train.onebit_step import onebit_train_steps
from jaxspeed.optim.onebit import onebit_state_specs as onebit_state_specs_of
from jaxspeed.train.step import StepSpec, TrainState, eval_step, offload_spec, train_step
from jaxspeed.zero.step import explicit_zero, gathered_once, host_major, runs_explicit


class Engine:
    """Jitted, sharded train and eval steps for one model, config and mesh.

    Build it with `jaxspeed.initialize`. The state lives where `plan` says; each step donates
    the old state.
    """

    def __init__(
        self, *, config: Config, mesh: Mesh, fns: ModelFns, plan: Plan, loss_fn, model=None,
        sample_batch=None,
    ):
        self.config = config
        self.mesh = mesh
        self.fns = fns
        self.plan = plan
        #: the Flax module when one was given (or built from `config.model`), else None
        self.model = model if isinstance(model, nn.Module) else None
        #: `initialize`'s `sample_batch` as `ShapeDtypeStruct`s (None: token batches)
        self.sample_batch = sample_batch
        self.batch_sizes = resolve_batch(config, data_parallel_size(mesh))
        host_update = config.zero_optimization.offload_optimizer.update_on == "host"
        self.onebit_axes = onebit_axes(config, mesh)
        self._returned = (None, 0)  # the state.step the last 1-bit step returned, its count
        self.tx, self.schedule = build_optimizer(
            config, clip_outside=host_update, axis_name=self.onebit_axes, plan=plan)
        self.compute_dtype = precision.compute_dtype(config)
        #: checkpoints saved from and restored into this engine's state and shardings
        self.checkpoints = EngineCheckpoints(config, self.abstract_state)
        self._compiled: dict[str | None, Any] = {}
        pipelined = mesh.shape.get(PIPE, 1) > 1
        #: ZeRO-3 with explicit collectives (`jaxspeed.zero.step`), or None
        self.explicit_zero = explicit_zero(
            config, mesh, plan, model, compute_dtype=self.compute_dtype,
            param_count=self.param_count)
        parts = objective_parts(fns, model, self.explicit_zero)
        self._spec = StepSpec(
            objective=step_objective(config, mesh, *parts, loss_fn),
            tx=self.tx,
            schedule=self.schedule,
            # with a pipeline, its microbatches are the accumulation steps (one scan fewer)
            accumulation=1 if pipelined else self.batch_sizes.accumulation_steps,
            compute_dtype=self.compute_dtype,
            grad_shardings=plan.grads,
            micro_sharding=plan.micro_batch_sharding,
            fp16=config.fp16 if config.fp16.enabled else None,
            offload=offload_spec(
                plan, update_on_host=host_update, clip=config.gradient_clipping,
                streams=getattr(model, "stream_layers", None) is not None,
                abstract_opt_state=lambda: self._abstract_opt_state),
            gathered_params=(None if self.explicit_zero is not None
                             else gathered_once(config, mesh, plan, self.param_count)),
            explicit_zero=self.explicit_zero,
        )
        dp = data_parallel_size(mesh)
        shardings = self.state_shardings
        # one jit for every `init` call, so it compiles once (a jit made per call traces and
        # compiles again); `abstract_state` evaluates it too, traced once for all its calls
        self._init = jax.jit(self._init_fn, out_shardings=shardings)
        jit_step = functools.partial(
            jax.jit, in_shardings=(shardings, None), out_shardings=(shardings, None), donate_argnums=0
        )
        if self.onebit_axes:  # one compiled step per phase, switched by the step count
            self._train, self._phases, self._phase_of = onebit_train_steps(
                self._spec, config.optimizer, self.abstract_state(), mesh=mesh,
                axes=self.onebit_axes, rules=plan.rules, jit=jit_step)
        else:
            self._train = {None: jit_step(functools.partial(train_step, self._spec, dp))}
        self._eval = jax.jit(functools.partial(eval_step, self._spec, dp), in_shardings=(shardings, None))

    def _phase(self, step: int | None) -> str | None:
        """The compiled step to run at `step`: a 1-bit optimizer's phase (its first, with full
        precision gradient averaging, for None), or the one step."""
        if not self.onebit_axes:
            return None
        return self._phases[0] if step is None else self._phase_of(step)

    # -- layouts ------------------------------------------------------------------------
    @property
    def param_count(self) -> int:
        """The model's number of parameters."""
        return self.plan.param_count

    @property
    def streamed_params(self):
        """Pytree of bools like the params: True where the model fetches the host-resident
        param layer by layer (`offload_param` with the reference GPT); None: no streaming."""
        off = self._spec.offload
        return off.streamed if off is not None else None

    def batch_sharding(self, ndim: int = 2) -> NamedSharding:
        """Sharding of a global batch array of rank `ndim` (rows over the data-parallel axes)."""
        return self.plan.batch_sharding(ndim)

    @functools.cached_property
    def _abstract_opt_state(self):
        with jax.set_mesh(self.mesh):  # 1-bit Adam sizes its per-worker buffers from the mesh
            return jax.eval_shape(self.tx.init, self.fns.abstract_params)

    @functools.cached_property
    def state_shardings(self) -> TrainState:
        """A `TrainState` of `NamedSharding`s: the plan applied to every piece of state."""
        rep = self.plan.replicated
        loss_scale = None
        if self.config.fp16.enabled:
            loss_scale = jax.tree.map(lambda _: rep, precision.init_loss_scale(self.config.fp16))
        opt_state = self.plan.opt_state_shardings(self._abstract_opt_state)
        if self.onebit_axes:
            specs = onebit_state_specs_of(self._abstract_opt_state, axis_name=self.onebit_axes)
            opt_state = jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), specs)
        fp8_meta = None
        if self.fns.init_fp8_meta is not None:  # tiny: replicated
            shapes = jax.eval_shape(self.fns.init_fp8_meta, jax.eval_shape(jax.random.key, 0))
            fp8_meta = jax.tree.map(lambda _: rep, shapes)
        return TrainState(
            step=rep,
            params=self.plan.params,
            opt_state=opt_state,
            rng=rep,
            loss_scale=loss_scale,
            fp8_meta=fp8_meta,
        )

    def abstract_state(self) -> TrainState:
        """The state as `ShapeDtypeStruct`s carrying their shardings (no allocation)."""
        params = None if self.fns.init is not None else self.fns.abstract_params
        key = jax.eval_shape(jax.random.key, 0)  # nothing runs: the mesh may be a GPU's not here
        with jax.set_mesh(self.mesh):
            shapes = jax.eval_shape(self._init, key, params)
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            shapes,
            self.state_shardings,
        )

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        """The global train batch as `ShapeDtypeStruct`s: each entry of `sample_batch` with
        `train_batch_size` rows, or int32 `inputs` and `targets` `[rows, data.seq_len]`."""
        rows = self.batch_sizes.train_batch_size
        sample = self.sample_batch
        if sample is None:
            tokens = jax.ShapeDtypeStruct((rows, self.config.data.seq_len), jnp.int32)
            sample = {"inputs": tokens, "targets": tokens}
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
            (rows, *x.shape[1:]), x.dtype, sharding=self.batch_sharding(len(x.shape))), sample)

    # -- state ---------------------------------------------------------------------------
    def _init_fn(self, rng, params):
        params_rng, state_rng = jax.random.split(rng)
        if params is None:
            params = self.fns.init(params_rng)
        loss_scale = precision.init_loss_scale(self.config.fp16) if self.config.fp16.enabled else None
        init_meta = self.fns.init_fp8_meta
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=self.tx.init(params),
            rng=state_rng,
            loss_scale=loss_scale,
            fp8_meta=None if init_meta is None else init_meta(params_rng),
        )

    def init(self, rng: jax.Array, *, params=None) -> TrainState:
        """Creates the train state directly in its planned shardings (params never gathered).

        `params`: start from these (e.g. `jaxspeed.checkpoint.params.start_from`'s, already in
        `plan.params`) with a fresh optimizer state, instead of initialising them.
        """
        params = self.fns.initial_params if params is None else params
        if params is not None:
            params = jax.device_put(params, self.plan.params)
        # No logical-rules context here: Flax's init-time reshapes (e.g. DenseGeneral) would
        # trip over activation constraints; `out_shardings` places the state. The mesh is set
        # for 1-bit Adam, whose init sizes its per-worker buffers from it.
        with jax.set_mesh(self.mesh):
            return self._init(rng, params)

    # -- steps ---------------------------------------------------------------------------
    def _context(self):
        return _mesh_context(self.mesh, self.plan.rules)

    def train_step(self, state: TrainState, batch) -> tuple[TrainState, dict[str, jax.Array]]:
        """One optimizer step on a global batch (arrays, or host numpy to be sharded). A 1-bit
        phase reads the step count from `state` (a wait) unless the last step returned it."""
        step = None
        if self.onebit_axes:
            returned, count = self._returned
            step = count if state.step is returned else int(jax.device_get(state.step))
        with self._context():
            state, metrics = self._train[self._phase(step)](state, self.shard_batch(batch))
        if step is not None:
            self._returned = (state.step, step + 1)
        return state, metrics

    def eval_step(self, state: TrainState, batch) -> dict[str, jax.Array]:
        """Mean loss on a global batch, without updating the state."""
        with self._context():
            return self._eval(state, self.shard_batch(batch))

    def shard_batch(self, batch):
        """Places a batch: jax Arrays are kept; numpy arrays are this process's rows."""
        if all(isinstance(x, jax.Array) for x in jax.tree.leaves(batch)):
            return batch
        return make_global_batch(batch, self.batch_sharding, self.batch_sizes.train_batch_size)

    def compile_train_step(self, *, step: int | None = None):
        """Lowers and compiles the train step for the abstract state and batch (once).

        `step` picks 1-bit Adam's phase (default: the warm-up step); other optimizers have
        one step.
        """
        phase = self._phase(step)
        if phase not in self._compiled:
            with self._context():
                lowered = self._train[phase].lower(self.abstract_state(), self.abstract_batch())
                self._compiled[phase] = lowered.compile()
        return self._compiled[phase]

    def step_flops(self) -> int:
        """Global matmul FLOPs of one train step (loops counted; see `cost.flops.jaxpr_flops`)."""
        with self._context():
            step = self._train[self._phase(None)]
            return jaxpr_flops(step, self.abstract_state(), self.abstract_batch())

    def profile(self) -> ProfileReport:
        """FLOPs, the device's peak, and collective bytes per device of the compiled step
        (`jaxspeed.cost.profile.profile`)."""
        return profile(self)

    def memory_report(self) -> MemoryReport:
        """Per-device bytes by category, estimated from shardings and read from the compiled
        step (`jaxspeed.cost.memory.memory_report`)."""
        return memory_report(self)

    # -- checkpoints: `self.checkpoints`' (`EngineCheckpoints`) -------------------------------
    def checkpointer(self, directory: str | Path | None = None) -> Checkpointer:
        """The `Checkpointer` for `directory` (default `checkpoint.dir` of the config)."""
        return self.checkpoints.checkpointer(directory)

    def save(self, state: TrainState, *, directory=None, meta: dict | None = None) -> int:
        """Saves `state` with Orbax (atomic; async when `checkpoint.async`). Returns the step."""
        return self.checkpoints.save(state, directory=directory, meta=meta)

    def restore(self, *, directory=None, step: int | None = None) -> TrainState:
        """Restores the newest (or `step`) checkpoint onto this engine's mesh and plan, from
        any mesh, ZeRO stage or tensor-parallel degree."""
        return self.checkpoints.restore(directory=directory, step=step)


@contextlib.contextmanager
def _mesh_context(mesh, rules):
    """`jax.set_mesh` + Flax logical-axis rules, so the model's activation hints resolve."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(tuple(rules)):
        yield


def initialize(
    config: Config | str | dict | None = None,
    model=None,
    loss_fn: Callable[[Any, Any], jax.Array] | None = None,
    sample_batch=None,
    *,
    mesh: Mesh | None = None,
    params=None,
    param_axes=None,
    rules=DEFAULT_RULES,
) -> Engine:
    """Builds an `Engine` from a config and a model.

    Args:
      config: a `Config`, a path to YAML/JSON, a dict, or None for defaults.
      model: a Flax Linen module, a Flax NNX module, an apply function `(params, inputs)`
        with `params=`, or None for the reference GPT described by `config.model`.
      loss_fn: `(outputs, batch) -> scalar`; default next-token cross entropy.
      sample_batch: a batch like the train step's, any number of rows: `inputs` (the model's
        input; it initialises a Linen model) and what `loss_fn` reads (default loss: `targets`,
        else shaped like `inputs`). `memory_report`/`profile` compile for its shapes and
        dtypes. Default: int32 `inputs` and `targets` `[micro_batch, data.seq_len]`.
      mesh: a mesh; default `make_mesh(config.mesh)`.
      params: params for a plain apply function.
      param_axes: logical axis names for plain params (pytree or `(path, leaf) -> names`).
      rules: ordered logical-axis rules.
    """
    if not isinstance(config, Config):
        config = load_config(config)
    mesh = mesh if mesh is not None else make_mesh(config.mesh)
    check_trainable(config, mesh, reference_model=model is None)
    batch = resolve_batch(config, data_parallel_size(mesh))
    zero = config.zero_optimization
    if model is None:
        model = reference_gpt(config)
    given = sample_batch
    if sample_batch is None:
        sample_batch = {"inputs": np.zeros((batch.micro_batch_per_device, config.data.seq_len), np.int32)}
    elif loss_fn is None and "targets" not in sample_batch:  # lm_loss: next tokens, as `inputs`
        given = {**sample_batch, "targets": sample_batch["inputs"]}
    fns = model_fns(model, sample_inputs=sample_batch["inputs"], params=params, param_axes=param_axes)
    plan = plan_sharding(
        fns.abstract_params, fns.logical_axes, mesh, stage=zero.stage, rules=rules,
        offload_optimizer=zero.offload_optimizer.device == "cpu",
        offload_params=zero.offload_param.device == "cpu",
        explicit_zero3=runs_explicit(config, mesh), host_major=host_major(config, mesh),
    )
    return Engine(
        config=config, mesh=mesh, fns=fns, plan=plan, loss_fn=loss_fn or lm_loss, model=model,
        sample_batch=None if given is None else jax.eval_shape(lambda: given),
    )
