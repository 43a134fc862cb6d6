"""Hugging Face Llama checkpoints in and out: `import_hf` and `export_hf`."""

from jaxspeed.checkpoint.hf.convert import export_hf, import_hf

__all__ = ["export_hf", "import_hf"]
