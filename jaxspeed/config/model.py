"""`model:`: the reference GPT's architecture, described once.

`ModelConfig` is the one list of the model's fields. Each architecture field carries its role
(`SHAPES`, `CONTEXT` or `FUNCTION`), and what other parts need is derived from the roles:
the keys a params checkpoint must agree on (`architecture_keys(SHAPES)`), the keys an
imported Hugging Face config sets (`architecture_keys()`), the keys `build_gpt` copies.

`moe` and `sparse_attention` are typed by the layers that use them: `MoeConfig` has
`jaxspeed.moe.MoE`'s options (`jaxspeed.options.moe.MoeOptions`, and `every_n_layers`) and
checks them with the layer's own `option_errors`; `sparse_attention` is a union over DeepSpeed's modes, one model per
`jaxspeed.attention` sparsity class with that class's fields, built (and so checked) against
the model's head count. So `load_config` reports every error in `model:` with its key path.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, ValidationInfo, create_model, field_validator
from pydantic import model_validator

from jaxspeed.attention.sparsity import DEFAULT_MODE, SPARSITY_MODES, SparsityConfig
from jaxspeed.config.fields import Bool, PositiveInt, Section
from jaxspeed.options.attention import SEQUENCE_IMPLS, SPARSE_IMPLS
from jaxspeed.options.moe import (
    ACTIVATIONS, ALGORITHMS, BALANCES, NOISY_GATE_POLICIES, PARALLELISMS, ROUTINGS, MoeOptions,
    option_errors,
)
from jaxspeed.options.moe import IMPLS as MOE_IMPLS

NORMS = ("rmsnorm", "layernorm")
MLPS = ("gelu", "swiglu")
POSITIONS = ("rotary", "learned")
#: `model.attention.impl`: how dense causal attention is computed (`jaxspeed.models.attend`).
ATTENTION_IMPLS = ("auto", "fused", "blocked", "reference", "cudnn", "pallas")


@dataclasses.dataclass(frozen=True)
class Role:
    """What an architecture field decides (carried in the field's metadata)."""

    name: str


#: The params' shapes: a checkpoint and the run that loads it must agree.
SHAPES = Role("shapes")
#: The longest sequence (the learned position table; the decode cache).
CONTEXT = Role("context")
#: The function but not the shapes (rotary frequencies, norm epsilon): a checkpoint's
#: differing value is only warned about, since fine-tuning may change it on purpose.
FUNCTION = Role("function")


class AttentionConfig(Section):
    """How the reference GPT computes dense causal attention (`jaxspeed.models.attend`).

    `reference` materialises the `[batch, heads, length, length]` scores; `blocked` is
    FlashAttention's algorithm in plain JAX, `O(length * block)` memory
    (`jaxspeed.attention.blocked_attention`); `fused` is `jax.nn.dot_product_attention` (its
    default implementation: XLA's dense attention, not cuDNN's kernel); `cudnn` is the same call
    with `implementation="cudnn"`, cuDNN's fused flash attention (NVIDIA GPUs only); `pallas`
    is our Pallas FlashAttention kernel over the causal block layout (Mosaic GPU on Hopper,
    Triton on older GPUs; block-sparse attention's XLA path off a GPU; no sliding window or
    packed documents; `block_q`/`block_kv` do not apply: it takes blocks of 128 or 64); `auto`
    (default) is `fused` on a GPU and elsewhere `blocked` for sequences longer than a block,
    `reference` for the rest.
    """

    impl: Literal[*ATTENTION_IMPLS] = "auto"
    block_q: PositiveInt = 512
    block_kv: PositiveInt = 512


class SequenceParallelConfig(Section):
    """How attention crosses `mesh.sequence` (`jaxspeed.attention.sequence_parallel`).

    `ulysses` (DeepSpeed-Ulysses): two all-to-alls turn sequence shards into head shards
    around any attention (`model.attention`, block-sparse too); needs the heads (per tensor
    shard) divisible by `mesh.sequence`. `ring`: k/v shards circulate over the devices, any
    head count, dense attention only. `load_balance` (ring) gives device i the chunks i and
    2S-1-i of 2S, so the causal mask costs every device the same; it needs `data.seq_len`
    divisible by 2 x `mesh.sequence`. Ulysses attends over whole sequences, balanced already,
    and ignores it.
    """

    impl: Literal[*SEQUENCE_IMPLS] = "ulysses"
    load_balance: Bool = True


class RopeScalingConfig(Section):
    """Llama 3's rotary frequency scaling (Hugging Face's `rope_scaling` with
    `rope_type: llama3`)."""

    rope_type: Literal["llama3"] = "llama3"
    factor: Annotated[float, Field(gt=0)] = 8.0
    low_freq_factor: Annotated[float, Field(gt=0)] = 1.0
    high_freq_factor: Annotated[float, Field(gt=0)] = 4.0
    original_max_position_embeddings: PositiveInt = 8192

    def as_tuple(self) -> tuple[float, float, float, int]:
        """`(factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)`."""
        return (self.factor, self.low_freq_factor, self.high_freq_factor,
                self.original_max_position_embeddings)


# ---------------------------------------------------------------------------------- typing


def _field_type(hint: Any) -> Any:
    """A dataclass field's type as a config field: ints and bools strict, sequences as lists
    or tuples (YAML gives lists), floats taking ints."""
    if hint is int:
        return Annotated[int, Field(strict=True)]
    if hint is bool:
        return Bool
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        return typing.Union[tuple(_field_type(arg) for arg in typing.get_args(hint))]
    if typing.get_origin(hint) is Sequence:
        return tuple[Annotated[int, Field(strict=True)], ...]
    return hint


def _options(cls: type, *, skip: Sequence[str]) -> dict[str, Any]:
    """`{field: (config type, default)}` of a dataclass's fields, without `skip`."""
    hints = typing.get_type_hints(cls)
    return {
        f.name: (_field_type(hints[f.name]), f.default)
        for f in dataclasses.fields(cls)
        if f.name not in skip and f.default is not dataclasses.MISSING
    }


# -------------------------------------------------------------------------------------- moe

_MOE_OPTIONS = _options(MoeOptions, skip=("cluster",))
#: `MoE`'s named choices, typed as the values the layer takes: pydantic names every bad one.
_MOE_CHOICES = {
    "noisy_gate_policy": (*NOISY_GATE_POLICIES, "None"), "balance": BALANCES,
    "routing": ROUTINGS, "all_to_all": ALGORITHMS, "parallelism": PARALLELISMS,
    "impl": MOE_IMPLS,
}

MoeConfig = create_model(
    "MoeConfig",
    __base__=Section,
    __doc__=(
        "`model.moe`: `jaxspeed.moe.MoE`'s options, `every_n_layers` (1: every layer is "
        "MoE; n: the n-th of every n) and `bias_update_rate` (with `balance: bias`, the step "
        "of DeepSeek-V3's sign rule; the optimizer applies it). `d_ff` and `activation` "
        "default to the model's."
    ),
    num_experts=(Annotated[int, Field(strict=True)], ...),
    every_n_layers=(PositiveInt, 1),
    bias_update_rate=(Annotated[float, Field(gt=0)], 1e-3),
    **{
        **_MOE_OPTIONS,
        **{name: (Literal[*choices], _MOE_OPTIONS[name][1])
           for name, choices in _MOE_CHOICES.items()},
        "d_ff": (PositiveInt | None, None),
        "activation": (Literal[*ACTIVATIONS] | None, None),
        "cluster": (str | None, None),  # a file or preset: the GPT's builder reads its links
    },
)


def moe_layer_options(moe: Any, *, d_ff: int, mlp: str) -> dict[str, Any]:
    """The `MoE` keyword arguments of a `model.moe` block (defaults: the model's `d_ff`, `mlp`)."""
    options = moe.model_dump(exclude={"every_n_layers", "bias_update_rate"})
    options["d_ff"] = options["d_ff"] or d_ff
    options["activation"] = options["activation"] or mlp
    return options


# ------------------------------------------------------------------------- sparse attention


class SparseAttentionBase(Section):
    """Base of the `model.sparse_attention` modes: the mode's layout keys plus `impl`."""

    #: the op's implementation (`jaxspeed.attention.block_sparse_attention`)
    impl: Literal[*SPARSE_IMPLS] = "auto"
    #: DeepSpeed's configs repeat the head count; it must then equal `model.n_heads`
    num_heads: PositiveInt | None = None

    def sparsity(self, num_heads: int) -> SparsityConfig:
        """The `jaxspeed.attention` sparsity config for a model of `num_heads` heads.

        Raises:
          ConfigError: `num_heads` disagrees with this block's, or the layout's keys do not go
            together (the sparsity class's own checks).
        """
        if self.num_heads is not None and self.num_heads != num_heads:
            raise ValueError(
                f"num_heads is {self.num_heads}, but the model has n_heads={num_heads}; leave "
                f"it out or set it to {num_heads}"
            )
        layout_keys = self.model_dump(exclude={"mode", "impl", "num_heads"})
        return SPARSITY_MODES[self.mode](num_heads, **layout_keys)


def _mode_config(mode: str, cls: type[SparsityConfig]) -> type[SparseAttentionBase]:
    return create_model(
        cls.__name__.replace("SparsityConfig", "SparseAttentionConfig"),
        __base__=SparseAttentionBase,
        __doc__=f"`model.sparse_attention` with `mode: {mode}` (`{cls.__name__}`).",
        mode=(Literal[mode], mode),
        **_options(cls, skip=("num_heads",)),
    )


SPARSE_ATTENTION_MODES: dict[str, type[SparseAttentionBase]] = {
    mode: _mode_config(mode, cls) for mode, cls in SPARSITY_MODES.items()
}


def _default_mode(value: Any) -> Any:
    """DeepSpeed's block without `mode` is `fixed`."""
    if isinstance(value, dict) and "mode" not in value:
        return {"mode": DEFAULT_MODE, **value}
    return value


#: `model.sparse_attention`: one of `SPARSE_ATTENTION_MODES`, picked by `mode`.
SparseAttentionConfig = typing.Union[tuple(SPARSE_ATTENTION_MODES.values())]


# ------------------------------------------------------------------------------------ model


class ModelConfig(Section):
    """The reference GPT (`jaxspeed.models.build_gpt`)."""

    type: Literal["gpt"] = "gpt"
    vocab_size: Annotated[PositiveInt, SHAPES] = 256
    d_model: Annotated[PositiveInt, SHAPES] = 256
    n_layers: Annotated[PositiveInt, SHAPES] = 4
    n_heads: Annotated[PositiveInt, SHAPES] = 4
    #: key/value heads (grouped-query attention, a divisor of n_heads); null: n_heads
    n_kv_heads: Annotated[PositiveInt | None, SHAPES] = None
    d_ff: Annotated[PositiveInt, SHAPES] = 1024
    max_seq_len: Annotated[PositiveInt, CONTEXT] = 256
    norm: Annotated[Literal[*NORMS], SHAPES] = "rmsnorm"
    mlp: Annotated[Literal[*MLPS], SHAPES] = "gelu"
    positions: Annotated[Literal[*POSITIONS], SHAPES] = "rotary"
    tie_embeddings: Annotated[Bool, SHAPES] = True
    #: rotary base frequency (Llama 2: 10000, Llama 3: 500000) and Llama 3's scaling
    rope_theta: Annotated[float, Field(gt=0), FUNCTION] = 10_000.0
    rope_scaling: Annotated[RopeScalingConfig | None, FUNCTION] = None
    #: epsilon of every norm (RMSNorm's or LayerNorm's)
    rms_norm_eps: Annotated[float, Field(gt=0), FUNCTION] = 1e-6
    #: biases on the query, key and value projections (Qwen2; the output projection has none)
    attention_bias: Annotated[Bool, SHAPES] = False
    #: Mistral's sliding window: a query at position i sees the keys at positions
    #: i - sliding_window + 1 .. i; null: every earlier key (plain causal attention)
    sliding_window: Annotated[PositiveInt | None, FUNCTION] = None
    attention: AttentionConfig = Field(default_factory=AttentionConfig)
    sequence_parallel: SequenceParallelConfig = Field(default_factory=SequenceParallelConfig)
    moe: MoeConfig | None = None
    sparse_attention: Annotated[
        SparseAttentionConfig | None, BeforeValidator(_default_mode)
    ] = Field(None, discriminator="mode")

    @field_validator("moe")
    @classmethod
    def _moe_fits(cls, moe: Any, info: ValidationInfo) -> Any:
        if moe is None or not {"d_ff", "mlp", "n_layers"} <= info.data.keys():
            return moe  # an error in those fields is reported already
        errors = option_errors(types.SimpleNamespace(
            **moe_layer_options(moe, d_ff=info.data["d_ff"], mlp=info.data["mlp"])))
        if info.data["n_layers"] % moe.every_n_layers:
            errors.append(
                f"every_n_layers={moe.every_n_layers} must divide n_layers="
                f"{info.data['n_layers']} (the layers are scanned in groups of that many)"
            )
        if errors:
            raise ValueError("; ".join(errors))
        return moe

    @field_validator("sparse_attention")
    @classmethod
    def _layout_fits(cls, sparse: Any, info: ValidationInfo) -> Any:
        if sparse is not None and "n_heads" in info.data:
            sparse.sparsity(info.data["n_heads"])
        return sparse

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        errors = [*self._head_errors(), *self._window_errors()]
        if errors:
            raise ValueError("; ".join(errors))
        return self

    def _head_errors(self) -> list[str]:
        errors = []
        if self.d_model % self.n_heads:
            errors.append(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                f"the head size d_model / n_heads must be a whole number"
            )
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
            errors.append(
                f"n_kv_heads={self.n_kv_heads} does not divide n_heads={self.n_heads}; each "
                f"key/value head serves a group of n_heads / n_kv_heads query heads"
            )
        whole = not self.d_model % self.n_heads
        if whole and self.positions == "rotary" and (self.d_model // self.n_heads) % 2:
            errors.append(
                f"positions 'rotary' needs an even head size; d_model / n_heads = "
                f"{self.d_model // self.n_heads}"
            )
        return errors

    def _window_errors(self) -> list[str]:
        """`sliding_window` runs in dense attention (`reference`, `fused`; Ulysses carries
        it); the blocked kernel, ring attention and block-sparse layouts have no window."""
        if self.sliding_window is None:
            return []
        refused = [
            (self.attention.impl == "blocked", "attention.impl: blocked",
             "model.attention.impl: auto, fused or reference"),
            (self.sequence_parallel.impl == "ring", "sequence_parallel.impl: ring",
             "model.sequence_parallel.impl: ulysses"),
            (self.sparse_attention is not None, "sparse_attention",
             "model.sparse_attention: null"),
        ]
        return [f"sliding_window={self.sliding_window} cannot run with {what} (it has no "
                f"window); set {instead}, or sliding_window: null"
                for bad, what, instead in refused if bad]


def architecture_keys(*roles: Role) -> tuple[str, ...]:
    """`ModelConfig` fields with one of `roles` (all architecture fields when none is given),
    in the config's order."""
    wanted = roles or (SHAPES, CONTEXT, FUNCTION)
    return tuple(
        name for name, field in ModelConfig.model_fields.items()
        if any(role in field.metadata for role in wanted)
    )
