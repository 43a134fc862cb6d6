"""LAMB (You et al. 2020) with DeepSpeed's clamped trust ratio, from optax's parts.

`optax.lamb` scales each leaf's Adam update by `||p|| / ||u||` unclamped; DeepSpeed's FusedLamb
(and its 1-bit LAMB) clamps that ratio to `[min_coeff, max_coeff]`. `lamb` here is
`scale_by_adam` → decoupled weight decay → the clamped ratio → `-lr`. The ratio is per leaf, as
in optax: a scanned stack of layers (`[layers, ...]`) is one leaf, so its layers share a ratio.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax


def trust_ratio(param: jax.Array, update: jax.Array, min_coeff: float, max_coeff: float):
    """`clip(||p|| / ||u||, min_coeff, max_coeff)`, 1 where either norm is 0 (DeepSpeed's rule)."""
    p_norm = jnp.linalg.norm(param.astype(jnp.float32))
    u_norm = jnp.linalg.norm(update.astype(jnp.float32))
    ratio = jnp.where((p_norm > 0) & (u_norm > 0), p_norm / jnp.where(u_norm > 0, u_norm, 1), 1.0)
    return jnp.clip(ratio, min_coeff, max_coeff)


def scale_by_clamped_trust_ratio(min_coeff: float = 0.01, max_coeff: float = 10.0
                                 ) -> optax.GradientTransformation:
    """Each leaf's update times `trust_ratio(param, update)` (stateless)."""

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("scale_by_clamped_trust_ratio needs params in update(...)")
        scaled = jax.tree.map(
            lambda u, p: (u * trust_ratio(p, u, min_coeff, max_coeff)).astype(u.dtype),
            updates, params)
        return scaled, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def lamb(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    max_coeff: float = 10.0,
    min_coeff: float = 0.01,
) -> optax.GradientTransformation:
    """LAMB with DeepSpeed FusedLamb's parameters: Adam's bias-corrected update `u`, plus
    `weight_decay * p`, times the clamped trust ratio, times `-lr`."""
    _check(b1, b2, eps, weight_decay, min_coeff, max_coeff, caller="lamb")
    return optax.chain(
        optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
        optax.add_decayed_weights(weight_decay),
        scale_by_clamped_trust_ratio(min_coeff, max_coeff),
        optax.scale_by_learning_rate(learning_rate),
    )


def _check(b1, b2, eps, weight_decay, min_coeff, max_coeff, *, caller: str) -> Any:
    for name, beta in (("b1", b1), ("b2", b2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{caller}: {name} must be in [0, 1), got {beta}")
    for name, value in (("eps", eps), ("weight_decay", weight_decay), ("min_coeff", min_coeff)):
        if value < 0:
            raise ValueError(f"{caller}: {name} must be >= 0, got {value}")
    if max_coeff < min_coeff:
        raise ValueError(f"{caller}: max_coeff ({max_coeff}) must be >= min_coeff ({min_coeff})")
