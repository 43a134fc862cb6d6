"""Reference GPT decoder (Flax Linen) written with logical axes.

Every parameter carries Flax logical-partitioning metadata (`vocab`, `embed`, `length`, `heads`,
`kv`, `mlp`, plus `layers` on the scanned stack) and the activations carry logical sharding
hints (`batch`, `length`, ...). The model never names a mesh axis: the sharding planner maps the
logical names to mesh axes with `nn.logical_axis_rules`; without rules the hints are no-ops.

Layers are stacked with `nn.scan`, so compile time does not grow with depth. Norms, rotary
sin/cos and the attention softmax run in float32 whatever the parameter dtype, so the model works
when the engine hands it bf16/fp16 copies of fp32 master parameters.

The pieces live beside this module: `layers` (norms, the feed-forward), `positions` (rotary),
`dense_attention` (how dense attention is computed), `attention` (the attention layer),
`sequence_split`, `decode_cache`, `block` and `moe_block`. The config that builds a `GPT`
(`build_gpt`) is validated by `jaxspeed.config.ModelConfig`, the one description of the model's
fields; `GPT` itself checks nothing.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxspeed.attention.sparsity import SparsityConfig
from jaxspeed.config.cluster import load_cluster
from jaxspeed.config.loading import validate_section
from jaxspeed.config.model import CONTEXT, SHAPES, ModelConfig, architecture_keys, moe_layer_options
from jaxspeed.errors import ConfigError
from jaxspeed.models.block import Block
from jaxspeed.models.layers import INIT_STD, NORM_EPS, Norm, cast, logical_param
from jaxspeed.models.moe_block import BlockGroup
from jaxspeed.models.positions import ROTARY_BASE, Rotary
from jaxspeed.models.sequence_split import sequence_split
from jaxspeed.attention.sequence_parallel import from_layout, to_layout
from jaxspeed.moe.layer import GATING_RNG
from jaxspeed.moe.layer import METRICS as MOE_METRICS
from jaxspeed.ops import matmul
from jaxspeed.ops.fp8 import META as FP8_META
from jaxspeed.ops.fp8 import Fp8Recipe
from jaxspeed.ops import offload
from jaxspeed.ops.losses import AUX_LOSS, LOGIT_MAX, STEP_METRICS
from jaxspeed.ops.remat import checkpoint_policy
from jaxspeed.zero.collectives import not_gathered

Array = jax.Array
Dtype = Any

#: `checkpoint_name` tags in each block, for `activation_checkpointing.policy: names`.
CHECKPOINT_NAMES = ("qkv", "attn_context", "attn_out", "mlp_hidden", "mlp_out")


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
    rope_theta: float = ROTARY_BASE
    rope_scaling: tuple[float, float, float, int] | None = None
    norm_eps: float = NORM_EPS
    #: biases on the q, k, v projections (Qwen2)
    attention_bias: bool = False
    #: Mistral's sliding window of keys each query sees (None: all earlier keys)
    sliding_window: int | None = None
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
    #: FP8 matmuls in the blocks (`jaxspeed.ops.fp8`); None: the compute dtype throughout
    fp8: Fp8Recipe | None = None
    #: each attention layer records its heads' largest logit (`LOGIT_MAX`, for QK-clip)
    record_logit_max: bool = False
    #: ZeRO-3 with explicit collectives (`jaxspeed.zero.step`): `(variables) ->
    #: variables` applied to each scanned unit's ZeRO-sharded params inside the step's
    #: `shard_map`, gathering them. The backward pass gathers them again, as DeepSpeed's
    #: ZeRO-3 does: no `remat_policy` saves them, and with "none" every other value is saved
    #: (`zero.collectives.not_gathered`).
    gather_layers: Any = None
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
            qkv_bias=self.attention_bias,
            sliding_window=self.sliding_window,
            logit_max=self.record_logit_max,
        )
        block = dict(
            d_ff=self.d_ff,
            norm=self.norm,
            mlp=self.mlp,
            out_std=INIT_STD / math.sqrt(2 * self.n_layers),
            attention=attention,
            param_dtype=self.param_dtype,
            dtype=self.dtype,
            norm_eps=self.norm_eps,
            moe=self.moe,
            fp8=self.fp8,
        )
        unit_cls, kwargs = Block, block
        if self.moe is not None:
            unit_cls, kwargs = BlockGroup, {"every": self.moe_every, "block": block}
        if self.stream_layers is not None:  # inside remat: recomputing a unit fetches it again
            fetch = functools.partial(offload.fetch, dtype=self.stream_layers)
            unit_cls = nn.map_variables(
                unit_cls, "params", trans_in_fn=fetch, init=False, mutable=True
            )
        if self.gather_layers is not None:  # inside remat: the recomputation gathers again
            unit_cls = nn.map_variables(
                unit_cls, "params", trans_in_fn=self.gather_layers, init=False, mutable=True
            )
        if self.remat_policy != "none":  # no policy saves the gathers' outputs
            policy = checkpoint_policy(
                self.remat_policy, self.remat_names, known_names=CHECKPOINT_NAMES
            )
            unit_cls = nn.remat(unit_cls, policy=policy, prevent_cse=False, static_argnums=(2,))
        elif self.gather_layers is not None:  # save all but the gathers: gather again
            unit_cls = nn.remat(unit_cls, policy=not_gathered, prevent_cse=False,
                                static_argnums=(2,))
        scanned = nn.scan(
            unit_cls,
            variable_axes={"params": 0, AUX_LOSS: 0, MOE_METRICS: 0, STEP_METRICS: 0, "cache": 0,
                           FP8_META: 0, LOGIT_MAX: 0},
            split_rngs={"params": True, GATING_RNG: True},
            in_axes=nn.broadcast,
            length=num_units,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        parent = self if self.scope is not None else None  # unbound: a standalone module
        return scanned(**kwargs, parent=parent)

    def setup(self) -> None:
        self.embedding = logical_param(
            self, "embedding", ("vocab", "embed"), (self.vocab_size, self.d_model), std=INIT_STD
        )
        if self.positions == "learned":
            self.pos_embedding = logical_param(
                self, "pos_embedding", ("length", "embed"), (self.max_seq_len, self.d_model),
                std=INIT_STD,
            )
        self.layers = self.layer_stack(self.num_units)
        if self.decode and self.positions == "learned":
            self.decoded = self.variable("cache", "decoded", lambda: jnp.zeros((), jnp.int32))
        self.final_norm = Norm(self.norm, self.param_dtype, self.norm_eps)
        if not self.tie_embeddings:
            self.head = logical_param(
                self, "head", ("embed", "vocab"), (self.d_model, self.vocab_size), std=INIT_STD
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
        x = cast(jnp.take(self.embedding, tokens, axis=0), self.dtype)
        if self.positions == "learned":
            split = None if self.decode else sequence_split(self.balanced)
            if positions is None and self.decode:  # after the tokens already decoded
                positions = self.decoded.value + jnp.arange(length)
                if not self.is_initializing():
                    self.decoded.value += length
            elif positions is None:
                positions = jnp.arange(length) if split is None else split.positions(length)
            pos = jnp.take(self.pos_embedding, jnp.broadcast_to(positions, tokens.shape), axis=0)
            x = x + cast(pos, x.dtype)
        return nn.with_logical_constraint(x, ("batch", "length", "embed"))

    def logits(self, x: Array) -> Array:
        """Residual stream `[batch, length, embed]` → float32 logits `[batch, length, vocab]`."""
        x = self.final_norm(x)
        if self.tie_embeddings:
            logits = matmul.logits_einsum("ble,ve->blv", x, cast(self.embedding, x.dtype))
        else:
            logits = matmul.logits_einsum("ble,ev->blv", x, cast(self.head, x.dtype))
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
    stream_layers=None, fp8: Fp8Recipe | None = None, record_logit_max: bool = False,
) -> GPT:
    """Builds a `GPT` from the `model:` section.

    Args:
      model_cfg: a `jaxspeed.config.ModelConfig`, or a mapping or object with its keys
        (validated into one; missing keys take the config's defaults).
      remat_policy: activation-checkpointing policy name (see `GPT`).
      remat_names: `checkpoint_name` tags saved with policy "names".
      stream_layers: the dtype the scanned layers' host-resident params are fetched in, one
        unit at a time (see `GPT`); None: params arrive on the device.
      fp8: the blocks' FP8 recipe (`jaxspeed.ops.fp8.Fp8Recipe`), or None.
      record_logit_max: each attention layer records its heads' largest logit (QK-clip).

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
        sliding_window=cfg.sliding_window,
        attention_impl=cfg.attention.impl,
        attention_block_q=cfg.attention.block_q,
        attention_block_kv=cfg.attention.block_kv,
        sequence_parallel=cfg.sequence_parallel.impl,
        sequence_load_balance=cfg.sequence_parallel.load_balance,
        sparse_attention=None if cfg.sparse_attention is None
        else cfg.sparse_attention.sparsity(cfg.n_heads),
        sparse_impl="auto" if cfg.sparse_attention is None else cfg.sparse_attention.impl,
        moe=None if moe is None else tuple(sorted(_moe_options(moe, cfg).items())),
        moe_every=1 if moe is None else moe.every_n_layers,
        remat_policy=remat_policy, remat_names=tuple(remat_names), stream_layers=stream_layers,
        fp8=fp8, record_logit_max=record_logit_max,
    )


def _moe_options(moe: Any, cfg: ModelConfig) -> dict[str, Any]:
    """The MoE layers' options, `model.moe.cluster` (a file or preset name) read into the links
    `parallelism: auto` prices."""
    options = moe_layer_options(moe, d_ff=cfg.d_ff, mlp=cfg.mlp)
    if isinstance(options.get("cluster"), str):
        from jaxspeed.moe.strategies import links_of

        options["cluster"] = links_of(load_cluster(options["cluster"]))
    return options


def count_params(params: Any) -> int:
    """Number of scalar parameters in a pytree (arrays, shape structs or boxed metadata)."""
    return int(sum(math.prod(np.shape(leaf)) for leaf in jax.tree.leaves(params)))
