"""Autoregressive sampling from the reference GPT, with a key/value cache.

`generate` prefills the cache with the prompt in one call, then decodes one token per step in
a `lax.fori_loop`, all in one jitted program. The GPT in `decode` mode keeps each layer's keys
and values in its `cache` collection, sized for the request (prompt + new tokens, not
`max_seq_len`: a long-context model's full cache would be gigabytes), so a step costs one
token's work, not the whole prefix's. A model trained with a block-sparse layout decodes with
that layout (`jaxspeed.models.decode_cache`). Under a mesh the parameters keep the plan they
were trained with (`sample_from_engine`): ZeRO-3 shards are gathered layer by layer as in
training, tensor-parallel weights stay split; `sample_tokens` runs on one device, for a
model built from a checkpoint without a training engine.

Choosing a token: `temperature == 0` is greedy (argmax); otherwise the logits are divided by
the temperature and, with `top_p < 1`, cut to the smallest set of tokens whose probability
reaches `top_p` (nucleus sampling, Holtzman et al. 2020).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxspeed.errors import ConfigError

Array = jax.Array
#: Logical axes of activations: decoding a handful of sequences leaves them unsplit.
_ACTIVATION_AXES = ("batch", "length")


def choose(logits: Array, key: Array, *, temperature: float, top_p: float) -> Array:
    """int32 `[batch]` tokens from float `[batch, vocab]` logits (see the module docstring)."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_p < 1:
        order = jnp.argsort(-logits, axis=-1)
        probs = jax.nn.softmax(jnp.take_along_axis(logits, order, axis=-1), axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
        cut = jnp.take_along_axis(before >= top_p, jnp.argsort(order, axis=-1), axis=-1)
        logits = jnp.where(cut, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def generate(
    model: nn.Module, params, prompt: Array, *, max_new_tokens: int, temperature: float = 1.0,
    top_p: float = 1.0, key: Array | None = None,
) -> Array:
    """Continues `prompt` by `max_new_tokens` tokens.

    Args:
      model: a `jaxspeed.models.GPT` (any attributes; `decode` is turned on here).
      params: its parameters (the `params` collection).
      prompt: int `[batch, prompt_len]`, at least one token.
      max_new_tokens: tokens to add; `prompt_len + max_new_tokens <= model.max_seq_len`.
      temperature: 0 for greedy decoding, else the softmax temperature.
      top_p: nucleus sampling's probability mass (1: the whole vocabulary).
      key: PRNG key (needed unless greedy).

    Returns:
      int32 `[batch, prompt_len + max_new_tokens]`: the prompt and its continuation.
    """
    batch, length = prompt.shape
    check_request(length, max_new_tokens, model.max_seq_len, temperature, top_p)
    check_causal(model)
    if key is None:
        if temperature != 0:
            raise ValueError("sampling with temperature > 0 needs a PRNG key")
        key = jax.random.key(0)
    cache_len = decode_length(model, length + max_new_tokens)
    decoder = model.clone(decode=True, remat_policy="none", stream_layers=None, gather_layers=None,
                          max_seq_len=cache_len)
    params = _fit_positions(params, cache_len)
    empty = jnp.zeros((batch, cache_len), jnp.int32)
    shapes = jax.eval_shape(  # in the dtypes `params` give the keys and values
        lambda p: decoder.apply({"params": p}, empty, deterministic=True, mutable=["cache"])[1],
        params)
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])

    def step(cache, tokens):
        logits, updated = decoder.apply({"params": params, "cache": cache}, tokens,
                                        deterministic=True, mutable=["cache"])
        return updated["cache"], logits[:, -1]

    pick = functools.partial(choose, temperature=temperature, top_p=top_p)
    keys = jax.random.split(key, max_new_tokens)
    cache, logits = step(cache, prompt.astype(jnp.int32))
    out = jnp.zeros((batch, max_new_tokens), jnp.int32).at[:, 0].set(pick(logits, keys[0]))

    def body(i, carry):
        cache, out = carry
        cache, logits = step(cache, jax.lax.dynamic_slice_in_dim(out, i - 1, 1, axis=1))
        return cache, out.at[:, i].set(pick(logits, keys[i]))

    _, out = jax.lax.fori_loop(1, max_new_tokens, body, (cache, out))
    return jnp.concatenate([prompt.astype(jnp.int32), out], axis=1)


def decode_length(model: nn.Module, tokens: int) -> int:
    """Positions the key/value cache holds for `tokens` tokens: `tokens`, rounded up to the
    block of a block-sparse layout (the layout is built for the cache's length)."""
    sparse = getattr(model, "sparse_attention", None)
    return tokens if sparse is None else -(-tokens // sparse.block) * sparse.block


def _fit_positions(params, length: int):
    """Learned position embeddings cut (or zero-padded) to `length` rows: the decoder is built
    for the request's length, and positions past it are never read."""
    if "pos_embedding" not in params:
        return params
    table = params["pos_embedding"]
    rows = table.shape[0]
    table = table[:length] if rows >= length else jnp.pad(table, ((0, length - rows), (0, 0)))
    return {**params, "pos_embedding": table}


def check_causal(model: nn.Module) -> None:
    """Refuses a model whose routing looks at later tokens (`routing: expert_choice`)."""
    if dict(getattr(model, "moe", None) or ()).get("routing") == "expert_choice":
        raise ConfigError(
            "this model cannot decode: model.moe.routing=expert_choice picks each expert's "
            "tokens from the whole group, later tokens included, which one-token-at-a-time "
            "decoding does not have; sample from a token_choice model")


def check_request(prompt_len: int, max_new_tokens: int, max_seq_len: int, temperature: float,
                  top_p: float) -> None:
    """One clear error for a request the model cannot serve."""
    if prompt_len < 1:
        raise ConfigError("the prompt is empty: give at least one token")
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if prompt_len + max_new_tokens > max_seq_len:
        raise ConfigError(
            f"prompt ({prompt_len} tokens) + --max-new-tokens ({max_new_tokens}) exceeds "
            f"model.max_seq_len={max_seq_len}; shorten one of them")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ConfigError(
            f"--temperature must be >= 0 (got {temperature}) and --top-p in (0, 1] (got {top_p})")


def sample_from_engine(engine, params, prompt: Sequence[Sequence[int]], **options) -> np.ndarray:
    """`generate` with an engine's reference GPT, its params in their planned shardings.

    Runs under the engine's mesh with its logical rules for parameters; activations stay
    unsplit (`batch` and `length` rules dropped), since a few prompts do not fill the mesh.
    """
    model = engine.model
    if model is None:
        raise ConfigError("sampling needs the reference GPT (model.type: gpt)")
    rules = tuple(r for r in engine.plan.rules if r[0] not in _ACTIVATION_AXES)
    with jax.set_mesh(engine.mesh), nn.logical_axis_rules(rules):
        tokens = _generate(model, params, jnp.asarray(prompt, jnp.int32), **options)
        return np.asarray(jax.device_get(tokens))


def sample_tokens(model: nn.Module, params, prompt: Sequence[Sequence[int]], **options) -> np.ndarray:
    """`generate` on the default device, with no mesh: a model built from a checkpoint (its
    params in their stored dtype) rather than a training engine."""
    tokens = _generate(model, params, jnp.asarray(prompt, jnp.int32), **options)
    return np.asarray(jax.device_get(tokens))


#: `generate` compiled once per model and options (training samples every N steps).
_generate = jax.jit(generate, static_argnums=0,
                    static_argnames=("max_new_tokens", "temperature", "top_p"))


class Codec:
    """Text ↔ tokens: a Hugging Face `tokenizer.json` (or its folder), or bytes (token =
    byte value).

    Args:
      tokenizer_path: the tokenizer; None: bytes.
      source: where the path came from (`--tokenizer`, `data.tokenizer`), named in errors.
    """

    def __init__(self, tokenizer_path: str | None = None, *, source: str = "data.tokenizer"):
        self._tokenizer = None
        self.path = None if tokenizer_path is None else str(tokenizer_path)
        if tokenizer_path is not None:
            from jaxspeed.data.text_tokens import load_tokenizer
            from jaxspeed.errors import JaxspeedError

            try:
                self._tokenizer = load_tokenizer(str(tokenizer_path))
            except JaxspeedError as err:
                raise type(err)(str(err).replace("data.tokenizer", source, 1)) from None

    @property
    def vocab_size(self) -> int:
        return 256 if self._tokenizer is None else self._tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        if self._tokenizer is None:
            return list(text.encode("utf-8"))
        return self._tokenizer.encode(text).ids

    def decode(self, tokens: Sequence[int]) -> str:
        """The text of `tokens`; with bytes, a token outside 0..255 reads as U+FFFD."""
        if self._tokenizer is None:
            return b"".join(bytes([int(t)]) if 0 <= int(t) < 256 else "\ufffd".encode()
                            for t in tokens).decode("utf-8", errors="replace")
        return self._tokenizer.decode([int(t) for t in tokens])


def sample_text(engine, params, text: str, codec: Codec, **options) -> str:
    """The continuation of `text` (without it) by an engine's model, in its plan, decoded with
    `codec`."""
    def sample(prompt):
        return sample_from_engine(engine, params, [prompt], **options)[0]

    return _continue(sample, engine.config.model.vocab_size, text, codec, strict=False)


def sample_model_text(model: nn.Module, params, text: str, codec: Codec, **options) -> str:
    """The continuation of `text` (without it) by `model` on one device (`sample_tokens`),
    decoded with `codec`; a token the codec cannot decode is a `ConfigError`."""
    def sample(prompt):
        return sample_tokens(model, params, [prompt], **options)[0]

    return _continue(sample, model.vocab_size, text, codec, strict=True)


def _continue(sample, vocab: int, text: str, codec: Codec, *, strict: bool) -> str:
    prompt = codec.encode(text)
    if max(prompt, default=0) >= vocab:
        raise ConfigError(
            f"the prompt has token {max(prompt)}, outside model.vocab_size={vocab}; use the "
            f"model's tokenizer (--tokenizer)")
    new = sample(prompt)[len(prompt):]
    if strict and codec.path is None and int(np.max(new)) >= codec.vocab_size:
        raise ConfigError(
            f"the model produced token {int(np.max(new))}, which bytes cannot decode (0..255; "
            f"model.vocab_size={vocab}); pass the model's tokenizer: --tokenizer tokenizer.json")
    return codec.decode(new)
