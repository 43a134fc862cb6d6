"""Optimizers and learning-rate schedules from config, with DeepSpeed's names and semantics.

`optimizer: {type, params}` and `scheduler: {type, params}` use DeepSpeed's keys. Each becomes
an optax object: `make_optimizer` → `optax.GradientTransformation`, `make_schedule` →
`optax.Schedule` (jit-traceable, `step` = number of optimizer updates already applied, so
`schedule(step)` is DeepSpeed's lr at `last_batch_iteration == step`). `build_optimizer` joins
them with the top-level `gradient_clipping`. The sections' models (`jaxspeed.config.optimizer`)
validate the params, with their defaults; this module only builds from them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import optax
from pydantic import BaseModel

from jaxspeed.config import Config, load_config
from jaxspeed.config.loading import validate_section
from jaxspeed.config.optimizer import DEFAULT_LR as DEFAULT_LR  # re-exported
from jaxspeed.config.optimizer import OPTIMIZER_TYPES as OPTIMIZER_TYPES  # re-exported
from jaxspeed.config.optimizer import (
    AdafactorParams,
    AdamParams,
    AdamWParams,
    LionParams,
    MuonParams,
    ONEBIT_TYPES,
    LambParams,
    OneBitAdamParams,
    OneBitLambParams,
    OptimizerConfig,
    SchedulerConfig,
    SGDParams,
    ZeroOneAdamParams,
)
from jaxspeed.errors import ConfigError


_SECTIONS = {"optimizer": OptimizerConfig, "scheduler": SchedulerConfig}


def _raw(cfg: Any) -> Any:
    """An object with `.type` and `.params` as the mapping a config file holds."""
    if cfg is None or isinstance(cfg, (Mapping, BaseModel)):
        return cfg
    return {"type": cfg.type, "params": cfg.params or {}}


def _typed(cfg: Any, section: str) -> Any:
    """`cfg` as the typed model of config `section` (`optimizer` or `scheduler`).

    A typed model passes as it is; anything else (an object with `.type` and `.params`, or a
    mapping) is validated as the config file's `section` would be.

    Raises:
      ConfigError: every invalid key, named `SECTION.params.KEY`.
    """
    if isinstance(cfg, BaseModel):
        return cfg
    return validate_section(_SECTIONS[section], _raw(cfg), at=section)


def base_learning_rate(optimizer_cfg) -> float:
    """The optimizer's `params.lr` (default 1e-3): the peak lr schedules scale."""
    return _typed(optimizer_cfg, "optimizer").params.lr


# ----------------------------------------------------------------------------- schedules


def _warmup_gamma(warmup_type: str, num_steps: int) -> Callable[[Any], jnp.ndarray]:
    """DeepSpeed's warmup fraction at `step < num_steps`: log(step+1)/log(n) or step/n."""
    if warmup_type == "log":
        inv_log = 1.0 / math.log(num_steps)
        return lambda step: jnp.log(jnp.asarray(step, jnp.float32) + 1.0) * inv_log
    return lambda step: jnp.asarray(step, jnp.float32) / num_steps


def make_schedule(scheduler_cfg, *, base_lr: float) -> optax.Schedule:
    """Builds DeepSpeed's lr schedule as a jit-traceable `optax.Schedule`.

    With `W = max(2, warmup_num_steps)`, `g(s) = log(s+1)/log(W)` (log) or `s/W` (linear):
      - `constant` (or no scheduler): `base_lr`.
      - `WarmupLR`: `min + (max - min) * g(s)` for `s < W`, then `max`. `warmup_max_lr`
        defaults to `base_lr` (the optimizer's lr, as current DeepSpeed does for WarmupLR; old
        DeepSpeed and its WarmupDecayLR use 0.001).
      - `WarmupDecayLR`: as WarmupLR, then
        `min + (max - min) * max(0, (T - s) / max(1, T - W))` with `T = total_num_steps`: a
        linear decay that reaches `warmup_min_lr` (0 by default) at `T`.
      - `WarmupCosine`: `base_lr * r(s)` with `r = wmin + (1 - wmin) * g(s)` for `s < W`, then
        `r = max(0, c + (1 - c) * (1 + cos(pi * p)) / 2)` with
        `p = min(1, (s - W + 1) / max(1, T - W))`, `wmin = warmup_min_ratio`, `c = cos_min_ratio`.

    Args:
      scheduler_cfg: a `SchedulerConfig` (or an object with `.type` and `.params`, validated
        as the config's `scheduler`), or None for constant.
      base_lr: the optimizer's lr (`base_learning_rate(optimizer_cfg)`).

    Returns:
      `schedule(step) -> f32[]`, `step` the 0-based number of optimizer updates applied.

    Raises:
      ConfigError: an untyped `scheduler_cfg` with an unknown type or params key, a missing
        `total_num_steps`, or a bad value.
    """
    if scheduler_cfg is None:
        return optax.constant_schedule(base_lr)
    cfg = _typed(scheduler_cfg, "scheduler")
    if cfg.type == "constant":
        return optax.constant_schedule(base_lr)
    p = cfg.params
    # DeepSpeed clamps to 2 so that log(warmup_num_steps) > 0.
    warmup_steps = max(2, p.warmup_num_steps)
    gamma = _warmup_gamma(p.warmup_type, warmup_steps)

    if cfg.type == "WarmupCosine":
        wmin, cmin, total = p.warmup_min_ratio, p.cos_min_ratio, p.total_num_steps
        warmup = lambda s: base_lr * (wmin + (1.0 - wmin) * gamma(s))  # noqa: E731
        cosine = optax.cosine_decay_schedule(
            base_lr, decay_steps=max(1, total - warmup_steps), alpha=cmin
        )
        # DeepSpeed's first post-warmup step is already one step into the cosine.
        decay = lambda s: jnp.maximum(cosine(s + 1), 0.0)  # noqa: E731
        return optax.join_schedules([warmup, decay], boundaries=[warmup_steps])

    min_lr = p.warmup_min_lr
    max_lr = base_lr if p.warmup_max_lr is None else p.warmup_max_lr
    if p.warmup_type == "linear":
        warmup = optax.linear_schedule(min_lr, max_lr, transition_steps=warmup_steps)
    else:
        warmup = lambda s: min_lr + (max_lr - min_lr) * gamma(s)  # noqa: E731
    if cfg.type == "WarmupLR":
        after = optax.constant_schedule(max_lr)
    elif p.total_num_steps - warmup_steps >= 1:
        after = optax.linear_schedule(
            max_lr, min_lr, transition_steps=p.total_num_steps - warmup_steps
        )
    else:  # total_num_steps <= W: DeepSpeed's decay factor is already 0 after warmup.
        after = optax.constant_schedule(min_lr)
    return optax.join_schedules([warmup, after], boundaries=[warmup_steps])


# ---------------------------------------------------------------------------- optimizers


def _adam(
    p: AdamParams | AdamWParams, lr: optax.ScalarOrSchedule, *, decoupled: bool
) -> optax.GradientTransformation:
    (b1, b2), eps, wd = p.betas, p.eps, p.weight_decay
    if wd == 0.0:
        return optax.adam(lr, b1=b1, b2=b2, eps=eps)
    if decoupled:
        return optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd)
    # adam_w_mode: false is classic Adam with L2: the decay joins the gradient before the moments.
    return optax.chain(
        optax.add_decayed_weights(wd),
        optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
        optax.scale_by_learning_rate(lr),
    )


def _sgd(p: SGDParams, lr: optax.ScalarOrSchedule) -> optax.GradientTransformation:
    sgd = optax.sgd(lr, momentum=p.momentum or None, nesterov=p.nesterov)
    if p.weight_decay == 0.0:
        return sgd
    # torch.optim.SGD adds weight_decay * param to the gradient before the momentum.
    return optax.chain(optax.add_decayed_weights(p.weight_decay), sgd)


def _lion(p: LionParams, lr: optax.ScalarOrSchedule) -> optax.GradientTransformation:
    b1, b2 = p.betas
    return optax.lion(lr, b1=b1, b2=b2, weight_decay=p.weight_decay)


def _adafactor(p: AdafactorParams, lr: optax.ScalarOrSchedule) -> optax.GradientTransformation:
    return optax.adafactor(
        lr,
        min_dim_size_to_factor=p.min_dim_size_to_factor,
        decay_rate=p.decay_rate,
        multiply_by_parameter_scale=p.multiply_by_parameter_scale,
        clipping_threshold=p.clipping_threshold or None,
        # optax adds this after the lr scaling: it is not multiplied by the lr.
        weight_decay_rate=p.weight_decay or None,
        eps=p.eps,
    )


def _onebit(
    p: OneBitAdamParams, lr: optax.ScalarOrSchedule, axis_name
) -> optax.GradientTransformation:
    from jaxspeed.optim.onebit import onebit_adam

    b1, b2 = p.betas
    return onebit_adam(
        lr, b1=b1, b2=b2, eps=p.eps, weight_decay=p.weight_decay,
        freeze_step=p.freeze_step, bias_correction=p.bias_correction, axis_name=axis_name,
    )


def _lamb(p: LambParams, lr: optax.ScalarOrSchedule) -> optax.GradientTransformation:
    from jaxspeed.optim.lamb import lamb

    b1, b2 = p.betas
    return lamb(lr, b1=b1, b2=b2, eps=p.eps, weight_decay=p.weight_decay,
                max_coeff=p.max_coeff, min_coeff=p.min_coeff)


def _onebit_lamb(
    p: OneBitLambParams, lr: optax.ScalarOrSchedule, axis_name
) -> optax.GradientTransformation:
    from jaxspeed.optim.onebit_lamb import onebit_lamb

    b1, b2 = p.betas
    return onebit_lamb(
        lr, b1=b1, b2=b2, eps=p.eps, weight_decay=p.weight_decay, max_coeff=p.max_coeff,
        min_coeff=p.min_coeff, freeze_step=p.freeze_step, coeff_beta=p.coeff_beta,
        factor_max=p.factor_max, factor_min=p.factor_min, factor_threshold=p.factor_threshold,
        axis_name=axis_name,
    )


def _zero_one_adam(
    p: ZeroOneAdamParams, lr: optax.ScalarOrSchedule, axis_name
) -> optax.GradientTransformation:
    from jaxspeed.optim.zero_one_adam import zero_one_adam

    b1, b2 = p.betas
    return zero_one_adam(
        lr, b1=b1, b2=b2, eps=p.eps, weight_decay=p.weight_decay,
        var_freeze_step=p.var_freeze_step, var_update_scaler=p.var_update_scaler,
        local_step_scaler=p.local_step_scaler, local_step_clipper=p.local_step_clipper,
        bias_correction=p.bias_correction, axis_name=axis_name,
    )


def _muon(p: MuonParams, lr: optax.ScalarOrSchedule, layout) -> optax.GradientTransformation:
    """Muon; AdamW's `adamw_lr` follows the same schedule, scaled by `adamw_lr / lr`."""
    from jaxspeed.optim.muon import Layout, muon
    from jaxspeed.optim.muon_price import cluster_rates

    adamw_lr = p.adamw_lr
    if adamw_lr is not None and callable(lr) and p.lr:
        adamw_lr = lambda step: lr(step) * (p.adamw_lr / p.lr)  # noqa: E731
    return muon(
        lr, beta=p.momentum, nesterov=p.nesterov, ns_steps=p.ns_steps, rms_scale=p.rms_scale,
        weight_decay=p.weight_decay, split_heads=p.split_heads, adamw_params=p.adamw_params,
        adamw_learning_rate=adamw_lr, adamw_betas=p.betas, adamw_eps=p.eps,
        adamw_weight_decay=p.adamw_weight_decay, placement=p.placement,
        rates=cluster_rates(p.cluster), layout=layout or Layout(), qk_clip=p.qk_clip,
        qk_clip_alpha=p.qk_clip_alpha,
    )


_BUILDERS: dict[str, Callable[[Any, optax.ScalarOrSchedule], optax.GradientTransformation]] = {
    "Adam": lambda p, lr: _adam(p, lr, decoupled=p.adam_w_mode),
    "AdamW": functools.partial(_adam, decoupled=True),
    "SGD": _sgd,
    "Lion": _lion,
    "Adafactor": _adafactor,
    "Lamb": _lamb,
}


def make_optimizer(
    optimizer_cfg, *, learning_rate: optax.ScalarOrSchedule, axis_name=None, layout=None
) -> optax.GradientTransformation:
    """Builds the optax optimizer for `optimizer: {type, params}` (DeepSpeed param names).

    The params and their defaults are the models of `jaxspeed.config.optimizer`.

    - `Adam`: like DeepSpeed's FusedAdam, weight decay is decoupled (`optax.adamw`) unless
      `adam_w_mode: false`, which adds `weight_decay * param` to the gradient (L2) before the
      Adam moments.
    - `AdamW`: `optax.adamw` (weight_decay 0 is FusedAdam's default).
    - `SGD`: torch.optim.SGD, L2 decay.
    - `Lion`: `optax.lion` (decoupled decay).
    - `Adafactor`: `optax.adafactor` with optax's meanings (`clipping_threshold` 0 = off).
    - `OneBitAdam`: `jaxspeed.optim.onebit_adam`, communicating over `axis_name`.
    - `Lamb`: `jaxspeed.optim.lamb` (FusedLamb's clamped trust ratio).
    - `OneBitLamb`: `jaxspeed.optim.onebit_lamb`, communicating over `axis_name`.
    - `ZeroOneAdam`: `jaxspeed.optim.zero_one_adam`, communicating over `axis_name`.
    - `Muon`: `jaxspeed.optim.muon` on the weight matrices (by `layout`'s logical axes),
      AdamW on the rest.

    Args:
      optimizer_cfg: an `OptimizerConfig` (or an object with `.type` and `.params`, validated
        as the config's `optimizer`).
      learning_rate: float or `optax.Schedule`; it replaces `params.lr`.
      axis_name: for the 1-bit optimizers, the data-parallel mesh axes of their all-reduce.
      layout: for Muon, the params' `jaxspeed.optim.muon.Layout` (None: 2-D leaves are the
        matrices, each where it lives).

    Returns:
      The optimizer as an `optax.GradientTransformation`.

    Raises:
      ConfigError: an untyped `optimizer_cfg` with an unknown type or params key, or a wrong
        value.
    """
    cfg = _typed(optimizer_cfg, "optimizer")
    if cfg.type == "OneBitAdam":
        return _onebit(cfg.params, learning_rate, axis_name)
    if cfg.type == "OneBitLamb":
        return _onebit_lamb(cfg.params, learning_rate, axis_name)
    if cfg.type == "ZeroOneAdam":
        return _zero_one_adam(cfg.params, learning_rate, axis_name)
    if cfg.type == "Muon":
        return _muon(cfg.params, learning_rate, layout)
    return _BUILDERS[cfg.type](cfg.params, learning_rate)


def onebit_phases(optimizer_cfg) -> tuple[tuple[str, ...], Callable[[int], str]]:
    """The phases of a 1-bit optimizer's config (each its own compiled step, the first the
    default one) and `phase_of(step)`, the phase of the update after `step` applied ones.

    Raises:
      ConfigError: an optimizer that is not one of `ONEBIT_TYPES`.
    """
    from jaxspeed.optim.onebit import COMPRESSED, WARMUP, onebit_phase
    from jaxspeed.optim.zero_one_adam import PHASES, zero_one_phase

    cfg = _typed(optimizer_cfg, "optimizer")
    if cfg.type not in ONEBIT_TYPES:
        raise ConfigError(f"optimizer.type {cfg.type} has no 1-bit phases "
                          f"({', '.join(ONEBIT_TYPES)} have)")
    p = cfg.params
    if cfg.type == "ZeroOneAdam":
        return PHASES, functools.partial(
            zero_one_phase, var_freeze_step=p.var_freeze_step,
            var_update_scaler=p.var_update_scaler, local_step_scaler=p.local_step_scaler,
            local_step_clipper=p.local_step_clipper)
    return (WARMUP, COMPRESSED), functools.partial(onebit_phase, freeze_step=p.freeze_step)


def build_optimizer(
    config, *, clip_outside: bool = False, axis_name=None, plan=None
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Builds the clipped optimizer and its lr schedule from the full config.

    Args:
      config: a `Config`, or an object with `.optimizer`, `.scheduler` (None: constant lr)
        and `.gradient_clipping` (max global norm; 0 = off), and optionally `.model` (a
        mapping or `ModelConfig`, for `model.moe.balance`), validated as a config's would be.
      clip_outside: the caller clips the gradients itself (on the device, before a host
        update: optax's global norm cannot run as a host computation). `tx` then chains
        `optax.identity()` in the clipping's place, so its state has the same structure.
      axis_name: the data-parallel axes (the 1-bit optimizers only).
      plan: the params' `jaxspeed.sharding.Plan` (Muon only: which axes of a leaf are its
        matrices, and where their Newton–Schulz runs; on the device unless `clip_outside`).

    Returns:
      `(tx, schedule)`: `tx` is `chain(clip_by_global_norm(c), optimizer)` when `c > 0`, else
      the optimizer, and with `model.moe.balance: bias` that for every param but the MoE
      selection biases, which move by DeepSeek-V3's sign rule
      (`jaxspeed.moe.balance.with_bias_update`); `schedule(step)` is the lr the optimizer uses
      at `step` (for logging).

    Raises:
      ConfigError: every invalid key of an untyped `config`'s three keys, in one message.
    """
    if not isinstance(config, Config):
        raw = {
            "optimizer": _raw(config.optimizer),
            "gradient_clipping": config.gradient_clipping or 0.0,
        }
        if config.scheduler is not None:
            raw["scheduler"] = _raw(config.scheduler)
        model = getattr(config, "model", None)
        if isinstance(model, (Mapping, BaseModel)):  # its `moe.balance: bias` is the optimizer's
            raw["model"] = model
        config = load_config(raw)
    schedule = make_schedule(config.scheduler, base_lr=base_learning_rate(config.optimizer))
    layout = None
    if plan is not None and config.optimizer.type == "Muon":
        from jaxspeed.optim.muon import layout_of

        layout = layout_of(plan, placed=not clip_outside)
    tx = make_optimizer(config.optimizer, learning_rate=schedule, axis_name=axis_name,
                        layout=layout)
    clip = config.gradient_clipping
    if clip > 0:
        tx = optax.chain(optax.identity() if clip_outside else optax.clip_by_global_norm(clip), tx)
    moe = config.model.moe
    if moe is not None and moe.balance == "bias":  # the selection biases move by the sign rule
        from jaxspeed.moe.balance import with_bias_update

        tx = with_bias_update(tx, moe.bias_update_rate)
    return tx, schedule
