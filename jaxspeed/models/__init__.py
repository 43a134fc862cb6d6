"""Reference models written with logical axes."""

from jaxspeed.models.gpt import GPT, build_gpt

__all__ = ["GPT", "build_gpt"]
