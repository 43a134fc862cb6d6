"""Compiled memory of the pipeline schedules: 1F1B bounded by the stages, GPipe by residuals.

The stage is two MLP blocks (`h + gelu(h @ w1) @ w2`, H = 4 D): one microbatch's autodiff
residuals (41 KiB) and the stage weights (64 KiB) are of the same size, so the checks can tell
which of them a schedule keeps per microbatch. Memory comes from `compiled.memory_analysis()`
(compile only, nothing runs).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType

from jaxspeed.pipeline.spmd import spmd_pipeline

S, D, ROWS, BLOCKS = 2, 32, 8, 2  # stages, width, rows per microbatch, blocks per stage


def _stage(p, h):
    for i in range(BLOCKS):
        h = h + jax.nn.gelu(h @ p["w1"][i]) @ p["w2"][i]
    return h


def _loss(head, y, targets):
    return jnp.mean((y @ head - targets) ** 2)


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "w1": jnp.asarray(rng.standard_normal((S, BLOCKS, D, 4 * D)) * D**-0.5, jnp.float32),
        "w2": jnp.asarray(rng.standard_normal((S, BLOCKS, 4 * D, D)) * 0.1, jnp.float32),
    }


@functools.lru_cache(maxsize=None)
def _temp_bytes(schedule: str, microbatches: int) -> int:
    """Per-device temp bytes of the compiled loss + grads step (pipe=S x data=8/S)."""
    mesh = jax.make_mesh((S, 8 // S), ("pipe", "data"), axis_types=(AxisType.Auto,) * 2)
    batch = microbatches * ROWS
    x = jax.ShapeDtypeStruct((batch, D), jnp.float32)
    head = jax.ShapeDtypeStruct((D, 4), jnp.float32)
    targets = jnp.zeros((batch, 4), jnp.float32)

    def loss(params, x, head):
        return spmd_pipeline(
            _stage, params, x, num_microbatches=microbatches, schedule=schedule, mesh=mesh,
            loss_fn=_loss, loss_params=head, loss_inputs=targets,
        )

    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _params())
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    return step.lower(params, x, head).compile().memory_analysis().temp_size_in_bytes


@functools.lru_cache(maxsize=None)
def _residual_bytes_per_microbatch() -> int:
    """Bytes autodiff keeps per microbatch for one stage, measured, not derived from JAX's
    internals: the temp growth per iteration of `grad` through a plain `lax.scan` of the
    stage over microbatches, the weights loop-invariant (so not stacked)."""

    def temp(microbatches):
        def loss(p, xs):
            return jnp.sum(lax.scan(lambda c, x: (c, _stage(p, x)), None, xs)[1])

        one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), _params())
        xs = jax.ShapeDtypeStruct((microbatches, ROWS, D), jnp.float32)
        step = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(one, xs).compile()
        return step.memory_analysis().temp_size_in_bytes

    return (temp(16) - temp(8)) // 8


def test_1f1b_temp_is_below_gpipe_and_sublinear_in_microbatches():
    """The issue's check: M = 4S against M = 8S."""
    gpipe, one_f_one_b = _temp_bytes("gpipe", 4 * S), _temp_bytes("1f1b", 4 * S)
    gpipe_8s, one_f_one_b_8s = _temp_bytes("gpipe", 8 * S), _temp_bytes("1f1b", 8 * S)
    # GPipe holds M + S - 1 steps of residuals, 1F1B an S-slot ring of stage inputs plus the
    # one microbatch whose stage the backward branch recomputes: (4S + S - 1) against ~1 here.
    assert one_f_one_b < 0.75 * gpipe
    # 1F1B: only input-sized buffers grow with M (the ring holds S microbatches' inputs).
    assert one_f_one_b_8s < 1.25 * one_f_one_b
    # GPipe keeps every microbatch's residuals: it grows by about M x residuals.
    assert gpipe_8s - gpipe > 0.75 * 4 * S * _residual_bytes_per_microbatch()


def test_gpipe_keeps_activations_not_weights_per_step():
    """Autodiff through the schedule stacks each step's residuals; the stage weights must not
    be among them (they would add the stage's weight bytes per step, more than its
    activations at this size)."""
    extra_steps = 8 * S - 4 * S  # the table has M + S - 1 forward steps
    growth = _temp_bytes("gpipe", 8 * S) - _temp_bytes("gpipe", 4 * S)
    weights = sum(a[0].size * a.dtype.itemsize for a in jax.tree.leaves(_params()))
    per_step = _residual_bytes_per_microbatch()
    assert weights >= per_step  # the check below can tell the two apart
    assert growth < extra_steps * (per_step + weights / 2)
