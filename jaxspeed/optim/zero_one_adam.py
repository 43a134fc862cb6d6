"""0/1 Adam as an optax transform (Lu et al. 2022, "Maximizing Communication Efficiency for
Large-scale Training via 0/1 Adam", Alg. 1; DeepSpeed's `ZeroOneAdam`).

Update `t = count + 1` (1-based) is one of four kinds (`zero_one_phase`), each a different
communication pattern:
  - `t <= var_freeze_step`, adaptive variance freezing. The variance is updated at the steps of
    the `var_update_scaler` policy: every step at first, and after every `var_update_scaler`
    variance updates the interval between them doubles (1, 2, 4, ...; a variance step is one
    whose `t` is a multiple of the interval). A **variance** step averages the gradients in
    full precision (`pmean`) and updates both moments; a **gradient** step averages them with
    the 1-bit compressed all-reduce (`compressed.py`, worker and server error feedback) and
    updates the momentum only.
  - `t > var_freeze_step`, local steps. The variance is frozen. Each worker folds its *local*
    gradient into its own momentum and takes a local step, accumulated in `drift` (DeepSpeed's
    `momentum_accumulator`, the paper's `u`). The interval between synchronisations starts at
    1 and doubles every `local_step_scaler` steps, up to `local_step_clipper` (the paper's H);
    a step whose `t` is a multiple of it is a **sync** step, the others **local** steps (no
    communication at all). A sync averages `drift * (sqrt(v) + eps)` with the 1-bit compressed
    all-reduce, applies the average, and rebuilds the momentum from it (its lr-weighted mean
    over the interval).

The parameters the transform is given (`params` in `update`) are the *synchronised* ones: they
move only at variance, gradient and sync steps, identically on every worker. Between syncs a
worker's own parameters are `params + drift` (`worker_params`), where it computes its gradient.
That keeps everything but the workers' own momenta (`mu_local`), the drift and the error buffers
the same on all workers, so the synchronised parameters and `mu` stay replicated (shard_map
proves it: no value that differs between workers flows into them but through the compressed
all-reduce). The price is memory: two param-sized buffers beside Adam's two (`mu_local`, the
workers' momenta between syncs, and `drift`), where DeepSpeed keeps one (its accumulator) and
lets each worker's parameters and momentum drift in place.

Differences from DeepSpeed's `ZeroOneAdam`, on purpose:
  - Bias correction (`bias_correction=True`, the default), as in `onebit_adam`: the momentum
    `/ (1 - b1^t)`, the variance `/ (1 - b2^k)` with `k` its number of updates so far (frozen
    with it). DeepSpeed takes the flag and never applies it; `bias_correction=False` is its
    arithmetic. The momentum's correction is folded into each local step's size, and the
    rebuilt momentum divides by the sum of those sizes (DeepSpeed: the sum of the lrs).
  - Weight decay stays out of the rebuilt momentum. DeepSpeed's accumulator holds
    `lr * (m / denom + wd * p)`, and its rebuilt momentum `-u * denom / sum(lr)` carries a
    `wd * p * denom` term into the next steps (roughly doubling the decay for ~1/(1-b1) steps
    after each sync). Here that term is subtracted, with the synchronised `params` for the
    workers' `p` (exact up to the drift within one interval). With `weight_decay=0` the two are
    the same.
  - `var_freeze_step` is the last step that may update the variance (the paper's
    `max T_v`); DeepSpeed's phase switch lands one step later.
  - No "initialization step" (every update moves the parameters) and no `exp_avg_mask`, as in
    `onebit_adam`; with one worker (`axis_name=None`) the compression still runs (DeepSpeed
    skips it and, on its gradient steps, the momentum update too).
  - The error buffers are zeroed at the first step after the freeze (they then carry the
    accumulated step instead of the gradient), as DeepSpeed does; they are kept in the state
    (checkpointed), as in `onebit_adam`.
"""

from __future__ import annotations

import functools
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxspeed.config.optimizer import ZeroOneAdamParams
from jaxspeed.optim.compressed import AxisName, bound_axis_size, compressed_allreduce
from jaxspeed.optim.compressed import error_feedback_sizes
from jaxspeed.optim.onebit import PHASE_ARG, _check_error_buffers, _init_layout, _to_varying

#: DeepSpeed's defaults of the schedule's knobs, declared once, by the config section.
_DEEPSPEED = ZeroOneAdamParams.model_fields

#: The update kinds, in `zero_one_phase`'s index order (pass one as `onebit_phase=`).
VARIANCE = "variance"  # full-precision average of the gradients; both moments updated
GRADIENT = "gradient"  # 1-bit average of the gradients; momentum updated, variance kept
LOCAL = "local"  # local gradient, local step, no communication
SYNC = "sync"  # local step, then the 1-bit average of the accumulated steps
PHASES = (VARIANCE, GRADIENT, LOCAL, SYNC)


class ZeroOneAdamState(NamedTuple):
    """State of `zero_one_adam`.

    Attributes:
      count: int32 `[]`, updates applied so far.
      var_count: int32 `[]`, variance updates so far (its bias correction).
      mu: like the params, the momentum of the workers together: the momentum until the
        freeze, then the one rebuilt at the last sync.
      nu: like the params, the variance (frozen after `var_freeze_step`).
      mu_local: per leaf `[W, *shape]`: each worker's own momentum (`mu` until the freeze and
        right after each sync; between syncs it folds in the worker's local gradients).
      drift: per leaf `[W, *shape]`: each worker's local steps since the last sync (its
        parameters are `params + drift`); 0 until the freeze.
      lr_sum: f32 `[]`, the sum of the lrs since the last sync.
      step_sum: f32 `[]`, the sum of the momentum's step sizes (lr times its bias
        correction) since the last sync.
      error_worker, error_server: f32 `[W, size]`, the compressed all-reduce's error feedback.
        `W` is 1 in a worker's view (inside `shard_map`, or `axis_name=None`) and the number
        of workers in the global view `init` returns under `jax.set_mesh`: shard dim 0 of
        `WORKER_FIELDS` over the axis (`onebit_state_specs`).
    """

    count: jax.Array
    var_count: jax.Array
    mu: optax.Updates
    nu: optax.Updates
    mu_local: optax.Updates
    drift: optax.Updates
    lr_sum: jax.Array
    step_sum: jax.Array
    error_worker: jax.Array
    error_server: jax.Array

    #: the fields with one row per worker (dim 0 sharded over the data axes)
    WORKER_FIELDS = ("mu_local", "drift", "error_worker", "error_server")


class ZeroOneSchedule(NamedTuple):
    """The static policy of `zero_one_adam`: which kind each update is (`index`)."""

    var_freeze_step: int
    #: the last step (1-based) of each variance-interval block; block j's interval is 2**j
    variance_block_ends: tuple[int, ...]
    local_step_scaler: int
    local_step_clipper: int

    @classmethod
    def of(cls, var_freeze_step: int, var_update_scaler: int, local_step_scaler: int,
           local_step_clipper: int) -> ZeroOneSchedule:
        ends, last, interval = [], 0, 1
        while last < var_freeze_step:  # DeepSpeed's counters: doubling after κ updates
            first = (last // interval + 1) * interval
            last = first + (var_update_scaler - 1) * interval
            ends.append(last)
            interval *= 2
        return cls(var_freeze_step, tuple(ends), local_step_scaler, local_step_clipper)

    def index(self, count, xp=np):
        """`PHASES` index of the update after `count` applied ones (numpy or jax.numpy)."""
        t = count + 1
        block = xp.searchsorted(xp.asarray(self.variance_block_ends or (0,)), t, side="left")
        variance = t % xp.left_shift(1, xp.minimum(block, 30)) == 0
        doublings = xp.maximum(t - self.var_freeze_step - 1, 0) // self.local_step_scaler
        local_interval = xp.minimum(self.local_step_clipper,
                                    xp.left_shift(1, xp.minimum(doublings, 30)))
        sync = t % local_interval == 0
        return xp.where(t <= self.var_freeze_step, xp.where(variance, 0, 1),
                        xp.where(sync, 3, 2))


def zero_one_phase(count: int, *, var_freeze_step: int,
                   var_update_scaler: int = _DEEPSPEED["var_update_scaler"].default,
                   local_step_scaler: int = _DEEPSPEED["local_step_scaler"].default,
                   local_step_clipper: int = _DEEPSPEED["local_step_clipper"].default) -> str:
    """The kind (`PHASES`) of the update that follows `count` applied updates."""
    schedule = ZeroOneSchedule.of(var_freeze_step, var_update_scaler, local_step_scaler,
                                  local_step_clipper)
    return PHASES[int(schedule.index(count))]


def worker_params(params: Any, opt_state: Any) -> Any:
    """The parameters a worker computes its gradient at: `params` plus the drift of the
    `ZeroOneAdamState` in `opt_state` (a worker's view, inside `shard_map` or with one
    worker); `params` itself when `opt_state` holds none."""
    states = [node for node in jax.tree.leaves(
        opt_state, is_leaf=lambda n: isinstance(n, ZeroOneAdamState))
        if isinstance(node, ZeroOneAdamState)]
    if not states:
        return params
    return jax.tree.map(lambda p, d: p + d[0].astype(p.dtype), params, states[0].drift)


def _check_args(b1, b2, eps, weight_decay, counts) -> None:
    for name, beta in (("b1", b1), ("b2", b2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"zero_one_adam: {name} must be in [0, 1), got {beta}")
    for name, value in (("eps", eps), ("weight_decay", weight_decay)):
        if value < 0:
            raise ValueError(f"zero_one_adam: {name} must be >= 0, got {value}")
    for name, (value, low) in counts.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
            raise ValueError(f"zero_one_adam: {name} must be an integer >= {low}, got {value!r}")


def zero_one_adam(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    var_freeze_step: int = _DEEPSPEED["var_freeze_step"].default,
    var_update_scaler: int = _DEEPSPEED["var_update_scaler"].default,
    local_step_scaler: int = _DEEPSPEED["local_step_scaler"].default,
    local_step_clipper: int = _DEEPSPEED["local_step_clipper"].default,
    bias_correction: bool = True,
    axis_name: AxisName = None,
) -> optax.GradientTransformationExtraArgs:
    """0/1 Adam (Lu et al. 2022, Alg. 1) with DeepSpeed's parameter names (module docstring).

    Every kind: `m_hat = m / (1 - b1^t)`, `v_hat = v / (1 - b2^k)` (`bias_correction`), a step
    `-lr(count) * (m_hat / (sqrt(v_hat) + eps) + weight_decay * p)`. Variance and gradient
    steps apply it to `params`; local and sync steps to the worker's `params + drift`, and a
    sync then moves `params` by the compressed average of the workers' accumulated steps.

    Use it as `onebit_adam`: inside `jax.shard_map` over `axis_name` with each worker's local
    gradient taken at `worker_params(params, state)`, the `WORKER_FIELDS` of the state sharded
    over the axis on dim 0 (`onebit_state_specs`). `update` picks the kind with `lax.switch`
    under `jit` (it reads the count when called eagerly); `onebit_phase=` one of `PHASES`
    compiles one kind only (`zero_one_phase(count, ...)` says which). With `axis_name=None` it
    is the one-worker algorithm (compression and error feedback included). With
    `var_update_scaler` and `var_freeze_step` beyond the run it is `optax.adamw`.

    Args:
      learning_rate: a float or an optax schedule of the update count.
      b1, b2, eps: Adam's.
      weight_decay: decoupled weight decay.
      var_freeze_step: the last update (1-based) that may update the variance.
      var_update_scaler: variance updates per interval before the interval doubles (kappa).
      local_step_scaler: steps after the freeze before the sync interval doubles (again).
      local_step_clipper: the largest sync interval (H).
      bias_correction: Adam's bias correction (module docstring).
      axis_name: mesh axis (or tuple of axes) of data parallelism, or None for one worker.

    Returns:
      An `optax.GradientTransformationExtraArgs` with state `ZeroOneAdamState`.

    Raises:
      ValueError: a bad hyperparameter; at update time an unbound axis, an unknown phase,
        missing params or error buffers that do not fit.
    """
    _check_args(b1, b2, eps, weight_decay, {
        "var_freeze_step": (var_freeze_step, 0), "var_update_scaler": (var_update_scaler, 1),
        "local_step_scaler": (local_step_scaler, 1), "local_step_clipper": (local_step_clipper, 1),
    })
    schedule = ZeroOneSchedule.of(var_freeze_step, var_update_scaler, local_step_scaler,
                                  local_step_clipper)

    def init_fn(params):
        rows, workers = _init_layout(axis_name)
        worker, server = error_feedback_sizes(params, num_workers=workers)
        def stacked():  # one row per worker
            return jax.tree.map(lambda p: jnp.zeros((rows, *p.shape), p.dtype), params)

        return ZeroOneAdamState(
            jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32), optax.tree.zeros_like(params),
            optax.tree.zeros_like(params), stacked(), stacked(), jnp.zeros([], jnp.float32),
            jnp.zeros([], jnp.float32), jnp.zeros((rows, worker), jnp.float32),
            jnp.zeros((rows, server), jnp.float32))

    def lr_at(count):
        lr = learning_rate(count) if callable(learning_rate) else learning_rate
        return jnp.asarray(lr, jnp.float32)

    def momentum_correction(count_inc):
        if not bias_correction:
            return jnp.float32(1)
        return 1 / (1 - jnp.float32(b1) ** count_inc.astype(jnp.float32))

    def denominator(nu, var_count):
        if bias_correction:  # no correction before the first variance update (v is 0 then)
            k = jnp.maximum(var_count, 1).astype(jnp.float32)
            nu = jax.tree.map(lambda v: v / (1 - jnp.float32(b2) ** k), nu)
        return jax.tree.map(lambda v: jnp.sqrt(v) + eps, nu)

    def rows(tree):
        return jax.tree.map(lambda x: x[0], tree)

    def stack(tree, like):
        tree = jax.tree.map(lambda x, old: x.astype(old.dtype)[None], tree, like)
        return _to_varying(tree, axis_name) if axis_name is not None else tree

    def errors_of(state):
        errors = (state.error_worker, state.error_server)
        return _to_varying(errors, axis_name) if axis_name is not None else errors

    def before_freeze(grads, state, params, *, variance):
        error_worker, error_server = errors_of(state)
        if variance:
            grads = grads if axis_name is None else jax.lax.pmean(grads, axis_name)
        else:
            grads, ew, es = compressed_allreduce(
                grads, state.error_worker[0], state.error_server[0], axis_name=axis_name)
            error_worker, error_server = ew[None], es[None]
        mu = optax.tree.cast_like(optax.tree.update_moment(grads, state.mu, b1, 1), state.mu)
        nu, var_count = state.nu, state.var_count
        if variance:
            nu = optax.tree.cast_like(
                optax.tree.update_moment_per_elem_norm(grads, state.nu, b2, 2), state.nu)
            var_count = var_count + 1
        count_inc = optax.safe_increment(state.count)
        step = lr_at(state.count) * momentum_correction(count_inc)
        denom = denominator(nu, var_count)
        updates = jax.tree.map(
            lambda m, d, p: (-step * m / d - lr_at(state.count) * weight_decay * p).astype(p.dtype),
            mu, denom, params)
        return updates, state._replace(
            count=count_inc, var_count=var_count, mu=mu, nu=nu, mu_local=stack(mu, mu),
            drift=stack(rows(state.drift), rows(state.drift)), error_worker=error_worker,
            error_server=error_server)

    def after_freeze(grads, state, params, *, sync):
        mu = optax.tree.update_moment(grads, rows(state.mu_local), b1, 1)
        count_inc = optax.safe_increment(state.count)
        lr = lr_at(state.count)
        step = lr * momentum_correction(count_inc)
        denom = denominator(state.nu, state.var_count)
        drift = jax.tree.map(
            lambda u, m, d, p: u - step * m / d - lr * weight_decay * (p + u),
            rows(state.drift), mu, denom, params)
        lr_sum, step_sum = state.lr_sum + lr, state.step_sum + step
        if not sync:
            return optax.tree.zeros_like(params), state._replace(
                count=count_inc, mu_local=stack(mu, mu), drift=stack(drift, drift),
                lr_sum=lr_sum, step_sum=step_sum, error_worker=errors_of(state)[0],
                error_server=errors_of(state)[1])
        first = state.count == var_freeze_step  # the errors held the gradient's until now
        error_worker = jnp.where(first, 0.0, state.error_worker[0])
        error_server = jnp.where(first, 0.0, state.error_server[0])
        scaled = jax.tree.map(lambda u, d: u * d, drift, denom)
        average, error_worker, error_server = compressed_allreduce(
            scaled, error_worker, error_server, axis_name=axis_name)
        updates = jax.tree.map(lambda a, d, p: (a / d).astype(p.dtype), average, denom, params)
        # the lr-weighted mean momentum, without the decay's share (module docstring)
        def rebuilt(a, d, p, old):
            return ((a + weight_decay * lr_sum * d * p) / -step_sum).astype(old.dtype)

        mu = jax.tree.map(rebuilt, average, denom, params, state.mu)
        zero = jnp.zeros([], jnp.float32)
        return updates, state._replace(
            count=count_inc, mu=mu, mu_local=stack(mu, mu),
            drift=stack(optax.tree.zeros_like(drift), drift), lr_sum=zero, step_sum=zero,
            error_worker=error_worker[None], error_server=error_server[None])

    kinds = (functools.partial(before_freeze, variance=True),
             functools.partial(before_freeze, variance=False),
             functools.partial(after_freeze, sync=False),
             functools.partial(after_freeze, sync=True))

    def update_fn(updates, state, params=None, **extra_args):
        phase = extra_args.get(PHASE_ARG)
        if phase not in (None, *PHASES):
            raise ValueError(f"zero_one_adam: {PHASE_ARG}={phase!r} is not a phase; accepted: "
                             f"{', '.join(map(repr, PHASES))} or None (chosen from the count)")
        if params is None:
            raise ValueError("zero_one_adam needs params in update(...) (the synchronised "
                             "parameters the local steps start from)")
        _check_error_buffers(state, updates,
                             bound_axis_size(axis_name, caller="zero_one_adam update"))
        if phase is None and not isinstance(state.count, jax.core.Tracer):
            phase = PHASES[int(schedule.index(int(state.count)))]  # eager call
        if phase is not None:
            return kinds[PHASES.index(phase)](updates, state, params)
        return jax.lax.switch(schedule.index(state.count, jnp), kinds, updates, state, params)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
