"""Hugging Face Llama-family tensors (Llama, Mistral, Qwen2) <-> the reference GPT's params.

HF's `nn.Linear` weights are `[out, in]`; the GPT's kernels are `[in, ...]` with heads split
out, and its layers are stacked on a leading `[n_layers]` axis (`nn.scan`). Llama's q/k
projections are already in the rotate-half layout the GPT's rotary embedding uses, and
`jnp.repeat` groups query heads onto key/value heads as HF's `repeat_kv` does, so every
tensor maps by a transpose and a reshape, without permuting rows. Qwen2's q/k/v biases
(`model.attention_bias`) are `[heads * head_dim]` vectors, the GPT's `[heads, head_dim]`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import jax
import numpy as np

from jaxspeed.checkpoint.state import CheckpointError
from jaxspeed.checkpoint.direct_io import LazyArray

#: Per-layer tensors: HF name suffix -> (params path under `layers`, kind of mapping).
_LAYER = {
    "self_attn.q_proj.weight": (("attn", "query"), "in_heads"),
    "self_attn.k_proj.weight": (("attn", "key"), "in_kv_heads"),
    "self_attn.v_proj.weight": (("attn", "value"), "in_kv_heads"),
    "self_attn.o_proj.weight": (("attn", "out"), "heads_out"),
    "input_layernorm.weight": (("attn_norm", "scale"), "vector"),
    "post_attention_layernorm.weight": (("mlp_norm", "scale"), "vector"),
    "mlp.gate_proj.weight": (("mlp", "wi_gate"), "transpose"),
    "mlp.up_proj.weight": (("mlp", "wi_up"), "transpose"),
    "mlp.down_proj.weight": (("mlp", "wo"), "transpose"),
}
#: Per-layer biases of a model with `attention_bias` (Qwen2).
_BIASES = {
    "self_attn.q_proj.bias": (("attn", "query_bias"), "heads_bias"),
    "self_attn.k_proj.bias": (("attn", "key_bias"), "kv_heads_bias"),
    "self_attn.v_proj.bias": (("attn", "value_bias"), "kv_heads_bias"),
}
# Buffers some older saves include; they are recomputed from the config, never read.
_IGNORED_SUFFIX = ".rotary_emb.inv_freq"


def _layer(model: Mapping[str, Any]) -> dict[str, tuple[tuple[str, str], str]]:
    """The per-layer tensors of `model` (`_LAYER`, and `_BIASES` with `attention_bias`)."""
    return {**_LAYER, **_BIASES} if model.get("attention_bias") else _LAYER


def _dims(model: Mapping[str, Any]) -> dict[str, int]:
    heads = model["n_heads"]
    return {"embed": model["d_model"], "heads": heads, "kv": model.get("n_kv_heads") or heads,
            "head_dim": model["d_model"] // heads, "ff": model["d_ff"], "vocab": model["vocab_size"]}


def _hf_shape(kind: str, d: dict[str, int]) -> tuple[int, ...]:
    return {
        "in_heads": (d["heads"] * d["head_dim"], d["embed"]),
        "in_kv_heads": (d["kv"] * d["head_dim"], d["embed"]),
        "heads_out": (d["embed"], d["heads"] * d["head_dim"]),
        "vector": (d["embed"],),
        "heads_bias": (d["heads"] * d["head_dim"],),
        "kv_heads_bias": (d["kv"] * d["head_dim"],),
    }.get(kind, ())


def hf_shapes(model: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the model has -> its HF shape."""
    d = _dims(model)
    shapes = {"model.embed_tokens.weight": (d["vocab"], d["embed"]), "model.norm.weight": (d["embed"],)}
    if not model["tie_embeddings"]:
        shapes["lm_head.weight"] = (d["vocab"], d["embed"])
    mlp = {"mlp.gate_proj.weight": (d["ff"], d["embed"]), "mlp.up_proj.weight": (d["ff"], d["embed"]),
           "mlp.down_proj.weight": (d["embed"], d["ff"])}
    for i in range(model["n_layers"]):
        for suffix, (_, kind) in _layer(model).items():
            shapes[f"model.layers.{i}.{suffix}"] = mlp.get(suffix) or _hf_shape(kind, d)
    return shapes


def check_names(names: set[str], model: Mapping[str, Any], *, source: str) -> None:
    """Refuses tensor sets that are not exactly the model's (naming one missing or extra)."""
    wanted = set(hf_shapes(model))
    names = {n for n in names if not n.endswith(_IGNORED_SUFFIX)}
    if not model["tie_embeddings"] or "lm_head.weight" not in names:
        extra = sorted(names - wanted)
    else:  # a tied model saved with its head too: the embedding is read, the head ignored
        extra = sorted(names - wanted - {"lm_head.weight"})
    missing = sorted(wanted - names)
    if missing:
        raise CheckpointError(f"{source}: no tensor {missing[0]} ({len(missing)} missing in all)")
    if extra:
        raise CheckpointError(
            f"{source}: unexpected tensor {extra[0]} for this config ({len(extra)} in all)"
        )


def _param_shape(kind: str, hf_shape: tuple[int, ...], d: dict[str, int]) -> tuple[int, ...]:
    """The GPT param's shape (one layer) for an HF tensor; as a matrix it is the transpose."""
    if kind == "vector":
        return hf_shape
    if kind.endswith("_bias"):  # [heads*hd] -> [heads, hd]
        return hf_shape[0] // d["head_dim"], d["head_dim"]
    if kind == "heads_out":  # [embed, heads*hd] -> [heads, hd, embed]
        return d["heads"], d["head_dim"], d["embed"]
    if kind == "transpose":
        return hf_shape[::-1]
    return d["embed"], hf_shape[0] // d["head_dim"], d["head_dim"]  # [heads*hd, embed] -> [embed, heads, hd]


#: Rows of the source per step of `transpose_into`: each output row then gets 16 contiguous
#: elements (a cache line or half of one) per step. Measured on the 2-core CI machine, a 2048 x
#: 8192 transpose runs at 3-4 GB/s per core this way, 1 GB/s with 64-row strips, and 0.6 GB/s as
#: numpy's one-call strided copy.
_STRIP = 16
#: Rows read from the source at a time (a lazy file slice reads exactly those bytes).
_READ = 256


def _copy_into(dst: np.ndarray, src, kind: str) -> None:
    """Writes one tensor, HF -> param or param -> HF, into `dst` (cast to its dtype).

    Either way it is `dst = src.T` for a 2-D `src`, with `dst` reshaped to match, except for
    vectors (and the embedding), which are copied. `src` needs only `.shape` and row slicing,
    so a lazy file slice is read `_READ` rows at a time.
    """
    if kind.endswith("_bias"):  # a vector either way, the param's `[heads, hd]` flattened
        dst, kind = dst.reshape(-1), "vector"
    rows = src.shape[0]
    if kind != "vector":
        dst = dst.reshape(src.shape[::-1])
    bits = np.dtype(src.dtype) == dst.dtype  # then move bits: numpy copies bfloat16 1.5-3x slower
    if bits:
        dst = dst.view(f"u{dst.itemsize}")
    for start in range(0, rows, _READ):
        block = np.asarray(src[start:min(start + _READ, rows)])  # safetensors slices do not clip
        if bits:
            block = block.view(dst.dtype)
        if kind == "vector":
            dst[start:start + _READ] = block
            continue
        for s in range(0, block.shape[0], _STRIP):
            dst[:, start + s:start + s + _STRIP] = block[s:s + _STRIP].T


def param_shapes(model: Mapping[str, Any], dtype) -> dict[str, Any]:
    """The GPT's params as a tree of `jax.ShapeDtypeStruct` (what `param_blocks` fill)."""
    d, shapes = _dims(model), hf_shapes(model)

    def spec(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, np.dtype(dtype))

    layers: dict[str, dict[str, Any]] = {}
    for suffix, ((group, leaf), kind) in _layer(model).items():
        layers.setdefault(group, {})[leaf] = spec(
            model["n_layers"], *_param_shape(kind, shapes[f"model.layers.0.{suffix}"], d))
    tree = {"embedding": spec(d["vocab"], d["embed"]), "layers": layers,
            "final_norm": {"scale": spec(d["embed"])}}
    if not model["tie_embeddings"]:
        tree["head"] = spec(d["embed"], d["vocab"])
    return tree


def param_blocks(
    read: Callable[[str], Any], model: Mapping[str, Any], *, dtype, source: str
) -> dict[str, list]:
    """The GPT's params from HF tensors, as `jaxspeed.checkpoint.params.write_params` blocks.

    Args:
      read: HF tensor name -> array or lazy `jaxspeed.checkpoint.hf.files.Tensor` (called once per
        tensor, when its block is written).
      model: the `model:` keys (`jaxspeed.checkpoint.hf.config.MODEL_KEYS`).
      dtype: the params' dtype (each tensor is cast to it).
      source: named in errors (the folder).

    Returns:
      `.`-joined params path -> fills, one per layer for the stacked layers (each writes
      one HF tensor into its block, cast on the way).
    """
    shapes = hf_shapes(model)

    def copy(name: str, kind: str, dst: np.ndarray, rows: slice = slice(None)) -> None:
        w = read(name)
        if tuple(w.shape) != shapes[name]:
            raise CheckpointError(
                f"{source}: tensor {name} has shape {tuple(w.shape)}, the config needs {shapes[name]}"
            )
        _copy_into(dst, w if rows == slice(None) else w[rows], kind)

    def copy_rows(name: str, dst: np.ndarray, start: int) -> None:
        copy(name, "vector", dst, rows=slice(start, start + len(dst)))

    blocks = {
        f"layers.{group}.{leaf}": [partial(copy, f"model.layers.{i}.{suffix}", kind)
                                   for i in range(model["n_layers"])]
        for suffix, ((group, leaf), kind) in _layer(model).items()
    }
    name = "model.embed_tokens.weight"
    blocks["embedding"] = [LazyArray(shapes[name], np.dtype(dtype), partial(copy, name, "vector"),
                                     fill_rows=partial(copy_rows, name))]
    blocks["final_norm.scale"] = [partial(copy, "model.norm.weight", "vector")]
    if not model["tie_embeddings"]:
        blocks["head"] = [partial(copy, "lm_head.weight", "transpose")]
    return blocks


def _matrix(param: np.ndarray, hf_shape: tuple[int, ...]) -> np.ndarray:
    """One layer's param as the matrix whose transpose is the HF tensor (vectors as they are)."""
    return param.reshape(hf_shape[::-1])


def hf_tensors(params: Mapping[str, Any], model: Mapping[str, Any], *, dtype=None) -> dict[str, Any]:
    """HF tensors from the GPT's params, each converted when it is written; the inverse of
    `param_blocks`.

    Values are `LazyArray`s (the transposed ones, and any cast), or the param itself where
    a tensor is a plain copy in the same dtype. A leaf of `params` only needs indexing, so a
    params checkpoint's memory-mapped arrays (`jaxspeed.checkpoint.params.open_params`) are
    read as they are converted.
    """
    shapes = hf_shapes(model)
    dtype = np.dtype(dtype or params["final_norm"]["scale"].dtype)

    def tensor(name: str, src, kind: str):
        if (kind == "vector" or kind.endswith("_bias")) and np.dtype(src.dtype) == dtype \
                and isinstance(src, np.ndarray):
            return src.reshape(shapes[name])
        return LazyArray(shapes[name], dtype, partial(_copy_into, src=src, kind=kind))

    out = {
        name: tensor(name, _matrix(params["layers"][group][leaf][i], shapes[name]), kind)
        for i in range(model["n_layers"]) for suffix, ((group, leaf), kind) in _layer(model).items()
        for name in [f"model.layers.{i}.{suffix}"]
    }
    out["model.embed_tokens.weight"] = tensor("model.embed_tokens.weight", params["embedding"], "vector")
    out["model.norm.weight"] = tensor("model.norm.weight", params["final_norm"]["scale"], "vector")
    if not model["tie_embeddings"]:
        out["lm_head.weight"] = tensor("lm_head.weight", params["head"], "transpose")
    return out
