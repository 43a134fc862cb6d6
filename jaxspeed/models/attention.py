"""The GPT's self-attention layer: projections, rotary positions, and which attention runs.

Dense attention goes through `attend` (`model.attention`); with a sparsity config, through
`jaxspeed.attention.block_sparse_attention` on that config's block layout; under a sequence
split, through `jaxspeed.attention.sequence_parallel_attention`; while decoding, over the
key/value cache (`decode_cache`).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jaxspeed.attention.block_sparse import block_sparse_attention
from jaxspeed.attention.sequence_parallel import sequence_parallel_attention
from jaxspeed.attention.sparsity import SparsityConfig
from jaxspeed.errors import ConfigError
from jaxspeed.models.decode_cache import attend_cached, cache_index
from jaxspeed.models.dense_attention import attend, max_logits, share_kv_heads
from jaxspeed.models.layers import INIT_STD, cast, logical_param
from jaxspeed.models.positions import Rotary, rotary_embedding
from jaxspeed.models.sequence_split import SequenceSplit, sequence_split
from jaxspeed.ops import fp8 as fp8_ops
from jaxspeed.ops import matmul
from jaxspeed.ops.losses import LOGIT_MAX

Array = jax.Array
Dtype = Any


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
    """Multi-head causal self-attention; biases on q, k, v with `qkv_bias` (Qwen2).

    Dense attention is computed by `attend` with `attention_impl` and its blocks. With
    `sparse` set, the attention is restricted to that config's block layout (plus the causal
    mask), through `jaxspeed.attention.block_sparse_attention` with `sparse_impl`. When the
    mesh splits `length` (`sequence_split`), `sequence_parallel` (`ulysses` or `ring`) crosses
    the split; ring always uses the blocked kernel and supports dense attention only.
    `sliding_window` (Mistral) limits each query to the latest `sliding_window` keys, in
    dense attention only (Ulysses included): block-sparse, ring and blocked are refused.
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
    qkv_bias: bool = False
    sliding_window: int | None = None
    #: FP8 for the q/k/v/out projections (attention itself stays in the compute dtype)
    fp8: fp8_ops.Fp8Recipe | None = None
    #: record each head's largest logit in the `LOGIT_MAX` collection (QK-clip's statistic;
    #: over every causal key, so under a block-sparse layout an upper bound)
    logit_max: bool = False

    @nn.compact
    def __call__(self, x: Array, segment_ids: Array | None = None,
                 positions: Array | None = None) -> Array:
        """`x: [batch, length, embed]` → `[batch, length, embed]`; `segment_ids` and
        `positions` (int `[batch, length]`) describe packed documents."""
        embed = x.shape[-1]
        head_dim = embed // self.n_heads
        kv_heads = self.n_kv_heads or self.n_heads
        x = cast(x, self.dtype)

        def project(name: str, heads: int) -> Array:
            kernel = logical_param(
                self, name, ("embed", "heads", "kv"), (embed, heads, head_dim), std=INIT_STD)
            y = fp8_ops.project(self, name, "ble,ehd->blhd", x, cast(kernel, self.dtype),
                                self.fp8, matmul.einsum)
            if self.qkv_bias:
                bias = self.param(
                    f"{name}_bias", nn.with_logical_partitioning(nn.initializers.zeros,
                                                                 ("heads", "kv")),
                    (heads, head_dim), self.param_dtype)
                y = y + cast(bias, y.dtype)
            y = nn.with_logical_constraint(y, ("batch", "length", "heads", "kv"))
            return checkpoint_name(y, "qkv")

        q = project("query", self.n_heads)
        k, v = project("key", kv_heads), project("value", kv_heads)
        split = None
        if self.decode:  # this call's tokens follow the ones already in the cache
            index = cache_index(self)
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
            y = attend_cached(self, q, k, v, index, positions, cache_len=self.cache_len,
                              n_heads=self.n_heads)
        else:
            k, v = share_kv_heads(k, v, self.n_heads)
            if self.logit_max:
                self.sow(LOGIT_MAX, "heads", max_logits(
                    q, k, None if split is None else positions, segment_ids,
                    window=self.sliding_window, block=self.block_q))
            y = self._attend(q, k, v, split, segment_ids)
        y = nn.with_logical_constraint(y, ("batch", "length", "heads", "kv"))
        y = checkpoint_name(y, "attn_context")
        out = logical_param(
            self, "out", ("heads", "kv", "embed"), (self.n_heads, head_dim, embed), std=self.out_std
        )
        y = fp8_ops.project(self, "out", "blhd,hde->ble", y, cast(out, self.dtype), self.fp8,
                            matmul.einsum)
        return checkpoint_name(y, "attn_out")

    def _attend(self, q: Array, k: Array, v: Array, split: SequenceSplit | None,
                segment_ids: Array | None = None) -> Array:
        window = self.sliding_window
        if window is not None and (self.sparse is not None or (
                split is not None and self.sequence_parallel == "ring")):
            raise ConfigError(
                f"model.sliding_window={window} runs in dense attention only; set "
                "model.sparse_attention: null and model.sequence_parallel.impl: ulysses")
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
                segment_ids=segment_ids, window=window,
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
