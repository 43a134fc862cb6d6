"""Hugging Face Llama, Mistral and Qwen2 `config.json` <-> jaxspeed's `model:` section.

Mistral is Llama with a sliding window (`model.sliding_window`), Qwen2 Llama with biases on
the q/k/v projections (`model.attention_bias`) and, if asked, a sliding window on every layer.

Both layouts transformers has written are read: transformers 4 keeps `rope_theta` and
`rope_scaling` at the top level, transformers 5 keeps them in `rope_parameters` (with
`rope_type`). A config the reference GPT cannot express exactly is refused with one error that
names the field, never approximated.
"""

from __future__ import annotations

from typing import Any

from jaxspeed.checkpoint.state import CheckpointError
from jaxspeed.config.model import architecture_keys

#: Keys of the `model:` section an imported checkpoint records (what the HF config sets): the
#: whole architecture.
MODEL_KEYS = architecture_keys()

#: HF name -> jaxspeed name of the plain integer sizes.
_SIZES = {
    "vocab_size": "vocab_size", "hidden_size": "d_model", "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads", "intermediate_size": "d_ff",
    "max_position_embeddings": "max_seq_len",
}
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# LlamaConfig's defaults for keys a config.json may leave out.
_HF_DEFAULTS = {"rope_theta": 10_000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
#: The `model_type`s read and written -> their transformers class (`architectures`).
FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM"}
# MistralConfig's defaults where they differ from LlamaConfig's.
_MISTRAL_DEFAULTS = {"num_key_value_heads": 8, "sliding_window": 4096}


def _refuse(source: str, key: str, value: Any, wanted: str) -> CheckpointError:
    return CheckpointError(f"{source}: {key}={value!r} is not Llama-like; jaxspeed needs {wanted}")


def _rope(config: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """`(rope_theta, rope_scaling or None)` from either transformers layout."""
    if isinstance(config.get("rope_parameters"), dict):  # transformers 5
        key, rope = "rope_parameters", dict(config["rope_parameters"])
        theta = rope.pop("rope_theta", config.get("rope_theta", _HF_DEFAULTS["rope_theta"]))
    else:  # transformers 4
        key, rope = "rope_scaling", dict(config.get("rope_scaling") or {})
        theta = config.get("rope_theta", _HF_DEFAULTS["rope_theta"])
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return float(theta), None
    if kind != "llama3":
        raise _refuse(source, f"{key}.rope_type", kind, "'default' or 'llama3'")
    missing = [k for k in _LLAMA3_KEYS if k not in rope]
    if missing:
        raise CheckpointError(f"{source}: {key} has rope_type 'llama3' but no {missing[0]}")
    scaling = {"rope_type": "llama3", **{k: rope[k] for k in _LLAMA3_KEYS}}
    scaling["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    return float(theta), scaling


def _qwen2_window(config: dict[str, Any], layers: int, source: str) -> int | None:
    """Qwen2's one sliding window, or None: `Qwen2Config` windows the layers `layer_types`
    names (default: those from `max_window_layers` on) when `use_sliding_window` is set."""
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    if window is None:
        return None
    kinds = config.get("layer_types") or [
        "sliding_attention" if i >= config.get("max_window_layers", 28) else "full_attention"
        for i in range(layers)]
    if len(set(kinds)) > 1:
        raise CheckpointError(
            f"{source}: layer_types mixes sliding_attention and full_attention layers; "
            "jaxspeed needs the same attention on every layer (a window on all or on none)")
    return window if kinds[0] == "sliding_attention" else None


def model_from_hf(config: dict[str, Any], *, source: str = "config.json") -> dict[str, Any]:
    """jaxspeed `model:` keys (`MODEL_KEYS`) for a Hugging Face Llama, Mistral or Qwen2 config.

    Raises:
      CheckpointError: naming the first field that is missing or not Llama-like.
    """
    model_type = config.get("model_type", "llama")
    if model_type not in FAMILIES:
        raise _refuse(source, "model_type", model_type,
                      " or ".join(repr(name) for name in FAMILIES))
    if model_type == "mistral":
        config = {**_MISTRAL_DEFAULTS, **config}
    model: dict[str, Any] = {}
    for hf_key, key in _SIZES.items():
        value = config.get(hf_key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CheckpointError(f"{source}: {hf_key} must be a positive integer, got {value!r}")
        model[key] = value
    model["n_kv_heads"] = int(config.get("num_key_value_heads") or model["n_heads"])
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim * model["n_heads"] != model["d_model"]:
        raise _refuse(
            source, "head_dim", head_dim,
            f"hidden_size / num_attention_heads = {model['d_model'] / model['n_heads']:g}",
        )
    if config.get("hidden_act", "silu") != "silu":
        raise _refuse(source, "hidden_act", config["hidden_act"], "'silu' (mlp: swiglu)")
    for key in ("attention_bias", "mlp_bias") if model_type == "llama" else ():
        if config.get(key, False):  # Llama's attention_bias is on o_proj too
            raise _refuse(source, key, config[key], "false (the reference GPT has no such biases)")
    model["attention_bias"] = model_type == "qwen2"
    model["sliding_window"] = (
        _qwen2_window(config, model["n_layers"], source) if model_type == "qwen2"
        else config["sliding_window"] if model_type == "mistral" else None)
    window = model["sliding_window"]
    if window is not None and (not isinstance(window, int) or isinstance(window, bool)
                               or window < 1):
        raise CheckpointError(f"{source}: sliding_window must be a positive integer or null, "
                              f"got {window!r}")
    model["rope_theta"], model["rope_scaling"] = _rope(config, source)
    model["rms_norm_eps"] = float(config.get("rms_norm_eps", _HF_DEFAULTS["rms_norm_eps"]))
    model["tie_embeddings"] = bool(config.get("tie_word_embeddings", _HF_DEFAULTS["tie_word_embeddings"]))
    model.update(norm="rmsnorm", mlp="swiglu", positions="rotary")
    return {key: model[key] for key in MODEL_KEYS}


def check_exportable(model: dict[str, Any]) -> None:
    """Refuses a `model:` section that a Hugging Face Llama cannot express, naming the key."""
    wanted = {"norm": "rmsnorm", "mlp": "swiglu", "positions": "rotary"}
    for key, value in wanted.items():
        if model.get(key) != value:
            raise CheckpointError(
                f"model.{key}={model.get(key)!r}: a Hugging Face Llama needs {key}: {value}"
            )
    for key in ("moe", "sparse_attention"):
        if model.get(key):
            raise CheckpointError(f"model.{key} is set: a Hugging Face Llama has no {key}")


def family(model: dict[str, Any], *, base_type: str | None = None) -> str:
    """The `FAMILIES` key that expresses a `model:` section: Qwen2 for q/k/v biases, Mistral
    for a sliding window (or when `base_type` is Mistral already), else Llama."""
    if model.get("attention_bias"):
        return "qwen2"
    return "mistral" if model.get("sliding_window") or base_type == "mistral" else "llama"


def _window_keys(kind: str, window: int | None, layers: int,
                 config: dict[str, Any]) -> dict[str, Any]:
    """The keys that say `kind`'s attention: biases, sliding window (per layer for Qwen2)."""
    if kind == "llama":
        return {"attention_bias": False, "mlp_bias": False}
    if kind == "mistral":
        return {"sliding_window": window}
    keys: dict[str, Any] = {"use_sliding_window": window is not None}
    if window is not None:
        keys.update(sliding_window=window, max_window_layers=0)
    if window is not None or "layer_types" in config:
        keys["layer_types"] = [("full", "sliding")[window is not None] + "_attention"] * layers
    return keys


def hf_from_model(
    model: dict[str, Any], *, dtype: str, base: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A Llama, Mistral or Qwen2 `config.json` dict for a `model:` section (`family`).

    Args:
      model: the `model:` keys (`MODEL_KEYS`; others are ignored).
      dtype: the saved weights' dtype name (`float32`, `bfloat16`, ...).
      base: the config an import read: its other keys (token ids, ...) and its rope layout are
        kept, so an imported-then-exported folder has the same config.json. Default: a
        transformers-4 layout (rope keys at the top level), which transformers 5 also reads.
    """
    check_exportable(model)
    kind = family(model, base_type=(base or {}).get("model_type"))
    config = dict(base or {})
    if config.get("model_type") != kind:
        config.update(architectures=[FAMILIES[kind]], model_type=kind)
    config.update({hf_key: model[key] for hf_key, key in _SIZES.items()})
    n_kv = model.get("n_kv_heads") or model["n_heads"]
    config.update(
        num_key_value_heads=n_kv, hidden_act="silu",
        rms_norm_eps=model["rms_norm_eps"], tie_word_embeddings=model["tie_embeddings"],
    )
    if kind != "qwen2" or "head_dim" in config:  # Qwen2Config has no head_dim of its own
        config["head_dim"] = model["d_model"] // model["n_heads"]
    config.update(_window_keys(kind, model.get("sliding_window"), model["n_layers"], config))
    scaling = model.get("rope_scaling")
    if "rope_parameters" in config:  # transformers 5 layout
        rope = {"rope_type": "default"} if scaling is None else dict(scaling)
        config["rope_parameters"] = {**rope, "rope_theta": model["rope_theta"]}
    else:
        config["rope_theta"] = model["rope_theta"]
        config["rope_scaling"] = None if scaling is None else dict(scaling)
    config["dtype" if "dtype" in config else "torch_dtype"] = dtype
    return config
