"""Precision policy (bf16 / fp16 / fp32) and DeepSpeed's dynamic loss scaling as pure state.

The engine, with fp16 enabled, does per step:

    scaled_grads = grad(lambda p: scale_loss(loss_fn(p), ls))(params)
    grads = unscale_grads(scaled_grads, ls)
    finite = all_finite(grads)
    new_params, new_opt_state = select_tree(finite, (updated_params, updated_opt_state),
                                            (params, opt_state))   # skip the step on overflow
    ls = update_loss_scale(ls, finite, **loss_scale_options(config.fp16))
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxspeed.errors import ConfigError


def _enabled(section: Any) -> bool:
    return section is not None and bool(section.enabled)


def compute_dtype(config) -> jnp.dtype:
    """The dtype activations and matmuls run in.

    Args:
      config: object with `.bf16.enabled` and `.fp16.enabled` (a section may be None).

    Returns:
      `bfloat16` if bf16 is enabled, `float16` if fp16 is, else `float32`.

    Raises:
      ConfigError: both are enabled (DeepSpeed rejects this too).
    """
    bf16, fp16 = _enabled(config.bf16), _enabled(config.fp16)
    if bf16 and fp16:
        raise ConfigError("bf16.enabled and fp16.enabled cannot both be true; enable one")
    if bf16:
        return jnp.dtype(jnp.bfloat16)
    if fp16:
        return jnp.dtype(jnp.float16)
    return jnp.dtype(jnp.float32)


def _is_floating(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def cast_floating(tree: Any, dtype: jnp.dtype) -> Any:
    """Casts the floating-point array leaves of `tree` to `dtype`; other leaves are unchanged."""
    return jax.tree.map(lambda x: x.astype(dtype) if _is_floating(x) else x, tree)


def all_finite(tree: Any) -> jax.Array:
    """`bool[]`: True when no floating-point leaf of `tree` holds an inf or a NaN."""
    checks = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if _is_floating(x)]
    if not checks:
        return jnp.asarray(True)
    return jnp.all(jnp.stack(checks))


class LossScaleState(NamedTuple):
    """Dynamic loss-scale state (DeepSpeed's `DynamicLossScaler` as arrays).

    Attributes:
      scale: `f32[]` the current loss scale.
      good_steps: `i32[]` steps since the last overflow (DeepSpeed's
        `cur_iter - last_overflow_iter` after the update; 0 right after an overflow).
      hysteresis: `i32[]` overflows still tolerated before the scale is halved
        (DeepSpeed's `cur_hysteresis`).
    """

    scale: jax.Array
    good_steps: jax.Array
    hysteresis: jax.Array


def loss_scale_options(fp16_cfg) -> dict[str, Any]:
    """Keyword arguments of `update_loss_scale` from the `fp16` config section.

    Args:
      fp16_cfg: object with `loss_scale_window`, `hysteresis`, `min_loss_scale` and
        `consecutive_hysteresis` (DeepSpeed keys; the last may be missing → False).

    Returns:
      `{"window", "hysteresis", "min_scale", "consecutive_hysteresis"}`.
    """
    return dict(
        window=int(fp16_cfg.loss_scale_window),
        hysteresis=int(fp16_cfg.hysteresis),
        min_scale=float(fp16_cfg.min_loss_scale),
        consecutive_hysteresis=bool(getattr(fp16_cfg, "consecutive_hysteresis", False)),
    )


def init_loss_scale(fp16_cfg) -> LossScaleState:
    """Initial state: `scale = 2**initial_scale_power`, full hysteresis, no good steps yet.

    Args:
      fp16_cfg: object with `initial_scale_power` and `hysteresis` (DeepSpeed keys).

    Raises:
      ConfigError: `hysteresis < 1`.
    """
    hysteresis = int(fp16_cfg.hysteresis)
    if hysteresis < 1:
        raise ConfigError(f"fp16.hysteresis must be >= 1, got {hysteresis}")
    return LossScaleState(
        scale=jnp.asarray(2.0 ** fp16_cfg.initial_scale_power, jnp.float32),
        good_steps=jnp.asarray(0, jnp.int32),
        hysteresis=jnp.asarray(hysteresis, jnp.int32),
    )


def update_loss_scale(
    state: LossScaleState,
    finite: jax.Array,
    *,
    window: int,
    hysteresis: int,
    min_scale: float,
    consecutive_hysteresis: bool = False,
) -> LossScaleState:
    """One step of DeepSpeed's `DynamicLossScaler.update_scale` (scale factor 2), jit-able.

    The rule, with `cur` = `state.hysteresis` and `n` = `state.good_steps`:
      - overflow (`finite` is False): if `hysteresis == 1 or cur == 1`, then
        `scale = max(scale / 2, min_scale)` (cur unchanged); else `cur -= 1` (scale kept).
        `n = 0` in both cases.
      - no overflow: `n += 1`; if `consecutive_hysteresis`, `cur = hysteresis`. If `n` is a
        multiple of `window`: `scale *= 2` and `cur = hysteresis`.

    So growth happens every `window` good steps since the last overflow (the count keeps running
    after a growth), and by default only an overflow-free window refills the hysteresis;
    `consecutive_hysteresis` refills it after any good step. DeepSpeed raises when an overflow
    hits a scale already at `min_scale`; a traced function cannot, so here the scale just
    stays at `min_scale` (the step is still skipped by the caller).

    Args:
      state: current `LossScaleState`.
      finite: `bool[]` whether this step's gradients were all finite.
      window: `fp16.loss_scale_window`, good steps between doublings (>= 1).
      hysteresis: `fp16.hysteresis` (DeepSpeed's `delayed_shift`, >= 1).
      min_scale: `fp16.min_loss_scale`.
      consecutive_hysteresis: `fp16.consecutive_hysteresis`.

    Returns:
      The next `LossScaleState`.
    """
    if window < 1:
        raise ConfigError(f"fp16.loss_scale_window must be >= 1, got {window}")
    if hysteresis < 1:
        raise ConfigError(f"fp16.hysteresis must be >= 1, got {hysteresis}")
    finite = jnp.asarray(finite, jnp.bool_)
    full = jnp.asarray(hysteresis, jnp.int32)

    # Overflow branch.
    shrink = (hysteresis == 1) | (state.hysteresis == 1)
    overflow_scale = jnp.where(
        shrink, jnp.maximum(state.scale / 2.0, jnp.float32(min_scale)), state.scale
    )
    overflow_hysteresis = jnp.where(shrink, state.hysteresis, state.hysteresis - 1)

    # No-overflow branch.
    good_steps = state.good_steps + 1
    grow = good_steps % window == 0
    good_scale = jnp.where(grow, state.scale * 2.0, state.scale)
    good_hysteresis = jnp.where(grow | consecutive_hysteresis, full, state.hysteresis)

    return LossScaleState(
        scale=jnp.where(finite, good_scale, overflow_scale).astype(jnp.float32),
        good_steps=jnp.where(finite, good_steps, 0).astype(jnp.int32),
        hysteresis=jnp.where(finite, good_hysteresis, overflow_hysteresis).astype(jnp.int32),
    )


def scale_loss(loss: jax.Array, state: LossScaleState) -> jax.Array:
    """`loss * scale` in float32 (an fp16 loss times 2**16 would overflow in fp16)."""
    return jnp.asarray(loss, jnp.float32) * state.scale


def unscale_grads(grads: Any, state: LossScaleState) -> Any:
    """Divides every gradient leaf by the loss scale (in float32), keeping each leaf's dtype."""
    return jax.tree.map(lambda g: (g.astype(jnp.float32) / state.scale).astype(g.dtype), grads)


def select_tree(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """Leafwise `where(pred, on_true, on_false)`: keeps the old params/opt_state on overflow."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)
