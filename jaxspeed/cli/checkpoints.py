"""`jaxspeed export | import-hf | sample`: checkpoints in and out, and text from them.

This module owns the commands that read or write a checkpoint outside training: `export`
consolidates a checkpoint's params into one file (or a Hugging Face Llama folder),
`import-hf` converts a Hugging Face Llama folder into a checkpoint, and `sample` continues a
prompt with the params of either.
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
    """`jaxspeed import-hf`: converts a Hugging Face Llama folder to a checkpoint."""
    from jaxspeed.checkpoint.hf import import_hf

    out = import_hf(args.folder, args.out, dtype=args.dtype)
    print(f"wrote {out}")
    return 0


def sample_command(args) -> int:
    """`jaxspeed sample`: prints the prompt continued by a checkpoint's model."""
    import jax

    from jaxspeed.config import load_config
    from jaxspeed.train.engine import initialize
    from jaxspeed.checkpoint.export import load_trained
    from jaxspeed.checkpoint.params import is_params_checkpoint, read_record, start_from
    from jaxspeed.models.sampling import Codec, sample_text

    codec = Codec(args.tokenizer)
    if is_params_checkpoint(args.checkpoint):  # straight from `jaxspeed import-hf`
        model = read_record(args.checkpoint)["model"]
        engine = initialize(load_config({
            "model": model, "data": {"seq_len": model["max_seq_len"]},
            "train_micro_batch_size_per_device": 1}))
        params = start_from(engine, args.checkpoint, jax.random.key(0)).params
    else:
        engine, state = load_trained(args.checkpoint, step=args.step)
        params = state.params
    text = sample_text(
        engine, params, args.prompt, codec, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_p=args.top_p, key=jax.random.key(args.seed),
    )
    print(args.prompt + text)
    return 0
