"""Reference GPT decoder (Flax Linen) written with logical axes.

Every parameter carries Flax logical-partitioning metadata (`vocab`, `embed`, `length`, `heads`,
`kv`, `mlp`, plus `layers` on the scanned stack) and the activations carry logical sharding
hints (`batch`, `length`, ...). The model never names a mesh axis: the sharding planner maps the
logical names to mesh axes with `nn.logical_axis_rules`; without rules the hints are no-ops.

Layers are stacked with `nn.scan`, so compile time does not grow with depth. Norms, rotary
sin/cos and the attention softmax run in float32 whatever the parameter dtype, so the model works
when the engine hands it bf16/fp16 copies of fp32 master parameters.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType

from jaxspeed.ops import matmul
from jaxspeed.ops import offload
from jaxspeed.attention.block_sparse import block_sparse_attention
from jaxspeed.attention.blocked import blocked_attention
from jaxspeed.attention.sequence_parallel import (
    from_layout,
    layout_positions,
    sequence_parallel_attention,
    to_layout,
)
from jaxspeed.attention.sparsity import SparsityConfig
from jaxspeed.config.loading import validate_section
from jaxspeed.config.model import CONTEXT, SHAPES, ModelConfig, architecture_keys, moe_layer_options
from jaxspeed.errors import ConfigError
from jaxspeed.ops.losses import AUX_LOSS
from jaxspeed.moe.layer import GATING_RNG, MoE
from jaxspeed.moe.layer import METRICS as MOE_METRICS
from jaxspeed.ops.remat import checkpoint_policy
from pallas_kernels._backend import on_gpu

Array = jax.Array
Dtype = Any

#: `checkpoint_name` tags in each block, for `activation_checkpointing.policy: names`.
CHECKPOINT_NAMES = ("qkv", "attn_context", "attn_out", "mlp_hidden", "mlp_out")

_INIT_STD = 0.02
_NORM_EPS = 1e-6
_ROTARY_BASE = 10_000.0


def _cast(x: Array, dtype: Dtype | None) -> Array:
    return x if dtype is None else x.astype(dtype)


def _logical_param(
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
    eps: float = _NORM_EPS

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


@dataclasses.dataclass(frozen=True)
class Rotary:
    """Rotary embedding settings: the base `theta` and Llama 3's frequency scaling.

    `scaling` is None or `(factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings)` (Hugging Face's `rope_type: llama3`).
    """

    theta: float = _ROTARY_BASE
    scaling: tuple[float, float, float, int] | None = None

    def frequencies(self, head_dim: int) -> np.ndarray:
        """float32 `[head_dim // 2]` inverse frequencies, computed as Hugging Face does."""
        exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
        inv_freq = (1.0 / (np.float32(self.theta) ** exponents)).astype(np.float32)
        if self.scaling is None:
            return inv_freq
        factor, low, high, original = self.scaling
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= original / high) & (wavelen <= original / low)
        return np.where(medium, smoothed, scaled).astype(np.float32)


def rotary_embedding(
    x: Array, positions: Array | None = None, rotary: Rotary = Rotary()
) -> Array:
    """Rotary position embedding (RoFormer, Su et al. 2021), rotate-half form (Llama's).

    Args:
      x: `[batch, length, heads, head_dim]`, head_dim even.
      positions: int `[length]` or `[batch, length]`, each row's position; default row i is
        position i.
      rotary: the base and scaling of the frequencies.

    Returns:
      `x` rotated by position-dependent angles, same shape and dtype (sin/cos in float32).
    """
    length, head_dim = x.shape[1], x.shape[-1]
    inv_freq = jnp.asarray(rotary.frequencies(head_dim))
    if positions is None:
        positions = jnp.arange(length)
    positions = jnp.broadcast_to(positions, x.shape[:2])  # per row: packed documents restart
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [batch, length, half]
    sin = jnp.sin(angles)[:, :, None, :]
    cos = jnp.cos(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def causal_attention(q: Array, k: Array, v: Array, segment_ids: Array | None = None, *,
                     q_positions: Array | None = None) -> Array:
    """Causal softmax attention with a float32 softmax.

    Args:
      q: `[batch, q_len, heads, head_dim]`; k, v: `[batch, kv_len, heads, head_dim]`, key `j`
        at position `j`.
      segment_ids: int `[batch, length]`: a query sees only keys of its own segment (packed
        documents); None: one segment.
      q_positions: int `[q_len]`, the queries' positions (a decoding step's, after a cache of
        keys); default `0, 1, ...`: query `i` sees keys `0..i`.

    Returns:
      `[batch, q_len, heads, head_dim]` in `v`'s dtype.
    """
    head_dim = q.shape[-1]
    scores = matmul.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    scores = scores.astype(jnp.float32) / math.sqrt(head_dim)
    if q_positions is None:
        q_positions = jnp.arange(q.shape[1])
    keep = jnp.arange(k.shape[1])[None, :] <= q_positions[:, None]
    if segment_ids is not None:
        keep = keep & same_segment(segment_ids)
    scores = jnp.where(keep, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return matmul.einsum("bhqk,bkhd->bqhd", probs, v)


def same_segment(segment_ids: Array) -> Array:
    """bool `[batch, 1, length, length]`: query and key in the same segment."""
    return segment_ids[:, None, :, None] == segment_ids[:, None, None, :]


def attend(q: Array, k: Array, v: Array, *, impl: str, block_q: int, block_kv: int,
           segment_ids: Array | None = None) -> Array:
    """Dense causal softmax attention, computed as `impl` says.

    Args:
      q, k, v: `[batch, length, heads, head_dim]`.
      impl: `reference` (`causal_attention`: `[batch, heads, length, length]` fp32 scores),
        `blocked` (`jaxspeed.attention.blocked_attention`, O(length * block) memory), `fused`
        (`jax.nn.dot_product_attention`: cuDNN on a GPU where it applies, XLA elsewhere) or
        `auto`: `fused` on a GPU; elsewhere `blocked` when the sequence is longer than a
        block, else `reference` (one block holds the whole `[length, length]` tile anyway,
        and the reference computes it without the loops).
      block_q, block_kv: the blocks of `blocked`.
      segment_ids: int `[batch, length]` of packed documents (attention stays within one),
        or None.

    Returns:
      `[batch, length, heads, head_dim]` in `v`'s dtype.
    """
    if impl == "auto":
        longer = q.shape[1] > block_q or k.shape[1] > block_kv
        impl = "fused" if on_gpu() else "blocked" if longer else "reference"
    if impl == "fused":
        mask = None if segment_ids is None else same_segment(segment_ids)
        y = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                         implementation=None)
        return y.astype(v.dtype)
    if impl == "blocked":
        return blocked_attention(q, k, v, causal=True, block_q=block_q, block_kv=block_kv,
                                 segment_ids=segment_ids)
    return causal_attention(q, k, v, segment_ids)


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
    """How the current mesh and logical rules split the activations' `length` axis.

    Attributes:
      axis: the mesh axis `length` maps to.
      shards: its size (> 1).
      head_axes: the mesh axes `heads` maps to (tensor parallelism).
      balanced: the sequence is in the load-balanced layout inside the layers.
    """

    axis: str
    shards: int
    head_axes: tuple[str, ...]
    balanced: bool

    def positions(self, length: int) -> Array:
        """Each row's position in the original sequence."""
        return layout_positions(length, self.shards, self.balanced)


def sequence_split(load_balance: bool) -> SequenceSplit | None:
    """The split of `length` under the current rules and mesh, or None when there is none.

    The logical rules (`nn.logical_axis_rules`) name the mesh axis; the mesh (`jax.set_mesh`)
    gives its size. Axes already manual (an enclosing `shard_map`) do not count.
    """
    spec = nn.logical_to_mesh_axes(("length", "heads"))
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or spec[0] is None:
        return None
    axes = (spec[0],) if isinstance(spec[0], str) else tuple(spec[0])
    auto = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t != AxisType.Manual}
    axes = tuple(a for a in axes if a in auto and mesh.shape[a] > 1)
    if not axes:
        return None
    if len(axes) > 1:
        raise ConfigError(f"the sequence may be split over one mesh axis, got {axes}")
    heads = spec[1] if spec[1] is not None else ()
    heads = (heads,) if isinstance(heads, str) else tuple(heads)
    heads = tuple(a for a in heads if a in auto and mesh.shape[a] > 1)
    return SequenceSplit(axes[0], mesh.shape[axes[0]], heads, bool(load_balance))


def _shared_layout(layout: np.ndarray) -> np.ndarray:
    """A block-sparse layout every head shares (`[1, nb, nb]`): Ulysses' devices each hold
    other heads, with one compiled program."""
    if layout.shape[0] > 1 and not (layout == layout[:1]).all():
        raise ConfigError(
            "model.sparse_attention with different_layout_per_head cannot run under "
            "sequence_parallel (each device holds other heads); set "
            "different_layout_per_head: false or mesh.sequence: 1"
        )
    return layout[:1]


@functools.lru_cache(maxsize=4)  # `[heads, nb, nb]`: hundreds of MiB at long lengths
def sparse_layout(config: SparsityConfig, seq_len: int) -> np.ndarray:
    """The block layout `[heads, nb, nb]` of `config` at `seq_len`, built once per pair."""
    layout = config.make_layout(seq_len)
    layout.setflags(write=False)
    return layout


class Attention(nn.Module):
    """Multi-head causal self-attention, no biases.

    Dense attention is computed by `attend` with `attention_impl` and its blocks. With
    `sparse` set, the attention is restricted to that config's block layout (plus the causal
    mask), through `jaxspeed.attention.block_sparse_attention` with `sparse_impl`. When the
    mesh splits `length` (`sequence_split`), `sequence_parallel` (`ulysses` or `ring`) crosses
    the split; ring always uses the blocked kernel and supports dense attention only.
    """

    n_heads: int
    rotary: Rotary | None
    out_std: float
    param_dtype: Dtype = jnp.float32
    dtype: Dtype | None = None
    sparse: SparsityConfig | None = None
    sparse_impl: str = "auto"
    attention_impl: str = "auto"
    block_q: int = 512
    block_kv: int = 512
    sequence_parallel: str = "ulysses"
    load_balance: bool = True
    #: key/value heads (grouped-query attention); None: `n_heads`
    n_kv_heads: int | None = None
    #: autoregressive decoding: keys and values of earlier calls are kept in the `cache`
    #: collection (`cache_len` positions), and each call's tokens follow them
    decode: bool = False
    cache_len: int = 0

    @nn.compact
    def __call__(self, x: Array, segment_ids: Array | None = None,
                 positions: Array | None = None) -> Array:
        """`x: [batch, length, embed]` → `[batch, length, embed]`; `segment_ids` and
        `positions` (int `[batch, length]`) describe packed documents."""
        embed = x.shape[-1]
        head_dim = embed // self.n_heads
        kv_heads = self.n_kv_heads or self.n_heads
        x = _cast(x, self.dtype)

        def project(name: str, heads: int) -> Array:
            kernel = _logical_param(
                self, name, ("embed", "heads", "kv"), (embed, heads, head_dim), std=_INIT_STD)
            y = matmul.einsum("ble,ehd->blhd", x, _cast(kernel, self.dtype))
            y = nn.with_logical_constraint(y, ("batch", "length", "heads", "kv"))
            return checkpoint_name(y, "qkv")

        q = project("query", self.n_heads)
        k, v = project("key", kv_heads), project("value", kv_heads)
        split = None
        if self.decode:  # this call's tokens follow the ones already in the cache
            index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
            positions = index.value + jnp.arange(q.shape[1])
        else:
            split = sequence_split(self.load_balance)
            if split is not None and (segment_ids is not None or positions is not None):
                raise ConfigError(
                    "packed sequences (segment_ids, positions) with mesh.sequence > 1 are not "
                    "available in this version of jaxspeed; use mesh.sequence=1 or no packing")
            if positions is None and split is not None:
                positions = split.positions(q.shape[1])
        if self.rotary is not None:
            q = rotary_embedding(q, positions, self.rotary)
            k = rotary_embedding(k, positions, self.rotary)
        if self.decode:
            y = self._decode(q, k, v, index, positions)
        else:
            y = self._attend(q, *self._share_kv_heads(k, v), split, segment_ids)
        y = nn.with_logical_constraint(y, ("batch", "length", "heads", "kv"))
        y = checkpoint_name(y, "attn_context")
        out = _logical_param(
            self, "out", ("heads", "kv", "embed"), (self.n_heads, head_dim, embed), std=self.out_std
        )
        y = matmul.einsum("blhd,hde->ble", y, _cast(out, self.dtype))
        return checkpoint_name(y, "attn_out")

    def _share_kv_heads(self, k: Array, v: Array) -> tuple[Array, Array]:
        """Grouped-query attention: each group of query heads reads one key/value head."""
        group = self.n_heads // k.shape[2]
        return (k, v) if group == 1 else tuple(jnp.repeat(t, group, axis=2) for t in (k, v))

    def _decode(self, q: Array, k: Array, v: Array, index, positions: Array) -> Array:
        """This call's tokens attend over the cached keys and values and their own, which
        join the cache at `index`."""
        shape = (k.shape[0], self.cache_len, *k.shape[2:])
        ready = self.has_variable("cache", "key")  # False while `init` creates the cache
        keys = self.variable("cache", "key", jnp.zeros, shape, k.dtype)
        values = self.variable("cache", "value", jnp.zeros, shape, v.dtype)
        if not ready:
            return causal_attention(q, *self._share_kv_heads(k, v))
        start = index.value
        keys.value = jax.lax.dynamic_update_slice(keys.value, k, (0, start, 0, 0))
        values.value = jax.lax.dynamic_update_slice(values.value, v, (0, start, 0, 0))
        index.value = start + q.shape[1]
        k, v = self._share_kv_heads(keys.value, values.value)
        return causal_attention(q, k, v, q_positions=positions)

    def _attend(self, q: Array, k: Array, v: Array, split: SequenceSplit | None,
                segment_ids: Array | None = None) -> Array:
        layout = None if self.sparse is None else sparse_layout(self.sparse, q.shape[1])
        if layout is not None and segment_ids is not None:
            raise ConfigError(
                "model.sparse_attention with packed sequences (segment_ids) is not available; "
                "set data.packing: false or model.sparse_attention: null")
        if split is not None:
            if self.sparse is not None and self.sequence_parallel == "ring":
                raise ConfigError(
                    "model.sparse_attention runs under sequence_parallel.impl: ulysses only "
                    "(ring attention is dense); set model.sequence_parallel.impl: ulysses"
                )
            layout = None if layout is None else _shared_layout(layout)
        if layout is None:
            dense = functools.partial(
                attend, impl=self.attention_impl, block_q=self.block_q, block_kv=self.block_kv,
                segment_ids=segment_ids,
            )
        else:
            dense = functools.partial(
                block_sparse_attention, layout=layout, causal=True, impl=self.sparse_impl
            )
        if split is None:
            return dense(q, k, v)
        return sequence_parallel_attention(
            q, k, v, impl=self.sequence_parallel, axis=split.axis, head_axes=split.head_axes,
            causal=True, load_balance=split.balanced, attend=dense,
            block_q=self.block_q, block_kv=self.block_kv,
        )


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
    """Feed-forward block: GELU or SwiGLU (Shazeer 2020), no biases."""

    d_ff: int
    kind: str
    out_std: float
    param_dtype: Dtype = jnp.float32
    dtype: Dtype | None = None

    @nn.compact
    def __call__(self, x: Array) -> Array:
        """`x: [batch, length, embed]` → `[batch, length, embed]`."""
        embed = x.shape[-1]
        x = _cast(x, self.dtype)

        def project_in(name: str) -> Array:
            kernel = _logical_param(self, name, ("embed", "mlp"), (embed, self.d_ff), std=_INIT_STD)
            return matmul.einsum("...e,ef->...f", x, _cast(kernel, self.dtype))

        if self.kind == "swiglu":
            h = swiglu(project_in("wi_gate"), project_in("wi_up"))
        else:
            h = nn.gelu(project_in("wi"))
        h = nn.with_logical_constraint(h, ("batch", "length", "mlp"))
        h = checkpoint_name(h, "mlp_hidden")
        wo = _logical_param(self, "wo", ("mlp", "embed"), (self.d_ff, embed), std=self.out_std)
        y = matmul.einsum("...f,fe->...e", h, _cast(wo, self.dtype))
        return checkpoint_name(y, "mlp_out")


class Block(nn.Module):
    """Pre-norm decoder block; `(carry, deterministic)` signature so it can be scanned.

    `attention` holds the `Attention` attributes besides the shared `out_std`, `param_dtype`
    and `dtype`. With `moe` (keyword arguments of `jaxspeed.moe.MoE`) the feed-forward is a
    mixture of experts, which records its aux loss for the engine.
    """

    d_ff: int
    norm: str
    mlp: str
    out_std: float
    attention: dict[str, Any]
    param_dtype: Dtype = jnp.float32
    dtype: Dtype | None = None
    norm_eps: float = _NORM_EPS
    moe: tuple[tuple[str, Any], ...] | None = None

    @nn.compact
    def __call__(self, x: Array, deterministic: bool = False, segment_ids: Array | None = None,
                 positions: Array | None = None) -> tuple[Array, None]:
        """`x: [batch, length, embed]` residual stream → (new residual stream, None);
        `segment_ids` / `positions` of packed documents go to the attention."""
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        h = Norm(self.norm, self.param_dtype, self.norm_eps, name="attn_norm")(x)
        h = Attention(
            **self.attention, out_std=self.out_std, param_dtype=self.param_dtype,
            dtype=self.dtype, name="attn",
        )(h, segment_ids, positions)
        x = x + h.astype(x.dtype)
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        h = Norm(self.norm, self.param_dtype, self.norm_eps, name="mlp_norm")(x)
        if self.moe is None:
            h = Mlp(self.d_ff, self.mlp, self.out_std, self.param_dtype, self.dtype, name="mlp")(h)
        else:
            moe = MoE(**dict(self.moe), param_dtype=self.param_dtype, dtype=self.dtype, name="moe")
            h = moe(h, deterministic=deterministic)
        x = x + h.astype(x.dtype)
        return nn.with_logical_constraint(x, ("batch", "length", "embed")), None


class BlockGroup(nn.Module):
    """`every` consecutive blocks, the last one with the MoE feed-forward: the scanned unit of
    a MoE GPT (`model.moe.every_n_layers`), so the scan stays over identical units."""

    every: int
    block: dict[str, Any]

    @nn.compact
    def __call__(self, x: Array, deterministic: bool = False, segment_ids: Array | None = None,
                 positions: Array | None = None) -> tuple[Array, None]:
        features = (segment_ids, positions)
        for i in range(self.every - 1):
            x, _ = Block(**{**self.block, "moe": None}, name=f"dense_{i}")(
                x, deterministic, *features)
        return Block(**self.block, name="moe_block")(x, deterministic, *features)


class GPT(nn.Module):
    """Decoder-only transformer language model.

    Attributes mirror the config's `model:` keys; `remat_policy` is one of
    `jaxspeed.ops.remat.POLICIES`, applied to the scanned block; `remat_names` are the
    `CHECKPOINT_NAMES` tags it saves with policy "names". `sparse_attention` (a
    `jaxspeed.attention` sparsity config) makes every layer's attention block-sparse, through
    `sparse_impl`; otherwise `attention_impl` (`ATTENTION_IMPLS`, see `attend`) with
    `attention_block_q` / `attention_block_kv` computes dense attention. `dtype=None`
    computes in the dtype the parameters arrive in; logits are always float32.

    `stream_layers` (a dtype, or None) is ZeRO-Offload's parameter offload, layer by layer:
    `params["layers"]` arrive in host memory, and each scanned unit fetches its own slice to
    the device in that dtype as it runs (again when remat recomputes it), so one unit's
    params at a time occupy device memory; their gradients go back to host memory.

    Besides `__call__`, the pieces are methods (for `apply(..., method=...)`), so the
    pipeline can run the layers in stages: `embed` (tokens → residual stream), `layer_stack`
    (an unbound stack of any number of layers, parameters like `params["layers"]` sliced on
    the leading dimension) and `logits` (final norm and head).
    """

    vocab_size: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    d_ff: int = 1024
    max_seq_len: int = 256
    norm: str = "rmsnorm"
    mlp: str = "gelu"
    positions: str = "rotary"
    tie_embeddings: bool = True
    rope_theta: float = _ROTARY_BASE
    rope_scaling: tuple[float, float, float, int] | None = None
    norm_eps: float = _NORM_EPS
    remat_policy: str = "none"
    remat_names: tuple[str, ...] = ()
    sparse_attention: SparsityConfig | None = None
    sparse_impl: str = "auto"
    attention_impl: str = "auto"
    attention_block_q: int = 512
    attention_block_kv: int = 512
    sequence_parallel: str = "ulysses"
    sequence_load_balance: bool = True
    moe: tuple[tuple[str, Any], ...] | None = None
    moe_every: int = 1
    param_dtype: Dtype = jnp.float32
    dtype: Dtype | None = None
    stream_layers: Dtype | None = None
    #: autoregressive decoding with a key/value cache of `max_seq_len` positions (the
    #: `cache` collection; see `jaxspeed.models.sampling`)
    decode: bool = False

    @property
    def balanced(self) -> bool:
        """Whether a sequence split uses the load-balanced layout: ring attention's causal
        work needs it; Ulysses attends over whole sequences, balanced already, so it keeps
        the natural layout whatever `sequence_load_balance` says."""
        return self.sequence_load_balance and self.sequence_parallel == "ring"

    @property
    def num_units(self) -> int:
        """Scanned units: layers, or groups of `moe_every` layers in a MoE model."""
        return self.n_layers if self.moe is None else self.n_layers // self.moe_every

    def layer_stack(self, num_units: int) -> nn.Module:
        """`num_units` scanned units (see `num_units`), `(x, deterministic) -> (x, None)`.

        Called outside a module it is unbound: `stack.apply({"params": p}, x, False)` with
        `p` a `[num_units, ...]` slice of `params["layers"]` runs those layers.
        """
        attention = dict(
            n_heads=self.n_heads,
            rotary=Rotary(self.rope_theta, self.rope_scaling) if self.positions == "rotary" else None,
            sparse=self.sparse_attention,
            sparse_impl=self.sparse_impl,
            attention_impl=self.attention_impl,
            block_q=self.attention_block_q,
            block_kv=self.attention_block_kv,
            sequence_parallel=self.sequence_parallel,
            load_balance=self.balanced,
            n_kv_heads=self.n_kv_heads,
            decode=self.decode,
            cache_len=self.max_seq_len,
        )
        block = dict(
            d_ff=self.d_ff,
            norm=self.norm,
            mlp=self.mlp,
            out_std=_INIT_STD / math.sqrt(2 * self.n_layers),
            attention=attention,
            param_dtype=self.param_dtype,
            dtype=self.dtype,
            norm_eps=self.norm_eps,
            moe=self.moe,
        )
        unit_cls, kwargs = Block, block
        if self.moe is not None:
            unit_cls, kwargs = BlockGroup, {"every": self.moe_every, "block": block}
        if self.stream_layers is not None:  # inside remat: recomputing a unit fetches it again
            fetch = functools.partial(offload.fetch, dtype=self.stream_layers)
            unit_cls = nn.map_variables(
                unit_cls, "params", trans_in_fn=fetch, init=False, mutable=True
            )
        if self.remat_policy != "none":
            policy = checkpoint_policy(
                self.remat_policy, self.remat_names, known_names=CHECKPOINT_NAMES
            )
            unit_cls = nn.remat(unit_cls, policy=policy, prevent_cse=False, static_argnums=(2,))
        scanned = nn.scan(
            unit_cls,
            variable_axes={"params": 0, AUX_LOSS: 0, MOE_METRICS: 0, "cache": 0},
            split_rngs={"params": True, GATING_RNG: True},
            in_axes=nn.broadcast,
            length=num_units,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        parent = self if self.scope is not None else None  # unbound: a standalone module
        return scanned(**kwargs, parent=parent)

    def setup(self) -> None:
        self.embedding = _logical_param(
            self, "embedding", ("vocab", "embed"), (self.vocab_size, self.d_model), std=_INIT_STD
        )
        if self.positions == "learned":
            self.pos_embedding = _logical_param(
                self, "pos_embedding", ("length", "embed"), (self.max_seq_len, self.d_model),
                std=_INIT_STD,
            )
        self.layers = self.layer_stack(self.num_units)
        if self.decode and self.positions == "learned":
            self.decoded = self.variable("cache", "decoded", lambda: jnp.zeros((), jnp.int32))
        self.final_norm = Norm(self.norm, self.param_dtype, self.norm_eps)
        if not self.tie_embeddings:
            self.head = _logical_param(
                self, "head", ("embed", "vocab"), (self.d_model, self.vocab_size), std=_INIT_STD
            )

    def embed(self, tokens: Array, positions: Array | None = None) -> Array:
        """int tokens `[batch, length]` → residual stream `[batch, length, embed]`.

        Under a sequence split with load balance, `tokens` are in the balanced layout.
        """
        if tokens.ndim != 2:
            raise ValueError(f"GPT expects tokens of shape [batch, length], got {tokens.shape}")
        length = tokens.shape[1]
        if length > self.max_seq_len:
            raise ConfigError(
                f"sequence length {length} exceeds model.max_seq_len={self.max_seq_len}"
            )
        x = _cast(jnp.take(self.embedding, tokens, axis=0), self.dtype)
        if self.positions == "learned":
            split = None if self.decode else sequence_split(self.balanced)
            if positions is None and self.decode:  # after the tokens already decoded
                positions = self.decoded.value + jnp.arange(length)
                if not self.is_initializing():
                    self.decoded.value += length
            elif positions is None:
                positions = jnp.arange(length) if split is None else split.positions(length)
            pos = jnp.take(self.pos_embedding, jnp.broadcast_to(positions, tokens.shape), axis=0)
            x = x + _cast(pos, x.dtype)
        return nn.with_logical_constraint(x, ("batch", "length", "embed"))

    def logits(self, x: Array) -> Array:
        """Residual stream `[batch, length, embed]` → float32 logits `[batch, length, vocab]`."""
        x = self.final_norm(x)
        if self.tie_embeddings:
            logits = matmul.einsum(
                "ble,ve->blv", x, _cast(self.embedding, x.dtype),
                preferred_element_type=jnp.float32,
            )
        else:
            logits = matmul.einsum(
                "ble,ev->blv", x, _cast(self.head, x.dtype), preferred_element_type=jnp.float32
            )
        logits = logits.astype(jnp.float32)
        return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))

    def __call__(self, tokens: Array, deterministic: bool = False, *,
                 segment_ids: Array | None = None, positions: Array | None = None) -> Array:
        """Next-token logits.

        Args:
          tokens: int `[batch, length]`, length ≤ max_seq_len, values in [0, vocab_size).
          deterministic: evaluation mode (MoE: eval capacity, no gate noise / random order).
          segment_ids: int `[batch, length]`, packed sequences' document ids: a token attends
            only to earlier tokens of its own document. None: each row is one document.
          positions: int `[batch, length]`, each token's position in its document (rotary
            and learned positions restart with each document). None: 0, 1, ...

        Returns:
          float32 logits `[batch, length, vocab]`.
        """
        split = None if self.decode else sequence_split(self.balanced)
        if split is None or not split.balanced:
            x, _ = self.layers(self.embed(tokens, positions), deterministic, segment_ids,
                               positions)
            return self.logits(x)
        # Load-balanced sequence split: the layers run on the balanced layout, whose causal
        # attention costs every device the same; the logits come out in the original order.
        x, _ = self.layers(self.embed(to_layout(tokens, split.axis)), deterministic,
                           segment_ids, positions)
        return self.logits(from_layout(x, split.axis))


#: `ModelConfig` fields `GPT` takes as they are (the rest are translated by `build_gpt`).
_COPIED = (*architecture_keys(SHAPES, CONTEXT), "rope_theta")


def build_gpt(
    model_cfg: ModelConfig | Any, *, remat_policy: str = "none", remat_names=(),
    stream_layers=None,
) -> GPT:
    """Builds a `GPT` from the `model:` section.

    Args:
      model_cfg: a `jaxspeed.config.ModelConfig`, or a mapping or object with its keys
        (validated into one; missing keys take the config's defaults).
      remat_policy: activation-checkpointing policy name (see `GPT`).
      remat_names: `checkpoint_name` tags saved with policy "names".
      stream_layers: the dtype the scanned layers' host-resident params are fetched in, one
        unit at a time (see `GPT`); None: params arrive on the device.

    Returns:
      The (unbound) `GPT` module.

    Raises:
      ConfigError: `model_cfg` is not a valid `model:` section (every error, with its key).
    """
    cfg = model_cfg
    if not isinstance(cfg, ModelConfig):
        cfg = validate_section(ModelConfig, cfg, at="model")
    moe = cfg.moe
    return GPT(
        **{key: getattr(cfg, key) for key in _COPIED},
        rope_scaling=None if cfg.rope_scaling is None else cfg.rope_scaling.as_tuple(),
        norm_eps=cfg.rms_norm_eps,
        attention_impl=cfg.attention.impl,
        attention_block_q=cfg.attention.block_q,
        attention_block_kv=cfg.attention.block_kv,
        sequence_parallel=cfg.sequence_parallel.impl,
        sequence_load_balance=cfg.sequence_parallel.load_balance,
        sparse_attention=None if cfg.sparse_attention is None
        else cfg.sparse_attention.sparsity(cfg.n_heads),
        sparse_impl="auto" if cfg.sparse_attention is None else cfg.sparse_attention.impl,
        moe=None if moe is None
        else tuple(sorted(moe_layer_options(moe, d_ff=cfg.d_ff, mlp=cfg.mlp).items())),
        moe_every=1 if moe is None else moe.every_n_layers,
        remat_policy=remat_policy, remat_names=tuple(remat_names), stream_layers=stream_layers,
    )


def count_params(params: Any) -> int:
    """Number of scalar parameters in a pytree (arrays, shape structs or boxed metadata)."""
    return int(sum(math.prod(np.shape(leaf)) for leaf in jax.tree.leaves(params)))
