"""Hugging Face Llama tensors <-> the reference GPT's params.

HF's `nn.Linear` weights are `[out, in]`; the GPT's kernels are `[in, ...]` with heads split
out, and its layers are stacked on a leading `[n_layers]` axis (`nn.scan`). Llama's q/k
projections are already in the rotate-half layout the GPT's rotary embedding uses, and
`jnp.repeat` groups query heads onto key/value heads as HF's `repeat_kv` does, so every
tensor maps by a transpose and a reshape, without permuting rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jaxspeed.checkpoint import CheckpointError

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
# Buffers some older saves include; they are recomputed from the config, never read.
_IGNORED_SUFFIX = ".rotary_emb.inv_freq"


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
        for suffix, (_, kind) in _LAYER.items():
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
            f"{source}: unexpected tensor {extra[0]} for a Llama model ({len(extra)} in all)"
        )


def _to_param(w: np.ndarray, kind: str, d: dict[str, int]) -> np.ndarray:
    if kind == "vector":
        return w
    if kind == "transpose":
        return w.T
    if kind == "heads_out":  # [embed, heads*hd] -> [heads, hd, embed]
        return w.T.reshape(d["heads"], d["head_dim"], d["embed"])
    heads = d["heads"] if kind == "in_heads" else d["kv"]  # [heads*hd, embed] -> [embed, heads, hd]
    return w.T.reshape(d["embed"], heads, d["head_dim"])


def _to_hf(p: np.ndarray, kind: str, d: dict[str, int]) -> np.ndarray:
    if kind == "vector":
        return p
    if kind == "transpose":
        return p.T
    if kind == "heads_out":
        return p.reshape(d["heads"] * d["head_dim"], d["embed"]).T
    return p.reshape(d["embed"], -1).T


def params_from_hf(
    read: Callable[[str], np.ndarray], model: Mapping[str, Any], *, source: str
) -> dict[str, Any]:
    """The GPT's params (numpy, the tensors' dtype) from HF tensors.

    Args:
      read: HF tensor name -> array (called once per tensor, so a caller can stream files).
      model: the `model:` keys (`jaxspeed.hf.config.MODEL_KEYS`).
      source: named in errors (the folder).

    Returns:
      `{embedding [vocab, embed], layers: {...} [n_layers, ...], final_norm, head?}`.
    """
    d, shapes = _dims(model), hf_shapes(model)

    def get(name: str) -> np.ndarray:
        w = read(name)
        if tuple(w.shape) != shapes[name]:
            raise CheckpointError(
                f"{source}: tensor {name} has shape {tuple(w.shape)}, the config needs {shapes[name]}"
            )
        return w

    layers: dict[str, dict[str, np.ndarray]] = {}
    for suffix, ((group, leaf), kind) in _LAYER.items():
        stacked = None
        for i in range(model["n_layers"]):
            p = _to_param(get(f"model.layers.{i}.{suffix}"), kind, d)
            if stacked is None:
                stacked = np.empty((model["n_layers"], *p.shape), p.dtype)
            stacked[i] = p
        layers.setdefault(group, {})[leaf] = stacked
    params = {
        "embedding": get("model.embed_tokens.weight"),
        "layers": layers,
        "final_norm": {"scale": get("model.norm.weight")},
    }
    if not model["tie_embeddings"]:
        params["head"] = np.ascontiguousarray(get("lm_head.weight").T)
    return params


def hf_from_params(params: Mapping[str, Any], model: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """HF tensors (contiguous numpy, the params' dtype) from the GPT's params; see
    `params_from_hf`, whose inverse it is."""
    d = _dims(model)
    out = {"model.embed_tokens.weight": np.asarray(params["embedding"])}
    for i in range(model["n_layers"]):
        for suffix, ((group, leaf), kind) in _LAYER.items():
            layer = np.asarray(params["layers"][group][leaf][i])
            out[f"model.layers.{i}.{suffix}"] = np.ascontiguousarray(_to_hf(layer, kind, d))
    out["model.norm.weight"] = np.asarray(params["final_norm"]["scale"])
    if not model["tie_embeddings"]:
        out["lm_head.weight"] = np.ascontiguousarray(np.asarray(params["head"]).T)
    return out
