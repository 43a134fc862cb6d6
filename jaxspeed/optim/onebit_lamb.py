"""1-bit LAMB as an optax transform (Li et al. 2021, "1-bit LAMB"; DeepSpeed's `OnebitLamb`).

Warm-up (the first `freeze_step` updates) is `jaxspeed.optim.lamb` on the gradient averaged
over `axis_name`, and each leaf's trust ratio is folded into an exponential average
(`coeff_beta`). After it the variance and that average are frozen; each worker folds its local
gradient into the momentum, and the momentum is averaged with the 1-bit compressed all-reduce
of 1-bit Adam (`compressed.py`: packed sign bits, worker and server error feedback). The step is
the frozen-variance Adam direction times the frozen trust ratio times a per-leaf factor that
tracks how far the variance has drifted: a "fresh" variance is kept from the gradient
reconstructed out of consecutive momenta, `factor = max(denom_frozen / denom_fresh)` (with
weight decay blended towards 1 by the decay's share of the step), clipped to
`[factor_min, factor_max]`, then moved at most `factor_threshold` from the last factor.

Differences from DeepSpeed's `OnebitLamb`, on purpose (as `onebit_adam`'s):
  - Adam's bias correction in warm-up (so warm-up equals `lamb` exactly); after the freeze the
    momentum keeps `1 / (1 - b1^t)`, both variances the correction of the freeze step.
  - The trust-ratio average is bias-corrected (`/ (1 - coeff_beta^freeze_step)`): DeepSpeed's
    starts at 0 and, with a short warm-up, freezes a ratio well below the ratios it saw.
  - Ratios and factors are per leaf (a scanned layer stack is one leaf), compression per leaf.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxspeed.optim.compressed import AxisName, bound_axis_size, compressed_allreduce
from jaxspeed.optim.compressed import error_feedback_sizes
from jaxspeed.optim.lamb import _check, trust_ratio
from jaxspeed.optim.onebit import (
    COMPRESSED, PHASE_ARG, WARMUP, _check_error_buffers, _init_layout, _to_varying, onebit_phase,
)


class OneBitLambState(NamedTuple):
    """State of `onebit_lamb` (the error buffers as `OneBitAdamState`'s: `[W, size]`).

    Attributes:
      count: int32 `[]`, updates applied so far.
      mu, nu: the moments (nu frozen after `freeze_step` updates).
      nu_fresh: the variance the compressed phase keeps updating, to measure the drift.
      coeff_freeze: per leaf, f32 `[]`: the averaged trust ratio (frozen with nu).
      last_factor: per leaf, f32 `[]`: the last step's variance factor (1 before the freeze).
      error_worker, error_server: the compressed all-reduce's error feedback.
    """

    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates
    nu_fresh: optax.Updates
    coeff_freeze: Any
    last_factor: Any
    error_worker: jax.Array
    error_server: jax.Array


def onebit_lamb(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    max_coeff: float = 10.0,
    min_coeff: float = 0.01,
    freeze_step: int = 100000,
    coeff_beta: float = 0.9,
    factor_max: float = 4.0,
    factor_min: float = 0.5,
    factor_threshold: float = 0.1,
    axis_name: AxisName = None,
) -> optax.GradientTransformationExtraArgs:
    """1-bit LAMB with DeepSpeed's parameter names (see the module docstring).

    Used as `onebit_adam` is: inside `jax.shard_map` over `axis_name` with local gradients, the
    error buffers' dim 0 sharded over the axis (`onebit_state_specs`), the phase chosen by
    `lax.cond` or statically with `onebit_phase=`. With `freeze_step` beyond the run it equals
    `lamb(learning_rate, b1, b2, eps, weight_decay, max_coeff, min_coeff)`.
    """
    _check(b1, b2, eps, weight_decay, min_coeff, max_coeff, caller="onebit_lamb")
    if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 0:
        raise ValueError(f"onebit_lamb: freeze_step must be an integer >= 0, got {freeze_step!r}")
    if not 0.0 <= coeff_beta < 1.0:
        raise ValueError(f"onebit_lamb: coeff_beta must be in [0, 1), got {coeff_beta}")
    if not 0 < factor_min <= 1.0 <= factor_max:
        raise ValueError(f"onebit_lamb: need 0 < factor_min <= 1 <= factor_max, got "
                         f"{factor_min}, {factor_max}")
    scalars = lambda tree, value: jax.tree.map(lambda _: jnp.full([], value, jnp.float32), tree)  # noqa: E731

    def init_fn(params):
        rows, workers = _init_layout(axis_name)
        worker, server = error_feedback_sizes(params, num_workers=workers)
        zeros = optax.tree.zeros_like(params)
        return OneBitLambState(
            jnp.zeros([], jnp.int32), zeros, zeros, zeros, scalars(params, 0.0),
            scalars(params, 1.0), jnp.zeros((rows, worker), jnp.float32),
            jnp.zeros((rows, server), jnp.float32))

    def with_decay(direction, params):
        if not weight_decay:
            return direction
        return jax.tree.map(lambda u, p: u + weight_decay * p, direction, params)

    def apply(direction, coeffs, count):
        """`-lr(count) * coeff * direction`, leaf by leaf."""
        lr = learning_rate(count) if callable(learning_rate) else learning_rate
        return jax.tree.map(lambda u, c: (-lr * c * u).astype(u.dtype), direction, coeffs)

    def adam_direction(mu_hat, nu_hat):
        return jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu_hat, nu_hat)

    def warmup(grads, state, params):
        if axis_name is not None:
            grads = jax.lax.pmean(grads, axis_name)
        mu = optax.tree.update_moment(grads, state.mu, b1, 1)
        nu = optax.tree.update_moment_per_elem_norm(grads, state.nu, b2, 2)
        count_inc = optax.safe_increment(state.count)
        direction = with_decay(adam_direction(optax.tree.bias_correction(mu, b1, count_inc),
                                              optax.tree.bias_correction(nu, b2, count_inc)),
                               params)
        ratios = jax.tree.map(lambda p, u: trust_ratio(p, u, min_coeff, max_coeff),
                              params, direction)
        updates = apply(direction, ratios, state.count)
        coeff_freeze = jax.tree.map(lambda a, r: coeff_beta * a + (1 - coeff_beta) * r,
                                    state.coeff_freeze, ratios)
        errors = (state.error_worker, state.error_server)
        if axis_name is not None:
            errors = _to_varying(errors, axis_name)
        mu, nu = optax.tree.cast_like(mu, state.mu), optax.tree.cast_like(nu, state.nu)
        return updates, OneBitLambState(count_inc, mu, nu, nu, coeff_freeze, state.last_factor,
                                        *errors)

    def compressed(grads, state, params):
        mu_local = optax.tree.update_moment(grads, state.mu, b1, 1)
        mu, error_worker, error_server = compressed_allreduce(
            optax.tree.cast_like(mu_local, state.mu), state.error_worker[0],
            state.error_server[0], axis_name=axis_name)
        rebuilt = jax.tree.map(lambda new, old: (new - b1 * old) / (1 - b1), mu, state.mu)
        nu_fresh = optax.tree.update_moment_per_elem_norm(rebuilt, state.nu_fresh, b2, 2)
        count_inc = optax.safe_increment(state.count)
        frozen = jnp.asarray(max(freeze_step, 1), jnp.int32)
        denom = jax.tree.map(lambda v: jnp.sqrt(v) + eps,
                             optax.tree.bias_correction(state.nu, b2, frozen))
        fresh = jax.tree.map(lambda v: jnp.sqrt(v) + eps,
                             optax.tree.bias_correction(nu_fresh, b2, frozen))
        mu_hat = optax.tree.bias_correction(mu, b1, count_inc)
        prelim = jax.tree.map(lambda m, d: m / d, mu_hat, denom)
        direction = with_decay(prelim, params)

        def factor(d, f, last, u_prelim, u):
            x = jnp.max(d / f).astype(jnp.float32)
            if weight_decay:  # the decay's share of the step does not scale (DeepSpeed)
                share = jnp.minimum(1.0, jnp.linalg.norm(u_prelim) / jnp.linalg.norm(u))
                x = x * share + (1 - share)
            x = jnp.clip(x, factor_min, factor_max)
            return jnp.clip(x, last * (1 - factor_threshold), last * (1 + factor_threshold))

        factors = jax.tree.map(factor, denom, fresh, state.last_factor, prelim, direction)
        average = 1 - coeff_beta ** max(freeze_step, 1)  # the average's bias correction
        coeffs = jax.tree.map(lambda a, x: a / average * x, state.coeff_freeze, factors)
        updates = apply(direction, coeffs, state.count)
        return updates, OneBitLambState(
            count_inc, mu, state.nu, optax.tree.cast_like(nu_fresh, state.nu_fresh),
            state.coeff_freeze, factors, error_worker[None], error_server[None])

    def update_fn(updates, state, params=None, **extra_args):
        phase = extra_args.get(PHASE_ARG)
        if phase not in (None, WARMUP, COMPRESSED):
            raise ValueError(f"onebit_lamb: {PHASE_ARG}={phase!r} is not a phase; accepted: "
                             f"{WARMUP!r}, {COMPRESSED!r} or None")
        if params is None:
            raise ValueError("onebit_lamb needs params in update(...) (trust ratios)")
        _check_error_buffers(state, updates, bound_axis_size(axis_name, caller="onebit_lamb"))
        if phase is None and not isinstance(state.count, jax.core.Tracer):
            phase = onebit_phase(int(state.count), freeze_step=freeze_step)
        if phase == WARMUP:
            return warmup(updates, state, params)
        if phase == COMPRESSED:
            return compressed(updates, state, params)
        return jax.lax.cond(state.count < freeze_step, warmup, compressed, updates, state, params)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
