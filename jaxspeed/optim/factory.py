"""Optimizers and learning-rate schedules from config, with DeepSpeed's names and semantics.

`optimizer: {type, params}` and `scheduler: {type, params}` use DeepSpeed's keys. Each becomes
an optax object: `make_optimizer` → `optax.GradientTransformation`, `make_schedule` →
`optax.Schedule` (jit-traceable, `step` = number of optimizer updates already applied, so
`schedule(step)` is DeepSpeed's lr at `last_batch_iteration == step`). `build_optimizer` joins
them with the top-level `gradient_clipping`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import optax

from jaxspeed.config import OPTIMIZER_TYPES as _SCHEMA_OPTIMIZER_TYPES
from jaxspeed.config import SCHEDULER_TYPES
from jaxspeed.errors import ConfigError, did_you_mean

#: The config's optimizer types that this factory builds.
OPTIMIZER_TYPES: tuple[str, ...] = _SCHEMA_OPTIMIZER_TYPES
_WARMUP_TYPES: tuple[str, ...] = ("log", "linear")
DEFAULT_LR = 1e-3

_REQUIRED = object()  # marks a params key without a default

# Param spec: key → (default, kind). Kinds are checked by `_check_value`.
_BETAS = "betas"
_OPTIMIZER_PARAMS: dict[str, dict[str, tuple[Any, str]]] = {
    # DeepSpeed's Adam is FusedAdam with adam_w_mode=True: decoupled weight decay.
    "Adam": {
        "lr": (DEFAULT_LR, "float"),
        "betas": ((0.9, 0.999), _BETAS),
        "eps": (1e-8, "float"),
        "weight_decay": (0.0, "float"),
        "adam_w_mode": (True, "bool"),
    },
    # DeepSpeed's AdamW is FusedAdam(adam_w_mode=True), whose weight_decay default is 0.0
    # (torch.optim.AdamW's 0.01 only applies with DeepSpeed's torch_adam).
    "AdamW": {
        "lr": (DEFAULT_LR, "float"),
        "betas": ((0.9, 0.999), _BETAS),
        "eps": (1e-8, "float"),
        "weight_decay": (0.0, "float"),
    },
    # torch.optim.SGD (DeepSpeed falls back to torch.optim for this name), dampening 0.
    "SGD": {
        "lr": (DEFAULT_LR, "float"),
        "momentum": (0.0, "float"),
        "nesterov": (False, "bool"),
        "weight_decay": (0.0, "float"),
    },
    # DeepSpeed's FusedLion.
    "Lion": {
        "lr": (DEFAULT_LR, "float"),
        "betas": ((0.9, 0.99), _BETAS),
        "weight_decay": (0.0, "float"),
    },
    # DeepSpeed's OnebitAdam; cuda_aware and comm_backend_name are accepted and ignored (the
    # compressed all-reduce is an XLA collective).
    "OneBitAdam": {
        "lr": (DEFAULT_LR, "float"),
        "betas": ((0.9, 0.999), _BETAS),
        "eps": (1e-8, "float"),
        "weight_decay": (0.0, "float"),
        "freeze_step": (100000, "int"),
        "bias_correction": (True, "bool"),
        "cuda_aware": (False, "bool"),
        "comm_backend_name": ("nccl", "str"),
    },
    # optax.adafactor's own names and meanings (DeepSpeed has no built-in Adafactor).
    "Adafactor": {
        "lr": (DEFAULT_LR, "float"),
        "decay_rate": (0.8, "float"),
        "eps": (1e-30, "float"),
        "clipping_threshold": (1.0, "float"),
        "weight_decay": (0.0, "float"),
        "multiply_by_parameter_scale": (True, "bool"),
        "min_dim_size_to_factor": (128, "int"),
    },
}

_WARMUP_PARAMS: dict[str, tuple[Any, str]] = {
    "warmup_min_lr": (0.0, "float"),
    "warmup_max_lr": (None, "float"),  # None → the optimizer's lr
    "warmup_num_steps": (1000, "int"),
    "warmup_type": ("log", "str"),
}
_SCHEDULER_PARAMS: dict[str, dict[str, tuple[Any, str]]] = {
    "constant": {},
    "WarmupLR": _WARMUP_PARAMS,
    "WarmupDecayLR": {**_WARMUP_PARAMS, "total_num_steps": (_REQUIRED, "int")},
    "WarmupCosine": {
        "total_num_steps": (_REQUIRED, "int"),
        "warmup_min_ratio": (0.0, "float"),
        "warmup_num_steps": (1000, "int"),
        "cos_min_ratio": (1e-4, "float"),
        "warmup_type": ("log", "str"),
    },
}

_KIND_WORDS = {
    "float": "a number",
    "int": "an integer",
    "bool": "true or false",
    "str": "a string",
    _BETAS: "a list of two numbers",
}


def _canonical_type(value: Any, accepted: tuple[str, ...], *, section: str) -> str:
    """Maps `value` case-insensitively onto one of `accepted` (DeepSpeed lowercases names)."""
    by_lower = {name.lower(): name for name in accepted}
    if isinstance(value, str) and value.lower() in by_lower:
        return by_lower[value.lower()]
    raise ConfigError(
        f"{section}.type {value!r} is not supported; accepted: {', '.join(accepted)}"
        + did_you_mean(str(value), accepted)
    )


def _check_value(value: Any, kind: str, *, key_path: str) -> Any:
    """Returns `value` normalised to `kind`, or raises ConfigError naming `key_path`."""

    def is_number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    if kind == "float" and is_number(value):
        return float(value)
    if kind == "int" and is_number(value) and float(value).is_integer():
        return int(value)
    if kind == "bool" and isinstance(value, bool):
        return value
    if kind == "str" and isinstance(value, str):
        return value
    if kind == _BETAS and isinstance(value, (list, tuple)) and len(value) == 2:
        if all(is_number(b) for b in value):
            return (float(value[0]), float(value[1]))
    raise ConfigError(f"{key_path}: expected {_KIND_WORDS[kind]}, got {value!r}")


def _read_params(
    params: Mapping[str, Any] | None,
    spec: Mapping[str, tuple[Any, str]],
    *,
    section: str,
    type_name: str,
) -> dict[str, Any]:
    """Validates `params` against `spec` and fills the defaults.

    Raises:
      ConfigError: unknown key (with the accepted keys and a did-you-mean), missing required
        key, or a value of the wrong type; the message names `SECTION.params.KEY`.
    """
    params = dict(params or {})
    accepted = sorted(spec)
    for key in params:
        if key not in spec:
            hint = ""
            if key == "max_grad_norm":
                hint = " (use the top-level gradient_clipping instead)"
            raise ConfigError(
                f"{section}.params.{key}: unknown key for {section}.type {type_name}; "
                f"accepted: {', '.join(accepted) or '(none)'}"
                + (hint or did_you_mean(key, accepted))
            )
    values = {}
    for key, (default, kind) in spec.items():
        if key not in params:
            if default is _REQUIRED:
                raise ConfigError(
                    f"{section}.params.{key} is required for {section}.type {type_name}"
                )
            values[key] = default
        else:
            values[key] = _check_value(params[key], kind, key_path=f"{section}.params.{key}")
    return values


def base_learning_rate(optimizer_cfg) -> float:
    """The optimizer's `params.lr` (default 1e-3): the peak lr schedules scale."""
    params = optimizer_cfg.params or {}
    return _check_value(params.get("lr", DEFAULT_LR), "float", key_path="optimizer.params.lr")


# ----------------------------------------------------------------------------- schedules


def _warmup_gamma(warmup_type: str, num_steps: int) -> Callable[[Any], jnp.ndarray]:
    """DeepSpeed's warmup fraction at `step < num_steps`: log(step+1)/log(n) or step/n."""
    if warmup_type == "log":
        inv_log = 1.0 / math.log(num_steps)
        return lambda step: jnp.log(jnp.asarray(step, jnp.float32) + 1.0) * inv_log
    return lambda step: jnp.asarray(step, jnp.float32) / num_steps


def _warmup_settings(p: dict[str, Any]) -> tuple[int, str]:
    if p["warmup_num_steps"] <= 0:
        raise ConfigError(
            f"scheduler.params.warmup_num_steps must be a positive integer, "
            f"got {p['warmup_num_steps']}"
        )
    if p["warmup_type"] not in _WARMUP_TYPES:
        raise ConfigError(
            f"scheduler.params.warmup_type {p['warmup_type']!r} is not supported; "
            f"accepted: {', '.join(_WARMUP_TYPES)}"
        )
    # DeepSpeed clamps to 2 so that log(warmup_num_steps) > 0.
    return max(2, p["warmup_num_steps"]), p["warmup_type"]


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
      scheduler_cfg: object with `.type` and `.params` (DeepSpeed keys), or None for constant.
      base_lr: the optimizer's lr (`base_learning_rate(optimizer_cfg)`).

    Returns:
      `schedule(step) -> f32[]`, `step` the 0-based number of optimizer updates applied.

    Raises:
      ConfigError: unknown type or params key, missing `total_num_steps`, bad value.
    """
    if scheduler_cfg is None:
        return optax.constant_schedule(base_lr)
    name = _canonical_type(scheduler_cfg.type, SCHEDULER_TYPES, section="scheduler")
    p = _read_params(
        scheduler_cfg.params, _SCHEDULER_PARAMS[name], section="scheduler", type_name=name
    )
    if name == "constant":
        return optax.constant_schedule(base_lr)
    warmup_steps, warmup_type = _warmup_settings(p)
    gamma = _warmup_gamma(warmup_type, warmup_steps)

    if name == "WarmupCosine":
        wmin, cmin, total = p["warmup_min_ratio"], p["cos_min_ratio"], p["total_num_steps"]
        warmup = lambda s: base_lr * (wmin + (1.0 - wmin) * gamma(s))  # noqa: E731
        cosine = optax.cosine_decay_schedule(
            base_lr, decay_steps=max(1, total - warmup_steps), alpha=cmin
        )
        # DeepSpeed's first post-warmup step is already one step into the cosine.
        decay = lambda s: jnp.maximum(cosine(s + 1), 0.0)  # noqa: E731
        return optax.join_schedules([warmup, decay], boundaries=[warmup_steps])

    min_lr = p["warmup_min_lr"]
    max_lr = base_lr if p["warmup_max_lr"] is None else p["warmup_max_lr"]
    if warmup_type == "linear":
        warmup = optax.linear_schedule(min_lr, max_lr, transition_steps=warmup_steps)
    else:
        warmup = lambda s: min_lr + (max_lr - min_lr) * gamma(s)  # noqa: E731
    if name == "WarmupLR":
        after = optax.constant_schedule(max_lr)
    elif p["total_num_steps"] - warmup_steps >= 1:
        after = optax.linear_schedule(
            max_lr, min_lr, transition_steps=p["total_num_steps"] - warmup_steps
        )
    else:  # total_num_steps <= W: DeepSpeed's decay factor is already 0 after warmup.
        after = optax.constant_schedule(min_lr)
    return optax.join_schedules([warmup, after], boundaries=[warmup_steps])


# ---------------------------------------------------------------------------- optimizers


def _adam(p: dict[str, Any], lr: optax.ScalarOrSchedule) -> optax.GradientTransformation:
    (b1, b2), eps, wd = p["betas"], p["eps"], p["weight_decay"]
    if wd == 0.0:
        return optax.adam(lr, b1=b1, b2=b2, eps=eps)
    if p.get("adam_w_mode", True):
        return optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd)
    # adam_w_mode: false is classic Adam with L2: the decay joins the gradient before the moments.
    return optax.chain(
        optax.add_decayed_weights(wd),
        optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
        optax.scale_by_learning_rate(lr),
    )


def _sgd(p: dict[str, Any], lr: optax.ScalarOrSchedule) -> optax.GradientTransformation:
    sgd = optax.sgd(lr, momentum=p["momentum"] or None, nesterov=p["nesterov"])
    if p["weight_decay"] == 0.0:
        return sgd
    # torch.optim.SGD adds weight_decay * param to the gradient before the momentum.
    return optax.chain(optax.add_decayed_weights(p["weight_decay"]), sgd)


def _lion(p: dict[str, Any], lr: optax.ScalarOrSchedule) -> optax.GradientTransformation:
    b1, b2 = p["betas"]
    return optax.lion(lr, b1=b1, b2=b2, weight_decay=p["weight_decay"])


def _adafactor(p: dict[str, Any], lr: optax.ScalarOrSchedule) -> optax.GradientTransformation:
    return optax.adafactor(
        lr,
        min_dim_size_to_factor=p["min_dim_size_to_factor"],
        decay_rate=p["decay_rate"],
        multiply_by_parameter_scale=p["multiply_by_parameter_scale"],
        clipping_threshold=p["clipping_threshold"] or None,
        # optax adds this after the lr scaling: it is not multiplied by the lr.
        weight_decay_rate=p["weight_decay"] or None,
        eps=p["eps"],
    )


def _onebit(p: dict[str, Any], lr: optax.ScalarOrSchedule, axis_name=None):
    from jaxspeed.optim.onebit import onebit_adam

    b1, b2 = p["betas"]
    if p["freeze_step"] < 0:
        raise ConfigError(f"optimizer.params.freeze_step must be >= 0, got {p['freeze_step']}")
    return onebit_adam(
        lr, b1=b1, b2=b2, eps=p["eps"], weight_decay=p["weight_decay"],
        freeze_step=p["freeze_step"], bias_correction=p["bias_correction"], axis_name=axis_name,
    )


_BUILDERS: dict[str, Callable[[dict[str, Any], optax.ScalarOrSchedule], Any]] = {
    "Adam": _adam,
    "AdamW": _adam,
    "SGD": _sgd,
    "Lion": _lion,
    "Adafactor": _adafactor,
}


def make_optimizer(
    optimizer_cfg, *, learning_rate: optax.ScalarOrSchedule, axis_name=None
) -> optax.GradientTransformation:
    """Builds the optax optimizer for `optimizer: {type, params}` (DeepSpeed param names).

    - `Adam` {lr, betas, eps, weight_decay=0, adam_w_mode=true}: like DeepSpeed's FusedAdam,
      weight decay is decoupled (`optax.adamw`) unless `adam_w_mode: false`, which adds
      `weight_decay * param` to the gradient (L2) before the Adam moments.
    - `AdamW` {lr, betas, eps, weight_decay=0}: `optax.adamw` (0 is FusedAdam's default).
    - `SGD` {lr, momentum=0, nesterov=false, weight_decay=0}: torch.optim.SGD, L2 decay.
    - `Lion` {lr, betas=[0.9, 0.99], weight_decay=0}: `optax.lion` (decoupled decay).
    - `Adafactor` {lr, decay_rate=0.8, eps=1e-30, clipping_threshold=1 (0 = off),
      weight_decay=0, multiply_by_parameter_scale=true, min_dim_size_to_factor=128}:
      `optax.adafactor` with optax's meanings.
    - `OneBitAdam` {lr, betas, eps, weight_decay=0, freeze_step=100000, bias_correction=true}:
      `jaxspeed.optim.onebit_adam`, communicating over `axis_name`.

    Args:
      optimizer_cfg: object with `.type` and `.params`.
      learning_rate: float or `optax.Schedule`; it replaces `params.lr` (only validated here).
      axis_name: for `OneBitAdam`, the data-parallel mesh axes of its all-reduce.

    Returns:
      The optimizer as an `optax.GradientTransformation`.

    Raises:
      ConfigError: unknown type or params key, or a wrong value type.
    """
    name = _canonical_type(optimizer_cfg.type, OPTIMIZER_TYPES, section="optimizer")
    p = _read_params(
        optimizer_cfg.params, _OPTIMIZER_PARAMS[name], section="optimizer", type_name=name
    )
    if name == "OneBitAdam":
        return _onebit(p, learning_rate, axis_name)
    return _BUILDERS[name](p, learning_rate)


def onebit_freeze_step(optimizer_cfg) -> int:
    """`optimizer.params.freeze_step` of a `OneBitAdam` config (validated, default applied)."""
    p = _read_params(
        optimizer_cfg.params, _OPTIMIZER_PARAMS["OneBitAdam"], section="optimizer",
        type_name="OneBitAdam",
    )
    return p["freeze_step"]


def build_optimizer(
    config, *, clip_outside: bool = False, axis_name=None
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Builds the clipped optimizer and its lr schedule from the full config.

    Args:
      config: object with `.optimizer`, `.scheduler` (may be None: constant lr) and
        `.gradient_clipping` (max global norm; 0 = off).
      clip_outside: the caller clips the gradients itself (on the device, before a host
        update: optax's global norm cannot run as a host computation). `tx` then chains
        `optax.identity()` in the clipping's place, so its state has the same structure.
      axis_name: the data-parallel axes (`OneBitAdam` only).

    Returns:
      `(tx, schedule)`: `tx` is `chain(clip_by_global_norm(c), optimizer)` when `c > 0`, else
      the optimizer; `schedule(step)` is the lr the optimizer uses at `step` (for logging).
    """
    if config.optimizer is None:
        raise ConfigError(f"optimizer is required; accepted types: {', '.join(OPTIMIZER_TYPES)}")
    schedule = make_schedule(config.scheduler, base_lr=base_learning_rate(config.optimizer))
    tx = make_optimizer(config.optimizer, learning_rate=schedule, axis_name=axis_name)
    clip = _check_value(config.gradient_clipping or 0.0, "float", key_path="gradient_clipping")
    if clip < 0:
        raise ConfigError(f"gradient_clipping must be >= 0 (0 = off), got {clip}")
    if clip > 0:
        tx = optax.chain(optax.identity() if clip_outside else optax.clip_by_global_norm(clip), tx)
    return tx, schedule
