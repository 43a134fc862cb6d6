"""The GPT's plain layers: norms, the feed-forward block, and parameter helpers.

Every parameter carries Flax logical-partitioning metadata; norms compute in float32 whatever
the parameter dtype.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxspeed.ops import fp8 as fp8_ops
from jaxspeed.ops import matmul

Array = jax.Array
Dtype = Any

INIT_STD = 0.02
NORM_EPS = 1e-6


def cast(x: Array, dtype: Dtype | None) -> Array:
    """`x` in `dtype`, or unchanged when `dtype` is None."""
    return x if dtype is None else x.astype(dtype)


def logical_param(
    module: nn.Module, name: str, names: tuple[str, ...], shape: tuple[int, ...], *, std: float
) -> Array:
    """A normal(std)-initialised parameter tagged with logical axis `names`."""
    init = nn.with_logical_partitioning(nn.initializers.normal(std), names)
    return module.param(name, init, shape, module.param_dtype)


class Norm(nn.Module):
    """RMSNorm or LayerNorm over the last axis, computed in float32.

    Attributes:
      kind: "rmsnorm" (scale only) or "layernorm" (scale and bias).
    """

    kind: str = "rmsnorm"
    param_dtype: Dtype = jnp.float32
    eps: float = NORM_EPS

    @nn.compact
    def __call__(self, x: Array) -> Array:
        """Normalises `x: [..., embed]`; returns the same shape and dtype."""
        features = x.shape[-1]
        scale = self.param(
            "scale", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
            (features,), self.param_dtype,
        )
        y = x.astype(jnp.float32)
        if self.kind == "layernorm":
            y = y - jnp.mean(y, axis=-1, keepdims=True)
        y = y * jax.lax.rsqrt(jnp.mean(jnp.square(y), axis=-1, keepdims=True) + self.eps)
        y = y * scale.astype(jnp.float32)
        if self.kind == "layernorm":
            bias = self.param(
                "bias", nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
                (features,), self.param_dtype,
            )
            y = y + bias.astype(jnp.float32)
        return y.astype(x.dtype)



@jax.custom_vjp
def swiglu(gate: Array, up: Array) -> Array:
    """`silu(gate) * up`, whose backward pass keeps only `gate` and `up`.

    Autodiff of `nn.silu(gate) * up` saves four `[.., d_ff]` tensors per layer (gate, its
    sigmoid, silu and up); with scanned layers and no remat XLA:CPU then reads all four back
    through one slow transposing fusion in the backward pass. Recomputing the sigmoid from
    `gate` costs one exp per element. The backward pass ends in an optimization barrier: fused
    into the weight-gradient dots' operand transposes, its elementwise math ran as strided
    loops (16 ms per layer and device for 1 MiB); on its own it is one contiguous pass.
    """
    return jax.nn.silu(gate) * up


def _swiglu_fwd(gate, up):
    return swiglu(gate, up), (gate, up)


def _swiglu_bwd(residuals, g):
    gate, up = residuals
    sig = jax.nn.sigmoid(gate)
    silu = gate * sig
    d_gate = g * up * (sig + silu * (1 - sig))
    return jax.lax.optimization_barrier((d_gate.astype(gate.dtype), (g * silu).astype(up.dtype)))


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


class Mlp(nn.Module):
    """Feed-forward block: GELU or SwiGLU (Shazeer 2020), no biases; its matmuls in FP8
    where `fp8` applies to them."""

    d_ff: int
    kind: str
    out_std: float
    param_dtype: Dtype = jnp.float32
    dtype: Dtype | None = None
    fp8: fp8_ops.Fp8Recipe | None = None

    @nn.compact
    def __call__(self, x: Array) -> Array:
        """`x: [batch, length, embed]` → `[batch, length, embed]`."""
        embed = x.shape[-1]
        x = cast(x, self.dtype)

        def project_in(name: str) -> Array:
            kernel = logical_param(self, name, ("embed", "mlp"), (embed, self.d_ff), std=INIT_STD)
            return fp8_ops.project(self, name, "...e,ef->...f", x, cast(kernel, self.dtype),
                                   self.fp8, matmul.einsum)

        if self.kind == "swiglu":
            h = swiglu(project_in("wi_gate"), project_in("wi_up"))
        else:
            h = nn.gelu(project_in("wi"))
        h = nn.with_logical_constraint(h, ("batch", "length", "mlp"))
        h = checkpoint_name(h, "mlp_hidden")
        wo = logical_param(self, "wo", ("mlp", "embed"), (self.d_ff, embed), std=self.out_std)
        y = fp8_ops.project(self, "wo", "...f,fe->...e", h, cast(wo, self.dtype), self.fp8,
                            matmul.einsum)
        return checkpoint_name(y, "mlp_out")
