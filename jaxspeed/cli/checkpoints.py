"""`jaxspeed export | import-hf | sample`: checkpoints in and out, and text from them.

This module owns the commands that read or write a checkpoint outside training: `export`
consolidates a checkpoint's params into one file (or a Hugging Face folder), `import-hf`
converts a Hugging Face Llama, Mistral or Qwen2 folder into a checkpoint, and `sample`
continues a prompt with the params of either. A checkpoint may be named by a run's folder (`runs/x` for
`runs/x/checkpoints`). `sample` decodes with `--tokenizer`, else the tokenizer the run was
trained with (its saved `data.tokenizer`), else the `tokenizer.json` beside an import's
source files, else bytes.
"""

from __future__ import annotations


def export_command(args) -> int:
    """`jaxspeed export`: writes a checkpoint's params, consolidated (msgpack or HF folder)."""
    from jaxspeed.errors import JaxspeedError
    from jaxspeed.checkpoint.export import export_params

    if args.format == "hf":
        from jaxspeed.checkpoint.hf import export_hf

        out = export_hf(args.checkpoint, args.out, step=args.step, dtype=args.dtype)
    elif args.dtype is not None:
        raise JaxspeedError("--dtype is only for --format hf (msgpack keeps the checkpoint's dtype)")
    else:
        out = export_params(args.checkpoint, args.out, step=args.step)
    print(f"wrote {out}")
    return 0


def import_hf_command(args) -> int:
    """`jaxspeed import-hf`: converts a Hugging Face Llama, Mistral or Qwen2 folder to a checkpoint."""
    from jaxspeed.checkpoint.hf import import_hf

    out = import_hf(args.folder, args.out, dtype=args.dtype)
    print(f"wrote {out}")
    return 0


def sample_command(args) -> int:
    """`jaxspeed sample`: prints the prompt continued by a checkpoint's model.

    Only the params are read, in their stored dtype, and only the model is built (no optimizer
    state, no training engine); the key/value cache holds the prompt and the new tokens.
    """
    import jax

    from jaxspeed.checkpoint.export import read_params
    from jaxspeed.models import build_gpt
    from jaxspeed.models.sampling import Codec, sample_model_text

    params, model, record = read_params(args.checkpoint, step=args.step)
    path, source = _tokenizer(args.tokenizer, record)
    codec = Codec(path, source=source)
    text = sample_model_text(
        build_gpt(model), params, args.prompt, codec, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_p=args.top_p, key=jax.random.key(args.seed),
    )
    print(args.prompt + text)
    return 0


def _tokenizer(flag: str | None, record: dict) -> tuple[str | None, str]:
    """`(tokenizer path or None, where it came from)`: `--tokenizer` if given, else the run's
    `data.tokenizer` (a train checkpoint's saved config), else the `tokenizer.json` of the
    folder an import came from; None: bytes."""
    from pathlib import Path

    from jaxspeed.errors import JaxspeedError

    if flag is not None:
        return flag, "--tokenizer"
    saved = ((record.get("config") or {}).get("data") or {}).get("tokenizer")
    if saved is not None:
        if not Path(saved).exists():
            raise JaxspeedError(
                f"the checkpoint's data.tokenizer {saved!r} does not exist here; pass the "
                "model's tokenizer with --tokenizer")
        return saved, "the checkpoint's data.tokenizer"
    source = record.get("source")
    if source is not None and (Path(source) / "tokenizer.json").is_file():
        return str(Path(source) / "tokenizer.json"), "the imported folder's tokenizer"
    return None, "--tokenizer"
