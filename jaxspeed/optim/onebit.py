"""1-bit Adam as an optax transform (Tang et al. 2021, "1-bit Adam", Alg. 1; DeepSpeed's
`OnebitAdam`).

Warm-up (the first `freeze_step` updates) is Adam on the gradient averaged over `axis_name`.
After it the variance is frozen, each worker folds its *local* gradient into the momentum, and
the momentum is averaged with the 1-bit compressed all-reduce of `compressed.py` (sign bits
packed 8 to a byte, one all-to-all and one all-gather, worker and server error feedback). The
error buffers live in the optimizer state, so they are sharded, checkpointed and restored like
the moments (DeepSpeed drops them when it loads a checkpoint).

Differences from DeepSpeed's `OnebitAdam`, on purpose:
  - Bias correction. DeepSpeed accepts `bias_correction` but never applies it. Here
    `bias_correction=True` is Adam's: during warm-up `m / (1 - b1^t)` and `v / (1 - b2^t)`
    (so the warm-up equals `optax.adam` / `optax.adamw` exactly); after the freeze the momentum
    keeps `1 / (1 - b1^t)` and the frozen variance keeps the correction of the last warm-up step,
    `v / (1 - b2^freeze_step)`: the preconditioner is exactly the one in use at the freeze.
    `bias_correction=False` is DeepSpeed's arithmetic (no correction at all).
  - No "initialization step": DeepSpeed's first `step()` updates the moments but not the
    parameters; here every update moves the parameters, as in optax.
  - Compression is per leaf (one scale per leaf, see `compressed.py`), with all leaves in one
    flat buffer and one collective per phase; DeepSpeed compresses each tensor it holds (one
    flat buffer per parameter group with its fp16 optimizer).
  - No `exp_avg_mask` (momentum mask for parameters whose momentum is exactly zero).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec

from jaxspeed.optim.compressed import (
    AxisName,
    bound_axis_size,
    compressed_allreduce,
    error_feedback_sizes,
)
from jaxspeed.sharding.vma import make_varying

#: The keyword that selects the phase statically: `tx.update(g, s, p, onebit_phase=...)`.
PHASE_ARG = "onebit_phase"
WARMUP = "warmup"
COMPRESSED = "compressed"
_PHASES = (None, WARMUP, COMPRESSED)


class OneBitAdamState(NamedTuple):
    """State of `onebit_adam`.

    Attributes:
      count: int32 `[]`, number of updates applied so far.
      mu: like the params, the first moment (after the freeze: the decompressed average).
      nu: like the params, the second moment (frozen after `freeze_step` updates).
      error_worker: f32 `[W, worker]`: the worker's compression error of all leaves, each
        padded to a multiple of 8 N, in the flat layout of `compressed.py`
        (`worker, server = compressed.error_feedback_sizes(params, num_workers=N)`).
      error_server: f32 `[W, server]`: the error of the chunks this worker reduces.
        `W` is 1 in a worker's (local) view and `N` in the global view that `init` returns
        outside `shard_map`: shard dim 0 over the data axis (`onebit_state_specs`).
    """

    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates
    error_worker: jax.Array
    error_server: jax.Array


def onebit_phase(count: int, *, freeze_step: int) -> str:
    """The phase of the update that follows `count` applied updates: "warmup" or "compressed"."""
    return WARMUP if count < freeze_step else COMPRESSED


def _axes(axis_name: AxisName) -> tuple[str, ...]:
    if axis_name is None:
        return ()
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def _check_args(learning_rate, b1, b2, eps, weight_decay, freeze_step, axis_name) -> None:
    if isinstance(freeze_step, bool) or not isinstance(freeze_step, numbers.Integral):
        raise ValueError(
            f"onebit_adam: freeze_step must be a non-negative integer (the number of warm-up "
            f"updates), got {freeze_step!r}"
        )
    if freeze_step < 0:
        raise ValueError(
            f"onebit_adam: freeze_step must be >= 0 (the number of warm-up updates), "
            f"got {freeze_step}"
        )
    for name, beta in (("b1", b1), ("b2", b2)):
        if isinstance(beta, numbers.Real) and not 0.0 <= beta < 1.0:
            raise ValueError(f"onebit_adam: {name} must be in [0, 1), got {beta}")
    for name, value in (("eps", eps), ("weight_decay", weight_decay)):
        if isinstance(value, numbers.Real) and value < 0:
            raise ValueError(f"onebit_adam: {name} must be >= 0, got {value}")
    if not callable(learning_rate) and not isinstance(learning_rate, (numbers.Real, jax.Array)):
        raise ValueError(
            f"onebit_adam: learning_rate must be a number or an optax schedule, "
            f"got {learning_rate!r}"
        )
    is_axes = isinstance(axis_name, tuple) and axis_name and all(
        isinstance(a, str) for a in axis_name
    )
    if axis_name is not None and not (isinstance(axis_name, str) or is_axes):
        raise ValueError(
            f"onebit_adam: axis_name must be None, a mesh axis name or a tuple of them, "
            f"got {axis_name!r}"
        )


def _init_layout(axis_name: AxisName) -> tuple[int, int]:
    """(rows W of the error buffers, workers N) for `init` in the current context."""
    if axis_name is None:
        return 1, 1
    try:
        return 1, int(jax.lax.axis_size(axis_name))  # inside shard_map: a worker's view
    except NameError:
        pass
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and all(a in mesh.axis_names for a in _axes(axis_name)):
        workers = math.prod(mesh.shape[a] for a in _axes(axis_name))
        return workers, workers  # under jax.set_mesh: the global view
    raise ValueError(
        f"onebit_adam: axis_name={axis_name!r} is neither bound (inside jax.shard_map) nor an "
        f"axis of the current mesh (jax.set_mesh), so init cannot size the error buffers; "
        f"mesh axes here: {tuple(mesh.axis_names)}"
    )


def _to_varying(tree: Any, axis_name: AxisName) -> Any:
    """Marks `tree` as varying over `axis_name` (shard_map's check_vma types) where it is not."""

    return jax.tree.map(lambda x: make_varying(x, _axes(axis_name)), tree)


def _check_error_buffers(state: OneBitAdamState, updates: Any, num_workers: int) -> None:
    sizes = error_feedback_sizes(updates, num_workers=num_workers)
    for name, size in zip(("error_worker", "error_server"), sizes):
        shape = tuple(np.shape(getattr(state, name)))
        if shape != (1, size):
            raise ValueError(
                f"onebit_adam: state.{name} has shape {shape}, but one worker out of "
                f"{num_workers} needs {(1, size)} for these parameters. Pass the state into "
                f"jax.shard_map with dim 0 of the error buffers sharded over the axis "
                f"(onebit_state_specs), and use it with the number of workers it was created "
                f"for."
            )


def onebit_adam(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    freeze_step: int = 100000,
    bias_correction: bool = True,
    axis_name: AxisName = None,
) -> optax.GradientTransformationExtraArgs:
    """1-bit Adam (Tang et al. 2021, Alg. 1) with DeepSpeed's semantics.

    Update `t = count + 1` (1-based):
      - `count < freeze_step` (warm-up): `g = pmean(grads, axis_name)` (when `axis_name` is
        set), `m = b1 m + (1 - b1) g`, `v = b2 v + (1 - b2) g^2`.
      - `count >= freeze_step`: `v` frozen; `m = b1 m + (1 - b1) g_local`, then
        `m = compressed_allreduce(m)` over `axis_name` with the error buffers of the state
        (the compressed average replaces the momentum, as in DeepSpeed).
      - Both: `updates = -lr(count) * (m_hat / (sqrt(v_hat) + eps) + weight_decay * params)`,
        `m_hat`, `v_hat` as described in the module docstring (`bias_correction`). With
        `bias_correction=True` and `freeze_step` beyond the run it equals `optax.adam`
        (`optax.adamw` with `weight_decay`, decoupled, on every leaf).

    Use with `axis_name` inside `jax.shard_map` over that axis, each worker passing its local
    gradients (the warm-up averages them; after the freeze only the compressed momentum is
    communicated). The state's error buffers differ per worker: shard their dim 0 over the
    axis (`onebit_state_specs`). With `axis_name=None` it is the same algorithm for one worker
    (the compression and its error feedback still apply, without communication).

    Composes with `optax.chain`. Transforms before it see the *local* gradients inside
    `shard_map`: e.g. `optax.chain(optax.clip_by_global_norm(1.0), onebit_adam(...))` clips
    each worker's gradient by its own norm (DeepSpeed clips the averaged gradient in warm-up).

    Phase selection: under `jit`, `update` picks the phase with `lax.cond(count < freeze_step)`,
    which compiles both communication patterns into the step (called eagerly, it reads the
    count). The extra argument `onebit_phase="warmup"` or `"compressed"` (which `optax.chain`
    forwards) compiles one phase only: e.g. two jitted steps, switched with
    `onebit_phase(count, freeze_step=...)`. The caller then guarantees that it matches `count`.

    Args:
      learning_rate: a float or an optax schedule of the update count.
      b1: decay of the first moment.
      b2: decay of the second moment.
      eps: added to `sqrt(v_hat)`.
      weight_decay: decoupled weight decay (AdamW, DeepSpeed's `update += wd * p`).
      freeze_step: number of warm-up (uncompressed Adam) updates; 0 compresses from the first
        update (then `v` stays 0 and the step is `m / eps`: only for tests).
      bias_correction: Adam's bias correction (see the module docstring).
      axis_name: mesh axis (or tuple of axes) of data parallelism, or None for one worker.

    Returns:
      An `optax.GradientTransformationExtraArgs` with state `OneBitAdamState`. `init` inside
      `shard_map` returns a worker's state (error buffers `[1, ...]`); outside it, under
      `jax.set_mesh(mesh)`, the global state (error buffers `[N, ...]`).

    Raises:
      ValueError: freeze_step < 0 or not an integer, a beta outside [0, 1), negative eps or
        weight_decay, a bad axis_name; at init/update time an `axis_name` that is not bound,
        an unknown `onebit_phase`, error buffers that do not fit, or weight decay without
        params.
    """
    _check_args(learning_rate, b1, b2, eps, weight_decay, freeze_step, axis_name)

    def init_fn(params):
        rows, workers = _init_layout(axis_name)
        worker, server = error_feedback_sizes(params, num_workers=workers)
        return OneBitAdamState(
            count=jnp.zeros([], jnp.int32),
            mu=optax.tree.zeros_like(params),
            nu=optax.tree.zeros_like(params),
            error_worker=jnp.zeros((rows, worker), jnp.float32),
            error_server=jnp.zeros((rows, server), jnp.float32),
        )

    def finish(mu_hat, nu_hat, params, count):
        """The optax update `-lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)`, op for op."""
        updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu_hat, nu_hat)
        if weight_decay:
            updates = jax.tree.map(lambda g, p: g + weight_decay * p, updates, params)
        if callable(learning_rate):
            step = -1 * learning_rate(count)
            return jax.tree.map(lambda g: jnp.array(step, dtype=g.dtype) * g, updates)
        return jax.tree.map(lambda g: -learning_rate * g, updates)

    def warmup(updates, state, params):
        grads = updates if axis_name is None else jax.lax.pmean(updates, axis_name)
        mu = optax.tree.update_moment(grads, state.mu, b1, 1)
        nu = optax.tree.update_moment_per_elem_norm(grads, state.nu, b2, 2)
        count_inc = optax.safe_increment(state.count)
        mu_hat, nu_hat = mu, nu
        if bias_correction:
            mu_hat = optax.tree.bias_correction(mu, b1, count_inc)
            nu_hat = optax.tree.bias_correction(nu, b2, count_inc)
        errors = (state.error_worker, state.error_server)
        if axis_name is not None:  # same check_vma type as the compressed phase's errors
            errors = _to_varying(errors, axis_name)
        new_state = OneBitAdamState(
            count_inc, optax.tree.cast_like(mu, state.mu), optax.tree.cast_like(nu, state.nu),
            *errors,
        )
        return finish(mu_hat, nu_hat, params, state.count), new_state

    def compressed(updates, state, params):
        mu = optax.tree.update_moment(updates, state.mu, b1, 1)
        mu, error_worker, error_server = compressed_allreduce(
            optax.tree.cast_like(mu, state.mu),
            state.error_worker[0],
            state.error_server[0],
            axis_name=axis_name,
        )
        count_inc = optax.safe_increment(state.count)
        mu_hat, nu_hat = mu, state.nu
        if bias_correction:
            mu_hat = optax.tree.bias_correction(mu, b1, count_inc)
            if freeze_step > 0:  # the correction of the last warm-up step, frozen with v
                nu_hat = optax.tree.bias_correction(
                    state.nu, b2, jnp.asarray(freeze_step, jnp.int32)
                )
        new_state = OneBitAdamState(
            count_inc, mu, state.nu, error_worker[None], error_server[None]
        )
        return finish(mu_hat, nu_hat, params, state.count), new_state

    def update_fn(updates, state, params=None, **extra_args):
        phase = extra_args.get(PHASE_ARG)
        if phase not in _PHASES:
            raise ValueError(
                f"onebit_adam: {PHASE_ARG}={phase!r} is not a phase; accepted: "
                f"{WARMUP!r}, {COMPRESSED!r} or None (chosen from the step count)"
            )
        if weight_decay and params is None:
            raise ValueError("onebit_adam: weight_decay > 0 needs params in update(...)")
        num_workers = bound_axis_size(axis_name, caller="onebit_adam update")
        _check_error_buffers(state, updates, num_workers)
        if phase is None and not isinstance(state.count, jax.core.Tracer):
            phase = onebit_phase(int(state.count), freeze_step=freeze_step)  # eager call
        if phase == WARMUP:
            return warmup(updates, state, params)
        if phase == COMPRESSED:
            return compressed(updates, state, params)
        return jax.lax.cond(
            state.count < freeze_step, warmup, compressed, updates, state, params
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def onebit_state_specs(
    opt_state: Any, *, axis_name: AxisName, default: PartitionSpec = PartitionSpec()
) -> Any:
    """PartitionSpecs for an optimizer state holding 1-bit states (e.g. inside a chain).

    Args:
      opt_state: the state (arrays or shape-dtype structs).
      axis_name: the data axis (or axes) the 1-bit all-reduce runs over.
      default: spec of every other leaf (count, moments, other transforms' state).

    Returns:
      A tree like `opt_state` of `PartitionSpec`s: `P(axis_name)` (dim 0, the workers) for the
      error buffers (and the other per-worker fields a state names in `WORKER_FIELDS`, e.g.
      `ZeroOneAdamState`'s), `default` elsewhere. Use it as shard_map in/out specs and for
      `NamedSharding`s of the global state.
    """
    def specs(node):
        if _has_error_feedback(node):
            rows = getattr(node, "WORKER_FIELDS", _ERROR_BUFFERS)
            return type(node)(**{
                name: jax.tree.map(
                    lambda x: PartitionSpec(axis_name) if name in rows else default, value)
                for name, value in node._asdict().items()
            })
        return jax.tree.map(lambda _: default, node)

    return jax.tree.map(specs, opt_state, is_leaf=_has_error_feedback)


_ERROR_BUFFERS = ("error_worker", "error_server")


def _has_error_feedback(node) -> bool:
    """A 1-bit optimizer's state (`OneBitAdamState`, `OneBitLambState`, `ZeroOneAdamState`): a
    NamedTuple holding the compressed all-reduce's error buffers."""
    return hasattr(node, "_asdict") and all(hasattr(node, name) for name in _ERROR_BUFFERS)
