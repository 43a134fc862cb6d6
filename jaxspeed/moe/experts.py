"""Expert feed-forward networks: batched over capacity buffers, dropless, or dynamic capacity.

Three ways to run `E` expert FFNs on routed tokens:
  - `expert_ffn` over dispatched capacity buffers `[E, C, M]`: two batched matmuls (the
    GShard/DeepSpeed/Tutel layout, and what expert parallelism's all-to-all moves);
  - `dropless_ffn`: the `T * k` (token, choice) rows sorted by expert and multiplied with a
    grouped matmul (`jaxspeed.moe.grouped.grouped_matmul`: `jax.lax.ragged_dot`'s product as
    one batched dot over per-expert blocks padded to the busiest expert's rows). Shapes are
    static (`[T * k, M]`) whatever the routing and nothing is ever dropped;
  - dynamic capacity (Tutel's `capacity_factor <= 0`): `capacity_buckets` picks a few static
    capacities up to a cap, and `switch_on_capacity` runs the capacity-buffer path with the
    smallest bucket that holds the busiest expert, via `lax.switch`.

Compile cost of dynamic capacity: every bucket is one branch of a `lax.switch`, so the MoE
layer (dispatch, FFN, combine, and their backward passes) is compiled once per bucket, all in
one executable: compile time and code size grow linearly with `num_buckets` (4 by default),
while a step runs only its chosen branch, with no recompilation. XLA sizes the temporary
buffers for the largest branch. Inside `shard_map`, every device must pick the same bucket
(reduce the counts with `lax.pmax` over the mesh axes first), or collectives inside the
branches would not match.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspeed.moe.grouped import grouped_matmul
from jaxspeed.ops import fp8 as fp8_ops
from jaxspeed.options.moe import ACTIVATIONS



class ExpertParams(NamedTuple):
    """Weights of `E` two-layer FFN experts (`H` hidden units each).

    Attributes:
      w_in: `[E, M, H]`.
      w_out: `[E, H, M]`.
      w_gate: `[E, M, H]`, the gate projection of "swiglu" (None otherwise).
      b_in: optional `[E, H]` bias of the first layer.
      b_out: optional `[E, M]` bias of the second layer.
    """

    w_in: jax.Array
    w_out: jax.Array
    w_gate: jax.Array | None = None
    b_in: jax.Array | None = None
    b_out: jax.Array | None = None


def init_expert_params(rng, num_experts: int, d_model: int, d_hidden: int, *,
                       activation: str = "gelu", bias: bool = False,
                       dtype=jnp.float32) -> ExpertParams:
    """Random `ExpertParams`: normal weights scaled by `1 / sqrt(fan_in)`, zero biases."""
    _check_activation(activation)
    k_in, k_out, k_gate = jax.random.split(rng, 3)

    def normal(key, shape, fan_in):
        return (jax.random.normal(key, shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)

    shape_in = (num_experts, d_model, d_hidden)
    return ExpertParams(
        w_in=normal(k_in, shape_in, d_model),
        w_out=normal(k_out, (num_experts, d_hidden, d_model), d_hidden),
        w_gate=normal(k_gate, shape_in, d_model) if activation == "swiglu" else None,
        b_in=jnp.zeros((num_experts, d_hidden), dtype) if bias else None,
        b_out=jnp.zeros((num_experts, d_model), dtype) if bias else None,
    )


def _check_activation(activation: str):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def _check_params(params: ExpertParams, activation: str):
    _check_activation(activation)
    if (activation == "swiglu") != (params.w_gate is not None):
        raise ValueError(
            f"params.w_gate must be given exactly when activation is 'swiglu'; got "
            f"activation={activation!r} and w_gate "
            f"{'None' if params.w_gate is None else params.w_gate.shape}")
    if params.w_in.ndim != 3 or params.w_out.shape != (
            params.w_in.shape[0], params.w_in.shape[2], params.w_in.shape[1]):
        raise ValueError(
            f"params.w_in must be [E, M, H] and params.w_out [E, H, M], got "
            f"{params.w_in.shape} and {params.w_out.shape}")


def _activate(h_in, h_gate, activation: str):
    """fp32 activation; "gelu" is the exact erf form (PyTorch's default)."""
    if activation == "relu":
        return jax.nn.relu(h_in)
    if activation == "gelu":
        return _gelu(h_in)
    return jax.nn.silu(h_gate) * h_in


@jax.custom_jvp
def _gelu(x):
    """`jax.nn.gelu(x, approximate=False)`, with its derivative written out.

    On jax 0.12 the derivative of `lax.erf` fails inside `shard_map` ("Primitive polynomial
    requires varying manual axes to match": its coefficients do not vary with `x`), and the
    experts run inside `shard_map` under a mesh. `d/dx x*Phi(x) = Phi(x) + x*phi(x)`.
    """
    return jax.nn.gelu(x, approximate=False)


@_gelu.defjvp
def _gelu_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    cdf = 0.5 * jax.lax.erfc(-x * math.sqrt(0.5))
    pdf = jnp.exp(-0.5 * x * x) * (1 / math.sqrt(2 * math.pi))
    return _gelu(x), (cdf + x * pdf) * dx


def expert_ffn(x, params: ExpertParams, *, activation: str = "gelu", fp8: str | None = None):
    """Applies expert `e`'s FFN to its capacity buffer `x[e]`, for every expert at once.

    Args:
      x: `[E, C, M]` dispatched tokens.
      params: `ExpertParams` with `E` experts.
      activation: "relu", "gelu" or "swiglu" (`silu(x @ w_gate) * (x @ w_in)`).
      fp8: None, or the FP8 recipe the matmuls run in (`tensorwise`: a scale per expert's
        weight and buffer; `rowwise`: per row of each; `jaxspeed.ops.fp8`).

    Returns:
      `[E, C, M]` in `x`'s dtype; matmuls accumulate and activations run in fp32.
    """
    _check_params(params, activation)
    f32 = jnp.float32

    einsum = jnp.einsum if fp8 is None else functools.partial(fp8_ops.einsum, recipe=fp8)

    def matmul(a, w):
        return einsum("ecm,emh->ech", a, w.astype(x.dtype), preferred_element_type=f32)

    def project(w, b):
        h = matmul(x, w)  # [E, C, H], fp32
        return h if b is None else h + b.astype(f32)[:, None, :]

    h_gate = project(params.w_gate, None) if activation == "swiglu" else None
    h = _activate(project(params.w_in, params.b_in), h_gate, activation).astype(x.dtype)
    out = matmul(h, params.w_out)
    if params.b_out is not None:
        out = out + params.b_out.astype(f32)[:, None, :]
    return out.astype(x.dtype)


def dropless_ffn(x, expert_index, weight, params: ExpertParams, activation: str = "gelu"):
    """Mixture-of-experts FFN without capacity: every (token, choice) is computed.

    The `T * k` (token, choice) rows are sorted by expert (stable, so each expert sees its
    tokens in order) and the experts run as two grouped matmuls
    (`jaxspeed.moe.grouped.grouped_matmul`, what `jax.lax.ragged_dot` computes) with the
    per-expert counts as group sizes. All shapes are static.

    Args:
      x: `[T, M]` tokens.
      expert_index: int `[T, k]` (e.g. `Routing.expert_index` from `top_k_gating(...,
        drop_tokens=False)`).
      weight: `[T, k]` combine weights (e.g. `Routing.weight`).
      params: `ExpertParams` with `E` experts.
      activation: "relu", "gelu" or "swiglu".

    Returns:
      `[T, M]` in `x`'s dtype: `sum_j weight[t, j] * expert_{e_tj}(x[t])`, accumulated in fp32.
    """
    _check_params(params, activation)
    if x.ndim != 2 or expert_index.ndim != 2 or expert_index.shape[0] != x.shape[0]:
        raise ValueError(
            f"x must be [T, M] and expert_index [T, k] with the same T, got {x.shape} and "
            f"{expert_index.shape}")
    if weight.shape != expert_index.shape:
        raise ValueError(
            f"weight must have expert_index's shape {expert_index.shape}, got {weight.shape}")
    tokens, k = expert_index.shape
    num_experts = params.w_in.shape[0]
    f32 = jnp.float32
    flat_expert = expert_index.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat_expert, stable=True)  # [T*k], rows grouped by expert
    sorted_expert = flat_expert[order]
    rows = x[order // k]
    group_sizes = jnp.bincount(flat_expert, length=num_experts).astype(jnp.int32)

    def project(w, b):
        h = grouped_matmul(rows, w.astype(x.dtype), group_sizes)  # [T*k, H], fp32
        return h if b is None else h + b.astype(f32)[sorted_expert]

    h_gate = project(params.w_gate, None) if activation == "swiglu" else None
    h = _activate(project(params.w_in, params.b_in), h_gate, activation).astype(x.dtype)
    out = grouped_matmul(h, params.w_out.astype(x.dtype), group_sizes)
    if params.b_out is not None:
        out = out + params.b_out.astype(f32)[sorted_expert]
    out = out.astype(x.dtype).astype(f32)  # rounded like the capacity path's expert outputs
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    unsorted = out[inverse].reshape(tokens, k, -1)
    return jnp.sum(weight.astype(f32)[..., None] * unsorted, axis=1).astype(x.dtype)


# ---- dynamic capacity ---------------------------------------------------------------------------


def capacity_buckets(num_tokens: int, num_experts: int, *, k: int, capacity_factor: float,
                     min_capacity: int = 4, num_buckets: int = 4,
                     multiple_of: int = 8) -> tuple[int, ...]:
    """The static capacities that dynamic capacity may choose from, ascending.

    Tutel's `capacity_factor` convention: `> 0` is a fixed capacity (one bucket,
    `max(ceil(k * cf * T / E), min_capacity)`); `< 0` is dynamic, capped at
    `max(ceil(|cf| * k * T / E), min_capacity)`; `0` is dynamic, capped at `T` (never drops).
    Below the cap the buckets halve: `cap, cap/2, cap/4, ...` (`num_buckets` of them), each
    rounded up to `multiple_of` and at least `min_capacity`.

    Returns:
      Ascending distinct ints; the last is the cap.
    """
    if num_buckets < 1 or multiple_of < 1:
        raise ValueError(
            f"num_buckets and multiple_of must be >= 1, got {num_buckets} and {multiple_of}")
    if capacity_factor > 0:
        return (max(math.ceil(k * capacity_factor * num_tokens / num_experts), min_capacity),)
    if capacity_factor == 0:
        cap = num_tokens
    else:
        cap = max(math.ceil(-capacity_factor * k * num_tokens / num_experts), min_capacity)
    buckets = set()
    for i in range(num_buckets):
        size = max(math.ceil(cap / 2**i), min_capacity, 1)
        buckets.add(min(cap, math.ceil(size / multiple_of) * multiple_of))
    return tuple(sorted(buckets))


def select_capacity_bucket(expert_counts, buckets) -> jax.Array:
    """Index of the smallest bucket holding the busiest expert (the last bucket if none does).

    Args:
      expert_counts: int `[E]` choices per expert (`Routing.expert_counts`); under
        `shard_map`, reduce it with `lax.pmax` first so every device agrees.
      buckets: ascending static capacities (`capacity_buckets`).

    Returns:
      int32 scalar in `[0, len(buckets))`.
    """
    table = jnp.asarray(buckets, jnp.int32)
    fits = table >= jnp.max(expert_counts)
    return jnp.where(jnp.any(fits), jnp.argmax(fits), len(buckets) - 1).astype(jnp.int32)


def switch_on_capacity(fn, expert_counts, buckets, *operands):
    """Runs `fn(*operands, capacity=c)` for the bucket `c` that `select_capacity_bucket` picks.

    `fn` typically gates with `top_k_gating(..., capacity=capacity)`, dispatches, runs
    `expert_ffn` and combines; its outputs must have the same shapes for every capacity (the
    combined `[T, M]` tokens and scalar losses do). See the module docstring for the cost.

    Args:
      fn: `fn(*operands, capacity: int) -> pytree`.
      expert_counts: int `[E]`, e.g. from a first `top_k_gating` call (counts do not depend
        on the capacity).
      buckets: ascending static capacities.
      *operands: passed to `fn`.

    Returns:
      `fn`'s output for the chosen bucket.
    """
    branches = [functools.partial(fn, capacity=int(c)) for c in buckets]
    if len(branches) == 1:
        return branches[0](*operands)
    return jax.lax.switch(select_capacity_bucket(expert_counts, buckets), branches, *operands)
